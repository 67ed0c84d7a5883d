// perf_analyzer's stability criterion for attnctl bench: measurement
// windows run back to back, under continuous load, until the last
// kStabilityWindows windows' throughput and mean latency each vary by less
// than a percentage, or a number of windows have run. The report then
// covers those last windows, as perf_analyzer merges them.
//
// Thread-safety: plain values and free functions; StabilityTracker is
// thread-compatible.
#ifndef ATTNSERVE_CLIENT_BENCH_STABILITY_H_
#define ATTNSERVE_CLIENT_BENCH_STABILITY_H_

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "client/bench/load.h"
#include "client/bench/report.h"

namespace attnserve {

// perf_analyzer's stability window: the windows compared, and reported.
inline constexpr int kStabilityWindows = 3;
// --max_trials without the flag: perf_analyzer's default.
inline constexpr int kDefaultMaxTrials = 10;

struct StabilityOptions {
  // --stability_percent; unset: no windows, one measured period
  // (--duration_s or --requests). 0 never settles: exactly max_trials
  // windows.
  std::optional<double> percent;
  // --max_trials: the most windows (unset: kDefaultMaxTrials).
  std::optional<int> max_trials;
  // --window_s: seconds of each window (unset: --duration_s).
  std::optional<double> window_s;
};

// OK when `options` can run with `load`; INVALID_ARGUMENT naming the flag
// otherwise (a percentage below 0, too few or many trials, a window of no
// length, --max_trials or --window_s without --stability_percent, a request
// count).
absl::Status VerifyStabilityOptions(const StabilityOptions& options,
                                    const LoadOptions& load);

// `load` with the measurement windows `options` ask for; unchanged without
// a percentage.
LoadOptions WithWindows(const LoadOptions& load,
                        const StabilityOptions& options);

// How much the last kStabilityWindows of `values` (or all, when fewer)
// vary: max / min - 1, in percent; infinite when one is 0 and another not.
double SpreadPercent(const std::vector<double>& values);

// Follows the windows of one run as they end.
class StabilityTracker {
 public:
  // `options` has a percentage; `window` is each window's length.
  StabilityTracker(const StabilityOptions& options, absl::Duration window);

  // Takes a window's report; true while another window is needed.
  bool Add(const BenchReport& window);
  const StabilityReport& report() const { return report_; }

 private:
  StabilityReport report_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_STABILITY_H_
