"""epx: expert-parallel dispatch/combine for MoE layers, from Python.

A pure-Python package over libepx.so (ctypes); tensors go in and out through DLPack, so
NumPy (CPU backend), torch, CuPy and JAX all work without a rebuild per framework version.
See docs/PYTHON.md.

    import epx
    buffer = epx.Buffer(None, max_tokens_per_rank=4096, hidden=7168, num_experts=256,
                        num_topk=8)            # group from `epx launch`
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, topk_idx=idx,
                                                                  topk_weights=w)
    y, _, _ = buffer.combine(expert_out, handle)
"""

from ._library import LibraryNotFoundError
from ._tensor import RawBits, raw_bits
from .buffer import Buffer, Config, Handle
from .errors import EpxError, Status
from .events import EventOverlap
from .group import Group, get_unique_id, launched
from .low_latency import LowLatencyHandle

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EpxError", "EventOverlap", "Group", "Handle",
           "LibraryNotFoundError", "LowLatencyHandle", "RawBits", "Status", "get_unique_id", "launched",
           "library_path", "library_version", "raw_bits"]


def library_path():
    """Where libepx.so was loaded from (loads it if needed)."""
    from . import _capi
    return _capi.api().path


def library_version():
    """(major, minor, patch) of the loaded libepx.so."""
    from . import _capi
    return _capi.api().version
