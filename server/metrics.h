// Serving metrics in the Prometheus text format, and the HTTP endpoint that
// exposes them (GET /metrics).
//
// Thread-safety: Metrics may be recorded into and rendered from any thread.
// The metrics page is an HttpServer, stopped by its owner.
#ifndef ATTNSERVE_SERVER_METRICS_H_
#define ATTNSERVE_SERVER_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "core/session_store.h"
#include "server/http/http_server.h"

namespace attnserve {

// Point-in-time values the metrics page shows next to the counters.
struct ServingGauges {
  int inflight = 0;
  int queued = 0;
  int models_loaded = 0;
  SessionStore::Stats sessions;
  // The step coalescer's passes, and the steps they ran.
  int64_t step_passes = 0;
  int64_t coalesced_steps = 0;
};

class Metrics {
 public:
  // One finished call: its RPC, gRPC status code name, and where its time
  // went (queue wait and compute are zero for calls refused up front).
  void RecordCall(const std::string& rpc, const std::string& code,
                  absl::Duration total, absl::Duration queue_wait,
                  absl::Duration compute, double flops, int64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The Prometheus text exposition of everything recorded, plus `gauges`,
  // build information and the process's resident memory.
  std::string Render(const ServingGauges& gauges) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  static constexpr std::array<double, 14> kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,  0.5,    1,     2.5,  5,     10};
  struct Histogram {
    std::array<int64_t, kBuckets.size()> counts{};  // cumulative at render
    int64_t count = 0;
    double sum = 0;
    void Observe(double seconds);
  };
  static void RenderHistogram(const std::string& name, const std::string& help,
                              const std::map<std::string, Histogram>& by_rpc,
                              std::string* out);

  mutable Mutex mu_;
  std::map<std::pair<std::string, std::string>, int64_t> calls_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> total_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> queue_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> compute_ ABSL_GUARDED_BY(mu_);
  double flops_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Serves GET /metrics from `render` on options' host and port (0: a free
// port), with options' bounds on clients.
absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsServer(
    HttpServerOptions options, std::function<std::string()> render);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_METRICS_H_
