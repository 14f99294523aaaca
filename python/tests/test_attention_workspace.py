"""The attention workspace (rope_jit_attention_args.workspace) from Python on the CPU: the size
query through ctypes (0 on the CPU backend, for either direction), the checks of the new
fields (a misaligned workspace or a size without one is refused naming the field, and nothing
is written), and torch tensors on the CPU taking no workspace. The GPU side (PyTorch's
allocator giving the sm_90 kernels their workspace) is in test_torch_gpu.py."""

import ctypes
import importlib

import numpy as np
import pytest

import rope_jit
from rope_jit import _structs as s
from rope_jit.tensors import as_tensor

# The module (rope_jit.attention is also the function's name in the package).
attention_module = importlib.import_module("rope_jit.attention")


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    shape_q, shape_k = (1, 4, 6, 16), (1, 2, 6, 16)
    positions = np.arange(6, dtype=np.float64)[:, None]
    angles = positions * (10000.0 ** (-np.arange(0, 16, 2) / 16.0))[None, :]
    return {
        "q": rng.standard_normal(shape_q).astype(np.float32),
        "k": rng.standard_normal(shape_k).astype(np.float32),
        "v": rng.standard_normal(shape_k).astype(np.float32),
        "out": np.full(shape_q, np.nan, dtype=np.float32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
        "lse": np.full(shape_q[:3], np.nan, dtype=np.float32),
        "dout": rng.standard_normal(shape_q).astype(np.float32),
        "dq": np.full(shape_q, np.nan, dtype=np.float32),
        "dk": np.full(shape_k, np.nan, dtype=np.float32),
        "dv": np.full(shape_k, np.nan, dtype=np.float32),
    }


def _args(runtime, arrays):
    """rope_jit_attention_args pointing at `arrays` (and the TensorArgs that must outlive it)."""
    library = runtime.library
    _, _, init = attention_module._functions(library)
    args = library.new_struct(s.AttentionArgs, init)
    held = []
    for name, value in arrays.items():
        tensor = as_tensor(value, name, writable=True)
        held.append(tensor)
        s.POINTER_FIELD.pack_into(args, getattr(s.AttentionArgs, name).offset, tensor.address)
    args.causal = 1
    return args, held


def _aligned(buffer, offset):
    """The address `offset` bytes past the first 256-byte boundary inside `buffer`."""
    base = buffer.ctypes.data
    return (base + 255) // 256 * 256 + offset


@pytest.fixture()
def attention_library(cpu_runtime):
    if not rope_jit.has_attention(cpu_runtime):
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    if attention_module._workspace_size_function(cpu_runtime.library) is None:
        pytest.skip("the loaded librope_jit has no rope_jit_attention_workspace_size")
    return cpu_runtime


def test_the_workspace_size_is_zero_for_either_direction_on_the_cpu_backend(attention_library):
    runtime = attention_library
    size_function = attention_module._workspace_size_function(runtime.library)
    args, held = _args(runtime, _arrays())
    for backward in (0, 1):
        size = ctypes.c_size_t(12345)
        assert size_function(runtime.handle, ctypes.byref(args), backward, ctypes.byref(size)) == 0
        assert size.value == 0
    # What the call refuses, the query refuses: a backward without dq.
    args.dq = None
    size = ctypes.c_size_t(12345)
    status = size_function(runtime.handle, ctypes.byref(args), 1, ctypes.byref(size))
    assert status != 0 and size.value == 0
    assert b"dq: required by the backward" in runtime.library.rope_jit_last_error()
    del held


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_misaligned_workspace_or_a_size_without_one_is_refused_and_nothing_is_written(
        attention_library, which):
    runtime = attention_library
    forward, backward, _ = attention_module._functions(runtime.library)
    function = forward if which == "forward" else backward
    name = "rope_jit_attention" + ("" if which == "forward" else "_backward")
    arrays = _arrays()
    if which == "backward":  # a backward reads the forward's out and lse
        args, held = _args(runtime, arrays)
        runtime.library.check(name, forward(runtime.handle, ctypes.byref(args)))
        del held
    before = {key: value.copy() for key, value in arrays.items()}
    buffer = np.zeros(2048, dtype=np.uint8)
    args, held = _args(runtime, arrays)
    for offset in (8, 128):
        args.workspace = _aligned(buffer, offset)
        args.workspace_bytes = 512
        with pytest.raises(rope_jit.InvalidArgumentError,
                           match="workspace: address .* is not 256-byte aligned"):
            runtime.library.check(name, function(runtime.handle, ctypes.byref(args)))
    args.workspace = None
    args.workspace_bytes = 4096
    with pytest.raises(rope_jit.InvalidArgumentError,
                       match="workspace_bytes: 4096 with a NULL workspace"):
        runtime.library.check(name, function(runtime.handle, ctypes.byref(args)))
    for key, value in arrays.items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    # An aligned workspace is accepted, and a call that needs none (the CPU) leaves it alone.
    buffer[:] = 0xAB
    args.workspace = _aligned(buffer, 0)
    args.workspace_bytes = 1
    runtime.library.check(name, function(runtime.handle, ctypes.byref(args)))
    assert (buffer == 0xAB).all()
    written = ("out", "lse") if which == "forward" else ("dq", "dk", "dv")
    for key in written:
        assert np.isfinite(arrays[key]).all(), key
    del held


def test_torch_tensors_on_the_cpu_take_no_workspace(monkeypatch):
    torch = pytest.importorskip("torch")
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    from rope_jit import torch_ops

    def refuse(*args, **kwargs):
        raise AssertionError("a workspace was asked for a call on the CPU")

    monkeypatch.setattr(attention_module, "_torch_workspace", refuse)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 6, 16, generator=generator, requires_grad=True)
    k = torch.randn(1, 2, 6, 16, generator=generator, requires_grad=True)
    v = torch.randn(1, 2, 6, 16, generator=generator, requires_grad=True)
    out = torch_ops.attention(q, k, v, causal=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
