// rope-jit-golden: runs the golden cases (tests/golden/README.md defines the format and the
// semantics) through the public C API only, and compares every output with the recorded one.
//
//   rope-jit-golden DIR [--backend auto|cpu|cuda] [--ops rope,attention,inv_freq]
//                       [--angles table|inv_freq] [--case SUBSTRING] [--device N] [--json]
//
// Exit status: 0 when every selected case passed, 1 when one failed or was unsupported, when
// none was selected, or when the runtime could not be created, 2 on a usage error or an
// unreadable manifest.
//
// Each op has one runner function in the dispatch table `op_runners`; an op the C API cannot
// run yet has a runner that reports it unsupported, so that it counts as failed.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <nlohmann/json.hpp>

#include "common/bounded_json.h"  // the library's bound on JSON nesting (compiled in)
#include "common/half_float.h"  // header-only: the same fp16/bf16 conversions as the library
// Device memory for --backend cuda (the tool's own copy of the loader).
#include "cuda/cuda_driver.h"
#include "rope_jit/rope_jit.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// ============================================================================================
// Failures of one case. They end that case only: the runner goes on with the next one.
// ============================================================================================

// The case ran and is wrong, or the case itself is malformed: reported as FAIL.
struct CaseFailure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The case is well formed but this runner (or the C API) cannot run it: reported as
// unsupported, which counts as failed.
struct CaseUnsupported : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A bad command line or an unreadable manifest: exit status 2.
struct UsageError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// ============================================================================================
// Command line
// ============================================================================================

enum class AngleMode { Table, InvFreq };

struct Options {
    std::string dir;
    rope_jit_backend_kind backend = ROPE_JIT_BACKEND_AUTO;
    std::set<std::string> ops;  // empty: every op
    AngleMode angles = AngleMode::Table;
    std::string case_filter;  // substring of the case name; empty: every case
    int device = 0;           // the CUDA device the tensors live on (CUDA backend)
    bool json = false;
    bool help = false;
};

const char* const kUsage =
    "usage: rope-jit-golden DIR [--backend auto|cpu|cuda] [--ops rope,attention,inv_freq]\n"
    "                           [--angles table|inv_freq] [--case SUBSTRING] [--device N] "
    "[--json]\n"
    "\n"
    "Runs every case of DIR/manifest.json (format rope-jit-golden/1) whose op is in --ops\n"
    "(default: all) through the rope-jit C API and compares its outputs with the recorded ones.\n"
    "  --backend   runtime backend (default auto)\n"
    "  --angles    rope cases: pass the cos/sin tables (default) or inv_freq instead\n"
    "  --case      run only the cases whose name contains SUBSTRING\n"
    "  --device    CUDA backend: put the tensors on device N (default 0)\n"
    "  --json      print one JSON object instead of one line per case\n"
    "Ends with the runtime's kernel counters (compiled, read from the disk cache, launched).\n"
    "Exit status: 0 all passed, 1 some failed or unsupported or none selected, 2 usage error.\n";

const std::set<std::string> kKnownOps = {"rope", "attention", "inv_freq"};

std::vector<std::string> split_commas(const std::string& text) {
    std::vector<std::string> parts;
    std::stringstream stream(text);
    std::string part;
    while (std::getline(stream, part, ',')) parts.push_back(part);
    return parts;
}

rope_jit_backend_kind parse_backend(const std::string& value) {
    if (value == "auto") return ROPE_JIT_BACKEND_AUTO;
    if (value == "cpu") return ROPE_JIT_BACKEND_CPU;
    if (value == "cuda") return ROPE_JIT_BACKEND_CUDA;
    throw UsageError(fmt::format("--backend: expected auto, cpu or cuda, got '{}'", value));
}

std::set<std::string> parse_ops(const std::string& value) {
    std::set<std::string> ops;
    for (const std::string& op : split_commas(value)) {
        if (kKnownOps.count(op) == 0)
            throw UsageError(
                fmt::format("--ops: unknown op '{}' (known: rope, attention, inv_freq)", op));
        ops.insert(op);
    }
    if (ops.empty()) throw UsageError("--ops: expected a comma-separated list of ops");
    return ops;
}

AngleMode parse_angles(const std::string& value) {
    if (value == "table") return AngleMode::Table;
    if (value == "inv_freq") return AngleMode::InvFreq;
    throw UsageError(fmt::format("--angles: expected table or inv_freq, got '{}'", value));
}

int parse_device(const std::string& value) {
    size_t used = 0;
    int device = -1;
    try {
        device = std::stoi(value, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != value.size() || device < 0)
        throw UsageError(
            fmt::format("--device: expected a device ordinal (0, 1, ...), got '{}'", value));
    return device;
}

// Accepts both "--flag value" and "--flag=value".
Options parse_options(int argc, char** argv) {
    Options options;
    bool have_dir = false;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        std::optional<std::string> inline_value;
        if (arg.rfind("--", 0) == 0 && arg.find('=') != std::string::npos) {
            inline_value = arg.substr(arg.find('=') + 1);
            arg = arg.substr(0, arg.find('='));
        }
        auto value = [&]() -> std::string {
            if (inline_value) return *inline_value;
            if (i + 1 >= argc) throw UsageError(fmt::format("{}: missing value", arg));
            return argv[++i];
        };
        if (arg == "-h" || arg == "--help") {
            options.help = true;
        } else if (arg == "--backend") {
            options.backend = parse_backend(value());
        } else if (arg == "--ops") {
            options.ops = parse_ops(value());
        } else if (arg == "--angles") {
            options.angles = parse_angles(value());
        } else if (arg == "--case") {
            options.case_filter = value();
        } else if (arg == "--device") {
            options.device = parse_device(value());
        } else if (arg == "--json") {
            if (inline_value) throw UsageError("--json takes no value");
            options.json = true;
        } else if (arg.size() > 1 && arg[0] == '-') {
            throw UsageError(fmt::format("unknown option '{}'", arg));
        } else if (have_dir) {
            throw UsageError(
                fmt::format("unexpected argument '{}' (DIR is already '{}')", arg, options.dir));
        } else {
            options.dir = arg;
            have_dir = true;
        }
    }
    if (!have_dir && !options.help)
        throw UsageError("missing DIR (the folder holding manifest.json)");
    return options;
}

// ============================================================================================
// Arrays as the golden files store them
// ============================================================================================

enum class ElementType { F32, F16, BF16, I32, I64, Bool };

struct ElementInfo {
    ElementType type;
    const char* name;  // as the manifest spells it
    size_t size;       // bytes
    DLDataType dl;
};

// DLPack 0.6 has no bool code; one-byte unsigned integers are its usual stand-in.
const ElementInfo kElements[] = {
    {ElementType::F32, "float32", 4, {kDLFloat, 32, 1}},
    {ElementType::F16, "float16", 2, {kDLFloat, 16, 1}},
    {ElementType::BF16, "bfloat16", 2, {kDLBfloat, 16, 1}},
    {ElementType::I32, "int32", 4, {kDLInt, 32, 1}},
    {ElementType::I64, "int64", 8, {kDLInt, 64, 1}},
    {ElementType::Bool, "bool", 1, {kDLUInt, 8, 1}},
};

const ElementInfo& element_info(ElementType type) {
    for (const ElementInfo& info : kElements)
        if (info.type == type) return info;
    return kElements[0];  // unreachable: every enumerator is in the table
}

std::string shape_string(const std::vector<int64_t>& shape) {
    return fmt::format("[{}]", fmt::join(shape, ", "));
}

// One file's contents: little-endian, C-contiguous, shape as in the manifest.
struct HostArray {
    ElementType type = ElementType::F32;
    std::vector<int64_t> shape;
    std::vector<unsigned char> bytes;
    // The case file holding the bytes until read_arrays reads them; empty for arrays the
    // runner makes itself.
    fs::path file;

    int64_t numel() const {
        int64_t n = 1;
        for (int64_t extent : shape) n *= extent;
        return n;
    }

    // Element i (flat index) as a double: every dtype converts exactly.
    double at(int64_t i) const {
        const unsigned char* p = bytes.data() + size_t(i) * element_info(type).size;
        switch (type) {
            case ElementType::F32: {
                float v;
                std::memcpy(&v, p, 4);
                return v;
            }
            case ElementType::F16: {
                uint16_t v;
                std::memcpy(&v, p, 2);
                return rope_jit::fp16_to_float(v);
            }
            case ElementType::BF16: {
                uint16_t v;
                std::memcpy(&v, p, 2);
                return rope_jit::bf16_to_float(v);
            }
            case ElementType::I32: {
                int32_t v;
                std::memcpy(&v, p, 4);
                return v;
            }
            case ElementType::I64: {
                int64_t v;
                std::memcpy(&v, p, 8);
                return double(v);
            }
            case ElementType::Bool: return *p != 0 ? 1.0 : 0.0;
        }
        return 0.0;
    }

    bool is_float() const {
        return type == ElementType::F32 || type == ElementType::F16 || type == ElementType::BF16;
    }
    bool is_index() const { return type == ElementType::I32 || type == ElementType::I64; }
};

ElementType parse_element_type(const json& value, const std::string& what) {
    if (value.is_string())
        for (const ElementInfo& info : kElements)
            if (value.get<std::string>() == info.name) return info.type;
    throw CaseFailure(fmt::format("{}: unknown dtype {}", what, value.dump()));
}

std::vector<int64_t> parse_shape(const json& value, const std::string& what) {
    if (!value.is_array())
        throw CaseFailure(fmt::format("{}: shape must be an array, got {}", what, value.dump()));
    std::vector<int64_t> shape;
    for (const json& extent : value) {
        if (!extent.is_number_integer() || extent.get<int64_t>() < 0)
            throw CaseFailure(
                fmt::format("{}: shape {} must hold non-negative integers", what, value.dump()));
        shape.push_back(extent.get<int64_t>());
    }
    return shape;
}

// Byte size of a shape, refusing absurd shapes before they overflow or exhaust memory.
uint64_t checked_byte_size(const std::vector<int64_t>& shape, size_t item_size,
                           const std::string& what) {
    const uint64_t limit = uint64_t(1) << 40;
    uint64_t bytes = item_size;
    for (int64_t extent : shape) {
        if (extent != 0 && bytes > limit / uint64_t(extent))
            throw CaseFailure(fmt::format("{}: shape {} is too large", what, shape_string(shape)));
        bytes *= uint64_t(extent);
    }
    return bytes;
}

// The array a manifest entry {file, dtype, shape} describes, its bytes not yet read: each
// runner first checks what the case's names, dtypes, ranks, output shapes and params decide,
// so that a case failing those costs no read of what may be gigabytes (read_arrays reads;
// the library checks the rest, such as the tables' shapes, on the data). `what` names the
// entry in messages.
HostArray declare_array(const fs::path& dir, const json& spec, const std::string& what) {
    if (!spec.is_object() || !spec.contains("file") || !spec["file"].is_string() ||
        !spec.contains("dtype") || !spec.contains("shape"))
        throw CaseFailure(fmt::format("{}: expected {{\"file\", \"dtype\", \"shape\"}}, got {}",
                                      what, spec.dump()));
    HostArray array;
    array.type = parse_element_type(spec["dtype"], what);
    array.shape = parse_shape(spec["shape"], what);
    const uint64_t expected_bytes =
        checked_byte_size(array.shape, element_info(array.type).size, what);

    array.file = dir / spec["file"].get<std::string>();
    std::error_code error;
    const uintmax_t file_bytes = fs::file_size(array.file, error);
    if (error)
        throw CaseFailure(
            fmt::format("{}: cannot read {}: {}", what, array.file.string(), error.message()));
    if (file_bytes != expected_bytes)
        throw CaseFailure(fmt::format("{}: {} has {} bytes, but {} {} needs {}", what,
                                      array.file.string(), file_bytes,
                                      element_info(array.type).name, shape_string(array.shape),
                                      expected_bytes));
    return array;
}

using ArrayMap = std::map<std::string, HostArray>;

// Declares every entry of a case's "inputs" or "outputs" object.
ArrayMap declare_arrays(const fs::path& dir, const json& entries, const std::string& section) {
    if (!entries.is_object()) throw CaseFailure(fmt::format("{}: must be an object", section));
    ArrayMap arrays;
    for (const auto& [name, spec] : entries.items())
        arrays.emplace(name, declare_array(dir, spec, fmt::format("{} '{}'", section, name)));
    return arrays;
}

// Reads the bytes of every declared array (their sizes were checked by declare_array).
void read_arrays(ArrayMap& arrays, const std::string& section) {
    for (auto& [name, array] : arrays) {
        const size_t size = size_t(array.numel()) * element_info(array.type).size;
        array.bytes.resize(size);
        std::ifstream file(array.file, std::ios::binary);
        if (!file.read(reinterpret_cast<char*>(array.bytes.data()), std::streamsize(size)))
            throw CaseFailure(fmt::format("{} '{}': reading {} failed", section, name,
                                          array.file.string()));
    }
}

// ============================================================================================
// Where tensors live: host memory on the CPU backend, device memory (cuMemAlloc) on the CUDA
// backend, so that `--backend cuda` exercises the GPU path end to end. TensorStorage is the
// only code that knows which.
// ============================================================================================

// Device memory for the CUDA backend, through the library's own driver loader (compiled into
// this tool; the tool calls the library only through its C API).
class DeviceMemory {
public:
    // Makes device `ordinal`'s primary context current, as a framework would; tensors are
    // allocated there from now on.
    static void activate(int ordinal) {
        const rope_jit::CudaDriverApi* api = rope_jit::cuda_driver_api();
        if (api == nullptr)
            throw UsageError("CUDA backend without a driver: " +
                             rope_jit::cuda_driver_load_error());
        const int count = rope_jit::cuda_device_count();
        if (ordinal >= count)
            throw UsageError(fmt::format(
                "--device: {} is not a device of this machine, which has {}", ordinal, count));
        rope_jit::CUdevice device = 0;
        rope_jit::check_cu(api->cuDeviceGet(&device, ordinal), "cuDeviceGet");
        rope_jit::CUcontext context = nullptr;
        rope_jit::check_cu(api->cuDevicePrimaryCtxRetain(&context, device),
                           "cuDevicePrimaryCtxRetain");
        rope_jit::check_cu(api->cuCtxSetCurrent(context), "cuCtxSetCurrent");
        enabled() = true;
        ordinal_() = ordinal;
    }
    static int ordinal() { return ordinal_(); }
    static bool& enabled() {
        static bool on = false;
        return on;
    }
    static int& ordinal_() {
        static int device = 0;
        return device;
    }
    static const rope_jit::CudaDriverApi& api() { return *rope_jit::cuda_driver_api(); }
};

class TensorStorage {
public:
    TensorStorage() = default;
    TensorStorage(TensorStorage&& other) noexcept
        : host_(std::move(other.host_)), device_(other.device_) {
        other.device_ = 0;
    }
    TensorStorage& operator=(TensorStorage&&) = delete;
    TensorStorage(const TensorStorage&) = delete;
    ~TensorStorage() {
        if (device_ != 0) DeviceMemory::api().cuMemFree(device_);
    }

    // A copy of `host`, where the library will read (and, in place, write) it.
    static TensorStorage upload(const HostArray& host) {
        TensorStorage storage;
        storage.host_ = host;
        storage.to_device();
        return storage;
    }

    // A fresh buffer whose every byte is `fill`.
    static TensorStorage allocate(ElementType type, const std::vector<int64_t>& shape,
                                  unsigned char fill) {
        TensorStorage storage;
        storage.host_.type = type;
        storage.host_.shape = shape;
        storage.host_.bytes.assign(size_t(storage.host_.numel()) * element_info(type).size, fill);
        storage.to_device();
        return storage;
    }

    // The current contents, back in host memory. The library launched on the legacy default
    // stream, which this synchronous copy waits for.
    HostArray download() const {
        HostArray copy = host_;
        if (device_ != 0 && !copy.bytes.empty())
            rope_jit::check_cu(
                DeviceMemory::api().cuMemcpyDtoH(copy.bytes.data(), device_, copy.bytes.size()),
                "cuMemcpyDtoH");
        return copy;
    }

    void* data() {
        if (device_ != 0) return reinterpret_cast<void*>(device_);
        return host_.bytes.empty() ? nullptr : host_.bytes.data();
    }
    DLDevice device() const {
        return device_ != 0 ? DLDevice{kDLCUDA, DeviceMemory::ordinal()} : DLDevice{kDLCPU, 0};
    }
    ElementType type() const { return host_.type; }
    const std::vector<int64_t>& shape() const { return host_.shape; }

private:
    void to_device() {
        if (!DeviceMemory::enabled() || host_.bytes.empty()) return;
        const rope_jit::CudaDriverApi& api = DeviceMemory::api();
        rope_jit::check_cu(api.cuMemAlloc(&device_, host_.bytes.size()), "cuMemAlloc");
        rope_jit::check_cu(api.cuMemcpyHtoD(device_, host_.bytes.data(), host_.bytes.size()),
                           "cuMemcpyHtoD");
    }

    HostArray host_;
    rope_jit::CUdeviceptr device_ = 0;
};

// A strided view of a TensorStorage, as the DLTensor the C API takes. A DLTensor only points
// at its shape and strides, so the view owns them and is never copied or moved.
class TensorView {
public:
    TensorView(TensorStorage& storage, std::vector<int64_t> shape, std::vector<int64_t> strides)
        : shape_(std::move(shape)), strides_(std::move(strides)) {
        tensor_.data = storage.data();
        tensor_.device = storage.device();
        tensor_.ndim = int32_t(shape_.size());
        tensor_.dtype = element_info(storage.type()).dl;
        tensor_.shape = shape_.data();
        tensor_.strides = strides_.data();
        tensor_.byte_offset = 0;
    }
    TensorView(const TensorView&) = delete;
    TensorView& operator=(const TensorView&) = delete;

    const DLTensor* get() const { return &tensor_; }

private:
    std::vector<int64_t> shape_, strides_;
    DLTensor tensor_{};
};

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
    std::vector<int64_t> strides(shape.size());
    int64_t stride = 1;
    for (size_t i = shape.size(); i-- > 0;) {
        strides[i] = stride;
        stride *= std::max<int64_t>(shape[i], 1);
    }
    return strides;
}

// Owns every storage and view of one library call, so the pointers in the argument struct
// stay valid until the call returns. Deques never move their elements.
class CallTensors {
public:
    TensorStorage& upload(const HostArray& host) {
        return storages_.emplace_back(TensorStorage::upload(host));
    }
    TensorStorage& allocate(ElementType type, const std::vector<int64_t>& shape,
                            unsigned char fill) {
        return storages_.emplace_back(TensorStorage::allocate(type, shape, fill));
    }
    const DLTensor* view(TensorStorage& storage, std::vector<int64_t> shape,
                         std::vector<int64_t> strides) {
        return views_.emplace_back(storage, std::move(shape), std::move(strides)).get();
    }
    // The storage as stored: C-contiguous, its own shape.
    const DLTensor* plain_view(TensorStorage& storage) {
        return view(storage, storage.shape(), contiguous_strides(storage.shape()));
    }

private:
    std::deque<TensorStorage> storages_;
    std::deque<TensorView> views_;
};

// ============================================================================================
// Comparison: |got - expected| <= atol + rtol * |expected|, in float64
// ============================================================================================

struct Tolerance {
    double atol = 0, rtol = 0;
};

// The worst element seen so far over one or more compared arrays. A ratio above 1 fails.
struct Measurement {
    double max_abs_error = 0;
    double worst_ratio = 0;
    std::string worst;  // where the worst ratio occurred, with both values

    bool passed() const { return worst_ratio <= 1.0; }
    void merge(const Measurement& other) {
        max_abs_error = std::max(max_abs_error, other.max_abs_error);
        if (other.worst_ratio > worst_ratio || std::isnan(other.worst_ratio)) {
            worst_ratio = other.worst_ratio;
            worst = other.worst;
        }
    }
};

std::string index_string(int64_t flat, const std::vector<int64_t>& shape) {
    std::vector<int64_t> index(shape.size());
    for (size_t d = shape.size(); d-- > 0;) {
        const int64_t extent = std::max<int64_t>(shape[d], 1);
        index[d] = flat % extent;
        flat /= extent;
    }
    return shape_string(index);
}

// `label` names the array and the run ("q (in place)") in the worst-element description.
Measurement compare_array(const HostArray& got, const HostArray& expected, Tolerance tolerance,
                          const std::string& label) {
    if (got.shape != expected.shape)
        throw CaseFailure(fmt::format("{}: got shape {}, expected {}", label,
                                      shape_string(got.shape), shape_string(expected.shape)));
    Measurement m;
    int64_t worst_index = -1;
    const int64_t n = expected.numel();
    for (int64_t i = 0; i < n; ++i) {
        const double g = got.at(i), e = expected.at(i);
        double error = std::fabs(g - e);
        double ratio = error / (tolerance.atol + tolerance.rtol * std::fabs(e));
        if (std::isnan(g) || std::isnan(e)) {
            // NaN only matches NaN; a NaN where a number was expected is the worst error.
            const bool both = std::isnan(g) && std::isnan(e);
            error = both ? 0.0 : std::numeric_limits<double>::infinity();
            ratio = both ? 0.0 : std::numeric_limits<double>::infinity();
        } else if (std::isinf(g) || std::isinf(e)) {
            // An infinity only matches itself (the tolerance of an infinite expected value is
            // infinite too, and inf / inf would make the ratio NaN, which no maximum records).
            error = g == e ? 0.0 : std::numeric_limits<double>::infinity();
            ratio = error;
        } else if (error == 0.0) {
            ratio = 0.0;  // exact, even with a zero tolerance
        }
        m.max_abs_error = std::max(m.max_abs_error, error);
        if (worst_index < 0 || ratio > m.worst_ratio) {
            m.worst_ratio = ratio;
            worst_index = i;
        }
    }
    if (worst_index >= 0)
        m.worst = fmt::format("{}{}: got {:.8g}, expected {:.8g}", label,
                              index_string(worst_index, expected.shape), got.at(worst_index),
                              expected.at(worst_index));
    return m;
}

// ============================================================================================
// Golden cases
// ============================================================================================

struct GoldenCase {
    std::string name;
    std::string op;         // "" when the entry has none
    std::string malformed;  // why the entry cannot be run at all; "" when it is well formed
    json params;
    json inputs;
    json outputs;
    json tolerance;
};

// How every runner sees the run: the golden folder (file names are relative to it), the
// runtime and the options.
struct RunContext {
    fs::path dir;
    rope_jit_runtime* runtime = nullptr;
    AngleMode angles = AngleMode::Table;
};

Tolerance parse_tolerance(const json& value) {
    if (!value.is_object() || !value.contains("atol") || !value["atol"].is_number() ||
        !value.contains("rtol") || !value["rtol"].is_number())
        throw CaseFailure(fmt::format(
            "tolerance: expected {{\"atol\": number, \"rtol\": number}}, got {}", value.dump()));
    const Tolerance tolerance{value["atol"].get<double>(), value["rtol"].get<double>()};
    // A negative tolerance would make every error's ratio negative: a pass for anything.
    for (const double bound : {tolerance.atol, tolerance.rtol})
        if (!std::isfinite(bound) || bound < 0)
            throw CaseFailure(fmt::format(
                "tolerance: atol and rtol must be finite and >= 0, got {}", value.dump()));
    return tolerance;
}

// ============================================================================================
// op = rope
// ============================================================================================

enum class Layout { BHSD, BSHD, THD };

struct RopeParams {
    Layout layout = Layout::BHSD;
    rope_jit_style style = ROPE_JIT_STYLE_HALF;
    int32_t rotary_dim = 0;  // 0 = head_dim, as in the C API
    int32_t rotary_offset = 0;
    bool backward = false;
    int64_t position_offset = 0;
    bool xpos = false;
};

// Inputs a rope case may have (README, "op = rope"). Anything else means the format grew
// semantics this runner does not know, so such a case fails rather than silently passing.
const std::set<std::string> kRopeInputs = {"q",          "k",
                                           "cos",        "sin",
                                           "positions",  "seqlen_offsets",
                                           "cu_seqlens", "q_position_offset",
                                           "xpos_scale", "inv_freq",
                                           "positions_f"};

std::string param_string(const json& params, const char* key, const char* fallback) {
    if (!params.contains(key)) return fallback;
    if (!params[key].is_string())
        throw CaseFailure(
            fmt::format("params.{}: expected a string, got {}", key, params[key].dump()));
    return params[key].get<std::string>();
}

int64_t param_int(const json& params, const char* key, int64_t fallback) {
    if (!params.contains(key)) return fallback;
    if (!params[key].is_number_integer())
        throw CaseFailure(
            fmt::format("params.{}: expected an integer, got {}", key, params[key].dump()));
    return params[key].get<int64_t>();
}

bool param_bool(const json& params, const char* key, bool fallback) {
    if (!params.contains(key)) return fallback;
    if (!params[key].is_boolean())
        throw CaseFailure(
            fmt::format("params.{}: expected true or false, got {}", key, params[key].dump()));
    return params[key].get<bool>();
}

RopeParams parse_rope_params(const json& params) {
    if (!params.is_object()) throw CaseFailure("params: must be an object");
    RopeParams p;
    const std::string layout = param_string(params, "layout", "bhsd");
    if (layout == "bhsd")
        p.layout = Layout::BHSD;
    else if (layout == "bshd")
        p.layout = Layout::BSHD;
    else if (layout == "thd")
        p.layout = Layout::THD;
    else
        throw CaseFailure(
            fmt::format("params.layout: expected bhsd, bshd or thd, got '{}'", layout));

    const std::string style = param_string(params, "style", "half");
    if (style == "half")
        p.style = ROPE_JIT_STYLE_HALF;
    else if (style == "interleaved")
        p.style = ROPE_JIT_STYLE_INTERLEAVED;
    else
        throw CaseFailure(
            fmt::format("params.style: expected half or interleaved, got '{}'", style));

    const int64_t rotary_dim = param_int(params, "rotary_dim", 0);
    const int64_t rotary_offset = param_int(params, "rotary_offset", 0);
    if (rotary_dim < 0 || rotary_dim > INT32_MAX || rotary_offset < 0 || rotary_offset > INT32_MAX)
        throw CaseFailure(fmt::format("params: rotary_dim {} / rotary_offset {} out of range",
                                      rotary_dim, rotary_offset));
    p.rotary_dim = int32_t(rotary_dim);
    p.rotary_offset = int32_t(rotary_offset);
    p.backward = param_bool(params, "backward", false);
    p.position_offset = param_int(params, "position_offset", 0);
    p.xpos = param_bool(params, "xpos", false);
    return p;
}

// Checks the inputs against the format before anything reaches the library, so a malformed
// case is reported as such rather than as a library error.
void check_rope_inputs(const ArrayMap& inputs, const RopeParams& params, const json& raw_params) {
    for (const auto& entry : inputs)
        if (kRopeInputs.count(entry.first) == 0)
            throw CaseFailure(
                fmt::format("input '{}' is not part of the rope format", entry.first));
    if (inputs.count("q") == 0) throw CaseFailure("input 'q' is missing");
    const HostArray& q = inputs.at("q");
    const size_t rank = params.layout == Layout::THD ? 3 : 4;
    for (const char* name : {"q", "k"}) {
        auto it = inputs.find(name);
        if (it == inputs.end()) continue;
        if (it->second.shape.size() != rank)
            throw CaseFailure(fmt::format("input '{}': layout needs {} dimensions, got {}", name,
                                          rank, shape_string(it->second.shape)));
        if (!it->second.is_float() || it->second.type != q.type)
            throw CaseFailure(fmt::format("input '{}': dtype must be q's float dtype", name));
    }
    if (raw_params.contains("dtype") && raw_params["dtype"] != element_info(q.type).name)
        throw CaseFailure(fmt::format("params.dtype {} differs from q's {}",
                                      raw_params["dtype"].dump(), element_info(q.type).name));
    for (const char* name : {"positions", "seqlen_offsets", "cu_seqlens", "q_position_offset"}) {
        auto it = inputs.find(name);
        if (it != inputs.end() && !it->second.is_index())
            throw CaseFailure(fmt::format("input '{}': dtype must be int32 or int64", name));
    }
    if (auto it = inputs.find("q_position_offset"); it != inputs.end() && it->second.numel() != 1)
        throw CaseFailure(fmt::format("input 'q_position_offset': expected [1], got {}",
                                      shape_string(it->second.shape)));
    if (params.xpos && inputs.count("xpos_scale") == 0)
        throw CaseFailure("params.xpos is true but input 'xpos_scale' is missing");
    if (params.layout == Layout::THD && inputs.count("cu_seqlens") == 0)
        throw CaseFailure("layout thd needs input 'cu_seqlens'");
}

// The rope op writes q and k in their own shapes, so those are the outputs a case may expect.
void check_rope_outputs(const ArrayMap& expected, const ArrayMap& inputs) {
    if (expected.empty()) throw CaseFailure("outputs: none to compare");
    for (const auto& [name, array] : expected) {
        if (name != "q" && name != "k")
            throw CaseFailure(fmt::format("output '{}': the rope op produces only q and k", name));
        auto input = inputs.find(name);
        if (input == inputs.end())
            throw CaseFailure(fmt::format("output '{}': the case has no input '{}'", name, name));
        if (array.shape != input->second.shape)
            throw CaseFailure(fmt::format("output '{}': expected the input's shape {}, got {}",
                                          name, shape_string(input->second.shape),
                                          shape_string(array.shape)));
    }
}

// The README's rule 3 puts q at s + q_position_offset[0] *instead of* s + position_offset;
// the C API adds args.q_position_offset on top of args.position_offset, hence the difference.
int64_t api_q_position_offset(const ArrayMap& inputs, const RopeParams& params) {
    auto it = inputs.find("q_position_offset");
    if (it == inputs.end()) return 0;
    return int64_t(it->second.at(0)) - params.position_offset;  // ([1]: check_rope_inputs)
}

// With --angles inv_freq the library computes angle = row * inv_freq[i], which reproduces the
// tables only where table row r is position r. (Whether the case has inv_freq at all is
// asked before its files are read, in run_rope_case.)
void require_inv_freq_usable(const ArrayMap& inputs) {
    auto it = inputs.find("positions_f");
    if (it == inputs.end()) return;
    const HostArray& positions = it->second;
    for (int64_t r = 0; r < positions.numel(); ++r)
        if (positions.at(r) != double(r))
            throw CaseUnsupported(
                fmt::format("float positions (positions_f[{}] = {:g}, not table row {})", r,
                            positions.at(r), r));
}

// q or k as the C API wants it: [B, H, S, D] in that logical order, or packed [T, H, D].
// A bshd buffer is passed as its transposed view (no copy), which is what the API promises
// to accept for any strides.
const DLTensor* head_view(CallTensors& tensors, TensorStorage& storage, Layout layout) {
    const std::vector<int64_t>& shape = storage.shape();
    const std::vector<int64_t> strides = contiguous_strides(shape);
    if (layout != Layout::BSHD) return tensors.view(storage, shape, strides);
    return tensors.view(storage, {shape[0], shape[2], shape[1], shape[3]},
                        {strides[0], strides[2], strides[1], strides[3]});
}

enum class Placement { OutOfPlace, InPlace };

const char* placement_name(Placement placement) {
    return placement == Placement::InPlace ? "in place" : "out of place";
}

// One rope_jit_rope call on fresh copies of the inputs; returns "q" (and "k") as computed,
// in the layout the golden files store.
ArrayMap execute_rope(const ArrayMap& inputs, const RopeParams& params, Placement placement,
                      const RunContext& context) {
    CallTensors tensors;
    rope_jit_rope_args args;
    rope_jit_rope_args_init(&args);

    std::map<std::string, TensorStorage*> results;  // where each output ends up
    for (const char* name : {"q", "k"}) {
        auto it = inputs.find(name);
        if (it == inputs.end()) continue;
        TensorStorage& input = tensors.upload(it->second);
        const DLTensor* input_view = head_view(tensors, input, params.layout);
        const DLTensor* output_view = nullptr;  // NULL = in place
        TensorStorage* result = &input;
        if (placement == Placement::OutOfPlace) {
            // 0xff bytes are NaN in every float dtype: an element the library fails to write
            // cannot pass by accident.
            TensorStorage& output = tensors.allocate(input.type(), input.shape(), 0xff);
            output_view = head_view(tensors, output, params.layout);
            result = &output;
        }
        if (std::strcmp(name, "q") == 0) {
            args.q = input_view;
            args.q_out = output_view;
        } else {
            args.k = input_view;
            args.k_out = output_view;
        }
        results[name] = result;
    }

    auto plain = [&](const char* name) -> const DLTensor* {
        auto it = inputs.find(name);
        return it == inputs.end() ? nullptr : tensors.plain_view(tensors.upload(it->second));
    };
    if (context.angles == AngleMode::Table) {
        args.cos = plain("cos");
        args.sin = plain("sin");
    } else {
        args.inv_freq = plain("inv_freq");
    }
    if (params.xpos) args.xpos_scale = plain("xpos_scale");
    args.positions = plain("positions");
    args.seqlen_offsets = plain("seqlen_offsets");
    args.cu_seqlens = plain("cu_seqlens");

    args.position_offset = params.position_offset;
    args.q_position_offset = api_q_position_offset(inputs, params);
    args.rotary_dim = params.rotary_dim;
    args.rotary_offset = params.rotary_offset;
    args.style = params.style;
    args.backward = params.backward ? 1 : 0;

    const rope_jit_status status = rope_jit_rope(context.runtime, &args);
    if (status != ROPE_JIT_OK)
        throw CaseFailure(fmt::format("{}: {}: {}", placement_name(placement),
                                      rope_jit_status_name(status), rope_jit_last_error()));

    ArrayMap outputs;
    for (const auto& [name, storage] : results) outputs.emplace(name, storage->download());
    return outputs;
}

Measurement compare_outputs(const ArrayMap& got, const ArrayMap& expected, Tolerance tolerance,
                            Placement placement) {
    Measurement worst;
    for (const auto& [name, array] : expected)
        worst.merge(compare_array(got.at(name), array, tolerance,
                                  fmt::format("{} ({})", name, placement_name(placement))));
    return worst;
}

// Out of place into fresh buffers, then in place on a copy: both must match.
Measurement run_rope_case(const GoldenCase& golden, const RunContext& context) {
    const RopeParams params = parse_rope_params(golden.params);
    const Tolerance tolerance = parse_tolerance(golden.tolerance);
    ArrayMap inputs = declare_arrays(context.dir, golden.inputs, "input");
    ArrayMap expected = declare_arrays(context.dir, golden.outputs, "output");
    check_rope_inputs(inputs, params, golden.params);
    check_rope_outputs(expected, inputs);
    if (context.angles == AngleMode::InvFreq && inputs.count("inv_freq") == 0)
        throw CaseUnsupported("no inv_freq input");
    read_arrays(inputs, "input");
    read_arrays(expected, "output");
    if (context.angles == AngleMode::InvFreq) require_inv_freq_usable(inputs);

    Measurement worst;
    for (Placement placement : {Placement::OutOfPlace, Placement::InPlace})
        worst.merge(compare_outputs(execute_rope(inputs, params, placement, context), expected,
                                    tolerance, placement));
    return worst;
}

// ============================================================================================
// op = attention: flash_attn_with_rotary through rope_jit_attention. cos/sin/pos_mask are the
// padded equivalent of rotary_pos_emb/rotary_pos_emb_indices (README), so the runner passes
// the tables and leaves the angles and indices aside.
// ============================================================================================

const std::set<std::string> kAttentionInputs = {"q",
                                                "k",
                                                "v",
                                                "cos",
                                                "sin",
                                                "pos_mask",
                                                "attn_mask",
                                                "rotary_pos_emb",
                                                "rotary_pos_emb_indices"};
const std::set<std::string> kAttentionParams = {"layout", "style", "head_dim", "rotary_dim",
                                                "causal", "scale", "dtype",    "note"};

Measurement run_attention_case(const GoldenCase& golden, const RunContext& context) {
    const json& params = golden.params;
    if (!params.is_object()) throw CaseFailure("params: must be an object");
    for (const auto& entry : params.items())
        if (kAttentionParams.count(entry.key()) == 0)
            throw CaseFailure(
                fmt::format("params.{} is not part of the attention format", entry.key()));
    const std::string layout_name = param_string(params, "layout", "bhsd");
    if (layout_name != "bhsd" && layout_name != "bshd")
        throw CaseFailure(
            fmt::format("params.layout: expected bhsd or bshd, got '{}'", layout_name));
    const Layout layout = layout_name == "bshd" ? Layout::BSHD : Layout::BHSD;
    const std::string style = param_string(params, "style", "interleaved");
    if (style != "half" && style != "interleaved")
        throw CaseFailure(
            fmt::format("params.style: expected half or interleaved, got '{}'", style));
    const int64_t rotary_dim = param_int(params, "rotary_dim", 0);
    if (rotary_dim < 0 || rotary_dim > INT32_MAX)
        throw CaseFailure("params.rotary_dim: out of range");
    double scale = 0;
    if (params.contains("scale") && !params["scale"].is_null()) {
        if (!params["scale"].is_number())
            throw CaseFailure(
                fmt::format("params.scale: expected a number, got {}", params["scale"].dump()));
        scale = params["scale"].get<double>();
    }

    const Tolerance tolerance = parse_tolerance(golden.tolerance);
    ArrayMap inputs = declare_arrays(context.dir, golden.inputs, "input");
    ArrayMap expected = declare_arrays(context.dir, golden.outputs, "output");
    for (const auto& entry : inputs)
        if (kAttentionInputs.count(entry.first) == 0)
            throw CaseFailure(
                fmt::format("input '{}' is not part of the attention format", entry.first));
    for (const auto& entry : expected)
        if (entry.first != "out" && entry.first != "lse")
            throw CaseFailure(
                fmt::format("output '{}' is not part of the attention format", entry.first));
    if (expected.count("out") == 0) throw CaseFailure("output 'out' is missing");
    for (const char* name : {"q", "k", "v"}) {
        auto it = inputs.find(name);
        if (it == inputs.end()) throw CaseFailure(fmt::format("input '{}' is missing", name));
        if (it->second.shape.size() != 4 || !it->second.is_float() ||
            it->second.type != inputs.at("q").type)
            throw CaseFailure(
                fmt::format("input '{}': expected 4 dimensions of q's float dtype", name));
    }
    if (inputs.count("cos") != inputs.count("sin"))
        throw CaseFailure("inputs: cos and sin go together");
    if (params.contains("dtype") && params["dtype"] != element_info(inputs.at("q").type).name)
        throw CaseFailure(fmt::format("params.dtype {} differs from q's {}", params["dtype"].dump(),
                                      element_info(inputs.at("q").type).name));
    const std::vector<int64_t>& q_shape = inputs.at("q").shape;
    const std::vector<int64_t> lse_shape =
        layout == Layout::BSHD ? std::vector<int64_t>{q_shape[0], q_shape[2], q_shape[1]}
                               : std::vector<int64_t>{q_shape[0], q_shape[1], q_shape[2]};
    for (const auto& [name, shape] : {std::pair{"out", q_shape}, std::pair{"lse", lse_shape}})
        if (auto it = expected.find(name); it != expected.end() && it->second.shape != shape)
            throw CaseFailure(fmt::format("output '{}': expected shape {}, got {}", name,
                                          shape_string(shape), shape_string(it->second.shape)));
    read_arrays(inputs, "input");
    read_arrays(expected, "output");

    CallTensors tensors;
    rope_jit_attention_args args;
    rope_jit_attention_args_init(&args);
    args.q = head_view(tensors, tensors.upload(inputs.at("q")), layout);
    args.k = head_view(tensors, tensors.upload(inputs.at("k")), layout);
    args.v = head_view(tensors, tensors.upload(inputs.at("v")), layout);
    const HostArray& q = inputs.at("q");
    // 0xff bytes are NaN: an element the library fails to write cannot pass by accident.
    TensorStorage& out = tensors.allocate(q.type, q.shape, 0xff);
    args.out = head_view(tensors, out, layout);
    TensorStorage& lse = tensors.allocate(ElementType::F32, lse_shape, 0xff);
    args.lse = tensors.plain_view(lse);
    auto plain = [&](const char* name) -> const DLTensor* {
        auto it = inputs.find(name);
        return it == inputs.end() ? nullptr : tensors.plain_view(tensors.upload(it->second));
    };
    args.cos = plain("cos");
    args.sin = plain("sin");
    args.pos_mask = plain("pos_mask");
    args.attn_mask = plain("attn_mask");
    args.causal = param_bool(params, "causal", false) ? 1 : 0;
    args.scale = scale;
    args.rotary_dim = int32_t(rotary_dim);
    args.style = style == "half" ? ROPE_JIT_STYLE_HALF : ROPE_JIT_STYLE_INTERLEAVED;

    const rope_jit_status status = rope_jit_attention(context.runtime, &args);
    if (status != ROPE_JIT_OK)
        throw CaseFailure(fmt::format("rope_jit_attention: {}: {}", rope_jit_status_name(status),
                                      rope_jit_last_error()));
    Measurement worst = compare_array(out.download(), expected.at("out"), tolerance, "out");
    if (auto it = expected.find("lse"); it != expected.end())
        worst.merge(compare_array(lse.download(), it->second, tolerance, "lse"));
    return worst;
}

// ============================================================================================
// op = inv_freq: HF transformers' rope types (and rotary-embedding-torch's freqs_for) through
// rope_jit_inv_freq. params are the HF config fields; a missing or null field is HF's None.
// ============================================================================================

// Every params key the op knows. Another key means the format grew semantics this runner
// does not know, so such a case fails rather than silently passing.
const std::set<std::string> kInvFreqParams = {"rope_type",
                                              "head_dim",
                                              "partial_rotary_factor",
                                              "dim",
                                              "rope_theta",
                                              "theta",
                                              "max_position_embeddings",
                                              "original_max_position_embeddings",
                                              "factor",
                                              "seq_len",
                                              "attention_factor",
                                              "beta_fast",
                                              "beta_slow",
                                              "mscale",
                                              "mscale_all_dim",
                                              "truncate",
                                              "low_freq_factor",
                                              "high_freq_factor",
                                              "short_factor",
                                              "long_factor",
                                              "theta_rescale_factor",
                                              "max_freq",
                                              "num_freqs",
                                              "note"};

// A number parameter; absent or null gives the fallback (the library's "unset").
double param_number(const json& params, const char* key, double fallback) {
    if (!params.contains(key) || params[key].is_null()) return fallback;
    if (!params[key].is_number())
        throw CaseFailure(
            fmt::format("params.{}: expected a number, got {}", key, params[key].dump()));
    return params[key].get<double>();
}

// A whole-number parameter (or, when absent, the fallback, which may be computed from others
// and is checked the same way).
int64_t param_whole_number(const json& params, const char* key, double fallback) {
    const double value = param_number(params, key, fallback);
    if (value != std::floor(value) || !(std::fabs(value) <= 9.0e15))
        throw CaseFailure(fmt::format("params.{}: expected a whole number below 9e15, got {}{}",
                                      key, value,
                                      params.contains(key) ? "" : " (derived from the others)"));
    return int64_t(value);
}

std::vector<float> param_float_list(const json& params, const char* key) {
    std::vector<float> values;
    if (!params.contains(key) || params[key].is_null()) return values;
    if (!params[key].is_array())
        throw CaseFailure(
            fmt::format("params.{}: expected a list of numbers, got {}", key, params[key].dump()));
    for (const json& value : params[key]) {
        if (!value.is_number())
            throw CaseFailure(fmt::format("params.{}: expected a list of numbers, got {}", key,
                                          params[key].dump()));
        values.push_back(value.get<float>());
    }
    return values;
}

rope_jit_rope_type parse_rope_type(const std::string& name) {
    static const std::map<std::string, rope_jit_rope_type> types = {
        {"default", ROPE_JIT_ROPE_TYPE_DEFAULT},  {"linear", ROPE_JIT_ROPE_TYPE_LINEAR},
        {"dynamic", ROPE_JIT_ROPE_TYPE_DYNAMIC},  {"yarn", ROPE_JIT_ROPE_TYPE_YARN},
        {"llama3", ROPE_JIT_ROPE_TYPE_LLAMA3},    {"longrope", ROPE_JIT_ROPE_TYPE_LONGROPE},
        {"lang", ROPE_JIT_ROPE_TYPE_LANG},        {"pixel", ROPE_JIT_ROPE_TYPE_PIXEL},
        {"constant", ROPE_JIT_ROPE_TYPE_CONSTANT},
        {"proportional", ROPE_JIT_ROPE_TYPE_PROPORTIONAL}};
    auto it = types.find(name);
    if (it == types.end()) throw CaseUnsupported(fmt::format("rope_type '{}'", name));
    return it->second;
}

Measurement run_inv_freq_case(const GoldenCase& golden, const RunContext& context) {
    const json& params = golden.params;
    if (!params.is_object()) throw CaseFailure("params: must be an object");
    for (const auto& entry : params.items())
        if (kInvFreqParams.count(entry.key()) == 0)
            throw CaseFailure(
                fmt::format("params.{} is not part of the inv_freq format", entry.key()));
    const Tolerance tolerance = parse_tolerance(golden.tolerance);
    ArrayMap expected = declare_arrays(context.dir, golden.outputs, "output");
    if (expected.count("inv_freq") == 0) throw CaseFailure("output 'inv_freq' is missing");
    for (const auto& entry : expected)
        if (entry.first != "inv_freq" && entry.first != "attention_factor")
            throw CaseFailure(
                fmt::format("output '{}' is not part of the inv_freq format", entry.first));
    if (auto it = expected.find("attention_factor");
        it != expected.end() && it->second.shape != std::vector<int64_t>{1})
        throw CaseFailure(fmt::format("output 'attention_factor': expected [1], got {}",
                                      shape_string(it->second.shape)));
    const HostArray& expected_inv_freq = expected.at("inv_freq");
    if (expected_inv_freq.shape.size() != 1 ||
        expected_inv_freq.shape[0] > ROPE_JIT_MAX_FREQUENCIES)
        throw CaseFailure(fmt::format("output 'inv_freq': expected [n], n at most {}, got {}",
                                      ROPE_JIT_MAX_FREQUENCIES,
                                      shape_string(expected_inv_freq.shape)));
    const int64_t n = expected_inv_freq.numel();

    rope_jit_freq_config config;
    rope_jit_freq_config_init(&config);
    config.rope_type = parse_rope_type(param_string(params, "rope_type", "default"));
    // HF: dim = int(head_dim * partial_rotary_factor); rotary-embedding-torch names it dim.
    // (Sizes the C API holds in int32: a larger one is the case's error, not a wrapped value.)
    const auto int32_size = [](int64_t value, const char* what) {
        if (value < INT32_MIN || value > INT32_MAX)
            throw CaseFailure(fmt::format("params: {} {} is out of range", what, value));
        return int32_t(value);
    };
    const double head_dim = double(param_whole_number(params, "head_dim", 0));
    const double partial = param_number(params, "partial_rotary_factor", 1.0);
    config.rotary_dim = int32_size(
        param_whole_number(params, "dim", std::trunc(head_dim * partial)), "rotary dim");
    // HF's proportional type: int(partial_rotary_factor * head_dim // 2) rotated pairs whose
    // exponents run over head_dim, then zeros up to head_dim / 2 (pairs that do not turn).
    const bool proportional = config.rope_type == ROPE_JIT_ROPE_TYPE_PROPORTIONAL;
    int64_t rotated = n;
    if (proportional) {
        const double pairs = std::floor(partial * head_dim / 2);
        if (!(pairs >= 0 && pairs <= double(n)))
            throw CaseFailure(fmt::format("params: {} rotated pairs, but inv_freq has {}",
                                          pairs, n));
        rotated = int64_t(pairs);
        config.rotary_dim = int32_t(2 * rotated);
        config.head_dim = int32_size(int64_t(head_dim), "head_dim");
    }
    config.theta = param_number(params, "rope_theta", param_number(params, "theta", config.theta));
    config.factor = param_number(params, "factor", 0);
    config.max_position_embeddings = param_whole_number(params, "max_position_embeddings", 0);
    config.original_max_position_embeddings =
        param_whole_number(params, "original_max_position_embeddings", 0);
    config.seq_len = param_whole_number(params, "seq_len", 0);
    config.attention_factor = param_number(params, "attention_factor", 0);
    config.beta_fast = param_number(params, "beta_fast", 0);  // 0: the default, as HF's `or 32`
    config.beta_slow = param_number(params, "beta_slow", 0);
    config.mscale = param_number(params, "mscale", 0);
    config.mscale_all_dim = param_number(params, "mscale_all_dim", 0);
    config.truncate = param_bool(params, "truncate", true) ? 1 : 0;
    config.low_freq_factor = param_number(params, "low_freq_factor", config.low_freq_factor);
    config.high_freq_factor = param_number(params, "high_freq_factor", config.high_freq_factor);
    config.theta_rescale_factor =
        param_number(params, "theta_rescale_factor", config.theta_rescale_factor);
    config.max_freq = param_number(params, "max_freq", config.max_freq);
    config.num_freqs = int32_size(param_whole_number(params, "num_freqs", config.num_freqs),
                                  "num_freqs");
    const std::vector<float> short_factor = param_float_list(params, "short_factor");
    const std::vector<float> long_factor = param_float_list(params, "long_factor");
    for (const auto* list : {&short_factor, &long_factor})
        if (!list->empty() && int64_t(list->size()) != n)
            throw CaseFailure(fmt::format(
                "params: short_factor/long_factor need {} entries, got {}", n, list->size()));
    config.short_factor = short_factor.empty() ? nullptr : short_factor.data();
    config.long_factor = long_factor.empty() ? nullptr : long_factor.data();
    read_arrays(expected, "output");

    HostArray inv_freq{ElementType::F32, {n}, std::vector<unsigned char>(size_t(n) * 4), {}};
    HostArray attention_factor{ElementType::F32, {1}, std::vector<unsigned char>(4), {}};
    const float one = 1.0f;
    std::memcpy(attention_factor.bytes.data(), &one, 4);  // (no pair turns: nothing to call)
    const rope_jit_status status =
        proportional && rotated == 0 ? ROPE_JIT_OK
                     : rope_jit_inv_freq(&config, reinterpret_cast<float*>(inv_freq.bytes.data()),
                                         size_t(rotated),
                                         reinterpret_cast<float*>(attention_factor.bytes.data()));
    if (status != ROPE_JIT_OK)
        throw CaseFailure(fmt::format("rope_jit_inv_freq: {}: {}", rope_jit_status_name(status),
                                      rope_jit_last_error()));

    Measurement worst = compare_array(inv_freq, expected.at("inv_freq"), tolerance, "inv_freq");
    if (auto it = expected.find("attention_factor"); it != expected.end())
        worst.merge(compare_array(attention_factor, it->second, tolerance, "attention_factor"));
    return worst;
}

using OpRunner = Measurement (*)(const GoldenCase&, const RunContext&);

const std::map<std::string, OpRunner> op_runners = {
    {"rope", run_rope_case},
    {"attention", run_attention_case},
    {"inv_freq", run_inv_freq_case},
};

// ============================================================================================
// Running and reporting
// ============================================================================================

enum class Verdict { Pass, Fail, Unsupported };

const char* verdict_name(Verdict verdict) {
    switch (verdict) {
        case Verdict::Pass: return "pass";
        case Verdict::Fail: return "FAIL";
        case Verdict::Unsupported: return "unsupported";
    }
    return "FAIL";
}

struct CaseResult {
    std::string name;
    std::string op;
    Verdict verdict = Verdict::Fail;
    std::optional<Measurement> measurement;  // absent when the case did not get to compare
    std::string message;
};

// Runs one case, turning every way it can end into a result: nothing a case does stops the
// run.
CaseResult run_case(const GoldenCase& golden, const RunContext& context) {
    CaseResult result{golden.name, golden.op, Verdict::Fail, std::nullopt, ""};
    try {
        if (!golden.malformed.empty()) throw CaseFailure(golden.malformed);
        auto runner = op_runners.find(golden.op);
        if (runner == op_runners.end())
            throw CaseUnsupported(fmt::format("unknown op '{}'", golden.op));
        result.measurement = runner->second(golden, context);
        const bool passed = result.measurement->passed();
        result.verdict = passed ? Verdict::Pass : Verdict::Fail;
        if (!passed) result.message = "worst " + result.measurement->worst;
    } catch (const CaseUnsupported& e) {
        result.verdict = Verdict::Unsupported;
        result.message = e.what();
    } catch (const CaseFailure& e) {
        result.message = e.what();
    } catch (const json::exception& e) {
        result.message = fmt::format("malformed case: {}", e.what());
    } catch (const std::bad_alloc&) {
        result.message = "out of memory";
    } catch (const std::exception& e) {
        result.message = fmt::format("error: {}", e.what());
    }
    return result;
}

json read_manifest(const fs::path& dir) {
    const fs::path path = dir / "manifest.json";
    std::error_code error;
    // (A FIFO would block the read, a directory fail it with a stream error.)
    if (!fs::is_regular_file(path, error))
        throw UsageError(fmt::format("cannot read {}: {}", path.string(),
                                     error ? error.message() : "not a regular file"));
    std::ifstream file(path);
    if (!file)
        throw UsageError(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
    const std::string text{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
    // Bounded nesting: the messages that quote a value dump it, recursively.
    std::string why;
    json manifest = rope_jit::parse_bounded_json(text, &why);
    if (manifest.is_discarded())
        throw UsageError(fmt::format("{}: {}", path.string(), why));
    if (!manifest.is_object() || !manifest.contains("format") ||
        manifest["format"] != "rope-jit-golden/1")
        throw UsageError(
            fmt::format("{}: expected \"format\": \"rope-jit-golden/1\"", path.string()));
    if (!manifest.contains("cases") || !manifest["cases"].is_array())
        throw UsageError(fmt::format("{}: expected a \"cases\" array", path.string()));
    return manifest;
}

// A case entry without a usable name or op cannot be dispatched; it still becomes a case
// (reported as FAIL) so that a broken manifest entry is never skipped silently.
GoldenCase parse_case(const json& entry, size_t index) {
    GoldenCase golden;
    golden.name = fmt::format("case[{}]", index);
    const bool has_name = entry.is_object() && entry.contains("name") && entry["name"].is_string();
    const bool has_op = entry.is_object() && entry.contains("op") && entry["op"].is_string();
    if (has_name) golden.name = entry["name"].get<std::string>();
    if (has_op) golden.op = entry["op"].get<std::string>();
    if (!has_name || !has_op) {
        golden.malformed = "malformed case: needs a string \"name\" and \"op\"";
        return golden;
    }
    golden.params = entry.value("params", json::object());
    golden.inputs = entry.value("inputs", json::object());
    golden.outputs = entry.value("outputs", json::object());
    golden.tolerance = entry.value("tolerance", json());
    return golden;
}

// An entry without an op passes any --ops filter: what it is meant to be is unknown.
bool selected(const GoldenCase& golden, const Options& options) {
    if (!options.ops.empty() && !golden.op.empty() && options.ops.count(golden.op) == 0)
        return false;
    return golden.name.find(options.case_filter) != std::string::npos;
}

std::string format_number(double value) {
    return fmt::format("{:.3e}", value);
}

void print_text_line(const CaseResult& result) {
    const std::string error =
        result.measurement ? format_number(result.measurement->max_abs_error) : "-";
    fmt::print("{:<50} max_abs_error {:<10} {}{}\n", result.name, error,
               verdict_name(result.verdict), result.message.empty() ? "" : ": " + result.message);
}

// NaN and infinity are not JSON numbers: they become null.
json json_number(double value) {
    return std::isfinite(value) ? json(value) : json(nullptr);
}

// The runtime's counters: what a run compiled, read from the disk cache and launched.
json kernel_counters(rope_jit_runtime* runtime) {
    rope_jit_stats stats;
    rope_jit_stats_init(&stats);
    if (rope_jit_get_stats(runtime, &stats) != ROPE_JIT_OK) return nullptr;
    return {{"compiles", stats.compiles},       {"compile_ms", stats.compile_ms},
            {"disk_hits", stats.disk_hits},     {"disk_writes", stats.disk_writes},
            {"memory_hits", stats.memory_hits}, {"launches", stats.launches}};
}

void print_json(const std::vector<CaseResult>& results, int passed, int failed,
                const json& kernels) {
    json cases = json::array();
    for (const CaseResult& r : results)
        cases.push_back({{"name", r.name},
                         {"op", r.op},
                         {"status", verdict_name(r.verdict)},
                         {"max_abs_error", r.measurement ? json_number(r.measurement->max_abs_error)
                                                         : json(nullptr)},
                         {"worst_ratio",
                          r.measurement ? json_number(r.measurement->worst_ratio) : json(nullptr)},
                         {"message", r.message}});
    const json report = {
        {"cases", cases}, {"passed", passed}, {"failed", failed}, {"kernels", kernels}};
    fmt::print("{}\n", report.dump(2, ' ', false,
                                   json::error_handler_t::replace));  // names need not be UTF-8
}

using RuntimeHandle = std::unique_ptr<rope_jit_runtime, decltype(&rope_jit_runtime_free)>;

// Returns an empty handle after printing why, when the runtime cannot be created.
RuntimeHandle create_runtime(rope_jit_backend_kind backend) {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = backend;
    rope_jit_runtime* runtime = nullptr;
    const rope_jit_status status = rope_jit_runtime_create(&config, &runtime);
    if (status != ROPE_JIT_OK)
        fmt::print(stderr, "rope-jit-golden: cannot create the runtime: {}: {}\n",
                   rope_jit_status_name(status), rope_jit_last_error());
    return RuntimeHandle(status == ROPE_JIT_OK ? runtime : nullptr, rope_jit_runtime_free);
}

int run(const Options& options) {
    const json manifest = read_manifest(options.dir);
    RuntimeHandle runtime = create_runtime(options.backend);
    if (!runtime) return 1;
    const bool on_cuda = rope_jit_backend(runtime.get()) == ROPE_JIT_BACKEND_CUDA;
    if (on_cuda) DeviceMemory::activate(options.device);
    fmt::print(stderr, "rope-jit-golden: backend {}\n",
               on_cuda ? fmt::format("cuda, device {}", options.device) : std::string("cpu"));
    const RunContext context{options.dir, runtime.get(), options.angles};

    std::vector<CaseResult> results;
    int passed = 0, failed = 0;
    const json& cases = manifest["cases"];
    for (size_t i = 0; i < cases.size(); ++i) {
        const GoldenCase golden = parse_case(cases[i], i);
        if (!selected(golden, options)) continue;
        CaseResult result = run_case(golden, context);
        (result.verdict == Verdict::Pass ? passed : failed) += 1;
        if (!options.json) print_text_line(result);
        results.push_back(std::move(result));
    }
    // A filter that selects nothing (a typo in CI) must not read as success.
    if (results.empty()) fmt::print(stderr, "rope-jit-golden: no case matched the selection\n");
    const json kernels = kernel_counters(runtime.get());
    if (options.json) {
        print_json(results, passed, failed, kernels);
    } else {
        fmt::print("{} passed, {} failed\n", passed, failed);
        if (!kernels.is_null())
            fmt::print(
                "kernels: {} compiled ({:.0f} ms), {} read from the disk cache, {} written to it, "
                "{} launches\n",
                kernels["compiles"].get<uint64_t>(), kernels["compile_ms"].get<double>(),
                kernels["disk_hits"].get<uint64_t>(), kernels["disk_writes"].get<uint64_t>(),
                kernels["launches"].get<uint64_t>());
    }
    return failed == 0 && !results.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options options = parse_options(argc, argv);
        if (options.help) {
            fmt::print("{}", kUsage);
            return 0;
        }
        return run(options);
    } catch (const UsageError& e) {
        fmt::print(stderr, "rope-jit-golden: {}\n{}", e.what(), kUsage);
        return 2;
    } catch (const std::exception& e) {
        fmt::print(stderr, "rope-jit-golden: {}\n", e.what());
        return 1;
    }
}
