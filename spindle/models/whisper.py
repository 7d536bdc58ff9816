"""Whisper (WhisperForConditionalGeneration): speech to text, an encoder-decoder.

The encoder turns a window of log-mel features [mels, 2 * positions] into `positions`
states (two convolutions, GELU, fixed sinusoidal positions, pre-norm transformer
layers with full attention, a final LayerNorm). It runs once per request, in the step
that computes the request's first decoder token, for the requests the runner passes
(``encoder_features``, with their state slots ``encoder_slots``).

The decoder is a pre-norm transformer over token ids with learned positions: causal
self-attention over the paged KV cache, cross-attention over the encoder's keys and
values (each layer projects them once and keeps them in the request's state slot:
spindle/attention/cross.py), and a GELU MLP; the LM head is tied to the token
embedding. Queries are scaled before the attention product, as transformers does.

A ``model_kind = "encoder_decoder"`` model, served by EncoderDecoderModelState.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from spindle.attention.cross import CrossAttention
from spindle.attention.layer import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spindle.layers.linear import ColumnParallelLinear, RowParallelLinear
from spindle.models.weights import load_named_weights

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


def check_supported_config(hf_config: Any, tp_group: TensorParallelGroup) -> None:
    """Refuse what this implementation would get wrong, by name."""
    act = getattr(hf_config, "activation_function", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"Whisper activation_function {act!r} is not supported "
                         f"(supported: {sorted(_ACTIVATIONS)})")
    for name in ("encoder_attention_heads", "decoder_attention_heads"):
        heads = getattr(hf_config, name)
        if heads % tp_group.size:
            raise ValueError(f"Whisper {name} ({heads}) must be divisible by "
                             f"tensor_parallel_size ({tp_group.size})")
        if hf_config.d_model % heads:
            raise ValueError(f"Whisper d_model ({hf_config.d_model}) must be divisible by "
                             f"{name} ({heads})")


class _Projections(nn.Module):
    """Whisper's q/k/v/out projections (k has no bias), split by heads across ranks."""

    def __init__(self, d_model: int, num_heads: int, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.head_dim = d_model // num_heads
        self.num_local_heads = num_heads // tp_group.size
        self.scaling = self.head_dim ** -0.5
        self.q_proj = ColumnParallelLinear(d_model, d_model, bias=True, tp_group=tp_group)
        self.k_proj = ColumnParallelLinear(d_model, d_model, bias=False, tp_group=tp_group)
        self.v_proj = ColumnParallelLinear(d_model, d_model, bias=True, tp_group=tp_group)
        self.out_proj = RowParallelLinear(d_model, d_model, bias=True, tp_group=tp_group)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Scaled queries, as transformers scales them (before the product)."""
        return self.q_proj(x) * self.scaling


class EncoderSelfAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, L, d] -> [n, L, d]: full attention within each window."""
        n, length, _ = x.shape
        shape = (n, length, self.num_local_heads, self.head_dim)
        q = self.query(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class _MLP(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, act: str, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(d_model, ffn_dim, bias=True, tp_group=tp_group)
        self.fc2 = RowParallelLinear(ffn_dim, d_model, bias=True, tp_group=tp_group)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = EncoderSelfAttention(cfg.d_model, cfg.encoder_attention_heads, tp_group)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = _MLP(cfg.d_model, cfg.encoder_ffn_dim, cfg.activation_function, tp_group)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.mlp(self.final_layer_norm(x))


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.num_positions = cfg.max_source_positions
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg, tp_group)
                                    for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    @property
    def num_frames(self) -> int:
        """Mel frames of one window: the convolutions halve them into the positions."""
        return 2 * self.num_positions

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [n, mels, frames] -> states [n, positions, d_model]."""
        if features.shape[-1] != self.num_frames:
            raise ValueError(f"Whisper's encoder takes {self.num_frames} mel frames, got "
                             f"{features.shape[-1]}")
        with _exact_float32_convolutions():
            x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
            x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


def _exact_float32_convolutions():
    """cuDNN runs float32 convolutions in TF32 unless told otherwise (torch's default,
    unlike its matmuls): a float32 model then drifts from transformers on the CPU by
    1e-3 in logprobs. Only here, only for these calls; the other cuDNN settings stay."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                       deterministic=cudnn.deterministic, allow_tf32=False)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        heads = cfg.decoder_attention_heads
        self.self_attn = _Projections(cfg.d_model, heads, tp_group)
        local, head_dim = self.self_attn.num_local_heads, self.self_attn.head_dim
        # (queries come scaled, so the attention itself scales by 1)
        self.attn = Attention(local, head_dim, 1.0, local)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.encoder_attn = _Projections(cfg.d_model, heads, tp_group)
        self.cross_attn = CrossAttention(local, head_dim, 1.0, local, cfg.max_source_positions)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = _MLP(cfg.d_model, cfg.decoder_ffn_dim, cfg.activation_function, tp_group)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, encoder_states: torch.Tensor | None,
                encoder_slots: torch.Tensor | None) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        proj = self.self_attn
        x = x + proj.out_proj(self.attn(proj.query(h), proj.k_proj(h), proj.v_proj(h)))
        h = self.encoder_attn_layer_norm(x)
        cross = self.encoder_attn
        new_kv = None
        if encoder_states is not None:
            n, length, _ = encoder_states.shape
            shape = (n, length, cross.num_local_heads, cross.head_dim)
            new_kv = (cross.k_proj(encoder_states).view(shape),
                      cross.v_proj(encoder_states).view(shape))
        x = x + cross.out_proj(self.cross_attn(cross.query(h), new_kv, encoder_slots))
        return x + self.mlp(self.final_layer_norm(x))


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group=tp_group)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, tp_group)
                                    for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                encoder_states: torch.Tensor | None,
                encoder_slots: torch.Tensor | None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x, encoder_states, encoder_slots)
        return self.layer_norm(x)


class _WhisperModel(nn.Module):
    """Holds encoder and decoder under the checkpoint's own prefix ("model.")."""

    def __init__(self, cfg: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(cfg, tp_group)
        self.decoder = WhisperDecoder(cfg, tp_group)


class WhisperForConditionalGeneration(nn.Module):
    """forward(input_ids [T], positions [T], encoder_features [n, mels, frames] | None,
    encoder_slots [n] | None) -> decoder hidden states [T, d_model]."""

    model_kind = "encoder_decoder"

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        check_supported_config(hf_config, tp_group)
        self.config = hf_config
        self.model = _WhisperModel(hf_config, tp_group)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.d_model, tp_group=tp_group)
        self.lm_head.tie_to(self.model.decoder.embed_tokens)

    @classmethod
    def max_model_len(cls, hf_config: Any) -> int:
        """The decoder's learned positions (448 for real checkpoints)."""
        return hf_config.max_target_positions

    @classmethod
    def encoder_input_bytes(cls, hf_config: Any) -> int:
        """Bytes of one window's features as the runner stages them (float32 [mels,
        2 * positions])."""
        return hf_config.num_mel_bins * 2 * hf_config.max_source_positions * 4

    @classmethod
    def encoder_input_positions(cls, hf_config: Any) -> int:
        """Positions one window's encoder computes (1500 for 30 s): its compute cost,
        which the scheduler's encoder budget counts."""
        return hf_config.max_source_positions

    def dummy_encoder_inputs(self) -> torch.Tensor:
        """Features of one window of silence [mels, frames] (warm-up and profiling)."""
        encoder = self.model.encoder
        return torch.zeros(encoder.conv1.in_channels, encoder.num_frames, device="cpu")

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.encoder(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                encoder_features: torch.Tensor | None = None,
                encoder_slots: torch.Tensor | None = None) -> torch.Tensor:
        states = self.encode(encoder_features) if encoder_features is not None else None
        return self.model.decoder(input_ids, positions, states, encoder_slots)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, _param_name)


# Checkpoint name parts -> this model's (the MLP's linears sit in a submodule here, the
# decoder's self-attention math in `attn` beside its projections).
_RENAMES = ((".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2."))


def _param_name(hf_name: str) -> tuple[str, Any] | None:
    """HF tensor name -> (parameter name, shard id); None for the tied LM head."""
    if hf_name == "proj_out.weight":
        return None  # tied to model.decoder.embed_tokens
    for old, new in _RENAMES:
        hf_name = hf_name.replace(old, new)
    return hf_name, None
