#include "cli_output.h"

#include <unistd.h>

#include <cctype>
#include <cstdint>
#include <cstdio>

#include <fmt/format.h>

#include "common/byte_size.h"
#include "kernel_spec_sets.h"

namespace rope_jit_cache {

std::string printable(const std::string& text) {
    std::string out;
    out.reserve(text.size());
    for (const char c : text) {
        const unsigned char byte = static_cast<unsigned char>(c);
        if (byte >= 0x20 && byte != 0x7f) {
            out += c;
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c == '\t') {
            out += "\\t";
        } else {
            out += fmt::format("\\x{:02x}", unsigned(byte));
        }
    }
    return out;
}

std::string format_bytes(uint64_t bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    if (bytes < 1024) return fmt::format("{} B", bytes);
    double value = double(bytes);
    int unit = 0;
    while (value >= 1024.0 && unit < 4) {
        value /= 1024.0;
        ++unit;
    }
    return fmt::format("{:.1f} {}", value, units[unit]);
}

std::string format_age(int64_t seconds) {
    if (seconds < 0) seconds = 0;
    if (seconds < 120) return fmt::format("{}s", seconds);
    if (seconds < 2 * 3600) return fmt::format("{}m", seconds / 60);
    if (seconds < 2 * 86400) return fmt::format("{}h", seconds / 3600);
    return fmt::format("{}d", seconds / 86400);
}

std::string format_ms(double milliseconds) {
    if (milliseconds < 1000.0) return fmt::format("{:.0f} ms", milliseconds);
    return fmt::format("{:.2f} s", milliseconds / 1000.0);
}

namespace {

// Splits "20M" into 20 and "M"; throws when there is no leading number.
std::pair<uint64_t, std::string> number_and_unit(const std::string& text,
                                                 const std::string& option) {
    size_t digits = 0;
    while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
    if (digits == 0 || digits > 15)
        throw UsageError(
            fmt::format("{}: '{}' is not a number with an optional unit", option, text));
    return {std::stoull(text.substr(0, digits)), text.substr(digits)};
}

}  // namespace

uint64_t parse_bytes(const std::string& text, const std::string& option) {
    const rope_jit::ByteSize size = rope_jit::parse_byte_size(text);
    switch (size.status) {
        case rope_jit::ByteSize::Status::ok:
            return size.bytes;
        case rope_jit::ByteSize::Status::not_a_number:
            throw UsageError(
                fmt::format("{}: '{}' is not a number with an optional unit", option, text));
        case rope_jit::ByteSize::Status::unknown_unit:
            throw UsageError(
                fmt::format("{}: unknown unit in '{}' (use B, K, M, G or T)", option, text));
        case rope_jit::ByteSize::Status::too_large:
            // A size past 64 bits would wrap to a tiny budget, and prune would then remove
            // everything.
            break;
    }
    throw UsageError(fmt::format("{}: '{}' is too large (over 2^64 - 1 bytes)", option, text));
}

int64_t parse_duration(const std::string& text, const std::string& option) {
    auto [number, unit] = number_and_unit(text, option);
    int64_t scale = 0;
    if (unit.empty() || unit == "s")
        scale = 1;
    else if (unit == "m")
        scale = 60;
    else if (unit == "h")
        scale = 3600;
    else if (unit == "d")
        scale = 86400;
    else if (unit == "w")
        scale = 7 * 86400;
    else
        throw UsageError(
            fmt::format("{}: unknown unit in '{}' (use s, m, h, d or w)", option, text));
    // An overflowing product would wrap to a short age, and prune would then remove everything.
    if (number > uint64_t(INT64_MAX / scale))
        throw UsageError(fmt::format("{}: '{}' is too large", option, text));
    return int64_t(number) * scale;
}

ProgressBar::ProgressBar(size_t total, bool allowed)
    : total_(total),
      enabled_(allowed && isatty(STDERR_FILENO)),
      shares_terminal_(isatty(STDOUT_FILENO)) {}

ProgressBar::~ProgressBar() {
    finish();
}

void ProgressBar::update(size_t done, const std::string& status) {
    done_ = done;
    status_ = status;
    if (enabled_) draw();
}

void ProgressBar::print_line(const std::string& line) {
    if (enabled_ && shares_terminal_) erase();
    std::fprintf(stdout, "%s\n", line.c_str());
    std::fflush(stdout);
    if (enabled_) draw();
}

void ProgressBar::finish() {
    if (enabled_) erase();
    enabled_ = false;
}

void ProgressBar::draw() {
    constexpr size_t kWidth = 30;
    const size_t filled = total_ == 0 ? kWidth : kWidth * done_ / total_;
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    std::fprintf(stderr, "\r\033[K[%s] %zu/%zu %s", bar.c_str(), done_, total_, status_.c_str());
    std::fflush(stderr);
}

void ProgressBar::erase() {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
}

}  // namespace rope_jit_cache
