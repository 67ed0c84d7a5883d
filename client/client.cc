#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/shared_memory.h"
#include "core/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace attnserve {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

std::shared_ptr<grpc::Channel> CreateChannel(const ClientOptions& options,
                                             bool own_connection) {
  grpc::ChannelArguments args;
  const int max_bytes = options.max_message_mb * 1024 * 1024;
  args.SetMaxReceiveMessageSize(max_bytes);
  args.SetMaxSendMessageSize(max_bytes);
  if (!options.service_config_json.empty()) {
    args.SetServiceConfigJSON(options.service_config_json);
  }
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Retries only ever come from a service config's retry policy; without
  // one, the retry machinery is per-call overhead for nothing.
  if (options.service_config_json.empty()) {
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!options.tls_ca_pem.empty() || !options.tls_cert_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  return grpc::CreateCustomChannel(options.target, credentials, args);
}

void PrepareContext(const ClientOptions& options,
                    grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMicroseconds(options.timeout));
  if (!options.token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options.token);
  }
}

AttnClient::AttnClient(const ClientOptions& options)
    : options_(options), channel_(CreateChannel(options)) {
  stub_ = v1::AttentionService::NewStub(channel_);
  health_stub_ = grpc::health::v1::Health::NewStub(channel_);
  inference_stub_ = inference::GRPCInferenceService::NewStub(channel_);
}

template <typename Stub, typename Request, typename Response>
absl::StatusOr<Response> AttnClient::Call(
    Stub* stub,
    grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                 Response*),
    const Request& request) {
  grpc::ClientContext context;
  PrepareContext(options_, &context);
  Response response;
  grpc::Status status = (stub->*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status AttnClient::ExportStream(
    const v1::ExportSessionRequest& request,
    absl::FunctionRef<absl::Status(absl::string_view)> write, uint64_t& written,
    uint64_t& version) {
  grpc::ClientContext context;
  PrepareContext(options_, &context);
  std::unique_ptr<grpc::ClientReader<v1::ExportSessionChunk>> reader =
      stub_->ExportSession(&context, request);
  v1::ExportSessionChunk chunk;
  uint64_t size = 0;
  absl::Status written_status;
  while (written_status.ok() && reader->Read(&chunk)) {
    if (chunk.offset() != written) {
      written_status = absl::DataLossError(
          absl::StrCat("export: a chunk at offset ", chunk.offset(), " after ",
                       written, " bytes"));
      break;
    }
    written_status = write(chunk.data());
    written += chunk.data().size();
    version = chunk.version();
    size = chunk.size();
  }
  if (!written_status.ok()) {
    context.TryCancel();
    reader->Finish().IgnoreError();
    return written_status;
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (written != size) {
    return absl::UnavailableError(absl::StrCat(
        "export: the stream ended after ", written, " of ", size, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status AttnClient::ExportSession(
    const std::string& session_id,
    absl::FunctionRef<absl::Status(absl::string_view)> write) {
  uint64_t written = 0, version = 0;
  absl::Status status;
  for (int attempt = 0; attempt < 3; ++attempt) {
    v1::ExportSessionRequest request;
    request.set_session_id(session_id);
    request.set_offset(written);
    request.set_version(version);
    status = ExportStream(request, write, written, version);
    if (!absl::IsUnavailable(status)) break;
  }
  return status;
}

absl::StatusOr<v1::ImportSessionResponse> AttnClient::ImportStream(
    const std::string& session_id, absl::string_view file, uint64_t offset,
    size_t chunk_bytes) {
  grpc::ClientContext context;
  PrepareContext(options_, &context);
  v1::ImportSessionResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ImportSessionChunk>> writer =
      stub_->ImportSession(&context, &response);
  v1::ImportSessionChunk chunk;
  chunk.set_session_id(session_id);
  chunk.set_offset(offset);
  // Without bytes, one chunk naming the session (a question).
  bool sent = file.empty() ? writer->Write(chunk) : true;
  for (uint64_t at = offset; sent && at < file.size(); at += chunk_bytes) {
    chunk.set_offset(at);
    chunk.set_data(std::string(file.substr(at, chunk_bytes)));
    sent = writer->Write(chunk);
    chunk.clear_session_id();
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::ImportSessionResponse> AttnClient::ImportSession(
    absl::string_view file, const std::string& session_id, size_t chunk_bytes) {
  chunk_bytes = std::max<size_t>(chunk_bytes, 1);
  absl::StatusOr<v1::ImportSessionResponse> response;
  for (int attempt = 0; attempt < 3; ++attempt) {
    // With the session's id, an import under way goes on from where it got.
    std::string resumed;
    uint64_t offset = 0;
    if (!session_id.empty()) {
      const absl::StatusOr<v1::ImportSessionResponse> progress =
          ImportStream(session_id, "", 0, chunk_bytes);
      if (progress.ok()) {
        resumed = session_id;
        offset = progress->received();
      } else if (absl::IsUnavailable(progress.status())) {
        // The stream that broke may hold the import until the server sees
        // it end: ask again shortly.
        response = progress.status();
        absl::SleepFor(absl::Milliseconds(100 * (attempt + 1)));
        continue;
      } else if (!absl::IsNotFound(progress.status())) {
        return progress.status();
      }
    }
    response = ImportStream(resumed, file, offset, chunk_bytes);
    if (response.ok() && response->received() < response->size()) {
      response = absl::UnavailableError(
          absl::StrCat("import: the server took ", response->received(),
                       " of the file's ", response->size(), " bytes"));
    }
    if (!absl::IsUnavailable(response.status()) || session_id.empty()) break;
  }
  return response;
}

absl::StatusOr<v1::AttendResponse> AttnClient::Attend(
    const v1::AttendRequest& request) {
  return Call(stub_.get(), &v1::AttentionService::Stub::Attend, request);
}

absl::StatusOr<v1::MultiHeadAttendResponse> AttnClient::MultiHeadAttend(
    const v1::MultiHeadAttendRequest& request) {
  return Call(stub_.get(), &v1::AttentionService::Stub::MultiHeadAttend,
              request);
}

absl::StatusOr<v1::LayerNormResponse> AttnClient::LayerNorm(
    const v1::LayerNormRequest& request) {
  return Call(stub_.get(), &v1::AttentionService::Stub::LayerNorm, request);
}

absl::StatusOr<v1::RmsNormResponse> AttnClient::RmsNorm(
    const v1::RmsNormRequest& request) {
  return Call(stub_.get(), &v1::AttentionService::Stub::RmsNorm, request);
}

absl::StatusOr<v1::CreateSessionResponse> AttnClient::CreateSession(
    const v1::CreateSessionRequest& request) {
  return Call(stub_.get(), &v1::AttentionService::Stub::CreateSession, request);
}

absl::StatusOr<inference::ModelInferResponse> AttnClient::ModelInfer(
    const inference::ModelInferRequest& request) {
  return Call(inference_stub_.get(),
              &inference::GRPCInferenceService::Stub::ModelInfer, request);
}

absl::StatusOr<v1::SessionStepResponse> AttnClient::SessionStep(
    const v1::SessionStepRequest& request) {
  return Call(stub_.get(), &v1::AttentionService::Stub::SessionStep, request);
}

absl::StatusOr<v1::SessionStepsResponse> AttnClient::SessionSteps(
    const v1::SessionStepsRequest& request) {
  return Call(stub_.get(), &v1::AttentionService::Stub::SessionSteps, request);
}

absl::Status AttnClient::DeleteSession(const std::string& session_id) {
  v1::DeleteSessionRequest request;
  request.set_session_id(session_id);
  return Call(stub_.get(), &v1::AttentionService::Stub::DeleteSession, request)
      .status();
}

absl::Status AttnClient::HandOverSession(const std::string& session_id) {
  v1::HandOverSessionRequest request;
  request.set_session_id(session_id);
  return Call(stub_.get(), &v1::AttentionService::Stub::HandOverSession,
              request)
      .status();
}

absl::StatusOr<v1::ForkSessionResponse> AttnClient::ForkSession(
    const std::string& session_id, std::optional<int64_t> length) {
  v1::ForkSessionRequest request;
  request.set_session_id(session_id);
  if (length.has_value()) request.set_length(*length);
  return Call(stub_.get(), &v1::AttentionService::Stub::ForkSession, request);
}

absl::StatusOr<v1::ListModelsResponse> AttnClient::ListModels() {
  return Call(stub_.get(), &v1::AttentionService::Stub::ListModels,
              v1::ListModelsRequest());
}

absl::StatusOr<v1::GetModelMetadataResponse> AttnClient::GetModelMetadata(
    const std::string& name) {
  v1::GetModelMetadataRequest request;
  request.set_name(name);
  return Call(stub_.get(), &v1::AttentionService::Stub::GetModelMetadata,
              request);
}

absl::Status AttnClient::RegisterSharedMemory(
    const v1::SharedMemoryRegion& region) {
  v1::RegisterSharedMemoryRequest request;
  *request.mutable_region() = region;
  return Call(stub_.get(), &v1::AttentionService::Stub::RegisterSharedMemory,
              request)
      .status();
}

absl::Status AttnClient::UnregisterSharedMemory(const std::string& name) {
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  return Call(stub_.get(), &v1::AttentionService::Stub::UnregisterSharedMemory,
              request)
      .status();
}

absl::StatusOr<v1::ListSharedMemoryResponse> AttnClient::ListSharedMemory(
    const std::string& name) {
  v1::ListSharedMemoryRequest request;
  request.set_name(name);
  return Call(stub_.get(), &v1::AttentionService::Stub::ListSharedMemory,
              request);
}

SharedMemorySession::~SharedMemorySession() {
  // Best effort: a server that is gone has dropped the region anyway.
  (void)client_->UnregisterSharedMemory(region_);
}

absl::StatusOr<std::unique_ptr<SharedMemorySession>>
AttnClient::PlaceInSharedMemory(google::protobuf::Message* request,
                                const v1::GetModelMetadataResponse* model) {
  ATTN_ASSIGN_OR_RETURN(const SharedMemoryPlan plan,
                        PlanSharedMemory(*request, model));
  const std::string key =
      UniqueSharedMemoryKey(request->GetDescriptor()->name());
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SharedMemoryBuffer> buffer,
                        SharedMemoryBuffer::Create(key, plan.total_bytes));
  v1::SharedMemoryRegion region;
  region.set_name(key.substr(1));
  region.set_key(key);
  region.set_byte_size(plan.total_bytes);
  ATTN_RETURN_IF_ERROR(RegisterSharedMemory(region));
  std::unique_ptr<SharedMemorySession> session(
      new SharedMemorySession(this, std::move(buffer), region.name()));
  ATTN_RETURN_IF_ERROR(PlaceRequest(plan, session->placer(), request));
  return session;
}

namespace {

// A response's weights, when it has some.
template <typename Response>
const v1::Tensor* WeightsOf(const Response& response) {
  if constexpr (requires { response.weights(); }) {
    if (response.has_weights()) return &response.weights();
  }
  return nullptr;
}

}  // namespace

template <typename Request>
absl::StatusOr<NamedTensors> AttnClient::RunInSharedMemory(
    Request request, const v1::GetModelMetadataResponse* model) {
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SharedMemorySession> session,
                        PlaceInSharedMemory(&request, model));
  ATTN_ASSIGN_OR_RETURN(auto response, Send(request));
  return ResultTensors(response.output(), WeightsOf(response),
                       &session->placer());
}

template <typename Request>
absl::StatusOr<NamedTensors> AttnClient::RunRequest(
    Request request, bool shared_memory,
    const v1::GetModelMetadataResponse* model) {
  if (shared_memory) return RunInSharedMemory(std::move(request), model);
  ATTN_ASSIGN_OR_RETURN(auto response, Send(request));
  return ResultTensors(response.output(), WeightsOf(response));
}

absl::StatusOr<NamedTensors> AttnClient::Run(Operation op,
                                             const NamedViews& tensors,
                                             const OpParams& params,
                                             bool shared_memory) {
  switch (op) {
    case Operation::kAttend: {
      ATTN_ASSIGN_OR_RETURN(auto request, BuildAttendRequest(tensors, params));
      return RunRequest(std::move(request), shared_memory, nullptr);
    }
    case Operation::kMultiHeadAttend: {
      ATTN_ASSIGN_OR_RETURN(auto request,
                            BuildMultiHeadAttendRequest(tensors, params));
      if (!shared_memory || params.model.empty()) {
        return RunRequest(std::move(request), shared_memory, nullptr);
      }
      ATTN_ASSIGN_OR_RETURN(auto model, GetModelMetadata(params.model));
      return RunRequest(std::move(request), shared_memory, &model);
    }
    case Operation::kLayerNorm: {
      ATTN_ASSIGN_OR_RETURN(auto request,
                            BuildLayerNormRequest(tensors, params));
      return RunRequest(std::move(request), shared_memory, nullptr);
    }
    case Operation::kRmsNorm: {
      ATTN_ASSIGN_OR_RETURN(auto request, BuildRmsNormRequest(tensors, params));
      return RunRequest(std::move(request), shared_memory, nullptr);
    }
  }
  return absl::InvalidArgumentError("unknown operation");
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
AttnClient::Health(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  ATTN_ASSIGN_OR_RETURN(const grpc::health::v1::HealthCheckResponse response,
                        Call(health_stub_.get(),
                             &grpc::health::v1::Health::Stub::Check, request));
  return response.status();
}

}  // namespace attnserve
