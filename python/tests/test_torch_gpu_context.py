"""A thread's CUDA context after our calls (issue 21, point 3): PyTorch warned "Attempting to run
cuBLAS, but there was no current CUDA context!" after our backward ran in its autograd thread.
Each check runs in a fresh process (the warning is printed once per process, and threads start
without a context only in a process that has not made them current yet). Skipped without CUDA."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

WARNING = "no current CUDA context"

PRELUDE = textwrap.dedent("""
    import ctypes, sys, threading
    import torch
    import rope_jit
    driver = ctypes.CDLL("libcuda.so.1")

    def current_context():
        context = ctypes.c_void_p()
        assert driver.cuCtxGetCurrent(ctypes.byref(context)) == 0
        return context.value

    positions = torch.arange(64, device="cuda", dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float32) / 64))
    angles = torch.outer(positions, inv_freq)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
""")


def run(body):
    env = dict(os.environ, PYTHONWARNINGS="always")
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_backward_in_the_autograd_thread_then_cublas_there_gives_no_context_warning():
    # The first backward of the process: the autograd device thread is new, and its first
    # CUDA work is our backward (sum's backward launches nothing); matmul's backward (cuBLAS)
    # follows on the same thread.
    output = run("""
        x = torch.randn(2, 64, 128, device="cuda", requires_grad=True)
        weight = torch.randn(128, 4 * 64, device="cuda", requires_grad=True)
        q = (x @ weight).view(2, 64, 4, 64)
        rotated = rope_jit.apply_rope(q, None, cos, sin, layout="bshd")
        rotated.sum().backward()
        torch.cuda.synchronize()
        assert x.grad is not None and weight.grad is not None
        print("done")
    """)
    assert "done" in output and WARNING not in output, output


def test_a_fresh_thread_keeps_a_current_context_after_our_call_and_cublas_does_not_warn():
    # q is made, and the kernel loaded, on the main thread: in the worker our call is the first
    # CUDA work (its output comes from the allocator's cache).
    output = run(
        """
        q = torch.randn(1, 4, 64, 64, device="cuda")
        rope_jit.apply_rope(q, None, cos, sin)
        torch.cuda.synchronize()
        results = {}

        def worker():
            results["before"] = current_context()
            rope_jit.apply_rope(q, None, cos, sin)
            results["after"] = current_context()
            a = torch.randn(64, 64, device="cuda")
            results["matmul"] = float((a @ a).sum())
            torch.cuda.synchronize()

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert results["before"] is None, results  # a fresh thread starts without a context
        assert results["after"], results  # a context is current after our launch
        assert "matmul" in results, results
        print("done", results)
    """
    )
    assert "done" in output and WARNING not in output, output


def test_backward_run_from_a_fresh_python_thread_then_cublas_gives_no_warning():
    output = run("""
        errors = []

        def worker():
            try:
                q = torch.randn(1, 64, 4, 64, device="cuda", requires_grad=True)
                k = torch.randn(1, 64, 2, 64, device="cuda", requires_grad=True)
                out_q, out_k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
                (out_q.sum() + out_k.sum()).backward()
                a = torch.randn(64, 64, device="cuda")
                (a @ a).sum().item()
            except Exception as error:
                errors.append(repr(error))

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert not errors, errors
        print("done")
    """)
    assert "done" in output and WARNING not in output, output
