"""Shared fixtures. The library comes from $ROPE_JIT_LIBRARY (scripts/test.sh sets it to the
build's librope_jit.so) or wherever rope_jit finds it; the golden cases from the repository's
tests/golden, or $ROPE_JIT_GOLDEN_DIR."""

import os
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


def golden_dir():
    return Path(os.environ.get("ROPE_JIT_GOLDEN_DIR", REPOSITORY / "tests" / "golden"))


@pytest.fixture(scope="session")
def library():
    import rope_jit
    return rope_jit.load_library()


@pytest.fixture(scope="session")
def cpu_runtime(library):
    import rope_jit
    with rope_jit.Runtime(backend="cpu") as runtime:
        yield runtime
