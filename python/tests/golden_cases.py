"""Reading the golden cases (tests/golden, format rope-jit-golden/1) into NumPy arrays.
bfloat16 arrays stay as their raw bits (uint16); `as_float` widens any of them to float64."""

import json

import numpy as np

from conftest import golden_dir
from rope_reference import bf16_bits_to_float

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32,
                 "int64": np.int64, "bool": np.bool_}


def manifest():
    with open(golden_dir() / "manifest.json") as file:
        data = json.load(file)
    assert data["format"] == "rope-jit-golden/1"
    return data["cases"]


def cases(op):
    return [case for case in manifest() if case["op"] == op]


def load(entry):
    """(array, dtype name) of one {file, dtype, shape} entry."""
    array = np.fromfile(golden_dir() / entry["file"], dtype=_NUMPY_DTYPES[entry["dtype"]])
    return array.reshape(entry["shape"]), entry["dtype"]


def load_all(entries):
    return {name: load(entry) for name, entry in entries.items()}


def as_float(array, dtype):
    if dtype == "bfloat16":
        return bf16_bits_to_float(array).astype(np.float64)
    return np.asarray(array, np.float64)


def assert_close(got, expected, tolerance, label):
    """The README's rule: |got - expected| <= atol + rtol * |expected| everywhere."""
    error = np.abs(got - expected)
    bound = tolerance["atol"] + tolerance["rtol"] * np.abs(expected)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (f"{label}: worst at {tuple(int(i) for i in worst)}: got {got[worst]!r}, "
                                    f"expected {expected[worst]!r}, max error {error.max():.3g}")
