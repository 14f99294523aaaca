// The cache item states as rope-jit-cache names them: `list` writes the names, a listed
// manifest (`prewarm --manifest` of `list --json`) reads them back. Header-only: the manifest
// reader (kernel_spec_sets.cpp) is also built into a fuzz target without the rest of the tool.
#pragma once

#include <string>

#include "rope_jit/rope_jit.h"

namespace rope_jit_cache {

// Every cache item state, in the order the reports count them, with its name.
struct ItemStateName {
    rope_jit_cache_item_state state;
    const char* name;
};
inline constexpr ItemStateName kItemStates[] = {
    {ROPE_JIT_CACHE_ITEM_OK, "ok"},
    {ROPE_JIT_CACHE_ITEM_STALE, "stale"},
    {ROPE_JIT_CACHE_ITEM_DAMAGED, "damaged"},
    {ROPE_JIT_CACHE_ITEM_TEMP, "temp"},
    {ROPE_JIT_CACHE_ITEM_SET_ASIDE, "set-aside"},
    {ROPE_JIT_CACHE_ITEM_STRAY, "stray"},
    {ROPE_JIT_CACHE_ITEM_UNTRUSTED, "untrusted"},
};

// The name of a state this tool does not know: one a newer library reports.
inline constexpr const char* kUnknownItemState = "unknown";

// kItemStates' name of `state`; kUnknownItemState for a value of none of the enum's names.
inline const char* item_state_name(rope_jit_cache_item_state state) {
    for (const ItemStateName& entry : kItemStates)
        if (entry.state == state) return entry.name;
    return kUnknownItemState;
}

// Whether `name` is one item_state_name gives (kUnknownItemState too).
inline bool is_item_state_name(const std::string& name) {
    for (const ItemStateName& entry : kItemStates)
        if (name == entry.name) return true;
    return name == kUnknownItemState;
}

// Every name item_state_name gives, comma-separated, for a message.
inline std::string item_state_names() {
    std::string names;
    for (const ItemStateName& entry : kItemStates) names += entry.name + std::string(", ");
    return names + kUnknownItemState;
}

}  // namespace rope_jit_cache
