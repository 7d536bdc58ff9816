"""The messages between the engine core and the model runner.

SchedulerOutput goes down once per step (through the executor, possibly to other
processes: keep it small and picklable, plain Python types only). It carries a
request's full state only the first time the runner sees it (or when it comes back
after preemption); afterwards only what changed. ModelRunnerOutput comes back up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spindle.outputs import RequestFailure
from spindle.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first schedule, or resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt + outputs generated so far (non-empty after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # Per cache group: paged groups' block ids in token order, [state slot] for a state
    # (mamba) group (spindle/engine/kv_cache_manager.py).
    block_ids: list[list[int]]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hits)
    # Set for an embedding request: it runs its whole prompt in one step and pools.
    pooling_params: Any = None  # spindle.pooling_params.PoolingParams
    # Set for a prompt given as embeddings [num_prompt_tokens, hidden] (a CPU tensor,
    # sent once); its prompt token ids are then placeholders that nothing embeds.
    prompt_embeds: Any = None
    # Set for a request of an encoder-decoder model: what its encoder reads (audio
    # features [mels, frames], a CPU tensor, sent once); the encoder runs in the step
    # that computes its first token.
    encoder_inputs: Any = None
    # Its tokens rotate by LongRoPE's long factors (Request.rope_long).
    rope_long: bool = False
    # The LoRA adapter it is served with (spindle.lora.LoRARequest), None: the base model.
    lora_request: Any = None


@dataclass
class CachedRequestData:
    """A request the runner already holds: only its new blocks and progress."""

    req_id: str
    new_block_ids: list[list[int]]  # per cache group, appended to its block list
    num_computed_tokens: int  # before this step's tokens
    # Pipeline parallelism only: this step's input tokens from new_token_start on that
    # are outputs (only the last stage saw them sampled); other stages append the ones
    # they lack.
    new_token_ids: list[int] | None = None
    new_token_start: int = 0


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute this step, per request; a request samples when these reach
    # the end of its known tokens (a partial prefill chunk does not sample).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget before this step: finished/aborted ones, and
    # preempted ones (they return later as NewRequestData).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # State-slot copies (src, dst) of state (mamba) layers: prefix-cache snapshots
    # into the running slots of requests admitted with a hit, before the forward;
    # running slots into new snapshots, after it.
    state_copies_before: list[tuple[int, int]] = field(default_factory=list)
    state_copies_after: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens each request's step verifies (they follow
    # its last known token in num_scheduled_tokens), and whether the runner proposes
    # drafts for the requests that sample this step (spindle/runner/spec_decode/).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    speculate: bool = False
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class SampledLogprobs:
    """Logprobs for one sampled token: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # rank of the sampled token among the vocabulary (1 = best)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    # Per request in req_ids: the new token ids ([] for a partial prefill chunk; with
    # speculative decoding, the accepted drafts and one token more).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Per request in req_ids: one entry per new token when its sampling params asked
    # for logprobs, else [].
    logprobs: list[list[SampledLogprobs]] = field(default_factory=list)
    # Per request in req_ids when the step speculated: the drafts proposed for its
    # next step ([] for none). Empty when nothing was proposed.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # Per request in req_ids when the step pooled: its embedding (a list of floats),
    # None for a request that did not pool. Empty when nothing pooled.
    pooled_outputs: list[list[float] | None] = field(default_factory=list)
    # Requests whose preparation failed this step (not in req_ids): the runner dropped
    # them, and ignores them until they come back in finished_req_ids.
    failed_requests: dict[str, RequestFailure] = field(default_factory=dict)
    # Requests that asked for prompt logprobs and computed prompt tokens this step:
    # (p, entries), entries[j] for the prompt token at position p + 1 + j (its own
    # logprob and rank, then the top k).
    prompt_logprobs: dict[str, tuple[int, list[SampledLogprobs]]] = field(
        default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request, handed to the output processor."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # stop token id (None for EOS) or stop string
    pooled_output: list[float] | None = None  # the embedding, for a finished pooling request
    error: RequestFailure | None = None  # why, when finish_reason is "error"
    # Once, with the request's first token when it asked for them: an entry per prompt
    # token after the first (SampledLogprobs: the prompt token, then the top k).
    prompt_logprobs: list[SampledLogprobs] | None = None
    # Of its prompt's tokens, those the prefix cache served (None: not admitted yet).
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
