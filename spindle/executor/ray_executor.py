"""RayExecutor: one Ray actor per worker, placed with a placement group; for more
than one machine (pipeline stages across nodes).

- Ray: the cluster of ray_address (or RAY_ADDRESS), the one this process already
  joined, or else a local instance started for this engine (and stopped with it).
- Placement: one bundle per worker (1 CPU, plus 1 GPU on CUDA), strategy from
  ray_placement_strategy (PACK by default). Ranks are ordered so that each node's
  workers are contiguous (this process's node first); a TP group that would
  straddle nodes is refused. On CUDA every actor sees its node's GPUs of the engine
  (CUDA_VISIBLE_DEVICES) and drives the one Ray gave it (its local rank).
- Calls: every actor gets the call (an actor runs its calls in order); replies are
  awaited with ray.wait, so the first dead actor is seen at once, not after its peers.
- Failure (a dead actor, a fatal step error, a step that times out) is final
  (Executor._fail): pending and later calls raise ExecutorFailedError naming the
  rank, node and pid; failure callbacks run once; actors are killed and the
  placement group is removed.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from spindle.executor.abstract import Executor
from spindle.executor.config_snapshot import config_for_workers
from spindle.executor.errors import ExecutorFailedError
from spindle.executor.multiproc import worker_threads
from spindle.executor.multiproc_worker import FATAL_METHODS
from spindle.executor.ray_worker import RayWorkerActor
from spindle.platforms import resolve_platform

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1200.0
PLACEMENT_TIMEOUT_S = 120.0
SHUTDOWN_GRACE_S = 5.0
# After a rank's step fails, how long to look for a dead peer (the likelier cause).
DEATH_PROBE_S = 2.0
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # steps are small messages


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed_executor_backend='ray' needs Ray: "
                          "pip install 'spindle-llm[ray]' (or pip install 'ray>=2.40')") from e
    return ray


class RayExecutor(Executor):
    # Off until steps overlapping through the actors' call queues are checked here.
    supports_async_scheduling = False
    supports_pipeline_parallel = True

    # ---- startup ------------------------------------------------------------------------
    def _init_executor(self) -> None:
        ray = self._ray = import_ray()
        self.platform = resolve_platform(self.config.device.device_type)
        self._release_lock = threading.Lock()  # actors and placement group, against _release
        self._send_lock = threading.Lock()
        self._released = threading.Event()
        self._call_ids = itertools.count(1)
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spindle-ray-rpc")
        self.actors: list[Any] = []
        self.placement_group = None
        self.nodes: list[dict[str, Any]] = []  # per rank: node_id, ip, gpu_ids, pid
        self.owns_ray = False
        try:
            self._connect()
            self._place_actors()
            self._run_on_all("init_device", "load_model", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self._closing = True
            self._release()
            if self.owns_ray and ray.is_initialized():
                ray.shutdown()
            raise

    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        address = self.config.parallel.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
            return
        # Nothing to join: a private local instance, on loopback, stopped at shutdown.
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=max(self.world_size, os.cpu_count() or 1),
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False)
        self.owns_ray = True

    def _bundle(self) -> dict[str, float]:
        if self.platform.device_type == "cuda":
            return {"CPU": 1.0, "GPU": 1.0}
        return {"CPU": 1.0}

    def _place_actors(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        strategy = self.config.parallel.ray_placement_strategy
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world_size)],
                                               strategy=strategy, name=f"spindle-{os.getpid()}-{id(self)}")
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ExecutorFailedError(
                f"Ray could not place {self.world_size} workers ({bundle} each, strategy "
                f"{strategy}) within {PLACEMENT_TIMEOUT_S:.0f}s; cluster resources: "
                f"{ray.available_resources()}") from None
        actor_class = ray.remote(RayWorkerActor)
        config = config_for_workers(self.config)
        threads = worker_threads(self.world_size, self.config.device.cpu_threads)
        actors = []
        for index in range(self.world_size):
            strategy_obj = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=index,
                placement_group_capture_child_tasks=True)
            actors.append(actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=strategy_obj, max_restarts=0).remote(config, threads))
        infos = ray.get([a.node_info.remote() for a in actors], timeout=STARTUP_TIMEOUT_S)
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        for info in infos:
            info["ip"] = addresses[info["node_id"]]  # the address the node joined Ray with
        order = rank_order(infos, ray.get_runtime_context().get_node_id())
        self.actors = [actors[i] for i in order]
        self.nodes = [infos[i] for i in order]
        check_tp_groups_within_nodes([n["node_id"] for n in self.nodes],
                                     self.config.parallel.tensor_parallel_size)
        init_method = None
        if self.world_size > 1:
            port = ray.get(self.actors[0].free_port.remote(self.nodes[0]["ip"]), timeout=60)
            init_method = f"tcp://{self.nodes[0]['ip']}:{port}"
        setups = []
        for rank, (actor, env, local_rank) in enumerate(zip(self.actors, *self._device_plan())):
            setups.append(actor.setup.remote(rank, local_rank, init_method, env,
                                             self.nodes[rank]["ip"]))
        ray.get(setups, timeout=STARTUP_TIMEOUT_S)
        logger.info("placed %d Ray actors: %s", self.world_size,
                    ", ".join(f"rank {r} on {n['ip']} (pid {n['pid']})"
                              for r, n in enumerate(self.nodes)))

    def _device_plan(self) -> tuple[list[dict[str, str]], list[int]]:
        """Per rank: environment to set, local rank (device index after that env)."""
        if self.platform.device_type != "cuda":
            return [{} for _ in self.nodes], [0] * len(self.nodes)
        by_node: dict[str, list[str]] = {}
        for n in self.nodes:
            by_node.setdefault(n["node_id"], []).extend(n["gpu_ids"])
        envs, local_ranks = [], []
        for n in self.nodes:
            visible = sorted(set(by_node[n["node_id"]]), key=lambda g: int(g) if g.isdigit() else g)
            if len(n["gpu_ids"]) != 1:
                raise ExecutorFailedError(f"a Ray actor got GPUs {n['gpu_ids']}; expected one")
            envs.append({"CUDA_VISIBLE_DEVICES": ",".join(visible)})
            local_ranks.append(visible.index(n["gpu_ids"][0]))
        return envs, local_ranks

    def _run_on_all(self, *methods: str, timeout: float) -> None:
        for method in methods:
            self.collective_rpc(method, timeout=timeout)

    # ---- calls ----------------------------------------------------------------------------
    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, non_block: bool = False) -> Any:
        payload, name = self._prepare_call(method, unique_reply_rank)
        with self._send_lock:  # every actor receives calls in the same order
            self._raise_if_unusable()
            refs = [a.execute_method.remote(payload, tuple(args), kwargs or {})
                    for a in self.actors]
        deadline = None if timeout is None else time.monotonic() + timeout

        def wait() -> Any:
            replies = self._wait(refs, name, deadline, timeout)
            return replies if unique_reply_rank is None else replies[unique_reply_rank]

        if non_block:  # one waiter thread: futures resolve in call order
            return self._waiter.submit(wait)
        return wait()

    def _wait(self, refs: list, name: str, deadline: float | None,
              timeout: float | None) -> list[Any]:
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        replies: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            self._raise_if_unusable()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # Short waits: a failure seen by another thread (or a shutdown) ends this one too.
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=1.0 if left is None else min(1.0, left))
            for ref in ready:
                rank = rank_of[ref]
                kind, value = self._get_one(ref, rank, name)
                if kind == "ok":
                    replies[rank] = value
                    continue
                if kind == "fatal":  # a broken collective: a dead peer is the likelier cause
                    value = self._death_among(pending, rank_of, name) or value
                if kind in ("fatal", "death"):
                    self._fail(value)
                    raise self._unusable_error() from None  # the first failure
                raise value
            if not ready and left is not None and left <= 0:
                missing = sorted(rank_of[r] for r in pending)
                raise TimeoutError(f"collective_rpc({name!r}): rank(s) {missing} did not answer "
                                   f"within {timeout}s ({self._where(missing)})")
        return [replies[r] for r in range(len(refs))]

    def _get_one(self, ref: Any, rank: int, name: str) -> tuple[str, Any]:
        """("ok", reply) | ("death" | "fatal", ExecutorFailedError) | ("error", RuntimeError)."""
        ray = self._ray
        try:
            return "ok", ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return "death", self._death_error(rank, name, e)
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
            if name in FATAL_METHODS:
                return "fatal", ExecutorFailedError(
                    f"worker rank {rank} ({self._where([rank])}): {name} failed: {cause}",
                    rank=rank)
            return "error", RuntimeError(f"worker rank {rank}: {name} raised {cause}")

    def _death_among(self, pending: list, rank_of: dict, name: str) -> ExecutorFailedError | None:
        """The death of a rank still pending in this call, if one shows within
        DEATH_PROBE_S (before any actor is killed, so a death here is real)."""
        ray = self._ray
        if not pending:
            return None
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_PROBE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return self._death_error(rank_of[ref], name, e)
            except Exception:  # that rank's own error, not a death: keep looking
                continue
        return None

    def _death_error(self, rank: int, name: str, e: BaseException) -> ExecutorFailedError:
        return ExecutorFailedError(f"Ray actor of worker rank {rank} ({self._where([rank])}) "
                                   f"died during {name}: {_first_line(e)}", rank=rank)

    def _where(self, ranks: list[int]) -> str:
        return "; ".join(f"rank {r} on node {self.nodes[r]['ip']} pid {self.nodes[r]['pid']}"
                         for r in ranks if r < len(self.nodes)) or f"ranks {ranks}"

    # ---- failure and shutdown ---------------------------------------------------------------
    def _stop_workers(self) -> None:
        # Peers of a dead actor may sit in a collective forever: kill them all now.
        self._release()

    def _shutdown_workers(self, clean: bool) -> None:
        """Ask the actors to shut their workers down (when clean), kill them, remove
        the placement group, stop a Ray instance this executor started."""
        if clean and self.actors:
            try:
                refs = [a.execute_method.remote("shutdown", (), {}) for a in self.actors]
                self._ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_GRACE_S)
            except Exception:  # killing them below is enough
                logger.warning("asking the Ray actors to shut down failed; killing them",
                               exc_info=True)
        self._release()
        self._waiter.shutdown(wait=False, cancel_futures=True)
        if self.owns_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def _release(self) -> None:
        """Kill every actor and remove the placement group (idempotent, any thread)."""
        with self._release_lock:
            actors, self.actors = self.actors, []
            group, self.placement_group = self.placement_group, None
        for actor in actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # gone already, or Ray is shutting down
                logger.warning("killing a Ray actor failed", exc_info=True)
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)
            except Exception:
                logger.exception("removing the placement group failed")
        self._released.set()


def rank_order(infos: list[dict[str, Any]], driver_node_id: str | None) -> list[int]:
    """Actor indices in rank order: the driver's node first, then the other nodes in
    order of first appearance; each node's actors contiguous (by GPU id, then index)."""
    node_order: dict[str, int] = {}
    if driver_node_id is not None and any(i["node_id"] == driver_node_id for i in infos):
        node_order[driver_node_id] = 0
    for info in infos:
        node_order.setdefault(info["node_id"], len(node_order))

    def key(index: int) -> tuple:
        info = infos[index]
        gpus = [int(g) for g in info["gpu_ids"] if str(g).isdigit()]
        return (node_order[info["node_id"]], gpus[0] if gpus else -1, index)

    return sorted(range(len(infos)), key=key)


def check_tp_groups_within_nodes(node_of_rank: list[str], tp: int) -> None:
    """Raise ValueError if a tensor-parallel group (tp consecutive ranks) spans nodes."""
    for start in range(0, len(node_of_rank), tp):
        nodes = set(node_of_rank[start:start + tp])
        if len(nodes) > 1:
            raise ValueError(f"tensor-parallel group of ranks {start}..{start + tp - 1} would span "
                             f"{len(nodes)} nodes; give each node a multiple of "
                             f"tensor_parallel_size={tp} workers (e.g. ray_placement_strategy="
                             "'PACK' and nodes with enough devices)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
