"""A Llama-style attention block in PyTorch, switched to rope-jit with one line.

The block is written as HF transformers' modeling_llama writes it: q/k/v/o projections, grouped
query attention, cos/sin from a LlamaRotaryEmbedding, RoPE through the module-level function
`apply_rotary_pos_emb`, then scaled_dot_product_attention. Switching its RoPE to rope-jit is
the one import in use_rope_jit():

    from rope_jit.dropin.hf import apply_rotary_pos_emb

The script runs the block before and after the switch on the same weights and inputs, checks
that outputs and gradients agree, and times both (the whole block, and RoPE alone).

    python python/examples/llama_attention.py              # CUDA if available, else CPU
    python python/examples/llama_attention.py --compile    # also under torch.compile
    python python/examples/llama_attention.py --batch 1 --seq 8192

Needs torch and the rope_jit package (pip install ./python) with librope_jit.so findable
($ROPE_JIT_LIBRARY, for instance build/librope_jit.so).
"""

import argparse
import time

import torch
from torch import nn

from sdpa_gqa import causal_sdpa  # (this folder: SDPA over grouped heads on torch 2.4 too)


# ------------------------------------------------------------------------------------------
# The model code, as in transformers (RoPE in plain PyTorch)
# ------------------------------------------------------------------------------------------

def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


PYTORCH_ROPE = apply_rotary_pos_emb


def use_rope_jit():
    """The switch: rebinds this module's apply_rotary_pos_emb, as editing its import would."""
    global apply_rotary_pos_emb
    from rope_jit.dropin.hf import apply_rotary_pos_emb  # noqa: F401,F811  (the one line)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, theta=500000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings):
        batch, seq_len, _ = hidden_states.shape
        shape = (batch, seq_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = causal_sdpa(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


# ------------------------------------------------------------------------------------------
# Running and timing
# ------------------------------------------------------------------------------------------

def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(function, device, repeats):
    """Median wall time of function() in milliseconds, after warm-up (JIT, caches)."""
    for _ in range(3):
        function()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def run_block(block, rotary, hidden, position_ids, grad_output):
    """Forward and backward; returns (output, input gradient)."""
    hidden = hidden.detach().requires_grad_(True)
    out = block(hidden, rotary(hidden, position_ids))
    out.backward(grad_output)
    return out.detach(), hidden.grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--batch", type=int, default=4 if cuda else 1)
    parser.add_argument("--seq", type=int, default=4096 if cuda else 256)
    parser.add_argument("--heads", type=int, default=32 if cuda else 8)
    parser.add_argument("--kv-heads", type=int, default=8 if cuda else 2)
    parser.add_argument("--head-dim", type=int, default=128 if cuda else 64)
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--repeats", type=int, default=20 if cuda else 5)
    parser.add_argument("--compile", action="store_true", help="also compare under torch.compile")
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    hidden_size = args.heads * args.head_dim
    block = LlamaAttention(hidden_size, args.heads, args.kv_heads).to(device, dtype)
    rotary = LlamaRotaryEmbedding(args.head_dim).to(device)
    hidden = torch.randn(args.batch, args.seq, hidden_size, device=device, dtype=dtype)
    position_ids = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)
    grad_output = torch.randn_like(hidden)
    cos, sin = rotary(hidden, position_ids)
    q = torch.randn(args.batch, args.heads, args.seq, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(args.batch, args.kv_heads, args.seq, args.head_dim, device=device, dtype=dtype)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{args.dtype}, batch {args.batch}, seq {args.seq}, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}")

    def measure(label):
        results = run_block(block, rotary, hidden, position_ids, grad_output)
        block.zero_grad(set_to_none=True)
        timing = {
            "block forward": time_ms(lambda: block(hidden, (cos, sin)), device, args.repeats),
            "block forward+backward": time_ms(lambda: run_block(block, rotary, hidden, position_ids, grad_output),
                                              device, args.repeats),
            "RoPE (q and k)": time_ms(lambda: apply_rotary_pos_emb(q, k, cos, sin), device, args.repeats),
        }
        print(f"  {label}: " + ", ".join(f"{name} {value:.3f} ms" for name, value in timing.items()))
        return results, timing

    before, before_timing = measure("PyTorch RoPE")
    use_rope_jit()
    after, after_timing = measure("rope-jit RoPE")

    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    ok = True
    for name, a, b in (("output", before[0], after[0]), ("input gradient", before[1], after[1])):
        difference = (a.float() - b.float()).abs().max().item()
        scale = a.float().abs().max().item()
        close = torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance * max(scale, 1.0))
        ok &= close
        print(f"  {name}: max |before - after| = {difference:.3g} (max |before| = {scale:.3g}) "
              f"{'same within ' + str(tolerance) if close else 'DIFFERENT'}")
    for name in before_timing:
        print(f"  speed-up {name}: {before_timing[name] / after_timing[name]:.2f}x")

    if args.compile:
        # Both versions under torch.compile(fullgraph=True): rope-jit's op stays in the graph.
        for label, rope in (("PyTorch RoPE", PYTORCH_ROPE), ("rope-jit RoPE", apply_rotary_pos_emb)):
            globals()["apply_rotary_pos_emb"] = rope
            torch._dynamo.reset()
            compiled = torch.compile(block, fullgraph=True)
            result = run_block(compiled, rotary, hidden, position_ids, grad_output)
            block.zero_grad(set_to_none=True)
            milliseconds = time_ms(lambda: run_block(compiled, rotary, hidden, position_ids, grad_output), device,
                                   args.repeats)
            block.zero_grad(set_to_none=True)
            difference = (result[0].float() - before[0].float()).abs().max().item()
            print(f"  torch.compile, {label}: forward+backward {milliseconds:.3f} ms, "
                  f"max |compiled - eager PyTorch| = {difference:.3g}")
    print("same outputs: yes" if ok else "same outputs: NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
