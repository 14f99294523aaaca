#include "common/bounded_json.h"

#include <algorithm>
#include <cstddef>
#include <set>
#include <string>
#include <vector>

namespace rope_jit {

int json_nesting_depth(std::string_view text, int limit) {
    int depth = 0, deepest = 0;
    bool in_string = false, escaped = false;
    for (const char c : text) {
        if (in_string) {
            if (escaped)
                escaped = false;
            else if (c == '\\')
                escaped = true;
            else if (c == '"')
                in_string = false;
            continue;
        }
        if (c == '"')
            in_string = true;
        else if (c == '[' || c == '{')
            deepest = std::max(deepest, ++depth);
        else if (c == ']' || c == '}')
            --depth;
        if (deepest > limit) break;
    }
    return deepest;
}

std::string escaped_json_text(const std::string& text) {
    const std::string quoted =
        nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return quoted.substr(1, quoted.size() - 2);
}

namespace {

// A SAX handler that builds nothing and notes the first key given twice in one object.
// nlohmann keeps the last value of a repeated key, so {"head_dim": 128, "head_dim": 64} passed
// as D64 without a word (adversarial pass, session 38): such a document is refused, as a field
// that cannot be read one way. A pass of its own, not a parse callback: nlohmann's callback
// parser rescans the enclosing array at every object's end, and a 240 KB manifest of "{}"s
// took a second, 5 MB minutes (session 45).
class DuplicateKeyFinder {
  public:
    using json = nlohmann::json;
    bool null() { return true; }
    bool boolean(bool) { return true; }
    bool number_integer(json::number_integer_t) { return true; }
    bool number_unsigned(json::number_unsigned_t) { return true; }
    bool number_float(json::number_float_t, const json::string_t&) { return true; }
    bool string(json::string_t&) { return true; }
    bool binary(json::binary_t&) { return true; }
    bool start_object(std::size_t) {
        open_objects_.emplace_back();
        return true;
    }
    bool key(json::string_t& key) {
        if (!found_ && !open_objects_.back().insert(key).second) {
            duplicate_ = key;
            found_ = true;
        }
        return true;
    }
    bool end_object() {
        open_objects_.pop_back();
        return true;
    }
    bool start_array(std::size_t) { return true; }
    bool end_array() { return true; }
    bool parse_error(std::size_t byte, const std::string&,
                     const nlohmann::detail::exception& error) {
        error_ = parse_error_text(byte, error.what());
        return false;
    }

    bool found() const { return found_; }
    const std::string& duplicate() const { return duplicate_; }
    // Where and why the text is not JSON (set when sax_parse returned false).
    const std::string& error() const { return error_; }

  private:
    // nlohmann's message without its "[json.exception.parse_error.101] " tag, in ASCII (the
    // token it quotes may hold any byte), with the byte where the parse stopped: "number
    // overflow parsing '1e400'" says no place (a manifest's 1e400 was only "not valid JSON";
    // adversarial pass, session 49).
    static std::string parse_error_text(std::size_t byte, const std::string& what) {
        const std::size_t tag_end = what.rfind("] ", what.find(' '));
        std::string text = tag_end == std::string::npos ? what : what.substr(tag_end + 2);
        for (char& c : text)
            if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f)
                c = '?';
        if (text.find("line ") == std::string::npos)
            text += " (at byte " + std::to_string(byte) + ")";
        return text;
    }

    std::vector<std::set<std::string>> open_objects_;  // the keys seen in each object open
    std::string duplicate_;
    std::string error_;
    bool found_ = false;
};

}  // namespace

nlohmann::json parse_bounded_json(std::string_view text, std::string* why) {
    const nlohmann::json discarded(nlohmann::json::value_t::discarded);
    if (json_nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth) {
        if (why) *why = "nests deeper than " + std::to_string(kMaxJsonDepth) + " levels";
        return discarded;
    }
    DuplicateKeyFinder keys;
    if (!nlohmann::json::sax_parse(text.begin(), text.end(), &keys)) {
        if (why) *why = "not valid JSON: " + keys.error();
        return discarded;
    }
    if (keys.found()) {
        if (why)
            *why = "key '" + escaped_json_text(keys.duplicate()) + "' given twice in one object";
        return discarded;
    }
    return nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
}

}  // namespace rope_jit
