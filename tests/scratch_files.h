// Test support: a scratch directory removed with everything in it (permissions restored first,
// so tests may make parts of it read-only), whole-file reads and writes, and a CPU runtime
// whose disk cache lives in one.
#pragma once

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <doctest/doctest.h>

#include "rope_jit/rope_jit.h"

struct ScratchDir {
    // prefix: the directory's name before mkdtemp's six random characters.
    explicit ScratchDir(const std::string& prefix) {
        std::string pattern = "/tmp/" + prefix + "_XXXXXX";
        const char* made = mkdtemp(pattern.data());
        REQUIRE(made != nullptr);
        path = made;
    }
    ~ScratchDir() {
        if (std::system(("chmod -R u+rwx '" + path + "' 2>/dev/null; rm -rf '" + path + "'")
                            .c_str()) != 0)
            MESSAGE("could not remove " << path);
    }
    ScratchDir(const ScratchDir&) = delete;
    ScratchDir& operator=(const ScratchDir&) = delete;
    std::string path;
};

inline std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_file(const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), std::streamsize(bytes.size()));
    REQUIRE(out.good());
}

// Whether anything (a link included, not followed) is at path.
inline bool exists(const std::string& path) {
    struct stat st;
    return lstat(path.c_str(), &st) == 0;
}

// A CPU runtime whose disk cache root is `root` (created by the first call that needs it); free
// it with rope_jit_runtime_free.
inline rope_jit_runtime* cpu_runtime_caching_in(const std::string& root) {
    rope_jit_config config;
    rope_jit_config_init(&config);
    config.backend = ROPE_JIT_BACKEND_CPU;
    config.cache_dir = root.c_str();
    rope_jit_runtime* runtime = nullptr;
    REQUIRE(rope_jit_runtime_create(&config, &runtime) == ROPE_JIT_OK);
    return runtime;
}
