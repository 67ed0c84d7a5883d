// attnserve: the attention inference server.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/row_ops.h"
#include "core/thread_budget.h"
#include "server/options.h"
#include "server/server.h"

ABSL_FLAG(std::string, host, attnserve::ServerOptions().host,
          "Address to listen on (0.0.0.0: every interface).");
ABSL_FLAG(int, port, attnserve::ServerOptions().port,
          "TCP port; 0 picks a free port.");
ABSL_FLAG(int, max_message_mb, attnserve::ServerOptions().max_message_mb,
          "Largest request and response message, in MiB.");
ABSL_FLAG(int, metrics_port, attnserve::ServerOptions().metrics_port,
          "Port of the Prometheus page GET /metrics (0: any free, -1: off).");
ABSL_FLAG(int, http_port, attnserve::ServerOptions().http_port,
          "Port of the Open Inference Protocol over HTTP/JSON, /v2/... (0: any "
          "free, -1: off).");
ABSL_FLAG(int, http_header_timeout_s,
          attnserve::ServerOptions().http_header_timeout_s,
          "Seconds an HTTP request head may take from its first byte.");
ABSL_FLAG(int, http_body_timeout_s,
          attnserve::ServerOptions().http_body_timeout_s,
          "Seconds an HTTP body (or a response being read) may go without "
          "progress.");
ABSL_FLAG(int, http_idle_timeout_s,
          attnserve::ServerOptions().http_idle_timeout_s,
          "Seconds an idle HTTP keep-alive connection stays open.");
ABSL_FLAG(int, http_max_connections,
          attnserve::ServerOptions().http_max_connections,
          "Open HTTP connections at most, per HTTP port.");
ABSL_FLAG(int, http_threads, attnserve::ServerOptions().http_threads,
          "Threads decoding HTTP requests (compute runs on the workers).");
ABSL_FLAG(std::string, log_level, attnserve::ServerOptions().log_level,
          "info (warnings and one access-log line per call), warning "
          "(problems such as a failed reload) or error (neither).");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve over TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificates: require client certificates they signed.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File of accepted bearer tokens, one per line.");
ABSL_FLAG(bool, reflection, attnserve::ServerOptions().reflection,
          "Serve gRPC server reflection (the API schema; needs no token). "
          "false: only health checks answer without a token.");
ABSL_FLAG(std::string, model_repository, "",
          "Folder of models: NAME/config.pbtxt and NAME/weights.safetensors. "
          "SIGHUP reloads it.");
ABSL_FLAG(int64_t, max_model_mb, attnserve::ServerOptions().max_model_mb,
          "Largest model file (config.pbtxt, weights.safetensors) loaded, "
          "MiB; a larger one is refused before it is read.");
ABSL_FLAG(int, threads, attnserve::ServerOptions().threads,
          "Compute threads shared by concurrent calls (0: all cores).");
ABSL_FLAG(int, drain_seconds, attnserve::ServerOptions().drain_seconds,
          "On SIGINT/SIGTERM, seconds from the signal until calls still "
          "running are cancelled.");
ABSL_FLAG(int, lame_duck_seconds, attnserve::ServerOptions().lame_duck_seconds,
          "First part of --drain_seconds: health says NOT_SERVING while calls "
          "are still served, then new calls get UNAVAILABLE (0: at once).");
ABSL_FLAG(int, max_connection_age_seconds,
          attnserve::ServerOptions().max_connection_age_seconds,
          "Close client connections after about this many seconds, so that "
          "load-balancing clients find new replicas (0: never).");
ABSL_FLAG(int, max_inflight, attnserve::ServerOptions().max_inflight,
          "Calls computing at once (0: one per compute thread).");
ABSL_FLAG(int, max_queue, attnserve::ServerOptions().max_queue,
          "Calls waiting beyond --max_inflight; more are refused at once.");
ABSL_FLAG(int64_t, max_tensor_elements,
          attnserve::ServerOptions().max_tensor_elements,
          "Largest tensor a request may carry, in elements.");
ABSL_FLAG(int64_t, max_shared_memory_mb,
          attnserve::ServerOptions().max_shared_memory_mb,
          "Most shared memory clients on this host may register at once, MiB "
          "(0: shared memory off).");
ABSL_FLAG(int64_t, max_session_memory_mb,
          attnserve::ServerOptions().max_session_memory_mb,
          "Key/value cache memory of all decode sessions together, MiB; past "
          "it the least recently used sessions are evicted (0: sessions "
          "off).");
ABSL_FLAG(int, session_idle_timeout_s,
          attnserve::ServerOptions().session_idle_timeout_s,
          "Seconds a decode session may sit idle before it is freed.");
ABSL_FLAG(std::string, session_dir, attnserve::ServerOptions().session_dir,
          "Durable decode sessions: evicted sessions, and every session on "
          "a drain, are saved here, and a session this server does not hold "
          "is looked for here (replicas sharing it hand sessions over); "
          "empty: off.");
ABSL_FLAG(int64_t, max_session_disk_mb,
          attnserve::ServerOptions().max_session_disk_mb,
          "Session files and journals in --session_dir together, MiB; past "
          "it the least recently written are removed, except the journals "
          "of running servers (0: no limit).");
ABSL_FLAG(bool, journal_sessions, attnserve::ServerOptions().journal_sessions,
          "With --session_dir: journal each session's full blocks of 512 "
          "tokens as they fill, so that a server that dies leaves them "
          "behind (its clients then resend only the tokens since).");
ABSL_FLAG(int, session_file_version,
          attnserve::ServerOptions().session_file_version,
          "With --session_dir: the newest session file format written: 3 "
          "saves a fork over a base file holding its shared prefix once; 2 "
          "saves every session whole, as releases before format 3 read "
          "(set it before rolling back to one).");
ABSL_FLAG(std::string, advertise_address,
          attnserve::ServerOptions().advertise_address,
          "With --session_dir: host:port other replicas reach this one's gRPC "
          "port at, to ask it for the sessions it holds (empty: this host's "
          "name, or 127.0.0.1 for a loopback --host, and the port).");
ABSL_FLAG(int, max_sessions, attnserve::ServerOptions().max_sessions,
          "Open decode sessions at most; one more evicts the least recently "
          "used.");
ABSL_FLAG(int64_t, max_session_length,
          attnserve::ServerOptions().max_session_length,
          "Tokens a decode session may hold, and the length of sessions "
          "created without max_length.");
ABSL_FLAG(int, max_steps_per_call,
          attnserve::ServerOptions().max_steps_per_call,
          "Steps one SessionSteps call may carry at most.");
ABSL_FLAG(int, coalesce_steps_us, attnserve::ServerOptions().coalesce_steps_us,
          "SessionStep calls that arrive together run as one batched pass; "
          "a pass waits up to this many microseconds for more steps, only "
          "when the pass before held more steps than have arrived (0: "
          "coalescing off).");
ABSL_FLAG(int64_t, max_request_memory_mb,
          attnserve::ServerOptions().max_request_memory_mb,
          "Largest memory a call may need for results and intermediates, MiB.");

namespace {

attnserve::ServerOptions OptionsFromFlags() {
  attnserve::ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  options.lame_duck_seconds = absl::GetFlag(FLAGS_lame_duck_seconds);
  options.max_connection_age_seconds =
      absl::GetFlag(FLAGS_max_connection_age_seconds);
  options.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  options.max_queue = absl::GetFlag(FLAGS_max_queue);
  options.max_tensor_elements = absl::GetFlag(FLAGS_max_tensor_elements);
  options.max_request_memory_mb = absl::GetFlag(FLAGS_max_request_memory_mb);
  options.max_shared_memory_mb = absl::GetFlag(FLAGS_max_shared_memory_mb);
  options.max_session_memory_mb = absl::GetFlag(FLAGS_max_session_memory_mb);
  options.session_idle_timeout_s = absl::GetFlag(FLAGS_session_idle_timeout_s);
  options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.session_dir = absl::GetFlag(FLAGS_session_dir);
  options.max_session_disk_mb = absl::GetFlag(FLAGS_max_session_disk_mb);
  options.journal_sessions = absl::GetFlag(FLAGS_journal_sessions);
  options.session_file_version = absl::GetFlag(FLAGS_session_file_version);
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  options.max_session_length = absl::GetFlag(FLAGS_max_session_length);
  options.max_steps_per_call = absl::GetFlag(FLAGS_max_steps_per_call);
  options.coalesce_steps_us = absl::GetFlag(FLAGS_coalesce_steps_us);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.model_repository = absl::GetFlag(FLAGS_model_repository);
  options.max_model_mb = absl::GetFlag(FLAGS_max_model_mb);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.http_port = absl::GetFlag(FLAGS_http_port);
  options.http_header_timeout_s = absl::GetFlag(FLAGS_http_header_timeout_s);
  options.http_body_timeout_s = absl::GetFlag(FLAGS_http_body_timeout_s);
  options.http_idle_timeout_s = absl::GetFlag(FLAGS_http_idle_timeout_s);
  options.http_max_connections = absl::GetFlag(FLAGS_http_max_connections);
  options.http_threads = absl::GetFlag(FLAGS_http_threads);
  options.log_level = absl::GetFlag(FLAGS_log_level);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.reflection = absl::GetFlag(FLAGS_reflection);
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves attention, multi-head attention and LayerNorm over gRPC.\n"
      "Usage: attnserve [--host=0.0.0.0] [--port=50051]");
  absl::ParseCommandLine(argc, argv);
  // Debian's abseil is built without NDEBUG, which turns on absl::Mutex
  // deadlock detection: a lock-order graph updated on every lock that gRPC
  // takes, per call. Lock order is a property of the code, checked by its
  // tests, not something to pay for on every request.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const attnserve::ServerOptions options = OptionsFromFlags();
  // Before oneDNN's first primitive, which the cap must reach.
  if (const absl::Status isa = attnserve::ApplyCpuIsaSetting(); !isa.ok()) {
    std::fprintf(stderr, "attnserve: %s\n", std::string(isa.message()).c_str());
    return EXIT_FAILURE;
  }

  // Block the stop signals in every thread (gRPC's threads inherit this
  // mask), then wait for them synchronously below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto server = attnserve::AttnServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "attnserve: %s\n",
                 std::string(server.status().message()).c_str());
    return EXIT_FAILURE;
  }
  std::printf(
      "attnserve listening on %s (%d compute threads, metrics port %d, http "
      "port %d, isa %s)\n",
      attnserve::ListenAddress(options.host, (*server)->port()).c_str(),
      attnserve::ThreadBudget::Global().total(), (*server)->metrics_port(),
      (*server)->http_port(), attnserve::GetRowOps().isa);
  std::fflush(stdout);

  int signal_number = 0;
  // SIGHUP reloads the models; SIGINT and SIGTERM stop the server.
  while (sigwait(&stop_signals, &signal_number) == 0 &&
         signal_number == SIGHUP) {
    const absl::Status reloaded = (*server)->ReloadModels();
    if (reloaded.ok()) {
      std::printf("attnserve: models reloaded from %s\n",
                  options.model_repository.c_str());
    } else if (attnserve::ShouldLog(options,
                                    attnserve::LogSeverity::kWarning)) {
      std::printf("attnserve: reload failed, keeping the loaded models: %s\n",
                  std::string(reloaded.message()).c_str());
    }
    std::fflush(stdout);
  }
  std::printf("attnserve: signal %d, shutting down\n", signal_number);
  std::fflush(stdout);
  (*server)->Drain(absl::Seconds(options.lame_duck_seconds),
                   absl::Seconds(options.drain_seconds));
  (*server)->Wait();
  std::printf("attnserve: stopped\n");
  std::fflush(stdout);
  // Every call is done and the HTTP ports are closed. Skip the destructors:
  // the gRPC server's calls grpc_shutdown, which joins gRPC's executor
  // threads, and one of them may sleep in epoll until a timer up to 10 s
  // away (8-9 s after a 37 MB call), which only delays a rolling restart
  // past --drain_seconds.
  std::_Exit(EXIT_SUCCESS);
}
