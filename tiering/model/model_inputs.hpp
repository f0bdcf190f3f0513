#pragma once
// What the PerfModel accepts (private to tiering/model/): the checks of a workload and its rates,
// and how the model's and the Calibration's messages show a number.

#include <string>

#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {

// Throws InvalidArgument naming the first field of `work` or `r` the model cannot use.
void validate_model_inputs(const Workload& work, const Rates& r);

// `v` as %g.
std::string show_number(double v);

}  // namespace memtide::tiering
