#include "client/bench/load.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnserve {
namespace {

// Failed calls are counted per canonical status code, OK to UNAUTHENTICATED.
constexpr int kNumCodes =
    static_cast<int>(absl::StatusCode::kUnauthenticated) + 1;
constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
// Each window keeps two histograms (about 120 KB): a bound on the memory.
constexpr int kMaxWindows = 100;

// The slot of `code` among the kNumCodes counters. A peer can send any
// number as a status; one outside the canonical codes counts as UNKNOWN.
int CodeSlot(absl::StatusCode code) {
  const int slot = static_cast<int>(code);
  return slot > 0 && slot < kNumCodes
             ? slot
             : static_cast<int>(absl::StatusCode::kUnknown);
}

int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SleepUntilNanos(int64_t nanos) {
  std::this_thread::sleep_until(
      std::chrono::steady_clock::time_point(std::chrono::nanoseconds(nanos)));
}

// User plus system CPU time of the whole process (all threads).
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) {
    return t.tv_sec + t.tv_usec / 1e6;
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// CPU seconds a running thread has used so far (0 if unreadable).
double ThreadCpuSeconds(std::thread& thread) {
  clockid_t clock;
  timespec t{};
  if (pthread_getcpuclockid(thread.native_handle(), &clock) != 0 ||
      clock_gettime(clock, &t) != 0) {
    return 0;
  }
  return t.tv_sec + t.tv_nsec / 1e9;
}

// The cores this process may run on (taskset narrows them).
int CoresAvailable() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// CPU seconds of each running thread in `threads`.
std::vector<double> ThreadsCpuSeconds(std::vector<std::thread>& threads) {
  std::vector<double> seconds;
  for (std::thread& thread : threads) {
    seconds.push_back(ThreadCpuSeconds(thread));
  }
  return seconds;
}

// The client's CPU time: so far (a sample of the clocks), or over a period
// (the difference of two samples).
struct CpuUse {
  // The whole process.
  double process_seconds = 0;
  // Each thread driving calls: one busy all the time limits the client even
  // when the process as a whole has cores to spare.
  std::vector<double> poller_seconds;
};

CpuUse ReadCpu(std::vector<std::thread>& pollers) {
  return {ProcessCpuSeconds(), ThreadsCpuSeconds(pollers)};
}

// The CPU used from `start` to `end`.
CpuUse CpuBetween(const CpuUse& start, const CpuUse& end) {
  CpuUse used;
  used.process_seconds = end.process_seconds - start.process_seconds;
  used.poller_seconds = end.poller_seconds;
  for (size_t i = 0;
       i < used.poller_seconds.size() && i < start.poller_seconds.size(); ++i) {
    used.poller_seconds[i] -= start.poller_seconds[i];
  }
  return used;
}

// What the counted calls that ended in one window did: added to by the
// threads driving calls, read by the caller's thread.
struct WindowTally {
  WindowTally() {
    for (auto& count : errors) count.store(0);
  }
  // Adds what `other` counted.
  void Add(const WindowTally& other) {
    latency.Merge(other.latency);
    compute.Merge(other.compute);
    ok.fetch_add(other.ok.load());
    failed.fetch_add(other.failed.load());
    late.fetch_add(other.late.load());
    for (int code = 0; code < kNumCodes; ++code) {
      errors[code].fetch_add(other.errors[code].load());
    }
  }

  LatencyHistogram latency;
  LatencyHistogram compute;
  std::atomic<int64_t> ok{0};
  std::atomic<int64_t> failed{0};
  // Open loop: late sends, in the window they were sent in.
  std::atomic<int64_t> late{0};
  // Failed calls by code.
  std::array<std::atomic<int64_t>, kNumCodes> errors;
};

// The client_* figures of `report`, whose duration_s and requests are set.
void AddClientCpu(const CpuUse& cpu, BenchReport* report) {
  const double wall = std::max(report->duration_s, 1e-9);
  report->client_cores_available = CoresAvailable();
  report->client_cpu_cores = cpu.process_seconds / wall;
  report->client_cpu_us_per_request =
      report->requests > 0 ? cpu.process_seconds * 1e6 / report->requests : 0;
  for (double seconds : cpu.poller_seconds) {
    report->client_busiest_thread =
        std::max(report->client_busiest_thread, seconds / wall);
  }
  report->client_saturated =
      report->client_cpu_cores >= 0.8 * report->client_cores_available ||
      report->client_busiest_thread >= 0.9;
}

// One load test from start to report. Calls run on completion queues, each
// drained by one thread that also starts the next call of a closed loop:
// the least CPU per call gRPC's C++ API allows (no hand-over between
// threads). The object outlives every call it starts (Run waits for all).
//
// The counted period is one window, or with LoadOptions::window a series of
// them back to back; a call counts in the window it ends in, so that the
// load never pauses between windows. Boundaries are crossed on the caller's
// thread: boundary 0 starts the counted period, boundary i ends window i-1.
class LoadRun {
 public:
  LoadRun(const Workload& workload, const LoadOptions& options)
      : workload_(workload),
        options_(options),
        window_ns_(options.window > absl::ZeroDuration()
                       ? absl::ToInt64Nanoseconds(options.window)
                       : kNever) {
    grpc::Slice slice(workload.request);
    request_ = grpc::ByteBuffer(&slice, 1);
    for (const std::vector<std::string>& cycle : workload.per_connection) {
      std::vector<grpc::ByteBuffer>& buffers = channel_requests_.emplace_back();
      for (const std::string& bytes : cycle) {
        grpc::Slice own(bytes);
        buffers.emplace_back(&own, 1);
      }
    }
    next_request_ =
        std::make_unique<std::atomic<int64_t>[]>(options.connections);
    for (int i = 0; i < options.connections; ++i) {
      next_request_[i].store(0);
      channels_.push_back(CreateChannel(options.client, true));
      stubs_.push_back(std::make_unique<grpc::GenericStub>(channels_.back()));
    }
    const int pollers = options.threads > 0
                            ? options.threads
                            : std::min(options.connections, CoresAvailable());
    for (int i = 0; i < pollers; ++i) {
      queues_.push_back(std::make_unique<grpc::CompletionQueue>());
    }
    const int windows = window_ns_ == kNever ? 1 : options.max_windows;
    for (int i = 0; i < windows; ++i) {
      windows_.push_back(std::make_unique<WindowTally>());
    }
    for (auto& seen : error_seen_) seen.store(false);
  }

  // Opens Workload::connect's connections, when it has one.
  absl::Status Connect();
  BenchReport Run(const LoadHooks& hooks) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One call in flight. Closed loop: `closed` is true and the call's
  // completion starts the next one on the same channel.
  struct Call {
    grpc::ClientContext context;
    grpc::ByteBuffer response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::ByteBuffer>> reader;
    int64_t intended = 0;
    int channel = 0;
    bool closed = false;
  };

  grpc::CompletionQueue* QueueOf(int channel) {
    return queues_[channel % queues_.size()].get();
  }
  // Starts a call meant to start at `intended` on `channel`.
  void Start(int channel, int64_t intended, bool closed);
  // Drains one completion queue until it is shut down.
  void Poll(grpc::CompletionQueue* queue) ABSL_LOCKS_EXCLUDED(mu_);

  // Whether a call meant to start at `intended` may start. Counted calls
  // (intended after the warm-up) take one of `requests` tickets, or must
  // fall inside the measured period.
  bool MayStart(int64_t intended);
  bool Counted(int64_t intended) const { return intended >= measure_start_; }
  // Starts the next call of a closed-loop caller, or retires the caller.
  void StartClosed(int channel) ABSL_LOCKS_EXCLUDED(mu_);
  void SendOpenLoop() ABSL_LOCKS_EXCLUDED(mu_);
  void Finish(const grpc::ClientContext& context, const grpc::Status& status,
              int64_t intended) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts a call meant to start at `intended` that ended now with
  // `status`; `peer()` names the server (asked for the first error of each
  // code only); `compute_ns` >= 0: the server's computation.
  void Record(const absl::Status& status, int64_t intended,
              absl::FunctionRef<std::string()> peer, int64_t compute_ns)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A caller of a workload over blocking connections: calls on `channel`'s
  // connection one after another until the run stops, then waits for the
  // end of the run (so that its CPU clock can still be read).
  void CallBlocking(int channel) ABSL_LOCKS_EXCLUDED(mu_);
  // One caller (slot, sender or open-loop call) is done.
  void Leave() ABSL_LOCKS_EXCLUDED(mu_);
  // The window a counted call ending at `now` belongs to; null after the
  // last one.
  WindowTally* WindowAt(int64_t now) const;
  // Counted calls finished so far, in every window.
  int64_t Completed() const;
  LoadProgress Snapshot(int64_t now, int64_t* last_completed,
                        int64_t* last_time) const;
  // The steps of Run: threads draining the completion queues; the first
  // calls (closed loop) or the sender thread (open loop); progress lines
  // and window boundaries until every caller is done.
  std::vector<std::thread> StartPollers();
  std::thread StartCallers() ABSL_LOCKS_EXCLUDED(mu_);
  void WaitForCallers(std::vector<std::thread>& pollers, const LoadHooks& hooks)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Samples the CPU clocks at the next boundary, calls its hook and sets
  // the time of the one after (or stops the run).
  void CrossBoundary(std::vector<std::thread>& pollers, const LoadHooks& hooks)
      ABSL_LOCKS_EXCLUDED(mu_);
  // What windows [first, last) counted, both boundaries crossed.
  BenchReport MakeReport(int first, int last) ABSL_LOCKS_EXCLUDED(mu_);

  const Workload& workload_;
  const LoadOptions& options_;
  grpc::ByteBuffer request_;
  // Workload::per_connection, when given, and each channel's count of
  // calls started (the next one in its cycle).
  std::vector<std::vector<grpc::ByteBuffer>> channel_requests_;
  std::unique_ptr<std::atomic<int64_t>[]> next_request_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::vector<std::unique_ptr<grpc::CompletionQueue>> queues_;
  // Workload::connect's connections, one per channel (else empty).
  std::vector<std::unique_ptr<BlockingConnection>> blocking_;
  // The blocking callers start calling once StartCallers says so (after
  // the counted period's first boundary when there is no warm-up), and
  // leave once the run is over.
  bool calls_start_ ABSL_GUARDED_BY(mu_) = false;
  bool run_over_ ABSL_GUARDED_BY(mu_) = false;

  int64_t start_ = 0;
  double start_unix_s_ = 0;  // start_ on the wall clock
  int64_t measure_start_ = 0;
  int64_t measure_end_ = kNever;
  // The length of a window; kNever: the counted period is one window.
  const int64_t window_ns_;
  // The caller's thread only: the next boundary to cross (kNever: none but
  // the end of the run) and the CPU clocks at each boundary crossed.
  int64_t next_boundary_ = 0;
  std::vector<CpuUse> cpu_at_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> tickets_{0};

  Mutex mu_;
  CondVar done_;  // active_ went down
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  // The first failed call of each code.
  struct FirstError {
    std::string message;
    int64_t at = 0;  // NowNanos() when it ended
    std::string peer;
  };
  std::map<int, FirstError> first_errors_ ABSL_GUARDED_BY(mu_);
  // Whether first_errors_ has (or is getting) each code.
  std::array<std::atomic<bool>, kNumCodes> error_seen_;

  // One per window, made before the first call.
  std::vector<std::unique_ptr<WindowTally>> windows_;
  std::atomic<int64_t> last_completion_{0};
};

WindowTally* LoadRun::WindowAt(int64_t now) const {
  if (window_ns_ == kNever || now < measure_start_) return windows_[0].get();
  const int64_t index = (now - measure_start_) / window_ns_;
  return index < static_cast<int64_t>(windows_.size()) ? windows_[index].get()
                                                       : nullptr;
}

int64_t LoadRun::Completed() const {
  int64_t completed = 0;
  for (const auto& window : windows_) {
    completed += window->ok.load() + window->failed.load();
  }
  return completed;
}

bool LoadRun::MayStart(int64_t intended) {
  if (stopping_.load(std::memory_order_relaxed)) return false;
  if (!Counted(intended)) return true;
  if (options_.requests > 0) {
    if (tickets_.fetch_add(1) < options_.requests) return true;
  } else if (intended < measure_end_) {
    return true;
  }
  stopping_.store(true);
  return false;
}

void LoadRun::Leave() {
  MutexLock lock(&mu_);
  --active_;
  // Wakes the sender waiting for a free slot, and Run when all are done.
  done_.SignalAll();
}

void LoadRun::Finish(const grpc::ClientContext& context,
                     const grpc::Status& status, int64_t intended) {
  if (!Counted(intended)) return;
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto compute = trailers.find("attnserve-compute-us");
  int64_t micros = 0;
  const bool computed =
      compute != trailers.end() &&
      absl::SimpleAtoi(
          absl::string_view(compute->second.data(), compute->second.size()),
          &micros);
  Record(
      FromGrpcStatus(status), intended, [&] { return context.peer(); },
      computed ? micros * 1000 : -1);
}

void LoadRun::Record(const absl::Status& status, int64_t intended,
                     absl::FunctionRef<std::string()> peer,
                     int64_t compute_ns) {
  if (!Counted(intended)) return;
  const int64_t now = NowNanos();
  WindowTally* window = WindowAt(now);
  if (window == nullptr) return;  // the run is over, the call is not counted
  window->latency.Record(now - intended);
  if (status.ok()) {
    window->ok.fetch_add(1, std::memory_order_relaxed);
  } else {
    const int code = CodeSlot(status.code());
    window->errors[code].fetch_add(1);
    if (!error_seen_[code].exchange(true)) {
      MutexLock lock(&mu_);
      first_errors_[code] = {std::string(status.message()), now, peer()};
    }
    window->failed.fetch_add(1, std::memory_order_relaxed);
  }
  if (compute_ns >= 0) window->compute.Record(compute_ns);
  int64_t last = last_completion_.load(std::memory_order_relaxed);
  while (now > last && !last_completion_.compare_exchange_weak(last, now)) {
  }
}

absl::Status LoadRun::Connect() {
  if (!workload_.connect) return absl::OkStatus();
  for (int i = 0; i < options_.connections; ++i) {
    ATTN_ASSIGN_OR_RETURN(std::unique_ptr<BlockingConnection> connection,
                          workload_.connect(i));
    blocking_.push_back(std::move(connection));
  }
  return absl::OkStatus();
}

void LoadRun::CallBlocking(int channel) {
  {
    MutexLock lock(&mu_);
    while (!calls_start_) done_.Wait(&mu_);
  }
  BlockingConnection& connection = *blocking_[channel];
  const std::string* request = &workload_.request;
  for (;;) {
    const int64_t intended = NowNanos();
    if (!MayStart(intended)) break;
    if (!workload_.per_connection.empty()) {
      const auto& cycle =
          workload_.per_connection[channel % workload_.per_connection.size()];
      request = &cycle[next_request_[channel].fetch_add(1) % cycle.size()];
    }
    const absl::Status status = connection.Call(*request);
    Record(
        status, intended, [&] { return connection.peer(); }, -1);
  }
  Leave();
  MutexLock lock(&mu_);
  while (!run_over_) done_.Wait(&mu_);
}

void LoadRun::Start(int channel, int64_t intended, bool closed) {
  auto* call = new Call();
  call->intended = intended;
  call->channel = channel;
  call->closed = closed;
  PrepareContext(options_.client, &call->context);
  const grpc::ByteBuffer* request = &request_;
  if (!channel_requests_.empty()) {
    const auto& cycle = channel_requests_[channel % channel_requests_.size()];
    request = &cycle[next_request_[channel].fetch_add(1) % cycle.size()];
  }
  call->reader = stubs_[channel]->PrepareUnaryCall(
      &call->context, workload_.method, *request, QueueOf(channel));
  call->reader->StartCall();
  call->reader->Finish(&call->response, &call->status, call);
}

void LoadRun::StartClosed(int channel) {
  const int64_t now = NowNanos();
  if (MayStart(now)) {
    Start(channel, now, /*closed=*/true);
  } else {
    Leave();
  }
}

void LoadRun::Poll(grpc::CompletionQueue* queue) {
  void* tag = nullptr;
  bool ok = false;
  while (queue->Next(&tag, &ok)) {
    std::unique_ptr<Call> call(static_cast<Call*>(tag));
    Finish(call->context, call->status, call->intended);
    if (call->closed) {
      StartClosed(call->channel);
    } else {
      Leave();
    }
  }
}

void LoadRun::SendOpenLoop() {
  ArrivalSchedule schedule(options_.arrival, options_.rate);
  const int64_t late_after = absl::ToInt64Nanoseconds(options_.late_threshold);
  for (int64_t sent = 0;; ++sent) {
    const int64_t intended = start_ + absl::ToInt64Nanoseconds(schedule.Next());
    SleepUntilNanos(intended);
    if (!MayStart(intended)) break;
    {
      // Outstanding calls are capped: a full client waits, and its waiting
      // shows up as late sends and as latency (measured from `intended`).
      MutexLock lock(&mu_);
      while (active_ > options_.concurrency) done_.Wait(&mu_);
      ++active_;
    }
    const int64_t now = NowNanos();
    if (Counted(intended) && now - intended > late_after) {
      if (WindowTally* window = WindowAt(now)) {
        window->late.fetch_add(1, std::memory_order_relaxed);
      }
    }
    Start(static_cast<int>(sent % stubs_.size()), intended,
          /*closed=*/false);
  }
  Leave();
}

LoadProgress LoadRun::Snapshot(int64_t now, int64_t* last_completed,
                               int64_t* last_time) const {
  LoadProgress p;
  p.elapsed = absl::Nanoseconds(now - start_);
  p.warming_up = now < measure_start_;
  p.completed = Completed();
  for (const auto& window : windows_) p.errors += window->failed.load();
  if (now > *last_time) {
    p.qps = (p.completed - *last_completed) * 1e9 / (now - *last_time);
  }
  // The current window's percentiles: the ones its end will judge.
  const WindowTally* current = WindowAt(now);
  if (current == nullptr) current = windows_.back().get();
  p.p50_ns = current->latency.Percentile(50);
  p.p99_ns = current->latency.Percentile(99);
  *last_completed = p.completed;
  *last_time = std::max(now, measure_start_);
  return p;
}

std::vector<std::thread> LoadRun::StartPollers() {
  std::vector<std::thread> pollers;
  if (!blocking_.empty()) {
    // The callers are the threads that drive calls.
    {
      MutexLock lock(&mu_);
      active_ = static_cast<int>(blocking_.size());
    }
    for (int i = 0; i < static_cast<int>(blocking_.size()); ++i) {
      pollers.emplace_back([this, i] { CallBlocking(i); });
    }
    return pollers;
  }
  for (auto& queue : queues_) {
    pollers.emplace_back([this, q = queue.get()] { Poll(q); });
  }
  return pollers;
}

std::thread LoadRun::StartCallers() {
  std::thread sender;
  if (!blocking_.empty()) {
    // Their threads wait for this.
    MutexLock lock(&mu_);
    calls_start_ = true;
    done_.SignalAll();
    return sender;
  }
  if (options_.rate > 0) {
    {
      MutexLock lock(&mu_);
      active_ = 1;
    }
    sender = std::thread([this] { SendOpenLoop(); });
  } else {
    {
      MutexLock lock(&mu_);
      active_ = options_.concurrency;
    }
    for (int i = 0; i < options_.concurrency; ++i) {
      StartClosed(i % options_.connections);
    }
  }
  return sender;
}

void LoadRun::WaitForCallers(std::vector<std::thread>& pollers,
                             const LoadHooks& hooks) {
  const int64_t interval = absl::ToInt64Nanoseconds(options_.progress_interval);
  int64_t last_completed = 0, last_time = measure_start_;
  mu_.Lock();
  while (active_ > 0) {
    const int64_t wake = std::min(NowNanos() + interval, next_boundary_);
    const auto deadline =
        std::chrono::steady_clock::time_point(std::chrono::nanoseconds(wake));
    while (active_ > 0 && !done_.WaitUntil(&mu_, deadline)) {
    }
    if (active_ == 0) break;
    const int64_t now = NowNanos();
    mu_.Unlock();
    if (now >= next_boundary_) {
      // Woken for a boundary: the next progress line is an interval on.
      CrossBoundary(pollers, hooks);
    } else if (hooks.progress) {
      hooks.progress(Snapshot(now, &last_completed, &last_time));
    }
    mu_.Lock();
  }
  mu_.Unlock();
  // Every caller has left, so every counted call is done; the pollers still
  // run, so their clocks can be read. The report measures between
  // boundaries: a run over before its warm-up has an empty counted period.
  if (cpu_at_.empty()) CrossBoundary(pollers, hooks);
  // The one window of a run without windows ends with its last call.
  if (window_ns_ == kNever) CrossBoundary(pollers, hooks);
}

void LoadRun::CrossBoundary(std::vector<std::thread>& pollers,
                            const LoadHooks& hooks) {
  cpu_at_.push_back(ReadCpu(pollers));
  const int boundary = static_cast<int>(cpu_at_.size()) - 1;
  bool go_on = true;
  if (boundary == 0) {
    if (hooks.measure_start) hooks.measure_start();
  } else if (hooks.window_end) {
    go_on = hooks.window_end(MakeReport(boundary - 1, boundary));
  }
  if (window_ns_ == kNever) {
    next_boundary_ = kNever;
  } else if (!go_on || boundary >= static_cast<int>(windows_.size())) {
    // Callers stop; calls still in flight end after the last window.
    stopping_.store(true);
    next_boundary_ = kNever;
  } else {
    next_boundary_ = measure_start_ + window_ns_ * (boundary + 1);
  }
}

BenchReport LoadRun::MakeReport(int first, int last) {
  std::unique_ptr<WindowTally> merged;
  if (last - first != 1) {
    merged = std::make_unique<WindowTally>();
    for (int i = first; i < last; ++i) merged->Add(*windows_[i]);
  }
  const WindowTally& tally = merged != nullptr ? *merged : *windows_[first];
  BenchReport report;
  report.rpc = workload_.rpc;
  report.workload = workload_.description;
  report.request_bytes = static_cast<int64_t>(workload_.request.size());
  report.concurrency = options_.concurrency;
  report.connections = options_.connections;
  report.target_rate = options_.rate;
  if (options_.rate > 0)
    report.arrival = std::string(ArrivalName(options_.arrival));
  report.start_unix_s = start_unix_s_;
  report.warmup_s = absl::ToDoubleSeconds(options_.warmup);
  report.ok = tally.ok.load();
  report.requests = report.ok + tally.failed.load();
  for (int code = 0; code < kNumCodes; ++code) {
    if (tally.errors[code].load() == 0) continue;
    const std::string name =
        absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
    report.errors[name] = tally.errors[code].load();
    MutexLock lock(&mu_);
    // Missing only while its call is still being recorded.
    const auto first_error = first_errors_.find(code);
    if (first_error == first_errors_.end()) continue;
    report.error_messages[name] = first_error->second.message;
    report.error_first_at_s[name] = (first_error->second.at - start_) / 1e9;
    report.error_first_peer[name] = first_error->second.peer;
  }
  if (window_ns_ == kNever) {
    const int64_t end = std::max(last_completion_.load(), measure_start_);
    report.duration_s = (end - measure_start_) / 1e9;
  } else {
    report.duration_s = (last - first) * window_ns_ / 1e9;
  }
  report.qps = report.duration_s > 0 ? report.requests / report.duration_s : 0;
  report.latency = Summarize(tally.latency);
  if (tally.compute.count() > 0) {
    report.server_compute = Summarize(tally.compute);
  }
  report.late = tally.late.load();
  report.late_threshold_ms =
      absl::ToDoubleMilliseconds(options_.late_threshold);
  AddClientCpu(CpuBetween(cpu_at_[first], cpu_at_[last]), &report);
  return report;
}

BenchReport LoadRun::Run(const LoadHooks& hooks) {
  start_ = NowNanos();
  start_unix_s_ = absl::ToUnixMicros(absl::Now()) / 1e6;
  measure_start_ = start_ + absl::ToInt64Nanoseconds(options_.warmup);
  if (options_.requests == 0 && window_ns_ == kNever) {
    measure_end_ = measure_start_ + absl::ToInt64Nanoseconds(options_.duration);
  }
  next_boundary_ = measure_start_;
  std::vector<std::thread> pollers = StartPollers();
  // Without a warm-up the counted period starts before the first call.
  if (options_.warmup <= absl::ZeroDuration()) CrossBoundary(pollers, hooks);
  std::thread sender = StartCallers();
  WaitForCallers(pollers, hooks);
  if (sender.joinable()) sender.join();
  {
    MutexLock lock(&mu_);
    run_over_ = true;
    done_.SignalAll();
  }
  for (auto& queue : queues_) queue->Shutdown();
  for (std::thread& poller : pollers) poller.join();
  const int last = static_cast<int>(cpu_at_.size()) - 1;
  return MakeReport(std::max(0, last - options_.report_windows), last);
}

// The window options of a windowed run (and none of a single period).
absl::Status VerifyWindows(const LoadOptions& options) {
  if (options.window < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--window_s: must be > 0");
  }
  if (options.window == absl::ZeroDuration()) return absl::OkStatus();
  if (options.requests > 0) {
    return absl::InvalidArgumentError(
        "--requests: not with measurement windows (they are measured in "
        "time: --window_s)");
  }
  if (options.max_windows < 1 || options.max_windows > kMaxWindows) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_trials: ", options.max_windows, " is not in [1, ",
                     kMaxWindows, "]"));
  }
  if (options.report_windows < 1) {
    return absl::InvalidArgumentError("report windows: must be >= 1");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status VerifyLoadOptions(const LoadOptions& options) {
  if (options.concurrency < 1 || options.concurrency > 100000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--concurrency: ", options.concurrency, " is not in [1, 100000]"));
  }
  if (options.connections < 1 || options.connections > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--connections: ", options.connections, " is not in [1, 1024]"));
  }
  if (options.threads < 0 || options.threads > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--client_threads: ", options.threads, " is not in [0, 256]"));
  }
  if (options.rate < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate: must be >= 0, got ", options.rate));
  }
  if (options.requests < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--requests: must be >= 0, got ", options.requests));
  }
  if (options.requests == 0 && options.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--duration_s: must be > 0 (or give --requests)");
  }
  if (options.warmup < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--warmup_s: must be >= 0");
  }
  if (options.client.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--timeout_s: must be > 0");
  }
  if (options.progress_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("progress interval: must be > 0");
  }
  return VerifyWindows(options);
}

absl::Status VerifyOneCallPerConnection(const LoadOptions& options) {
  if (options.rate <= 0 && options.concurrency == options.connections) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--concurrency: this transport carries one call at a time per "
      "connection, closed loop: set --concurrency equal to --connections (",
      options.connections, ") and no --rate"));
}

absl::StatusOr<BenchReport> RunLoad(
    const Workload& workload, const LoadOptions& options,
    const std::function<void(const LoadProgress&)>& progress) {
  LoadHooks hooks;
  hooks.progress = progress;
  return RunLoad(workload, options, hooks);
}

absl::StatusOr<BenchReport> RunLoad(const Workload& workload,
                                    const LoadOptions& options,
                                    const LoadHooks& hooks) {
  if (absl::Status status = VerifyLoadOptions(options); !status.ok()) {
    return status;
  }
  for (const std::vector<std::string>& cycle : workload.per_connection) {
    if (cycle.empty()) {
      return absl::InvalidArgumentError(
          "workload: a connection has no requests to send");
    }
  }
  if (workload.connect) {
    ATTN_RETURN_IF_ERROR(VerifyOneCallPerConnection(options));
  }
  LoadRun run(workload, options);
  ATTN_RETURN_IF_ERROR(run.Connect());
  return run.Run(hooks);
}

}  // namespace attnserve
