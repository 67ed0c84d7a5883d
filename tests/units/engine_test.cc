// The engine alone, with no front end: admission and its refusals, the one
// dispatch (here, queued, busy), computation (cancellation, deadlines, the
// cost model), the record of every call Submit handles, and whether session
// steps go to the coalescer.
#include "engine/engine.h"

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/session_store.h"
#include "core/thread_budget.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// Effort that is tiny (runs where it arrives) and effort that is not.
constexpr double kTinyFlops = 1e3;
constexpr double kLargeFlops = 1e8;

RequestCost CostOfFlops(double flops) {
  RequestCost cost;
  cost.flops = flops;
  return cost;
}

class EngineTest : public ::testing::Test {
 protected:
  EngineOptions Options(int max_inflight = 1, int max_queue = 0) {
    EngineOptions options;
    options.max_inflight = max_inflight;
    options.max_queue = max_queue;
    options.initial_flops_per_second = 1e9;
    options.thread_budget = &budget_;
    options.max_tensor_elements = 1000;
    options.max_request_bytes = int64_t{1} << 20;
    return options;
  }

  // What Dispatch did with one call: which of the route's functions ran,
  // on which thread, and the refusal.
  struct Dispatched {
    bool here = false;
    bool asked_to_queue = false;
    absl::Status refused = absl::OkStatus();
    bool was_refused = false;
  };
  // Dispatches a call of `cost` due at `deadline`; a queued call runs
  // `work` on its worker.
  Dispatched Dispatch(const Engine& engine, const RequestCost& cost,
                      absl::Time deadline, std::function<void()> work) {
    Dispatched result;
    engine.Dispatch(cost, deadline,
                    {.refuse =
                         [&](const absl::Status& status) {
                           result.was_refused = true;
                           result.refused = status;
                         },
                     .here = [&] { result.here = true; },
                     .queued =
                         [&] {
                           result.asked_to_queue = true;
                           return work;
                         }});
    return result;
  }

  ThreadBudget budget_{2};
};

TEST_F(EngineTest, TinyCallsRunHereAndOthersOnAWorker) {
  Engine engine(Options());
  Dispatched tiny =
      Dispatch(engine, CostOfFlops(kTinyFlops), absl::InfiniteFuture(), [] {});
  EXPECT_TRUE(tiny.here);
  EXPECT_FALSE(tiny.asked_to_queue);
  EXPECT_FALSE(tiny.was_refused);

  absl::Notification ran;
  // Atomic: ThreadSanitizer does not see abseil's synchronization.
  std::atomic<std::thread::id> worker;
  Dispatched large =
      Dispatch(engine, CostOfFlops(kLargeFlops), absl::InfiniteFuture(), [&] {
        worker.store(std::this_thread::get_id());
        ran.Notify();
      });
  EXPECT_FALSE(large.here);
  EXPECT_TRUE(large.asked_to_queue);
  EXPECT_FALSE(large.was_refused);
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_NE(worker.load(), std::this_thread::get_id());
}

TEST_F(EngineTest, AFullQueueRefusesAsBusyAndDropsTheWork) {
  Engine engine(Options(/*max_inflight=*/1, /*max_queue=*/0));
  absl::Notification started, release;
  Dispatch(engine, CostOfFlops(kLargeFlops), absl::InfiniteFuture(), [&] {
    started.Notify();
    release.WaitForNotification();
  });
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // The worker is busy: a tiny call is not run here either.
  for (double flops : {kTinyFlops, kLargeFlops}) {
    auto witness = std::make_shared<int>(0);
    std::weak_ptr<int> alive = witness;
    Dispatched busy =
        Dispatch(engine, CostOfFlops(flops), absl::InfiniteFuture(),
                 [witness = std::move(witness)] { ADD_FAILURE() << "ran"; });
    EXPECT_FALSE(busy.here) << flops;
    EXPECT_TRUE(busy.asked_to_queue) << flops;
    ASSERT_TRUE(busy.was_refused) << flops;
    EXPECT_EQ(busy.refused.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(busy.refused.message(),
              "server busy: 1 calls computing and 0 waiting (--max_inflight, "
              "--max_queue); retry later");
    EXPECT_TRUE(alive.expired()) << "the refused work is destroyed";
  }
  release.Notify();
}

TEST_F(EngineTest, AdmissionRefusesOverTheLimitsAndTheDeadline) {
  Engine engine(Options());
  RequestCost wide = CostOfFlops(kTinyFlops);
  wide.largest_tensor = 1001;
  Dispatched refused = Dispatch(engine, wide, absl::InfiniteFuture(), [] {});
  EXPECT_FALSE(refused.here);
  EXPECT_FALSE(refused.asked_to_queue);
  EXPECT_EQ(refused.refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.refused.message(),
            "request: a tensor of 1001 elements exceeds --max_tensor_elements "
            "1000");

  RequestCost big = CostOfFlops(kTinyFlops);
  big.bytes = int64_t{3} << 20;
  EXPECT_THAT(
      Dispatch(engine, big, absl::InfiniteFuture(), [] {}).refused.message(),
      HasSubstr("needs about 3 MiB for results and intermediates, "
                "above --max_request_memory_mb 1"));

  refused = Dispatch(engine, CostOfFlops(kTinyFlops),
                     absl::Now() - absl::Milliseconds(1), [] {});
  EXPECT_EQ(refused.refused.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(refused.refused.message(),
            "deadline passed before the call started");

  // 1e12 FLOPs at the initial 1e9 FLOP/s: 1000 s, due in 2 s.
  refused = Dispatch(engine, CostOfFlops(1e12), absl::Now() + absl::Seconds(2),
                     [] {});
  EXPECT_EQ(refused.refused.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(refused.refused.message(),
              HasSubstr("call needs about 1000000 ms at this server's "
                        "measured rate; the deadline is in 1"));
}

TEST_F(EngineTest, DrainingRefusesCallsAndStepsButNotReadyDoesNot) {
  Engine engine(Options());
  EXPECT_TRUE(engine.ready());
  EXPECT_EQ(engine.last_refused(), absl::UnixEpoch());
  engine.MarkNotReady();
  EXPECT_FALSE(engine.ready());
  EXPECT_FALSE(engine.draining());
  // The lame duck still serves.
  EXPECT_TRUE(
      Dispatch(engine, CostOfFlops(kTinyFlops), absl::InfiniteFuture(), [] {
      }).here);

  engine.StopAcceptingCalls();
  EXPECT_TRUE(engine.draining());
  const absl::Time before = absl::Now();
  Dispatched refused =
      Dispatch(engine, CostOfFlops(kTinyFlops), absl::InfiniteFuture(), [] {});
  EXPECT_EQ(refused.refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(refused.refused.message(),
            "server is shutting down; retry on another replica");
  EXPECT_GE(engine.last_refused(), before);

  bool made = false;
  const absl::Status step =
      engine.Coalesce({.label = "Step", .cost = CostOfFlops(kLargeFlops)}, [&] {
        made = true;
        return std::unique_ptr<StepCoalescer::Step>();
      });
  EXPECT_EQ(step.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(made);
}

TEST_F(EngineTest, ComputeRefusesCancelledAndLateCallsAndLearnsTheRate) {
  Engine engine(Options());
  const RequestCost cost = CostOfFlops(1e9);
  EXPECT_EQ(engine.cost_model().Estimate(cost.effort()), absl::Seconds(1));
  bool computed = false;
  const auto compute = [&] {
    computed = true;
    return absl::OkStatus();
  };
  absl::Duration took = absl::Seconds(5);
  const std::atomic<bool> cancelled{true};
  absl::Status status =
      engine.Compute(cost, &cancelled, absl::InfiniteFuture(), compute, &took);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(status.message(), "call cancelled while queued");
  EXPECT_FALSE(computed);
  EXPECT_EQ(took, absl::ZeroDuration());

  status = engine.Compute(cost, nullptr, absl::Now() - absl::Seconds(1),
                          compute, &took);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(status.message(),
            "deadline passed while the call waited for a worker");
  EXPECT_FALSE(computed);

  // A failed computation teaches nothing; a successful one does (1e9 FLOPs
  // in about 10 ms is far faster than the initial 1e9 FLOP/s).
  status = engine.Compute(
      cost, nullptr, absl::InfiniteFuture(),
      [] { return absl::InternalError("broken"); }, &took);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(engine.cost_model().Estimate(cost.effort()), absl::Seconds(1));
  status = engine.Compute(
      cost, nullptr, absl::InfiniteFuture(),
      [] {
        absl::SleepFor(absl::Milliseconds(10));
        return absl::OkStatus();
      },
      &took);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_GE(took, absl::Milliseconds(10));
  EXPECT_LT(engine.cost_model().Estimate(cost.effort()),
            absl::Milliseconds(900));
}

// Every record the engine made, in order.
class RecordingRecorder : public CallRecorder {
 public:
  struct Entry {
    std::string label;
    absl::StatusCode code;
    CallTimes times;
    double flops;
  };
  void Record(const EngineCall& call, const absl::Status& status,
              const CallTimes& times, double flops) const override {
    std::lock_guard<std::mutex> lock(mu);
    entries.push_back({call.label, status.code(), times, flops});
  }
  std::vector<Entry> Entries() const {
    std::lock_guard<std::mutex> lock(mu);
    return entries;
  }
  // std::mutex, not absl's: ThreadSanitizer sees the order it makes.
  mutable std::mutex mu;
  mutable std::vector<Entry> entries;
};

TEST_F(EngineTest, SubmitComputesRecordsAndFinishesEachCallOnce) {
  RecordingRecorder recorder;
  EngineOptions options = Options(/*max_inflight=*/1, /*max_queue=*/1);
  options.recorder = &recorder;
  Engine engine(options);

  // A computed call: its time from arrival splits into input (until it was
  // decoded), queue and compute, and its FLOPs are counted.
  const absl::Time arrived = absl::Now() - absl::Milliseconds(30);
  absl::Notification done;
  std::mutex finished_mu;
  absl::Status finished = absl::UnknownError("not finished");
  int finishes = 0;
  engine.Submit(
      {.label = "Attend",
       .cost = CostOfFlops(kLargeFlops),
       .arrived = arrived,
       .decoded = arrived + absl::Milliseconds(10)},
      [] {
        absl::SleepFor(absl::Milliseconds(20));
        return absl::OkStatus();
      },
      nullptr,
      [&](const absl::Status& status) {
        {
          std::lock_guard<std::mutex> lock(finished_mu);
          finished = status;
          ++finishes;
        }
        done.Notify();
      });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  {
    std::lock_guard<std::mutex> lock(finished_mu);
    EXPECT_TRUE(finished.ok()) << finished;
    EXPECT_EQ(finishes, 1);
  }
  std::vector<RecordingRecorder::Entry> entries = recorder.Entries();
  ASSERT_EQ(entries.size(), 1u);
  const RecordingRecorder::Entry computed = entries[0];
  EXPECT_EQ(computed.label, "Attend");
  EXPECT_EQ(computed.code, absl::StatusCode::kOk);
  EXPECT_EQ(computed.times.input, absl::Milliseconds(10));
  EXPECT_GE(computed.times.queue, absl::Milliseconds(20));
  EXPECT_GE(computed.times.compute, absl::Milliseconds(20));
  EXPECT_GE(computed.times.total, computed.times.input + computed.times.queue +
                                      computed.times.compute);
  EXPECT_EQ(computed.flops, kLargeFlops);

  // A refused call is recorded with its status and no FLOPs, and finished
  // once with the refusal; it never computes.
  bool ran = false;
  absl::Status refused;
  engine.Submit(
      {.label = "Attend",
       .cost = CostOfFlops(kLargeFlops),
       .arrived = absl::Now(),
       .deadline = absl::Now() - absl::Seconds(1)},
      [&] {
        ran = true;
        return absl::OkStatus();
      },
      nullptr, [&](const absl::Status& status) { refused = status; });
  EXPECT_FALSE(ran);
  EXPECT_EQ(refused.code(), absl::StatusCode::kDeadlineExceeded);
  entries = recorder.Entries();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[1].code, absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(entries[1].flops, 0);
  EXPECT_EQ(entries[1].times.compute, absl::ZeroDuration());
}

TEST_F(EngineTest, StepsAreCoalescedOnlyWithSessionsAndAWait) {
  EXPECT_EQ(Engine(Options()).step_coalescer(), nullptr);
  SessionStore::Options store;
  store.max_bytes = size_t{1} << 20;
  SessionStore sessions(store);
  EngineOptions options = Options();
  options.sessions = &sessions;
  EXPECT_EQ(Engine(options).step_coalescer(), nullptr);  // no wait

  options.coalesce_wait = absl::Microseconds(200);
  Engine engine(options);
  ASSERT_NE(engine.step_coalescer(), nullptr);
  // With no pass forming, a tiny step runs alone where it arrived.
  EXPECT_FALSE(engine.Coalesces(CostOfFlops(kTinyFlops)));
  EXPECT_TRUE(engine.Coalesces(CostOfFlops(kLargeFlops)));
  EXPECT_FALSE(Engine(Options()).Coalesces(CostOfFlops(kLargeFlops)));
}

}  // namespace
}  // namespace attnserve
