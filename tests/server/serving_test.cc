// The server under load: bounded admission, deadlines, cancellation and
// the compute-time trailer.
#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "core/row_ops.h"
#include "grpc/grpc.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "proto/tensor_codec.h"
#include "server/metrics.h"
#include "tests/test_util.h"

namespace attnserve::testing {
namespace {

// Attention over L queries and keys, d=64, 8 heads: about 2 * 8 * L^2 * 128
// FLOPs, some hundreds of milliseconds for L in the thousands.
v1::AttendRequest LongRequest(int64_t len, int64_t batch = 8) {
  std::mt19937 rng(31);
  v1::AttendRequest r;
  for (v1::Tensor* t :
       {r.mutable_query(), r.mutable_key(), r.mutable_value()}) {
    *t = RandomWireTensor(DType::kFloat32, {batch, len, 64}, rng);
  }
  return r;
}

// Long to compute, small to send: 8 x 16384 queries and keys of width 1
// (2 billion exponentials, 1.5 MB of request).
v1::AttendRequest LongCheapRequest() {
  std::mt19937 rng(33);
  v1::AttendRequest r;
  for (v1::Tensor* t :
       {r.mutable_query(), r.mutable_key(), r.mutable_value()}) {
    *t = RandomWireTensor(DType::kFloat32, {8, 16384, 1}, rng);
  }
  return r;
}

v1::LayerNormRequest ShortRequest() {
  std::mt19937 rng(32);
  v1::LayerNormRequest r;
  *r.mutable_input() = RandomWireTensor(DType::kFloat32, {4, 8}, rng);
  return r;
}

ServerOptions OneWorker(int max_queue) {
  ServerOptions options;
  options.max_inflight = 1;
  options.max_queue = max_queue;
  return options;
}

AttnClient ClientWithTimeout(const TestServer& server, absl::Duration timeout) {
  ClientOptions options;
  options.target = server.target();
  options.timeout = timeout;
  return AttnClient(options);
}

TEST(ServingTest, FullQueueIsRefusedAtOnce) {
  TestServer server(OneWorker(/*max_queue=*/1));
  // The two long calls take ~0.2 s each with AVX-512 and ~5 s on an AVX2
  // core; more when other tests share the cores: no deadline in the way.
  AttnClient client = ClientWithTimeout(server, absl::Seconds(240));
  const v1::AttendRequest slow = LongCheapRequest();
  std::vector<absl::Status> results(2);
  std::vector<std::thread> calls;
  for (int i = 0; i < 2; ++i) {
    calls.emplace_back([&, i] { results[i] = client.Attend(slow).status(); });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // One computing, one queued: a third call, even a tiny one, is refused
  // without waiting.
  // (Its own connection: on the first one it would wait behind the large
  // requests' bytes.)
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto own_channel = grpc::CreateCustomChannel(
      server.target(), grpc::InsecureChannelCredentials(), args);
  auto other = v1::AttentionService::NewStub(own_channel);
  {
    grpc::ClientContext warmup;
    v1::ListModelsResponse models;
    ASSERT_TRUE(other->ListModels(&warmup, {}, &models).ok());
  }
  const absl::Time start = absl::Now();
  grpc::ClientContext third_context;
  v1::LayerNormResponse third_response;
  const absl::Status third = FromGrpcStatus(
      other->LayerNorm(&third_context, ShortRequest(), &third_response));
  const absl::Duration waited = absl::Now() - start;
  for (std::thread& call : calls) call.join();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_EQ(third.message(),
            "server busy: 1 calls computing and 1 waiting (--max_inflight, "
            "--max_queue); retry later");
  EXPECT_LT(waited, absl::Milliseconds(50));
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];
}

TEST(ServingTest, CallThatCannotMeetItsDeadlineIsRefusedUpFront) {
  ServerOptions options;
  options.threads = 2;
  TestServer server(options);
  // Long enough for the 48 MB request to arrive on a busy machine (2 s
  // was not, with other builds running beside the test).
  AttnClient client = ClientWithTimeout(server, absl::Seconds(10));
  // 1.1 TFLOP, which a fresh server's cost model (20 GFLOP/s per thread
  // until it has measured calls) puts at 27 s on 2 threads.
  const absl::Status status =
      client.Attend(LongRequest(65536, /*batch=*/1)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find("call needs about"), std::string::npos)
      << "refused by the server's estimate, not by the client's timer: "
      << status;
}

TEST(ServingTest, CancelledCallStopsComputingAndFreesTheWorker) {
  TestServer server(OneWorker(/*max_queue=*/0));
  const v1::AttendRequest slow = LongRequest(4096);
  // How long the call takes when left alone.
  AttnClient client = server.MakeClient();
  const absl::Time start = absl::Now();
  ASSERT_TRUE(client.Attend(slow).ok());
  const absl::Duration full = absl::Now() - start;

  auto channel =
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  v1::AttendResponse response;
  std::thread call([&] { (void)stub->Attend(&context, slow, &response); });
  std::this_thread::sleep_for(absl::ToChronoMilliseconds(full / 5));
  context.TryCancel();
  const absl::Time cancelled_at = absl::Now();
  // With one worker and no queue, a new call gets in only once the
  // cancelled one has stopped.
  absl::Status short_call;
  do {
    short_call = client.LayerNorm(ShortRequest()).status();
  } while (short_call.code() == absl::StatusCode::kResourceExhausted &&
           absl::Now() - cancelled_at < full);
  const absl::Duration freed_after = absl::Now() - cancelled_at;
  call.join();
  EXPECT_TRUE(short_call.ok()) << short_call;
  EXPECT_LT(freed_after, full / 2) << "full call " << full << ", worker freed "
                                   << freed_after << " after the cancel";
}

// Attention over FLOAT32 [1, 1, len, 0] queries and keys: 40 bytes of
// request, 0 FLOPs, len^2 logits of nothing; values [1, 1, len, dv].
v1::AttendRequest ZeroWidthRequest(int64_t len, int64_t dv) {
  v1::AttendRequest r;
  for (v1::Tensor* t :
       {r.mutable_query(), r.mutable_key(), r.mutable_value()}) {
    t->set_dtype(v1::DATA_TYPE_FLOAT32);
    for (int64_t d : {int64_t{1}, int64_t{1}, len, int64_t{0}}) {
      t->add_shape(d);
    }
  }
  r.mutable_value()->set_shape(3, dv);
  r.mutable_value()->set_raw_data(std::string(len * dv * 4, '\0'));
  return r;
}

// A server used to compute such calls on gRPC's thread, where nothing
// could stop them: the 3 s call ran 27 s more and the next call waited for
// it. They end within their deadline now, and delay nothing.
TEST(ServingTest, CallsOfNoFlopsEndWithinTheirDeadline) {
  TestServer server;
  AttnClient client = ClientWithTimeout(server, absl::Seconds(3));
  for (const int64_t len : {int64_t{262144}, int64_t{1048576}}) {
    const absl::Time start = absl::Now();
    auto answer = client.Attend(ZeroWidthRequest(len, 0));
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(answer.ok()) << len << ": " << answer.status();
    EXPECT_EQ(ShapeString(Shape(answer->output().shape().begin(),
                                answer->output().shape().end())),
              absl::StrCat("[1, 1, ", len, ", 0]"));
    EXPECT_LT(took, absl::Seconds(3)) << len;
    const absl::Time next = absl::Now();
    EXPECT_TRUE(client.LayerNorm(ShortRequest()).ok());
    EXPECT_LT(absl::Now() - next, absl::Seconds(1)) << "after " << len;
  }
  // Keys of width 0 over one value column: each row is the mean of the
  // values (here 0), linear in the keys.
  auto mean = client.Attend(ZeroWidthRequest(1048576, 1));
  ASSERT_TRUE(mean.ok()) << mean.status();
  EXPECT_EQ(mean->output().raw_data(), std::string(1048576 * 4, '\0'));
}

// With a mask the 2^40 logits of [1, 1, 2^20, 0] queries and keys are
// computed: a call of hours, which its client can stop and which frees its
// worker when it does.
TEST(ServingTest, CancelledCallOfFewFlopsFreesTheWorker) {
  TestServer server(OneWorker(/*max_queue=*/0));
  v1::AttendRequest slow = ZeroWidthRequest(1 << 20, 1);
  slow.mutable_attn_mask()->set_dtype(v1::DATA_TYPE_BOOL);
  slow.mutable_attn_mask()->set_raw_data(std::string(1, '\1'));
  auto channel =
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  v1::AttendResponse response;
  grpc::Status slow_status;
  std::thread call(
      [&] { slow_status = stub->Attend(&context, slow, &response); });
  // Once the slow call holds the only worker (not before: a LayerNorm
  // running then would have the slow call refused instead), a second call
  // is refused (no queue).
  const absl::Time started_by = absl::Now() + absl::Seconds(30);
  while (server.server().RenderMetrics().find(
             "attnserve_inflight_requests 1\n") == std::string::npos &&
         absl::Now() < started_by) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  AttnClient client = server.MakeClient();
  absl::Status busy;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  do {
    busy = client.LayerNorm(ShortRequest()).status();
  } while (busy.ok() && absl::Now() < give_up);
  EXPECT_EQ(busy.code(), absl::StatusCode::kResourceExhausted) << busy;
  context.TryCancel();
  const absl::Time cancelled_at = absl::Now();
  absl::Status freed;
  do {
    freed = client.LayerNorm(ShortRequest()).status();
  } while (freed.code() == absl::StatusCode::kResourceExhausted &&
           absl::Now() - cancelled_at < absl::Seconds(30));
  const absl::Duration freed_after = absl::Now() - cancelled_at;
  call.join();
  EXPECT_EQ(slow_status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(freed.ok()) << freed;
  // Generous for a loaded machine: without cancellation it would take minutes.
  EXPECT_LT(freed_after, absl::Seconds(10));
}

TEST(ServingTest, ComputeTimeComesBackInTheTrailer) {
  TestServer server;
  auto channel =
      grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  v1::LayerNormResponse response;
  ASSERT_TRUE(stub->LayerNorm(&context, ShortRequest(), &response).ok());
  const auto& trailers = context.GetServerTrailingMetadata();
  auto it = trailers.find("attnserve-compute-us");
  ASSERT_NE(it, trailers.end());
  EXPECT_GE(std::stol(std::string(it->second.data(), it->second.size())), 0);
}

TEST(ServingTest, MetricsPageCountsCallsByRpcAndCode) {
  TestServer server;
  ASSERT_GT(server.metrics_port(), 0);
  AttnClient client = server.MakeClient();
  ASSERT_TRUE(client.LayerNorm(ShortRequest()).ok());
  ASSERT_TRUE(client.LayerNorm(ShortRequest()).ok());
  v1::LayerNormRequest bad = ShortRequest();
  bad.set_eps(-1);
  EXPECT_FALSE(client.LayerNorm(bad).ok());

  httplib::Client http("127.0.0.1", server.metrics_port());
  auto page = http.Get("/metrics");
  ASSERT_TRUE(page) << "GET /metrics failed";
  EXPECT_EQ(page->status, 200);
  const std::string& text = page->body;
  const std::string build_info =
      absl::StrCat("\",isa=\"", GetRowOps().isa, "\",row_kernels=\"",
                   GetRowOps().name, "\"} 1\n");
  for (const char* line : {
           "attnserve_requests_total{rpc=\"LayerNorm\",code=\"OK\"} 2\n",
           "attnserve_requests_total{rpc=\"LayerNorm\",code=\"INVALID_"
           "ARGUMENT\"} 1\n",
           "attnserve_compute_seconds_count{rpc=\"LayerNorm\"} 2\n",
           "attnserve_request_duration_seconds_count{rpc=\"LayerNorm\"} 3\n",
           "attnserve_request_duration_seconds_bucket{rpc=\"LayerNorm\",le=\"+"
           "Inf\"} 3\n",
           "attnserve_inflight_requests 0\n",
           "attnserve_queued_requests 0\n",
           "attnserve_models_loaded 0\n",
           "attnserve_build_info{version=\"",
           build_info.c_str(),
           "# TYPE attnserve_queue_wait_seconds histogram\n",
           "process_resident_memory_bytes ",
       }) {
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line << "\n"
                                                  << text;
  }
}

// Bucket bounds and sums in the shortest text that reads back as the same
// double, as Prometheus' clients print them.
TEST(ServingTest, MetricsPagePrintsShortestBucketBounds) {
  Metrics metrics;
  metrics.RecordCall("Attend", "OK", absl::Microseconds(400),
                     absl::ZeroDuration(), absl::Microseconds(300), 1e6, 0);
  metrics.RecordCall("Attend", "OK", absl::Seconds(2), absl::ZeroDuration(),
                     absl::Seconds(2), 1e6, 0);
  const std::string text = metrics.Render({});
  for (const char* line : {
           "attnserve_request_duration_seconds_bucket{rpc=\"Attend\",le=\"0."
           "0005\"} 1\n",
           "attnserve_request_duration_seconds_bucket{rpc=\"Attend\",le=\"1\"}"
           " 1\n",
           "attnserve_request_duration_seconds_bucket{rpc=\"Attend\",le=\"2."
           "5\"} 2\n",
           "attnserve_request_duration_seconds_bucket{rpc=\"Attend\",le=\"+"
           "Inf\"} 2\n",
           "attnserve_request_duration_seconds_sum{rpc=\"Attend\"} 2.0004\n",
           "attnserve_flops_total 2e+06\n",
       }) {
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line << "\n"
                                                  << text;
  }
  EXPECT_EQ(text.find("le=\"0.00050"), std::string::npos) << text;
}

TEST(ServingTest, HealthWatchersSeeNotServingWhenTheServerDrains) {
  TestServer server;
  HealthWatch watch(server.target());
  ASSERT_TRUE(watch.FirstSaysServing());
  std::thread drain([&] { server.server().Shutdown(absl::Seconds(5)); });
  EXPECT_TRUE(watch.WaitForNotServing());
  drain.join();
}

TEST(ServingTest, OversizedTensorIsRefusedBeforeAllocation) {
  ServerOptions options;
  options.max_tensor_elements = 1000;
  TestServer server(options);
  AttnClient client = server.MakeClient();
  v1::LayerNormRequest r;
  std::mt19937 rng(1);
  *r.mutable_input() = RandomWireTensor(DType::kFloat32, {10, 101}, rng);
  const absl::Status status = client.LayerNorm(r).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "request: a tensor of 1010 elements exceeds --max_tensor_elements "
            "1000");
}

}  // namespace
}  // namespace attnserve::testing
