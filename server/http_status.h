// The HTTP front end's answer to a status: the HTTP status of its code
// (400 INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE and
// ALREADY_EXISTS; 401, 403, 404; 429 RESOURCE_EXHAUSTED; 499 CANCELLED;
// 503 UNAVAILABLE; 504 DEADLINE_EXCEEDED; 500 for the rest) and the body
// {"error": message}.
//
// Thread-safety: pure functions.
#ifndef ATTNSERVE_SERVER_HTTP_STATUS_H_
#define ATTNSERVE_SERVER_HTTP_STATUS_H_

#include "absl/status/status.h"
#include "server/http/http_server.h"

namespace attnserve {

int HttpStatusOf(absl::StatusCode code);
// The JSON error answer of `status` (not OK).
HttpResponse StatusResponse(const absl::Status& status);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HTTP_STATUS_H_
