// Kernel specs for tests that compile RoPE kernels without a GPU: a Llama-like base (bf16,
// D128, GQA 4, 16-byte vectors) and variants of it, each a change applied to a copy.
#pragma once

#include <functional>
#include <vector>

#include "ops/rope/kernel_spec.h"

namespace rope_test {

inline rope_jit::KernelSpec llama_like_kernel_spec() {
    rope_jit::KernelSpec base;
    base.dtype = 2;
    base.head_dim = base.rotary_dim = 128;
    base.has_k = 1;
    base.gqa_group = 4;
    base.vec = 8;
    base.vec_loads = 1;
    base.table_vec_loads = 1;
    return base;
}

// Collects variants of `base`: add(change) appends a copy of base with change applied, then
// `finish` (for instance a fix-up or a validation) applied to it.
class SpecVariants {
public:
    using Change = std::function<void(rope_jit::KernelSpec&)>;
    SpecVariants(const rope_jit::KernelSpec& base, Change finish = nullptr)
        : base_(base), finish_(std::move(finish)) {}
    void add(const Change& change) {
        rope_jit::KernelSpec spec = base_;
        change(spec);
        if (finish_) finish_(spec);
        specs_.push_back(spec);
    }
    const std::vector<rope_jit::KernelSpec>& specs() const { return specs_; }

private:
    rope_jit::KernelSpec base_;
    Change finish_;
    std::vector<rope_jit::KernelSpec> specs_;
};

}  // namespace rope_test
