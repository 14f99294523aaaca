// rope-jit-bench: measures RoPE through the public C API against the copy bandwidth of the
// same machine, in the same process.
//
//   rope-jit-bench [--backend auto|cpu|cuda] [--filter SUBSTRING] [--json FILE] [--quick] [--list]
//
// The suite (function `suite`) covers DESIGN.md's performance table and every axis of the API
// that changes what a call reads and writes: fp32/fp16/bf16; [B,S,H,D] buffers (passed as
// their transposed view), [B,H,S,D], and packed [T,H,D] batches with cu_seqlens of variable
// lengths; implicit and per-token positions; half and interleaved pairs; full and partial
// rotary; HF full tables, half tables and angles computed from inv_freq; forward and backward;
// in place and out of place; head_dim 64, 80, 96, 128 and 256; and a decode series (S = 1,
// B = 1..256, per-token positions, as decode engines call it).
//
// On the CUDA backend: per case the GPU time of a call from CUDA-graph replay (calls captured
// back to back once, the graph replayed: the method of DESIGN.md's performance table, with no
// launch gaps of the host's stream in it) and, for reference, from the same calls launched back
// to back on a stream; bytes moved (see make_case_data), GB/s and its fraction of a
// device-to-device copy measured here; for cases of 16 MB and more a copy of the same bytes,
// in a graph the same way; the host overhead of one call against a bare cuLaunchKernel of an
// empty kernel; the cold-compile and warm-disk-cache first-call times. Each case's first
// call goes through a second runtime with debug_checks, so its positions and cu_seqlens are
// checked against the table before any kernel reads them. On the CPU backend: the same cases
// against memcpy of the same bytes. A case that fails is reported and the others still run
// (unless the CUDA context is lost); the exit status is then 1.
//
// --filter runs only the cases whose name contains SUBSTRING (or any of several, comma-separated), --quick only the first of them,
// --list prints them without running; --json writes the results to FILE.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cuda/cuda_driver.h"
#include "common/half_float.h"
#include "jit/nvrtc_compiler.h"
#include "rope_jit/rope_jit.h"

namespace {

using Clock = std::chrono::steady_clock;
using rope_jit::check_cu;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
}

// ---- Cases ----------------------------------------------------------------------------

enum class DType { F32, F16, BF16 };
enum class Layout { Bshd, Bhsd, Thd };
enum class Angles { FullTable, HalfTable, InvFreq };

size_t dtype_size(DType type) {
    return type == DType::F32 ? 4 : 2;
}

const char* dtype_name(DType type) {
    return type == DType::F32 ? "float32" : type == DType::F16 ? "float16" : "bfloat16";
}

const char* dtype_short(DType type) {
    return type == DType::F32 ? "f32" : type == DType::F16 ? "f16" : "bf16";
}

DLDataType dl_dtype(DType type) {
    if (type == DType::BF16) return {kDLBfloat, 16, 1};
    return {kDLFloat, uint8_t(type == DType::F32 ? 32 : 16), 1};
}

const char* layout_name(Layout layout) {
    return layout == Layout::Bshd ? "bshd" : layout == Layout::Bhsd ? "bhsd" : "thd";
}

// The pair style as the JSON names it, and as the terminal table abbreviates it.
const char* style_name(rope_jit_style style) {
    return style == ROPE_JIT_STYLE_INTERLEAVED    ? "interleaved"
           : style == ROPE_JIT_STYLE_PROPORTIONAL ? "proportional"
                                                  : "half";
}
const char* style_short(rope_jit_style style) {
    return style == ROPE_JIT_STYLE_INTERLEAVED    ? "intl"
           : style == ROPE_JIT_STYLE_PROPORTIONAL ? "prop"
                                                  : "half";
}

const char* angles_name(Angles angles) {
    return angles == Angles::FullTable   ? "full_table"
           : angles == Angles::HalfTable ? "half_table"
                                         : "inv_freq";
}

// One benchmark case. B, S, Hq, Hk and D as in the C API; a packed case holds B sequences of
// variable lengths that average S tokens, T = B * S tokens in all.
struct Case {
    Case(std::string case_name, int64_t batch, int64_t seqlen, int64_t heads_q, int64_t heads_k,
         int64_t head_dim)
        : name(std::move(case_name)), B(batch), S(seqlen), Hq(heads_q), Hk(heads_k), D(head_dim) {}

    std::string name;
    int64_t B, S, Hq, Hk, D;
    Layout layout = Layout::Bshd;
    DType dtype = DType::BF16;
    rope_jit_style style = ROPE_JIT_STYLE_HALF;
    int64_t rotary_dim = 0;  // 0 = D
    bool indices = false;    // per-token positions [B, S] ([T] packed); else implicit
    int index_bits = 64;     // of positions and cu_seqlens
    Angles angles = Angles::FullTable;
    DType angle_dtype = DType::BF16;  // of the cos/sin tables or of inv_freq
    bool backward = false;
    bool in_place = true;
    bool qk_norm = false;  // RMSNorm of every head (weights [D] in the tensors' dtype) first
    // KV cache write (issue 23): k rotated and v copied into paged NHD caches of 16-token
    // blocks at slot_mapping (token t at slot t), float8 e4m3fn with scales when kv_fp8.
    bool kv_cache = false, kv_fp8 = false;

    int64_t rotary() const { return rotary_dim == 0 ? D : rotary_dim; }
    bool packed() const { return layout == Layout::Thd; }

    // Modifiers, so the suite reads one line per case.
    Case& as(Layout value) {
        layout = value;
        return *this;
    }
    // Tables in the tensors' dtype, as HF casts cos/sin to the activations'.
    Case& typed(DType value) {
        dtype = angle_dtype = value;
        return *this;
    }
    Case& interleaved() {
        style = ROPE_JIT_STYLE_INTERLEAVED;
        return *this;
    }
    // Gemma-4's partial rotary: R features rotated in pairs (i, i + D/2).
    Case& proportional(int64_t rotated) {
        style = ROPE_JIT_STYLE_PROPORTIONAL;
        rotary_dim = rotated;
        return *this;
    }
    Case& normed() {
        qk_norm = true;
        return *this;
    }
    Case& paged_kv(bool fp8) {
        kv_cache = true;
        kv_fp8 = fp8;
        return *this;
    }
    Case& partial(int64_t rotated) {
        rotary_dim = rotated;
        return *this;
    }
    Case& with_indices(int bits = 64) {
        indices = true;
        index_bits = bits;
        return *this;
    }
    Case& angles_from(Angles source, DType type) {
        angles = source;
        angle_dtype = type;
        return *this;
    }
    Case& bwd() {
        backward = true;
        return *this;
    }
    Case& out_of_place() {
        in_place = false;
        return *this;
    }
};

std::vector<Case> suite() {
    const auto llama = [](const char* name) { return Case(name, 4, 4096, 32, 8, 128); };
    const auto packed = [](const char* name) {
        return Case(name, 16, 1024, 32, 8, 128).as(Layout::Thd);
    };
    const auto decode = [](const char* name, int64_t batch) {
        return Case(name, batch, 1, 32, 8, 128).with_indices();
    };
    return {
        // The first seven keep their names and shapes: earlier results are compared by name.
        llama("llama3-8b prefill"),
        llama("llama3-8b prefill bwd").bwd(),
        llama("llama3-8b prefill bhsd").as(Layout::Bhsd),
        Case("long context", 1, 32768, 32, 8, 128),
        Case("D64 MHA", 8, 2048, 16, 16, 64),
        Case("D256", 2, 4096, 16, 8, 256),
        Case("decode B=64", 64, 1, 32, 8, 128),
        // Layouts, dtypes, directions and outputs, on the llama3-8b prefill (335 MB in bf16).
        llama("llama3-8b prefill bhsd bwd").as(Layout::Bhsd).bwd(),
        llama("llama3-8b fp32").typed(DType::F32),
        llama("llama3-8b fp32 bwd").typed(DType::F32).bwd(),
        llama("llama3-8b fp16").typed(DType::F16),
        llama("llama3-8b fp16 out of place").typed(DType::F16).out_of_place(),
        llama("llama3-8b out of place").out_of_place(),
        llama("llama3-8b out of place bwd").out_of_place().bwd(),
        // Positions and angle sources.
        llama("llama3-8b positions").with_indices(),
        llama("llama3-8b positions bhsd bwd").with_indices().as(Layout::Bhsd).bwd(),
        llama("llama3-8b inv_freq").angles_from(Angles::InvFreq, DType::F32),
        llama("llama3-8b inv_freq bwd").angles_from(Angles::InvFreq, DType::F32).bwd(),
        llama("llama3-8b half table f32").angles_from(Angles::HalfTable, DType::F32),
        // Interleaved pairs: HF-style full table (pair i in column 2i), flash-attn's half table.
        llama("llama3-8b interleaved").interleaved(),
        llama("llama3-8b interleaved half f32")
            .interleaved()
            .angles_from(Angles::HalfTable, DType::F32),
        // Packed variable-length batches: 16 sequences of 256..1792 tokens, T = 16384.
        packed("packed varlen"),
        packed("packed varlen positions").with_indices(),
        packed("packed varlen bwd out of place").bwd().out_of_place(),
        packed("packed varlen int32 positions").with_indices(32),
        // Head dims 64, 80, 96, 256, and the partial rotary of real models.
        Case("D64 MHA bwd", 8, 2048, 16, 16, 64).bwd(),
        Case("D64 bhsd interleaved", 8, 2048, 16, 16, 64).as(Layout::Bhsd).interleaved(),
        Case("D80 MHA", 4, 4096, 32, 32, 80),
        Case("phi-2 partial 32/80", 4, 4096, 32, 32, 80).partial(32),
        Case("phi-2 partial 32/80 out of place", 4, 4096, 32, 32, 80).partial(32).out_of_place(),
        Case("D96 MHA", 4, 4096, 32, 32, 96),
        Case("gpt-neox-20b partial 24/96", 8, 2048, 64, 64, 96).partial(24),
        Case("gpt-neox-20b partial 24/96 out of place", 8, 2048, 64, 64, 96)
            .partial(24)
            .out_of_place(),
        Case("gpt-j-6b partial 64/256", 8, 2048, 16, 16, 256).partial(64).interleaved(),
        Case("gpt-j-6b partial 64/256 out of place", 8, 2048, 16, 16, 256)
            .partial(64)
            .interleaved()
            .out_of_place(),
        // More partial rotary out of place, for the bulk path's rule (RopePlan::bulk_rows):
        // StableLM-3B's 20 of 80, Persimmon-8B's 32 of 64, ChatGLM2-6B's interleaved 64 of 128
        // (2 kv heads), half and interleaved pairs at 128 features, GPT-NeoX in f32 (384-byte
        // rows).
        Case("stablelm-3b partial 20/80 out of place", 4, 4096, 32, 32, 80)
            .partial(20)
            .out_of_place(),
        Case("persimmon-8b partial 32/64 out of place", 8, 2048, 64, 64, 64)
            .partial(32)
            .out_of_place(),
        Case("chatglm2-6b partial 64/128 out of place", 4, 4096, 32, 2, 128)
            .partial(64)
            .interleaved()
            .out_of_place(),
        Case("D128 partial 64/128 out of place", 4, 4096, 32, 8, 128).partial(64).out_of_place(),
        Case("D128 interleaved partial 32/128 out of place", 4, 4096, 32, 8, 128)
            .partial(32)
            .interleaved()
            .out_of_place(),
        Case("gpt-neox-20b fp32 partial 24/96 out of place", 8, 2048, 64, 64, 96)
            .typed(DType::F32)
            .partial(24)
            .out_of_place(),
        Case("D256 bwd", 2, 4096, 16, 8, 256).bwd(),
        // Decode: one new token per sequence at its own position ([B, 1] int64 indices).
        decode("decode B=1 positions", 1),
        decode("decode B=8 positions", 8),
        decode("decode B=64 positions", 64),
        decode("decode B=256 positions", 256),
        // Fusions (issue 23): QK-norm before the rotation (Qwen3-8B), Gemma-4's proportional
        // partial rotary (128 of head_dim 512).
        llama("qwen3-8b qk-norm prefill").normed(),
        decode("decode B=64 qk-norm", 64).normed(),
        // RoPE + paged KV cache write (NHD, slot_mapping) + FP8 caches in one launch.
        llama("llama3-8b prefill paged kv fp8").paged_kv(true),
        decode("decode B=64 paged kv fp8", 64).paged_kv(true),
        decode("decode B=64 qk-norm paged kv fp8", 64).normed().paged_kv(true),
        llama("qwen3-8b prefill qk-norm paged kv fp8").normed().paged_kv(true),
        Case("gemma-4 proportional 128/512", 2, 4096, 16, 8, 512).proportional(128),
        Case("gemma-4 proportional 128/512 out of place", 2, 4096, 16, 8, 512)
            .proportional(128)
            .out_of_place(),
    };
}

// ---- What a case reads and writes -----------------------------------------------------

// DRAM moves 32-byte sectors: a read or write of part of a sector moves all of it.
constexpr int64_t kSectorBytes = 32;

// Bytes moved for the span [begin, end) of every row of `pitch` bytes. When rows start on
// sector boundaries (pitch a multiple of 32: every q/k row here, cuMemAlloc being 256-byte
// aligned) the span is rounded out to whole sectors; otherwise rows share sectors and the span
// itself is counted.
double span_bytes(int64_t begin, int64_t end, int64_t pitch) {
    if (pitch % kSectorBytes != 0) return double(end - begin);
    const int64_t first = begin / kSectorBytes, last = (end + kSectorBytes - 1) / kSectorBytes;
    return double((last - first) * kSectorBytes);
}

// The host side of a case: its sequences, index and angle data in the bytes the device gets
// (the same on both backends), and the traffic one call must move.
struct CaseData {
    int64_t tokens = 0;  // B * S (= T when packed)
    int64_t max_seqlen = 0;
    int64_t table_rows = 0;  // P
    int64_t rows_used = 0;   // distinct table rows the tokens use
    std::vector<char> cos, sin, inv_freq, positions, cu_seqlens;
    std::vector<char> norm_weights;  // QK-norm: q's [D] weights, then k's
    std::vector<char> slot_mapping;  // KV cache: int64 [tokens], token t at slot t
    double qk_bytes = 0, table_bytes = 0, index_bytes = 0;

    double bytes() const { return qk_bytes + table_bytes + index_bytes; }
};

void store_float(std::vector<char>& bytes, size_t index, DType type, double value) {
    if (type == DType::F32) {
        const float f = float(value);
        std::memcpy(bytes.data() + index * 4, &f, 4);
        return;
    }
    const uint16_t h = type == DType::F16 ? rope_jit::float_to_fp16(float(value))
                                          : rope_jit::float_to_bf16(float(value));
    std::memcpy(bytes.data() + index * 2, &h, 2);
}

void store_index(std::vector<char>& bytes, size_t index, int bits, int64_t value) {
    if (bits == 64) {
        std::memcpy(bytes.data() + index * 8, &value, 8);
    } else {
        const int32_t narrow = int32_t(value);
        std::memcpy(bytes.data() + index * 4, &narrow, 4);
    }
}

// Builds the data of a case and counts its bytes. The rule, per call:
//   q and k: every (token, head) row is read and written once. Out of place the whole row of D
//     features moves (rotated pairs and the copied unrotated features, read from q, written to
//     q_out). In place only the rotated features [0, R) are read and written (proportional
//     pairs: [0, R/2) and [D/2, D/2 + R/2)); the others are not touched (rounded out to 32-byte
//     sectors, which matters for GPT-NeoX's 24 of 96). With QK-norm every feature changes: the
//     whole row moves, and the two weight vectors are read once.
//   cos and sin: each distinct table row the tokens use is read once (later reads of a row hit
//     the caches), and of it only the columns read: R/2 of a half table [P, R/2]; the first
//     R/2 of a full table [P, R] with half-style pairs (pair i in column i); all R of a full
//     table with interleaved pairs (pair i in column 2i: the odd columns share the sectors).
//   inv_freq: its R/2 values, nothing per token.
//   positions and cu_seqlens: every element, once.
// Positions stay inside the table: P = max(longest sequence, 4096) rows; per-token positions
// are each sequence's tokens at consecutive rows from a random start that fits (so a
// prefill of S = P tokens is an arange, a decode token a random row).
CaseData make_case_data(const Case& c) {
    CaseData d;
    const int64_t rotary = c.rotary(), pairs = rotary / 2;
    std::mt19937_64 random(0x5eed);  // fixed: both machines build the same case
    const auto below = [&](int64_t n) { return int64_t(random() % uint64_t(n)); };

    // Sequence lengths: S each; packed, pairs of sequences of S + x and S - x (|x| <= 3S/4),
    // so lengths vary from S/4 to 7S/4 and still sum to T = B * S.
    std::vector<int64_t> lengths(size_t(c.B), c.S);
    if (c.packed()) {
        const int64_t spread = 3 * c.S / 4;
        for (size_t b = 0; b + 1 < lengths.size(); b += 2) {
            const int64_t x = below(2 * spread + 1) - spread;
            lengths[b] = c.S + x;
            lengths[b + 1] = c.S - x;
        }
    }
    d.tokens = c.B * c.S;
    d.max_seqlen = *std::max_element(lengths.begin(), lengths.end());
    d.table_rows = std::max<int64_t>(d.max_seqlen, 4096);

    if (c.packed()) {
        d.cu_seqlens.resize(size_t(c.B + 1) * size_t(c.index_bits / 8));
        int64_t end = 0;
        store_index(d.cu_seqlens, 0, c.index_bits, 0);
        for (size_t b = 0; b < lengths.size(); ++b) {
            end += lengths[b];
            store_index(d.cu_seqlens, b + 1, c.index_bits, end);
        }
        if (end != d.tokens) throw std::logic_error(c.name + ": sequence lengths do not sum to T");
    }

    std::vector<char> used(size_t(d.table_rows), 0);
    if (c.indices) {
        // [B, S] row-major, or [T] packed: either way token s of sequence b is element
        // (start of b) + s, sequences in order.
        d.positions.resize(size_t(d.tokens) * size_t(c.index_bits / 8));
        size_t token = 0;
        for (const int64_t length : lengths) {
            const int64_t first = below(d.table_rows - length + 1);
            for (int64_t s = 0; s < length; ++s, ++token) {
                store_index(d.positions, token, c.index_bits, first + s);
                used[size_t(first + s)] = 1;
            }
        }
        if (int64_t(token) != d.tokens)
            throw std::logic_error(c.name + ": positions do not cover every token");
    } else {
        // Implicit: token s of every sequence uses row s.
        std::fill(used.begin(), used.begin() + d.max_seqlen, char(1));
    }
    d.rows_used = std::count(used.begin(), used.end(), char(1));

    // Angles: the usual inverse frequencies (base 10000), real cos/sin values, so rotating in
    // place over and over keeps values normal (no denormal slow paths on the CPU).
    std::vector<double> inv_freq(static_cast<size_t>(pairs));
    for (int64_t i = 0; i < pairs; ++i)
        inv_freq[size_t(i)] = std::pow(10000.0, -2.0 * double(i) / double(rotary));
    const int64_t angle_size = int64_t(dtype_size(c.angle_dtype));
    if (c.angles == Angles::InvFreq) {
        d.inv_freq.resize(size_t(pairs * angle_size));
        for (int64_t i = 0; i < pairs; ++i)
            store_float(d.inv_freq, size_t(i), c.angle_dtype, inv_freq[size_t(i)]);
        d.table_bytes = double(pairs * angle_size);
    } else {
        const bool half = c.angles == Angles::HalfTable;
        const bool interleaved = c.style == ROPE_JIT_STYLE_INTERLEAVED;
        const int64_t columns = half ? pairs : rotary;
        d.cos.resize(size_t(d.table_rows * columns * angle_size));
        d.sin.resize(d.cos.size());
        for (int64_t p = 0; p < d.table_rows; ++p)
            for (int64_t column = 0; column < columns; ++column) {
                const int64_t pair = half ? column : interleaved ? column / 2 : column % pairs;
                const double angle = double(p) * inv_freq[size_t(pair)];
                store_float(d.cos, size_t(p * columns + column), c.angle_dtype, std::cos(angle));
                store_float(d.sin, size_t(p * columns + column), c.angle_dtype, std::sin(angle));
            }
        const int64_t pitch = columns * angle_size;
        const int64_t read = !half && !interleaved ? pairs * angle_size : pitch;
        d.table_bytes = 2.0 * double(d.rows_used) * span_bytes(0, read, pitch);
    }

    const int64_t element = int64_t(dtype_size(c.dtype));
    const double rows = double(d.tokens) * double(c.Hq + c.Hk);
    const int64_t pitch = c.D * element;
    double row_bytes = double(pitch);
    if (c.in_place && !c.qk_norm)
        row_bytes = c.style == ROPE_JIT_STYLE_PROPORTIONAL
                        ? span_bytes(0, pairs * element, pitch) +
                              span_bytes(c.D / 2 * element, (c.D / 2 + pairs) * element, pitch)
                        : span_bytes(0, rotary * element, pitch);
    d.qk_bytes = 2.0 * rows * row_bytes;
    if (c.kv_cache) {
        // q as above; k read whole (it is not written) and its rotated row written to the
        // cache; v read and written to its cache; the slots read once.
        const double k_rows = double(d.tokens) * double(c.Hk);
        const int64_t cache_element = c.kv_fp8 ? 1 : element;
        d.qk_bytes = 2.0 * double(d.tokens) * double(c.Hq) * row_bytes +
                     2.0 * k_rows * double(pitch + c.D * cache_element);
        d.slot_mapping.resize(size_t(d.tokens) * 8);
        for (int64_t t = 0; t < d.tokens; ++t) store_index(d.slot_mapping, size_t(t), 64, t);
        d.index_bytes += double(d.slot_mapping.size());
    }
    if (c.qk_norm) {
        d.norm_weights.resize(size_t(2 * c.D * element));
        for (int64_t i = 0; i < 2 * c.D; ++i)
            store_float(d.norm_weights, size_t(i), c.dtype, 1.0 + 0.01 * double(i % 7));
        d.table_bytes += double(d.norm_weights.size());
    }
    d.index_bytes += double(d.positions.size() + d.cu_seqlens.size());
    return d;
}

// ---- Buffers and tensors --------------------------------------------------------------

// Where a case's buffers live: host memory, or device memory (below). Buffers stay valid as
// long as the Memory.
class Memory {
public:
    virtual ~Memory() = default;
    // A buffer of `bytes` bytes, each set to `byte`.
    virtual void* filled(size_t bytes, unsigned char byte) = 0;
    // A buffer holding a copy of `host`.
    virtual void* copy_of(const std::vector<char>& host) = 0;
    // Returns when every buffer holds its contents.
    virtual void ready() {}
    virtual DLDevice device() const = 0;
};

class HostMemory final : public Memory {
public:
    void* filled(size_t bytes, unsigned char byte) override {
        std::unique_ptr<char[]> buffer(new char[std::max<size_t>(bytes, 1)]);
        std::memset(buffer.get(), byte, bytes);
        buffers_.push_back(std::move(buffer));
        return buffers_.back().get();
    }
    void* copy_of(const std::vector<char>& host) override {
        void* buffer = filled(host.size(), 0);
        std::memcpy(buffer, host.data(), host.size());
        return buffer;
    }
    DLDevice device() const override { return {kDLCPU, 0}; }

private:
    std::vector<std::unique_ptr<char[]>> buffers_;
};

// Elements a strided view spans, first to last (every dimension non-empty).
size_t extent_elements(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
    int64_t last = 0;
    for (size_t i = 0; i < shape.size(); ++i) last += (shape[i] - 1) * strides[i];
    return size_t(last + 1);
}

// The DLTensors and arguments of one case over buffers from `memory`. Not copyable or movable:
// the arguments point at the tensors and the tensors at the shape vectors.
class CaseTensors {
public:
    CaseTensors(const Case& c, const CaseData& d, Memory& memory, void* stream) {
        const int64_t rotary = c.rotary();
        const DLDevice device = memory.device();
        const DLDataType type = dl_dtype(c.dtype);
        const size_t element = dtype_size(c.dtype);

        // q and k: [B, H, S, D] views of [B, S, H, D] or [B, H, S, D] buffers, or [T, H, D].
        const auto view = [&](int64_t heads, std::vector<int64_t>& shape,
                              std::vector<int64_t>& strides) {
            const int64_t S = c.S, D = c.D;
            switch (c.layout) {
                case Layout::Bshd:
                    shape = {c.B, heads, S, D};
                    strides = {S * heads * D, D, heads * D, 1};
                    break;
                case Layout::Bhsd:
                    shape = {c.B, heads, S, D};
                    strides = {heads * S * D, S * D, D, 1};
                    break;
                case Layout::Thd:
                    shape = {d.tokens, heads, D};
                    strides = {heads * D, D, 1};
                    break;
            }
        };
        view(c.Hq, q_shape_, q_strides_);
        view(c.Hk, k_shape_, k_strides_);
        const size_t q_bytes = extent_elements(q_shape_, q_strides_) * element;
        const size_t k_bytes = extent_elements(k_shape_, k_strides_) * element;
        q_bytes_ = q_bytes;
        k_bytes_ = k_bytes;
        const int ndim = int(q_shape_.size());
        // 0x3c bytes: about 0.0115 in bf16 and fp32, 1.06 in fp16.
        q_ = {memory.filled(q_bytes, 0x3c),
              device,
              ndim,
              type,
              q_shape_.data(),
              q_strides_.data(),
              0};
        k_ = {memory.filled(k_bytes, 0x3c),
              device,
              ndim,
              type,
              k_shape_.data(),
              k_strides_.data(),
              0};
        if (!c.in_place) {
            q_out_ = {memory.filled(q_bytes, 0), device, ndim, type, q_shape_.data(),
                      q_strides_.data(),         0};
            k_out_ = {memory.filled(k_bytes, 0), device, ndim, type, k_shape_.data(),
                      k_strides_.data(),         0};
        }

        const DLDataType angle_type = dl_dtype(c.angle_dtype);
        const size_t angle_size = dtype_size(c.angle_dtype);
        if (c.angles == Angles::InvFreq) {
            freq_shape_ = {rotary / 2};
            expect_bytes(d.inv_freq, size_t(rotary / 2) * angle_size, "inv_freq");
            inv_freq_ = {memory.copy_of(d.inv_freq), device,  1, angle_type,
                         freq_shape_.data(),         nullptr, 0};
        } else {
            table_shape_ = {d.table_rows, c.angles == Angles::HalfTable ? rotary / 2 : rotary};
            expect_bytes(d.cos, size_t(table_shape_[0] * table_shape_[1]) * angle_size, "cos");
            expect_bytes(d.sin, d.cos.size(), "sin");
            cos_ = {memory.copy_of(d.cos), device, 2, angle_type, table_shape_.data(), nullptr, 0};
            sin_ = {memory.copy_of(d.sin), device, 2, angle_type, table_shape_.data(), nullptr, 0};
        }
        const DLDataType index_type{kDLInt, uint8_t(c.index_bits), 1};
        const size_t index_size = size_t(c.index_bits / 8);
        if (c.indices) {
            if (c.packed())
                positions_shape_ = {d.tokens};
            else
                positions_shape_ = {c.B, c.S};
            expect_bytes(d.positions, size_t(d.tokens) * index_size, "positions");
            positions_ = {memory.copy_of(d.positions),
                          device,
                          int(positions_shape_.size()),
                          index_type,
                          positions_shape_.data(),
                          nullptr,
                          0};
        }
        if (c.packed()) {
            cu_shape_ = {c.B + 1};
            expect_bytes(d.cu_seqlens, size_t(c.B + 1) * index_size, "cu_seqlens");
            cu_seqlens_ = {
                memory.copy_of(d.cu_seqlens), device, 1, index_type, cu_shape_.data(), nullptr, 0};
        }
        if (c.qk_norm) {
            weight_shape_ = {c.D};
            expect_bytes(d.norm_weights, size_t(2 * c.D) * element, "norm weights");
            char* weights = static_cast<char*>(memory.copy_of(d.norm_weights));
            q_norm_weight_ = {weights, device, 1, type, weight_shape_.data(), nullptr, 0};
            k_norm_weight_ = {weights + c.D * element, device,  1, type,
                              weight_shape_.data(),    nullptr, 0};
        }
        if (c.kv_cache) {
            // v like k; caches [blocks, 16, Hk, D]; scales 1.
            v_ = k_;
            v_.data = memory.filled(k_bytes, 0x3c);
            const int64_t block = 16, blocks = (d.tokens + block - 1) / block;
            cache_shape_ = {blocks, block, c.Hk, c.D};
            const DLDataType cache_type =
                c.kv_fp8 ? DLDataType{ROPE_JIT_DLPACK_FLOAT8_E4M3FN, 8, 1} : type;
            const size_t cache_bytes =
                size_t(blocks * block * c.Hk * c.D) * (c.kv_fp8 ? 1 : element);
            k_cache_ = {memory.filled(cache_bytes, 0), device,  4, cache_type,
                        cache_shape_.data(),           nullptr, 0};
            v_cache_ = {memory.filled(cache_bytes, 0), device,  4, cache_type,
                        cache_shape_.data(),           nullptr, 0};
            slots_shape_ = {d.tokens};
            expect_bytes(d.slot_mapping, size_t(d.tokens) * 8, "slot_mapping");
            slot_mapping_ = {memory.copy_of(d.slot_mapping),
                             device,
                             1,
                             DLDataType{kDLInt, 64, 1},
                             slots_shape_.data(),
                             nullptr,
                             0};
            scale_shape_ = {1};
            std::vector<char> one(4);
            const float unit = 1.0f;
            std::memcpy(one.data(), &unit, 4);
            scale_ = {memory.copy_of(one), device,  1, DLDataType{kDLFloat, 32, 1},
                      scale_shape_.data(), nullptr, 0};
        }
        memory.ready();

        rope_jit_rope_args_init(&args_);
        args_.q = &q_;
        args_.k = &k_;
        if (!c.in_place) {
            args_.q_out = &q_out_;
            args_.k_out = &k_out_;
        }
        if (c.angles == Angles::InvFreq) {
            args_.inv_freq = &inv_freq_;
        } else {
            args_.cos = &cos_;
            args_.sin = &sin_;
        }
        if (c.indices) args_.positions = &positions_;
        if (c.packed()) args_.cu_seqlens = &cu_seqlens_;
        if (c.qk_norm) {
            args_.q_norm_weight = &q_norm_weight_;
            args_.k_norm_weight = &k_norm_weight_;
        }
        if (c.kv_cache) {
            args_.kv_layout = ROPE_JIT_KV_CACHE_PAGED_NHD;
            args_.v = &v_;
            args_.k_cache = &k_cache_;
            args_.v_cache = &v_cache_;
            args_.slot_mapping = &slot_mapping_;
            args_.k_out = nullptr;  // k goes to the cache
            if (c.kv_fp8) args_.k_scale = args_.v_scale = &scale_;
        }
        args_.rotary_dim = c.rotary_dim == 0 ? 0 : int32_t(c.rotary_dim);
        args_.style = c.style;
        args_.backward = c.backward ? 1 : 0;
        args_.stream = stream;
    }
    CaseTensors(const CaseTensors&) = delete;
    CaseTensors& operator=(const CaseTensors&) = delete;

    const rope_jit_rope_args* args() const { return &args_; }
    // The q and k buffers, whole.
    void* q_data() const { return q_.data; }
    void* k_data() const { return k_.data; }
    size_t q_bytes() const { return q_bytes_; }
    size_t k_bytes() const { return k_bytes_; }

private:
    static void expect_bytes(const std::vector<char>& data, size_t bytes, const char* what) {
        if (data.size() != bytes)
            throw std::logic_error(fmt::format("{}: {} bytes of data for a tensor of {} bytes",
                                               what, data.size(), bytes));
    }

    std::vector<int64_t> q_shape_, q_strides_, k_shape_, k_strides_, table_shape_, freq_shape_,
        positions_shape_, cu_shape_, weight_shape_, cache_shape_, slots_shape_, scale_shape_;
    size_t q_bytes_ = 0, k_bytes_ = 0;
    DLTensor q_{}, k_{}, q_out_{}, k_out_{}, cos_{}, sin_{}, inv_freq_{}, positions_{},
        cu_seqlens_{}, q_norm_weight_{}, k_norm_weight_{}, v_{}, k_cache_{}, v_cache_{},
        slot_mapping_{}, scale_{};
    rope_jit_rope_args args_{};
};

// ---- Options, runtimes, reporting -----------------------------------------------------

struct Options {
    rope_jit_backend_kind backend = ROPE_JIT_BACKEND_AUTO;
    std::string json_path;
    std::string filter;
    bool quick = false;
    bool list = false;
    bool help = false;
};

constexpr const char* kUsage =
    "usage: rope-jit-bench [--backend auto|cpu|cuda] [--filter SUBSTRING] [--json FILE] [--quick] "
    "[--list] [--help]";

constexpr const char* kHelp =
    "Measures RoPE through the C API against the copy bandwidth of this machine, in one process.\n"
    "  --backend B     auto (default), cpu or cuda\n"
    "  --filter S      only the cases whose name contains S (or any of several, comma-separated)\n"
    "  --json FILE     also write the results to FILE as JSON\n"
    "  --quick         only the first selected case\n"
    "  --list          print the cases without running them\n"
    "  --help, -h      print this help\n"
    "Exit status: 0 success, 1 a case or an argument failed.";

Options parse(int argc, char** argv) {
    Options options;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::runtime_error(arg + ": missing value\n" + kUsage);
            return argv[++i];
        };
        if (arg == "--backend") {
            const std::string v = value();
            if (v == "cpu")
                options.backend = ROPE_JIT_BACKEND_CPU;
            else if (v == "cuda")
                options.backend = ROPE_JIT_BACKEND_CUDA;
            else if (v == "auto")
                options.backend = ROPE_JIT_BACKEND_AUTO;
            else
                throw std::runtime_error("--backend: expected auto, cpu or cuda, got " + v);
        } else if (arg == "--json") {
            options.json_path = value();
        } else if (arg == "--filter") {
            options.filter = value();
        } else if (arg == "--quick") {
            options.quick = true;
        } else if (arg == "--list") {
            options.list = true;
        } else if (arg == "--help" || arg == "-h") {
            options.help = true;
        } else {
            throw std::runtime_error("unknown argument " + arg + "\n" + kUsage);
        }
    }
    return options;
}

std::vector<Case> selected_cases(const Options& options) {
    std::vector<Case> all = suite();
    std::set<std::string> names;
    for (const Case& c : all)
        if (!names.insert(c.name).second) throw std::logic_error("two cases are named " + c.name);
    // Comma-separated substrings: a case runs when its name contains any of them.
    std::vector<std::string> wanted;
    for (size_t start = 0;;) {
        const size_t comma = options.filter.find(',', start);
        wanted.push_back(options.filter.substr(
            start, comma == std::string::npos ? std::string::npos : comma - start));
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    std::vector<Case> cases;
    for (const Case& c : all)
        if (std::any_of(wanted.begin(), wanted.end(),
                        [&](const std::string& w) { return c.name.find(w) != std::string::npos; }))
            cases.push_back(c);
    if (cases.empty())
        throw std::runtime_error("no case name contains '" + options.filter +
                                 "' (--list shows them)");
    if (options.quick) cases.erase(cases.begin() + 1, cases.end());
    return cases;
}

void require_ok(rope_jit_status status, const char* what) {
    if (status != ROPE_JIT_OK)
        throw std::runtime_error(
            fmt::format("{}: {}: {}", what, rope_jit_status_name(status), rope_jit_last_error()));
}

// programmatic_launch: rope_jit_config.programmatic_launch (default: the library's).
rope_jit_runtime* make_runtime(rope_jit_backend_kind backend, const char* cache_dir,
                               bool debug_checks = false,
                               int programmatic_launch = ROPE_JIT_PROGRAMMATIC_AUTO) {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = backend;
    config.cache_dir = cache_dir;
    config.debug_checks = debug_checks ? 1 : 0;
    config.programmatic_launch = programmatic_launch;
    rope_jit_runtime* runtime = nullptr;
    require_ok(rope_jit_runtime_create(&config, &runtime), "rope_jit_runtime_create");
    return runtime;
}

std::string positions_name(const Case& c) {
    if (!c.indices) return "implicit";
    return c.packed() ? "indices [T]" : "indices [B,S]";
}

nlohmann::json case_json(const Case& c, const CaseData& d, double seconds, double copy_gbps) {
    const double bytes = d.bytes();
    const double gbps = bytes / seconds / 1e9;
    nlohmann::json j = {
        {"name", c.name},
        {"B", c.B},
        {"S", c.S},
        {"Hq", c.Hq},
        {"Hk", c.Hk},
        {"D", c.D},
        {"layout", layout_name(c.layout)},
        {"dtype", dtype_name(c.dtype)},
        {"direction", c.backward ? "backward" : "forward"},
        {"time_us", seconds * 1e6},
        {"bytes", bytes},
        {"gbps", gbps},
        {"fraction_of_copy", gbps / copy_gbps},
        {"style", style_name(c.style)},
        {"qk_norm", c.qk_norm},
        {"kv_cache", c.kv_cache ? (c.kv_fp8 ? "paged-nhd-fp8" : "paged-nhd") : "none"},
        {"rotary_dim", c.rotary()},
        {"positions", positions_name(c)},
        {"angles", angles_name(c.angles)},
        {"angle_dtype", dtype_name(c.angle_dtype)},
        {"in_place", c.in_place},
        {"varlen", c.packed()},
        {"tokens", d.tokens},
        {"table_rows", d.table_rows},
        {"table_rows_used", d.rows_used},
        {"bytes_qk", d.qk_bytes},
        {"bytes_angles", d.table_bytes},
        {"bytes_indices", d.index_bytes}};
    if (c.packed()) j["max_seqlen"] = d.max_seqlen;
    if (c.indices || c.packed()) j["index_dtype"] = c.index_bits == 64 ? "int64" : "int32";
    return j;
}

// The terminal table. Compact columns: type = q/k dtype; pair = half, intl(eaved),
// prop(ortional) or norm (QK-norm, then half pairs);
// pos = impl(icit) or the index dtype of per-token positions; angles = full/half table or
// invf (inv_freq) and their dtype; mem = in place or out of place.
size_t name_width(const std::vector<Case>& cases) {
    size_t width = 4;
    for (const Case& c : cases) width = std::max(width, c.name.size());
    return width;
}

void print_header(size_t width) {
    fmt::print(
        "{:<{}} {:>9} {:>5} {:>4} {:>4} {:<4} {:<4} {:<4} {:<4} {:<9} {:<3} {:<3} {:>11} {:>8} "
        "{:>8} {:>7} {:>7}\n",
        "case", width, "BxS", "Hq/Hk", "D", "R", "type", "lay", "pair", "pos", "angles", "dir",
        "mem", "time us", "MB", "GB/s", "of copy", "stream");
}

void print_case(const Case& c, size_t width, const std::string& tail) {
    const std::string angles = fmt::format("{}.{}",
                                           c.angles == Angles::FullTable   ? "full"
                                           : c.angles == Angles::HalfTable ? "half"
                                                                           : "invf",
                                           dtype_short(c.angle_dtype));
    fmt::print("{:<{}} {:>9} {:>5} {:>4} {:>4} {:<4} {:<4} {:<4} {:<4} {:<9} {:<3} {:<3} {}\n",
               c.name, width, fmt::format("{}x{}", c.B, c.S), fmt::format("{}/{}", c.Hq, c.Hk), c.D,
               c.rotary(), dtype_short(c.dtype), layout_name(c.layout),
               c.qk_norm ? "norm" : style_short(c.style),
               c.indices ? (c.index_bits == 64 ? "i64" : "i32") : "impl", angles,
               c.backward ? "bwd" : "fwd", c.in_place ? "in" : "out", tail);
    std::fflush(stdout);
}

// Three decimals for the small (decode) cases, one for the rest.
std::string megabytes(double bytes) {
    return fmt::format("{:.{}f}", bytes / 1e6, bytes < 1e7 ? 3 : 1);
}

// On CUDA, time us and of copy come from graph replay, stream is the fraction of copy of the
// same calls back to back on a stream.
void print_result(const Case& c, size_t width, const nlohmann::json& j) {
    const std::string stream =
        j.contains("stream_fraction_of_copy")
            ? fmt::format("{:.3f}", j["stream_fraction_of_copy"].get<double>())
            : "-";
    print_case(c, width,
               fmt::format("{:>11.2f} {:>8} {:>8.1f} {:>7.3f} {:>7}", j["time_us"].get<double>(),
                           megabytes(j["bytes"].get<double>()), j["gbps"].get<double>(),
                           j["fraction_of_copy"].get<double>(), stream));
}

nlohmann::json case_error(const Case& c, size_t width, const std::exception& e) {
    print_case(c, width, std::string("FAILED: ") + e.what());
    return {{"name", c.name}, {"error", e.what()}};
}

// ---- CPU ------------------------------------------------------------------------------

// Repetitions that make one timed trial last about 2 ms, given one run's time.
int repetitions(double seconds) {
    return int(std::clamp(std::ceil(2e-3 / std::max(seconds, 1e-9)), 1.0, 10000.0));
}

nlohmann::json bench_cpu(const std::vector<Case>& cases) {
    rope_jit_runtime* runtime = make_runtime(ROPE_JIT_BACKEND_CPU, nullptr);
    nlohmann::json results = nlohmann::json::array(), errors = nlohmann::json::array();
    const size_t width = name_width(cases);
    fmt::print("backend cpu: RoPE against memcpy of the same bytes, same process\n");
    print_header(width);
    for (const Case& c : cases) {
        try {
            const CaseData data = make_case_data(c);
            HostMemory memory;
            CaseTensors tensors(c, data, memory, nullptr);
            // Warm-up (worker pool, pages); the CPU backend also checks every position here.
            Clock::time_point start = Clock::now();
            require_ok(rope_jit_rope(runtime, tensors.args()), "rope_jit_rope");
            const int repeat = repetitions(seconds_since(start));
            // memcpy of half the bytes: as many read and written as the call moves.
            const size_t copy_bytes = std::max<size_t>(1, size_t(data.bytes() / 2));
            std::vector<char> copy_src(copy_bytes, 1), copy_dst(copy_bytes, 2);
            const auto copy = [&] {
                std::memcpy(copy_dst.data(), copy_src.data(), copy_bytes);
                asm volatile("" : : "r"(copy_dst.data()) : "memory");  // the copy is not dead code
            };
            start = Clock::now();
            copy();
            const int copy_repeat = repetitions(seconds_since(start));
            std::vector<double> rope_times, copy_times;
            for (int trial = 0; trial < 5; ++trial) {
                start = Clock::now();
                for (int i = 0; i < repeat; ++i)
                    require_ok(rope_jit_rope(runtime, tensors.args()), "rope_jit_rope");
                rope_times.push_back(seconds_since(start) / repeat);
                start = Clock::now();
                for (int i = 0; i < copy_repeat; ++i) copy();
                copy_times.push_back(seconds_since(start) / copy_repeat);
            }
            const double copy_gbps = 2.0 * double(copy_bytes) / median(copy_times) / 1e9;
            nlohmann::json j = case_json(c, data, median(rope_times), copy_gbps);
            j["copy_gbps"] = copy_gbps;
            print_result(c, width, j);
            results.push_back(j);
        } catch (const std::exception& e) {
            errors.push_back(case_error(c, width, e));
        }
    }
    rope_jit_runtime_free(runtime);
    nlohmann::json result = {{"backend", "cpu"}, {"cases", results}};
    if (!errors.empty()) result["errors"] = errors;
    return result;
}

// ---- CUDA -----------------------------------------------------------------------------

const rope_jit::CudaDriverApi& driver() {
    return *rope_jit::cuda_driver_api();
}

// One cuMemAlloc, freed with the object.
class DeviceBuffer {
public:
    explicit DeviceBuffer(size_t bytes) {
        check_cu(driver().cuMemAlloc(&pointer_, std::max<size_t>(bytes, 1)), "cuMemAlloc");
    }
    ~DeviceBuffer() { driver().cuMemFree(pointer_); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    rope_jit::CUdeviceptr pointer() const { return pointer_; }
    void* get() const { return reinterpret_cast<void*>(pointer_); }

private:
    rope_jit::CUdeviceptr pointer_ = 0;
};

// Device memory of the current context (device 0). Fills and uploads run on the legacy
// default stream, which the benchmark's non-blocking stream does not wait for, and an upload
// from pageable memory may return before the data lands: ready() waits for all of them, so no
// kernel reads indices that are not there yet.
class DeviceMemory final : public Memory {
public:
    ~DeviceMemory() override {
        // Nothing may still use the buffers when they are freed (an exception may have left
        // launches queued). Errors are ignored here: the caller checks the context.
        driver().cuCtxSynchronize();
    }
    void* filled(size_t bytes, unsigned char byte) override {
        auto buffer = std::make_unique<DeviceBuffer>(bytes);
        if (bytes > 0) check_cu(driver().cuMemsetD8(buffer->pointer(), byte, bytes), "cuMemsetD8");
        buffers_.push_back(std::move(buffer));
        return buffers_.back()->get();
    }
    void* copy_of(const std::vector<char>& host) override {
        auto buffer = std::make_unique<DeviceBuffer>(host.size());
        if (!host.empty())
            check_cu(driver().cuMemcpyHtoD(buffer->pointer(), host.data(), host.size()),
                     "cuMemcpyHtoD");
        buffers_.push_back(std::move(buffer));
        return buffers_.back()->get();
    }
    void ready() override { check_cu(driver().cuCtxSynchronize(), "cuCtxSynchronize"); }
    DLDevice device() const override { return {kDLCUDA, 0}; }

private:
    std::vector<std::unique_ptr<DeviceBuffer>> buffers_;
};

// Median seconds per repetition of `body` on `stream`, by events around `repeat` launches.
double time_on_stream(rope_jit::CUstream stream, int repeat, const std::function<void()>& body) {
    const rope_jit::CudaDriverApi& api = driver();
    rope_jit::CUevent start, stop;
    check_cu(api.cuEventCreate(&start, rope_jit::CU_EVENT_DEFAULT), "cuEventCreate");
    check_cu(api.cuEventCreate(&stop, rope_jit::CU_EVENT_DEFAULT), "cuEventCreate");
    std::vector<double> trials;
    try {
        for (int i = 0; i < 3; ++i) body();  // warm-up
        for (int trial = 0; trial < 7; ++trial) {
            check_cu(api.cuEventRecord(start, stream), "cuEventRecord");
            for (int i = 0; i < repeat; ++i) body();
            check_cu(api.cuEventRecord(stop, stream), "cuEventRecord");
            check_cu(api.cuEventSynchronize(stop), "cuEventSynchronize");
            float ms = 0;
            check_cu(api.cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime");
            trials.push_back(double(ms) / 1e3 / repeat);
        }
    } catch (...) {
        api.cuEventDestroy(start);
        api.cuEventDestroy(stop);
        throw;
    }
    api.cuEventDestroy(start);
    api.cuEventDestroy(stop);
    return median(trials);
}

// GPU seconds of one call from CUDA-graph replay: `calls` calls of `enqueue` (each enqueues one
// call on `stream`, throwing on failure) captured once, the graph replayed; the median of
// time_on_stream's trials. The capture ends whatever happens, so that the stream stays usable.
double graph_seconds_per_call(rope_jit::CUstream stream, int calls,
                              const std::function<void()>& enqueue) {
    const rope_jit::CudaDriverApi& api = driver();
    rope_jit::CUgraph graph = nullptr;
    rope_jit::CUgraphExec graph_exec = nullptr;
    check_cu(api.cuStreamBeginCapture(stream, rope_jit::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
             "cuStreamBeginCapture");
    try {
        for (int i = 0; i < calls; ++i) enqueue();
    } catch (...) {
        if (api.cuStreamEndCapture(stream, &graph) == rope_jit::CUDA_SUCCESS && graph != nullptr)
            api.cuGraphDestroy(graph);
        throw;
    }
    check_cu(api.cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
    double seconds = 0;
    try {
        check_cu(api.cuGraphInstantiate(&graph_exec, graph, 0), "cuGraphInstantiate");
        seconds = time_on_stream(
                      stream, 5,
                      [&] { check_cu(api.cuGraphLaunch(graph_exec, stream), "cuGraphLaunch"); }) /
                  calls;
        check_cu(api.cuStreamSynchronize(stream), "cuStreamSynchronize");
    } catch (...) {
        if (graph_exec != nullptr) api.cuGraphExecDestroy(graph_exec);
        api.cuGraphDestroy(graph);
        throw;
    }
    api.cuGraphExecDestroy(graph_exec);
    api.cuGraphDestroy(graph);
    return seconds;
}

// Microseconds of one RoPE call inside a CUDA graph of 100 calls, as decode loops run it.
double graph_us_per_call(rope_jit::CUstream stream, rope_jit_runtime* runtime,
                         const rope_jit_rope_args* args) {
    return graph_seconds_per_call(
               stream, 100,
               [&] { require_ok(rope_jit_rope(runtime, args), "rope_jit_rope (captured)"); }) *
           1e6;
}

// A kernel of the bench's own, compiled for device 0 and loaded into the current context;
// unloaded with the object.
class CompiledKernel {
public:
    CompiledKernel(const char* source, const char* name) {
        const rope_jit::CompileResult compiled = rope_jit::compile_cuda(
            source, std::string(name) + ".cu", rope_jit::cuda_device_target(0), {});
        check_cu(driver().cuModuleLoadData(&module_, compiled.binary.data()), "cuModuleLoadData");
        check_cu(driver().cuModuleGetFunction(&function_, module_, name), "cuModuleGetFunction");
    }
    ~CompiledKernel() { driver().cuModuleUnload(module_); }
    CompiledKernel(const CompiledKernel&) = delete;
    CompiledKernel& operator=(const CompiledKernel&) = delete;

    rope_jit::CUfunction function() const { return function_; }

private:
    rope_jit::CUmodule module_ = nullptr;
    rope_jit::CUfunction function_ = nullptr;
};

// The bandwidth a partial in-place call's access pattern allows on this device: a kernel that
// reads and writes back, unchanged and in place, the same span of every head row (the rotary
// features) with 16-byte accesses and no arithmetic. A RoPE call reaching this kernel's
// bandwidth is limited by its access pattern, not by its own work.
class SpanCopy {
public:
    SpanCopy()
        : kernel_(R"(
struct alignas(16) V { unsigned w[4]; };
extern "C" __global__ void span_copy(char* rows, long long n_rows, long long pitch, int chunks) {
    const long long n = n_rows * chunks;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / chunks;
        V* at = reinterpret_cast<V*>(rows + row * pitch) + (i - row * chunks);
        V v = *at;
        // Opaque to the compiler, so that the store of what was loaded is not dropped.
        asm volatile("" : "+r"(v.w[0]), "+r"(v.w[1]), "+r"(v.w[2]), "+r"(v.w[3]));
        *at = v;
    }
})",
                  "span_copy") {}

    // Seconds per pass over q's and k's rows (median, on `stream`), or a negative value when
    // the span is not made of aligned 16-byte chunks.
    double seconds(const Case& c, const CaseTensors& tensors, rope_jit::CUstream stream) const {
        const int64_t element = int64_t(dtype_size(c.dtype));
        const int64_t pitch = c.D * element, span = c.rotary() * element;
        if (pitch % 16 != 0 || span % 16 != 0) return -1;
        const auto launch = [&](void* data, size_t bytes) {
            long long n_rows = (long long)(bytes / size_t(pitch)), row_pitch = pitch;
            int chunks =
                int(span / 16);  // the rotary features start each row (no case has an offset)
            void* args[] = {&data, &n_rows, &row_pitch, &chunks};
            const long long work = n_rows * chunks;
            const unsigned blocks = unsigned(std::min<long long>((work + 255) / 256, 1 << 20));
            check_cu(driver().cuLaunchKernel(kernel_.function(), blocks, 1, 1, 256, 1, 1, 0, stream,
                                             args, nullptr),
                     "cuLaunchKernel(span_copy)");
        };
        return graph_seconds_per_call(stream, 20, [&] {
            launch(tensors.q_data(), tensors.q_bytes());
            launch(tensors.k_data(), tensors.k_bytes());
        });
    }

private:
    CompiledKernel kernel_;
};

void add_stats(const rope_jit_runtime* runtime, uint64_t& compiles, double& compile_ms) {
    rope_jit_stats stats;
    rope_jit_stats_init(&stats);
    if (rope_jit_get_stats(runtime, &stats) != ROPE_JIT_OK) return;
    compiles += stats.compiles;
    compile_ms += stats.compile_ms;
}

nlohmann::json bench_cuda(const std::vector<Case>& cases) {
    const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api();
    if (api == nullptr)
        throw std::runtime_error("no CUDA driver: " + rope_jit::cuda_driver_load_error());
    rope_jit::CUdevice device = 0;
    check_cu(api->cuDeviceGet(&device, 0), "cuDeviceGet");
    rope_jit::CUcontext context = nullptr;
    check_cu(api->cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
    check_cu(api->cuCtxSetCurrent(context), "cuCtxSetCurrent");
    char name[256] = {};
    api->cuDeviceGetName(name, sizeof name, device);
    rope_jit::CUstream stream = nullptr;
    check_cu(api->cuStreamCreate(&stream, rope_jit::CU_STREAM_NON_BLOCKING), "cuStreamCreate");

    // Copy bandwidth: device-to-device copies of 2 GiB, counting bytes read and written.
    double copy_gbps;
    {
        const size_t bytes = size_t(2) << 30;
        DeviceMemory memory;
        const auto src = reinterpret_cast<rope_jit::CUdeviceptr>(memory.filled(bytes, 0x3c));
        const auto dst = reinterpret_cast<rope_jit::CUdeviceptr>(memory.filled(bytes, 0));
        memory.ready();
        const double seconds = time_on_stream(
            nullptr, 5, [&] { check_cu(api->cuMemcpyDtoD(dst, src, bytes), "cuMemcpyDtoD"); });
        copy_gbps = 2.0 * double(bytes) / seconds / 1e9;
    }
    fmt::print("backend cuda on {}: device copy bandwidth {:.1f} GB/s (read + write)\n", name,
               copy_gbps);

    char cache_template[] = "/tmp/rope_jit_bench_cache_XXXXXX";
    if (mkdtemp(cache_template) == nullptr) throw std::runtime_error("mkdtemp failed");
    const std::string cache_dir = cache_template;
    rope_jit_runtime* runtime = make_runtime(ROPE_JIT_BACKEND_CUDA, cache_dir.c_str());

    // The decode call of the host-overhead and graph timings below, also the first call of
    // the process: a cold compile (empty cache), then the first call of a second runtime on
    // the same cache directory, which loads the kernel from disk. Implicit positions: nothing
    // a kernel reads is left unchecked.
    const Case decode("decode B=1 S=1 32/8 D128 bf16", 1, 1, 32, 8, 128);
    const CaseData decode_data = make_case_data(decode);
    DeviceMemory decode_memory;
    const CaseTensors decode_tensors(decode, decode_data, decode_memory, stream);
    const rope_jit_rope_args* decode_args = decode_tensors.args();
    nlohmann::json jit = {{"case", decode.name}};
    {
        Clock::time_point start = Clock::now();
        require_ok(rope_jit_rope(runtime, decode_args), "rope_jit_rope");
        check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
        jit["cold_first_call_ms"] = seconds_since(start) * 1e3;
        rope_jit_runtime* warm = make_runtime(ROPE_JIT_BACKEND_CUDA, cache_dir.c_str());
        start = Clock::now();
        const rope_jit_status status = rope_jit_rope(warm, decode_args);
        const rope_jit::CUresult synced = api->cuStreamSynchronize(stream);
        jit["warm_cache_first_call_ms"] = seconds_since(start) * 1e3;
        rope_jit_runtime_free(warm);
        require_ok(status, "rope_jit_rope");
        check_cu(synced, "cuStreamSynchronize");
    }

    // Every case's first call runs on this runtime: debug_checks copies positions and
    // cu_seqlens to the host and checks them against the table before the kernel runs (and
    // compiles the kernel, which the timed runtime then loads from disk).
    rope_jit_runtime* checked = make_runtime(ROPE_JIT_BACKEND_CUDA, cache_dir.c_str(), true);
    // The timed runtime launches as the library does by default (ROPE_JIT_PROGRAMMATIC_AUTO:
    // programmatic dependent launches on sm_90 under CUDA 12.3 and later); decode and prefill
    // cases are also timed with plain launches (the same kernels).
    rope_jit_runtime* plain =
        make_runtime(ROPE_JIT_BACKEND_CUDA, cache_dir.c_str(), false, ROPE_JIT_PROGRAMMATIC_OFF);
    const SpanCopy span_copy;
    nlohmann::json results = nlohmann::json::array(), errors = nlohmann::json::array();
    bool context_lost = false;
    const size_t width = name_width(cases);
    print_header(width);
    for (const Case& c : cases) {
        try {
            const CaseData data = make_case_data(c);
            DeviceMemory memory;
            const CaseTensors tensors(c, data, memory, stream);
            require_ok(rope_jit_rope(checked, tensors.args()), "rope_jit_rope (debug checks)");
            check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
            // Calls back to back on the stream first (their warm-up loads the kernel, which a
            // capture must not do), then the same calls replayed from a graph: the case's time.
            // A call that cannot be captured is an error of the case; its time is then the
            // stream's.
            const int repeat = data.bytes() < 16e6 ? 100 : 20;
            const auto call = [&] {
                require_ok(rope_jit_rope(runtime, tensors.args()), "rope_jit_rope");
            };
            const double stream_seconds = time_on_stream(stream, repeat, call);
            check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
            double seconds = stream_seconds;
            std::string graph_error;
            try {
                seconds = graph_seconds_per_call(stream, repeat, call);
            } catch (const std::exception& e) {
                graph_error = e.what();
            }
            nlohmann::json j = case_json(c, data, seconds, copy_gbps);
            j["stream_time_us"] = stream_seconds * 1e6;
            j["stream_fraction_of_copy"] = data.bytes() / stream_seconds / 1e9 / copy_gbps;
            if (!graph_error.empty()) {
                j["graph_error"] = graph_error;
                errors.push_back({{"name", c.name}, {"error", "graph capture: " + graph_error}});
                fmt::print("{:>{}} graph capture failed ({}): time from the stream\n", "", width,
                           graph_error);
            }
            print_result(c, width, j);
            if (data.bytes() >= 16e6) {
                // A device copy of the same bytes (half read, half written) in the same process:
                // what a kernel of this length can reach (launch, ramp and tail included), the
                // limit the 2 GiB copy above does not show for kernels of 30-100 us. Its size is
                // rounded up to whole 64 KiB: captured in a graph, the copies whose size was not
                // a multiple of 4 KiB ran at 0.64 of copy, those of whole 16 KiB at 0.94-1.00
                // (run FC: the packed varlen, inv_freq and QK-norm cases), a slow path of the
                // copy, not the limit of the kernel's length. The bytes added (under 0.8% at
                // 16 MB) count in its bandwidth.
                const size_t unit = size_t(64) << 10;
                const size_t half = (size_t(data.bytes() / 2) + unit - 1) / unit * unit;
                const auto src = reinterpret_cast<rope_jit::CUdeviceptr>(memory.filled(half, 0x3c));
                const auto dst = reinterpret_cast<rope_jit::CUdeviceptr>(memory.filled(half, 0));
                memory.ready();
                const double same_seconds = graph_seconds_per_call(stream, repeat, [&] {
                    check_cu(api->cuMemcpyDtoDAsync(dst, src, half, stream), "cuMemcpyDtoDAsync");
                });
                const double same_gbps = 2.0 * double(half) / same_seconds / 1e9;
                j["same_size_copy_gbps"] = same_gbps;
                j["same_size_copy_fraction_of_copy"] = same_gbps / copy_gbps;
                j["fraction_of_same_size_copy"] = j["gbps"].get<double>() / same_gbps;
                fmt::print("{:>{}} copy of the same bytes: {:.3f} of copy; RoPE at {:.3f} of it\n",
                           "", width, same_gbps / copy_gbps,
                           j["fraction_of_same_size_copy"].get<double>());
                // The same calls as plain launches (ROPE_JIT_PROGRAMMATIC_OFF), captured and
                // replayed the same way: what the default's programmatic launches gain where
                // they are taken (each kernel's launch and set-up overlap the end of the call
                // before it; issue 24's D64 and D256 cases last 34-50 us).
                const auto plain_call = [&] {
                    require_ok(rope_jit_rope(plain, tensors.args()), "rope_jit_rope (plain)");
                };
                plain_call();  // loads the kernel, which a capture must not do
                const double plain_seconds = graph_seconds_per_call(stream, repeat, plain_call);
                const double plain_gbps = data.bytes() / plain_seconds / 1e9;
                j["plain_time_us"] = plain_seconds * 1e6;
                j["plain_fraction_of_copy"] = plain_gbps / copy_gbps;
                fmt::print("{:>{}} as plain launches: {:.2f} us, {:.3f} of copy\n", "", width,
                           plain_seconds * 1e6, plain_gbps / copy_gbps);
            }
            if (c.S == 1 && !c.packed()) {
                // Decode: the case's time, its GPU time per call inside a CUDA graph (the
                // issue 23 bar: <= 2.5 us for QK-norm + RoPE + paged KV + FP8 at B = 64).
                const double graph_us = seconds * 1e6;
                j["us_per_call_in_graph"] = graph_us;
                // The same calls as plain launches (ROPE_JIT_PROGRAMMATIC_OFF): what the
                // default's programmatic launches gain where they are taken (each call's launch
                // and set-up overlap the end of the call before it).
                require_ok(rope_jit_rope(plain, tensors.args()), "rope_jit_rope (plain)");
                const double plain_us = graph_us_per_call(stream, plain, tensors.args());
                j["us_per_call_in_graph_plain"] = plain_us;
                fmt::print("{:>{}} in a CUDA graph: {:.2f} us per call; {:.2f} us as plain "
                           "launches\n",
                           "", width, graph_us, plain_us);
            }
            if (c.in_place && c.rotary() < c.D) {
                const double span_seconds = span_copy.seconds(c, tensors, stream);
                if (span_seconds > 0) {
                    const double span_gbps = data.qk_bytes / span_seconds / 1e9;
                    j["span_copy_gbps"] = span_gbps;
                    j["span_copy_fraction_of_copy"] = span_gbps / copy_gbps;
                    j["fraction_of_span_copy"] = j["gbps"].get<double>() / span_gbps;
                    fmt::print(
                        "{:>{}} in-place copy of the same spans: {:.1f} GB/s, {:.3f} of copy; RoPE "
                        "at {:.3f} of it\n",
                        "", width, span_gbps, span_gbps / copy_gbps,
                        j["fraction_of_span_copy"].get<double>());
                }
            }
            results.push_back(j);
        } catch (const std::exception& e) {
            errors.push_back(case_error(c, width, e));
            // A fault in a kernel poisons the context: every later call would fail too.
            if (api->cuCtxSynchronize() != rope_jit::CUDA_SUCCESS) {
                context_lost = true;
                fmt::print(
                    "the CUDA context is lost; the remaining cases and timings are skipped\n");
                break;
            }
        }
    }

    nlohmann::json result = {{"backend", "cuda"},
                             {"device", name},
                             {"copy_gbps", copy_gbps},
                             {"cases", results},
                             {"jit", jit}};
    if (!context_lost) {
        try {
            // Host overhead: wall time per call of many back-to-back decode calls, against a
            // bare cuLaunchKernel of an empty kernel, both on the same stream.
            const CompiledKernel empty("extern \"C\" __global__ void empty_kernel() {}",
                                       "empty_kernel");
            auto host_time = [&](const std::function<void()>& call) {
                std::vector<double> trials;
                for (int trial = 0; trial < 5; ++trial) {
                    check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
                    const int calls = 2000;
                    Clock::time_point start = Clock::now();
                    for (int i = 0; i < calls; ++i) call();
                    trials.push_back(seconds_since(start) / calls);
                }
                check_cu(api->cuStreamSynchronize(stream), "cuStreamSynchronize");
                return median(trials) * 1e6;
            };
            const double rope_us =
                host_time([&] { require_ok(rope_jit_rope(runtime, decode_args), "rope"); });
            const double empty_us = host_time([&] {
                check_cu(api->cuLaunchKernel(empty.function(), 1, 1, 1, 32, 1, 1, 0, stream,
                                             nullptr, nullptr),
                         "cuLaunchKernel");
            });
            const double decode_stream_us =
                time_on_stream(stream, 200,
                               [&] { require_ok(rope_jit_rope(runtime, decode_args), "rope"); }) *
                1e6;
            // Inside a CUDA graph, as decode loops run: 100 calls captured once, the graph replayed.
            const double decode_gpu_us = graph_us_per_call(stream, runtime, decode_args);
            fmt::print(
                "host overhead per call: rope {:.2f} us, bare empty cuLaunchKernel {:.2f} us "
                "(+{:.2f} us)\n",
                rope_us, empty_us, rope_us - empty_us);
            fmt::print(
                "decode B=1 S=1 32/8 D128: {:.2f} us per call inside a CUDA graph ({:.2f} us back "
                "to back on "
                "a stream)\n",
                decode_gpu_us, decode_stream_us);
            result["host_overhead_us"] = {{"rope_call", rope_us},
                                          {"empty_launch", empty_us},
                                          {"difference", rope_us - empty_us}};
            result["decode_us_per_call_in_graph"] = decode_gpu_us;
            result["decode_us_per_call_on_stream"] = decode_stream_us;

            // The launch floor of issue 21: decode B=64 (a token per sequence at its own
            // position) against an empty kernel, each 100 times in a graph captured the same
            // way; the GPU time a call adds over a launch that does nothing.
            Case decode64("decode B=64 positions", 64, 1, 32, 8, 128);
            decode64.with_indices();
            const CaseData decode64_data = make_case_data(decode64);
            DeviceMemory decode64_memory;
            const CaseTensors decode64_tensors(decode64, decode64_data, decode64_memory, stream);
            require_ok(rope_jit_rope(runtime, decode64_tensors.args()), "rope_jit_rope");
            const double decode64_us =
                graph_us_per_call(stream, runtime, decode64_tensors.args());
            const auto empty_launch = [&] {
                check_cu(api->cuLaunchKernel(empty.function(), 1, 1, 1, 32, 1, 1, 0, stream,
                                             nullptr, nullptr),
                         "cuLaunchKernel");
            };
            const double empty_graph_us = graph_seconds_per_call(stream, 100, empty_launch) * 1e6;
            fmt::print(
                "decode B=64 positions 32/8 D128: {:.2f} us per call inside a CUDA graph; an "
                "empty kernel in the same graph setup {:.2f} us (+{:.2f} us)\n",
                decode64_us, empty_graph_us, decode64_us - empty_graph_us);
            result["decode_floor"] = {{"case", "decode B=64 positions"},
                                      {"decode_us_in_graph", decode64_us},
                                      {"empty_kernel_us_in_graph", empty_graph_us},
                                      {"difference_us", decode64_us - empty_graph_us}};
        } catch (const std::exception& e) {
            fmt::print("host overhead and decode timings FAILED: {}\n", e.what());
            errors.push_back(
                nlohmann::json{{"name", "host overhead and decode timings"}, {"error", e.what()}});
        }
    }
    fmt::print(
        "first call, cold compile: {:.1f} ms; first call of a fresh runtime, warm disk cache: "
        "{:.1f} ms\n",
        jit["cold_first_call_ms"].get<double>(), jit["warm_cache_first_call_ms"].get<double>());

    uint64_t compiles = 0;
    double compile_ms = 0;
    add_stats(runtime, compiles, compile_ms);
    add_stats(checked, compiles, compile_ms);
    result["compiles"] = compiles;
    result["compile_ms"] = compile_ms;
    if (!errors.empty()) result["errors"] = errors;
    if (context_lost) result["context_lost"] = true;
    rope_jit_runtime_free(checked);
    rope_jit_runtime_free(plain);
    rope_jit_runtime_free(runtime);
    api->cuStreamDestroy(stream);
    if (std::system(("rm -rf '" + cache_dir + "'").c_str()) != 0)
        fmt::print(stderr, "could not remove {}\n", cache_dir);
    return result;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options options = parse(argc, argv);
        if (options.help) {
            fmt::print("{}\n{}\n", kUsage, kHelp);
            return 0;
        }
        const std::vector<Case> cases = selected_cases(options);
        if (options.list) {
            const size_t width = name_width(cases);
            print_header(width);
            for (const Case& c : cases) {
                const CaseData data = make_case_data(c);
                print_case(c, width, fmt::format("{:>11} {:>8}", "", megabytes(data.bytes())));
            }
            return 0;
        }
        rope_jit_runtime* probe = make_runtime(options.backend, nullptr);
        const bool cuda = rope_jit_backend(probe) == ROPE_JIT_BACKEND_CUDA;
        rope_jit_runtime_free(probe);
        nlohmann::json result = cuda ? bench_cuda(cases) : bench_cpu(cases);
        result["version"] = rope_jit_version_string();
        if (!options.filter.empty()) result["filter"] = options.filter;
        if (!options.json_path.empty()) {
            std::FILE* file = std::fopen(options.json_path.c_str(), "w");
            if (file == nullptr) throw std::runtime_error("cannot write " + options.json_path);
            fmt::print(file, "{}\n",
                       result.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
            if (std::fclose(file) != 0)
                throw std::runtime_error("cannot write " + options.json_path);
        }
        if (result.contains("errors")) {
            fmt::print(stderr, "rope-jit-bench: {} case(s) failed\n", result["errors"].size());
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rope-jit-bench: {}\n", e.what());
        return 1;
    }
}
