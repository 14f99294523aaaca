"""Issue 20, P1 and P2: Python arguments that C would misread are refused before the call.

P1: a sequence shorter than what the library reads (rope_tables' positions, longrope's
short_factor/long_factor) made C read past the Python buffer. P2: ctypes silently truncated
integers wider than the C field (2**64 -> 0, 2**32 + 16 -> 16), floats (16.7 -> 16) and
strings with NUL (cut at the NUL). Each case here gave a result (or OK) before the fix; now it
raises, naming the argument, and writes nothing."""

import re
from pathlib import Path

import numpy as np
import pytest

import rope_jit
from rope_jit import _structs as s
from rope_jit import frequencies


def tensors():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 4, 32)).astype(np.float32)
    cos = np.cos(rng.standard_normal((8, 16))).astype(np.float32)
    sin = np.sin(rng.standard_normal((8, 16))).astype(np.float32)
    return q, cos, sin


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("position_offset", 2**64, OverflowError),
        ("position_offset", 2**63, OverflowError),
        ("q_position_offset", -(2**64) + 3, OverflowError),
        ("rotary_dim", 2**32 + 16, OverflowError),
        ("rotary_offset", 2**31, OverflowError),
        ("rotary_dim", 16.7, TypeError),
        ("position_offset", 1.0, TypeError),
        ("rotary_dim", "16", TypeError),
    ],
)
def test_rope_refuses_integers_that_do_not_fit_their_c_field_and_non_integers(
    cpu_runtime, name, value, error
):
    q, cos, sin = tensors()
    before = q.copy()
    with pytest.raises(error, match=name):
        rope_jit.rope(q, cos=cos, sin=sin, runtime=cpu_runtime, **{name: value})
    np.testing.assert_array_equal(q, before)  # nothing written


def test_rope_still_takes_numpy_integers_and_bools_where_c_wants_an_int(cpu_runtime):
    q, cos, sin = tensors()
    expected, _ = rope_jit.rope(
        q.copy(), cos=cos, sin=sin, position_offset=2, rotary_dim=16, runtime=cpu_runtime
    )
    got, _ = rope_jit.rope(
        q.copy(),
        cos=cos,
        sin=sin,
        position_offset=np.int64(2),
        rotary_dim=np.int32(16),
        runtime=cpu_runtime,
    )
    np.testing.assert_array_equal(got, expected)


def test_no_mrope_sections_is_plain_rope_in_rope_as_in_rope_tables(cpu_runtime):
    # rope() failed on [] with "num_mrope_sections = 0", a C field Python never sets, where
    # rope_tables() takes [] as no sections (review, session 39).
    q, cos, sin = tensors()
    expected, got = q.copy(), q.copy()
    rope_jit.rope(expected, cos=cos, sin=sin, runtime=cpu_runtime)
    rope_jit.rope(got, cos=cos, sin=sin, mrope_sections=[], runtime=cpu_runtime)
    np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(got, q)


def test_mrope_sections_that_do_not_fit_an_int32_are_refused(cpu_runtime):
    q, cos, sin = tensors()
    positions = np.zeros((2, 4), np.int64)
    with pytest.raises(OverflowError, match=r"mrope_sections\[0\]"):
        rope_jit.rope(
            q,
            cos=cos,
            sin=sin,
            positions=positions,
            mrope_sections=[2**32 + 4, 4],
            runtime=cpu_runtime,
        )
    with pytest.raises(TypeError, match=r"mrope_sections\[1\]"):
        rope_jit.rope(
            q, cos=cos, sin=sin, positions=positions, mrope_sections=[4, 4.0], runtime=cpu_runtime
        )


def test_list_and_name_arguments_of_another_kind_are_errors_naming_them(cpu_runtime):
    # An int for a list, or a list for a name, gave Python's own "'int' object is not
    # iterable" and "unhashable type: 'list'" (adversarial pass, session 47).
    q, cos, sin = tensors()
    before = q.copy()
    with pytest.raises(TypeError, match="mrope_sections: expected a sequence, got int 4"):
        rope_jit.rope(q, cos=cos, sin=sin, positions=np.zeros((1, 4), np.int64),
                      mrope_sections=4, runtime=cpu_runtime)
    with pytest.raises(ValueError, match=r"kv_layout: expected one of .*, got \['nhd'\]"):
        rope_jit.rope(q, cos=cos, sin=sin, kv_layout=["nhd"], runtime=cpu_runtime)
    np.testing.assert_array_equal(q, before)
    if frequencies.has_frequency_builders():
        table = np.full((4, 4), 7.0, np.float32)
        for field, value in (("positions", 3), ("mrope_sections", 4)):
            with pytest.raises(TypeError, match=f"{field}: expected a sequence, got int"):
                frequencies.rope_tables([1, 0.1, 0.01, 0.001], cos=table, **{field: value})
        np.testing.assert_array_equal(table, 7.0)


def test_attention_names_only_the_styles_it_takes(cpu_runtime):
    # Its message listed 'proportional', which the library then refused for attention
    # (adversarial pass, session 49).
    if not rope_jit.has_attention():
        pytest.skip("the loaded library has no attention op")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    out = np.full_like(q, 7.0)
    table = np.ones((2, 4), np.float32)
    for style in ("neox", "proportional", s.STYLE_PROPORTIONAL):
        with pytest.raises(ValueError, match=re.escape("style: expected one of ['half', 'interleaved'], got")):
            rope_jit.attention(q, q.copy(), q.copy(), out, cos=table, sin=table, style=style,
                               runtime=cpu_runtime)
    np.testing.assert_array_equal(out, 7.0)


def test_runtime_refuses_a_thread_count_past_int_and_a_cache_dir_with_nul(library):
    with pytest.raises(OverflowError, match="cpu_threads"):
        rope_jit.Runtime(backend="cpu", cpu_threads=2**32)
    with pytest.raises(TypeError, match="cpu_threads"):
        rope_jit.Runtime(backend="cpu", cpu_threads=2.5)
    with pytest.raises(ValueError, match="cache_dir"):
        rope_jit.Runtime(backend="cpu", cache_dir="/a\0/etc")


def test_prewarm_refuses_wide_head_dims_and_targets_with_nul(cpu_runtime):
    with pytest.raises(OverflowError, match=r"specs\[0\].head_dim"):
        cpu_runtime.prewarm([{"head_dim": 2**32 + 64}], target="sm_90")
    with pytest.raises(TypeError, match=r"specs\[0\].rotary_dim"):
        cpu_runtime.prewarm([{"head_dim": 64, "rotary_dim": 16.7}], target="sm_90")
    with pytest.raises(ValueError, match="target"):
        cpu_runtime.prewarm([{"head_dim": 64}], target="sm_90\0x")


needs_builders = pytest.mark.skipif(
    not frequencies.has_frequency_builders(),
    reason="the loaded librope_jit has no rope_jit_inv_freq",
)


@needs_builders
def test_rope_tables_refuses_positions_shorter_than_the_rows():
    cos = np.full((4, 4), 7.0, np.float32)
    with pytest.raises(ValueError, match="positions"):
        frequencies.rope_tables([1, 0.1, 0.01, 0.001], cos=cos, positions=[0.0])
    np.testing.assert_array_equal(cos, 7.0)
    # One position axis per section: 2 sections x 4 rows need 8 positions.
    with pytest.raises(ValueError, match="positions"):
        frequencies.rope_tables(
            [1, 0.1, 0.01, 0.001], cos=cos, positions=[0.0] * 4, mrope_sections=[2, 2]
        )
    np.testing.assert_array_equal(cos, 7.0)
    frequencies.rope_tables([1, 0.1, 0.01, 0.001], cos=cos, positions=[0.0, 1.0, 2.0, 3.0])
    np.testing.assert_allclose(cos[:, 0], np.cos([0.0, 1.0, 2.0, 3.0]), atol=1e-6)


@needs_builders
def test_frequency_counts_past_the_cap_are_refused_before_anything_is_allocated():
    # inv_freq("constant", num_freqs=2**31 - 1) made an 8 GiB array first (review, session 38).
    for rope_type, fields in (("constant", dict(num_freqs=2**31 - 1)),
                              ("constant", dict(num_freqs=s.MAX_FREQUENCIES + 1)),
                              ("default", dict(rotary_dim=2 * s.MAX_FREQUENCIES + 2))):
        with pytest.raises(ValueError, match="at most 2\\^24 frequencies"):
            frequencies.inv_freq(rope_type, **fields)
    assert len(frequencies.inv_freq("constant", num_freqs=4)[0]) == 4


def test_the_frequency_cap_is_the_headers():
    header = Path(__file__).resolve().parents[2] / "include" / "rope_jit" / "rope_jit.h"
    if not header.exists():
        pytest.skip("no source tree beside the tests")
    match = re.search(r"#define ROPE_JIT_MAX_FREQUENCIES \(1 << (\d+)\)", header.read_text())
    assert match and 1 << int(match.group(1)) == s.MAX_FREQUENCIES


@needs_builders
def test_longrope_factors_must_have_one_value_per_pair():
    common = dict(
        rotary_dim=128,
        factor=4.0,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
    )
    with pytest.raises(ValueError, match="short_factor"):
        frequencies.inv_freq("longrope", short_factor=[1.0], long_factor=[1.0] * 64, **common)
    with pytest.raises(ValueError, match="long_factor"):
        frequencies.inv_freq("longrope", short_factor=[1.0] * 64, long_factor=[1.0] * 63, **common)
    values, _ = frequencies.inv_freq(
        "longrope", short_factor=[1.0] * 64, long_factor=[1.0] * 64, **common
    )
    assert len(values) == 64
    # Not sequences: before, an int gave "'int' object is not iterable", naming nothing.
    for factors, kind in ((2.0, "float"), (None, "NoneType"), ("1.0", "str")):
        with pytest.raises(TypeError, match=rf"^long_factor: expected a sequence of floats, got {kind}$"):
            frequencies.inv_freq("longrope", short_factor=[1.0] * 64, long_factor=factors, **common)


@needs_builders
def test_frequency_fields_are_range_checked_and_typed():
    with pytest.raises(OverflowError, match="rotary_dim"):
        frequencies.inv_freq("default", 2**32 + 64)
    with pytest.raises(OverflowError, match="max_position_embeddings"):
        frequencies.inv_freq("dynamic", 64, factor=2.0, max_position_embeddings=2**64)
    with pytest.raises(TypeError, match="rotary_dim"):
        frequencies.inv_freq("default", 64.5)
    with pytest.raises(OverflowError, match=r"mrope_sections\[0\]"):
        frequencies.rope_tables([1.0], cos=np.zeros((2, 1), np.float32), mrope_sections=[2**32 + 1])


# Adversarial pass, session 37: each raised something that named no argument (a KeyError of a
# ctypes type, ctypes' TypeError, struct.error, AttributeError) or, for floats and bools given
# as enum values, was accepted.


@needs_builders
def test_longrope_factor_counts_come_from_the_lists_not_from_the_caller():
    with pytest.raises(TypeError, match="num_short_factor: set from the length of short_factor"):
        frequencies.inv_freq("longrope", rotary_dim=8, num_short_factor=4)
    with pytest.raises(TypeError, match="num_long_factor"):
        frequencies.inv_freq("longrope", rotary_dim=8, num_long_factor=4)


def test_enum_arguments_take_names_or_integer_values_only(cpu_runtime):
    with pytest.raises(ValueError, match="backend"):
        rope_jit.Runtime(backend=2.0)
    q = np.ones((1, 1, 2, 4), np.float32)
    cos = np.ones((2, 2), np.float32)
    for style in (1.0, True, [1]):
        with pytest.raises(ValueError, match="style"):
            rope_jit.rope(q, cos=cos, sin=cos, style=style, runtime=cpu_runtime)
    assert (q == 1).all()
    rope_jit.rope(q, cos=cos, sin=np.zeros_like(cos), style=np.int64(1), runtime=cpu_runtime)
    np.testing.assert_array_equal(q, 1)  # cos 1, sin 0: interleaved by its C value, unchanged


def test_runtime_and_stream_arguments_of_another_kind_are_type_errors_naming_them(cpu_runtime):
    # runtime="cpu" failed as AttributeError, stream="x" as int()'s ValueError, stream="7"
    # and 7.9 were taken (review, session 39).
    q, cos, sin = tensors()
    before = q.copy()
    for arguments, error, match in (
            (dict(runtime="cpu"), TypeError, "runtime: expected a rope_jit.Runtime"),
            (dict(stream="x"), TypeError, "stream: expected a CUstream"),
            (dict(stream="7"), TypeError, "stream: expected a CUstream"),
            (dict(stream=7.9), TypeError, "stream: expected a CUstream"),
            (dict(stream=-1), ValueError, "stream: a CUstream is an address")):
        arguments.setdefault("runtime", cpu_runtime)
        with pytest.raises(error, match=match):
            rope_jit.rope(q, cos=cos, sin=sin, **arguments)
        with pytest.raises(error, match=match):
            rope_jit.attention(q, q, q, np.empty_like(q), **arguments)
    np.testing.assert_array_equal(q, before)
    rope_jit.rope(q, cos=cos, sin=sin, stream=0, runtime=cpu_runtime)  # an int still is one


def test_raw_memory_takes_only_addresses_and_device_indices_that_are_ones():
    # A float address was truncated, -16 became 0xfff...f0 and crashed the process in rope(),
    # "cuda:2**40" raised struct.error (review, session 39).
    for data, error in ((4096.9, TypeError), (-16, ValueError), (2**64, ValueError)):
        with pytest.raises(error, match=None if error is TypeError else "data: an address"):
            rope_jit.from_pointer(data, (1, 1, 1, 8), "float32")
    for device in ("cuda:1099511627776", "cuda:x", "cuda:-1", "cpu:0"):
        with pytest.raises(ValueError, match="device: expected"):
            rope_jit.from_pointer(4096, (8,), "float32", device=device)
    assert rope_jit.from_pointer(2**64 - 64, (8,), "float32", device="cuda:3").data == 2**64 - 64


def test_raw_memory_with_extents_past_int64_is_a_value_error():
    with pytest.raises(ValueError, match="shape"):
        rope_jit.from_pointer(4096, [2**64, 2], "float32")
    with pytest.raises(ValueError, match="strides"):  # contiguous strides past int64
        rope_jit.from_pointer(4096, [0, 2**63 - 1, 2**63 - 1, 2], "float32")


def test_prewarm_names_a_spec_that_is_not_a_dict(cpu_runtime):
    for spec in (64, "abc", None):
        with pytest.raises(TypeError, match=r"specs\[0\]: expected a dict"):
            cpu_runtime.prewarm([spec], target="sm_90")
    # Not a list at all: before, an int or None gave "'int' object is not iterable", and a lone
    # spec or a string were iterated as keys or characters.
    for specs, kind in ((5, "int"), (None, "NoneType"), ({"head_dim": 64}, "dict"), ("x", "str")):
        with pytest.raises(TypeError, match=r"^specs: expected a list of dicts of "
                                            rf"rope_jit_kernel_spec fields \(one spec too\), got {kind}$"):
            cpu_runtime.prewarm(specs, target="sm_90")
    for specs in ({64, 128}, [{"head_dim": object()}]):
        with pytest.raises(TypeError, match=r"^specs: not JSON \(Object of type (set|object) is not"):
            cpu_runtime.prewarm_json(specs, target="sm_90")
    looped = [{"head_dim": 64}]
    looped.append(looped)
    with pytest.raises(TypeError, match=r"^specs: not JSON \(Circular reference"):
        cpu_runtime.prewarm_json(looped, target="sm_90")
    assert cpu_runtime.stats()["compiles"] == 0
