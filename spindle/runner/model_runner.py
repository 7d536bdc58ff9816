"""ModelRunner: turns a SchedulerOutput into sampled tokens (or, for task="embed",
pooled embeddings) on one device.

It owns the request rows (InputBatch), the KV cache tensors and the sampler, and
delegates everything architecture-specific to a ModelState. It never branches on
the architecture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from spindle.attention.layer import Attention
from spindle.cache.spec import CacheLayout, CacheRequirements, KVCacheConfig, build_cache_layout
from spindle.config import EngineConfig
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import IntermediateTensors, PipelineStage
from spindle.forward_context import forward_context
from spindle.layers.batch_invariant import enable_batch_invariance
from spindle.layers.linear import drop_weight_loaders
from spindle.memory.sleep_backend import KV_CACHE, WEIGHTS
from spindle.models.loader import load_model, reload_checkpoint
from spindle.outputs import RequestFailure
from spindle.platforms.interface import Platform
from spindle.runner import compile_ahead
from spindle.runner.async_output import PendingOutput
from spindle.runner.cuda_graph import CudaGraphRunner, graph_tokens
from spindle.runner.input_batch import InputBatch, StepBatch
from spindle.runner.kernel_plan import KernelPlan, engine_fingerprint
from spindle.runner.model_states import model_state_class
from spindle.runner.model_states.base import ModelState
from spindle.runner.pool import Pooler
from spindle.runner.sample import Sampler, SamplerOutput
from spindle.runner.sample.metadata import SamplingMetadata
from spindle.runner.sample.prompt_logprobs import prompt_rows, score_rows
from spindle.runner.staging import DeviceToHost, HostToDevice
from spindle.step_messages import (ModelRunnerOutput, NewRequestData, SampledLogprobs,
                                   SchedulerOutput)
from spindle.switches import kernel_switch_settings, on_off

logger = logging.getLogger(__name__)


MemoryScope = Callable[[str], ContextManager]

# Errors of this rank's memory or device, not of the request being prepared: they
# could strike one tensor-parallel rank and not another, so they stay fatal (a
# request failing alone must fail on every rank alike, or the ranks diverge).
_RANK_LOCAL_ERRORS = (MemoryError, torch.OutOfMemoryError, torch.AcceleratorError)


def flatten_cache_entries(entries: Sequence[torch.Tensor | Sequence[torch.Tensor]]
                          ) -> list[torch.Tensor]:
    """The tensors of per-layer cache entries: a tensor, or a list of tensors for a
    layer with several states (hybrid models). Every path that touches the cache's
    memory (sizing, zeroing, sleep, release) goes through this."""
    tensors: list[torch.Tensor] = []
    for entry in entries:
        if isinstance(entry, torch.Tensor):
            tensors.append(entry)
        else:
            tensors.extend(flatten_cache_entries(entry))
    return tensors


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, platform: Platform,
                 tp_group: TensorParallelGroup, stage: PipelineStage | None = None) -> None:
        self.config = config
        self.device = device
        self.platform = platform
        self.tp_group = tp_group
        # Pipeline parallelism: this rank runs only its stage's layers; a stage other
        # than the first receives its input, one other than the last sends its output.
        self.stage = stage or PipelineStage.single()
        self.model: nn.Module | None = None
        self.state: ModelState | None = None
        self.sampler = Sampler(processed=config.model.logprobs_mode == "processed_logprobs",
                               batch_invariant=config.device.batch_invariant)
        # task="embed": requests pool their prompt's states instead of sampling.
        self.pooler = Pooler(config.pooler) if config.pooler is not None else None
        self.attn_layers: list[Attention] = []
        # One entry per attention layer: a tensor, or a list of them (hybrid state).
        self.kv_caches: list[torch.Tensor | list[torch.Tensor]] = []
        self.num_kv_blocks = 0
        self.kv_config = KVCacheConfig(0)
        self.cache_layout = CacheLayout([], [], [])
        self._memory_scope: MemoryScope = lambda tag: contextlib.nullcontext()
        self.graph_runner: CudaGraphRunner | None = None
        self.num_graph_captures = 0  # CUDA graphs captured so far (warmup and recaptures)
        self.kernels_compiled_ahead = 0  # Triton kernels compiled on threads (compile_ahead.py)
        self._recapture_on_wake = False
        self._weight_check = None  # update_weights' check (models/weight_update.py)
        self._last_launched: PendingOutput | None = None
        # Speculative decoding (runner/spec_decode/): the proposer, and its last
        # proposals that carry draft distributions, by request.
        self.proposer = None
        self.lora = None  # the adapters' slots (lora/manager.py), where adapters are served
        if config.speculative is not None:
            from spindle.runner.spec_decode import make_proposer

            self.proposer = make_proposer(config, self)
        self._drafted: dict = {}
        # Requests whose preparation failed: the scheduler may still schedule them (it
        # learns of the failure from this step's output) until it reports them finished.
        self._dropped: set[str] = set()
        self.h2d = HostToDevice(device)
        self.d2h = DeviceToHost(device)
        self.input_batch = InputBatch(
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=config.model.max_model_len,
            block_size=config.cache.block_size,
            vocab_size=config.model.vocab_size,
            device=device,
            # (Only tensor-parallel rank 0 of the last stage samples: the others skip
            # structured outputs' token tables.)
            token_vocab=self._token_vocab if tp_group.rank == 0 and self.stage.is_last
            else None)
        self._vocab = None  # the tokenizer's bytes, for structured outputs (on first use)

    def _token_vocab(self) -> Any:
        """The vocabulary's byte strings (structured/vocab.py) from the model's
        tokenizer, loaded when the first structured-outputs request arrives."""
        if self._vocab is None:
            from spindle.engine.tokenizer_loader import load_tokenizer
            from spindle.structured.vocab import TokenVocab, token_byte_strings

            tokenizer = load_tokenizer(self.config.model.tokenizer)
            self._vocab = TokenVocab(token_byte_strings(tokenizer.backend_tokenizer),
                                     self.config.model.vocab_size)
        return self._vocab

    # ---- lifecycle ------------------------------------------------------------
    def set_memory_scope(self, scope: MemoryScope | None) -> None:
        """Where tagged memory ("weights", "kv_cache") is allocated from: scope(tag) is
        entered around the allocations (a pool of the cumem allocator, or of a sleep
        backend). None: plain torch allocations. Set before load_model."""
        self._memory_scope = scope or (lambda tag: contextlib.nullcontext())

    def load_model(self) -> None:
        if self.stage.size > 1 and self.pooler is not None:
            raise ValueError("pipeline_parallel_size > 1 is not supported for task='embed'")
        with self._memory_scope(WEIGHTS):
            self.model = load_model(self.config.model, self.device, self.tp_group, self.stage)
        self.state = model_state_class(self.model, self.config)(self.model, self.device, self.h2d)
        if self.config.memory.reserved_bytes:
            self.state.set_media_buffer(self.config.memory.reserved_bytes)
        if self.config.device.batch_invariant:
            enable_batch_invariance(self.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = self.config.device.attention_backend
        for layer in self.attn_layers:
            if layer.backend_name != backend:
                layer.use_backend(backend)
        self._group_cache_layers()
        if self.config.lora is not None:
            from spindle.lora.manager import LoRAManager

            lora = self.config.lora
            with self._memory_scope(WEIGHTS):
                self.lora = LoRAManager(self.model, self.model.param_name, lora.max_loras,
                                        lora.max_lora_rank, self.config.model.dtype,
                                        self.device)
            self.input_batch.serves_lora = True
        if self.config.model.long_rope_from is not None:
            from spindle.layers.rotary import long_rope_rows

            self.input_batch.long_rope_rows = long_rope_rows(self.model,
                                                             self.config.model.long_rope_from)
        if self.proposer is not None:
            with self._memory_scope(WEIGHTS):
                self.proposer.load_model()

    def _group_cache_layers(self) -> None:
        """Group the layers that declare a cache spec (spindle/cache/spec.py) and tell
        each layer, the model state and the input batch what the groups are. The
        runner keeps no cache layout of its own: the specs decide it."""
        if not self._require_state().needs_kv_cache:
            self.cache_layout = CacheLayout([], [], [])
            return
        layers = [m for m in self._require_model().modules() if hasattr(m, "cache_spec")]
        self.cache_layout = build_cache_layout(layers, self.config.cache.block_size,
                                               self.config.model.dtype)
        for group, members in enumerate(self.cache_layout.group_layers):
            for layer in members:
                layer.cache_group = group
        self.state.cache_groups = list(self.cache_layout.groups)
        self.input_batch.set_cache_groups([g.is_paged for g in self.cache_layout.groups])

    @property
    def needs_kv_cache(self) -> bool:
        return self._require_state().needs_kv_cache and bool(self.cache_layout.groups)

    def cache_requirements(self) -> CacheRequirements:
        """This rank's cache groups and what a block id / a state slot costs here (a
        draft model's cache included)."""
        self._require_state()
        needs = self.cache_layout.requirements()
        if self.proposer is not None and needs.block_bytes:
            needs = dataclasses.replace(needs, block_bytes=needs.block_bytes
                                        + self.proposer.block_bytes(self.config.cache.block_size))
        return needs

    @torch.inference_mode()
    def profile_run(self, num_tokens: int | None = None) -> None:
        """A cache-less forward plus the sampler. By default at the step token budget,
        with the sampler over max_num_seqs rows: the activation peak a measured KV
        budget must leave room for. With num_tokens: a forward of that many tokens
        (at most the budget) and the sampler over its requests, which only checks that
        the path runs."""
        if self._compiles_ahead() and not (num_tokens is None and self._preload_kernel_plan()):
            with self._compiling_ahead("profile_run"):
                self._profile_forward(num_tokens)
            self.platform.reset_peak_memory(self.device)  # (the pass above measures nothing)
        with self._recording_plan_misses():
            self._profile_forward(num_tokens)

    def _profile_forward(self, num_tokens: int | None) -> None:
        state = self._require_state()
        sched = self.config.scheduler
        full = num_tokens is None
        num_tokens = min(num_tokens or sched.max_num_batched_tokens, sched.max_num_batched_tokens)
        num_reqs = -(-num_tokens // sched.max_model_len)
        tokens_per_req = max(1, num_tokens // num_reqs)
        num_tokens = num_reqs * tokens_per_req
        num_rows = sched.max_num_seqs if full else num_reqs
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(tokens_per_req, device=self.device).repeat(num_reqs)
        inputs = {"input_ids": input_ids, "positions": positions}
        if not self.stage.is_first:
            inputs["intermediate_tensors"] = self._empty_intermediate(num_tokens)
        no_adapters = torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)
        with forward_context(state.dummy_attn(num_reqs, tokens_per_req),
                             self._lora_step(no_adapters)):
            hidden = state.forward(inputs)
        if not self.stage.is_last:
            pass  # the last stage's logits and sampler are not this rank's
        elif self.pooler is not None:
            self.pooler.dummy_run(hidden, num_reqs)
        else:
            rows = torch.arange(num_rows, device=self.device) % num_tokens
            logits = state.compute_logits(hidden[rows]).float()
            self.sampler(logits, _dummy_sampling_metadata(num_rows, self.device))
        self.platform.synchronize(self.device)

    def allocate_kv_cache(self, config: KVCacheConfig) -> int:
        """Allocate the cache the engine sized: for the paged groups, group_size
        tensors of config.num_blocks pages (layer j of every paged group uses tensor
        j); for each state layer, its state tensors with config.num_state_slots slots.
        Returns the bytes allocated."""
        self.kv_config = config
        self.num_kv_blocks = config.num_blocks
        if not self.needs_kv_cache:
            return 0
        layout, dtype = self.cache_layout, self.config.model.dtype
        self.kv_caches = []
        with self._memory_scope(KV_CACHE):
            if layout.attention_page is not None:
                shared = [self.platform.allocate_zeroed(
                    layout.attention_page.shape(config.num_blocks, layout.block_size), dtype,
                    self.device) for _ in range(layout.group_size)]
                self.kv_caches.extend(shared)
                for g in layout.paged_groups:
                    for j, layer in enumerate(layout.group_layers[g]):
                        layer.kv_cache = layout.attention_page.layer_view(shared[j])
            for g in layout.state_groups:
                spec = layout.group_specs[g]
                for layer in layout.group_layers[g]:
                    layer.kv_cache = [self.platform.allocate_zeroed(
                        (config.num_state_slots, *shape), state_dtype, self.device)
                        for shape, state_dtype in zip(spec.shapes, spec.dtypes)]
                    self.kv_caches.append(layer.kv_cache)
            if self.proposer is not None:
                self.kv_caches.extend(self.proposer.allocate_cache(
                    config.num_blocks, lambda shape, dtype: self.platform.allocate_zeroed(
                        shape, dtype, self.device)))
        return sum(c.numel() * c.element_size() for c in flatten_cache_entries(self.kv_caches))

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run real steps through the cache path (short and long prefill, decode, and
        without graphs a decode step of each graph batch size), so every kernel variant
        is compiled before the first request; then capture CUDA graphs. Where kernels
        compile, the same steps run first in a compile-only pass that compiles them on
        threads (compile_ahead.py). Where nothing is compiled (CPU) the short request
        alone checks the path."""
        if not self.needs_kv_cache or self.pooler is not None:
            return  # (pooling requests never decode: the sampling warm-up does not apply)
        requests = self._warmup_requests()
        graphs = self._new_graph_runner()
        # Without graphs, eager decode steps of every graph batch size still run once:
        # the kernel variants those steps need are compiled before the first request.
        eager_sizes = (self._new_graph_runner(eager=True)
                       if graphs is None and self.platform.compiles_kernels_on_first_use
                       else None)

        def warm_passes(compile_only: bool) -> None:
            for num_prompt, block_ids in requests:
                self._warmup_request(num_prompt, block_ids)
            self._warmup_mixed_steps()
            if eager_sizes is not None:
                eager_sizes.forward_each_size()
            if compile_only and graphs is not None:
                graphs.forward_each_size()  # (what capture would compile one by one)

        if self._compiles_ahead() and not self.kernel_plan.used:
            with self._compiling_ahead("warmup"):
                warm_passes(compile_only=True)
        with self._recording_plan_misses():
            warm_passes(compile_only=False)
            self._capture_cuda_graphs(graphs)
        if self._compiles_ahead():
            self.kernel_plan.save()

    def _warmup_requests(self) -> list[tuple[int, list[list[int]]]]:
        """(prompt length, block ids per cache group) of the warm-up's throw-away
        requests: a short and a long prompt (block_size and 4 * block_size tokens: both
        prefill tile heights), or only the short one where nothing compiles."""
        block_size = self.config.cache.block_size
        lengths = (block_size, 4 * block_size)
        if not self.platform.compiles_kernels_on_first_use:
            lengths = lengths[:1]
        groups = self.cache_layout.groups
        num_paged = sum(g.is_paged for g in groups)
        lookahead = self.config.speculative.num_lookahead_tokens if self.proposer else 0
        requests = []
        for n in lengths:
            blocks = -(-(n + 1 + lookahead) // block_size)
            if n + 1 > self.config.model.max_model_len or blocks * num_paged > self.num_kv_blocks:
                break
            requests.append((n, self._warmup_block_ids([n + 1 + lookahead])[0]))
        return requests

    def _warmup_block_ids(self, tokens: list[int]) -> list[list[list[int]]]:
        """Block ids per cache group for warm-up requests holding tokens[i] tokens each:
        distinct blocks for every request in every paged group (groups share tensors),
        and request i in state slot i."""
        block_size, next_block, block_ids = self.config.cache.block_size, 0, []
        for i, n in enumerate(tokens):
            ids = []
            for group in self.cache_layout.groups:
                if group.is_paged:
                    blocks = -(-n // block_size)
                    ids.append(list(range(next_block, next_block + blocks)))
                    next_block += blocks
                else:
                    ids.append([i])
            block_ids.append(ids)
        return block_ids

    def _compiles_ahead(self) -> bool:
        """Whether warm-up compiles its Triton kernels ahead on threads
        (runner/compile_ahead.py): where kernels compile on first use, on one pipeline
        stage (the stages of a pipeline exchange activations step by step)."""
        return (self.platform.compiles_kernels_on_first_use and self.stage.size == 1
                and compile_ahead.switched_on())

    @contextlib.contextmanager
    def _compiling_ahead(self, what: str):
        per_host = self.config.parallel.world_size
        threads = compile_ahead.compile_threads(per_host)
        with compile_ahead.compiling_ahead(self.device, threads) as report:
            yield
        logger.debug("%s: %d Triton kernels compiled ahead on %d threads (%.2f s waited)",
                     what, report["kernels"], threads, report["wait_s"])
        self.kernels_compiled_ahead += report["kernels"]
        self.kernel_plan.add(report["variants"])

    @functools.cached_property
    def kernel_plan(self) -> KernelPlan:
        """This engine's kernel plan (runner/kernel_plan.py): its fingerprint covers the
        configuration, the checkpoint's config, the kernel switches set in the
        environment, this rank and the device."""
        hf_config = self.config.model.hf_config
        to_json = getattr(hf_config, "to_json_string", None)
        return KernelPlan(engine_fingerprint(
            repr(self.config), to_json() if to_json else repr(hf_config),
            f"switches {kernel_switch_settings()}",
            f"tp rank {self.tp_group.rank} of {self.tp_group.size}",
            f"stage {self.stage.rank} of {self.stage.size}",
            self.platform.device_model(self.device)))

    def _preload_kernel_plan(self) -> bool:
        """Load every kernel of this engine's plan on threads; False when it has none."""
        threads = compile_ahead.compile_threads(self.config.parallel.world_size)
        report = self.kernel_plan.preload(self.device, threads)
        if report is None:
            return False
        logger.debug("kernel plan: %d Triton kernels loaded on %d threads (%.2f s waited)",
                     report["kernels"], threads, report["wait_s"])
        self.kernels_compiled_ahead += report["kernels"]
        return True

    def _recording_plan_misses(self) -> ContextManager:
        """Where a kernel plan was used: record what compiles anyway (into the plan)."""
        if not (self._compiles_ahead() and self.kernel_plan.used):
            return contextlib.nullcontext()
        return self.kernel_plan.recording_misses()

    def _warmup_request(self, num_prompt: int, block_ids: list[list[int]]) -> None:
        """A throw-away greedy request: its prefill step, then one decode step."""
        from spindle.step_messages import CachedRequestData

        req, = self._warmup_prefill([num_prompt], [block_ids])
        # (new_token_ids: what pipeline stages other than the last did not sample)
        no_blocks = [[] for _ in block_ids]
        decode = SchedulerOutput(cached_requests=[CachedRequestData(req, no_blocks, num_prompt,
                                                                    [0], num_prompt)],
                                 num_scheduled_tokens={req: 1}, total_num_scheduled_tokens=1,
                                 speculate=self.proposer is not None)
        self.execute_model(decode)
        self.input_batch.remove_request(req)

    def _warmup_mixed_steps(self) -> None:
        """Where the model state splits mixed steps (AttentionMetadata.single_token_reqs),
        the steps that compile what such a split runs: a prompt of 2 tokens, then one of
        33 (both prefill tile heights), each beside as many one-token requests as a step
        can hold, so that the attention backend's bound for sending them to the decode
        kernel is met wherever a served step could meet it."""
        if not self._require_state().splits_mixed_steps:  # (a GPU's states only)
            return
        sched, block_size = self.config.scheduler, self.config.cache.block_size
        groups = self.cache_layout.groups
        num_paged = sum(g.is_paged for g in groups)
        for num_prompt in (2, 33):
            singles = min(sched.max_num_seqs - 1, sched.max_num_batched_tokens - num_prompt)
            prompt_blocks = -(-(num_prompt + 1) // block_size)
            if (singles < 1 or num_prompt + 1 > self.config.model.max_model_len
                    or (prompt_blocks + singles) * num_paged > self.num_kv_blocks
                    or (num_paged < len(groups) and singles + 1 > self.kv_config.num_state_slots)):
                continue
            lengths = [num_prompt] + [1] * singles
            block_ids = self._warmup_block_ids([n + 1 for n in lengths])
            for req in self._warmup_prefill(lengths, block_ids):
                self.input_batch.remove_request(req)

    def _warmup_prefill(self, prompt_lengths: list[int], block_ids: list) -> list[str]:
        """One step of new throw-away greedy requests, the whole of each prompt (token
        id 0) in it, request i in the blocks block_ids[i]. Returns their ids."""
        from spindle.sampling_params import SamplingParams

        reqs = [f"__warmup_{i}__" for i in range(len(prompt_lengths))]
        extra = self._require_state().warmup_inputs()
        self.execute_model(SchedulerOutput(
            new_requests=[NewRequestData(req, [0] * n, n, SamplingParams(temperature=0.0),
                                         ids, 0, **extra)
                          for req, n, ids in zip(reqs, prompt_lengths, block_ids)],
            num_scheduled_tokens=dict(zip(reqs, prompt_lengths)),
            total_num_scheduled_tokens=sum(prompt_lengths)))
        return reqs

    def _capture_cuda_graphs(self, graphs: CudaGraphRunner | None) -> None:
        """Capture graphs' shapes and serve from them (None: this engine has none)."""
        if graphs is None:
            return
        graphs.capture()
        self.graph_runner = graphs
        self.num_graph_captures += len(graphs.graphs)
        held = graphs.logits_bytes()
        counted = self.graph_logits_bytes()
        if held > counted:
            logger.warning("the CUDA graphs' logits take %d MiB, more than the %d MiB the KV "
                           "cache budget set aside for them", held >> 20, counted >> 20)

    def _new_graph_runner(self, eager: bool = False) -> CudaGraphRunner | None:
        """The CUDA graph runner this engine captures, None where it captures none.
        eager=True: one regardless of enforce_eager (its shapes serve compiling ahead)."""
        if not self._captures_graphs(eager):
            return None
        verify_len, verify_max_batch = self._verify_shape()
        return CudaGraphRunner(
            self._require_state(), self.config.device.max_cudagraph_batch_size,
            self.input_batch.max_blocks_per_req, self.device, self.cache_layout.groups,
            verify_len=verify_len, verify_max_batch=verify_max_batch, lora=self.lora,
            logits=self._graphs_compute_logits(), block_size=self.config.cache.block_size)

    def _captures_graphs(self, eager: bool = False) -> bool:
        """Whether decode steps replay CUDA graphs (eager=True: regardless of
        enforce_eager)."""
        return ((eager or not self.config.device.enforce_eager)
                and self._require_state().supports_cuda_graphs and self.needs_kv_cache
                and self.stage.size == 1)

    def _verify_shape(self) -> tuple[int, int]:
        """(tokens per request, most requests) of the verifying steps the graphs capture:
        every request's last token and k drafts, in batches that speculate (fewer than
        disable_by_batch_size requests); (1, 0) without speculation."""
        spec = self.config.speculative
        if spec is None:
            return 1, 0
        return spec.num_speculative_tokens + 1, spec.disable_by_batch_size - 1

    def _graphs_compute_logits(self) -> bool:
        """Whether the CUDA graphs end with the LM head (cuda_graph.py): where this rank
        samples alone (one tensor-parallel rank; a head gathered across ranks stays
        outside the graphs), unless SPINDLE_GRAPH_LOGITS=0."""
        return (self.pooler is None and self.tp_group.size == 1
                and on_off("SPINDLE_GRAPH_LOGITS", True))

    def graph_logits_bytes(self) -> int:
        """Device memory the CUDA graphs' logits will hold, for the KV cache budget: one
        buffer per graph (each shape, each adapter variant) of the model's dtype (every
        compute_logits keeps its hidden states' dtype; capture warns if they took
        more); 0 where no graphs compute them."""
        if not (self._captures_graphs() and self._graphs_compute_logits()):
            return 0
        tokens = sum(graph_tokens(self.config.device.max_cudagraph_batch_size,
                                  *self._verify_shape()))
        variants = 2 if self.lora is not None else 1
        return (tokens * variants * self.config.model.vocab_size
                * self.config.model.dtype.itemsize)

    # ---- sleep mode (the SleepTarget of spindle/memory/sleep_backend.py) ----------
    def tagged_tensors(self, tag: str) -> list[torch.Tensor]:
        """The distinct tensors holding tag's device memory."""
        if tag == KV_CACHE:
            return flatten_cache_entries(self.kv_caches)
        if tag != WEIGHTS:
            raise ValueError(f"unknown memory tag {tag!r}")
        model = self._require_model()
        distinct: dict[int, torch.Tensor] = {}
        for tensor in list(model.parameters()) + list(model.buffers()):
            distinct.setdefault(id(tensor), tensor)  # tied weights appear once
        if self.proposer is not None:
            for tensor in self.proposer.weights():
                distinct.setdefault(id(tensor), tensor)
        return list(distinct.values())

    def buffers_outside_checkpoint(self) -> list[torch.Tensor]:
        """Buffers are derived from the config (rotary tables), never loaded: a
        reload from the checkpoint does not restore them."""
        proposer = self.proposer.buffers() if self.proposer is not None else []
        return list(self._require_model().buffers()) + proposer

    def reload_weights(self) -> None:
        """Copy the checkpoint into the existing parameters (same tensors, same
        addresses), as load_model did; a draft model's too."""
        reload_checkpoint(self._require_model(), self.config.model)
        if self.proposer is not None:
            self.proposer.reload_weights()

    @torch.no_grad()
    def update_weights(self, source) -> int:
        """Copy new weights into the existing parameters (same tensors, same
        addresses: CUDA graphs stay valid), after checking the whole source against
        the checkpoint's layout (spindle/models/weight_update.py); returns the number
        of tensors the source held."""
        from spindle.models import weight_update
        from spindle.models.loader import load_into

        names = self._weights().source(source)
        load_into(self._require_model(),
                  weight_update.iter_source(source, self.config.model.dtype))
        self.platform.synchronize(self.device)
        return len(names)

    @torch.no_grad()
    def receive_weights(self, receiver) -> int:
        """update_weights from a trainer's WeightSender (spindle/rl/weight_transfer.py):
        the list of tensors is checked first on every rank, then each batch is loaded
        as it arrives. Returns the number of tensors."""
        from spindle.layers.int4 import finish_loading
        from spindle.models import weight_update

        model, dtype = self._require_model(), self.config.model.dtype
        count = receiver.receive(self._weights().entries, lambda tensors: model.load_weights(
            weight_update.cast_weights(tensors, dtype)))
        finish_loading(model)  # int4 weights: packed once every batch has arrived
        self.platform.synchronize(self.device)
        return count

    def _weights(self):
        from spindle.models.weight_update import WeightCheck

        if self._weight_check is None:
            self._weight_check = WeightCheck(self.config.model)
        return self._weight_check

    def before_sleep(self, addresses_will_change: bool) -> None:
        """Captured graphs would point at freed memory after such a sleep: drop them
        now (their pool goes back too) and recapture on wake."""
        if addresses_will_change and self.graph_runner is not None:
            self.graph_runner = None
            self._recapture_on_wake = True
            self.platform.empty_cache()

    @torch.no_grad()
    def after_wake(self, woken: Sequence[str], all_awake: bool) -> None:
        """A woken KV cache holds garbage: zero it, as allocate_kv_cache left it. Once
        weights and cache are both back, recapture the graphs before_sleep dropped."""
        if KV_CACHE in woken:
            for cache in flatten_cache_entries(self.kv_caches):
                cache.zero_()
        if self.graph_runner is not None:  # (what the graphs' inputs hold is not known)
            self.graph_runner.forget_device_inputs()
        if all_awake and self._recapture_on_wake:
            self._recapture_on_wake = False
            self._capture_cuda_graphs(self._new_graph_runner())
        self.platform.synchronize(self.device)

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the model is not loaded")
        return self.model

    def release(self) -> None:
        """Drop every tensor this runner holds (graphs first: they reference the pool
        and the cache), so the memory is free for whoever comes next, by reference
        counts alone: nothing of it is left in a cycle for the garbage collector
        (tests/test_release_memory.py)."""
        self.graph_runner = None
        self._last_launched = None
        self._drafted = {}
        if self.proposer is not None:
            self.proposer.release()
        for members in self.cache_layout.group_layers:
            for layer in members:
                layer.kv_cache = None
        self.kv_caches = []  # (state layers' list entries included)
        self.attn_layers = []
        self.cache_layout = CacheLayout([], [], [])  # (its groups listed the layers)
        if self.model is not None:
            drop_weight_loaders(self.model)
        self.model = self.state = self.pooler = self.lora = None
        # (It holds a method of this runner's: the runner would outlive its last reference.)
        self.input_batch = None

    # ---- one step ---------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).get()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> PendingOutput:
        """Launch one step and return without waiting for the device.

        The caller may launch the next step before get()ting this one: a decode
        input whose token this step is still sampling is then fed on the device
        from this step's sampled tokens (see _feed_inflight_tokens).
        """
        failures = self._update_states(sched)
        scheduled = self._runnable(sched)
        if not scheduled:
            return PendingOutput.ready(ModelRunnerOutput(failed_requests=failures))
        state = self._require_state()
        self.h2d.new_step()
        batch = self.input_batch.prepare(scheduled, sched.spec_token_ids or None)
        feed, inputs_in_place = self._inflight_feed(batch)
        self._copy_state_slots(sched.state_copies_before)
        # (The LM head's logits and their argmax, where the graph has them; the argmax on
        # the host too, where the graph wrote it there: cuda_graph.py's tokens_to_host.)
        logits = greedy = greedy_host = None
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            hidden, logits, greedy, greedy_host = self.graph_runner.run(batch, feed,
                                                                        inputs_in_place)
        else:
            inputs = state.prepare_inputs(batch)
            if feed is not None:
                feed(inputs["input_ids"])
            if not self.stage.is_first:
                inputs["intermediate_tensors"] = self.stage.recv(
                    batch.num_tokens, self._hidden_size(), self.config.model.dtype, self.device)
            with forward_context(state.prepare_attn(batch),
                                 self._lora_step(batch.token_lora_slots)):
                hidden = state.forward(inputs)
            if not self.stage.is_last:
                self.stage.send(hidden)
        if self.proposer is not None:
            self.proposer.after_forward(batch, feed, hidden)
        self._copy_state_slots(sched.state_copies_after)
        self.input_batch.advance(batch)
        if not self.stage.is_last:
            # The last stage samples and reports; this stage is free for the next batch.
            return PendingOutput.ready(ModelRunnerOutput())
        if self.pooler is not None:
            output = self._pool_and_report(batch, hidden)
            output.failed_requests = failures
            return PendingOutput.ready(output)
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        sampled = self._sample(batch, hidden, logits, greedy)
        tokens_on_host = greedy_host if (greedy_host is not None and sampled is not None
                                         and sampled.sampled_token_ids is greedy) else None
        pending = PendingOutput(self, batch, sampled, failures, prompt_logprobs, tokens_on_host)
        if tokens_on_host is not None:
            self.graph_runner.read_ring_by(pending)
        # Its tokens are the graph's argmax, which the graph left in its input ids too.
        pending.in_graph_inputs = (greedy is not None and self.graph_runner.feeds_inputs
                                   and sampled is not None
                                   and sampled.sampled_token_ids is greedy)
        earlier, self._last_launched = self._last_launched, pending
        if sched.speculate and self.proposer is not None:
            if earlier is not None:
                earlier.get()  # (steps record their tokens in launch order)
            return PendingOutput.ready(self._propose(pending.get()))
        return pending

    def _propose(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Drafts for the requests that got tokens in output (a speculating step), for
        their next step; the draft distributions stay here until it verifies them."""
        held = self.input_batch.requests
        req_ids = [r for r, tokens in zip(output.req_ids, output.sampled_token_ids)
                   if tokens and r in held]
        proposals = self.proposer.propose(req_ids)
        self._drafted = {r: p for r, p in proposals.items() if p.probs is not None}
        output.spec_token_ids = [proposals[r].token_ids if r in proposals else []
                                 for r in output.req_ids]
        return output

    def _copy_state_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy state slots (src, dst) in every state layer: prefix-cache snapshots
        (spindle/engine/kv_cache_manager.py). Queued on the device in step order."""
        if not copies:
            return
        src = self.h2d.put([c[0] for c in copies], torch.int64)
        dst = self.h2d.put([c[1] for c in copies], torch.int64)
        layout = self.cache_layout
        for g in layout.state_groups:
            for layer in layout.group_layers[g]:
                for tensor in layer.kv_cache:
                    tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def _runnable(self, sched: SchedulerOutput) -> dict[str, int]:
        """The step's scheduled requests and token counts, without the dropped ones."""
        if not self._dropped:
            return sched.num_scheduled_tokens
        return {r: n for r, n in sched.num_scheduled_tokens.items() if r not in self._dropped}

    def _inflight_feed(self, batch: StepBatch):
        """(feed, in place): feed writes, on the device, the input ids whose token the
        last launched step is still sampling (None when every input id is known); in
        place: the CUDA graphs' input ids hold them already (the last step's graph
        left its argmax there, and this step decodes the same requests in order)."""
        if not batch.inflight_dst.size:
            return None, False
        last = self._last_launched
        if last is None or last.sampled is None:
            raise RuntimeError("a step needs tokens of a step that sampled nothing")
        tokens = last.sampled.sampled_token_ids
        num = batch.num_reqs
        if batch.inflight_dst.size == batch.num_tokens == num and last.rows_follow(batch.req_ids):
            # A decode step of the same requests as the last: token i is input i (one
            # copy on the device instead of a gather and a scatter).
            def feed_all(input_ids: torch.Tensor) -> None:
                input_ids[:num].copy_(tokens[:num])

            return feed_all, last.in_graph_inputs
        src = [last.sample_row[batch.req_ids[i]] for i in batch.token_req_index[batch.inflight_dst]]
        dst_t = self.h2d.put(batch.inflight_dst, torch.int64)
        src_t = self.h2d.put(src, torch.int64)

        def feed(input_ids: torch.Tensor) -> None:
            input_ids[dst_t] = tokens[src_t].to(input_ids.dtype)

        return feed, False

    def _update_states(self, sched: SchedulerOutput) -> dict[str, RequestFailure]:
        """Forget finished and preempted requests, add new ones, advance cached ones.
        Returns the new requests whose preparation failed (they are dropped)."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self._remove_request(req_id)
            self._dropped.discard(req_id)
        failures = {}
        for new in sched.new_requests:
            failure = self._add_request(new)
            if failure is not None:
                failures[new.req_id] = failure
        self._dropped.update(failures)
        for cached_req in sched.cached_requests:
            if cached_req.req_id in self._dropped:
                continue
            self.input_batch.append_blocks(cached_req.req_id, cached_req.new_block_ids)
            if cached_req.new_token_ids:
                self._append_step_tokens(cached_req)
            self.input_batch.requests[cached_req.req_id].num_computed_tokens = \
                cached_req.num_computed_tokens
        return failures

    def _add_request(self, new: NewRequestData) -> RequestFailure | None:
        """Prepare a request the runner first sees: its row, its generator, its model
        state (prompt embeddings, ...). What goes wrong here belongs to this request
        alone: it is dropped and reported, and the step goes on without it. Every
        rank prepares it from the same data, so every rank fails it alike."""
        state = self._require_state()
        acquired = added = False
        try:
            state.validate_request(new)
            lora_slot = self._lora_slot(new)
            acquired = new.lora_request is not None
            cached = self.input_batch.add_request(new, lora_slot)
            added = True
            state.preprocess_state(cached, new)
        except _RANK_LOCAL_ERRORS:
            raise
        except Exception as e:
            if added:
                self._remove_request(new.req_id)  # (its adapter released with it)
            elif acquired:  # (only its own hold: others may use the same adapter)
                self.lora.release(new.lora_request.lora_int_id)
            failure = RequestFailure.from_exception(e)
            reporting = self.tp_group.rank == 0 and self.stage.is_last  # one log, not one a rank
            logger.log(logging.WARNING if reporting else logging.DEBUG,
                       "request %r failed alone in its preparation: %s", new.req_id,
                       failure.message, exc_info=not failure.bad_request)
            return failure
        return None

    def _lora_slot(self, new: NewRequestData) -> int:
        """The slot of the request's adapter (loaded now if need be); -1 for none."""
        if new.lora_request is None:
            return -1
        if self.lora is None:
            raise ValueError(f"request {new.req_id!r} names LoRA adapter "
                             f"{new.lora_request.lora_name!r}, and this engine serves none "
                             "(enable_lora)")
        return self.lora.acquire(new.lora_request)

    def _remove_request(self, req_id: str) -> None:
        state = self.input_batch.remove_request(req_id)
        if state is not None and state.lora_int_id is not None:
            self.lora.release(state.lora_int_id)

    def _lora_step(self, token_slots):
        """The step's adapters (lora/layers.py LoRAStep) from its tokens' slots; None
        without adapters served, or (an eager step's host slots) when none of its
        requests has one: the layers then are the base model's."""
        if self.lora is None:
            return None
        if not isinstance(token_slots, torch.Tensor):
            if (token_slots < 0).all():
                return None
            token_slots = self.h2d.put(token_slots, torch.int64)
        return self.lora.step(token_slots)

    def _append_step_tokens(self, cached_req) -> None:
        """Pipeline parallelism: append the sampled tokens this stage has not seen
        (the scheduler output carries them; the last stage already has them)."""
        state = self.input_batch.requests[cached_req.req_id]
        skip = state.num_tokens - cached_req.new_token_start
        if skip < 0:
            raise RuntimeError(f"request {cached_req.req_id!r}: stage {self.stage.rank} lacks "
                               f"tokens {state.num_tokens}..{cached_req.new_token_start - 1}")
        for token in cached_req.new_token_ids[skip:]:
            self.input_batch.append_token(state, token)

    def _empty_intermediate(self, num_tokens: int) -> IntermediateTensors:
        shape = (num_tokens, self._hidden_size())
        dtype = self.config.model.dtype
        return IntermediateTensors(torch.zeros(shape, dtype=dtype, device=self.device),
                                   torch.zeros(shape, dtype=dtype, device=self.device))

    def _hidden_size(self) -> int:
        return self.config.model.hf_config.hidden_size

    def _sample(self, batch: StepBatch, hidden: torch.Tensor,
                logits: torch.Tensor | None = None,
                greedy: torch.Tensor | None = None) -> SamplerOutput | None:
        """The step's tokens; logits: every token's, where a CUDA graph computed them,
        and greedy their argmax, where it computed that too."""
        if len(batch.logits_indices) == 0:
            return None
        num_samples = len(batch.logits_indices)
        rows = hidden if logits is None else logits
        if num_samples < batch.num_tokens:
            rows = rows[self.h2d.put(batch.logits_indices, torch.int64)]
            greedy = None
        # else: every token samples (a decode step): its rows are already in order.
        # (The sampler widens the logits.)
        logits = rows if logits is not None else self._require_state().compute_logits(rows)
        if self.tp_group.rank != 0:
            # Tensor-parallel rank 0 samples and the others take its tokens: ranks cannot
            # diverge, whatever their random streams or kernels do.
            tokens = torch.empty(num_samples, dtype=torch.int64, device=self.device)
            return SamplerOutput(sampled_token_ids=self.tp_group.broadcast(tokens))
        if self.input_batch.needs_outputs(batch.sampling_req_ids) and self._last_launched:
            self._last_launched.get()  # penalties / min_tokens read every output so far
        if batch.draft_token_ids:
            sampled = self._verify(batch, logits)
        else:
            metadata = self.input_batch.sampling_metadata(batch.sampling_req_ids, self.h2d)
            sampled = self.sampler(logits, metadata, argmax=greedy)
        self.tp_group.broadcast(sampled.sampled_token_ids)
        return sampled

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> dict | None:
        """The prompt logprobs this step computes (runner/sample/prompt_logprobs.py),
        as device tensors per request: (first position, ids, logprobs, ranks)."""
        if not self.input_batch.num_prompt_logprobs:
            return None
        rows = prompt_rows(batch)
        if not rows:
            return None
        state = self._require_state()
        out = {}
        for request, k, start, first_row, num in rows:
            targets = self.h2d.put(
                self.input_batch.token_ids[request.row, start + 1:start + 1 + num], torch.int64)
            # (Every tensor-parallel rank takes part in the LM head; rank 0 reports.)
            out[request.req_id] = (start, *score_rows(hidden[first_row:first_row + num],
                                                      targets, k, state.compute_logits))
        return out if self.tp_group.rank == 0 else None

    def _draft_distribution(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The distributions req_id's drafts were drawn from, when the proposal that
        drew them is the last one this runner made (else None: the drafts are then
        verified as certain, which stays exact, only accepts less often)."""
        proposal = self._drafted.pop(req_id, None)
        if proposal is None or proposal.token_ids[:len(drafts)] != drafts:
            return None
        return proposal.probs[:len(drafts)]

    def _verify(self, batch: StepBatch, logits: torch.Tensor) -> SamplerOutput:
        """A step verifying drafts: the target's distribution at every sampled row,
        and the tokens exact rejection sampling emits (-1 past a rejection)."""
        from spindle.runner.spec_decode import verify_drafts

        metadata = self.input_batch.verify_metadata(batch, self.h2d)
        sampled, drawn_from, logprobs_of = self.sampler.draw(logits, metadata)
        drafts, first_rows, weighed = [], [], []  # weighed: (first row, q) per request
        for req_id, num_rows in zip(batch.req_ids, batch.sample_rows.tolist()):
            if not num_rows:
                continue
            req_drafts = batch.draft_token_ids.get(req_id, [])
            q = self._draft_distribution(req_id, req_drafts)
            if q is not None:
                weighed.append((len(drafts), q))
            first_rows += [len(drafts)] * num_rows
            drafts += req_drafts + [-1]
        draft_probs = has_probs = None
        if weighed:
            draft_probs = torch.zeros_like(drawn_from)
            has_probs = torch.zeros(len(drafts), dtype=torch.bool)
            for start, q in weighed:
                draft_probs[start:start + len(q)] = q
                has_probs[start:start + len(q)] = True
            has_probs = has_probs.to(self.device)
        tokens = verify_drafts(sampled, drawn_from, metadata,
                               self.h2d.put(drafts, torch.int64),
                               self.h2d.put(first_rows, torch.int64), draft_probs, has_probs)
        return self.sampler.gather(logprobs_of, tokens, metadata)

    def _record_and_report(self, batch: StepBatch, token_ids: list[int],
                           logprobs) -> ModelRunnerOutput:
        """Append a finished step's sampled tokens to the requests still held, and
        build the reply (called once per step, in launch order, by PendingOutput)."""
        held = self.input_batch.requests
        out = ModelRunnerOutput(req_ids=batch.req_ids)
        row = 0
        for req_id, state, num_rows in zip(batch.req_ids, batch.requests,
                                           batch.sample_rows.tolist()):
            tokens = token_ids[row:row + num_rows]
            if num_rows > 1:  # a verified step: its tokens end at the first rejection
                tokens = tokens[:next((j for j, t in enumerate(tokens) if t < 0), num_rows)]
            if held.get(req_id) is state:  # (gone if finished or preempted meanwhile)
                for token in tokens:
                    self.input_batch.append_token(state, token)
            wanted = state.sampling_params.logprobs if logprobs is not None else None
            out.sampled_token_ids.append(tokens)
            out.logprobs.append([] if wanted is None else [
                _logprobs_for(logprobs, row + j, wanted) for j in range(len(tokens))])
            row += num_rows
        return out

    def _pool_and_report(self, batch: StepBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        """Report the embeddings of the requests that completed their prompt (their
        whole step; input_batch.advance() counted it); nothing is sampled."""
        pooled = self.pooler(hidden, batch)
        return ModelRunnerOutput(req_ids=batch.req_ids,
                                 sampled_token_ids=[[] for _ in batch.req_ids],
                                 logprobs=[[] for _ in batch.req_ids], pooled_outputs=pooled)

    def _require_state(self) -> ModelState:
        if self.state is None:
            raise RuntimeError("the model is not loaded: call load_model() first")
        return self.state


def _logprobs_for(rows, i: int, wanted: int) -> SampledLogprobs:
    ids, lps, ranks = rows
    return SampledLogprobs(token_ids=ids[i][:wanted + 1], logprobs=lps[i][:wanted + 1],
                           sampled_rank=ranks[i])


def _dummy_sampling_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    """Random sampling with top-k/top-p over every row: the sampler's heaviest path."""
    return SamplingMetadata(
        temperature=torch.ones(num_rows, device=device), all_greedy=False, all_random=True,
        top_k=torch.full((num_rows,), 50, dtype=torch.int64, device=device),
        top_p=torch.full((num_rows,), 0.9, device=device), min_p=None)
