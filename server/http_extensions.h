// Triton's protocol extensions over HTTP/JSON, on the inference port
// beside the protocol's own endpoints (server/http_inference.h), with the
// same authentication:
//   GET  /v2/models/{m}[/versions/{v}]/config          model configuration
//   GET  /v2/models[/{m}[/versions/{v}]]/stats          statistics
//   POST /v2/repository/index                           {"ready": bool}
//   POST /v2/repository/models/{m}/load | /unload
//   GET  /v2/systemsharedmemory[/region/{r}]/status
//   POST /v2/systemsharedmemory/region/{r}/register     {"key", "offset",
//                                                        "byte_size"}
//   POST /v2/systemsharedmemory[/region/{r}]/unregister
//   /v2/cudasharedmemory/...                            400: not supported
//   GET|POST /v2/trace/setting, /v2/models/{m}/trace/setting
//   GET|POST /v2/logging                                (POST updates)
// Bodies and answers are Triton's JSON: the configuration object itself,
// {"model_stats": [...]}, index and status as arrays, {} for load,
// unload, register and unregister; errors {"error": message} with the
// status of their code.
//
// Thread-safety: free functions; the pipeline is thread-safe.
#ifndef ATTNSERVE_SERVER_HTTP_EXTENSIONS_H_
#define ATTNSERVE_SERVER_HTTP_EXTENSIONS_H_

#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "server/call_pipeline.h"
#include "server/http/http_server.h"

namespace attnserve {

struct ExtensionRoute {
  enum class Kind {
    kModelConfig,
    kModelStatistics,
    kRepositoryIndex,
    kRepositoryLoad,
    kRepositoryUnload,
    kSharedMemoryStatus,
    kSharedMemoryRegister,
    kSharedMemoryUnregister,
    kTraceSetting,
    kLogSettings,
  } kind;
  std::string model;         // empty: every model (statistics)
  std::string version;       // empty: the server's choice
  std::string region;        // empty: every region (status, unregister)
  bool cuda = false;         // shared memory: CUDA's, else system's
  bool post = false;         // else GET (and HEAD)
  bool get_or_post = false;  // either: GET reads, POST updates
};

// The extension endpoint `path` names, if any.
std::optional<ExtensionRoute> ExtensionRouteOf(absl::string_view path);

// Answers an authenticated request to `route` with its (decompressed)
// `body`.
HttpResponse HandleExtension(const ExtensionRoute& route,
                             absl::string_view body,
                             const CallPipeline& pipeline);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_HTTP_EXTENSIONS_H_
