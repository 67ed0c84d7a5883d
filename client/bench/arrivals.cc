#include "client/bench/arrivals.h"

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<Arrival> ParseArrival(absl::string_view name) {
  if (name == "constant") return Arrival::kConstant;
  if (name == "poisson") return Arrival::kPoisson;
  return absl::InvalidArgumentError(
      absl::StrCat("--arrival: '", name, "' is not one of constant, poisson"));
}

absl::string_view ArrivalName(Arrival arrival) {
  return arrival == Arrival::kConstant ? "constant" : "poisson";
}

ArrivalSchedule::ArrivalSchedule(Arrival arrival, double rate_per_second,
                                 uint64_t seed)
    : arrival_(arrival),
      rate_(rate_per_second),
      random_(seed),
      gap_(rate_per_second) {}

absl::Duration ArrivalSchedule::Next() {
  if (arrival_ == Arrival::kConstant) {
    // Computed from the index, not summed, so no rounding error builds up.
    return absl::Seconds(static_cast<double>(sent_++) / rate_);
  }
  const absl::Duration at = absl::Seconds(poisson_seconds_);
  poisson_seconds_ += gap_(random_);
  ++sent_;
  return at;
}

}  // namespace attnserve
