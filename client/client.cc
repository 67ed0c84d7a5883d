#include "client/client.h"

#include <chrono>

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
}

template <typename Request, typename Response, typename Method>
absl::StatusOr<Response> AttnClient::Call(Method method,
                                          const Request& request) {
  grpc::ClientContext context;
  PrepareContext(options_, &context);
  Response response;
  grpc::Status status = method(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::AttendResponse> AttnClient::Attend(
    const v1::AttendRequest& request) {
  return Call<v1::AttendRequest, v1::AttendResponse>(
      [this](auto* c, const auto& req, auto* resp) {
        return stub_->Attend(c, req, resp);
      },
      request);
}

absl::StatusOr<v1::MultiHeadAttendResponse> AttnClient::MultiHeadAttend(
    const v1::MultiHeadAttendRequest& request) {
  return Call<v1::MultiHeadAttendRequest, v1::MultiHeadAttendResponse>(
      [this](auto* c, const auto& req, auto* resp) {
        return stub_->MultiHeadAttend(c, req, resp);
      },
      request);
}

absl::StatusOr<v1::LayerNormResponse> AttnClient::LayerNorm(
    const v1::LayerNormRequest& request) {
  return Call<v1::LayerNormRequest, v1::LayerNormResponse>(
      [this](auto* c, const auto& req, auto* resp) {
        return stub_->LayerNorm(c, req, resp);
      },
      request);
}

absl::StatusOr<v1::ListModelsResponse> AttnClient::ListModels() {
  return Call<v1::ListModelsRequest, v1::ListModelsResponse>(
      [this](auto* c, const auto& req, auto* resp) {
        return stub_->ListModels(c, req, resp);
      },
      v1::ListModelsRequest());
}

absl::StatusOr<v1::GetModelMetadataResponse> AttnClient::GetModelMetadata(
    const std::string& name) {
  v1::GetModelMetadataRequest request;
  request.set_name(name);
  return Call<v1::GetModelMetadataRequest, v1::GetModelMetadataResponse>(
      [this](auto* c, const auto& req, auto* resp) {
        return stub_->GetModelMetadata(c, req, resp);
      },
      request);
}

absl::StatusOr<NamedTensors> AttnClient::Run(Operation op,
                                             const NamedViews& tensors,
                                             const OpParams& params) {
  switch (op) {
    case Operation::kAttend: {
      ATTN_ASSIGN_OR_RETURN(auto request, BuildAttendRequest(tensors, params));
      ATTN_ASSIGN_OR_RETURN(auto response, Attend(request));
      return ResultTensors(response.output(), response.has_weights()
                                                  ? &response.weights()
                                                  : nullptr);
    }
    case Operation::kMultiHeadAttend: {
      ATTN_ASSIGN_OR_RETURN(auto request,
                            BuildMultiHeadAttendRequest(tensors, params));
      ATTN_ASSIGN_OR_RETURN(auto response, MultiHeadAttend(request));
      return ResultTensors(response.output(), response.has_weights()
                                                  ? &response.weights()
                                                  : nullptr);
    }
    case Operation::kLayerNorm: {
      ATTN_ASSIGN_OR_RETURN(auto request,
                            BuildLayerNormRequest(tensors, params));
      ATTN_ASSIGN_OR_RETURN(auto response, LayerNorm(request));
      return ResultTensors(response.output(), nullptr);
    }
  }
  return absl::InvalidArgumentError("unknown operation");
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
AttnClient::Health(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  auto response = Call<grpc::health::v1::HealthCheckRequest,
                       grpc::health::v1::HealthCheckResponse>(
      [this](auto* c, const auto& req, auto* resp) {
        return health_stub_->Check(c, req, resp);
      },
      request);
  if (!response.ok()) return response.status();
  return response->status();
}

}  // namespace attnserve
