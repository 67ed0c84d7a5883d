#include "client/bench/stability.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

// Each window's counts are kept in memory until the run ends.
constexpr int kMaxTrials = 100;

// The last kStabilityWindows of `values`, or all when fewer.
std::vector<double> LastWindows(const std::vector<double>& values) {
  return {values.end() - std::min<size_t>(values.size(), kStabilityWindows),
          values.end()};
}

}  // namespace

absl::Status VerifyStabilityOptions(const StabilityOptions& options,
                                    const LoadOptions& load) {
  if (!options.percent.has_value()) {
    // Refused rather than ignored: a run measured otherwise than asked
    // misleads.
    if (options.max_trials.has_value()) {
      return absl::InvalidArgumentError(
          "--max_trials: needs --stability_percent");
    }
    if (options.window_s.has_value()) {
      return absl::InvalidArgumentError(
          "--window_s: needs --stability_percent");
    }
    return absl::OkStatus();
  }
  const double percent = *options.percent;
  if (!std::isfinite(percent) || percent < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stability_percent: must be a number >= 0, got ", percent));
  }
  const int trials = options.max_trials.value_or(kDefaultMaxTrials);
  if (trials < kStabilityWindows || trials > kMaxTrials) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_trials: ", trials, " is not in [", kStabilityWindows, ", ",
        kMaxTrials, "] (stability compares the last ", kStabilityWindows,
        " windows)"));
  }
  if (options.window_s.has_value() &&
      !(std::isfinite(*options.window_s) && *options.window_s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--window_s: must be > 0, got ", *options.window_s));
  }
  if (load.requests > 0) {
    return absl::InvalidArgumentError(
        "--requests: not with --stability_percent (windows are measured in "
        "time: --window_s)");
  }
  return absl::OkStatus();
}

LoadOptions WithWindows(const LoadOptions& load,
                        const StabilityOptions& options) {
  LoadOptions windowed = load;
  if (!options.percent.has_value()) return windowed;
  windowed.window = options.window_s.has_value()
                        ? absl::Seconds(*options.window_s)
                        : load.duration;
  windowed.max_windows = options.max_trials.value_or(kDefaultMaxTrials);
  windowed.report_windows = kStabilityWindows;
  return windowed;
}

double SpreadPercent(const std::vector<double>& values) {
  const std::vector<double> last = LastWindows(values);
  if (last.empty()) return 0;
  const auto [low, high] = std::minmax_element(last.begin(), last.end());
  if (*high == 0) return 0;
  if (*low <= 0) return std::numeric_limits<double>::infinity();
  return (*high / *low - 1) * 100;
}

StabilityTracker::StabilityTracker(const StabilityOptions& options,
                                   absl::Duration window) {
  report_.percent = options.percent.value_or(0);
  report_.max_windows = options.max_trials.value_or(kDefaultMaxTrials);
  report_.window_s = absl::ToDoubleSeconds(window);
}

bool StabilityTracker::Add(const BenchReport& window) {
  report_.window_qps.push_back(window.qps);
  report_.window_mean_us.push_back(window.latency.mean_us);
  report_.qps_spread_percent = SpreadPercent(report_.window_qps);
  report_.latency_spread_percent = SpreadPercent(report_.window_mean_us);
  // As perf_analyzer: a window without a completed call is never stable.
  // Strictly less than the limit, so that 0% never settles and runs a
  // fixed number of windows.
  const std::vector<double> last = LastWindows(report_.window_qps);
  report_.compared_windows = static_cast<int>(last.size());
  const bool idle = *std::min_element(last.begin(), last.end()) <= 0;
  report_.stable =
      report_.window_qps.size() >= static_cast<size_t>(kStabilityWindows) &&
      !idle && report_.qps_spread_percent < report_.percent &&
      report_.latency_spread_percent < report_.percent;
  return !report_.stable;
}

}  // namespace attnserve
