// A call as the engine sees it, and the record it leaves: the engine
// records every call it admits or refuses (engine/engine.h), through a
// CallRecorder the server supplies (metrics, per-model statistics, the
// access log). Neither knows a wire format: what only the front end can
// read of its request (the model it names, its bytes, a description) comes
// through the call's CallSubject.
//
// Thread-safety: a CallRecorder is called from any thread at once; a
// CallSubject only from the thread that records its call. Ownership: an
// EngineCall points to its subject, which the front end owns and keeps
// alive until the call is recorded.
#ifndef ATTNSERVE_ENGINE_CALL_RECORD_H_
#define ATTNSERVE_ENGINE_CALL_RECORD_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/call_cost.h"

namespace attnserve {

// What a front end tells about a call's request, asked for only when the
// record needs it (a call that succeeds, an access log that is on).
class CallSubject {
 public:
  virtual ~CallSubject() = default;
  // The served model the call counts under; empty when it names none.
  virtual std::string Model() const = 0;
  // The bytes of the request and of its response, read after the response
  // is complete.
  virtual int64_t Bytes() const = 0;
  // The request's shapes and names for the access log, e.g.
  // "query=[2, 3, 8] model=m"; empty when there is nothing to say.
  virtual std::string Describe() const = 0;
};

// One call: its label, cost and times, and its subject.
struct EngineCall {
  std::string label = "";  // the metrics' label, e.g. "Attend"
  // Null: a call whose request could not be read (nothing but its label
  // and status is recorded).
  const CallSubject* subject = nullptr;
  RequestCost cost = {};
  absl::Time arrived = absl::Time();
  // When the front end had translated the request into its native call
  // (the statistics' input time ends there); InfinitePast: no translation.
  absl::Time decoded = absl::InfinitePast();
  absl::Time deadline = absl::InfiniteFuture();
};

// Where one call's time went.
struct CallTimes {
  absl::Duration total;    // from arrival to answer
  absl::Duration input;    // the request's translation into a native call
  absl::Duration queue;    // from then to the start of its computation
  absl::Duration compute;  // its computation
};

class CallRecorder {
 public:
  virtual ~CallRecorder() = default;
  // One finished call (computed, or refused with `status`); `flops` is
  // what it computed (zero when refused).
  virtual void Record(const EngineCall& call, const absl::Status& status,
                      const CallTimes& times, double flops) const = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_CALL_RECORD_H_
