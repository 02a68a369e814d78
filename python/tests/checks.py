"""Assertions the tests share: a rank's results against the NumPy model (reference.py)."""

import numpy as np


def assert_bf16_equal(got, want, backend):
    """bf16 `got` equals `want`: exactly on the host backend, which sums in rank order in
    fp32 (the model's order); within 1e-2 on the GPU backend, which may add in another
    order, so its results may differ in the last bit."""
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    if backend == "host":
        np.testing.assert_array_equal(got32, want32)
    else:
        np.testing.assert_allclose(got32, want32, rtol=1e-2, atol=1e-2)


def assert_recv_x(tensors, recv_x, want, fp8):
    """A dispatch's received rows equal the model's `want` (Case.dispatch) bit for bit:
    with fp8, recv_x is the (x, scales) pair and both are compared."""
    if fp8:
        recv_x, recv_scales = recv_x
        np.testing.assert_array_equal(tensors.get(recv_scales), want["recv_scales"])
        np.testing.assert_array_equal(tensors.get(recv_x).view(np.uint8),
                                      want["recv_x"].view(np.uint8))
    else:
        np.testing.assert_array_equal(tensors.get(recv_x).view(np.uint16),
                                      want["recv_x"].view(np.uint16))
