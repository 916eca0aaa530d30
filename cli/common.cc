#include "common.h"

#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <iostream>

#include "tensorstash/kvstore/registry.h"

namespace tensorstash::cli {

Result<StepLocation> OpenStepPath(const std::string& path) {
  TS_ASSIGN_OR_RETURN(StepUrl url, SplitStepUrl(path));
  StepLocation location;
  TS_ASSIGN_OR_RETURN(location.kv, OpenKvStore(url.root, {.create = false}));
  location.key = url.step;
  return location;
}

std::string HumanBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  }
  return buf;
}

std::string HumanTime(int64_t unix_ms) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm local{};
  localtime_r(&seconds, &local);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &local);
  return buf;
}

int Fail(const Status& status) {
  std::cerr << "error: " << status.message() << "\n";
  return 2;
}

ProgressBar::ProgressBar(std::string label, uint64_t total)
    : label_(std::move(label)),
      total_(total),
      enabled_(isatty(STDERR_FILENO) && total >= (uint64_t{64} << 20)),
      start_(std::chrono::steady_clock::now()),
      last_draw_() {}

ProgressBar::~ProgressBar() {
  if (enabled_) std::fprintf(stderr, "\r\033[K");
}

void ProgressBar::Update(uint64_t done) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  const double fraction =
      total_ == 0 ? 1.0 : static_cast<double>(done) / static_cast<double>(total_);
  const int width = 30, filled = static_cast<int>(fraction * width);
  const double seconds = std::chrono::duration<double>(now - start_).count();
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
  std::fprintf(stderr, "\r%s [%s%s] %3d%% %s / %s  %s/s", label_.c_str(),
               std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
               static_cast<int>(fraction * 100), HumanBytes(done).c_str(),
               HumanBytes(total_).c_str(), HumanBytes(static_cast<uint64_t>(rate)).c_str());
  std::fflush(stderr);
}

}  // namespace tensorstash::cli
