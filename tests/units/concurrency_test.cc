// The shared state of the core and the server's scheduling pieces, driven
// from many threads at once without gRPC in between, so that
// ThreadSanitizer sees every access (Debian's gRPC is not instrumented).
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention.h"
#include "core/buffer_pool.h"
#include "core/decode_session.h"
#include "core/primitives.h"
#include "core/session_store.h"
#include "core/thread_budget.h"
#include "engine/scheduler.h"
#include "engine/step_coalescer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/message_pool.h"
#include "server/metrics.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

TEST(ConcurrencyTest, ConcurrentOperationsMatchSerialResults) {
  // Three shapes, computed once serially, then by six threads at once.
  std::mt19937 rng(50);
  std::vector<std::array<Tensor, 3>> inputs;
  std::vector<Tensor> expected;
  for (int64_t len : {7, 64, 200}) {
    inputs.push_back({RandomTensor(DType::kFloat32, {2, len, 16}, rng),
                      RandomTensor(DType::kFloat32, {2, len + 3, 16}, rng),
                      RandomTensor(DType::kFloat32, {2, len + 3, 8}, rng)});
    const auto& in = inputs.back();
    auto r =
        Attend({in[0].view(), in[1].view(), in[2].view(), std::nullopt}, {});
    ASSERT_TRUE(r.ok());
    expected.push_back(std::move(r->output));
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 12; ++i) {
        const size_t k = (t + i) % inputs.size();
        const auto& in = inputs[k];
        auto r = Attend(
            {in[0].view(), in[1].view(), in[2].view(), std::nullopt}, {});
        if (!r.ok() || std::memcmp(r->output.data(), expected[k].data(),
                                   expected[k].num_bytes()) != 0) {
          ++mismatches;
        }
        auto ln = LayerNorm(in[0].view(), std::nullopt, std::nullopt, {});
        if (!ln.ok()) ++mismatches;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(ConcurrencyTest, BufferPoolHandsOutDistinctBuffers) {
  BufferPool pool(size_t{64} << 20);
  std::atomic<int> overlaps{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        size_t capacity = 0;
        const size_t bytes = (size_t{64} << 10) * (1 + (i + t) % 3);
        auto* p = static_cast<unsigned char*>(pool.Acquire(bytes, &capacity));
        std::memset(p, t, bytes);
        for (size_t j = 0; j < bytes; j += 4096) {
          if (p[j] != t) ++overlaps;
        }
        pool.Release(p, capacity);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_LE(pool.cached_bytes(), size_t{64} << 20);
}

// Calls that compute for `time` each, counted: how many compute at once
// at most.
class ComputeMeter {
 public:
  explicit ComputeMeter(std::chrono::microseconds time) : time_(time) {}
  void Compute() {
    const int now = ++computing_;
    int seen = most_.load();
    while (now > seen && !most_.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(time_);
    --computing_;
  }
  int most() const { return most_.load(); }

 private:
  const std::chrono::microseconds time_;
  std::atomic<int> computing_{0}, most_{0};
};

TEST(ConcurrencyTest, SchedulerRunsEverythingItAccepts) {
  std::atomic<int> ran{0}, refused{0};
  {
    Scheduler scheduler(/*max_inflight=*/2, /*max_queue=*/4);
    std::vector<std::thread> submitters;
    for (int t = 0; t < 4; ++t) {
      submitters.emplace_back([&] {
        for (int i = 0; i < 50; ++i) {
          if (!scheduler.Submit([&] { ++ran; })) ++refused;
        }
      });
    }
    for (std::thread& submitter : submitters) submitter.join();
  }  // the destructor runs what is queued
  EXPECT_EQ(ran.load() + refused.load(), 200);
  EXPECT_GT(ran.load(), 0);
}

// A call waiting outside its slot (for another replica) lets the next
// queued call compute; it takes a slot again when its wait ends, before
// calls queued meanwhile, and no more than max_inflight ever compute.
TEST(ConcurrencyTest, CallsWaitingOutsideTheirSlotsLetOthersCompute) {
  ComputeMeter meter(std::chrono::microseconds(500));
  const auto compute = [&meter] { meter.Compute(); };
  std::atomic<bool> release{false}, waited{false}, second_ran{false};
  std::atomic<int> finished{0};
  {
    Scheduler scheduler(/*max_inflight=*/1, /*max_queue=*/32);
    ASSERT_TRUE(scheduler.Submit([&] {
      compute();
      Scheduler::WaitOutsideSlot([&] {
        while (!release.load()) std::this_thread::yield();
      });
      waited = true;
      EXPECT_TRUE(second_ran.load()) << "the next call ran during the wait";
      compute();
      ++finished;
    }));
    ASSERT_TRUE(scheduler.Submit([&] {
      EXPECT_FALSE(waited.load());
      compute();
      second_ran = true;
      ++finished;
    }));
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while ((!second_ran.load() || scheduler.inflight() > 0) &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
    EXPECT_TRUE(second_ran.load());
    EXPECT_EQ(scheduler.waiting(), 1);
    EXPECT_EQ(scheduler.inflight(), 0);
    // Off a worker, the wait is just run.
    bool ran_here = false;
    Scheduler::WaitOutsideSlot([&] { ran_here = true; });
    EXPECT_TRUE(ran_here);
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(scheduler.Submit([&] {
        compute();
        ++finished;
      }));
    }
    release = true;
  }
  EXPECT_EQ(finished.load(), 22);
  EXPECT_EQ(meter.most(), 1);
}

TEST(ConcurrencyTest, CallsRunInPlaceNeverExceedMaxInflight) {
  ComputeMeter meter(std::chrono::microseconds(200));
  std::atomic<int> ran{0}, in_place{0};
  const auto work = [&] {
    meter.Compute();
    ++ran;
  };
  {
    Scheduler scheduler(/*max_inflight=*/2, /*max_queue=*/1000);
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t) {
      callers.emplace_back([&] {
        for (int i = 0; i < 50; ++i) {
          if (scheduler.RunHereIfIdle(work)) {
            ++in_place;
          } else {
            ASSERT_TRUE(scheduler.Submit(work));
          }
        }
      });
    }
    for (std::thread& caller : callers) caller.join();
  }
  EXPECT_EQ(ran.load(), 200);
  EXPECT_GT(in_place.load(), 0);
  EXPECT_LE(meter.most(), 2);
}

TEST(ConcurrencyTest, MessagePoolReusesClearedMessagesWithinItsBounds) {
  using Pool = MessagePool<v1::LayerNormRequest, v1::LayerNormResponse>;
  Pool pool(/*max_pooled=*/4, /*max_pooled_bytes=*/1 << 20);
  auto* first = pool.AllocateMessages();
  first->request()->mutable_input()->set_raw_data(std::string(4096, 'x'));
  first->response()->mutable_output()->set_raw_data(std::string(4096, 'y'));
  first->Release();
  auto* again = pool.AllocateMessages();
  EXPECT_EQ(again, first);
  EXPECT_EQ(pool.reused(), 1u);
  EXPECT_FALSE(again->request()->has_input());  // cleared
  EXPECT_FALSE(again->response()->has_output());
  // A pair holding more than the byte bound is freed, not kept.
  again->request()->mutable_input()->set_raw_data(std::string(2 << 20, 'z'));
  again->Release();
  auto* fresh = pool.AllocateMessages();
  EXPECT_EQ(pool.reused(), 1u);
  fresh->Release();
  // Many threads taking and returning pairs.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool] {
      for (int i = 0; i < 200; ++i) {
        auto* held = pool.AllocateMessages();
        held->request()->set_eps(1e-5f);
        held->Release();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_GT(pool.reused(), 700u);
  pool.AllocateMessages()->Release();
}

// A coalesced step of an attention session of 2 heads, d8, one token.
class OneTokenStep : public StepCoalescer::Step {
 public:
  OneTokenStep(std::string id, std::mt19937& rng,
               std::function<void(const absl::Status&)> done)
      : id_(std::move(id)),
        q_(RandomTensor(DType::kFloat32, {2, 1, 8}, rng)),
        k_(RandomTensor(DType::kFloat32, {2, 1, 8}, rng)),
        v_(RandomTensor(DType::kFloat32, {2, 1, 8}, rng)),
        done_(std::move(done)) {}
  const std::string& session_id() const override { return id_; }
  double flops() const override { return flops_; }
  void set_flops(double flops) { flops_ = flops; }
  absl::Status Expired() const override { return expired_; }
  void set_expired(absl::Status status) { expired_ = std::move(status); }
  absl::Time deadline() const override { return deadline_; }
  void set_deadline(absl::Time deadline) { deadline_ = deadline; }
  absl::StatusOr<const SessionStore::StepInput*> Prepare() override {
    if (!expired_.ok()) return expired_;
    input_.id = id_;
    input_.inputs.query = q_.view();
    input_.inputs.key = k_.view();
    input_.inputs.value = v_.view();
    input_.results = &results_;
    return &input_;
  }
  void Finish(const absl::Status& status, absl::Time started,
              absl::Duration) override {
    started_ = started;
    done_(status);
  }
  // When its pass started (steps of one pass share it).
  absl::Time started() const { return started_; }

 private:
  std::string id_;
  Tensor q_, k_, v_;
  std::function<void(const absl::Status&)> done_;
  double flops_ = 1e3;
  absl::Time deadline_ = absl::InfiniteFuture();
  absl::Time started_;
  absl::Status expired_;
  SessionStore::StepInput input_;
  TensorResults results_;
};

// After a pass of two steps, a lone step that arrives at once waits at most
// the coalescing wait for company, then runs, and the runner stops: the
// wait ends when it times out (it once looped on its timeouts, a core spun
// and the server could not stop).
TEST(ConcurrencyTest, CoalescerWaitsForCompanyOnlyAsLongAsItsWait) {
  // Leaked when the test fails: a runner that never stops still uses them.
  auto store_owner = std::make_unique<SessionStore>(SessionStore::Options{});
  SessionStore& store = *store_owner;
  DecodeSessionConfig config;
  config.num_heads = 2;
  config.key_dim = 8;
  config.max_length = 16;
  std::string ids[2];
  for (std::string& id : ids) {
    auto session = DecodeSession::Create(config);
    ASSERT_TRUE(session.ok()) << session.status();
    auto added = store.Add(*std::move(session));
    ASSERT_TRUE(added.ok()) << added.status();
    id = *added;
  }
  std::vector<std::function<void()>> runners;
  std::mutex runners_mu;
  StepCoalescer::Options options;
  options.wait = absl::Milliseconds(50);
  auto coalescer_owner = std::make_unique<StepCoalescer>(
      &store, &ThreadBudget::Global(), options,
      [&](std::function<void()> runner) {
        std::lock_guard<std::mutex> lock(runners_mu);
        runners.push_back(std::move(runner));
        return true;
      },
      [] { return absl::ResourceExhaustedError("busy"); });
  StepCoalescer& coalescer = *coalescer_owner;
  std::mt19937 rng(5);
  std::atomic<int> finished{0};
  std::atomic<bool> lone_ok{false};
  const auto count = [&](const absl::Status& status) {
    EXPECT_TRUE(status.ok()) << status;
    ++finished;
  };
  bool sent_lone = false;
  // The first step of the pass of two sends the lone one as it is answered,
  // as a client does with its next token.
  coalescer.Add(std::make_unique<OneTokenStep>(
      ids[0], rng, [&](const absl::Status& status) {
        count(status);
        if (sent_lone) return;
        sent_lone = true;
        coalescer.Add(std::make_unique<OneTokenStep>(
            ids[0], rng, [&](const absl::Status& lone) {
              lone_ok = lone.ok();
              ++finished;
            }));
      }));
  coalescer.Add(std::make_unique<OneTokenStep>(ids[1], rng, count));
  ASSERT_EQ(runners.size(), 1u);
  std::thread runner(runners[0]);
  const auto start = std::chrono::steady_clock::now();
  while (finished.load() < 3 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (finished.load() < 3) {
    // A runner that never stops: fail without waiting for it.
    runner.detach();
    coalescer_owner.release();
    store_owner.release();
    FAIL() << "the lone step did not run within 10 s";
  }
  runner.join();
  EXPECT_TRUE(lone_ok.load());
  EXPECT_FALSE(coalescer.active());
  EXPECT_EQ(runners.size(), 1u);
}

// Steps whose deadline passed while they waited are answered before the
// pass runs, not after it: the late answers the coalescer once gave.
TEST(ConcurrencyTest, CoalescerAnswersExpiredStepsBeforeThePass) {
  SessionStore store(SessionStore::Options{});
  DecodeSessionConfig config;
  config.num_heads = 2;
  config.key_dim = 8;
  config.max_length = 16;
  std::string ids[3];
  for (std::string& id : ids) {
    auto added = store.Add(*DecodeSession::Create(config));
    ASSERT_TRUE(added.ok()) << added.status();
    id = *added;
  }
  std::vector<std::function<void()>> runners;
  StepCoalescer coalescer(
      &store, &ThreadBudget::Global(), StepCoalescer::Options{},
      [&](std::function<void()> runner) {
        runners.push_back(std::move(runner));
        return true;
      },
      [] { return absl::ResourceExhaustedError("busy"); });
  std::mt19937 rng(6);
  std::vector<std::string> order;
  std::mutex order_mu;
  const auto record = [&](std::string name) {
    return [&, name](const absl::Status& status) {
      std::lock_guard<std::mutex> lock(order_mu);
      order.push_back(absl::StrCat(name, ":", static_cast<int>(status.code())));
    };
  };
  coalescer.Add(std::make_unique<OneTokenStep>(ids[0], rng, record("a")));
  auto late = std::make_unique<OneTokenStep>(ids[1], rng, record("late"));
  late->set_expired(absl::DeadlineExceededError("deadline passed"));
  coalescer.Add(std::move(late));
  coalescer.Add(std::make_unique<OneTokenStep>(ids[2], rng, record("c")));
  ASSERT_EQ(runners.size(), 1u);
  runners[0]();
  const std::string deadline =
      absl::StrCat(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(order, (std::vector<std::string>{absl::StrCat("late:", deadline),
                                             "a:0", "c:0"}));
  EXPECT_FALSE(coalescer.active());
}

// A pass is estimated to take at most max_pass (or one step's time), and a
// step that could not end before its deadline even alone is answered at once:
// 200 steps of 990 tokens once waited behind passes of a second, answered
// up to 0.6 s past their deadline.
TEST(ConcurrencyTest, CoalescerKeepsPassesShortAndAnswersHopelessStepsAtOnce) {
  SessionStore store(SessionStore::Options{});
  DecodeSessionConfig config;
  config.num_heads = 2;
  config.key_dim = 8;
  config.max_length = 16;
  std::vector<std::string> ids(5);
  for (std::string& id : ids) {
    auto added = store.Add(*DecodeSession::Create(config));
    ASSERT_TRUE(added.ok()) << added.status();
    id = *added;
  }
  std::vector<std::function<void()>> runners;
  StepCoalescer::Options options;
  options.max_pass = absl::Milliseconds(50);
  // 1 GFLOP/s: a step of 2e7 FLOPs is estimated at 20 ms.
  options.estimate = [](double flops) { return absl::Seconds(flops / 1e9); };
  StepCoalescer coalescer(
      &store, &ThreadBudget::Global(), options,
      [&](std::function<void()> runner) {
        runners.push_back(std::move(runner));
        return true;
      },
      [] { return absl::ResourceExhaustedError("busy"); });
  std::mt19937 rng(7);
  std::vector<absl::Status> statuses(ids.size());
  std::vector<OneTokenStep*> steps;  // alive until each finishes
  std::vector<absl::Time> started(ids.size());
  std::vector<int> order;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto step = std::make_unique<OneTokenStep>(
        ids[i], rng, [&, i](const absl::Status& status) {
          statuses[i] = status;
          started[i] = steps[i]->started();
          order.push_back(static_cast<int>(i));
        });
    step->set_flops(2e7);
    // The last one is due in 10 ms: it cannot make it.
    if (i + 1 == ids.size()) {
      step->set_deadline(absl::Now() + absl::Milliseconds(10));
    }
    steps.push_back(step.get());
    coalescer.Add(std::move(step));
  }
  ASSERT_EQ(runners.size(), 1u);
  runners[0]();
  EXPECT_EQ(order, (std::vector<int>{4, 0, 1, 2, 3}));
  EXPECT_EQ(statuses[4].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(statuses[4].message()),
              ::testing::HasSubstr("step needs about 20 ms at this server's "
                                   "measured rate; its deadline is in "));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(statuses[i].ok()) << statuses[i];
  // Passes of two: 40 ms estimated, a third would make 60.
  EXPECT_EQ(started[0], started[1]);
  EXPECT_EQ(started[2], started[3]);
  EXPECT_NE(started[1], started[2]);
  EXPECT_FALSE(coalescer.active());
}

// A session exported while another thread steps it: each export either
// reads one consistent file (which loads, at the length of some step) or
// ends ABORTED; meanwhile a second store imports the files that were read
// while a third thread steps the id being imported (UNAVAILABLE until it
// opens) and asks for its stats.
TEST(ConcurrencyTest, ExportsAndImportsRaceStepsSafely) {
  SessionStore source(SessionStore::Options{});
  SessionStore target(SessionStore::Options{});
  DecodeSessionConfig config;
  config.num_heads = 2;
  config.key_dim = 16;
  config.max_length = 4096;
  const std::string id = *source.Add(*DecodeSession::Create(config));
  const auto step = [&](SessionStore& store, const std::string& session,
                        std::mt19937& rng) {
    Tensor q = RandomTensor(DType::kFloat32, {1, 2, 8, 16}, rng);
    DecodeStepInputs in;
    in.query = q.view();
    in.key = q.view();
    in.value = q.view();
    TensorResults results;
    return store.Step(session, in, {}, results, nullptr);
  };
  std::atomic<bool> done{false};
  std::thread stepper([&] {
    std::mt19937 rng(1);
    for (int i = 0; i < 300; ++i) ASSERT_TRUE(step(source, id, rng).ok());
    done = true;
  });
  std::vector<std::string> files;
  int aborted = 0;
  while (!done) {
    auto exported = source.ExportSession(id);
    if (!exported.ok()) {
      // Steps kept changing it while its fingerprint was read.
      EXPECT_EQ(exported.status().code(), absl::StatusCode::kAborted)
          << exported.status();
      ++aborted;
      continue;
    }
    std::string file;
    absl::Status status;
    while (status.ok() && file.size() < exported->image.size()) {
      auto piece = exported->image.Read(file.size(), 4096);
      status = piece.status();
      if (piece.ok()) file.append(piece->data(), piece->size());
    }
    if (status.ok()) {
      files.push_back(std::move(file));
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
      ++aborted;
    }
  }
  stepper.join();
  std::printf("%zu exports read, %d aborted\n", files.size(), aborted);
  ASSERT_FALSE(files.empty());
  // The last file read imports while another thread steps its id.
  const std::string& file = files.back();
  std::atomic<bool> imported{false};
  std::thread prober([&] {
    std::mt19937 rng(2);
    while (!imported) {
      const absl::Status early = step(target, id, rng);
      EXPECT_TRUE(early.code() == absl::StatusCode::kUnavailable ||
                  early.code() == absl::StatusCode::kNotFound || early.ok())
          << early;
      target.stats();
    }
  });
  SessionStore::Import import;
  for (size_t at = 0; at < file.size(); at += 1000) {
    ASSERT_TRUE(
        target.ImportBytes(import, at, absl::string_view(file).substr(at, 1000))
            .ok());
  }
  imported = true;
  prober.join();
  target.EndImport(import);
  EXPECT_TRUE(import.complete);
  EXPECT_EQ(target.stats().imported, 1);
}

TEST(ConcurrencyTest, MetricsRecordAndRenderConcurrently) {
  Metrics metrics;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        metrics.RecordCall("Attend", "OK", absl::Milliseconds(1),
                           absl::Microseconds(10), absl::Microseconds(900), 1e6,
                           1000);
        if (i % 10 == 0) (void)metrics.Render({});
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_NE(metrics.Render({}).find(
                "attnserve_requests_total{rpc=\"Attend\",code=\"OK\"} 400\n"),
            std::string::npos);
}

}  // namespace
}  // namespace attnserve::testing
