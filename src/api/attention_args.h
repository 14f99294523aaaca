// The caller's rope_jit_attention_args as this library reads them: read_versioned's copy, plus
// the one field whose default depends on the caller's header.
#pragma once

#include "rope_jit/rope_jit.h"

namespace rope_jit {

// A copy of *args with this library's struct_size (defaults for fields the caller's struct
// lacks). A caller built before `deterministic` existed (a struct_size that ends before it)
// gets deterministic = 1: that header promised a deterministic backward. Throws
// INVALID_ARGUMENT for NULL or a malformed struct_size.
rope_jit_attention_args read_attention_args(const rope_jit_attention_args* args);

}  // namespace rope_jit
