#include "api/attention_args.h"

#include <cstddef>

#include "common/versioned_struct.h"

namespace rope_jit {

rope_jit_attention_args read_attention_args(const rope_jit_attention_args* args) {
    rope_jit_attention_args read = read_versioned(args, rope_jit_attention_args_init, "args");
    if (args->struct_size <
        offsetof(rope_jit_attention_args, deterministic) + sizeof read.deterministic)
        read.deterministic = 1;
    return read;
}

}  // namespace rope_jit
