// The NVRTC identity memo (src/jit/nvrtc_identity.*): written after a real load with what the
// library reports, trusted only while the selection fingerprint and the library file are
// unchanged, refused quietly when damaged, never an error when it cannot be written, invisible
// to cache maintenance, and (in a child process) serving a warm process without loading NVRTC.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/cache_maintenance.h"
#include "cache/disk_cache.h"
#include "common/error.h"
#include "env_guard.h"
#include "jit/kernel_builder.h"
#include "jit/nvrtc_identity.h"
#include "jit/nvrtc_loader.h"
#include "ops/rope/kernel_spec.h"
#include "rope_jit/rope_jit.h"
#include "scratch_files.h"

extern char** environ;

using rope_jit::FileIdentity;
using rope_jit::NvrtcIdentity;
using rope_jit::NvrtcMemo;

namespace {

std::string memo_path(const std::string& root) {
    return root + "/" + rope_jit::kNvrtcMemoFileName;
}

const FileIdentity kLibraryFile{2049, 4242, 109338064, 1792100186000000000};

NvrtcMemo sample_memo() {
    NvrtcMemo memo;
    memo.library_path = "/opt/cuda/lib64/libnvrtc.so.13";
    memo.library_file = kLibraryFile;
    memo.selection = {"env LD_LIBRARY_PATH=/opt/cuda/lib64", "search libnvrtc.so.13"};
    memo.identity = NvrtcIdentity{"13.0", {75, 80, 90, 100, 120}};
    return memo;
}

// A stat function that knows one file.
rope_jit::FileIdentityLookup knows(const std::string& path, const FileIdentity& id) {
    return [path, id](const std::string& asked) -> std::optional<FileIdentity> {
        if (asked == path) return id;
        return std::nullopt;
    };
}

std::string refusal(std::string_view text, const std::vector<std::string>& selection,
                    const rope_jit::FileIdentityLookup& identify) {
    std::string why = "unset";
    const std::optional<NvrtcIdentity> accepted =
        rope_jit::accept_nvrtc_memo(text, selection, identify, &why);
    return accepted ? std::string() : why;
}

bool nvrtc_mapped() {
    return read_file("/proc/self/maps").find("libnvrtc.so") != std::string::npos;
}

const char* const kChildTest = "the NVRTC identity memo child process";

// A RoPE spec whose key both processes compute.
std::string child_spec_json() {
    rope_jit_kernel_spec spec;
    rope_jit_kernel_spec_init(&spec);
    spec.head_dim = 64;
    return rope_jit::kernel_spec_from_public(spec).to_json();
}

// Runs this test binary's kChildTest in a fresh process with `env` added, its output going to
// `log_path`; whether it ran that one test and passed.
bool run_child(const std::map<std::string, std::string>& env, const std::string& log_path) {
    std::vector<std::string> variables;
    for (char** entry = environ; *entry != nullptr; ++entry) {
        const std::string variable = *entry;
        if (env.count(variable.substr(0, variable.find('='))) == 0) variables.push_back(variable);
    }
    for (const auto& [name, value] : env) variables.push_back(name + "=" + value);
    std::vector<char*> envp;
    for (std::string& variable : variables) envp.push_back(variable.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    std::string no_skip = "--no-skip";
    std::string filter = std::string("--test-case=") + kChildTest;
    std::vector<char*> argv = {exe.data(), no_skip.data(), filter.data(), nullptr};

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0600);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = 0;
    const int spawned = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    REQUIRE(spawned == 0);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    // The count guards against a filter that matches nothing, which doctest also calls a pass.
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
           read_file(log_path).find("test cases: 1 | 1 passed") != std::string::npos;
}

}  // namespace

TEST_SUITE_BEGIN("nvrtc_identity");

TEST_CASE("a memo reads back as written while its fingerprint and library file are unchanged") {
    const NvrtcMemo memo = sample_memo();
    const std::string text = rope_jit::serialize_nvrtc_memo(memo);
    const auto identify = knows(memo.library_path, kLibraryFile);
    std::string why = "unset";
    const std::optional<NvrtcIdentity> accepted =
        rope_jit::accept_nvrtc_memo(text, memo.selection, identify, &why);
    REQUIRE(accepted.has_value());
    CHECK(accepted->version == "13.0");
    CHECK(accepted->archs == std::vector<int>{75, 80, 90, 100, 120});
    CHECK(why.empty());

    // Each input of the decision, changed alone, refuses the memo.
    std::vector<std::string> other_selection = memo.selection;
    other_selection[0] = "env LD_LIBRARY_PATH=/elsewhere";
    CHECK(refusal(text, other_selection, identify).find("selection") != std::string::npos);
    CHECK_FALSE(refusal(text, {}, identify).empty());
    FileIdentity touched = kLibraryFile;
    touched.mtime_ns += 1;
    CHECK(refusal(text, memo.selection, knows(memo.library_path, touched)).find("not the file") !=
          std::string::npos);
    FileIdentity resized = kLibraryFile;
    resized.size -= 1;
    CHECK_FALSE(refusal(text, memo.selection, knows(memo.library_path, resized)).empty());
    FileIdentity replaced = kLibraryFile;
    replaced.inode += 1;
    CHECK_FALSE(refusal(text, memo.selection, knows(memo.library_path, replaced)).empty());
    CHECK_FALSE(refusal(text, memo.selection, knows("/somewhere/else.so", kLibraryFile)).empty());
}

TEST_CASE("a damaged, truncated or malformed memo is refused without an error") {
    const NvrtcMemo memo = sample_memo();
    const std::string text = rope_jit::serialize_nvrtc_memo(memo);
    const auto identify = knows(memo.library_path, kLibraryFile);
    // Every proper prefix: what a crash between write and rename could leave (no fsync).
    for (size_t length = 0; length + 1 < text.size(); ++length) {
        CAPTURE(length);
        CHECK_FALSE(refusal(std::string_view(text).substr(0, length), memo.selection, identify)
                        .empty());
    }
    auto with = [&](const char* field, const nlohmann::json& value) {
        nlohmann::json document = nlohmann::json::parse(text);
        if (value.is_null())
            document.erase(field);
        else
            document[field] = value;
        return document.dump();
    };
    const std::map<std::string, std::string> malformed = {
        {"not JSON", "\x01\xff garbage"},
        {"an array", "[1,2,3]"},
        {"another format", with("format", 2)},
        {"no format", with("format", nullptr)},
        {"no version", with("version", nullptr)},
        {"a number as version", with("version", 13)},
        {"a version that is a path", with("version", "../13.0")},
        {"a version without minor", with("version", "13")},
        {"no architectures", with("archs", nlohmann::json::array())},
        {"unsorted architectures", with("archs", {90, 80})},
        {"architectures as text", with("archs", "75,80")},
        {"a library without identity", with("library", {{"path", memo.library_path}})},
        {"a selection of numbers", with("selection", {1, 2})},
    };
    for (const auto& item : malformed) {
        CAPTURE(item.first);
        CHECK_FALSE(refusal(item.second, memo.selection, identify).empty());
    }
}

TEST_CASE("the selection fingerprint follows the environment, ld.so.cache and search dirs") {
    std::map<std::string, std::string> values = {{"LD_LIBRARY_PATH", "/a:/b;/a"},
                                                 {"CUDA_HOME", "/cuda"}};
    const rope_jit::EnvLookup env = [&](const char* name) {
        const auto found = values.find(name);
        return found == values.end() ? std::string() : found->second;
    };
    std::map<std::string, FileIdentity> files = {{"/etc/ld.so.cache", {1, 2, 3, 4}},
                                                 {"/a", {1, 10, 4096, 5}},
                                                 {"/cuda/lib64/", {1, 11, 4096, 6}}};
    const rope_jit::FileIdentityLookup identify =
        [&](const std::string& path) -> std::optional<FileIdentity> {
        const auto found = files.find(path);
        if (found == files.end()) return std::nullopt;
        return found->second;
    };
    const std::vector<std::string> order = {"libnvrtc.so.13", "/cuda/lib64/libnvrtc.so.13",
                                            "/cuda/lib64/libnvrtc.so"};
    const std::vector<std::string> lines =
        rope_jit::nvrtc_selection_fingerprint(order, env, identify);
    const std::vector<std::string> expected = {
        "env ROPE_JIT_NVRTC_LIBRARY=",
        "env LD_LIBRARY_PATH=/a:/b;/a",
        "env CUDA_HOME=/cuda",
        "env CUDA_PATH=",
        "file /etc/ld.so.cache dev=1 ino=2 size=3 mtime_ns=4",
        "search libnvrtc.so.13",
        "search /cuda/lib64/libnvrtc.so.13",
        "search /cuda/lib64/libnvrtc.so",
        "dir /a dev=1 ino=10 size=4096 mtime_ns=5",
        "dir /b missing",
        "dir /cuda/lib64/ dev=1 ino=11 size=4096 mtime_ns=6",
    };
    CHECK(lines == expected);

    // A library dropped into a searched directory changes its mtime; ldconfig rewrites its
    // cache; a forced library is an environment variable.
    files["/cuda/lib64/"].mtime_ns = 7;
    CHECK(rope_jit::nvrtc_selection_fingerprint(order, env, identify) != lines);
    files["/cuda/lib64/"].mtime_ns = 6;
    files["/etc/ld.so.cache"].size = 99;
    CHECK(rope_jit::nvrtc_selection_fingerprint(order, env, identify) != lines);
    files["/etc/ld.so.cache"].size = 3;
    values["ROPE_JIT_NVRTC_LIBRARY"] = "/cuda/lib64/libnvrtc.so.13";
    CHECK(rope_jit::nvrtc_selection_fingerprint(order, env, identify) != lines);
    values.erase("ROPE_JIT_NVRTC_LIBRARY");
    CHECK(rope_jit::nvrtc_selection_fingerprint(order, env, identify) == lines);
}

TEST_CASE("memo files: written atomically, read only when trusted, never an error") {
    ScratchDir tmp("rope_jit_nvrtc_memo");
    const std::string root = tmp.path + "/cache";
    const NvrtcMemo memo = sample_memo();
    // A root that does not exist is not made (a process whose runtimes use their own
    // cache_dir keeps the default place untouched); one that a runtime made is written.
    CHECK_FALSE(rope_jit::write_nvrtc_memo(root, memo));
    CHECK_FALSE(exists(root));
    REQUIRE(mkdir(root.c_str(), 0700) == 0);
    REQUIRE(rope_jit::write_nvrtc_memo(root, memo));
    const std::optional<std::string> text = rope_jit::read_nvrtc_memo(root);
    REQUIRE(text.has_value());
    CHECK(*text == rope_jit::serialize_nvrtc_memo(memo));
    struct stat st;
    REQUIRE(stat(memo_path(root).c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    for (const std::string& name : rope_jit::sorted_names(root))
        CHECK(name.find(".tmp-") == std::string::npos);  // the temp file was renamed

    SUBCASE("no root, or one that cannot be made: false, and nothing read") {
        CHECK_FALSE(rope_jit::write_nvrtc_memo("", memo));
        CHECK_FALSE(rope_jit::read_nvrtc_memo("").has_value());
        write_file(tmp.path + "/file", "x");
        CHECK_FALSE(rope_jit::write_nvrtc_memo(tmp.path + "/file/cache", memo));
        CHECK_FALSE(rope_jit::read_nvrtc_memo(tmp.path + "/file/cache").has_value());
        CHECK_FALSE(rope_jit::read_nvrtc_memo(tmp.path + "/missing").has_value());
    }
    SUBCASE("a read-only root: false, the old memo stays") {
        if (geteuid() == 0) {
            MESSAGE("skipped: root ignores permissions");
            return;
        }
        REQUIRE(chmod(root.c_str(), 0500) == 0);
        NvrtcMemo other = memo;
        other.identity.version = "12.8";
        CHECK_FALSE(rope_jit::write_nvrtc_memo(root, other));
        CHECK(rope_jit::read_nvrtc_memo(root) == text);
    }
    SUBCASE("a root others can write is neither read nor written") {
        REQUIRE(chmod(root.c_str(), 0777) == 0);
        CHECK_FALSE(rope_jit::read_nvrtc_memo(root).has_value());
        CHECK_FALSE(rope_jit::write_nvrtc_memo(root, memo));
    }
    SUBCASE("a memo others can write, a link, a directory or a huge file is not read") {
        REQUIRE(chmod(memo_path(root).c_str(), 0666) == 0);
        CHECK_FALSE(rope_jit::read_nvrtc_memo(root).has_value());
        REQUIRE(chmod(memo_path(root).c_str(), 0600) == 0);
        REQUIRE(rename(memo_path(root).c_str(), (root + "/real.json").c_str()) == 0);
        REQUIRE(symlink("real.json", memo_path(root).c_str()) == 0);
        CHECK_FALSE(rope_jit::read_nvrtc_memo(root).has_value());
        REQUIRE(unlink(memo_path(root).c_str()) == 0);
        REQUIRE(mkdir(memo_path(root).c_str(), 0700) == 0);
        CHECK_FALSE(rope_jit::read_nvrtc_memo(root).has_value());
        REQUIRE(rmdir(memo_path(root).c_str()) == 0);
        write_file(memo_path(root), std::string(1 << 20, ' '));
        CHECK_FALSE(rope_jit::read_nvrtc_memo(root).has_value());
    }
    SUBCASE("a FIFO in its place is not read, and does not block the reader") {
        // Opened without O_NONBLOCK it hung every process that asked for NVRTC's identity
        // (adversarial test, session 32); a writer replaces it.
        REQUIRE(unlink(memo_path(root).c_str()) == 0);
        REQUIRE(mkfifo(memo_path(root).c_str(), 0600) == 0);
        CHECK_FALSE(rope_jit::read_nvrtc_memo(root).has_value());
        CHECK(rope_jit::write_nvrtc_memo(root, memo));
        CHECK(rope_jit::read_nvrtc_memo(root) == text);
    }
    SUBCASE("a truncated memo file is read, and refused by the check") {
        write_file(memo_path(root), text->substr(0, text->size() / 2));
        const std::optional<std::string> half = rope_jit::read_nvrtc_memo(root);
        REQUIRE(half.has_value());
        CHECK_FALSE(refusal(*half, memo.selection, knows(memo.library_path, kLibraryFile)).empty());
    }
}

TEST_CASE("after a real load the memo holds what NVRTC reports, for this environment only") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    ScratchDir tmp("rope_jit_nvrtc_memo");
    EnvGuard env;
    env.set("ROPE_JIT_CACHE_DIR", tmp.path.c_str());
    const std::string root = rope_jit::DiskCache::default_root();
    REQUIRE(root == tmp.path);
    CHECK_FALSE(rope_jit::nvrtc_identity_from_memo(root).has_value());
    REQUIRE(rope_jit::nvrtc_remember_identity(root));

    // The file, read independently of the memo code.
    const nlohmann::json document = nlohmann::json::parse(read_file(memo_path(root)));
    CHECK(document["version"] == rope_jit::nvrtc_version_string());
    CHECK(document["archs"].get<std::vector<int>>() == rope_jit::nvrtc_supported_archs());
    CHECK(document["library"]["path"] == rope_jit::nvrtc_library_path());
    struct stat library;
    REQUIRE(stat(rope_jit::nvrtc_library_path().c_str(), &library) == 0);
    CHECK(document["library"]["inode"] == uint64_t(library.st_ino));
    CHECK(document["library"]["size"] == uint64_t(library.st_size));

    // The reader a fresh process uses gives the same values.
    const std::optional<NvrtcIdentity> read = rope_jit::nvrtc_identity_from_memo(root);
    REQUIRE(read.has_value());
    CHECK(read->version == rope_jit::nvrtc_version_string());
    CHECK(read->archs == rope_jit::nvrtc_supported_archs());

    // An equal memo is not rewritten (the rename would give the file a new inode).
    struct stat before, after;
    REQUIRE(stat(memo_path(root).c_str(), &before) == 0);
    REQUIRE(rope_jit::nvrtc_remember_identity(root));
    REQUIRE(stat(memo_path(root).c_str(), &after) == 0);
    CHECK(before.st_ino == after.st_ino);

    // Another environment could pick another library: the memo does not serve it, and a load
    // there writes one for it.
    const char* set = std::getenv("LD_LIBRARY_PATH");
    const std::optional<std::string> old_path =
        set ? std::optional<std::string>(set) : std::nullopt;
    env.set("LD_LIBRARY_PATH", (old_path.value_or("") + ":/nonexistent").c_str());
    CHECK_FALSE(rope_jit::nvrtc_identity_from_memo(root).has_value());
    env.set("LD_LIBRARY_PATH", old_path ? old_path->c_str() : nullptr);
    REQUIRE(rope_jit::nvrtc_identity_from_memo(root).has_value());
    env.set("ROPE_JIT_NVRTC_LIBRARY", rope_jit::nvrtc_library_path().c_str());
    CHECK_FALSE(rope_jit::nvrtc_identity_from_memo(root).has_value());
    REQUIRE(rope_jit::nvrtc_remember_identity(root));
    CHECK(rope_jit::nvrtc_identity_from_memo(root) == read);
    env.set("ROPE_JIT_NVRTC_LIBRARY", nullptr);
    CHECK_FALSE(rope_jit::nvrtc_identity_from_memo(root).has_value());
}

TEST_CASE("cache maintenance leaves the memo alone: not listed, not verified, not removed") {
    ScratchDir tmp("rope_jit_nvrtc_memo");
    const rope_jit::DiskCache disk(tmp.path, {});
    const rope_jit::CacheEntryId id{std::string(64, 'a'), "13.0", "sm_90", "cubin"};
    REQUIRE(disk.store(id, rope_jit::CacheEntry{"{}", std::vector<char>(100, 'x')}));
    REQUIRE(rope_jit::write_nvrtc_memo(tmp.path, sample_memo()));

    for (const rope_jit::DiskCache::EntryReport& report : disk.verify(tmp.path))
        CHECK(report.path != memo_path(tmp.path));
    const std::vector<rope_jit::CacheItem> items = rope_jit::scan_cache(disk);
    REQUIRE(items.size() == 1);  // the entry alone
    CHECK(items[0].path == disk.entry_path(tmp.path, id));
    // What `rope-jit-cache clear` does: remove every item scan reports.
    for (const rope_jit::CacheItem& item : items)
        rope_jit::remove_cache_item(disk, item.path, nullptr);
    CHECK(rope_jit::scan_cache(disk).empty());
    CHECK(exists(memo_path(tmp.path)));
    CHECK_THROWS_AS(rope_jit::remove_cache_item(disk, memo_path(tmp.path), nullptr),
                    rope_jit::Error);
    CHECK(exists(memo_path(tmp.path)));
}

TEST_CASE("a fresh process with a valid memo computes keys without loading NVRTC") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    ScratchDir tmp("rope_jit_nvrtc_memo");
    const std::string root = tmp.path + "/cache";
    REQUIRE(mkdir(root.c_str(), 0700) == 0);  // the default root, as a runtime makes it
    std::map<std::string, std::string> env = {
        {"ROPE_JIT_CACHE_DIR", root},
        {"ROPE_JIT_TEST_MEMO_VERSION", rope_jit::nvrtc_version_string()},
        {"ROPE_JIT_TEST_MEMO_KEY",
         rope_jit::plan_compile(child_spec_json(), "sm_90").entry.key_hex}};
    // No memo yet: the child loads NVRTC, which writes the memo.
    auto child = [&](const char* expect, const std::string& name) {
        env["ROPE_JIT_TEST_MEMO_EXPECT"] = expect;
        const std::string log = tmp.path + "/" + name + ".log";
        const bool passed = run_child(env, log);
        INFO(name << " child (" << expect << "):\n" << read_file(log));
        CHECK(passed);
    };
    child("loaded", "first");  // no memo yet: it loads NVRTC, which writes the memo
    REQUIRE(exists(memo_path(root)));
    // The memo serves the next one: same version, same key, no libnvrtc in its address space.
    child("served", "second");
    // A memo that no longer matches (another LD_LIBRARY_PATH) does not serve.
    const char* library_path = std::getenv("LD_LIBRARY_PATH");
    env["LD_LIBRARY_PATH"] = std::string(library_path ? library_path : "") + ":/nonexistent";
    child("loaded", "third");
}

TEST_CASE("a memo that disagrees with the library it names yields to it, and no kernel is "
          "stored under the memo's version") {
    if (rope_jit::nvrtc_api() == nullptr) {
        MESSAGE("skipped: NVRTC not available: " << rope_jit::nvrtc_load_error());
        return;
    }
    ScratchDir tmp("rope_jit_nvrtc_memo");
    const std::string root = tmp.path + "/cache";
    REQUIRE(mkdir(root.c_str(), 0700) == 0);  // the default root, as a runtime makes it
    {
        EnvGuard guard;
        guard.set("ROPE_JIT_CACHE_DIR", root.c_str());
        REQUIRE(rope_jit::nvrtc_remember_identity(root));
    }
    // A hand-edited memo: the same library file and environment, another version.
    nlohmann::json document = nlohmann::json::parse(read_file(memo_path(root)));
    REQUIRE(document["version"] != "12.9");
    document["version"] = "12.9";
    write_file(memo_path(root), document.dump());
    std::map<std::string, std::string> env = {
        {"ROPE_JIT_CACHE_DIR", root},
        {"ROPE_JIT_TEST_MEMO_EXPECT", "disagree"},
        {"ROPE_JIT_TEST_MEMO_VERSION", rope_jit::nvrtc_version_string()},
        {"ROPE_JIT_TEST_MEMO_KEY",
         rope_jit::plan_compile(child_spec_json(), "sm_90").entry.key_hex}};
    const std::string log = tmp.path + "/child.log";
    const bool passed = run_child(env, log);
    INFO("child:\n" << read_file(log));
    CHECK(passed);
    CHECK(read_file(log).find("the NVRTC identity memo") != std::string::npos);  // the warning
    CHECK_FALSE(exists(root + "/v1/nvrtc12.9"));
    CHECK(exists(root + "/v1/nvrtc" + rope_jit::nvrtc_version_string()));
    EnvGuard guard;
    guard.set("ROPE_JIT_CACHE_DIR", root.c_str());
    const std::optional<NvrtcIdentity> rewritten = rope_jit::nvrtc_identity_from_memo(root);
    REQUIRE(rewritten.has_value());
    CHECK(rewritten->version == rope_jit::nvrtc_version_string());
}

// Run only by the two tests above, in a fresh process (--no-skip): the warm path's calls, then
// a look at whether libnvrtc was mapped.
TEST_CASE(kChildTest * doctest::skip()) {
    const char* expect = std::getenv("ROPE_JIT_TEST_MEMO_EXPECT");
    REQUIRE(expect != nullptr);
    REQUIRE_FALSE(nvrtc_mapped());
    if (std::string(expect) == "disagree") {
        // The memo's version serves the keys until a miss needs the library.
        CHECK(rope_jit::nvrtc_version_string() == "12.9");
        const std::string real = std::getenv("ROPE_JIT_TEST_MEMO_VERSION");
        rope_jit::KernelRecipe recipe;
        recipe.spec_json = "{\"op\":\"memo-test\"}";
        recipe.template_name = "memo_test.cu";
        recipe.entry = "memo_test";
        recipe.source = [] { return std::string("extern \"C\" __global__ void memo_test() {}\n"); };
        const rope_jit::DiskCache disk(std::getenv("ROPE_JIT_CACHE_DIR"), {});
        rope_jit::KernelStats stats;
        const rope_jit::KernelBinary binary =
            rope_jit::build_kernel_binary(recipe, "sm_90", &disk, stats);
        CHECK(binary.compiled);
        CHECK(nvrtc_mapped());
        CHECK(rope_jit::nvrtc_version_string() == real);
        CHECK(rope_jit::plan_compile(child_spec_json(), "sm_90").entry.key_hex ==
              std::string(std::getenv("ROPE_JIT_TEST_MEMO_KEY")));
        // Stored under the key the real library gives, so the next process finds it.
        CHECK(disk.load(rope_jit::plan_compile(recipe.spec_json, "sm_90").entry).has_value());
        CHECK(stats.disk_writes.load() == 1);
        return;
    }
    const rope_jit::CompilePlan plan = rope_jit::plan_compile(child_spec_json(), "sm_90");
    const char* version = nullptr;
    REQUIRE(rope_jit_nvrtc_version(&version) == ROPE_JIT_OK);
    CHECK(std::string(version) == std::getenv("ROPE_JIT_TEST_MEMO_VERSION"));
    CHECK(plan.entry.key_hex == std::string(std::getenv("ROPE_JIT_TEST_MEMO_KEY")));
    CHECK(nvrtc_mapped() == (std::string(expect) == "loaded"));
    // The look at the maps sees a load.
    REQUIRE(rope_jit::nvrtc_api() != nullptr);
    CHECK(nvrtc_mapped());
}

TEST_SUITE_END();
