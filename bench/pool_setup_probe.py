"""What a process's first stream-ordered allocation costs, and whether another pool is cheaper.

Run AD measured the first cuMemAllocAsync of a process (after PyTorch made its context) at
10-11 ms on the H200, later ones at 0.15-0.46 ms: the fused attention's first call pays it
(issue 19's warm-cache cold start). This probe times, each in fresh processes after torch has
made its CUDA context, through the driver API (ctypes, no library of ours):

  default      cuMemAllocAsync(1 byte) from the device's default pool, then a second one
  own          cuMemPoolCreate (pinned, device 0), then cuMemAllocFromPoolAsync from it
  own_max      the same with CUmemPoolProps.maxSize = 1 GiB (CUDA 12.2+ drivers)
  sync_alloc   cuMemAlloc (what PyTorch's caching allocator calls), for comparison

    python3 bench/pool_setup_probe.py [--repeats 3] [--json out.json]

Needs a GPU and torch.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import ctypes, json, sys, time
import torch
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
mode = sys.argv[1]
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuGetProcAddress_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                     ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
def check(result, what):
    if result != 0:
        raise SystemExit(f"{what} failed: CUresult {result}")
def get(name, version=12000):
    fn = ctypes.c_void_p()
    status = ctypes.c_int()
    # Flag 1: CU_GET_PROC_ADDRESS_LEGACY_STREAM (a NULL stream is the legacy default stream).
    check(cuda.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), version, 1, ctypes.byref(status)),
          "cuGetProcAddress " + name)
    return fn.value
def proto(name, *args):
    return ctypes.CFUNCTYPE(ctypes.c_int, *args)(get(name))
P = ctypes.POINTER
u64 = ctypes.c_uint64
alloc_async = proto("cuMemAllocAsync", P(u64), ctypes.c_size_t, ctypes.c_void_p)
free_async = proto("cuMemFreeAsync", u64, ctypes.c_void_p)
alloc_from_pool = proto("cuMemAllocFromPoolAsync", P(u64), ctypes.c_size_t, ctypes.c_void_p,
                        ctypes.c_void_p)
pool_create = proto("cuMemPoolCreate", P(ctypes.c_void_p), ctypes.c_void_p)
mem_alloc = proto("cuMemAlloc", P(u64), ctypes.c_size_t)
mem_free = proto("cuMemFree", u64)
stream_sync = proto("cuStreamSynchronize", ctypes.c_void_p)

class Props(ctypes.Structure):  # CUmemPoolProps (88 bytes)
    _fields_ = [("alloc_type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("location_type", ctypes.c_int), ("location_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("max_size", ctypes.c_size_t),
                ("reserved", ctypes.c_ubyte * 56)]

stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
out = {}
def timed(name, fn):
    t = time.perf_counter(); fn(); out[name] = (time.perf_counter() - t) * 1e3
pointer = u64()
if mode == "default":
    timed("first_ms", lambda: check(alloc_async(ctypes.byref(pointer), 1, stream), "alloc"))
    check(free_async(pointer, stream), "free")
    timed("second_ms", lambda: check(alloc_async(ctypes.byref(pointer), 1, stream), "alloc"))
    check(free_async(pointer, stream), "free")
elif mode in ("own", "own_max"):
    props = Props(alloc_type=1, handle_types=0, location_type=1, location_id=0)
    if mode == "own_max":
        props.max_size = 1 << 30
    pool = ctypes.c_void_p()
    timed("create_ms", lambda: check(pool_create(ctypes.byref(pool), ctypes.byref(props)), "pool"))
    timed("first_ms", lambda: check(alloc_from_pool(ctypes.byref(pointer), 1, pool, stream), "alloc"))
    check(free_async(pointer, stream), "free")
    timed("second_ms", lambda: check(alloc_from_pool(ctypes.byref(pointer), 1, pool, stream), "alloc"))
    check(free_async(pointer, stream), "free")
else:
    timed("first_ms", lambda: check(mem_alloc(ctypes.byref(pointer), 1 << 20), "cuMemAlloc"))
    check(mem_free(pointer), "cuMemFree")
    timed("second_ms", lambda: check(mem_alloc(ctypes.byref(pointer), 1 << 20), "cuMemAlloc"))
    check(mem_free(pointer), "cuMemFree")
check(stream_sync(stream), "sync")
print(json.dumps(out))
"""

MODES = ("default", "own", "own_max", "sync_alloc")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write every child's numbers here")
    args = parser.parse_args()
    runs = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            child = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                                   env=dict(os.environ))
            if child.returncode != 0:
                runs[mode].append({"error": child.stderr.strip()[-500:]})
                continue
            runs[mode].append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"fresh processes after torch's context, {args.repeats} each (median ms):")
    for mode, results in runs.items():
        good = [r for r in results if "error" not in r]
        if not good:
            print(f"  {mode:11s} failed: {results[0]['error']}")
            continue
        fields = {k: statistics.median(r[k] for r in good) for k in good[0]}
        print(f"  {mode:11s} " + "  ".join(f"{k} {v:.3f}" for k, v in fields.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
