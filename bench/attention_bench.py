#!/usr/bin/env python3
"""Fused attention with rotary (rope_jit_attention) against PyTorch SDPA fed by rope-jit's RoPE.

Three contenders per shape, all causal bf16 with float32 half tables, on the same tensors in
one process:
  fused   rope_jit_attention (q/k rotated on load), then rope_jit_attention_backward
  fa2     rope_jit_rope(q, k) + SDPA with the FLASH_ATTENTION backend; backward through
          autograd: SDPA's backward, then rope_jit_rope(backward=1) on dq and dk
  cudnn   the same with the CUDNN_ATTENTION backend
GQA goes through SDPA's enable_gqa=True (K/V repeat_interleave only where a backend refuses
it; the row says which in <contender>_gqa).

Timing is GPU time from CUDA-graph replay (the house rule: ratios measured in one process on
the same tensors): each sequence (forward; forward+backward) is warmed up, captured once and
replayed N times between CUDA events. Backward = (forward+backward) - forward for every
contender, so the three are measured the same way. A sequence whose capture fails is timed
back-to-back with events instead; the row says so ("timing", "timing_of", "graph_errors").
TFLOP/s count causal attention as half the square (fwd 2*B*Hq*S*S*D), backward 2.5x the
forward; "speedup_vs_rope_<base>_<phase>" = baseline ms / fused ms (> 1: fused is faster).
Every shape also checks the fused output and gradients against SDPA on explicitly rotated
q and k ("checked_ok").

Issue 19's run (on the GPU machine, from the repository root):

    python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out $OUT \
        --issue-shapes --tag h200_issue19

Other uses: --headline (the first issue shape only), the default sweep (D 64/128/256, S 1k-16k;
--quick for fewer lengths), --variants / --adopt-best (kernel overrides), --profile-once (ncu).
Writes OUT/attention_<tag>.json (rewritten after every shape, so a crash keeps the shapes
done) and OUT/attention_<tag>.png. Needs torch with CUDA and matplotlib; the library is called
through a minimal ctypes mirror of include/rope_jit/rope_jit.h.
"""

import argparse
import ctypes
import json
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
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


P = ctypes.POINTER(DLTensor)


# Mirrors of the header's structs, field for field (keep in sync with rope_jit.h; the size
# check in init_struct catches a mirror that drifted).
class AttentionArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", P), ("k", P), ("v", P), ("out", P),
                ("cos", P), ("sin", P), ("pos_mask", P), ("attn_mask", P),
                ("causal", ctypes.c_int), ("scale", ctypes.c_double),
                ("rotary_dim", ctypes.c_int32), ("style", ctypes.c_int), ("lse", P),
                ("stream", ctypes.c_void_p), ("dout", P), ("dq", P), ("dk", P), ("dv", P),
                ("deterministic", ctypes.c_int), ("workspace", ctypes.c_void_p),
                ("workspace_bytes", ctypes.c_size_t)]


class Config(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("backend", ctypes.c_int),
                ("cache_dir", ctypes.c_char_p), ("disk_cache", ctypes.c_int),
                ("cpu_threads", ctypes.c_int), ("debug_checks", ctypes.c_int),
                ("cache_max_bytes", ctypes.c_int64), ("background_builds", ctypes.c_int)]


class RopeArgsPrefix(ctypes.Structure):
    # The ABI-stable head of rope_jit_rope_args (structs only grow at their end); the rest of
    # the library's struct is kept as its init function wrote it.
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", P), ("k", P), ("q_out", P),
                ("k_out", P), ("cos", P), ("sin", P)]


# Offsets in rope_jit_rope_args (x86-64, as the header lays them out): after q..cu_seqlens
# (10 pointers), position_offset 88, q_position_offset 96, rotary_dim 104, rotary_offset 108,
# style 112, backward 116, xpos_scale 120, stream 128.
BACKWARD_OFFSET = 116
STREAM_OFFSET = 128

DTYPES = {torch.bfloat16: (4, 16), torch.float16: (2, 16), torch.float32: (2, 32),
          torch.bool: (1, 8)}


def init_struct(init_function, mirror):
    """Runs the library's init on a roomy buffer (so a stale mirror cannot be overrun) and
    returns it as `mirror`, after checking that the library's struct_size matches."""
    buffer = ctypes.create_string_buffer(4096)
    init_function(buffer)
    size = ctypes.c_size_t.from_buffer(buffer).value
    if size != ctypes.sizeof(mirror):
        raise RuntimeError(f"{mirror.__name__}: the library's struct is {size} bytes, the "
                           f"ctypes mirror {ctypes.sizeof(mirror)}: sync it with rope_jit.h")
    return mirror.from_buffer_copy(buffer)


def current_stream():
    return torch.cuda.current_stream().cuda_stream or None  # 0: the legacy default stream


class Library:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        lib = self.lib
        lib.rope_jit_last_error.restype = ctypes.c_char_p
        lib.rope_jit_status_name.restype = ctypes.c_char_p
        config = init_struct(lib.rope_jit_config_init, Config)
        config.backend = 1  # CUDA
        self.runtime = ctypes.c_void_p()
        self.check("rope_jit_runtime_create",
                   lib.rope_jit_runtime_create(ctypes.byref(config), ctypes.byref(self.runtime)))
        self.attention_defaults = init_struct(lib.rope_jit_attention_args_init, AttentionArgs)
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
        dl = DLTensor(t.data_ptr(), DLDevice(2, t.device.index or 0), t.dim(),
                      DLDataType(code, bits, 1), shape, strides, 0)
        self.held += [shape, strides, dl]  # alive until the call returns
        return ctypes.pointer(dl)

    def attention(self, q, k, v, out, cos, sin, lse, causal, dout=None, dq=None, dk=None,
                  dv=None):
        """The forward, or the backward when dout is given; enqueued on the current stream."""
        args = AttentionArgs.from_buffer_copy(self.attention_defaults)
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("cos", cos), ("sin", sin),
                        ("lse", lse), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
            if t is not None:
                setattr(args, name, self.tensor(t))
        args.causal = int(causal)
        args.stream = current_stream()
        backward = dout is not None
        function = self.lib.rope_jit_attention_backward if backward else self.lib.rope_jit_attention
        name = "rope_jit_attention_backward" if backward else "rope_jit_attention"
        try:
            self.check(name, function(self.runtime, ctypes.byref(args)))
        finally:
            self.held.clear()

    def rope(self, q, k, cos, sin, backward=False, q_out=None, k_out=None):
        """Rotates q and k (in place unless q_out/k_out are given) on the current stream;
        `backward` applies the inverse rotation (the RoPE backward of gradients)."""
        args = RopeArgsPrefix.from_buffer(self.rope_buffer)
        args.q, args.k = self.tensor(q), self.tensor(k)
        args.q_out, args.k_out = self.tensor(q_out), self.tensor(k_out)  # None: NULL
        args.cos, args.sin = self.tensor(cos), self.tensor(sin)
        ctypes.c_int.from_buffer(self.rope_buffer, BACKWARD_OFFSET).value = int(backward)
        ctypes.c_void_p.from_buffer(self.rope_buffer, STREAM_OFFSET).value = current_stream()
        try:
            self.check("rope_jit_rope", self.lib.rope_jit_rope(self.runtime, self.rope_buffer))
        finally:
            self.held.clear()


class LibraryRope(torch.autograd.Function):
    """rope-jit's RoPE of q and k as an autograd op: forward rotates into new tensors, backward
    applies the library's inverse rotation (backward=1) to dq and dk, so the baselines pay for
    the RoPE backward as a training step does."""

    @staticmethod
    def forward(ctx, q, k, lib, cos, sin):
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        lib.rope(q, k, cos, sin, q_out=q_out, k_out=k_out)
        ctx.lib = lib
        ctx.save_for_backward(cos, sin)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_rotated, dk_rotated):
        cos, sin = ctx.saved_tensors
        dq, dk = torch.empty_like(dq_rotated), torch.empty_like(dk_rotated)
        ctx.lib.rope(dq_rotated, dk_rotated, cos, sin, backward=True, q_out=dq, k_out=dk)
        return dq, dk, None, None, None


# ---- what is measured -----------------------------------------------------------------------

# Issue 19's shapes (B, S, Hq, Hk, D); the first is the headline.
ISSUE_SHAPES = [(4, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (4, 4096, 16, 16, 64),
                (2, 4096, 16, 8, 256)]
HEADLINE = ISSUE_SHAPES[0]

# (key, label, SDPA backend or None for the fused op)
CONTENDERS = (("fused", "rope-jit fused", None),
              ("fa2", "rope-jit RoPE + SDPA flash", SDPBackend.FLASH_ATTENTION),
              ("cudnn", "rope-jit RoPE + SDPA cuDNN", SDPBackend.CUDNN_ATTENTION))
BASELINES = [key for key, _, backend in CONTENDERS if backend is not None]

# FLOPs of each phase as a multiple of the forward's.
PHASES = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}

# bf16 keeps 8 significant bits (rounding 2^-9, about 0.2%). The two sides round inputs and
# outputs to bf16 at different points (the reference stores the rotated q and k in bf16 before
# its attention, which moves the scores by about 2^-8), sum in different orders, and the sm_90
# backward adds dq with float32 atomics; together a few bf16 ulps of the largest value. 2e-2
# of max(1, |reference|) is about 5 ulps there: far above that rounding, far below what a real
# bug gives (a wrong mask, rotation or GQA head mapping moves values by O(|reference|)).
TOLERANCE = 2e-2


def attention_flops(b, hq, s, d, causal=True):
    flops = 4.0 * b * hq * s * s * d
    return flops / 2 if causal else flops


def tables(s, r, device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, r, 2, device=device, dtype=torch.float64) / r))
    angles = torch.outer(torch.arange(s, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()  # [S, R/2]


def rotate_reference(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def sdpa(q, k, v, backend, gqa="enable_gqa"):
    """Causal SDPA on one backend. gqa: "none" (Hq == Hk), "enable_gqa", or "repeat" (K/V
    expanded to Hq heads, for a backend that refuses enable_gqa)."""
    with sdpa_kernel([backend]):
        if gqa == "none":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if gqa == "enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                              v.repeat_interleave(group, 1), is_causal=True)


def gqa_mode(q, k, v, backend):
    """How `backend` takes these heads; decided eagerly, so no failing call is ever captured."""
    if q.shape[1] == k.shape[1]:
        return "none"
    try:
        with torch.no_grad():
            sdpa(q, k, v, backend, "enable_gqa")
        torch.cuda.synchronize()
        return "enable_gqa"
    except RuntimeError:
        return "repeat"


def one_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


class Tensors:
    """One shape's inputs and outputs, shared by every contender. q/k/v are [B,H,S,D] views
    of [B,S,H,D] buffers, as models hold them."""

    def __init__(self, shape, device=torch.device("cuda"), dtype=torch.bfloat16):
        b, s, hq, hk, d = shape
        torch.manual_seed(0)
        self.q = torch.randn(b, s, hq, d, device=device, dtype=dtype).transpose(1, 2)
        self.k = torch.randn(b, s, hk, d, device=device, dtype=dtype).transpose(1, 2)
        self.v = torch.randn(b, s, hk, d, device=device, dtype=dtype).transpose(1, 2)
        self.cos, self.sin = tables(s, d, device)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(b, hq, s, device=device, dtype=torch.float32)
        self.dout = torch.randn_like(self.q)
        self.dq, self.dk, self.dv = (torch.empty_like(self.q), torch.empty_like(self.k),
                                     torch.empty_like(self.v))
        # Leaves for the baselines' autograd (same storage as q, k, v).
        self.qg, self.kg, self.vg = (x.detach().requires_grad_(True)
                                     for x in (self.q, self.k, self.v))


# ---- timing ---------------------------------------------------------------------------------


def time_ms(function, min_total_ms=100.0, warmup=3):
    """Back-to-back calls between CUDA events (includes host launch gaps): the fallback."""
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


def graph_ms(function, min_total_ms=200.0, warmup=3):
    """GPU time of one call of `function`: captured in a CUDA graph, replayed between events."""
    previous = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    try:
        # Warm up on the capture stream (kernels compiled and cached, cuDNN plans built,
        # autograd's streams set), as torch's whole-network capture recipe does.
        side.wait_stream(previous)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                function()
        previous.wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the library's background compile threads may make CUDA calls that a
        # global-mode capture would count against this one.
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            function()
        graph.replay()  # the first replay uploads the graph
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        once = max(start.elapsed_time(end), 1e-3)
        repeats = max(3, min(500, int(min_total_ms / once)))
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats
    finally:
        # A capture that raised may leave the capture stream current (torch.cuda.graph's exit
        # raises before restoring it).
        torch.cuda.set_stream(previous)


def measure(row, key, function):
    """row[key_ms] by graph replay, else by events; a failure of both goes to row[key_error].
    Never raises, so one contender's failure leaves the others' numbers."""
    try:
        row[f"{key}_ms"] = graph_ms(function)
        row.setdefault("timing_of", {})[key] = "graph"
        return
    except Exception as error:
        row.setdefault("graph_errors", {})[key] = one_line(error)
    try:
        torch.cuda.synchronize()
        row[f"{key}_ms"] = time_ms(function)
        row.setdefault("timing_of", {})[key] = "events"
    except Exception as error:
        row[f"{key}_error"] = one_line(error)


def fused_sequences(lib, t):
    def forward():
        lib.attention(t.q, t.k, t.v, t.out, t.cos, t.sin, t.lse, True)

    def forward_backward():
        forward()
        lib.attention(t.q, t.k, t.v, t.out, t.cos, t.sin, t.lse, True, t.dout, t.dq, t.dk, t.dv)
    return forward, forward_backward


def baseline_sequences(lib, t, backend, gqa):
    def forward():
        with torch.no_grad():
            q, k = LibraryRope.apply(t.q, t.k, lib, t.cos, t.sin)
            return sdpa(q, k, t.v, backend, gqa)

    def forward_backward():
        q, k = LibraryRope.apply(t.qg, t.kg, lib, t.cos, t.sin)
        out = sdpa(q, k, t.vg, backend, gqa)
        return torch.autograd.grad(out, (t.qg, t.kg, t.vg), t.dout)
    return forward, forward_backward


def time_contender(row, name, forward, forward_backward, backward):
    """<name>_fwd_ms, <name>_fwdbwd_ms and their difference <name>_bwd_ms."""
    measure(row, f"{name}_fwd", forward)
    if not backward:
        return
    measure(row, f"{name}_fwdbwd", forward_backward)
    if f"{name}_fwd_ms" in row and f"{name}_fwdbwd_ms" in row:
        row[f"{name}_bwd_ms"] = row[f"{name}_fwdbwd_ms"] - row[f"{name}_fwd_ms"]


def time_rope(lib, row, t, backward):
    """rope-jit's RoPE alone (part of both baselines), for the record."""
    q_out, k_out = torch.empty_like(t.q), torch.empty_like(t.k)
    measure(row, "rope_fwd", lambda: lib.rope(t.q, t.k, t.cos, t.sin, q_out=q_out, k_out=k_out))
    if backward:
        measure(row, "rope_bwd", lambda: lib.rope(t.q, t.k, t.cos, t.sin, backward=True,
                                                  q_out=q_out, k_out=k_out))


def summarize_timing(row):
    ways = set(row.get("timing_of", {}).values())
    row["timing"] = ways.pop() if len(ways) == 1 else ("mixed" if ways else "none")


def add_rates(row):
    """TFLOP/s of every timed phase, and the ratios baseline / fused."""
    forward_flops = attention_flops(row["B"], row["Hq"], row["S"], row["D"], row["causal"])
    for name, _, _ in CONTENDERS:
        for phase, factor in PHASES.items():
            ms = row.get(f"{name}_{phase}_ms")
            if ms is not None and ms > 0:  # a difference of two timings may be <= 0 in noise
                row[f"{name}_{phase}_tflops"] = forward_flops * factor / (ms * 1e-3) / 1e12
    for base in BASELINES:
        for phase in PHASES:
            fused, other = row.get(f"fused_{phase}_ms"), row.get(f"{base}_{phase}_ms")
            if fused and other and fused > 0 and other > 0:
                row[f"speedup_vs_rope_{base}_{phase}"] = other / fused


# ---- correctness ----------------------------------------------------------------------------

# SDPA backends tried in turn for the reference (flash may lack D=256 or its backward).
REFERENCE_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH)


def reference(t, backward):
    """SDPA on explicitly rotated q and k (rotation in float32), and the gradients through the
    rotation when `backward`: (backend name, out, (dq, dk, dv) or None)."""
    errors = []
    for backend in REFERENCE_BACKENDS:
        try:
            gqa = "none" if t.q.shape[1] == t.k.shape[1] else "enable_gqa"
            q, k, v = (x.detach().clone().requires_grad_(backward) for x in (t.q, t.k, t.v))
            with torch.set_grad_enabled(backward):
                out = sdpa(rotate_reference(q, t.cos, t.sin), rotate_reference(k, t.cos, t.sin),
                           v, backend, gqa)
                grads = torch.autograd.grad(out, (q, k, v), t.dout) if backward else None
            torch.cuda.synchronize()
            return backend.name, out.detach(), grads
        except RuntimeError as error:
            errors.append(f"{backend.name}: {one_line(error)}")
    raise RuntimeError("no SDPA backend for the reference: " + "; ".join(errors))


def check_correctness(lib, t, backward):
    """Fused output (and dq, dk, dv) against the reference: max abs diffs, the reference's max
    abs, and checked_ok (every diff within TOLERANCE * max(1, reference max abs))."""
    forward, forward_backward = fused_sequences(lib, t)
    (forward_backward if backward else forward)()
    backend, out, grads = reference(t, backward)
    result = {"reference_backend": backend}
    pairs = [("out", t.out, out)]
    if backward:
        pairs += [("dq", t.dq, grads[0]), ("dk", t.dk, grads[1]), ("dv", t.dv, grads[2])]
    ok = True
    for name, ours, theirs in pairs:
        diff = float((ours.float() - theirs.float()).abs().max())
        scale = float(theirs.float().abs().max())
        result[f"max_abs_diff_{name}"], result[f"max_abs_{name}"] = diff, scale
        ok = ok and diff <= TOLERANCE * max(1.0, scale)  # NaN compares False: not ok
    result["checked_ok"] = ok
    return result


# ---- one shape ------------------------------------------------------------------------------


def run_shape(lib, shape, backward):
    """Checks and times the three contenders at `shape`; errors are recorded per contender
    (and phase), never raised."""
    b, s, hq, hk, d = shape
    row = {"B": b, "S": s, "Hq": hq, "Hk": hk, "D": d, "causal": True, "dtype": "bfloat16",
           "backward": backward}
    t = Tensors(shape)
    try:
        row.update(check_correctness(lib, t, backward))
    except Exception as error:
        row["checked_ok"] = False
        row["correctness_error"] = one_line(error)
    time_contender(row, "fused", *fused_sequences(lib, t), backward)
    time_rope(lib, row, t, backward)
    for name, _, backend in CONTENDERS:
        if backend is None:
            continue
        row[f"{name}_gqa"] = gqa_mode(t.q, t.k, t.v, backend)
        time_contender(row, name, *baseline_sequences(lib, t, backend, row[f"{name}_gqa"]),
                       backward)
    summarize_timing(row)
    add_rates(row)
    return row


def run_variants(lib, variants, backward, shape):
    """The fused kernels at `shape` under each ROPE_JIT_ATTENTION_KERNELS override."""
    t = Tensors(shape)
    rows = []
    for variant in variants:
        os.environ["ROPE_JIT_ATTENTION_KERNELS"] = variant
        b, s, hq, hk, d = shape
        row = {"variant": variant, "B": b, "S": s, "Hq": hq, "Hk": hk, "D": d, "causal": True}
        try:
            lib = Library(lib.path)  # a runtime reads the override once, when it is created
            time_contender(row, "fused", *fused_sequences(lib, t), backward)
            summarize_timing(row)
            add_rates(row)
        except Exception as error:
            row["error"] = one_line(error)
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.environ.pop("ROPE_JIT_ATTENTION_KERNELS", None)
    return rows


# ---- report ---------------------------------------------------------------------------------


def shape_label(row):
    return f"{row['B']}x{row['S']}\n{row['Hq']}/{row['Hk']} D{row['D']}"


def plot(rows, path):
    """Grouped bars per shape, one panel per phase: TFLOP/s of the three contenders, each bar
    labelled with its ms (and the fused bars with the ratio to RoPE + cuDNN)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    titles = {"fwd": "forward", "bwd": "backward ((fwd+bwd) - fwd)", "fwdbwd": "forward+backward"}
    width = 0.27
    fig, axes = plt.subplots(len(PHASES), 1, figsize=(max(8.0, 1.7 * len(rows) + 2), 11),
                             squeeze=False)
    for ax, phase in zip((a[0] for a in axes), PHASES):
        drawn = False
        for i, (name, label, _) in enumerate(CONTENDERS):
            xs, heights, notes = [], [], []
            for x, row in enumerate(rows):
                if f"{name}_{phase}_tflops" in row:
                    xs.append(x + (i - 1) * width)
                    heights.append(row[f"{name}_{phase}_tflops"])
                    note = f"{row[f'{name}_{phase}_ms']:.2f}ms"
                    ratio = row.get(f"speedup_vs_rope_cudnn_{phase}")
                    if name == "fused" and ratio:
                        note += f"\n{ratio:.2f}x"
                    notes.append(note)
                elif row.get("backward") or phase == "fwd":  # timed, but failed: say so
                    ax.text(x + (i - 1) * width, 0, "failed", rotation=90, ha="center",
                            va="bottom", fontsize=7)
            if xs:
                bars = ax.bar(xs, heights, width, label=label)
                ax.bar_label(bars, labels=notes, fontsize=6)
                drawn = True
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the labels and the legend
        ax.set_xticks(range(len(rows)), [shape_label(r) for r in rows], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{titles[phase]}, causal bf16 (fused bars: x = vs RoPE + cuDNN)",
                     fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, ncol=3, loc="upper center")
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sweep_shapes(quick):
    shapes = [HEADLINE]
    lengths = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
    for d, hq, hk in ((64, 32, 8), (128, 32, 8), (256, 16, 4)):
        for s in lengths:
            shape = (max(1, 16384 // s), s, hq, hk, d)
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def profile_once(lib):
    """One fused forward and backward at the headline shape, for ncu."""
    _, forward_backward = fused_sequences(lib, Tensors(HEADLINE))
    forward_backward()
    torch.cuda.synchronize()


def adopt_best(variants, variant_shapes):
    """The fastest fwd= and dq= variants at the first variant shape, as one override."""
    def best(prefix, key):
        timed = [v for v in variants if v["variant"].startswith(prefix) and key in v and
                 (v["B"], v["S"], v["Hq"], v["Hk"], v["D"]) == variant_shapes[0]]
        return min(timed, key=lambda v: v[key])["variant"] if timed else None
    choice = [c for c in (best("fwd=", "fused_fwd_ms"), best("dq=", "fused_bwd_ms")) if c]
    return ",".join(choice)


def parse_options():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--issue-shapes", action="store_true",
                        help="issue 19's four shapes (backward everywhere unless --backward)")
    parser.add_argument("--quick", action="store_true",
                        help="the headline shape and two sweep points per D")
    parser.add_argument("--headline", action="store_true", help="the headline shape only")
    parser.add_argument("--backward", choices=("all", "some", "none"), default=None,
                        help="where to time the backward: every shape, the headline shape "
                             "only, none (default: all with --issue-shapes, else some)")
    parser.add_argument("--variants", default="",
                        help="';'-separated ROPE_JIT_ATTENTION_KERNELS values to time at "
                             "--variant-shapes")
    parser.add_argument("--variant-shapes", default="4,4096,32,8,128",
                        help="';'-separated B,S,Hq,Hk,D shapes to time the variants at "
                             "(default: the headline shape)")
    parser.add_argument("--skip-shapes", action="store_true", help="only the variants")
    parser.add_argument("--adopt-best", action="store_true",
                        help="run the shapes with the fastest fwd= and dq=/dkdv= variants "
                             "(recorded in the report)")
    parser.add_argument("--profile-once", action="store_true",
                        help="one fused forward and backward at the headline shape (for ncu), "
                             "then exit")
    options = parser.parse_args()
    if options.backward is None:
        options.backward = "all" if options.issue_shapes else "some"
    return options


def main():
    options = parse_options()
    os.makedirs(options.out, exist_ok=True)
    lib = Library(options.library)
    if options.profile_once:
        profile_once(lib)
        return

    if options.headline:
        shapes = [HEADLINE]
    elif options.issue_shapes:
        shapes = list(ISSUE_SHAPES)
    else:
        shapes = sweep_shapes(options.quick)
    variant_shapes = [tuple(int(x) for x in shape.split(","))
                      for shape in options.variant_shapes.split(";")]
    variants = []
    for shape in variant_shapes if options.variants else []:
        variants += run_variants(lib, options.variants.split(";"), options.backward != "none",
                                 shape)
    adopted = adopt_best(variants, variant_shapes) if options.adopt_best else ""
    if adopted:
        os.environ["ROPE_JIT_ATTENTION_KERNELS"] = adopted
        lib = Library(options.library)  # a runtime reads the override once, when it is created
        print("adopted kernels:", adopted, flush=True)
    rows = []

    def write_report():
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
                  "library": os.path.abspath(options.library),
                  "note": "GPU time per call from CUDA-graph replay (timing_of says 'events' where "
                          "capture failed: back-to-back calls between events). TFLOP/s count "
                          "causal attention as half the square; bwd = 2.5 x fwd FLOPs, fwdbwd "
                          "3.5 x. bwd_ms = fwdbwd_ms - fwd_ms for every contender. fa2/cudnn "
                          "include rope-jit's RoPE (forward: rotate q and k into new tensors; "
                          "backward: rotate dq and dk back, through autograd). speedup = "
                          "baseline ms / fused ms.",
                  "tolerance": f"max_abs_diff <= {TOLERANCE} * max(1, max_abs of the reference)",
                  "kernels": adopted or os.environ.get("ROPE_JIT_ATTENTION_KERNELS")
                  or "library defaults", "rows": rows, "variants": variants}
        with open(os.path.join(options.out, f"attention_{options.tag}.json"), "w") as f:
            json.dump(report, f, indent=1)

    write_report()  # the variants alone, should no shape follow
    for shape in [] if options.skip_shapes else shapes:
        started = time.time()
        backward = options.backward == "all" or (options.backward == "some" and shape == HEADLINE)
        try:
            row = run_shape(lib, shape, backward)
        except Exception as error:  # report and go on with the next shape
            b, s, hq, hk, d = shape
            row = {"B": b, "S": s, "Hq": hq, "Hk": hk, "D": d, "error": one_line(error)}
        row["seconds"] = round(time.time() - started, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_report()
        try:
            torch.cuda.empty_cache()  # graphs' pools and this shape's tensors, before the next
        except Exception as error:  # a broken context: the next shapes will say so
            print("empty_cache failed:", one_line(error), file=sys.stderr)
    try:
        if rows:
            plot([r for r in rows if "error" not in r],
                 os.path.join(options.out, f"attention_{options.tag}.png"))
    except Exception as error:
        print("plot failed:", error, file=sys.stderr)


if __name__ == "__main__":
    main()
