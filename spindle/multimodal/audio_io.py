"""Audio files in, waveforms out: decoding an upload (soundfile, so whatever libsndfile
reads: wav, flac, ogg, mp3, ...), resampling (soxr) and cutting a long recording into
windows a speech model takes at once. Knows nothing of models or of HTTP."""

from __future__ import annotations

import io

import numpy as np

# Frames decoded per read: bounds the memory a file claiming to be longer than it is
# can make us allocate, and lets a too-long file be refused part way.
_BLOCK_FRAMES = 1 << 20


class AudioError(ValueError):
    """Audio that cannot be used: not decodable, empty, non-finite or too long."""


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """The mono float32 waveform of an audio file's bytes, and its sample rate.

    Several channels are averaged into one. max_seconds: refuse (AudioError) a file
    longer than this, before decoding more of it than the limit.
    """
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            sample_rate = int(f.samplerate)
            limit = None if max_seconds is None else int(max_seconds * sample_rate)
            waveform = _read_mono(f, limit, max_seconds)
    except soundfile.SoundFileError as e:
        reason = getattr(e, "error_string", None) or str(e)
        raise AudioError(f"could not decode the audio file: {reason}") from None
    if waveform.size == 0:
        raise AudioError("the audio file holds no samples")
    if not np.isfinite(waveform).all():
        raise AudioError("the audio file holds non-finite samples (NaN or infinity)")
    return waveform, sample_rate


def resample(waveform: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """waveform (mono) at target_sr; the waveform itself when the rates are equal."""
    if orig_sr <= 0 or target_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {target_sr}")
    if orig_sr == target_sr:
        return waveform
    import soxr  # lazily: the servers that never see audio need not have it

    return soxr.resample(waveform, orig_sr, target_sr, quality="HQ").astype(np.float32, copy=False)


def split_windows(waveform: np.ndarray, sample_rate: int,
                  window_s: float) -> list[tuple[float, float, np.ndarray]]:
    """Consecutive windows of at most window_s seconds covering every sample:
    (start_s, end_s, samples) each; none is empty (no window at all for no samples)."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    window = int(round(window_s * sample_rate))
    if window < 1:
        raise ValueError(f"window_s must hold at least one sample at {sample_rate} Hz, "
                         f"got {window_s}")
    return [(start / sample_rate, min(start + window, len(waveform)) / sample_rate,
             waveform[start:start + window]) for start in range(0, len(waveform), window)]


def _read_mono(f, limit: int | None, max_seconds: float | None) -> np.ndarray:
    """Every frame of an open SoundFile, channels averaged, in blocks (a header's frame
    count is not trusted); AudioError once more than limit frames were read."""
    blocks, total = [], 0
    while True:
        block = f.read(_BLOCK_FRAMES, dtype="float32", always_2d=True)
        if len(block) == 0:
            break
        total += len(block)
        if limit is not None and total > limit:
            raise AudioError(f"the audio is longer than the limit of {max_seconds:g} seconds")
        blocks.append(block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0])
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
