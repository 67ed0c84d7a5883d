#include "server/server.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/mutex.h"
#include "core/session_file.h"
#include "core/status_macros.h"
#include "core/thread_budget.h"
#include "core/verify.h"
#include "engine/scheduler.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "server/http_inference.h"

namespace attnserve {

namespace {

// Takes gRPC's reflection service out of a server: gRPC registers it in
// every builder once InitProtoReflectionServerBuilderPlugin has run.
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*
                         plugins) override {
    plugins->erase(
        std::remove_if(plugins->begin(), plugins->end(),
                       [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
                         return p->name() == "proto_server_reflection";
                       }),
        plugins->end());
  }
};

// Request headers (metadata) the server accepts, in all.
constexpr int kMaxMetadataBytes = 64 << 10;

// Message limits, port sharing, connection age and reflection from `options`.
void ConfigureBuilder(const ServerOptions& options,
                      grpc::ServerBuilder* builder) {
  const int max_bytes = options.max_message_mb * 1024 * 1024;
  builder->SetMaxReceiveMessageSize(max_bytes);
  builder->SetMaxSendMessageSize(max_bytes);
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would
  // silently share it instead of failing.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Headers up to kMaxMetadataBytes reach the handlers, so that an
  // oversized token gets UNAUTHENTICATED with its size
  // (TokenAuthenticator::kMaxTokenBytes) rather than gRPC's 8 KiB default
  // refusal, which some clients see as a closed connection.
  builder->AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  if (options.max_connection_age_seconds > 0) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                                options.max_connection_age_seconds * 1000);
    // Calls in flight on a closing connection finish as in a drain.
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                                options.drain_seconds * 1000);
  }
  if (!options.reflection) {
    builder->SetOption(std::make_unique<WithoutReflection>());
  }
}

// The bounds on HTTP clients, for both HTTP ports.
HttpServerOptions HttpOptionsFrom(const ServerOptions& options) {
  HttpServerOptions http;
  http.host = options.host;
  http.limits.max_body_bytes = static_cast<uint64_t>(options.max_message_mb)
                               << 20;
  http.header_timeout = absl::Seconds(options.http_header_timeout_s);
  http.body_timeout = absl::Seconds(options.http_body_timeout_s);
  http.idle_timeout = absl::Seconds(options.http_idle_timeout_s);
  http.max_connections = options.http_max_connections;
  http.handler_threads = options.http_threads;
  return http;
}

// Address space the decode sessions' caches may reserve together (each its
// whole max_length, committing pages as tokens fill them): 16 TiB, an
// eighth of x86-64's user address space, or half the process's RLIMIT_AS
// when that is lower. Past it, creating a session evicts the least recently
// used ones: mappings that filled the address space once made every later
// allocation fail (a LayerNorm answered UNIMPLEMENTED, the next crashed).
size_t SessionAddressSpace() {
  size_t bytes = size_t{16} << 40;
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    bytes = std::min<size_t>(bytes, limit.rlim_cur / 2);
  }
  return bytes;
}

// Protobuf's own log lines: one ERROR per string field of invalid UTF-8 it
// parses, i.e. one per such request (after authentication: the services
// parse only authenticated calls; reflection, open by design, parses before
// any). Written when the log level takes them, at most kProtobufLines a
// minute, then counted: a client must not be able to flood the log.
constexpr int kProtobufLines = 10;

struct ProtobufLog {
  Mutex mu;
  LogSeverity least = LogSeverity::kWarning;  // written from this on
  absl::Time window_start ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  int written ABSL_GUARDED_BY(mu) = 0;
  int64_t suppressed ABSL_GUARDED_BY(mu) = 0;
};

ProtobufLog& TheProtobufLog() {
  static ProtobufLog* const log = new ProtobufLog();
  return *log;
}

void WriteProtobufLine(google::protobuf::LogLevel level, const char* file,
                       int line, const std::string& message) {
  static constexpr const char* kNames[] = {"INFO", "WARNING", "ERROR", "FATAL"};
  const char* name = level >= 0 && level <= 3 ? kNames[level] : "LOG";
  ProtobufLog& log = TheProtobufLog();
  const LogSeverity severity =
      level == google::protobuf::LOGLEVEL_INFO    ? LogSeverity::kInfo
      : level == google::protobuf::LOGLEVEL_FATAL ? LogSeverity::kError
                                                  : LogSeverity::kWarning;
  MutexLock lock(&log.mu);
  if (level != google::protobuf::LOGLEVEL_FATAL) {
    if (severity < log.least) return;
    const absl::Time now = absl::Now();
    if (now - log.window_start >= absl::Minutes(1)) {
      if (log.suppressed > 0) {
        std::fprintf(stderr,
                     "[libprotobuf] %lld more lines in the last minute not "
                     "written (at most %d a minute)\n",
                     static_cast<long long>(log.suppressed), kProtobufLines);
      }
      log.window_start = now;
      log.written = 0;
      log.suppressed = 0;
    }
    if (log.written >= kProtobufLines) {
      ++log.suppressed;
      return;
    }
    ++log.written;
  }
  std::fprintf(stderr, "[libprotobuf %s %s:%d] %s\n", name, file, line,
               message.c_str());
}

void InstallProtobufLogHandler(const ServerOptions& options) {
  ProtobufLog& log = TheProtobufLog();
  {
    MutexLock lock(&log.mu);
    log.least = ShouldLog(options, LogSeverity::kInfo) ? LogSeverity::kInfo
                : ShouldLog(options, LogSeverity::kWarning)
                    ? LogSeverity::kWarning
                    : LogSeverity::kError;
  }
  google::protobuf::SetLogHandler(&WriteProtobufLine);
}

// Channels to the replicas this one asks for hand-overs, one per address,
// kept between hand-overs: a channel per hand-over paid a connection each
// time (about half of a small session's move on one host). At most
// kMaxPeers addresses are kept, the oldest dropped first; a channel whose
// call is UNAVAILABLE is dropped, so that a replica restarted at its
// address is reached through a fresh connection rather than a backed-off
// one. A replica that does not answer through a new channel is taken for
// down for kDownFor: the sessions a lost node held are then each asked of
// it at once, not each after a hand-over's whole deadline on a worker.
// Thread-safe.
class PeerChannels {
 public:
  static constexpr absl::Duration kDownFor = absl::Seconds(3);

  explicit PeerChannels(std::shared_ptr<grpc::ChannelCredentials> credentials)
      : credentials_(std::move(credentials)) {}

  // The channel to `address` (`*made`: made now), or null while the
  // replica there is taken for down.
  std::shared_ptr<grpc::Channel> Of(const std::string& address, bool* made) {
    MutexLock lock(&mu_);
    Peer& peer = Find(address);
    *made = false;
    if (absl::Now() < peer.down_until) return nullptr;
    if (peer.channel == nullptr) {
      peer.channel = grpc::CreateChannel(address, credentials_);
      *made = true;
    }
    return peer.channel;
  }
  // Drops `channel`, the one to `address` (unless another replaced it).
  void Drop(const std::string& address,
            const std::shared_ptr<grpc::Channel>& channel) {
    MutexLock lock(&mu_);
    const auto it = peers_.find(address);
    if (it != peers_.end() && it->second.channel == channel) {
      it->second.channel = nullptr;
    }
  }
  // Takes the replica at `address` for down for kDownFor.
  void MarkDown(const std::string& address) {
    MutexLock lock(&mu_);
    Peer& peer = Find(address);
    peer.channel = nullptr;
    peer.down_until = absl::Now() + kDownFor;
  }

 private:
  static constexpr size_t kMaxPeers = 64;
  struct Peer {
    std::shared_ptr<grpc::Channel> channel;
    absl::Time down_until = absl::InfinitePast();
  };
  // The entry of `address`, added (and the oldest dropped) if new.
  Peer& Find(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto [it, added] = peers_.try_emplace(address);
    if (!added) return it->second;
    order_.push_back(address);
    if (order_.size() > kMaxPeers) {
      peers_.erase(order_.front());
      order_.pop_front();
    }
    return peers_.at(address);
  }

  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  Mutex mu_;
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);
};

// Asks the replica at `address` to hand session `id` over (its
// HandOverSession), within a few seconds in all; once more through a new
// channel when a kept one is UNAVAILABLE (the replica may have restarted
// since). UNAVAILABLE at once while the replica is taken for down.
absl::Status AskToHandOver(absl::string_view id, absl::string_view address,
                           PeerChannels& peers, const std::string& token) {
  const std::string target(address);
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(5);
  grpc::Status status;
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool made = false;
    const std::shared_ptr<grpc::Channel> channel = peers.Of(target, &made);
    if (channel == nullptr) {
      return absl::UnavailableError(absl::StrCat(
          "replica ", address, " did not answer a hand-over in the last ",
          absl::FormatDuration(PeerChannels::kDownFor),
          "; not asked for session ", id));
    }
    const std::unique_ptr<v1::AttentionService::Stub> peer =
        v1::AttentionService::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(deadline);
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::HandOverSessionRequest request;
    request.set_session_id(std::string(id));
    request.set_file_version(kSessionFileVersion);
    v1::HandOverSessionResponse response;
    status = peer->HandOverSession(&context, request, &response);
    if (status.ok()) return absl::OkStatus();
    const grpc::StatusCode code = status.error_code();
    // Silent, or not there (no connection: not the replica's own answer).
    if (code == grpc::StatusCode::DEADLINE_EXCEEDED ||
        (made && code == grpc::StatusCode::UNAVAILABLE &&
         channel->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE)) {
      peers.MarkDown(target);
      break;
    }
    if (code != grpc::StatusCode::UNAVAILABLE) break;  // it answered
    peers.Drop(target, channel);
  }
  return absl::UnavailableError(
      absl::StrCat("replica ", address, " did not hand session ", id,
                   " over: ", status.error_message()));
}

// The address peers reach this replica's gRPC port at.
std::string AdvertisedAddress(const ServerOptions& options, int port) {
  if (!options.advertise_address.empty()) return options.advertise_address;
  if (options.host == "127.0.0.1" || options.host == "localhost" ||
      options.host == "::1") {
    return absl::StrCat("127.0.0.1:", port);
  }
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "";
  return absl::StrCat(name, ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Start(
    const ServerOptions& options) {
  ATTN_RETURN_IF_ERROR(VerifyServerOptions(options));
  ThreadBudget::Global().SetTotal(options.threads);
  InstallProtobufLogHandler(options);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<AttnServer> server(new AttnServer());
  ATTN_RETURN_IF_ERROR(server->StartState(options));
  ATTN_RETURN_IF_ERROR(server->StartGrpc(options));
  ATTN_RETURN_IF_ERROR(server->StartHttp(options));
  server->server_->GetHealthCheckService()->SetServingStatus(
      v1::AttentionService::service_full_name(), true);
  return server;
}

absl::Status AttnServer::StartSessions(const ServerOptions& options) {
  if (options.max_session_memory_mb > 0) {
    SessionStore::Options sessions;
    sessions.max_bytes = static_cast<size_t>(options.max_session_memory_mb)
                         << 20;
    sessions.idle_timeout = absl::Seconds(options.session_idle_timeout_s);
    sessions.max_sessions = options.max_sessions;
    sessions.max_reserved_bytes = SessionAddressSpace();
    if (models_ != nullptr) {
      // A model a reload replaced, kept alive by sessions, takes budget.
      const ModelRepository* models = models_.get();
      sessions.model_served = [models](const MultiHeadLayer& layer) {
        for (const auto& model : models->List()) {
          if (model->layer.get() == &layer) return true;
        }
        return false;
      };
    }
    if (!options.session_dir.empty()) {
      ATTN_ASSIGN_OR_RETURN(
          session_directory_,
          SessionDirectory::Open(
              {.path = options.session_dir,
               .max_bytes = static_cast<uint64_t>(options.max_session_disk_mb)
                            << 20,
               // The largest session the budget holds, and its records.
               .max_file_bytes = (sessions.max_bytes + (size_t{1} << 20)) * 2,
               .file_version =
                   static_cast<uint32_t>(options.session_file_version)}));
      sessions.directory = session_directory_.get();
      sessions.journal = options.journal_sessions;
      ATTN_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> peers,
                            PeerCredentialsFor(options));
      std::string token;
      if (!options.auth_token_file.empty()) {
        ATTN_ASSIGN_OR_RETURN(
            std::unique_ptr<TokenAuthenticator> auth,
            TokenAuthenticator::FromFile(options.auth_token_file));
        token = auth->peer_token();
      }
      auto channels = std::make_shared<PeerChannels>(std::move(peers));
      sessions.reclaim = [channels, token](absl::string_view id,
                                           absl::string_view holder) {
        // Up to the hand-over's deadline: outside the compute slot.
        absl::Status asked;
        Scheduler::WaitOutsideSlot(
            [&] { asked = AskToHandOver(id, holder, *channels, token); });
        return asked;
      };
    }
    // A model session's layer, for sessions taken from files or imports.
    const ModelRepository* models = models_.get();
    sessions.layer_of = [models](absl::string_view model)
        -> absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> {
      if (models == nullptr) {
        return absl::NotFoundError(absl::StrCat(
            "model ", EchoString(model),
            " of a session file: this server has no model repository"));
      }
      ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const Model> found,
                            models->Find(model));
      return std::shared_ptr<const MultiHeadLayer>(found, found->layer.get());
    };
    sessions_ = std::make_unique<SessionStore>(sessions);
  }
  return absl::OkStatus();
}

void AttnServer::SaveSessions(absl::Time deadline) {
  if (sessions_ == nullptr || session_directory_ == nullptr) return;
  const absl::Time start = absl::Now();
  const SessionStore::SaveReport report = sessions_->SaveAll(deadline);
  if (report.sessions == 0 && report.failed == 0) return;
  std::printf(
      "attnserve: saved %lld sessions to %s in %lld ms",
      static_cast<long long>(report.sessions),
      session_directory_->path().c_str(),
      static_cast<long long>(absl::ToInt64Milliseconds(absl::Now() - start)));
  if (report.failed > 0) {
    std::printf("; %lld not saved: %s", static_cast<long long>(report.failed),
                report.first_error.ToString().c_str());
  }
  std::printf("\n");
  std::fflush(stdout);
}

void AttnServer::StartEngine(const ServerOptions& options) {
  const int threads = ThreadBudget::Global().total();
  EngineOptions engine;
  engine.max_inflight =
      options.max_inflight > 0 ? options.max_inflight : threads;
  engine.max_queue = options.max_queue;
  // A conservative first guess of the compute rate (20 GFLOP/s per thread),
  // replaced by measurements as calls complete.
  engine.initial_flops_per_second = 20e9 * threads;
  engine.thread_budget = &ThreadBudget::Global();
  engine.sessions = sessions_.get();
  engine.coalesce_wait = absl::Microseconds(options.coalesce_steps_us);
  engine.max_steps_per_pass = options.max_steps_per_call;
  engine.max_tensor_elements = options.max_tensor_elements;
  engine.max_request_bytes = options.max_request_memory_mb << 20;
  engine.recorder = records_.get();
  engine_ = std::make_unique<Engine>(engine);
}

absl::Status AttnServer::StartState(const ServerOptions& options) {
  if (!options.model_repository.empty()) {
    // A broken model stops start-up: better no server than a wrong one.
    models_ = std::make_unique<ModelRepository>(options.model_repository,
                                                options.max_model_mb);
    ATTN_RETURN_IF_ERROR(models_->Reload());
  }
  metrics_ = std::make_unique<Metrics>();
  if (!options.auth_token_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(
        auth_, TokenAuthenticator::FromFile(options.auth_token_file));
  }
  if (options.max_shared_memory_mb > 0) {
    shared_memory_ = std::make_unique<SharedMemoryRegistry>(
        static_cast<uint64_t>(options.max_shared_memory_mb) << 20);
  }
  records_ = std::make_unique<CallRecords>(CallRecords::Options{
      .metrics = metrics_.get(),
      .models = models_.get(),
      .access_log = ShouldLog(options, LogSeverity::kInfo),
      .log_warnings = ShouldLog(options, LogSeverity::kWarning),
      .log_errors = ShouldLog(options, LogSeverity::kError)});
  ATTN_RETURN_IF_ERROR(StartSessions(options));
  StartEngine(options);
  ServiceConfig config;
  config.engine = engine_.get();
  config.shared_memory = shared_memory_.get();
  config.sessions = sessions_.get();
  config.max_session_length = options.max_session_length;
  config.max_steps_per_call = options.max_steps_per_call;
  config.auth = auth_.get();
  config.records = records_.get();
  config.models = models_.get();
  config.repository = models_.get();
  pipeline_ = std::make_unique<CallPipeline>(config);
  return absl::OkStatus();
}

absl::Status AttnServer::StartGrpc(const ServerOptions& options) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                        ServerCredentialsFor(options));
  grpc_calls_ = std::make_unique<GrpcCalls>(pipeline_.get());
  service_ = std::make_unique<AttentionServiceImpl>(grpc_calls_.get());
  open_inference_service_ =
      std::make_unique<OpenInferenceService>(grpc_calls_.get());
  grpc::ServerBuilder builder;
  const std::string address = ListenAddress(options.host, options.port);
  builder.AddListeningPort(address, credentials, &port_);
  ConfigureBuilder(options, &builder);
  builder.RegisterService(service_.get());
  builder.RegisterService(open_inference_service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address,
                     " (address in use, or not an address of this host?)"));
  }
  if (session_directory_ != nullptr) {
    sessions_->SetHolder(AdvertisedAddress(options, port_));
  }
  return absl::OkStatus();
}

absl::Status AttnServer::StartHttp(const ServerOptions& options) {
  if (options.metrics_port >= 0) {
    HttpServerOptions metrics = HttpOptionsFrom(options);
    metrics.port = options.metrics_port;
    ATTN_ASSIGN_OR_RETURN(metrics_server_, StartMetricsServer(metrics, [this] {
                            return RenderMetrics();
                          }));
  }
  if (options.http_port >= 0) {
    HttpServerOptions http = HttpOptionsFrom(options);
    http.port = options.http_port;
    ATTN_ASSIGN_OR_RETURN(http_server_,
                          StartHttpInference(http, pipeline_.get()));
  }
  return absl::OkStatus();
}

std::string AttnServer::RenderMetrics() const {
  ServingGauges gauges;
  gauges.inflight = engine_->scheduler().inflight();
  gauges.queued = engine_->scheduler().queued();
  gauges.models_loaded =
      models_ != nullptr ? static_cast<int>(models_->List().size()) : 0;
  if (sessions_ != nullptr) gauges.sessions = sessions_->stats();
  if (engine_->step_coalescer() != nullptr) {
    const StepCoalescer::Stats coalesced = engine_->step_coalescer()->stats();
    gauges.step_passes = coalesced.passes;
    gauges.coalesced_steps = coalesced.steps;
  }
  return metrics_->Render(gauges);
}

absl::Status AttnServer::ReloadModels() {
  if (models_ == nullptr) {
    return absl::FailedPreconditionError(
        "no --model_repository: nothing to reload");
  }
  return models_->Reload();
}

AttnServer::~AttnServer() {
  Shutdown(absl::ZeroDuration());
  Wait();
}

void AttnServer::Drain(absl::Duration lame_duck, absl::Duration grace) {
  if (server_ == nullptr) return;
  const absl::Time deadline = absl::Now() + grace;
  // Load balancers and health-checking clients stop sending calls here
  // when they see NOT_SERVING; until they do, calls are served.
  server_->GetHealthCheckService()->SetServingStatus(false);
  engine_->MarkNotReady();
  absl::SleepFor(std::min(lame_duck, grace));
  // Calls that still come get a status that clients' retry policies retry.
  engine_->StopAcceptingCalls();
  // Once no admitted call runs, every session is saved for the replica that
  // takes over its clients, who meanwhile retry the refusals here (so they
  // find it there when this replica stops listening).
  if (session_directory_ != nullptr) {
    while (!engine_->idle() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    SaveSessions(std::max(deadline, absl::Now() + absl::Seconds(5)));
  }
  // gRPC 1.51's Server::Shutdown drops as CANCELLED, which clients do not
  // retry, every call not yet handed to a handler: requests still arriving
  // when it starts or while it tells connections to stop. So stop listening
  // once calls have stopped coming; clients that keep sending (they check
  // no health) get the GOAWAY after kMaxRefusing, which moves them to other
  // replicas sooner than refusals would.
  constexpr absl::Duration kQuiet = absl::Milliseconds(250);
  constexpr absl::Duration kMaxRefusing = absl::Seconds(1);
  const absl::Time refusing_since = absl::Now();
  const absl::Time stop_refusing =
      std::min(deadline, refusing_since + kMaxRefusing);
  while (absl::Now() < stop_refusing &&
         absl::Now() - std::max(refusing_since, engine_->last_refused()) <
             kQuiet) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  server_->GetHealthCheckService()->Shutdown();
  if (http_server_ != nullptr) http_server_->StopListening();
  server_->Shutdown(absl::ToChronoTime(deadline));
  // HTTP calls get the same deadline; then they are cancelled.
  if (http_server_ != nullptr) http_server_->Stop(deadline);
  http_server_.reset();
  // Sessions opened since (CreateSession is not refused while draining).
  SaveSessions(std::max(deadline, absl::Now() + absl::Seconds(5)));
}

void AttnServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace attnserve
