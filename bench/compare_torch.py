"""RoPE through rope-jit (C API on PyTorch tensors) against PyTorch eager and torch.compile doing
the same rotation on the same tensors, in one process, on the GPU.

    ROPE_JIT_LIBRARY=build-gpu/librope_jit.so PYTHONPATH=python python3 bench/compare_torch.py \
        --json bench/results/h200_vs_torch.json

Every shape: Q and K in [B, S, H, D] (bf16), HF-style full cos/sin tables (bf16), out of
place, forward; half style over all of D, or (GPT-NeoX, GPT-J) partial rotary with the rest
of each head copied, GPT-J with interleaved pairs. Each implementation's output is checked
against eager's. Two times per implementation, both medians of CUDA-event timings:
  * calls: back-to-back Python calls, as a training loop makes them (host overhead included:
    a call whose host side is slower than its kernel leaves the GPU waiting);
  * graph: the GPU time of one call, from replays of a CUDA graph of ten calls (no host work).
Bytes are q and k read and written plus the table rows read; the fraction is of a
device-to-device copy timed in the same process. bench/plot_results.py draws the PNG.
"""

import argparse
import json
import statistics

import torch

import rope_jit

SHAPES = [  # (B, S, Hq, Hk, D, R, style): DESIGN.md's table, other head_dims, partial rotary, decode
    (4, 4096, 32, 8, 128, 128, "half"),
    (1, 32768, 32, 8, 128, 128, "half"),
    (8, 2048, 16, 16, 64, 64, "half"),
    (2, 4096, 16, 8, 256, 256, "half"),
    (4, 4096, 32, 8, 80, 80, "half"),
    (4, 4096, 32, 8, 96, 96, "half"),
    (8, 2048, 64, 64, 96, 24, "half"),          # GPT-NeoX-20B: rotary_pct 0.25
    (8, 2048, 16, 16, 256, 64, "interleaved"),  # GPT-J-6B: rotary_dim 64, rotate_every_two
    (64, 1, 32, 8, 128, 128, "half"),
]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def torch_rope(q, k, cos, sin):
    # HF transformers' apply_rotary_pos_emb on [B, S, H, D]: tables broadcast over heads.
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def torch_rope_partial(q, k, cos, sin, rotary_dim, interleaved):
    # GPT-NeoX / GPT-J in HF: rotate the first rotary_dim features, pass the rest through.
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    turn = rotate_every_two if interleaved else rotate_half

    def one(x):
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((rot * cos + turn(rot) * sin, rest), dim=-1)

    return one(q), one(k)


def time_ms(fn, repeat=20, trials=7):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / repeat)
    return statistics.median(times)


def time_graph_ms(fn, calls=10, trials=7):
    """GPU time of one call of fn: replays of a CUDA graph of `calls` calls. None when fn cannot
    be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as error:  # noqa: BLE001 (reported, not fatal: the call timing stands)
        print(f"  (no CUDA graph: {type(error).__name__}: {error})")
        return None
    return time_ms(graph.replay, repeat=5, trials=trials) / calls


def copy_gbps():
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeat=5)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    torch.manual_seed(0)
    copy = copy_gbps()
    rows = []
    print(f"{torch.cuda.get_device_name()}: device copy {copy:.0f} GB/s")
    print(f"{'B,S,Hq,Hk,D R style':<32} {'rope-jit':>9} {'compile':>9} {'eager':>9}   fraction of copy (calls) / "
          "speedup vs compile")
    for B, S, Hq, Hk, D, R, style in SHAPES:
        interleaved = style == "interleaved"
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
        position = torch.arange(S, device="cuda", dtype=torch.float32)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2, device="cuda", dtype=torch.float32) / R))
        angles = torch.outer(position, inv_freq)
        # HF's full tables: [S, R], pair i at columns (i, i + R/2), or (2i, 2i+1) interleaved.
        emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        if R == D and not interleaved:
            reference = torch_rope
        else:
            def reference(q, k, cos, sin):
                return torch_rope_partial(q, k, cos, sin, R, interleaved)
        compiled = torch.compile(reference, dynamic=False)

        def ours():
            rope_jit.rope(q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd", rotary_dim=R,
                          style=style)

        ours()
        expected_q, expected_k = reference(q, k, cos, sin)
        compiled_q, compiled_k = compiled(q, k, cos, sin)
        torch.cuda.synchronize()
        # Eager rounds q*cos and rotate_half(q)*sin to bf16 before adding; we and compile keep
        # fp32 in between: allow two bf16 roundings.
        for got, want in ((q_out, expected_q), (k_out, expected_k), (compiled_q, expected_q), (compiled_k, expected_k)):
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)

        bytes_moved = 2 * (q.numel() + k.numel()) * 2 + 2 * S * R * 2
        runs = {"rope_jit": ours, "torch_compile": lambda: compiled(q, k, cos, sin),
                "torch_eager": lambda: reference(q, k, cos, sin)}
        times = {name: time_ms(fn) for name, fn in runs.items()}
        graph_times = {name: time_graph_ms(fn) for name, fn in runs.items()}
        row = {"B": B, "S": S, "Hq": Hq, "Hk": Hk, "D": D, "rotary_dim": R, "style": style, "dtype": "bfloat16",
               "layout": "bshd", "bytes": bytes_moved, "time_ms": times, "graph_time_ms": graph_times,
               "fraction_of_copy": {name: bytes_moved / (ms * 1e-3) / 1e9 / copy for name, ms in times.items()},
               "graph_fraction_of_copy": {name: None if ms is None else bytes_moved / (ms * 1e-3) / 1e9 / copy
                                          for name, ms in graph_times.items()},
               "speedup_vs_compile": times["torch_compile"] / times["rope_jit"],
               "speedup_vs_eager": times["torch_eager"] / times["rope_jit"],
               "graph_speedup_vs_compile": (graph_times["torch_compile"] / graph_times["rope_jit"]
                                            if graph_times["torch_compile"] and graph_times["rope_jit"] else None)}
        rows.append(row)
        f, g = row["fraction_of_copy"], row["graph_fraction_of_copy"]
        graph_text = (f"graph: {g['rope_jit']:.3f} vs compile {g['torch_compile']:.3f}"
                      if g["rope_jit"] and g["torch_compile"] else "graph: -")
        print(f"{f'{B},{S},{Hq},{Hk},{D} R{R} {style[:4]}':<32} {f['rope_jit']:>9.3f} {f['torch_compile']:>9.3f} "
              f"{f['torch_eager']:>9.3f}   x{row['speedup_vs_compile']:.2f} vs compile, "
              f"x{row['speedup_vs_eager']:.1f} vs eager; {graph_text}")

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy,
              "library": rope_jit.library_version(), "shapes": rows}
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
