"""NumPy arrays in the dtypes the library takes: bfloat16 travels as uint16 bits (NumPy has no
bfloat16), reinterpreted for the library; the tests compare in float64 after the same
rounding."""

import numpy as np

import rope_jit
from rope_reference import bf16_bits_to_float, float_to_bf16_bits


def to_dtype(values, dtype):
    """(array the library gets, the same values as float64 after rounding)."""
    if dtype == "bfloat16":
        bits = float_to_bf16_bits(values)
        return bits, bf16_bits_to_float(bits).astype(np.float64)
    array = np.asarray(values, dtype=dtype)
    return array, array.astype(np.float64)


def from_dtype(array, dtype):
    """The values of a library array (as to_dtype makes them) in float64."""
    return bf16_bits_to_float(array).astype(np.float64) if dtype == "bfloat16" else array.astype(np.float64)


def library_tensor(array, dtype):
    """`array` as the library reads it: bfloat16 bits reinterpreted."""
    return rope_jit.reinterpret(array, "bfloat16") if dtype == "bfloat16" else array
