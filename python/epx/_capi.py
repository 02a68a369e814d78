"""ctypes mirror of include/epx.h: every struct, enum and entry point the package uses.

This is the only module that knows the C layout. Keep it in step with epx.h: the test
python/tests/test_capi.py compares every struct's size and field offsets with what a C
compiler gives for the header, and every call with a `size` field proves its size
against the library at run time (a mismatch is rejected with EPX_ERR_INVALID_ARG).
"""

import ctypes
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_int, c_int32,
                    c_int64, c_size_t, c_uint32, c_uint64, c_void_p)

from . import _library

# The version of epx.h this mirror was written against.
VERSION_MAJOR = 0
VERSION_MINOR = 1

# ---------------------------------------------------------------- enums

# EPX_STATUS_MAP, in order: (name without EPX_, value).
STATUS = (
    ("SUCCESS", 0),
    ("ERR_INVALID_ARG", 1),
    ("ERR_INVALID_STATE", 2),
    ("ERR_OUT_OF_MEMORY", 3),
    ("ERR_CAPACITY", 4),
    ("ERR_UNSUPPORTED", 5),
    ("ERR_SYSTEM", 6),
    ("ERR_CUDA", 7),
    ("ERR_NVSHMEM", 8),
    ("ERR_BOOTSTRAP", 9),
    ("ERR_TIMEOUT", 10),
    ("ERR_REMOTE", 11),
    ("ERR_INTERNAL", 12),
)

DTYPE_INVALID = 0
DTYPE_BF16 = 1
DTYPE_FP8_E4M3 = 2
DTYPE_FP32 = 3
DTYPE_INT64 = 4
DTYPE_INT32 = 5
DTYPE_BOOL = 6

DTYPE_NAMES = {
    DTYPE_INVALID: "invalid",
    DTYPE_BF16: "bf16",
    DTYPE_FP8_E4M3: "fp8_e4m3",
    DTYPE_FP32: "fp32",
    DTYPE_INT64: "int64",
    DTYPE_INT32: "int32",
    DTYPE_BOOL: "bool",
}
DTYPE_SIZES = {DTYPE_BF16: 2, DTYPE_FP8_E4M3: 1, DTYPE_FP32: 4, DTYPE_INT64: 8,
               DTYPE_INT32: 4, DTYPE_BOOL: 1}

BACKEND_AUTO = 0
BACKEND_HOST = 1
BACKEND_CUDA = 2
BACKEND_NAMES = {BACKEND_AUTO: "auto", BACKEND_HOST: "host", BACKEND_CUDA: "cuda"}

MAX_DIMS = 3
UNIQUE_ID_BYTES = 128
DISPATCH_WORST_CASE = 0x1
LL_SEND_ONLY = 0x1

# ---------------------------------------------------------------- structs

epx_group_p = c_void_p
epx_buffer_p = c_void_p
epx_handle_p = c_void_p


class Tensor(Structure):
    """epx_tensor_t"""
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int),
        ("ndim", c_int32),
        ("shape", c_int64 * MAX_DIMS),
        ("strides", c_int64 * MAX_DIMS),
    ]


class UniqueId(Structure):
    """epx_unique_id_t"""
    _fields_ = [("internal", c_char * UNIQUE_ID_BYTES)]


AllgatherFn = CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t)
BarrierFn = CFUNCTYPE(c_int, c_void_p)


class BootstrapCallbacks(Structure):
    """epx_bootstrap_callbacks_t"""
    _fields_ = [
        ("allgather", AllgatherFn),
        ("barrier", BarrierFn),
        ("ctx", c_void_p),
    ]


class GroupConfig(Structure):
    """epx_group_config_t"""
    _fields_ = [
        ("size", c_size_t),
        ("rank", c_int),
        ("world_size", c_int),
        ("backend", c_int),
        ("device", c_int),
        ("ranks_per_node", c_int),
        ("unique_id", POINTER(UniqueId)),
        ("callbacks", POINTER(BootstrapCallbacks)),
        ("timeout_ms", c_int64),
    ]


class GroupInfo(Structure):
    """epx_group_info_t"""
    _fields_ = [
        ("size", c_size_t),
        ("rank", c_int),
        ("world_size", c_int),
        ("local_rank", c_int),
        ("ranks_per_node", c_int),
        ("backend", c_int),
        ("device", c_int),
    ]


class BufferConfig(Structure):
    """epx_buffer_config_t"""
    _fields_ = [
        ("size", c_size_t),
        ("max_tokens_per_rank", c_int64),
        ("hidden", c_int64),
        ("num_experts", c_int),
        ("num_topk", c_int),
        ("dispatch_dtype", c_int),
        ("num_sms", c_int),
        ("max_low_latency_tokens", c_int64),
        ("low_latency_dtype", c_int),
        ("auto_register", c_int),
    ]


class LayoutArgs(Structure):
    """epx_layout_args_t"""
    _fields_ = [
        ("size", c_size_t),
        ("topk_idx", Tensor),
        ("num_tokens_per_rank", Tensor),
        ("num_tokens_per_expert", Tensor),
        ("is_token_in_rank", Tensor),
    ]


class DispatchArgs(Structure):
    """epx_dispatch_args_t"""
    _fields_ = [
        ("size", c_size_t),
        ("x", Tensor),
        ("x_scales", Tensor),
        ("topk_idx", Tensor),
        ("topk_weights", Tensor),
        ("handle", epx_handle_p),
        ("expert_alignment", c_int),
        ("flags", c_uint32),
        ("recv_x", Tensor),
        ("recv_x_scales", Tensor),
        ("recv_topk_idx", Tensor),
        ("recv_topk_weights", Tensor),
        ("is_token_in_rank", Tensor),
        ("num_tokens_per_expert", Tensor),
    ]


class DispatchResult(Structure):
    """epx_dispatch_result_t"""
    _fields_ = [
        ("size", c_size_t),
        ("num_recv_tokens", c_int64),
        ("recv_x", Tensor),
        ("recv_x_scales", Tensor),
        ("recv_topk_idx", Tensor),
        ("recv_topk_weights", Tensor),
        ("num_recv_tokens_per_expert", POINTER(c_int32)),
        ("num_local_experts", c_int),
        ("num_recv_tokens_device", POINTER(c_int32)),
        ("num_recv_tokens_per_expert_device", POINTER(c_int32)),
        ("handle", epx_handle_p),
    ]


class CombineArgs(Structure):
    """epx_combine_args_t"""
    _fields_ = [
        ("size", c_size_t),
        ("handle", epx_handle_p),
        ("x", Tensor),
        ("topk_weights", Tensor),
        ("out_x", Tensor),
        ("out_topk_weights", Tensor),
        ("bias", Tensor * 2),
        ("order_topk_idx", Tensor),
    ]


class HandleInfo(Structure):
    """epx_handle_info_t"""
    _fields_ = [
        ("size", c_size_t),
        ("num_tokens", c_int64),
        ("num_recv_tokens", c_int64),
        ("num_local_experts", c_int),
        ("expert_alignment", c_int),
    ]


class LLHandle(Structure):
    """epx_ll_handle_t (a value: copied, never freed)"""
    _fields_ = [("internal", c_uint64 * 4)]


class LLDispatchArgs(Structure):
    """epx_ll_dispatch_args_t"""
    _fields_ = [
        ("size", c_size_t),
        ("x", Tensor),
        ("topk_idx", Tensor),
        ("use_fp8", c_int),
        ("round_scale", c_int),
        ("use_ue8m0", c_int),
        ("flags", c_uint32),
        ("cumulative_local_expert_recv_stats", Tensor),
        ("wait_recv_cost_stats", Tensor),
    ]


class LLDispatchResult(Structure):
    """epx_ll_dispatch_result_t"""
    _fields_ = [
        ("size", c_size_t),
        ("recv_x", Tensor),
        ("recv_x_scales", Tensor),
        ("recv_count", Tensor),
        ("recv_src_info", Tensor),
        ("recv_layout_range", Tensor),
        ("num_masked_entries", c_int64),
        ("handle", LLHandle),
    ]


class LLCombineArgs(Structure):
    """epx_ll_combine_args_t"""
    _fields_ = [
        ("size", c_size_t),
        ("handle", LLHandle),
        ("x", Tensor),
        ("topk_idx", Tensor),
        ("topk_weights", Tensor),
        ("out", Tensor),
        ("flags", c_uint32),
        ("wait_recv_cost_stats", Tensor),
    ]


class LLCombineResult(Structure):
    """epx_ll_combine_result_t"""
    _fields_ = [
        ("size", c_size_t),
        ("num_masked_entries", c_int64),
    ]


# Every struct of epx.h with its C name (the layout test walks this table).
STRUCTS = {
    "epx_tensor_t": Tensor,
    "epx_unique_id_t": UniqueId,
    "epx_bootstrap_callbacks_t": BootstrapCallbacks,
    "epx_group_config_t": GroupConfig,
    "epx_group_info_t": GroupInfo,
    "epx_buffer_config_t": BufferConfig,
    "epx_layout_args_t": LayoutArgs,
    "epx_dispatch_args_t": DispatchArgs,
    "epx_dispatch_result_t": DispatchResult,
    "epx_combine_args_t": CombineArgs,
    "epx_handle_info_t": HandleInfo,
    "epx_ll_handle_t": LLHandle,
    "epx_ll_dispatch_args_t": LLDispatchArgs,
    "epx_ll_dispatch_result_t": LLDispatchResult,
    "epx_ll_combine_args_t": LLCombineArgs,
    "epx_ll_combine_result_t": LLCombineResult,
}


def new(struct):
    """A struct filled as its *_INIT macro does: zeros, `size` set, defaults applied."""
    value = struct()
    if "size" in dict(struct._fields_):
        value.size = ctypes.sizeof(struct)
    if struct is GroupConfig:
        value.world_size = 1
        value.device = -1
    elif struct is GroupInfo:
        value.device = -1
    elif struct is BufferConfig:
        value.dispatch_dtype = DTYPE_BF16
        value.low_latency_dtype = DTYPE_BF16
    return value


# ---------------------------------------------------------------- entry points

# name: (restype, argtypes)
_PROTOTYPES = {
    "epx_version": (c_int, []),
    "epx_status_string": (c_char_p, [c_int]),
    "epx_status_name": (c_char_p, [c_int]),
    "epx_last_error": (c_char_p, []),
    "epx_dtype_size": (c_size_t, [c_int]),
    "epx_dtype_name": (c_char_p, [c_int]),
    "epx_tensor_1d": (Tensor, [c_void_p, c_int, c_int64]),
    "epx_tensor_2d": (Tensor, [c_void_p, c_int, c_int64, c_int64]),
    "epx_backend_name": (c_char_p, [c_int]),
    "epx_get_unique_id": (c_int, [POINTER(UniqueId)]),
    "epx_unique_id_to_string": (c_int, [POINTER(UniqueId), c_char_p, c_size_t]),
    "epx_unique_id_from_string": (c_int, [c_char_p, POINTER(UniqueId)]),
    "epx_group_create": (c_int, [POINTER(GroupConfig), POINTER(epx_group_p)]),
    "epx_group_create_from_env": (c_int, [c_int, POINTER(epx_group_p)]),
    "epx_group_destroy": (c_int, [epx_group_p]),
    "epx_group_get_info": (c_int, [epx_group_p, POINTER(GroupInfo)]),
    "epx_group_barrier": (c_int, [epx_group_p]),
    "epx_group_allgather": (c_int, [epx_group_p, c_void_p, c_void_p, c_size_t]),
    "epx_buffer_size": (c_int, [epx_group_p, POINTER(BufferConfig), POINTER(c_size_t)]),
    "epx_buffer_create": (c_int, [epx_group_p, POINTER(BufferConfig), POINTER(epx_buffer_p)]),
    "epx_buffer_destroy": (c_int, [epx_buffer_p]),
    "epx_buffer_abort": (c_int, [epx_buffer_p, c_int, c_char_p]),
    "epx_get_async_error": (c_int, [epx_buffer_p, POINTER(c_int), c_char_p, c_size_t]),
    "epx_get_dispatch_layout": (c_int, [epx_buffer_p, POINTER(LayoutArgs), c_void_p]),
    "epx_dispatch": (c_int, [epx_buffer_p, POINTER(DispatchArgs), POINTER(DispatchResult),
                             c_void_p]),
    "epx_combine": (c_int, [epx_buffer_p, POINTER(CombineArgs), c_void_p]),
    "epx_get_combine_input": (c_int, [epx_buffer_p, epx_handle_p, POINTER(Tensor)]),
    "epx_buffer_register": (c_int, [epx_buffer_p, c_void_p, c_size_t]),
    "epx_buffer_deregister": (c_int, [epx_buffer_p, c_void_p]),
    "epx_handle_get_info": (c_int, [epx_handle_p, POINTER(HandleInfo)]),
    "epx_handle_destroy": (c_int, [epx_handle_p]),
    "epx_handle_get_rank_prefix_matrix": (c_int, [epx_handle_p, POINTER(Tensor)]),
    "epx_ll_dispatch": (c_int, [epx_buffer_p, POINTER(LLDispatchArgs),
                                POINTER(LLDispatchResult), c_void_p]),
    "epx_ll_receive": (c_int, [epx_buffer_p, LLHandle, c_void_p]),
    "epx_ll_combine": (c_int, [epx_buffer_p, POINTER(LLCombineArgs), POINTER(LLCombineResult),
                               c_void_p]),
    "epx_ll_get_combine_buffer": (c_int, [epx_buffer_p, LLHandle, POINTER(Tensor)]),
    "epx_ll_mask_rank": (c_int, [epx_buffer_p, c_int]),
    "epx_ll_get_masked": (c_int, [epx_buffer_p, POINTER(c_int32), c_int]),
    "epx_ll_clean_buffer": (c_int, [epx_buffer_p, c_void_p]),
    "epx_ll_rejoin": (c_int, [epx_buffer_p, epx_group_p]),
    "epx_buffer_create_rejoin": (c_int, [epx_group_p, POINTER(BufferConfig),
                                         POINTER(epx_buffer_p)]),
}


class _Api:
    """The loaded library with typed entry points as attributes (lib.epx_dispatch, ...)."""

    def __init__(self):
        self.cdll, self.path = _library.load()
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                function = getattr(self.cdll, name)
            except AttributeError:
                raise _library.LibraryNotFoundError(
                    "%s (loaded from %s) has no %s: it is older than this package"
                    % ("libepx", self.path, name))
            function.restype = restype
            function.argtypes = argtypes
            setattr(self, name, function)
        code = self.epx_version()
        self.version = (code // 10000, code // 100 % 100, code % 100)
        if self.version[:2] != (VERSION_MAJOR, VERSION_MINOR):
            raise _library.LibraryNotFoundError(
                "libepx at %s is version %d.%d.%d, this package mirrors epx.h %d.%d: "
                "rebuild the library from the same checkout, or point EPX_LIBRARY at a "
                "matching one" % ((self.path,) + self.version + (VERSION_MAJOR, VERSION_MINOR)))

    def last_error(self):
        message = self.epx_last_error()
        return message.decode("utf-8", "replace") if message else ""


_api = None


def api():
    """The loaded library (loaded on first use, so `import epx` itself never fails)."""
    global _api
    if _api is None:
        _api = _Api()
    return _api
