// An embedding interpreter's user line (memory/context.h's CallSiteScope names C++ lines):
// the Python module installs a hook that names the calling Python frame
// (python/call_sites.cpp). It is asked when a CallSiteScope in Tally's own sources opens
// (python/, the bindings, counts as Tally's own: is_library_source) and when the allocator
// finds no scope open; it writes `site` and returns true, or returns false (not called from
// the interpreter, or nothing records sites) and CallSiteScope's rules apply. The strings it
// writes must live for the process (interned).
#pragma once

#include "memory/context.h"

namespace tally::memory {

using UserSiteHook = bool (*)(SourceLoc& site);
void set_user_site_hook(UserSiteHook hook);
// The installed hook's answer (false when none is installed).
bool hooked_user_site(SourceLoc& site);

// Whether any allocator records history now (record_memory_history): one atomic load, for a
// hook deciding whether the user's line is worth finding.
bool any_history_recording();

}  // namespace tally::memory
