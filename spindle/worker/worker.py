"""Worker: drives one device through a strict, named lifecycle.

The executor calls, in this order and nothing else in between:
    init_device -> load_model -> determine_available_memory (runs profile_run)
    -> allocate_kv_cache -> warmup -> freeze_gc_heap
then execute_model once per step. Each stage is timed and its memory change
recorded; lifecycle_report() returns the rows of the startup table. The
constructor only stores its arguments, so a worker can be built anywhere (in
process, in a child process, in a Ray actor) and driven by the same calls.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from spindle.cache.spec import CacheLayout, CacheRequirements, KVCacheConfig
from spindle.config import EngineConfig
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage, build_parallel_groups
from spindle.platforms import resolve_platform
from spindle.step_messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Decode graphs share one pool sized by the largest batch's activations: small (the
# logits the graphs compute are counted apart, ModelRunner.graph_logits_bytes).
CUDA_GRAPH_MEMORY_ESTIMATE = 512 * 2**20
# profile_run's forward where the KV budget is configured, not measured: enough tokens
# to run every layer and the sampler, few enough to take milliseconds.
SMOKE_FORWARD_TOKENS = 16

LIFECYCLE = ("init_device", "load_model", "profile_run", "allocate_kv_cache", "warmup",
             "freeze_gc_heap")


@dataclass
class StageRecord:
    stage: str
    seconds: float
    bytes: int  # memory change during the stage (device memory on GPU, RSS on CPU)
    note: str = ""


@dataclass
class Heartbeat:
    rank: int
    last_stage: str  # the stage or call last entered
    last_step: int
    seconds_since: float  # since last_stage was entered or left
    busy: bool = False  # still inside last_stage (a hung rank stays busy, seconds grow)
    pid: int | None = None


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.platform = resolve_platform(config.device.device_type)
        self.device: torch.device | None = None
        self.runner = None
        self.sleep_backend = None  # a SleepModeBackend under enable_sleep_mode
        self.cumem_allocator = None  # enable_cumem_allocator without sleep mode
        self._weight_receiver = None  # a trainer's weight transfer (init_weight_transfer)
        self.tp_group = TensorParallelGroup.single()
        self.pp_stage = PipelineStage.single()
        self.records: list[StageRecord] = []
        self._next_stage = 0
        self._last_stage = "created"
        self._last_step = -1
        self._last_activity = time.monotonic()
        self._shut_down = False

    # ---- lifecycle ------------------------------------------------------------
    def init_device(self) -> None:
        with self._stage("init_device"):
            # What exists before the start (imports; in-process, the caller's objects)
            # leaves the collector's view now, so freeze_gc_heap's collection scans
            # only what the start made: a fifth of a second less on a big heap.
            gc.freeze()
            if self.platform.compiles_kernels_on_first_use:
                from spindle.runner.compile_ahead import hash_triton_in_background

                hash_triton_in_background()  # (overlaps the rest of the start)
            self.device = self.platform.device_for_rank(self.local_rank)
            self.platform.wait_for_device_start(self.device)
            self.platform.set_device(self.device)
            torch.manual_seed(self.config.model.seed)
            self._init_distributed()

    def load_model(self) -> None:
        from spindle.runner.model_runner import ModelRunner

        with self._stage("load_model") as record:
            self.runner = ModelRunner(self.config, self.device, self.platform, self.tp_group,
                                      self.pp_stage)
            self.runner.set_memory_scope(self._create_memory_scope())
            self.runner.load_model()
            params = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
            record.note = f"weights {_human_bytes(params)}"

    def determine_available_memory(self) -> int:
        """Run profile_run, then return the bytes this rank can give the KV cache.
        Where the platform measures the KV budget (a GPU) profile_run is a forward at the
        step's token budget; elsewhere the budget is configured and profile_run is a
        small forward that checks the model and the sampler run."""
        measured = self.platform.kv_cache_from_measured_peak
        with self._stage("profile_run") as record:
            self.platform.reset_peak_memory(self.device)
            self.runner.profile_run(None if measured else SMOKE_FORWARD_TOKENS)
            available, how = self._kv_budget()
            record.note = f"kv budget {_human_bytes(available)}" + (f" ({how})" if how else "")
        return available

    def cache_requirements(self) -> CacheRequirements:
        return self.runner.cache_requirements()

    def allocate_kv_cache(self, config: KVCacheConfig) -> int:
        with self._stage("allocate_kv_cache") as record:
            allocated = self.runner.allocate_kv_cache(config)
            record.note = describe_cache(config, self.runner.cache_layout, allocated)
        return allocated

    def warmup(self) -> None:
        with self._stage("warmup"):
            self.runner.warmup()

    def freeze_gc_heap(self) -> None:
        """Collect once (what was made since init_device froze the rest), then move
        every surviving object out of the collector's view: startup garbage is gone
        and later collections stay short."""
        with self._stage("freeze_gc_heap"):
            gc.collect()
            gc.freeze()

    # ---- serving ----------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._last_step = sched.step_id
        self._last_activity = time.monotonic()
        return self.runner.execute_model(sched)

    def execute_model_async(self, sched: SchedulerOutput):
        """Launch a step; returns a PendingOutput (in-process executors only)."""
        self._last_step = sched.step_id
        self._last_activity = time.monotonic()
        return self.runner.execute_model_async(sched)

    # ---- sleep mode ----------------------------------------------------------------
    def sleep(self, level: int) -> dict[str, Any]:
        """Give the device memory of weights and KV cache back (level 1: weights kept
        on the host; level 2: weights dropped, reloaded on wake). Returns the seconds
        it took and the device memory freed (driver figures)."""
        backend = self._require_sleep_backend()
        with self._timed_under_device_lock("sleep") as report:
            backend.suspend(level)
        return report

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Take the memory of tags back (None: every tag asleep); the KV cache comes
        back zeroed, the weights as they were."""
        backend = self._require_sleep_backend()
        with self._timed_under_device_lock("wake_up") as report:
            backend.resume(tags)
        return report

    def update_weights(self, source) -> dict[str, Any]:
        """Load new weights into the model in place (see ModelRunner.update_weights);
        the weights must be awake. Returns the seconds it took and the tensors loaded."""
        self._require_weights_awake()
        with self._timed_under_device_lock("update_weights") as report:
            report["tensors"] = self.runner.update_weights(source)
        return report

    def init_weight_transfer(self, address: str, num_ranks: int, timeout_s: float) -> None:
        """Join a trainer's WeightSender at address, as rank 1 + this rank of
        1 + num_ranks (spindle/rl/weight_transfer.py)."""
        from spindle.rl.weight_transfer import WeightReceiver

        self._last_stage = "init_weight_transfer"
        self._weight_receiver = WeightReceiver(address, 1 + self.rank, 1 + num_ranks, timeout_s)

    def receive_weights(self) -> dict[str, Any]:
        """Load what the trainer's next send() sends (see ModelRunner.receive_weights).
        A list of tensors that does not fit is refused by every rank before anything
        is loaded: the report then says why ("refused"), for the engine to raise."""
        if self._weight_receiver is None:
            raise RuntimeError(f"worker rank {self.rank}: no weight transfer: call "
                               "init_weight_transfer first")
        from spindle.rl.weight_transfer import WeightsRefused

        self._require_weights_awake()
        with self._timed_under_device_lock("receive_weights", lock=False) as report:
            try:
                report["tensors"] = self.runner.receive_weights(self._weight_receiver)
            except WeightsRefused as e:
                report["refused"] = str(e)
        return report

    def _require_weights_awake(self) -> None:
        from spindle.memory.sleep_backend import WEIGHTS

        if self.sleep_backend is not None and WEIGHTS in self.sleep_backend.asleep:
            raise RuntimeError(f"worker rank {self.rank}: the weights are asleep; "
                               "wake_up(['weights']) before updating them")

    def sleep_state(self) -> dict[str, Any]:
        """The backend's state and the device memory this process uses now: by tag,
        and the rest ("other": CUDA context, graph pool, activation cache, ...)."""
        state = asdict(self._require_sleep_backend().state())
        in_use = self.platform.memory_in_use(self.device)
        state.update(rank=self.rank, device_memory_in_use=in_use,
                     other_device_bytes=max(0, in_use - sum(state["device_bytes"].values())))
        if self.device.type == "cuda":
            state["torch_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        return state

    def _require_sleep_backend(self):
        if self.sleep_backend is None:
            raise RuntimeError("sleep mode is off for this engine: start it with "
                               "enable_sleep_mode=True (--enable-sleep-mode)")
        return self.sleep_backend

    @contextlib.contextmanager
    def _timed_under_device_lock(self, what: str, lock: bool = True
                                 ) -> Iterator[dict[str, Any]]:
        """Time what (and the device memory it changes), holding the device lock that
        orders sleep and wake of the engines sharing a device; lock=False for work
        inside a collective, which the other ranks of this device must join."""
        from spindle.memory.device_lock import device_lock

        report: dict[str, Any] = {"rank": self.rank}
        self._last_stage = what
        self._last_activity = time.monotonic()
        held = (device_lock(self.platform.device_key(self.device)) if lock
                else contextlib.nullcontext(0.0))
        with held as waited:
            before = self.platform.memory_in_use(self.device)
            start = time.perf_counter()
            yield report
            self.platform.synchronize(self.device)
            report["seconds"] = time.perf_counter() - start
            report["lock_wait_seconds"] = waited
            report["memory_change_bytes"] = self.platform.memory_in_use(self.device) - before
        logger.info("worker %d: %s in %.3fs, device memory %+.1f MiB", self.rank, what,
                    report["seconds"], report["memory_change_bytes"] / 2**20)

    def _create_memory_scope(self):
        """The scope the runner allocates weights and KV cache in: the sleep backend's
        pools under sleep mode, the cumem allocator's when only that is on, else none."""
        memory = self.config.memory
        if memory.enable_sleep_mode:
            from spindle.memory.sleep_backend import get_backend_class

            backend_class = get_backend_class(memory.sleep_mode_backend)
            self.sleep_backend = backend_class(self.runner, self.platform)
            return self.sleep_backend.allocating
        if memory.enable_cumem_allocator:
            from spindle.memory.cumem import CuMemAllocator

            self.cumem_allocator = CuMemAllocator(self.device)
            return self.cumem_allocator.use_pool
        return None

    def lifecycle_report(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(rank=self.rank, last_stage=self._last_stage, last_step=self._last_step,
                         seconds_since=time.monotonic() - self._last_activity)

    def check_health(self) -> bool:
        """True while the worker can serve; raises once it has been shut down (say by a
        collective_rpc("shutdown")), so that health checks see a dead engine at once."""
        if self._shut_down:
            raise RuntimeError(f"worker rank {self.rank} has been shut down")
        return True

    def shutdown(self) -> None:
        self._shut_down = True
        if self._weight_receiver is not None:
            self._weight_receiver.close()
            self._weight_receiver = None
        if self.runner is not None:
            self.runner.release()
        self.runner = None
        # freeze_gc_heap hid startup's objects from the collector: cycles among them
        # would never be freed. Let it see them again. The model's tensors are in none
        # (release() took the weight loaders off), so on the CPU the collector may find
        # the rest in its own time: a full collection here scans the caller's whole heap
        # (0.2-0.3 s on a process that imported transformers, at every LLM exit). A device's
        # memory, and the tagged pools, which go after every tensor allocated from them,
        # are given back now.
        gc.unfreeze()
        memory_pools = (self.sleep_backend, self.cumem_allocator)
        if self.platform.device_type != "cpu" or any(m is not None for m in memory_pools):
            gc.collect()
        for memory in memory_pools:
            if memory is not None:
                memory.close()
        self.sleep_backend = self.cumem_allocator = None
        if self.device is not None:
            self.platform.empty_cache()  # give the device memory back now, not at exit
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # ---- helpers ------------------------------------------------------------------
    def _init_distributed(self) -> None:
        world_size = self.config.parallel.world_size
        if world_size == 1:
            return
        torch.distributed.init_process_group(
            backend=self.platform.dist_backend, init_method=self.distributed_init_method,
            world_size=world_size, rank=self.rank)
        parallel = self.config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        group, self.pp_stage = build_parallel_groups(
            self.rank, tp, pp, self.platform.dist_backend,
            parallel.pipeline_layer_partition,
            getattr(self.config.model.hf_config, "num_hidden_layers", None))
        self.tp_group = TensorParallelGroup(rank=self.rank % tp, size=tp, group=group)

    def _kv_budget(self) -> tuple[int, str]:
        """This rank's KV cache bytes, and how they were chosen (for the startup table)."""
        cache, reserved = self.config.cache, self.config.memory.reserved_bytes
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        if self.platform.kv_cache_from_measured_peak:
            budget, how = self._measured_kv_budget(), ""
        else:
            budget, how = self._configured_kv_budget()
        if not reserved:
            return budget, how
        set_aside = f"after {_human_bytes(reserved)} set aside by mm_ipc_gpu_memory_gb"
        return max(0, budget - reserved), f"{how}; {set_aside}" if how else set_aside

    def _configured_kv_budget(self) -> tuple[int, str]:
        config = self.config
        sharing = config.parallel.world_size if self.platform.workers_share_device else 1
        free, _ = self.platform.mem_get_info(self.device)
        return cpu_kv_cache_budget(
            space_bytes=config.cache.cpu_kv_cache_bytes,
            useful_bytes=self.cache_requirements_bytes(config.scheduler.max_num_seqs),
            available_bytes=free, workers=sharing)

    def cache_requirements_bytes(self, num_seqs: int) -> int:
        """Bytes num_seqs sequences of max_model_len tokens use at most, with the state
        slots the prefix cache may keep as snapshots beside them (a model with state
        layers and nothing paged would otherwise get no room for any)."""
        req = self.cache_requirements()
        blocks = req.blocks_per_sequence(self.config.model.max_model_len,
                                         self.config.cache.block_size,
                                         self.config.scheduler.max_num_batched_tokens)
        snapshots = self._most_state_snapshots(num_seqs) if req.has_state else 0
        return num_seqs * (blocks * req.block_bytes + req.slot_bytes) + snapshots * req.slot_bytes

    def _most_state_snapshots(self, num_seqs: int) -> int:
        """The most snapshot slots the engine takes: state_snapshot_slots, by default at
        most one per sequence (EngineCore._state_snapshots)."""
        cache = self.config.cache
        if not cache.enable_prefix_caching:
            return 0
        return cache.state_snapshot_slots if cache.state_snapshot_slots is not None else num_seqs

    def _measured_kv_budget(self) -> int:
        """GPU: what the utilisation target leaves after the measured peak (weights +
        activations + sampler), memory outside torch, and the CUDA graphs to come."""
        cache = self.config.cache
        free, total = self.platform.mem_get_info(self.device)
        peak = self.platform.peak_memory(self.device) or 0
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        graphs = (0 if self.config.device.enforce_eager
                  else CUDA_GRAPH_MEMORY_ESTIMATE + self.runner.graph_logits_bytes())
        return max(0, int(total * cache.gpu_memory_utilization) - peak - non_torch - graphs)

    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[StageRecord]:
        expected = LIFECYCLE[self._next_stage] if self._next_stage < len(LIFECYCLE) else None
        if name != expected:
            raise RuntimeError(f"worker {self.rank}: lifecycle stage {name!r} called out of order "
                               f"(expected {expected!r}; order is {' -> '.join(LIFECYCLE)})")
        self._last_stage = name
        self._last_activity = time.monotonic()
        device = self.device or self.platform.device_for_rank(self.local_rank)
        # (The clock starts first: on CUDA the first memory reading of a process makes
        # the context, which belongs to init_device's time.)
        start = time.perf_counter()
        before = self.platform.memory_in_use(device)
        record = StageRecord(stage=name, seconds=0.0, bytes=0)
        yield record
        self.platform.synchronize(device)
        record.seconds = time.perf_counter() - start
        record.bytes = self.platform.memory_in_use(device) - before
        self.records.append(record)
        self._next_stage += 1
        logger.debug("worker %d: %s took %.3fs", self.rank, name, record.seconds)


def cpu_kv_cache_budget(space_bytes: int, useful_bytes: int, available_bytes: int,
                        workers: int) -> tuple[int, str]:
    """One worker's KV cache bytes on a host whose RAM its workers share: its part of
    the configured space (cpu_kv_cache_gb), at most what max_num_seqs full sequences
    can use, and at most its part of half the available RAM. Only the last depends on
    the machine's state, and only when RAM is short; the note says which bound held."""
    share = space_bytes // workers
    ram_cap = max(0, available_bytes) // 2 // workers
    flag = f"cpu_kv_cache_gb={space_bytes / 2**30:g} (--cpu-kv-cache-gb)"
    if useful_bytes <= min(share, ram_cap):
        return useful_bytes, f"capped at max_num_seqs x max_model_len; {flag}"
    if ram_cap < share:
        return ram_cap, f"capped at half of available RAM; {flag}"
    return share, flag


def describe_cache(config: KVCacheConfig, layout: CacheLayout, allocated: int) -> str:
    """The allocate_kv_cache row's note: sizes, then the groups."""
    parts = [f"{config.num_blocks} blocks"]
    if config.num_state_slots:
        parts.append(f"{config.num_state_slots} state slots")
    return f"{', '.join(parts)}, {_human_bytes(allocated)}; groups: {layout.describe()}"


def _human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


