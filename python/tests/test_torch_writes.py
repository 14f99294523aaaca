"""Torch tensors the library writes through their data pointers (rope()'s q and k in place or
q_out/k_out, apply_rope(inplace=True) without autograd, torch.ops.rope_jit.rope_/rope_qk_, a KV
cache): each write counts in the tensor's version counter as a torch in-place op's does; a tensor
that requires grad in grad mode (whose write autograd would not record) is refused before anything
is written; inference tensors are written, and counted nowhere (they have no counter). Also tensors the library must not
read as raw memory (the negative bit), meta tensors, and empty q and k. Every case runs twice
with tensors of one signature: once building the plan, once through it. CPU tensors (the
library's CPU reference); skipped without torch."""

import pytest

torch = pytest.importorskip("torch")

import rope_jit  # noqa: E402
from rope_jit import _plans, torch_ops  # noqa: E402,F401  (defines the rope_jit:: ops)
from torch_reference import hf_tables, rope_torch  # noqa: E402
from torch_support import fresh_plans, random  # noqa: E402

B, HQ, HK, S, D = 1, 4, 2, 6, 16
OFFSET = 2
EPS = 1e-6
COS, SIN = hf_tables(torch.arange(16), D)


def rotated(x, offset=OFFSET):
    return rope_torch(x.detach(), COS, SIN, torch.arange(x.shape[2]) + offset)


def rms_normed(x, weight):
    x = x.detach().double()
    return (x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight.double()).float()


def same_bytes(a, b):
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- the writers ----------------------------------------------------------------------------
#
# Each takes the tensors of one call (q, k, q_out, k_out, w: a dict) and writes `written`;
# `expect` gives those tensors' values from the inputs, by the references above.


class Writer:
    def __init__(self, name, written, call, expect, autograd_records=False):
        self.name, self.written, self.call, self.expect = name, written, call, expect
        # apply_rope records a call on tensors that require grad (its own Function), so its
        # in-place writes never meet them.
        self.autograd_records = autograd_records

    def __str__(self):
        return self.name


def _op_tables():
    return (COS, SIN, None, None, None, None, None)


WRITERS = [
    Writer(
        "apply_rope(q, inplace=True)",
        ("q",),
        lambda t: rope_jit.apply_rope(t["q"], None, COS, SIN, position_offset=OFFSET, inplace=True),
        lambda t: {"q": rotated(t["q"])},
        autograd_records=True,
    ),
    Writer(
        "apply_rope(q, k, inplace=True)",
        ("q", "k"),
        lambda t: rope_jit.apply_rope(
            t["q"], t["k"], COS, SIN, position_offset=OFFSET, inplace=True
        ),
        lambda t: {"q": rotated(t["q"]), "k": rotated(t["k"])},
        autograd_records=True,
    ),
    Writer(
        "rope(q, k) in place",
        ("q", "k"),
        lambda t: rope_jit.rope(t["q"], t["k"], cos=COS, sin=SIN, position_offset=OFFSET),
        lambda t: {"q": rotated(t["q"]), "k": rotated(t["k"])},
    ),
    Writer(
        "rope(q, k, q_out, k_out)",
        ("q_out", "k_out"),
        lambda t: rope_jit.rope(
            t["q"], t["k"], cos=COS, sin=SIN, q_out=t["q_out"], k_out=t["k_out"],
            position_offset=OFFSET,
        ),
        lambda t: {"q_out": rotated(t["q"]), "k_out": rotated(t["k"])},
    ),
    Writer(
        "rope(q, k) with QK-norm (the general path)",
        ("q", "k"),
        lambda t: rope_jit.rope(
            t["q"], t["k"], cos=COS, sin=SIN, position_offset=OFFSET, q_norm_weight=t["w"],
            k_norm_weight=t["w"], norm_eps=EPS,
        ),
        lambda t: {"q": rotated(rms_normed(t["q"], t["w"])), "k": rotated(rms_normed(t["k"], t["w"]))},
    ),
    Writer(
        "torch.ops.rope_jit.rope_",
        ("q",),
        lambda t: torch.ops.rope_jit.rope_(t["q"], *_op_tables(), OFFSET, 0, 0, False, False),
        lambda t: {"q": rotated(t["q"])},
    ),
    Writer(
        "torch.ops.rope_jit.rope_qk_",
        ("q", "k"),
        lambda t: torch.ops.rope_jit.rope_qk_(
            t["q"], t["k"], *_op_tables(), OFFSET, 0, 0, 0, False, False
        ),
        lambda t: {"q": rotated(t["q"]), "k": rotated(t["k"])},
    ),
]
# The writers whose written tensors rope-jit itself must refuse when they require grad.
UNRECORDED = [writer for writer in WRITERS if not writer.autograd_records]


def make_tensors(seed, requires_grad=()):
    """The tensors of one call, the names in `requires_grad` as leaves that require grad."""
    tensors = {
        "q": random(B, HQ, S, D, seed=seed),
        "k": random(B, HK, S, D, seed=seed + 1),
        "q_out": random(B, HQ, S, D, seed=seed + 2),
        "k_out": random(B, HK, S, D, seed=seed + 3),
    }
    for name in requires_grad:
        tensors[name].requires_grad_(True)
    tensors["w"] = torch.rand(D, generator=torch.Generator().manual_seed(seed + 4)) + 0.5
    return tensors


def check_values(writer, tensors, inputs):
    """The written tensors hold the reference's values; the others are unchanged."""
    want = writer.expect(inputs)
    for name in ("q", "k", "q_out", "k_out"):
        if name in writer.written:
            torch.testing.assert_close(
                tensors[name].detach(), want[name], rtol=5e-5, atol=5e-5, msg=f"{name} of {writer}"
            )
        else:
            assert same_bytes(tensors[name], inputs[name]), f"{writer} wrote {name}"


def snapshot(tensors):
    return {name: tensor.detach().clone() for name, tensor in tensors.items()}


# ---- version counter ------------------------------------------------------------------------


@pytest.mark.parametrize("writer", WRITERS, ids=str)
def test_each_write_counts_in_the_version_counter_and_matches_the_reference(writer):
    fresh_plans(rope_jit.default_runtime())
    for seed in (0, 10, 20):  # the first call builds the plan, the others go through it
        tensors = make_tensors(seed)
        inputs = snapshot(tensors)
        versions = {name: tensor._version for name, tensor in tensors.items()}
        writer.call(tensors)
        for name, tensor in tensors.items():
            if name in writer.written:
                assert tensor._version > versions[name], f"{name} of {writer} (call {seed})"
            else:
                assert tensor._version == versions[name], f"{name} of {writer} (call {seed})"
        check_values(writer, tensors, inputs)


@pytest.mark.parametrize("writer", WRITERS, ids=str)
def test_a_backward_that_saved_a_written_tensor_fails_instead_of_using_the_new_values(writer):
    fresh_plans(rope_jit.default_runtime())
    for seed in (0, 10):
        tensors = make_tensors(seed)
        inputs = snapshot(tensors)
        weight = torch.ones(B, HQ, S, D, requires_grad=True)
        # Autograd saves q (and q_out) for d(loss)/d(weight); only what the call writes
        # invalidates the saved value.
        losses = {name: (tensors[name] * weight).sum() for name in ("q", "q_out")}
        writer.call(tensors)
        for name, loss in losses.items():
            if name in writer.written:
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    loss.backward()
            else:
                (grad,) = torch.autograd.grad(loss, (weight,))
                torch.testing.assert_close(grad, inputs[name], rtol=0, atol=0)


def test_torch_in_place_ops_and_rope_jit_writes_count_alike():
    # rope() in place counts one write per written tensor, like q.mul_(1).
    tensors = make_tensors(30)
    reference = tensors["q"].clone()
    for _ in range(2):
        before, reference_before = tensors["q"]._version, reference._version
        rope_jit.rope(tensors["q"], tensors["k"], cos=COS, sin=SIN, position_offset=OFFSET)
        reference.mul_(1)
        assert tensors["q"]._version - before == reference._version - reference_before == 1


def test_a_normal_tensor_written_inside_inference_mode_counts_the_write():
    for seed in (0, 10):
        tensors = make_tensors(seed)
        inputs = snapshot(tensors)
        before = tensors["q"]._version
        with torch.inference_mode():
            rope_jit.apply_rope(tensors["q"], None, COS, SIN, position_offset=OFFSET, inplace=True)
        assert tensors["q"]._version > before
        torch.testing.assert_close(tensors["q"], rotated(inputs["q"]), rtol=2e-5, atol=2e-5)


def test_a_kv_cache_write_counts_in_the_caches_and_q_not_in_k():
    block_size = 2
    slot = torch.tensor([5, 0, 2, 7, 1, 4])
    for seed in (0, 10):  # (the general path: KV cache calls take no plan)
        q, k, v = (random(B, S, h, D, seed=seed + i) for i, h in enumerate((HQ, HK, HK)))
        k_cache, v_cache = torch.zeros(4, block_size, HK, D), torch.zeros(4, block_size, HK, D)
        q_in, k_in = q.clone(), k.clone()
        versions = [t._version for t in (q, k, v, k_cache, v_cache)]
        rope_jit.rope(q, k, v=v, cos=COS, sin=SIN, position_offset=OFFSET, layout="bshd",
                      kv_layout="nhd", k_cache=k_cache, v_cache=v_cache, slot_mapping=slot)
        changed = [t._version > before for t, before in zip((q, k, v, k_cache, v_cache), versions)]
        assert changed == [True, False, False, True, True]
        torch.testing.assert_close(q, rotated(q_in.transpose(1, 2)).transpose(1, 2), rtol=2e-5, atol=2e-5)
        assert same_bytes(k, k_in)
        want_k = rotated(k_in.transpose(1, 2)).transpose(1, 2)
        for token, cell in enumerate(slot.tolist()):
            where = (cell // block_size, cell % block_size)
            torch.testing.assert_close(k_cache[where], want_k[0, token], rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(v_cache[where], v[0, token], rtol=0, atol=0)


def test_a_kv_cache_that_requires_grad_is_refused_and_left_unwritten():
    q, k, v = (random(B, S, h, D, seed=40 + i) for i, h in enumerate((HQ, HK, HK)))
    k_cache = torch.zeros(4, 2, HK, D, requires_grad=True)
    v_cache = torch.zeros(4, 2, HK, D)
    before = snapshot({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    with pytest.raises(RuntimeError, match="^k_cache: requires grad"):
        rope_jit.rope(q, k, v=v, cos=COS, sin=SIN, layout="bshd", kv_layout="nhd",
                      k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.arange(S))
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert same_bytes(tensor, before[name]), name


# ---- tensors torch would not let an in-place op write ---------------------------------------


@pytest.mark.parametrize(
    "writer,name",
    [(writer, name) for writer in UNRECORDED for name in writer.written],
    ids=lambda value: str(value),
)
def test_a_written_tensor_that_requires_grad_is_refused_in_grad_mode_and_allowed_in_no_grad(
    writer, name
):
    fresh_plans(rope_jit.default_runtime())

    def refused(seed):
        tensors = make_tensors(seed, requires_grad=(name,))
        before = snapshot(tensors)
        with pytest.raises(RuntimeError, match=f"^{name}: requires grad"):
            writer.call(tensors)
        for other, tensor in tensors.items():
            assert same_bytes(tensor, before[other]), f"{other} written by a refused {writer}"

    refused(0)  # (builds the plan)
    tensors = make_tensors(10, requires_grad=(name,))
    inputs = snapshot(tensors)
    with torch.no_grad():
        writer.call(tensors)  # the same signature: through the plan
    check_values(writer, tensors, inputs)
    refused(20)  # the plan exists and its guard saw this tensor kind last
    with torch.no_grad():
        tensors = make_tensors(30, requires_grad=(name,))
        inputs = snapshot(tensors)
        writer.call(tensors)
        check_values(writer, tensors, inputs)


def test_a_non_leaf_that_requires_grad_is_refused_in_grad_mode_too():
    leaf = random(B, HQ, S, D, seed=50, requires_grad=True)
    for _ in range(2):
        q = leaf * 1.0  # not a leaf: torch would record q.mul_(); rope-jit cannot
        before = q.detach().clone()
        with pytest.raises(RuntimeError, match="^q: requires grad"):
            rope_jit.rope(q, cos=COS, sin=SIN)
        assert same_bytes(q, before)


@pytest.mark.parametrize("writer", WRITERS, ids=str)
def test_an_inference_tensor_is_written_inside_inference_mode_and_out(writer):
    # Inference tensors have no version counter and can never be saved for a backward: the
    # library writes them in or out of inference mode (torch's own in-place ops refuse the
    # latter, for no gradient's sake) and counts nothing.
    fresh_plans(rope_jit.default_runtime())

    def inference_tensors(seed):
        with torch.inference_mode():
            tensors = make_tensors(seed)
        assert all(tensor.is_inference() for tensor in tensors.values())
        return tensors

    for seed in (0, 20):  # while the plan is new, then after it served a call
        tensors = inference_tensors(seed)
        inputs = snapshot(tensors)
        writer.call(tensors)
        check_values(writer, tensors, inputs)

        tensors = inference_tensors(seed + 10)
        inputs = snapshot(tensors)
        with torch.inference_mode():
            writer.call(tensors)
        check_values(writer, tensors, inputs)


# ---- the negative bit -----------------------------------------------------------------------


def negated(x, how):
    """(a tensor equal to x with its negative bit set, the memory it lies in); the memory
    holds -x."""
    if how == "_neg_view":
        memory = -x.detach()
        return torch._neg_view(memory), memory
    memory = torch.complex(torch.zeros_like(x), -x.detach())  # imag holds -x
    return memory.conj().imag, memory


def plain_like(view, how):
    """A tensor of the same signature as a negated() one (shape, strides, dtype), no negative
    bit: its plan is the one the negated tensor would find."""
    if how == "_neg_view":
        return view.resolve_neg().clone()
    return torch.complex(torch.zeros_like(view), view.resolve_neg()).imag


NEG_CALLS = {
    # name: (the argument that has the negative bit, the call given q, k, q_out)
    "apply_rope(q)": ("q", lambda q, k, q_out: rope_jit.apply_rope(q, None, COS, SIN)),
    "apply_rope(q, k): k": ("k", lambda q, k, q_out: rope_jit.apply_rope(q, k, COS, SIN)),
    "apply_rope(q, inplace=True)": (
        "q", lambda q, k, q_out: rope_jit.apply_rope(q, None, COS, SIN, inplace=True)),
    "apply_rope(q, k, inplace=True): k": (
        "k", lambda q, k, q_out: rope_jit.apply_rope(q, k, COS, SIN, inplace=True)),
    "rope(q) in place": ("q", lambda q, k, q_out: rope_jit.rope(q, cos=COS, sin=SIN)),
    "rope(q, q_out)": ("q", lambda q, k, q_out: rope_jit.rope(q, cos=COS, sin=SIN, q_out=q_out)),
    "rope(q, q_out): q_out": (
        "q_out", lambda q, k, q_out: rope_jit.rope(q, cos=COS, sin=SIN, q_out=q_out)),
    "rope(q, k) in place: k": ("k", lambda q, k, q_out: rope_jit.rope(q, k, cos=COS, sin=SIN)),
}


@pytest.mark.parametrize("how", ["_neg_view", "conj().imag"])
@pytest.mark.parametrize("case", list(NEG_CALLS))
def test_a_tensor_with_the_negative_bit_is_refused_also_after_its_signature_has_a_plan(case, how):
    name, call = NEG_CALLS[case]
    shapes = {"q": (B, HQ, S, D), "k": (B, HK, S, D), "q_out": (B, HQ, S, D)}

    def arguments(seed, neg):
        values = {key: random(*shape, seed=seed + i) for i, (key, shape) in enumerate(shapes.items())}
        view, memory = negated(values[name], how)
        values[name] = view if neg else plain_like(view, how)
        return values, memory

    # A plain call of the same signature first: its plan exists when the negated tensor comes.
    for seed in (0, 10):
        values, _ = arguments(seed, neg=False)
        inputs = snapshot(values)
        result = call(**values)
        got_q = result[0] if isinstance(result, tuple) else result  # (rope() returns (q, k))
        torch.testing.assert_close(got_q, rotated(inputs["q"], offset=0), rtol=2e-5, atol=2e-5)
    for seed in (20, 30):
        values, memory = arguments(seed, neg=True)
        assert values[name].is_neg()
        before = snapshot({**values, "memory": memory})
        with pytest.raises(ValueError, match=f"^{name}: .*{name}\\.resolve_neg\\(\\)"):
            call(**values)
        assert same_bytes(memory, before["memory"])
        for other in ("q", "k", "q_out"):
            assert same_bytes(values[other].resolve_neg(), before[other].resolve_neg()), other


def test_a_negative_bit_q_that_requires_grad_is_refused_by_apply_rope():
    for seed in (0, 10):
        leaf = random(B, HQ, S, D, seed=seed, requires_grad=True)
        rope_jit.apply_rope(leaf * 1.0, None, COS, SIN).sum().backward()  # the plain signature
        q = torch._neg_view(leaf)
        assert q.is_neg()
        with pytest.raises(ValueError, match="^q: .*q\\.resolve_neg\\(\\)"):
            rope_jit.apply_rope(q, None, COS, SIN)


# ---- meta tensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("with_k", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_apply_rope_on_meta_tensors_gives_meta_tensors_of_the_ops_shapes(requires_grad, with_k, layout):
    def shape(heads):
        return (2, heads, 5, D) if layout == "bhsd" else (2, 5, heads, D)

    # A CPU call of the same shapes first: its plan exists (meta tensors must not take it).
    cpu_q = random(*shape(3), seed=1)
    cpu_k = random(*shape(1), seed=2) if with_k else None
    rope_jit.apply_rope(cpu_q, cpu_k, COS, SIN, layout=layout)
    cos, sin = COS.to("meta"), SIN.to("meta")
    for _ in range(2):
        q = torch.empty(shape(3), device="meta", requires_grad=requires_grad)
        k = torch.empty(shape(1), device="meta", requires_grad=requires_grad) if with_k else None
        out = rope_jit.apply_rope(q, k, cos, sin, layout=layout)
        outs = out if with_k else (out,)
        assert len(outs) == (2 if with_k else 1)
        for got, source in zip(outs, (q, k)):
            assert got.device.type == "meta" and got.shape == source.shape
            assert got.dtype == source.dtype and got.requires_grad == requires_grad
        if requires_grad:
            sum(got.sum() for got in outs).backward()
            for source in (q, k)[: len(outs)]:
                assert source.grad.device.type == "meta" and source.grad.shape == source.shape


def test_apply_rope_in_place_on_meta_tensors_returns_them():
    q = torch.empty(2, 3, 5, D, device="meta")
    k = torch.empty(2, 1, 5, D, device="meta")
    for _ in range(2):
        got_q, got_k = rope_jit.apply_rope(q, k, COS.to("meta"), SIN.to("meta"), inplace=True)
        assert got_q is q and got_k is k


# ---- empty q and k --------------------------------------------------------------------------


EMPTY_SHAPES = [((2, 4, 0, 8), (2, 2, 0, 8)), ((0, 4, 5, 8), (0, 2, 5, 8))]


@pytest.mark.parametrize("shapes", EMPTY_SHAPES, ids=str)
def test_empty_q_and_k_in_one_call_are_a_no_op(shapes):
    cos, sin = hf_tables(torch.arange(16), 8)
    for _ in range(2):  # the second call of each signature goes through its plan
        q, k = torch.randn(shapes[0]), torch.randn(shapes[1])
        assert q.data_ptr() == k.data_ptr() == 0  # the case: both "at" address 0
        out_q, out_k = rope_jit.apply_rope(q, k, cos, sin)
        assert out_q.shape == q.shape and out_k.shape == k.shape
        got_q, got_k = rope_jit.apply_rope(q, k, cos, sin, inplace=True)
        assert got_q is q and got_k is k
        assert rope_jit.rope(q, k, cos=cos, sin=sin) == (q, k)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        assert rope_jit.rope(q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out) == (q_out, k_out)
        torch.ops.rope_jit.rope_qk_(q, k, cos, sin, None, None, None, None, None, 0, 0, 0, 0, False, False)
        out_q, out_k = torch.ops.rope_jit.rope_qk(
            q, k, cos, sin, None, None, None, None, None, 0, 0, 0, 0, False, False
        )
        assert out_q.shape == q.shape and out_k.shape == k.shape


@pytest.mark.parametrize("shapes", EMPTY_SHAPES, ids=str)
def test_empty_q_and_k_that_require_grad_give_empty_gradients(shapes):
    cos, sin = hf_tables(torch.arange(16), 8)
    for _ in range(2):
        q = torch.randn(shapes[0], requires_grad=True)
        k = torch.randn(shapes[1], requires_grad=True)
        out_q, out_k = rope_jit.apply_rope(q, k, cos, sin)
        (out_q.sum() + out_k.sum()).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_empty_inputs_still_refuse_a_real_alias():
    # (The library's empty-tensor exception must not let non-empty q and k share memory.)
    cos, sin = hf_tables(torch.arange(16), 8)
    q = torch.randn(1, 2, 4, 8)
    before = q.clone()
    with pytest.raises(rope_jit.InvalidArgumentError, match="k: is the same memory as q"):
        rope_jit.rope(q, q, cos=cos, sin=sin)
    assert same_bytes(q, before)



def test_attention_outputs_count_their_write_and_refuse_a_tensor_that_requires_grad():
    """attention(q, k, v, out) writes `out` (and lse) as rope() writes its outputs: a backward
    that saved `out` raises instead of using the new values, and an `out` that requires grad
    in grad mode is refused, unwritten (adversarial pass, session 35)."""
    q, k, v = (random(1, 2, 8, 16, seed=seed) for seed in (1, 2, 3))
    out = torch.zeros(1, 2, 8, 16)
    weight = torch.ones(1, requires_grad=True)
    saved = (weight * out).sum()  # saves out
    rope_jit.attention(q, k, v, out, causal=True)
    assert out._version == 1
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()

    leaf = torch.zeros(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="^out: requires grad"):
        rope_jit.attention(q, k, v, leaf)
    assert torch.equal(leaf.detach(), torch.zeros(1, 2, 8, 16))
    with torch.no_grad():
        rope_jit.attention(q, k, v, leaf, causal=True)
    torch.testing.assert_close(leaf.detach(), expected, rtol=1e-5, atol=1e-5)
