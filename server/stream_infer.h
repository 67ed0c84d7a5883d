// ModelStreamInfer, the protocol's bidirectional stream: each request is
// authenticated with the stream, translated as a ModelInfer request
// (server/open_inference.h) and run through the call pipeline (admission,
// queue, limits, metrics under rpc="ModelStreamInfer", statistics, access
// log); its answer is one ModelStreamInferResponse, in request order. A
// request that fails (it does not parse, names no served model, or its
// computation fails) is answered with error_message "CODE: message" (e.g.
// "INVALID_ARGUMENT: key: last dim 4 != query last dim 8") and its id and
// model, and the stream goes on. The requests of one stream compute one at
// a time: the next is read once the previous one's answer is written, which
// bounds what a stream holds to one request and one response.
//
// The stream ends OK when the client closes its side; CANCELLED when the
// client cancels or a write fails; UNAUTHENTICATED before any request is
// read when the server takes tokens and the stream has none.
//
// Thread-safety: gRPC and the pipeline's workers call the reactor in turn,
// never at once (one operation outstanding at a time). Ownership: the
// reactor deletes itself when gRPC is done with it; `pipeline` must
// outlive the stream.
#ifndef ATTNSERVE_SERVER_STREAM_INFER_H_
#define ATTNSERVE_SERVER_STREAM_INFER_H_

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/call_pipeline.h"

namespace attnserve {

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
StartModelStreamInfer(grpc::CallbackServerContext* context,
                      const CallPipeline* pipeline);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_STREAM_INFER_H_
