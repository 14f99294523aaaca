"""rope_jit.rope with QK-norm (q_norm_weight, k_norm_weight) on NumPy arrays, against a NumPy
float64 reference written here from the definitions: RMSNorm of each head, then the rotation
(HF's rotate_half for the half style, pairs (2i, 2i+1) interleaved, (i, i + D/2) proportional);
the backward's dL/dx and dL/dw against the reference's gradient, itself checked against finite
differences."""

import itertools
import random

import numpy as np
import pytest

import rope_jit
from library_arrays import from_dtype, library_tensor, to_dtype

TOLERANCES = {"float32": 3e-5, "float16": 3e-3, "bfloat16": 1.6e-2}


def pairs_of(style, head_dim, rotary_dim):
    i = np.arange(rotary_dim // 2)
    if style == "interleaved":
        return 2 * i, 2 * i + 1
    if style == "proportional":
        return i, i + head_dim // 2
    return i, i + rotary_dim // 2


def rotation_matrix(style, head_dim, rotary_dim, angles):
    """[N, D, D] matrices M with y = M x for each token's angles [N, R/2]."""
    n = angles.shape[0]
    m = np.tile(np.eye(head_dim), (n, 1, 1))
    first, second = pairs_of(style, head_dim, rotary_dim)
    c, s = np.cos(angles), np.sin(angles)
    m[:, first, first], m[:, first, second] = c, -s
    m[:, second, first], m[:, second, second] = s, c
    return m


def reference_forward(x, w, eps, unit_offset, rot):
    """x [N, H, D] float64, rot [N, D, D]: rope(x / rms(x) * w')."""
    weight = w + (1.0 if unit_offset else 0.0)
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight
    return np.einsum("nij,nhj->nhi", rot, n)


def reference_backward(x, w, eps, unit_offset, rot, dy):
    """(dL/dx, dL/dw) for loss = sum(dy * forward(x)), by the chain rule."""
    weight = w + (1.0 if unit_offset else 0.0)
    g = np.einsum("nji,nhj->nhi", rot, dy)  # the transposed rotation
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    xh = x * r
    dx = r * (weight * g - xh * (weight * g * xh).mean(-1, keepdims=True))
    return dx, (g * xh).sum(axis=(0, 1))


def test_the_reference_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    x, w, dy = rng.standard_normal((3, 2, 8)), rng.standard_normal(8), rng.standard_normal((3, 2, 8))
    rot = rotation_matrix("half", 8, 4, rng.uniform(-3, 3, (3, 2)))
    dx, dw = reference_backward(x, w, 1e-5, True, rot, dy)
    step = 1e-6

    def loss(x_, w_):
        return float((dy * reference_forward(x_, w_, 1e-5, True, rot)).sum())

    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += step
        down[index] -= step
        assert dx[index] == pytest.approx((loss(up, w) - loss(down, w)) / (2 * step), rel=1e-5, abs=1e-7)
    for d in range(8):
        up, down = w.copy(), w.copy()
        up[d] += step
        down[d] -= step
        assert dw[d] == pytest.approx((loss(x, up) - loss(x, down)) / (2 * step), rel=1e-5, abs=1e-7)


def sample_cases(count=40):
    grid = list(itertools.product(
        ["bhsd", "bshd"], ["float32", "float16", "bfloat16"], ["half", "interleaved", "proportional"],
        [16, 128, 576], ["full", "quarter"], [False, True], [False, True], [False, True], [False, True]))
    chosen = random.Random(99).sample(grid, count)
    names = ("layout", "dtype", "style", "head_dim", "rotary", "with_k", "in_place", "backward", "unit_offset")
    return [dict(zip(names, values), seed=index) for index, values in enumerate(chosen)]


@pytest.mark.parametrize("case", sample_cases(), ids=lambda case: "-".join(str(v) for v in case.values()))
def test_qk_norm_matches_the_reference(case, cpu_runtime):
    rng = np.random.default_rng(case["seed"])
    layout, dtype, style, head_dim = case["layout"], case["dtype"], case["style"], case["head_dim"]
    rotary_dim = head_dim if case["rotary"] == "full" else head_dim // 4
    batch, heads_q, heads_k, seq_len, eps = 2, 4, 2, 5, 1e-5
    inv_freq = (1.0 / 10000 ** (np.arange(rotary_dim // 2) * 2 / rotary_dim)).astype(np.float32)
    rows = np.tile(np.arange(seq_len) + 3, batch)  # position_offset 3, (batch, token) order
    rot = rotation_matrix(style, head_dim, rotary_dim, rows[:, None] * inv_freq.astype(np.float64)[None, :])

    def make(heads):
        shape = (batch, heads, seq_len, head_dim) if layout == "bhsd" else (batch, seq_len, heads, head_dim)
        return to_dtype(rng.standard_normal(shape), dtype)

    def tokens(values):  # [B*S, H, D] in (batch, token) order
        return (values.transpose(0, 2, 1, 3) if layout == "bhsd" else values).reshape(batch * seq_len, -1, head_dim)

    arguments = dict(inv_freq=inv_freq, position_offset=3, rotary_dim=rotary_dim, style=style, layout=layout,
                     backward=case["backward"], norm_eps=eps, norm_unit_offset=case["unit_offset"])
    names = ["q"] + (["k"] if case["with_k"] else [])
    tensors, weights, inputs, results, grads = {}, {}, {}, {}, {}
    for name, heads in zip(names, (heads_q, heads_k)):
        array, values = make(heads)
        tensors[name] = values
        weights[name] = rng.uniform(-0.5, 0.5, head_dim) + (0.0 if case["unit_offset"] else 1.0)
        arguments[name] = library_tensor(array, dtype)
        arguments[name + "_norm_weight"] = weights[name].astype(np.float32)
        if case["in_place"]:
            results[name] = array
        else:
            results[name] = np.zeros_like(array)
            arguments[name + "_out"] = library_tensor(results[name], dtype)
        if case["backward"]:
            x_array, inputs[name] = make(heads)
            arguments[name + "_norm_input"] = library_tensor(x_array, dtype)
            grads[name] = np.full(head_dim, np.nan, np.float32)
            arguments[name + "_norm_weight_grad"] = grads[name]

    rope_jit.rope(runtime=cpu_runtime, **arguments)

    tolerance = TOLERANCES[dtype]
    for name in names:
        w = weights[name].astype(np.float32).astype(np.float64)
        if case["backward"]:
            expected, dw = reference_backward(tokens(inputs[name]), w, eps, case["unit_offset"], rot,
                                              tokens(tensors[name]))
            np.testing.assert_allclose(grads[name], dw, rtol=1e-4, atol=1e-4 * (1 + np.abs(dw).max()),
                                       err_msg=f"d{name}_norm_weight of {case}")
        else:
            expected = reference_forward(tokens(tensors[name]), w, eps, case["unit_offset"], rot)
        got = tokens(from_dtype(results[name], dtype))
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=f"{name} of {case}")


def test_qk_norm_errors_name_the_argument(cpu_runtime):
    q = np.ones((1, 2, 3, 8), np.float32)
    k = np.ones((1, 1, 3, 8), np.float32)
    inv_freq = np.ones(4, np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises(rope_jit.InvalidArgumentError, match="k_norm_weight"):
        rope_jit.rope(q, k, inv_freq=inv_freq, q_norm_weight=w, runtime=cpu_runtime)
    with pytest.raises(rope_jit.InvalidArgumentError, match="norm_eps"):
        rope_jit.rope(q, k, inv_freq=inv_freq, q_norm_weight=w, k_norm_weight=w, norm_eps=-1.0,
                      runtime=cpu_runtime)
    with pytest.raises(rope_jit.InvalidArgumentError, match="q_norm_input"):
        rope_jit.rope(q, k, inv_freq=inv_freq, q_norm_weight=w, k_norm_weight=w, backward=True,
                      runtime=cpu_runtime)
    np.testing.assert_array_equal(q, 1.0)
