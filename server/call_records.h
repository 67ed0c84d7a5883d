// The server's record of every call the engine admits or refuses
// (engine/call_record.h): the metrics, the Open Inference Protocol's
// per-model statistics and the access log. Also the subject of a call whose
// request is a protobuf message.
//
// Thread-safety: CallRecords may be used from any thread; a MessageSubject
// is read on the thread that records its call. Ownership: CallRecords owns
// its statistics and log settings; the metrics and model repository must
// outlive it. A MessageSubject points to messages its front end owns.
#ifndef ATTNSERVE_SERVER_CALL_RECORDS_H_
#define ATTNSERVE_SERVER_CALL_RECORDS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "engine/call_record.h"
#include "google/protobuf/message.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/runtime_settings.h"
#include "server/statistics.h"

namespace attnserve {

// A call's protobuf request and response: its model (ModelOfRequest), its
// bytes and its description.
class MessageSubject final : public CallSubject {
 public:
  // `response` may be null (a call refused before it had one).
  MessageSubject(const google::protobuf::Message* request,
                 const google::protobuf::Message* response)
      : request_(request), response_(response) {}

  std::string Model() const override { return ModelOfRequest(*request_); }
  int64_t Bytes() const override;
  // "query=[2, 3, 8] key=[2, 5, 8] model=m": the shapes of the request's
  // tensors, the model and session it names and its step count (names
  // quoted and cut as status messages quote them: a client's newline must
  // not start a log line).
  std::string Describe() const override;

 private:
  const google::protobuf::Message* const request_;
  const google::protobuf::Message* const response_;
};

class CallRecords final : public CallRecorder {
 public:
  struct Options {
    Metrics* metrics = nullptr;               // required
    const ModelRepository* models = nullptr;  // null: built-in models only
    // Write one access-log line per call to stderr (at start: the logging
    // extension's log_info turns it on and off).
    bool access_log = false;
    // What --log_level lets through, for the logging extension's answer.
    bool log_warnings = true;
    bool log_errors = true;
  };
  explicit CallRecords(const Options& options)
      : metrics_(options.metrics),
        statistics_(options.models),
        log_settings_(options.access_log, options.log_warnings,
                      options.log_errors) {}

  void Record(const EngineCall& call, const absl::Status& status,
              const CallTimes& times, double flops) const override;

  // Per-model statistics of the calls recorded.
  const StatisticsTable& statistics() const { return statistics_; }
  // The logging extension's settings.
  LogSettings* log_settings() const { return &log_settings_; }

 private:
  Metrics* const metrics_;
  mutable StatisticsTable statistics_;
  mutable LogSettings log_settings_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_CALL_RECORDS_H_
