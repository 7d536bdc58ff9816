"""Pooling: one vector per finished prompt (embeddings), instead of sampled tokens."""

from spindle.runner.pool.pooler import Pooler, pool_hidden_states

__all__ = ["Pooler", "pool_hidden_states"]
