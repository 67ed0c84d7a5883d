// What a call will cost, as the engine weighs it: FLOPs, the rest of its
// work (elements read and written, logits evaluated: a call of 0 FLOPs may
// still scan billions of rows), both for the deadline check and the choice
// of running it inline, and the bytes it will allocate (for the memory
// limit); and the server's measured rate that turns effort into time.
// Front ends compute a call's cost from their requests' shapes
// (server/request_cost.h for the native messages).
//
// Thread-safety: plain values and free functions; CostModel is safe for
// concurrent use.
#ifndef ATTNSERVE_ENGINE_CALL_COST_H_
#define ATTNSERVE_ENGINE_CALL_COST_H_

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attnserve {

struct RequestCost {
  double flops = 0;
  // The work besides the FLOPs, in FLOP-equivalents: kElementWork per
  // element read or written (tensors, results, intermediates, mask elements
  // read for each logit) and kLogitWork per logit evaluated (batch x heads
  // x Lq x Lk, whatever the head dims, when the kernel computes them).
  double work = 0;
  // Results and intermediates the call allocates.
  int64_t bytes = 0;
  // The most elements of any tensor in the request.
  int64_t largest_tensor = 0;
  // The call may wait for a file or another replica (a decode session not
  // open here, taken up or handed over first): never computed on the
  // thread that received it (gRPC's threads, which a hand-over's answer
  // needs on the replica asked).
  bool may_wait = false;

  // What the deadline estimate and the inline decision go by: the FLOPs,
  // or the other work when it is larger.
  double effort() const { return std::max(flops, work); }
};

// FLOP-equivalents of reading or writing one element, and of evaluating
// one logit (scale, mask, running max, exp, sum). Measured on one AVX-512
// core: ~3e9 elements written and ~2e9 logits a second (1e9 masked),
// against 1e11 FLOP/s in the GEMMs. These weights are lower than those
// ratios: a call estimated too cheap runs until its deadline cancels it,
// one estimated too dear is refused when it could have finished.
inline constexpr double kElementWork = 4;
inline constexpr double kLogitWork = 16;

// Calls below this effort (LayerNorm of ~100K elements, a few-token
// attention; at most ~100 us) run on the thread that received them when a
// worker slot is free: they finish in less time than waking a worker costs.
// They cannot be cancelled there, so nothing above this bound may run there.
inline constexpr double kRunInlineEffort = 1e6;
inline bool RunsInline(const RequestCost& cost) {
  return !cost.may_wait && cost.effort() < kRunInlineEffort;
}

// RESOURCE_EXHAUSTED when `cost` exceeds the server's limits on the
// elements of one tensor or the bytes a call allocates; checked before
// anything is decoded or allocated. The message names `field` (the
// request, or one entry of it).
absl::Status VerifyWithinLimits(const RequestCost& cost,
                                int64_t max_tensor_elements,
                                int64_t max_request_bytes,
                                absl::string_view field = "request");

// The server's compute rate, learned from the calls it served, to estimate
// how long a call will take.
class CostModel {
 public:
  // `initial_flops_per_second` until calls have been measured.
  explicit CostModel(double initial_flops_per_second);
  // `flops`: a call's effort() (FLOPs or FLOP-equivalents).
  absl::Duration Estimate(double flops) const;
  // Folds one call in (calls under 10 MFLOP are too short to measure).
  void Observe(double flops, absl::Duration took);

 private:
  std::atomic<double> flops_per_second_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_CALL_COST_H_
