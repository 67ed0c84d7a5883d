// A latency histogram for load tests: log-linear buckets (exact below 256 ns,
// then 128 buckets per power of two), so every reported value is within 0.4%
// of a recorded one, over the whole range of int64 nanoseconds.
//
// Thread-safety: Record() may be called from any number of threads at once
// (relaxed atomics); readers see a consistent-enough view while recording
// goes on (progress lines) and an exact one once recording has stopped.
#ifndef ATTNSERVE_CLIENT_BENCH_HISTOGRAM_H_
#define ATTNSERVE_CLIENT_BENCH_HISTOGRAM_H_

#include <array>
#include <atomic>
#include <cstdint>

namespace attnserve {

class LatencyHistogram {
 public:
  LatencyHistogram();
  LatencyHistogram(const LatencyHistogram&) = delete;
  LatencyHistogram& operator=(const LatencyHistogram&) = delete;

  // Records one value in nanoseconds; negative values count as 0.
  void Record(int64_t nanos);
  // Adds every value `other` recorded.
  void Merge(const LatencyHistogram& other);
  void Reset();

  int64_t count() const { return count_.load(std::memory_order_relaxed); }
  // Exact smallest and largest values (0 when empty).
  int64_t min() const;
  int64_t max() const;
  // Exact mean (0 when empty).
  double mean() const;
  // Standard deviation from the bucket midpoints.
  double stddev() const;
  // The value at `percentile` (0..100]: the midpoint of the bucket holding
  // the value of that rank, clamped to [min, max]; 0 when empty.
  int64_t Percentile(double percentile) const;

  // Bucket layout, exposed for tests.
  static int BucketOf(int64_t nanos);
  static int64_t BucketLow(int bucket);
  static int64_t BucketWidth(int bucket);

 private:
  static constexpr int kLinearLimit = 256;
  static constexpr int kSubBuckets = 128;
  static constexpr int kNumBuckets = kLinearLimit + 56 * kSubBuckets;

  std::array<std::atomic<uint64_t>, kNumBuckets> buckets_;
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> min_;
  std::atomic<int64_t> max_{0};
  // Sum in nanoseconds as a double: exact enough for means of any run.
  std::atomic<double> sum_{0};
};

}  // namespace attnserve

#endif  // ATTNSERVE_CLIENT_BENCH_HISTOGRAM_H_
