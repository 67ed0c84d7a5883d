#include "engine/call_cost.h"

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::Status VerifyWithinLimits(const RequestCost& cost,
                                int64_t max_tensor_elements,
                                int64_t max_request_bytes,
                                absl::string_view field) {
  if (cost.largest_tensor > max_tensor_elements) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, ": a tensor of ", cost.largest_tensor,
        " elements exceeds --max_tensor_elements ", max_tensor_elements));
  }
  if (cost.bytes > max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        field, ": needs about ", cost.bytes >> 20,
        " MiB for results and intermediates, above --max_request_memory_mb ",
        max_request_bytes >> 20));
  }
  return absl::OkStatus();
}

CostModel::CostModel(double initial_flops_per_second)
    : flops_per_second_(initial_flops_per_second) {}

absl::Duration CostModel::Estimate(double flops) const {
  return absl::Seconds(flops / flops_per_second_.load());
}

void CostModel::Observe(double flops, absl::Duration took) {
  const double seconds = absl::ToDoubleSeconds(took);
  if (flops < 1e7 || seconds <= 0) return;
  const double rate = flops / seconds;
  double current = flops_per_second_.load();
  // An exponential moving average, updated without a lock.
  while (!flops_per_second_.compare_exchange_weak(current,
                                                  0.8 * current + 0.2 * rate)) {
  }
}

}  // namespace attnserve
