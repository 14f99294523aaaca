// What rope-jit-cache shows people: sizes, ages and durations in a few characters, the sizes
// and durations they type (--max-bytes 2G, --older-than 30d), and a progress bar that only
// appears on a terminal.
#pragma once

#include <cstdint>
#include <string>

namespace rope_jit_cache {

// `text` with every control character (bytes below 0x20, and 0x7f) written as an escape:
// \n, \r, \t, else \xNN. File names may hold any byte but '/' and NUL; printed raw, an
// escape sequence in one could rewrite the terminal or forge lines of the report.
std::string printable(const std::string& text);

// "512 B", "21.3 KiB", "1.2 GiB".
std::string format_bytes(uint64_t bytes);

// An age in the largest whole unit: "45s", "12m", "3h", "20d".
std::string format_age(int64_t seconds);

// "142 ms", "3.21 s".
std::string format_ms(double milliseconds);

// "1048576", "500K", "20M", "2G", "1T" (powers of 1024; an optional trailing "B" or "iB"):
// common/byte_size.h, the parser $ROPE_JIT_CACHE_MAX_BYTES is read with.
// Throws UsageError naming `option` for anything else.
uint64_t parse_bytes(const std::string& text, const std::string& option);

// "3600", "45s", "90m", "12h", "30d", "2w" in seconds. Throws UsageError naming `option`.
int64_t parse_duration(const std::string& text, const std::string& option);

// A one-line bar on stderr, redrawn in place, when stderr is a terminal (and not disabled);
// otherwise every call does nothing. Lines printed to stdout go through print_line so the
// bar never tears them when both share the terminal.
class ProgressBar {
public:
    ProgressBar(size_t total, bool allowed);
    ~ProgressBar();
    ProgressBar(const ProgressBar&) = delete;
    ProgressBar& operator=(const ProgressBar&) = delete;

    // Redraws the bar: `done` of total, followed by `status` ("3 compiled, 1 cached").
    void update(size_t done, const std::string& status);
    // Prints `line` and a newline on stdout, the bar cleared first and redrawn after.
    void print_line(const std::string& line);
    // Erases the bar for good (the destructor does too).
    void finish();

private:
    void draw();
    void erase();

    size_t total_;
    bool enabled_;
    bool shares_terminal_;  // stdout is a terminal too
    size_t done_ = 0;
    std::string status_;
};

}  // namespace rope_jit_cache
