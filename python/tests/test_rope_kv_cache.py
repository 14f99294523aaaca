"""rope_jit.rope writing k and v into a KV cache (kv_layout, slot_mapping, block_tables) and FP8
outputs (float8_e4m3fn caches and q_out with k_scale/v_scale/q_scale), on NumPy arrays, against
a NumPy reference written here from the definitions: each token's cache cell from vLLM's
slot = block * block_size + offset (or block_tables[b, pos // block_size], or contiguous rows
seqlen_offsets[b] + s), HF's rotation in float64, and e4m3fn by enumerating its 256 codes and
taking the nearest (ties to the even code) after saturation at +-448. Torch CPU tensors too,
when torch is installed."""

import itertools

import numpy as np
import pytest

import rope_jit

# ---- float8 e4m3fn from its definition ------------------------------------------------------


def e4m3_values():
    """The value of each of the 256 codes (NaN for 0x7f and 0xff)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    value = np.where(
        exponent == 0,
        np.ldexp(mantissa / 8.0, -6),
        np.ldexp(1.0 + mantissa / 8.0, exponent - 7),
    )
    value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    return np.where(codes & 0x80, -value, value)


VALUES = e4m3_values()
POSITIVE = VALUES[:0x7F]  # codes 0..0x7e, increasing


def e4m3_encode(x):
    """Nearest code of each float32 value x (ties to even), saturating; NaN -> 0x7f."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), 448.0)
    distance = np.abs(POSITIVE[None, :] - a.reshape(-1, 1))
    best = distance.min(axis=1, keepdims=True)
    candidates = distance == best
    # Among equally near codes, the even one (the mantissa's last bit is the code's).
    even = candidates & (np.arange(0x7F)[None, :] % 2 == 0)
    code = np.where(even.any(axis=1), even.argmax(axis=1), candidates.argmax(axis=1))
    code = code.reshape(x.shape) | np.where(np.signbit(x), 0x80, 0)
    return np.where(np.isnan(x), 0x7F, code).astype(np.uint8)


def test_e4m3_reference_round_trips_every_code():
    finite = ~np.isnan(VALUES)
    codes = np.arange(256)[finite]
    assert (e4m3_encode(VALUES[finite].astype(np.float32)) == codes).all()
    assert e4m3_encode(np.float32(500.0)) == 0x7E and e4m3_encode(np.float32(-np.inf)) == 0xFE


# ---- the reference ------------------------------------------------------------------------


def rotate(x, angles, style, rotary_dim):
    """x [..., D] float64 rotated by angles [..., R/2] (HF rotate_half / interleaved)."""
    i = np.arange(rotary_dim // 2)
    first, second = (2 * i, 2 * i + 1) if style == "interleaved" else (i, i + rotary_dim // 2)
    y = x.copy()
    c, s = np.cos(angles), np.sin(angles)
    y[..., first] = x[..., first] * c - x[..., second] * s
    y[..., second] = x[..., second] * c + x[..., first] * s
    return y


CASES = list(
    itertools.product(
        ["contiguous", "nhd", "hnd"], ["slots", "tables"], [False, True], ["half", "interleaved"]
    )
)


@pytest.mark.parametrize("kv_layout,index,fp8,style", CASES)
def test_kv_cache_write_matches_the_definition(kv_layout, index, fp8, style, cpu_runtime):
    if kv_layout == "contiguous" and index == "tables":
        pytest.skip("contiguous caches take rows, not block tables")
    rng = np.random.default_rng(hash((kv_layout, index, fp8, style)) % 2**32)
    B, S, Hk, group, D, R, Dv, block_size = 2, 5, 2, 2, 32, 16, 24, 4
    Hq = Hk * group
    q = rng.uniform(-2, 2, (B, S, Hq, D)).astype(np.float32)  # layout "bshd"
    k = rng.uniform(-2, 2, (B, S, Hk, D)).astype(np.float32)
    v = rng.uniform(-2, 2, (B, S, Hk, Dv)).astype(np.float32)
    q_in, k_in = q.copy(), k.copy()
    offsets = rng.integers(0, 4, B).astype(np.int64)
    inv_freq = (100.0 ** (-np.arange(R // 2) * 2.0 / R)).astype(np.float32)
    positions = offsets[:, None] + np.arange(S)[None, :]  # [B, S] cache positions and rows

    # Cache cells of every token (block, offset), from the definitions.
    if kv_layout == "contiguous":
        blocks, slots = B, S + 4
        cell = [(b, positions[b, s]) for b in range(B) for s in range(S)]
        extra = {}
    elif index == "slots":
        blocks, slots = (B * S) // block_size + 2, block_size
        slot = rng.permutation(blocks * slots)[: B * S].astype(np.int64)
        slot[3] = -1  # a padding token: skipped
        cell = [(x // slots, x % slots) if x >= 0 else None for x in slot]
        extra = {"slot_mapping": slot}
    else:
        slots = block_size
        entries = int(positions.max()) // slots + 1
        blocks = B * entries + 1
        tables = rng.permutation(blocks)[: B * entries].reshape(B, entries).astype(np.int32)
        cell = [
            (tables[b, positions[b, s] // slots], positions[b, s] % slots)
            for b in range(B)
            for s in range(S)
        ]
        extra = {"block_tables": tables}

    def cache(dim):
        shape = (blocks, Hk, slots, dim) if kv_layout == "hnd" else (blocks, slots, Hk, dim)
        return rng.integers(0, 256, shape, dtype=np.uint8) if fp8 else rng.uniform(
            -9, 9, shape
        ).astype(np.float32)

    k_cache, v_cache = cache(D), cache(Dv)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    scales = {}
    cache_args = {"k_cache": k_cache, "v_cache": v_cache}
    q_out = None
    if fp8:
        k_scale, v_scale, q_scale = (np.array([x], dtype=np.float32) for x in (0.3, 0.02, 0.7))
        scales = {"k_scale": k_scale, "v_scale": v_scale, "q_scale": q_scale}
        cache_args = {name: rope_jit.reinterpret(a, "float8_e4m3fn") for name, a in cache_args.items()}
        q_out = np.zeros(q.shape, dtype=np.uint8)
        cache_args["q_out"] = rope_jit.reinterpret(q_out, "float8_e4m3fn")

    rope_jit.rope(
        q, k, v=v, inv_freq=inv_freq, seqlen_offsets=offsets, rotary_dim=R, style=style,
        layout="bshd", kv_layout=kv_layout, runtime=cpu_runtime, **cache_args, **extra, **scales
    )

    angles = positions[..., None].astype(np.float64) * inv_freq.astype(np.float64)  # [B, S, R/2]
    q_expected = rotate(q_in.astype(np.float64), angles[:, :, None, :], style, R)
    k_expected = rotate(k_in.astype(np.float64), angles[:, :, None, :], style, R)
    assert (k == k_in).all(), "k is only read with a KV cache"
    written_k = np.zeros(k_cache.shape, dtype=bool)
    written_v = np.zeros(v_cache.shape, dtype=bool)

    def check(got, expected, rotated, scale):
        if not fp8:
            tolerance = 3e-5 if rotated else 0.0
            np.testing.assert_allclose(got, expected.astype(np.float32), atol=tolerance, rtol=0)
            return
        if not rotated:  # copies: exactly the nearest code of the float32 quotient
            np.testing.assert_array_equal(got, e4m3_encode(np.float32(expected) / np.float32(scale)))
            return
        value = np.clip(expected / scale, -448, 448)
        decoded = VALUES[got]
        half_step = np.where(
            np.abs(value) < 2.0**-6, 2.0**-10, np.ldexp(1.0, np.floor(np.log2(np.abs(value) + 1e-300)).astype(int) - 4)
        )
        assert (np.abs(decoded - value) <= half_step * 1.001 + 1e-9).all()

    rotated = np.zeros(D, dtype=bool)
    rotated[:R] = True  # half and interleaved pairs both cover features [0, R)
    for t, where in enumerate(cell):
        if where is None:
            continue
        b, s = divmod(t, S)
        block, offset = where
        for h in range(Hk):
            index_k = (block, h, offset) if kv_layout == "hnd" else (block, offset, h)
            written_k[index_k] = True
            written_v[index_k] = True
            check(k_cache[index_k][rotated], k_expected[b, s, h][rotated], True, 0.3)
            check(k_cache[index_k][~rotated], k_in[b, s, h][~rotated].astype(np.float64), False, 0.3)
            check(v_cache[index_k], v[b, s, h].astype(np.float64), False, 0.02)
    # Every cell no token maps to keeps its contents.
    np.testing.assert_array_equal(k_cache[~written_k], k_before[~written_k])
    np.testing.assert_array_equal(v_cache[~written_v], v_before[~written_v])
    # q: rotated in place, or into the FP8 q_out.
    if fp8:
        check(q_out[..., :R], q_expected[..., :R], True, 0.7)
        check(q_out[..., R:], q_in[..., R:].astype(np.float64), False, 0.7)
    else:
        np.testing.assert_allclose(q, q_expected.astype(np.float32), atol=3e-5, rtol=0)


def test_kv_cache_errors_name_the_argument(cpu_runtime):
    q = np.zeros((1, 4, 2, 8), dtype=np.float32)
    k = np.zeros((1, 4, 2, 8), dtype=np.float32)
    inv_freq = np.ones(4, dtype=np.float32)
    k_cache = np.zeros((2, 4, 2, 8), dtype=np.float32)
    slot = np.array([0, 1, 2, 99], dtype=np.int64)  # 99: past the 8 slots
    with pytest.raises(rope_jit.InvalidArgumentError, match="slot_mapping"):
        rope_jit.rope(q, k, inv_freq=inv_freq, layout="bshd", kv_layout="nhd", k_cache=k_cache,
                      slot_mapping=slot, runtime=cpu_runtime)
    assert (k_cache == 0).all() and (q == 0).all()
    with pytest.raises(ValueError, match="kv_layout"):
        rope_jit.rope(q, k, inv_freq=inv_freq, kv_layout="paged", k_cache=k_cache,
                      runtime=cpu_runtime)
    with pytest.raises(rope_jit.InvalidArgumentError, match="k_scale"):
        rope_jit.rope(q, k, inv_freq=inv_freq, layout="bshd", kv_layout="nhd", k_cache=k_cache,
                      slot_mapping=np.arange(4), k_scale=np.ones(1, np.float32),
                      runtime=cpu_runtime)


def test_a_kv_cache_call_reads_k_with_any_strides(cpu_runtime):
    """With a KV cache k is only read: a k broadcast over its tokens (repeated strides, which
    no written tensor may have) fills the cache as the same values in their own memory do
    (review, session 35)."""
    rng = np.random.default_rng(35)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)  # [B, S, Hq, D]
    row = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k_broadcast = np.broadcast_to(row, (1, 4, 2, 8))  # one token's k, stride 0 over S
    inv_freq = (10000.0 ** (-np.arange(4) / 4)).astype(np.float32)
    caches = []
    for k in (k_broadcast, np.ascontiguousarray(k_broadcast)):
        k_cache = np.zeros((1, 6, 2, 8), dtype=np.float32)  # contiguous [B, S_max, Hk, D]
        rope_jit.rope(q.copy(), k, inv_freq=inv_freq, layout="bshd", kv_layout="contiguous",
                      k_cache=k_cache, seqlen_offsets=np.array([1]), runtime=cpu_runtime)
        caches.append(k_cache)
    np.testing.assert_array_equal(caches[0], caches[1])
    assert (caches[0][0, 1:5] != 0).any() and (caches[0][0, [0, 5]] == 0).all()


def test_torch_float8_cache_on_cpu(cpu_runtime):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    B, S, Hk, D, block_size = 1, 3, 1, 8, 2
    q = torch.randn(B, S, 2, D)
    k = torch.randn(B, S, Hk, D)
    v = torch.randn(B, S, Hk, D)
    k_cache = torch.zeros(4, block_size, Hk, D, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(4, block_size, Hk, D, dtype=torch.float8_e4m3fn)
    slot = torch.tensor([5, 0, 2], dtype=torch.int64)
    inv_freq = torch.ones(D // 2)
    rope_jit.rope(q, k, v=v, inv_freq=inv_freq, layout="bshd", kv_layout="nhd",
                  k_cache=k_cache, v_cache=v_cache, slot_mapping=slot,
                  v_scale=torch.tensor([0.5]), k_scale=torch.tensor([1.0]), runtime=cpu_runtime)
    codes = v_cache.view(torch.uint8).numpy()
    for t, s in enumerate(slot.tolist()):
        expected = e4m3_encode((v[0, t, 0].numpy() / np.float32(0.5)).astype(np.float32))
        np.testing.assert_array_equal(codes[s // block_size, s % block_size, 0], expected)
    # Token 0 at position 0: angle 0, so its k is copied.
    np.testing.assert_array_equal(k_cache.view(torch.uint8).numpy()[2, 1, 0],
                                  e4m3_encode(k[0, 0, 0].numpy()))


def test_torch_cuda_kv_cache_matches_the_cpu(cpu_runtime):
    """GPU machines: torch CUDA tensors (bf16, paged NHD at slot_mapping, FP8 caches) give the
    CPU backend's cache bytes: v's exactly, k's within one e4m3 step."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("needs CUDA and torch.float8_e4m3fn")
    generator = torch.Generator().manual_seed(23)
    B, S, Hq, Hk, D, block_size = 3, 7, 8, 2, 128, 16
    q = torch.randn(B, S, Hq, D, generator=generator).to(torch.bfloat16)
    k = torch.randn(B, S, Hk, D, generator=generator).to(torch.bfloat16)
    v = torch.randn(B, S, Hk, D, generator=generator).to(torch.bfloat16)
    positions = torch.arange(S).repeat(B, 1) + 3
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    slot = torch.randperm(4 * block_size, generator=generator)[: B * S]
    scale = torch.tensor([0.25])
    results = []
    for device in ("cpu", "cuda"):
        k_cache = torch.zeros(4, block_size, Hk, D, dtype=torch.float8_e4m3fn, device=device)
        v_cache = torch.zeros_like(k_cache)
        q_d = q.clone().to(device)  # rotated in place: each backend its own copy
        runtime = cpu_runtime if device == "cpu" else None
        rope_jit.rope(q_d, k.to(device), v=v.to(device), inv_freq=inv_freq.to(device),
                      positions=positions.to(device), layout="bshd", kv_layout="nhd",
                      k_cache=k_cache, v_cache=v_cache, slot_mapping=slot.to(device),
                      k_scale=scale.to(device), v_scale=scale.to(device), runtime=runtime)
        torch.cuda.synchronize()
        results.append((q_d.float().cpu(), k_cache.view(torch.uint8).cpu().numpy(),
                        v_cache.view(torch.uint8).cpu().numpy()))
    (q_cpu, k_cpu, v_cpu), (q_gpu, k_gpu, v_gpu) = results
    np.testing.assert_array_equal(v_gpu, v_cpu)
    decoded_cpu, decoded_gpu = VALUES[k_cpu], VALUES[k_gpu]
    step = np.maximum(np.abs(decoded_cpu), 2.0**-6) / 8
    assert (np.abs(decoded_gpu - decoded_cpu) <= step * 1.001).all()
    torch.testing.assert_close(q_gpu, q_cpu, atol=1.6e-2, rtol=0)
