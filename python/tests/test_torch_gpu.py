"""GPU-only behaviour of the PyTorch integration (skipped without CUDA): PyTorch's current stream,
CUDA graph capture, torch.compile with CUDA graphs, every golden case on the GPU through torch
tensors, and large Llama shapes against plain PyTorch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import rope_jit  # noqa: E402
from golden_cases import as_float, assert_close, cases, load_all  # noqa: E402
from torch_reference import hf_tables, rope_torch  # noqa: E402

DEVICE = "cuda"


def from_numpy(array, dtype):
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if dtype == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(DEVICE)


def to_numpy_float(tensor):
    return tensor.detach().float().cpu().numpy().astype(np.float64)


def test_the_kernel_runs_on_pytorchs_current_stream():
    cos, sin = hf_tables(torch.arange(64, device=DEVICE), 128)
    source = torch.randn(2, 8, 64, 128, device=DEVICE)
    expected = rope_torch(source, cos, sin, torch.arange(64, device=DEVICE))
    q = torch.zeros_like(source)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # The stream is kept busy, then q is filled on it: a kernel launched anywhere else
        # (the legacy default stream does not wait for PyTorch's streams) would read zeros.
        torch.cuda._sleep(100_000_000)
        q.copy_(source)
        out = rope_jit.apply_rope(q, cos=cos, sin=sin)
    stream.synchronize()
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_the_rope_op_is_captured_in_a_cuda_graph_and_replays_with_new_inputs():
    cos, sin = hf_tables(torch.arange(32, device=DEVICE), 64, dtype=torch.bfloat16)
    static_q = torch.randn(1, 8, 32, 64, device=DEVICE, dtype=torch.bfloat16)
    static_k = torch.randn(1, 2, 32, 64, device=DEVICE, dtype=torch.bfloat16)
    rope_jit.apply_rope(static_q, static_k, cos, sin)  # compile and load before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_k = rope_jit.apply_rope(static_q, static_k, cos, sin)
    for seed in range(3):
        torch.manual_seed(seed)
        static_q.copy_(torch.randn_like(static_q))
        static_k.copy_(torch.randn_like(static_k))
        graph.replay()
        torch.cuda.synchronize()
        rows = torch.arange(32, device=DEVICE)
        torch.testing.assert_close(
            out_q.float(), rope_torch(static_q, cos, sin, rows), rtol=1.6e-2, atol=1.6e-2
        )
        torch.testing.assert_close(
            out_k.float(), rope_torch(static_k, cos, sin, rows), rtol=1.6e-2, atol=1.6e-2
        )


def test_torch_compile_with_cuda_graphs_gives_the_eager_values():
    cos, sin = hf_tables(torch.arange(128, device=DEVICE), 128, dtype=torch.bfloat16)

    def block(q, k):
        q, k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
        return q * 2, k + 1

    torch._dynamo.reset()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for seed in range(3):
        torch.manual_seed(seed)
        q = torch.randn(2, 128, 16, 128, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(2, 128, 4, 128, device=DEVICE, dtype=torch.bfloat16)
        got = [t.clone() for t in compiled(q, k)]
        expected = block(q, k)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_llama_shapes_match_plain_pytorch_with_gradients(dtype):
    batch, seq_len, heads_q, heads_k, head_dim = 4, 4096, 32, 8, 128
    position_ids = torch.arange(seq_len, device=DEVICE)
    cos, sin = hf_tables(position_ids, head_dim, theta=500000.0, dtype=dtype)
    q = torch.randn(
        batch, seq_len, heads_q, head_dim, device=DEVICE, dtype=dtype, requires_grad=True
    )
    k = torch.randn(
        batch, seq_len, heads_k, head_dim, device=DEVICE, dtype=dtype, requires_grad=True
    )
    q_out, k_out = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
    q_ref = q.detach().transpose(1, 2).requires_grad_(True)
    k_ref = k.detach().transpose(1, 2).requires_grad_(True)
    q_expected = rope_torch(q_ref, cos, sin, position_ids).transpose(1, 2)
    k_expected = rope_torch(k_ref, cos, sin, position_ids).transpose(1, 2)
    tolerance = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(q_out.float(), q_expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(k_out.float(), k_expected, rtol=tolerance, atol=tolerance)
    grad_q, grad_k = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward([q_out, k_out], [grad_q, grad_k])
    torch.autograd.backward([q_expected, k_expected], [grad_q.float(), grad_k.float()])
    # The reference's leaves have the input dtype, so their gradients were rounded to it too.
    torch.testing.assert_close(
        q.grad.float(), q_ref.grad.float().transpose(1, 2), rtol=tolerance, atol=tolerance
    )
    torch.testing.assert_close(
        k.grad.float(), k_ref.grad.float().transpose(1, 2), rtol=tolerance, atol=tolerance
    )


ROPE_CASES = cases("rope")


@pytest.mark.parametrize("case", ROPE_CASES, ids=[case["name"] for case in ROPE_CASES])
def test_each_golden_rope_case_matches_on_the_gpu_through_torch(case):
    params = case["params"]
    inputs = {name: from_numpy(*value) for name, value in load_all(case["inputs"]).items()}
    position_offset = params.get("position_offset", 0)
    q_position_offset = 0
    if "q_position_offset" in inputs:
        q_position_offset = int(inputs.pop("q_position_offset")[0]) - position_offset
    arguments = {
        name: inputs[name]
        for name in ("positions", "seqlen_offsets", "cu_seqlens")
        if name in inputs
    }
    if params.get("xpos"):
        arguments["xpos_scale"] = inputs["xpos_scale"]
    got = rope_jit.apply_rope(
        inputs["q"],
        inputs.get("k"),
        inputs["cos"],
        inputs["sin"],
        layout=params["layout"],
        style=params["style"],
        rotary_dim=params["rotary_dim"],
        rotary_offset=params.get("rotary_offset", 0),
        backward=params["backward"],
        position_offset=position_offset,
        q_position_offset=q_position_offset,
        **arguments,
    )
    got = {"q": got} if "k" not in inputs else {"q": got[0], "k": got[1]}
    for name, (array, dtype) in load_all(case["outputs"]).items():
        assert_close(
            to_numpy_float(got[name]),
            as_float(array, dtype),
            case["tolerance"],
            f"{case['name']} {name}",
        )


ATTENTION_CASES = cases("attention")


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[case["name"] for case in ATTENTION_CASES])
def test_each_golden_attention_case_matches_on_the_gpu_through_torch(case):
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    params = case["params"]
    inputs = {name: from_numpy(*value) for name, value in load_all(case["inputs"]).items()}
    optional = {name: inputs[name] for name in ("pos_mask", "attn_mask") if name in inputs}
    out = rope_jit.torch_ops.attention(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["cos"],
        inputs["sin"],
        causal=params["causal"],
        scale=params["scale"],
        rotary_dim=params["rotary_dim"],
        style=params["style"],
        **optional,
    )
    expected, dtype = load_all(case["outputs"])["out"]
    assert_close(to_numpy_float(out), as_float(expected, dtype), case["tolerance"], case["name"])


def test_tensors_on_another_gpu_run_on_that_gpu_and_its_current_stream():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    cos, sin = hf_tables(torch.arange(16, device="cuda:1"), 32)
    q = torch.randn(1, 4, 16, 32, device="cuda:1")
    with torch.cuda.device(0):
        out = rope_jit.apply_rope(q, cos=cos, sin=sin)
    torch.cuda.synchronize(1)
    torch.testing.assert_close(
        out, rope_torch(q, cos, sin, torch.arange(16, device="cuda:1")), rtol=2e-5, atol=2e-5
    )


def _bshd_inputs(seed, batch=2, seq=64, heads_q=8, heads_k=2, head_dim=64, dtype=torch.bfloat16):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, seq, heads_q, head_dim, device=DEVICE, dtype=dtype, generator=generator)
    k = torch.randn(batch, seq, heads_k, head_dim, device=DEVICE, dtype=dtype, generator=generator)
    return q, k


def test_forward_and_backward_through_the_eager_fast_path_make_no_host_synchronization():
    cos, sin = hf_tables(torch.arange(64, device=DEVICE), 64, dtype=torch.bfloat16)
    q, k = (t.requires_grad_(True) for t in _bshd_inputs(0))
    offsets = torch.tensor([0, 5], device=DEVICE)
    # Kernels compile and load outside the check (the check sees PyTorch's CUDA calls only).
    rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
    rope_jit.apply_rope(
        q.detach()[:, :32], k.detach()[:, :32], cos, sin, seqlen_offsets=offsets, layout="bshd"
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out_q, out_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
            torch.autograd.backward((out_q, out_k), (out_q.detach(), out_k.detach()))
            rope_jit.apply_rope(
                q.detach()[:, :32],
                k.detach()[:, :32],
                cos,
                sin,
                seqlen_offsets=offsets,
                layout="bshd",
            )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_eager_forward_and_backward_are_captured_in_a_cuda_graph_and_replay_with_new_inputs():
    cos, sin = hf_tables(torch.arange(64, device=DEVICE), 64, dtype=torch.bfloat16)
    static_q, static_k = (t.requires_grad_(True) for t in _bshd_inputs(1))
    static_grad_q, static_grad_k = (t.detach() for t in _bshd_inputs(2))

    def step():
        out_q, out_k = rope_jit.apply_rope(static_q, static_k, cos, sin, layout="bshd")
        grad_q, grad_k = torch.autograd.grad(
            (out_q, out_k), (static_q, static_k), (static_grad_q, static_grad_k)
        )
        return out_q, out_k, grad_q, grad_k

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for seed in range(3, 6):
        q, k = _bshd_inputs(seed)
        grad_q, grad_k = _bshd_inputs(seed + 10)
        with torch.no_grad():
            static_q.copy_(q)
            static_k.copy_(k)
        static_grad_q.copy_(grad_q)
        static_grad_k.copy_(grad_k)
        graph.replay()
        q_ref, k_ref = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        expected = rope_jit.apply_rope(q_ref, k_ref, cos, sin, layout="bshd")
        expected_grads = torch.autograd.grad(expected, (q_ref, k_ref), (grad_q, grad_k))
        for got, want in zip(outputs, (*expected, *expected_grads)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_torch_compile_reduce_overhead_fullgraph_forward_and_backward():
    cos, sin = hf_tables(torch.arange(64, device=DEVICE), 64, dtype=torch.bfloat16)

    def block(q, k):
        q, k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
        return (q.float() * 0.5).sum() + (k.float() ** 2).sum()

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # warm-up runs, then replays of the recorded graphs
        q, k = (t.requires_grad_(True) for t in _bshd_inputs(20 + seed))
        got = compiled(q, k)
        got.backward()
        q_ref, k_ref = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(
            True
        )
        want = block(q_ref, k_ref)
        want.backward()
        # Inductor fuses the loss around the op and may round bf16 intermediates differently.
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)
        torch.testing.assert_close(q.grad, q_ref.grad, rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(k.grad, k_ref.grad, rtol=1.6e-2, atol=1.6e-2)


def test_outputs_made_by_the_plans_allocator_on_the_gpu_are_empty_likes_and_right():
    # Decode shapes through apply_rope (bshd) and the HF drop-in (the [B, H, 1, D] views the
    # models pass, per-sequence tables): the plan makes the outputs after its first call, with
    # torch.empty_like's strides, dtype and device; values against plain PyTorch every call.
    from rope_jit.dropin.hf import apply_rotary_pos_emb

    cos, sin = hf_tables(torch.arange(64, device=DEVICE), 128, dtype=torch.bfloat16)
    for seed in range(3):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        q = torch.randn(8, 1, 32, 128, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        k = torch.randn(8, 1, 8, 128, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        offsets = torch.arange(8, device=DEVICE) * 7
        got_q, got_k = rope_jit.apply_rope(q, k, cos, sin, seqlen_offsets=offsets, layout="bshd")
        positions = offsets[:, None]  # [B, 1]
        hf_cos, hf_sin = cos[positions], sin[positions]  # [B, 1, D]
        hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)
        made = ((got_q, q), (got_k, k), (hf_q, q.transpose(1, 2)), (hf_k, k.transpose(1, 2)))
        for got, x in made:
            reference = torch.empty_like(x)
            assert (got.stride(), got.dtype, got.device) == (
                reference.stride(), reference.dtype, reference.device
            )
        for got, x in ((got_q, q), (got_k, k)):
            want = rope_torch(x.transpose(1, 2).float(), cos.float(), sin.float(), positions)
            torch.testing.assert_close(got.transpose(1, 2).float(), want, rtol=2e-2, atol=2e-2)
            hf_got = (hf_q if x is q else hf_k).float()
            torch.testing.assert_close(hf_got, got.transpose(1, 2).float(), rtol=2e-2, atol=2e-2)


def test_the_attention_op_takes_its_workspace_from_torch_and_matches_the_library_allocating_one(
        monkeypatch):
    # bf16, D128, causal, GQA 4: on sm_90 the wgmma kernels, whose workspace PyTorch's allocator
    # now gives (rope_jit_attention_args.workspace). The same op with the size query hidden (a
    # library older than it) makes the library allocate its own: the same bits for out, lse,
    # dk and dv, dq within rounding (float32 atomic adds).
    if not rope_jit.has_attention():
        pytest.skip("the loaded librope_jit has no rope_jit_attention")
    import importlib

    attention_module = importlib.import_module("rope_jit.attention")
    if attention_module._workspace_size_function(rope_jit.default_runtime().library) is None:
        pytest.skip("the loaded librope_jit has no rope_jit_attention_workspace_size")
    generator = torch.Generator(device=DEVICE).manual_seed(19)
    shape_q, shape_k = (2, 8, 300, 128), (2, 2, 300, 128)
    q = torch.randn(shape_q, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    k = torch.randn(shape_k, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    v = torch.randn(shape_k, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    dout = torch.randn(shape_q, device=DEVICE, dtype=torch.bfloat16, generator=generator)
    cos, sin = hf_tables(torch.arange(300, device=DEVICE), 128)

    def forward_backward():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = rope_jit.torch_ops.attention(*leaves, cos, sin, causal=True, return_lse=True)
        out.backward(dout)
        return out.detach(), lse, *(t.grad for t in leaves)

    given = []
    real_workspace = attention_module._torch_workspace

    def recording_workspace(runtime, args, which, q_tensor, held):
        real_workspace(runtime, args, which, q_tensor, held)
        given.append((which, args.workspace_bytes, (args.workspace or 0) % 256))

    monkeypatch.setattr(attention_module, "_torch_workspace", recording_workspace)
    torch.cuda.synchronize()
    with_torch = forward_backward()
    torch.cuda.synchronize()
    assert [which for which, _, _ in given] == ["forward", "backward"]
    assert all(misalignment == 0 for _, _, misalignment in given)
    if torch.cuda.get_device_capability() == (9, 0):  # the wgmma kernels take a workspace
        assert all(size > 0 for _, size, _ in given), given

    monkeypatch.setattr(attention_module, "_workspace_size_function", lambda library: None)
    library_allocated = forward_backward()
    torch.cuda.synchronize()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), with_torch, library_allocated):
        if name == "dq":
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2)
        else:
            assert torch.equal(got, want), name
