// rope_jit_config.programmatic_launch: RoPE kernels launched as programmatic dependent launches
// must give exactly what plain launches give. Each case chains in-place calls, so that every
// call reads what the one before it wrote: a kernel that touched q or k before the previous
// grid had finished (griddepcontrol.wait missing or misplaced) would read stale rows and
// diverge; an out-of-place chain reads its outputs back as the next call's inputs (q and q_out
// swapped every call). The other suites check the library's default launches (ROPE_JIT_PROGRAMMATIC_AUTO:
// programmatic on sm_90 under CUDA 12.3 and later) against the CPU backend; here plain launches
// are the reference, bit for bit, for programmatic chains on a stream and in a CUDA graph. In
// TEST_SUITE("gpu").
#include <doctest/doctest.h>

#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_driver.h"
#include "env_guard.h"
#include "gpu_rope_norm_problem.h"
#include "gpu_rope_problem.h"

using namespace rope_test;
using namespace gpu_test;
using namespace gpu_rope_test;
using rope_jit::check_cu;

namespace {

constexpr int kChainCalls = 24;

// The launcher's path for a chain's calls, checked before the chain runs.
enum class Path { Flat, Bulk, Other };

struct ChainCase {
    const char* name;
    Spec spec;
    bool qk_norm;
    Path path;  // Flat: takes_flat_path; Bulk: bulk_rows_of on sm_90; Other: neither
};

std::vector<ChainCase> chain_cases() {
    Spec prefill;  // several waves of blocks: the trigger fires as the last wave starts (flat)
    prefill.dt = Dt::BF16, prefill.table_dt = Dt::BF16, prefill.angles = Angles::FullTable;
    prefill.layout = Layout::BSHD;
    prefill.positions = Positions::PerBatchToken;
    prefill.B = 4, prefill.S = 515, prefill.Hk = 8, prefill.group = 4, prefill.D = 128;
    prefill.R = 128;
    Spec decode = prefill;  // one token a sequence: one-token blocks on the direct path
    decode.B = 64, decode.S = 1;
    Spec partial = prefill;  // the staged path with shared memory and a barrier
    partial.D = 96, partial.R = 32, partial.S = 67;
    Spec flat = prefill;  // dense rows, no positions: the flat path (rope_flat_kernel), D64
    flat.positions = Positions::Implicit;
    flat.B = 2, flat.S = 1031, flat.Hk = 16, flat.group = 1, flat.D = flat.R = 64;
    Spec bulk = prefill;  // out-of-place partial rotary: the bulk path's tile copies
    bulk.in_place = false, bulk.R = 64;
    return {{"prefill", prefill, false, Path::Flat},
            {"decode", decode, false, Path::Other},
            {"partial rotary", partial, false, Path::Other},
            {"flat rows", flat, false, Path::Flat},
            {"out-of-place partial rotary", bulk, false, Path::Bulk},
            {"QK-norm prefill", prefill, true, Path::Other},
            {"QK-norm decode", decode, true, Path::Other}};
}

// The call's device tensors: the problem's and, with QK-norm, its weights.
struct ChainTensors {
    explicit ChainTensors(const Problem& p, const NormTensors* norm) : problem(p) {
        if (norm != nullptr) {
            q_weight = std::make_unique<DeviceTensor>(norm->q_weight);
            k_weight = std::make_unique<DeviceTensor>(norm->k_weight);
        }
    }
    // swapped: q_out and k_out as the inputs, q and k as the outputs (out of place).
    rope_jit_rope_args args(const Spec& c, const NormTensors* norm, rope_jit::CUstream stream,
                            bool swapped = false) const {
        Views views = problem.views();
        if (swapped) {
            std::swap(views[kQ], views[kQOut]);
            std::swap(views[kK], views[kKOut]);
        }
        rope_jit_rope_args a = make_args(c, views, stream);
        if (norm != nullptr)
            add_norm_args(a, *norm,
                          {q_weight->dl(), k_weight->dl(), nullptr, nullptr, nullptr, nullptr});
        return a;
    }
    DeviceProblem problem;
    std::unique_ptr<DeviceTensor> q_weight, k_weight;
};

// The tensors after kChainCalls calls of `runtime` on stream, or (graph) replaying them
// captured. Out of place, odd calls take the outputs as inputs and the inputs as outputs.
Problem run_chain(rope_jit_runtime* runtime, const Problem& p, const NormTensors* norm,
                  bool graph) {
    Stream stream;
    ChainTensors tensors(p, norm);
    const rope_jit_rope_args forth = tensors.args(p.spec, norm, stream.get());
    const rope_jit_rope_args back = tensors.args(p.spec, norm, stream.get(), !p.spec.in_place);
    const auto args = [&](int call) { return call % 2 == 0 ? forth : back; };
    if (!graph) {
        for (int call = 0; call < kChainCalls; ++call)
            require_ok(call_rope(runtime, args(call)), "call " + std::to_string(call));
        synchronize(stream.get());
        return tensors.problem.download(p);
    }
    // Compile and load outside the capture (one call), then restore the tensors.
    require_ok(call_rope(runtime, forth), "warm-up");
    synchronize(stream.get());
    for (size_t s : {kQ, kK, kQOut, kKOut})
        if (p.has(s)) tensors.problem[s].upload(p.t[s]);
    Graph chain;
    check_cu(driver().cuStreamBeginCapture(stream.get(), rope_jit::CU_STREAM_CAPTURE_MODE_GLOBAL),
             "cuStreamBeginCapture");
    CallResult captured{ROPE_JIT_OK, ""};
    for (int call = 0; call < kChainCalls && captured.status == ROPE_JIT_OK; ++call)
        captured = call_rope(runtime, args(call));
    const rope_jit::CUresult ended = driver().cuStreamEndCapture(stream.get(), &chain.graph);
    require_ok(captured, "during capture");
    check_cu(ended, "cuStreamEndCapture");
    check_cu(driver().cuGraphInstantiate(&chain.exec, chain.graph, 0), "cuGraphInstantiate");
    check_cu(driver().cuGraphLaunch(chain.exec, stream.get()), "cuGraphLaunch");
    synchronize(stream.get());
    return tensors.problem.download(p);
}

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE_FIXTURE(GpuFixture,
                      "programmatic launches: chains of calls, each reading what the one before "
                      "wrote, on a stream and in a CUDA graph, give the plain launches' results "
                      "bit for bit") {
        // Both explicit (the fixture's runtime takes the library's default, AUTO), and the
        // environment variable, which overrides both, unset.
        EnvGuard env;
        env.set("ROPE_JIT_PROGRAMMATIC_LAUNCH", nullptr);
        RuntimeHandle plain_runtime(ROPE_JIT_BACKEND_CUDA, false, ROPE_JIT_PROGRAMMATIC_OFF);
        RuntimeHandle programmatic(ROPE_JIT_BACKEND_CUDA, false, ROPE_JIT_PROGRAMMATIC_ON);
        uint32_t seed = 20261203;
        for (const ChainCase& chain : chain_cases()) {
            const std::string name = chain.name;
            CAPTURE(name);
            const std::string spec = describe(chain.spec);
            CAPTURE(spec);
            std::mt19937 rng(seed++);
            const Problem p = make_problem(chain.spec, rng);
            NormTensors norm;
            if (chain.qk_norm) norm = make_norm(p, Dt::BF16, false, false, rng);
            const NormTensors* n = chain.qk_norm ? &norm : nullptr;

            if (!chain.qk_norm) {
                DeviceProblem device(p);
                const rope_jit_rope_args args = make_args(p.spec, device.views(), nullptr);
                const rope_jit::RopeProblem problem = rope_jit::make_rope_problem(args);
                const bool bulk =
                    rope_jit::bulk_rows_of(rope_jit::make_kernel_spec(problem), problem, 90)
                        .has_value();
                CHECK(takes_flat_path(args) == (chain.path == Path::Flat));
                CHECK(bulk == (chain.path == Path::Bulk));
            }
            const Problem plain = run_chain(plain_runtime.get(), p, n, false);
            // The chain changed q and k (a chain that wrote nothing would match trivially).
            CHECK(bytes_of(plain.t[kQ]) != bytes_of(p.t[kQ]));
            CHECK(bytes_of(plain.t[kK]) != bytes_of(p.t[kK]));
            for (bool graph : {false, true}) {
                CAPTURE(graph);
                const Problem got = run_chain(programmatic.get(), p, n, graph);
                for (size_t s : {kQ, kK, kQOut, kKOut}) {
                    if (!p.has(s)) continue;
                    CAPTURE(slot_name(s));
                    CHECK(bytes_of(got.t[s]) == bytes_of(plain.t[s]));
                }
            }
        }
    }
}
