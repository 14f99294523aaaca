"""rope_jit.rope on NumPy arrays against the independent NumPy reference: every layout, pair
style, dtype, table kind, position source, partial rotary, GQA, in and out of place, forward
and backward."""

import itertools
import os
import random

import numpy as np
import pytest

import rope_jit
from library_arrays import from_dtype, library_tensor, to_dtype
from rope_reference import (angle_tables, packed_rows, rope_reference,
                            token_rows)

TOLERANCES = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


class Case:
    """One randomized configuration; str() names every parameter, so a failure explains itself."""

    def __init__(self, layout, style, dtype, angles, positions, rotary, with_k, placement, backward, seed):
        self.layout, self.style, self.dtype, self.angles = layout, style, dtype, angles
        self.positions, self.rotary, self.with_k, self.placement = positions, rotary, with_k, placement
        self.backward, self.seed = backward, seed

    def __str__(self):
        return "-".join(str(value) for value in vars(self).values())


def sample_cases(count=64):
    grid = list(itertools.product(
        ["bhsd", "bshd", "thd"], ["half", "interleaved"], ["float32", "float16", "bfloat16"],
        ["table_half", "table_full", "inv_freq"], ["implicit", "offset", "indices_s", "indices_bs32", "seqlen_offsets"],
        ["full", "partial", "partial_offset"], [False, True], ["in_place", "out_of_place"], [False, True]))
    chooser = random.Random(1234)
    chosen = chooser.sample(grid, count)
    return [Case(*values, seed=index) for index, values in enumerate(chosen)]


@pytest.mark.parametrize("case", sample_cases(), ids=str)
def test_rope_matches_the_numpy_reference(case, cpu_runtime):
    rng = np.random.default_rng(case.seed)
    batch, heads_q, heads_k, seq_len, head_dim = 2, 4, (2 if case.with_k else 4), 7, 16
    rotary_dim, rotary_offset = {"full": (16, 0), "partial": (8, 0), "partial_offset": (8, 4)}[case.rotary]
    rows_in_table = 40

    # Token rows and the position arguments that produce them.
    arguments, offset = {}, 0
    if case.layout == "thd":
        cu_seqlens = np.array([0, 3, 7, 12], dtype=np.int32)
        arguments["cu_seqlens"] = cu_seqlens
        total = int(cu_seqlens[-1])
    if case.positions == "offset":
        offset = 5
        arguments["position_offset"] = offset
    elif case.positions in ("indices_s", "indices_bs32"):
        index_dtype = np.int32 if case.positions == "indices_bs32" else np.int64
        if case.layout == "thd":
            positions = rng.integers(0, rows_in_table, total).astype(index_dtype)
        elif case.positions == "indices_s":
            positions = rng.integers(0, rows_in_table, seq_len).astype(index_dtype)
        else:
            positions = rng.integers(0, rows_in_table, (batch, seq_len)).astype(index_dtype)
        arguments["positions"] = positions
    elif case.positions == "seqlen_offsets":
        seqlen_offsets = rng.integers(0, 20, 3 if case.layout == "thd" else batch).astype(np.int64)
        arguments["seqlen_offsets"] = seqlen_offsets
    if case.layout == "thd":
        rows = packed_rows(cu_seqlens, arguments.get("positions"), arguments.get("seqlen_offsets"), offset)
    else:
        rows = token_rows(batch, seq_len, arguments.get("positions"), arguments.get("seqlen_offsets"), offset)

    # Angles: random tables (any values are valid), or inv_freq with angles p * inv_freq[i].
    half = rotary_dim // 2
    if case.angles == "inv_freq":
        inv_freq = (1.0 / 10000 ** (np.arange(half) * 2 / rotary_dim)).astype(np.float32)
        arguments["inv_freq"] = inv_freq
        cos, sin = angle_tables(inv_freq.astype(np.float64), rows_in_table + 30)
    else:
        width = half if case.angles == "table_half" else rotary_dim
        angles = rng.uniform(-4, 4, (rows_in_table + 30, width))
        cos32, sin32 = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        arguments["cos"], arguments["sin"] = cos32, sin32
        cos, sin = cos32.astype(np.float64), sin32.astype(np.float64)

    def make(heads):
        shape = {"bhsd": (batch, heads, seq_len, head_dim), "bshd": (batch, seq_len, heads, head_dim),
                 "thd": (total if case.layout == "thd" else 0, heads, head_dim)}[case.layout]
        return to_dtype(rng.standard_normal(shape), case.dtype)

    q, q_values = make(heads_q)
    names = [("q", q, q_values)]
    if case.with_k:
        k, k_values = make(heads_k)
        names.append(("k", k, k_values))
    results = {}
    for name, array, _ in names:
        arguments[name] = library_tensor(array, case.dtype)
        if case.placement == "out_of_place":
            out = np.zeros_like(array)
            arguments[name + "_out"] = library_tensor(out, case.dtype)
            results[name] = out
        else:
            results[name] = array
    before = {name: array.copy() for name, array, _ in names}

    rope_jit.rope(style=case.style, rotary_dim=rotary_dim, rotary_offset=rotary_offset, backward=case.backward,
                  layout=case.layout, runtime=cpu_runtime, **arguments)

    tolerance = TOLERANCES[case.dtype]
    for name, array, values in names:
        expected = rope_reference(values, case.layout, cos, sin, rows, rotary_dim=rotary_dim,
                                  rotary_offset=rotary_offset, style=case.style, backward=case.backward)
        np.testing.assert_allclose(from_dtype(results[name], case.dtype), expected, rtol=tolerance, atol=tolerance,
                                   err_msg=f"{name} of {case}")
        if case.placement == "out_of_place":
            np.testing.assert_array_equal(array, before[name], err_msg=f"input {name} was written ({case})")


def test_backward_undoes_forward(cpu_runtime):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 9, 32)).astype(np.float32)
    k = rng.standard_normal((2, 1, 9, 32)).astype(np.float32)
    original_q, original_k = q.copy(), k.copy()
    inv_freq = (1.0 / 500000 ** (np.arange(16) / 16)).astype(np.float32)
    rope_jit.rope(q, k, inv_freq=inv_freq, position_offset=100, runtime=cpu_runtime)
    assert np.abs(q - original_q).max() > 0.1
    rope_jit.rope(q, k, inv_freq=inv_freq, position_offset=100, backward=True, runtime=cpu_runtime)
    np.testing.assert_allclose(q, original_q, atol=2e-5)
    np.testing.assert_allclose(k, original_k, atol=2e-5)


def test_queries_after_cached_keys_take_the_last_positions(cpu_runtime):
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 10, 8)).astype(np.float32)
    inv_freq = np.array([1.0, 0.5, 0.1, 0.01], np.float32)
    cos, sin = angle_tables(inv_freq, 20)
    expected_q = rope_reference(q, "bhsd", cos, sin, token_rows(1, 3, offset=7), rotary_dim=8)
    expected_k = rope_reference(k, "bhsd", cos, sin, token_rows(1, 10), rotary_dim=8)
    rope_jit.rope(q, k, inv_freq=inv_freq, q_position_offset=7, runtime=cpu_runtime)
    np.testing.assert_allclose(q, expected_q, atol=2e-5)
    np.testing.assert_allclose(k, expected_k, atol=2e-5)


def test_xpos_scales_multiply_queries_and_divide_keys(cpu_runtime):
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    angles = rng.uniform(-3, 3, (6, 8))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, (6, 8)).astype(np.float32)
    rows = token_rows(1, 6)
    expected_q = rope_reference(q, "bhsd", cos, sin, rows, rotary_dim=8, style="interleaved", xpos=scale)
    expected_k = rope_reference(k, "bhsd", cos, sin, rows, rotary_dim=8, style="interleaved", xpos=scale,
                                xpos_divides=True)
    rope_jit.rope(q, k, cos=cos, sin=sin, xpos_scale=scale, style="interleaved", runtime=cpu_runtime)
    np.testing.assert_allclose(q, expected_q, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(k, expected_k, rtol=2e-5, atol=2e-5)


def test_positions_outside_the_table_fail_and_write_nothing(cpu_runtime):
    q = np.ones((1, 1, 3, 4), np.float32)
    cos = np.ones((2, 2), np.float32)
    with pytest.raises(rope_jit.InvalidArgumentError, match="position"):
        rope_jit.rope(q, cos=cos, sin=cos, runtime=cpu_runtime)
    np.testing.assert_array_equal(q, 1.0)


def test_a_bad_style_or_layout_is_a_value_error_naming_it(cpu_runtime):
    q = np.ones((1, 1, 3, 4), np.float32)
    with pytest.raises(ValueError, match="style"):
        rope_jit.rope(q, inv_freq=np.ones(2, np.float32), style="neox", runtime=cpu_runtime)
    with pytest.raises(ValueError, match="layout"):
        rope_jit.rope(q, inv_freq=np.ones(2, np.float32), layout="sbhd", runtime=cpu_runtime)
    with pytest.raises(ValueError, match="q: layout bshd needs 4 dimensions"):
        rope_jit.rope(q[0], inv_freq=np.ones(2, np.float32), layout="bshd", runtime=cpu_runtime)


def test_calls_from_several_threads_at_once_each_get_their_own_arguments(cpu_runtime):
    # Each thread rotates its own decode-shaped q and k (bshd, out of place), with its own
    # offset, many times over: a DLTensor or argument struct shared between calls would mix
    # them up.
    import threading

    rng = np.random.default_rng(10)
    inv_freq = (1.0 / 10000 ** (np.arange(8) / 8)).astype(np.float32)
    cos, sin = (table.astype(np.float32) for table in angle_tables(inv_freq, 64))
    jobs = []
    for index in range(6):
        q = rng.standard_normal((1, 1 + index % 3, 4, 16)).astype(np.float32)
        k = rng.standard_normal((1, 1 + index % 3, 2, 16)).astype(np.float32)
        rows = token_rows(1, q.shape[1], offset=3 * index)
        jobs.append((q, k, index, rope_reference(q, "bshd", cos, sin, rows, rotary_dim=16),
                     rope_reference(k, "bshd", cos, sin, rows, rotary_dim=16)))
    failures = []

    def work(q, k, offset, expected_q, expected_k):
        q_out, k_out = np.empty_like(q), np.empty_like(k)
        for _ in range(200):
            q_out[...] = k_out[...] = np.nan
            rope_jit.rope(q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd",
                          position_offset=3 * offset, runtime=cpu_runtime)
            if not (np.allclose(q_out, expected_q, atol=2e-5) and np.allclose(k_out, expected_k, atol=2e-5)):
                failures.append(offset)
                return

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


# ---- memory the library must not write, byte orders, NumPy scalars --------------------------


def _rotation_case(seed, dtype=np.float32):
    """q [1, 2, 5, 8] and k [1, 1, 5, 8], tables [16, 4], and the reference of q and k
    rotated at positions 0..4 (float64)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, 5, 8)).astype(dtype)
    k = rng.standard_normal((1, 1, 5, 8)).astype(dtype)
    angles = rng.uniform(-3, 3, (16, 4))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    rows = token_rows(1, 5)

    def reference(x):
        return rope_reference(np.asarray(x, np.float64), "bhsd", cos, sin, rows, rotary_dim=8)

    return q, k, cos, sin, reference


def _read_only(array):
    array = array.copy()
    array.flags.writeable = False
    return array


def _as_float32(array):
    return rope_jit.reinterpret(array, "float32")


# name: (the argument refused, the array made read-only from (q, k), call(that array, q, k,
# cos, sin) giving it to rope through reinterpret)
READ_ONLY_OUTPUTS = {
    "q in place": (
        "q", lambda q, k: q,
        lambda ro, q, k, cos, sin: rope_jit.rope(_as_float32(ro), cos=cos, sin=sin)),
    "k in place": (
        "k", lambda q, k: k,
        lambda ro, q, k, cos, sin: rope_jit.rope(q, _as_float32(ro), cos=cos, sin=sin)),
    "q_out": (
        "q_out", lambda q, k: np.zeros_like(q),
        lambda ro, q, k, cos, sin: rope_jit.rope(q, cos=cos, sin=sin, q_out=_as_float32(ro))),
    "k_out": (
        "k_out", lambda q, k: np.zeros_like(k),
        lambda ro, q, k, cos, sin: rope_jit.rope(q, k, cos=cos, sin=sin, q_out=np.zeros_like(q),
                                                 k_out=_as_float32(ro))),
    # [B, S, H, D]: the library gets the view with dims 1 and 2 exchanged (with_dims_swapped)
    "q in place, bshd": (
        "q", lambda q, k: q.transpose(0, 2, 1, 3),
        lambda ro, q, k, cos, sin: rope_jit.rope(_as_float32(ro), cos=cos, sin=sin, layout="bshd")),
    "q through reinterpret twice": (
        "q", lambda q, k: q,
        lambda ro, q, k, cos, sin: rope_jit.rope(_as_float32(rope_jit.reinterpret(ro, "int32")),
                                                 cos=cos, sin=sin)),
    "q as bfloat16 bits": (
        "q", lambda q, k: to_dtype(q, "bfloat16")[0],
        lambda ro, q, k, cos, sin: rope_jit.rope(rope_jit.reinterpret(ro, "bfloat16"), cos=cos, sin=sin)),
}


@pytest.mark.parametrize("case", list(READ_ONLY_OUTPUTS))
def test_a_read_only_array_given_through_reinterpret_is_refused_as_an_output(case):
    name, source, call = READ_ONLY_OUTPUTS[case]
    q, k, cos, sin, _ = _rotation_case(11)
    for _ in range(2):
        array = _read_only(source(q, k))
        before = array.tobytes()
        with pytest.raises(ValueError, match=f"^{name}: .*read-only"):
            call(array, q, k, cos, sin)
        assert not array.flags.writeable
        assert array.tobytes() == before, f"{name} was written ({case})"


def test_a_read_only_memmap_through_reinterpret_is_refused_and_the_file_is_unchanged(tmp_path, cpu_runtime):
    # In a child process: writing a read-only mapping is a segmentation fault, which would end
    # the test run rather than fail this test.
    import os
    import subprocess
    import sys

    q, _, cos, sin, reference = _rotation_case(12)
    path = tmp_path / "q.bin"
    q.tofile(path)
    np.save(tmp_path / "cos.npy", cos)
    np.save(tmp_path / "sin.npy", sin)
    before = path.read_bytes()
    code = f"""
import numpy as np, rope_jit
cos, sin = np.load({str(tmp_path / "cos.npy")!r}), np.load({str(tmp_path / "sin.npy")!r})
mapped = np.memmap({str(path)!r}, dtype=np.float32, mode="r", shape={q.shape!r})
for how, argument in (("direct", mapped), ("reinterpret", rope_jit.reinterpret(mapped, "float32"))):
    for _ in range(2):
        try:
            rope_jit.rope(argument, cos=cos, sin=sin)
            print(how, "written")
        except ValueError as error:
            print(how, error)
"""
    python_path = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": python_path},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4, result.stdout
    for line in lines:
        assert line.split(" ", 1)[1].startswith("q: ") and "read-only" in line, line
    assert path.read_bytes() == before
    # A writable mapping ("r+") is written, through reinterpret too.
    writable = np.memmap(path, dtype=np.float32, mode="r+", shape=q.shape)
    rope_jit.rope(rope_jit.reinterpret(writable, "float32"), cos=cos, sin=sin, runtime=cpu_runtime)
    writable.flush()
    del writable
    np.testing.assert_allclose(np.fromfile(path, np.float32).reshape(q.shape), reference(q),
                               rtol=2e-5, atol=2e-5)


def test_a_read_only_array_through_reinterpret_is_read_where_nothing_is_written(cpu_runtime):
    q, k, cos, sin, reference = _rotation_case(13)
    q_out, k_out = np.zeros_like(q), np.zeros_like(k)
    ro_q, ro_k, ro_cos = _read_only(q), _read_only(k), _read_only(cos)
    rope_jit.rope(rope_jit.reinterpret(ro_q, "float32"), rope_jit.reinterpret(ro_k, "float32"),
                  cos=rope_jit.reinterpret(ro_cos, "float32"), sin=sin, q_out=q_out, k_out=k_out,
                  runtime=cpu_runtime)
    np.testing.assert_allclose(q_out, reference(q), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(k_out, reference(k), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(ro_q, q)


def test_ml_dtypes_bfloat16_little_endian_matches_the_reference_and_big_endian_is_refused(cpu_runtime):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    little = np.dtype(ml_dtypes.bfloat16)
    big = little.newbyteorder(">")
    values, k, cos, sin, reference = _rotation_case(14)
    # Little-endian first: its dtype is known (cached) when the big-endian one comes.
    q = values.astype(little)
    expected = reference(q.astype(np.float64))
    rope_jit.rope(q, cos=cos, sin=sin, runtime=cpu_runtime)
    np.testing.assert_allclose(q.astype(np.float64), expected, rtol=1.6e-2, atol=1.6e-2)
    for name, arguments in (
        ("q", lambda q_big: dict(q=q_big)),
        ("q", lambda q_big: dict(q=q_big, q_out=np.zeros(q_big.shape, little))),
        ("q_out", lambda q_big: dict(q=values.astype(little), q_out=q_big)),
    ):
        q_big = values.astype(little).astype(big)
        assert q_big.dtype.byteorder == ">"
        before = q_big.tobytes()
        with pytest.raises(ValueError, match=f"^{name}: big-endian arrays are not supported"):
            rope_jit.rope(cos=cos, sin=sin, runtime=cpu_runtime, **arguments(q_big))
        assert q_big.tobytes() == before


def test_norm_eps_as_a_numpy_float32_equals_the_python_float(cpu_runtime):
    rng = np.random.default_rng(15)
    # Small values: eps is not negligible against mean(x^2), so a wrong eps shows.
    q = (0.3 * rng.standard_normal((1, 2, 5, 8))).astype(np.float32)
    k = (0.3 * rng.standard_normal((1, 1, 5, 8))).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, 8).astype(np.float32)
    inv_freq = np.array([1.0, 0.5, 0.1, 0.01], np.float32)
    eps32 = np.float32(0.1)
    results = []
    for eps in (eps32, float(eps32)):
        q_out, k_out = np.zeros_like(q), np.zeros_like(k)
        rope_jit.rope(q, k, inv_freq=inv_freq, q_norm_weight=weight, k_norm_weight=weight,
                      norm_eps=eps, q_out=q_out, k_out=k_out, runtime=cpu_runtime)
        results.append((q_out, k_out))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    cos, sin = angle_tables(inv_freq, 5)
    for x, got in ((q, results[0][0]), (k, results[0][1])):
        x64 = x.astype(np.float64)
        normed = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + float(eps32)) * weight
        expected = rope_reference(normed, "bhsd", cos, sin, token_rows(1, 5), rotary_dim=8)
        np.testing.assert_allclose(got, expected, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("eps", [True, "1e-6"], ids=repr)
def test_norm_eps_that_is_not_a_number_is_a_type_error_naming_it(eps, cpu_runtime):
    q = np.ones((1, 2, 4, 8), np.float32)
    weight = np.ones(8, np.float32)
    with pytest.raises(TypeError, match="^norm_eps: expected a number"):
        rope_jit.rope(q, inv_freq=np.ones(4, np.float32), q_norm_weight=weight, norm_eps=eps,
                      runtime=cpu_runtime)
    np.testing.assert_array_equal(q, 1.0)


@pytest.mark.parametrize("shape", [(2, 4, 0, 8), (0, 4, 5, 8)], ids=str)
def test_empty_q_and_k_arrays_in_one_call_are_a_no_op(shape, cpu_runtime):
    q, k = np.zeros(shape, np.float32), np.zeros(shape[:1] + (2,) + shape[2:], np.float32)
    cos = np.ones((16, 4), np.float32)
    for _ in range(2):
        got_q, got_k = rope_jit.rope(q, k, cos=cos, sin=cos, runtime=cpu_runtime)
        assert got_q is q and got_k is k
        q_out, k_out = np.empty_like(q), np.empty_like(k)
        got_q, got_k = rope_jit.rope(q, k, cos=cos, sin=cos, q_out=q_out, k_out=k_out,
                                     runtime=cpu_runtime)
        assert got_q is q_out and got_k is k_out


@pytest.mark.parametrize("layout, shape", [("bhsd", (2, 3, 4)), ("bshd", (2, 3, 4)),
                                           ("thd", (1, 2, 3, 4))])
def test_q_of_another_rank_than_its_layout_is_refused_and_left_unchanged(cpu_runtime, layout, shape):
    # The library reads the layout from the rank: a 3-D q under "bhsd" was rotated as packed
    # tokens ([T, H, D], positions along its first axis), a 4-D one under "thd" as bhsd.
    q = np.random.default_rng(10).standard_normal(shape).astype(np.float32)
    original = q.copy()
    cos, sin = angle_tables(np.array([1.0, 0.1], np.float32), 8)
    with pytest.raises(ValueError, match=f"q: layout {layout} needs {4 if layout != 'thd' else 3} dim"):
        rope_jit.rope(q, cos=cos, sin=sin, layout=layout, runtime=cpu_runtime)
    np.testing.assert_array_equal(q, original)


def test_close_waits_for_a_call_in_flight_on_another_thread_and_refuses_later_calls(
        library, monkeypatch):
    # close() freed the runtime under a call running on another thread (a use after free
    # under ASan, adversarial pass of session 37); it now waits for that call.
    import threading
    import time

    runtime = rope_jit.Runtime(backend="cpu", disk_cache=False, cpu_threads=1)
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 16, 4096, 64)).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    cos, sin = angle_tables(inv_freq.astype(np.float64), 4096)
    expected = rope_reference(q, "bhsd", cos, sin, token_rows(1, 4096), rotary_dim=64)
    entered, returned_at, failures = threading.Event(), [], []
    rope_call = library.rope_jit_rope

    def timed_rope_call(*args):  # the library call itself, as the runtime makes it
        entered.set()
        status = rope_call(*args)
        returned_at.append(time.perf_counter())
        return status

    monkeypatch.setattr(library, "rope_jit_rope", timed_rope_call)

    def call():
        try:
            rope_jit.rope(q, inv_freq=inv_freq, runtime=runtime)
        except Exception as error:  # noqa: BLE001 (reported below)
            failures.append(error)

    worker = threading.Thread(target=call)
    worker.start()
    assert entered.wait(30)
    runtime.close()
    closed_at = time.perf_counter()
    worker.join()
    assert not failures, failures
    assert returned_at and returned_at[0] <= closed_at  # freed only after the call returned
    np.testing.assert_allclose(q, expected, atol=1e-4)
    with pytest.raises(ValueError, match="closed"):
        rope_jit.rope(q, inv_freq=inv_freq, runtime=runtime)


def _hold_a_call(library, monkeypatch, runtime):
    """Starts a rope() call on `runtime` in a thread and holds it inside the library call
    until the returned `release` event is set; returns (release, thread) once it is there."""
    import threading

    entered, release = threading.Event(), threading.Event()
    rope_call = library.rope_jit_rope

    def held_rope_call(*args):
        entered.set()
        release.wait(30)
        return rope_call(*args)

    monkeypatch.setattr(library, "rope_jit_rope", held_rope_call)
    q = np.ones((1, 1, 2, 4), np.float32)
    caller = threading.Thread(target=rope_jit.rope, args=(q,),
                              kwargs=dict(inv_freq=np.ones(2, np.float32), runtime=runtime))
    caller.start()
    assert entered.wait(30)
    return release, caller


def _a_forked_child_closes_it_in_time(runtime):
    """Whether a child forked now closes `runtime` within 5 s (SIGALRM ends it otherwise)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        child = os.fork()
    if child == 0:
        import signal
        signal.alarm(5)
        runtime.close()
        os._exit(0)
    _, status = os.waitpid(child, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_closes_a_runtime_without_waiting_for_its_parents_calls(library, monkeypatch):
    # The calls other threads had in flight at the fork never return in the child: its
    # close() must not wait for them.
    runtime = rope_jit.Runtime(backend="cpu", disk_cache=False, cpu_threads=1)
    release, caller = _hold_a_call(library, monkeypatch, runtime)
    try:
        assert _a_forked_child_closes_it_in_time(runtime)
    finally:
        release.set()
        caller.join()
    runtime.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_close_waits_can_close_its_copy(library, monkeypatch):
    # The child inherited close()'s lock held by the waiting thread, and its own close (or
    # its exit's __del__) waited forever (review of session 37).
    import threading
    import time

    runtime = rope_jit.Runtime(backend="cpu", disk_cache=False, cpu_threads=1)
    release, caller = _hold_a_call(library, monkeypatch, runtime)
    closer = threading.Thread(target=runtime.close)
    try:
        closer.start()
        while not runtime._close_lock.locked():  # close() waits for the call, holding it
            time.sleep(0.001)
        assert _a_forked_child_closes_it_in_time(runtime)
    finally:
        release.set()
        caller.join()
        closer.join()


def test_close_inside_a_call_on_the_same_thread_raises_and_leaves_the_runtime_usable(
        library, monkeypatch):
    # A signal handler or finalizer closing the runtime inside a call on it: close() waited
    # for that call, which could never return (review of session 37).
    runtime = rope_jit.Runtime(backend="cpu", disk_cache=False, cpu_threads=1)
    rope_call = library.rope_jit_rope
    caught = []

    def closing_rope_call(*args):  # as a signal handler run at this point would
        try:
            runtime.close()
        except RuntimeError as error:
            caught.append(error)
        return rope_call(*args)

    monkeypatch.setattr(library, "rope_jit_rope", closing_rope_call)
    q = np.ones((1, 1, 2, 4), np.float32)
    import threading  # (on a thread of its own: a regression hangs it, not the test run)

    caller = threading.Thread(
        target=rope_jit.rope, args=(q,), kwargs=dict(inv_freq=np.zeros(2, np.float32),
                                                     runtime=runtime), daemon=True)
    caller.start()
    caller.join(30)
    assert not caller.is_alive(), "close() inside a call on the same thread waited for it"
    assert caught and "inside a call on it" in str(caught[0])
    monkeypatch.undo()
    rope_jit.rope(q, inv_freq=np.zeros(2, np.float32), runtime=runtime)  # still open
    runtime.close()
