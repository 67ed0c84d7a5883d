#include "server/session_transfer.h"

#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.pb.h"
#include "core/session_store.h"
#include "core/status_macros.h"
#include "core/verify.h"
#include "grpcpp/server_context.h"
#include "server/auth.h"
#include "server/call_records.h"
#include "server/grpc_calls.h"
#include "server/grpc_status.h"
#include "server/handlers.h"

namespace attnserve {
namespace {

using ByteBuffer = grpc::ByteBuffer;

// The checks every transfer stream makes first: its token, and a server
// that keeps sessions.
absl::Status VerifyTransfer(grpc::CallbackServerContext& context,
                            const CallPipeline& pipeline) {
  const ServiceConfig& config = pipeline.config();
  if (config.auth != nullptr) ATTN_RETURN_IF_ERROR(config.auth->Check(context));
  if (config.sessions == nullptr) {
    return absl::FailedPreconditionError(
        "decode sessions are off on this server (--max_session_memory_mb=0)");
  }
  return absl::OkStatus();
}

// A stream's end in the metrics, statistics and access log, under `label`;
// `request` (may be null) describes it.
void RecordStream(const CallPipeline& pipeline, const std::string& label,
                  const google::protobuf::Message* request, absl::Time arrived,
                  const absl::Status& status) {
  const MessageSubject subject(request, nullptr);
  pipeline.engine().Record({.label = label,
                            .subject = request != nullptr ? &subject : nullptr,
                            .arrived = arrived},
                           status, absl::ZeroDuration(), absl::ZeroDuration());
}

class ExportReactor final : public grpc::ServerWriteReactor<ByteBuffer> {
 public:
  ExportReactor(grpc::CallbackServerContext* context, const ByteBuffer* raw,
                const CallPipeline* pipeline)
      : pipeline_(pipeline) {
    const absl::Status accepted = Accept(*context, *raw);
    if (!accepted.ok()) {
      End(accepted);
      return;
    }
    if (!WaitsForSession(pipeline_->config().sessions, request_.session_id())) {
      // On a worker after all when the session moved away meanwhile.
      const absl::Status opened = OpenExport(PeerWait::kRefused);
      if (!IsWouldWait(opened)) {
        Begin(opened);
        return;
      }
    }
    // Taking the session up may wait for a file or a peer's hand-over: on
    // a worker, never on gRPC's thread (see GrpcCalls::ServeWaitingState).
    RequestCost cost;
    cost.may_wait = true;
    const absl::Time deadline = DeadlineOf(*context);
    pipeline_->engine().Dispatch(
        cost, deadline,
        {.refuse = [this](const absl::Status& status) { End(status); },
         .here = [this] { Begin(OpenExport(PeerWait::kAllowed)); },
         .queued = [this, cost, deadline]() -> std::function<void()> {
           return [this, cost, deadline] {
             // Refused once its deadline passed in the queue, as calls are.
             absl::Duration took;
             Begin(pipeline_->engine().Compute(
                 cost, /*cancelled=*/nullptr, deadline,
                 [this] { return OpenExport(PeerWait::kAllowed); }, &took));
           };
         }});
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::CancelledError("the client went"));
    } else if (offset_ == export_->image.size()) {
      End(absl::OkStatus());
    } else {
      WriteNext();
    }
  }

  void OnDone() override { delete this; }

 private:
  void End(const absl::Status& status) {
    RecordStream(*pipeline_, "ExportSession", parsed_ ? &request_ : nullptr,
                 arrived_, status);
    Finish(ToGrpcStatus(status));
  }

  absl::Status Accept(grpc::CallbackServerContext& context,
                      const ByteBuffer& raw) {
    ATTN_RETURN_IF_ERROR(VerifyTransfer(context, *pipeline_));
    ATTN_RETURN_IF_ERROR(ParseMessage(raw, &request_));
    parsed_ = true;
    return absl::OkStatus();
  }

  // The first chunk once the export is open, or the end of the stream.
  void Begin(const absl::Status& opened) {
    if (opened.ok()) {
      WriteNext();
    } else {
      End(opened);
    }
  }

  absl::Status OpenExport(PeerWait wait) {
    const v1::ExportSessionRequest& request = request_;
    ATTN_ASSIGN_OR_RETURN(export_, pipeline_->config().sessions->ExportSession(
                                       request.session_id(), wait));
    const SessionFileImage& image = export_->image;
    if (request.version() != 0 && request.version() != image.version()) {
      return absl::AbortedError(absl::StrCat(
          "version: session ", EchoString(request.session_id(), '"'),
          " changed since the export began (a step or a rewind: version ",
          request.version(), ", now ", image.version(),
          "); export it again from offset 0"));
    }
    if (request.offset() > image.size()) {
      return absl::OutOfRangeError(absl::StrCat("offset: ", request.offset(),
                                                ", past the file's ",
                                                image.size(), " bytes"));
    }
    offset_ = request.offset();
    return absl::OkStatus();
  }

  // The next chunk, from offset_: as many records' bytes as fit.
  void WriteNext() {
    SessionFileImage& image = export_->image;
    chunk_.Clear();
    chunk_.set_offset(offset_);
    chunk_.set_size(image.size());
    chunk_.set_version(image.version());
    std::string& data = *chunk_.mutable_data();
    while (data.size() < kExportChunkBytes && offset_ < image.size()) {
      const absl::StatusOr<absl::string_view> piece =
          image.Read(offset_, kExportChunkBytes - data.size());
      if (!piece.ok()) {
        return End(absl::Status(
            piece.status().code(),
            absl::StrCat("session_id: ", piece.status().message(),
                         " at offset ", offset_,
                         "; export it again from offset 0, or fork it and "
                         "export the fork (a fork does not change)")));
      }
      data.append(piece->data(), piece->size());
      offset_ += piece->size();
    }
    buffer_.Clear();
    const absl::Status serialized = SerializeMessage(chunk_, &buffer_);
    if (!serialized.ok()) return End(serialized);
    StartWrite(&buffer_);
  }

  const CallPipeline* const pipeline_;
  const absl::Time arrived_ = absl::Now();
  v1::ExportSessionRequest request_;
  bool parsed_ = false;
  std::optional<SessionStore::Export> export_;
  uint64_t offset_ = 0;
  v1::ExportSessionChunk chunk_;
  ByteBuffer buffer_;
};

class ImportReactor final : public grpc::ServerReadReactor<ByteBuffer> {
 public:
  ImportReactor(grpc::CallbackServerContext* context, ByteBuffer* response,
                const CallPipeline* pipeline)
      : response_(response), pipeline_(pipeline) {
    absl::Status started = VerifyTransfer(*context, *pipeline);
    if (started.ok() && pipeline->engine().draining()) {
      started = absl::UnavailableError(
          "server is shutting down; import the session on another replica");
    }
    if (!started.ok()) {
      End(started);
      return;
    }
    sessions_ = pipeline->config().sessions;
    StartRead(&buffer_);
  }

  void OnReadDone(bool ok) override {
    // The client closed its side: the import answers how far it got.
    if (!ok) return Answer();
    const absl::Status taken = Take();
    if (!taken.ok()) return End(taken);
    StartRead(&buffer_);
  }

  void OnDone() override {
    if (sessions_ != nullptr) sessions_->EndImport(import_);
    delete this;
  }

 private:
  void End(const absl::Status& status) {
    // The import is let go before the answer leaves: a client that
    // resumes as soon as it has it finds the import free to claim.
    if (sessions_ != nullptr) sessions_->EndImport(import_);
    RecordStream(*pipeline_, "ImportSession", nullptr, arrived_, status);
    Finish(ToGrpcStatus(status));
  }

  absl::Status Take() {
    v1::ImportSessionChunk chunk;
    ATTN_RETURN_IF_ERROR(ParseMessage(buffer_, &chunk));
    if (!chunk.session_id().empty()) {
      if (chunks_ > 0 && chunk.session_id() != import_.id) {
        return absl::InvalidArgumentError(
            absl::StrCat("session_id: ", EchoString(chunk.session_id(), '"'),
                         " in chunk ", chunks_,
                         "; a stream imports one session, named in "
                         "its first chunk"));
      }
      if (chunks_ == 0) import_.id = chunk.session_id();
    }
    ++chunks_;
    return sessions_->ImportBytes(import_, chunk.offset(), chunk.data());
  }

  void Answer() {
    v1::ImportSessionResponse response;
    response.set_session_id(import_.id);
    response.set_received(import_.received);
    response.set_size(import_.size);
    for (int64_t length : import_.lengths) response.add_lengths(length);
    End(SerializeMessage(response, response_));
  }

  ByteBuffer* const response_;
  const CallPipeline* const pipeline_;
  const absl::Time arrived_ = absl::Now();
  SessionStore* sessions_ = nullptr;
  SessionStore::Import import_;
  int64_t chunks_ = 0;
  ByteBuffer buffer_;
};

}  // namespace

grpc::ServerWriteReactor<ByteBuffer>* StartExportSession(
    grpc::CallbackServerContext* context, const ByteBuffer* request,
    const CallPipeline* pipeline) {
  return new ExportReactor(context, request, pipeline);
}

grpc::ServerReadReactor<ByteBuffer>* StartImportSession(
    grpc::CallbackServerContext* context, ByteBuffer* response,
    const CallPipeline* pipeline) {
  return new ImportReactor(context, response, pipeline);
}

}  // namespace attnserve
