"""The PyTorch hot path (_plans.py, apply_rope's eager autograd.Function): argument structs built
once per signature and patched per call must give the same results as building them afresh,
never keep a tensor alive, never serve another signature, and step aside for tracing and
dispatch modes. CPU tensors (the library's CPU reference); skipped without torch."""

import gc
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import rope_jit  # noqa: E402
from rope_jit import _plans, torch_ops  # noqa: E402
from torch_reference import hf_tables, rope_torch  # noqa: E402


def random(*shape, seed, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*shape, generator=generator, dtype=torch.float64)
        .float()
        .requires_grad_(requires_grad)
    )


def expected(x, cos, sin, positions):
    return rope_torch(x, cos, sin, positions)


def test_a_plan_serves_new_tensors_of_its_signature_and_a_new_signature_gets_its_own():
    cos, sin = hf_tables(torch.arange(64), 32)
    runtime = rope_jit.default_runtime()
    for seed in range(3):  # same signature, new data each time
        q = random(2, 4, 16, 32, seed=seed)
        out = rope_jit.apply_rope(q, cos=cos, sin=sin, position_offset=seed * 5)
        torch.testing.assert_close(
            out, expected(q, cos, sin, torch.arange(16) + seed * 5), rtol=2e-5, atol=2e-5
        )
    plans = _plans._plans_of(runtime)
    count = len(plans)
    # The same shape with other strides (a transposed buffer) is another signature.
    q = random(2, 16, 4, 32, seed=9).transpose(1, 2)
    out = rope_jit.apply_rope(q, cos=cos, sin=sin)
    torch.testing.assert_close(out, expected(q, cos, sin, torch.arange(16)), rtol=2e-5, atol=2e-5)
    assert len(plans) == count + 1


def test_rope_on_torch_tensors_through_a_plan_matches_the_numpy_path_and_refuses_wide_offsets():
    numpy = pytest.importorskip("numpy")
    cos, sin = hf_tables(torch.arange(40), 16)
    q, k = random(1, 6, 2, 16, seed=1), random(1, 6, 1, 16, seed=2)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    for offset in (0, 3, 20):
        rope_jit.rope(
            q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd", position_offset=offset
        )
        q_np, k_np = q.numpy().copy(), k.numpy().copy()
        rope_jit.rope(
            q_np, k_np, cos=cos.numpy(), sin=sin.numpy(), layout="bshd", position_offset=offset
        )
        numpy.testing.assert_array_equal(q_out.numpy(), q_np)
        numpy.testing.assert_array_equal(k_out.numpy(), k_np)
    before = q_out.clone()
    with pytest.raises(OverflowError, match="position_offset"):
        rope_jit.rope(
            q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd", position_offset=2**64
        )
    with pytest.raises(TypeError, match="q_position_offset"):
        rope_jit.rope(
            q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd", q_position_offset=1.5
        )
    with pytest.raises(TypeError, match="rotary_dim"):
        rope_jit.rope(
            q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd", rotary_dim=16.0
        )
    torch.testing.assert_close(q_out, before, rtol=0, atol=0)


def test_a_plan_keeps_no_tensor_alive():
    cos, sin = hf_tables(torch.arange(8), 16)
    q = random(1, 2, 8, 16, seed=3)
    out = rope_jit.apply_rope(q, cos=cos, sin=sin)
    watched = [weakref.ref(tensor) for tensor in (q, out, cos, sin)]
    del q, out, cos, sin
    gc.collect()
    assert all(reference() is None for reference in watched)


def test_eager_gradients_and_double_backward_through_the_fast_function():
    cos, sin = hf_tables(torch.arange(12), 8)
    q = random(1, 2, 12, 8, seed=11, requires_grad=True)
    k = random(1, 1, 12, 8, seed=12, requires_grad=True)
    out_q, out_k = rope_jit.apply_rope(q, k, cos, sin)
    weight_q, weight_k = torch.randn_like(out_q), torch.randn_like(out_k)
    grad_q, grad_k = torch.autograd.grad(
        (out_q * weight_q).sum() + (out_k * weight_k).sum(), (q, k), create_graph=True
    )
    # The gradient of a rotation is the inverse rotation of the output gradient; against
    # autograd of plain PyTorch too.
    q_ref = q.detach().requires_grad_(True)
    (expected(q_ref, cos, sin, torch.arange(12)) * weight_q).sum().backward()
    torch.testing.assert_close(grad_q, q_ref.grad, rtol=1e-5, atol=1e-5)
    # Double backward: the backward was recorded (create_graph), and differentiating the
    # gradient with respect to the output weights gives back the rotation: d(sum(grad_q * v))/
    # d(weight_q) = rope(v).
    v = torch.randn_like(grad_q)
    weight_q.requires_grad_(True)
    (grad_q2,) = torch.autograd.grad(
        (rope_jit.apply_rope(q, None, cos, sin) * weight_q).sum(), (q,), create_graph=True
    )
    (second,) = torch.autograd.grad((grad_q2 * v).sum(), (weight_q,))
    torch.testing.assert_close(
        second, expected(v, cos, sin, torch.arange(12)), rtol=1e-5, atol=1e-5
    )


def test_a_key_output_outside_the_loss_and_threads_use_their_own_plans():
    cos, sin = hf_tables(torch.arange(32), 16)
    q = random(1, 2, 16, 16, seed=4, requires_grad=True)
    k = random(1, 1, 16, 16, seed=5, requires_grad=True)
    out_q, _ = rope_jit.apply_rope(q, k, cos, sin)
    out_q.sum().backward()
    ones = torch.ones_like(out_q)
    torch.testing.assert_close(
        q.grad, rope_jit.apply_rope(ones, None, cos, sin, backward=True), rtol=1e-5, atol=1e-5
    )

    results = {}

    def worker(index):
        x = random(1, 2, 16, 16, seed=10 + index)
        results[index] = (x, rope_jit.apply_rope(x, None, cos, sin, position_offset=index))

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1, 2, 3]
    for index, (x, out) in results.items():
        torch.testing.assert_close(
            out, expected(x, cos, sin, torch.arange(16) + index), rtol=2e-5, atol=2e-5
        )


def test_a_dispatch_mode_sees_the_rope_op_so_the_fast_path_steps_aside():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    cos, sin = hf_tables(torch.arange(8), 16)
    q = random(1, 2, 8, 16, seed=6)
    with Recorder():
        out = rope_jit.apply_rope(q, cos=cos, sin=sin)
    assert any("rope_jit.rope" in name for name in seen), seen
    torch.testing.assert_close(out, expected(q, cos, sin, torch.arange(8)), rtol=2e-5, atol=2e-5)


def test_in_place_without_autograd_writes_into_q_and_k_through_the_fast_path():
    cos, sin = hf_tables(torch.arange(8), 16)
    q, k = random(1, 8, 2, 16, seed=7), random(1, 8, 1, 16, seed=8)
    want_q, want_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
    pointers = (q.data_ptr(), k.data_ptr())
    got_q, got_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd", inplace=True)
    assert got_q is q and got_k is k and (q.data_ptr(), k.data_ptr()) == pointers
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)


def test_the_ops_are_defined_with_torch_library_not_custom_op():
    # Library.define/impl: the dispatcher calls the kernel with no CustomOpDef layer around it.
    assert isinstance(torch_ops.rope_qk_op, torch._ops.OpOverload)
    assert torch_ops.rope_qk_op._schema.name == "rope_jit::rope_qk"
