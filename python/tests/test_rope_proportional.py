"""rope_jit.rope with style="proportional" (Gemma-4 partial rotary) on NumPy arrays, against a
NumPy reference written from HF's formulation of it rather than from pairs: the D/2 inverse
frequencies are the R/2 rotated ones followed by zeros, and y = x * cos + rotate_half(x) * sin
over the whole head. Layouts, dtypes, table kinds and inv_freq, positions, GQA, in and out of
place, forward and backward, head_dim up to 576."""

import itertools
import random

import numpy as np
import pytest

import rope_jit
from rope_jit.frequencies import rope_tables
from rope_reference import packed_rows, token_rows
from library_arrays import from_dtype, library_tensor, to_dtype

TOLERANCES = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def hf_proportional(x, cos_pairs, sin_pairs):
    """x [N, H, D] float64; cos_pairs/sin_pairs [N, R/2] the angles' cosines and sines of each
    token's R/2 rotated pairs. HF: cos = cat(freqs, freqs) padded to D with angle 0."""
    n, _, d = x.shape
    pad = d // 2 - cos_pairs.shape[1]
    cos_half = np.concatenate([cos_pairs, np.ones((n, pad))], axis=1)
    sin_half = np.concatenate([sin_pairs, np.zeros((n, pad))], axis=1)
    cos_full = np.concatenate([cos_half, cos_half], axis=1)[:, None, :]
    sin_full = np.concatenate([sin_half, sin_half], axis=1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos_full + rotated * sin_full


def flat_tokens(x, layout):
    """[N, H, D] view of every layout, in (batch, token) order."""
    if layout == "bhsd":
        return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])
    if layout == "bshd":
        return x.reshape(-1, x.shape[2], x.shape[3])
    return x


def sample_cases(count=48):
    grid = list(itertools.product(
        ["bhsd", "bshd", "thd"], ["float32", "float16", "bfloat16"], ["table_half", "table_full", "inv_freq"],
        ["implicit", "indices", "seqlen_offsets"], [8, 64, 512, 576], ["quarter", "half", "full"],
        [False, True], [False, True], [False, True]))
    chosen = random.Random(4321).sample(grid, count)
    return [dict(zip(("layout", "dtype", "angles", "positions", "head_dim", "rotary", "with_k", "in_place",
                      "backward"), values), seed=index) for index, values in enumerate(chosen)]


@pytest.mark.parametrize("case", sample_cases(), ids=lambda case: "-".join(str(v) for v in case.values()))
def test_proportional_matches_hfs_formulation(case, cpu_runtime):
    rng = np.random.default_rng(case["seed"])
    layout, dtype, head_dim = case["layout"], case["dtype"], case["head_dim"]
    rotary_dim = {"quarter": head_dim // 4, "half": head_dim // 2, "full": head_dim}[case["rotary"]]
    rotary_dim -= rotary_dim % 2
    half = rotary_dim // 2
    batch, heads_q, heads_k, seq_len, rows_in_table = 2, 4, 2, 5, 30
    arguments, total = {}, 0
    cu_seqlens = np.array([0, 2, 7], dtype=np.int64)
    if layout == "thd":
        arguments["cu_seqlens"] = cu_seqlens
        total = int(cu_seqlens[-1])
    if case["positions"] == "indices":
        shape = total if layout == "thd" else (batch, seq_len)
        arguments["positions"] = rng.integers(0, rows_in_table, shape).astype(np.int64)
    elif case["positions"] == "seqlen_offsets":
        arguments["seqlen_offsets"] = rng.integers(0, 10, 2).astype(np.int32)
    if layout == "thd":
        rows = packed_rows(cu_seqlens, arguments.get("positions"), arguments.get("seqlen_offsets"), 0)
    else:
        rows = token_rows(batch, seq_len, arguments.get("positions"), arguments.get("seqlen_offsets"), 0)
    rows = np.asarray(rows).reshape(-1)

    # Gemma-4's frequencies come from head_dim (not R): base ** (-2i / D) for the R/2 pairs.
    inv_freq = (1.0 / 10000 ** (np.arange(half) * 2 / head_dim)).astype(np.float32)
    if case["angles"] == "inv_freq":
        arguments["inv_freq"] = inv_freq
        angles = np.arange(rows_in_table)[:, None] * inv_freq.astype(np.float64)[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
    else:
        angles = rng.uniform(-4, 4, (rows_in_table, half))
        cos32, sin32 = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        if case["angles"] == "table_full":  # HF's cat(freqs, freqs), as for the half style
            arguments["cos"], arguments["sin"] = np.concatenate([cos32] * 2, 1), np.concatenate([sin32] * 2, 1)
        else:
            arguments["cos"], arguments["sin"] = cos32, sin32
        cos, sin = cos32.astype(np.float64), sin32.astype(np.float64)
    if case["backward"]:
        sin = -sin

    def make(heads):
        shape = {"bhsd": (batch, heads, seq_len, head_dim), "bshd": (batch, seq_len, heads, head_dim),
                 "thd": (total, heads, head_dim)}[layout]
        return to_dtype(rng.standard_normal(shape), dtype)

    names = [("q",) + make(heads_q)] + ([("k",) + make(heads_k)] if case["with_k"] else [])
    results = {}
    for name, array, _ in names:
        arguments[name] = library_tensor(array, dtype)
        if case["in_place"]:
            results[name] = array
        else:
            results[name] = np.zeros_like(array)
            arguments[name + "_out"] = library_tensor(results[name], dtype)

    rope_jit.rope(style="proportional", rotary_dim=rotary_dim, backward=case["backward"], layout=layout,
                  runtime=cpu_runtime, **arguments)

    for name, _, values in names:
        flat = flat_tokens(values, layout)
        expected = hf_proportional(flat, cos[rows], sin[rows])
        got = flat_tokens(from_dtype(results[name], dtype), layout)
        tolerance = TOLERANCES[dtype]
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=f"{name} of {case}")
        # The unrotated tail of each half passes through exactly.
        tail = np.r_[half: head_dim // 2, head_dim // 2 + half: head_dim]
        np.testing.assert_array_equal(got[..., tail], flat[..., tail], err_msg=f"{name} of {case}")


def test_a_rotary_offset_with_proportional_pairs_is_refused_naming_it(cpu_runtime):
    q = np.ones((1, 1, 2, 16), np.float32)
    cos = np.ones((2, 4), np.float32)
    with pytest.raises(rope_jit.InvalidArgumentError, match="rotary_offset"):
        rope_jit.rope(q, cos=cos, sin=cos, rotary_dim=8, rotary_offset=2, style="proportional",
                      runtime=cpu_runtime)
    np.testing.assert_array_equal(q, 1.0)


def test_proportional_tables_are_laid_out_as_half_ones(library):
    inv_freq = [1.0, 0.25]
    cos_p, sin_p = np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)
    cos_h, sin_h = np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)
    rope_tables(inv_freq, cos=cos_p, sin=sin_p, style="proportional")
    rope_tables(inv_freq, cos=cos_h, sin=sin_h, style="half")
    np.testing.assert_array_equal(cos_p, cos_h)
    np.testing.assert_array_equal(sin_p, sin_h)
    angles = np.arange(3)[:, None] * np.array(inv_freq)[None, :]
    np.testing.assert_allclose(cos_p, np.cos(np.concatenate([angles, angles], 1)), rtol=1e-6, atol=1e-6)
