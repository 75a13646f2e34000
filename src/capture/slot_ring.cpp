// SlotRing: staging, back-pressure and rollback on the host (see slot_ring.h).
#include "capture/slot_ring.h"

#include <cstring>
#include <thread>

#include "common/check.h"

namespace nimble_train::capture {

SlotRing::SlotRing(std::byte* slots, int64_t num_values, int64_t capacity,
                   const volatile RingCounters* counters)
    : slots_(slots),
      num_values_(num_values),
      capacity_(capacity),
      slot_bytes_(slot_bytes(num_values)),
      counters_(counters) {
  NT_CHECK(slots != nullptr && counters != nullptr, "SlotRing needs slot and counter memory");
  NT_CHECK(num_values >= 0, "SlotRing: num_values must be >= 0; got ", num_values);
  NT_CHECK(capacity >= 2, "SlotRing needs at least two slots; got ", capacity);
  // No launch is numbered -1: before its first staging, every slot reads as stale.
  const SlotHeader never{-1, 0};
  for (int64_t i = 0; i < capacity; ++i) std::memcpy(slot(i), &never, sizeof(never));
}

void SlotRing::write(int64_t seq, const float* values) {
  std::byte* s = slot(seq);
  const SlotHeader header{seq, 0};
  std::memcpy(s + sizeof(SlotHeader), values, sizeof(float) * size_t(num_values_));
  // The header last: a fetch that races with this write (it cannot, with back-pressure, but a
  // replay without staging can) sees the old sequence number and counts the slot as stale.
  std::memcpy(s, &header, sizeof(header));
}

int64_t SlotRing::stage(const float* values, std::chrono::milliseconds timeout) {
  const int64_t stale_now = stale();
  if (stale_now != stale_seen_) {
    const int64_t missed = stale_now - stale_seen_;
    stale_seen_ = stale_now;
    NT_FAIL("the staging ring saw ", missed, " launch(es) read a slot that was not staged for "
            "them: a graph that fetches staged values was replayed without staging (", staged_,
            " staged, ", consumed(), " consumed). Their learning rates and sample counts were "
            "stale. Launch captured steps only through their owner (nt.Step, or "
            "FusedOptimizer.stage_host_values() once before each replay).");
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (staged_ - consumed() >= capacity_) {
    NT_CHECK(std::chrono::steady_clock::now() < deadline,
             "the staging ring waited ", timeout.count(), " ms for the GPU to start one of the ",
             "last ", capacity_, " launches (consumed ", consumed(), ", staged ", staged_,
             "); is the device hung?");
    std::this_thread::yield();
  }
  write(staged_, values);
  return staged_++;
}

void SlotRing::restage(const float* values) {
  NT_CHECK(pending() > 0, "SlotRing::restage: no staged slot is waiting for its launch");
  write(staged_ - 1, values);
}

void SlotRing::unstage() {
  NT_CHECK(pending() > 0, "SlotRing::unstage: every staged slot was launched (staged ", staged_,
           ", launched ", launched_, "); only a slot whose launch did not happen can be taken "
           "back");
  --staged_;
}

void SlotRing::launched(int64_t n) {
  NT_CHECK(n >= 0 && n <= pending(), "SlotRing::launched: ", n, " launch(es) but ", pending(),
           " slot(s) staged for them");
  launched_ += n;
}

void fetch_slot_reference(const std::byte* slots, int64_t num_values, int64_t capacity,
                          float* current, RingCounters* counters) {
  const int64_t launch = counters->consumed;
  const std::byte* s = slots + (launch % capacity) * slot_bytes(num_values);
  SlotHeader header;
  std::memcpy(&header, s, sizeof(header));
  if (header.seq != launch) ++counters->stale;
  std::memcpy(current, s + sizeof(SlotHeader), sizeof(float) * size_t(num_values));
  counters->consumed = launch + 1;
}

}  // namespace nimble_train::capture
