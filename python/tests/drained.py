"""A buffer's asynchronous failure, read once the device has drained: on the CUDA backend a
combine does not wait on the host, so a peer's failure can reach it after the call
returned (then epx_get_async_error reports it)."""

import time

from epx import Status


def async_error(buffer, seconds=10):
    """(status, message) of `buffer`'s asynchronous failure after a device sync, waiting up to
    `seconds` for it to be recorded; (SUCCESS, "") if none came."""
    import torch
    torch.cuda.synchronize()
    deadline = time.time() + seconds
    while buffer.get_async_error()[0] == Status.SUCCESS and time.time() < deadline:
        time.sleep(0.01)
    return buffer.get_async_error()
