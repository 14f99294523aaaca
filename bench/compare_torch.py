"""RoPE through rope-jit (C API on PyTorch tensors) against PyTorch eager and torch.compile doing
the same rotation on the same tensors, in one process, on the GPU.

    ROPE_JIT_LIBRARY=build-gpu/librope_jit.so PYTHONPATH=python python3 bench/compare_torch.py \
        --json bench/results/h200_vs_torch.json

Every shape: Q and K in [B, S, H, D] (bf16), HF-style full cos/sin tables [S, D] (bf16), half
style, out of place, forward. Each implementation's output is checked against eager's. Time is
the median of CUDA-event timings; bytes are q and k read and written plus the table rows read;
the fraction is of a device-to-device copy timed in the same process. bench/plot_results.py
draws the PNG from the JSON.
"""

import argparse
import json
import statistics

import torch

import rope_jit

SHAPES = [  # (B, S, Hq, Hk, D): DESIGN.md's table, then other head_dims and decode
    (4, 4096, 32, 8, 128),
    (1, 32768, 32, 8, 128),
    (8, 2048, 16, 16, 64),
    (2, 4096, 16, 8, 256),
    (4, 4096, 32, 8, 80),
    (4, 4096, 32, 8, 96),
    (64, 1, 32, 8, 128),
]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_rope(q, k, cos, sin):
    # HF transformers' apply_rotary_pos_emb on [B, S, H, D]: tables broadcast over heads.
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


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
    compiled = torch.compile(torch_rope, dynamic=False)
    rows = []
    print(f"{torch.cuda.get_device_name()}: device copy {copy:.0f} GB/s")
    print(f"{'B,S,Hq,Hk,D':<22} {'rope-jit':>9} {'compile':>9} {'eager':>9}   fraction of copy / speedup vs compile")
    for B, S, Hq, Hk, D in SHAPES:
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
        position = torch.arange(S, device="cuda", dtype=torch.float32)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
        angles = torch.outer(position, inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)

        def ours():
            rope_jit.rope(q, k, cos=cos, sin=sin, q_out=q_out, k_out=k_out, layout="bshd")

        ours()
        expected_q, expected_k = torch_rope(q, k, cos, sin)
        compiled_q, compiled_k = compiled(q, k, cos, sin)
        torch.cuda.synchronize()
        # Eager rounds q*cos and rotate_half(q)*sin to bf16 before adding; we and compile keep
        # fp32 in between: allow two bf16 roundings.
        for got, want in ((q_out, expected_q), (k_out, expected_k), (compiled_q, expected_q), (compiled_k, expected_k)):
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)

        bytes_moved = 2 * (q.numel() + k.numel()) * 2 + 2 * S * D * 2
        times = {
            "rope_jit": time_ms(ours),
            "torch_compile": time_ms(lambda: compiled(q, k, cos, sin)),
            "torch_eager": time_ms(lambda: torch_rope(q, k, cos, sin)),
        }
        row = {"B": B, "S": S, "Hq": Hq, "Hk": Hk, "D": D, "dtype": "bfloat16", "layout": "bshd",
               "bytes": bytes_moved, "time_ms": times,
               "fraction_of_copy": {name: bytes_moved / (ms * 1e-3) / 1e9 / copy for name, ms in times.items()},
               "speedup_vs_compile": times["torch_compile"] / times["rope_jit"],
               "speedup_vs_eager": times["torch_eager"] / times["rope_jit"]}
        rows.append(row)
        f = row["fraction_of_copy"]
        print(f"{f'{B},{S},{Hq},{Hk},{D}':<22} {f['rope_jit']:>9.3f} {f['torch_compile']:>9.3f} {f['torch_eager']:>9.3f}"
              f"   x{row['speedup_vs_compile']:.2f} vs compile, x{row['speedup_vs_eager']:.1f} vs eager")

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy,
              "library": rope_jit.library_version(), "shapes": rows}
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
