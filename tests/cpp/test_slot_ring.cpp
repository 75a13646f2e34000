// SlotRing's protocol on the host, with the device side played by fetch_slot_reference:
// ordering across wrap-around, back-pressure with its timeout, the stale-slot check, rollback.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "capture/slot_ring.h"
#include "common/check.h"

namespace nimble_train::capture {
namespace {

using std::chrono::milliseconds;

// A ring in plain memory, with its device side run by hand.
struct Ring {
  Ring(int64_t num_values, int64_t capacity)
      : memory(size_t(capacity * slot_bytes(num_values))),
        counters{0, 0},
        ring(memory.data(), num_values, capacity, &counters),
        current(size_t(num_values), -1.0f) {}

  // The device consumes the next slot, as the fetch kernel does at the top of a launch.
  void fetch() {
    fetch_slot_reference(memory.data(), ring.num_values(), ring.capacity(), current.data(),
                         &counters);
  }

  std::vector<std::byte> memory;
  RingCounters counters;
  SlotRing ring;
  std::vector<float> current;
};

std::vector<float> values_of(int64_t launch, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float(launch * 100 + i) + 0.5f;
  return v;
}

TEST(SlotRing, SlotsAreSixteenByteAlignedAndHoldTheHeader) {
  EXPECT_EQ(slot_bytes(0), 16);
  EXPECT_EQ(slot_bytes(1), 32);   // 16 + 4, rounded up
  EXPECT_EQ(slot_bytes(4), 32);   // 16 + 16
  EXPECT_EQ(slot_bytes(5), 48);
}

TEST(SlotRing, EachLaunchFetchesItsOwnValuesAcrossWrapAround) {
  Ring r(3, 4);
  for (int64_t launch = 0; launch < 11; ++launch) {  // wraps the 4-slot ring twice
    const auto v = values_of(launch, 3);
    EXPECT_EQ(r.ring.stage(v.data(), milliseconds(10)), launch);
    r.ring.launched();
    r.fetch();
    EXPECT_EQ(r.current, v) << "launch " << launch;
  }
  EXPECT_EQ(r.ring.stale(), 0);
  EXPECT_EQ(r.ring.consumed(), 11);
}

TEST(SlotRing, TheHostRunsAheadByUpToCapacityLaunches) {
  Ring r(2, 4);
  for (int64_t launch = 0; launch < 4; ++launch) {  // four launches queued, none run yet
    const auto v = values_of(launch, 2);
    r.ring.stage(v.data(), milliseconds(10));
    r.ring.launched();
  }
  // A fifth would overwrite the slot launch 0 has not read: the host must wait, then give up.
  const auto v = values_of(4, 2);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(r.ring.stage(v.data(), milliseconds(30)), InvalidArgument);
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(30));
  for (int64_t launch = 0; launch < 4; ++launch) {  // the queued launches read their own slots
    r.fetch();
    EXPECT_EQ(r.current, values_of(launch, 2));
  }
  EXPECT_EQ(r.ring.stage(v.data(), milliseconds(10)), 4);
}

TEST(SlotRing, BackPressureReleasesAsSoonAsTheDeviceConsumes) {
  Ring r(1, 2);
  for (int64_t launch = 0; launch < 2; ++launch) {
    const auto v = values_of(launch, 1);
    r.ring.stage(v.data(), milliseconds(10));
    r.ring.launched();
  }
  std::thread device([&] {
    std::this_thread::sleep_for(milliseconds(20));
    r.fetch();  // launch 0 runs: its slot frees
  });
  const auto v = values_of(2, 1);
  EXPECT_EQ(r.ring.stage(v.data(), milliseconds(5000)), 2);
  device.join();
  r.fetch();
  EXPECT_EQ(r.current, values_of(1, 1));
  r.fetch();
  EXPECT_EQ(r.current, values_of(2, 1));
}

TEST(SlotRing, ALaunchWithoutStagingIsCountedStaleAndTheNextStagingRaises) {
  Ring r(2, 4);
  auto v = values_of(0, 2);
  r.ring.stage(v.data(), milliseconds(10));
  r.ring.launched();
  r.fetch();
  r.fetch();  // a replay nobody staged for: slot 1 was never written
  EXPECT_EQ(r.ring.stale(), 1);
  v = values_of(1, 2);
  try {
    r.ring.stage(v.data(), milliseconds(10));
    FAIL() << "stage() must raise on a stale launch";
  } catch (const RuntimeFailure& e) {
    EXPECT_NE(std::string(e.what()).find("1 launch(es) read a slot that was not staged"),
              std::string::npos) << e.what();
  }
}

TEST(SlotRing, TheFirstLaunchWithoutStagingIsStaleToo) {
  Ring r(1, 4);
  r.fetch();  // zeroed memory must not pass for launch 0's slot
  EXPECT_EQ(r.ring.stale(), 1);
}

TEST(SlotRing, UnstageGivesBackTheSlotOfALaunchThatDidNotHappen) {
  Ring r(2, 3);
  for (int64_t launch = 0; launch < 7; ++launch) {
    const auto doomed = values_of(1000 + launch, 2);
    r.ring.stage(doomed.data(), milliseconds(10));
    r.ring.unstage();  // the call failed after staging
    const auto v = values_of(launch, 2);
    EXPECT_EQ(r.ring.stage(v.data(), milliseconds(10)), launch);
    r.ring.launched();
    r.fetch();
    EXPECT_EQ(r.current, v);
  }
  EXPECT_EQ(r.ring.stale(), 0);
}

TEST(SlotRing, OnlyPendingSlotsCanBeTakenBackOrRewritten) {
  Ring r(1, 2);
  const auto v = values_of(0, 1);
  EXPECT_THROW(r.ring.unstage(), InvalidArgument);
  EXPECT_THROW(r.ring.restage(v.data()), InvalidArgument);
  r.ring.stage(v.data(), milliseconds(10));
  const auto w = values_of(7, 1);
  r.ring.restage(w.data());  // staged twice before one launch: the latest values win
  r.ring.launched();
  EXPECT_THROW(r.ring.unstage(), InvalidArgument);  // launched: its slot belongs to the device
  EXPECT_THROW(r.ring.launched(), InvalidArgument);  // nothing staged for a second launch
  r.fetch();
  EXPECT_EQ(r.current, w);
}

TEST(SlotRing, RandomInterleavingsOfFailuresKeepHostAndDeviceInStep) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t capacity = 2 + int64_t(rng() % 6);
    Ring r(1 + int64_t(rng() % 9), capacity);
    std::vector<std::vector<float>> expected;  // values of launches queued, not yet fetched
    int64_t next = 0;
    for (int op = 0; op < 200; ++op) {
      const int choice = int(rng() % 4);
      if (choice < 2 && int64_t(expected.size()) < capacity) {
        auto v = values_of(next++, r.ring.num_values());
        r.ring.stage(v.data(), milliseconds(10));
        if (choice == 0) {
          r.ring.unstage();  // this call failed
        } else {
          r.ring.launched();
          expected.push_back(v);
        }
      } else if (!expected.empty()) {
        r.fetch();
        ASSERT_EQ(r.current, expected.front()) << "trial " << trial << " op " << op;
        expected.erase(expected.begin());
      }
    }
    EXPECT_EQ(r.ring.stale(), 0);
    EXPECT_EQ(r.ring.pending(), 0);
  }
}

TEST(SlotRing, RejectsABadShape) {
  std::vector<std::byte> memory(64);
  RingCounters counters{0, 0};
  EXPECT_THROW(SlotRing(memory.data(), 1, 1, &counters), InvalidArgument);
  EXPECT_THROW(SlotRing(memory.data(), -1, 2, &counters), InvalidArgument);
  EXPECT_THROW(SlotRing(nullptr, 1, 2, &counters), InvalidArgument);
}

}  // namespace
}  // namespace nimble_train::capture
