"""The drop-ins against plain PyTorch versions of the peers' formulas (written here from their
documented semantics), values and gradients, on the CPU and, when there is one, the GPU."""

import math

import pytest

torch = pytest.importorskip("torch")

import rope_jit  # noqa: E402
from rope_jit.dropin import flash_attn, hf, rotary_embedding_torch as ret, unsloth  # noqa: E402
from torch_reference import hf_tables, rotate_pairs  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random(shape, device, seed, dtype=torch.float32, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device, dtype).requires_grad_(requires_grad)


def close(got, expected, tolerance=2e-5, label=""):
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance,
                               msg=lambda m: f"{label}: {m}")


def check_gradients(inputs, run, reference, device, label, tolerance=2e-5):
    """Gradients of a random projection of the outputs, through `run` and through `reference`."""
    copies = [x.detach().clone().requires_grad_(True) for x in inputs]
    outputs, expected = run(*inputs), reference(*copies)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    loss = sum((out.float() * random(out.shape, device, 100 + i)).sum() for i, out in enumerate(outputs))
    loss_expected = sum((out.float() * random(out.shape, device, 100 + i)).sum() for i, out in enumerate(expected))
    loss.backward()
    loss_expected.backward()
    for index, (x, copy) in enumerate(zip(inputs, copies)):
        close(x.grad, copy.grad, tolerance, label=f"{label} grad {index}")


# ------------------------------------------------------------------------------------------
# HF transformers
# ------------------------------------------------------------------------------------------

def hf_formula(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    out = []
    for x in (q, k):
        rotated = x[..., :rotary_dim] * cos + rotate_pairs(x[..., :rotary_dim], "half") * sin
        passed = x[..., rotary_dim:]
        out.append(torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated)
    return tuple(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("per_batch_positions", [False, True])
def test_hf_apply_rotary_pos_emb_matches_transformers_formula(device, unsqueeze_dim, per_batch_positions):
    batch, seq_len, heads_q, heads_k, head_dim = 3, 10, 8, 2, 32
    if per_batch_positions:
        position_ids = torch.stack([torch.arange(seq_len) + 4 * b for b in range(batch)]).to(device)
    else:
        position_ids = torch.arange(seq_len, device=device)[None].expand(batch, seq_len)
    cos, sin = hf_tables(position_ids, head_dim)  # [B, S, D]
    if not per_batch_positions:
        cos, sin = cos[:1], sin[:1]
    layout_shape = (lambda h: (batch, h, seq_len, head_dim)) if unsqueeze_dim == 1 else (
        lambda h: (batch, seq_len, h, head_dim))
    q = random(layout_shape(heads_q), device, 1, requires_grad=True)
    k = random(layout_shape(heads_k), device, 2, requires_grad=True)
    got_q, got_k = hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    expected_q, expected_k = hf_formula(q, k, cos, sin, unsqueeze_dim)
    close(got_q, expected_q, label="q")
    close(got_k, expected_k, label="k")
    check_gradients([q, k], lambda a, b: hf.apply_rotary_pos_emb(a, b, cos, sin, unsqueeze_dim=unsqueeze_dim),
                    lambda a, b: hf_formula(a, b, cos, sin, unsqueeze_dim), device, "hf")


@pytest.mark.parametrize("device", DEVICES)
def test_hf_apply_rotary_pos_emb_refuses_tables_of_another_batch_or_shape(device):
    """Per-sequence tables for another batch size would read rows past the tables on the GPU
    (the sequence starts are device data): such calls run transformers' formula, which fails
    as transformers does (its broadcast); so does a sin unlike cos. (They raised ValueError
    of the drop-in's own, also for shapes transformers broadcasts: review, session 39.)"""
    batch, seq_len, heads, head_dim = 4, 5, 2, 16
    q = random((batch, heads, seq_len, head_dim), device, 1)
    k = random((batch, heads, seq_len, head_dim), device, 2)
    position_ids = torch.stack([torch.arange(seq_len) + b for b in range(2)]).to(device)
    cos, sin = hf_tables(position_ids, head_dim)  # [2, S, D] for a batch of 4
    for bad_cos, bad_sin in ((cos, sin), (cos[:1], sin)):
        with pytest.raises(RuntimeError, match="must match the size"):
            hf_formula(q, k, bad_cos, bad_sin)  # (transformers' own failure)
        with pytest.raises(RuntimeError, match="must match the size"):
            hf.apply_rotary_pos_emb(q, k, bad_cos, bad_sin)


@pytest.mark.parametrize("device", DEVICES)
def test_hf_cos_shared_by_the_batch_beside_a_sin_per_sequence_rotates_each_by_its_own(device):
    # (Adversarial pass, session 49.) The general code chose "one table for the batch" from
    # cos alone: an expanded cos beside a per-sequence sin gave every sequence sin[0].
    batch, heads, seq_len, dim = 2, 2, 4, 8
    q, k = random((batch, heads, seq_len, dim), device, 60), random((batch, heads, seq_len, dim), device, 61)
    cos, sin = hf_tables(torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10]], device=device), dim)
    for label, (c, s) in {"cos expanded": (cos[:1].expand(batch, -1, -1), sin),
                          "sin expanded": (cos, sin[:1].expand(batch, -1, -1))}.items():
        got_q, got_k = hf.apply_rotary_pos_emb(q, k, c, s)
        expected_q, expected_k = hf_formula(q, k, c, s)
        close(got_q, expected_q, label=f"q, {label}")
        close(got_k, expected_k, label=f"k, {label}")


@pytest.mark.parametrize("device", DEVICES)
def test_hf_apply_rotary_pos_emb_broadcasts_and_promotes_as_transformers(device):
    # Each raised ValueError, or returned q's dtype, where transformers returns (review,
    # session 39): cos [B, 1, R] over the tokens, a q of batch 1 over cos's batch, the
    # [1, 1, P, R] cache with position_ids of transformers 4.31-4.35, a cos wider than q.
    q, k = random((2, 4, 5, 16), device, 11), random((2, 2, 5, 16), device, 12)
    starts = torch.tensor([[3], [7]], device=device)
    one_row = hf_tables(starts, 16)  # cos, sin [B, 1, R]
    cos, sin = hf_tables(torch.arange(5, device=device)[None] + starts, 16)
    table_cos, table_sin = hf_tables(torch.arange(12, device=device), 16)
    position_ids = torch.stack([torch.arange(5) + 2, torch.arange(5) + 5]).to(device)
    for label, arguments, expected in (
            ("cos [B, 1, R]", (q, k, *one_row), hf_formula(q, k, *one_row)),
            ("q of batch 1", (q[:1], k[:1], cos, sin), hf_formula(q[:1], k[:1], cos, sin)),
            ("transformers 4.31-4.35", (q, k, table_cos[None, None], table_sin[None, None],
                                        position_ids),
             hf_formula(q, k, table_cos[position_ids], table_sin[position_ids])),
            ("cos wider than q", (q.bfloat16(), k.bfloat16(), cos, sin),
             hf_formula(q.bfloat16(), k.bfloat16(), cos, sin))):
        got = hf.apply_rotary_pos_emb(*arguments)
        for name, a, b in zip("qk", got, expected):
            assert a.dtype == b.dtype and a.shape == b.shape, (label, name, a.dtype, a.shape)
            close(a, b, label=f"{label} {name}")
    # k_embed of a k that needs no grad needs none either (it had a grad_fn beside q's).
    leaf = q.clone().requires_grad_()
    q_embed, k_embed = hf.apply_rotary_pos_emb(leaf, k, cos, sin)
    assert q_embed.requires_grad and not k_embed.requires_grad and k_embed.grad_fn is None
    reference = leaf.detach().clone().requires_grad_()
    hf_formula(reference, k, cos, sin)[0].sum().backward()
    q_embed.sum().backward()
    close(leaf.grad, reference.grad, label="q's gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_hf_apply_rotary_pos_emb_takes_the_old_table_and_position_ids_signature_and_partial_rotary(device):
    table_cos, table_sin = hf_tables(torch.arange(50, device=device), 16)  # [P, R], R < D
    position_ids = torch.tensor([[3, 9, 20, 4], [0, 1, 2, 49]], device=device)
    q, k = random((2, 4, 4, 32), device, 3), random((2, 4, 4, 32), device, 4)
    got_q, got_k = hf.apply_rotary_pos_emb(q, k, table_cos, table_sin, position_ids)
    expected_q, expected_k = hf_formula(q, k, table_cos[position_ids], table_sin[position_ids])
    close(got_q, expected_q, label="q")
    close(got_k, expected_k, label="k")
    # The newer positional form apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim).
    cos, sin = table_cos[position_ids], table_sin[position_ids]
    got_q, _ = hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)
    close(got_q, expected_q.transpose(1, 2), label="q (unsqueeze_dim 2)")


@pytest.mark.parametrize("device", DEVICES)
def test_hf_old_signature_counts_negative_position_ids_from_the_tables_end_as_transformers(device):
    # transformers < 4.38 gathered cos[position_ids]: -1 is the last row, -P the first; the
    # library refused them (an error naming the row) where transformers ran.
    table_cos, table_sin = hf_tables(torch.arange(50, device=device), 16)  # [P, R], P = 50
    position_ids = torch.tensor([[-1, 9, -50, 4], [0, -2, 2, 49]], device=device)
    q, k = random((2, 4, 4, 32), device, 5), random((2, 4, 4, 32), device, 6)
    for ids in (position_ids, position_ids.int(), position_ids[:1]):
        got_q, got_k = hf.apply_rotary_pos_emb(q, k, table_cos, table_sin, ids)
        expected_q, expected_k = hf_formula(q, k, table_cos[ids], table_sin[ids])
        close(got_q, expected_q, label=f"q, ids {ids.dtype} {list(ids.shape)}")
        close(got_k, expected_k, label=f"k, ids {ids.dtype} {list(ids.shape)}")
    if device != "cpu":
        return  # (the CUDA backend reads positions on the device: checked with debug_checks)
    # Below -P there is no row: transformers raises an IndexError, the library its error.
    q_before, k_before = q.clone(), k.clone()
    with pytest.raises(rope_jit.RopeJitError, match="gives table row -51, outside cos's 50 rows"):
        hf.apply_rotary_pos_emb(q, k, table_cos, table_sin, position_ids - 1)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_hf_calls_the_library_cannot_serve_get_transformers_own_results():
    """(Adversarial pass, session 35.) Where the library would compute something else or
    refuse, the drop-in runs transformers' formula: cos/sin that require grad (their gradient
    too), float64 (gradcheck), q and k of different dtypes, an odd head_dim, k with one token
    against q's five (transformers broadcasts), k without heads, unbatched input with
    unsqueeze_dim=0."""
    position_ids = torch.arange(5)[None]
    cos, sin = hf_tables(position_ids, 16)  # [1, 5, 16]

    def same(q, k, c, s, unsqueeze_dim=1):
        got = hf.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=unsqueeze_dim)
        expected = hf_formula(q, k, c, s, unsqueeze_dim)
        for g, e, name in zip(got, expected, ("q", "k")):
            assert g.shape == e.shape and g.dtype == e.dtype, name
            close(g, e, label=name)

    q, k = random((2, 4, 5, 16), "cpu", 1), random((2, 2, 5, 16), "cpu", 2)
    # Tables that require grad: values, and their gradient as transformers gives it.
    c, s = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
    c2, s2 = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
    got = hf.apply_rotary_pos_emb(q, k, c, s)
    expected = hf_formula(q, k, c2, s2)
    (got[0].sum() + 2 * got[1].sum()).backward()
    (expected[0].sum() + 2 * expected[1].sum()).backward()
    close(c.grad, c2.grad, label="cos grad")
    close(s.grad, s2.grad, label="sin grad")
    # float64, and gradcheck through it.
    q64, k64 = (x.double().requires_grad_(True) for x in (q[:1, :2, :3, :4], k[:1, :1, :3, :4]))
    c64, s64 = (t[:, :3, :4].double() for t in hf_tables(position_ids, 4))
    same(q64, k64, c64, s64)
    assert torch.autograd.gradcheck(
        lambda a, b: hf.apply_rotary_pos_emb(a, b, c64, s64), (q64, k64)
    )
    same(q, k.bfloat16(), cos, sin)  # q and k of different dtypes
    same(q, k, cos, sin.bfloat16())  # cos and sin of different dtypes
    odd = hf_tables(position_ids, 14)
    same(random((2, 4, 5, 15), "cpu", 3), random((2, 2, 5, 15), "cpu", 4), *odd)  # odd head_dim
    same(q, k[:, :, :1], cos, sin)  # one key against five queries: broadcast
    same(q, k[:, :0], cos, sin)  # k without heads
    same(q[0], k[0], cos[0], sin[0], unsqueeze_dim=0)  # unbatched [H, S, D]
    with pytest.raises(RuntimeError):  # three keys against five queries: transformers raises
        hf.apply_rotary_pos_emb(q, k[:, :, :3], cos, sin)


# ------------------------------------------------------------------------------------------
# Unsloth
# ------------------------------------------------------------------------------------------

def unsloth_formula(x, cos, sin, rows):
    # x [B, H, S, D]; Unsloth's kernels read the first D/2 columns of each row.
    half = x.shape[-1] // 2
    c, s = cos[rows][..., :half], sin[rows][..., :half]
    c, s = (c[:, None], s[:, None]) if rows.dim() == 2 else (c, s)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_indices", [False, True])
def test_unsloth_fast_rope_embedding_matches_its_kernels_formula(device, with_indices):
    batch, heads_q, heads_k, seq_len, head_dim = 2, 6, 2, 9, 64
    cos, sin = hf_tables(torch.arange(30, device=device), head_dim)
    cos4, sin4 = cos[None, None], sin[None, None]  # Unsloth squeezes [1, 1, P, D]
    q = random((batch, heads_q, seq_len, head_dim), device, 5, requires_grad=True)
    k = random((batch, heads_k, seq_len, head_dim), device, 6, requires_grad=True)
    indices = torch.randint(0, 30, (batch, seq_len), generator=torch.Generator().manual_seed(7)).to(device)
    rows = indices if with_indices else torch.arange(seq_len, device=device)
    used = indices if with_indices else None
    got_q, got_k = unsloth.fast_rope_embedding(q, k, cos4, sin4, used)
    close(got_q, unsloth_formula(q, cos, sin, rows), label="q")
    close(got_k, unsloth_formula(k, cos, sin, rows), label="k")
    check_gradients([q, k], lambda a, b: unsloth.fast_rope_embedding(a, b, cos4, sin4, used),
                    lambda a, b: (unsloth_formula(a, cos, sin, rows), unsloth_formula(b, cos, sin, rows)),
                    device, "unsloth")
    # The single-tensor function takes [B, S, H, D].
    got = unsloth.Fast_RoPE_Embedding.apply(q.detach().transpose(1, 2), cos4, sin4)
    close(got.transpose(1, 2), unsloth_formula(q.detach(), cos, sin, torch.arange(seq_len, device=device)),
          label="Fast_RoPE_Embedding")


# ------------------------------------------------------------------------------------------
# flash-attention
# ------------------------------------------------------------------------------------------

def flash_formula(x, cos, sin, interleaved, rows):
    """flash-attention's apply_rotary_emb_torch with per-token rows: x [..., S, H, D] tokens."""
    rotary_dim = cos.shape[-1] * 2
    c, s = cos[rows], sin[rows]
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    style = "interleaved" if interleaved else "half"
    rotated = x[..., :rotary_dim] * c + rotate_pairs(x[..., :rotary_dim], style) * s
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def flash_tables(rows, rotary_dim, device):
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * (0.5 ** torch.arange(rotary_dim // 2))
    return angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
def test_flash_attn_apply_rotary_emb_matches_its_torch_formula(device, interleaved, offsets):
    batch, seq_len, heads, head_dim, rotary_dim = 3, 7, 4, 64, 32
    cos, sin = flash_tables(40, rotary_dim, device)
    seqlen_offsets = 5 if offsets == "int" else torch.tensor([0, 11, 30], device=device, dtype=torch.int32)
    start = torch.full((batch,), 5, device=device) if offsets == "int" else seqlen_offsets.long()
    rows = start[:, None] + torch.arange(seq_len, device=device)
    x = random((batch, seq_len, heads, head_dim), device, 8, requires_grad=True)
    got = flash_attn.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets)
    close(got, flash_formula(x, cos, sin, interleaved, rows), label="x")
    check_gradients([x], lambda a: flash_attn.apply_rotary_emb(a, cos, sin, interleaved, False, seqlen_offsets),
                    lambda a: flash_formula(a, cos, sin, interleaved, rows), device, "flash")
    with torch.no_grad():
        y = x.detach().clone()
        assert flash_attn.apply_rotary_emb(y, cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets) is y
        close(y, flash_formula(x.detach(), cos, sin, interleaved, rows), label="in place")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_apply_rotary_emb_on_packed_sequences_restarts_positions_per_sequence(device):
    cu_seqlens = torch.tensor([0, 4, 9, 15], device=device, dtype=torch.int32)
    cos, sin = flash_tables(16, 32, device)
    x = random((15, 3, 32), device, 9)
    rows = torch.cat([torch.arange(4), torch.arange(5), torch.arange(6)]).to(device)
    got = flash_attn.apply_rotary_emb(x, cos, sin, interleaved=True, cu_seqlens=cu_seqlens, max_seqlen=6)
    close(got, flash_formula(x, cos, sin, True, rows), label="packed")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_flash_attn_apply_rotary_emb_rotates_part_of_an_odd_head_and_passes_the_rest(device,
                                                                                    interleaved):
    # flash-attention rotates the first R features of any head and copies the rest; an odd
    # head was refused, naming q (adversarial pass, session 47).
    cos, sin = flash_tables(12, 6, device)
    x = random((2, 5, 3, 7), device, 71, requires_grad=True)
    rows = 2 + torch.arange(5, device=device).expand(2, 5)
    got = flash_attn.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=2)
    close(got, flash_formula(x, cos, sin, interleaved, rows), label="odd head")
    check_gradients([x], lambda a: flash_attn.apply_rotary_emb(a, cos, sin, interleaved, False, 2),
                    lambda a: flash_formula(a, cos, sin, interleaved, rows), device, "odd head")
    with torch.no_grad():
        y = x.detach().clone()
        assert flash_attn.apply_rotary_emb(y, cos, sin, interleaved, inplace=True,
                                           seqlen_offsets=2) is y
        close(y, flash_formula(x.detach(), cos, sin, interleaved, rows), label="in place")
    packed = random((9, 3, 7), device, 72)
    cu_seqlens = torch.tensor([0, 4, 9], device=device, dtype=torch.int32)
    packed_rows = torch.cat([torch.arange(4), torch.arange(5)]).to(device)
    close(flash_attn.apply_rotary_emb(packed, cos, sin, interleaved, cu_seqlens=cu_seqlens),
          flash_formula(packed, cos, sin, interleaved, packed_rows), label="packed")
    before = x.detach().clone()
    wide_cos, wide_sin = flash_tables(12, 8, device)
    with pytest.raises(ValueError, match="cos: rotary_dim 8 .* exceeds x's head_dim 7"):
        flash_attn.apply_rotary_emb(x.detach(), wide_cos, wide_sin, interleaved, inplace=True)
    close(x.detach(), before, tolerance=0, label="untouched")


def test_flash_attn_qkv_and_unsloth_take_q_heads_that_are_no_multiple_of_k_heads():
    """(Adversarial pass, session 35.) flash-attention's packed qkv with Hq = 3, Hk = 2 (and
    Hq = 2, Hk = 4) and Unsloth's kernels rotate every head; the drop-ins do it in two
    launches instead of refusing."""
    for heads_q, heads_k in ((3, 2), (2, 4)):
        qkv = random((2, 6, heads_q + 2 * heads_k, 8), "cpu", 5)
        expected = qkv.clone()
        cos, sin = (t[0, :, :4] for t in hf_tables(torch.arange(6)[None], 8))
        for start, stop in ((0, heads_q), (heads_q, heads_q + heads_k)):
            x = expected[:, :, start:stop]
            x1, x2 = x[..., :4], x[..., 4:]
            c, s = cos[None, :, None], sin[None, :, None]
            expected[:, :, start:stop] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, num_heads_q=heads_q)
        close(qkv, expected, label=f"qkv {heads_q}/{heads_k}")

        q, k = random((2, heads_q, 6, 8), "cpu", 6), random((2, heads_k, 6, 8), "cpu", 7)
        table_cos, table_sin = hf_tables(torch.arange(6), 8)
        got_q, got_k = unsloth.fast_rope_embedding(q, k, table_cos, table_sin)
        rows = torch.arange(6)
        close(got_q, unsloth_formula(q, table_cos, table_sin, rows), label="unsloth q")
        close(got_k, unsloth_formula(k, table_cos, table_sin, rows), label="unsloth k")


def test_flash_attn_qkv_in_two_launches_writes_an_inference_tensor_outside_inference_mode():
    # (Adversarial pass, session 49.) As one launch does (the library writes inference
    # tensors); k's copy_ raised after q and k were both written: a retry rotated them twice.
    cos, sin = flash_tables(4, 8, "cpu")
    with torch.inference_mode():
        packed = random((1, 4, 3, 2, 8), "cpu", 62)
        heads = random((1, 4, 3 + 2 * 2, 8), "cpu", 63)
    for label, qkv, kwargs in [("cos_k given", packed, dict(cos_k=cos.clone(), sin_k=sin.clone())),
                               ("Hq 3, Hk 2", heads, dict(num_heads_q=3))]:
        expected = qkv.clone()
        with torch.inference_mode():
            flash_attn.apply_rotary_emb_qkv_(expected, cos, sin, **kwargs)
        reference = qkv.clone().reshape(1, 4, -1, 8)
        rotated_heads = 4 if label == "cos_k given" else 5
        x = reference[:, :, :rotated_heads]
        x1, x2 = x[..., :4], x[..., 4:]
        c, s = cos[None, :, None], sin[None, :, None]
        reference[:, :, :rotated_heads] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        close(expected.reshape(1, 4, -1, 8), reference, label=f"inside inference mode, {label}")
        assert flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, **kwargs) is qkv
        close(qkv, expected, tolerance=0, label=label)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_qkv_and_kv_variants_rotate_q_and_k_in_place_and_leave_v(device):
    cos, sin = flash_tables(8, 16, device)
    rows = torch.arange(8, device=device)
    qkv = random((2, 8, 3, 4, 16), device, 10)
    original = qkv.clone()
    assert flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin) is qkv
    close(qkv[:, :, 0], flash_formula(original[:, :, 0], cos, sin, False, rows), label="q")
    close(qkv[:, :, 1], flash_formula(original[:, :, 1], cos, sin, False, rows), label="k")
    torch.testing.assert_close(qkv[:, :, 2], original[:, :, 2], rtol=0, atol=0)
    gqa = random((2, 8, 8, 16), device, 11)  # 4 query heads, 2 kv heads
    original = gqa.clone()
    flash_attn.apply_rotary_emb_qkv_(gqa, cos, sin, num_heads_q=4)
    close(gqa[:, :, :6], flash_formula(original[:, :, :6], cos, sin, False, rows), label="gqa q, k")
    torch.testing.assert_close(gqa[:, :, 6:], original[:, :, 6:], rtol=0, atol=0)
    kv = random((2, 8, 2, 4, 16), device, 12)
    original = kv.clone()
    flash_attn.apply_rotary_emb_kv_(kv, cos, sin, interleaved=True)
    close(kv[:, :, 0], flash_formula(original[:, :, 0], cos, sin, True, rows), label="kv k")
    torch.testing.assert_close(kv[:, :, 1], original[:, :, 1], rtol=0, atol=0)


def test_flash_attn_qkv_with_bad_k_tables_writes_nothing_and_names_them():
    # The two-launch path rotated q in place, then k's call refused cos_k, naming "cos"
    # (atomicity audit, session 40); now k's rotation comes first, out of place.
    cos, sin = flash_tables(8, 16, "cpu")
    cases = [
        (dict(cos_k=cos[:2].clone(), sin_k=sin[:2].clone()), "cos_k: k uses table rows 0..7"),
        (dict(cos_k=cos.double(), sin_k=sin.double()), "cos_k: unsupported dtype"),
        (dict(cos_k=cos.half()), "sin: dtype float32 differs from cos_k's float16"),
        (dict(cos_k=cos.clone().requires_grad_(), sin_k=sin), "cos_k requires grad"),
        (dict(cos_k=[[1.0]], sin_k=sin), "cos_k: expected a torch.Tensor or None, got list"),
    ]
    for packed in (False, True):
        for grad in (False, True):
            for tables, message in cases:
                shape = (2, 8, 3 + 2 * 2, 16) if packed else (2, 8, 3, 4, 16)
                qkv = random(shape, "cpu", 13, requires_grad=grad) * 1
                before, version = qkv.detach().clone(), qkv._version
                with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
                    flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, num_heads_q=3 if packed else None,
                                                     **tables)
                torch.testing.assert_close(qkv.detach(), before, rtol=0, atol=0)
                assert qkv._version == version


def test_flash_attn_packed_qkv_refuses_more_query_heads_than_it_holds():
    # num_heads_q 6 of 4 heads rotated all four (v's too), -2 rotated two as q (atomicity audit,
    # session 40).
    cos, sin = flash_tables(8, 16, "cpu")
    for heads, heads_q in ((4, 6), (5, 7), (4, -2)):
        qkv = random((2, 8, heads, 16), "cpu", 14)
        before = qkv.clone()
        with pytest.raises(ValueError, match=rf"qkv: {heads} heads is not num_heads_q={heads_q} "
                                             r"\+ 2 \* Hk with Hk >= 0"):
            flash_attn.apply_rotary_emb_qkv_(qkv, cos, sin, num_heads_q=heads_q)
        torch.testing.assert_close(qkv, before, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# rotary-embedding-torch
# ------------------------------------------------------------------------------------------

@pytest.fixture
def kernel_only(monkeypatch):
    """Fails a test whose rotation falls back to plain PyTorch instead of the kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("rotary-embedding-torch drop-in fell back to PyTorch")
    monkeypatch.setattr(ret, "_rotate_in_torch", refuse)


def ret_freqs(dim, positions, theta=10000.0):
    """rotary-embedding-torch's lang angles [S, dim]: each frequency repeated for its pair."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    return (positions.float()[:, None] * inv.to(positions.device)).repeat_interleave(2, -1)


def ret_formula(freqs, t, start_index=0, scale=1.0):
    end = start_index + freqs.shape[-1]
    middle = t[..., start_index:end]
    middle = middle * freqs.cos() * scale + rotate_pairs(middle, "interleaved") * freqs.sin() * scale
    return torch.cat((t[..., :start_index], middle, t[..., end:]), dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seq_before_head_dim", [False, True])
def test_ret_rotate_queries_or_keys_matches_the_formula_with_offset_and_partial_rotary(kernel_only, device,
                                                                                       seq_before_head_dim):
    rotary = ret.RotaryEmbedding(dim=32, seq_before_head_dim=seq_before_head_dim, interpolate_factor=2.0).to(device)
    shape = (2, 11, 3, 64) if seq_before_head_dim else (2, 3, 11, 64)
    t = random(shape, device, 13, requires_grad=True)
    freqs = ret_freqs(32, (torch.arange(11, device=device) + 4) / 2.0)
    freqs_b = freqs[:, None, :] if seq_before_head_dim else freqs
    got = rotary.rotate_queries_or_keys(t, offset=4)
    close(got, ret_formula(freqs_b, t), label="rotated")
    check_gradients([t], lambda a: rotary.rotate_queries_or_keys(a, offset=4), lambda a: ret_formula(freqs_b, a),
                    device, "ret")


def test_ret_tables_follow_frequencies_assigned_anew(kernel_only):
    # The tables kept for the next call were keyed on the frequencies' version only: a new
    # Parameter, or a tensor set through .data, kept the old ones (atomicity audit, session 40).
    rotary = ret.RotaryEmbedding(dim=32)
    t = random((2, 3, 7, 32), "cpu", 16)
    rotary.rotate_queries_or_keys(t)  # keeps the tables of these frequencies
    positions = torch.arange(7, dtype=torch.float32)
    for label, assign in (("a new Parameter", lambda new: setattr(rotary, "freqs",
                                                                  torch.nn.Parameter(new, False))),
                          ("through .data", lambda new: setattr(rotary.freqs, "data", new))):
        new = rotary.freqs.detach() * 1.5
        assign(new)
        expected_freqs = (positions[:, None] * new[None]).repeat_interleave(2, dim=-1)
        close(rotary.rotate_queries_or_keys(t), ret_formula(expected_freqs, t), label=label)


def test_ret_tables_follow_frequencies_in_a_new_storage_at_an_old_address():
    # The kept tables were keyed on the frequencies' address: a new storage there (a freed
    # one's memory reused, here one NumPy buffer brought in twice), with version 0 again,
    # matched the entry made for the old frequencies (adversarial pass, session 47: 3 to 6 of
    # 50 assignments through .data, depending on the allocator).
    np = pytest.importorskip("numpy")
    rotary = ret.RotaryEmbedding(dim=8)
    t = random((1, 1, 7, 16), "cpu", 73)
    positions = torch.arange(7, dtype=torch.float32)
    memory = np.empty(4, np.float32)
    for label, values in (("first", [1.0, 0.5, 0.25, 0.125]), ("second", [2.0, 1.0, 0.5, 0.25])):
        memory[:] = values
        rotary.freqs.data = torch.from_numpy(memory)
        expected_freqs = (positions[:, None] * torch.tensor(values)).repeat_interleave(2, -1)
        with torch.no_grad():
            close(rotary.rotate_queries_or_keys(t), ret_formula(expected_freqs, t), label=label)


def test_ret_rotates_part_of_an_odd_feature_dimension_and_passes_the_rest():
    # The peer rotates features [start, start + R) whatever the parity of the rest; an odd
    # dimension was refused, naming q (adversarial pass, session 47).
    t = random((2, 3, 5, 7), "cpu", 75)
    rotary = ret.RotaryEmbedding(dim=6)
    close(rotary.rotate_queries_or_keys(t), ret_formula(ret_freqs(6, torch.arange(5)), t),
          label="module")
    freqs = ret_freqs(4, torch.arange(5))
    close(ret.apply_rotary_emb(freqs, t, start_index=1), ret_formula(freqs, t, start_index=1),
          label="function")


def test_ret_exports_and_vmaps_over_its_frequencies():
    # The kept tables' key read the frequencies' data pointer, which export's and vmap's
    # tensors lack (review, session 40): such frequencies keep no tables.
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary = ret.RotaryEmbedding(dim=8)

        def forward(self, t):
            return self.rotary.rotate_queries_or_keys(t)

    block, t = Block(), random((1, 2, 5, 8), "cpu", 17)
    close(torch.export.export(block, (t,)).module()(t), block(t), label="exported")
    base = block.rotary.freqs.detach()
    stacked = torch.stack([base, base * 2])
    got = torch.func.vmap(lambda f: torch.func.functional_call(block, {"rotary.freqs": f},
                                                               (t,)))(stacked)
    for index, freqs in enumerate(stacked):
        angles = (torch.arange(5.0)[:, None] * freqs[None]).repeat_interleave(2, dim=-1)
        close(got[index], ret_formula(angles, t), label=f"vmap {index}")


@pytest.mark.parametrize("device", DEVICES)
def test_ret_cached_keys_put_queries_at_the_last_positions(kernel_only, device):
    rotary = ret.RotaryEmbedding(dim=64).to(device)
    q, k = random((2, 4, 3, 64), device, 14), random((2, 4, 10, 64), device, 15)
    got_q, got_k = rotary.rotate_queries_with_cached_keys(q, k, offset=2)
    close(got_q, ret_formula(ret_freqs(64, torch.arange(3, device=device) + 9), q), label="q")
    close(got_k, ret_formula(ret_freqs(64, torch.arange(10, device=device)), k), label="k")


@pytest.mark.parametrize("device", DEVICES)
def test_ret_cached_keys_take_a_fractional_offset_as_the_original_does(device):
    # The original adds offset to float positions; the fused launch raised TypeError on 0.5
    # (review, session 39).
    rotary = ret.RotaryEmbedding(dim=64).to(device)
    q, k = random((2, 4, 3, 64), device, 16), random((2, 4, 10, 64), device, 17)
    got_q, got_k = rotary.rotate_queries_with_cached_keys(q, k, offset=0.5)
    close(got_q, ret_formula(ret_freqs(64, torch.arange(3, device=device) + 7.5), q), label="q")
    close(got_k, ret_formula(ret_freqs(64, torch.arange(10, device=device)), k), label="k")


def test_ret_exports_broadcat_under_the_packages_name():
    # rotary_embedding_torch's __init__ exports broadcat; the drop-in had broadcast only.
    got = ret.broadcat([torch.ones(2, 1, 3), torch.zeros(1, 4, 3)])
    assert got.shape == (2, 4, 6) and got[..., :3].eq(1).all() and got[..., 3:].eq(0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_ret_xpos_scales_queries_up_and_keys_down(kernel_only, device):
    rotary = ret.RotaryEmbedding(dim=32, use_xpos=True).to(device)
    q, k = random((1, 2, 12, 32), device, 16), random((1, 2, 12, 32), device, 17)
    got_q, got_k = rotary.rotate_queries_and_keys(q, k)
    positions = torch.arange(12, device=device).float()
    scale_base = (torch.arange(0, 32, 2, device=device) + 0.4 * 32) / (1.4 * 32)
    scale = (scale_base ** ((positions - 6) / 512)[:, None]).repeat_interleave(2, -1)
    freqs = ret_freqs(32, positions)
    close(got_q, ret_formula(freqs, q, scale=scale), label="q")
    close(got_k, ret_formula(freqs, k, scale=scale ** -1), label="k")


@pytest.mark.parametrize("device", DEVICES)
def test_ret_axial_frequencies_rotate_a_grid_flattened_or_not(kernel_only, device):
    rotary = ret.RotaryEmbedding(dim=16, freqs_for="pixel", max_freq=64).to(device)
    freqs = rotary.get_axial_freqs(4, 6)  # [4, 6, 32]
    assert freqs.shape == (4, 6, 32)
    pixel = torch.linspace(1.0, 32, 8) * math.pi
    rows = torch.linspace(-1, 1, 4)[:, None, None] * pixel.repeat_interleave(2)
    cols = torch.linspace(-1, 1, 6)[None, :, None] * pixel.repeat_interleave(2)
    expected = torch.cat(torch.broadcast_tensors(rows, cols), dim=-1).to(device)
    close(freqs, expected, label="freqs")
    t = random((2, 3, 4, 6, 64), device, 18)
    close(ret.apply_rotary_emb(freqs, t), ret_formula(freqs, t), tolerance=1e-4, label="grid")
    flat = random((2, 3, 24, 64), device, 19)
    close(ret.apply_rotary_emb(freqs.reshape(24, 32), flat), ret_formula(freqs.reshape(24, 32), flat),
          tolerance=1e-4, label="flattened")


@pytest.mark.parametrize("device", DEVICES)
def test_ret_learned_frequencies_get_their_gradient(device):
    rotary = ret.RotaryEmbedding(dim=16, learned_freq=True).to(device)
    t = random((1, 2, 5, 16), device, 20)
    rotary.rotate_queries_or_keys(t).square().sum().backward()
    freqs = rotary.freqs.detach().clone().requires_grad_(True)
    angles = (torch.arange(5, device=device).float()[:, None] * freqs).repeat_interleave(2, -1)
    ret_formula(angles, t).square().sum().backward()
    close(rotary.freqs.grad, freqs.grad, tolerance=1e-4, label="d freqs")


@pytest.mark.parametrize("device", DEVICES)
def test_ret_module_apply_rotary_emb_uses_the_last_rows_of_longer_frequencies(kernel_only, device):
    freqs = ret_freqs(32, torch.arange(20, device=device))
    t = random((2, 4, 7, 48), device, 21)
    close(ret.apply_rotary_emb(freqs, t, start_index=8), ret_formula(freqs[-7:], t, start_index=8), label="t")


# ------------------------------------------------------------------------------------------
# flash_attn_with_rotary (needs the library's attention op)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["causal", "bool_mask", "indices"])
def test_flash_attn_with_rotary_matches_the_reference_attention_and_its_gradients(device, variant):
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    batch, heads_q, heads_k, seq_len, head_dim = 2, 4, 2, 12, 32
    q = random((batch, heads_q, seq_len, head_dim), device, 22, requires_grad=True)
    k = random((batch, heads_k, seq_len, head_dim), device, 23, requires_grad=True)
    v = random((batch, heads_k, seq_len, head_dim), device, 24, requires_grad=True)
    kwargs = {}
    if variant == "indices":
        kwargs["rotary_pos_emb"] = ret_freqs(32, torch.arange(10, device=device))
        kwargs["rotary_pos_emb_indices"] = torch.arange(10, device=device) + 2
        kwargs["is_causal"] = False
    else:
        kwargs["rotary_pos_emb"] = ret_freqs(16, torch.arange(seq_len, device=device))  # partial rotary
        if variant == "bool_mask":
            mask = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
            mask[1, 7:] = False
            kwargs["attn_mask"], kwargs["is_causal"] = mask, False
    reference = ret.get_flash_attention_fused(force_reference=True)
    got = ret.flash_attn_with_rotary(q, k, v, **kwargs)
    close(got, reference(q, k, v, **kwargs), tolerance=1e-4, label=variant)
    check_gradients([q, k, v], lambda a, b, c: ret.flash_attn_with_rotary(a, b, c, **kwargs),
                    lambda a, b, c: reference(a, b, c, **kwargs), device, variant, tolerance=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_with_rotary_under_deterministic_algorithms_is_reproducible_and_right(device):
    # torch.use_deterministic_algorithms(True) selects the library's bitwise-reproducible
    # backward (rope_jit_attention_args.deterministic): the same gradients as the reference,
    # and the same bits on a second run.
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    q = random((1, 4, 40, 64), device, 31, requires_grad=True)
    k = random((1, 2, 40, 64), device, 32, requires_grad=True)
    v = random((1, 2, 40, 64), device, 33, requires_grad=True)
    kwargs = {"rotary_pos_emb": ret_freqs(64, torch.arange(40, device=device)), "is_causal": True}
    reference = ret.get_flash_attention_fused(force_reference=True)
    previous = torch.are_deterministic_algorithms_enabled()
    # warn_only: the reference's own matmuls on CUDA would otherwise ask for a cuBLAS setting.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        grads = []
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            ret.flash_attn_with_rotary(q, k, v, **kwargs).square().sum().backward()
            grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
        check_gradients([q, k, v], lambda a, b, c: ret.flash_attn_with_rotary(a, b, c, **kwargs),
                        lambda a, b, c: reference(a, b, c, **kwargs), device, "deterministic",
                        tolerance=1e-4)
    finally:
        torch.use_deterministic_algorithms(previous)
    for first, second in zip(*grads):
        assert torch.equal(first, second)


def test_hf_old_call_with_a_table_and_position_ids_broadcasts_and_falls_back_as_transformers():
    # transformers < 4.38 passes a [P, D] table and position_ids [1, S] for any batch; a
    # float64 or differentiated table runs transformers' formula. All three raised before
    # (adversarial pass, session 37).
    batch, seq_len, dim = 2, 5, 8
    cos, sin = hf_tables(torch.arange(32), dim)  # [P, D]
    q = random((batch, 4, seq_len, dim), "cpu", 40)
    k = random((batch, 2, seq_len, dim), "cpu", 41)
    position_ids = torch.tensor([[3, 0, 7, 7, 1]])  # [1, S]

    def transformers_old(q, k, cos, sin, position_ids):
        c, s = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        return q * c + rotate_pairs(q, "half") * s, k * c + rotate_pairs(k, "half") * s

    for label, args in [
        ("[1, S]", (q, k, cos, sin)),
        ("float64", (q.double(), k.double(), cos.double(), sin.double())),
    ]:
        got = hf.apply_rotary_pos_emb(*args, position_ids)
        expected = transformers_old(*args, position_ids)
        close(got[0], expected[0], label=label)
        close(got[1], expected[1], label=label)
    learned = cos.clone().requires_grad_()
    got_q, _ = hf.apply_rotary_pos_emb(q, k, learned, sin, position_ids.expand(batch, seq_len))
    got_q.sum().backward()
    reference = cos.clone().requires_grad_()
    transformers_old(q, k, reference, sin, position_ids.expand(batch, seq_len))[0].sum().backward()
    close(learned.grad, reference.grad, label="cos gradient")


def test_hf_position_ids_beside_a_3d_cos_are_ignored_also_where_transformers_formula_runs():
    cos, sin = hf_tables(torch.arange(5)[None], 8)
    q = random((1, 2, 5, 8), "cpu", 45).double()
    got = hf.apply_rotary_pos_emb(q, q, cos.double(), sin.double(), torch.arange(5)[None])
    expected = hf.apply_rotary_pos_emb(q, q, cos.double(), sin.double())
    close(got[0], expected[0])
