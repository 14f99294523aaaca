"""The golden cases (outputs recorded from Unsloth, Liger, flash-attention,
rotary-embedding-torch and HF transformers) run through the Python API on the CPU, and the
independent NumPy reference checked against them too."""

import numpy as np
import pytest

import rope_jit
from golden_cases import as_float, assert_close, cases, load_all
from rope_reference import packed_rows, rope_reference, token_rows

ROPE_CASES = cases("rope")


def test_the_golden_manifest_has_rope_cases_of_every_peer():
    sources = {case["source"].split()[0] for case in ROPE_CASES}
    assert len(ROPE_CASES) >= 25
    assert {"unsloth", "Liger-Kernel", "flash-attention", "rotary-embedding-torch"} <= sources


def _prepare(case):
    params = case["params"]
    inputs = load_all(case["inputs"])
    layout = params.get("layout", "bhsd")
    position_offset = params.get("position_offset", 0)
    q_position_offset = 0
    if "q_position_offset" in inputs:
        # README rule 3 puts q at s + q_position_offset *instead of* s + position_offset; the
        # API adds its q_position_offset on top of position_offset.
        q_position_offset = int(inputs["q_position_offset"][0][0]) - position_offset
    return params, inputs, layout, position_offset, q_position_offset


def _tensor(array, dtype):
    array = np.ascontiguousarray(array)
    return rope_jit.reinterpret(array, "bfloat16") if dtype == "bfloat16" else array


@pytest.mark.parametrize("placement", ["out_of_place", "in_place"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=[case["name"] for case in ROPE_CASES])
def test_each_golden_rope_case_matches_its_peer_through_the_python_api(case, placement, cpu_runtime):
    params, inputs, layout, position_offset, q_position_offset = _prepare(case)
    arguments = {}
    outputs = {}
    for name in ("q", "k"):
        if name not in inputs:
            continue
        array, dtype = inputs[name]
        array = array.copy()
        arguments[name] = _tensor(array, dtype)
        outputs[name] = (array, dtype)
        if placement == "out_of_place":
            out = np.full_like(array, 0xFFFF if dtype == "bfloat16" else np.nan)  # NaN in every dtype
            arguments[name + "_out"] = _tensor(out, dtype)
            outputs[name] = (out, dtype)
    for name in ("cos", "sin", "positions", "seqlen_offsets", "cu_seqlens"):
        if name in inputs:
            arguments[name] = _tensor(*inputs[name])
    if params.get("xpos"):
        arguments["xpos_scale"] = _tensor(*inputs["xpos_scale"])
    rope_jit.rope(layout=layout, style=params["style"], rotary_dim=params["rotary_dim"],
                  rotary_offset=params.get("rotary_offset", 0), backward=params["backward"],
                  position_offset=position_offset, q_position_offset=q_position_offset, runtime=cpu_runtime,
                  **arguments)
    expected = load_all(case["outputs"])
    for name, (array, dtype) in expected.items():
        got_array, got_dtype = outputs[name]
        assert_close(as_float(got_array, got_dtype), as_float(array, dtype), case["tolerance"],
                     f"{case['name']} {name} ({placement})")


@pytest.mark.parametrize("case", ROPE_CASES, ids=[case["name"] for case in ROPE_CASES])
def test_the_numpy_reference_reproduces_each_golden_rope_case(case):
    # The tests trust rope_reference.py as their oracle: it must agree with the peers too.
    params, inputs, layout, position_offset, q_position_offset = _prepare(case)
    cos, sin = as_float(*inputs["cos"]), as_float(*inputs["sin"])
    expected = load_all(case["outputs"])
    for name in ("q", "k"):
        if name not in inputs:
            continue
        x = as_float(*inputs[name])
        positions = inputs["positions"][0] if "positions" in inputs else None
        offsets = inputs["seqlen_offsets"][0] if "seqlen_offsets" in inputs else None
        offset = position_offset + (q_position_offset if name == "q" else 0)
        if layout == "thd":
            rows = packed_rows(inputs["cu_seqlens"][0], positions, offsets, offset)
        else:
            seq_len = x.shape[2] if layout == "bhsd" else x.shape[1]
            rows = token_rows(x.shape[0], seq_len, positions, offsets, offset)
        xpos = as_float(*inputs["xpos_scale"]) if params.get("xpos") else None
        got = rope_reference(x, layout, cos, sin, rows, rotary_dim=params["rotary_dim"],
                             rotary_offset=params.get("rotary_offset", 0), style=params["style"],
                             backward=params["backward"], xpos=xpos, xpos_divides=name == "k")
        assert_close(got, as_float(*expected[name]), case["tolerance"], f"{case['name']} {name} (reference)")


ATTENTION_CASES = cases("attention")
INV_FREQ_CASES = cases("inv_freq")


def run_golden_attention(case, inputs, to_tensor, empty_like, runtime=None):
    """Runs one attention case through rope_jit.attention; returns its output."""
    params = case["params"]
    tensors = {name: to_tensor(*inputs[name]) for name in ("q", "k", "v", "cos", "sin", "pos_mask", "attn_mask")
               if name in inputs}
    out = empty_like(tensors["q"])
    rope_jit.attention(tensors.pop("q"), tensors.pop("k"), tensors.pop("v"), out, causal=params["causal"],
                       scale=params["scale"], rotary_dim=params["rotary_dim"], style=params["style"], runtime=runtime,
                       **tensors)
    return out


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[case["name"] for case in ATTENTION_CASES])
def test_each_golden_attention_case_matches_through_the_python_api(case, cpu_runtime):
    if not rope_jit.has_attention(cpu_runtime):
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    inputs = load_all(case["inputs"])
    out = run_golden_attention(case, inputs, _tensor, lambda q: np.full_like(q, np.nan), cpu_runtime)
    expected, dtype = load_all(case["outputs"])["out"]
    assert_close(as_float(out, dtype), as_float(expected, dtype), case["tolerance"], case["name"])


def freq_fields(params):
    """The rope_jit_freq_config fields of an inv_freq case's HF parameters."""
    fields = {"theta": params["rope_theta"]}
    for name in ("factor", "max_position_embeddings", "original_max_position_embeddings", "seq_len",
                 "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
        if name in params:
            fields[name] = params[name]
    return fields


@pytest.mark.parametrize("case", INV_FREQ_CASES, ids=[case["name"] for case in INV_FREQ_CASES])
def test_each_golden_frequency_case_matches_hf_transformers(case):
    from rope_jit import frequencies
    if not frequencies.has_frequency_builders():
        pytest.skip("the loaded librope_jit has no rope_jit_inv_freq")
    params = case["params"]
    values, attention_factor = frequencies.inv_freq(params["rope_type"], params["head_dim"], **freq_fields(params))
    expected = load_all(case["outputs"])
    assert_close(np.array(values, np.float64), as_float(*expected["inv_freq"]), case["tolerance"],
                 f"{case['name']} inv_freq")
    assert_close(np.array([attention_factor]), as_float(*expected["attention_factor"]), case["tolerance"],
                 f"{case['name']} attention_factor")
