#include "ops/rope/rope_plan.h"

namespace rope_jit {

RopeShape rope_shape(const KernelSpec& spec) {
    RopeShape shape{};
    shape.head_dim = spec.head_dim;
    shape.rotary_dim = spec.rotary_dim;
    shape.rotary_offset = spec.rotary_offset;
    shape.vec = spec.vec;
    shape.mrope_axes = spec.mrope_axes;
    shape.interleaved = spec.interleaved != 0;
    shape.proportional = spec.proportional != 0;
    shape.has_k = spec.has_k != 0;
    shape.in_place_q = spec.in_place_q != 0;
    shape.in_place_k = spec.in_place_k != 0;
    shape.k_own_angles = spec.k_own_angles != 0;
    shape.angles_from_inv_freq = spec.angles_from_inv_freq != 0;
    shape.has_xpos = spec.has_xpos != 0;
    shape.table_full = spec.table_full != 0;
    shape.freq_grad = spec.freq_grad != 0;
    shape.v_dim = spec.v_dim;
    shape.v_vec = spec.v_vec;
    shape.qk_norm = spec.qk_norm != 0;
    shape.backward = spec.backward != 0;
    shape.kv_cache = spec.kv_cache != 0;
    shape.q_fp8 = spec.q_fp8 != 0;
    shape.dense_rows = spec.dense_rows != 0;
    return shape;
}

}  // namespace rope_jit
