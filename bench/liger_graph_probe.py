"""In-place RoPE, rope-jit against Liger's Triton kernel, in CUDA graphs of 20 calls on the same
tensors (one process), with three controls: the same graph replayed again, graphs alternating
two tensor sets (no L2 contents carried from one call to the next), and a 96 MB fill between
calls (its own time subtracted). Prints microseconds per call and GB/s of q and k read and
written. Session 14's probe of why run AX put Liger ahead
(bench/results/h200_liger_graph_probe.log).

    pip install --no-deps --target /tmp/lgpkg liger_kernel-0.8.5-py3-none-any.whl
    ROPE_JIT_LIBRARY=build-gpu/librope_jit.so PYTHONPATH=python \
        python3 bench/liger_graph_probe.py [--liger-path /tmp/lgpkg]
"""
import argparse
import sys

import torch

SHAPES = [(8, 2048, 16, 16, 64), (4, 4096, 32, 8, 128)]  # B, S, Hq, Hk, D (issue 24's D64, Llama)


def inputs(B, S, Hq, Hk, D):
    """q, k [B, S, H, D] bf16 and HF's full cos/sin tables [S, D]."""
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    angles = torch.outer(torch.arange(S, device="cuda", dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), -1)
    return q, k, emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def graph_us(fns, calls=20, trials=5, replays=10):
    """Median microseconds per call of a CUDA graph of `calls` calls cycling through fns."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    times = []
    for _ in range(trials):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / (replays * calls))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--liger-path", default="/tmp/lgpkg",
                        help="where liger_kernel is installed, if not on the path")
    options = parser.parse_args()
    sys.path.insert(0, options.liger_path)
    import rope_jit
    from liger_kernel.ops.rope import rope_forward

    for shape in SHAPES:
        D = shape[-1]
        q1, k1, cos, sin = inputs(*shape)
        q2, k2, _, _ = inputs(*shape)
        scratch = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")

        def ours(q, k):
            return lambda: rope_jit.rope(q, k, cos=cos, sin=sin, layout="bshd", rotary_dim=D)

        def liger(q, k):
            return lambda: rope_forward(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

        def fill():
            scratch.fill_(1)

        nbytes = 2 * (q1.numel() + k1.numel()) * q1.element_size()
        results = {"fill alone": graph_us([fill])}
        for name, make in (("rope_jit", ours), ("liger", liger)):
            results[name + " same"] = graph_us([make(q1, k1)])
            results[name + " alternate"] = graph_us([make(q1, k1), make(q2, k2)])
            results[name + " + fill"] = 2 * graph_us([make(q1, k1), fill]) - results["fill alone"]
            results[name + " same again"] = graph_us([make(q1, k1)])
        print(f"{shape}: {nbytes / 1e6:.1f} MB")
        for name, us in results.items():
            print(f"  {name:24s} {us:8.2f} us  {nbytes / us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
