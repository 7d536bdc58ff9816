"""Weights from a trainer process to an engine's workers over torch.distributed.

The trainer makes a WeightSender: it opens a TCP store on a free port of its host and
says where (sender.address). The engine's workers join it (LLM.init_weight_transfer),
each as rank 1 + its own rank, in a group of their own: the default process group,
which tensor parallelism uses, is not touched. The group is gloo, or NCCL when the
sender asks for it (backend="nccl"; it writes its choice into the store, where the
workers read it before joining). Then each send() of the trainer meets one
receive_weights() of the engine:

  1. the sender broadcasts the list of (name, shape, dtype) it is about to send;
  2. every worker checks it against its checkpoint's layout, and all ranks agree
     (an all-reduce of "ok"): if any refuses, no tensor is sent, the engine raises
     the ValueError naming the tensors, and the sender a RuntimeError;
  3. the tensors follow in batches of about batch_bytes, one broadcast each, and the
     workers load each batch as it arrives (each takes its shard).

gloo moves host memory: on a GPU the workers copy each batch to the device as they
load it. NCCL moves device memory: the trainer's GPU broadcasts straight into buffers
on the workers' GPUs (every rank on a GPU of its own). A trainer on the same GPU (or
one its peers can map) sends with cuda_ipc=True instead: step 3 then broadcasts CUDA
IPC handles of the trainer's own tensors, no tensor bytes; each worker opens them (no
copy), loads its shard straight from the trainer's memory, and all ranks report back
before send() returns, so the trainer may change its tensors again afterwards.
"""

from __future__ import annotations

import datetime
import math
import pickle
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

_PREFIX = "spindle-weight-transfer"
_BACKEND_KEY = "spindle-weight-transfer-backend"
BACKENDS = ("gloo", "nccl")
_BATCH_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 300.0

Entry = tuple[str, tuple[int, ...], str]  # name, shape, dtype name


class WeightsRefused(ValueError):
    """The engine's ranks refused a send() (names or shapes that do not fit): nothing
    was sent, nothing was loaded."""


class WeightSender:
    """The trainer's end of a weight transfer to num_engine_ranks engine workers
    (tensor_parallel_size x pipeline_parallel_size of the engine)."""

    def __init__(self, num_engine_ranks: int, host: str = "127.0.0.1",
                 timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo") -> None:
        if num_engine_ranks < 1:
            raise ValueError(f"num_engine_ranks must be >= 1, got {num_engine_ranks}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs a CUDA device in the trainer's process")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=self.timeout)
        self._store.set(_BACKEND_KEY, backend)
        self.address = f"{host}:{self._store.port}"
        self.size = 1 + num_engine_ranks
        self.backend = backend
        self._channel: _Channel | None = None

    def connect(self) -> None:
        """Wait until every engine rank joined (LLM.init_weight_transfer(address))."""
        self._channel = _Channel(self._store, self.backend, 0, self.size, self.timeout)

    def send(self, weights: Any, batch_bytes: int = _BATCH_BYTES,
             cuda_ipc: bool = False) -> None:
        """Send a state_dict or (name, tensor) pairs (HF naming) to the engine, which
        receives them in LLM.receive_weights(). Raises RuntimeError if the engine
        refused them (the engine's error names the tensors); nothing was loaded then.

        cuda_ipc: the tensors are CUDA tensors the engine's GPUs can map (the same
        GPU, or a peer): pass handles to them instead of their bytes."""
        channel = self._channel
        if channel is None:
            raise RuntimeError("WeightSender.send before connect()")
        pairs = list(weights.items() if isinstance(weights, dict) else weights)
        if cuda_ipc:
            not_cuda = [name for name, t in pairs if not t.is_cuda]
            if not_cuda:
                raise ValueError(f"cuda_ipc=True needs CUDA tensors; {len(not_cuda)} are "
                                 f"not, e.g. {not_cuda[0]!r}")
            tensors = [t.detach() for _, t in pairs]
        else:
            tensors = [t.detach().to(channel.device).contiguous() for _, t in pairs]
        entries = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                   for (name, _), t in zip(pairs, tensors)]
        channel.broadcast_object((entries, batch_bytes, cuda_ipc))
        if not channel.all_agree(True):
            raise RuntimeError("the engine refused these weights (its error names the "
                               "tensors at fault); nothing was sent")
        if cuda_ipc:
            torch.cuda.synchronize()  # the tensors are final before anyone reads them
            uuids = {d: str(torch.cuda.get_device_properties(d).uuid)
                     for d in {t.device for t in tensors}}
            channel.broadcast_object([_share(t, uuids[t.device]) for t in tensors])
            loaded = channel.all_agree(True)  # every rank is done reading them
            torch.cuda.ipc_collect()
            if not loaded:
                raise RuntimeError("an engine rank failed to load the shared tensors (its "
                                   "error says why); the engine may hold a partial update")
            return
        for batch in _batches(entries, batch_bytes):
            buffer = torch.cat([tensors[i].view(-1).view(torch.uint8) for i in batch])
            channel.broadcast(buffer)

    def close(self) -> None:
        """Leave the transfer (before the process exits: a group left to the
        interpreter's teardown can abort it)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._store = None


class WeightReceiver:
    """A worker's end: joined at init_weight_transfer, used by each receive."""

    def __init__(self, address: str, rank: int, size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a weight transfer address is HOST:PORT, got {address!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        backend = store.get(_BACKEND_KEY).decode()
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("the trainer sends over NCCL, which needs the engine on CUDA; "
                             "make the WeightSender with backend='gloo'")
        self._channel = _Channel(store, backend, rank, size, timeout)

    def receive(self, check: Callable[[list[tuple[str, tuple[int, ...], bool]]], None],
                load: Callable[[Iterator[tuple[str, torch.Tensor]]], Any]) -> int:
        """Take one send(): check(entries) may raise ValueError to refuse it (every rank
        then raises WeightsRefused); else load(tensors) consumes them as they arrive.
        Returns the number of tensors."""
        channel = self._channel
        entries, batch_bytes, cuda_ipc = channel.broadcast_object(None)
        refusal = None
        try:
            check([(name, shape, getattr(torch, dtype).is_floating_point)
                   for name, shape, dtype in entries])
        except ValueError as e:
            refusal = str(e)
        if not channel.all_agree(refusal is None):
            raise WeightsRefused(refusal or "update_weights: another engine rank refused the "
                                 "weights (its error names them); nothing was changed")
        if not cuda_ipc:
            load(self._tensors(entries, batch_bytes))
            return len(entries)
        handles = channel.broadcast_object(None)
        try:
            local = {str(torch.cuda.get_device_properties(i).uuid): i
                     for i in range(torch.cuda.device_count())}
            load((name, _open_shared(handle, local))
                 for (name, _, _), handle in zip(entries, handles))
            torch.cuda.synchronize()  # done reading the trainer's memory
        except BaseException:
            channel.all_agree(False)
            raise
        channel.all_agree(True)
        return len(entries)

    def close(self) -> None:
        self._channel.close()

    def _tensors(self, entries: list[Entry], batch_bytes: int
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for batch in _batches(entries, batch_bytes):
            sizes = [_nbytes(entries[i]) for i in batch]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self._channel.device)
            self._channel.broadcast(buffer)
            for i, piece in zip(batch, buffer.split(sizes)):
                name, shape, dtype = entries[i]
                yield name, piece.view(getattr(torch, dtype)).view(shape)


def _share(tensor: torch.Tensor, uuid: str) -> tuple:
    """What another process needs to map tensor: torch's CUDA IPC reduction, and the
    UUID of the tensor's GPU (device indices differ between processes that see
    different CUDA_VISIBLE_DEVICES)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    return rebuild, args, uuid


def _open_shared(handle: tuple, local: dict[str, int]) -> torch.Tensor:
    """The sender's tensor, mapped into this process on the GPU with its UUID (local:
    this process's device index by GPU UUID)."""
    rebuild, args, uuid = handle
    if uuid not in local:
        raise RuntimeError(f"cuda_ipc: the trainer's GPU ({uuid}) is not visible to this "
                           "engine worker; send without cuda_ipc")
    args = list(args)
    args[_STORAGE_DEVICE_ARG] = local[uuid]
    return rebuild(*args)


# Where rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions) name the device.
_STORAGE_DEVICE_ARG = 6


class _Channel:
    """One process's end of the transfer group: broadcasts from rank 0 and a vote,
    over gloo (host tensors) or NCCL (tensors on this process's current GPU)."""

    def __init__(self, store: Any, backend: str, rank: int, size: int,
                 timeout: datetime.timedelta) -> None:
        prefixed = dist.PrefixStore(_PREFIX, store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
            self.device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def broadcast_object(self, value: Any) -> Any:
        """value from rank 0 to every rank (others pass None)."""
        if value is not None:
            payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
            payload = payload.to(self.device)
        length = torch.tensor([payload.numel() if value is not None else 0],
                              dtype=torch.int64, device=self.device)
        self.broadcast(length)
        if value is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload)
        return value if value is not None else pickle.loads(payload.cpu().numpy().tobytes())

    def all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([flag], options).wait()
        return bool(flag.item())

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)  # NCCL: free its communicator
        if self.device.type == "cuda" and shutdown is not None:
            shutdown()
        self.group = None


def _nbytes(entry: Entry) -> int:
    _, shape, dtype = entry
    return math.prod(shape) * getattr(torch, dtype).itemsize


def _batches(entries: list[Entry], batch_bytes: int) -> Iterable[list[int]]:
    """Consecutive entries, about batch_bytes a batch (a bigger tensor alone)."""
    batch: list[int] = []
    size = 0
    for i, entry in enumerate(entries):
        n = _nbytes(entry)
        if batch and size + n > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += n
    if batch:
        yield batch
