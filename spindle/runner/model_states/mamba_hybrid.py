"""MambaHybridModelState: decoders whose layers mix attention and state-space (Mamba2)
mixers, fed token ids.

Attention layers read the paged KV cache as in DefaultModelState. A state-space layer
keeps a fixed-size state per sequence (conv state + SSM state) in the slot its
request holds (spindle/cache/spec.py, MambaCacheSpec); its metadata says which slot
each request owns and whether the request starts from zeros this step (its first
token) or from the state its earlier steps left (chunked prefill, decode). A
preempted request comes back with nothing computed, so it starts from zeros again
and recomputes its state.

Under pipeline parallelism each stage keeps the states of its own layers in the same
slots (the scheduler's slot ids hold on every stage), so a stage's layers must form
the same cache groups as every other stage's: FalconH1 (attention and a mixer in every
layer), or a Bamba-pattern model cut where each stage holds attention and Mamba
layers; otherwise the engine refuses the partition by name.
"""

from __future__ import annotations

import numpy as np
import torch

from spindle.cache.spec import CacheGroup
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.mixer import MambaMixer
from spindle.runner.input_batch import StepBatch
from spindle.runner.model_states.default import DefaultModelState


def prompt_rows(batch: StepBatch) -> np.ndarray:
    """[num_reqs] bool: the request computes prompt tokens this step (its first new
    token is one of its prompt's)."""
    prompts = np.fromiter((r.num_prompt_tokens for r in batch.requests), dtype=np.int64,
                          count=batch.num_reqs)
    return batch.num_computed < prompts


class MambaHybridModelState(DefaultModelState):
    needs_kv_cache = True
    supports_cuda_graphs = True
    _prompts_differ: bool | None = None  # (prompts_differ's answer, found on first use)

    def prompts_differ(self) -> bool:
        """Whether the model's state layers compute a prompt token otherwise than a
        generated one (by_step_kind's prompts_as_prefill: Zamba2). Only then does a step
        need its prompt rows, a Python pass over its requests."""
        if self._prompts_differ is None:
            self._prompts_differ = any(m.decode_time_step_limit != m.time_step_limit
                                       for m in self.model.modules()
                                       if isinstance(m, MambaMixer))
        return self._prompts_differ

    def graph_can_take(self, batch: StepBatch) -> bool:
        """Such a model runs a step holding prompt tokens eagerly: inside a graph every
        one-token row is a decode row."""
        return not (self.prompts_differ() and prompt_rows(batch).any())

    def state_metadata(self, batch: StepBatch, group: CacheGroup, common: dict) -> MambaMetadata:
        if batch.state_slots is None:
            raise RuntimeError("a step of a hybrid model without state slots")
        has_initial = batch.num_computed > 0
        return MambaMetadata(
            num_reqs=batch.num_reqs, num_tokens=batch.num_tokens,
            query_start_loc=common["query_start_loc"],
            state_indices=self.h2d.put(batch.state_slots, torch.int32),
            has_initial_state=self.h2d.put(has_initial, torch.bool),
            max_query_len=common["max_query_len"],
            query_start_loc_cpu=common["query_start_loc_cpu"],
            has_initial_state_cpu=torch.from_numpy(has_initial),
            state_indices_cpu=torch.from_numpy(np.ascontiguousarray(batch.state_slots)),
            prompt_rows_cpu=(torch.from_numpy(prompt_rows(batch)) if self.prompts_differ()
                             else None))

    def dummy_state_metadata(self, group: CacheGroup, query_start_loc: torch.Tensor,
                             tokens_per_req: int) -> MambaMetadata:
        """The profiling forward runs without states (the layers' caches are None)."""
        num_reqs = len(query_start_loc) - 1
        slots = torch.full((num_reqs,), -1, dtype=torch.int32)
        no_state = torch.zeros(num_reqs, dtype=torch.bool)
        return MambaMetadata(
            num_reqs=num_reqs, num_tokens=num_reqs * tokens_per_req,
            query_start_loc=query_start_loc.to(self.device),
            state_indices=slots.to(self.device), has_initial_state=no_state.to(self.device),
            max_query_len=tokens_per_req, query_start_loc_cpu=query_start_loc,
            has_initial_state_cpu=no_state, state_indices_cpu=slots)
