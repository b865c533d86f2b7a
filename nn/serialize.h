// safetensors files (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON {"name": {"dtype": "F32", "shape": [..],
// "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}, then the raw
// little-endian row-major bytes of every tensor, back to back. Weights move between Tally
// and PyTorch (safetensors.torch.load_file / save_file) both ways.
//
// Tied weights: save_safetensors writes every name it is given, so a GPT state_dict is
// saved with both transformer.wte.weight and lm_head.weight (two copies of the bytes, as
// torch.save(state_dict) keeps both names); Module::load_state_dict accepts a file that
// has either or both names.
#pragma once

#include <map>
#include <string>

#include "nn/module.h"

namespace tally::nn {

// Writes `tensors` (any device; copied to the CPU) in the given order. Names must be
// unique, and names and metadata valid UTF-8 (JSON text is; std::invalid_argument naming the
// file otherwise). dtypes: F32, F16, BF16, F64, I32, I64, BOOL, U8. The write is atomic (a
// temporary file in the same folder, fsync'ed and renamed into place: base/atomic_file.h),
// so a failed save leaves an existing file at `path` intact. Throws std::runtime_error naming
// the path and the errno text on I/O failure.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Reads every tensor onto the CPU (allocated under the caller's allocation context), in
// the order of their data offsets. `metadata`, when given, receives __metadata__. A
// corrupt or truncated file throws std::runtime_error naming the file, what was wrong and
// the byte offset.
NamedTensors load_safetensors(const std::string& path,
                              std::map<std::string, std::string>* metadata = nullptr);

}  // namespace tally::nn
