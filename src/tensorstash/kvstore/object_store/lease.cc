#include "tensorstash/kvstore/object_store/lease.h"

#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Record(const std::string& holder, std::chrono::milliseconds duration) {
  char host[256] = "";
  gethostname(host, sizeof(host) - 1);
  return nlohmann::json{{"holder", holder},
                        {"host", host},
                        {"pid", static_cast<int64_t>(getpid())},
                        {"expires_unix_ms", NowUnixMs() + duration.count()}}
      .dump();
}

class Lease final : public KvLock {
 public:
  Lease(std::shared_ptr<LeaseOps> ops, std::string key, std::string holder,
        std::chrono::milliseconds duration)
      : ops_(std::move(ops)), key_(std::move(key)), holder_(std::move(holder)),
        duration_(duration) {
    renewer_ = std::thread([this] { RenewUntilReleased(); });
  }
  ~Lease() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
    renewer_.join();
    if (HeldByUs()) (void)ops_->Delete(key_);  // never a successor's lease
  }

  // Whether the lease object still names this holder (not a successor that took it over).
  bool HeldByUs() const {
    Result<std::string> current = ops_->Read(key_);
    if (!current.ok()) return false;
    const nlohmann::json parsed = nlohmann::json::parse(*current, nullptr, false);
    return parsed.is_object() && parsed.value("holder", std::string()) == holder_;
  }

 private:
  void RenewUntilReleased() {
    const auto period = duration_ / 3;
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, period, [&] { return released_; })) {
      lock.unlock();
      // A holder that stalled past its lease may have been taken over: then it stops renewing,
      // rather than overwrite its successor's lease.
      if (!HeldByUs()) return;
      (void)ops_->Replace(key_, Record(holder_, duration_));
      lock.lock();
    }
  }

  const std::shared_ptr<LeaseOps> ops_;
  const std::string key_;
  const std::string holder_;
  const std::chrono::milliseconds duration_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;  // guarded by mu_
  std::thread renewer_;
};

class KvLeaseOps final : public LeaseOps {
 public:
  explicit KvLeaseOps(KvStore* kv) : kv_(kv) {}
  Status CreateIfAbsent(std::string_view key, std::string_view value) override {
    return kv_->WriteIfAbsent(key, value);
  }
  Result<std::string> Read(std::string_view key) override { return kv_->Read(key); }
  Status Replace(std::string_view key, std::string_view value) override {
    return kv_->Write(key, value);
  }
  Status Delete(std::string_view key) override {
    Status status = kv_->Delete(key);
    return absl::IsNotFound(status) ? OkStatus() : status;
  }
  std::string Where(std::string_view key) const override {
    return StrCat("'", key, "' in ", kv_->Describe());
  }

 private:
  KvStore* const kv_;
};

}  // namespace

Result<std::unique_ptr<KvLock>> TakeLease(std::shared_ptr<LeaseOps> ops, std::string_view key,
                                          LeaseOptions options) {
  const std::string holder = RandomHexId();
  const std::string record = Record(holder, options.duration);
  Status created = ops->CreateIfAbsent(key, record);
  if (absl::IsAlreadyExists(created)) {
    // Held, or left by a holder that died: an expired lease is taken over.
    Result<std::string> current = ops->Read(key);
    if (current.ok()) {
      const nlohmann::json parsed = nlohmann::json::parse(*current, nullptr, false);
      const int64_t now = NowUnixMs();
      const bool readable = parsed.is_object() && parsed.contains("expires_unix_ms") &&
                            parsed["expires_unix_ms"].is_number_integer();
      const int64_t expires = readable ? parsed["expires_unix_ms"].get<int64_t>() : 0;
      if (readable && expires > now) {
        return FailedPreconditionError(StrCat(
            ops->Where(key), " is locked by another manager (host ",
            parsed.value("host", std::string("?")), ", pid ", parsed.value("pid", int64_t{0}),
            ", lease valid for ", (expires - now) / 1000, " s more)"));
      }
      TS_RETURN_IF_ERROR(ops->Delete(key));
      created = ops->CreateIfAbsent(key, record);
    } else if (absl::IsNotFound(current.status())) {
      created = ops->CreateIfAbsent(key, record);  // released meanwhile
    } else {
      return current.status();
    }
    if (absl::IsAlreadyExists(created)) {
      return FailedPreconditionError(
          StrCat(ops->Where(key), " is locked by another manager (taken just now)"));
    }
  }
  TS_RETURN_IF_ERROR(created);
  auto lease = std::make_unique<Lease>(ops, std::string(key), holder, options.duration);
  // Two takers of one expired lease may each delete and create it; the one whose record is not
  // there afterwards lost.
  if (!lease->HeldByUs()) {
    return FailedPreconditionError(
        StrCat(ops->Where(key), " is locked by another manager (taken just now)"));
  }
  return std::unique_ptr<KvLock>(std::move(lease));
}

std::shared_ptr<LeaseOps> KvStoreLeaseOps(KvStore* kv) { return std::make_shared<KvLeaseOps>(kv); }

}  // namespace tensorstash
