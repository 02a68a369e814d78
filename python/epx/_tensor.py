"""Caller tensors to epx_tensor_t: pointer, dtype, shape and strides, read through DLPack.

Order of attempts for one argument:
1. ``__dlpack__`` (torch, CuPy, JAX, NumPy >= 1.22, anything that speaks DLPack);
2. ``__array_interface__`` for NumPy arrays DLPack cannot describe (ml_dtypes' bfloat16
   and float8_e4m3fn);
3. a torch tensor's own ``data_ptr()/stride()`` when its DLPack export refuses the dtype
   (float8 on older torch).
"""

from . import _capi, _dlpack
from .errors import invalid_argument

# A non-NULL address for tensors with no elements: the C API reads "data == NULL" as "not
# given", and an empty tensor is given. Nothing is ever read or written through it.
_EMPTY = (_capi.ctypes.c_int64 * 2)()
_EMPTY_ADDRESS = _capi.ctypes.addressof(_EMPTY)

_RAW_NAMES = {"bf16": _capi.DTYPE_BF16, "bfloat16": _capi.DTYPE_BF16,
              "fp8": _capi.DTYPE_FP8_E4M3, "fp8_e4m3": _capi.DTYPE_FP8_E4M3,
              "float8_e4m3fn": _capi.DTYPE_FP8_E4M3}


class RawBits:
    """A uint16 (or uint8) array whose elements are bf16 (or fp8 e4m3) bit patterns."""

    def __init__(self, array, dtype):
        if dtype not in _RAW_NAMES:
            raise invalid_argument("raw_bits: dtype %r is not one of %s"
                                   % (dtype, ", ".join(sorted(_RAW_NAMES))))
        self.array = array
        self.dtype = _RAW_NAMES[dtype]


def raw_bits(array, dtype="bf16"):
    """Mark `array` as raw bits of `dtype` ("bf16" for uint16, "fp8" for uint8 arrays).

    NumPy has no bfloat16 or float8 type of its own; pass ``epx.raw_bits(x_uint16)`` where
    a bf16 tensor is expected, and outputs of the same call come back as raw bits too.
    (With ml_dtypes installed, ``ml_dtypes.bfloat16`` arrays work directly.)
    """
    return RawBits(array, dtype)


def _from_dlpack_dtype(code, bits, lanes):
    if lanes != 1:
        return _capi.DTYPE_INVALID
    return {
        (_dlpack.BFLOAT, 16): _capi.DTYPE_BF16,
        (_dlpack.FLOAT8_E4M3FN, 8): _capi.DTYPE_FP8_E4M3,
        (_dlpack.FLOAT, 32): _capi.DTYPE_FP32,
        (_dlpack.INT, 64): _capi.DTYPE_INT64,
        (_dlpack.INT, 32): _capi.DTYPE_INT32,
        (_dlpack.BOOL, 8): _capi.DTYPE_BOOL,
    }.get((code, bits), _capi.DTYPE_INVALID)


def _from_numpy_dtype(dtype):
    name = dtype.name
    if name == "bfloat16":
        return _capi.DTYPE_BF16
    if name == "float8_e4m3fn":
        return _capi.DTYPE_FP8_E4M3
    return {("f", 4): _capi.DTYPE_FP32, ("i", 8): _capi.DTYPE_INT64, ("i", 4): _capi.DTYPE_INT32,
            ("b", 1): _capi.DTYPE_BOOL}.get((dtype.kind, dtype.itemsize), _capi.DTYPE_INVALID)


class Arg:
    """One tensor argument, resolved."""

    __slots__ = ("name", "obj", "dtype", "raw", "type_name", "bits", "data", "shape", "strides",
                 "device", "keepalive")

    def c_tensor(self):
        t = _capi.Tensor()
        t.data = self.data if self.data else _EMPTY_ADDRESS
        t.dtype = self.dtype
        t.ndim = len(self.shape)
        for i, size in enumerate(self.shape):
            t.shape[i] = size
        if self.strides is not None:
            for i, stride in enumerate(self.strides):
                t.strides[i] = stride
        return t


def _resolve_dlpack(arg, obj, stream):
    device = None
    if hasattr(obj, "__dlpack_device__"):
        device = tuple(obj.__dlpack_device__())
    # The stream argument is for device memory only; CPU producers must get None.
    use_stream = None
    if device is not None and device[0] in (_dlpack.CUDA, _dlpack.CUDA_MANAGED):
        # DLPack reserves 0 (ambiguous); the legacy default stream is 1.
        use_stream = 1 if not stream else stream
    imported = _dlpack.import_object(obj, use_stream)
    arg.data = imported.data
    arg.shape = imported.shape
    arg.strides = imported.strides
    arg.device = (imported.device_type, imported.device_id)
    arg.dtype = _from_dlpack_dtype(imported.code, imported.bits, imported.lanes)
    arg.bits = imported.bits * imported.lanes
    arg.type_name = imported.dtype_name()
    arg.keepalive = imported


def _resolve_array_interface(arg, obj):
    interface = obj.__array_interface__
    dtype = obj.dtype
    arg.data = interface["data"][0]
    arg.shape = tuple(interface["shape"])
    if interface.get("strides") is None:
        arg.strides = None
    else:
        if any(s % dtype.itemsize for s in interface["strides"]):
            raise invalid_argument("%s has strides %s bytes, not a multiple of its element size"
                                   % (arg.name, interface["strides"]))
        arg.strides = tuple(s // dtype.itemsize for s in interface["strides"])
    arg.device = (_dlpack.CPU, 0)
    arg.dtype = _from_numpy_dtype(dtype)
    arg.bits = dtype.itemsize * 8
    arg.type_name = dtype.name
    arg.keepalive = obj


def _resolve_torch(arg, obj):
    arg.data = obj.data_ptr()
    arg.shape = tuple(obj.shape)
    arg.strides = tuple(obj.stride())
    if obj.device.type == "cuda":
        arg.device = (_dlpack.CUDA, obj.device.index)
    else:
        arg.device = (_dlpack.CPU, 0)
    name = str(obj.dtype).replace("torch.", "")
    arg.dtype = {"bfloat16": _capi.DTYPE_BF16, "float8_e4m3fn": _capi.DTYPE_FP8_E4M3,
                 "float32": _capi.DTYPE_FP32, "int64": _capi.DTYPE_INT64,
                 "int32": _capi.DTYPE_INT32, "bool": _capi.DTYPE_BOOL}.get(name,
                                                                           _capi.DTYPE_INVALID)
    arg.bits = obj.element_size() * 8
    arg.type_name = name
    arg.keepalive = obj


def resolve(obj, name, stream=None, force_dtype=None):
    """An Arg for a caller's tensor. Raises EpxError naming `name` if it is not one.

    force_dtype: for outputs this package allocated itself (bf16 may be a uint16 array).
    """
    arg = Arg()
    arg.name = name
    arg.obj = obj
    arg.raw = False
    forced = None
    if isinstance(obj, RawBits):
        forced = obj.dtype
        obj = obj.array
        arg.raw = True
    errors = []
    done = False
    if hasattr(obj, "__dlpack__"):
        try:
            _resolve_dlpack(arg, obj, stream)
            done = True
        except (BufferError, TypeError, RuntimeError, ValueError, AssertionError) as error:
            errors.append("__dlpack__: %s" % error)
    if not done and hasattr(obj, "__array_interface__") and hasattr(obj, "dtype"):
        _resolve_array_interface(arg, obj)
        done = True
    if not done and type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "data_ptr"):
        _resolve_torch(arg, obj)
        done = True
    if not done:
        why = " (%s)" % "; ".join(errors) if errors else ""
        raise invalid_argument("%s: expected a tensor or array (an object with __dlpack__), got "
                               "%s%s" % (name, type(obj).__name__, why))
    if forced is not None:
        want_bits = 16 if forced == _capi.DTYPE_BF16 else 8
        if arg.bits != want_bits or arg.type_name.startswith(("float", "bfloat")):
            raise invalid_argument("%s: raw_bits(%s) needs a %d-bit integer array, got %s"
                                   % (name, _capi.DTYPE_NAMES[forced], want_bits, arg.type_name))
        arg.dtype = forced
        arg.type_name = "%s (raw %s bits)" % (arg.type_name, _capi.DTYPE_NAMES[forced])
    if force_dtype is not None:
        arg.dtype = force_dtype
    if not 1 <= len(arg.shape) <= _capi.MAX_DIMS:
        raise invalid_argument("%s has %d dimensions; epx takes 1 to %d"
                               % (name, len(arg.shape), _capi.MAX_DIMS))
    if arg.strides is not None and all(arg.shape):
        for size, stride in zip(arg.shape, arg.strides):
            if size > 1 and stride == 0:
                raise invalid_argument(
                    "%s has shape %s and strides %s: a broadcast view (stride 0) cannot be "
                    "read as rows; make it contiguous first"
                    % (name, list(arg.shape), list(arg.strides)))
    return arg


def device_name(device):
    kind = _dlpack.DEVICE_NAMES.get(device[0], "device type %d" % device[0])
    return kind if device[0] in (_dlpack.CPU, _dlpack.CUDA_HOST) else "%s:%d" % (kind, device[1])
