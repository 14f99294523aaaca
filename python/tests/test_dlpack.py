"""The DLPack bridge: every path is zero-copy, honours strides, keeps memory alive for the
call and releases it after."""

import ctypes
import sys

import pytest

import rope_jit
from rope_reference import angle_tables, rope_reference, token_rows

np = pytest.importorskip("numpy")


class ForeignTensor:
    """A tensor from "another framework": it speaks only the DLPack protocol (here by
    forwarding to a NumPy array, whose memory it shares)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def inputs(seed=0, shape=(2, 3, 5, 8)):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, shape[-1], 2) / shape[-1])).astype(np.float32)
    return q, inv_freq


def expected_rotation(q, inv_freq):
    cos, sin = angle_tables(inv_freq, q.shape[2])
    return rope_reference(q, "bhsd", cos, sin, token_rows(q.shape[0], q.shape[2]), rotary_dim=q.shape[-1])


def test_a_numpy_array_is_rotated_in_place_in_its_own_memory(cpu_runtime):
    q, inv_freq = inputs()
    expected = expected_rotation(q, inv_freq)
    address = q.ctypes.data
    result, k_result = rope_jit.rope(q, inv_freq=inv_freq, runtime=cpu_runtime)
    assert result is q and k_result is None and q.ctypes.data == address
    np.testing.assert_allclose(q, expected, rtol=1e-5, atol=1e-5)


def test_a_tensor_known_only_through_dlpack_is_rotated_in_place_without_a_copy(cpu_runtime):
    q, inv_freq = inputs(1)
    expected = expected_rotation(q, inv_freq)
    foreign = ForeignTensor(q)
    tensor = rope_jit.as_tensor(foreign, "q")
    assert tensor.data == q.ctypes.data and tensor.shape == q.shape and tensor.dtype == "float32"
    rope_jit.rope(foreign, inv_freq=ForeignTensor(inv_freq), runtime=cpu_runtime)
    np.testing.assert_allclose(q, expected, rtol=1e-5, atol=1e-5)


def test_the_dlpack_capsule_is_released_after_the_call(cpu_runtime):
    q, inv_freq = inputs(2)
    before = sys.getrefcount(q)
    rope_jit.rope(ForeignTensor(q), inv_freq=inv_freq, runtime=cpu_runtime)
    # NumPy's capsule holds a reference to the array until its deleter runs.
    assert sys.getrefcount(q) == before


def test_strided_dlpack_views_are_read_through_their_strides(cpu_runtime):
    base, inv_freq = inputs(3, shape=(2, 5, 3, 8))
    view = base.transpose(0, 2, 1, 3)  # [B, H, S, D] view of a [B, S, H, D] buffer
    expected = expected_rotation(np.ascontiguousarray(view), inv_freq)
    tensor = rope_jit.as_tensor(ForeignTensor(view), "q")
    assert tensor.strides == (120, 8, 24, 1)
    rope_jit.rope(ForeignTensor(view), inv_freq=inv_freq, runtime=cpu_runtime)
    np.testing.assert_allclose(view, expected, rtol=1e-5, atol=1e-5)


def test_a_slice_of_a_padded_buffer_is_rotated_and_the_padding_is_untouched(cpu_runtime):
    rng = np.random.default_rng(4)
    buffer = rng.standard_normal((2, 3, 5, 12)).astype(np.float32)
    padding = buffer[..., 8:].copy()
    q = buffer[..., :8]
    _, inv_freq = inputs()
    expected = expected_rotation(np.ascontiguousarray(q), inv_freq)
    rope_jit.rope(q, inv_freq=inv_freq, runtime=cpu_runtime)
    np.testing.assert_allclose(q, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(buffer[..., 8:], padding)


def test_read_only_arrays_are_taken_as_inputs_and_refused_as_outputs(cpu_runtime):
    q, inv_freq = inputs(5)
    inv_freq.setflags(write=False)
    q.setflags(write=False)
    out = np.full_like(q, np.nan)
    rope_jit.rope(q, inv_freq=inv_freq, q_out=out, runtime=cpu_runtime)
    np.testing.assert_allclose(out, expected_rotation(q, inv_freq), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="q: the array is read-only"):
        rope_jit.rope(q, inv_freq=inv_freq, runtime=cpu_runtime)
    with pytest.raises(ValueError, match="q_out: the array is read-only"):
        rope_jit.rope(out, inv_freq=inv_freq, q_out=q, runtime=cpu_runtime)


def test_strides_that_are_not_whole_elements_are_refused_with_the_argument_named(cpu_runtime):
    record = np.zeros((2, 1, 3, 4), dtype=[("value", np.float32), ("flag", np.uint8)])
    with pytest.raises(ValueError, match="q: stride .* not a whole number"):
        rope_jit.rope(record["value"], inv_freq=np.ones(2, np.float32), runtime=cpu_runtime)


def test_objects_that_are_not_tensors_are_a_type_error_naming_the_argument(cpu_runtime):
    q, inv_freq = inputs()
    with pytest.raises(TypeError, match="cos: expected a tensor"):
        rope_jit.rope(q, cos=[[1.0]], sin=[[0.0]], runtime=cpu_runtime)


def test_bfloat16_bits_in_a_uint16_array_pass_as_bfloat16(cpu_runtime):
    from rope_reference import bf16_bits_to_float, float_to_bf16_bits
    q, inv_freq = inputs(6)
    bits = float_to_bf16_bits(q)
    tensor = rope_jit.reinterpret(bits, "bfloat16")
    assert tensor.dtype == "bfloat16" and tensor.data == bits.ctypes.data
    rope_jit.rope(tensor, inv_freq=inv_freq, runtime=cpu_runtime)
    expected = expected_rotation(bf16_bits_to_float(float_to_bf16_bits(q)), inv_freq)
    np.testing.assert_allclose(bf16_bits_to_float(bits), expected, rtol=8e-3, atol=8e-3)
    with pytest.raises(ValueError, match="bits"):
        rope_jit.reinterpret(q, "bfloat16")


def test_raw_memory_passes_through_from_pointer(cpu_runtime):
    q, inv_freq = inputs(7)
    expected = expected_rotation(q, inv_freq)
    raw = rope_jit.from_pointer(q.ctypes.data, q.shape, "float32", keepalive=q)
    assert raw.strides == (120, 40, 8, 1)
    rope_jit.rope(raw, inv_freq=inv_freq, runtime=cpu_runtime)
    np.testing.assert_allclose(q, expected, rtol=1e-5, atol=1e-5)


def test_the_dltensor_handed_to_the_library_describes_the_memory_field_by_field():
    base = np.zeros((2, 5, 3, 8), np.float16)[:, :, 1:, :]  # [B, S, H, D] slice, not contiguous
    tensor = rope_jit.as_tensor(base, "q", swap_dims=(1, 2))
    for struct in (tensor.struct, tensor.pointer.contents):
        assert ctypes.addressof(struct) == tensor.address
        assert struct.data == base.ctypes.data and struct.byte_offset == 0
        assert (struct.device.device_type, struct.device.device_id) == (1, 0)
        assert (struct.dtype.code, struct.dtype.bits, struct.dtype.lanes) == (2, 16, 1)
        assert struct.ndim == 4
        assert [struct.shape[i] for i in range(4)] == [2, 2, 5, 8] == list(tensor.shape)
        assert [struct.strides[i] for i in range(4)] == [120, 8, 24, 1] == list(tensor.strides)
    scalar = rope_jit.from_pointer(1234, (), "int64", device="cuda:1")
    assert (scalar.struct.ndim, scalar.struct.data, scalar.device, scalar.dtype) == (0, 1234, (2, 1), "int64")
    with pytest.raises(TypeError):
        rope_jit.from_pointer(1234, (2.0, 3), "float32")


class ForeignTensorV1(ForeignTensor):
    """A producer of DLPack 1.0: it passes the consumer's max_version on (NumPy then exports
    read-only memory with its read-only flag, which it refuses to the older protocol)."""

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.1.0",
                    reason="NumPy exports DLPack 1.0 from 2.1")
def test_read_only_memory_of_a_dlpack_1_producer_is_read_but_never_written(cpu_runtime):
    # Adversarial pass, session 37: only the older protocol was asked for, so read-only
    # memory failed with the producer's BufferError even as an input.
    q, inv_freq = inputs(12)
    expected = expected_rotation(q, inv_freq)
    inv_freq.flags.writeable = False
    rope_jit.rope(ForeignTensorV1(q), inv_freq=ForeignTensorV1(inv_freq), runtime=cpu_runtime)
    np.testing.assert_allclose(q, expected, atol=2e-5)
    frozen = q.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="q: the tensor's memory is read-only"):
        rope_jit.rope(ForeignTensorV1(frozen), inv_freq=inv_freq, runtime=cpu_runtime)
    q_out = np.zeros_like(q)
    q_out.flags.writeable = False
    with pytest.raises(ValueError, match="q_out: the tensor's memory is read-only"):
        rope_jit.rope(q, inv_freq=inv_freq, q_out=ForeignTensorV1(q_out), runtime=cpu_runtime)
    assert not q_out.any()


@pytest.mark.parametrize("refusal", [TypeError, BufferError, NotImplementedError])
def test_a_producer_refusing_max_version_in_any_way_is_asked_the_older_protocol(cpu_runtime, refusal):
    # array-api-strict 2.0 raises NotImplementedError for max_version (review of session 37).
    class Refusing(ForeignTensor):
        def __dlpack__(self, **kwargs):
            if "max_version" in kwargs:
                raise refusal("max_version is not supported")
            return self.array.__dlpack__()

    q, inv_freq = inputs(13)
    expected = expected_rotation(q, inv_freq)
    rope_jit.rope(Refusing(q), inv_freq=inv_freq, runtime=cpu_runtime)
    np.testing.assert_allclose(q, expected, atol=2e-5)


class Nonsense(ForeignTensor):
    """A producer whose DLPack answers are not DLPack's."""

    def __init__(self, array, device=None, capsule=None):
        super().__init__(array)
        self.device, self.capsule = device, capsule

    def __dlpack_device__(self):
        return self.device if self.device is not None else super().__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.capsule if self.capsule is not None else self.array.__dlpack__()


@pytest.mark.parametrize("device, message", [
    ((1,), r"__dlpack_device__\(\) returned \(1,\), not a \(device type, device id\) pair of integers"),
    ("cpu", r"__dlpack_device__\(\) returned 'cpu', not a \(device type"),
    ((1.0, 0), r"__dlpack_device__\(\) returned \(1.0, 0\), not a"),
    ((None, 0), r"__dlpack_device__\(\) returned \(None, 0\), not a"),
    ((9, 0), r"DLPack device type 9 is not supported"),
])
def test_a_dlpack_device_that_is_not_a_pair_of_integers_is_a_value_error_naming_the_argument(
        cpu_runtime, device, message):
    q, inv_freq = inputs(14)
    before = q.copy()
    with pytest.raises(ValueError, match="^q: " + message):
        rope_jit.rope(Nonsense(q, device=device), inv_freq=inv_freq, runtime=cpu_runtime)
    np.testing.assert_array_equal(q, before)


def test_a_dlpack_export_that_is_no_capsule_or_a_consumed_one_is_a_value_error_naming_the_argument(
        cpu_runtime):
    q, inv_freq = inputs(15)
    before = q.copy()
    with pytest.raises(ValueError, match=r"^q: __dlpack__\(\) returned ndarray, not a DLPack capsule"):
        rope_jit.rope(Nonsense(q, capsule=q), inv_freq=inv_freq, runtime=cpu_runtime)
    # A capsule that a consumer already took is renamed 'used_dltensor' by the protocol.
    consumed = q.__dlpack__()
    ctypes.pythonapi.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ctypes.pythonapi.PyCapsule_SetName(consumed, b"used_dltensor")
    with pytest.raises(ValueError, match="^k: __dlpack__\\(\\) returned a capsule named "
                                         "'used_dltensor', not 'dltensor'"):
        rope_jit.rope(q, Nonsense(q.copy(), capsule=consumed), inv_freq=inv_freq,
                      runtime=cpu_runtime)
    np.testing.assert_array_equal(q, before)


@pytest.mark.parametrize("ndim, shape", [(-1, True), (65, True), (2, False)])
def test_a_dlpack_tensor_declaring_impossible_dims_is_refused_before_its_shape_is_read(
        cpu_runtime, ndim, shape):
    from rope_jit import _structs

    q, inv_freq = inputs(16)
    before = q.copy()
    dims = (ctypes.c_int64 * 4)(*q.shape)
    managed = _structs.DLManagedTensor()
    managed.dl_tensor.data = q.ctypes.data
    managed.dl_tensor.device = _structs.DLDevice(_structs.KDL_CPU, 0)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = _structs.DLDataType(2, 32, 1)  # float32
    if shape:
        managed.dl_tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(managed), b"dltensor", None)
    expected = f"^q: the DLPack tensor declares {ndim} dims{'' if shape else ' and no shape'}; "
    with pytest.raises(ValueError, match=expected + "0 to 64 dims with a shape are read"):
        rope_jit.rope(Nonsense(q, capsule=capsule), inv_freq=inv_freq, runtime=cpu_runtime)
    np.testing.assert_array_equal(q, before)


def test_the_library_tells_views_of_one_buffer_that_share_elements_as_numpy_does_exactly():
    # rope_jit_tensors_share_memory against NumPy's exact answer (max_work=None) on random
    # strided views of one buffer: heads side by side (a fused qkv), overlapping slices,
    # reversed and stepped views, of 4 dims and, as under vmap's batching, of 5 and 8.
    from rope_jit import _structs, tensors

    buffer = np.zeros((2, 6, 5, 12, 8), np.float32)
    sources = (buffer[1], buffer, buffer.reshape(2, 2, 3, 5, 2, 6, 2, 4))
    rng = np.random.default_rng(11)

    def random_view():
        source = sources[int(rng.integers(0, len(sources)))]
        index = []
        for size in source.shape:
            start = int(rng.integers(0, size // 2 + 1))
            stop = int(rng.integers(max(start + 1, size // 2), size + 1))
            step = int(rng.choice([1, 1, 2, 3])) * (-1 if rng.random() < 0.2 else 1)
            reverse = slice(stop - 1, start - 1 if start else None, step)
            index.append(slice(start, stop, step) if step > 0 else reverse)
        return source[tuple(index)]

    answers = {True: 0, False: 0}
    for _ in range(300):
        a, b = random_view(), random_view()
        expected = bool(np.shares_memory(a, b, max_work=None))
        got = tensors.shares_memory(tensors.as_tensor(a, "a"), tensors.as_tensor(b, "b"))
        assert got == expected, (a.shape, a.strides, b.shape, b.strides)
        answers[expected] += 1
    assert min(answers.values()) > 30  # both answers well exercised
    q, k = buffer[0, :, :, :8], buffer[0, :, :, 8:]  # interleaved heads: elements apart
    assert not tensors.shares_memory(tensors.as_tensor(q, "q"), tensors.as_tensor(k, "k"))
    # The package's mirror of the library's limit: that many dims are taken, one more is not.
    most = _structs.MEMORY_QUERY_MAX_DIMS
    widest = buffer.reshape((1,) * (most - buffer.ndim) + buffer.shape)
    assert tensors.shares_memory(tensors.as_tensor(q, "q"), tensors.as_tensor(widest, "k"))
    with pytest.raises(rope_jit.InvalidArgumentError, match=f"b: expected at most {most} dim"):
        tensors.shares_memory(tensors.as_tensor(q, "q"), tensors.as_tensor(widest[None], "k"))


def test_the_library_calls_elements_distinct_only_where_no_two_indices_meet():
    # rope_jit_tensor_has_distinct_elements (the rule for what a call writes: strides sorted,
    # each beyond the span below it, a sufficient test) on random as_strided views, against
    # their offsets enumerated: never "distinct" where two indices address one element, never
    # for a zero stride over several indices; and slices of a buffer, stepped or reversed,
    # always distinct.
    from numpy.lib.stride_tricks import as_strided

    from rope_jit import _structs, tensors

    buffer = np.zeros(4096, np.float32)
    rng = np.random.default_rng(12)
    answers = {True: 0, False: 0}
    for _ in range(400):  # 1 to 8 dims: up to 4 as the ops take, more as under vmap
        ndim = int(rng.integers(1, _structs.MEMORY_QUERY_MAX_DIMS + 1))
        shape = tuple(int(size) for size in rng.integers(1, 5, size=ndim))
        strides = tuple(int(stride) for stride in rng.integers(0, 13, size=len(shape)))
        view = as_strided(buffer, shape, tuple(4 * stride for stride in strides),
                          writeable=False)
        offsets = np.zeros(shape, np.int64)
        for dim, (size, stride) in enumerate(zip(shape, strides)):
            offsets += (np.arange(size) * stride).reshape(
                [size if d == dim else 1 for d in range(len(shape))])
        exact = np.unique(offsets).size == offsets.size
        got = tensors.has_distinct_elements(tensors.as_tensor(view, "q"))
        assert not got or exact, (shape, strides)
        if any(size > 1 and stride == 0 for size, stride in zip(shape, strides)):
            assert not got, (shape, strides)
        answers[got] += 1
    assert min(answers.values()) > 40  # both answers well exercised
    block = np.zeros((6, 5, 12, 8), np.float32)
    for index in [(slice(None), slice(1, 4), slice(0, 8), slice(None)),
                  (slice(None, None, 2), slice(None), slice(None, None, -3), slice(1, 7, 2)),
                  (0, slice(None, None, -1), slice(4, 12), slice(None))]:
        assert tensors.has_distinct_elements(tensors.as_tensor(block[index], "q")), index
    most = _structs.MEMORY_QUERY_MAX_DIMS
    widest = np.zeros((1,) * (most - 1) + (2,), np.float32)
    assert tensors.has_distinct_elements(tensors.as_tensor(widest, "t"))
    with pytest.raises(rope_jit.InvalidArgumentError, match=f"t: expected at most {most} dim"):
        tensors.has_distinct_elements(tensors.as_tensor(widest[None], "t"))
