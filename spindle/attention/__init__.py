"""Attention: the model-facing layer, its metadata, and the pluggable backends."""

from spindle.attention.layer import Attention
from spindle.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata"]
