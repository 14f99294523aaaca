"""apply_rope, the HF drop-in and attention under torch.func transforms (grad, jvp, jacfwd,
hessian, vmap of grad) and forward-mode AD (torch.autograd.forward_ad), against the same
transforms of a plain PyTorch RoPE. Before session 38 torch.func.grad refused the ops
("must override the setup_context staticmethod") and jvp / dual tensors silently got a zero
tangent. CPU tensors (the library's CPU reference), and CUDA ones when there is a GPU."""

import pytest

torch = pytest.importorskip("torch")

import rope_jit  # noqa: E402
from rope_jit import torch_ops  # noqa: E402
from torch_reference import hf_tables, rope_torch  # noqa: E402

func = torch.func
forward_ad = torch.autograd.forward_ad
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# float32 throughout: the library's rotation against torch's, a few ulps apart.
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


def random(shape, device, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device)


def half_tables(rows, rotary_dim, device, seed=0):
    angles = random((rows, rotary_dim // 2), "cpu", seed) * 4
    return angles.cos().to(device), angles.sin().to(device)


class Case:
    """A GQA call with partial rotary at positions: q [2, 4, 5, 16], k [2, 2, 5, 16] in
    either layout, rotary features 4..15 (12 of 16), half tables of 9 rows."""

    def __init__(self, device, layout, style):
        self.device, self.layout, self.style = device, layout, style
        self.cos, self.sin = half_tables(9, 12, device)
        self.positions = torch.tensor([[0, 3, 1, 8, 2], [5, 4, 7, 6, 0]], device=device)
        self.q = self.shaped(random((2, 4, 5, 16), device, 1))
        self.k = self.shaped(random((2, 2, 5, 16), device, 2))

    def shaped(self, bhsd):
        return bhsd if self.layout == "bhsd" else bhsd.transpose(1, 2).contiguous()

    def library(self, q, k, cos=None, sin=None, **extra):
        return rope_jit.apply_rope(
            q, k, self.cos if cos is None else cos, self.sin if sin is None else sin,
            positions=self.positions, rotary_dim=12, rotary_offset=4, style=self.style,
            layout=self.layout, **extra)

    def reference(self, q, k, cos=None, sin=None):
        def one(x):
            bhsd = x if self.layout == "bhsd" else x.transpose(1, 2)
            rotated = rope_torch(bhsd, self.cos if cos is None else cos,
                                 self.sin if sin is None else sin, self.positions,
                                 rotary_dim=12, rotary_offset=4, style=self.style)
            return rotated if self.layout == "bhsd" else rotated.transpose(1, 2)
        return one(q), one(k)


def cubes(pair):
    # A loss that is not linear in q and k, so that the hessian has something to show.
    return sum((x ** 3).sum() for x in pair)


def assert_all_close(got, expected, label):
    for index, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m: f"{label} [{index}]: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_apply_rope_under_torch_func_matches_the_same_transforms_of_plain_pytorch(
        device, layout, style):
    case = Case(device, layout, style)
    q, k = case.q, case.k
    tangent_q, tangent_k = random(q.shape, device, 3), random(k.shape, device, 4)

    got = func.grad(lambda q, k: cubes(case.library(q, k)), argnums=(0, 1))(q, k)
    expected = func.grad(lambda q, k: cubes(case.reference(q, k)), argnums=(0, 1))(q, k)
    assert_all_close(got, expected, "grad")

    got = func.jvp(case.library, (q, k), (tangent_q, tangent_k))
    expected = func.jvp(case.reference, (q, k), (tangent_q, tangent_k))
    assert_all_close(got[0] + got[1], expected[0] + expected[1], "jvp (primal, tangent)")
    assert got[1][0].abs().max() > 0.1  # (a zero tangent was the defect)

    q_small = q[:1, :1] if layout == "bhsd" else q[:1, :, :1]
    k_small = k[:1, :1] if layout == "bhsd" else k[:1, :, :1]
    small = Case(device, layout, style)
    small.positions = case.positions[:1]
    for name, transform in (("jacfwd", func.jacfwd), ("jacrev", func.jacrev)):
        got = transform(lambda q: small.library(q, k_small)[0])(q_small)
        expected = transform(lambda q: small.reference(q, k_small)[0])(q_small)
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"{name}: {m}")
    got = func.hessian(lambda q: cubes(small.library(q, k_small)))(q_small)
    expected = func.hessian(lambda q: cubes(small.reference(q, k_small)))(q_small)
    torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"hessian: {m}")

    # Per-sample gradients: vmap over the batch of grad of one sample's loss.
    def per_sample(run):
        def loss(q, k):
            return cubes(run(q[None], k[None]))
        return func.vmap(func.grad(loss, argnums=(0, 1)))
    single = Case(device, layout, style)
    single.positions = case.positions[:1]
    q_same = q[:1].expand_as(q).contiguous()  # (one sample's positions for every sample)
    k_same = k[:1].expand_as(k).contiguous() + random(k.shape, device, 5)
    assert_all_close(per_sample(single.library)(q_same, k_same),
                     per_sample(single.reference)(q_same, k_same), "vmap(grad)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope_carries_forward_ad_tangents(device, inplace):
    case = Case(device, "bshd", "half")
    tangent_q, tangent_k = random(case.q.shape, device, 6), random(case.k.shape, device, 7)
    expected_q, expected_k = case.reference(case.q, case.k)
    expected_tq, expected_tk = case.reference(tangent_q, tangent_k)
    with forward_ad.dual_level():
        q = forward_ad.make_dual(case.q.clone(), tangent_q.clone())
        k = forward_ad.make_dual(case.k.clone(), tangent_k.clone())
        q_out, k_out = case.library(q, k, inplace=inplace)
        if inplace:
            assert q_out is q and k_out is k
        for name, out, primal, tangent in (("q", q_out, expected_q, expected_tq),
                                           ("k", k_out, expected_k, expected_tk)):
            unpacked = forward_ad.unpack_dual(out)
            torch.testing.assert_close(unpacked.primal, primal, **TOLERANCE)
            assert unpacked.tangent is not None, f"{name}: the tangent was dropped"
            torch.testing.assert_close(unpacked.tangent, tangent, **TOLERANCE,
                                       msg=lambda m: f"{name} tangent: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_apply_rope_jvp_takes_the_tangents_of_cos_and_sin(device, style):
    # cos and sin enter linearly; the features outside the rotary span get no part of them.
    case = Case(device, "bhsd", style)
    tangent_cos, tangent_sin = half_tables(9, 12, device, seed=8)
    tangent_q = random(case.q.shape, device, 9)
    primals = (case.q, case.cos, case.sin)
    tangents = (tangent_q, tangent_cos, tangent_sin)
    got = func.jvp(lambda q, cos, sin: case.library(q, case.k, cos, sin), primals, tangents)
    expected = func.jvp(lambda q, cos, sin: case.reference(q, case.k, cos, sin), primals,
                        tangents)
    assert_all_close(got[1], expected[1], "tangents of (q, k)")
    assert got[1][1].abs().max() > 0.1  # k has no tangent of its own: only the tables'


def ops_call(case, q, k, cos=None, sin=None, inv_freq=None):
    """case's call through torch.ops.rope_jit.rope_qk (k None: rope) on [B, H, S, D] tensors."""
    cos, sin = (None, None) if inv_freq is not None else (
        case.cos if cos is None else cos, case.sin if sin is None else sin)
    tables = (cos, sin, inv_freq, case.positions, None, None, None)
    style = case.style == "interleaved"
    if k is None:
        return torch.ops.rope_jit.rope(q, *tables, 0, 12, 4, style, False)
    return torch.ops.rope_jit.rope_qk(q, k, *tables, 0, 0, 12, 4, style, False)


@pytest.mark.parametrize("device", DEVICES)
def test_the_ops_called_directly_carry_tangents_and_refuse_what_they_cannot(device):
    # Before session 39 torch.ops.rope_jit.rope and rope_qk under forward_ad gave a result
    # without a tangent, rope_ left its input's tangent unrotated, and a cos requiring grad got
    # none: all silently.
    case = Case(device, "bhsd", "half")
    tangent_q, tangent_k = random(case.q.shape, device, 21), random(case.k.shape, device, 22)
    tangent_cos, tangent_sin = half_tables(9, 12, device, seed=23)
    expected_tq, expected_tk = case.reference(tangent_q, tangent_k)
    expected_cos_part = func.jvp(lambda cos, sin: case.reference(case.q, case.k, cos, sin),
                                 (case.cos, case.sin), (tangent_cos, tangent_sin))[1]
    with forward_ad.dual_level():
        q = forward_ad.make_dual(case.q, tangent_q)
        k = forward_ad.make_dual(case.k, tangent_k)
        for label, outs, expected in (
                ("rope_qk", ops_call(case, q, k), (expected_tq, expected_tk)),
                ("rope", (ops_call(case, q, None),), (expected_tq,)),
                ("rope_qk by cos and sin",
                 ops_call(case, case.q, case.k, forward_ad.make_dual(case.cos, tangent_cos),
                          forward_ad.make_dual(case.sin, tangent_sin)), expected_cos_part)):
            tangents = [forward_ad.unpack_dual(out).tangent for out in outs]
            assert all(t is not None for t in tangents), f"{label}: the tangent was dropped"
            assert_all_close(tangents, expected, label)
        with pytest.raises(NotImplementedError, match="inv_freq varies"):
            ops_call(case, case.q, case.k,
                     inv_freq=forward_ad.make_dual(torch.ones(6, device=device),
                                                   torch.ones(6, device=device)))
        with pytest.raises(RuntimeError, match="q: is a dual tensor"):
            torch.ops.rope_jit.rope_(forward_ad.make_dual(case.q.clone(), tangent_q),
                                     case.cos, case.sin, None, case.positions, None, None, None,
                                     0, 12, 4, False, False)
    # Reverse mode as before, with the tables refused where they require grad.
    q = case.q.clone().requires_grad_()
    grad = random(case.q.shape, device, 24)
    ops_call(case, q, None).backward(grad)
    expected = torch.autograd.grad(case.reference(q, case.k)[0], q, grad)[0]
    torch.testing.assert_close(q.grad, expected, **TOLERANCE)
    with pytest.raises(NotImplementedError, match="cos requires grad"):
        ops_call(case, case.q, None, cos=case.cos.clone().requires_grad_())
    # torch.func reaches a Function from Python only: the ops say to call apply_rope.
    for transform in (lambda f: func.grad(lambda q: f(q).sum()),
                      lambda f: lambda q: func.jvp(f, (q,), (tangent_q,))):
        with pytest.raises(NotImplementedError, match="call rope_jit.apply_rope"):
            transform(lambda q: ops_call(case, q, None))(case.q)


def rope_inplace_call(case, q, cos=None):
    torch.ops.rope_jit.rope_(q, case.cos if cos is None else cos, case.sin, None,
                             case.positions, None, None, None, 0, 12, 4, False, False)


@pytest.mark.parametrize("device", DEVICES)
def test_the_ops_autograd_kernels_against_the_review_of_session_39(device):
    # Each part failed on the first version of the ops' Autograd kernels (9ac73ed).
    from torch.utils.flop_counter import FlopCounterMode
    case = Case(device, "bhsd", "half")
    tangent_q = random(case.q.shape, device, 31)
    tangent_cos, tangent_sin = half_tables(9, 12, device, seed=32)
    expected_tq = case.reference(tangent_q, case.k)[0]

    # A dual level under a dispatch mode: an internal assert of torch's ("InferenceMode").
    with FlopCounterMode(display=False), forward_ad.dual_level():
        for label, rotate in (("raw rope", lambda q: ops_call(case, q, None)),
                              ("apply_rope", lambda q: case.library(q, None))):
            out = rotate(forward_ad.make_dual(case.q, tangent_q))
            torch.testing.assert_close(forward_ad.unpack_dual(out).tangent, expected_tq,
                                       **TOLERANCE, msg=lambda m: f"{label}: {m}")

    # The raw ops on constants under torch.func: every tensor is wrapped there, and was taken
    # for one that varies (refused).
    weight = torch.tensor(1.5, device=device)
    expected = case.reference(case.q, case.k)[0].sum()
    for label, run in (
            ("grad", lambda f: func.grad(f)(weight)),
            ("jvp", lambda f: func.jvp(f, (weight,), (torch.ones((), device=device),))[1])):
        got = run(lambda y: (ops_call(case, case.q, None) * y).sum())
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"{label}: {m}")

    # Forward over reverse with dual cos and sin: the gradient's tangent lacked the tables'
    # part (the backward passed tables_vary False).
    upstream = random(case.q.shape, device, 33)

    def gradient(rotate, cos, sin):
        q = case.q.clone().requires_grad_()
        return torch.autograd.grad((rotate(q, cos, sin) * upstream).sum(), q,
                                   create_graph=True)[0]
    with forward_ad.dual_level():
        cos = forward_ad.make_dual(case.cos, tangent_cos)
        sin = forward_ad.make_dual(case.sin, tangent_sin)
        expected = forward_ad.unpack_dual(
            gradient(lambda q, c, s: case.reference(q, case.k, c, s)[0], cos, sin)).tangent
        assert expected.abs().max() > 0.1
        for label, rotate in (("raw rope", lambda q, c, s: ops_call(case, q, None, c, s)),
                              ("apply_rope", lambda q, c, s: case.library(q, None, c, s))):
            got = forward_ad.unpack_dual(gradient(rotate, cos, sin)).tangent
            torch.testing.assert_close(got, expected, **TOLERANCE,
                                       msg=lambda m: f"{label}: {m}")
        # A dual inv_freq is refused with q requiring grad too (it came out zero).
        with pytest.raises(NotImplementedError, match="inv_freq varies"):
            ops_call(case, case.q.clone().requires_grad_(), None,
                     inv_freq=forward_ad.make_dual(torch.ones(6, device=device),
                                                   torch.ones(6, device=device)))
        # The in-place ops: a dual table, not only a dual written tensor (silently untouched).
        with pytest.raises(RuntimeError, match="cos: is a dual tensor"):
            rope_inplace_call(case, case.q.clone(), cos)
    # ... under torch.func, where the kernel saw unwrapped tensors (a wrong tangent, gradient).
    with pytest.raises(RuntimeError, match="q: is a dual tensor"):
        func.jvp(lambda q: rope_inplace_call(case, q), (case.q.clone(),), (tangent_q,))
    with pytest.raises(RuntimeError, match="q: requires grad"):
        func.grad(lambda q: (rope_inplace_call(case, q), q.sum())[1])(case.q.clone())
    # ... a table requiring grad, as the out-of-place ops refuse it (accepted, silently).
    with pytest.raises(NotImplementedError, match="cos requires grad"):
        rope_inplace_call(case, case.q.clone(), case.cos.clone().requires_grad_())

    # torch_ops.attention under torch.func with a mask that requires grad: a zero gradient
    # (its refusal had moved into the op's kernel, which transforms skip).
    if rope_jit.has_attention():
        q, k, v = (random((1, 2, 4, 16), device, seed) for seed in (34, 35, 36))
        mask = random((4, 4), device, 37)
        with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
            func.grad(lambda m: torch_ops.attention(q, k, v, attn_mask=m).sum())(mask)


def test_inv_freq_is_refused_where_it_varies_and_taken_where_it_is_fixed():
    q = random((2, 2, 4, 8), "cpu", 10)
    inv_freq = torch.tensor([1.0, 0.1, 0.01, 0.001])
    cos, sin = half_tables(4, 8, "cpu")

    def with_inv_freq(q, f=inv_freq):
        return rope_jit.apply_rope(q, None, inv_freq=f)

    def with_tables(q):
        return rope_jit.apply_rope(q, None, cos, sin)

    # (inv_freq's angles are the tables' here: t * inv_freq at rows t = 0..3)
    angles = torch.arange(4.0)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    for name, transform in (("jvp", lambda f: func.jvp(f, (q,), (q,))[1]),
                            ("jacfwd", lambda f: func.jacfwd(f)(q[:1, :1])),
                            ("vmap(jvp)", lambda f: func.vmap(lambda x: func.jvp(f, (x,), (x,))[1])(q))):
        torch.testing.assert_close(transform(with_inv_freq), transform(with_tables), **TOLERANCE,
                                   msg=lambda m: f"{name}: {m}")
    for run in (lambda: func.jvp(lambda f: with_inv_freq(q, f), (inv_freq,), (torch.ones(4),)),
                lambda: func.jacfwd(lambda f: with_inv_freq(q, f))(inv_freq),
                lambda: func.grad(lambda f: with_inv_freq(q, f).sum())(inv_freq)):
        with pytest.raises((NotImplementedError, RuntimeError), match="inv_freq"):
            run()
    with forward_ad.dual_level():
        with pytest.raises(NotImplementedError, match="inv_freq varies"):
            with_inv_freq(q, forward_ad.make_dual(inv_freq, torch.ones(4)))
    with pytest.raises(NotImplementedError, match="cos requires grad"):
        func.grad(lambda cos: rope_jit.apply_rope(q, None, cos, sin).sum())(cos)


@pytest.mark.parametrize("device", DEVICES)
def test_the_hf_dropins_sequence_starts_made_under_a_transform_are_not_kept(device):
    # Made under torch.func.grad they were cached as a wrapper of its level, and the next
    # call of the same shape outside it failed ("Cannot access data pointer": GPU run FO).
    from rope_jit.dropin import hf

    shape = (3, 2, 7, 16)  # (a batch and length no other test uses: the cache is global)
    q, k = random(shape, device, 50), random(shape, device, 51)
    positions = torch.arange(7, device=device)[None] + torch.arange(3, device=device)[:, None]
    cos, sin = hf_tables(positions, 16)  # [B, S, R]: per-sequence rows, sequence starts
    expected = func.grad(lambda q: hf._transformers_formula(q, k, cos, sin, 1)[0].sum())(q)
    got = func.grad(lambda q: hf.apply_rotary_pos_emb(q, k, cos, sin)[0].sum())(q)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    leaf = q.clone().requires_grad_()
    hf.apply_rotary_pos_emb(leaf, k, cos, sin)[0].sum().backward()
    torch.testing.assert_close(leaf.grad, expected, **TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_gradients_of_the_eager_path(device):
    # autograd's is_grads_batched and the vectorized jacobian / hessian vmap the backward
    # (torch's older vmap): the eager path's backward handed the library tensors without
    # storage ("Cannot access data pointer": review of session 39).
    from rope_jit.dropin import hf

    case = Case(device, "bshd", "half")
    cos, sin = hf_tables(torch.arange(5, device=device)[None], 16)
    runs = {
        "apply_rope q, k": (lambda q: case.library(q, q[:, :, :2]),
                            lambda q: case.reference(q, q[:, :, :2])),
        "apply_rope q": (lambda q: case.library(q, None),
                         lambda q: case.reference(q, case.k)[0]),
        "hf": (lambda q: hf.apply_rotary_pos_emb(q.transpose(1, 2), q[:, :, :2].transpose(1, 2),
                                                 cos, sin),
               lambda q: hf._transformers_formula(q.transpose(1, 2),
                                                  q[:, :, :2].transpose(1, 2), cos, sin, 1)),
    }
    def as_tuple(outs):
        return outs if isinstance(outs, tuple) else (outs,)

    for name, (library, reference) in runs.items():
        def batched_grads(f):
            q = case.q.clone().requires_grad_()
            outs = as_tuple(f(q))
            grads = tuple(random((3,) + tuple(out.shape), device, 40 + i)
                          for i, out in enumerate(outs))
            return torch.autograd.grad(outs, q, grads, is_grads_batched=True)[0]
        torch.testing.assert_close(batched_grads(library), batched_grads(reference), **TOLERANCE,
                                   msg=lambda m: f"{name} is_grads_batched: {m}")
        small = case.q[:1, :, :2].contiguous()  # (positions of one sequence)
        case.positions, positions = case.positions[:1], case.positions
        for label, derivative in (
                ("jacobian", lambda f: torch.autograd.functional.jacobian(f, small,
                                                                          vectorize=True)),
                ("hessian", lambda f: torch.autograd.functional.hessian(
                    lambda x: cubes(as_tuple(f(x))), small, vectorize=True))):
            got, expected = derivative(library), derivative(reference)
            torch.testing.assert_close(got, expected, **TOLERANCE,
                                       msg=lambda m: f"{name} {label}: {m}")
        case.positions = positions
    if rope_jit.has_attention():  # (with create_graph it failed: no batching rule for detach)
        q, k, v = (random((1, 2, 4, 16), device, seed) for seed in (44, 45, 46))
        cos, sin = half_tables(4, 16, device, seed=47)
        cotangents = random((3, 1, 2, 4, 16), device, 48)
        for create_graph in (False, True):
            got, expected = (torch.autograd.grad(f(leaf), leaf, cotangents, is_grads_batched=True,
                                                 create_graph=create_graph)[0]
                             for f, leaf in (
                                 (lambda x: torch_ops.attention(x, k, v, cos, sin),
                                  q.clone().requires_grad_()),
                                 (lambda x: attention_reference(x, k, v, cos, sin),
                                  q.clone().requires_grad_())))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"attention, create_graph {create_graph}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_reverse_mode_through_vmapped_calls_and_nested_transforms(device):
    # grad of vmap, vmap(...).backward() and jacrev of jacrev raised "flat_bdims must not be
    # None" (two saved-tensor lists of different lengths: review of session 38).
    from rope_jit.dropin import hf

    case = Case(device, "bhsd", "half")
    case.positions = case.positions[:1]  # (one sequence: the nested jacobians stay small)
    cos, sin = hf_tables(torch.arange(5, device=device)[None], 16)
    runs = {
        "apply_rope": (lambda x: case.library(x, x[:, :2])[0],
                       lambda x: case.reference(x, x[:, :2])[0]),
        "hf": (lambda x: hf.apply_rotary_pos_emb(x, x, cos, sin)[0],
               lambda x: hf._transformers_formula(x, x, cos, sin, 1)[0]),
    }
    x = random((3, 1, 4, 5, 16), device, 20)
    for name, (library, reference) in runs.items():
        got, expected = (func.grad(lambda x: cubes((func.vmap(f)(x),)))(x)
                         for f in (library, reference))
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"{name} grad(vmap): {m}")
        leaf = x.clone().requires_grad_()
        cubes((func.vmap(library)(leaf),)).backward()
        torch.testing.assert_close(leaf.grad, expected, **TOLERANCE,
                                   msg=lambda m: f"{name} vmap().backward(): {m}")
        small = x[0, :1, :1]
        got, expected = (func.jacrev(func.jacrev(lambda x: cubes((f(x),))))(small)
                         for f in (library, reference))
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"{name} jacrev(jacrev): {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_packed_thd_calls_under_compile_vmap_and_jvp(device):
    # The ops took 3-D q as [B, H, S, D] and refused it: layout "thd" failed under
    # torch.compile and every transform (review of session 38).
    cos, sin = half_tables(8, 16, device)
    cu_seqlens = torch.tensor([0, 3, 7], device=device, dtype=torch.int32)
    q, k = random((7, 4, 16), device, 21), random((7, 2, 16), device, 22)

    def library(q, k):
        return rope_jit.apply_rope(q, k, cos, sin, cu_seqlens=cu_seqlens, layout="thd")

    rows = torch.tensor([0, 1, 2, 0, 1, 2, 3], device=device)

    def reference(q, k):
        def one(x):  # [T, H, D] as [1, H, T, D] at each token's row
            return rope_torch(x.transpose(0, 1)[None], cos, sin, rows)[0].transpose(0, 1)
        return one(q), one(k)

    assert_all_close(library(q, k), reference(q, k), "eager")
    assert_all_close(torch.compile(library, fullgraph=True, backend="aot_eager")(q, k),
                     reference(q, k), "torch.compile")
    got = func.jvp(library, (q, k), (k.repeat(1, 2, 1), q[:, :2]))
    expected = func.jvp(reference, (q, k), (k.repeat(1, 2, 1), q[:, :2]))
    assert_all_close(got[1], expected[1], "jvp")
    batch = torch.stack((q, 2 * q))
    torch.testing.assert_close(func.vmap(lambda x: library(x, k)[0])(batch),
                               torch.stack([reference(x, k)[0] for x in batch]), **TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
def test_the_hf_dropin_under_jvp_grad_and_forward_ad(device):
    from rope_jit.dropin import hf

    q, k = random((2, 4, 5, 8), device, 11), random((2, 2, 5, 8), device, 12)
    cos, sin = hf_tables(torch.arange(5, device=device)[None].expand(2, 5), 8)
    tangent_q, tangent_k = random(q.shape, device, 13), random(k.shape, device, 14)

    def formula(q, k):
        return hf._transformers_formula(q, k, cos, sin, 1)

    def dropin(q, k):
        return hf.apply_rotary_pos_emb(q, k, cos, sin)

    got, expected = (func.jvp(f, (q, k), (tangent_q, tangent_k)) for f in (dropin, formula))
    assert_all_close(got[0] + got[1], expected[0] + expected[1], "jvp")
    got, expected = (func.grad(lambda q, k: cubes(f(q, k)), argnums=(0, 1))(q, k)
                     for f in (dropin, formula))
    assert_all_close(got, expected, "grad")
    # Tangents of the tables (full [B, S, D] tables, not the same in both halves): the
    # formula's derivative, in every column, as the code the drop-in replaces.
    tangent_cos, tangent_sin = random(cos.shape, device, 15), random(sin.shape, device, 16)
    got, expected = (func.jvp(lambda q, c, s: (f(q, k, c, s)), (q, cos, sin),
                              (tangent_q, tangent_cos, tangent_sin))
                     for f in (lambda q, k, c, s: hf.apply_rotary_pos_emb(q, k, c, s),
                               lambda q, k, c, s: hf._transformers_formula(q, k, c, s, 1)))
    assert_all_close(got[1], expected[1], "jvp of the tables")
    with forward_ad.dual_level():
        out = dropin(forward_ad.make_dual(q, tangent_q), k)
        tangent = forward_ad.unpack_dual(out[0]).tangent
        assert tangent is not None, "the drop-in's fast path dropped the tangent"
        torch.testing.assert_close(tangent, formula(tangent_q, k)[0], **TOLERANCE)


def attention_reference(q, k, v, cos, sin):
    rotated_q = rope_torch(q, cos, sin, torch.arange(q.shape[2]))
    rotated_k = rope_torch(k, cos, sin, torch.arange(k.shape[2]))
    rotated_k = rotated_k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = rotated_q @ rotated_k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("device", DEVICES)
def test_attention_under_torch_func_grads_match_and_forward_mode_raises(device):
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    q = random((2, 4, 6, 16), device, 15)
    k, v = random((2, 2, 6, 16), device, 16), random((2, 2, 6, 16), device, 17)
    cos, sin = half_tables(6, 16, device, seed=18)

    def fused(q, k, v):
        return torch_ops.attention(q, k, v, cos, sin)

    def reference(q, k, v):
        return attention_reference(q, k, v, cos, sin)

    torch.testing.assert_close(fused(q, k, v), reference(q, k, v), rtol=1e-4, atol=1e-4)
    got, expected = (func.grad(lambda q, k, v: (f(q, k, v) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
                     for f in (fused, reference))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    def per_sample(f):
        return func.vmap(func.grad(lambda q, k, v: (f(q[None], k[None], v[None]) ** 2).sum()))
    torch.testing.assert_close(per_sample(fused)(q, k, v), per_sample(reference)(q, k, v),
                               rtol=1e-4, atol=1e-4)

    with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
        func.jvp(fused, (q, k, v), (q, k, v))
    with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
        func.hessian(lambda q: (fused(q, k, v) ** 2).sum())(q)
    with pytest.raises(RuntimeError, match="not differentiable"):
        func.jacrev(func.grad(lambda q: (fused(q, k, v) ** 2).sum()))(q)
    with forward_ad.dual_level():
        with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
            fused(forward_ad.make_dual(q, q), k, v)
        # Without dual inputs a dual level changes nothing.
        torch.testing.assert_close(fused(q, k, v), reference(q, k, v), rtol=1e-4, atol=1e-4)

    # The op called directly: the same refusal under forward AD, and under torch.func a
    # pointer to the function that works there.
    def raw(q, k, v):
        return torch.ops.rope_jit.attention(q, k, v, cos, sin, None, None, False, 0.0, 0,
                                            False)[0]
    with forward_ad.dual_level():
        with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
            raw(forward_ad.make_dual(q, q), k, v)
    with pytest.raises(NotImplementedError, match="call rope_jit.torch_ops.attention"):
        func.grad(lambda q: raw(q, k, v).sum())(q)
    q_grad = q.clone().requires_grad_()
    raw(q_grad, k, v).sum().backward()
    torch.testing.assert_close(q_grad.grad, func.grad(lambda q: reference(q, k, v).sum())(q),
                               rtol=1e-4, atol=1e-4)
