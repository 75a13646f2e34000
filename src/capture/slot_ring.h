// SlotRing: the host side of the one staging ring through which every value that changes
// between launches of a captured step (the valid-sample count, learning rates, the fused
// optimizer's hyper-parameters) reaches the device.
//
// Why a ring. A captured graph replays its kernel arguments verbatim, so per-launch values must
// be read from memory when the graph runs. The host runs ahead of the GPU: when it stages the
// values of launch n, launches n - 1, n - 2, ... may not have run yet, so one fixed buffer would
// hand them launch n's values. Launch n's values therefore go into slot n % capacity of a ring
// in host memory the device can read (mapped pinned memory), and the launch's first kernel (the
// fetch, see staging_ring.h) copies slot (its own launch count % capacity) into device memory,
// where the step's kernels read them.
//
// Each slot opens with the sequence number it was staged for. The fetch compares it with the
// device's launch count and counts a mismatch (a launch that found a slot not staged for it:
// a replay without staging) instead of silently using stale values; the count is published to
// host memory, and the next stage() raises on it.
//
// Back-pressure: the fetch publishes how many launches it has consumed, and stage() waits while
// `capacity` staged launches are unconsumed; with 1024 slots it waits only when the host is 1024
// launches ahead, more than CUDA lets it queue. The wait is bounded by a timeout (a hung device
// raises instead of hanging the process).
//
// Rollback: stage() takes a slot; when the launch it was for does not happen (a later part of
// the call failed), unstage() gives it back. Only the newest slot that no launch has consumed
// can be given back, so whichever part of a call fails, the same one call undoes the staging.
// The owner says when it enqueued a launch that fetches (launched()); slots staged and not yet
// launched are "pending".
//
// The class holds no CUDA: the memory is given to it, so tests drive the device side by hand.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace nimble_train::capture {

// The header of a slot; the float values follow, and the slot is padded to 16 bytes.
struct SlotHeader {
  int64_t seq;  // the launch this slot was staged for (0, 1, 2, ...)
  int64_t reserved;
};

constexpr int64_t slot_bytes(int64_t num_values) {
  const int64_t raw = int64_t(sizeof(SlotHeader)) + num_values * int64_t(sizeof(float));
  return (raw + 15) / 16 * 16;
}

// What the device side publishes to the host after each fetch.
struct RingCounters {
  int64_t consumed;  // launches whose fetch has run
  int64_t stale;     // of those, launches that found a slot staged for another launch
};

class SlotRing {
 public:
  // slots: capacity * slot_bytes(num_values) bytes of host memory; counters: written by the
  // device side (read here with volatile loads, so a GPU writing mapped memory is seen).
  SlotRing(std::byte* slots, int64_t num_values, int64_t capacity,
           const volatile RingCounters* counters);

  // Writes the values of the next launch (values: [num_values]); returns its sequence number.
  // Waits while `capacity` staged launches are unconsumed and throws after `timeout`; throws
  // when the device reported a launch that read a stale slot.
  int64_t stage(const float* values, std::chrono::milliseconds timeout);
  // Rewrites the newest pending slot (staged, not launched) with new values.
  void restage(const float* values);
  // Takes back the newest pending slot: the launch it was staged for will not happen.
  void unstage();
  // The owner enqueued `n` launches that fetch; each consumes the oldest pending slot.
  void launched(int64_t n = 1);

  int64_t num_values() const { return num_values_; }
  int64_t capacity() const { return capacity_; }
  int64_t staged() const { return staged_; }
  int64_t launches() const { return launched_; }
  int64_t pending() const { return staged_ - launched_; }
  int64_t consumed() const { return counters_->consumed; }  // as last published by the device
  int64_t stale() const { return counters_->stale; }

  // The slot that launch `seq` reads (for the device side and for tests).
  std::byte* slot(int64_t seq) const { return slots_ + (seq % capacity_) * slot_bytes_; }

 private:
  void write(int64_t seq, const float* values);

  std::byte* slots_;
  int64_t num_values_;
  int64_t capacity_;
  int64_t slot_bytes_;
  const volatile RingCounters* counters_;
  int64_t staged_ = 0;
  int64_t launched_ = 0;
  int64_t stale_seen_ = 0;
};

// The device side's work for one launch, as plain host code: the CPU path of the ring, and the
// reference the fetch kernel follows. Copies launch `counters->consumed`'s slot into `current`
// ([num_values] floats) and advances the counters.
void fetch_slot_reference(const std::byte* slots, int64_t num_values, int64_t capacity,
                          float* current, RingCounters* counters);

}  // namespace nimble_train::capture
