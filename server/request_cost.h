// What a call will cost, read from its request's shapes before anything is
// decoded or allocated: FLOPs (for the deadline check) and the bytes it will
// allocate (for the memory limit). Shapes that do not validate cost 0; the
// operation reports them.
//
// Thread-safety: free functions; CostModel is safe for concurrent use.
#ifndef ATTNSERVE_SERVER_REQUEST_COST_H_
#define ATTNSERVE_SERVER_REQUEST_COST_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "core/decode_session.h"
#include "core/multi_head_attention.h"

namespace attnserve {

struct RequestCost {
  double flops = 0;
  // Results and intermediates the call allocates.
  int64_t bytes = 0;
  // The most elements of any tensor in the request.
  int64_t largest_tensor = 0;
};

RequestCost CostOf(const v1::AttendRequest& request);
// `layer`: the model's, when the request names one (else null).
RequestCost CostOf(const v1::MultiHeadAttendRequest& request,
                   const MultiHeadLayer* layer);
RequestCost CostOf(const v1::LayerNormRequest& request);
// `session`: the one the request names (null when it was not found).
RequestCost CostOf(const v1::SessionStepRequest& request,
                   const DecodeSession* session);

// RESOURCE_EXHAUSTED when `cost` exceeds the server's limits on the
// elements of one tensor or the bytes a call allocates; checked before
// anything is decoded or allocated.
absl::Status VerifyWithinLimits(const RequestCost& cost,
                                int64_t max_tensor_elements,
                                int64_t max_request_bytes);

// The server's compute rate, learned from the calls it served, to estimate
// how long a call will take.
class CostModel {
 public:
  // `initial_flops_per_second` until calls have been measured.
  explicit CostModel(double initial_flops_per_second);
  absl::Duration Estimate(double flops) const;
  // Folds one call in (calls under 10 MFLOP are too short to measure).
  void Observe(double flops, absl::Duration took);

 private:
  std::atomic<double> flops_per_second_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_COST_H_
