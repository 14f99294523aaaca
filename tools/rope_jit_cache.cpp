// rope-jit-cache: fills, inspects and trims rope-jit's on-disk kernel cache, through the
// public C API only (rope_jit_prewarm_plan, rope_jit_prewarm_json and the rope_jit_cache_*
// calls); spec JSON passes through it to the library, which reads every field.
//
//   rope-jit-cache prewarm --preset llama3-8b --target sm_90   compile ahead of time
//   rope-jit-cache list | verify | prune | clear | info
//
// Global options (before or after the subcommand): --cache-dir DIR (default: the library's
// default root, $ROPE_JIT_CACHE_DIR, else $XDG_CACHE_HOME/rope_jit, else
// ~/.cache/rope_jit), --json (one JSON document on stdout instead of text).
// Exit status: 0 success, 1 failure (a kernel failed to compile, verify found damage, a
// removal failed), 2 usage (bad option or value, unknown preset, unreadable manifest).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cache_item_states.h"
#include "cli_output.h"
#include "common/bounded_json.h"
#include "common/log.h"
#include "kernel_spec_sets.h"
#include "local_gpus.h"
#include "prewarm_processes.h"
#include "rope_jit/rope_jit.h"

namespace {

using nlohmann::json;
using namespace rope_jit_cache;

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// With no GPU and no --target, prewarm compiles for the architecture of the GPUs the project
// targets first (H100/H200). Caches built on CPU hosts are meant for such machines.
constexpr const char* kDefaultTarget = "sm_90";

// Temp files younger than this may belong to a write in progress (writes take milliseconds,
// so anything older was left by a killed process). prune keeps them; clear does not.
constexpr int64_t kTempGraceSeconds = 600;

// A failure to report with exit status 1.
class Failure : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

struct GlobalOptions {
    std::string cache_dir;  // "" = the library's default
    bool json = false;
};

std::string last_error_or(rope_jit_status status) {
    const std::string detail = rope_jit_last_error();
    return detail.empty() ? rope_jit_status_message(status) : detail;
}

using RuntimeHandle = std::unique_ptr<rope_jit_runtime, decltype(&rope_jit_runtime_free)>;

// What a command's runtime is for: compiling (prewarm, info) stores entries under the size
// limit; the maintenance commands (list, verify, prune, clear) store none, so they do not read
// ROPE_JIT_CACHE_MAX_BYTES: a malformed limit in the environment never blocks cleaning up.
enum class RuntimeUse { Compile, Maintenance };

RuntimeHandle make_runtime(const GlobalOptions& global, rope_jit_backend_kind backend,
                           RuntimeUse use = RuntimeUse::Compile) {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = backend;
    if (use == RuntimeUse::Maintenance) config.cache_max_bytes = 0;  // unbounded: env unread
    config.cache_dir = global.cache_dir.empty() ? nullptr : global.cache_dir.c_str();
    rope_jit_runtime* runtime = nullptr;
    const rope_jit_status status = rope_jit_runtime_create(&config, &runtime);
    if (status != ROPE_JIT_OK) throw Failure("cannot create a runtime: " + last_error_or(status));
    return RuntimeHandle(runtime, rope_jit_runtime_free);
}

int64_t now_seconds() {
    return int64_t(std::time(nullptr));
}

// "a, b, c".
std::string joined(const std::vector<std::string>& names) {
    std::string text;
    for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
    return text;
}

// Whether print_json has printed the run's document (--json prints one, also for a failure).
bool json_document_printed = false;

// File names need not be UTF-8: invalid bytes print as U+FFFD rather than failing the report
// (after prune or clear has already acted).
void print_json(const json& document) {
    json_document_printed = true;
    std::cout << document.dump(2, ' ', false, json::error_handler_t::replace) << std::endl;
}

// ---- cache items ------------------------------------------------------------------------

// An owned copy of a rope_jit_cache_item (whose strings live only during the visit).
struct Item {
    rope_jit_cache_item_state state;
    std::string path, problem, key, nvrtc_version, target, kind, spec_json, spec;
    uint64_t bytes = 0, payload_bytes = 0;
    int64_t modified = 0, accessed = 0;
};

std::vector<Item> collect_items(const rope_jit_runtime* runtime) {
    std::vector<Item> items;
    auto visit = [](const rope_jit_cache_item* item, void* user) -> int {
        static_cast<std::vector<Item>*>(user)->push_back(
            Item{item->state, item->path, item->problem, item->key, item->nvrtc_version,
                 item->target, item->kind, item->spec_json, item->spec, item->bytes,
                 item->payload_bytes, item->modified, item->accessed});
        return 0;
    };
    const rope_jit_status status = rope_jit_cache_walk(runtime, visit, &items);
    if (status != ROPE_JIT_OK) throw Failure("cannot read the cache: " + last_error_or(status));
    return items;
}

json item_json(const Item& item, int64_t now) {
    // The library's bound on nesting: dump() recurses.
    json spec = rope_jit::parse_bounded_json(item.spec_json);
    return json{{"state", item_state_name(item.state)},
                {"path", item.path},
                {"problem", item.problem},
                {"key", item.key},
                {"nvrtc_version", item.nvrtc_version},
                {"target", item.target},
                {"kind", item.kind},
                {"spec", item.spec},
                {"spec_json", spec.is_discarded() ? json(nullptr) : spec},
                {"bytes", item.bytes},
                {"payload_bytes", item.payload_bytes},
                {"modified", item.modified},
                {"accessed", item.accessed},
                {"unused_seconds", std::max<int64_t>(0, now - item.accessed)}};
}

// Counts and bytes per state.
struct Totals {
    std::map<rope_jit_cache_item_state, size_t> count;
    std::map<rope_jit_cache_item_state, uint64_t> bytes;
    uint64_t all_bytes = 0;

    void add(const Item& item) {
        ++count[item.state];
        bytes[item.state] += item.bytes;
        all_bytes += item.bytes;
    }
    json to_json() const {
        json out = json::object();
        for (const ItemStateName& named : kItemStates) {
            const rope_jit_cache_item_state state = named.state;
            out[named.name] = json{{"count", count.count(state) ? count.at(state) : 0},
                                   {"bytes", bytes.count(state) ? bytes.at(state) : 0}};
        }
        out["bytes"] = all_bytes;
        return out;
    }
    // "20 ok (1.2 MiB), 1 damaged (0 B)": the states present, ok first.
    std::string summary() const {
        std::string text;
        for (const ItemStateName& named : kItemStates) {
            const rope_jit_cache_item_state state = named.state;
            if (!count.count(state)) continue;
            text += fmt::format("{}{} {} ({})", text.empty() ? "" : ", ", count.at(state),
                                named.name, format_bytes(bytes.at(state)));
        }
        return text.empty() ? "empty" : text;
    }
};

Totals totals_of(const std::vector<Item>& items) {
    Totals totals;
    for (const Item& item : items) totals.add(item);
    return totals;
}

// What a person reads for an item: the kernel for entries, else the path and the problem.
std::string item_text(const Item& item) {
    if (item.state == ROPE_JIT_CACHE_ITEM_OK) return item.spec.empty() ? item.path : item.spec;
    if (item.state == ROPE_JIT_CACHE_ITEM_STALE && !item.spec.empty())
        return fmt::format("{}  ({})", item.path, item.problem);
    return fmt::format("{}: {}", item.path, item.problem);
}

// ---- prewarm ----------------------------------------------------------------------------

struct PrewarmOptions {
    std::vector<std::string> presets;
    std::vector<std::string> manifests;
    std::vector<std::string> targets;
    std::vector<std::string> ops;  // --ops; empty = both
    int jobs = 0;
    int processes = 0;  // --processes; 0 = split_processes's choice
    bool dry_run = false;
    json flag_template = json::object();
};

enum class Result { compiled, cached, failed };

const char* result_name(Result result) {
    switch (result) {
        case Result::compiled: return "compiled";
        case Result::cached: return "cached";
        case Result::failed: return "failed";
    }
    return "?";
}

struct Kernel {
    Result result = Result::failed;
    double ms = 0.0;          // wall time of the prewarm call
    double compile_ms = 0.0;  // NVRTC's share of it
    bool written = false;
    uint64_t evicted = 0;  // entries the size limit removed after its write
    std::string error;
};

// The templates of every source the options name.
std::vector<SpecTemplate> gather_templates(const PrewarmOptions& options) {
    const Ops ops = options.ops.empty() ? Ops{} : parse_ops(options.ops);
    std::vector<SpecTemplate> templates;
    for (const std::string& preset : options.presets)
        append_templates(templates, preset_templates(preset, ops), "--preset " + preset);
    for (const std::string& manifest : options.manifests)
        append_templates(templates, read_manifest(manifest, ops), "--manifest " + manifest);
    if (!options.flag_template.empty())
        templates.push_back(SpecTemplate{options.flag_template, "flags", ""});
    if (templates.empty())
        throw UsageError("prewarm: nothing to compile; give --preset, --manifest or --head-dim");
    return templates;
}

// Adds a local GPU's target to `targets` (each target once) and the GPU to `note`.
void add_local_gpu(const std::string& gpu, const std::string& target,
                   std::vector<std::string>* targets, std::string* note) {
    *note += fmt::format("{}{} ({})", note->empty() ? "compiling for the local GPUs: " : ", ",
                         gpu, target);
    if (std::find(targets->begin(), targets->end(), target) == targets->end())
        targets->push_back(target);
}

// The targets to compile for, and a note on where they came from.
std::vector<std::string> choose_targets(const GlobalOptions& global, const PrewarmOptions& options,
                                        std::string* note) {
    if (!options.targets.empty()) {
        std::vector<std::string> targets;
        std::unordered_set<std::string> seen;
        for (const std::string& target : options.targets) {
            if (!valid_target(target))
                throw UsageError(fmt::format(
                    "--target: '{}' is not an architecture like sm_90, sm_90a or compute_90",
                    target));
            if (seen.insert(target).second) targets.push_back(target);
        }
        return targets;
    }
    // NVML first: it spares the prewarm cuInit's 180-230 ms (local_gpus.h).
    if (const std::optional<std::vector<LocalGpu>> gpus = local_gpus_from_nvml()) {
        std::vector<std::string> targets;
        for (const LocalGpu& gpu : *gpus)
            add_local_gpu(gpu.name.empty() ? "a GPU" : gpu.name,
                          fmt::format("sm_{}{}", gpu.major, gpu.minor), &targets, note);
        return targets;
    }
    RuntimeHandle runtime = make_runtime(global, ROPE_JIT_BACKEND_AUTO);
    const int devices = rope_jit_device_count(runtime.get());
    if (devices == 0) {
        *note = fmt::format("no GPU found: compiling for {}, the default (choose with --target)",
                            kDefaultTarget);
        return {kDefaultTarget};
    }
    std::vector<std::string> targets;
    for (int ordinal = 0; ordinal < devices; ++ordinal) {
        rope_jit_device_info info;
        rope_jit_device_info_init(&info);
        const rope_jit_status status = rope_jit_device_describe(runtime.get(), ordinal, &info);
        if (status != ROPE_JIT_OK)
            throw Failure(fmt::format("device {}: {}", ordinal, last_error_or(status)));
        add_local_gpu(fmt::format("device {}: {}", ordinal, info.name), info.target, &targets,
                      note);
    }
    return targets;
}

// The order in which the jobs start the kernels: the slowest kinds first, so that the wall
// time approaches the slowest kernel's instead of ending on one started last. The same rule
// as the library's own parallel prewarm (prewarm_start_order in src/api/prewarm_specs.h):
// the attention backward's main kernels, then attention forwards, then the rest (RoPE and
// the backward's row kernels, 3-5x faster to compile). Reads only "op" and "kind".
std::vector<size_t> start_order(const std::vector<PlannedKernel>& planned) {
    const auto rank = [](const PlannedKernel& kernel) {
        const json spec = json::parse(kernel.spec_json, nullptr, /*allow_exceptions=*/false);
        // (A field of another type ranks like an absent one: the library judges the spec.)
        const auto text = [&](const char* name) {
            return spec.contains(name) && spec[name].is_string() ? spec[name].get<std::string>()
                                                                 : std::string();
        };
        if (!spec.is_object() || text("op") != "attention") return 2;
        const std::string kind = text("kind");
        if (kind == "backward-wgmma" || kind == "backward-dq" || kind == "backward-dkdv") return 0;
        return kind == "forward" ? 1 : 2;
    };
    std::vector<int> ranks;
    for (const PlannedKernel& kernel : planned) ranks.push_back(rank(kernel));
    std::vector<size_t> order(planned.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return ranks[a] < ranks[b]; });
    return order;
}

// Prewarms one kernel on a runtime of its own thread, so the counters it reads are its own.
void prewarm_one(rope_jit_runtime* runtime, const PlannedKernel& planned, Kernel& kernel) {
    rope_jit_stats before, after;
    rope_jit_stats_init(&before);
    rope_jit_stats_init(&after);
    rope_jit_get_stats(runtime, &before);
    const auto start = std::chrono::steady_clock::now();
    const rope_jit_status status =
        rope_jit_prewarm_json(runtime, planned.spec_json.c_str(), planned.target.c_str());
    kernel.ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (status != ROPE_JIT_OK) {
        kernel.result = Result::failed;
        kernel.error = fmt::format("{}: {}", rope_jit_status_name(status), last_error_or(status));
        return;
    }
    rope_jit_get_stats(runtime, &after);
    kernel.result = after.compiles > before.compiles ? Result::compiled : Result::cached;
    kernel.compile_ms = after.compile_ms - before.compile_ms;
    kernel.written = after.disk_writes > before.disk_writes;
    kernel.evicted = after.disk_evictions - before.disk_evictions;
}

json kernel_json(const PlannedKernel& planned, const Kernel& kernel, const char* result) {
    return json{{"target", planned.target},
                {"spec", json::parse(planned.spec_json)},
                {"description", planned.description},
                {"sources", planned.sources},
                {"result", result},
                {"ms", kernel.ms},
                {"compile_ms", kernel.compile_ms},
                {"written", kernel.written},
                {"evicted", kernel.evicted},
                {"error", kernel.error}};
}

// prewarm --dry-run: what would be compiled, compiling nothing.
int print_prewarm_plan(const GlobalOptions& global, const std::vector<PlannedKernel>& planned,
                       const std::string& root, const std::vector<std::string>& targets,
                       const std::string& note) {
    if (global.json) {
        json list = json::array();
        for (const PlannedKernel& kernel : planned)
            list.push_back(kernel_json(kernel, Kernel{}, "planned"));
        print_json(json{{"command", "prewarm"},
                        {"dry_run", true},
                        {"cache_dir", root},
                        {"targets", targets},
                        {"note", note},
                        {"kernels", list}});
        return kExitOk;
    }
    for (const PlannedKernel& kernel : planned)
        std::cout << fmt::format("would prewarm  {:<7} {}  [{}]", kernel.target, kernel.description,
                                 joined(kernel.sources))
                  << "\n";
    std::cout << fmt::format("prewarm: {} kernels planned for {}", planned.size(), root)
              << std::endl;
    return kExitOk;
}

// Runs work(runtime, runtime_error, n) for n = 0 .. count - 1 on `jobs` threads, each with a
// CPU-backend runtime of its own (null where it could not be made, runtime_error saying why).
void on_threads(const GlobalOptions& global, size_t jobs, size_t count,
                const std::function<void(rope_jit_runtime*, const std::string&, size_t)>& work) {
    std::atomic<size_t> next{0};
    auto worker = [&] {
        RuntimeHandle runtime(nullptr, rope_jit_runtime_free);
        std::string runtime_error;
        try {
            runtime = make_runtime(global, ROPE_JIT_BACKEND_CPU);
        } catch (const Failure& e) {
            runtime_error = e.what();
        }
        for (size_t n = next++; n < count; n = next++) work(runtime.get(), runtime_error, n);
    };
    std::vector<std::thread> threads;
    try {
        for (size_t j = 1; j < jobs; ++j) threads.emplace_back(worker);
    } catch (...) {
        // No more threads to be had: the ones started and this one do the work.
    }
    worker();
    for (std::thread& thread : threads) thread.join();
}

// prewarm-worker: a worker process of prewarm (prewarm_processes.h). Reads its share
// (WorkerKernel lines) from stdin to the end, compiles it with `jobs` threads and writes a
// WorkerResult line for each kernel as it finishes.
int run_prewarm_worker(const GlobalOptions& global, int jobs, long parent) {
    exit_with_parent(parent);
    std::vector<WorkerKernel> share;
    for (std::string line; std::getline(std::cin, line);)
        if (!line.empty()) share.push_back(parse_worker_kernel_line(line));
    std::mutex out_mutex;
    on_threads(global, size_t(std::max(jobs, 1)), share.size(),
               [&](rope_jit_runtime* runtime, const std::string& runtime_error, size_t n) {
                   Kernel kernel;
                   if (runtime) {
                       PlannedKernel planned;
                       planned.spec_json = share[n].spec_json;
                       planned.target = share[n].target;
                       prewarm_one(runtime, planned, kernel);
                   } else {
                       kernel.error = runtime_error;
                   }
                   const WorkerResult result{share[n].index, result_name(kernel.result),
                                             kernel.ms, kernel.compile_ms, kernel.written,
                                             kernel.evicted, kernel.error};
                   std::lock_guard<std::mutex> lock(out_mutex);
                   std::cout << worker_result_line(result) << std::flush;
               });
    return kExitOk;
}

int run_prewarm(const GlobalOptions& global, const PrewarmOptions& options) {
    std::vector<SpecTemplate> templates = gather_templates(options);
    // --target, when given, is for every spec: also a `list --json` manifest's items, which
    // else keep their own (it was ignored there, and not even checked).
    if (!options.targets.empty())
        for (SpecTemplate& t : templates) t.target.clear();
    if (options.jobs < 0) throw UsageError("--jobs: must be >= 1 (0 = one per hardware thread)");
    if (options.processes < 0)
        throw UsageError("--processes: must be >= 1 (0 = chosen from the jobs)");
    // Targets are chosen (and said) only for templates without one of their own (a `list
    // --json` manifest's items carry theirs); the report names the targets planned.
    std::string note;
    const bool all_targeted = std::all_of(templates.begin(), templates.end(),
                                          [](const SpecTemplate& t) { return !t.target.empty(); });
    const std::vector<PlannedKernel> planned =
        plan_kernels(templates, all_targeted ? std::vector<std::string>()
                                             : choose_targets(global, options, &note));
    std::vector<std::string> targets;
    std::unordered_set<std::string> seen_targets;
    for (const PlannedKernel& kernel : planned)
        if (seen_targets.insert(kernel.target).second) targets.push_back(kernel.target);
    // The root every worker's runtime resolves to, for the report.
    const std::string root = rope_jit_cache_root(make_runtime(global, ROPE_JIT_BACKEND_CPU).get());
    std::vector<Kernel> kernels(planned.size());
    const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
    const size_t jobs =
        std::min(kernels.size(), options.jobs > 0 ? size_t(options.jobs) : hardware);

    if (!global.json && !note.empty()) std::cout << note << std::endl;
    if (options.dry_run) return print_prewarm_plan(global, planned, root, targets, note);
    const char* nvrtc = "";
    if (const rope_jit_status status = rope_jit_nvrtc_version(&nvrtc); status != ROPE_JIT_OK)
        throw Failure("prewarm compiles with NVRTC, which is not available here: " +
                      last_error_or(status));
    ProgressBar bar(kernels.size(), !global.json);
    std::mutex report_mutex;
    size_t done = 0, compiled = 0, cached = 0, failed = 0;
    auto report = [&](size_t i) {
        const Kernel& kernel = kernels[i];
        std::lock_guard<std::mutex> lock(report_mutex);
        ++done;
        compiled += kernel.result == Result::compiled;
        cached += kernel.result == Result::cached;
        failed += kernel.result == Result::failed;
        if (!global.json) {
            bar.print_line(fmt::format("{:<9} {:<7} {}  [{}]  {}", result_name(kernel.result),
                                       planned[i].target, planned[i].description,
                                       joined(planned[i].sources), format_ms(kernel.ms)));
            if (kernel.result == Result::failed) bar.print_line("  " + kernel.error);
        }
        bar.update(done,
                   fmt::format("{} compiled, {} cached, {} failed", compiled, cached, failed));
    };

    bar.update(0, "compiling");
    const auto start = std::chrono::steady_clock::now();
    const std::vector<size_t> order = start_order(planned);
    // Worker processes where one process's threads would wait on each other in NVRTC
    // (prewarm_processes.h); the slowest kernels first in each worker's share.
    const int split = split_processes(jobs, kernels.size(), options.processes);
    bool in_workers = false;
    if (split > 1) {
        std::vector<std::vector<WorkerKernel>> shares(static_cast<size_t>(split));
        for (size_t n = 0; n < order.size(); ++n)
            shares[n % shares.size()].push_back(
                WorkerKernel{order[n], planned[order[n]].spec_json, planned[order[n]].target});
        const std::string parent = std::to_string(long(getpid()));
        auto worker_args = [&](int w) {
            std::vector<std::string> args;
            if (!global.cache_dir.empty()) args = {"--cache-dir", global.cache_dir};
            for (const std::string& arg :
                 {std::string("prewarm-worker"), std::string("--parent"), parent,
                  std::string("--jobs"), std::to_string(jobs_of_worker(jobs, split, w))})
                args.push_back(arg);
            return args;
        };
        in_workers = run_prewarm_workers(worker_args, shares, [&](const WorkerResult& result) {
            Kernel& kernel = kernels[result.index];
            kernel.result = result.result == "compiled" ? Result::compiled
                            : result.result == "cached" ? Result::cached
                                                        : Result::failed;
            kernel.ms = result.ms;
            kernel.compile_ms = result.compile_ms;
            kernel.written = result.written;
            kernel.evicted = result.evicted;
            kernel.error = result.error;
            report(result.index);
        });
    }
    const size_t processes = in_workers ? size_t(split) : 1;
    if (!in_workers)
        on_threads(global, jobs, kernels.size(),
                   [&](rope_jit_runtime* runtime, const std::string& runtime_error, size_t n) {
                       const size_t i = order[n];
                       if (runtime)
                           prewarm_one(runtime, planned[i], kernels[i]);
                       else
                           kernels[i].error = runtime_error;
                       report(i);
                   });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    bar.finish();

    size_t written = 0;
    uint64_t evicted = 0;
    double compile_ms = 0.0;
    for (const Kernel& kernel : kernels) {
        written += kernel.written;
        evicted += kernel.evicted;
        compile_ms += kernel.compile_ms;
    }
    if (global.json) {
        json list = json::array();
        for (size_t i = 0; i < kernels.size(); ++i)
            list.push_back(kernel_json(planned[i], kernels[i], result_name(kernels[i].result)));
        print_json(json{{"command", "prewarm"},
                        {"cache_dir", root},
                        {"targets", targets},
                        {"note", note},
                        {"jobs", jobs},
                        {"processes", processes},
                        {"kernels", list},
                        {"compiled", compiled},
                        {"cached", cached},
                        {"failed", failed},
                        {"written", written},
                        {"evicted", evicted},
                        {"seconds", seconds},
                        {"compile_seconds", compile_ms / 1000.0}});
    } else {
        std::string where = root.empty() ? "no cache directory" : root;
        std::string unwritten;
        if (written < compiled)
            unwritten = fmt::format(" ({} not written: kept in memory only, {})",
                                    compiled - written,
                                    rope_jit::warnings_silenced()
                                        ? "ROPE_JIT_QUIET=1 hid the warning saying why"
                                        : "see the warning above");
        // The size limit may have taken back entries this run wrote (it removes the least
        // recently used first, which a prewarm's own earlier entries can be).
        if (evicted > 0)
            unwritten += fmt::format(
                "; then the cache's size limit (ROPE_JIT_CACHE_MAX_BYTES, else 1 GiB) removed {} "
                "entr{}, so some of those written may be gone: `list` shows what is there",
                evicted, evicted == 1 ? "y" : "ies");
        const std::string in_processes =
            processes > 1 ? fmt::format(" in {} processes", processes) : std::string();
        const std::string summary = fmt::format(
            "prewarm: {} kernels for {} in {} with {} job{}{}: {} compiled ({} in NVRTC), {} "
            "already cached, {} failed; {} written to {}{}",
            kernels.size(), joined(targets), format_ms(seconds * 1000.0), jobs,
            jobs == 1 ? "" : "s", in_processes, compiled, format_ms(compile_ms), cached, failed,
            written, where, unwritten);
        std::cout << printable(summary) << std::endl;
    }
    // Prewarming is for later processes: a kernel that compiled but could not be stored (a
    // root of another user, read-only, full) is a failure, however well it compiled.
    return failed == 0 && written >= compiled ? kExitOk : kExitFailure;
}

// ---- list and verify --------------------------------------------------------------------

int run_list(const GlobalOptions& global) {
    RuntimeHandle runtime = make_runtime(global, ROPE_JIT_BACKEND_CPU, RuntimeUse::Maintenance);
    const std::string root = rope_jit_cache_root(runtime.get());
    const std::vector<Item> items = collect_items(runtime.get());
    const int64_t now = now_seconds();
    const Totals totals = totals_of(items);
    if (global.json) {
        json list = json::array();
        for (const Item& item : items) list.push_back(item_json(item, now));
        print_json(json{{"command", "list"},
                        {"cache_dir", root},
                        {"items", list},
                        {"totals", totals.to_json()}});
        return kExitOk;
    }
    if (!items.empty())
        std::cout << fmt::format("{:<9} {:<7} {:<6} {:>10} {:>5}  {}", "STATE", "TARGET", "NVRTC",
                                 "SIZE", "USED", "KERNEL OR PATH")
                  << "\n";
    for (const Item& item : items) {
        const std::string line =
            fmt::format("{:<9} {:<7} {:<6} {:>10} {:>5}  {}", item_state_name(item.state),
                        item.target.empty() ? "-" : item.target,
                        item.nvrtc_version.empty() ? "-" : item.nvrtc_version,
                        format_bytes(item.bytes), format_age(now - item.accessed), item_text(item));
        std::cout << printable(line) << "\n";
    }
    std::cout << printable(fmt::format("{}: {} items, {}: {}", root, items.size(),
                                       format_bytes(totals.all_bytes), totals.summary()))
              << std::endl;
    return kExitOk;
}

int run_verify(const GlobalOptions& global) {
    RuntimeHandle runtime = make_runtime(global, ROPE_JIT_BACKEND_CPU, RuntimeUse::Maintenance);
    const std::string root = rope_jit_cache_root(runtime.get());
    const std::vector<Item> items = collect_items(runtime.get());
    const Totals totals = totals_of(items);
    auto count = [&](rope_jit_cache_item_state state) {
        return totals.count.count(state) ? totals.count.at(state) : 0;
    };
    // Damage, strays and untrusted entries mean something wrote where only rope-jit should, as
    // does an entry of this NVRTC version whose stored spec does not hash to its key (another
    // kernel under its name, or another rope-jit build's: this library never loads it). The
    // rest is normal wear (entries of other NVRTC versions or formats after upgrades,
    // leftovers of killed processes) that prune removes.
    const char* nvrtc = "";
    if (rope_jit_nvrtc_version(&nvrtc) != ROPE_JIT_OK) nvrtc = "";
    size_t mismatched = 0;
    for (const Item& item : items)
        mismatched += item.state == ROPE_JIT_CACHE_ITEM_STALE && !item.key.empty() &&
                      *nvrtc != '\0' && item.nvrtc_version == nvrtc;
    const bool healthy = count(ROPE_JIT_CACHE_ITEM_DAMAGED) == 0 &&
                         count(ROPE_JIT_CACHE_ITEM_STRAY) == 0 &&
                         count(ROPE_JIT_CACHE_ITEM_UNTRUSTED) == 0 && mismatched == 0;
    if (global.json) {
        json list = json::array();
        const int64_t now = now_seconds();
        for (const Item& item : items) list.push_back(item_json(item, now));
        print_json(json{{"command", "verify"},
                        {"cache_dir", root},
                        {"healthy", healthy},
                        {"items", list},
                        {"totals", totals.to_json()}});
    } else {
        for (const Item& item : items)
            if (item.state != ROPE_JIT_CACHE_ITEM_OK)
                std::cout << printable(fmt::format("{:<9} {}: {}", item_state_name(item.state),
                                                   item.path, item.problem))
                          << "\n";
        const size_t good = count(ROPE_JIT_CACHE_ITEM_OK);
        // prune refuses a root (or directory) that others can write: say how to get there.
        const char* hint =
            healthy ? ""
            : count(ROPE_JIT_CACHE_ITEM_UNTRUSTED) == 0
                ? " (damaged, stray or mismatched files found; prune removes them)"
                : " (damaged, stray, untrusted or mismatched files found; prune removes them, "
                  "once every directory named above as writable by others is not: chmod go-w)";
        std::cout << printable(fmt::format("verify {}: {} good entr{}; {}{}", root, good,
                                           good == 1 ? "y" : "ies", totals.summary(), hint))
                  << std::endl;
    }
    return healthy ? kExitOk : kExitFailure;
}

// ---- prune and clear --------------------------------------------------------------------

struct PruneOptions {
    std::string max_bytes;   // "" = no limit
    std::string older_than;  // "" = no age limit
    bool keep_stale = false;
    bool dry_run = false;
};

struct Removal {
    size_t item;
    std::string reason;
};

// Which items prune removes, in this order: damage, strays, set-aside files, temp files past
// the grace period and (unless kept) stale entries; then entries unused for longer than
// --older-than; then, least recently used first, entries until the rest fits --max-bytes.
std::vector<Removal> plan_prune(const std::vector<Item>& items, int64_t now,
                                const PruneOptions& options) {
    const bool has_age = !options.older_than.empty();
    const int64_t older_than = has_age ? parse_duration(options.older_than, "--older-than") : 0;
    const bool has_budget = !options.max_bytes.empty();
    const uint64_t budget = has_budget ? parse_bytes(options.max_bytes, "--max-bytes") : 0;
    // ROPE_JIT_CACHE_MAX_BYTES=0 means no limit; the same value here would empty the cache.
    if (has_budget && budget == 0)
        throw UsageError(
            "--max-bytes: 0 would remove every entry (ROPE_JIT_CACHE_MAX_BYTES=0 means no "
            "limit); use `rope-jit-cache clear` to empty the cache");

    // A time stamp more than a day ahead of the clock (a bundle copied from a machine whose
    // clock was wrong) tells nothing about use: its age is unknown, and counts as old rather
    // than as "just used" forever.
    constexpr int64_t kUnknownAge = INT64_MAX;
    const auto age_of = [&](int64_t when) {
        return when > now + 24 * 3600 ? kUnknownAge : now - when;
    };
    const auto age_text = [](int64_t age) {
        return age == kUnknownAge ? std::string("an unknown time (time stamp in the future)")
                                  : format_age(age);
    };
    std::vector<Removal> removals;
    std::vector<size_t> kept;  // entries that count against the budget
    for (size_t i = 0; i < items.size(); ++i) {
        const Item& item = items[i];
        switch (item.state) {
            case ROPE_JIT_CACHE_ITEM_DAMAGED:
            case ROPE_JIT_CACHE_ITEM_UNTRUSTED:
            case ROPE_JIT_CACHE_ITEM_STRAY:
            case ROPE_JIT_CACHE_ITEM_SET_ASIDE:
                removals.push_back({i, item_state_name(item.state)});
                continue;
            case ROPE_JIT_CACHE_ITEM_TEMP:
                if (age_of(item.modified) > kTempGraceSeconds)
                    removals.push_back({i, "leftover temp file"});
                continue;
            case ROPE_JIT_CACHE_ITEM_STALE:
                if (!options.keep_stale) {
                    removals.push_back({i, "stale"});  // why: the item's problem, shown with it
                    continue;
                }
                break;
            case ROPE_JIT_CACHE_ITEM_OK: break;
        }
        if (has_age && age_of(item.accessed) > older_than) {
            removals.push_back({i, "unused for " + age_text(age_of(item.accessed))});
            continue;
        }
        kept.push_back(i);
    }
    if (has_budget) {
        uint64_t total = 0;
        for (size_t i : kept) total += items[i].bytes;
        // Oldest use first (unknown ages first of all).
        std::stable_sort(kept.begin(), kept.end(), [&](size_t a, size_t b) {
            return age_of(items[a].accessed) > age_of(items[b].accessed);
        });
        for (size_t i : kept) {
            if (total <= budget) break;
            removals.push_back(
                {i, fmt::format("least recently used over --max-bytes {}", format_bytes(budget))});
            total -= items[i].bytes;
        }
    }
    return removals;
}

// Whether the file at `item`'s path is no longer the one the walk judged: another process
// replaced it since (a prewarm rewriting a damaged entry with a good one, which prune must not
// remove for the damaged one's reason). Directories are judged as a whole: never "changed".
bool changed_since_walk(const Item& item) {
    struct stat st;
    if (lstat(item.path.c_str(), &st) != 0) return false;  // gone: removing it is a no-op
    if (S_ISDIR(st.st_mode)) return false;
    return uint64_t(st.st_size) != item.bytes || int64_t(st.st_mtime) != item.modified;
}

// Removes the planned items and reports; shared by prune and clear. Prune (recheck) leaves
// a file that changed since the walk judged it; clear removes whatever is there.
int remove_items(const GlobalOptions& global, const rope_jit_runtime* runtime, const char* command,
                 const std::vector<Item>& items, const std::vector<Removal>& removals,
                 bool dry_run, bool recheck) {
    const std::string root = rope_jit_cache_root(runtime);
    const int64_t now = now_seconds();
    json removed = json::array(), failures = json::array(), changed = json::array(),
         gone_already = json::array();
    uint64_t removed_bytes = 0;
    std::set<size_t> gone;
    std::map<size_t, uint64_t> partly_removed;  // bytes freed of items whose removal failed
    // An item not removed by this run: listed under `list` (JSON) or as one line of text.
    auto skipped = [&](json& list, const char* word, const Item& item, const char* why) {
        list.push_back(item.path);
        if (!global.json)
            std::cout << printable(fmt::format("{:<9} {}  ({})", word, item.path, why)) << "\n";
    };
    for (const Removal& removal : removals) {
        const Item& item = items[removal.item];
        if (!dry_run && recheck && changed_since_walk(item)) {
            skipped(changed, "left", item, "changed since it was judged: another process wrote it");
            continue;
        }
        uint64_t bytes = item.bytes;
        if (!dry_run) {
            uint64_t entries = 0;
            const rope_jit_status status =
                rope_jit_cache_remove_counted(runtime, item.path.c_str(), &entries, &bytes);
            if (status != ROPE_JIT_OK) {
                // A directory can fail partway: what went before its failure is freed all the
                // same and counts in removed_bytes.
                const std::string error = last_error_or(status);
                failures.push_back(
                    json{{"path", item.path}, {"error", error}, {"removed_bytes", bytes}});
                removed_bytes += bytes;
                partly_removed[removal.item] = bytes;
                if (!global.json)
                    std::cerr << "rope-jit-cache: error: " << printable(error)
                              << (bytes > 0 ? fmt::format(" ({} of it removed before that)",
                                                          format_bytes(bytes))
                                            : std::string())
                              << std::endl;
                continue;
            }
            if (entries == 0) {  // another process (a prune beside this one) removed it first
                gone.insert(removal.item);
                skipped(gone_already, "gone", item, "another process removed it first");
                continue;
            }
        }
        gone.insert(removal.item);
        removed_bytes += bytes;
        // The bytes this run removed (a tree another process emptied in part, a file rewritten
        // since the walk), so that the items add up to removed_bytes.
        json entry = item_json(item, now);
        entry["bytes"] = bytes;
        entry["reason"] = removal.reason;
        removed.push_back(entry);
        if (!global.json) {
            std::cout << printable(fmt::format("{} {:<9} {:>10}  {}  ({})",
                                               dry_run ? "would remove" : "removed",
                                               item_state_name(item.state), format_bytes(bytes),
                                               item_text(item), removal.reason))
                      << "\n";
        }
    }
    std::vector<Item> remaining;
    for (size_t i = 0; i < items.size(); ++i) {
        if (gone.count(i)) continue;
        remaining.push_back(items[i]);
        if (partly_removed.count(i))
            remaining.back().bytes -= std::min(remaining.back().bytes, partly_removed[i]);
    }
    const Totals left = totals_of(remaining);
    if (global.json) {
        print_json(json{{"command", command},
                        {"cache_dir", root},
                        {"dry_run", dry_run},
                        {"removed", removed},
                        {"removed_bytes", removed_bytes},
                        {"failures", failures},
                        {"changed_since_walk", changed},
                        {"removed_by_another_process", gone_already},
                        {"remaining", left.to_json()}});
    } else {
        std::cout << printable(fmt::format("{}: {} {} items ({}) from {}; left: {}", command,
                                           dry_run ? "would remove" : "removed", removed.size(),
                                           format_bytes(removed_bytes), root, left.summary()))
                  << std::endl;
    }
    return failures.empty() ? kExitOk : kExitFailure;
}

int run_prune(const GlobalOptions& global, const PruneOptions& options) {
    RuntimeHandle runtime = make_runtime(global, ROPE_JIT_BACKEND_CPU, RuntimeUse::Maintenance);
    const std::vector<Item> items = collect_items(runtime.get());
    const std::vector<Removal> removals = plan_prune(items, now_seconds(), options);
    return remove_items(global, runtime.get(), "prune", items, removals, options.dry_run,
                        /*recheck=*/true);
}

int run_clear(const GlobalOptions& global, bool dry_run) {
    RuntimeHandle runtime = make_runtime(global, ROPE_JIT_BACKEND_CPU, RuntimeUse::Maintenance);
    const std::vector<Item> items = collect_items(runtime.get());
    std::vector<Removal> removals;
    for (size_t i = 0; i < items.size(); ++i) removals.push_back({i, "clear"});
    return remove_items(global, runtime.get(), "clear", items, removals, dry_run,
                        /*recheck=*/false);
}

// ---- info -------------------------------------------------------------------------------

int run_info(const GlobalOptions& global) {
    RuntimeHandle runtime = make_runtime(global, ROPE_JIT_BACKEND_AUTO);
    const char* nvrtc = "";
    const rope_jit_status nvrtc_status = rope_jit_nvrtc_version(&nvrtc);
    const std::string nvrtc_problem =
        nvrtc_status == ROPE_JIT_OK ? "" : last_error_or(nvrtc_status);
    const bool cuda = rope_jit_backend(runtime.get()) == ROPE_JIT_BACKEND_CUDA;
    json devices = json::array();
    for (int ordinal = 0; ordinal < rope_jit_device_count(runtime.get()); ++ordinal) {
        rope_jit_device_info info;
        rope_jit_device_info_init(&info);
        if (rope_jit_device_describe(runtime.get(), ordinal, &info) == ROPE_JIT_OK)
            devices.push_back(
                json{{"ordinal", ordinal}, {"name", info.name}, {"target", info.target}});
    }
    const std::string root = rope_jit_cache_root(runtime.get());
    // A root that does not exist is not created by looking at it (a mistyped --cache-dir left
    // directories behind): rope_jit_cache_check, which creates what is missing, runs only on
    // one that exists.
    struct stat root_stat;
    const bool root_exists =
        root.empty() || lstat(root.c_str(), &root_stat) == 0 || errno != ENOENT;
    const rope_jit_status check =
        root_exists ? rope_jit_cache_check(runtime.get()) : ROPE_JIT_ERROR_CACHE;
    const std::string why_not_writable =
        !root_exists ? "it does not exist yet (the first kernel stored, or prewarm, creates it)"
        : check == ROPE_JIT_OK ? ""
                               : last_error_or(check);
    std::vector<Item> items;
    std::string walk_problem;
    try {
        items = collect_items(runtime.get());
    } catch (const Failure& e) {
        walk_problem = e.what();
    }
    const Totals totals = totals_of(items);
    const char* read_only = std::getenv("ROPE_JIT_CACHE_RO_DIRS");

    if (global.json) {
        print_json(json{{"command", "info"},
                        {"version", rope_jit_version_string()},
                        {"nvrtc_version", nvrtc},
                        {"nvrtc_problem", nvrtc_problem},
                        {"backend", cuda ? "cuda" : "cpu"},
                        {"devices", devices},
                        {"cache_dir", root},
                        {"cache_exists", root_exists && !root.empty()},
                        {"cache_writable", check == ROPE_JIT_OK},
                        {"cache_problem", why_not_writable},
                        {"read_only_dirs", read_only ? read_only : ""},
                        {"totals", totals.to_json()}});
        return kExitOk;
    }
    auto line = [](const char* label, const std::string& value) {
        std::cout << printable(fmt::format("{:<16}{}", label, value)) << "\n";
    };
    line("rope-jit", rope_jit_version_string());
    line("NVRTC", nvrtc_problem.empty() ? nvrtc : "not available: " + nvrtc_problem);
    line("backend", cuda ? "cuda" : "cpu (no usable CUDA device)");
    if (devices.empty()) line("devices", "none");
    for (const json& device : devices)
        line("device",
             fmt::format("{}: {} ({})", device["ordinal"].get<int>(),
                         device["name"].get<std::string>(), device["target"].get<std::string>()));
    line("cache dir", root.empty() ? "none (memory only)" : root);
    line("cache writable", check == ROPE_JIT_OK ? "yes" : "no: " + why_not_writable);
    if (read_only && *read_only) line("read-only dirs", read_only);
    line("cache contents", walk_problem.empty()
                               ? fmt::format("{} items, {}: {}", items.size(),
                                             format_bytes(totals.all_bytes), totals.summary())
                               : walk_problem);
    std::cout << std::flush;
    return kExitOk;
}

// ---- command line -----------------------------------------------------------------------

// The exit code of a run that failed with `message`. With --json, stdout still holds one JSON
// document, {"command", "error", "exit_code"}, unless the subcommand printed its own: a
// failing list, verify, prune or clear printed nothing there, and a script reading it found no
// document (adversarial pass, session 49).
int failed_with(bool json_output, const std::string& command, const std::string& message,
                int exit_code) {
    if (json_output && !json_document_printed)
        print_json(json{{"command", command}, {"error", message}, {"exit_code", exit_code}});
    return exit_code;
}

// The subcommand CLI11 chose, "" before it chose one.
std::string chosen_command(const CLI::App& app) {
    const std::vector<CLI::App*> chosen = app.get_subcommands();
    return chosen.empty() ? "" : chosen.front()->get_name();
}

// Whether --json is among the arguments: a command line CLI11 refuses sets no option, and its
// usage error gets the document too.
bool json_requested(int argc, char** argv) {
    for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]) == "--json") return true;
    return false;
}

int run(int argc, char** argv) {
    CLI::App app{
        "rope-jit-cache: prewarm, inspect and trim the rope-jit kernel cache.\n"
        "Exit status: 0 success, 1 failure, 2 usage error."};
    app.require_subcommand(1);
    GlobalOptions global;
    // The global options, accepted before the subcommand and after it (and listed in each
    // subcommand's --help).
    auto add_global_options = [&global](CLI::App* command) {
        // An empty value (an unset shell variable, say) must not quietly mean the default cache,
        // which clear or prune would then empty.
        command
            ->add_option(
                "--cache-dir", global.cache_dir,
                "cache root (default: $ROPE_JIT_CACHE_DIR, else $XDG_CACHE_HOME/rope_jit, else "
                "~/.cache/rope_jit)")
            ->check([](const std::string& dir) {
                return dir.empty()
                           ? std::string("empty; leave the option out for the default cache")
                           : std::string();
            });
        command->add_flag("--json", global.json,
                          "print one JSON document on stdout instead of text");
    };
    add_global_options(&app);

    // prewarm
    CLI::App* prewarm = app.add_subcommand(
        "prewarm", "compile kernels ahead of time into the cache (needs NVRTC, not a GPU)");
    PrewarmOptions prewarm_options;
    std::vector<std::string> preset_names;
    for (const Preset& preset : presets()) preset_names.push_back(preset.name);
    prewarm
        ->add_option(
            "--preset", prewarm_options.presets,
            "model presets, comma-separated: the kernels rope_jit.rope, apply_rope, the HF drop-in "
            "and the fused attention run for one layer of the model (bf16, bf16 tables; RoPE in "
            "and "
            "out of place, forward and backward, implicit, int64 indices and int64 offsets; causal "
            "attention forward and backward). Known: " +
                joined(preset_names))
        ->delimiter(',');
    prewarm
        ->add_option("--ops", prewarm_options.ops,
                     "ops of the presets: rope, attention (default both)")
        ->delimiter(',');
    prewarm->add_option(
        "--manifest", prewarm_options.manifests,
        "JSON file: {\"presets\": [...], \"ops\": [...], \"specs\": [{field: value or [values]}, "
        "...]}, a list of such specs, or the output of `rope-jit-cache list --json` (its ok "
        "entries, each for its own target unless --target is given). Fields are "
        "rope_jit_prewarm_json's (rope_jit.h): \"op\" (rope, attention), head_dim, rotary_dim, "
        "dtype, direction, ...; at most 4 MiB, 16 levels of nesting and 20000 specs (each "
        "counted once per target), a key once in an object");
    prewarm
        ->add_option(
            "--target", prewarm_options.targets,
            std::string("architectures, comma-separated (sm_80,sm_90); default: those of the local "
                        "GPUs, or ") +
                kDefaultTarget + " when there is none")
        ->delimiter(',');
    prewarm->add_option("--jobs,-j", prewarm_options.jobs,
                        "kernels compiled in parallel (default 0: one per hardware thread)");
    prewarm->add_option("--processes", prewarm_options.processes,
                        "worker processes the jobs are spread over, at most one a job (default "
                        "0: one per 4 jobs from 8 jobs up, else none: NVRTC's threads in one "
                        "process wait on each other)");
    prewarm->add_flag("--dry-run", prewarm_options.dry_run,
                      "only list the kernels it would prewarm");
    // Spec flags: each takes comma-separated values; the specs are their cross product.
    std::vector<int> head_dims, rotary_dims, rotary_offsets, gqa_groups;
    std::vector<std::string> dtypes, table_dtypes, styles, directions, positions, index_dtypes,
        angles;
    bool q_only = false, packed = false, xpos = false, out_of_place = false, dense_rows = false;
    prewarm
        ->add_option("--head-dim", head_dims,
                     "spec: features per head (required for specs from flags)")
        ->delimiter(',');
    prewarm->add_option("--rotary-dim", rotary_dims, "spec: rotated features (default head_dim)")
        ->delimiter(',');
    prewarm
        ->add_option("--rotary-offset", rotary_offsets, "spec: first rotated feature (default 0)")
        ->delimiter(',');
    prewarm->add_option("--gqa-group", gqa_groups, "spec: q heads per k head (default 1)")
        ->delimiter(',');
    prewarm->add_option("--dtype", dtypes, "spec: float32 (default), float16, bfloat16")
        ->delimiter(',');
    prewarm
        ->add_option("--table-dtype", table_dtypes,
                     "spec: cos/sin dtype, float32 (default), float16, bfloat16")
        ->delimiter(',');
    prewarm->add_option("--style", styles, "spec: half (default), interleaved or proportional")
        ->delimiter(',');
    prewarm->add_option("--direction", directions, "spec: forward (default), backward")
        ->delimiter(',');
    prewarm
        ->add_option("--positions", positions, "spec: implicit (default), indices, seqlen-offsets")
        ->delimiter(',');
    prewarm->add_option("--index-dtype", index_dtypes, "spec: int64 (default) or int32");
    prewarm->add_option("--angles", angles, "spec: table-full (default), table-half, inv-freq")
        ->delimiter(',');
    prewarm->add_flag("--q-only", q_only, "spec: rotate q alone (no k)");
    prewarm->add_flag("--packed", packed, "spec: packed [T,H,D] tensors with cu_seqlens");
    prewarm->add_flag("--xpos", xpos, "spec: xPos scales");
    prewarm->add_flag("--out-of-place", out_of_place, "spec: separate outputs");
    prewarm->add_flag("--dense-rows", dense_rows,
                      "spec: the kernel of prefill calls on dense rows ([B,H,S,D] memory, or "
                      "16-bit [B,S,H,D] rotated whole)");

    // list, verify, prune, clear, info
    CLI::App* list = app.add_subcommand(
        "list", "list every item of the cache: entries and what is wrong with others");
    CLI::App* verify = app.add_subcommand(
        "verify", "re-check every entry; exit status 1 when damaged or stray files are found");
    CLI::App* prune = app.add_subcommand(
        "prune",
        "remove damaged, stale (other NVRTC or format versions) and leftover files, then old or "
        "least recently used entries");
    PruneOptions prune_options;
    // An empty value (an unset shell variable) read as "no limit" pruned less than asked.
    auto not_empty = [](const std::string& value) {
        return value.empty() ? std::string("empty; leave the option out for no such limit")
                             : std::string();
    };
    prune
        ->add_option(
            "--max-bytes", prune_options.max_bytes,
            "keep at most this much (500M, 2G...), removing least recently used entries first")
        ->check(not_empty);
    prune
        ->add_option("--older-than", prune_options.older_than,
                     "remove entries unused for this long (12h, 30d, 2w...)")
        ->check(not_empty);
    prune->add_flag("--keep-stale", prune_options.keep_stale,
                    "keep entries of other NVRTC or cache format versions");
    prune->add_flag("--dry-run", prune_options.dry_run, "only say what would be removed");
    CLI::App* clear = app.add_subcommand("clear",
                                         "remove every item of the cache; the compile lock files "
                                         "in <root>/locks stay (empty, and perhaps "
                                         "held by a process compiling right now)");
    bool clear_dry_run = false;
    clear->add_flag("--dry-run", clear_dry_run, "only say what would be removed");
    CLI::App* info = app.add_subcommand(
        "info", "versions, backend, devices, cache directory and whether it is writable");
    // prewarm's worker processes (prewarm_processes.h): not listed in --help.
    CLI::App* prewarm_worker = app.add_subcommand("prewarm-worker", "");
    prewarm_worker->group("");
    int worker_jobs = 1;
    long worker_parent = 0;
    prewarm_worker->add_option("--jobs", worker_jobs, "threads of this worker");
    prewarm_worker->add_option("--parent", worker_parent, "the prewarm process it works for")
        ->required();

    for (CLI::App* command : {prewarm, list, verify, prune, clear, info, prewarm_worker})
        add_global_options(command);

    // CLI11 reports a word that is no subcommand as "A subcommand is required"; name it instead.
    // The first word that is neither an option nor the value of --cache-dir is the subcommand.
    for (int i = 1; i < argc; ++i) {
        const std::string word = argv[i];
        if (word == "--cache-dir") {
            ++i;
            continue;
        }
        if (word.empty() || word[0] == '-') continue;
        std::vector<std::string> names;
        for (const CLI::App* command : {prewarm, list, verify, prune, clear, info})
            names.push_back(command->get_name());
        if (word == prewarm_worker->get_name()) break;
        if (std::find(names.begin(), names.end(), word) == names.end()) {
            const std::string message =
                "unknown subcommand '" + word + "' (expected one of: " + joined(names) + ")";
            std::cerr << "rope-jit-cache: " << printable(message) << "\nRun with --help for usage."
                      << std::endl;
            return failed_with(json_requested(argc, argv), "", message, kExitUsage);
        }
        break;
    }

    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        if (app.exit(e) == 0) return kExitOk;  // --help
        return failed_with(json_requested(argc, argv), chosen_command(app), e.what(), kExitUsage);
    }

    try {
        if (*prewarm) {
            json& tmpl = prewarm_options.flag_template;
            if (!head_dims.empty()) tmpl["head_dim"] = head_dims;
            if (!rotary_dims.empty()) tmpl["rotary_dim"] = rotary_dims;
            if (!rotary_offsets.empty()) tmpl["rotary_offset"] = rotary_offsets;
            if (!gqa_groups.empty()) tmpl["gqa_group"] = gqa_groups;
            // Flags take the short dtype names too; the JSON vocabulary has the long ones.
            auto long_dtypes = [](std::vector<std::string> names) {
                for (std::string& name : names) {
                    if (name == "f32" || name == "fp32") name = "float32";
                    if (name == "f16" || name == "fp16") name = "float16";
                    if (name == "bf16") name = "bfloat16";
                }
                return names;
            };
            if (!dtypes.empty()) tmpl["dtype"] = long_dtypes(dtypes);
            if (!table_dtypes.empty()) tmpl["table_dtype"] = long_dtypes(table_dtypes);
            if (!styles.empty()) tmpl["style"] = styles;
            if (!directions.empty()) tmpl["direction"] = directions;
            if (!positions.empty()) tmpl["positions"] = positions;
            if (!index_dtypes.empty()) {
                // int64, the default, is what the derived index dtype fields give.
                if (index_dtypes.size() != 1 ||
                    (index_dtypes[0] != "int32" && index_dtypes[0] != "int64"))
                    throw UsageError("--index-dtype: expected one of int32, int64");
                if (index_dtypes[0] == "int32")
                    for (const char* key :
                         {"positions_int64", "seqlen_offsets_int64", "cu_seqlens_int64"})
                        tmpl[key] = false;
            }
            if (!angles.empty()) tmpl["angles"] = angles;
            if (q_only) tmpl["has_k"] = false;
            if (packed) tmpl["packed"] = true;
            if (xpos) tmpl["xpos"] = true;
            if (out_of_place) tmpl["in_place_q"] = false;
            if (dense_rows) tmpl["dense_rows"] = true;
            if (!tmpl.empty() && head_dims.empty())
                throw UsageError("prewarm: --head-dim is required with the other spec flags");
            return run_prewarm(global, prewarm_options);
        }
        if (*list) return run_list(global);
        if (*verify) return run_verify(global);
        if (*prune) return run_prune(global, prune_options);
        if (*clear) return run_clear(global, clear_dry_run);
        if (*info) return run_info(global);
        if (*prewarm_worker) return run_prewarm_worker(global, worker_jobs, worker_parent);
    } catch (const UsageError& e) {
        std::cerr << "rope-jit-cache: " << printable(e.what()) << "\nRun with --help for usage."
                  << std::endl;
        return failed_with(global.json, chosen_command(app), e.what(), kExitUsage);
    } catch (const Failure& e) {
        std::cerr << "rope-jit-cache: error: " << printable(e.what()) << std::endl;
        return failed_with(global.json, chosen_command(app), e.what(), kExitFailure);
    } catch (const std::exception& e) {
        std::cerr << "rope-jit-cache: error: " << printable(e.what()) << std::endl;
        return failed_with(global.json, chosen_command(app), e.what(), kExitFailure);
    }
    return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
    return run(argc, argv);
}
