"""Platform selection: `auto` picks CUDA when a GPU is visible, else CPU."""

from __future__ import annotations

from spindle.platforms.cpu import CpuPlatform
from spindle.platforms.cuda import CudaPlatform
from spindle.platforms.interface import Platform

_PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}


def resolve_platform(device: str = "auto") -> Platform:
    if device == "auto":
        cuda = CudaPlatform()
        return cuda if cuda.is_available() else CpuPlatform()
    if device not in _PLATFORMS:
        raise ValueError(f"device must be one of auto, {', '.join(_PLATFORMS)}, got {device!r}")
    platform = _PLATFORMS[device]()
    if not platform.is_available():
        raise ValueError(f"device {device!r} was asked for but is not available on this machine")
    return platform


__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "resolve_platform"]
