// Atomic file writes: every file Tally writes (weights, snapshots, traces, timelines, reports)
// goes through write_file_atomic, so a write cut short (disk full, a file-size limit, an
// exception in the writer) never destroys the previous good file.
//
// The bytes go to a temporary file in the target's folder ("<target>.tmp<6 characters>",
// created with O_EXCL), every write is checked, the file is flushed and fsync'ed, closed and
// renamed over the target; the folder is then fsync'ed (best effort: some file systems refuse
// to fsync a folder, and the new file is already in place). On any failure the temporary
// file is removed and the target is left as it was.
//
// Details:
// - the new file keeps the permission bits of the file it replaces; a new target gets 0666
//   less the umask, as an ordinary open would;
// - a symbolic link as the target is followed: the file it points to is replaced, the link
//   stays;
// - a target that exists and is not a regular file (/dev/null, /dev/stdout, a FIFO) cannot be
//   replaced by a rename; it is opened and written in place, every write still checked;
// - a folder as the target is an error (EISDIR);
// - a writer holds a flock on its temporary file until the rename, and each write first
//   removes the target's temporary files that no live writer holds (left by a writer that was
//   killed), so a crash leaves at most one stale file per target until its next write.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <string_view>

namespace tally::base {

// Writes what `write` puts into the stream to `path`, atomically as above. `who` starts the
// error message (the public function that writes, e.g. "save_safetensors"). Throws
// std::runtime_error naming `who`, `path`, the step that failed and the errno text
// ("save_safetensors: cannot write 'w.safetensors': File too large (writing
// 'w.safetensors.tmpA1b2C3'); 'w.safetensors' is unchanged"). An exception thrown by `write`
// removes the temporary file and propagates unchanged.
void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write,
                       std::string_view who);

// For a target that exists and is not a regular file (written in place): opens it for writing
// and writes zero bytes, which reaches the device's own write without writing anything
// (/dev/full answers ENOSPC). Returns 0 when it would take a write, else the errno. A FIFO
// without a reader yet passes (its reader may come). For checks before a run.
int probe_in_place_write(const std::string& path) noexcept;

// The same for bytes already in memory.
void write_file_atomic(const std::string& path, std::string_view bytes, std::string_view who);

}  // namespace tally::base
