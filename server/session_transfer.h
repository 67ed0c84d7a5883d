// ExportSession and ImportSession (attnserve.v1): a session's file streamed
// out of a replica and into another (SessionStore::ExportSession,
// ImportBytes). Each stream is authenticated when it starts; an export
// sends chunks of at most kExportChunkBytes, one write outstanding, each
// read from the session as it is sent; an import applies each chunk as it
// arrives, so that a stream holds one chunk at a time. New imports are
// refused (UNAVAILABLE) while the server drains.
//
// Thread-safety: gRPC calls each reactor in turn, never at once (one
// operation outstanding at a time). Ownership: a reactor deletes itself
// when gRPC is done with it; `pipeline` must outlive the stream.
#ifndef ATTNSERVE_SERVER_SESSION_TRANSFER_H_
#define ATTNSERVE_SERVER_SESSION_TRANSFER_H_

#include <cstddef>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/call_pipeline.h"

namespace attnserve {

// The most file bytes an export chunk carries.
inline constexpr size_t kExportChunkBytes = size_t{1} << 20;

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartExportSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    const CallPipeline* pipeline);

grpc::ServerReadReactor<grpc::ByteBuffer>* StartImportSession(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
    const CallPipeline* pipeline);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSION_TRANSFER_H_
