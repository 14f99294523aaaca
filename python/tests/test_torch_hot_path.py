"""The PyTorch hot path (_plans.py, apply_rope's eager autograd.Function): argument structs built
once per signature and patched per call must give the same results as building them afresh,
never keep a tensor alive, never serve another signature, and step aside for tracing and
dispatch modes. CPU tensors (the library's CPU reference); skipped without torch."""

import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import rope_jit  # noqa: E402
from rope_jit import _plans, torch_ops  # noqa: E402
from torch_reference import hf_tables, rope_torch  # noqa: E402
from torch_support import fresh_plans, random  # noqa: E402


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
    plans = _plans._plans_of(rope_jit.default_runtime())
    count = len(plans)
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
    # One plan served the three calls (the planned path ran, and only once built).
    assert len(plans) == count + 1
    assert any(plan is not _plans._NO_PLAN for plan in plans.values())
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
    thread_plans = {}

    def worker(index):
        x = random(1, 2, 16, 16, seed=10 + index)
        results[index] = (x, rope_jit.apply_rope(x, None, cos, sin, position_offset=index))
        thread_plans[index] = dict(_plans._plans_of(rope_jit.default_runtime()))

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1, 2, 3]
    # Each thread built its own plan objects for the same signature.
    built = [
        plan for plans in thread_plans.values() for plan in plans.values()
        if plan is not _plans._NO_PLAN
    ]
    assert len(built) >= 4 and len({id(plan) for plan in built}) == len(built)
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


def _plan_recipes(runtime):
    return [key[0].name for key in _plans._plans_of(runtime)]


@pytest.mark.parametrize("per_sequence", [False, True])
def test_the_hf_drop_in_runs_through_a_plan_of_its_own_and_matches_the_formula(per_sequence):
    from rope_jit.dropin import hf

    batch, seq_len, head_dim = 3, 5, 16
    starts = torch.arange(batch)[:, None] * (7 if per_sequence else 0)
    positions = torch.arange(seq_len)[None] + starts  # [B, S]
    cos, sin = hf_tables(positions.reshape(-1), head_dim)
    cos, sin = cos.reshape(batch, seq_len, head_dim), sin.reshape(batch, seq_len, head_dim)
    if not per_sequence:
        cos, sin = cos[:1], sin[:1]
    runtime = rope_jit.default_runtime()
    for seed in range(3):  # new tensors of one signature: one plan, refilled
        # [B, H, S, D] views of [B, S, H, D] projections, as the models pass them.
        q = random(batch, seq_len, 4, head_dim, seed=20 + seed, requires_grad=True).transpose(1, 2)
        k = random(batch, seq_len, 2, head_dim, seed=30 + seed, requires_grad=True).transpose(1, 2)
        got_q, got_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        for got, x in ((got_q, q), (got_k, k)):
            want = x * cos[:, None] + torch.cat((-x[..., 8:], x[..., :8]), -1) * sin[:, None]
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        weight = torch.randn_like(got_q)
        (grad_q,) = torch.autograd.grad((got_q * weight).sum(), (q,))
        # The gradient of the rotation: the inverse rotation of the output's gradient.
        want_grad = weight * cos[:, None] + torch.cat(
            (weight[..., 8:], -weight[..., :8]), -1
        ) * sin[:, None]
        torch.testing.assert_close(grad_q, want_grad, rtol=2e-5, atol=2e-5)
    recipe = "hf cos/sin per sequence" if per_sequence else "hf shared cos/sin"
    assert recipe in _plan_recipes(runtime)


@pytest.mark.parametrize("tables", ["expanded", "per sequence"])
def test_the_hf_drop_in_picks_its_recipe_by_the_tables_strides_in_inference(tables):
    # cos [B, S, D] expanded from one row per token (batch stride 0, not contiguous) is shared
    # by the batch; a contiguous [B, S, D] one holds a table per sequence. The drop-in tells
    # them apart per call without stride(0) when cos is contiguous.
    from rope_jit.dropin import hf

    batch, seq_len, head_dim = 3, 2, 16
    starts = torch.arange(batch)[:, None] * (5 if tables == "per sequence" else 0)
    positions = torch.arange(seq_len)[None] + starts
    cos, sin = hf_tables(positions.reshape(-1), head_dim)
    cos, sin = cos.reshape(batch, seq_len, head_dim), sin.reshape(batch, seq_len, head_dim)
    if tables == "expanded":
        cos, sin = cos[:1].expand(batch, -1, -1), sin[:1].expand(batch, -1, -1)
        assert cos.stride(0) == 0 and not cos.is_contiguous()
    runtime = rope_jit.default_runtime()
    fresh_plans(runtime)
    q = random(batch, seq_len, 4, head_dim, seed=60).transpose(1, 2)
    k = random(batch, seq_len, 2, head_dim, seed=61).transpose(1, 2)
    with torch.no_grad():
        for _ in range(2):  # the plan's build, then its reuse
            got_q, got_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
            for got, x in ((got_q, q), (got_k, k)):
                want = x * cos[:, None] + torch.cat((-x[..., 8:], x[..., :8]), -1) * sin[:, None]
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    recipe = "hf cos/sin per sequence" if tables == "per sequence" else "hf shared cos/sin"
    assert _plan_recipes(runtime) == [recipe]


def test_the_first_drop_in_call_of_a_fresh_process_is_served_by_a_plan():
    # Nothing else has run: the plans' torch types are set when torch_ops is imported, so the
    # drop-in's first call already takes its own plan (not the general code through apply_rope).
    code = """
import torch, rope_jit
from rope_jit import _plans
from rope_jit.dropin.hf import apply_rotary_pos_emb
q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16)
cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
with torch.no_grad():
    apply_rotary_pos_emb(q, k, cos, sin)
print(_plans._thread_state(rope_jit.default_runtime()).last_key[0].name)
"""
    python_path = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": python_path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hf shared cos/sin"


def test_a_view_that_would_copy_gets_no_plan_and_the_general_path_still_answers():
    from rope_jit.dropin import hf

    batch, seq_len, head_dim = 2, 3, 16
    positions = torch.arange(batch * seq_len) * 3
    cos, sin = hf_tables(positions, head_dim)
    # [B, S, D] tables whose rows cannot be viewed as [B*S, D] (S and B exchanged in memory):
    # reshape copies, so the library must read the copy, every call.
    cos = cos.reshape(seq_len, batch, head_dim).transpose(0, 1)
    sin = sin.reshape(seq_len, batch, head_dim).transpose(0, 1)
    q = random(batch, 4, seq_len, head_dim, seed=40)
    k = random(batch, 2, seq_len, head_dim, seed=41)
    runtime = rope_jit.default_runtime()
    for _ in range(2):
        got_q, got_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        for got, x in ((got_q, q), (got_k, k)):
            want = x * cos[:, None] + torch.cat((-x[..., 8:], x[..., :8]), -1) * sin[:, None]
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert any(plan is _plans._NO_PLAN for plan in _plans._plans_of(runtime).values())


def test_apply_rope_outputs_are_derived_yet_a_new_input_layout_gets_a_new_plan():
    # The outputs' strides follow q's (empty_like keeps a dense layout): a transposed q gives
    # transposed outputs, through another plan, and both results are right.
    cos, sin = hf_tables(torch.arange(16), 16)
    runtime = rope_jit.default_runtime()
    contiguous = random(1, 3, 16, 16, seed=50)
    transposed = random(1, 16, 3, 16, seed=51).transpose(1, 2)
    for q in (contiguous, transposed, contiguous):
        out = rope_jit.apply_rope(q, None, cos, sin)
        assert out.stride() == q.stride()
        want = expected(q, cos, sin, torch.arange(16))
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    keys = [key for key in _plans._plans_of(runtime) if key[0] is torch_ops.APPLY_RECIPE]
    assert len({(key[2], key[3]) for key in keys}) >= 2  # q's shape and strides lead each key


def test_a_plan_holds_its_struct_and_dltensors_in_one_buffer_that_points_into_itself():
    cos, sin = hf_tables(torch.arange(8), 16)
    q = random(1, 2, 8, 16, seed=60)
    runtime = rope_jit.Runtime(backend="cpu")
    rope_jit.rope(q, cos=cos, sin=sin, runtime=runtime)
    (plan,) = _plans._plans_of(runtime).values()
    import ctypes

    start = ctypes.addressof(plan.buffer)
    end = start + ctypes.sizeof(plan.buffer)
    for name in ("q", "cos", "sin"):
        pointer = ctypes.cast(getattr(plan.args, name), ctypes.c_void_p).value
        assert start <= pointer < end, name
        dl_tensor = getattr(plan.args, name).contents
        shape = ctypes.cast(dl_tensor.shape, ctypes.c_void_p).value
        assert start <= shape < end, name
    assert plan.args.q.contents.shape[2] == 8 and plan.args.cos.contents.shape[1] == 16
    runtime.close()


def test_mrope_sections_of_floats_never_find_the_plan_of_equal_integers():
    # (16.0 == 16 and they hash alike: a plan key holding the sections must not serve floats,
    # which the general path refuses.)
    cos, sin = hf_tables(torch.arange(8), 16)
    q = random(1, 2, 4, 16, seed=70)
    positions = torch.zeros(2, 4, dtype=torch.int64)
    runtime = rope_jit.Runtime(backend="cpu")
    out = torch.empty_like(q)
    rope_jit.rope(q, cos=cos, sin=sin, positions=positions, mrope_sections=[4, 4], q_out=out,
                  runtime=runtime)
    torch.testing.assert_close(out, expected(q, cos, sin, torch.zeros(4, dtype=torch.int64)),
                               rtol=2e-5, atol=2e-5)
    with pytest.raises(TypeError, match=r"mrope_sections\[1\]"):
        rope_jit.rope(q, cos=cos, sin=sin, positions=positions, mrope_sections=[4, 4.0],
                      q_out=out, runtime=runtime)
    runtime.close()


def test_kv_cache_calls_take_the_general_path_and_build_no_plan():
    """A plan's key holds neither kv_layout nor the cache arguments: such calls never plan."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("needs torch.float8_e4m3fn")
    runtime = rope_jit.default_runtime()
    plans = _plans._plans_of(runtime)
    D, block_size = 16, 4
    q, k, v = random(1, 3, 2, D, seed=11), random(1, 3, 1, D, seed=12), random(1, 3, 1, D, seed=13)
    inv_freq = torch.ones(D // 2)
    count = len(plans)
    for _ in range(2):
        k_cache = torch.zeros(2, block_size, 1, D)
        v_cache = torch.zeros_like(k_cache)
        rope_jit.rope(q.clone(), k, v=v, inv_freq=inv_freq, layout="bshd", kv_layout="nhd",
                      k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=torch.tensor([1, 4, 6], dtype=torch.int64))
        torch.testing.assert_close(v_cache[1, 0, 0], v[0, 1, 0], rtol=0, atol=0)
    assert len(plans) == count


def test_contiguous_tensors_differing_only_in_size_one_strides_share_a_plan_and_both_are_right():
    # [2, 1, 4, 16] made directly (strides 64, 64, 16, 1) and as a transposed view (64, 16, 64,
    # 1): both contiguous, so one key (strides of a size-1 dimension address nothing).
    cos, sin = hf_tables(torch.arange(8), 16)
    plans = _plans._plans_of(rope_jit.default_runtime())
    direct = random(2, 1, 4, 16, seed=70)
    viewed = random(2, 4, 1, 16, seed=71).transpose(1, 2)
    assert direct.stride() != viewed.stride() and viewed.is_contiguous()
    count = None
    for q in (direct, viewed, direct):
        out = rope_jit.apply_rope(q, None, cos, sin)
        want = expected(q, cos, sin, torch.arange(4))
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
        count = len(plans) if count is None else count
        assert len(plans) == count


def test_the_hf_recipes_check_refuses_a_signature_once_and_its_calls_still_raise():
    from rope_jit.dropin import hf

    batch, seq_len, head_dim = 2, 3, 16
    cos, sin = hf_tables(torch.arange(seq_len + 1), head_dim)
    cos, sin = cos[None], sin[None]  # [1, S+1, D]: one row too many for S tokens
    q = random(batch, 4, seq_len, head_dim, seed=80)
    k = random(batch, 2, seq_len, head_dim, seed=81)
    runtime = rope_jit.default_runtime()
    for _ in range(2):  # the first call builds the refusal, the second finds it
        with pytest.raises(RuntimeError, match="must match the size"):  # (transformers')
            hf.apply_rotary_pos_emb(q, k, cos, sin)
    refused = [
        plan
        for key, plan in _plans._plans_of(runtime).items()
        if key[0].name == "hf shared cos/sin" and key[4][0] == cos.shape
    ]
    assert refused and all(plan is _plans._NO_PLAN for plan in refused)
    # The right rows of the same table go through a plan and give the formula's values.
    got_q, _ = hf.apply_rotary_pos_emb(q, k, cos[:, :seq_len], sin[:, :seq_len])
    c, s = cos[:, None, :seq_len], sin[:, None, :seq_len]
    want = q * c + torch.cat((-q[..., 8:], q[..., :8]), -1) * s
    torch.testing.assert_close(got_q, want, rtol=2e-5, atol=2e-5)


def _empty_like_strides(x):
    return torch.empty_like(x).stride()


def test_outputs_made_by_a_plan_have_empty_likes_strides_dtype_and_values_on_every_call():
    # Contiguous q whose size-1 strides differ (one plan: the strides are read per call), and
    # a q sliced out of a fused projection (not dense: empty_like's own strides, from the key).
    cos, sin = hf_tables(torch.arange(8), 16)
    fused = random(2, 4, 3 * 4, 16, seed=90)  # [B, S, 3 * H, D]
    cases = [
        random(2, 1, 4, 16, seed=91),
        random(2, 4, 1, 16, seed=92).transpose(1, 2),
        fused[:, :, :4],
        random(2, 1, 4, 16, seed=93),
    ]
    assert not cases[2].is_contiguous() and _empty_like_strides(cases[2]) != cases[2].stride()
    for q in cases + cases:
        k = q[:, :, :2]
        for inference in (True, False):
            with torch.set_grad_enabled(not inference):
                x = q if inference else q.detach().requires_grad_(True)
                got_q, got_k = rope_jit.apply_rope(x, k, cos, sin, layout="bshd")
            for got, source in ((got_q, q), (got_k, k)):
                assert got.stride() == _empty_like_strides(source)
                assert got.dtype == source.dtype and got.shape == source.shape
                want = expected(source.transpose(1, 2), cos, sin, torch.arange(q.shape[1]))
                torch.testing.assert_close(got.transpose(1, 2), want, rtol=2e-5, atol=2e-5)


def test_the_last_plan_check_follows_changed_tensors_and_never_serves_another_signature():
    # One signature called with a Tensor, a Parameter, a tensor that requires grad, then
    # another shape and dtype: each call's result is right, and the refused checks re-arm the
    # same plan instead of building others.
    cos, sin = hf_tables(torch.arange(16), 16)
    runtime = rope_jit.default_runtime()
    plans = fresh_plans(runtime)
    base = random(1, 3, 8, 16, seed=95)
    calls = [
        base,
        torch.nn.Parameter(base.clone(), requires_grad=False),
        base + 1,
        random(1, 3, 5, 16, seed=96),  # another shape: another plan
        random(1, 3, 8, 16, seed=97).half(),  # another dtype: another plan
        base * 2,
    ]
    for q in calls:
        with torch.no_grad():
            out = rope_jit.apply_rope(q, None, cos, sin)
        want = expected(q.detach().float(), cos, sin, torch.arange(q.shape[2]))
        tolerance = 2e-5 if q.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out, want.to(q.dtype), rtol=tolerance, atol=tolerance)
        assert type(out) is torch.Tensor and not out.requires_grad
    assert len(plans) == 3
    if _plans._new_guard is not None:
        state = _plans._thread_state(runtime)
        # The guard of the last plan (q, cos, sin present) has followed the last call's q.
        guard = state.last_plan.guard
        assert guard(base * 2, cos, sin) and not guard(base.half(), cos, sin)
        assert not guard(base.requires_grad_(True), cos, sin)


def test_without_torchs_private_guard_and_allocator_the_key_and_empty_like_serve(monkeypatch):
    monkeypatch.setattr(_plans, "_new_guard", None)
    monkeypatch.setattr(_plans, "_ALLOCATORS", {})
    runtime = rope_jit.default_runtime()
    fresh_plans(runtime)
    cos, sin = hf_tables(torch.arange(8), 16)
    for seed in range(3):
        q = random(1, 8, 2, 16, seed=100 + seed)
        k = random(1, 8, 1, 16, seed=110 + seed)
        got_q, got_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
        for got, x in ((got_q, q), (got_k, k)):
            want = expected(x.transpose(1, 2), cos, sin, torch.arange(8)).transpose(1, 2)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            assert got.stride() == x.stride()
    (plan,) = _plans._plans_of(runtime).values()
    assert plan.guard is None and plan.allocate is None


def test_deterministic_algorithms_make_outputs_with_empty_like(monkeypatch):
    # Under torch.use_deterministic_algorithms, empty_like fills new memory: the plan's outputs
    # come from it then, and the values are the same.
    made = []
    real = _plans._empty_like
    monkeypatch.setattr(_plans, "_empty_like", lambda x: made.append(x) or real(x))
    cos, sin = hf_tables(torch.arange(8), 16)
    q = random(1, 2, 8, 16, seed=120)
    rope_jit.apply_rope(q, None, cos, sin)  # builds the plan
    made.clear()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = rope_jit.apply_rope(q, None, cos, sin)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert [x is q for x in made] == [True]
    torch.testing.assert_close(out, expected(q, cos, sin, torch.arange(8)), rtol=2e-5, atol=2e-5)
    made.clear()
    rope_jit.apply_rope(q, None, cos, sin)
    assert made == [] or _plans._ALLOCATORS.get("cpu") is None


def test_the_last_plan_never_serves_a_call_that_gives_a_tensor_where_its_own_had_none():
    # Same q, k and tables; positions and xpos_scale absent, then given, then absent again:
    # each call follows its own arguments.
    cos, sin = hf_tables(torch.arange(32), 16)
    q = random(1, 2, 4, 16, seed=130)
    positions = torch.tensor([9, 3, 30, 0])
    cases = (None, positions, None, positions)
    for given in cases:  # (one function at a time: the last plan is the previous call's)
        out = torch.empty_like(q)
        rope_jit.rope(q, cos=cos, sin=sin, positions=given, q_out=out)
        want = expected(q, cos, sin, torch.arange(4) if given is None else given)
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    for given in cases:
        with torch.no_grad():
            got = rope_jit.apply_rope(q, None, cos, sin, positions=given)
        want = expected(q, cos, sin, torch.arange(4) if given is None else given)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_q_and_k_rotated_by_turns_are_served_by_the_two_last_plans_and_stay_right():
    # rotary-embedding-torch's way: q, then k (fewer heads), then q... each call with new data.
    cos, sin = hf_tables(torch.arange(32), 16)
    runtime = rope_jit.default_runtime()
    plans = fresh_plans(runtime)
    for seed in range(4):
        for heads in (4, 2):
            x = random(1, 16, heads, 16, seed=140 + 2 * seed + heads)
            with torch.no_grad():
                got = rope_jit.apply_rope(x, None, cos, sin, position_offset=seed, layout="bshd")
            want = expected(x.transpose(1, 2), cos, sin, torch.arange(16) + seed)
            torch.testing.assert_close(got.transpose(1, 2), want, rtol=2e-5, atol=2e-5)
    assert len(plans) == 2
    state = _plans._thread_state(runtime)
    # The last call's plan leads; the key the state holds is that plan's.
    assert state.last_plan is plans[tuple(state.last_key)] and state.other_plan in plans.values()
    assert state.last_key[2][0] == (1, 16, 2, 16)


def _count_guards_and_arms(monkeypatch):
    """Counts TensorGuards built, plans armed and calls the guards did not serve (found by
    their key) from now on; torch's guards still answer."""
    counts = {"guards": 0, "arms": 0, "keys": 0}
    new_guard, arm, find = _plans._new_guard, _plans.Plan.arm, _plans._find

    def counting_guard(tensors):
        counts["guards"] += 1
        return new_guard(tensors)

    def counting_arm(plan, signed):
        counts["arms"] += 1
        return arm(plan, signed)

    def counting_find(*args):
        counts["keys"] += 1
        return find(*args)

    monkeypatch.setattr(_plans, "_new_guard", counting_guard)
    monkeypatch.setattr(_plans.Plan, "arm", counting_arm)
    monkeypatch.setattr(_plans, "_find", counting_find)
    return counts


@pytest.mark.parametrize("aliasing", ["q_out is q", "k is q", "cos is sin"])
def test_calls_passing_one_tensor_twice_are_served_by_a_guard_and_distinct_ones_rearm_it_once(
    aliasing, monkeypatch
):
    # A TensorGuards refuses every call in which one object comes twice: such a plan's guard
    # checks each object once and the repeats by identity, so its calls are served without a
    # new guard per call; the same signature with distinct tensors re-arms it once.
    if _plans._new_guard is None:
        pytest.skip("needs torch's TensorGuards")
    counts = _count_guards_and_arms(monkeypatch)
    runtime = rope_jit.default_runtime()
    fresh_plans(runtime)
    tables = hf_tables(torch.arange(8), 16)

    def run(seed, aliased):
        q = random(1, 2, 8, 16, seed=150 + seed)
        other = random(1, 2, 8, 16, seed=160 + seed)
        cos, sin = tables
        if aliasing == "q_out is q":
            want = expected(q, cos, sin, torch.arange(8))
            target = q if aliased else other
            rope_jit.rope(q, cos=cos, sin=sin, q_out=target)
            got = (target,)
        elif aliasing == "k is q":
            want = expected(q, cos, sin, torch.arange(8))
            with torch.no_grad():
                got = rope_jit.apply_rope(q, q if aliased else other, cos, sin)
            got = got if aliased else got[:1]  # (k's result is another rotation)
        else:
            cos = sin if aliased else cos
            want = expected(q, cos, sin, torch.arange(8))
            with torch.no_grad():
                got = (rope_jit.apply_rope(q, None, cos, sin),)
        for tensor in got:
            torch.testing.assert_close(tensor, want, rtol=2e-5, atol=2e-5)

    for seed in range(4):
        run(seed, aliased=True)
    assert counts == {"guards": 1, "arms": 1, "keys": 1}  # (the build)
    for seed in range(4, 8):
        run(seed, aliased=False)
    assert counts == {"guards": 2, "arms": 2, "keys": 2}
    run(8, aliased=True)
    assert counts == {"guards": 3, "arms": 3, "keys": 3}
    assert len(_plans._plans_of(runtime)) == 1


def test_an_allocator_that_raises_is_dropped_and_empty_like_makes_the_outputs(monkeypatch):
    # (A torch whose private allocator's signature changed: TypeError on its first use.)
    calls = []

    def broken(shape, strides, dtype):
        calls.append(shape)
        raise TypeError("_empty_strided_cpu(): incompatible function arguments")

    monkeypatch.setattr(_plans, "_ALLOCATORS", {"cpu": broken})
    runtime = rope_jit.default_runtime()
    plans = fresh_plans(runtime)
    cos, sin = hf_tables(torch.arange(8), 16)
    for seed in range(3):
        q, k = random(1, 8, 2, 16, seed=170 + seed), random(1, 8, 1, 16, seed=180 + seed)
        with torch.no_grad():
            got_q, got_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
        for got, x in ((got_q, q), (got_k, k)):
            want = expected(x.transpose(1, 2), cos, sin, torch.arange(8)).transpose(1, 2)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            assert got.stride() == x.stride()
    assert len(calls) == 1 and "cpu" not in _plans._ALLOCATORS
    assert all(plan.allocate is None for plan in plans.values())


def test_an_allocator_failing_where_empty_like_fails_too_is_kept_and_the_error_raised(
    monkeypatch,
):
    # (Out of memory: not the allocator's fault; the caller sees empty_like's error.)
    def out_of_memory(*_):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(_plans, "_ALLOCATORS", {"cpu": out_of_memory})
    runtime = rope_jit.default_runtime()
    fresh_plans(runtime)
    cos, sin = hf_tables(torch.arange(8), 16)
    q = random(1, 2, 8, 16, seed=190)
    with torch.no_grad():
        rope_jit.apply_rope(q, None, cos, sin)  # the plan's build (empty_like's outputs)
        monkeypatch.setattr(_plans, "_empty_like", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            rope_jit.apply_rope(q, None, cos, sin)
    assert _plans._ALLOCATORS == {"cpu": out_of_memory}
    assert _plans._thread_state(runtime).last_plan.allocate is out_of_memory


def test_a_plans_first_call_allocates_each_output_once(monkeypatch):
    made = []
    real_empty_like, real_allocator = _plans._empty_like, _plans._ALLOCATORS.get("cpu")
    monkeypatch.setattr(_plans, "_empty_like", lambda x: made.append(x) or real_empty_like(x))
    if real_allocator is not None:
        monkeypatch.setitem(
            _plans._ALLOCATORS, "cpu", lambda *a: made.append(a) or real_allocator(*a)
        )
    runtime = rope_jit.default_runtime()
    fresh_plans(runtime)
    cos, sin = hf_tables(torch.arange(8), 16)
    q, k = random(1, 2, 8, 16, seed=200), random(1, 1, 8, 16, seed=201)
    with torch.no_grad():
        for calls in (1, 2):
            got_q, got_k = rope_jit.apply_rope(q, k, cos, sin)
            assert len(made) == 2 * calls  # q's output and k's
    torch.testing.assert_close(got_q, expected(q, cos, sin, torch.arange(8)), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_k, expected(k, cos, sin, torch.arange(8)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("default", ["meta device", "float64 dtype"])
def test_the_private_functions_self_test_passes_under_another_default_device_or_dtype(
    default, monkeypatch
):
    # The self-test runs at first use, maybe inside `with torch.device(...)` (or during CUDA
    # graph capture with a CUDA default device): its tensors name their device and dtype.
    if _plans._new_guard is None or not _plans._ALLOCATORS:
        pytest.skip("needs torch's TensorGuards and allocator")
    monkeypatch.setattr(_plans, "_new_guard", None)
    monkeypatch.setattr(_plans, "_ALLOCATORS", {})
    previous = torch.get_default_dtype()
    try:
        if default == "meta device":
            with torch.device("meta"):
                _plans._find_torch_internals(torch)
        else:
            torch.set_default_dtype(torch.float64)
            _plans._find_torch_internals(torch)
    finally:
        torch.set_default_dtype(previous)
    assert _plans._new_guard is not None and "cpu" in _plans._ALLOCATORS


def test_a_disabled_guard_is_never_consulted_even_by_a_plan_armed_before(monkeypatch):
    if _plans._new_guard is None:
        pytest.skip("needs torch's TensorGuards")
    runtime = rope_jit.default_runtime()
    fresh_plans(runtime)
    cos, sin = hf_tables(torch.arange(8), 16)
    with torch.no_grad():
        rope_jit.apply_rope(random(1, 2, 8, 16, seed=210), None, cos, sin)
    plan = _plans._thread_state(runtime).last_plan
    consulted = []
    guard = plan.guard
    plan.guard = lambda *tensors: consulted.append(tensors) or guard(*tensors)
    monkeypatch.setattr(_plans, "_new_guard", None)
    q = random(1, 2, 8, 16, seed=211)
    with torch.no_grad():
        got = rope_jit.apply_rope(q, None, cos, sin)
    torch.testing.assert_close(got, expected(q, cos, sin, torch.arange(8)), rtol=2e-5, atol=2e-5)
    assert consulted == [] and _plans._thread_state(runtime).last_plan is plan


@pytest.mark.parametrize("array", ["torch", "numpy"])
def test_a_head_that_cannot_be_compared_gets_the_general_paths_error_naming_the_argument(array):
    # mrope_sections holding an array of two values: comparing it with the last plan's head
    # raises; the general path names the argument.
    numpy = pytest.importorskip("numpy")
    section = torch.tensor([4, 4]) if array == "torch" else numpy.array([4, 4])
    cos, sin = hf_tables(torch.arange(8), 16)
    q = random(1, 2, 4, 16, seed=220)
    positions = torch.zeros(2, 4, dtype=torch.int64)
    out = torch.empty_like(q)
    for _ in range(2):  # built, then armed on a guard
        rope_jit.rope(q, cos=cos, sin=sin, positions=positions, mrope_sections=[4, 4], q_out=out)
    with pytest.raises(TypeError, match=r"mrope_sections\[0\]"):
        rope_jit.rope(q, cos=cos, sin=sin, positions=positions,
                      mrope_sections=[section, 4], q_out=out)
