"""Encoder-only models and their attention: tiny random BERT / RoBERTa checkpoints
against transformers, and the packed bidirectional attention plan."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from spindle.attention.encoder import (MAX_GROUP_SCORES, EncoderAttentionMetadata,
                                       encoder_attention, plan_groups)
from spindle.config import EngineArgs, ModelConfig
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.forward_context import forward_context
from spindle.models.loader import load_model
from spindle.models.registry import model_kind, resolve_model_class

CPU = torch.device("cpu")


def save_tiny_encoder(path, arch: str, **overrides):
    """A random BertModel / RobertaModel checkpoint saved by transformers itself."""
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    config_cls, model_cls = {"bert": (BertConfig, BertModel),
                             "roberta": (RobertaConfig, RobertaModel)}[arch]
    torch.manual_seed(0)
    extra = {"pad_token_id": 1} if arch == "roberta" else {}
    config = config_cls(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=66, **{**extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # random norms and biases: a loader mixing them up must fail
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.normal_(0.5 if name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_encoder_matches_transformers(tmp_path, arch):
    hf = save_tiny_encoder(tmp_path, arch)
    config = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    assert config.model.model_kind == "encoder" and config.model.task == "embed"
    model = load_model(config.model, CPU, TensorParallelGroup.single())
    lens = [5, 17, 1, 64, 30, 29, 8]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 300, (n,), generator=gen) for n in lens]
    ids, positions = torch.cat(seqs), torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad(), forward_context(EncoderAttentionMetadata.from_seq_lens(lens, CPU)):
        packed = model(ids, positions)
    for seq, out in zip(seqs, packed.split(lens)):
        with torch.no_grad():
            expected = hf(seq[None]).last_hidden_state[0]
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


def test_roberta_positions_leave_room_for_the_offset(tmp_path):
    save_tiny_encoder(tmp_path, "roberta")
    config = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    assert config.model.max_model_len == 66 - 2  # positions start at pad_token_id + 1
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(model=str(tmp_path), device="cpu", max_model_len=66).create_engine_config()


def test_unsupported_encoder_config_is_refused(tmp_path):
    save_tiny_encoder(tmp_path, "bert", position_embedding_type="relative_key")
    config = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="position_embedding_type"):
        load_model(config.model, CPU, TensorParallelGroup.single())


def test_registry_kinds():
    assert model_kind(resolve_model_class(["BertModel"])) == "encoder"
    assert model_kind(resolve_model_class(["XLMRobertaModel"])) == "encoder"
    assert model_kind(resolve_model_class(["LlamaForCausalLM"])) == "decoder"


@pytest.mark.parametrize("seed", range(5))
def test_plan_groups_partition_with_bounded_padding(seed):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, 7, 30, 31, 100, 255, 512]) + rng.randint(0, 5) for _ in range(40)]
    groups = plan_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for group in groups:
        longest = max(lens[i] for i in group)
        assert longest == lens[group[0]]
        assert all(longest - lens[i] <= max(8, 0.25 * longest) for i in group)
        assert len(group) == 1 or len(group) * longest * longest <= MAX_GROUP_SCORES


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_encoder_attention_matches_per_sequence_sdpa(num_kv_heads):
    gen = torch.Generator().manual_seed(0)
    lens = [3, 40, 1, 39, 12, 35, 9, 64, 2]
    total, heads, dim = sum(lens), 4, 16
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, num_kv_heads, dim, generator=gen)
    v = torch.randn(total, num_kv_heads, dim, generator=gen)
    out = encoder_attention(q, k, v, EncoderAttentionMetadata.from_seq_lens(lens, CPU), 0.25)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        expected = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), scale=0.25,
            enable_gqa=num_kv_heads != heads).transpose(0, 1)
        torch.testing.assert_close(out[sl], expected, atol=1e-5, rtol=0)
        start += n


def test_metadata_refuses_empty_sequences():
    with pytest.raises(ValueError, match="at least one token"):
        EncoderAttentionMetadata.from_seq_lens([3, 0], CPU)


def test_model_config_without_kind_fields_defaults_to_a_decoder(tmp_path):
    save_tiny_encoder(tmp_path, "bert")
    hf_config = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), dtype=torch.float32,
                         max_model_len=64, seed=0, hf_config=hf_config)
    assert (config.model_kind, config.task, config.enable_prompt_embeds) == \
        ("decoder", "generate", False)
