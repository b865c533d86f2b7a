// The CUDA side of tensor/pinned.h: host<->device copies with pinned memory, enqueued
// without host synchronisation. A plain host-to-device copy runs on Tally's stream; the
// offload copies run on the copy stream (cuda::copy_stream), ordered after the work queued
// on Tally's stream when they are issued, so they overlap with the ops that follow. Every
// block a copy reads or writes is recorded as in use by the stream that copies it.
#pragma once

#include <memory>

#include "tensor/tensor.h"

namespace tally::cuda {

// `dev` (contiguous, on a CUDA device, allocated by the caller: ops::to_device_async) filled
// from the contiguous pinned CPU tensor `host` of its shape by cudaMemcpyAsync on Tally's
// stream.
void copy_pinned_to_device(const Tensor& host, const Tensor& dev);

// `host` (a contiguous CPU tensor of dev's shape, pinned for an asynchronous copy) filled
// from the contiguous CUDA tensor `dev` on the copy stream, after the work queued so far
// on Tally's stream.
void copy_to_host_on_copy_stream(const Tensor& dev, const Tensor& host);
// `dev` (contiguous, on a CUDA device) filled from the contiguous CPU tensor `host` on the
// copy stream, after the work queued so far on Tally's stream.
void copy_to_device_on_copy_stream(const Tensor& host, const Tensor& dev);

// An event recorded on the copy stream of `device` (shared, destroyed with the last copy).
std::shared_ptr<void> record_copy_event(int device);
// Tally's stream on `device` waits for `event` (cudaStreamWaitEvent: no host wait).
void stream_wait_copy_event(int device, const std::shared_ptr<void>& event);
// The calling thread waits until `event` has completed (cudaEventSynchronize).
void synchronize_copy_event(int device, const std::shared_ptr<void>& event);
// Whether `event` has completed, without waiting (cudaEventQuery).
bool query_copy_event(int device, const std::shared_ptr<void>& event);

}  // namespace tally::cuda
