#!/usr/bin/env python3
"""Fused attention with rotary (rope_jit_attention) against PyTorch SDPA fed by rope-jit's RoPE.

For each shape it times, with CUDA events on one stream:
  fused      rope_jit_attention (q/k rotated on load), and rope_jit_attention_backward
  fa2        rope_jit_rope(q, k) + SDPA with the FlashAttention-2 backend (+ their backwards)
  cudnn      rope_jit_rope(q, k) + SDPA with the cuDNN backend (+ their backwards)
and reports TFLOP/s (causal attention counts half the square: fwd 2*B*Hq*S*S*D, bwd 2.5x
that) and the ratios fused / baseline. It also checks the fused output against SDPA's.

    python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out DIR [--quick]

Writes DIR/attention_<tag>.json and DIR/attention_<tag>.png. Needs torch with CUDA and
matplotlib; the library is called through a minimal ctypes binding of its C API.
"""

import argparse
import ctypes
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# ---- the C API, minimally -------------------------------------------------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


P = ctypes.POINTER(DLTensor)


class AttentionArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", P), ("k", P), ("v", P), ("out", P), ("cos", P), ("sin", P),
                ("pos_mask", P), ("attn_mask", P), ("causal", ctypes.c_int), ("scale", ctypes.c_double),
                ("rotary_dim", ctypes.c_int32), ("style", ctypes.c_int), ("lse", P), ("stream", ctypes.c_void_p),
                ("dout", P), ("dq", P), ("dk", P), ("dv", P), ("deterministic", ctypes.c_int)]


class RopeArgsPrefix(ctypes.Structure):
    # The ABI-stable head of rope_jit_rope_args (structs only grow at their end); the rest of
    # the library's struct is kept as its init function wrote it.
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", P), ("k", P), ("q_out", P), ("k_out", P), ("cos", P),
                ("sin", P)]


class Config(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("backend", ctypes.c_int), ("cache_dir", ctypes.c_char_p),
                ("disk_cache", ctypes.c_int), ("cpu_threads", ctypes.c_int), ("debug_checks", ctypes.c_int),
                ("cache_max_bytes", ctypes.c_int64)]


DTYPES = {torch.bfloat16: (4, 16), torch.float16: (2, 16), torch.float32: (2, 32), torch.bool: (1, 8)}


class Library:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        lib = self.lib
        lib.rope_jit_last_error.restype = ctypes.c_char_p
        lib.rope_jit_status_name.restype = ctypes.c_char_p
        config = Config()
        lib.rope_jit_config_init(ctypes.byref(config))
        config.backend = 1  # CUDA
        self.runtime = ctypes.c_void_p()
        self.check("rope_jit_runtime_create", lib.rope_jit_runtime_create(ctypes.byref(config), ctypes.byref(self.runtime)))
        self.rope_buffer = ctypes.create_string_buffer(4096)
        lib.rope_jit_rope_args_init(self.rope_buffer)
        self.held = []

    def check(self, name, status):
        if status != 0:
            raise RuntimeError(f"{name}: {self.lib.rope_jit_status_name(status).decode()}: "
                               f"{self.lib.rope_jit_last_error().decode()}")

    def tensor(self, t):
        if t is None:
            return None
        shape = (ctypes.c_int64 * t.dim())(*t.shape)
        strides = (ctypes.c_int64 * t.dim())(*t.stride())
        code, bits = DTYPES[t.dtype]
        dl = DLTensor(t.data_ptr(), DLDevice(2, t.device.index or 0), t.dim(), DLDataType(code, bits, 1), shape, strides, 0)
        self.held += [shape, strides, dl]
        return ctypes.pointer(dl)

    def attention(self, q, k, v, out, cos, sin, lse, causal, dout=None, dq=None, dk=None, dv=None):
        args = AttentionArgs()
        self.lib.rope_jit_attention_args_init(ctypes.byref(args))
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("cos", cos), ("sin", sin), ("lse", lse),
                        ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
            if t is not None:
                setattr(args, name, self.tensor(t))
        args.causal = int(causal)
        args.stream = torch.cuda.current_stream().cuda_stream or None
        function = self.lib.rope_jit_attention_backward if dout is not None else self.lib.rope_jit_attention
        self.check("rope_jit_attention", function(self.runtime, ctypes.byref(args)))
        self.held.clear()

    def rope(self, q, k, cos, sin, backward=False):
        # In place on q and k. `backward` flips the field by offset, found once below.
        args = RopeArgsPrefix.from_buffer(self.rope_buffer)
        args.q, args.k, args.cos, args.sin = self.tensor(q), self.tensor(k), self.tensor(cos), self.tensor(sin)
        ctypes.c_int.from_buffer(self.rope_buffer, BACKWARD_OFFSET).value = int(backward)
        ctypes.c_void_p.from_buffer(self.rope_buffer, STREAM_OFFSET).value = torch.cuda.current_stream().cuda_stream or None
        self.check("rope_jit_rope", self.lib.rope_jit_rope(self.runtime, self.rope_buffer))
        self.held.clear()


# Offsets in rope_jit_rope_args (x86-64, as the header lays them out; checked with offsetof):
# after q..cu_seqlens (10 pointers), position_offset 88, q_position_offset 96, rotary_dim 104,
# rotary_offset 108, style 112, backward 116, xpos_scale 120, stream 128.
BACKWARD_OFFSET = 116
STREAM_OFFSET = 128

# ---- timing ---------------------------------------------------------------------------------


def time_ms(function, min_total_ms=100.0, warmup=3):
    for _ in range(warmup):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    function()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    repeats = max(3, min(50, int(min_total_ms / once)))
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def attention_flops(b, hq, s, d, causal):
    flops = 4.0 * b * hq * s * s * d
    return flops / 2 if causal else flops


def tables(s, r, device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2, device=device, dtype=torch.float64) / r))
    angles = torch.outer(torch.arange(s, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()  # half tables [S, R/2]


def rotate_reference(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def sdpa(q, k, v, causal, backend, group):
    with sdpa_kernel([backend]):
        if group == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        except RuntimeError:
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  is_causal=causal)


def run_variants(lib, variants, backward, shape):
    """The fused kernels at `shape` (B, S, Hq, Hk, D) under each ROPE_JIT_ATTENTION_KERNELS override."""
    b, s, hq, hk, d = shape
    device = torch.device("cuda")
    q = torch.randn(b, s, hq, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, s, hk, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = tables(s, d, device)
    out, lse = torch.empty_like(q), torch.empty(b, hq, s, device=device, dtype=torch.float32)
    dout = torch.randn_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flops = attention_flops(b, hq, s, d, True)
    rows = []
    for variant in variants:
        os.environ["ROPE_JIT_ATTENTION_KERNELS"] = variant
        lib = Library(lib.path)  # a runtime reads the override once, when it is created
        row = {"variant": variant, "B": b, "S": s, "Hq": hq, "Hk": hk, "D": d}
        try:
            row["fused_fwd_ms"] = time_ms(lambda: lib.attention(q, k, v, out, cos, sin, lse, True), 100.0)
            row["fused_fwd_tflops"] = flops / (row["fused_fwd_ms"] * 1e-3) / 1e12
            if backward:
                row["fused_bwd_ms"] = time_ms(lambda: lib.attention(q, k, v, out, cos, sin, lse, True, dout, dq, dk, dv), 100.0)
                row["fused_bwd_tflops"] = 2.5 * flops / (row["fused_bwd_ms"] * 1e-3) / 1e12
        except Exception as error:
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.environ.pop("ROPE_JIT_ATTENTION_KERNELS", None)
    return rows


def run_shape(lib, b, s, hq, hk, d, causal, dtype, backward):
    device = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype).transpose(1, 2)  # [B,H,S,D] views of bshd buffers
    k = torch.randn(b, s, hk, d, device=device, dtype=dtype).transpose(1, 2)
    v = torch.randn(b, s, hk, d, device=device, dtype=dtype).transpose(1, 2)
    cos, sin = tables(s, d, device)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device=device, dtype=torch.float32)
    dout = torch.randn_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    group = hq // hk
    row = {"B": b, "S": s, "Hq": hq, "Hk": hk, "D": d, "causal": causal, "dtype": str(dtype).replace("torch.", "")}

    # Correctness against SDPA on explicitly rotated q and k (math in float32 through rotate_reference).
    lib.attention(q, k, v, out, cos, sin, lse, causal)
    with torch.no_grad():
        reference = sdpa(rotate_reference(q, cos, sin), rotate_reference(k, cos, sin), v, causal, SDPBackend.FLASH_ATTENTION, group)
    row["max_abs_diff_vs_sdpa"] = float((out.float() - reference.float()).abs().max())
    if backward:
        lib.attention(q, k, v, out, cos, sin, lse, causal, dout, dq, dk, dv)
        qr = q.detach().clone().requires_grad_(True)
        kr = k.detach().clone().requires_grad_(True)
        vr = v.detach().clone().requires_grad_(True)
        o = sdpa(rotate_reference(qr, cos, sin), rotate_reference(kr, cos, sin), vr, causal, SDPBackend.FLASH_ATTENTION, group)
        gq, gk, gv = torch.autograd.grad(o, (qr, kr, vr), dout)
        for name, ours, theirs in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
            row[f"max_abs_diff_{name}"] = float((ours.float() - theirs.float()).abs().max())
            row[f"max_abs_{name}"] = float(theirs.float().abs().max())

    row["fused_fwd_ms"] = time_ms(lambda: lib.attention(q, k, v, out, cos, sin, lse, causal))
    if backward:
        row["fused_bwd_ms"] = time_ms(lambda: lib.attention(q, k, v, out, cos, sin, lse, causal, dout, dq, dk, dv))

    for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with torch.no_grad():
                row[f"{name}_sdpa_fwd_ms"] = time_ms(lambda: sdpa(q, k, v, causal, backend, group))
            if backward:
                qg, kg, vg = q.detach().requires_grad_(True), k.detach().requires_grad_(True), v.detach().requires_grad_(True)
                o = sdpa(qg, kg, vg, causal, backend, group)
                row[f"{name}_sdpa_bwd_ms"] = time_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True))
        except RuntimeError as error:
            row[f"{name}_error"] = str(error).splitlines()[0][:200]
    return row


def add_rope(lib, row):
    """rope-jit's RoPE of q and k at the row's shape, and the baselines' totals and ratios."""
    device = torch.device("cuda")
    b, s, hq, hk, d = row["B"], row["S"], row["Hq"], row["Hk"], row["D"]
    q = torch.randn(b, s, hq, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = tables(s, d, device)
    row["rope_ms"] = time_ms(lambda: lib.rope(q, k, cos, sin))  # in place; the values do not matter
    for name in ("fa2", "cudnn"):
        if f"{name}_sdpa_fwd_ms" in row:
            row[f"{name}_fwd_ms"] = row["rope_ms"] + row[f"{name}_sdpa_fwd_ms"]
        if f"{name}_sdpa_bwd_ms" in row:
            # The RoPE backward (the inverse rotation of dq and dk) costs what the forward does.
            row[f"{name}_bwd_ms"] = row["rope_ms"] + row[f"{name}_sdpa_bwd_ms"]


def add_rates(row):
    fwd_flops = attention_flops(row["B"], row["Hq"], row["S"], row["D"], row.get("causal", True))
    for key in list(row):
        if key.endswith("_ms") and not key.startswith("rope"):
            flops = fwd_flops * (2.5 if "bwd" in key else 1.0)
            row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
    for base in ("fa2", "cudnn"):
        for direction in ("fwd", "bwd"):
            if f"{base}_{direction}_ms" in row and f"fused_{direction}_ms" in row:
                row[f"speedup_vs_rope_{base}_{direction}"] = row[f"{base}_{direction}_ms"] / row[f"fused_{direction}_ms"]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dims = sorted({r["D"] for r in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(5 * len(dims), 8), squeeze=False)
    for col, d in enumerate(dims):
        sel = sorted((r for r in rows if r["D"] == d), key=lambda r: r["S"])
        for row_index, direction in enumerate(("fwd", "bwd")):
            ax = axes[row_index][col]
            for key, label in (("fused", "rope-jit fused"), ("fa2", "rope-jit RoPE + SDPA FA2"),
                               ("cudnn", "rope-jit RoPE + SDPA cuDNN")):
                points = [(r["S"], r[f"{key}_{direction}_tflops"]) for r in sel if f"{key}_{direction}_tflops" in r]
                if not points and key != "fused":  # no RoPE timing: plot SDPA alone, and say so
                    points = [(r["S"], r[f"{key}_sdpa_{direction}_tflops"]) for r in sel
                              if f"{key}_sdpa_{direction}_tflops" in r]
                    label = label.replace("rope-jit RoPE + ", "") + " (no RoPE)"
                if points:
                    ax.plot(*zip(*points), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction}, D={d}, causal bf16")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
            else:  # --backward some times the backward at the headline shape only
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--quick", action="store_true", help="the headline shape and two sweep points per D")
    parser.add_argument("--headline", action="store_true", help="the headline shape only")
    parser.add_argument("--backward", choices=("all", "some", "none"), default="some",
                        help="where to time the backward: every shape, the headline shape only, none")
    parser.add_argument("--variants", default="",
                        help="';'-separated ROPE_JIT_ATTENTION_KERNELS values to time at --variant-shapes")
    parser.add_argument("--variant-shapes", default="4,4096,32,8,128",
                        help="';'-separated B,S,Hq,Hk,D shapes to time the variants at (default: the headline shape)")
    parser.add_argument("--skip-shapes", action="store_true", help="only the variants")
    parser.add_argument("--adopt-best", action="store_true",
                        help="run the shapes with the fastest fwd= and dq=/dkdv= variants (recorded in the report)")
    parser.add_argument("--profile-once", action="store_true",
                        help="one fused forward and backward at the headline shape (for ncu), then exit")
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)
    lib = Library(options.library)
    if options.profile_once:
        b, s, hq, hk, d = 4, 4096, 32, 8, 128
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        cos, sin = tables(s, d, q.device)
        out, lse = torch.empty_like(q), torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
        dout, dq, dk, dv = torch.randn_like(q), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lib.attention(q, k, v, out, cos, sin, lse, True)
        lib.attention(q, k, v, out, cos, sin, lse, True, dout, dq, dk, dv)
        torch.cuda.synchronize()
        return

    shapes = [(4, 4096, 32, 8, 128)]
    lengths = [1024, 4096] if options.quick else [1024, 2048, 4096, 8192, 16384]
    for d, hq, hk in () if options.headline else ((64, 32, 8), (128, 32, 8), (256, 16, 4)):
        for s in lengths:
            shape = (max(1, 16384 // s), s, hq, hk, d)
            if shape not in shapes:
                shapes.append(shape)
    variant_shapes = [tuple(int(x) for x in shape.split(",")) for shape in options.variant_shapes.split(";")]
    variants = []
    for shape in variant_shapes if options.variants else []:
        variants += run_variants(lib, options.variants.split(";"), options.backward != "none", shape)
    adopted = ""
    if options.adopt_best and variants:
        def best(prefix, key):  # at the first variant shape
            timed = [v for v in variants if v["variant"].startswith(prefix) and key in v and
                     (v["B"], v["S"], v["Hq"], v["Hk"], v["D"]) == variant_shapes[0]]
            return min(timed, key=lambda v: v[key])["variant"] if timed else None
        choice = [c for c in (best("fwd=", "fused_fwd_ms"), best("dq=", "fused_bwd_ms")) if c]
        adopted = ",".join(choice)
        os.environ["ROPE_JIT_ATTENTION_KERNELS"] = adopted
        lib = Library(options.library)  # a runtime reads the override once, when it is created
        print("adopted kernels:", adopted, flush=True)
    rows = []

    def write_report():
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "python": platform.python_version(),
                  "note": "TFLOP/s count causal attention as half the square; bwd = 2.5 x fwd FLOPs. fa2/cudnn "
                          "include rope-jit's RoPE (forward: rotate q and k; backward: rotate dq and dk back), "
                          "timed separately after the attention timings.",
                  "kernels": adopted or "library defaults", "rows": rows, "variants": variants}
        with open(os.path.join(options.out, f"attention_{options.tag}.json"), "w") as f:
            json.dump(report, f, indent=1)

    write_report()  # the variants alone, should no shape follow
    for b, s, hq, hk, d in [] if options.skip_shapes else shapes:
        started = time.time()
        backward = options.backward == "all" or (options.backward == "some" and (b, s, hq, hk, d) == shapes[0])
        try:
            row = run_shape(lib, b, s, hq, hk, d, True, torch.bfloat16, backward)
        except Exception as error:  # report and go on with the next shape
            row = {"B": b, "S": s, "Hq": hq, "Hk": hk, "D": d, "error": repr(error)[:300]}
        row["seconds"] = round(time.time() - started, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_report()
    # RoPE last: a failure there cannot take the attention timings with it.
    for row in rows:
        if "error" in row:
            continue
        try:
            add_rope(lib, row)
        except Exception as error:
            row["rope_error"] = repr(error)[:300]
        add_rates(row)
        print(json.dumps({k: v for k, v in row.items() if "speedup" in k or k in ("S", "D", "rope_ms")}), flush=True)
        write_report()
    try:
        if rows:
            plot([r for r in rows if "error" not in r], os.path.join(options.out, f"attention_{options.tag}.png"))
    except Exception as error:
        print("plot failed:", error, file=sys.stderr)


if __name__ == "__main__":
    main()
