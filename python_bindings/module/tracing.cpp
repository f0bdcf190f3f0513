// memtide._memtide: the process's CUPTI activity tracer (one per process, as CUPTI allows).

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>

#include "memtide/cupti_tracer/tracer.hpp"
#include "common.hpp"

namespace memtide::bindings {
namespace {

struct ProcessTracer {
  std::mutex mutex;
  std::unique_ptr<cupti::Tracer> tracer;
  double offset_ns = 0;  // steady_clock - CUPTI clock, so records share the allocator trace's clock
};

ProcessTracer& process_tracer() {
  static auto* t = new ProcessTracer;  // never destroyed: CUPTI may call back at exit
  return *t;
}

double steady_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

nb::dict status_dict(const cupti::Tracer& t, const std::string& library) {
  nb::dict d;
  d["status"] = cupti::to_string(t.status());
  d["detail"] = t.detail();
  d["library"] = library;
  d["dropped"] = t.dropped();
  return d;
}

}  // namespace

std::optional<cupti::PcieUse> traced_pcie(double from_ns, double to_ns) {
  ProcessTracer& p = process_tracer();
  std::lock_guard lock(p.mutex);
  if (!p.tracer) return std::nullopt;
  const cupti::Status s = p.tracer->status();
  if (s != cupti::Status::active && s != cupti::Status::partial) return std::nullopt;
  p.tracer->flush();  // completed buffers only: records still in CUPTI's hands are missed, not waited for
  const double from = from_ns - p.offset_ns, to = to_ns - p.offset_ns;
  if (!(to > from) || from < 0) return std::nullopt;
  return p.tracer->pcie_between(static_cast<std::uint64_t>(from), static_cast<std::uint64_t>(to));
}

void bind_tracing(nb::module_& m) {
  m.def(
      "device_trace_start",
      [] {
        ProcessTracer& p = process_tracer();
        std::lock_guard lock(p.mutex);
        cupti::Api api = cupti::Api::load();
        const std::string library = api.library;
        if (p.tracer) p.tracer->stop();
        p.tracer = std::make_unique<cupti::Tracer>(std::move(api));
        const cupti::Status s = p.tracer->start();
        if (s == cupti::Status::active || s == cupti::Status::partial) {
          p.offset_ns = steady_ns() - static_cast<double>(p.tracer->now_ns());
        }
        return status_dict(*p.tracer, library);
      },
      "Starts CUPTI activity tracing of copies, memsets and kernels. Returns the status (active, partial,\n"
      "no_gpu, no_cupti, busy) and why; never raises for a missing GPU, library or a busy CUPTI.");
  m.def(
      "device_trace_stop",
      [] {
        ProcessTracer& p = process_tracer();
        std::lock_guard lock(p.mutex);
        nb::list out;
        if (!p.tracer) return out;
        p.tracer->stop();
        for (const cupti::Activity& a : p.tracer->take()) {
          const char* engine = a.kind == cupti::Activity::Kind::h2d   ? "h2d"
                               : a.kind == cupti::Activity::Kind::d2h ? "d2h"
                                                                      : "compute";
          out.append(nb::make_tuple(engine, (static_cast<double>(a.start_ns) + p.offset_ns) / 1e9,
                                    (static_cast<double>(a.end_ns) + p.offset_ns) / 1e9, a.bytes, a.pinned,
                                    cupti::to_string(a.kind)));
        }
        return out;
      },
      "Stops tracing (synchronize the device first) and returns the activities: (engine, start_s, end_s,\n"
      "bytes, pinned, kind), on the clock of allocator_events().");
}

}  // namespace memtide::bindings
