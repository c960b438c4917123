"""cct.core.bits.same_bits: bit-for-bit equality by memcmp, and its numpy fallback."""
import numpy as np
import pytest

from cct.core import bits


@pytest.fixture(params=["memcmp", "numpy"])
def same_bits(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(bits, "_memcmp", None)
    else:
        assert bits._memcmp is not None, "libc's memcmp was not found on this platform"
    return bits.same_bits


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.complex64])
def test_equal_arrays_and_every_single_change(same_bits, dtype):
    a = (np.arange(37) * 3 - 50).astype(dtype).reshape(37)
    assert same_bits(a, a.copy())
    for index in (0, 18, 36):                  # the first, a middle and the last element
        b = a.copy()
        b[index] += 1
        assert not same_bits(a, b)


def test_signed_zeros_and_nans_are_told_by_their_bits(same_bits):
    zeros, negative_zeros = np.zeros(5, np.float32), -np.zeros(5, np.float32)
    assert (zeros == negative_zeros).all() and not same_bits(zeros, negative_zeros)
    nans = np.full(5, np.nan, np.float32)
    assert same_bits(nans, nans.copy())         # the same NaN is the same value here
    other_nan = nans.copy()
    other_nan.view(np.uint32)[2] ^= 1           # another payload
    assert not same_bits(nans, other_nan)


def test_shape_dtype_order_and_emptiness(same_bits):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert not same_bits(a, a.reshape(4, 3))
    assert not same_bits(a, a.astype(np.float64))
    assert same_bits(a.T, np.ascontiguousarray(a.T))          # compared in C order
    assert not same_bits(a.T, np.ascontiguousarray(a))
    assert same_bits(np.empty((0, 3), np.float32), np.empty((0, 3), np.float32))
