// attnctl: the command-line client of an attnserve server. It runs an
// operation on tensors from a safetensors file (and writes the results to
// one), checks health, lists models, and measures the server under load.
//
//   attnctl attend|mha|layernorm|rmsnorm --target=HOST:PORT
//           --in=FILE.safetensors [--out=RESULT.safetensors] [--shared_memory]
//           [operation flags]
//   attnctl health --target=HOST:PORT [--service=NAME]
//   attnctl models --target=HOST:PORT [--model=NAME]
//   attnctl export --target=HOST:PORT --session_id=ID --out=FILE
//   attnctl import --target=HOST:PORT --in=FILE [--session_id=ID]
//   attnctl bench --target=HOST:PORT
//           --rpc=attend|mha|layernorm|rmsnorm|decode|health
//           [--batch --seq --kv_seq --dim --heads --dtype | --in=FILE]
//           [--batch_sessions=N (decode: one SessionSteps call of N sessions)]
//           [--cache_dtype=f32|bf16|int8 --layers=L (decode)]
//           [--protocol=native|open_inference|open_inference_stream|
//            open_inference_http --http_target=HOST:PORT (decode)]
//           [--model=NAME] [--shared_memory] [--concurrency=N]
//           [--connections=M] [--client_threads=T]
//           [--rate=R --arrival=constant|poisson --late_ms=MS]
//           [--duration_s=S | --requests=N] [--warmup_s=S]
//           [--format=text|json|csv] [--save_request=FILE] [--csv=FILE]
//           [--stability_percent=P --max_trials=N --window_s=S]
//           [--sweep=concurrency=N,N,...|rate=R,R,... --plot=FILE.svg]
//
// Every command also takes the connection flags --timeout_s,
// --max_message_mb, --tls_ca, --tls_cert, --tls_key, --token and
// --service_config.
//
// Operation flags: --causal, --scale, --temperature, --return_weights and
// --compute_bf16 (attend, mha); --num_heads, --average_weights and --model
// (mha); --eps and --normalized_ndim (layernorm, rmsnorm); --rms_norm
// (layernorm computing RMSNorm, as rmsnorm does). bench takes them
// too, but its synthetic mha requests take the head count from --heads.
// Operation parameters come from the flags, else from the input file's
// __metadata__ (causal, scale, temperature, num_heads, eps,
// normalized_ndim, rms_norm), else the server's defaults.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/bench/command.h"
#include "client/bench/decode.h"
#include "client/bench/load.h"
#include "client/bench/workload.h"
#include "client/client.h"
#include "client/requests.h"
#include "core/convert.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "core/status_macros.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address HOST:PORT.");
ABSL_FLAG(std::string, in, "", "Input safetensors file.");
ABSL_FLAG(std::string, out, "",
          "Output safetensors file (tensors `output` and `weights`).");
ABSL_FLAG(double, timeout_s, 60, "Deadline of the call, in seconds.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: connect over TLS and verify the server.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate chain, for servers that require one.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, token, "",
          "Bearer token sent as 'authorization: Bearer <token>'.");
ABSL_FLAG(int, max_message_mb, 256, "Largest message, in MiB.");
ABSL_FLAG(bool, causal, false, "Query i attends to keys j <= i.");
ABSL_FLAG(std::optional<float>, scale, std::nullopt,
          "Multiplies Q*K^T (default 1/sqrt(dk)).");
ABSL_FLAG(std::optional<float>, temperature, std::nullopt,
          "Divides the scaled logits (default 1).");
ABSL_FLAG(bool, return_weights, false, "Also return attention weights.");
ABSL_FLAG(bool, compute_bf16, false,
          "attend/mha: compute on the bfloat16 kernels (without it, every "
          "input dtype computes in float32).");
ABSL_FLAG(bool, average_weights, false,
          "mha: return weights averaged over heads.");
ABSL_FLAG(std::optional<int>, num_heads, std::nullopt, "mha: number of heads.");
ABSL_FLAG(bool, shared_memory, false,
          "attend, mha, layernorm, rmsnorm and bench: send tensors and receive "
          "results through a POSIX shared-memory object (server on this host "
          "only).");
ABSL_FLAG(std::string, model, "",
          "mha: the server-side model to use; models: the model to describe.");
ABSL_FLAG(std::optional<float>, eps, std::nullopt,
          "layernorm and rmsnorm: epsilon (default 1e-5; rmsnorm: the "
          "machine epsilon of the input's dtype).");
ABSL_FLAG(std::optional<int>, normalized_ndim, std::nullopt,
          "layernorm and rmsnorm: trailing dims normalized (default 1).");
ABSL_FLAG(bool, rms_norm, false,
          "layernorm: RMSNorm (torch.nn.RMSNorm) instead of LayerNorm.");
ABSL_FLAG(std::string, session_id, "",
          "export: the session to write to --out; import: the session --in "
          "holds, to resume an import cut short.");
ABSL_FLAG(std::string, service, "",
          "health: service to check (empty: the whole server).");
ABSL_FLAG(std::string, service_config, "",
          "JSON file with a gRPC service config (load balancing policy, "
          "retry policy), e.g. round_robin over an ipv4:A,B,C target.");
ABSL_FLAG(
    std::string, rpc, "",
    "bench: attend, mha, layernorm, rmsnorm, decode (steps of decode sessions "
    "holding --kv_seq tokens, --seq new tokens a step, one session per "
    "connection; --model or --heads/--kv_heads/--dim), or health (an "
    "empty gRPC health Check, the baseline of a call that computes "
    "nothing).");
ABSL_FLAG(int64_t, batch, 1, "bench: batch size of synthetic requests.");
ABSL_FLAG(
    int64_t, seq, 128,
    "bench: query length (layernorm, rmsnorm: rows per batch entry; 0 sends "
    "[batch, dim]).");
ABSL_FLAG(int64_t, kv_seq, 0, "bench: key/value length (0: --seq).");
ABSL_FLAG(int64_t, dim, 0,
          "bench: attend head dim (default 64), mha embedding dim (default "
          "512), layernorm and rmsnorm normalized dim (default 512).");
ABSL_FLAG(int64_t, heads, 8, "bench: attend, mha and decode heads.");
ABSL_FLAG(int64_t, kv_heads, 0,
          "bench: decode key/value heads (grouped-query attention; 0: "
          "--heads).");
ABSL_FLAG(int, batch_sessions, 0,
          "bench: decode: > 0 sends one SessionSteps call stepping this many "
          "sessions per connection instead of one SessionStep call (each "
          "connection its own sessions); the report adds steps/s.");
ABSL_FLAG(std::string, dtype, "f32",
          "bench: element type of synthetic inputs: f32, bf16 or f16.");
ABSL_FLAG(std::string, cache_dtype, "",
          "bench: decode: what the sessions' caches store: f32, bf16 or int8 "
          "(empty: the compute dtype, or a model's configured cache dtype).");
ABSL_FLAG(std::string, protocol, "native",
          "bench --rpc=decode: native (SessionStep, SessionSteps), "
          "open_inference (ModelInfer steps of sequences of attention_session "
          "or of --model's NAME_session, unary gRPC), open_inference_stream "
          "(the same over ModelStreamInfer, a stream per connection) or "
          "open_inference_http (the same over HTTP/1.1 to --http_target, a "
          "keep-alive connection each; both closed loop with --concurrency "
          "equal to --connections).");
ABSL_FLAG(std::string, http_target, "",
          "bench --rpc=decode --protocol=open_inference_http: the server's "
          "HTTP address, HOST:PORT (the sequences start over gRPC at "
          "--target).");
ABSL_FLAG(int, layers, 1,
          "bench: decode: layers each session holds; a token is one step per "
          "layer (one call per layer, of all the connection's sessions with "
          "--batch_sessions); the report adds tokens/s.");
ABSL_FLAG(int, concurrency, 1,
          "bench: calls in flight (closed loop), or the cap on outstanding "
          "calls (open loop).");
ABSL_FLAG(int, connections, 1,
          "bench: channels, each with its own connection.");
ABSL_FLAG(int, client_threads, 0,
          "bench: threads driving the calls (0: one per connection, at most "
          "the cores attnctl may run on).");
ABSL_FLAG(double, rate, 0,
          "bench: > 0 runs open loop at this many requests per second.");
ABSL_FLAG(std::string, arrival, "constant",
          "bench: open-loop spacing of sends: constant or poisson.");
ABSL_FLAG(double, duration_s, 10, "bench: measured seconds.");
ABSL_FLAG(int64_t, requests, 0,
          "bench: > 0 measures exactly this many calls instead.");
ABSL_FLAG(double, warmup_s, 1, "bench: seconds sent first and not counted.");
ABSL_FLAG(double, late_ms, 1,
          "bench: an open-loop send this late counts as late.");
ABSL_FLAG(std::string, format, "text", "bench: report as text, json or csv.");
ABSL_FLAG(std::string, sweep, "",
          "bench: concurrency=1,2,4,... or rate=R1,R2,...: one run per value "
          "and a throughput-versus-latency table.");
ABSL_FLAG(std::string, plot, "",
          "bench: with --sweep, write latency percentiles against "
          "throughput to this SVG file.");
ABSL_FLAG(std::string, save_request, "",
          "bench: write the request as a gRPC-framed HTTP/2 body (for h2load "
          "-d).");
ABSL_FLAG(std::string, csv, "",
          "bench: also write perf_analyzer's CSV (its -f FILE) here: one row "
          "per level (the run, or each sweep value), latencies in "
          "microseconds.");
ABSL_FLAG(std::optional<double>, stability_percent, std::nullopt,
          "bench: measure in windows, under continuous load, until the last 3 "
          "windows' throughput and mean latency each vary by less than this "
          "percentage (perf_analyzer's --stability-percentage); the report "
          "covers those 3 windows. 0 never settles: --max_trials windows.");
ABSL_FLAG(std::optional<int>, max_trials, std::nullopt,
          "bench: with --stability_percent, the most windows (default 10); "
          "unstable after them, the report is still written and attnctl "
          "exits 1.");
ABSL_FLAG(std::optional<double>, window_s, std::nullopt,
          "bench: with --stability_percent, seconds of each window (default: "
          "--duration_s).");

namespace attnserve {
namespace {

// Everything attnctl takes from its command line.
struct AttnctlOptions {
  // attend, mha, layernorm, rmsnorm, health, models or bench.
  std::string command;
  // --target, --timeout_s, --max_message_mb, --tls_ca, --tls_cert,
  // --tls_key, --token and --service_config.
  ClientOptions client;
  // --in: the request's tensors (required by attend, mha, layernorm and
  // rmsnorm; bench uses it instead of synthetic shapes).
  std::string in_path;
  // --out: where to write the results; empty: only print a summary.
  std::string out_path;
  // Operation flags; unset ones fall back to the input file's metadata.
  bool causal = false;
  std::optional<float> scale;
  std::optional<float> temperature;
  std::optional<int> num_heads;
  std::optional<float> eps;
  std::optional<int> normalized_ndim;
  bool rms_norm = false;
  bool return_weights = false;
  bool average_weights = false;
  bool compute_bf16 = false;
  // --shared_memory: tensors travel through a shared-memory object.
  bool shared_memory = false;
  // --model: mha and bench, the server-side model to call; models, the
  // model to describe.
  std::string model;
  // health: the service to check; empty: the whole server.
  std::string service;
  // export and import: --session_id.
  std::string session_id;
  // bench: the operation (--rpc), synthetic shapes and the load test.
  std::string rpc;
  SyntheticShape shape;
  // bench --rpc=decode: key/value heads (0: shape.heads).
  int64_t kv_heads = 0;
  // bench --rpc=decode: sessions each SessionSteps call steps (0: single
  // SessionStep calls).
  int batch_sessions = 0;
  // bench --rpc=decode: --cache_dtype (unset: the server's default) and
  // --layers.
  std::optional<DType> cache_dtype;
  int layers = 1;
  // bench --rpc=decode: the wire API of the steps (--protocol) and the
  // HTTP address of open_inference_http (--http_target).
  DecodeProtocol protocol = DecodeProtocol::kNative;
  std::string http_target;
  BenchCommandOptions bench;
};

absl::StatusOr<DType> ParseDtypeFlag(absl::string_view name) {
  if (name == "f32") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "f16") return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype: '", name, "' is not one of f32, bf16, f16"));
}

// --cache_dtype: empty (unset), f32, bf16 or int8.
absl::StatusOr<std::optional<DType>> ParseCacheDtypeFlag(
    absl::string_view name) {
  if (name.empty()) return std::nullopt;
  if (name == "f32") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "int8") return DType::kInt8;
  return absl::InvalidArgumentError(absl::StrCat(
      "--cache_dtype: '", name, "' is not one of f32, bf16, int8"));
}

// The contents of the file a flag names ("" for an empty flag).
absl::StatusOr<std::string> FlagFile(const std::string& path,
                                     absl::string_view flag) {
  if (path.empty()) return std::string();
  return ReadFileToString(path, flag);
}

absl::StatusOr<AttnctlOptions> OptionsFromFlags(const std::string& command) {
  AttnctlOptions options;
  ATTN_ASSIGN_OR_RETURN(options.client.tls_ca_pem,
                        FlagFile(absl::GetFlag(FLAGS_tls_ca), "--tls_ca"));
  ATTN_ASSIGN_OR_RETURN(options.client.tls_cert_pem,
                        FlagFile(absl::GetFlag(FLAGS_tls_cert), "--tls_cert"));
  ATTN_ASSIGN_OR_RETURN(options.client.tls_key_pem,
                        FlagFile(absl::GetFlag(FLAGS_tls_key), "--tls_key"));
  options.client.token = absl::GetFlag(FLAGS_token);
  options.command = command;
  options.client.target = absl::GetFlag(FLAGS_target);
  options.client.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.client.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.in_path = absl::GetFlag(FLAGS_in);
  options.out_path = absl::GetFlag(FLAGS_out);
  options.causal = absl::GetFlag(FLAGS_causal);
  options.scale = absl::GetFlag(FLAGS_scale);
  options.temperature = absl::GetFlag(FLAGS_temperature);
  options.num_heads = absl::GetFlag(FLAGS_num_heads);
  options.eps = absl::GetFlag(FLAGS_eps);
  options.normalized_ndim = absl::GetFlag(FLAGS_normalized_ndim);
  options.rms_norm = absl::GetFlag(FLAGS_rms_norm);
  options.return_weights = absl::GetFlag(FLAGS_return_weights);
  options.average_weights = absl::GetFlag(FLAGS_average_weights);
  options.compute_bf16 = absl::GetFlag(FLAGS_compute_bf16);
  options.model = absl::GetFlag(FLAGS_model);
  options.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  options.service = absl::GetFlag(FLAGS_service);
  options.session_id = absl::GetFlag(FLAGS_session_id);
  ATTN_ASSIGN_OR_RETURN(
      options.client.service_config_json,
      FlagFile(absl::GetFlag(FLAGS_service_config), "--service_config"));
  options.rpc = absl::GetFlag(FLAGS_rpc);
  options.shape.batch = absl::GetFlag(FLAGS_batch);
  options.shape.seq = absl::GetFlag(FLAGS_seq);
  options.shape.kv_seq = absl::GetFlag(FLAGS_kv_seq);
  options.shape.dim = absl::GetFlag(FLAGS_dim);
  options.shape.heads = absl::GetFlag(FLAGS_heads);
  options.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  options.batch_sessions = absl::GetFlag(FLAGS_batch_sessions);
  ATTN_ASSIGN_OR_RETURN(options.shape.dtype,
                        ParseDtypeFlag(absl::GetFlag(FLAGS_dtype)));
  ATTN_ASSIGN_OR_RETURN(options.cache_dtype,
                        ParseCacheDtypeFlag(absl::GetFlag(FLAGS_cache_dtype)));
  options.layers = absl::GetFlag(FLAGS_layers);
  ATTN_ASSIGN_OR_RETURN(options.protocol,
                        ParseDecodeProtocol(absl::GetFlag(FLAGS_protocol)));
  options.http_target = absl::GetFlag(FLAGS_http_target);
  LoadOptions& load = options.bench.load;
  load.concurrency = absl::GetFlag(FLAGS_concurrency);
  load.connections = absl::GetFlag(FLAGS_connections);
  load.threads = absl::GetFlag(FLAGS_client_threads);
  load.rate = absl::GetFlag(FLAGS_rate);
  ATTN_ASSIGN_OR_RETURN(load.arrival,
                        ParseArrival(absl::GetFlag(FLAGS_arrival)));
  load.duration = absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  load.requests = absl::GetFlag(FLAGS_requests);
  load.warmup = absl::Seconds(absl::GetFlag(FLAGS_warmup_s));
  load.late_threshold = absl::Milliseconds(absl::GetFlag(FLAGS_late_ms));
  ATTN_ASSIGN_OR_RETURN(options.bench.format,
                        ParseReportFormat(absl::GetFlag(FLAGS_format)));
  options.bench.sweep = absl::GetFlag(FLAGS_sweep);
  options.bench.plot_path = absl::GetFlag(FLAGS_plot);
  options.bench.save_request_path = absl::GetFlag(FLAGS_save_request);
  options.bench.csv_path = absl::GetFlag(FLAGS_csv);
  options.bench.stability.percent = absl::GetFlag(FLAGS_stability_percent);
  options.bench.stability.max_trials = absl::GetFlag(FLAGS_max_trials);
  options.bench.stability.window_s = absl::GetFlag(FLAGS_window_s);
  return options;
}

// The decode workload --rpc=decode asks for.
DecodeBenchOptions DecodeOptionsOf(const AttnctlOptions& options) {
  DecodeBenchOptions decode;
  decode.model = options.model;
  decode.kv_seq = options.shape.kv_seq;
  decode.step_tokens = options.shape.seq;
  decode.heads = options.shape.heads;
  decode.kv_heads = options.kv_heads;
  decode.head_dim = options.shape.dim > 0 ? options.shape.dim : 64;
  decode.dtype = options.shape.dtype;
  decode.cache_dtype = options.cache_dtype;
  decode.layers = options.layers;
  decode.sessions = options.bench.load.connections;
  decode.batch_sessions = options.batch_sessions;
  decode.protocol = options.protocol;
  decode.http_target = options.http_target;
  decode.client = options.client;
  return decode;
}

// The flags only --rpc=decode reads are refused elsewhere rather than
// ignored: a benchmark that silently ran another workload misleads.
absl::Status VerifyDecodeOnlyFlags(const AttnctlOptions& options) {
  if (options.rpc == "decode") return absl::OkStatus();
  if (options.batch_sessions != 0) {
    return absl::InvalidArgumentError(
        "--batch_sessions: only for --rpc=decode");
  }
  if (options.cache_dtype.has_value()) {
    return absl::InvalidArgumentError("--cache_dtype: only for --rpc=decode");
  }
  if (options.layers != 1) {
    return absl::InvalidArgumentError("--layers: only for --rpc=decode");
  }
  if (options.protocol != DecodeProtocol::kNative) {
    return absl::InvalidArgumentError("--protocol: only for --rpc=decode");
  }
  if (!options.http_target.empty()) {
    return absl::InvalidArgumentError("--http_target: only for --rpc=decode");
  }
  return absl::OkStatus();
}

absl::Status VerifyOptions(const AttnctlOptions& options) {
  if (options.client.tls_cert_pem.empty() !=
      options.client.tls_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key: give both or neither");
  }
  if (options.client.target.empty()) {
    return absl::InvalidArgumentError("--target: must not be empty");
  }
  if (options.client.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--timeout_s: must be > 0");
  }
  if (options.client.max_message_mb < 1 ||
      options.client.max_message_mb > 2047) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_mb: ", options.client.max_message_mb,
                     " is not in [1, 2047]"));
  }
  if (options.command == "export" &&
      (options.session_id.empty() || options.out_path.empty())) {
    return absl::InvalidArgumentError(
        "export: --session_id and --out are required");
  }
  if (options.command == "import" && options.in_path.empty()) {
    return absl::InvalidArgumentError("import: --in is required");
  }
  if (options.command == "bench" && options.rpc.empty()) {
    return absl::InvalidArgumentError(
        "--rpc: missing (attend, mha, layernorm, rmsnorm, decode or health)");
  }
  if (options.rpc == "decode" &&
      options.bench.load.concurrency > options.bench.load.connections) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--concurrency: ", options.bench.load.concurrency, " > --connections ",
        options.bench.load.connections,
        "; --rpc=decode steps one session per connection, and steps of one "
        "session run one after another"));
  }
  // Checked before the sequences are started.
  if (options.protocol == DecodeProtocol::kOpenInferenceStream ||
      options.protocol == DecodeProtocol::kOpenInferenceHttp) {
    ATTN_RETURN_IF_ERROR(VerifyOneCallPerConnection(options.bench.load));
  }
  if (options.command == "bench") {
    ATTN_RETURN_IF_ERROR(VerifyDecodeOnlyFlags(options));
    if (options.rpc == "decode") {
      ATTN_RETURN_IF_ERROR(VerifyDecodeBenchOptions(DecodeOptionsOf(options)));
    }
    // Before any call: decode sessions are opened before the load starts.
    BenchCommandOptions bench = options.bench;
    bench.load.client = options.client;
    ATTN_RETURN_IF_ERROR(VerifyBenchCommandOptions(bench));
  }
  if (options.command != "health" && options.command != "models" &&
      options.command != "bench" && options.command != "export" &&
      options.command != "import" && options.in_path.empty()) {
    return absl::InvalidArgumentError("--in: missing (a .safetensors file)");
  }
  return absl::OkStatus();
}

// Flags override the file's metadata (--causal can only turn causal on).
absl::StatusOr<OpParams> Params(const AttnctlOptions& options,
                                const SafetensorsFile& file) {
  OpParams params;
  ATTN_RETURN_IF_ERROR(ApplyMetadata(file.metadata, &params));
  if (options.causal) params.causal = true;
  if (options.scale) params.scale = options.scale;
  if (options.temperature) params.temperature = options.temperature;
  if (options.num_heads) params.num_heads = *options.num_heads;
  if (options.eps) params.eps = options.eps;
  if (options.normalized_ndim)
    params.normalized_ndim = *options.normalized_ndim;
  if (options.rms_norm) params.rms_norm = true;
  params.return_weights = options.return_weights;
  params.average_weights = options.average_weights;
  params.compute_bf16 = options.compute_bf16;
  params.model = options.model;
  return params;
}

// Largest |a - b| over a float tensor and a reference of the same shape.
std::optional<double> MaxAbsDiff(const Tensor& got, const Tensor& expected) {
  if (got.shape() != expected.shape() || !IsFloating(got.dtype()) ||
      !IsFloating(expected.dtype())) {
    return std::nullopt;
  }
  auto a = Float32Data::From(got.view(), "output");
  auto b = Float32Data::From(expected.view(), "expected");
  if (!a.ok() || !b.ok()) return std::nullopt;
  double max_diff = 0;
  for (int64_t i = 0; i < got.num_elements(); ++i) {
    max_diff = std::max(
        max_diff, std::abs(static_cast<double>(a->data()[i]) - b->data()[i]));
  }
  return max_diff;
}

void PrintResults(const NamedTensors& results, const SafetensorsFile& input) {
  for (const auto& [name, tensor] : results) {
    std::printf("%s: %s %s", name.c_str(),
                std::string(DTypeName(tensor.dtype())).c_str(),
                ShapeString(tensor.shape()).c_str());
    if (const Tensor* expected = input.Find("expected_" + name)) {
      if (auto diff = MaxAbsDiff(tensor, *expected)) {
        std::printf(", max |diff| vs expected_%s = %.3g", name.c_str(), *diff);
      }
    }
    std::printf("\n");
  }
}

absl::Status RunOperation(const AttnctlOptions& options) {
  ATTN_ASSIGN_OR_RETURN(Operation op, ParseOperation(options.command));
  ATTN_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(options.in_path));
  ATTN_ASSIGN_OR_RETURN(OpParams params, Params(options, file));
  AttnClient client(options.client);
  ATTN_ASSIGN_OR_RETURN(
      NamedTensors results,
      client.Run(op, ViewsOf(file.tensors), params, options.shared_memory));
  PrintResults(results, file);
  if (!options.out_path.empty()) {
    ATTN_RETURN_IF_ERROR(
        WriteSafetensors(options.out_path, ViewsOf(results), {}));
    std::printf("wrote %s\n", options.out_path.c_str());
  }
  return absl::OkStatus();
}

absl::Status RunHealth(const AttnctlOptions& options) {
  AttnClient client(options.client);
  ATTN_ASSIGN_OR_RETURN(auto status, client.Health(options.service));
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(status)
                  .c_str());
  if (status != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError("not serving");
  }
  return absl::OkStatus();
}

// The file of session --session_id, written to --out (replaced only once
// whole).
absl::Status RunExport(const AttnctlOptions& options) {
  AttnClient client(options.client);
  const std::string partial = options.out_path + ".partial";
  std::FILE* out = std::fopen(partial.c_str(), "wb");
  if (out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out: cannot write ", partial));
  }
  uint64_t bytes = 0;
  absl::Status status = client.ExportSession(
      options.session_id, [&](absl::string_view data) -> absl::Status {
        bytes += data.size();
        if (std::fwrite(data.data(), 1, data.size(), out) != data.size()) {
          return absl::DataLossError(
              absl::StrCat("--out: writing ", partial, " failed"));
        }
        return absl::OkStatus();
      });
  if (std::fclose(out) != 0 && status.ok()) {
    status = absl::DataLossError(absl::StrCat("--out: closing ", partial));
  }
  if (status.ok() && std::rename(partial.c_str(), options.out_path.c_str())) {
    status = absl::DataLossError(absl::StrCat("--out: cannot rename ", partial,
                                              " to ", options.out_path));
  }
  if (!status.ok()) {
    std::remove(partial.c_str());
    return status;
  }
  std::printf("session %s: %llu bytes to %s\n", options.session_id.c_str(),
              static_cast<unsigned long long>(bytes), options.out_path.c_str());
  return absl::OkStatus();
}

// The session file --in, opened on the server under the id it holds.
absl::Status RunImport(const AttnctlOptions& options) {
  AttnClient client(options.client);
  ATTN_ASSIGN_OR_RETURN(const std::string file,
                        ReadFileToString(options.in_path, "--in"));
  ATTN_ASSIGN_OR_RETURN(const v1::ImportSessionResponse response,
                        client.ImportSession(file, options.session_id));
  std::printf("session %s: %llu bytes, tokens per layer %s\n",
              response.session_id().c_str(),
              static_cast<unsigned long long>(response.received()),
              absl::StrJoin(response.lengths(), ",").c_str());
  return absl::OkStatus();
}

// One line per model; with --model, that model's metadata.
absl::Status RunModels(const AttnctlOptions& options) {
  AttnClient client(options.client);
  if (!options.model.empty()) {
    ATTN_ASSIGN_OR_RETURN(auto metadata,
                          client.GetModelMetadata(options.model));
    std::printf("%s", metadata.DebugString().c_str());
    return absl::OkStatus();
  }
  ATTN_ASSIGN_OR_RETURN(auto list, client.ListModels());
  for (const auto& model : list.models()) {
    std::printf("%s heads=%d embed_dim=%lld\n", model.name().c_str(),
                model.num_heads(), static_cast<long long>(model.embed_dim()));
  }
  return absl::OkStatus();
}

// The bench request: from --in (with its metadata) or synthetic shapes. With
// --shared_memory its tensors go into an object registered through `client`
// for as long as `*session` lives.
absl::StatusOr<Workload> BenchWorkload(
    const AttnctlOptions& options, AttnClient& client,
    std::unique_ptr<SharedMemorySession>* session,
    std::unique_ptr<DecodeSessions>* decode) {
  // The cheapest call the server answers: a baseline for the others.
  if (options.rpc == "health") return HealthCheckWorkload();
  if (options.rpc == "decode") {
    ATTN_ASSIGN_OR_RETURN(
        *decode, DecodeSessions::Open(client, DecodeOptionsOf(options)));
    return (*decode)->workload();
  }
  ATTN_ASSIGN_OR_RETURN(Operation op, ParseOperation(options.rpc));
  RequestTransform transform;
  if (options.shared_memory) {
    transform = [&](google::protobuf::Message* request) -> absl::Status {
      std::optional<v1::GetModelMetadataResponse> model;
      if (!options.model.empty()) {
        ATTN_ASSIGN_OR_RETURN(model, client.GetModelMetadata(options.model));
      }
      ATTN_ASSIGN_OR_RETURN(
          *session, client.PlaceInSharedMemory(
                        request, model.has_value() ? &*model : nullptr));
      return absl::OkStatus();
    };
  }
  if (!options.in_path.empty()) {
    ATTN_ASSIGN_OR_RETURN(SafetensorsFile file,
                          ReadSafetensors(options.in_path));
    ATTN_ASSIGN_OR_RETURN(OpParams params, Params(options, file));
    return MakeWorkload(op, ViewsOf(file.tensors), params, transform);
  }
  ATTN_ASSIGN_OR_RETURN(
      NamedTensors tensors,
      SyntheticTensors(op, options.shape, !options.model.empty()));
  SafetensorsFile no_file;
  ATTN_ASSIGN_OR_RETURN(OpParams params, Params(options, no_file));
  if (op == Operation::kMultiHeadAttend && options.model.empty()) {
    params.num_heads = static_cast<int>(options.shape.heads);
  }
  return MakeWorkload(op, ViewsOf(tensors), params, transform);
}

absl::Status RunBench(const AttnctlOptions& options) {
  AttnClient client(options.client);
  std::unique_ptr<SharedMemorySession> session;
  std::unique_ptr<DecodeSessions> decode;
  ATTN_ASSIGN_OR_RETURN(const Workload workload,
                        BenchWorkload(options, client, &session, &decode));
  BenchCommandOptions bench = options.bench;
  bench.load.client = options.client;
  return RunBenchCommand(workload, bench, stdout, stderr);
}

absl::Status Run(const std::string& command) {
  ATTN_ASSIGN_OR_RETURN(const AttnctlOptions options,
                        OptionsFromFlags(command));
  ATTN_RETURN_IF_ERROR(VerifyOptions(options));
  if (options.command == "health") return RunHealth(options);
  if (options.command == "models") return RunModels(options);
  if (options.command == "export") return RunExport(options);
  if (options.command == "import") return RunImport(options);
  if (options.command == "bench") return RunBench(options);
  return RunOperation(options);
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attnctl attend|mha|layernorm|rmsnorm --target=HOST:PORT "
      "--in=FILE.safetensors [--out=FILE.safetensors] [--shared_memory] "
      "[--model=NAME] "
      "[operation flags]\n"
      "attnctl health --target=HOST:PORT [--service=NAME]\n"
      "attnctl models --target=HOST:PORT [--model=NAME]\n"
      "attnctl export --target=HOST:PORT --session_id=ID --out=FILE\n"
      "attnctl import --target=HOST:PORT --in=FILE [--session_id=ID]\n"
      "attnctl bench --target=HOST:PORT "
      "--rpc=attend|mha|layernorm|rmsnorm|decode|health "
      "[--batch --seq --kv_seq --dim --heads --kv_heads --dtype | --in=FILE] "
      "[decode: --batch_sessions=N --cache_dtype=f32|bf16|int8 --layers=L "
      "--protocol=native|open_inference|open_inference_stream|"
      "open_inference_http --http_target=HOST:PORT] "
      "[--model=NAME] [--shared_memory] [--concurrency=N --connections=M "
      "--client_threads=T | --rate=R --arrival=constant|poisson "
      "--late_ms=MS] [--duration_s=S | --requests=N] [--warmup_s=S] "
      "[--format=text|json|csv] [--sweep=concurrency=1,2,4 --plot=FILE.svg] "
      "[--save_request=FILE] [--csv=FILE] [--stability_percent=P "
      "--max_trials=N --window_s=S]\n"
      "Connection flags for every command: --timeout_s --max_message_mb "
      "--service_config --tls_ca --tls_cert --tls_key --token. "
      "--help lists every flag.");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  // Debian's abseil is built without NDEBUG, which turns on absl::Mutex
  // deadlock detection: a lock-order graph updated on every lock that gRPC
  // takes, per call. Lock order is a property of the code, checked by its
  // tests, not something to pay for on every request.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = args[1];
  if (command != "health" && command != "models" && command != "attend" &&
      command != "mha" && command != "layernorm" && command != "rmsnorm" &&
      command != "bench" && command != "export" && command != "import") {
    std::fprintf(stderr, "attnctl: unknown command '%s'\n%s\n", command.c_str(),
                 absl::ProgramUsageMessage().data());
    return 2;
  }
  const absl::Status status = attnserve::Run(command);
  if (!status.ok()) {
    std::fprintf(stderr, "attnctl: %s: %s\n",
                 absl::StatusCodeToString(status.code()).c_str(),
                 std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
