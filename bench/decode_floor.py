"""What a tiny kernel's time in a CUDA graph is made of (issue 21, deliverable 2).

Stand-alone: ctypes over libcuda and libnvrtc, no build, no PyTorch. Each kernel below is
launched 100 times into one captured graph, as rope-jit-bench times its decode cases, and the
graph replayed; the result is GPU time per call. The kernels add one piece of a decode RoPE
call's dependent chain at a time (all data stays in L2 across replays):

  empty        nothing (rope-jit-bench's empty kernel: 1 block of 32 threads)
  store        each thread stores 16 bytes (the completion waits for the stores)
  copy         out = in: one L2 round trip, then the store
  gather       out = table[pos[b]]: two dependent L2 round trips (position, then table row)
  rope_like    gather plus an independent load (q) issued first, as rope.cu's direct path
  rope_big     rope_like with a 640-byte parameter block (RopeKernelParams' size), its
               pointers at the end

Run on the GPU machine: python3 bench/decode_floor.py   (prints one line per kernel and grid)
"""

import ctypes
import statistics
import sys

SOURCE = r"""
struct alignas(16) V { unsigned w[4]; };
__device__ __forceinline__ V mix(V a, V b) {
    V r;
    for (int j = 0; j < 4; ++j) r.w[j] = a.w[j] ^ b.w[j];
    return r;
}
extern "C" __global__ void empty() {}
extern "C" __global__ void store(V* out) {
    V v = {{1u, 2u, 3u, 4u}};
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
extern "C" __global__ void copy(const V* in, V* out) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i];
}
extern "C" __global__ void gather(const long long* pos, const V* table, V* out) {
    const long long p = pos[blockIdx.x];
    out[blockIdx.x * blockDim.x + threadIdx.x] = table[p * 32 + threadIdx.x % 32];
}
extern "C" __global__ void rope_like(const long long* pos, const V* table, const V* q, V* out) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const V x = q[i];
    const long long p = pos[blockIdx.x];
    out[i] = mix(x, table[p * 32 + threadIdx.x % 32]);
}
struct Big {
    char pad[608];
    const long long* pos;
    const V* table;
    const V* q;
    V* out;
};
extern "C" __global__ void rope_big(const Big a) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const V x = a.q[i];
    const long long p = a.pos[blockIdx.x];
    a.out[i] = mix(x, a.table[p * 32 + threadIdx.x % 32]);
}
"""

CALLS = 100  # launches captured in one graph
REPLAYS = 20


def fail(what, code):
    sys.exit(f"{what} failed: {code}")


def main():
    cuda = ctypes.CDLL("libcuda.so.1")
    try:
        nvrtc = ctypes.CDLL("libnvrtc.so")
    except OSError:
        nvrtc = ctypes.CDLL("libnvrtc.so.13")

    def cu(name, *args):
        rc = getattr(cuda, name)(*args)
        if rc != 0:
            fail(name, rc)

    cu("cuInit", 0)
    dev = ctypes.c_int()
    cu("cuDeviceGet", ctypes.byref(dev), 0)
    major, minor = ctypes.c_int(), ctypes.c_int()
    cu("cuDeviceGetAttribute", ctypes.byref(major), 75, dev)  # compute capability major
    cu("cuDeviceGetAttribute", ctypes.byref(minor), 76, dev)
    ctx = ctypes.c_void_p()
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    cu("cuCtxSetCurrent", ctx)

    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"floor.cu", 0, None, None):
        fail("nvrtcCreateProgram", "")
    arch = f"--gpu-architecture=sm_{major.value}{minor.value}".encode()
    opts = (ctypes.c_char_p * 2)(arch, b"-std=c++17")
    if nvrtc.nvrtcCompileProgram(prog, 2, opts):
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        fail("nvrtcCompileProgram", log.value.decode())
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    module = ctypes.c_void_p()
    cu("cuModuleLoadData", ctypes.byref(module), cubin)

    def function(name):
        f = ctypes.c_void_p()
        cu("cuModuleGetFunction", ctypes.byref(f), module, name.encode())
        return f

    def alloc(nbytes):
        p = ctypes.c_uint64()
        cu("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(nbytes))
        cu("cuMemsetD8_v2", p, 0, ctypes.c_size_t(nbytes))
        return p

    blocks_max, threads = 64, 320
    pos = alloc(8 * blocks_max)  # zeros: every block reads table row 0
    table = alloc(16 * 32)
    q = alloc(16 * blocks_max * threads)
    out = alloc(16 * blocks_max * threads)

    class Big(ctypes.Structure):
        _fields_ = [("pad", ctypes.c_char * 608), ("pos", ctypes.c_uint64),
                    ("table", ctypes.c_uint64), ("q", ctypes.c_uint64), ("out", ctypes.c_uint64)]

    big = Big(b"", pos.value, table.value, q.value, out.value)
    kernels = {
        "empty": [],
        "store": [out],
        "copy": [q, out],
        "gather": [pos, table, out],
        "rope_like": [pos, table, q, out],
        "rope_big": [big],
    }
    elapsed = "cuEventElapsedTime"
    if hasattr(cuda, "cuEventElapsedTime_v2"):
        elapsed = "cuEventElapsedTime_v2"
    stream = ctypes.c_void_p()
    cu("cuStreamCreate", ctypes.byref(stream), 1)  # non-blocking
    start, stop = ctypes.c_void_p(), ctypes.c_void_p()
    cu("cuEventCreate", ctypes.byref(start), 0)
    cu("cuEventCreate", ctypes.byref(stop), 0)

    def per_call_us(f, args, grid, block):
        params = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(a) for a in args])
        cu("cuStreamBeginCapture_v2", stream, 0)
        for _ in range(CALLS):
            cu("cuLaunchKernel", f, grid, 1, 1, block, 1, 1, 0, stream,
               params if args else None, None)
        graph = ctypes.c_void_p()
        cu("cuStreamEndCapture", stream, ctypes.byref(graph))
        exe = ctypes.c_void_p()
        cu("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
        for _ in range(3):
            cu("cuGraphLaunch", exe, stream)
        cu("cuStreamSynchronize", stream)
        times = []
        for _ in range(REPLAYS):
            cu("cuEventRecord", start, stream)
            cu("cuGraphLaunch", exe, stream)
            cu("cuEventRecord", stop, stream)
            cu("cuEventSynchronize", stop)
            ms = ctypes.c_float()
            cu(elapsed, ctypes.byref(ms), start, stop)
            times.append(ms.value * 1e3 / CALLS)
        cu("cuGraphExecDestroy", exe)
        cu("cuGraphDestroy", graph)
        return statistics.median(times)

    base = per_call_us(function("empty"), [], 1, 32)
    print(f"empty 1x32: {base:.2f} us per call in a graph of {CALLS}")
    for grid in (1, 64):
        for name, args in kernels.items():
            t = per_call_us(function(name), args, grid, threads)
            print(f"{name:10s} {grid:2d}x{threads}: {t:.2f} us (+{t - base:.2f} over empty 1x32)")


if __name__ == "__main__":
    main()
