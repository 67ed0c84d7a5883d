// Start-up options of the attnserve binary.
//
// ServerOptions is a plain value; the functions below only read their
// arguments and may be called from any thread.
#ifndef ATTNSERVE_SERVER_OPTIONS_H_
#define ATTNSERVE_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace attnserve {

struct ServerOptions {
  // Address to listen on: an IPv4/IPv6 literal or a host name. 0.0.0.0
  // listens on every interface.
  std::string host = "0.0.0.0";
  // TCP port; 0 picks a free one (the chosen port is printed at start-up).
  int port = 50051;
  // Largest request and response message, in MiB (1 to 2047).
  int max_message_mb = 256;
  // On SIGINT/SIGTERM: seconds from the signal until calls still running
  // are cancelled. The drain: health turns NOT_SERVING; after
  // lame_duck_seconds new compute calls are refused with UNAVAILABLE while
  // accepted ones finish; then the server stops listening and waits for the
  // rest of this time.
  int drain_seconds = 25;
  // The first part of drain_seconds: health reports NOT_SERVING but calls
  // are still served, so that load balancers and health-checking clients
  // move away before any call is refused (0: refuse at once). Less than
  // drain_seconds, so that calls accepted meanwhile have time to finish.
  int lame_duck_seconds = 2;
  // Close each client connection after about this many seconds (gRPC sends
  // GOAWAY; calls in flight get drain_seconds to finish), so that clients
  // balancing over a changing set of replicas (a Kubernetes headless
  // Service) reconnect and find new ones. 0: connections live on.
  int max_connection_age_seconds = 0;
  // Calls computing at once (0: one per compute thread).
  int max_inflight = 0;
  // Calls waiting for a worker beyond those; more get RESOURCE_EXHAUSTED.
  int max_queue = 64;
  // Largest tensor a request may carry, in elements.
  int64_t max_tensor_elements = int64_t{1} << 28;
  // Largest estimate of what a call allocates (results, intermediates), MiB.
  int64_t max_request_memory_mb = 4096;
  // Most shared memory clients on this host may register at once, MiB
  // (RegisterSharedMemory); 0 turns shared memory off.
  int64_t max_shared_memory_mb = 4096;
  // Decode sessions (CreateSession): the key/value cache memory of all
  // sessions together, MiB. A step that needs more evicts the least
  // recently used other sessions; 0 turns sessions off.
  int64_t max_session_memory_mb = 4096;
  // Seconds a session may sit idle (no step) before it is freed.
  int session_idle_timeout_s = 600;
  // Durable sessions: a directory (created if missing) where evicted
  // sessions, and every session on a drain, are saved as files, and where a
  // session this server does not hold is looked for (and taken up, its
  // file removed). Replicas that share it hand sessions over. Empty: off.
  std::string session_dir;
  // The session files and journals in session_dir together, MiB; past it
  // the least recently written are removed, except the journals of running
  // servers. 0: no limit.
  int64_t max_session_disk_mb = 16384;
  // With session_dir: keep a journal of every open session there, each
  // block of 512 tokens appended (off the step's path) once it fills, so
  // that a server that dies (SIGKILL, out of memory, a lost node) leaves its
  // sessions' full blocks behind for the next server asked for them.
  bool journal_sessions = true;
  // With session_dir: the newest session file format written. 3: a fork
  // is saved over a base file holding its shared prefix once; 2: every
  // session whole, which releases before format 3 read (set it before
  // rolling back to one).
  int session_file_version = 3;
  // With session_dir: the address ("host:port") other replicas reach this
  // one's gRPC port at, recorded beside each session it holds, so that a
  // replica asked for a session held here asks this one to hand it over.
  // Empty: this host's name (127.0.0.1 when `host` is a loopback address)
  // and the port it listens on.
  std::string advertise_address;
  // Open sessions at most; creating one more evicts the least recently used.
  int max_sessions = 10000;
  // Tokens a session's sequence may hold at most, and the length of
  // sessions created without max_length.
  int64_t max_session_length = 32768;
  // Steps one SessionSteps call may carry at most.
  int max_steps_per_call = 256;
  // SessionStep calls on different sessions that arrive together run as one
  // batched pass over their caches (as one SessionSteps call would). A pass
  // waits up to this many microseconds for more steps, and only when the
  // pass before it, which ended less than this long ago, held more steps
  // than have arrived (their clients are about to send the next ones): a
  // lone client never waits. 0 turns coalescing off (each call steps on
  // its own).
  int coalesce_steps_us = 200;
  // Port of the Prometheus metrics page (GET /metrics) on `host`; 0 picks a
  // free port, -1 turns it off.
  int metrics_port = 9090;
  // Port of the Open Inference Protocol over HTTP/JSON (/v2/...) on `host`;
  // 0 picks a free port, -1 turns it off. Bodies are limited to
  // max_message_mb, like gRPC messages.
  int http_port = 8000;
  // HTTP clients (both HTTP ports) are bounded so that slow or idle ones
  // cannot hold the server: a request head must arrive within
  // http_header_timeout_s of its first byte; a body (and a response the
  // client reads) must move at least once every http_body_timeout_s; an
  // idle keep-alive connection closes after http_idle_timeout_s; at most
  // http_max_connections are open per port (one more closes an idle one,
  // or is answered 503).
  int http_header_timeout_s = 10;
  int http_body_timeout_s = 30;
  int http_idle_timeout_s = 60;
  int http_max_connections = 1024;
  // Threads that decode HTTP requests and answer the cheap ones; compute
  // calls go on to the scheduler's workers.
  int http_threads = 2;
  // The least serious log lines written (ShouldLog): "info" adds one
  // access-log line per call on stderr to the warnings; "warning": problems
  // the server works around (a failed reload, which keeps the loaded
  // models); "error": neither. Start-up errors are always written.
  std::string log_level = "info";
  // TLS: PEM certificate chain and private key of the server. Both or
  // neither.
  std::string tls_cert;
  std::string tls_key;
  // Mutual TLS: PEM CA certificates; clients must present a certificate
  // signed by one of them. Needs tls_cert.
  std::string tls_client_ca;
  // File of accepted bearer tokens, one per line ('#' starts a comment).
  // When set, every AttentionService call needs the metadata
  // `authorization: Bearer <token>`; health checks and reflection do not.
  std::string auth_token_file;
  // Serve gRPC server reflection (the API's schema, for tools such as
  // grpcurl). It answers without a token: it tells only what the published
  // proto files tell, no models and no server state. false: only health
  // checks answer without one.
  bool reflection = true;
  // Model repository folder: NAME/config.pbtxt and NAME/weights.safetensors
  // per model. Empty: no models (weights come with each request).
  std::string model_repository;
  // Largest model file (config.pbtxt, weights.safetensors) loaded, MiB; a
  // larger one is refused before it is read (1 to 2^20). The same value as
  // kDefaultMaxModelMb (server/model_repository.h).
  int64_t max_model_mb = 4096;
  // Compute threads shared by all calls (0: the cores this process may
  // use). A call alone uses all of them; n concurrent calls get about
  // threads / n each (see core/thread_budget.h).
  int threads = 0;
};

// OK, or INVALID_ARGUMENT naming the flag that is out of range.
absl::Status VerifyServerOptions(const ServerOptions& options);

// How serious a log line is, least first.
enum class LogSeverity { kInfo, kWarning, kError };

// Whether a server started with `options` writes lines of `severity`: those
// at or above its log_level (which must be valid).
bool ShouldLog(const ServerOptions& options, LogSeverity severity);

// "host:port", with IPv6 literals bracketed.
std::string ListenAddress(const std::string& host, int port);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_OPTIONS_H_
