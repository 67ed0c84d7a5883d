// The call pipeline alone, with no front end and no server: a call handed
// to CallPipeline::Run is admitted, computed (here or on a worker) with its
// control, recorded in the metrics under its label and code, and finished
// once, whichever way it ends.
#include "server/call_pipeline.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/thread_budget.h"
#include "engine/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/call_records.h"
#include "server/metrics.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class CallPipelineTest : public ::testing::Test {
 protected:
  CallPipelineTest() : engine_(EngineOptionsForTest()) {
    ServiceConfig config;
    config.engine = &engine_;
    config.records = &records_;
    pipeline_ = std::make_unique<CallPipeline>(config);
  }

  EngineOptions EngineOptionsForTest() {
    EngineOptions options;
    options.max_inflight = 1;
    options.max_queue = 1;
    options.thread_budget = &budget_;
    options.max_tensor_elements = 1000;
    options.max_request_bytes = int64_t{1} << 20;
    options.recorder = &records_;
    return options;
  }

  // A call labelled `rpc` of `flops`, due in `due`.
  static EngineCall Call(const std::string& rpc, double flops,
                         absl::Duration due = absl::InfiniteDuration()) {
    EngineCall call;
    call.label = rpc;
    call.cost.flops = flops;
    call.arrived = absl::Now();
    call.deadline = absl::Now() + due;
    return call;
  }

  // What Run finished a call with, waiting for it.
  struct Finished {
    absl::Notification done;
    absl::Status status;
    int calls = 0;
  };
  static std::function<void(const absl::Status&)> FinishInto(Finished* f) {
    return [f](const absl::Status& status) {
      f->status = status;
      ++f->calls;
      f->done.Notify();
    };
  }

  std::string Metric(const std::string& rpc, const std::string& code) {
    const std::string page = metrics_.Render(ServingGauges());
    const std::string series =
        "attnserve_requests_total{rpc=\"" + rpc + "\",code=\"" + code + "\"} ";
    const size_t at = page.find(series);
    if (at == std::string::npos) return "absent";
    return page.substr(at + series.size(),
                       page.find('\n', at) - at - series.size());
  }

  ThreadBudget budget_{2};
  Metrics metrics_;
  CallRecords records_{{.metrics = &metrics_}};
  Engine engine_;
  std::unique_ptr<CallPipeline> pipeline_;
};

TEST_F(CallPipelineTest, TinyAndLargeCallsComputeAndAreRecorded) {
  for (double flops : {1e3, 1e8}) {
    Finished finished;
    std::thread::id ran_on;
    pipeline_->Run(
        Call("Tiny", flops),
        [&](const CallControl& control) {
          ran_on = std::this_thread::get_id();
          EXPECT_NE(control.shared_memory, nullptr);
          return absl::OkStatus();
        },
        nullptr, FinishInto(&finished));
    ASSERT_TRUE(
        finished.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_TRUE(finished.status.ok()) << finished.status;
    EXPECT_EQ(finished.calls, 1);
    // A tiny call computes on the caller's thread, a larger one on a worker.
    EXPECT_EQ(ran_on == std::this_thread::get_id(), flops < 1e6) << flops;
  }
  EXPECT_EQ(Metric("Tiny", "OK"), "2");
}

TEST_F(CallPipelineTest, RefusalsAreRecordedAndFinishTheCallOnce) {
  RequestCost wide;
  wide.largest_tensor = 2000;
  EngineCall call = Call("Wide", 0);
  call.cost = wide;
  Finished refused;
  bool computed = false;
  pipeline_->Run(
      call,
      [&](const CallControl&) {
        computed = true;
        return absl::OkStatus();
      },
      nullptr, FinishInto(&refused));
  ASSERT_TRUE(refused.done.HasBeenNotified());
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status.message(),
              HasSubstr("exceeds --max_tensor_elements 1000"));
  EXPECT_FALSE(computed);
  EXPECT_EQ(Metric("Wide", "RESOURCE_EXHAUSTED"), "1");

  engine_.StopAcceptingCalls();
  Finished draining;
  pipeline_->Run(
      Call("Late", 1e3), [](const CallControl&) { return absl::OkStatus(); },
      nullptr, FinishInto(&draining));
  EXPECT_EQ(draining.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(draining.calls, 1);
  EXPECT_EQ(Metric("Late", "UNAVAILABLE"), "1");
}

TEST_F(CallPipelineTest, AFullQueueIsBusyAndACancelledCallNeverComputes) {
  // The one worker computes until released; the one queue slot holds a
  // call its client cancels meanwhile; a third call finds both taken.
  absl::Notification started, release;
  Finished first, cancelled_call, busy;
  pipeline_->Run(
      Call("Long", 1e8),
      [&](const CallControl&) {
        started.Notify();
        release.WaitForNotification();
        return absl::OkStatus();
      },
      nullptr, FinishInto(&first));
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::atomic<bool> cancelled{false};
  bool computed = false;
  pipeline_->Run(
      Call("Gone", 1e8),
      [&](const CallControl&) {
        computed = true;
        return absl::OkStatus();
      },
      &cancelled, FinishInto(&cancelled_call));
  pipeline_->Run(
      Call("Third", 1e8), [](const CallControl&) { return absl::OkStatus(); },
      nullptr, FinishInto(&busy));
  ASSERT_TRUE(busy.done.HasBeenNotified());
  EXPECT_EQ(busy.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(std::string(busy.status.message()),
            "server busy: 1 calls computing and 1 waiting (--max_inflight, "
            "--max_queue); retry later");
  cancelled.store(true);
  release.Notify();
  ASSERT_TRUE(first.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(
      cancelled_call.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(first.status.ok());
  EXPECT_EQ(cancelled_call.status.code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(computed);
  EXPECT_EQ(Metric("Long", "OK"), "1");
  EXPECT_EQ(Metric("Gone", "CANCELLED"), "1");
  EXPECT_EQ(Metric("Third", "RESOURCE_EXHAUSTED"), "1");
}

TEST_F(CallPipelineTest, AHandlerErrorIsTheCallsStatus) {
  Finished finished;
  pipeline_->Run(
      Call("Broken", 1e3),
      [](const CallControl&) {
        return absl::InvalidArgumentError("query: wrong");
      },
      nullptr, FinishInto(&finished));
  ASSERT_TRUE(finished.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(finished.status, absl::InvalidArgumentError("query: wrong"));
  EXPECT_EQ(Metric("Broken", "INVALID_ARGUMENT"), "1");
}

}  // namespace
}  // namespace attnserve
