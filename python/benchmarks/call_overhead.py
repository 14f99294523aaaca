"""Host time of one rope_jit.rope() call through the Python binding, on a decode shape.

A decode step rotates one token: q [1, 1, 32, 128] and k [1, 1, 8, 128] ("bshd"), a one-row
cos/sin table, out of place into q_out/k_out: six tensors, almost no work. The kernel is so
small that wall time per call is the binding's overhead (converting six tensors to DLTensors,
finding the stream, filling rope_jit_rope_args, the ctypes call) plus the launch.

Prints, per kind of tensor available here:
  * NumPy (always), on the CPU reference: rope(); rope_jit_rope alone on arguments filled
    once (the floor: rope() minus this is the binding's own cost); as_tensor() of q (with the
    bshd swap) and of cos; resolve_stream();
  * PyTorch CPU tensors (when torch is installed), the same;
  * PyTorch CUDA bf16 tensors (when a GPU is present), the same plus
    torch.cuda.current_stream(device).cuda_stream for comparison. CUDA calls are timed back to
    back and synchronized once at the end of each run, so the GPU time hides behind the host
    time unless the host is faster than the kernel.

Each row gives the best of several repeats of many calls (the least-disturbed run) and their
median, in microseconds per call. From the repository root, without installing the package:

    PYTHONPATH=python ROPE_JIT_LIBRARY=build/librope_jit.so python3 python/benchmarks/call_overhead.py

(PYTHONPATH pointing at another checkout's python/ times that version: before and after.)

--python-only replaces the library call of every plan (the torch hot path) by a no-op: the
torch rows then time the Python path alone (nothing is computed; the NumPy rows and the bare
rope_jit_rope row are unchanged). With --clock thread it isolates what the binding costs from
what the library and the launch cost.
"""

import argparse
import ctypes
import statistics
import time

import numpy as np

import rope_jit
from rope_jit import _structs
from rope_jit.rope import resolve_stream
from rope_jit.runtime import default_runtime
from rope_jit.tensors import as_tensor

BATCH, SEQUENCE, Q_HEADS, K_HEADS, HEAD_DIM = 1, 1, 32, 8, 128
CLOCK = time.perf_counter  # --clock thread: this thread's CPU time (see main)


def best_us_per_call(function, calls, repeats, finish=None):
    """(best, median) of `repeats` runs of `calls` calls, in microseconds per call. `finish`
    runs once at the end of each run (inside the timing), e.g. to wait for queued GPU work."""
    runs = []
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(calls):
            function()
        if finish is not None:
            finish()
        runs.append((CLOCK() - start) / calls * 1e6)
    return min(runs), statistics.median(runs)


def report(label, microseconds):
    best, median = microseconds
    print(f"  {label:<50} {best:8.2f} us  (median {median:8.2f} us)")


def report_split(function, runtime, calls, repeats, finish=None):
    """Splits a torch hot-path row: the library call of the plan `function` uses, replayed alone
    (that signature's C cost and launch), and `function` with that plan's library call stubbed
    (the Python path, with its torch calls on these tensors: output allocations, the stream).
    Their sum against the row shows how much of each hides behind the other."""
    from rope_jit import _plans

    runtime = runtime if runtime is not None else default_runtime()
    kept = function()  # the plan's buffer points at these outputs: they stay alive while replayed
    state = _plans._thread_state(runtime)
    plan = state.last_plan
    if plan is None or plan is _plans._NO_PLAN:
        print("    (no plan: the general path served this call)")
        return
    # The recipe that served the call: e.g. the drop-in's own, or apply_rope's when the
    # drop-in's eager path stepped aside and its general code ran (slower).
    print(f"    (served by the plan of {state.last_key[0].name!r})")
    library_call, handle, args_ref = plan.function, runtime.handle, plan.args_ref
    report(
        "  of which the library call alone (plan replayed)",
        best_us_per_call(lambda: library_call(handle, args_ref), calls, repeats, finish),
    )
    plan.function = lambda handle, args: 0
    try:
        report(
            "  of which Python alone (library call stubbed)",
            best_us_per_call(function, calls, repeats, finish),
        )
    finally:
        plan.function = library_call
    del kept


def numpy_decode_tensors():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((BATCH, SEQUENCE, Q_HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((BATCH, SEQUENCE, K_HEADS, HEAD_DIM)).astype(np.float32)
    cos = rng.standard_normal((SEQUENCE, HEAD_DIM)).astype(np.float32)
    sin = rng.standard_normal((SEQUENCE, HEAD_DIM)).astype(np.float32)
    return q, k, cos, sin, np.empty_like(q), np.empty_like(k)


def torch_decode_tensors(torch, device, dtype):
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    q = randn(BATCH, SEQUENCE, Q_HEADS, HEAD_DIM)
    k = randn(BATCH, SEQUENCE, K_HEADS, HEAD_DIM)
    cos, sin = randn(SEQUENCE, HEAD_DIM), randn(SEQUENCE, HEAD_DIM)
    return q, k, cos, sin, torch.empty_like(q), torch.empty_like(k)


def bare_c_call(tensors, runtime):
    """rope_jit_rope on arguments filled once: the floor under rope(), which is this plus the
    binding's per-call work (with a GPU, the launch is in both)."""
    q, k, cos, sin, q_out, k_out = tensors
    runtime = runtime if runtime is not None else default_runtime()
    library = runtime.library
    stream = resolve_stream(None, tensors)
    args = library.new_struct(_structs.RopeArgs, library.rope_jit_rope_args_init)
    held = []
    for name, value in (
        ("q", q),
        ("k", k),
        ("q_out", q_out),
        ("k_out", k_out),
        ("cos", cos),
        ("sin", sin),
    ):
        tensor = as_tensor(
            value, name, swap_dims=(1, 2) if name in ("q", "k", "q_out", "k_out") else None
        )
        held.append(tensor)
        setattr(args, name, tensor.pointer)
    args.stream = stream or None
    function, handle, args_pointer = library.rope_jit_rope, runtime.handle, ctypes.byref(args)

    def call():
        function(handle, args_pointer)  # the status is checked once, below

    library.check("rope_jit_rope", function(handle, args_pointer))
    call.held = held  # the DLTensors outlive every call
    return call


def time_tensors(title, tensors, runtime, calls, repeats, finish=None, extra=()):
    q, k, cos, sin, q_out, k_out = tensors

    def call():
        return rope_jit.rope(
            q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd", runtime=runtime
        )

    for _ in range(20):  # compiles (GPU) or loads the kernel, and warms every cache
        call()
    if finish is not None:
        finish()
    print(title)
    report("rope() decode, 6 tensors, bshd", best_us_per_call(call, calls, repeats, finish))
    if type(q).__module__.startswith("torch"):
        report_split(call, runtime, calls, repeats, finish)
    report(
        "rope_jit_rope alone, arguments filled once",
        best_us_per_call(bare_c_call(tensors, runtime), calls, repeats, finish),
    )
    report(
        "as_tensor(q, swap_dims=(1, 2))",
        best_us_per_call(lambda: as_tensor(q, "q", swap_dims=(1, 2)), calls, repeats),
    )
    report("as_tensor(cos)", best_us_per_call(lambda: as_tensor(cos, "cos"), calls, repeats))
    report(
        "resolve_stream(None, tensors)",
        best_us_per_call(lambda: resolve_stream(None, tensors), calls, repeats),
    )
    for label, function in extra:
        report(label, best_us_per_call(function, calls, repeats))


def time_torch_paths(title, torch, device, dtype, runtime_note, calls, repeats, finish=None):
    """apply_rope (forward; forward+backward), the HF drop-in and a bare autograd step for
    scale, at decode (B=64, S=1, 32/8 heads, D128, per-sequence positions: seqlen_offsets)."""
    import rope_jit.torch_ops  # noqa: F401  (torch ops registered; apply_rope)
    from rope_jit.dropin.hf import apply_rotary_pos_emb

    generator = torch.Generator(device=device).manual_seed(0)
    # On the CPU reference the rotation itself takes time at B=64: B=1 there shows the host cost.
    batch = 64 if device == "cuda" else 1

    def randn(*shape, requires_grad=False):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator).requires_grad_(
            requires_grad
        )

    q, k = randn(batch, 1, Q_HEADS, HEAD_DIM), randn(batch, 1, K_HEADS, HEAD_DIM)
    cos, sin = randn(4096, HEAD_DIM), randn(4096, HEAD_DIM)
    offsets = torch.arange(batch, device=device, dtype=torch.int64) * 7
    q_grad, k_grad = randn(batch, 1, Q_HEADS, HEAD_DIM, requires_grad=True), randn(
        batch, 1, K_HEADS, HEAD_DIM, requires_grad=True
    )
    hf_q, hf_k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, 1, D] views, as the models pass them
    hf_cos, hf_sin = randn(batch, 1, HEAD_DIM), randn(batch, 1, HEAD_DIM)
    # The GPU's decode shape takes the drop-in's per-sequence branch (cos [B, 1, D], B > 1: the
    # [B*S, D] rows and sequence starts); B=1 on the CPU takes the shared one. B=2 shows the
    # per-sequence branch's host cost there.
    seq_q, seq_k = randn(2, 1, Q_HEADS, HEAD_DIM).transpose(1, 2), randn(
        2, 1, K_HEADS, HEAD_DIM
    ).transpose(1, 2)
    seq_cos, seq_sin = randn(2, 1, HEAD_DIM), randn(2, 1, HEAD_DIM)
    grad_out = (torch.ones_like(q_grad), torch.ones_like(k_grad))

    def forward():
        return rope_jit.apply_rope(q, k, cos, sin, seqlen_offsets=offsets, layout="bshd")

    def forward_backward():
        q_out, k_out = rope_jit.apply_rope(
            q_grad, k_grad, cos, sin, seqlen_offsets=offsets, layout="bshd"
        )
        torch.autograd.backward((q_out, k_out), (q_out, k_out))

    def plain_autograd_step():  # the floor of any fwd+bwd: two multiplications and their backward
        q_out, k_out = q_grad * 1.0, k_grad * 1.0
        torch.autograd.backward((q_out, k_out), (q_out, k_out))

    def forward_grad():  # as bench/compare_torch_autograd.py's fwd_bwd: no .grad accumulation
        outs = rope_jit.apply_rope(q_grad, k_grad, cos, sin, seqlen_offsets=offsets, layout="bshd")
        torch.autograd.grad(outs, (q_grad, k_grad), grad_out)

    def plain_grad():
        outs = (q_grad * 1.0, k_grad * 1.0)
        torch.autograd.grad(outs, (q_grad, k_grad), grad_out)

    def hf_dropin():
        return apply_rotary_pos_emb(hf_q, hf_k, hf_cos, hf_sin)

    def hf_dropin_per_sequence():
        return apply_rotary_pos_emb(seq_q, seq_k, seq_cos, seq_sin)

    def hf_dropin_no_grad():  # as generate() calls it (no autograd checks on q and k)
        with torch.no_grad():
            return apply_rotary_pos_emb(hf_q, hf_k, hf_cos, hf_sin)

    def empty_like_q_k():  # the two outputs apply_rope and the drop-in allocated per call
        return torch.empty_like(hf_q), torch.empty_like(hf_k)

    from rope_jit import _plans

    # What the plans make the outputs with, where torch (and this version of the package) has it.
    allocate = getattr(_plans, "_ALLOCATORS", {}).get(device)
    q_layout = (tuple(hf_q.shape), hf_q.stride(), hf_q.dtype)
    k_layout = (tuple(hf_k.shape), hf_k.stride(), hf_k.dtype)

    def allocate_q_k():
        return allocate(*q_layout), allocate(*k_layout)

    rows = [
        (f"apply_rope fwd, decode B={batch} bshd seqlen_offsets", forward),
        ("apply_rope fwd+bwd (backward())", forward_backward),
        ("x * 1.0 fwd+bwd, plain PyTorch (floor)", plain_autograd_step),
        ("apply_rope fwd+bwd (autograd.grad)", forward_grad),
        ("x * 1.0 fwd+bwd (autograd.grad, floor)", plain_grad),
        (f"dropin.hf.apply_rotary_pos_emb, cos [B,1,D] B={batch}", hf_dropin),
    ]
    if batch != 2:
        rows.append(("dropin.hf.apply_rotary_pos_emb, cos [B,1,D] B=2", hf_dropin_per_sequence))
    rows.append((f"dropin.hf B={batch}, under torch.no_grad()", hf_dropin_no_grad))
    rows.append(("torch.empty_like of q and k", empty_like_q_k))
    if allocate is not None:
        rows.append(("the plans' allocator, q and k (the outputs)", allocate_q_k))
    # Rows whose one plan call is split into its library call and its Python (report_split).
    split = (forward, hf_dropin, hf_dropin_per_sequence)
    for _, function in rows:
        for _ in range(20):
            function()
    if finish is not None:
        finish()
    print(f"{title} ({runtime_note}):")
    for label, function in rows:
        report(label, best_us_per_call(function, calls, repeats, finish))
        if function in split:
            report_split(function, None, calls, repeats, finish)


def stub_plan_calls():
    """Every plan built from now on calls a no-op instead of rope_jit_rope (--python-only)."""
    from rope_jit import _plans

    build = _plans._build

    def build_stubbed(*args, **kwargs):
        built = build(*args, **kwargs)
        # (_build gives (plan, outputs); an older package's gives the plan alone.)
        plan = built[0] if type(built) is tuple else built
        if plan is not _plans._NO_PLAN:
            plan.function = lambda handle, args: 0
        return built

    _plans._build = build_stubbed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per timed run")
    parser.add_argument(
        "--repeats", type=int, default=30, help="timed runs; the best and the median are printed"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: the calling thread's CPU time (time.thread_time), which a busy machine "
        "disturbs far less than wall time; it leaves out the CPU reference's worker threads "
        "and any wait for the GPU, so use it to compare host costs (before/after), not GPU runs",
    )
    parser.add_argument(
        "--python-only",
        action="store_true",
        help="plans call a no-op instead of the library: the torch rows time the Python path",
    )
    options = parser.parse_args()
    if options.python_only:
        stub_plan_calls()
    global CLOCK
    CLOCK = time.thread_time if options.clock == "thread" else time.perf_counter

    print(f"rope_jit {rope_jit.__file__}, library {rope_jit.library_path()}")
    try:
        import torch

        torch.set_num_threads(1)  # host-cost numbers, not the CPU ops' thread pool contending
    except ImportError:
        pass
    with rope_jit.Runtime(backend="cpu") as cpu_runtime:
        time_tensors(
            "NumPy float32, CPU reference:",
            numpy_decode_tensors(),
            cpu_runtime,
            options.calls,
            options.repeats,
        )

        try:
            import torch
        except ImportError:
            print("PyTorch: not installed, skipped")
            return
        time_tensors(
            f"PyTorch {torch.__version__} float32 CPU tensors, CPU reference:",
            torch_decode_tensors(torch, "cpu", torch.float32),
            cpu_runtime,
            options.calls,
            options.repeats,
        )

    time_torch_paths(
        f"PyTorch {torch.__version__} float32 CPU tensors",
        torch,
        "cpu",
        torch.float32,
        "default runtime, CPU reference",
        options.calls,
        options.repeats,
    )
    if not torch.cuda.is_available():
        print("PyTorch CUDA: no GPU, skipped")
        return
    tensors = torch_decode_tensors(torch, "cuda", torch.bfloat16)
    q = tensors[0]
    time_tensors(
        f"PyTorch {torch.__version__} bfloat16 CUDA tensors ({torch.cuda.get_device_name()}), "
        "default runtime:",
        tensors,
        None,
        options.calls,
        options.repeats,
        finish=torch.cuda.synchronize,
        extra=[
            (
                "torch.cuda.current_stream(device).cuda_stream",
                lambda: torch.cuda.current_stream(q.device).cuda_stream,
            ),
            (  # what the torch hot path calls per call (_plans.call)
                "torch._C._cuda_getCurrentRawStream(index)",
                lambda: torch._C._cuda_getCurrentRawStream(q.device.index),
            ),
        ],
    )
    time_torch_paths(
        f"PyTorch {torch.__version__} bfloat16 CUDA tensors",
        torch,
        "cuda",
        torch.bfloat16,
        "default runtime",
        options.calls,
        options.repeats,
        finish=torch.cuda.synchronize,
    )


if __name__ == "__main__":
    main()
