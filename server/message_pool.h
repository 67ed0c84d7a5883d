// Request and response messages recycled from call to call: gRPC's callback
// API takes a MessageAllocator per method, and a cleared protobuf message
// keeps the capacity of its byte fields, so a steady stream of calls of
// similar sizes parses its tensors and writes its results without
// allocating (or page-faulting in) new buffers.
//
// Bounds: at most `max_pooled` idle pairs and `max_pooled_bytes` of their
// capacity are kept; larger pairs are freed when their call ends.
//
// Thread-safety: AllocateMessages and the holders' Release may be called
// concurrently from any thread. Ownership: the pool owns the idle pairs and
// must outlive the server that uses it (gRPC's contract for allocators).
#ifndef ATTNSERVE_SERVER_MESSAGE_POOL_H_
#define ATTNSERVE_SERVER_MESSAGE_POOL_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/mutex.h"
#include "grpcpp/support/message_allocator.h"

namespace attnserve {

template <typename Request, typename Response>
class MessagePool : public grpc::MessageAllocator<Request, Response> {
 public:
  MessagePool(size_t max_pooled, size_t max_pooled_bytes)
      : max_pooled_(max_pooled), max_pooled_bytes_(max_pooled_bytes) {}
  MessagePool(const MessagePool&) = delete;
  MessagePool& operator=(const MessagePool&) = delete;

  grpc::MessageHolder<Request, Response>* AllocateMessages() override
      ABSL_LOCKS_EXCLUDED(mu_) {
    {
      MutexLock lock(&mu_);
      if (!idle_.empty()) {
        std::unique_ptr<Holder> holder = std::move(idle_.back());
        idle_.pop_back();
        pooled_bytes_ -= holder->bytes;
        ++reused_;
        return holder.release();
      }
    }
    return new Holder(this);
  }

  // Calls that found an idle pair (for tests and metrics).
  size_t reused() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return reused_;
  }

 private:
  struct Holder : grpc::MessageHolder<Request, Response> {
    explicit Holder(MessagePool* pool) : pool(pool) {
      this->set_request(&request);
      this->set_response(&response);
    }
    void Release() override { pool->Recycle(this); }

    MessagePool* pool;
    Request request;
    Response response;
    // What the pair held in its last call: a bound on its idle capacity.
    size_t bytes = 0;
  };

  void Recycle(Holder* released) ABSL_LOCKS_EXCLUDED(mu_) {
    std::unique_ptr<Holder> holder(released);
    holder->bytes =
        holder->request.ByteSizeLong() + holder->response.ByteSizeLong();
    holder->request.Clear();
    holder->response.Clear();
    MutexLock lock(&mu_);
    if (idle_.size() < max_pooled_ &&
        pooled_bytes_ + holder->bytes <= max_pooled_bytes_) {
      pooled_bytes_ += holder->bytes;
      idle_.push_back(std::move(holder));
    }
  }

  const size_t max_pooled_;
  const size_t max_pooled_bytes_;
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Holder>> idle_ ABSL_GUARDED_BY(mu_);
  size_t pooled_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t reused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MESSAGE_POOL_H_
