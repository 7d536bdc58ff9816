"""DefaultModelState: causal decoders over a paged KV cache, fed token ids."""

from __future__ import annotations

from typing import Any

import torch

from spindle.attention.metadata import AttentionMetadata
from spindle.runner.input_batch import StepBatch
from spindle.runner.model_states.base import ModelState


class DefaultModelState(ModelState):
    needs_kv_cache = True
    supports_cuda_graphs = True

    def prepare_inputs(self, batch: StepBatch) -> dict[str, Any]:
        return {
            "input_ids": self.h2d.put(batch.input_ids, torch.int64),
            "positions": self.h2d.put(batch.positions, torch.int64),
        }

    def prepare_attn(self, batch: StepBatch) -> AttentionMetadata:
        query_start_loc = torch.from_numpy(batch.query_start_loc).to(torch.int32)
        seq_lens = torch.from_numpy(batch.seq_lens).to(torch.int32)
        return AttentionMetadata(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc=self.h2d.put(query_start_loc, torch.int32),
            seq_lens=self.h2d.put(seq_lens, torch.int32),
            block_tables=self.h2d.put(batch.block_tables, torch.int32),
            slot_mapping=self.h2d.put(batch.slot_mapping, torch.int64),
            max_query_len=int(batch.num_scheduled.max()),
            max_seq_len=int(batch.seq_lens.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )

    def dummy_attn(self, num_reqs: int, tokens_per_req: int) -> AttentionMetadata:
        qsl = torch.arange(0, (num_reqs + 1) * tokens_per_req, tokens_per_req, dtype=torch.int32)
        lens = torch.full((num_reqs,), tokens_per_req, dtype=torch.int32)
        num_tokens = num_reqs * tokens_per_req
        return AttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens,
            query_start_loc=qsl.to(self.device), seq_lens=lens.to(self.device),
            block_tables=torch.zeros((num_reqs, 1), dtype=torch.int32, device=self.device),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
            max_query_len=tokens_per_req, max_seq_len=tokens_per_req,
            query_start_loc_cpu=qsl, seq_lens_cpu=lens)

