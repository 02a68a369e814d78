"""Groups: the ranks that exchange tokens, and how they found each other."""

import ctypes
import os
import weakref

from . import _capi
from .errors import EpxError, Status, check, invalid_argument, note_callback_failure

_BACKENDS = {"auto": _capi.BACKEND_AUTO, "host": _capi.BACKEND_HOST, "cpu": _capi.BACKEND_HOST,
             "cuda": _capi.BACKEND_CUDA, "gpu": _capi.BACKEND_CUDA}


def _backend_value(backend):
    if isinstance(backend, int):
        return backend
    try:
        return _BACKENDS[str(backend).lower()]
    except KeyError:
        raise invalid_argument("backend %r is not one of auto, host, cuda" % (backend,))


def get_unique_id():
    """A rendezvous id (text) for Group.create: make it on rank 0, give it to every rank."""
    api = _capi.api()
    uid = _capi.UniqueId()
    check(api.epx_get_unique_id(ctypes.byref(uid)), "get_unique_id")
    text = ctypes.create_string_buffer(2 * _capi.UNIQUE_ID_BYTES + 64)
    check(api.epx_unique_id_to_string(ctypes.byref(uid), text, len(text)), "unique_id_to_string")
    return text.value.decode()


class _Callbacks:
    """epx_bootstrap_callbacks_t over Python functions, kept alive with the group.

    allgather(data: bytes) -> bytes of world_size * len(data), rank i's part at i * len(data).
    barrier() -> None (optional). A Python exception becomes a nonzero return (the C library
    then fails with EPX_ERR_BOOTSTRAP) and is named in, and chained to, the EpxError of
    whichever call it failed (errors.check): the group's creation, a barrier, a buffer's
    creation or destroy vote.
    """

    def __init__(self, allgather, barrier, world_size):
        self.allgather = allgather
        self.barrier = barrier
        self.world_size = world_size
        self.c_allgather = _capi.AllgatherFn(self._allgather)
        self.c_barrier = _capi.BarrierFn(self._barrier) if barrier is not None else \
            ctypes.cast(None, _capi.BarrierFn)
        self.struct = _capi.BootstrapCallbacks(self.c_allgather, self.c_barrier, None)

    def _allgather(self, ctx, send, recv, nbytes):
        try:
            data = ctypes.string_at(send, nbytes) if nbytes else b""
            gathered = bytes(self.allgather(data))
            if len(gathered) != nbytes * self.world_size:
                raise RuntimeError("allgather callback returned %d bytes, expected %d x %d"
                                   % (len(gathered), self.world_size, nbytes))
            ctypes.memmove(recv, gathered, len(gathered))
            return 0
        except BaseException as error:  # nothing may unwind through C
            note_callback_failure(error)
            return 1

    def _barrier(self, ctx):
        try:
            self.barrier()
            return 0
        except BaseException as error:
            note_callback_failure(error)
            return 1


class Group:
    """The ranks of one expert-parallel group (epx_group_t).

    Make one with Group.from_env() (under `epx launch`), Group.from_process_group(pg)
    (torch.distributed), Group.create(rank, world_size, unique_id) or
    Group.from_callbacks(rank, world_size, allgather). Creation is collective.
    """

    def __init__(self, _pointer, _callbacks=None, _process_group=None):
        self._ptr = _pointer
        self._callbacks = _callbacks  # the C library keeps calling them: keep them alive
        self.process_group = _process_group
        self._buffers = weakref.WeakSet()
        info = _capi.new(_capi.GroupInfo)
        check(_capi.api().epx_group_get_info(self._ptr, ctypes.byref(info)), "group_get_info")
        self.rank = info.rank
        self.world_size = info.world_size
        self.local_rank = info.local_rank
        self.ranks_per_node = info.ranks_per_node
        self.backend = _capi.BACKEND_NAMES.get(info.backend, str(info.backend))
        self.device = info.device

    # ------------------------------------------------------------ constructors

    @classmethod
    def from_env(cls, backend="auto"):
        """From EPX_RANK, EPX_WORLD_SIZE, EPX_UNIQUE_ID (set by `epx launch`); a process
        started without a launcher becomes a group of one."""
        pointer = _capi.epx_group_p()
        check(_capi.api().epx_group_create_from_env(_backend_value(backend),
                                                    ctypes.byref(pointer)), "group_create_from_env")
        return cls(pointer)

    @classmethod
    def create(cls, rank, world_size, unique_id=None, backend="auto", device=-1,
               ranks_per_node=0, timeout_ms=0):
        """Rendezvous through a unique id (text from get_unique_id() on one rank)."""
        config = cls._config(rank, world_size, backend, device, ranks_per_node, timeout_ms)
        uid = None
        if unique_id is not None:
            uid = _capi.UniqueId()
            check(_capi.api().epx_unique_id_from_string(str(unique_id).encode(),
                                                        ctypes.byref(uid)), "unique_id")
            config.unique_id = ctypes.pointer(uid)
        pointer = _capi.epx_group_p()
        check(_capi.api().epx_group_create(ctypes.byref(config), ctypes.byref(pointer)),
              "group_create")
        return cls(pointer)

    @classmethod
    def from_callbacks(cls, rank, world_size, allgather, barrier=None, backend="auto",
                       device=-1, ranks_per_node=0, timeout_ms=0, _process_group=None):
        """Rendezvous through the caller's collectives.

        allgather(data: bytes) -> bytes: every rank passes the same number of bytes and
        gets world_size times as many, rank i's at offset i * len(data).
        barrier() (optional; an allgather of one byte stands in when None).
        """
        if not callable(allgather) or (barrier is not None and not callable(barrier)):
            raise invalid_argument("from_callbacks: allgather (and barrier, if given) must be "
                                   "callable")
        callbacks = _Callbacks(allgather, barrier, int(world_size))
        config = cls._config(rank, world_size, backend, device, ranks_per_node, timeout_ms)
        config.callbacks = ctypes.pointer(callbacks.struct)
        pointer = _capi.epx_group_p()
        check(_capi.api().epx_group_create(ctypes.byref(config), ctypes.byref(pointer)),
              "group_create")
        return cls(pointer, callbacks, _process_group)

    @classmethod
    def from_process_group(cls, process_group=None, backend="auto", device=None, timeout_ms=0):
        """Over a torch.distributed process group (None = the default group).

        Its all_gather_into_tensor is the bootstrap: byte tensors on the CPU for gloo, on
        the current CUDA device for nccl. `device` is the CUDA device epx uses (default:
        torch.cuda.current_device() when CUDA is available, else chosen by local rank).
        """
        import torch
        import torch.distributed as dist

        pg = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(pg)
        world_size = dist.get_world_size(pg)
        pg_backend = str(dist.get_backend(pg)).lower()
        if "nccl" in pg_backend:
            tensor_device = torch.device("cuda", torch.cuda.current_device())
        else:
            tensor_device = torch.device("cpu")

        def allgather(data):
            send = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(tensor_device) \
                if data else torch.empty(0, dtype=torch.uint8, device=tensor_device)
            recv = torch.empty(len(data) * world_size, dtype=torch.uint8, device=tensor_device)
            dist.all_gather_into_tensor(recv, send, group=pg)
            return recv.cpu().numpy().tobytes()

        def barrier():
            dist.barrier(group=pg)

        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else -1
        return cls.from_callbacks(rank, world_size, allgather, barrier, backend=backend,
                                  device=device, timeout_ms=timeout_ms, _process_group=pg)

    @staticmethod
    def _config(rank, world_size, backend, device, ranks_per_node, timeout_ms):
        config = _capi.new(_capi.GroupConfig)
        config.rank = int(rank)
        config.world_size = int(world_size)
        config.backend = _backend_value(backend)
        config.device = int(device)
        config.ranks_per_node = int(ranks_per_node)
        config.timeout_ms = int(timeout_ms)
        return config

    # ------------------------------------------------------------ use

    @property
    def pointer(self):
        if self._ptr is None:
            raise EpxError(Status.ERR_INVALID_STATE, "group: used after destroy()")
        return self._ptr

    def size(self):
        """torch.distributed.ProcessGroup-style alias of world_size."""
        return self.world_size

    def barrier(self):
        """Collective barrier with the group's timeout."""
        check(_capi.api().epx_group_barrier(self.pointer), "group_barrier")

    def allgather(self, data):
        """Collective allgather of small control data over the group's rendezvous.

        data: bytes, the same length (> 0) on every rank. Returns a list of world_size
        bytes objects, rank i's contribution at index i (epx_group_allgather).
        """
        data = bytes(data)
        send = ctypes.create_string_buffer(data, max(len(data), 1))
        recv = ctypes.create_string_buffer(max(len(data), 1) * self.world_size)
        check(_capi.api().epx_group_allgather(self.pointer, send, recv, len(data)),
              "group_allgather")
        return [recv.raw[i * len(data):(i + 1) * len(data)] for i in range(self.world_size)]

    def destroy(self):
        """Destroy the group (and any buffer still using it). Idempotent."""
        if self._ptr is None:
            return
        for buffer in list(self._buffers):
            buffer.destroy()
        check(_capi.api().epx_group_destroy(self._ptr), "group_destroy")
        self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass

    def __repr__(self):
        return "epx.Group(rank=%d, world_size=%d, backend=%s, device=%d)" % (
            self.rank, self.world_size, self.backend, self.device)


def launched():
    """True when this process was started by `epx launch` (or another launcher)."""
    return int(os.environ.get("EPX_WORLD_SIZE", "0") or 0) > 0
