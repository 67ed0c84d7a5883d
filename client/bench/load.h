// The load generator of attnctl bench: one pre-serialized request sent over
// several channels, closed loop (a fixed number of calls in flight) or open
// loop (calls sent on a schedule, whatever the server's pace), with a
// warm-up, a duration, a request count or a series of measurement windows,
// and per-call deadlines.
//
// Thread-safety: RunLoad blocks its caller; it runs calls on its own
// completion-queue threads, a sender thread (open loop) and calls its hooks
// on the caller's thread. Ownership: everything it creates is gone when it
// returns.
#ifndef ATTNSERVE_CLIENT_BENCH_LOAD_H_
#define ATTNSERVE_CLIENT_BENCH_LOAD_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/bench/arrivals.h"
#include "client/bench/report.h"
#include "client/bench/workload.h"
#include "client/client.h"

namespace attnserve {

struct LoadOptions {
  // Target, credentials, token, service config and per-call deadline
  // (`timeout`).
  ClientOptions client;
  // Closed loop: calls kept in flight. Open loop: the most calls
  // outstanding at once; a send that finds them all busy waits (and is
  // late).
  int concurrency = 1;
  // Channels, each with its own connection; calls are spread evenly.
  int connections = 1;
  // > 0: open loop at this many requests per second.
  double rate = 0;
  Arrival arrival = Arrival::kConstant;
  // Not counted: lets connections open and the server warm its caches.
  absl::Duration warmup = absl::Seconds(1);
  // The counted period; ignored when `requests` > 0.
  absl::Duration duration = absl::Seconds(10);
  // > 0: count exactly this many calls after the warm-up, then stop.
  int64_t requests = 0;
  // Open loop: a send this far behind its schedule counts as late.
  absl::Duration late_threshold = absl::Milliseconds(1);
  // Threads driving the calls, each with its own completion queue and a
  // share of the connections (0: one per connection, at most the cores the
  // client may run on).
  int threads = 0;
  // How often `progress` is called.
  absl::Duration progress_interval = absl::Seconds(1);
  // > 0: the counted period is a series of windows this long, one after
  // another while the load goes on, until LoadHooks::window_end says stop
  // or `max_windows` have run (instead of `duration` or `requests`). A call
  // belongs to the window it ends in; the report covers the last
  // `report_windows` windows.
  absl::Duration window = absl::ZeroDuration();
  int max_windows = 10;
  int report_windows = 3;
};

// OK when the options can run; INVALID_ARGUMENT naming the flag otherwise.
absl::Status VerifyLoadOptions(const LoadOptions& options);
// OK when the options suit a workload over blocking connections
// (Workload::connect): closed loop, one call in flight per connection.
absl::Status VerifyOneCallPerConnection(const LoadOptions& options);

// A running load test, as the progress line shows it.
struct LoadProgress {
  absl::Duration elapsed;
  bool warming_up = false;
  // Counted calls finished so far, and how many of them failed.
  int64_t completed = 0;
  int64_t errors = 0;
  // Over the last interval.
  double qps = 0;
  int64_t p50_ns = 0;
  int64_t p99_ns = 0;
};

// What RunLoad tells its caller as it goes, on the caller's thread; each
// hook may be empty.
struct LoadHooks {
  // Every LoadOptions::progress_interval.
  std::function<void(const LoadProgress&)> progress;
  // When the counted period starts: the warm-up is over.
  std::function<void()> measure_start;
  // At the end of each window with what it measured, before the next one
  // starts; false ends the run there. Without LoadOptions::window the run is
  // one window, which ends once its last counted call is done (the result
  // is then ignored).
  std::function<bool(const BenchReport& window)> window_end;
};

// Runs the load test. Fails only for options or a workload it cannot run;
// failed calls are counted in the report, by status code.
absl::StatusOr<BenchReport> RunLoad(const Workload& workload,
                                    const LoadOptions& options,
                                    const LoadHooks& hooks);
absl::StatusOr<BenchReport> RunLoad(
    const Workload& workload, const LoadOptions& options,
    const std::function<void(const LoadProgress&)>& progress = nullptr);

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_LOAD_H_
