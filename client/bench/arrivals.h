// When an open-loop load test sends each request: evenly spaced (constant)
// or as a Poisson process (exponential gaps), at a mean rate.
//
// Thread-safety: not thread-safe; one sender thread owns a schedule.
#ifndef ATTNSERVE_CLIENT_BENCH_ARRIVALS_H_
#define ATTNSERVE_CLIENT_BENCH_ARRIVALS_H_

#include <cstdint>
#include <random>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attnserve {

enum class Arrival { kConstant, kPoisson };

// "constant" or "poisson"; INVALID_ARGUMENT naming --arrival otherwise.
absl::StatusOr<Arrival> ParseArrival(absl::string_view name);
absl::string_view ArrivalName(Arrival arrival);

class ArrivalSchedule {
 public:
  // `rate_per_second` > 0. The same seed gives the same schedule.
  ArrivalSchedule(Arrival arrival, double rate_per_second, uint64_t seed = 1);

  // The send time of the next request, from the start of the schedule.
  absl::Duration Next();

 private:
  Arrival arrival_;
  double rate_;
  int64_t sent_ = 0;
  double poisson_seconds_ = 0;
  std::mt19937_64 random_;
  std::exponential_distribution<double> gap_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_ARRIVALS_H_
