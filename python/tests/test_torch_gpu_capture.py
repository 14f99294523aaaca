"""apply_rope's backward captured in a CUDA graph as bench/compare_torch_autograd.py captures it
(skipped without CUDA): q and k are non-leaf tensors (a model's projections), the forward is
recorded outside the capture and its backward alone is captured, then forward and backward
together. Each check runs in a fresh process: the first backward of the process runs on the
autograd device thread, which starts without a CUDA context and allocates its first blocks
during the capture (what a sync, an allocation or a module load there would break; the bench
saw cudaErrorStreamCaptureInvalidated at its first shape). Everything runs on one side stream:
autograd runs a backward node on its forward's stream, so a graph recorded on the legacy
default stream cannot be captured on another one."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import rope_jit
    from rope_jit.dropin.hf import apply_rotary_pos_emb

    torch.cuda.set_stream(torch.cuda.Stream())
    B, S, HQ, HK, D = 4, 1024, 32, 8, 128  # 32 MiB of q: fresh blocks during the capture
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    angles = torch.outer(
        torch.arange(S, device="cuda", dtype=torch.float32),
        1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D),
    )
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    if sys.argv[1] == "apply_rope":
        def impl(q, k):
            return rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
    else:
        def impl(q, k):
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            return apply_rotary_pos_emb(q, k, cos[None], sin[None])
    q_leaf = randn(B, S, HQ, D).requires_grad_(True)
    k_leaf = randn(B, S, HK, D).requires_grad_(True)
    q, k = q_leaf * 1, k_leaf * 1
    recorded = impl(q, k)
    grads_out = tuple(torch.randn_like(t) for t in recorded)
    want = torch.autograd.grad(recorded, (q, k), grads_out, retain_graph=True)
    want = [t.clone() for t in want]

    def backward():
        return torch.autograd.grad(recorded, (q, k), grads_out, retain_graph=True)

    def forward_backward():
        outs = impl(q, k)
        return torch.autograd.grad(outs, (q, k), grads_out)

    for name, step in (("bwd", backward), ("fwd_bwd", forward_backward)):
        for _ in range(3):
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
            got = step()
        for output in got:
            output.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        print(name, "captured")
""")


@pytest.mark.parametrize("entry", ["apply_rope", "hf"])
def test_backward_alone_and_forward_backward_are_captured_in_a_fresh_process(entry):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, entry],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "bwd captured" in output and "fwd_bwd captured" in output, output
