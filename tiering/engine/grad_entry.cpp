// The C entry of grad_entry.h: converts, calls StepProtocol::grad_ready, turns an exception into
// a message (it is called across a library boundary, from autograd's threads).

#include "memtide/tiering/engine/grad_entry.h"

#include <cstring>
#include <exception>
#include <string>

#include "memtide/tiering/engine/step_protocol.hpp"

namespace memtide::tiering {
namespace {

static_assert(static_cast<int>(GradRoute::device_path) == MEMTIDE_GRAD_DEVICE_PATH);
static_assert(static_cast<int>(GradRoute::host_copy) == MEMTIDE_GRAD_HOST_COPY);
static_assert(static_cast<int>(GradRoute::in_place) == MEMTIDE_GRAD_IN_PLACE);

void say(const std::string& why, char* error, std::size_t error_size) {
  if (error == nullptr || error_size == 0) return;
  const std::size_t n = why.size() < error_size - 1 ? why.size() : error_size - 1;
  std::memcpy(error, why.data(), n);
  error[n] = '\0';
}

}  // namespace
}  // namespace memtide::tiering

extern "C" int memtide_step_protocol_grad_ready(void* protocol, size_t param, const void* data, int dtype, size_t n,
                                                int route, void* stream, char* error, size_t error_size) {
  using namespace memtide::tiering;
  GradArrival g;
  g.data = data;
  g.n = n;
  g.producer = memtide::Stream{stream};
  switch (dtype) {
    case MEMTIDE_GRAD_FP32: g.dtype = DType::fp32; break;
    case MEMTIDE_GRAD_FP16: g.dtype = DType::fp16; break;
    case MEMTIDE_GRAD_BF16: g.dtype = DType::bf16; break;
    default: say("grad_ready: unknown gradient dtype code " + std::to_string(dtype), error, error_size); return -1;
  }
  if (route < MEMTIDE_GRAD_DEVICE_PATH || route > MEMTIDE_GRAD_IN_PLACE) {
    say("grad_ready: unknown gradient route code " + std::to_string(route), error, error_size);
    return -1;
  }
  g.how = static_cast<GradRoute>(route);
  try {
    static_cast<StepProtocol*>(protocol)->grad_ready(param, g, false);
  } catch (const std::exception& e) {
    say(e.what(), error, error_size);
    return -1;
  }
  return 0;
}
