// A running attnserve gRPC server: AttentionService, the Open Inference
// Protocol's GRPCInferenceService, the grpc.health.v1 health service and
// server reflection, on one listening port.
//
// Ownership: AttnServer owns the gRPC server and the service. Thread-safety:
// Drain(), Shutdown() and Wait() may be called from any thread; Drain() and
// Shutdown() may be repeated (the destructor does).
#ifndef ATTNSERVE_SERVER_SERVER_H_
#define ATTNSERVE_SERVER_SERVER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/session_directory.h"
#include "core/session_store.h"
#include "engine/engine.h"
#include "grpcpp/server.h"
#include "server/attention_service.h"
#include "server/call_records.h"
#include "server/http/http_server.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/open_inference_service.h"
#include "server/options.h"

namespace attnserve {

class AttnServer {
 public:
  // Validates `options`, binds the port and starts serving.
  static absl::StatusOr<std::unique_ptr<AttnServer>> Start(
      const ServerOptions& options);
  ~AttnServer();

  // The bound port (the chosen one when options.port was 0).
  int port() const { return port_; }
  // The metrics page's port, or -1 when it is off.
  int metrics_port() const {
    return metrics_server_ != nullptr ? metrics_server_->port() : -1;
  }
  // The HTTP/JSON inference port, or -1 when it is off.
  int http_port() const {
    return http_server_ != nullptr ? http_server_->port() : -1;
  }
  // The metrics page's text.
  std::string RenderMetrics() const;

  // Reloads the model repository atomically: on success calls started
  // afterwards see the new models (calls in flight finish on the ones they
  // started with); on failure the current models stay and the error is
  // returned.
  absl::Status ReloadModels();

  // Drains, `grace` in all (see ServerOptions::drain_seconds):
  //  1. the lame duck: the health service says NOT_SERVING while calls are
  //     still served, for `lame_duck`;
  //  2. new compute calls are refused with UNAVAILABLE (retryable) while
  //     accepted ones (computing or queued) go on, until none has come for
  //     250 ms, or for 1 s at most;
  //  3. the server stops listening; accepted calls get the rest of `grace`,
  //     then are cancelled (they stop at their next block boundary).
  // Returns when every call is done.
  void Drain(absl::Duration lame_duck, absl::Duration grace);
  // Drain() without the lame duck.
  void Shutdown(absl::Duration grace) { Drain(absl::ZeroDuration(), grace); }
  // Blocks until the server has shut down.
  void Wait();

 private:
  AttnServer() = default;
  // Start's steps: the models, metrics, registries, sessions, the engine and
  // the call pipeline; the gRPC services and port; the HTTP ports.
  absl::Status StartState(const ServerOptions& options);
  // StartState's decode sessions (when on), then the engine over them.
  absl::Status StartSessions(const ServerOptions& options);
  void StartEngine(const ServerOptions& options);
  // Saves every session to --session_dir (a drain), by `deadline`.
  void SaveSessions(absl::Time deadline);
  absl::Status StartGrpc(const ServerOptions& options);
  absl::Status StartHttp(const ServerOptions& options);
  // Declared before server_: destroyed after it, once every call is done.
  std::unique_ptr<ModelRepository> models_;  // null: no repository
  std::unique_ptr<Metrics> metrics_;
  // What the engine records into; outlives it.
  std::unique_ptr<CallRecords> records_;
  std::unique_ptr<TokenAuthenticator> auth_;
  // Null when shared memory is off. Declared before the service and the
  // gRPC server, so that it is destroyed (its regions unmapped) after them.
  std::unique_ptr<SharedMemoryRegistry> shared_memory_;
  // Null when sessions are off; destroyed after the service, freeing every
  // session's cache.
  // Null without --session_dir; outlives the session store.
  std::unique_ptr<SessionDirectory> session_directory_;
  std::unique_ptr<SessionStore> sessions_;
  // Declared after the session store: destroyed (its queued work run, its
  // workers joined) before it.
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<CallPipeline> pipeline_;
  std::unique_ptr<GrpcCalls> grpc_calls_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<OpenInferenceService> open_inference_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HttpServer> metrics_server_;
  // Calls the pipeline: stopped before it is destroyed.
  std::unique_ptr<HttpServer> http_server_;
  int port_ = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SERVER_H_
