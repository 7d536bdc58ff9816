"""DefaultModelState: causal decoders over a paged KV cache, fed token ids."""

from __future__ import annotations

from typing import Any

import torch

from spindle.attention.metadata import (AttentionMetadata, decode_order, longest_first_enabled,
                                       mixed_split_enabled, mixed_step_requests)
from spindle.cache.spec import CacheGroup
from spindle.runner.input_batch import StepBatch
from spindle.runner.model_states.base import ModelState


class DefaultModelState(ModelState):
    needs_kv_cache = True
    supports_cuda_graphs = True
    # Whether mixed steps on a GPU may send their single-token requests to the decode
    # kernel (AttentionMetadata.single_token_reqs); the warm-up then runs such steps.
    may_split_mixed_steps = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Decode steps on a GPU may hand the kernel an order, longest context first.
        self.longest_first = not self.h2d.on_cpu and longest_first_enabled()
        self.splits_mixed_steps = (self.may_split_mixed_steps and not self.h2d.on_cpu
                                   and mixed_split_enabled())

    def prepare_inputs(self, batch: StepBatch) -> dict[str, Any]:
        return {
            "input_ids": self.h2d.put(batch.input_ids, torch.int64),
            "positions": self.h2d.put(batch.model_positions, torch.int64),
        }

    def prepare_attn(self, batch: StepBatch) -> AttentionMetadata | list:
        """One metadata per cache group (the object itself when there is one group):
        paged groups share the step's geometry and differ in block tables and slots."""
        query_start_loc = torch.from_numpy(batch.query_start_loc).to(torch.int32)
        seq_lens = torch.from_numpy(batch.seq_lens).to(torch.int32)
        common = dict(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc=self.h2d.put(query_start_loc, torch.int32),
            seq_lens=self.h2d.put(seq_lens, torch.int32),
            max_query_len=int(batch.num_scheduled.max()),
            max_seq_len=int(batch.seq_lens.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        if self.longest_first and common["max_query_len"] == 1:
            common["decode_order"] = self.h2d.put(decode_order(batch.seq_lens), torch.int32)
        paged = self._mixed_step_requests(batch) if common["max_query_len"] > 1 else {}
        metadata, table = [], 0
        for group in self.groups():
            if group.is_paged:
                metadata.append(AttentionMetadata(
                    **common, **paged,
                    block_tables=self.h2d.put(batch.block_tables[table], torch.int32),
                    slot_mapping=self.h2d.put(batch.slot_mappings[table], torch.int64)))
                table += 1
            else:
                metadata.append(self.state_metadata(batch, group, common))
        return metadata[0] if len(metadata) == 1 else metadata

    def _mixed_step_requests(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        """AttentionMetadata's single_token_reqs and multi_token_reqs for a step with
        prompt tokens, where it has both kinds and this state splits mixed steps."""
        if not self.splits_mixed_steps:
            return {}
        found = mixed_step_requests(batch.num_scheduled, batch.seq_lens)
        if found is None:
            return {}
        order, num_single = found
        # (Two copies, each 16-byte aligned: Triton specializes on a pointer's alignment.)
        return dict(single_token_reqs=self.h2d.put(order[:num_single], torch.int32),
                    multi_token_reqs=self.h2d.put(order[num_single:], torch.int32))

    def state_metadata(self, batch: StepBatch, group: CacheGroup, common: dict) -> Any:
        """The metadata of a state (non-paged) cache group; see MambaHybridModelState."""
        raise ValueError(f"{type(self).__name__} serves no {group.kind} layers")

    def dummy_attn(self, num_reqs: int, tokens_per_req: int) -> AttentionMetadata | list:
        qsl = torch.arange(0, (num_reqs + 1) * tokens_per_req, tokens_per_req, dtype=torch.int32)
        lens = torch.full((num_reqs,), tokens_per_req, dtype=torch.int32)
        num_tokens = num_reqs * tokens_per_req
        metadata = []
        for group in self.groups():
            if group.is_paged:
                metadata.append(AttentionMetadata(
                    num_reqs=num_reqs, num_tokens=num_tokens,
                    query_start_loc=qsl.to(self.device), seq_lens=lens.to(self.device),
                    block_tables=torch.zeros((num_reqs, 1), dtype=torch.int32, device=self.device),
                    slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
                    max_query_len=tokens_per_req, max_seq_len=tokens_per_req,
                    query_start_loc_cpu=qsl, seq_lens_cpu=lens))
            else:
                metadata.append(self.dummy_state_metadata(group, qsl, tokens_per_req))
        return metadata[0] if len(metadata) == 1 else metadata

    def dummy_state_metadata(self, group: CacheGroup, query_start_loc: torch.Tensor,
                             tokens_per_req: int) -> Any:
        raise ValueError(f"{type(self).__name__} serves no {group.kind} layers")
