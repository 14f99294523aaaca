"""Data-parallel training through PyTorch's distributed engine (examples/train_ddp.py, launched
with torchrun in subprocesses): a run on several ranks against one process with the same global
batch, kernels compiled once across ranks sharing an empty cache, and no host synchronization
added by rope-jit.

What runs depends on the machine (skipped without torch):
  CPU only:  2 ranks over gloo, DDP and FSDP, float32 (rope-jit's CPU reference; no kernels).
  one GPU:   1 rank over NCCL (DDP, FSDP, DDP with the fused attention), and 2 ranks sharing
             the GPU over gloo (DDP), bf16 autocast.
  2+ GPUs:   2 ranks over NCCL (DDP, FSDP, DDP with the fused attention), bf16 autocast.
ROPE_JIT_DDP_NPROC overrides the number of NCCL ranks on GPUs (at most one per GPU). With
ROPE_JIT_DDP_OUT set, every run's log and JSON, and summary.json, are kept there (parameters
and caches stay in pytest's temporary directory).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch without torch.distributed", allow_module_level=True)

import rope_jit  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
STEPS = 5
# Relative error of the losses, and distance of the final parameters over the distance
# training moved them. float32 on the CPU: the runs differ only in the order of the gradient
# sums. bf16 autocast on GPUs: splitting the batch changes the rounding of every matmul's
# reduction, and AdamW moves each weight by about lr whatever its gradient's size, so a
# near-zero gradient that flips sign moves it by 2 lr the other way.
TOLERANCE = {"float32": {"loss": 1e-5, "params": 1e-4},
             "bfloat16": {"loss": 1e-2, "params": 0.1}}
# Steps with rope-jit may take this much longer than with PyTorch's RoPE (GPUs only: the
# CPU reference is not what a training job runs, and two ranks share two busy cores here).
STEP_TIME_RATIO = 1.15
SUMMARY = {}


def has_fsdp2():
    """Whether this torch has FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.6 and later),
    which the example's --mode fsdp needs."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def launches():
    """(name, mode, ranks, backend, attention) of each run this machine allows (FSDP runs
    skipped without FSDP2)."""
    if GPUS == 0:
        runs = [("ddp_gloo2", "ddp", 2, "gloo", "rope_jit"),
                ("fsdp_gloo2", "fsdp", 2, "gloo", "rope_jit")]
    else:
        ranks = min(int(os.environ.get("ROPE_JIT_DDP_NPROC", min(GPUS, 2))), GPUS)
        runs = [(f"ddp_nccl{ranks}", "ddp", ranks, "nccl", "rope_jit"),
                (f"fsdp_nccl{ranks}", "fsdp", ranks, "nccl", "rope_jit"),
                (f"ddp_fused_nccl{ranks}", "ddp", ranks, "nccl", "fused")]
        if ranks == 1:  # two processes on the one GPU: the shared cache still gets tested
            runs.append(("ddp_gloo2_one_gpu", "ddp", 2, "gloo", "rope_jit"))
    if has_fsdp2():
        return runs
    return [run if run[1] != "fsdp" else pytest.param(
        run, id=run[0], marks=pytest.mark.skip(reason="FSDP2 needs torch >= 2.6"))
        for run in runs]


class Directories:
    def __init__(self, work, out):
        self.work, self.out = work, out  # parameters and caches; logs and JSON


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("distributed")
    kept = os.environ.get("ROPE_JIT_DDP_OUT")
    out = Path(kept) if kept else work
    out.mkdir(parents=True, exist_ok=True)
    yield Directories(work, out)
    with open(out / "summary.json", "w") as f:
        json.dump(SUMMARY, f, indent=1)


_runs = {}


def run(out_dir, name, mode, ranks, backend, attention):
    """Runs the example (torchrun unless mode is single) on a new empty cache directory;
    returns (its JSON, its final parameters, the number of kernels in its cache)."""
    if name in _runs:
        return _runs[name]
    cache = Path(tempfile.mkdtemp(prefix=f"cache_{name}_", dir=out_dir.work))
    env = dict(os.environ, ROPE_JIT_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    package = str(Path(rope_jit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH")) if p)
    launcher = [sys.executable]
    if mode != "single":
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command = launcher + [str(EXAMPLE), "--mode", mode, "--attention", attention,
                          "--steps", str(STEPS), "--time-steps", "4" if GPUS else "2",
                          "--json", str(out_dir.out / f"{name}.json"),
                          "--save-params", str(out_dir.work / f"{name}.pt")]
    if backend:
        command += ["--backend", backend]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    (out_dir.out / f"{name}.log").write_text(" ".join(command) + "\n" + done.stdout)
    assert done.returncode == 0, f"{name} failed ({done.returncode}):\n{done.stdout[-4000:]}"
    with open(out_dir.out / f"{name}.json") as f:
        result = json.load(f)
    params = torch.load(out_dir.work / f"{name}.pt")
    kernels = sum(1 for p in cache.rglob("*") if p.suffix in (".cubin", ".ptx"))
    _runs[name] = (result, params, kernels)
    return _runs[name]


def single(out_dir, attention):
    return run(out_dir, f"single_{attention}", "single", 1, None, attention)


@pytest.mark.parametrize("launch", launches(), ids=lambda launch: launch[0])
def test_data_parallel_training_matches_one_process_with_the_same_global_batch(out_dir, launch):
    name, mode, ranks, backend, attention = launch
    reference, reference_params, _ = single(out_dir, attention)
    result, params, _ = run(out_dir, *launch)
    assert result["world_size"] == ranks and result["mode"] == mode
    assert result["global_batch"] == reference["global_batch"]
    tolerance = TOLERANCE[result["dtype"]]
    losses, expected = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    assert len(losses) == STEPS
    loss_error = ((losses - expected).abs() / expected.abs()).max().item()
    assert params.keys() == reference_params.keys()
    # Parameters: the distance between the two runs over the distance training moved them,
    # so that the check measures the updates (and fails if nothing moved).
    initial = initial_params()
    param_error = max(((params[n] - reference_params[n]).norm()
                       / (reference_params[n] - initial[n]).norm()).item() for n in params)
    SUMMARY[name] = {"losses": result["losses"], "single_losses": reference["losses"],
                     "max_loss_rel_error": loss_error, "max_param_error_over_update": param_error,
                     "step_ms": result["step_ms"], "single_step_ms": reference["step_ms"],
                     "device": result["device_name"], "dtype": result["dtype"]}
    print(f"\n{name}: losses {[round(x, 6) for x in result['losses']]}, single "
          f"{[round(x, 6) for x in reference['losses']]}; max relative error of the losses "
          f"{loss_error:.2e}, of the parameters' updates {param_error:.2e} ({result['dtype']})")
    assert loss_error <= tolerance["loss"], (result["losses"], reference["losses"])
    assert param_error <= tolerance["params"]


_initial = {}


def initial_params():
    """The example's parameters before training (its model at seed 0), by name."""
    if not _initial:
        sys.path.insert(0, str(EXAMPLE.parent))
        try:
            import train_ddp
        finally:
            sys.path.pop(0)
        torch.manual_seed(0)
        model = train_ddp.LlamaModel(train_ddp.PRESETS["small" if GPUS else "tiny"])
        _initial.update((n, p.detach().float()) for n, p in model.named_parameters())
    return _initial


@pytest.mark.skipif(GPUS == 0, reason="kernels are compiled for GPUs only (CPU reference here)")
@pytest.mark.parametrize("launch", launches(), ids=lambda launch: launch[0])
def test_ranks_sharing_an_empty_cache_compile_each_kernel_once(out_dir, launch):
    result, _, kernels = run(out_dir, *launch)
    stats = result["stats"]
    compiles = sum(s["compiles"] for s in stats)
    SUMMARY.setdefault(launch[0], {})["kernels"] = {"entries": kernels, "per_rank": stats}
    print(f"\n{launch[0]}: {kernels} kernels in the cache; per rank " + "; ".join(
        f"{s['compiles']} compiled, {s['disk_hits']} from disk" for s in stats))
    assert kernels > 0
    assert compiles == kernels, f"{compiles} compiles for {kernels} distinct kernels"
    for rank, rank_stats in enumerate(stats):
        # Each process loads every kernel once: compiled by itself, or read from disk.
        assert rank_stats["compiles"] + rank_stats["disk_hits"] == kernels, (rank, rank_stats)
        assert rank_stats["launches"] > 0
    if len(stats) > 1:
        assert sum(s["disk_hits"] for s in stats) == (len(stats) - 1) * kernels


@pytest.mark.parametrize("launch", launches(), ids=lambda launch: launch[0])
def test_rope_jit_adds_no_host_synchronization_to_a_training_step(out_dir, launch):
    result, _, _ = run(out_dir, *launch)
    timing = result["timing"]
    SUMMARY.setdefault(launch[0], {}).update(timing=timing, sync_probe=result["sync_probe"])
    print(f"\n{launch[0]}: median step {timing['median_ms'][launch[4]]:.2f} ms with "
          f"{launch[4]}, {timing['median_ms']['torch']:.2f} ms with PyTorch RoPE + SDPA "
          f"(ratio {timing['ratio']:.3f}); sync probe {result['sync_probe']}")
    if GPUS == 0:
        pytest.skip("step times reported only: the CPU reference is not a GPU kernel")
    for rank, probe in enumerate(result["sync_probe"]):
        # Behind ~100 ms of GPU work, a layer's forward and backward returns at once unless
        # something waits for the GPU.
        assert probe["sync_error"] is None, (rank, probe)
        assert probe["host_ms"] < 0.5 * probe["gpu_ms"], (rank, probe)
    # Not for the fused attention (its speed is its own issue), nor over gloo (gradients go
    # through host memory, and that dominates the step).
    if launch[4] == "rope_jit" and launch[3] == "nccl":
        assert timing["ratio"] <= STEP_TIME_RATIO, timing
