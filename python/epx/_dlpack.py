"""DLPack in pure Python: read a producer's capsule, and export library memory.

Import: ``__dlpack__()`` gives a PyCapsule named "dltensor_versioned" (DLManagedTensorVersioned)
or "dltensor" (DLManagedTensor); PyCapsule_GetPointer through ctypes.pythonapi gives the
struct, from which the pointer, device, dtype, shape and strides are read. The capsule is
kept alive (and so is the producer's memory) for as long as the imported view is used; it
is never renamed to "used_dltensor", so the producer's capsule destructor frees the
managed tensor when the capsule goes away, as the protocol asks of an unconsumed capsule.

Export: ``DLPackView`` is an object with ``__dlpack__``/``__dlpack_device__`` whose capsule
owns a DLManagedTensor (or the versioned struct) that points at memory epx owns. Its
deleter only drops the Python references that keep that memory alive.
"""

import ctypes
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_int, c_int32, c_int64,
                    c_uint8, c_uint16, c_uint32, c_uint64, c_void_p)

# DLDeviceType values used here.
CPU = 1
CUDA = 2
CUDA_HOST = 3
CUDA_MANAGED = 13
DEVICE_NAMES = {CPU: "cpu", CUDA: "cuda", CUDA_HOST: "cuda_host", 4: "opencl", 7: "vulkan",
                8: "metal", 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}

# DLDataTypeCode values used here.
INT = 0
UINT = 1
FLOAT = 2
BFLOAT = 4
BOOL = 6
FLOAT8_E4M3FN = 10
CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex", 6: "bool",
              7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
              11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz",
              14: "float8_e8m0fnu", 15: "float6_e2m3fn", 16: "float6_e3m2fn",
              17: "float4_e2m1fn"}


def dtype_name(code, bits, lanes=1):
    """'float16', 'bfloat16', 'float8_e4m3fn', 'bool', ... for messages."""
    name = CODE_NAMES.get(code, "code%d" % code)
    if code == BOOL or code >= 7:
        text = name
    else:
        text = "%s%d" % (name, bits)
    return text if lanes == 1 else "%sx%d" % (text, lanes)


class DLDevice(Structure):
    _fields_ = [("device_type", c_int), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


Deleter = CFUNCTYPE(None, c_void_p)


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", Deleter)]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", Deleter),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


FLAG_READ_ONLY = 1

# Private prototypes of the capsule API (so that nobody else's argtypes on
# ctypes.pythonapi.* can interfere). PYFUNCTYPE keeps the GIL and raises Python errors.
_capsule_get_pointer = ctypes.PYFUNCTYPE(c_void_p, ctypes.py_object, c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_is_valid = ctypes.PYFUNCTYPE(c_int, ctypes.py_object, c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, c_void_p, c_char_p, c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
# Used inside the capsule destructor, where the capsule is being freed: raw pointers, so
# that ctypes takes no new reference to it.
_raw_capsule_is_valid = ctypes.PYFUNCTYPE(c_int, c_void_p, c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_raw_capsule_get_pointer = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"


class Imported:
    """What a producer's DLPack capsule describes (valid while `keepalive` lives)."""

    __slots__ = ("data", "device_type", "device_id", "code", "bits", "lanes", "shape",
                 "strides", "read_only", "keepalive")

    def dtype_name(self):
        return dtype_name(self.code, self.bits, self.lanes)


def parse_capsule(capsule):
    """An Imported from a "dltensor" or "dltensor_versioned" capsule (not consumed)."""
    if _capsule_is_valid(capsule, _NAME_VERSIONED):
        managed = DLManagedTensorVersioned.from_address(
            _capsule_get_pointer(capsule, _NAME_VERSIONED))
        if managed.version.major != 1:
            raise BufferError("DLPack version %d.%d is not supported (1.x is)"
                              % (managed.version.major, managed.version.minor))
        tensor = managed.dl_tensor
        read_only = bool(managed.flags & FLAG_READ_ONLY)
    elif _capsule_is_valid(capsule, _NAME):
        tensor = DLManagedTensor.from_address(_capsule_get_pointer(capsule, _NAME)).dl_tensor
        read_only = False
    else:
        raise BufferError("__dlpack__() did not return an unused DLPack capsule")
    out = Imported()
    ndim = tensor.ndim
    out.data = (tensor.data or 0) + tensor.byte_offset
    out.device_type = tensor.device.device_type
    out.device_id = tensor.device.device_id
    out.code = tensor.dtype.code
    out.bits = tensor.dtype.bits
    out.lanes = tensor.dtype.lanes
    out.shape = tuple(tensor.shape[i] for i in range(ndim))
    out.strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else None
    out.read_only = read_only
    out.keepalive = capsule
    return out


def import_object(obj, stream=None):
    """Call obj.__dlpack__ (asking for a versioned capsule) and parse what it returns.

    `stream` is the consumer's CUDA stream (an int) for device tensors: the producer makes
    that stream wait for its pending work on the tensor, as the protocol specifies.
    Raises BufferError/TypeError/AttributeError/RuntimeError when the object cannot export.
    """
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=(1, 1))
    except TypeError:
        # A producer from before DLPack 1.0 takes no max_version.
        capsule = obj.__dlpack__(stream=stream)
    return parse_capsule(capsule)


# ---------------------------------------------------------------- export

# Managed structs handed out and not yet deleted, by address: each entry holds the struct,
# its shape/strides arrays, and the object that keeps the memory valid.
_live = {}


def _release(address):
    _live.pop(address, None)


@Deleter
def _deleter(address):
    # Called by the consumer (or by the capsule destructor below) exactly once.
    _release(address)


@CFUNCTYPE(None, c_void_p)
def _capsule_destructor(capsule):
    # Runs while the capsule is being freed. A capsule still named "dltensor..." was never
    # consumed, so the producer (us) must delete the managed tensor; a consumed one was
    # renamed "used_dltensor..." and its consumer calls the deleter itself.
    try:
        for name in (_NAME, _NAME_VERSIONED):
            if _raw_capsule_is_valid(capsule, name):
                _release(_raw_capsule_get_pointer(capsule, name))
                return
    except Exception:  # nothing may propagate out of a destructor
        pass


class DLPackView:
    """Memory epx owns, shaped as a tensor, exportable through DLPack.

    data: address; shape, strides: tuples (strides in elements); code/bits: DLPack dtype;
    device: (device_type, device_id); owner: any object that keeps the memory valid.
    """

    def __init__(self, data, shape, strides, code, bits, device, owner):
        self.data = data
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.code = code
        self.bits = bits
        self.device = (int(device[0]), int(device[1]))
        self.owner = owner

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        # The stream argument is not acted on: epx makes these views on the stream that the
        # consumer (this package, right after the operation) uses.
        if copy:
            raise BufferError("epx views cannot be copied on export; copy after import")
        if dl_device is not None and tuple(dl_device) != self.device:
            raise BufferError("epx view lives on device %s, %s was asked for"
                              % (self.device, tuple(dl_device)))
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        ndim = len(self.shape)
        shape = (c_int64 * max(ndim, 1))(*self.shape)
        strides = (c_int64 * max(ndim, 1))(*self.strides)
        managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        tensor = managed.dl_tensor
        # A zero-size view may have no address; DLPack allows NULL there.
        tensor.data = self.data or None
        tensor.device = DLDevice(self.device[0], self.device[1])
        tensor.ndim = ndim
        tensor.dtype = DLDataType(self.code, self.bits, 1)
        tensor.shape = ctypes.cast(shape, POINTER(c_int64))
        tensor.strides = ctypes.cast(strides, POINTER(c_int64))
        tensor.byte_offset = 0
        managed.manager_ctx = None
        managed.deleter = _deleter
        if versioned:
            managed.version = DLPackVersion(1, 0)
            managed.flags = 0
        address = ctypes.addressof(managed)
        _live[address] = (managed, shape, strides, self.owner)
        name = _NAME_VERSIONED if versioned else _NAME
        return _capsule_new(address, name, ctypes.cast(_capsule_destructor, c_void_p))


def live_exports():
    """How many exported managed tensors are not yet deleted (for tests)."""
    return len(_live)
