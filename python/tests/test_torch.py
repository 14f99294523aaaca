"""The PyTorch integration: rope_jit.apply_rope and the rope_jit:: custom ops, forward and
gradients against autograd of a plain PyTorch RoPE, torch.library.opcheck, and torch.compile
without graph breaks. Runs on the CPU (the library's CPU reference) and, when there is one, on
the GPU."""

import pytest

torch = pytest.importorskip("torch")

import rope_jit  # noqa: E402
from rope_jit import torch_ops  # noqa: E402
from torch_reference import hf_tables, rope_torch  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tables(rows, rotary_dim, style, kind, device, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = rotary_dim // 2 if kind == "half" else rotary_dim
    angles = torch.rand(rows, rotary_dim // 2, generator=generator) * 8 - 4
    if kind == "full":
        angles = torch.cat((angles, angles), -1) if style == "half" else angles.repeat_interleave(2, -1)
    assert angles.shape[-1] == width
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def random(shape, device, dtype, seed, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device, dtype).requires_grad_(requires_grad)


def assert_close(got, expected, dtype, label):
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("table_kind", ["half", "full"])
def test_apply_rope_and_its_gradients_match_autograd_of_plain_pytorch(device, dtype, layout, style, table_kind):
    batch, heads_q, heads_k, seq_len, head_dim, rotary_dim, rotary_offset = 2, 8, 2, 11, 64, 48, 8
    label = f"{device} {dtype} {layout} {style} {table_kind}"
    cos, sin = tables(40, rotary_dim, style, table_kind, device)
    positions = torch.randint(0, 40, (batch, seq_len), generator=torch.Generator().manual_seed(1)).to(device)

    def shaped(heads, seed):
        shape = (batch, heads, seq_len, head_dim) if layout == "bhsd" else (batch, seq_len, heads, head_dim)
        return random(shape, device, dtype, seed, requires_grad=True)

    q, k = shaped(heads_q, 2), shaped(heads_k, 3)
    q_out, k_out = rope_jit.apply_rope(q, k, cos, sin, positions=positions, rotary_dim=rotary_dim,
                                       rotary_offset=rotary_offset, style=style, layout=layout)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape

    def as_bhsd(x):
        return x if layout == "bhsd" else x.transpose(1, 2)

    def from_bhsd(x):
        return x if layout == "bhsd" else x.transpose(1, 2)

    q_ref = q.detach().clone().requires_grad_(True)
    k_ref = k.detach().clone().requires_grad_(True)
    q_expected = from_bhsd(rope_torch(as_bhsd(q_ref), cos, sin, positions, rotary_dim, rotary_offset, style))
    k_expected = from_bhsd(rope_torch(as_bhsd(k_ref), cos, sin, positions, rotary_dim, rotary_offset, style))
    assert_close(q_out, q_expected, dtype, f"q {label}")
    assert_close(k_out, k_expected, dtype, f"k {label}")

    weight_q, weight_k = random(q.shape, device, torch.float32, 4), random(k.shape, device, torch.float32, 5)
    ((q_out.float() * weight_q).sum() + (k_out.float() * weight_k).sum()).backward()
    ((q_expected * weight_q).sum() + (k_expected * weight_k).sum()).backward()
    assert_close(q.grad, q_ref.grad, dtype, f"dq {label}")
    assert_close(k.grad, k_ref.grad, dtype, f"dk {label}")


@pytest.mark.parametrize("device", DEVICES)
def test_q_alone_with_inv_freq_angles_and_an_offset_matches_plain_pytorch_with_gradients(device):
    q = random((2, 4, 9, 32), device, torch.float32, 6, requires_grad=True)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    positions = torch.arange(9) + 5
    cos, sin = hf_tables(torch.arange(14), 32)
    out = rope_jit.apply_rope(q, inv_freq=inv_freq.to(device), position_offset=5)
    q_ref = q.detach().clone().requires_grad_(True)
    expected = rope_torch(q_ref, cos.to(device), sin.to(device), positions.to(device))
    assert_close(out, expected, torch.float32, "q")
    weight = random(q.shape, device, torch.float32, 7)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    assert_close(q.grad, q_ref.grad, torch.float32, "dq")


@pytest.mark.parametrize("device", DEVICES)
def test_a_key_output_that_does_not_reach_the_loss_still_gives_the_query_its_gradient(device):
    cos, sin = tables(8, 16, "half", "full", device)
    q = random((1, 2, 8, 16), device, torch.float32, 8, requires_grad=True)
    k = random((1, 2, 8, 16), device, torch.float32, 9, requires_grad=True)
    q_out, _ = rope_jit.apply_rope(q, k, cos, sin)
    q_out.sum().backward()
    q_ref = q.detach().clone().requires_grad_(True)
    rope_torch(q_ref, cos, sin, torch.arange(8, device=device)).sum().backward()
    assert_close(q.grad, q_ref.grad, torch.float32, "dq")


@pytest.mark.parametrize("device", DEVICES)
def test_xpos_gradients_scale_queries_up_and_keys_down(device):
    cos, sin = tables(6, 16, "interleaved", "full", device)
    # One scale per pair, at both of its columns (a full interleaved table).
    scale = (torch.rand(6, 8, generator=torch.Generator().manual_seed(3)) + 0.5).repeat_interleave(2, -1).to(device)
    q = random((1, 2, 6, 16), device, torch.float32, 10, requires_grad=True)
    k = random((1, 2, 6, 16), device, torch.float32, 11, requires_grad=True)
    q_out, k_out = rope_jit.apply_rope(q, k, cos, sin, style="interleaved", xpos_scale=scale)
    q_ref, k_ref = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    rows = torch.arange(6, device=device)
    q_expected = rope_torch(q_ref, cos, sin, rows, style="interleaved", xpos=scale)
    k_expected = rope_torch(k_ref, cos, sin, rows, style="interleaved", xpos=scale, xpos_divides=True)
    assert_close(q_out, q_expected, torch.float32, "q")
    assert_close(k_out, k_expected, torch.float32, "k")
    (q_out.square().sum() + k_out.square().sum()).backward()
    (q_expected.square().sum() + k_expected.square().sum()).backward()
    assert_close(q.grad, q_ref.grad, torch.float32, "dq")
    assert_close(k.grad, k_ref.grad, torch.float32, "dk")


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_rope_under_autograd_gives_the_same_values_and_gradients(device):
    cos, sin = tables(8, 16, "half", "half", device)
    leaf = random((1, 2, 8, 16), device, torch.float32, 12, requires_grad=True)
    q = leaf * 1.0  # a non-leaf, which autograd lets us modify in place
    result = rope_jit.apply_rope(q, cos=cos, sin=sin, inplace=True)
    assert result is q
    (result * 3).sum().backward()
    leaf_ref = leaf.detach().clone().requires_grad_(True)
    expected = rope_torch(leaf_ref * 1.0, cos, sin, torch.arange(8, device=device))
    (expected * 3).sum().backward()
    assert_close(result, expected, torch.float32, "q")
    assert_close(leaf.grad, leaf_ref.grad, torch.float32, "dq")


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_rope_without_autograd_writes_into_the_given_tensors(device):
    cos, sin = tables(8, 16, "half", "full", device)
    q = random((1, 8, 4, 16), device, torch.bfloat16, 13)  # bshd
    k = random((1, 8, 2, 16), device, torch.bfloat16, 14)
    expected_q, expected_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
    pointers = (q.data_ptr(), k.data_ptr())
    with torch.no_grad():
        got_q, got_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd", inplace=True)
    assert got_q is q and got_k is k and (q.data_ptr(), k.data_ptr()) == pointers
    torch.testing.assert_close(q, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(k, expected_k, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_custom_ops_pass_torch_library_opcheck(device):
    cos, sin = tables(10, 16, "half", "full", device)
    positions = torch.arange(10, device=device).flip(0)
    q = random((2, 4, 10, 16), device, torch.float32, 15, requires_grad=True)
    k = random((2, 2, 10, 16), device, torch.float32, 16, requires_grad=True)
    common = (cos, sin, None, positions, None, None, None)
    torch.library.opcheck(torch_ops.rope_op, (q, *common, 0, 16, 0, False, False))
    torch.library.opcheck(torch_ops.rope_qk_op, (q, k, *common, 0, 0, 16, 0, False, False))
    torch.library.opcheck(torch_ops.rope_inplace_op, (q.detach().clone(), *common, 0, 16, 0, False, False))
    torch.library.opcheck(torch_ops.rope_qk_inplace_op,
                          (q.detach().clone(), k.detach().clone(), *common, 0, 0, 16, 0, False, False))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_keeps_the_rope_op_in_one_graph_with_the_same_values_and_gradients(device):
    captured = []

    def capture_backend(graph_module, example_inputs):
        captured.append(str(graph_module.graph))
        return graph_module.forward

    cos, sin = hf_tables(torch.arange(32, device=device), 64)

    def attention_scores(q, k, positions):
        q, k = rope_jit.apply_rope(q, k, cos, sin, positions=positions, layout="bshd")
        return torch.einsum("bshd,bthd->bhst", q * 0.125, k.repeat_interleave(2, dim=2)).softmax(-1)

    q = random((2, 16, 4, 64), device, torch.float32, 17, requires_grad=True)
    k = random((2, 16, 2, 64), device, torch.float32, 18, requires_grad=True)
    positions = torch.arange(16, device=device).expand(2, 16) + torch.tensor([[0], [7]], device=device)

    torch._dynamo.reset()
    compiled = torch.compile(attention_scores, backend=capture_backend, fullgraph=True)
    got = compiled(q, k, positions)
    assert len(captured) == 1 and "rope_jit.rope_qk" in captured[0]

    # The real compilers too: aot_eager (fake tensors, the autograd formula) everywhere, and
    # inductor on the GPU.
    for backend in ["aot_eager"] + (["inductor"] if device == "cuda" else []):
        torch._dynamo.reset()
        q_c, k_c = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
        got = torch.compile(attention_scores, backend=backend, fullgraph=True)(q_c, k_c, positions)
        expected = attention_scores(q, k, positions)
        assert_close(got, expected, torch.float32, backend)
        weight = random(got.shape, device, torch.float32, 19)
        (got * weight).sum().backward()
        q.grad = k.grad = None
        (expected * weight).sum().backward()
        assert_close(q_c.grad, q.grad, torch.float32, f"dq {backend}")
        assert_close(k_c.grad, k.grad, torch.float32, f"dk {backend}")


def test_tables_that_require_grad_are_refused_rather_than_silently_left_without_gradient():
    cos, sin = tables(8, 16, "half", "full", "cpu")
    cos.requires_grad_(True)
    q = random((1, 1, 8, 16), "cpu", torch.float32, 20)
    with pytest.raises(NotImplementedError, match="cos requires grad"):
        rope_jit.apply_rope(q, cos=cos, sin=sin)
    with torch.no_grad():
        rope_jit.apply_rope(q, cos=cos, sin=sin)  # fine without autograd


def test_library_errors_surface_as_python_exceptions_with_the_argument_named():
    cos, sin = tables(8, 16, "half", "full", "cpu")
    q = random((1, 3, 8, 16), "cpu", torch.float32, 21)
    k = random((1, 2, 8, 16), "cpu", torch.float32, 22)  # 3 query heads, 2 kv heads
    with pytest.raises(rope_jit.InvalidArgumentError, match="k"):
        rope_jit.apply_rope(q, k, cos, sin)


@pytest.mark.parametrize("device", DEVICES)
def test_the_attention_op_passes_opcheck_and_compiles_into_one_graph(device):
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    cos, sin = tables(12, 16, "interleaved", "full", device)
    q = random((1, 4, 12, 32), device, torch.float32, 23, requires_grad=True)
    k = random((1, 2, 12, 32), device, torch.float32, 24, requires_grad=True)
    v = random((1, 2, 12, 32), device, torch.float32, 25, requires_grad=True)
    torch.library.opcheck(torch_ops.attention_op, (q, k, v, cos, sin, None, None, True, 0.0, 16, True))
    captured = []

    def capture_backend(graph_module, example_inputs):
        captured.append(str(graph_module.graph))
        return graph_module.forward

    def block(q, k, v):
        return torch_ops.attention(q, k, v, cos, sin, causal=True, rotary_dim=16, style="interleaved") * 2

    torch._dynamo.reset()
    got = torch.compile(block, backend=capture_backend, fullgraph=True)(q, k, v)
    assert len(captured) == 1 and "rope_jit.attention" in captured[0]
    torch.testing.assert_close(got, block(q, k, v), rtol=1e-5, atol=1e-5)
    got.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


# Adversarial pass, session 37 (torch on the CPU): each of these gave a silently wrong
# gradient, or wrote q and then refused k.


@pytest.mark.parametrize("changed", ["cos", "positions"])
def test_a_table_changed_in_place_after_the_forward_fails_its_backward(changed):
    cos, sin = tables(16, 8, "half", "half", "cpu")
    positions = torch.tensor([3, 1, 4, 1, 5])
    q = random((1, 2, 5, 8), "cpu", torch.float32, 30, requires_grad=True)
    rotated = rope_jit.apply_rope(q, None, cos, sin, positions=positions)
    {"cos": cos, "positions": positions}[changed].add_(1)  # the backward reads it again
    with pytest.raises(RuntimeError, match=f"{changed} modified by an inplace operation"):
        rotated.sum().backward()


def test_the_hf_drop_in_fails_its_backward_after_cos_changed_in_place():
    from rope_jit.dropin import hf

    cos, sin = hf_tables(torch.arange(6)[None], 8)
    q = random((1, 2, 6, 8), "cpu", torch.float32, 31, requires_grad=True)
    k = random((1, 1, 6, 8), "cpu", torch.float32, 32, requires_grad=True)
    q_embed, k_embed = hf.apply_rotary_pos_emb(q, k, cos, sin)
    cos.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (q_embed.sum() + k_embed.sum()).backward()


def test_an_in_place_rotation_autograd_refuses_leaves_before_writing_either_tensor():
    cos, sin = tables(16, 8, "half", "half", "cpu")
    leaf = random((1, 2, 5, 8), "cpu", torch.float32, 33, requires_grad=True)
    q = leaf * 1  # not a leaf: writable in place under autograd
    k = random((1, 1, 5, 8), "cpu", torch.float32, 34, requires_grad=True)  # a leaf
    q_before, k_before = q.detach().clone(), k.detach().clone()
    with pytest.raises(RuntimeError, match="k: a leaf tensor that requires grad"):
        rope_jit.apply_rope(q, k, cos, sin, inplace=True)
    torch.testing.assert_close(q.detach(), q_before, rtol=0, atol=0)
    torch.testing.assert_close(k.detach(), k_before, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="q: a view of a leaf tensor"):
        rope_jit.apply_rope(leaf[:, :1], None, cos, sin, inplace=True)


def test_attention_refuses_a_mask_that_requires_grad_and_a_double_backward():
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    cos, sin = tables(8, 8, "half", "full", "cpu")
    q = random((1, 2, 4, 8), "cpu", torch.float32, 35, requires_grad=True)
    k = random((1, 2, 4, 8), "cpu", torch.float32, 36, requires_grad=True)
    v = random((1, 2, 4, 8), "cpu", torch.float32, 37, requires_grad=True)
    mask = torch.zeros(1, 1, 4, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        torch_ops.attention(q, k, v, cos, sin, attn_mask=mask)
    # create_graph: the first-order gradient as without it; differentiating it raises (a
    # second derivative of zero, with a warning, before).
    (plain,) = torch.autograd.grad((torch_ops.attention(q, k, v, cos, sin) ** 2).sum(), q)
    (graphed,) = torch.autograd.grad((torch_ops.attention(q, k, v, cos, sin) ** 2).sum(), q,
                                     create_graph=True)
    torch.testing.assert_close(graphed, plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad((graphed ** 2).sum(), q)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_lse_carries_its_gradient_eagerly_under_torch_func_and_compiled(device):
    # lse came marked non-differentiable: a loss through it (a z-loss, a merge of attention
    # over chunks of keys) got no gradient from it, silently (adversarial pass, session 49).
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    cos, sin = tables(7, 8, "half", "full", device)  # R = 8 of D = 16: partial rotary
    leaves = [random(shape, device, torch.float32, 50 + i, requires_grad=True)
              for i, shape in enumerate([(2, 4, 5, 16), (2, 2, 7, 16), (2, 2, 7, 16)])]
    weight = random((2, 4, 5), device, torch.float32, 53)
    mask = torch.ones(2, 7, dtype=torch.bool, device=device)
    mask[1, 5:] = False

    def reference(q, k, v):
        # float64, rotation by torch_reference, GQA by repeat, causal top-left, key mask.
        q = rope_torch(q.double(), cos, sin, torch.arange(5, device=device), rotary_dim=8).double()
        k = rope_torch(k.double(), cos, sin, torch.arange(7, device=device), rotary_dim=8).double()
        k, v = k.repeat_interleave(2, dim=1), v.double().repeat_interleave(2, dim=1)
        scores = q @ k.transpose(-1, -2) / 4.0
        visible = torch.ones(5, 7, dtype=torch.bool, device=device).tril() & mask[:, None, None, :]
        scores = scores.masked_fill(~visible, float("-inf"))
        return scores.softmax(-1) @ v, scores.logsumexp(-1)

    for label, loss_of in [("out and lse", lambda out, lse: out.sum() + (lse * weight).sum()),
                           ("lse only", lambda out, lse: (lse * weight).sum())]:
        got = [t.detach().clone().requires_grad_() for t in leaves]
        out, lse = torch_ops.attention(*got, cos, sin, attn_mask=mask, causal=True, rotary_dim=8,
                                       return_lse=True)
        loss_of(out, lse).backward()
        expected = [t.detach().double().requires_grad_() for t in leaves]
        loss_of(*reference(*expected)).backward()
        torch.testing.assert_close(lse.double(), reference(*leaves)[1].detach(), rtol=1e-5, atol=1e-5)
        for name, mine, theirs in zip("qkv", got, expected):
            if theirs.grad is None:  # (v has no share in lse)
                assert mine.grad is None, f"d{name}, {label}"
                continue
            torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"d{name}, {label}: {m}")

        # torch.func: grad, and vmap of grad (the same q twice: each its gradient).
        def loss(q, k, v):
            out, lse = torch_ops.attention(q, k, v, cos, sin, attn_mask=mask, causal=True,
                                           rotary_dim=8, return_lse=True)
            return loss_of(out, lse)

        plain = [t.detach() for t in leaves]
        dq, dk = torch.func.grad(loss, argnums=(0, 1))(*plain)
        torch.testing.assert_close(dq.double(), expected[0].grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dk.double(), expected[1].grad, rtol=1e-4, atol=1e-5)
        twice = torch.stack([plain[0], plain[0]])
        batched = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None, None))(twice, *plain[1:])
        torch.testing.assert_close(batched.double(), expected[0].grad.expand(2, -1, -1, -1, -1),
                                   rtol=1e-4, atol=1e-5)
        # grad of a vmapped loss (there q reads requires_grad False: the gradient through lse
        # came out zero; review, session 49). Not on torch 2.4, whose vmap rule cannot take
        # the None gradients this needs (see _vmap_takes_unmaterialized_grads).
        summed = torch.func.grad(lambda q: torch.func.vmap(loss, in_dims=(0, None, None))(q, *plain[1:]).sum())
        if torch_ops._vmap_takes_unmaterialized_grads():
            torch.testing.assert_close(summed(twice).double(),
                                       expected[0].grad.expand(2, -1, -1, -1, -1), rtol=1e-4, atol=1e-5)
        # torch.compile (aot_eager: fake tensors, the autograd formulas) gives the same.
        torch._dynamo.reset()
        compiled = [t.detach().clone().requires_grad_() for t in leaves]
        torch.compile(loss, backend="aot_eager", fullgraph=True)(*compiled).backward()
        for name, mine, theirs in zip("qk", compiled, expected):
            torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"compiled d{name}, {label}: {m}")

    # lse is a tensor of its own: written in place (a masked row's -inf to 0), out's gradient
    # is still right (a view of the op's lse was refused there).
    got = [t.detach().clone().requires_grad_() for t in leaves]
    out, lse = torch_ops.attention(*got, cos, sin, attn_mask=mask, causal=True, rotary_dim=8,
                                   return_lse=True)
    lse.nan_to_num_(neginf=0.0)
    out.sum().backward()
    expected = [t.detach().double().requires_grad_() for t in leaves]
    reference(*expected)[0].sum().backward()
    torch.testing.assert_close(got[0].grad.double(), expected[0].grad, rtol=1e-4, atol=1e-5)


def test_apply_rope_under_vmap_takes_the_ops_and_matches_each_sample():
    # The eager paths took vmap's batched tensors (whose class is torch.Tensor) and failed
    # with "Cannot access data pointer" (adversarial pass, session 37).
    from rope_jit.dropin import hf

    cos, sin = tables(16, 8, "half", "half", "cpu")
    hf_cos, hf_sin = hf_tables(torch.arange(4)[None], 8)
    x = random((3, 1, 2, 4, 8), "cpu", torch.float32, 42)
    for run in (lambda q: rope_jit.apply_rope(q, None, cos, sin),
                lambda q: hf.apply_rotary_pos_emb(q, q, hf_cos, hf_sin)[0]):
        got = torch.func.vmap(run)(x)
        expected = torch.stack([run(sample) for sample in x])
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_an_in_place_rotation_refuses_a_view_of_a_multi_output_op_before_writing_q():
    # k, v = kv.unbind(...): torch refuses in-place writes to such views; q was written first
    # (review of session 37).
    cos, sin = tables(16, 8, "half", "half", "cpu")
    q = random((1, 2, 5, 8), "cpu", torch.float32, 43, requires_grad=True) * 1
    kv = random((2, 1, 1, 5, 8), "cpu", torch.float32, 44, requires_grad=True) * 1
    k, _ = kv.unbind(0)
    q_before = q.detach().clone()
    with pytest.raises(RuntimeError, match="k: a view made as MULTI_OUTPUT_NODE"):
        rope_jit.apply_rope(q, k, cos, sin, inplace=True)
    torch.testing.assert_close(q.detach(), q_before, rtol=0, atol=0)


def _k_refusals():
    """(label, k maker, message) of k that torch's copy_ refuses to write, beside a q it
    accepts: each was refused after q's copy (atomicity audit, session 40)."""
    def expanded():
        return (random((1, 1, 1, 8), "cpu", torch.float32, 46, requires_grad=True) * 1).expand(
            1, 1, 5, 8)

    def overlapping_rows():
        base = random((16,), "cpu", torch.float32, 47, requires_grad=True) * 1
        return base.as_strided((1, 1, 5, 8), (0, 0, 0, 1))  # (torch judges only zero strides)

    def overlapping_strides():  # row s + 1 starts 2 features into row s: torch's copy_ wrote it
        base = random((16,), "cpu", torch.float32, 49, requires_grad=True) * 1
        return base.as_strided((1, 1, 5, 8), (40, 40, 2, 1))

    def inference():
        with torch.inference_mode():
            return random((1, 1, 5, 8), "cpu", torch.float32, 48)

    internal = "k: its strides may make several indices address the same element"
    return [("expand", expanded, internal), ("as_strided", overlapping_rows, internal),
            ("as_strided overlapping", overlapping_strides, internal),
            ("inference", inference, "k: an inference tensor cannot be written in place")]


@pytest.mark.parametrize("label, make_k, message", _k_refusals(), ids=lambda x: str(x)[:12])
@pytest.mark.parametrize("dispatch_mode", [False, True])
def test_an_in_place_rotation_under_autograd_refuses_k_before_writing_q(label, make_k, message,
                                                                         dispatch_mode):
    from torch.utils.flop_counter import FlopCounterMode

    cos, sin = tables(16, 8, "half", "half", "cpu")
    q = random((1, 2, 5, 8), "cpu", torch.float32, 45, requires_grad=True) * 1
    k = make_k()
    q_before, k_before, version = q.detach().clone(), k.detach().clone(), q._version
    grad_fn = q.grad_fn
    with FlopCounterMode(display=False) if dispatch_mode else torch.enable_grad():
        with pytest.raises(RuntimeError, match=message):
            rope_jit.apply_rope(q, k, cos, sin, inplace=True)
    torch.testing.assert_close(q.detach(), q_before, rtol=0, atol=0)
    torch.testing.assert_close(k.detach(), k_before, rtol=0, atol=0)
    assert q._version == version and q.grad_fn is grad_fn


@pytest.mark.parametrize("grad", [False, True])
def test_an_in_place_rotation_refuses_q_whose_strides_overlap_with_and_without_autograd(grad):
    # Without grad the library refuses q; under autograd apply_rope rotated out of place and
    # torch's copy_, which judges only zero strides, wrote the overlapping elements twice
    # (left out in sessions 40-41).
    cos, sin = tables(16, 8, "half", "half", "cpu")
    base = random((48,), "cpu", torch.float32, 59, requires_grad=grad) * 1
    q = base.as_strided((1, 1, 5, 8), (40, 40, 2, 1))  # row s + 1 starts 2 features into row s
    k = random((1, 1, 5, 8), "cpu", torch.float32, 60)
    before, k_before = base.detach().clone(), k.clone()
    error = RuntimeError if grad else ValueError
    with pytest.raises(error, match="q: its strides may make several indices address the same "
                                    "element"):
        rope_jit.apply_rope(q, k, cos, sin, inplace=True)
    torch.testing.assert_close(base.detach(), before, rtol=0, atol=0)
    torch.testing.assert_close(k, k_before, rtol=0, atol=0)

    # Distinct elements the rule cannot prove distinct (strides 2 and 3 over 3 x 2 indices)
    # are refused too, with autograd as without: the library's rule is a sufficient test.
    tight = (random((16,), "cpu", torch.float32, 65, requires_grad=grad) * 1).as_strided(
        (1, 1, 3, 2), (8, 8, 2, 3))
    with pytest.raises(error, match="q: its strides may make several indices address"):
        rope_jit.apply_rope(tight, None, *tables(16, 2, "half", "half", "cpu"), inplace=True)

    # A strided q whose elements are distinct (every other feature) is still written.
    wide = random((1, 1, 5, 16), "cpu", torch.float32, 61, requires_grad=grad) * 1
    expected = rope_jit.apply_rope(wide.detach()[..., ::2].clone(), None, cos, sin)
    rope_jit.apply_rope(wide[..., ::2], None, cos, sin, inplace=True)
    torch.testing.assert_close(wide.detach()[..., ::2], expected, rtol=0, atol=0)


def test_an_in_place_rotation_under_vmap_refuses_a_captured_k_before_writing_q():
    cos, sin = tables(16, 8, "half", "half", "cpu")
    qs = random((3, 1, 2, 5, 8), "cpu", torch.float32, 49)
    k = random((1, 1, 5, 8), "cpu", torch.float32, 50)
    qs_before, k_before = qs.clone(), k.clone()
    with pytest.raises(RuntimeError, match="k: a tensor a torch.func transform"):
        torch.func.vmap(lambda q: rope_jit.apply_rope(q, k, cos, sin, inplace=True))(qs)
    torch.testing.assert_close(qs, qs_before, rtol=0, atol=0)
    torch.testing.assert_close(k, k_before, rtol=0, atol=0)


def test_an_in_place_rotation_under_vmap_refuses_a_broadcast_k_before_writing_q():
    # Below vmap the memory has 5 dims: q was rotated before torch's copy_ refused k (review
    # helper-91, session 42).
    _check_vmapped_broadcast_k_refused(*tables(16, 8, "half", "half", "cpu"), 62)


def _check_vmapped_broadcast_k_refused(cos, sin, seed):
    """vmap of an in-place rotation of 3 samples of q beside one k broadcast over them: k is
    refused, and q is left as it was."""
    qs = random((3, 1, 2, 5, 8), "cpu", torch.float32, seed)
    ks = random((1, 1, 2, 5, 8), "cpu", torch.float32, seed + 1).expand(3, 1, 2, 5, 8)
    qs_before = qs.clone()
    with pytest.raises(RuntimeError, match="k: its strides may make several indices address"):
        torch.func.vmap(lambda q, k: rope_jit.apply_rope(q, k, cos, sin, inplace=True))(qs, ks)
    torch.testing.assert_close(qs, qs_before, rtol=0, atol=0)


def test_an_in_place_rotation_under_vmap_judges_the_batched_memory_as_the_library_does():
    # Below vmap the memory has 5 dims, which the library's memory queries took only from
    # session 47: samples overlapping by a head (non-zero strides, which torch's copy_ lets
    # write an element twice) and q of one sample on k of the next were rotated in place, the
    # shared elements written twice, each with another position's rotation.
    cos, sin = tables(16, 8, "half", "half", "cpu")
    base = random((160,), "cpu", torch.float32, 66)
    before = base.clone()
    # [3, 1, 2, 5, 8] samples one head (40 elements) apart: sample i's head 1 is i + 1's head 0.
    qs = base.as_strided((3, 1, 2, 5, 8), (40, 80, 40, 8, 1))
    with pytest.raises(RuntimeError, match="q: its strides may make several indices address"):
        torch.func.vmap(lambda q: rope_jit.apply_rope(q, None, cos, sin, inplace=True))(qs)
    torch.testing.assert_close(base, before, rtol=0, atol=0)

    # One head each, k sample i on q sample i + 1: apart within each sample, shared across.
    qs = base.as_strided((3, 1, 1, 5, 8), (40, 40, 40, 8, 1))
    ks = base.as_strided((3, 1, 1, 5, 8), (40, 40, 40, 8, 1), 40)
    with pytest.raises(ValueError, match="q: shares memory with k"):
        torch.func.vmap(lambda q, k: rope_jit.apply_rope(q, k, cos, sin, inplace=True))(qs, ks)
    torch.testing.assert_close(base, before, rtol=0, atol=0)

    # Samples apart are rotated as each sample alone would be.
    _check_vmapped_fused_rotation_in_place(cos, sin, 67)


def _check_vmapped_fused_rotation_in_place(cos, sin, seed):
    """vmap of an in-place rotation over 3 samples of [1, 5, 4, 8] tokens, q heads 0 and 2 of
    each token, k head 1 (elements apart, memory strided), against each sample alone."""
    fused = random((3, 1, 5, 4, 8), "cpu", torch.float32, seed)
    expected = fused.clone()
    for sample in expected:
        rope_jit.apply_rope(sample[:, :, 0::2].transpose(1, 2), sample[:, :, 1:2].transpose(1, 2),
                            cos, sin, inplace=True)
    torch.func.vmap(lambda q, k: rope_jit.apply_rope(q, k, cos, sin, inplace=True))(
        fused[:, :, :, 0::2].transpose(2, 3), fused[:, :, :, 1:2].transpose(2, 3))
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)


def test_under_vmap_a_library_whose_memory_queries_take_4_dims_judges_as_before(monkeypatch):
    # A library built before the queries took 8 dims refuses vmap's 5 (both say 0.1.0): the
    # package then judges that memory as before, by torch's zero-stride answer alone, instead
    # of failing every in-place rotation of strided memory under vmap (review helper-98).
    from rope_jit import errors, tensors
    from rope_jit import torch_ops

    def four_dims_only(query):
        def ask(*views):
            if any(view.ndim > 4 for view in views):
                raise errors.error_for_status("rope_jit_tensor_has_distinct_elements", 1,
                                              "ERROR_INVALID_ARGUMENT",
                                              "t: expected at most 4 dimensions, got 5")
            return query(*views)
        return ask

    for name in ("has_distinct_elements", "shares_memory"):
        monkeypatch.setattr(tensors, name, four_dims_only(getattr(tensors, name)))
    monkeypatch.setattr(torch_ops, "_distinct_layouts", {})
    monkeypatch.setattr(torch_ops, "_shared_layouts", {})
    cos, sin = tables(16, 8, "half", "half", "cpu")
    _check_vmapped_fused_rotation_in_place(cos, sin, 68)
    _check_vmapped_broadcast_k_refused(cos, sin, 69)


def test_an_in_place_rotation_under_autograd_writes_a_strided_wrapper_subclass():
    # A wrapper subclass (TwoTensor: two plain tensors behind one) has a data pointer of 0:
    # the share and stride checks cannot judge it and leave it to the subclass's copy_ (the
    # library refused it as "data is NULL": review helper-91, session 42).
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    cos, sin = tables(16, 8, "half", "half", "cpu")
    a = random((1, 2, 5, 16), "cpu", torch.float32, 64)
    y = two_tensor.TwoTensor(a, a.clone()).requires_grad_() * 1
    expected = rope_jit.apply_rope(a[..., :8].clone(), a[..., 8:].clone(), cos, sin)
    rope_jit.apply_rope(y[..., :8], y[..., 8:], cos, sin, inplace=True)
    for part in (y.a, y.b):
        torch.testing.assert_close(part.detach(), torch.cat(expected, dim=-1), rtol=0, atol=0)


def test_an_in_place_rotation_refuses_k_that_is_q_with_autograd_as_without():
    cos, sin = tables(16, 8, "half", "half", "cpu")
    for grad in (False, True):
        y = random((1, 2, 5, 8), "cpu", torch.float32, 51, requires_grad=grad) * 1
        before = y.detach().clone()
        with pytest.raises(ValueError, match="k: is the same memory as q; it would be rotated twice"):
            rope_jit.apply_rope(y, y, cos, sin, inplace=True)
        torch.testing.assert_close(y.detach(), before, rtol=0, atol=0)


def test_an_in_place_rotation_refuses_k_partly_on_q_with_autograd_as_without():
    # [B,S,H,D] views of one buffer: k one head over q's last head was copied into under
    # autograd, the overlap written twice (left out in session 40); heads side by side, as a
    # fused qkv's, pass and match the out-of-place rotation.
    cos, sin = tables(16, 8, "half", "half", "cpu")
    for grad in (False, True):
        y = random((1, 5, 4, 8), "cpu", torch.float32, 55, requires_grad=grad) * 1
        before = y.detach().clone()
        with pytest.raises((ValueError, rope_jit.InvalidArgumentError),
                           match="q: shares memory with k"):
            rope_jit.apply_rope(y[:, :, :2], y[:, :, 1:3], cos, sin, layout="bshd", inplace=True)
        torch.testing.assert_close(y.detach(), before, rtol=0, atol=0)
        expected = rope_jit.apply_rope(before[:, :, :2], before[:, :, 2:], cos, sin, layout="bshd")
        q, k = rope_jit.apply_rope(y[:, :, :2], y[:, :, 2:], cos, sin, layout="bshd", inplace=True)
        assert q.requires_grad == grad
        torch.testing.assert_close(y.detach(), torch.cat(expected, dim=2), rtol=0, atol=0)
    # Under torch.func.grad the memory below its wrappers is judged.
    for k_head, refused in ((2, False), (1, True)):

        def loss(x):
            t = x * 1
            rope_jit.apply_rope(t[:, :, :2], t[:, :, k_head:k_head + 2], cos, sin, layout="bshd",
                                inplace=True)
            return (t * t).sum()

        x = random((1, 5, 4, 8), "cpu", torch.float32, 56)
        if refused:
            with pytest.raises(ValueError, match="q: shares memory with k"):
                torch.func.grad(loss)(x)
        else:
            torch.func.grad(loss)(x)


def test_the_in_place_share_check_meets_memory_across_storages_and_spares_an_older_library(
        monkeypatch):
    # Two torch storages over one NumPy array's memory passed (review, session 41): the check
    # now starts from the views' byte ranges. A library without rope_jit_tensors_share_memory
    # refuses nothing, as before (fused qkv views raised NotImplementedError then).
    np = pytest.importorskip("numpy")
    from rope_jit import _library
    from rope_jit import torch_ops

    cos, sin = tables(16, 8, "half", "half", "cpu")
    weight = torch.ones(1, requires_grad=True)
    memory = random((1, 5, 4, 8), "cpu", torch.float32, 57).numpy()
    before = memory.copy()
    q = torch.from_numpy(memory[:, :, :2]).mul_(weight)  # written in place: non-leaf, with grad
    k = torch.from_numpy(memory[:, :, 1:3])
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="q: shares memory with k"):
        rope_jit.apply_rope(q, k, cos, sin, layout="bshd", inplace=True)
    np.testing.assert_array_equal(memory, before)

    monkeypatch.setitem(_library.load().tensor_queries, "rope_jit_tensors_share_memory", None)
    monkeypatch.setattr(torch_ops, "_shared_layouts", {})
    y = random((1, 5, 4, 8), "cpu", torch.float32, 58, requires_grad=True) * 1
    expected = rope_jit.apply_rope(y.detach()[:, :, :2], y.detach()[:, :, 2:], cos, sin,
                                   layout="bshd")
    rope_jit.apply_rope(y[:, :, :2], y[:, :, 2:], cos, sin, layout="bshd", inplace=True)
    torch.testing.assert_close(y.detach(), torch.cat(expected, dim=2), rtol=0, atol=0)


def test_the_ops_refuse_tensors_on_several_devices_where_one_is_meta():
    # With k (or a table) on meta and the rest on the CPU the dispatcher ran the fake kernels:
    # empty outputs, or no write, and no error (atomicity audit, session 40).
    cos, sin = tables(8, 8, "half", "half", "cpu")
    q = random((1, 2, 4, 8), "cpu", torch.float32, 52)
    k = torch.empty(1, 2, 4, 8, device="meta")
    before = q.clone()
    ops = torch.ops.rope_jit
    rest = (None, None, None, None, None, 0, 0, 0, 0, False, False)
    with pytest.raises(ValueError, match="k: on meta, but q is on cpu"):
        ops.rope_qk(q, k, cos, sin, *rest)
    with pytest.raises(ValueError, match="k: on meta, but q is on cpu"):
        ops.rope_qk_(q, k, cos, sin, *rest)
    with pytest.raises(ValueError, match="cos: on meta, but x is on cpu"):
        ops.rope(q, cos.to("meta"), sin, None, None, None, None, None, 0, 0, 0, False, False)
    torch.testing.assert_close(q, before, rtol=0, atol=0)
    # All on meta: shapes as before.
    meta_q = q.to("meta")
    assert ops.rope_qk(meta_q, k, cos.to("meta"), sin.to("meta"), *rest)[1].shape == k.shape


def test_an_in_place_rotation_under_autograd_compiles_whole_and_matches_eager():
    # Its checks before the copies read memory that torch.compile's fake tensors lack: they
    # stand aside while it traces (session 40).
    cos, sin = tables(16, 8, "half", "half", "cpu")

    def block(x, y):
        q, k = x * 1, y * 1
        rope_jit.apply_rope(q, k, cos, sin, inplace=True)
        return (q * k.repeat_interleave(2, dim=1)).sum()

    x = random((1, 2, 5, 8), "cpu", torch.float32, 53, requires_grad=True)
    y = random((1, 1, 5, 8), "cpu", torch.float32, 54, requires_grad=True)
    eager = block(x, y)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, y)
    torch.testing.assert_close(compiled, eager)
    for got, expected in zip(torch.autograd.grad(compiled, (x, y)), torch.autograd.grad(eager, (x, y))):
        torch.testing.assert_close(got, expected)


def test_an_in_place_rotation_of_q_and_k_without_memory_passes_the_same_memory_check():
    # Meta tensors (FLOP counting, shape checks) all have data pointer 0: q and k of one shape
    # were refused as "the same memory" (review, session 40).
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        q_proj, k_proj = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        angles = torch.arange(16.0)[:, None] * torch.ones(8)
        cos, sin = angles.cos(), angles.sin()
        x = torch.empty(1, 16, 64)
    q, k = q_proj(x).view(1, 16, 4, 16), k_proj(x).view(1, 16, 4, 16)
    with FlopCounterMode(display=False):
        got_q, got_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd", inplace=True)
    assert got_q is q and got_k is k
    with pytest.raises(ValueError, match="k: is the same memory as q"):
        with FlopCounterMode(display=False):
            rope_jit.apply_rope(q, q, cos, sin, layout="bshd", inplace=True)
