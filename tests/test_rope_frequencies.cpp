// Frequency builders, angle tables, multi-section (M-RoPE) positions and the frequency
// gradient, through the public C API, each against an independent reference:
//   - HF's rope types against float32 re-statements of transformers' ROPE_INIT_FUNCTIONS
//     (torch arithmetic) and against the golden values recorded from transformers;
//   - rotary-embedding-torch's builders and tables against the golden inv_freq/cos/sin/xpos
//     recorded from it (tests/golden/ret_*);
//   - M-RoPE against Qwen2-VL's and Qwen3-VL's element-wise definitions (cos/sin selected per
//     column, rotate_half), and axial RoPE against rotary-embedding-torch's get_axial_freqs;
//   - the frequency gradient against central finite differences of a float64 forward.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "rope_test_support.h"
#include "scratch_files.h"

using namespace rope_test;

namespace {

constexpr double kPi = 3.14159265358979323846;

std::vector<float> read_golden_floats(const std::string& relative) {
    const std::string path = std::string(ROPE_JIT_TEST_DATA_DIR) + "/golden/" + relative;
    std::ifstream file(path, std::ios::binary | std::ios::ate);
    REQUIRE_MESSAGE(file.good(), "cannot open " << path);
    const std::streamsize bytes = file.tellg();
    file.seekg(0);
    std::vector<float> values(size_t(bytes) / 4);
    file.read(reinterpret_cast<char*>(values.data()), bytes);
    return values;
}

// The library's frequencies for a config; REQUIREs success.
std::vector<float> library_inv_freq(const rope_jit_freq_config& config, size_t n,
                                    float* attention = nullptr) {
    std::vector<float> inv(n, -1.0f);
    float factor = -1.0f;
    const rope_jit_status status = rope_jit_inv_freq(&config, inv.data(), n, &factor);
    CAPTURE(rope_jit_last_error());
    REQUIRE(status == ROPE_JIT_OK);
    if (attention) *attention = factor;
    return inv;
}

void check_close(const std::vector<float>& got, const std::vector<float>& expected, double rtol,
                 double atol = 0) {
    REQUIRE(got.size() == expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
        CAPTURE(i);
        CHECK(std::fabs(double(got[i]) - double(expected[i])) <=
              atol + rtol * std::fabs(double(expected[i])));
    }
}

// torch.linspace(start, end, steps) in float32: PyTorch steps from both ends towards the middle.
std::vector<float> torch_linspace(float start, float end, int steps) {
    std::vector<float> values(static_cast<size_t>(steps));
    const float step = (end - start) / float(steps - 1);
    for (int i = 0; i < steps; ++i)
        values[size_t(i)] =
            i < steps / 2 ? start + step * float(i) : end - step * float(steps - i - 1);
    return values;
}

// rotary-embedding-torch's pixel frequencies as torch computes them: linspace(1, max_freq / 2,
// n) * pi in float32.
std::vector<float> torch_pixel_freqs(float max_freq, int n) {
    std::vector<float> freqs = torch_linspace(1.0f, max_freq / 2, n);
    for (float& f : freqs) f *= float(kPi);
    return freqs;
}

rope_jit_freq_config freq_config(rope_jit_rope_type type, int32_t rotary_dim, double theta) {
    rope_jit_freq_config config;
    rope_jit_freq_config_init(&config);
    config.rope_type = type;
    config.rotary_dim = rotary_dim;
    config.theta = theta;
    return config;
}

// ------------------------------------------------------------------------------------------
// HF transformers' ROPE_INIT_FUNCTIONS, restated with torch's float32 arithmetic (tensor ops
// in float32, Python scalars in float64), for one dim.
// ------------------------------------------------------------------------------------------

// 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
std::vector<float> hf_default(double base, int dim) {
    std::vector<float> inv(static_cast<size_t>(dim / 2));
    for (int i = 0; i < dim / 2; ++i)
        inv[size_t(i)] = 1.0f / std::pow(float(base), float(2 * i) / float(dim));
    return inv;
}

std::vector<float> hf_dynamic(double base, int dim, double factor, int64_t max_pos,
                              int64_t seq_len) {
    const double length = double(std::max(seq_len, max_pos));
    base = base * std::pow(factor * length / double(max_pos) - (factor - 1),
                           double(dim) / double(dim - 2));
    return hf_default(base, dim);
}

std::vector<float> hf_yarn(double base, int dim, double factor, int64_t original, double beta_fast,
                           double beta_slow, bool truncate) {
    auto correction_dim = [&](double rotations) {
        return (dim * std::log(double(original) / (rotations * 2 * kPi))) / (2 * std::log(base));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (truncate) {
        low = std::floor(low);
        high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    std::vector<float> inv(static_cast<size_t>(dim / 2));
    for (int i = 0; i < dim / 2; ++i) {
        const float pos_freq = std::pow(float(base), float(2 * i) / float(dim));
        const float extrapolation = 1.0f / pos_freq;
        const float interpolation = 1.0f / (float(factor) * pos_freq);
        const float ramp = std::clamp((float(i) - float(low)) / float(high - low), 0.0f, 1.0f);
        const float extrapolation_factor = 1.0f - ramp;
        inv[size_t(i)] =
            interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
    return inv;
}

double hf_yarn_mscale(double scale, double mscale) {
    return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

std::vector<float> hf_llama3(double base, int dim, double factor, double low_ff, double high_ff,
                             int64_t old_context) {
    std::vector<float> inv = hf_default(base, dim);
    const double low_wavelen = double(old_context) / low_ff,
                 high_wavelen = double(old_context) / high_ff;
    for (float& f : inv) {
        const float wavelen = float(2 * kPi) / f;
        const float scaled = wavelen > low_wavelen ? f / float(factor) : f;
        const float smooth =
            (float(old_context) / wavelen - float(low_ff)) / float(high_ff - low_ff);
        const float smoothed = (1 - smooth) * scaled / float(factor) + smooth * scaled;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        f = medium ? smoothed : scaled;
    }
    return inv;
}

// Half a float32 ulp of `value` and a little more: what rounding a float64 result may move it.
double rounding_allowance_f32(double value) {
    return std::fabs(value) * std::ldexp(1.0, -24) * 1.01;
}

std::vector<float> hf_longrope(double base, int dim, const std::vector<float>& ext) {
    std::vector<float> inv(static_cast<size_t>(dim / 2));
    for (int i = 0; i < dim / 2; ++i)
        inv[size_t(i)] = 1.0f / (ext[size_t(i)] * std::pow(float(base), float(2 * i) / float(dim)));
    return inv;
}

}  // namespace

// ==========================================================================================
// Inverse frequencies
// ==========================================================================================

TEST_CASE("the HF rope types match the golden values recorded from transformers") {
    struct Golden {
        const char* name;
        rope_jit_freq_config config;
    };
    auto make = [](rope_jit_rope_type type, double theta) { return freq_config(type, 128, theta); };
    std::vector<Golden> cases;
    cases.push_back({"hf_inv_freq_default", make(ROPE_JIT_ROPE_TYPE_DEFAULT, 10000)});
    cases.push_back({"hf_inv_freq_linear", make(ROPE_JIT_ROPE_TYPE_LINEAR, 10000)});
    cases.back().config.factor = 4;
    cases.push_back({"hf_inv_freq_dynamic", make(ROPE_JIT_ROPE_TYPE_DYNAMIC, 10000)});
    cases.back().config.factor = 2;
    cases.back().config.max_position_embeddings = 32768;
    cases.back().config.seq_len = 16384;
    cases.push_back({"hf_inv_freq_yarn", make(ROPE_JIT_ROPE_TYPE_YARN, 10000)});
    cases.back().config.factor = 4;
    cases.back().config.max_position_embeddings = 32768;
    cases.back().config.original_max_position_embeddings = 4096;
    cases.push_back({"hf_inv_freq_llama3", make(ROPE_JIT_ROPE_TYPE_LLAMA3, 500000)});
    cases.back().config.factor = 8;
    cases.back().config.low_freq_factor = 1;
    cases.back().config.high_freq_factor = 4;
    cases.back().config.original_max_position_embeddings = 8192;
    cases.back().config.max_position_embeddings = 32768;

    for (const Golden& golden : cases) {
        CAPTURE(golden.name);
        float attention = 0;
        const std::vector<float> inv = library_inv_freq(golden.config, 64, &attention);
        check_close(inv, read_golden_floats(std::string(golden.name) + "/out_inv_freq.bin"), 1e-5,
                    1e-6);
        const float expected_attention =
            read_golden_floats(std::string(golden.name) + "/out_attention_factor.bin").at(0);
        CHECK(std::fabs(attention - expected_attention) <=
              1e-6 + 1e-5 * std::fabs(expected_attention));
    }
}

TEST_CASE("default, linear and dynamic NTK match transformers' formulas") {
    for (int dim : {2, 64, 96, 128}) {
        CAPTURE(dim);
        for (double theta : {10000.0, 500000.0, 1e6}) {
            CAPTURE(theta);
            check_close(library_inv_freq(freq_config(ROPE_JIT_ROPE_TYPE_DEFAULT, dim, theta),
                                         size_t(dim / 2)),
                        hf_default(theta, dim), 2e-6);
            rope_jit_freq_config linear = freq_config(ROPE_JIT_ROPE_TYPE_LINEAR, dim, theta);
            linear.factor = 2.5;
            std::vector<float> expected = hf_default(theta, dim);
            for (float& f : expected) f /= 2.5f;
            check_close(library_inv_freq(linear, size_t(dim / 2)), expected, 2e-6);
            if (dim == 2) continue;  // dynamic NTK raises to dim / (dim - 2)
            for (int64_t seq_len : {0, 1000, 4096, 5000, 70000}) {
                CAPTURE(seq_len);
                rope_jit_freq_config dynamic = freq_config(ROPE_JIT_ROPE_TYPE_DYNAMIC, dim, theta);
                dynamic.factor = 4;
                dynamic.max_position_embeddings = 4096;
                dynamic.seq_len = seq_len;
                float attention = 0;
                check_close(library_inv_freq(dynamic, size_t(dim / 2), &attention),
                            hf_dynamic(theta, dim, 4, 4096, seq_len), 4e-6);
                CHECK(attention == 1.0f);
            }
        }
    }
}

TEST_CASE("YaRN matches transformers' formula, its attention factor and its options") {
    struct YarnCase {
        double theta, factor;
        int64_t max_pos, original;
        double beta_fast, beta_slow, mscale, mscale_all_dim, attention;
        bool truncate;
        double expected_attention;
    };
    const double ln40 = std::log(40.0);
    const std::vector<YarnCase> cases = {
        {10000, 4, 32768, 4096, 0, 0, 0, 0, 0, true, 0.1 * std::log(4.0) + 1},
        {1e6, 4, 131072, 32768, 32, 1, 0, 0, 0, true, 0.1 * std::log(4.0) + 1},  // Qwen2.5 style
        {10000, 40, 163840, 4096, 32, 1, 1.0, 1.0, 0, true, 1.0},                // DeepSeek-V3
        {10000, 40, 163840, 4096, 32, 1, 0.707, 1.0, 0, true,
         (0.1 * 0.707 * ln40 + 1) / (0.1 * ln40 + 1)},
        {10000, 40, 163840, 4096, 32, 1, 1.0, 0.0, 0, true,
         0.1 * ln40 + 1},  // mscale_all_dim 0: plain
        {150000, 32, 131072, 4096, 32, 1, 0, 0, 0, false,
         0.1 * std::log(32.0) + 1},                              // gpt-oss: no truncation
        {10000, 8, 65536, 8192, 16, 2, 0, 0, 1.25, true, 1.25},  // explicit attention factor
        {10000, 0.5, 4096, 8192, 32, 1, 0, 0, 0, true, 1.0},     // factor <= 1
    };
    for (const YarnCase& c : cases) {
        for (int dim : {64, 128}) {
            CAPTURE(dim);
            CAPTURE(c.factor);
            CAPTURE(c.theta);
            CAPTURE(c.truncate);
            CAPTURE(c.mscale);
            rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_YARN, dim, c.theta);
            config.factor = c.factor;
            config.max_position_embeddings = c.max_pos;
            config.original_max_position_embeddings = c.original;
            config.beta_fast = c.beta_fast;
            config.beta_slow = c.beta_slow;
            config.mscale = c.mscale;
            config.mscale_all_dim = c.mscale_all_dim;
            config.attention_factor = c.attention;
            config.truncate = c.truncate ? 1 : 0;
            float attention = 0;
            const std::vector<float> inv = library_inv_freq(config, size_t(dim / 2), &attention);
            const double beta_fast = c.beta_fast == 0 ? 32 : c.beta_fast,
                         beta_slow = c.beta_slow == 0 ? 1 : c.beta_slow;
            check_close(
                inv, hf_yarn(c.theta, dim, c.factor, c.original, beta_fast, beta_slow, c.truncate),
                4e-6);
            CHECK(attention == doctest::Approx(c.expected_attention).epsilon(1e-6));
            CHECK(double(attention) ==
                  doctest::Approx(c.attention > 0 ? c.attention
                                  : c.mscale != 0 && c.mscale_all_dim != 0
                                      ? hf_yarn_mscale(c.factor, c.mscale) /
                                            hf_yarn_mscale(c.factor, c.mscale_all_dim)
                                      : hf_yarn_mscale(c.factor, 1))
                      .epsilon(1e-6));
        }
    }

    SUBCASE("an unset factor is max_position_embeddings / original_max_position_embeddings") {
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_YARN, 64, 10000);
        config.max_position_embeddings = 16384;
        config.original_max_position_embeddings = 2048;
        float attention = 0;
        check_close(library_inv_freq(config, 32, &attention),
                    hf_yarn(10000, 64, 8, 2048, 32, 1, true), 4e-6);
        CHECK(attention == doctest::Approx(0.1 * std::log(8.0) + 1).epsilon(1e-6));
    }
    SUBCASE("an unset original context falls back to max_position_embeddings") {
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_YARN, 64, 10000);
        config.factor = 4;
        config.max_position_embeddings = 4096;
        check_close(library_inv_freq(config, 32), hf_yarn(10000, 64, 4, 4096, 32, 1, true), 4e-6);
    }
}

TEST_CASE("Llama 3 keeps high frequencies, divides low ones and blends the band between") {
    for (int dim : {64, 128}) {
        CAPTURE(dim);
        for (double factor : {8.0, 32.0}) {
            CAPTURE(factor);
            rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_LLAMA3, dim, 500000);
            config.factor = factor;
            config.low_freq_factor = 1;
            config.high_freq_factor = 4;
            config.original_max_position_embeddings = 8192;
            const std::vector<float> inv = library_inv_freq(config, size_t(dim / 2));
            check_close(inv, hf_llama3(500000, dim, factor, 1, 4, 8192), 4e-6);
            // The bands by their definition: wavelength against 8192 / 4 and 8192 / 1.
            const std::vector<float> plain = hf_default(500000, dim);
            int high = 0, low = 0, medium = 0;
            for (size_t i = 0; i < plain.size(); ++i) {
                const double wavelength = 2 * kPi / plain[i];
                if (wavelength < 2048) {
                    CHECK(inv[i] == doctest::Approx(plain[i]).epsilon(1e-6));
                    ++high;
                } else if (wavelength > 8192) {
                    CHECK(inv[i] == doctest::Approx(plain[i] / factor).epsilon(1e-6));
                    ++low;
                } else {
                    CHECK(inv[i] < plain[i]);
                    CHECK(inv[i] > plain[i] / factor);
                    ++medium;
                }
            }
            CHECK(high > 0);
            CHECK(low > 0);
            CHECK(medium > 0);
        }
    }
}

TEST_CASE("Llama 3 takes max_position_embeddings when original_max_position_embeddings is unset") {
    // As HF does (and as YaRN and LongRoPE here did): it was refused (adversarial test,
    // session 35).
    for (const int64_t context : {int64_t(2048), int64_t(8192)}) {
        CAPTURE(context);
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_LLAMA3, 64, 500000);
        config.factor = 8;
        config.max_position_embeddings = context;
        float attention = 0;
        const std::vector<float> unset = library_inv_freq(config, 32, &attention);
        CHECK(attention == 1.0f);
        config.original_max_position_embeddings = context;
        config.max_position_embeddings = 131072;  // ignored once the original is given
        CHECK(unset == library_inv_freq(config, 32));
        check_close(unset, hf_llama3(500000, 64, 8, 1, 4, context), 4e-6);
    }
}

namespace {

// HF's "proportional" (Gemma 4) for the rotated pairs, from its definition in float64:
// theta^(-2i/head_dim) / factor for i < rotary_dim / 2.
std::vector<double> proportional_definition(double theta, int head_dim, int rotary_dim,
                                            double factor) {
    std::vector<double> inv(size_t(rotary_dim / 2));
    for (int i = 0; i < rotary_dim / 2; ++i)
        inv[size_t(i)] = 1.0 / (std::pow(theta, double(2 * i) / double(head_dim)) * factor);
    return inv;
}

}  // namespace

TEST_CASE("proportional (Gemma 4) frequencies turn the rotated pairs as a head of head_dim would") {
    struct Case {
        int head_dim, rotary_dim;
        double theta, factor;
    };
    // Gemma 4's global layers (head_dim 512, partial_rotary_factor 0.25), an odd pair count,
    // a factor, and a whole head.
    for (const Case c : {Case{512, 128, 1e6, 0}, Case{128, 38, 10000, 0}, Case{128, 64, 10000, 2},
                         Case{64, 64, 10000, 0}}) {
        CAPTURE(c.head_dim);
        CAPTURE(c.rotary_dim);
        CAPTURE(c.factor);
        rope_jit_freq_config config =
            freq_config(ROPE_JIT_ROPE_TYPE_PROPORTIONAL, c.rotary_dim, c.theta);
        config.head_dim = c.head_dim;
        config.factor = c.factor;
        float attention = 0;
        const std::vector<float> inv =
            library_inv_freq(config, size_t(c.rotary_dim / 2), &attention);
        CHECK(attention == 1.0f);
        const double factor = c.factor == 0 ? 1 : c.factor;
        const std::vector<double> expected =
            proportional_definition(c.theta, c.head_dim, c.rotary_dim, factor);
        for (size_t i = 0; i < inv.size(); ++i) {
            CAPTURE(i);
            CHECK(std::fabs(double(inv[i]) - expected[i]) <= rounding_allowance_f32(expected[i]));
        }
        // HF's float32 arithmetic: the first rotary_dim / 2 of the default type over head_dim.
        std::vector<float> hf = hf_default(c.theta, c.head_dim);
        hf.resize(inv.size());
        for (float& f : hf) f /= float(factor);
        check_close(inv, hf, 4e-6);
    }
    SUBCASE("head_dim 0 means rotary_dim: the default type's frequencies") {
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_PROPORTIONAL, 96, 10000);
        const std::vector<float> inv = library_inv_freq(config, 48);
        CHECK(inv == library_inv_freq(freq_config(ROPE_JIT_ROPE_TYPE_DEFAULT, 96, 10000), 48));
        config.head_dim = 96;
        CHECK(inv == library_inv_freq(config, 48));
    }
    SUBCASE("a caller built before head_dim gets 0, whatever lies past its struct") {
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_PROPORTIONAL, 64, 10000);
        const std::vector<float> unset = library_inv_freq(config, 32);
        config.struct_size = offsetof(rope_jit_freq_config, head_dim);
        config.head_dim = 256;  // beyond the old struct: never read
        CHECK(library_inv_freq(config, 32) == unset);
    }
}

TEST_CASE(
    "LongRoPE picks short or long factors by sequence length and derives Phi-3's attention "
    "factor") {
    const int dim = 96;  // Phi-3-mini: head_dim 96
    std::vector<float> short_factor(48), long_factor(48);
    for (int i = 0; i < 48; ++i) {
        short_factor[size_t(i)] = 1.0f + 0.02f * float(i);
        long_factor[size_t(i)] = 1.0f + 1.5f * float(i);
    }
    rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_LONGROPE, dim, 10000);
    config.short_factor = short_factor.data();
    config.long_factor = long_factor.data();
    config.max_position_embeddings = 131072;
    config.original_max_position_embeddings = 4096;
    // factor = 131072 / 4096 = 32: sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12).
    const double phi3_attention = std::sqrt(17.0 / 12.0);

    SUBCASE("no sequence length, or one within the original context: short factors") {
        for (int64_t seq_len : {0, 1, 4096}) {
            CAPTURE(seq_len);
            config.seq_len = seq_len;
            float attention = 0;
            check_close(library_inv_freq(config, 48, &attention),
                        hf_longrope(10000, dim, short_factor), 4e-6);
            CHECK(attention == doctest::Approx(phi3_attention).epsilon(1e-6));
        }
    }
    SUBCASE("beyond the original context: long factors") {
        for (int64_t seq_len : {4097, 131072}) {
            CAPTURE(seq_len);
            config.seq_len = seq_len;
            float attention = 0;
            check_close(library_inv_freq(config, 48, &attention),
                        hf_longrope(10000, dim, long_factor), 4e-6);
            CHECK(attention == doctest::Approx(phi3_attention).epsilon(1e-6));
        }
    }
    SUBCASE("an explicit factor and attention factor are used as given") {
        config.factor = 4;
        float attention = 0;
        library_inv_freq(config, 48, &attention);
        CHECK(attention ==
              doctest::Approx(std::sqrt(1 + std::log(4.0) / std::log(4096.0))).epsilon(1e-6));
        config.attention_factor = 1.1;
        library_inv_freq(config, 48, &attention);
        CHECK(attention == doctest::Approx(1.1).epsilon(1e-7));
    }
    SUBCASE("a factor of at most 1 gives attention factor 1") {
        config.max_position_embeddings = 4096;
        float attention = 0;
        library_inv_freq(config, 48, &attention);
        CHECK(attention == 1.0f);
    }
    SUBCASE("missing or non-positive factors are rejected, naming the list") {
        std::vector<float> inv(48);
        config.long_factor = nullptr;
        CHECK(rope_jit_inv_freq(&config, inv.data(), 48, nullptr) ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("long_factor") != std::string::npos);
        config.long_factor = long_factor.data();
        short_factor[7] = 0;
        CHECK(rope_jit_inv_freq(&config, inv.data(), 48, nullptr) ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("short_factor: element 7") !=
              std::string::npos);
    }
}

TEST_CASE("rotary-embedding-torch's lang, pixel and constant frequencies match the recorded ones") {
    SUBCASE("lang, theta 10000") {
        check_close(library_inv_freq(freq_config(ROPE_JIT_ROPE_TYPE_LANG, 64, 10000), 32),
                    read_golden_floats("ret_lang_d64/in_inv_freq.bin"), 1e-6);
        check_close(library_inv_freq(freq_config(ROPE_JIT_ROPE_TYPE_LANG, 32, 10000), 16),
                    read_golden_floats("ret_lang_partial_d64_r32/in_inv_freq.bin"), 1e-6);
    }
    SUBCASE("lang with theta_rescale_factor 4") {
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_LANG, 64, 10000);
        config.theta_rescale_factor = 4;
        check_close(library_inv_freq(config, 32),
                    read_golden_floats("ret_theta_rescale_interp/in_inv_freq.bin"), 2e-6);
    }
    SUBCASE("pixel with max_freq 64") {
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_PIXEL, 32, 10000);
        config.max_freq = 64;
        check_close(library_inv_freq(config, 16),
                    read_golden_floats("ret_pixel_d32/in_inv_freq.bin"), 1e-6);
    }
    SUBCASE("constant: num_freqs ones, whatever rotary_dim") {
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_CONSTANT, 0, 10000);
        config.num_freqs = 3;
        check_close(library_inv_freq(config, 3), {1.0f, 1.0f, 1.0f}, 0);
    }
}

TEST_CASE("bad frequency configs are rejected with the field named and the outputs untouched") {
    std::vector<float> inv(32, 7.0f);
    float attention = 7.0f;
    auto expect_invalid = [&](const rope_jit_freq_config* config, size_t n,
                              const std::string& needle) {
        const rope_jit_status status = rope_jit_inv_freq(config, inv.data(), n, &attention);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        for (float f : inv) CHECK(f == 7.0f);
        CHECK(attention == 7.0f);
    };
    rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_DEFAULT, 64, 10000);
    SUBCASE("NULL or uninitialized config") {
        expect_invalid(nullptr, 32, "config: NULL");
        config.struct_size = 0;
        expect_invalid(&config, 32, "struct_size");
    }
    SUBCASE("wrong n") {
        expect_invalid(&config, 31, "n: expected rotary_dim / 2 = 32");
    }
    SUBCASE("odd rotary_dim") {
        config.rotary_dim = 63;
        expect_invalid(&config, 31, "rotary_dim: must be even");
    }
    SUBCASE("bad theta") {
        config.theta = 0;
        expect_invalid(&config, 32, "theta");
        config.theta = NAN;
        expect_invalid(&config, 32, "theta");
    }
    SUBCASE("unknown rope_type") {
        config.rope_type = static_cast<rope_jit_rope_type>(42);
        expect_invalid(&config, 32, "rope_type: unknown value 42");
    }
    SUBCASE("missing factor") {
        config.rope_type = ROPE_JIT_ROPE_TYPE_LINEAR;
        expect_invalid(&config, 32, "factor");
        config.rope_type = ROPE_JIT_ROPE_TYPE_YARN;
        config.original_max_position_embeddings = 4096;
        expect_invalid(&config, 32, "factor: required for rope_type yarn");
    }
    SUBCASE("dynamic without max_position_embeddings") {
        config.rope_type = ROPE_JIT_ROPE_TYPE_DYNAMIC;
        config.factor = 2;
        expect_invalid(&config, 32, "max_position_embeddings");
    }
    SUBCASE("llama3 with inverted frequency factors or no original context") {
        config.rope_type = ROPE_JIT_ROPE_TYPE_LLAMA3;
        config.factor = 8;
        expect_invalid(&config, 32, "original_max_position_embeddings");
        config.original_max_position_embeddings = 8192;
        config.low_freq_factor = 4;
        config.high_freq_factor = 1;
        expect_invalid(&config, 32, "high_freq_factor: must exceed low_freq_factor");
    }
    SUBCASE("yarn with theta 1") {
        config.rope_type = ROPE_JIT_ROPE_TYPE_YARN;
        config.factor = 4;
        config.max_position_embeddings = 4096;
        config.theta = 1;
        expect_invalid(&config, 32, "theta: yarn divides by ln(theta)");
    }
    SUBCASE("constant with the wrong count") {
        config.rope_type = ROPE_JIT_ROPE_TYPE_CONSTANT;
        config.num_freqs = 4;
        expect_invalid(&config, 32, "num_freqs = 4");
    }
    SUBCASE("counts past ROPE_JIT_MAX_FREQUENCIES, refused before anything is computed") {
        // (2^31 - 1 constant frequencies were computed into a 16 GiB buffer: review, session 38.)
        SUBCASE("constant") {
            config.rope_type = ROPE_JIT_ROPE_TYPE_CONSTANT;
            config.num_freqs = ROPE_JIT_MAX_FREQUENCIES + 1;
            expect_invalid(&config, 32, "num_freqs: must be in [1, 2^24]");
            config.num_freqs = INT32_MAX;
            expect_invalid(&config, 32, "num_freqs: must be in [1, 2^24]");
        }
        SUBCASE("rotary_dim") {
            config.rotary_dim = 2 * ROPE_JIT_MAX_FREQUENCIES + 2;
            expect_invalid(&config, 32, "rotary_dim: at most 2^25");
        }
    }
    SUBCASE("fields each valid that combine into frequencies that are not finite and > 0") {
        // Each was returned: NaN, infinite or negative values (adversarial test, session 35).
        config.rope_type = ROPE_JIT_ROPE_TYPE_YARN;
        config.factor = 4;
        config.original_max_position_embeddings = 4096;
        SUBCASE("yarn with beta_fast 1e-310: NaN frequencies") {
            config.beta_fast = 1e-310;
            for (const int truncate : {1, 0}) {
                CAPTURE(truncate);
                config.truncate = truncate;
                expect_invalid(&config, 32,
                               "rope_type yarn: the config's fields give inverse frequency 0 = ");
                expect_invalid(&config, 32, "nan, not finite and > 0 (check factor, beta_fast");
            }
        }
        SUBCASE("yarn whose mscale_all_dim makes get_mscale 0: an infinite attention factor") {
            config.factor = std::exp(1.0);
            config.mscale = 1;
            config.mscale_all_dim = -10;
            expect_invalid(&config, 32,
                           "rope_type yarn: the config's fields give attention "
                           "factor inf, not finite and > 0 (check mscale, "
                           "mscale_all_dim");
        }
        SUBCASE("yarn whose mscale_all_dim makes get_mscale negative") {
            config.mscale = 1;
            config.mscale_all_dim = -20;
            expect_invalid(&config, 32,
                           "rope_type yarn: the config's fields give attention "
                           "factor -");
        }
        SUBCASE("linear with factor 1e-40: infinite as float32") {
            config.rope_type = ROPE_JIT_ROPE_TYPE_LINEAR;
            config.factor = 1e-40;
            expect_invalid(&config, 32,
                           "rope_type linear: the config's fields give inverse "
                           "frequency 0 = inf");
        }
        SUBCASE("proportional with factor 1e-40") {
            config.rope_type = ROPE_JIT_ROPE_TYPE_PROPORTIONAL;
            config.factor = 1e-40;
            expect_invalid(&config, 32,
                           "rope_type proportional: the config's fields give "
                           "inverse frequency 0 = inf");
        }
    }
    SUBCASE("proportional with a bad head_dim or factor") {
        config.rope_type = ROPE_JIT_ROPE_TYPE_PROPORTIONAL;
        for (const int32_t head_dim : {62, 65, 129, -2}) {
            CAPTURE(head_dim);
            config.head_dim = head_dim;
            expect_invalid(&config, 32,
                           "head_dim: must be even and >= rotary_dim (64) for rope_type "
                           "proportional (0 = rotary_dim), got " +
                               std::to_string(head_dim));
        }
        config.head_dim = 128;
        for (const double factor : {-1.0, double(NAN), double(INFINITY)}) {
            CAPTURE(factor);
            config.factor = factor;
            expect_invalid(&config, 32,
                           "factor: must be finite and > 0 for rope_type proportional");
        }
        config.factor = 0;
        expect_invalid(&config, 64, "n: expected rotary_dim / 2 = 32");  // not head_dim / 2
    }
    SUBCASE("NULL output") {
        CHECK(rope_jit_inv_freq(&config, nullptr, 32, nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(rope_jit_last_error()).find("inv_freq: NULL") != std::string::npos);
    }
    SUBCASE("outputs over each other or over the factor lists") {
        // The attention factor inside inv_freq replaced a frequency, and an inv_freq over a
        // factor list overwrote it, each returning OK (overlap audit, session 40).
        for (const size_t at : {size_t(0), size_t(17), size_t(31)}) {
            CAPTURE(at);
            CHECK(rope_jit_inv_freq(&config, inv.data(), 32, &inv[at]) ==
                  ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(std::string(rope_jit_last_error()) ==
                  "attention_factor: points into inv_freq, which the call writes");
            for (float f : inv) CHECK(f == 7.0f);
        }
        config = freq_config(ROPE_JIT_ROPE_TYPE_LONGROPE, 64, 10000);
        config.factor = 4;
        config.original_max_position_embeddings = 4096;
        config.max_position_embeddings = 16384;
        std::vector<float> factors(64, 1.5f);
        config.short_factor = factors.data();
        config.long_factor = factors.data() + 32;
        config.num_short_factor = 32;
        config.num_long_factor = 32;
        std::vector<float> fine(32);
        REQUIRE(rope_jit_inv_freq(&config, fine.data(), 32, nullptr) == ROPE_JIT_OK);
        for (const size_t offset : {size_t(0), size_t(20), size_t(40)}) {
            CAPTURE(offset);
            CHECK(rope_jit_inv_freq(&config, factors.data() + offset, 32, nullptr) ==
                  ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(std::string(rope_jit_last_error())
                      .find(offset < 32 ? "inv_freq: shares memory with short_factor"
                                        : "inv_freq: shares memory with long_factor") !=
                  std::string::npos);
            for (float f : factors) CHECK(f == 1.5f);
        }
        float attention_out = 7.0f;
        for (const size_t offset : {size_t(0), size_t(31), size_t(32), size_t(63)}) {
            CAPTURE(offset);
            CHECK(rope_jit_inv_freq(&config, fine.data(), 32, factors.data() + offset) ==
                  ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(std::string(rope_jit_last_error()) ==
                  (offset < 32 ? "attention_factor: points into short_factor, the caller's input"
                               : "attention_factor: points into long_factor, the caller's input"));
            for (float f : factors) CHECK(f == 1.5f);
        }
        CHECK(rope_jit_inv_freq(&config, fine.data(), 32, &attention_out) == ROPE_JIT_OK);
        CHECK(attention_out != 7.0f);
    }
}

TEST_CASE("the config init functions fill the documented defaults") {
    rope_jit_freq_config freq;
    std::memset(&freq, 0x5a, sizeof freq);
    rope_jit_freq_config_init(&freq);
    CHECK(freq.struct_size == sizeof(rope_jit_freq_config));
    CHECK(freq.rope_type == ROPE_JIT_ROPE_TYPE_DEFAULT);
    CHECK(freq.rotary_dim == 0);
    CHECK(freq.theta == 10000.0);
    CHECK(freq.factor == 0.0);
    CHECK(freq.beta_fast == 32.0);
    CHECK(freq.beta_slow == 1.0);
    CHECK(freq.truncate == 1);
    CHECK(freq.low_freq_factor == 1.0);
    CHECK(freq.high_freq_factor == 4.0);
    CHECK(freq.short_factor == nullptr);
    CHECK(freq.theta_rescale_factor == 1.0);
    CHECK(freq.max_freq == 10.0);
    CHECK(freq.num_freqs == 1);
    CHECK(freq.head_dim == 0);

    rope_jit_table_config table;
    std::memset(&table, 0x5a, sizeof table);
    rope_jit_table_config_init(&table);
    CHECK(table.struct_size == sizeof(rope_jit_table_config));
    CHECK(table.inv_freq == nullptr);
    CHECK(table.positions == nullptr);
    CHECK(table.position_start == 0.0);
    CHECK(table.interpolate_factor == 1.0);
    CHECK(table.attention_factor == 1.0);
    CHECK(table.style == ROPE_JIT_STYLE_HALF);
    CHECK(table.mrope_sections == nullptr);
    CHECK(table.num_mrope_sections == 0);
    CHECK(table.float32_angles == 0);
    CHECK(table.xpos_scale_base == 512.0);
    CHECK(table.xpos_center == 0.0);

    rope_jit_rope_args args;
    std::memset(&args, 0x5a, sizeof args);
    rope_jit_rope_args_init(&args);
    CHECK(args.mrope_sections == nullptr);
    CHECK(args.num_mrope_sections == 0);
    CHECK(args.mrope_interleaved == 0);
    CHECK(args.inv_freq_grad == nullptr);
    CHECK(args.q_saved == nullptr);
    CHECK(args.k_saved == nullptr);

    rope_jit_freq_config_init(nullptr);
    rope_jit_table_config_init(nullptr);
}

// ==========================================================================================
// Tables
// ==========================================================================================

namespace {

// Half an ulp of the storage type, relative: the most that rounding a float64 value may move
// it (16-bit types go through float32 first, hence the margin).
double rounding_allowance(Dt dt, double value) {
    const double magnitude = std::max(std::fabs(value), dt == Dt::F16 ? 6.1e-5 : 1.2e-38);
    switch (dt) {
        case Dt::F16: return magnitude * std::ldexp(1.0, -11) * 1.01;
        case Dt::BF16: return magnitude * std::ldexp(1.0, -8) * 1.01;
        default: return magnitude * std::ldexp(1.0, -24) * 1.01;
    }
}

rope_jit_status build_tables(const rope_jit_table_config& config, HostTensor* cos, HostTensor* sin,
                             HostTensor* xpos) {
    return rope_jit_rope_tables(&config, cos ? cos->dl() : nullptr, sin ? sin->dl() : nullptr,
                                xpos ? xpos->dl() : nullptr);
}

}  // namespace

TEST_CASE("tables hold cos and sin of position times inv_freq in every layout, style and dtype") {
    const std::vector<float> inv = {1.0f, 0.3f, 0.05f, 0.001f};
    const int64_t n = 4, P = 11;
    for (Dt dt : {Dt::F32, Dt::F16, Dt::BF16}) {
        for (bool full : {false, true}) {
            for (rope_jit_style style : {ROPE_JIT_STYLE_HALF, ROPE_JIT_STYLE_INTERLEAVED}) {
                CAPTURE(dt_name(dt));
                CAPTURE(full);
                CAPTURE(int(style));
                rope_jit_table_config config;
                rope_jit_table_config_init(&config);
                config.inv_freq = inv.data();
                config.num_freqs = size_t(n);
                config.style = style;
                config.position_start = 3;
                config.interpolate_factor = 2;
                config.attention_factor = 1.25;
                // A padded view: every row has unused trailing elements that must stay.
                HostTensor cos(dt, {P, full ? 2 * n : n}, {}, 3),
                    sin(dt, {P, full ? 2 * n : n}, {}, 3);
                const std::vector<uint8_t> padding_before = cos.bytes();
                REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
                for (int64_t r = 0; r < P; ++r) {
                    for (int64_t i = 0; i < n; ++i) {
                        const double angle = (3.0 + double(r)) / 2.0 * double(inv[size_t(i)]);
                        const double c = 1.25 * std::cos(angle), s = 1.25 * std::sin(angle);
                        std::vector<int64_t> columns;
                        if (!full)
                            columns = {i};
                        else if (style == ROPE_JIT_STYLE_HALF)
                            columns = {i, i + n};
                        else
                            columns = {2 * i, 2 * i + 1};
                        for (int64_t col : columns) {
                            CAPTURE(r);
                            CAPTURE(col);
                            CHECK(std::fabs(cos.get({r, col}) - c) <= rounding_allowance(dt, c));
                            CHECK(std::fabs(sin.get({r, col}) - s) <= rounding_allowance(dt, s));
                        }
                    }
                }
                // Padding bytes after each row are untouched.
                for (int64_t r = 0; r < P; ++r)
                    for (int64_t extra = 0; extra < 3; ++extra) {
                        const size_t byte =
                            size_t((r * (cos.shape()[1] + 3) + cos.shape()[1] + extra)) *
                            dt_size(dt);
                        CHECK(cos.bytes()[byte] == padding_before[byte]);
                    }
            }
        }
    }
}

TEST_CASE("tables from the builders reproduce rotary-embedding-torch's recorded tables") {
    auto lang = [](int dim) {
        return library_inv_freq(freq_config(ROPE_JIT_ROPE_TYPE_LANG, dim, 10000), size_t(dim / 2));
    };
    auto check_table = [](const HostTensor& got, const std::vector<float>& expected, double atol) {
        const std::vector<double> values = got.values();
        REQUIRE(values.size() == expected.size());
        double worst = 0;
        for (size_t e = 0; e < values.size(); ++e)
            worst = std::max(worst, std::fabs(values[e] - double(expected[e])));
        CAPTURE(worst);
        CHECK(worst <= atol);
    };
    rope_jit_table_config config;
    rope_jit_table_config_init(&config);
    config.style = ROPE_JIT_STYLE_INTERLEAVED;  // repeat(freqs, '... n -> ... (n r)', r = 2)

    SUBCASE("lang, positions 0..16") {
        const std::vector<float> inv = lang(64);
        config.inv_freq = inv.data();
        config.num_freqs = 32;
        HostTensor cos(Dt::F32, {17, 64}), sin(Dt::F32, {17, 64});
        REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
        check_table(cos, read_golden_floats("ret_lang_d64/in_cos.bin"), 2e-6);
        check_table(sin, read_golden_floats("ret_lang_d64/in_sin.bin"), 2e-6);
    }
    SUBCASE("offset 5") {
        const std::vector<float> inv = lang(64);
        config.inv_freq = inv.data();
        config.num_freqs = 32;
        config.position_start = 5;
        HostTensor cos(Dt::F32, {17, 64}), sin(Dt::F32, {17, 64});
        REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
        check_table(cos, read_golden_floats("ret_offset5/in_cos.bin"), 4e-6);
        check_table(sin, read_golden_floats("ret_offset5/in_sin.bin"), 4e-6);
    }
    SUBCASE("theta_rescale_factor 4 with interpolate_factor 2") {
        rope_jit_freq_config freq = freq_config(ROPE_JIT_ROPE_TYPE_LANG, 64, 10000);
        freq.theta_rescale_factor = 4;
        const std::vector<float> inv = library_inv_freq(freq, 32);
        config.inv_freq = inv.data();
        config.num_freqs = 32;
        config.interpolate_factor = 2;
        HostTensor cos(Dt::F32, {17, 64}), sin(Dt::F32, {17, 64});
        REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
        check_table(cos, read_golden_floats("ret_theta_rescale_interp/in_cos.bin"), 2e-6);
        check_table(sin, read_golden_floats("ret_theta_rescale_interp/in_sin.bin"), 2e-6);
    }
    SUBCASE("pixel: large angles differ only by the reference's float32 angle rounding") {
        // The recorded frequencies, so that only the table builder is under test here.
        const std::vector<float> inv = read_golden_floats("ret_pixel_d32/in_inv_freq.bin");
        config.inv_freq = inv.data();
        config.num_freqs = 16;
        HostTensor cos(Dt::F32, {9, 32}), sin(Dt::F32, {9, 32});
        // Exact angles: off by at most the rounding of an angle up to 8 * 100.5 in float32.
        REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
        const double angle_rounding = 8 * 100.54 * std::ldexp(1.0, -24);
        check_table(cos, read_golden_floats("ret_pixel_d32/in_cos.bin"), angle_rounding + 1e-6);
        check_table(sin, read_golden_floats("ret_pixel_d32/in_sin.bin"), angle_rounding + 1e-6);
        // float32 angles, as PyTorch rounds them: the same numbers to float32's last bits.
        config.float32_angles = 1;
        REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
        check_table(cos, read_golden_floats("ret_pixel_d32/in_cos.bin"), 3e-7);
        check_table(sin, read_golden_floats("ret_pixel_d32/in_sin.bin"), 3e-7);
    }
    SUBCASE("xPos scales with scale_base 512 centred on seq_len // 2") {
        const std::vector<float> inv = lang(64);
        config.inv_freq = inv.data();
        config.num_freqs = 32;
        config.xpos_scale_base = 512;
        config.xpos_center = 17 / 2;
        HostTensor xpos(Dt::F32, {17, 64});
        REQUIRE(build_tables(config, nullptr, nullptr, &xpos) == ROPE_JIT_OK);
        check_table(xpos, read_golden_floats("ret_xpos_d64/in_xpos_scale.bin"), 2e-7);
        // And straight from the formula, in a half table.
        HostTensor half(Dt::F32, {17, 32});
        REQUIRE(build_tables(config, nullptr, nullptr, &half) == ROPE_JIT_OK);
        for (int64_t r = 0; r < 17; ++r)
            for (int64_t i = 0; i < 32; ++i)
                CHECK(half.get({r, i}) ==
                      doctest::Approx(std::pow((2.0 * i + 0.4 * 64) / (1.4 * 64), (r - 8) / 512.0))
                          .epsilon(1e-7));
    }
    SUBCASE("axial pixel frequencies over a 4 x 6 grid (get_axial_freqs)") {
        // RotaryEmbedding(dim = 16, freqs_for = 'pixel', max_freq = 32): each axis takes a full
        // block of 8 pairs, at positions torch.linspace(-1, 1, steps) along that axis.
        const std::vector<float> axis_inv = torch_pixel_freqs(32, 8);
        std::vector<float> inv = axis_inv;
        inv.insert(inv.end(), axis_inv.begin(), axis_inv.end());
        const std::vector<float> steps4 = torch_linspace(-1, 1, 4),
                                 steps6 = torch_linspace(-1, 1, 6);
        std::vector<double> positions(2 * 24);
        for (int64_t r = 0; r < 24; ++r) {
            positions[size_t(r)] = steps4[size_t(r / 6)];       // axis 0 of the grid
            positions[size_t(24 + r)] = steps6[size_t(r % 6)];  // axis 1
        }
        const int32_t sections[2] = {8, 8};
        config.inv_freq = inv.data();
        config.num_freqs = 16;
        config.positions = positions.data();
        config.mrope_sections = sections;
        config.num_mrope_sections = 2;
        HostTensor cos(Dt::F32, {24, 32}), sin(Dt::F32, {24, 32});
        // Exact angles: within the float32 rounding of angles up to 50.3.
        REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
        check_table(cos, read_golden_floats("ret_axial_4x6/in_cos.bin"),
                    50.3 * std::ldexp(1.0, -24) + 1e-6);
        check_table(sin, read_golden_floats("ret_axial_4x6/in_sin.bin"),
                    50.3 * std::ldexp(1.0, -24) + 1e-6);
        config.float32_angles = 1;
        REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
        check_table(cos, read_golden_floats("ret_axial_4x6/in_cos.bin"), 3e-7);
        check_table(sin, read_golden_floats("ret_axial_4x6/in_sin.bin"), 3e-7);
    }
}

TEST_CASE("bad table arguments are rejected, naming the argument, and nothing is written") {
    const std::vector<float> inv = {1.0f, 0.5f};
    rope_jit_table_config config;
    rope_jit_table_config_init(&config);
    config.inv_freq = inv.data();
    config.num_freqs = 2;
    HostTensor cos(Dt::F32, {5, 4}), sin(Dt::F32, {5, 4});
    const std::vector<uint8_t> cos_before = cos.bytes(), sin_before = sin.bytes();
    auto expect_invalid = [&](const DLTensor* c, const DLTensor* s, const DLTensor* x,
                              const std::string& needle) {
        const rope_jit_status status = rope_jit_rope_tables(&config, c, s, x);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        CHECK(cos.bytes() == cos_before);
        CHECK(sin.bytes() == sin_before);
    };
    SUBCASE("no inv_freq") {
        config.inv_freq = nullptr;
        expect_invalid(cos.dl(), sin.dl(), nullptr, "inv_freq: required");
    }
    SUBCASE("no table at all") {
        expect_invalid(nullptr, nullptr, nullptr, "all NULL");
    }
    SUBCASE("num_freqs 0 or past ROPE_JIT_MAX_FREQUENCIES") {
        for (const size_t count : {size_t(0), size_t(ROPE_JIT_MAX_FREQUENCIES) + 1}) {
            config.num_freqs = count;
            expect_invalid(cos.dl(), sin.dl(), nullptr, "num_freqs: must be in [1, 2^24]");
        }
    }
    SUBCASE("a table of the wrong width") {
        HostTensor wide(Dt::F32, {5, 3});
        expect_invalid(cos.dl(), wide.dl(), nullptr, "sin: expected [P, 2] (half table) or [P, 4]");
    }
    SUBCASE("tables with different row counts") {
        HostTensor shorter(Dt::F32, {4, 4});
        expect_invalid(cos.dl(), shorter.dl(), nullptr, "sin: has 4 rows but cos has 5");
    }
    SUBCASE("an integer table") {
        HostTensor ints(Dt::I32, {5, 4});
        expect_invalid(cos.dl(), ints.dl(), nullptr, "sin: dtype must be float32");
    }
    SUBCASE("a table in device memory") {
        HostTensor device(Dt::F32, {5, 4});
        device.dl()->device = {kDLCUDA, 0};
        expect_invalid(cos.dl(), device.dl(), nullptr, "sin: lives on CUDA");
    }
    SUBCASE("two tables in one buffer") {
        expect_invalid(cos.dl(), cos.dl(), nullptr, "cos: shares memory with sin");
    }
    SUBCASE("a table over the inputs it is computed from") {
        // A sin table on the caller's inv_freq filled its later rows from its own first one,
        // and returned OK (adversarial pass, session 38); positions likewise.
        HostTensor holder(Dt::F32, {5, 4});
        holder.set({0, 0}, 1.0);
        holder.set({0, 1}, 0.5);
        const std::vector<uint8_t> holder_before = holder.bytes();
        config.inv_freq = reinterpret_cast<const float*>(holder.dl()->data);
        expect_invalid(cos.dl(), holder.dl(), nullptr, "sin: shares memory with inv_freq");
        CHECK(holder.bytes() == holder_before);
        config.inv_freq = inv.data();
        HostTensor doubles(Dt::F32, {5, 4});  // 80 bytes: 10 positions of 8 bytes
        for (int64_t r = 0; r < 5; ++r)
            for (int64_t c = 0; c < 4; ++c) doubles.set({r, c}, 0.0);
        config.positions = reinterpret_cast<const double*>(doubles.dl()->data);
        const std::vector<uint8_t> doubles_before = doubles.bytes();
        expect_invalid(doubles.dl(), sin.dl(), nullptr, "cos: shares memory with positions");
        CHECK(doubles.bytes() == doubles_before);
        config.positions = nullptr;
    }
    SUBCASE("a table over the caller's mrope_sections") {
        // Read before the tables are written, so they came out right, but the sections were
        // overwritten and the call returned OK (overlap audit, session 40).
        HostTensor holder(Dt::F32, {5, 4});
        auto* sections = reinterpret_cast<int32_t*>(holder.dl()->data);
        sections[0] = 1;
        sections[1] = 1;
        config.mrope_sections = sections;
        config.num_mrope_sections = 2;
        const std::vector<uint8_t> holder_before = holder.bytes();
        expect_invalid(cos.dl(), holder.dl(), nullptr, "sin: shares memory with mrope_sections");
        CHECK(holder.bytes() == holder_before);
    }
    SUBCASE("a zero or infinite interpolate_factor") {
        config.interpolate_factor = 0;
        expect_invalid(cos.dl(), sin.dl(), nullptr, "interpolate_factor");
        config.interpolate_factor = INFINITY;
        expect_invalid(cos.dl(), sin.dl(), nullptr, "interpolate_factor");
    }
    SUBCASE("sections that do not add up to num_freqs") {
        const int32_t sections[2] = {1, 2};
        config.mrope_sections = sections;
        config.num_mrope_sections = 2;
        expect_invalid(cos.dl(), sin.dl(), nullptr,
                       "mrope_sections: sections sum to 3, but there are 2");
    }
    SUBCASE("a non-finite explicit position") {
        std::vector<double> positions = {0, 1, NAN, 3, 4};
        config.positions = positions.data();
        expect_invalid(cos.dl(), sin.dl(), nullptr, "positions: entry [0, 2] is not finite");
    }
    SUBCASE("xPos with a zero scale base") {
        HostTensor xpos(Dt::F32, {5, 2});
        config.xpos_scale_base = 0;
        expect_invalid(cos.dl(), sin.dl(), xpos.dl(), "xpos_scale_base");
    }
    SUBCASE("a non-finite inv_freq element") {
        // Tables of NaN were written (adversarial test, session 35).
        for (const float bad : {NAN, INFINITY, -INFINITY}) {
            CAPTURE(bad);
            const std::vector<float> bad_inv = {1.0f, bad};
            config.inv_freq = bad_inv.data();
            expect_invalid(cos.dl(), sin.dl(), nullptr, "inv_freq: element 1 is not finite");
            HostTensor xpos(Dt::F32, {5, 2});
            expect_invalid(nullptr, nullptr, xpos.dl(), "inv_freq: element 1 is not finite");
        }
    }
    SUBCASE("positions / interpolate_factor * inv_freq that overflow") {
        // Each finite, their angle not: tables of NaN were written (adversarial test,
        // session 35).
        config.interpolate_factor = 1e-310;
        expect_invalid(cos.dl(), sin.dl(), nullptr,
                       "interpolate_factor: positions up to 4 divided by 1e-310 and multiplied "
                       "by inverse frequencies up to 1 overflow");
        config.interpolate_factor = 1e-10;
        std::vector<double> positions = {0, 1, 2, -1e300, 4};
        config.positions = positions.data();
        expect_invalid(cos.dl(), sin.dl(), nullptr, "interpolate_factor: positions up to 1e+300");
        config.positions = nullptr;
        config.position_start = 1e300;
        const std::vector<float> large_inv = {1e9f, 0.5f};
        config.inv_freq = large_inv.data();
        config.interpolate_factor = 1;
        expect_invalid(cos.dl(), sin.dl(), nullptr,
                       "multiplied by inverse frequencies up to 1000000000 overflow");
    }
    SUBCASE("the same in float32 with float32_angles") {
        // Finite in float64, not in the float32 arithmetic of float32_angles: a factor of
        // 1e-40 (a float32 denormal), 1e-50 (0 in float32), a position of 1e39.
        config.float32_angles = 1;
        for (const double factor : {1e-40, 1e-50}) {
            CAPTURE(factor);
            config.interpolate_factor = factor;
            expect_invalid(cos.dl(), sin.dl(), nullptr, "overflow in float32 (float32_angles)");
        }
        config.interpolate_factor = 1;
        std::vector<double> positions = {0, 1, 2, 3, 1e39};
        config.positions = positions.data();
        expect_invalid(cos.dl(), sin.dl(), nullptr, "overflow in float32 (float32_angles)");
    }
}

namespace {

// cos and sin of the exact angle position * inv / divisor in long double, for a whole
// position below 2^40, a float32 inv = m * 2^e (m < 2^24) and a whole divisor: position * m is
// a whole number n below 2^64, so the angle is (n div divisor + (n mod divisor) / divisor) *
// 2^e, whose first part long double holds exactly (64-bit significand) and whose second is
// tiny. What rounds is cos and sin of those, to long double's precision.
void exact_cos_sin(double position, float inv, uint64_t divisor, long double* cos_value,
                   long double* sin_value) {
    int e = 0;
    const double fraction = std::frexp(double(inv), &e);  // inv = fraction * 2^e
    const uint64_t m = uint64_t(std::ldexp(fraction, 24));
    const uint64_t p = uint64_t(position);
    REQUIRE(double(p) == position);
    REQUIRE(p < (uint64_t(1) << 40));
    const uint64_t n = p * m;
    const long double big = std::ldexp(static_cast<long double>(n / divisor), e - 24);
    const long double small = std::ldexp(
        static_cast<long double>(n % divisor) / static_cast<long double>(divisor), e - 24);
    *cos_value = std::cos(big) * std::cos(small) - std::sin(big) * std::sin(small);
    *sin_value = std::sin(big) * std::cos(small) + std::cos(big) * std::sin(small);
}

// A float32 ulp at |value|: the spacing of float32 numbers there.
double float32_ulp(long double value) {
    const float magnitude = float(std::fabs(value));
    return double(std::nextafter(magnitude, INFINITY)) - double(magnitude);
}

}  // namespace

TEST_CASE("tables far out in the context are within one float32 ulp of the exact cos and sin") {
    // The float64 angle rounded to half its ulp, at 1e12 already 1,500 float32 ulps of its
    // cosine (adversarial test, session 35); the header promises one.
    if (std::numeric_limits<long double>::digits < 64) {
        MESSAGE("skipped: the reference needs a long double of at least 64 significant bits");
        return;
    }
    const std::vector<float> inv = {1.0f, 0.7498942f, 0.0123f, 1e-4f,
                                    float(std::pow(500000, -0.5))};
    const int64_t n = int64_t(inv.size()), P = 6;
    for (const double start : {1e10, 1e12}) {
        for (const uint64_t divisor : {uint64_t(1), uint64_t(3)}) {
            CAPTURE(start);
            CAPTURE(divisor);
            rope_jit_table_config config;
            rope_jit_table_config_init(&config);
            config.inv_freq = inv.data();
            config.num_freqs = size_t(n);
            config.position_start = start;
            config.interpolate_factor = double(divisor);
            HostTensor cos(Dt::F32, {P, n}), sin(Dt::F32, {P, n});
            REQUIRE(build_tables(config, &cos, &sin, nullptr) == ROPE_JIT_OK);
            double worst = 0;  // in float32 ulps of the exact value (NaN stays NaN)
            auto note = [&](double got, long double exact) {
                const double ulps = double(std::fabs(got - exact)) / float32_ulp(exact);
                if (!(ulps <= worst)) worst = ulps;
            };
            for (int64_t r = 0; r < P; ++r)
                for (int64_t i = 0; i < n; ++i) {
                    long double c = 0, s = 0;
                    exact_cos_sin(start + double(r), inv[size_t(i)], divisor, &c, &s);
                    note(cos.get({r, i}), c);
                    note(sin.get({r, i}), s);
                }
            CAPTURE(worst);
            CHECK(worst <= 1.0);
        }
    }
}

namespace {

// A [rows, columns] view of a buffer's columns first_column, first_column + step, ...
struct ColumnView {
    ColumnView(HostTensor& buffer, int64_t first_column, int64_t step, int64_t columns) {
        shape[0] = buffer.shape()[0];
        shape[1] = columns;
        strides[0] = buffer.strides()[0];
        strides[1] = step;
        tensor = *buffer.dl();
        tensor.shape = shape;
        tensor.strides = strides;
        tensor.byte_offset = uint64_t(first_column) * dt_size(buffer.dtype());
    }
    ColumnView(const ColumnView&) = delete;
    ColumnView& operator=(const ColumnView&) = delete;
    int64_t shape[2], strides[2];
    DLTensor tensor;
};

}  // namespace

TEST_CASE("cos and sin interleaved in one buffer are filled; views that share an element are not") {
    // Disjoint views were refused as overlapping by their extents (adversarial test,
    // session 35).
    const std::vector<float> inv = {1.0f, 0.25f};
    rope_jit_table_config config;
    rope_jit_table_config_init(&config);
    config.inv_freq = inv.data();
    config.num_freqs = 2;
    config.position_start = 2;
    SUBCASE("half tables: b[:, ::2] and b[:, 1::2]") {
        HostTensor buffer(Dt::F32, {5, 4});
        ColumnView cos(buffer, 0, 2, 2), sin(buffer, 1, 2, 2);
        REQUIRE(rope_jit_rope_tables(&config, &cos.tensor, &sin.tensor, nullptr) == ROPE_JIT_OK);
        for (int64_t r = 0; r < 5; ++r)
            for (int64_t i = 0; i < 2; ++i) {
                CAPTURE(r);
                CAPTURE(i);
                const double angle = (2.0 + double(r)) * double(inv[size_t(i)]);
                CHECK(std::fabs(buffer.get({r, 2 * i}) - std::cos(angle)) <=
                      rounding_allowance(Dt::F32, std::cos(angle)));
                CHECK(std::fabs(buffer.get({r, 2 * i + 1}) - std::sin(angle)) <=
                      rounding_allowance(Dt::F32, std::sin(angle)));
            }
    }
    SUBCASE("full tables, with xPos: b[:, ::3], b[:, 1::3] and b[:, 2::3]") {
        HostTensor buffer(Dt::F32, {5, 12});
        ColumnView cos(buffer, 0, 3, 4), sin(buffer, 1, 3, 4), xpos(buffer, 2, 3, 4);
        REQUIRE(rope_jit_rope_tables(&config, &cos.tensor, &sin.tensor, &xpos.tensor) ==
                ROPE_JIT_OK);
        HostTensor cos_alone(Dt::F32, {5, 4}), sin_alone(Dt::F32, {5, 4}),
            xpos_alone(Dt::F32, {5, 4});
        REQUIRE(build_tables(config, &cos_alone, &sin_alone, &xpos_alone) == ROPE_JIT_OK);
        for (int64_t r = 0; r < 5; ++r)
            for (int64_t col = 0; col < 4; ++col) {
                CHECK(buffer.get({r, 3 * col}) == cos_alone.get({r, col}));
                CHECK(buffer.get({r, 3 * col + 1}) == sin_alone.get({r, col}));
                CHECK(buffer.get({r, 3 * col + 2}) == xpos_alone.get({r, col}));
            }
    }
    SUBCASE("views that share elements are refused, and nothing is written") {
        HostTensor buffer(Dt::F32, {5, 4});
        const std::vector<uint8_t> before = buffer.bytes();
        auto expect_invalid = [&](const DLTensor* c, const DLTensor* s, const DLTensor* x,
                                  const std::string& needle) {
            const rope_jit_status status = rope_jit_rope_tables(&config, c, s, x);
            const std::string message = rope_jit_last_error();
            CAPTURE(message);
            CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
            CHECK(message.find(needle) != std::string::npos);
            CHECK(buffer.bytes() == before);
        };
        ColumnView even(buffer, 0, 2, 2), even_again(buffer, 0, 2, 2), odd(buffer, 1, 2, 2);
        ColumnView first_two(buffer, 0, 1, 2), middle_two(buffer, 1, 1, 2);
        expect_invalid(&even.tensor, &even_again.tensor, nullptr, "cos: shares memory with sin");
        expect_invalid(&first_two.tensor, &middle_two.tensor, nullptr,
                       "cos: shares memory with sin");
        HostTensor other(Dt::F32, {5, 2});
        expect_invalid(&even.tensor, other.dl(), &first_two.tensor,
                       "cos: shares memory with xpos_scale");
        expect_invalid(other.dl(), &odd.tensor, &middle_two.tensor,
                       "sin: shares memory with xpos_scale");
    }
}

namespace {

// One inv_freq case of the golden format for HF's "proportional" type.
struct ProportionalCase {
    std::string name;
    int head_dim;
    double partial_rotary_factor, theta, factor;  // factor 0: not in params (HF's 1.0)
};

// Writes dir/manifest.json and the expected outputs of `cases`: HF's definition, in float64
// then float32, int(partial * head_dim // 2) pairs theta^(-2i/head_dim) / factor and zeros up
// to head_dim / 2, attention factor 1. `exponent_over_rotated` puts rotary_dim in place of
// head_dim in the exponent (what the default type would give), for a case that must fail.
void write_proportional_cases(const std::string& dir, const std::vector<ProportionalCase>& cases,
                              bool exponent_over_rotated = false) {
    std::string manifest = R"({"format": "rope-jit-golden/1", "cases": [)";
    for (size_t k = 0; k < cases.size(); ++k) {
        const ProportionalCase& c = cases[k];
        const int rotated = int(std::floor(c.partial_rotary_factor * c.head_dim / 2));
        const double factor = c.factor == 0 ? 1.0 : c.factor;
        const double exponent_dim = exponent_over_rotated ? 2.0 * rotated : double(c.head_dim);
        std::vector<float> inv(size_t(c.head_dim / 2), 0.0f);
        for (int i = 0; i < rotated; ++i)
            inv[size_t(i)] = float(1.0 / (std::pow(c.theta, 2.0 * i / exponent_dim) * factor));
        const float attention = 1.0f;
        REQUIRE(mkdir((dir + "/" + c.name).c_str(), 0755) == 0);
        write_file(dir + "/" + c.name + "/out_inv_freq.bin",
                   std::string(reinterpret_cast<const char*>(inv.data()), inv.size() * 4));
        write_file(dir + "/" + c.name + "/out_attention_factor.bin",
                   std::string(reinterpret_cast<const char*>(&attention), 4));
        char params[256];
        std::snprintf(params, sizeof params,
                      R"("rope_type": "proportional", "head_dim": %d, "rope_theta": %.17g, )"
                      R"("partial_rotary_factor": %.17g)",
                      c.head_dim, c.theta, c.partial_rotary_factor);
        std::string params_text = params;
        if (c.factor != 0) params_text += ", \"factor\": " + std::to_string(c.factor);
        manifest += std::string(k ? ", " : "") + R"({"name": ")" + c.name +
                    R"(", "op": "inv_freq", "source": "HF proportional, by its definition", )" +
                    R"("params": {)" + params_text + R"(}, "inputs": {}, "outputs": {)" +
                    R"("inv_freq": {"file": ")" + c.name +
                    R"(/out_inv_freq.bin", "dtype": "float32", "shape": [)" +
                    std::to_string(c.head_dim / 2) + R"(]}, )" +
                    R"("attention_factor": {"file": ")" + c.name +
                    R"(/out_attention_factor.bin", "dtype": "float32", "shape": [1]}}, )" +
                    R"("tolerance": {"atol": 0, "rtol": 1e-6}})";
    }
    write_file(dir + "/manifest.json", manifest + "]}");
}

// Runs rope-jit-golden on dir (inv_freq cases only): its exit status and what it printed.
int run_golden_runner(const std::string& tool, const std::string& dir, std::string* output) {
    const std::string command = "'" + tool + "' '" + dir + "' --backend cpu --ops inv_freq 2>&1";
    FILE* pipe = popen(command.c_str(), "r");
    REQUIRE(pipe != nullptr);
    char buffer[512];
    for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) output->append(buffer, n);
    const int status = pclose(pipe);
    REQUIRE(WIFEXITED(status));
    return WEXITSTATUS(status);
}

}  // namespace

TEST_CASE("rope-jit-golden runs HF proportional inv_freq cases, rotated pairs then zeros") {
    const std::string tool = std::string(ROPE_JIT_BINARY_DIR) + "/tools/rope-jit-golden";
    if (access(tool.c_str(), X_OK) != 0) {
        MESSAGE("skipped: " << tool << " is not built (ROPE_JIT_BUILD_TOOLS=OFF)");
        return;
    }
    // Gemma 4's global layers (head_dim 512, partial_rotary_factor 0.25), a pair count HF
    // rounds down (0.3 * 128 / 2 = 19.2), a factor, and the whole head.
    const std::vector<ProportionalCase> cases = {{"gemma4_global", 512, 0.25, 1e6, 0},
                                                 {"partial_0_3", 128, 0.3, 10000, 0},
                                                 {"factor_2", 128, 0.5, 10000, 2},
                                                 {"whole_head", 64, 1.0, 10000, 0}};
    ScratchDir tmp("rope_jit_golden_proportional");
    SUBCASE("the definition passes") {
        write_proportional_cases(tmp.path, cases);
        std::string output;
        const int status = run_golden_runner(tool, tmp.path, &output);
        CAPTURE(output);
        CHECK(status == 0);
        for (const ProportionalCase& c : cases) {
            CAPTURE(c.name);
            const size_t line = output.find(c.name + " ");
            REQUIRE(line != std::string::npos);
            CHECK(output.find("pass", line) < output.find('\n', line));
        }
        CHECK(output.find("4 passed, 0 failed") != std::string::npos);
    }
    SUBCASE("exponents over the rotated features instead of head_dim fail") {
        write_proportional_cases(tmp.path, {cases[0], cases[1]}, true);
        std::string output;
        const int status = run_golden_runner(tool, tmp.path, &output);
        CAPTURE(output);
        CHECK(status == 1);
        CHECK(output.find("0 passed, 2 failed") != std::string::npos);
    }
}

// ==========================================================================================
// Multi-section positions (M-RoPE)
// ==========================================================================================

namespace {

// Qwen2-VL's apply_multimodal_rotary_pos_emb for one head vector of R = 2n features (rotary
// part only), written from its definition: the cos/sin of every axis are cat(freqs, freqs)
// rows of width R, split along the last dim into chunks of mrope_section * 2, chunk j taken
// from axis j % A; then q * cos + rotate_half(q) * sin. `interleaved` is Qwen3-VL's
// apply_interleaved_mrope instead: freqs of axis 0, with columns a, a + A, ... up to
// A * section[a] overwritten by axis a (before the cat).
std::vector<double> qwen_mrope_reference(const std::vector<double>& x,
                                         const std::vector<double>& inv_freq,
                                         const std::vector<int64_t>& axis_positions,
                                         const std::vector<int32_t>& sections, bool interleaved,
                                         bool backward) {
    const size_t n = inv_freq.size(), R = 2 * n, A = sections.size();
    std::vector<size_t> column_axis(R);
    if (!interleaved) {
        std::vector<int32_t> chunks = sections;
        chunks.insert(chunks.end(), sections.begin(), sections.end());  // mrope_section * 2
        size_t column = 0;
        for (size_t j = 0; j < chunks.size(); ++j)
            for (int32_t c = 0; c < chunks[j]; ++c) column_axis[column++] = j % A;
    } else {
        std::vector<size_t> freq_axis(n, 0);
        for (size_t a = 1; a < A; ++a)
            for (size_t f = a; f < A * size_t(sections[a]); f += A) freq_axis[f] = a;
        for (size_t d = 0; d < R; ++d) column_axis[d] = freq_axis[d % n];
    }
    std::vector<double> rotated_half(R), y(R);
    for (size_t d = 0; d < n; ++d) {
        rotated_half[d] = -x[d + n];
        rotated_half[d + n] = x[d];
    }
    for (size_t d = 0; d < R; ++d) {
        const double angle = double(axis_positions[column_axis[d]]) * inv_freq[d % n];
        const double s = backward ? -std::sin(angle) : std::sin(angle);
        y[d] = x[d] * std::cos(angle) + rotated_half[d] * s;
    }
    return y;
}

struct MropeCase {
    Dt dt = Dt::F32;
    Dt index_dt = Dt::I64;
    std::vector<int32_t> sections = {4, 6, 6};  // Qwen2-VL style, R = 32
    bool interleaved = false, backward = false, packed = false, batched_positions = true,
         table = false;
    int64_t B = 2, Hq = 4, Hk = 2, S = 7, D = 40, offset = 4;
};

void run_mrope_case(rope_jit_runtime* runtime, const MropeCase& c, std::mt19937& rng) {
    const int64_t A = int64_t(c.sections.size());
    int64_t n = 0;
    for (int32_t s : c.sections) n += s;
    const int64_t R = 2 * n;
    const int64_t B = c.packed ? 1 : c.B;
    const int64_t T = c.B * c.S;  // packed: all sequences back to back
    const int64_t S = c.packed ? T : c.S;
    const int64_t P = 60;

    HostTensor q = c.packed ? HostTensor(c.dt, {T, c.Hq, c.D})
                            : HostTensor(c.dt, {c.B, c.Hq, c.S, c.D}, {0, 2, 1, 3});
    HostTensor k =
        c.packed ? HostTensor(c.dt, {T, c.Hk, c.D}) : HostTensor(c.dt, {c.B, c.Hk, c.S, c.D});
    q.fill_uniform(rng, -2, 2);
    k.fill_uniform(rng, -2, 2);
    const HostTensor q_in = q, k_in = k;
    HostTensor q_out =
        c.packed ? HostTensor(c.dt, {T, c.Hq, c.D}) : HostTensor(c.dt, {c.B, c.Hq, c.S, c.D});

    // Positions: text-like (all axes equal) for some tokens, image-like (t, h, w differ) for others.
    std::vector<int64_t> pos_shape = {A};
    if (c.packed)
        pos_shape.push_back(T);
    else if (c.batched_positions)
        pos_shape.insert(pos_shape.end(), {c.B, c.S});
    else
        pos_shape.push_back(c.S);
    HostTensor positions(c.index_dt, pos_shape);
    std::uniform_int_distribution<int64_t> any(0, P - 1);
    positions.for_each([&](const std::vector<int64_t>& i) { positions.set(i, double(any(rng))); });
    auto position = [&](int64_t a, int64_t b, int64_t s) -> int64_t {
        if (c.packed) return int64_t(positions.get({a, s}));
        if (c.batched_positions) return int64_t(positions.get({a, b, s}));
        return int64_t(positions.get({a, s}));
    };

    std::vector<float> inv(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
        inv[size_t(i)] = float(std::pow(10000.0, -double(2 * i) / double(R)));
    std::vector<double> inv_d(inv.begin(), inv.end());
    int64_t inv_shape_value = n;
    HostTensor inv_freq(Dt::F32, {inv_shape_value});
    for (int64_t i = 0; i < n; ++i) inv_freq.set({i}, inv[size_t(i)]);
    // HF-style full table [P, R] (cat(freqs, freqs)), built by the library's table builder.
    HostTensor cos(Dt::F32, {P, R}), sin(Dt::F32, {P, R});
    rope_jit_table_config table_config;
    rope_jit_table_config_init(&table_config);
    table_config.inv_freq = inv.data();
    table_config.num_freqs = size_t(n);
    REQUIRE(rope_jit_rope_tables(&table_config, cos.dl(), sin.dl(), nullptr) == ROPE_JIT_OK);

    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.q_out = q_out.dl();
    args.k = k.dl();  // in place
    if (c.table) {
        args.cos = cos.dl();
        args.sin = sin.dl();
    } else {
        args.inv_freq = inv_freq.dl();
    }
    args.positions = positions.dl();
    args.mrope_sections = c.sections.data();
    args.num_mrope_sections = int32_t(A);
    args.mrope_interleaved = c.interleaved ? 1 : 0;
    args.rotary_dim = int32_t(R);
    args.rotary_offset = int32_t(c.offset);
    args.backward = c.backward ? 1 : 0;
    const rope_jit_status status = rope_jit_rope(runtime, &args);
    CAPTURE(rope_jit_last_error());
    REQUIRE(status == ROPE_JIT_OK);

    const double tol = tolerance_for(c.dt);
    double worst = 0;
    auto check_head = [&](const HostTensor& in, const HostTensor& out, int64_t b, int64_t h,
                          int64_t s) {
        std::vector<double> x(static_cast<size_t>(R)), everything(static_cast<size_t>(c.D));
        auto at = [&](int64_t d) -> std::vector<int64_t> {
            return c.packed ? std::vector<int64_t>{s, h, d} : std::vector<int64_t>{b, h, s, d};
        };
        for (int64_t d = 0; d < R; ++d) x[size_t(d)] = in.get(at(c.offset + d));
        std::vector<int64_t> axis_positions;
        for (int64_t a = 0; a < A; ++a) axis_positions.push_back(position(a, b, s));
        const std::vector<double> y =
            qwen_mrope_reference(x, inv_d, axis_positions, c.sections, c.interleaved, c.backward);
        for (int64_t d = 0; d < c.D; ++d) {
            const bool rotated = d >= c.offset && d < c.offset + R;
            const double expected = rotated ? y[size_t(d - c.offset)] : in.get(at(d));
            const double got = out.get(at(d));
            const double ratio = std::fabs(got - expected) / (tol + tol * std::fabs(expected));
            worst = std::max(worst, std::isfinite(ratio) ? ratio : 1e30);
        }
    };
    for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) {
            for (int64_t h = 0; h < c.Hq; ++h) check_head(q_in, q_out, b, h, s);
            for (int64_t h = 0; h < c.Hk; ++h) check_head(k_in, k, b, h, s);
        }
    CHECK(worst <= 1.0);
}

}  // namespace

TEST_CASE(
    "M-RoPE matches Qwen2-VL's and Qwen3-VL's definitions over layouts, dtypes and angle sources") {
    CpuRuntime runtime;
    std::mt19937 rng(1234);
    for (bool interleaved : {false, true})
        for (bool table : {false, true})
            for (bool backward : {false, true})
                for (int shape = 0; shape < 3; ++shape)
                    for (Dt dt : {Dt::F32, Dt::BF16}) {
                        MropeCase c;
                        c.interleaved = interleaved;
                        c.table = table;
                        c.backward = backward;
                        c.packed = shape == 2;
                        c.batched_positions = shape == 0;
                        c.dt = dt;
                        c.index_dt = shape == 1 ? Dt::I32 : Dt::I64;
                        if (interleaved) c.sections = {6, 5, 5};  // Qwen3-VL's 24/20/20 scaled down
                        CAPTURE(interleaved);
                        CAPTURE(table);
                        CAPTURE(backward);
                        CAPTURE(shape);
                        CAPTURE(dt_name(dt));
                        run_mrope_case(runtime.handle, c, rng);
                    }
}

TEST_CASE(
    "M-RoPE with a text token (all axes equal) is plain RoPE, and one section is plain RoPE") {
    CpuRuntime runtime;
    std::mt19937 rng(99);
    MropeCase c;
    c.sections = {16};  // one axis: nothing to split
    run_mrope_case(runtime.handle, c, rng);
    c.sections = {2, 0, 14};  // an empty section is allowed
    run_mrope_case(runtime.handle, c, rng);
}

TEST_CASE(
    "axial RoPE with per-axis sections reproduces rotary-embedding-torch's get_axial_freqs "
    "output") {
    // ret_axial_4x6: q [2, 3, 24, 64], rotary_dim 32 interleaved, grid cell r = (r / 6, r % 6).
    // As M-RoPE: sections {8, 8}, positions [2, 24] = the grid indices, and a table whose
    // row j holds, in each section's columns, that axis' linspace(-1, 1, steps)[j] angles.
    CpuRuntime runtime;
    const std::vector<float> axis_inv = torch_pixel_freqs(32, 8);
    std::vector<float> inv = axis_inv;
    inv.insert(inv.end(), axis_inv.begin(), axis_inv.end());
    const int64_t rows = 6;
    const std::vector<float> steps4 = torch_linspace(-1, 1, 4), steps6 = torch_linspace(-1, 1, 6);
    std::vector<double> table_positions(2 * rows);
    for (int64_t j = 0; j < rows; ++j) {
        table_positions[size_t(j)] = steps4[size_t(std::min<int64_t>(j, 3))];  // rows 4, 5 unused
        table_positions[size_t(rows + j)] = steps6[size_t(j)];
    }
    const int32_t sections[2] = {8, 8};
    rope_jit_table_config table_config;
    rope_jit_table_config_init(&table_config);
    table_config.inv_freq = inv.data();
    table_config.num_freqs = 16;
    table_config.positions = table_positions.data();
    table_config.mrope_sections = sections;
    table_config.num_mrope_sections = 2;
    table_config.style = ROPE_JIT_STYLE_INTERLEAVED;
    table_config.float32_angles = 1;  // as torch rounds them, to meet the case's 1e-5
    for (bool full : {false, true}) {
        CAPTURE(full);
        HostTensor cos(Dt::F32, {rows, full ? 32 : 16}), sin(Dt::F32, {rows, full ? 32 : 16});
        REQUIRE(rope_jit_rope_tables(&table_config, cos.dl(), sin.dl(), nullptr) == ROPE_JIT_OK);

        HostTensor q(Dt::F32, {2, 3, 24, 64});
        const std::vector<float> q_values = read_golden_floats("ret_axial_4x6/in_q.bin");
        size_t e = 0;
        q.for_each([&](const std::vector<int64_t>& i) { q.set(i, q_values[e++]); });
        HostTensor positions(Dt::I32, {2, 24});
        for (int64_t r = 0; r < 24; ++r) {
            positions.set({0, r}, double(r / 6));
            positions.set({1, r}, double(r % 6));
        }
        rope_jit_rope_args args;
        rope_jit_rope_args_init(&args);
        args.q = q.dl();
        args.cos = cos.dl();
        args.sin = sin.dl();
        args.positions = positions.dl();
        args.mrope_sections = sections;
        args.num_mrope_sections = 2;
        args.rotary_dim = 32;
        args.style = ROPE_JIT_STYLE_INTERLEAVED;
        REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
        const std::vector<float> expected = read_golden_floats("ret_axial_4x6/out_q.bin");
        const std::vector<double> got = q.values();
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i)
            worst = std::max(
                worst, std::fabs(got[i] - expected[i]) / (1e-5 + 1e-5 * std::fabs(expected[i])));
        CHECK(worst <= 1.0);
    }
}

TEST_CASE("bad M-RoPE arguments are rejected, naming the argument, and nothing is written") {
    CpuRuntime runtime;
    std::mt19937 rng(5);
    HostTensor q(Dt::F32, {2, 2, 5, 16}), inv_freq(Dt::F32, {8}), positions(Dt::I64, {3, 2, 5});
    q.fill_uniform(rng, -1, 1);
    for (int64_t i = 0; i < 8; ++i) inv_freq.set({i}, 1.0 / double(i + 1));
    positions.for_each([&](const std::vector<int64_t>& i) { positions.set(i, double(i[2])); });
    HostTensor cos(Dt::F32, {6, 8}), sin(Dt::F32, {6, 8});
    int32_t sections[3] = {2, 3, 3};
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.inv_freq = inv_freq.dl();
    args.positions = positions.dl();
    args.mrope_sections = sections;
    args.num_mrope_sections = 3;
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);  // the valid call
    const std::vector<uint8_t> q_valid = q.bytes();
    auto expect_invalid = [&](const std::string& needle) {
        const rope_jit_status status = rope_jit_rope(runtime.handle, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        CHECK(q.bytes() == q_valid);
    };
    SUBCASE("sections that do not sum to R/2") {
        sections[2] = 2;
        expect_invalid("mrope_sections: sections sum to 7, but there are 8 rotary pairs");
    }
    SUBCASE("a negative section") {
        sections[0] = -1;
        sections[1] = 6;
        expect_invalid("mrope_sections: section 0 is negative");
    }
    SUBCASE("too many sections") {
        args.num_mrope_sections = 9;
        expect_invalid("mrope_sections: expected 1 to 8 sections");
    }
    SUBCASE("sections without a count, or a negative count") {
        args.num_mrope_sections = 0;
        expect_invalid("mrope_sections: given with num_mrope_sections = 0");
        args.num_mrope_sections = -1;
        expect_invalid("num_mrope_sections: must be >= 0");
    }
    SUBCASE("NULL sections") {
        args.mrope_sections = nullptr;
        expect_invalid("mrope_sections: NULL");
    }
    SUBCASE("interleaved sections that run past the pairs") {
        sections[0] = 0;
        sections[1] = 1;
        sections[2] = 7;  // axis 2 would need pairs 2, 5, ..., 20
        args.mrope_interleaved = 1;
        expect_invalid("interleaved section 2 of 7 pairs needs pair 20");
    }
    SUBCASE("no positions") {
        args.positions = nullptr;
        expect_invalid("positions: required with mrope_sections");
    }
    SUBCASE("positions without the leading axis, or with the wrong count") {
        HostTensor flat(Dt::I64, {2, 5});
        args.positions = flat.dl();
        expect_invalid("positions: expected [A, S] = [3, 5] or [A, B, S] = [3, 2, 5]");
        HostTensor two_axes(Dt::I64, {2, 2, 5});
        args.positions = two_axes.dl();
        expect_invalid("(A = num_mrope_sections)");
    }
    SUBCASE("a position outside the table, named with its axis") {
        args.inv_freq = nullptr;
        args.cos = cos.dl();
        args.sin = sin.dl();
        positions.set({2, 1, 4}, 6.0);
        expect_invalid("positions: [2, 1, 4] gives table row 6, outside cos's 6 rows");
    }
}

TEST_CASE("an old caller's smaller rope_args struct gets no sections and no frequency gradient") {
    CpuRuntime runtime;
    HostTensor q(Dt::F32, {1, 1, 3, 4}), inv_freq(Dt::F32, {2}), positions(Dt::I64, {3});
    q.set({0, 0, 1, 0}, 1.0);
    inv_freq.set({0}, 1.0);
    inv_freq.set({1}, 0.5);
    for (int64_t s = 0; s < 3; ++s) positions.set({s}, double(s));
    int32_t sections[2] = {1, 1};
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.inv_freq = inv_freq.dl();
    args.positions = positions.dl();  // one-axis positions: valid only without sections
    args.struct_size = offsetof(rope_jit_rope_args, mrope_sections);
    args.mrope_sections = sections;  // beyond the old struct: must be ignored
    args.num_mrope_sections = 2;
    CHECK(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    CHECK(q.get({0, 0, 1, 0}) == doctest::Approx(std::cos(1.0)));
    CHECK(q.get({0, 0, 1, 2}) == doctest::Approx(std::sin(1.0)));
}

TEST_CASE("on-the-fly angles match builder tables at positions up to 1,000,000") {
    // The contract every backend keeps: angles computed from inv_freq agree with a table
    // built (in float64) from the same inv_freq, far out in the context. Long-context
    // frequencies (Llama 3 scaled) over 4 pairs keep the table small.
    CpuRuntime runtime;
    rope_jit_freq_config freq = freq_config(ROPE_JIT_ROPE_TYPE_LLAMA3, 8, 500000);
    freq.factor = 8;
    freq.original_max_position_embeddings = 8192;
    const std::vector<float> inv = library_inv_freq(freq, 4);
    const int64_t P = 1000001;
    HostTensor cos(Dt::F32, {P, 4}), sin(Dt::F32, {P, 4});
    rope_jit_table_config table;
    rope_jit_table_config_init(&table);
    table.inv_freq = inv.data();
    table.num_freqs = 4;
    REQUIRE(rope_jit_rope_tables(&table, cos.dl(), sin.dl(), nullptr) == ROPE_JIT_OK);
    HostTensor inv_freq(Dt::F32, {4});
    for (int64_t i = 0; i < 4; ++i) inv_freq.set({i}, inv[size_t(i)]);

    std::mt19937 rng(11);
    HostTensor positions(Dt::I64, {2, 16});
    std::uniform_int_distribution<int64_t> far(900000, P - 1);
    positions.for_each([&](const std::vector<int64_t>& i) { positions.set(i, double(far(rng))); });
    positions.set({1, 15}, double(P - 1));
    for (Dt dt : {Dt::F32, Dt::BF16}) {
        CAPTURE(dt_name(dt));
        HostTensor q(dt, {2, 3, 16, 8});
        q.fill_uniform(rng, -2, 2);
        HostTensor with_table = q, on_the_fly = q;
        rope_jit_rope_args args;
        rope_jit_rope_args_init(&args);
        args.positions = positions.dl();
        args.q = with_table.dl();
        args.cos = cos.dl();
        args.sin = sin.dl();
        REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
        args.q = on_the_fly.dl();
        args.cos = args.sin = nullptr;
        args.inv_freq = inv_freq.dl();
        REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
        const std::vector<double> a = with_table.values(), b = on_the_fly.values();
        const double tol = dt == Dt::F32 ? 1e-5 : 1.6e-2;
        for (size_t e = 0; e < a.size(); ++e)
            CHECK(std::fabs(a[e] - b[e]) <= tol + tol * std::fabs(a[e]));
    }
}

// ==========================================================================================
// Learned frequencies: d(loss)/d(inv_freq)
// ==========================================================================================

namespace {

struct GradCase {
    Dt dt = Dt::F32;
    bool interleaved = false, has_k = true, xpos = false, mrope = false, packed = false;
    int64_t B = 2, Hq = 4, Hk = 2, S = 6, D = 20, R = 12, offset = 4;
};

// y for one head vector in float64, straight from the definition (forward only).
std::vector<double> rotate_reference(const std::vector<double>& x,
                                     const std::vector<double>& inv_freq,
                                     const std::vector<double>& pair_position,
                                     const std::vector<double>& scale, const GradCase& c) {
    std::vector<double> y = x;
    const int64_t half = c.R / 2;
    for (int64_t i = 0; i < half; ++i) {
        const int64_t i1 = c.interleaved ? c.offset + 2 * i : c.offset + i;
        const int64_t i2 = c.interleaved ? c.offset + 2 * i + 1 : c.offset + i + half;
        const double angle = pair_position[size_t(i)] * inv_freq[size_t(i)];
        y[size_t(i1)] =
            scale[size_t(i)] * (x[size_t(i1)] * std::cos(angle) - x[size_t(i2)] * std::sin(angle));
        y[size_t(i2)] =
            scale[size_t(i)] * (x[size_t(i2)] * std::cos(angle) + x[size_t(i1)] * std::sin(angle));
    }
    return y;
}

void run_grad_case(rope_jit_runtime* runtime, const GradCase& c, std::mt19937& rng) {
    const int64_t half = c.R / 2, P = 40;
    const int64_t B = c.packed ? 1 : c.B, S = c.packed ? c.B * c.S : c.S;
    auto head_tensor = [&](int64_t H) {
        return c.packed ? HostTensor(c.dt, {S, H, c.D}) : HostTensor(c.dt, {B, H, S, c.D});
    };
    auto index = [&](int64_t b, int64_t h, int64_t s, int64_t d) {
        return c.packed ? std::vector<int64_t>{s, h, d} : std::vector<int64_t>{b, h, s, d};
    };

    std::vector<float> inv(static_cast<size_t>(half));
    std::uniform_real_distribution<double> jitter(0.8, 1.2);
    for (int64_t i = 0; i < half; ++i)
        inv[size_t(i)] = float(std::pow(100.0, -double(2 * i) / double(c.R)) * jitter(rng));
    HostTensor inv_freq(Dt::F32, {half});
    for (int64_t i = 0; i < half; ++i) inv_freq.set({i}, inv[size_t(i)]);

    // Positions: per token (or per axis and token with M-RoPE sections {2, 2, 2}).
    const std::vector<int32_t> sections = {2, 2, 2};
    HostTensor positions =
        c.mrope ? (c.packed ? HostTensor(Dt::I64, {3, S}) : HostTensor(Dt::I64, {3, B, S}))
                : (c.packed ? HostTensor(Dt::I64, {S}) : HostTensor(Dt::I64, {B, S}));
    std::uniform_int_distribution<int64_t> any(0, P - 1);
    positions.for_each([&](const std::vector<int64_t>& i) { positions.set(i, double(any(rng))); });
    auto pair_positions = [&](int64_t b, int64_t s) {
        std::vector<double> p(static_cast<size_t>(half));
        for (int64_t i = 0; i < half; ++i) {
            if (!c.mrope)
                p[size_t(i)] = c.packed ? positions.get({s}) : positions.get({b, s});
            else {
                const int64_t axis = i / 2;  // contiguous sections of 2 pairs
                p[size_t(i)] = c.packed ? positions.get({axis, s}) : positions.get({axis, b, s});
            }
        }
        return p;
    };
    HostTensor xpos(Dt::F32, {P, half});
    xpos.fill_uniform(rng, 0.8, 1.25);
    auto scales = [&](int64_t b, int64_t s, bool is_k) {
        std::vector<double> scale(size_t(half), 1.0);
        if (!c.xpos) return scale;
        const std::vector<double> p = pair_positions(b, s);
        for (int64_t i = 0; i < half; ++i) {
            const double v = xpos.get({int64_t(p[size_t(i)]), i});
            scale[size_t(i)] = is_k ? 1.0 / v : v;
        }
        return scale;
    };

    // Forward inputs x and the upstream gradients w = d(loss)/dy.
    HostTensor xq = head_tensor(c.Hq), xk = head_tensor(c.Hk), wq = head_tensor(c.Hq),
               wk = head_tensor(c.Hk);
    for (HostTensor* t : {&xq, &xk, &wq, &wk}) t->fill_uniform(rng, -1, 1);
    HostTensor yq = head_tensor(c.Hq), yk = head_tensor(c.Hk);

    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = xq.dl();
    args.q_out = yq.dl();
    if (c.has_k) {
        args.k = xk.dl();
        args.k_out = yk.dl();
    }
    args.inv_freq = inv_freq.dl();
    args.positions = positions.dl();
    if (c.mrope) {
        args.mrope_sections = sections.data();
        args.num_mrope_sections = 3;
    }
    if (c.xpos) args.xpos_scale = xpos.dl();
    args.rotary_dim = int32_t(c.R);
    args.rotary_offset = int32_t(c.offset);
    args.style = c.interleaved ? ROPE_JIT_STYLE_INTERLEAVED : ROPE_JIT_STYLE_HALF;
    REQUIRE(rope_jit_rope(runtime, &args) == ROPE_JIT_OK);  // forward: y saved

    // Backward, in place on the gradients, with the frequency gradient.
    HostTensor gq = wq, gk = wk;
    HostTensor grad(Dt::F32, {half});
    grad.fill_uniform(rng, 100, 200);  // overwritten, not accumulated into
    args.q = gq.dl();
    args.q_out = nullptr;
    args.k = c.has_k ? gk.dl() : nullptr;
    args.k_out = nullptr;
    args.backward = 1;
    args.inv_freq_grad = grad.dl();
    args.q_saved = yq.dl();
    args.k_saved = c.has_k ? yk.dl() : nullptr;
    const rope_jit_status status = rope_jit_rope(runtime, &args);
    CAPTURE(rope_jit_last_error());
    REQUIRE(status == ROPE_JIT_OK);

    // The loss L(f) = sum w . y(x; f) in float64, and its central differences.
    auto loss = [&](const std::vector<double>& f) {
        double total = 0;
        auto add = [&](const HostTensor& x, const HostTensor& w, int64_t H, bool is_k) {
            for (int64_t b = 0; b < B; ++b)
                for (int64_t s = 0; s < S; ++s)
                    for (int64_t h = 0; h < H; ++h) {
                        std::vector<double> xv(static_cast<size_t>(c.D));
                        for (int64_t d = 0; d < c.D; ++d) xv[size_t(d)] = x.get(index(b, h, s, d));
                        const std::vector<double> y =
                            rotate_reference(xv, f, pair_positions(b, s), scales(b, s, is_k), c);
                        for (int64_t d = 0; d < c.D; ++d)
                            total += w.get(index(b, h, s, d)) * y[size_t(d)];
                    }
        };
        add(xq, wq, c.Hq, false);
        if (c.has_k) add(xk, wk, c.Hk, true);
        return total;
    };
    std::vector<double> f(inv.begin(), inv.end());
    // What the rounding of the stored y is relative to: per pair, the sum of |p (g2 y1 - g1 y2)|
    // over its terms. y is rounded once to the tensor dtype (and computed in float32).
    std::vector<double> magnitude(size_t(half), 0.0);
    auto add_magnitude = [&](const HostTensor& x, const HostTensor& w, int64_t H, bool is_k) {
        for (int64_t b = 0; b < B; ++b)
            for (int64_t s = 0; s < S; ++s)
                for (int64_t h = 0; h < H; ++h) {
                    std::vector<double> xv(static_cast<size_t>(c.D));
                    for (int64_t d = 0; d < c.D; ++d) xv[size_t(d)] = x.get(index(b, h, s, d));
                    const std::vector<double> p = pair_positions(b, s);
                    const std::vector<double> y = rotate_reference(xv, f, p, scales(b, s, is_k), c);
                    for (int64_t i = 0; i < half; ++i) {
                        const int64_t i1 = c.interleaved ? c.offset + 2 * i : c.offset + i;
                        const int64_t i2 =
                            c.interleaved ? c.offset + 2 * i + 1 : c.offset + i + half;
                        magnitude[size_t(i)] +=
                            std::fabs(p[size_t(i)]) *
                            (std::fabs(w.get(index(b, h, s, i2)) * y[size_t(i1)]) +
                             std::fabs(w.get(index(b, h, s, i1)) * y[size_t(i2)]));
                    }
                }
    };
    add_magnitude(xq, wq, c.Hq, false);
    if (c.has_k) add_magnitude(xk, wk, c.Hk, true);
    const double relative = c.dt == Dt::F32   ? 1e-6
                            : c.dt == Dt::F16 ? std::ldexp(1.0, -10)
                                              : std::ldexp(1.0, -7);
    for (int64_t i = 0; i < half; ++i) {
        CAPTURE(i);
        CAPTURE(magnitude[size_t(i)]);
        const double h = 1e-6 * f[size_t(i)];
        std::vector<double> up = f, down = f;
        up[size_t(i)] += h;
        down[size_t(i)] -= h;
        const double finite_difference = (loss(up) - loss(down)) / (2 * h);
        CAPTURE(finite_difference);
        CHECK(std::fabs(grad.get({i}) - finite_difference) <=
              relative * magnitude[size_t(i)] + 1e-7);
    }

    // The input gradients are the inverse rotation of w (scaled like the forward).
    double worst = 0;
    const double tol = tolerance_for(c.dt);
    auto check_input_gradient = [&](const HostTensor& w, const HostTensor& g, int64_t H,
                                    bool is_k) {
        for (int64_t b = 0; b < B; ++b)
            for (int64_t s = 0; s < S; ++s)
                for (int64_t h = 0; h < H; ++h) {
                    std::vector<double> wv(static_cast<size_t>(c.D));
                    for (int64_t d = 0; d < c.D; ++d) wv[size_t(d)] = w.get(index(b, h, s, d));
                    std::vector<double> p = pair_positions(b, s);
                    std::vector<double> minus_f(f.size());
                    for (size_t i = 0; i < f.size(); ++i) minus_f[i] = -f[i];
                    const std::vector<double> expected =
                        rotate_reference(wv, minus_f, p, scales(b, s, is_k), c);
                    for (int64_t d = 0; d < c.D; ++d) {
                        const double e = expected[size_t(d)], got = g.get(index(b, h, s, d));
                        worst = std::max(worst, std::fabs(got - e) / (tol + tol * std::fabs(e)));
                    }
                }
    };
    check_input_gradient(wq, gq, c.Hq, false);
    if (c.has_k) check_input_gradient(wk, gk, c.Hk, true);
    CHECK(worst <= 1.0);
}

}  // namespace

TEST_CASE("the frequency gradient matches finite differences of the loss") {
    CpuRuntime runtime;
    std::mt19937 rng(2024);
    for (bool interleaved : {false, true})
        for (bool has_k : {false, true})
            for (bool xpos : {false, true})
                for (bool mrope : {false, true})
                    for (bool packed : {false, true}) {
                        GradCase c;
                        c.interleaved = interleaved;
                        c.has_k = has_k;
                        c.xpos = xpos;
                        c.mrope = mrope;
                        c.packed = packed;
                        CAPTURE(interleaved);
                        CAPTURE(has_k);
                        CAPTURE(xpos);
                        CAPTURE(mrope);
                        CAPTURE(packed);
                        run_grad_case(runtime.handle, c, rng);
                    }
    SUBCASE("bfloat16 and float16 tensors") {
        for (Dt dt : {Dt::BF16, Dt::F16}) {
            GradCase c;
            c.dt = dt;
            CAPTURE(dt_name(dt));
            run_grad_case(runtime.handle, c, rng);
        }
    }
}

TEST_CASE("an empty backward still writes a zero frequency gradient") {
    CpuRuntime runtime;
    HostTensor q(Dt::F32, {0, 2, 3, 8}), saved(Dt::F32, {0, 2, 3, 8}), inv_freq(Dt::F32, {4}),
        grad(Dt::F32, {4});
    std::mt19937 rng(1);
    grad.fill_uniform(rng, 1, 2);
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.inv_freq = inv_freq.dl();
    args.backward = 1;
    args.inv_freq_grad = grad.dl();
    args.q_saved = saved.dl();
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    for (int64_t i = 0; i < 4; ++i) CHECK(grad.get({i}) == 0.0);
}

TEST_CASE("bad frequency-gradient arguments are rejected, naming the argument") {
    CpuRuntime runtime;
    std::mt19937 rng(3);
    HostTensor q(Dt::F32, {1, 2, 4, 8}), k(Dt::F32, {1, 1, 4, 8}), q_saved(Dt::F32, {1, 2, 4, 8}),
        k_saved(Dt::F32, {1, 1, 4, 8}), inv_freq(Dt::F32, {4}), grad(Dt::F32, {4});
    for (HostTensor* t : {&q, &k, &q_saved, &k_saved, &inv_freq}) t->fill_uniform(rng, 0.1, 1);
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.k = k.dl();
    args.inv_freq = inv_freq.dl();
    args.backward = 1;
    args.inv_freq_grad = grad.dl();
    args.q_saved = q_saved.dl();
    args.k_saved = k_saved.dl();
    REQUIRE(rope_jit_rope(runtime.handle, &args) == ROPE_JIT_OK);
    const std::vector<uint8_t> q_valid = q.bytes();
    auto expect_invalid = [&](const std::string& needle) {
        const rope_jit_status status = rope_jit_rope(runtime.handle, &args);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
        CHECK(message.find(needle) != std::string::npos);
        CHECK(q.bytes() == q_valid);
    };
    SUBCASE("in the forward pass") {
        args.backward = 0;
        expect_invalid("inv_freq_grad: only defined for the backward pass");
    }
    SUBCASE("with tables") {
        HostTensor cos(Dt::F32, {4, 4}), sin(Dt::F32, {4, 4});
        args.cos = cos.dl();
        args.sin = sin.dl();
        expect_invalid("inv_freq_grad: needs angles from inv_freq");
    }
    SUBCASE("of the wrong dtype or size") {
        HostTensor half_grad(Dt::F16, {4}), long_grad(Dt::F32, {5});
        args.inv_freq_grad = half_grad.dl();
        expect_invalid("inv_freq_grad: expected float32 [4]");
        args.inv_freq_grad = long_grad.dl();
        expect_invalid("inv_freq_grad: expected float32 [4]");
    }
    SUBCASE("without the saved outputs") {
        args.q_saved = nullptr;
        expect_invalid("q_saved: required with inv_freq_grad");
        args.q_saved = q_saved.dl();
        args.k_saved = nullptr;
        expect_invalid("k_saved: required with inv_freq_grad when k is given");
    }
    SUBCASE("saved outputs of the wrong shape") {
        HostTensor small(Dt::F32, {1, 2, 3, 8});
        args.q_saved = small.dl();
        expect_invalid("q_saved: shape [1, 2, 3, 8] does not match q [1, 2, 4, 8]");
    }
    SUBCASE("k_saved without k, or saved outputs without a gradient") {
        args.k = nullptr;
        expect_invalid("k_saved: given without k");
        args.k_saved = nullptr;
        args.inv_freq_grad = nullptr;
        expect_invalid("q_saved: only used with inv_freq_grad");
    }
    SUBCASE("a saved output that is also the in-place output") {
        args.q_saved = q.dl();
        expect_invalid("q_saved: overlaps the output q");
    }
    SUBCASE("a gradient that overlaps an input") {
        args.inv_freq_grad = inv_freq.dl();
        expect_invalid("inv_freq_grad: overlaps");
    }
    SUBCASE("a gradient whose zero stride puts every pair on one element") {
        for (int64_t i = 0; i < 4; ++i) grad.set({i}, 7.0);
        int64_t shape[1] = {4}, strides[1] = {0};
        DLTensor one_element = *grad.dl();
        one_element.shape = shape;
        one_element.strides = strides;
        args.inv_freq_grad = &one_element;
        expect_invalid("inv_freq_grad: its strides may make several indices address");
        CHECK(grad.values() == std::vector<double>(4, 7.0));
    }
}

TEST_CASE(
    "a frequency gradient on the memory of positions, seqlen_offsets or cu_seqlens is refused") {
    // The gradient is written while the call reads its indices: it needs memory of its own.
    // Each index tensor holds at least the gradient's 16 bytes, which lie on its first ones.
    CpuRuntime runtime;
    std::mt19937 rng(4);
    HostTensor q(Dt::F32, {2, 2, 4, 8}), q_saved(Dt::F32, {2, 2, 4, 8}), inv_freq(Dt::F32, {4});
    HostTensor packed(Dt::F32, {8, 2, 8}), packed_saved(Dt::F32, {8, 2, 8});
    for (HostTensor* t : {&q, &q_saved, &inv_freq, &packed, &packed_saved})
        t->fill_uniform(rng, 0.1, 1);
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);
    args.q = q.dl();
    args.inv_freq = inv_freq.dl();
    args.backward = 1;
    args.q_saved = q_saved.dl();
    HostTensor index;
    std::string name;
    SUBCASE("positions") {
        index = HostTensor(Dt::I64, {4});
        for (int64_t s = 0; s < 4; ++s) index.set({s}, double(s));
        args.positions = index.dl();
        name = "positions";
    }
    SUBCASE("seqlen_offsets") {
        index = HostTensor(Dt::I64, {2});
        index.set({0}, 0.0);
        index.set({1}, 3.0);
        args.seqlen_offsets = index.dl();
        name = "seqlen_offsets";
    }
    SUBCASE("cu_seqlens") {
        index = HostTensor(Dt::I64, {3});
        index.set({0}, 0.0);
        index.set({1}, 3.0);
        index.set({2}, 8.0);
        args.q = packed.dl();
        args.q_saved = packed_saved.dl();
        args.cu_seqlens = index.dl();
        name = "cu_seqlens";
    }
    CAPTURE(name);
    // With a gradient of its own the call is valid.
    HostTensor grad(Dt::F32, {4});
    args.inv_freq_grad = grad.dl();
    {
        HostTensor q_copy = q, packed_copy = packed;
        const DLTensor* given = args.q;
        args.q = given == q.dl() ? q_copy.dl() : packed_copy.dl();
        const rope_jit_status status = rope_jit_rope(runtime.handle, &args);
        INFO(rope_jit_last_error());
        REQUIRE(status == ROPE_JIT_OK);
        args.q = given;
    }
    int64_t grad_shape[1] = {4};
    DLTensor over_index = *index.dl();
    over_index.dtype = dl_type(Dt::F32);
    over_index.ndim = 1;
    over_index.shape = grad_shape;
    over_index.strides = nullptr;
    args.inv_freq_grad = &over_index;
    const std::vector<uint8_t> q_before = q.bytes(), packed_before = packed.bytes(),
                               index_before = index.bytes();
    const rope_jit_status status = rope_jit_rope(runtime.handle, &args);
    const std::string message = rope_jit_last_error();
    CAPTURE(message);
    CHECK(status == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(message.find("inv_freq_grad: overlaps " + name) != std::string::npos);
    CHECK(index.bytes() == index_before);
    CHECK(q.bytes() == q_before);
    CHECK(packed.bytes() == packed_before);
}

TEST_CASE(
    "lists whose stated length is not what the builders read are rejected before reading them") {
    SUBCASE(
        "longrope short_factor or long_factor with fewer (or more) than rotary_dim / 2 elements") {
        const std::vector<float> one = {1.0f};
        std::vector<float> factors(64, 1.0f);
        rope_jit_freq_config config = freq_config(ROPE_JIT_ROPE_TYPE_LONGROPE, 128, 10000);
        config.original_max_position_embeddings = 4096;
        config.factor = 2;
        config.short_factor = one.data();
        config.long_factor = factors.data();
        config.num_short_factor = one.size();
        config.num_long_factor = factors.size();
        std::vector<float> inv(64, 7.0f);
        CHECK(rope_jit_inv_freq(&config, inv.data(), 64, nullptr) ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(message.find("short_factor: num_short_factor is 1, but rope_type longrope reads "
                           "rotary_dim / 2 = 64") != std::string::npos);
        CHECK(inv == std::vector<float>(64, 7.0f));
        // The long list is checked whichever one the sequence length picks.
        config.short_factor = factors.data();
        config.num_short_factor = 64;
        config.num_long_factor = 65;
        CHECK(rope_jit_inv_freq(&config, inv.data(), 64, nullptr) ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        message = rope_jit_last_error();
        CHECK(message.find("long_factor: num_long_factor is 65") != std::string::npos);
        // Stated right, or not stated (0): computed.
        config.num_long_factor = 64;
        CHECK(rope_jit_inv_freq(&config, inv.data(), 64, nullptr) == ROPE_JIT_OK);
        CHECK(inv[0] == 1.0f);
        config.num_short_factor = config.num_long_factor = 0;
        CHECK(rope_jit_inv_freq(&config, inv.data(), 64, nullptr) == ROPE_JIT_OK);
    }
    SUBCASE("table positions shorter than the tables' rows (times the sections)") {
        const std::vector<float> inv = {1.0f, 0.1f, 0.01f, 0.001f};
        rope_jit_table_config config;
        rope_jit_table_config_init(&config);
        config.inv_freq = inv.data();
        config.num_freqs = inv.size();
        const std::vector<double> positions = {0.0};
        config.positions = positions.data();
        config.num_positions = positions.size();
        HostTensor cos(Dt::F32, {4, 4});
        const std::vector<uint8_t> before = cos.bytes();
        CHECK(rope_jit_rope_tables(&config, cos.dl(), nullptr, nullptr) ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(message.find("positions: num_positions is 1, but the tables' 4 rows need 4") !=
              std::string::npos);
        CHECK(cos.bytes() == before);
        // With two sections every row reads two positions: 4 rows need 8.
        const std::vector<double> four = {0, 1, 2, 3};
        const int32_t sections[2] = {1, 1};
        HostTensor half_cos(Dt::F32, {4, 2});
        const std::vector<float> two = {1.0f, 0.5f};
        config.inv_freq = two.data();
        config.num_freqs = 2;
        config.positions = four.data();
        config.num_positions = four.size();
        config.mrope_sections = sections;
        config.num_mrope_sections = 2;
        CHECK(rope_jit_rope_tables(&config, half_cos.dl(), nullptr, nullptr) ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        message = rope_jit_last_error();
        CHECK(message.find("positions: num_positions is 4, but the tables' 4 rows need 8") !=
              std::string::npos);
        // Enough positions (more is fine: a longer buffer), or not stated: filled.
        const std::vector<double> nine = {0, 1, 2, 3, 0, 1, 2, 3, 99};
        config.positions = nine.data();
        config.num_positions = nine.size();
        CHECK(rope_jit_rope_tables(&config, half_cos.dl(), nullptr, nullptr) == ROPE_JIT_OK);
        CHECK(half_cos.get({3, 0}) == doctest::Approx(std::cos(3.0)));
        CHECK(half_cos.get({3, 1}) == doctest::Approx(std::cos(1.5)));
    }
}

TEST_CASE("a table whose device type is outside DLPack's enum is rejected as a raw integer") {
    const std::vector<float> inv = {1.0f, 0.5f};
    rope_jit_table_config config;
    rope_jit_table_config_init(&config);
    config.inv_freq = inv.data();
    config.num_freqs = 2;
    HostTensor cos(Dt::F32, {5, 4});
    const std::vector<uint8_t> before = cos.bytes();
    for (int type : {16, -1}) {
        CAPTURE(type);
        std::memcpy(&cos.dl()->device.device_type, &type, sizeof type);
        CHECK(rope_jit_rope_tables(&config, cos.dl(), nullptr, nullptr) ==
              ROPE_JIT_ERROR_INVALID_ARGUMENT);
        const std::string message = rope_jit_last_error();
        CAPTURE(message);
        CHECK(message.find("cos: device type " + std::to_string(type) + " is not") !=
              std::string::npos);
        CHECK(cos.bytes() == before);
    }
}
