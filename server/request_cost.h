// What a native call will cost (engine/call_cost.h), read from its
// request's shapes before anything is decoded or allocated. Shapes that do
// not validate cost 0; the operation reports them.
//
// Thread-safety: free functions.
#ifndef ATTNSERVE_SERVER_REQUEST_COST_H_
#define ATTNSERVE_SERVER_REQUEST_COST_H_

#include <memory>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "core/decode_session.h"
#include "core/multi_head_attention.h"
#include "engine/call_cost.h"

namespace attnserve {

RequestCost CostOf(const v1::AttendRequest& request);
// `layer`: the model's, when the request names one (else null).
RequestCost CostOf(const v1::MultiHeadAttendRequest& request,
                   const MultiHeadLayer* layer);
RequestCost CostOf(const v1::LayerNormRequest& request);
RequestCost CostOf(const v1::RmsNormRequest& request);
// `session`: the one the request names (null when it is not open here:
// the step may then wait to take it up, and never runs inline).
RequestCost CostOf(const v1::SessionStepRequest& request,
                   const DecodeSession* session);

// The sum of its steps' costs (their largest tensor, the largest of
// theirs); `sessions[i]`: the session step i names (null when not found).
RequestCost CostOf(
    const v1::SessionStepsRequest& request,
    const std::vector<std::shared_ptr<const DecodeSession>>& sessions);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_COST_H_
