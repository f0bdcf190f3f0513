#include "memtide/tiering/engine/param_layout.hpp"

#include <algorithm>
#include <string>

#include "memtide/core/error.hpp"

namespace memtide::tiering {

std::vector<std::pair<std::size_t, std::size_t>> cut_subgroups(std::size_t n, std::size_t size, const char* size_name) {
  if (size == 0) throw InvalidArgument(std::string(size_name) + " must be >= 1, got 0");
  const std::size_t count = n / size + (n % size != 0);
  if (count > kMaxSubgroups) {
    const std::size_t fits = n / kMaxSubgroups + (n % kMaxSubgroups != 0);
    throw InvalidArgument(std::string(size_name) + " " + std::to_string(size) + " cuts " + std::to_string(n) +
                          " params into " + std::to_string(count) + " subgroups, at most " +
                          std::to_string(kMaxSubgroups) + " are supported: use " + size_name + " >= " +
                          std::to_string(fits));
  }
  std::vector<std::pair<std::size_t, std::size_t>> out;
  out.reserve(count);
  for (std::size_t s = 0; s < n; s += size) out.emplace_back(s, s + std::min(size, n - s));
  return out;
}

ParamLayout::ParamLayout(std::vector<ParamSlot> params,
                         const std::vector<std::pair<std::size_t, std::size_t>>& subgroups)
    : params_(std::move(params)),
      pieces_(subgroups.size()),
      subgroups_of_(params_.size(), {0, 0}),
      steps_(params_.size(), 0.0f) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamSlot& p = params_[i];
    if (p.start != at || p.end < p.start) {
      throw InvalidArgument("ParamLayout: param " + std::to_string(i) + " is [" + std::to_string(p.start) + ", " +
                            std::to_string(p.end) + "), expected to start at " + std::to_string(at));
    }
    at = p.end;
  }
  const std::size_t total = subgroups.empty() ? 0 : subgroups.back().second;
  if (at != total) {
    throw InvalidArgument("ParamLayout: the params cover " + std::to_string(at) + " elements, the subgroups " +
                          std::to_string(total));
  }
  // Both lists are sorted: one walk cuts every param at the subgroup bounds.
  std::size_t g = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    std::size_t lo = params_[i].start;
    const std::size_t hi = params_[i].end;
    bool first = true;
    while (lo < hi) {
      while (subgroups[g].second <= lo) ++g;
      if (first) subgroups_of_[i].first = g;
      first = false;
      subgroups_of_[i].second = g + 1;
      const std::size_t cut = std::min(hi, subgroups[g].second);
      pieces_[g].push_back(Piece{i, lo, cut});
      lo = cut;
    }
  }
}

std::vector<Segment> ParamLayout::segments(const std::vector<StepParams>& groups,
                                           const std::vector<std::uint8_t>& has_grad,
                                           std::optional<std::size_t> only) const {
  if (has_grad.size() != params_.size()) {
    throw InvalidArgument("ParamLayout::segments: " + std::to_string(has_grad.size()) + " gradient flags for " +
                          std::to_string(params_.size()) + " params");
  }
  if (only && *only >= pieces_.size()) {
    throw InvalidArgument("ParamLayout::segments: subgroup " + std::to_string(*only) + " of " +
                          std::to_string(pieces_.size()));
  }
  std::vector<Segment> out;
  const std::size_t first = only ? *only : 0;
  const std::size_t last = only ? *only + 1 : pieces_.size();
  for (std::size_t g = first; g < last; ++g) {
    bool open = false;  // the last segment may grow
    std::size_t open_group = 0;
    for (const Piece& piece : pieces_[g]) {
      if (!has_grad[piece.param]) {
        open = false;
        continue;
      }
      const ParamSlot& p = params_[piece.param];
      if (p.group >= groups.size()) {
        throw InvalidArgument("ParamLayout::segments: param " + std::to_string(piece.param) + " is in group " +
                              std::to_string(p.group) + ", hyper-parameters were given for " +
                              std::to_string(groups.size()));
      }
      const auto step = static_cast<std::int64_t>(steps_[piece.param]) + 1;
      if (open) {
        Segment& s = out.back();
        if (s.end == piece.start && s.params.step == step && s.low_precision == p.low_precision &&
            open_group == p.group) {
          s.end = piece.end;
          continue;
        }
      }
      Segment s;
      s.subgroup = g;
      s.start = piece.start;
      s.end = piece.end;
      s.params = groups[p.group];
      s.params.step = step;
      s.low_precision = p.low_precision;
      out.push_back(s);
      open = true;
      open_group = p.group;
    }
  }
  return out;
}

void ParamLayout::advance(const std::vector<std::uint8_t>& has_grad) {
  if (has_grad.size() != params_.size()) {
    throw InvalidArgument("ParamLayout::advance: " + std::to_string(has_grad.size()) + " gradient flags for " +
                          std::to_string(params_.size()) + " params");
  }
  for (std::size_t i = 0; i < params_.size(); ++i) steps_[i] += has_grad[i] ? 1.0f : 0.0f;
}

}  // namespace memtide::tiering
