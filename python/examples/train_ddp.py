"""Data-parallel training of a small Llama-style model whose attention uses rope-jit, under
PyTorch's distributed engine (DDP or FSDP2), launched with torchrun.

The model (random weights from a config, plain PyTorch: embedding, decoder layers with RMSNorm,
grouped-query attention and a SwiGLU MLP, untied LM head) rotates q and k with
rope_jit.apply_rope, or with --attention fused calls rope-jit's attention with rotary fused
in (rope_jit.torch_ops.attention), and learns a synthetic next-token task (arithmetic
sequences, which need positions to predict). Every rank takes its slice of the same global
batch, so a run on N ranks follows the same loss curve as one process with the whole batch.

    torchrun --standalone --nproc-per-node 2 python/examples/train_ddp.py --mode ddp
    torchrun --standalone --nproc-per-node 2 python/examples/train_ddp.py --mode fsdp
    python python/examples/train_ddp.py --mode single          # one process, the whole batch

One GPU per rank with NCCL when CUDA is there (--backend gloo lets several ranks share one
GPU), else the CPU with gloo (rope-jit then runs its CPU reference). Point all ranks at one
cache directory (ROPE_JIT_CACHE_DIR): each kernel is compiled by one rank and read from disk by
the others. Needs torch and the rope_jit package with librope_jit.so findable
($ROPE_JIT_LIBRARY).

Rank 0 prints the loss curve and, with --json, writes what the checks of
python/tests/test_distributed.py read: the losses (averaged over ranks), step times, every
rank's kernel-cache counters, with --time-steps step times against the same model with
PyTorch's RoPE and SDPA, and on CUDA a host-synchronization probe. --save-params writes the
final parameters (full tensors, float32) with torch.save.
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rope_jit
import rope_jit.torch_ops

from sdpa_gqa import causal_sdpa  # (this folder: SDPA over grouped heads on torch 2.4 too)


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    seq: int = 32
    theta: float = 10000.0

    @property
    def head_dim(self):
        return self.hidden // self.heads


# "tiny" keeps a CPU run of two processes on two cores within seconds; "small" gives a GPU
# enough work per step (head_dim 64, where the fused attention has its tensor-core kernels).
PRESETS = {
    "tiny": Config(),
    "small": Config(vocab=4096, hidden=1024, layers=4, heads=16, kv_heads=4, intermediate=2816,
                    seq=1024),
}


def rope_torch(q, k, cos, sin):
    """PyTorch's RoPE as HF transformers writes it (rotate_half), for [B, S, H, D] q and k and
    half tables [S, D/2]: the baseline the step times are compared against."""
    cos = torch.cat((cos, cos), dim=-1)[None, :, None, :].to(q.dtype)
    sin = torch.cat((sin, sin), dim=-1)[None, :, None, :].to(q.dtype)

    def rotate_half(x):
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * self.head_dim, config.hidden, bias=False)
        # Switched by set_implementation: "rope_jit", "fused" (rope-jit's attention) or
        # "torch" (PyTorch RoPE); a plain attribute, so wrappers (DDP, FSDP) do not mind.
        self.implementation = "rope_jit"

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim)
        if self.implementation == "fused":
            # q and k are rotated as the kernel loads them; [B, S, H, D] buffers go as their
            # [B, H, S, D] views, no copies.
            out = rope_jit.torch_ops.attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), cos, sin, causal=True)
        else:
            if self.implementation == "rope_jit":
                q, k = rope_jit.apply_rope(q, k, cos, sin, layout="bshd")
            else:
                q, k = rope_torch(q, k, cos, sin)
            out = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden)
        self.gate_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def rotary_tables(config, device):
    """cos and sin [seq, head_dim/2], float32: Llama's inv_freq at positions 0..seq-1."""
    dim = config.head_dim
    inv_freq = 1.0 / config.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(config.seq, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float().to(device), angles.sin().float().to(device)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        # Tables are inputs, not state: no gradient (rope-jit refuses tables that need one),
        # and not sharded or broadcast by DDP/FSDP.
        self.tables = rotary_tables(config, "cpu")

    def forward(self, tokens):
        if self.tables[0].device != tokens.device:
            self.tables = tuple(t.to(tokens.device) for t in self.tables)
        cos, sin = (t[: tokens.shape[1]] for t in self.tables)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def set_implementation(model, implementation):
    for module in model.modules():
        if isinstance(module, Attention):
            module.implementation = implementation


def global_batch(config, size, step, seed):
    """Step `step`'s global batch [size, seq + 1]: arithmetic sequences modulo the vocabulary
    (a random start and stride per row), the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, config.vocab, (size, 1), generator=generator)
    stride = torch.randint(1, 17, (size, 1), generator=generator)
    return (start + stride * torch.arange(config.seq + 1)) % config.vocab


# ------------------------------------------------------------------------------------------
# Distributed setup, training, measurements
# ------------------------------------------------------------------------------------------

def setup(args):
    """(rank, world_size, device, backend or None); joins the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        # With gloo several ranks may share a GPU; NCCL needs one GPU per rank.
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.mode == "single":
        if world_size != 1:
            raise SystemExit("--mode single: run one process (without torchrun, or nproc 1)")
        return 0, 1, device, None
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return rank, world_size, device, backend


def wrap(model, mode, device):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        device_ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if mode == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            raise SystemExit("--mode fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, "
                             "torch >= 2.6)")
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def full_parameters(model):
    """{name: float32 CPU tensor} of the whole model, on every rank (a collective under FSDP:
    DTensor shards are gathered)."""
    params = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        # A copy: on the CPU .float().cpu() would return the live parameter itself.
        params[name.removeprefix("module.")] = tensor.detach().float().cpu().clone()
    return params


def gather(value, world_size):
    """[value of rank 0, value of rank 1, ...] on every rank."""
    if world_size == 1:
        return [value]
    values = [None] * world_size
    dist.all_gather_object(values, value)
    return values


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    def __init__(self, args, config, model, device, rank, world_size):
        self.args, self.config, self.model, self.device = args, config, model, device
        self.rank, self.world_size = rank, world_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        self.dtype = getattr(torch, args.dtype)
        if args.global_batch % world_size:
            raise SystemExit(f"--global-batch {args.global_batch}: not a multiple of the "
                             f"{world_size} ranks")
        self.local_batch = args.global_batch // world_size

    def step(self, step):
        """One optimizer step on this rank's slice of global batch `step`; returns the loss
        as a tensor (no host synchronization)."""
        rows = global_batch(self.config, self.args.global_batch, step, self.args.seed)
        rows = rows[self.rank * self.local_batch:(self.rank + 1) * self.local_batch]
        rows = rows.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.dtype,
                            enabled=self.dtype != torch.float32):
            logits = self.model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def timed_step(self, step):
        synchronize(self.device)
        start = time.perf_counter()
        loss = self.step(step)
        synchronize(self.device)
        return loss, (time.perf_counter() - start) * 1e3


def compare_step_times(trainer, implementation, rounds):
    """Median step time (ms) of the model with `implementation` against the same model with
    PyTorch's RoPE and SDPA, steps alternating so that both see the same machine state."""
    variants = [implementation, "torch"]
    times = {name: [] for name in variants}
    for index in range(rounds + 2):
        for name in variants:
            set_implementation(trainer.model, name)
            _, ms = trainer.timed_step(10_000 + index)
            if index >= 2:  # the first steps of a variant warm caches up
                times[name].append(ms)
    set_implementation(trainer.model, implementation)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"median_ms": medians, "ratio": medians[implementation] / medians["torch"],
            "rounds": rounds}


def host_sync_probe(config, device, dtype, batch, implementation):
    """Runs one decoder layer's forward and backward (with rope-jit) behind ~100 ms of GPU
    sleep, under torch.cuda.set_sync_debug_mode("error"). A call that waited for the GPU would
    either raise (a synchronizing PyTorch call) or hold the host until the sleep ended (a
    synchronizing driver call in the library), so host_ms stays far below sleep_ms when
    nothing synchronizes. A fresh layer, not the wrapped model: DDP's hooks must not fire."""
    torch.manual_seed(1)
    layer = DecoderLayer(config).to(device)
    set_implementation(layer, implementation)
    cos, sin = rotary_tables(config, device)
    x = torch.randn(batch, config.seq, config.hidden, device=device, requires_grad=True)

    def forward_backward():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = layer(x, cos, sin)
        out.float().square().mean().backward()

    forward_backward()  # kernels loaded, allocator warm
    synchronize(device)
    # Cycles per millisecond of torch.cuda._sleep, measured, to ask for about 100 ms.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    synchronize(device)
    cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    previous = torch.cuda.get_sync_debug_mode()
    error = None
    start.record()
    torch.cuda._sleep(int(100 * cycles_per_ms))
    begin = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward()
    except RuntimeError as caught:
        error = str(caught).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    host_ms = (time.perf_counter() - begin) * 1e3
    end.record()
    synchronize(device)
    return {"host_ms": host_ms, "gpu_ms": start.elapsed_time(end), "sync_error": error}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("single", "ddp", "fsdp"), default="ddp")
    parser.add_argument("--attention", choices=("rope_jit", "fused", "torch"), default="rope_jit",
                        help="rope_jit: rope_jit.apply_rope then SDPA; fused: rope-jit's "
                             "attention with rotary; torch: PyTorch RoPE then SDPA")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model size (default: small on CUDA, tiny on the CPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="autocast dtype; parameters stay float32 "
                             "(default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step over all ranks (default: 8 on CUDA, 4 on CPU)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-steps", type=int, default=0,
                        help="after training: this many timed steps each against PyTorch RoPE")
    parser.add_argument("--json", help="rank 0 writes the results here")
    parser.add_argument("--save-params", help="rank 0 writes the final parameters here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, device, backend = setup(args)
    cuda = device.type == "cuda"
    args.preset = args.preset or ("small" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.global_batch = args.global_batch or (8 if cuda else 4)
    config = PRESETS[args.preset]
    if cuda:
        # Float32 matmuls exactly float32: runs of different batch splits stay comparable.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = LlamaModel(config).to(device)
    set_implementation(model, args.attention)
    model = wrap(model, args.mode, device)
    trainer = Trainer(args, config, model, device, rank, world_size)

    losses, step_ms = [], []
    for step in range(args.steps):
        loss, ms = trainer.timed_step(step)
        losses.append(loss)
        step_ms.append(ms)
    losses = torch.stack(losses).float()
    if world_size > 1:
        dist.all_reduce(losses)  # gloo has no AVG: sum, then divide
        losses /= world_size
    losses = losses.tolist()
    params = full_parameters(model)

    timing = None
    if args.time_steps:
        timing = compare_step_times(trainer, args.attention, args.time_steps)
    probe = None
    if cuda and args.attention != "torch":
        probe = host_sync_probe(config, device, getattr(torch, args.dtype), trainer.local_batch,
                                args.attention)
    # Counters last: every kernel this process loaded, to set against the cache's entries.
    stats = rope_jit.default_runtime().stats()
    all_stats, probes = gather(stats, world_size), gather(probe, world_size)

    if rank == 0:
        print(f"{args.mode} on {world_size} rank(s), {device.type} ({backend or 'no process group'}"
              f"), {args.preset} model, {args.dtype}, global batch {args.global_batch}, "
              f"attention {args.attention}")
        for step, (loss, ms) in enumerate(zip(losses, step_ms)):
            print(f"  step {step}: loss {loss:.6f}  ({ms:.1f} ms on rank 0)")
        for index, rank_stats in enumerate(all_stats):
            print(f"  rank {index} kernels: {rank_stats['compiles']} compiled, "
                  f"{rank_stats['disk_hits']} from disk, {rank_stats['launches']} launches")
        if timing:
            print(f"  step time: {timing['median_ms'][args.attention]:.2f} ms with "
                  f"{args.attention}, {timing['median_ms']['torch']:.2f} ms with PyTorch RoPE "
                  f"(ratio {timing['ratio']:.3f})")
        for index, rank_probe in enumerate(probes):
            if rank_probe:
                print(f"  rank {index} sync probe: host {rank_probe['host_ms']:.2f} ms behind "
                      f"{rank_probe['gpu_ms']:.1f} ms of GPU work, "
                      f"sync error: {rank_probe['sync_error']}")
        if args.save_params:
            torch.save(params, args.save_params)
        if args.json:
            result = {
                "mode": args.mode, "world_size": world_size, "device": device.type,
                "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
                "backend": backend, "attention": args.attention, "preset": args.preset,
                "config": dataclasses.asdict(config), "dtype": args.dtype,
                "global_batch": args.global_batch, "lr": args.lr, "torch": torch.__version__,
                "rope_jit_backend": rope_jit.default_runtime().backend,
                "losses": losses, "step_ms": step_ms, "stats": all_stats, "timing": timing,
                "sync_probe": probes,
            }
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if world_size > 1:
        # The wrapped model and its optimizer go before the process group, so no gradient
        # hook or pending collective outlives it into interpreter shutdown.
        del trainer, model
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
