// Shared-memory segments for ranks on one host: layout, waiting, and the handle registry.
//
// A *group segment* holds, after a header page, one double-buffered workspace per local rank:
//   [header | rank0: half0 half1 | rank1: half0 half1 | ...]
// Rank r writes only into its own workspace (and, in two-shot all-reduce, only its own slice of
// it) and reads peers' workspaces after a barrier. Barriers are monotonic per-rank counters
// (one cache line each): a rank publishes "I reached barrier s" with a release store and waits
// for every peer's counter >= s with acquire loads, so all writes before the peer's store are
// visible after the wait (the pattern of DeepSpeed's shm.cpp, with counters instead of states).
//
// A *channel segment* is a single-producer single-consumer ring of slots for point-to-point
// send/recv between two pipeline stages.
//
// Both kinds are unlinked from /dev/shm as soon as every participant has mapped them (the
// mapping keeps the memory alive), so neither a normal exit nor a crash leaves a name behind.
// A wait that does not finish checks, every few milliseconds, the abort flag, the liveness of
// the peers' pids (stored in the header) and a deadline, and throws a clear error instead of
// hanging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace rmm_comm {

constexpr uint64_t kGroupMagic = 0x524d4d5f47525031ULL;  // "RMM_GRP1"
constexpr uint64_t kChanMagic = 0x524d4d5f43484e31ULL;   // "RMM_CHN1"
constexpr int kMaxRanks = 64;                             // local ranks per host we support
constexpr size_t kCacheLine = 64;

struct alignas(kCacheLine) Counter {
  uint64_t v;
  char pad[kCacheLine - sizeof(uint64_t)];
};

struct GroupHeader {
  uint64_t magic;
  int64_t nranks;
  int64_t half_bytes;         // bytes of one half of one rank's double buffer
  int64_t abort_rank;         // -1, or the rank that gave up (others then fail fast)
  int64_t abort_peer;         // the rank it gave up on
  int64_t abort_why;          // 1: that rank died, 2: it timed out
  int32_t pids[kMaxRanks];    // pid of each local rank, for liveness checks
  Counter mapped;             // how many ranks mapped the segment
  Counter arrive[kMaxRanks];  // barrier counters, one cache line per rank
};

struct ChanHeader {
  uint64_t magic;
  int64_t slot_bytes;
  int64_t slots;
  int64_t abort_side;  // -1, 0 (sender gave up) or 1 (receiver gave up)
  int32_t pids[2];     // sender, receiver
  Counter written;     // slots filled by the sender (monotonic)
  Counter consumed;    // slots emptied by the receiver (monotonic)
};

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// One mapped group segment in this process.
struct Group {
  std::string name;
  GroupHeader* hdr = nullptr;
  char* data = nullptr;     // start of rank 0's workspace
  size_t map_bytes = 0;
  int rank = 0;
  int nranks = 0;
  int64_t half_bytes = 0;
  uint64_t barrier_seq = 0;  // barriers this rank has passed
  uint64_t chunk_seq = 0;    // chunks processed: picks the buffer half (double buffering)
  double timeout_s = 300.0;

  char* buf(int r, uint64_t chunk) const {
    return data + (static_cast<size_t>(r) * 2 + (chunk & 1)) * static_cast<size_t>(half_bytes);
  }
  // Publish arrival at the next barrier and wait for all peers; `what` names the op in errors.
  void barrier(const char* what);
};

// One mapped channel segment in this process.
struct Channel {
  std::string name;
  ChanHeader* hdr = nullptr;
  char* data = nullptr;
  size_t map_bytes = 0;
  int side = 0;  // 0 sender, 1 receiver
  int64_t src_rank = -1, dst_rank = -1;  // global ranks, for error messages
  double timeout_s = 300.0;
  char* slot(uint64_t i) const {
    return data + static_cast<size_t>(i % hdr->slots) * static_cast<size_t>(hdr->slot_bytes);
  }
};

Group& group_from_handle(int64_t handle);
Channel& channel_from_handle(int64_t handle);

// Control ops (no tensor arguments; registered as catch-all kernels in comm.cpp).
int64_t group_open(const std::string& name, int64_t rank, int64_t nranks, int64_t half_bytes,
                   bool create, double timeout_s);
void group_close(int64_t handle);
int64_t group_mapped(int64_t handle);
int64_t channel_open(const std::string& name, int64_t side, int64_t slot_bytes, int64_t slots,
                     bool create, double timeout_s, int64_t src_rank, int64_t dst_rank);
void channel_close(int64_t handle);
void channel_rewind(int64_t handle);
int64_t channel_mapped(int64_t handle);
void shm_unlink_name(const std::string& name);

// Polite waiting: spin briefly, then yield, then sleep; call `check` every few milliseconds.
// Returns when `ready()` is true. `check` throws to abandon the wait.
template <class Ready, class Check>
void wait_until(Ready ready, Check check);

// Is the process alive (exists and is not a zombie)?
bool pid_alive(int32_t pid);

}  // namespace rmm_comm

#include "shm_wait.h"
