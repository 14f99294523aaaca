// Cache maintenance (src/cache_maintenance.*) and its C API: every item under a root is
// classified against this build, removal stays inside the cache and never follows links, and
// the diagnostics calls report what the runtime uses.
#include <doctest/doctest.h>

#include <dirent.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ops/attention/attention_spec.h"
#include "cache/cache_maintenance.h"
#include "child_process.h"
#include "ops/attention/cuda_attention.h"
#include "cache/disk_cache.h"
#include "common/error.h"
#include "jit/kernel_builder.h"
#include "ops/rope/kernel_spec.h"
#include "jit/nvrtc_loader.h"
#include "rope_jit/rope_jit.h"
#include "scratch_files.h"
#include "common/sha256.h"

using rope_jit::CacheEntry;
using rope_jit::CacheEntryId;
using rope_jit::CacheItem;
using rope_jit::CacheItemState;
using rope_jit::DiskCache;

namespace {

void make_dirs(const std::string& path) {
    REQUIRE(std::system(("mkdir -p -m 700 '" + path + "'").c_str()) == 0);
}

std::map<std::string, CacheItem> scan_by_path(const DiskCache& disk) {
    std::map<std::string, CacheItem> items;
    for (CacheItem& item : rope_jit::scan_cache(disk)) items[item.path] = item;
    return items;
}

rope_jit::KernelSpec small_spec() {
    rope_jit_kernel_spec spec;
    rope_jit_kernel_spec_init(&spec);
    spec.head_dim = 64;
    return rope_jit::kernel_spec_from_public(spec);
}

CacheEntry entry_of(const rope_jit::KernelSpec& spec) {
    CacheEntry entry;
    entry.spec_json = spec.to_json();
    entry.payload.assign(1000, 'x');
    return entry;
}

#if defined(__x86_64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_AARCH64;
#else
constexpr uint32_t kAuditArch = 0;  // no filter: the test that needs it skips
#endif

// Installs a seccomp filter: `rules` run on the syscall's data for this architecture, every
// other architecture's syscalls pass. A filter cannot be undone: for a forked child. False
// where such filters are not available.
bool install_seccomp_filter(std::vector<sock_filter> rules) {
    if (kAuditArch == 0) return false;
    std::vector<sock_filter> filter = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kAuditArch, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    filter.insert(filter.end(), rules.begin(), rules.end());
    struct sock_fprog program;
    program.len = static_cast<unsigned short>(filter.size());
    program.filter = filter.data();
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
           prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

// The low word of a syscall's argument (both architectures are little-endian).
constexpr uint32_t argument_low_word(int index) {
    return uint32_t(offsetof(struct seccomp_data, args) + size_t(index) * 8);
}

// Makes every open() of a file with O_NOFOLLOW in this process, unless it asks for a
// directory, fail with EMFILE, as if the descriptors had run out just then: the cache opens
// its own entries so, while opendir() and the loading of libraries do not.
bool fail_entry_opens_with_emfile() {
    return install_seccomp_filter({
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_openat, 0, 4),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, argument_low_word(2)),  // openat's flags
        BPF_STMT(BPF_ALU | BPF_AND | BPF_K, O_NOFOLLOW | O_DIRECTORY),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, O_NOFOLLOW, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EMFILE & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    });
}

// Makes every removal of a directory in this process fail with EACCES, as if this user could
// not write its parent, while files are unlinked as usual: a tree's removal then fails partway,
// after its first file. (Root passes permission checks, so a test cannot make one so.)
bool fail_directory_removals_with_eacces() {
    return install_seccomp_filter({
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
#ifdef __NR_rmdir
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_rmdir, 3, 0),
#endif
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_unlinkat, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, argument_low_word(2)),  // unlinkat's flags
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, AT_REMOVEDIR, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EACCES & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    });
}

}  // namespace

TEST_SUITE_BEGIN("cache_maintenance");

TEST_CASE(
    "scan judges entries against this build: current, other NVRTC, other build, other format") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available, so keys cannot be recomputed");
        return;
    }
    ScratchDir tmp("rope_jit_maintenance");
    DiskCache disk(tmp.path, {});
    const rope_jit::KernelSpec spec = small_spec();
    const CacheEntryId current = rope_jit::plan_compile(spec.to_json(), "sm_90").entry;
    REQUIRE(disk.store(current, entry_of(spec)));

    CacheEntryId other_nvrtc = current;
    other_nvrtc.nvrtc_version = "11.8";
    REQUIRE(disk.store(other_nvrtc, entry_of(spec)));
    CacheEntryId other_build = current;  // what a build with other templates would have stored
    other_build.key_hex = rope_jit::sha256_hex("an older rope-jit");
    REQUIRE(disk.store(other_build, entry_of(spec)));
    const std::string other_format = tmp.path + "/v7";
    make_dirs(other_format + "/nvrtc13.0/sm_90/ab");
    write_file(other_format + "/nvrtc13.0/sm_90/ab/ab" + std::string(62, '0') + ".cubin",
               std::string(300, 'y'));
    write_file(tmp.path + "/notes.txt", "not the cache's");  // outside any v<N>: not reported

    auto items = scan_by_path(disk);
    CHECK(items.size() == 4);
    const CacheItem& ok = items[disk.entry_path(tmp.path, current)];
    CHECK(ok.state == CacheItemState::Ok);
    CHECK(ok.problem.empty());
    CHECK(ok.spec_description == spec.describe());
    CHECK(ok.payload_bytes == 1000);
    CHECK(ok.bytes > 1000);
    const CacheItem& nvrtc = items[disk.entry_path(tmp.path, other_nvrtc)];
    CHECK(nvrtc.state == CacheItemState::Stale);
    CHECK(nvrtc.problem.find("NVRTC 11.8") != std::string::npos);
    const CacheItem& build = items[disk.entry_path(tmp.path, other_build)];
    CHECK(build.state == CacheItemState::Stale);
    CHECK(build.problem.find("another rope-jit build") != std::string::npos);
    const CacheItem& format = items[other_format];
    CHECK(format.state == CacheItemState::Stale);
    CHECK(format.problem.find("format v7") != std::string::npos);
    CHECK(format.bytes == 300);
}

TEST_CASE("a wgmma attention kernel is cached under sm_90a, read back, and judged current") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available");
        return;
    }
    ScratchDir tmp("rope_jit_maintenance");
    DiskCache disk(tmp.path, {});
    rope_jit::AttentionSpec spec;
    spec.dtype = 2;
    spec.head_dim = 64;
    spec.rotary_dim = 64;
    spec.causal = 1;
    spec.tensor_cores = 1;
    spec.wgmma = 1;
    spec.warps = 8;
    spec.block_n = 64;
    rope_jit::KernelStats stats;
    // Asked for the device's target (sm_90), it compiles for sm_90a and stores the entry there.
    const rope_jit::KernelBinary built =
        rope_jit::build_attention_binary(spec, "sm_90", &disk, stats);
    CHECK(stats.compiles.load() == 1);
    CHECK(stats.disk_writes.load() == 1);
    const rope_jit::KernelBinary again =
        rope_jit::build_attention_binary(spec, "sm_90", &disk, stats);
    CHECK(stats.compiles.load() == 1);
    CHECK(stats.disk_hits.load() == 1);
    CHECK(again.image == built.image);
    const std::vector<CacheItem> items = rope_jit::scan_cache(disk);
    REQUIRE(items.size() == 1);
    CHECK(items[0].state == CacheItemState::Ok);
    CHECK(items[0].problem.empty());
    CHECK(items[0].path.find("/sm_90a/") != std::string::npos);
    CHECK(items[0].spec_description == spec.describe());
}

TEST_CASE("scan reports damage, temp files, set-aside entries and strays, and changes nothing") {
    ScratchDir tmp("rope_jit_maintenance");
    DiskCache disk(tmp.path, {});
    CacheEntryId id{rope_jit::sha256_hex("damaged"), "13.0", "sm_90", "cubin"};
    REQUIRE(disk.store(id, CacheEntry{"{}", std::vector<char>(100, 'z')}));
    const std::string path = disk.entry_path(tmp.path, id);
    write_file(path, "RJITCACH truncated");
    const std::string dir = path.substr(0, path.rfind('/'));
    write_file(dir + "/.tmp-1-2-3", "half");
    write_file(path + ".bad-1-0", "old");
    write_file(tmp.path + "/v1/nvrtc9.9", "stray");          // a file where a directory belongs
    write_file(tmp.path + "/v1/README", "not the cache's");  // a foreign name: not reported

    auto items = scan_by_path(disk);
    CHECK(items.size() == 4);
    CHECK(items[path].state == CacheItemState::Damaged);
    CHECK(items[dir + "/.tmp-1-2-3"].state == CacheItemState::Temp);
    CHECK(items[path + ".bad-1-0"].state == CacheItemState::SetAside);
    CHECK(items[tmp.path + "/v1/nvrtc9.9"].state == CacheItemState::Stray);
    CHECK(scan_by_path(disk).size() == 4);
    CHECK(rope_jit::scan_cache(DiskCache(tmp.path + "/missing", {})).empty());
}

TEST_CASE(
    "remove deletes one item, also a whole directory, and never follows links out of the cache") {
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/cache";
    DiskCache disk(root, {});
    REQUIRE(disk.writable());
    const std::string outside = tmp.path + "/precious";
    write_file(outside, "keep me");
    const std::string old_entries = root + "/v9/nvrtc12.0/sm_90/ab";
    make_dirs(old_entries);
    write_file(old_entries + "/ab" + std::string(62, '1') + ".cubin", "old format");
    const std::string link = old_entries + "/ab" + std::string(62, '2') + ".cubin";
    REQUIRE(symlink(outside.c_str(), link.c_str()) == 0);
    REQUIRE(symlink(tmp.path.c_str(), (root + "/v1/nvrtc13.0").c_str()) == 0);

    rope_jit::remove_cache_item(disk, root + "/v9", nullptr);
    CHECK_FALSE(exists(root + "/v9"));
    CHECK(exists(outside));

    // Paths that leave the cache, or pass through a link, are refused.
    for (const std::string& path :
         {outside, tmp.path + "/cache2/v1/x", root + "/v1/../../precious", root + "/v1/./x",
          root + "//v1/x", root + "/notes/x", root, root + "/v1/nvrtc13.0/precious",
          root + "/v1/nvrtc13.0/sm_90"}) {
        CAPTURE(path);
        bool refused = false;
        try {
            rope_jit::remove_cache_item(disk, path, nullptr);
        } catch (const rope_jit::Error& e) {
            refused = e.status() == ROPE_JIT_ERROR_INVALID_ARGUMENT;
        }
        CHECK(refused);
    }
    CHECK(exists(outside));
    // A link that is itself the item is removed, its target kept; a missing item is no error.
    rope_jit::remove_cache_item(disk, root + "/v1/nvrtc13.0", nullptr);
    CHECK_FALSE(exists(root + "/v1/nvrtc13.0"));
    CHECK(exists(tmp.path + "/precious"));
    const std::string never_there = "/v1/nvrtc13.0/sm_90/ab/ab" + std::string(62, '0') + ".cubin";
    rope_jit::remove_cache_item(disk, root + never_there, nullptr);
}

TEST_CASE("a root given with a trailing slash scans and removes like one without") {
    ScratchDir tmp("rope_jit_maintenance");
    DiskCache disk(tmp.path + "/cache/", {});
    REQUIRE(disk.writable());
    write_file(tmp.path + "/cache/v1/nvrtc9.9", "stray");
    make_dirs(tmp.path + "/cache/v3");
    const std::vector<CacheItem> items = rope_jit::scan_cache(disk);
    REQUIRE(items.size() == 2);
    for (const CacheItem& item : items) {
        CAPTURE(item.path);
        rope_jit::remove_cache_item(disk, item.path, nullptr);
        CHECK_FALSE(exists(item.path));
    }
    CHECK(exists(tmp.path + "/cache/v1"));
}

TEST_CASE("remove refuses a root that belongs to another user") {
    if (geteuid() != 0) {
        MESSAGE("skipped: changing a directory's owner needs root");
        return;
    }
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/cache";
    DiskCache disk(root, {});
    REQUIRE(disk.writable());
    write_file(root + "/v1/nvrtc9.9", "x");
    REQUIRE(chown(root.c_str(), 65534, 65534) == 0);
    bool refused = false;
    try {
        rope_jit::remove_cache_item(disk, root + "/v1/nvrtc9.9", nullptr);
    } catch (const rope_jit::Error& e) {
        refused = e.status() == ROPE_JIT_ERROR_CACHE &&
                  std::string(e.what()).find("owned by uid 65534") != std::string::npos;
    }
    CHECK(refused);
    CHECK(exists(root + "/v1/nvrtc9.9"));
}

TEST_CASE("the cache C API reports the root, walks, removes and rejects bad arguments") {
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/cache";
    rope_jit_runtime* runtime = cpu_runtime_caching_in(root);
    CHECK(std::string(rope_jit_cache_root(runtime)) == root);
    CHECK_FALSE(exists(root));  // creating a runtime touches nothing
    CHECK(rope_jit_cache_check(runtime) == ROPE_JIT_OK);
    CHECK(exists(root + "/v1"));
    write_file(root + "/v1/nvrtc9.9", "stray");
    write_file(root + "/v1/README", "not the cache's");

    std::vector<std::string> seen;
    auto collect = [](const rope_jit_cache_item* item, void* user) -> int {
        static_cast<std::vector<std::string>*>(user)->push_back(std::string(item->path) + " " +
                                                                item->problem + " state " +
                                                                std::to_string(int(item->state)));
        return 0;
    };
    CHECK(rope_jit_cache_walk(runtime, collect, &seen) == ROPE_JIT_OK);
    REQUIRE(seen.size() == 1);
    CHECK(seen[0].find(root + "/v1/nvrtc9.9") == 0);
    CHECK(seen[0].find("state 5") != std::string::npos);  // ROPE_JIT_CACHE_ITEM_STRAY
    CHECK(rope_jit_cache_remove(runtime, (root + "/v1/nvrtc9.9").c_str()) == ROPE_JIT_OK);
    CHECK(rope_jit_cache_remove(runtime, (root + "/v1/README").c_str()) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(exists(root + "/v1/README"));
    seen.clear();
    CHECK(rope_jit_cache_walk(runtime, collect, &seen) == ROPE_JIT_OK);
    CHECK(seen.empty());

    CHECK(rope_jit_cache_walk(nullptr, collect, &seen) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("runtime") != std::string::npos);
    CHECK(rope_jit_cache_walk(runtime, nullptr, &seen) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("visitor") != std::string::npos);
    CHECK(rope_jit_cache_remove(runtime, nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(rope_jit_cache_remove(runtime, "/etc/passwd") == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("path:") != std::string::npos);
    CHECK(rope_jit_cache_check(nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_cache_root(nullptr)).empty());
    rope_jit_runtime_free(runtime);

    // A memory-only runtime has no cache to walk.
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    CHECK(std::string(rope_jit_cache_root(runtime)).empty());
    CHECK(rope_jit_cache_walk(runtime, collect, &seen) == ROPE_JIT_ERROR_CACHE);
    CHECK(rope_jit_cache_check(runtime) == ROPE_JIT_ERROR_CACHE);
    CHECK(std::string(rope_jit_last_error()).find("no disk cache") != std::string::npos);
    rope_jit_runtime_free(runtime);
}

TEST_CASE("a counted removal tells what this call removed: nothing for an item already gone") {
    // Two prunes at once both removed an item and both counted it (totals inflated, left out
    // in session 40): the second now hears that it removed nothing.
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/cache";
    rope_jit_runtime* runtime = cpu_runtime_caching_in(root);
    make_dirs(root + "/v1");
    write_file(root + "/v1/nvrtc9.9", "stray");
    make_dirs(root + "/v3/nvrtc9.9/sm_90/ab");
    const std::string entry = "/v3/nvrtc9.9/sm_90/ab/ab" + std::string(62, '0') + ".cubin";
    write_file(root + entry, "12345678");  // another format's tree: 4 directories and a file
    struct Item {
        std::string path;
        uint64_t entries, bytes;
    };
    for (const Item& item : {Item{root + "/v1/nvrtc9.9", 1, 5}, Item{root + "/v3", 5, 8}}) {
        CAPTURE(item.path);
        uint64_t entries = 99, bytes = 99;
        REQUIRE(rope_jit_cache_remove_counted(runtime, item.path.c_str(), &entries, &bytes) ==
                ROPE_JIT_OK);
        CHECK(entries == item.entries);
        CHECK(bytes == item.bytes);
        CHECK_FALSE(exists(item.path));
        entries = bytes = 99;
        REQUIRE(rope_jit_cache_remove_counted(runtime, item.path.c_str(), &entries, &bytes) ==
                ROPE_JIT_OK);
        CHECK(entries == 0);
        CHECK(bytes == 0);
    }
    write_file(root + "/v1/nvrtc9.9", "stray");
    CHECK(rope_jit_cache_remove_counted(runtime, (root + "/v1/nvrtc9.9").c_str(), nullptr,
                                        nullptr) == ROPE_JIT_OK);
    CHECK_FALSE(exists(root + "/v1/nvrtc9.9"));
    uint64_t entries = 99, bytes = 99;
    CHECK(rope_jit_cache_remove_counted(runtime, "/etc/passwd", &entries, &bytes) ==
          ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(entries == 0);
    CHECK(bytes == 0);
    rope_jit_runtime_free(runtime);
}

TEST_CASE("a counted removal that fails partway tells what went before the failure") {
    // It said 0 (left out in session 43), so a prune's total of freed bytes missed them.
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/cache";
    rope_jit_runtime* runtime = cpu_runtime_caching_in(root);
    make_dirs(root + "/v3/nvrtc9.9/sm_90/ab");
    const std::string entry = root + "/v3/nvrtc9.9/sm_90/ab/ab" + std::string(62, '0') + ".cubin";
    write_file(entry, "12345678");
    const std::string tree = root + "/v3";

    // In a child, whose directory removals fail: the status, the counts and the error, one per
    // line, or why it could not be tried.
    const ChildResult child = run_in_child([&](std::string* result) {
        if (!fail_directory_removals_with_eacces()) {
            *result = "skip";
            return 0;
        }
        uint64_t entries = 99, bytes = 99;
        const rope_jit_status status =
            rope_jit_cache_remove_counted(runtime, tree.c_str(), &entries, &bytes);
        *result = std::to_string(int(status)) + "\n" + std::to_string(entries) + "\n" +
                  std::to_string(bytes) + "\n" + rope_jit_last_error();
        return 0;
    });
    rope_jit_runtime_free(runtime);
    CAPTURE(child.wait_status);
    REQUIRE(child.exited_with(0));
    if (child.output == "skip") {
        MESSAGE("skipped: no seccomp filter can be installed here");
        return;
    }
    CAPTURE(child.output);
    std::istringstream lines(child.output);
    int status = -1;
    uint64_t entries = 99, bytes = 99;
    std::string message;
    lines >> status >> entries >> bytes;
    std::getline(lines >> std::ws, message);
    CHECK(status == ROPE_JIT_ERROR_CACHE);
    CHECK(message.find("cannot remove '" + root + "/v3/nvrtc9.9/sm_90/ab'") != std::string::npos);
    // The entry file went (1 entry, its 8 bytes); its directory and those above it stayed.
    CHECK(entries == 1);
    CHECK(bytes == 8);
    CHECK_FALSE(exists(entry));
    CHECK(exists(root + "/v3/nvrtc9.9/sm_90/ab"));
}

TEST_CASE("a CPU runtime has no devices, and the NVRTC version is the loaded library's") {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.disk_cache = 0;
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    CHECK(rope_jit_device_count(runtime) == 0);
    CHECK(rope_jit_device_count(nullptr) == 0);
    rope_jit_device_info info;
    rope_jit_device_info_init(&info);
    CHECK(info.struct_size == sizeof info);
    CHECK(rope_jit_device_describe(runtime, 0, &info) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(rope_jit_last_error()).find("ordinal: 0") != std::string::npos);
    info.struct_size = 0;
    CHECK(rope_jit_device_describe(runtime, 0, &info) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    CHECK(rope_jit_device_describe(runtime, 0, nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
    rope_jit_runtime_free(runtime);

    const char* version = nullptr;
    const rope_jit_status status = rope_jit_nvrtc_version(&version);
    REQUIRE(version != nullptr);
    if (rope_jit::nvrtc_api() != nullptr) {
        CHECK(status == ROPE_JIT_OK);
        CHECK(std::string(version) == rope_jit::nvrtc_version_string());
        CHECK(std::string(version).find('.') != std::string::npos);
    } else {
        CHECK(status == ROPE_JIT_ERROR_BACKEND_UNAVAILABLE);
        CHECK(std::string(version).empty());
    }
    CHECK(rope_jit_nvrtc_version(nullptr) == ROPE_JIT_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("a project given as the cache root by mistake loses nothing to scan and remove") {
    // Issue 20, S1: files in <root>/v1 that are not the cache's were removed as strays.
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/project";
    DiskCache disk(root, {});
    REQUIRE(disk.writable());
    const std::vector<std::string> files = {root + "/v1/src/main.py",
                                            root + "/v1/README.md",
                                            root + "/v1/x/y/z/dir/f",
                                            root + "/v2/src/x.py",
                                            root + "/v1/nvrtc13.0/notes.txt",
                                            root + "/v1/nvrtc13.0/docs/a",
                                            root + "/v1/nvrtc13.0/sm_90/ab/main.c",
                                            root + "/v1/nvrtc13.0/sm_90/xy/a.cubin",
                                            root + "/v2/nvrtc12.0/sm_80/ab/readme"};
    for (const std::string& file : files) {
        make_dirs(file.substr(0, file.rfind('/')));
        write_file(file, "precious");
    }
    CHECK(rope_jit::scan_cache(disk).empty());
    for (const std::string& path : files) {
        CAPTURE(path);
        bool refused = false;
        try {
            rope_jit::remove_cache_item(disk, path, nullptr);
        } catch (const rope_jit::Error& e) {
            refused = e.status() == ROPE_JIT_ERROR_INVALID_ARGUMENT;
        }
        CHECK(refused);
        CHECK(exists(path));
    }
    for (const std::string& dir :
         {root + "/v1/src", root + "/v1/x", root + "/v2", root + "/v1/nvrtc13.0/docs"}) {
        CAPTURE(dir);
        CHECK_THROWS_AS(rope_jit::remove_cache_item(disk, dir, nullptr), rope_jit::Error);
        CHECK(exists(dir));
    }
}

TEST_CASE("a directory named like a cache file is the cache's only when empty") {
    // Adversarial pass, session 40: an entry-named directory holding a file was listed as a
    // damaged entry and pruned with what it held, and one inside another format's tree made
    // that whole tree stale, pruned too. The cache never writes such directories.
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/project";
    DiskCache disk(root, {});
    REQUIRE(disk.writable());
    const std::string key(64, 'a');
    const std::string entry_dir = root + "/v1/nvrtc13.0/sm_90/aa/" + key + ".cubin";
    const std::string set_aside_dir = entry_dir + ".bad-12-0";
    const std::string old_tree = root + "/v3";
    const std::vector<std::string> files = {entry_dir + "/sub/notes.txt",
                                            set_aside_dir + "/notes.txt",
                                            old_tree + "/nvrtc12.0/sm_80/aa/" + key + ".cubin/n"};
    for (const std::string& file : files) {
        make_dirs(file.substr(0, file.rfind('/')));
        write_file(file, "precious");
    }
    CHECK(rope_jit::scan_cache(disk).empty());
    for (const std::string& dir : {entry_dir, set_aside_dir}) {
        CAPTURE(dir);
        CHECK_THROWS_WITH_AS(rope_jit::remove_cache_item(disk, dir, nullptr),
                             doctest::Contains("is a directory named like a cache file that "
                                               "holds files the cache never writes"),
                             rope_jit::Error);
    }
    CHECK_THROWS_WITH_AS(rope_jit::remove_cache_item(disk, old_tree, nullptr),
                         doctest::Contains("is not an item of the cache layout"), rope_jit::Error);
    for (const std::string& file : files) CHECK(read_file(file) == "precious");

    // Empty, such a directory is damage in the entry's place, reported and removed.
    const std::string empty_dir = root + "/v1/nvrtc13.0/sm_90/bb/" + std::string(64, 'b') + ".ptx";
    make_dirs(empty_dir);
    const std::vector<CacheItem> items = rope_jit::scan_cache(disk);
    REQUIRE(items.size() == 1);
    CHECK(items[0].path == empty_dir);
    CHECK(items[0].state == rope_jit::CacheItemState::Damaged);
    rope_jit::remove_cache_item(disk, empty_dir, nullptr);
    CHECK_FALSE(exists(empty_dir));
    for (const std::string& file : files) CHECK(read_file(file) == "precious");
}

TEST_CASE("files named v1 or v2 in the root are not the cache's: not scanned, never removed") {
    // A file "v1" was listed as a stray, which prune then removed (after the writability
    // check had renamed it aside; adversarial test, session 32).
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/project";
    make_dirs(root);
    write_file(root + "/v1", "notes");
    write_file(root + "/v2", "more notes");
    DiskCache disk(root, {});
    CHECK_FALSE(disk.writable());
    CHECK(rope_jit::scan_cache(disk).empty());
    CHECK_THROWS_AS(rope_jit::remove_cache_item(disk, root + "/v1", nullptr), rope_jit::Error);
    CHECK(exists(root + "/v1"));
    CHECK(exists(root + "/v2"));
    // With a usable v1/ beside it, the other file is still refused, by name (a helper's review
    // found it removed through rope_jit_cache_remove).
    REQUIRE(unlink((root + "/v1").c_str()) == 0);
    REQUIRE(disk.writable());
    CHECK_THROWS_WITH_AS(rope_jit::remove_cache_item(disk, root + "/v2", nullptr),
                         doctest::Contains("only names the cache writes are removed"),
                         rope_jit::Error);
    CHECK(exists(root + "/v2"));
    REQUIRE(symlink("v2", (root + "/v3").c_str()) == 0);
    CHECK_THROWS_AS(rope_jit::remove_cache_item(disk, root + "/v3", nullptr), rope_jit::Error);
    CHECK(exists(root + "/v3"));
}

TEST_CASE("a walk that cannot open an entry for want of descriptors fails and reports no damage") {
    // The entry was reported damaged ("cannot open: Too many open files"), and prune, which
    // removes what the walk calls damaged, deleted a good kernel (adversarial test, session 35).
    ScratchDir tmp("rope_jit_maintenance");
    const std::string root = tmp.path + "/cache";
    DiskCache disk(root, {});
    const CacheEntryId id{rope_jit::sha256_hex("no descriptor"), "13.0", "sm_90", "cubin"};
    REQUIRE(disk.store(id, entry_of(small_spec())));
    const std::string path = disk.entry_path(root, id);
    const std::string bytes = read_file(path);
    rope_jit::nvrtc_api();  // loaded here, so the child has it before its filter

    // In a child, whose opens of entry files fail with EMFILE: what the walk says, one per line
    // (the errno of opening the entry there, the walk's status, the items it reported, its
    // error), or why it could not be tried.
    const ChildResult child = run_in_child([&](std::string* result) {
        rope_jit_config config;
        rope_jit_config_init(&config);
        config.backend = ROPE_JIT_BACKEND_CPU;
        config.cache_dir = root.c_str();
        rope_jit_runtime* runtime = nullptr;
        if (rope_jit_runtime_create(&config, &runtime) != ROPE_JIT_OK) {
            *result = "error: cannot create a runtime";
        } else if (!fail_entry_opens_with_emfile()) {
            *result = "skip";
        } else {
            const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
            const int open_error = fd < 0 ? errno : 0;
            size_t items = 0;
            auto count = [](const rope_jit_cache_item*, void* user) -> int {
                ++*static_cast<size_t*>(user);
                return 0;
            };
            const rope_jit_status status = rope_jit_cache_walk(runtime, count, &items);
            *result = std::to_string(open_error) + "\n" + std::to_string(int(status)) + "\n" +
                      std::to_string(items) + "\n" + rope_jit_last_error();
        }
        return 0;
    });
    const std::string& result = child.output;
    CAPTURE(child.wait_status);
    REQUIRE(child.exited_with(0));
    if (result == "skip") {
        MESSAGE("skipped: no seccomp filter can be installed here");
        return;
    }
    CAPTURE(result);
    std::istringstream lines(result);
    int open_error = -1, status = -1;
    size_t items = 1;
    std::string message;
    lines >> open_error >> status >> items;
    std::getline(lines >> std::ws, message);
    REQUIRE(open_error == EMFILE);  // the filter took
    CHECK(status == ROPE_JIT_ERROR_CACHE);
    CHECK(items == 0);
    CHECK(message.find("'" + path + "': cannot open it now") != std::string::npos);
    CHECK(message.find("the walk of the cache stopped there, nothing was changed") !=
          std::string::npos);

    // The entry is as it was, and a walk with descriptors to spare finds no damage in it.
    CHECK(read_file(path) == bytes);
    const auto after = scan_by_path(disk);
    REQUIRE(after.count(path) == 1);
    CHECK(after.at(path).state != CacheItemState::Damaged);
    CHECK(after.at(path).problem.find("open") == std::string::npos);
}

TEST_SUITE_END();
