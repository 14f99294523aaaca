// attention-ptx-fingerprint: compiles a representative set of attention kernel specs to PTX
// with NVRTC (no GPU needed) and prints one normalized fingerprint per spec and target, so a
// refactoring of the attention templates can show that the generated code did not change.
//
//   attention-ptx-fingerprint                 prints "<target> <multiset> <text> <spec>" lines
//   attention-ptx-fingerprint --check FILE    compares with FILE (a previous output); exit 1
//                                             on any difference, naming the spec
//   attention-ptx-fingerprint --dump DIR      also writes each kernel's normalized PTX to
//                                             DIR/<n>.ptx (to diff two runs)
//   attention-ptx-fingerprint --raw DIR       writes each kernel's PTX unchanged to DIR/<n>.ptx
//                                             (for ptxas -v: registers and spills)
//
// Two fingerprints per kernel, SHA-256 over normalized PTX (comments, blank lines, the NVRTC
// version banner and module-scope .global constants dropped; virtual register numbers, label
// numbers and register-count declarations erased): "multiset" hashes the sorted lines (the
// instructions whatever their order), "text" hashes them in order. Equal multisets with different
// text mean the same instructions emitted in another order. The PTX depends on the NVRTC version,
// so a stored file is only comparable under the same NVRTC (its first line records the version).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/sha256.h"
#include "jit/kernel_source.h"
#include "jit/nvrtc_compiler.h"
#include "jit/nvrtc_loader.h"
#include "ops/attention/attention_spec.h"

using namespace rope_jit;

namespace {

using K = AttentionKernelKind;

AttentionSpec base_spec(K kind, int dtype, int head_dim, int rotary_dim, bool tensor_cores) {
    AttentionSpec s;
    s.kind = int32_t(kind);
    s.dtype = dtype;
    s.head_dim = head_dim;
    s.rotary_dim = rotary_dim;
    s.tensor_cores = tensor_cores;
    s.warps = tensor_cores ? 8 : 4;
    s.block_n = tensor_cores ? (head_dim <= 128 ? 64 : 32) : 0;
    s.write_lse = kind == K::Forward;
    return s;
}

// sm_80/sm_90 specs: every kernel body (SIMT, mma forward, dq, dk/dv) over head_dims 64, 128,
// 256 and 56/72, both pair styles, half and full tables, staged or read in place, each mask
// kind, causal, pos_mask, GQA, split dk/dv passes, two m-tiles.
std::vector<AttentionSpec> mma_and_simt_specs() {
    std::vector<AttentionSpec> specs;
    for (K kind : {K::Forward, K::BackwardDq, K::BackwardDkDv}) {
        AttentionSpec headline = base_spec(kind, 2, 128, 128, true);
        headline.causal = 1;
        headline.gqa_group = 4;
        headline.table_async = 1;
        if (kind == K::BackwardDkDv) headline.block_n = 32;
        specs.push_back(headline);
        AttentionSpec registers = base_spec(kind, 1, 64, 32, true);
        registers.interleaved = 1;
        registers.table_full = 1;
        registers.pos_mask = 1;
        registers.mask_kind = 1;
        registers.warps = 4;
        specs.push_back(registers);
        AttentionSpec full_half = base_spec(kind, 2, 64, 64, true);
        full_half.table_full = 1;
        full_half.table_dtype = 2;
        full_half.table_async = 1;
        full_half.mask_kind = 2;
        full_half.mask_dtype = 0;
        full_half.causal = 1;
        specs.push_back(full_half);
        AttentionSpec wide = base_spec(kind, 2, 256, 0, true);
        wide.mask_kind = 2;
        wide.mask_dtype = 2;
        wide.warps = 4;
        wide.block_n = 32;
        if (kind == K::BackwardDkDv) wide.compute_dk = 0;
        specs.push_back(wide);
        AttentionSpec wide_rot = base_spec(kind, 1, 256, 128, true);
        wide_rot.warps = 4;
        wide_rot.block_n = kind == K::Forward ? 64 : 16;
        wide_rot.table_async = 1;
        wide_rot.causal = 1;
        if (kind == K::BackwardDkDv) wide_rot.compute_dv = 0;
        specs.push_back(wide_rot);
        AttentionSpec odd = base_spec(kind, 2, 56, 56, true);
        odd.interleaved = 1;
        odd.warps = 4;
        odd.block_n = 32;
        odd.pos_mask = 1;
        specs.push_back(odd);
        AttentionSpec simt = base_spec(kind, 0, 72, 24, false);
        simt.pos_mask = 1;
        simt.mask_kind = 2;
        simt.causal = 1;
        simt.gqa_group = 2;
        specs.push_back(simt);
        AttentionSpec simt16 = base_spec(kind, 2, 128, 64, false);
        simt16.interleaved = 1;
        simt16.table_full = 1;
        simt16.table_dtype = 1;
        simt16.mask_kind = 1;
        specs.push_back(simt16);
        AttentionSpec simt_plain = base_spec(kind, 1, 40, 0, false);
        simt_plain.write_lse = 0;
        specs.push_back(simt_plain);
    }
    AttentionSpec two_tiles = base_spec(K::Forward, 2, 128, 128, true);
    two_tiles.m_tiles = 2;
    two_tiles.warps = 4;
    two_tiles.causal = 1;
    two_tiles.table_async = 1;
    specs.push_back(two_tiles);
    AttentionSpec two_tiles_64 = base_spec(K::Forward, 1, 64, 32, true);
    two_tiles_64.m_tiles = 2;
    two_tiles_64.interleaved = 1;
    two_tiles_64.mask_kind = 1;
    two_tiles_64.write_lse = 0;
    specs.push_back(two_tiles_64);
    AttentionSpec dk_pass = base_spec(K::BackwardDkDv, 2, 128, 128, true);
    dk_pass.pos_mask = 1;
    dk_pass.compute_dv = 0;
    dk_pass.warps = 4;
    dk_pass.block_n = 32;
    dk_pass.table_async = 1;
    specs.push_back(dk_pass);
    AttentionSpec dv_pass = dk_pass;
    dv_pass.compute_dk = 1;
    dv_pass.compute_dv = 0;
    dv_pass.pos_mask = 0;
    dv_pass.interleaved = 1;
    specs.push_back(dv_pass);
    return specs;
}

// sm_90a wgmma forwards: three and two warpgroups, 2 and 3 stages, 64- and 128-key tiles, with
// and without producer warps and clusters, head_dims 64, 128, 56 and 256.
std::vector<AttentionSpec> wgmma_specs() {
    AttentionSpec headline = base_spec(K::Forward, 2, 128, 128, true);
    headline.wgmma = 1;
    headline.warps = 12;
    headline.stages = 3;
    headline.causal = 1;
    headline.gqa_group = 4;
    headline.table_async = 1;
    AttentionSpec narrow = base_spec(K::Forward, 1, 64, 32, true);
    narrow.wgmma = 1;
    narrow.interleaved = 1;
    narrow.table_dtype = 2;
    narrow.table_async = 1;
    narrow.mask_kind = 1;
    AttentionSpec unrotated = base_spec(K::Forward, 2, 128, 0, true);
    unrotated.wgmma = 1;
    unrotated.block_n = 128;
    unrotated.mask_kind = 2;
    unrotated.mask_dtype = 2;
    unrotated.write_lse = 0;
    AttentionSpec in_place = base_spec(K::Forward, 2, 128, 64, true);  // tables read in place
    in_place.wgmma = 1;
    in_place.table_full = 1;
    in_place.causal = 1;
    AttentionSpec specialized = headline;
    specialized.warps = 8;
    specialized.producer_warps = 4;
    AttentionSpec specialized_narrow = narrow;
    specialized_narrow.warps = 4;
    specialized_narrow.producer_warps = 4;
    AttentionSpec long_keys = base_spec(K::Forward, 2, 64, 64, true);
    long_keys.wgmma = 1;
    long_keys.block_n = 128;
    long_keys.producer_warps = 4;
    long_keys.table_async = 1;
    long_keys.causal = 1;
    AttentionSpec padded = base_spec(K::Forward, 2, 56, 56, true);
    padded.wgmma = 1;
    padded.interleaved = 1;
    padded.table_async = 1;
    padded.producer_warps = 4;
    padded.stages = 3;
    AttentionSpec padded_plain = padded;
    padded_plain.producer_warps = 0;
    padded_plain.warps = 12;
    padded_plain.stages = 2;
    AttentionSpec clustered = specialized;
    clustered.cluster = 4;
    AttentionSpec clustered_narrow = specialized_narrow;
    clustered_narrow.gqa_group = 2;
    clustered_narrow.cluster = 2;
    // Keys by TMA (rotated beforehand; unrotated from k), alone and in a cluster.
    AttentionSpec keys_by_tma = specialized;
    keys_by_tma.keys_by_tma = 1;
    keys_by_tma.table_async = 0;
    AttentionSpec keys_by_tma_plain = long_keys;
    keys_by_tma_plain.keys_by_tma = 1;
    keys_by_tma_plain.rotary_dim = 0;
    AttentionSpec keys_by_tma_cluster = clustered;
    keys_by_tma_cluster.keys_by_tma = 1;
    AttentionSpec keys_by_tma_wide = keys_by_tma;  // head_dim 128 over 128-key tiles (default)
    keys_by_tma_wide.block_n = 128;
    keys_by_tma_wide.stages = 2;
    std::vector<AttentionSpec> specs = {
        keys_by_tma,  keys_by_tma_plain, keys_by_tma_cluster, keys_by_tma_wide,   headline,  narrow,
        unrotated,    in_place,          specialized,         specialized_narrow, long_keys, padded,
        padded_plain, clustered,         clustered_narrow};
    // The sm_90 backward's three kernels: the headline (GQA 4, causal, half tables), head_dim
    // 64 interleaved with an additive mask, and an unrotated head_dim 120.
    AttentionSpec wide = headline;  // head_dim 256: 64-key blocks, two stages
    wide.head_dim = wide.rotary_dim = 256;
    wide.interleaved = 1;
    for (const AttentionSpec& forward : {headline, narrow, unrotated, wide}) {
        for (K kind : {K::BackwardPrepare, K::Backward, K::BackwardDqFinish}) {
            AttentionSpec s = forward;
            s.kind = int32_t(kind);
            s.write_lse = 0;
            s.warps = 8;
            s.block_n = forward.head_dim == 256 ? 64 : 128;
            s.stages = forward.head_dim == 256 ? 2 : 3;
            s.table_async = 0;
            if (forward.mask_kind == 2) s.head_dim = 120;
            if (forward.mask_kind == 1) {
                s.mask_kind = 2;
                s.mask_dtype = 0;
            }
            specs.push_back(s);
        }
    }
    // head_dim 256 (two warpgroups loading 64-key tiles, two stages): the issue-19 shape (GQA 2,
    // causal, float32 half tables read in place, as they do not fit in shared memory), bf16
    // tables staged, and fp16 interleaved partial rotary with an additive mask.
    AttentionSpec fwd256 = base_spec(K::Forward, 2, 256, 256, true);
    fwd256.wgmma = 1;
    fwd256.block_n = 64;
    fwd256.causal = 1;
    fwd256.gqa_group = 2;
    AttentionSpec fwd256_staged = fwd256;
    fwd256_staged.table_dtype = 2;
    fwd256_staged.table_async = 1;
    AttentionSpec fwd256_partial = base_spec(K::Forward, 1, 256, 128, true);
    fwd256_partial.wgmma = 1;
    fwd256_partial.block_n = 64;
    fwd256_partial.interleaved = 1;
    fwd256_partial.table_async = 1;
    fwd256_partial.mask_kind = 2;
    fwd256_partial.mask_dtype = 2;
    fwd256_partial.write_lse = 0;
    // The default at head_dim 256 with a workspace: keys rotated beforehand, copied as values.
    AttentionSpec fwd256_prerotated = fwd256;
    fwd256_prerotated.keys_by_tma = 1;
    AttentionSpec fwd256_partial_prerotated = fwd256_partial;
    fwd256_partial_prerotated.keys_by_tma = 1;
    for (const AttentionSpec& s : {fwd256, fwd256_staged, fwd256_partial, fwd256_prerotated,
                                   fwd256_partial_prerotated})
        specs.push_back(s);
    // Experiments of the consumer schedule (off by default) on the head_dim 128 default and a
    // head_dim 64 one: warpgroups taking turns for S, for both products, registers moved to
    // the consumers, turns with the registers; a quarter of the exponentials on the FMA pipe,
    // alone and with turns for both products and the registers.
    for (const AttentionSpec& base : {keys_by_tma_wide, keys_by_tma_plain}) {
        for (int variant = 0; variant < 6; ++variant) {
            AttentionSpec s = base;
            s.pingpong = variant == 0 || variant == 3 ? 1 : variant == 1 || variant == 5 ? 2 : 0;
            s.setmaxnreg = variant == 2 || variant == 3 || variant == 5;
            s.exp2_fma = variant >= 4;
            specs.push_back(s);
        }
        AttentionSpec overlap = base;  // each warpgroup's softmax beside its O += P V
        overlap.setmaxnreg = 1;
        overlap.overlap = 1;
        overlap.stages = 3;
        specs.push_back(overlap);
    }
    return specs;
}

// Normalized PTX lines: no comments, blank lines or version banner; register and label
// numbers erased.
std::vector<std::string> normalized_lines(const std::string& ptx) {
    static const std::regex registers(R"(%([a-z]+)[0-9]+)");
    static const std::regex counts(R"(<[0-9]+>)");
    static const std::regex labels(R"(\$L__([A-Za-z]+)[0-9_]+)");
    std::vector<std::string> lines;
    std::istringstream in(ptx);
    std::string line;
    int depth = 0;  // braces open: 0 at module scope
    while (std::getline(in, line)) {
        const int opening = int(std::count(line.begin(), line.end(), '{'));
        const int closing = int(std::count(line.begin(), line.end(), '}'));
        const bool module_scope = depth == 0;
        depth += opening - closing;
        // Module-scope .global variables are the namespace-scope constexpr constants, which
        // NVRTC emits as data whether or not code reads them (code that does keeps their name
        // in its instructions); adding or renaming a constant is no change of the code.
        if (module_scope && line.rfind(".global ", 0) == 0) continue;
        const size_t first = line.find_first_not_of(" \t");
        if (first == std::string::npos) continue;
        line = line.substr(first);
        if (line.rfind("//", 0) == 0) continue;
        if (const size_t comment = line.find("//"); comment != std::string::npos)
            line.resize(comment);
        while (!line.empty() && (line.back() == ' ' || line.back() == '\t' || line.back() == '\0'))
            line.pop_back();
        if (line.empty()) continue;
        line = std::regex_replace(line, registers, "%$1");
        line = std::regex_replace(line, counts, "<N>");
        line = std::regex_replace(line, labels, "$$L__$1");
        lines.push_back(line);
    }
    return lines;
}

std::string hash_lines(const std::vector<std::string>& lines) {
    Sha256 hash;
    for (const std::string& line : lines) {
        hash.update(line);
        hash.update(std::string_view("\n", 1));
    }
    return hash.finish_hex().substr(0, 16);
}

}  // namespace

int main(int argc, char** argv) {
    std::string check, dump, raw;
    if (argc == 3 && std::string(argv[1]) == "--check") {
        check = argv[2];
    } else if (argc == 3 && std::string(argv[1]) == "--dump") {
        dump = argv[2];
    } else if (argc == 3 && std::string(argv[1]) == "--raw") {
        raw = argv[2];
    } else if (argc != 1) {
        std::cerr << "usage: attention-ptx-fingerprint [--check FILE | --dump DIR | --raw DIR]\n";
        return 2;
    }
    if (nvrtc_api() == nullptr) {
        std::cerr << "NVRTC not available: " << nvrtc_load_error() << "\n";
        return 2;
    }
    std::vector<std::pair<AttentionSpec, std::string>> jobs;
    for (const AttentionSpec& s : mma_and_simt_specs())
        for (const char* target : {"compute_80", "compute_90"}) jobs.emplace_back(s, target);
    for (const AttentionSpec& s : wgmma_specs()) jobs.emplace_back(s, "compute_90a");

    std::vector<std::string> out;
    out.push_back("nvrtc " + nvrtc_version_string());
    if (check.empty()) std::cout << out.back() << std::endl;
    for (const auto& [spec, target] : jobs) {
        spec.validate();
        const std::string source = specialize_template(spec.preamble(), "attention.cu");
        const CompileResult r = compile_cuda(source, "attention.cu", target, {}, kernel_headers());
        std::vector<std::string> lines = normalized_lines(std::string(r.binary.data()));
        const std::string text = hash_lines(lines);
        if (!raw.empty()) {  // the PTX as NVRTC wrote it (for ptxas -v)
            std::ofstream file(raw + "/" + std::to_string(out.size()) + ".ptx");
            file << r.binary.data();
        }
        if (!dump.empty()) {
            std::ofstream file(dump + "/" + std::to_string(out.size()) + ".ptx");
            for (const std::string& line : lines) file << line << "\n";
        }
        std::sort(lines.begin(), lines.end());
        out.push_back(target + " " + hash_lines(lines) + " " + text + " " + spec.to_json());
        if (check.empty()) std::cout << out.back() << std::endl;
    }
    if (check.empty()) return 0;
    std::ifstream file(check);
    std::vector<std::string> expected;
    for (std::string line; std::getline(file, line);) expected.push_back(line);
    if (expected.empty() || expected[0] != out[0]) {
        std::cerr << "fingerprints of another NVRTC (" << (expected.empty() ? "none" : expected[0])
                  << ", here " << out[0] << "): not comparable\n";
        return 2;
    }
    int differences = 0, reordered = 0;
    std::map<std::string, std::string> by_key;  // "<target> <json>" -> "<multiset> <text>"
    for (size_t i = 1; i < expected.size(); ++i) {
        std::istringstream fields(expected[i]);
        std::string target, multiset, text, json;
        fields >> target >> multiset >> text >> json;
        by_key[target + " " + json] = multiset + " " + text;
    }
    for (size_t i = 1; i < out.size(); ++i) {
        std::istringstream fields(out[i]);
        std::string target, multiset, text, json;
        fields >> target >> multiset >> text >> json;
        const auto found = by_key.find(target + " " + json);
        if (found == by_key.end()) {
            std::cout << "NEW      " << out[i] << "\n";
            ++differences;
        } else if (found->second.substr(0, 16) != multiset) {
            std::cout << "CHANGED  " << out[i] << "\n";
            ++differences;
        } else if (found->second != multiset + " " + text) {
            std::cout << "REORDER  " << out[i] << "\n";
            ++reordered;
        }
    }
    std::cout << out.size() - 1 << " kernels: " << differences << " with other instructions, "
              << reordered << " with the same instructions in another order\n";
    return differences == 0 ? 0 : 1;
}
