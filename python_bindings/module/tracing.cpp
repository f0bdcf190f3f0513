// memtide._memtide: the process's CUPTI activity tracer (cupti::ProcessTrace), converted.

#include "memtide/cupti_tracer/tracer.hpp"
#include "common.hpp"

namespace memtide::bindings {

void bind_tracing(nb::module_& m) {
  m.def(
      "device_trace_start",
      [] {
        const cupti::ProcessTrace::Started s = cupti::ProcessTrace::start(cupti::Api::load());
        nb::dict d;
        d["status"] = cupti::to_string(s.status);
        d["detail"] = s.detail;
        d["library"] = s.library;
        d["dropped"] = s.dropped;
        return d;
      },
      "Starts CUPTI activity tracing of copies, memsets and kernels. Returns the status (active, partial,\n"
      "no_gpu, no_cupti, busy) and why; never raises for a missing GPU, library or a busy CUPTI.");
  m.def(
      "device_trace_stop",
      [] {
        nb::list out;
        for (const cupti::ProcessTrace::Timed& t : cupti::ProcessTrace::stop()) {
          const cupti::Activity& a = t.activity;
          const char* engine = a.kind == cupti::Activity::Kind::h2d   ? "h2d"
                               : a.kind == cupti::Activity::Kind::d2h ? "d2h"
                                                                      : "compute";
          out.append(nb::make_tuple(engine, t.start_ns / 1e9, t.end_ns / 1e9, a.bytes, a.pinned,
                                    cupti::to_string(a.kind)));
        }
        return out;
      },
      "Stops tracing (synchronize the device first) and returns the activities: (engine, start_s, end_s,\n"
      "bytes, pinned, kind), on the clock of allocator_events().");
}

}  // namespace memtide::bindings
