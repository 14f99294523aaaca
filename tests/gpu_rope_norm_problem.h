// The QK-norm part of the rope problems the gpu suites run (test_gpu_rope_qk_norm.cpp): norm
// weights, pre-norm inputs and weight gradients added to a gpu_rope_problem.h Problem, and the
// randomized families of the sweep, which a CPU test (test_rope_qk_norm.cpp) also runs and
// compiles. Header-only and inline.
#pragma once

#include <algorithm>
#include <random>
#include <vector>

#include "gpu_rope_problem.h"

namespace gpu_rope_test {

// The norm tensors of a call: weights, the forward's inputs (backward) and weight gradients.
struct NormTensors {
    HostTensor q_weight, k_weight, q_input, k_input, q_grad, k_grad;
    bool unit_offset = false, weight_grad = false;
    double eps = 1e-6;
};

enum NormSlot { kQWeight, kKWeight, kQInput, kKInput, kQGrad, kKGrad, kNormSlots };

inline std::vector<HostTensor*> norm_slots(NormTensors& n) {
    return {&n.q_weight, &n.k_weight, &n.q_input, &n.k_input, &n.q_grad, &n.k_grad};
}

// weight_step > 1: the weights are views of every weight_step-th element (no vector reads:
// the kernel's scalar path, KernelSpec::norm_weight_vec_loads 0).
inline NormTensors make_norm(const Problem& p, Dt weight_dt, bool unit_offset, bool weight_grad,
                             std::mt19937& rng, int64_t weight_step = 1) {
    const Spec& c = p.spec;
    NormTensors n;
    n.unit_offset = unit_offset;
    n.weight_grad = c.backward && weight_grad;
    n.eps = 1e-5;
    auto weights = [&] {
        return weight_step > 1 ? HostTensor::spaced(weight_dt, c.D, weight_step)
                               : HostTensor(weight_dt, {c.D});
    };
    n.q_weight = weights();
    n.q_weight.fill_uniform(rng, unit_offset ? -0.5 : 0.5, unit_offset ? 0.5 : 1.5);
    if (c.has_k) {
        n.k_weight = weights();
        n.k_weight.fill_uniform(rng, unit_offset ? -0.5 : 0.5, unit_offset ? 0.5 : 1.5);
    }
    if (c.backward) {
        n.q_input = HostTensor(c.dt, p.t[kQ].shape());
        n.q_input.fill_uniform(rng, -2, 2);
        if (c.has_k) {
            n.k_input = HostTensor(c.dt, p.t[kK].shape());
            n.k_input.fill_uniform(rng, -2, 2);
        }
        if (n.weight_grad) {
            n.q_grad = HostTensor(Dt::F32, {c.D});
            if (c.has_k) n.k_grad = HostTensor(Dt::F32, {c.D});
        }
    }
    return n;
}

inline void add_norm_args(rope_jit_rope_args& args, const NormTensors& n,
                          const std::vector<const DLTensor*>& views) {
    args.q_norm_weight = views[kQWeight];
    args.k_norm_weight = views[kKWeight];
    args.q_norm_input = views[kQInput];
    args.k_norm_input = views[kKInput];
    args.q_norm_weight_grad = views[kQGrad];
    args.k_norm_weight_grad = views[kKGrad];
    args.norm_eps = n.eps;
    args.norm_unit_offset = n.unit_offset;
}

inline double norm_tolerance(const Spec& c) {
    return c.dt == Dt::F32 ? 3e-5 : c.dt == Dt::F16 ? 3e-3 : 1.6e-2;
}

constexpr uint32_t kNormSeed = 20261203;
constexpr uint32_t kNormFamilies = 48;

// One call of the sweep: a random rope problem (no xPos; a third proportional, some D576)
// with random norm weights (float32, bfloat16 or float16, plain or unit offset; in a quarter of
// the families strided views, which the kernel reads element by element) and, in the backward,
// usually the weight gradients.
struct NormFamily {
    Problem problem;
    NormTensors norm;
};

inline NormFamily norm_family(uint32_t family) {
    std::mt19937 rng(kNormSeed + family);
    Spec c = random_spec(rng);
    c.xpos = false;
    c.out_as_same_view = false;
    if (family % 3 == 0) {  // proportional pairs over a quarter of the head
        c.proportional = true, c.interleaved = false, c.offset = 0;
        c.R = std::max<int64_t>(2, c.D / 4 - c.D / 4 % 2);
    }
    if (family % 8 == 5) {
        c.D = 576;
        c.R = c.proportional ? 144 : 576;
        c.offset = 0;
    }
    c.rotary_dim_zero = c.R == c.D && c.rotary_dim_zero;
    const Dt weight_dt = pick(rng, {Dt::F32, Dt::BF16, Dt::F16});
    const bool unit_offset = rng() & 1, weight_grad = rng() % 4 != 0;
    NormFamily f;
    f.problem = make_problem(c, rng);
    const int64_t weight_step = family % 4 == 3 ? 3 : 1;  // strided weights: the scalar path
    f.norm = make_norm(f.problem, weight_dt, unit_offset, weight_grad, rng, weight_step);
    return f;
}

}  // namespace gpu_rope_test
