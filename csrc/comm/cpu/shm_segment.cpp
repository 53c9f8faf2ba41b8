// Creating, mapping and releasing shared-memory segments; barriers and liveness checks.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include <c10/util/Exception.h>

#include "../shm.h"

namespace rmm_comm {

namespace {

std::mutex g_mu;
std::vector<std::unique_ptr<Group>> g_groups;
std::vector<std::unique_ptr<Channel>> g_chans;

inline uint64_t load_acq(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_rel(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// Map `bytes` of the named segment; create it (exclusively) or open an existing one.
void* map_segment(const std::string& name, size_t bytes, bool create) {
  int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "rmm_comm: shm_open(", name, create ? ", create" : ", open", ") failed: ",
              std::strerror(errno));
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "rmm_comm: ftruncate(", name, ", ", bytes, ") failed: ", std::strerror(e));
  }
  if (!create) {
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
      close(fd);
      TORCH_CHECK(false, "rmm_comm: segment ", name, " is smaller than expected (", bytes,
                  " bytes): ranks disagree on the buffer size?");
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);  // the mapping keeps the segment alive
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    TORCH_CHECK(false, "rmm_comm: mmap(", name, ") failed: ", std::strerror(e));
  }
  return p;
}

}  // namespace

bool pid_alive(int32_t pid) {
  if (pid <= 0) return true;  // not registered yet: cannot tell
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child stays a zombie until its parent reaps it; kill(pid, 0) still succeeds.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;  // no procfs: trust kill()
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* rp = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may contain spaces
  if (rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X')) return false;
  return true;
}

void Group::barrier(const char* what) {
  // An aborted group stays unusable: its peers may be gone or out of step.
  int64_t ab0 = __atomic_load_n(&hdr->abort_rank, __ATOMIC_ACQUIRE);
  TORCH_CHECK(ab0 < 0, "rmm_comm shm ", what, ": local rank ", ab0,
              " aborted the group because local rank ", hdr->abort_peer,
              hdr->abort_why == 1 ? " died" : " timed out", "; the group cannot be used any more");
  const uint64_t target = ++barrier_seq;
  store_rel(&hdr->arrive[rank].v, target);
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    const uint64_t* c = &hdr->arrive[p].v;
    wait_until([&] { return load_acq(c) >= target; },
               [&](double waited) {
                 int64_t ab = __atomic_load_n(&hdr->abort_rank, __ATOMIC_ACQUIRE);
                 if (ab >= 0 && ab != rank) {
                   TORCH_CHECK(false, "rmm_comm shm ", what, ": local rank ", ab,
                               " aborted the group because local rank ", hdr->abort_peer,
                               hdr->abort_why == 1 ? " died" : " timed out", "; local rank ", rank,
                               " gives up too");
                 }
                 if (!pid_alive(hdr->pids[p])) {
                   hdr->abort_peer = p;
                   hdr->abort_why = 1;
                   __atomic_store_n(&hdr->abort_rank, static_cast<int64_t>(rank), __ATOMIC_RELEASE);
                   TORCH_CHECK(false, "rmm_comm shm ", what, ": local rank ", p, " (pid ",
                               hdr->pids[p], ") died during the collective; local rank ", rank,
                               " cannot complete it");
                 }
                 if (waited > timeout_s) {
                   hdr->abort_peer = p;
                   hdr->abort_why = 2;
                   __atomic_store_n(&hdr->abort_rank, static_cast<int64_t>(rank), __ATOMIC_RELEASE);
                   TORCH_CHECK(false, "rmm_comm shm ", what, ": local rank ", rank,
                               " timed out after ", timeout_s, " s waiting for local rank ", p,
                               " (alive but not calling the same collective?)");
                 }
               });
  }
}

int64_t group_open(const std::string& name, int64_t rank, int64_t nranks, int64_t half_bytes,
                   bool create, double timeout_s) {
  TORCH_CHECK(nranks >= 1 && nranks <= kMaxRanks, "rmm_comm: nranks must be in [1, ", kMaxRanks,
              "], got ", nranks);
  TORCH_CHECK(rank >= 0 && rank < nranks, "rmm_comm: bad rank ", rank);
  TORCH_CHECK(half_bytes >= 4096 && half_bytes % 64 == 0,
              "rmm_comm: half_bytes must be a multiple of 64 and >= 4096");
  const size_t hdr_bytes = align_up(sizeof(GroupHeader), 4096);
  const size_t bytes = hdr_bytes + static_cast<size_t>(nranks) * 2 * half_bytes;
  void* p = map_segment(name, bytes, create);
  auto* hdr = static_cast<GroupHeader*>(p);
  if (create) {
    std::memset(p, 0, hdr_bytes);
    hdr->nranks = nranks;
    hdr->half_bytes = half_bytes;
    hdr->abort_rank = -1;
    __atomic_store_n(&hdr->magic, kGroupMagic, __ATOMIC_RELEASE);
  } else if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != kGroupMagic ||
             hdr->nranks != nranks || hdr->half_bytes != half_bytes) {
    munmap(p, bytes);
    TORCH_CHECK(false, "rmm_comm: segment ", name, " has a different layout than expected");
  }
  hdr->pids[rank] = static_cast<int32_t>(getpid());
  __atomic_fetch_add(&hdr->mapped.v, 1, __ATOMIC_ACQ_REL);
  auto g = std::make_unique<Group>();
  g->name = name;
  g->hdr = hdr;
  g->data = static_cast<char*>(p) + hdr_bytes;
  g->map_bytes = bytes;
  g->rank = static_cast<int>(rank);
  g->nranks = static_cast<int>(nranks);
  g->half_bytes = half_bytes;
  g->timeout_s = timeout_s;
  std::lock_guard<std::mutex> lk(g_mu);
  g_groups.push_back(std::move(g));
  return static_cast<int64_t>(g_groups.size() - 1);
}

Group& group_from_handle(int64_t h) {
  std::lock_guard<std::mutex> lk(g_mu);
  TORCH_CHECK(h >= 0 && h < static_cast<int64_t>(g_groups.size()) && g_groups[h],
              "rmm_comm: invalid or closed group handle ", h);
  return *g_groups[h];
}

int64_t group_mapped(int64_t h) {
  return static_cast<int64_t>(load_acq(&group_from_handle(h).hdr->mapped.v));
}

void group_close(int64_t h) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (h < 0 || h >= static_cast<int64_t>(g_groups.size()) || !g_groups[h]) return;
  munmap(g_groups[h]->hdr, g_groups[h]->map_bytes);
  g_groups[h].reset();
}

int64_t channel_open(const std::string& name, int64_t side, int64_t slot_bytes, int64_t slots,
                     bool create, double timeout_s, int64_t src_rank, int64_t dst_rank) {
  TORCH_CHECK(side == 0 || side == 1, "rmm_comm: channel side must be 0 (send) or 1 (recv)");
  TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0 && slots >= 1,
              "rmm_comm: slot_bytes must be a multiple of 64, slots >= 1");
  const size_t hdr_bytes = align_up(sizeof(ChanHeader), 4096);
  const size_t bytes = hdr_bytes + static_cast<size_t>(slots) * slot_bytes;
  void* p = map_segment(name, bytes, create);
  auto* hdr = static_cast<ChanHeader*>(p);
  if (create) {
    std::memset(p, 0, hdr_bytes);
    hdr->slot_bytes = slot_bytes;
    hdr->slots = slots;
    hdr->abort_side = -1;
    __atomic_store_n(&hdr->magic, kChanMagic, __ATOMIC_RELEASE);
  } else if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != kChanMagic ||
             hdr->slot_bytes != slot_bytes || hdr->slots != slots) {
    munmap(p, bytes);
    TORCH_CHECK(false, "rmm_comm: channel ", name, " has a different layout than expected");
  }
  hdr->pids[side] = static_cast<int32_t>(getpid());
  auto c = std::make_unique<Channel>();
  c->name = name;
  c->hdr = hdr;
  c->data = static_cast<char*>(p) + hdr_bytes;
  c->map_bytes = bytes;
  c->side = static_cast<int>(side);
  c->src_rank = src_rank;
  c->dst_rank = dst_rank;
  c->timeout_s = timeout_s;
  std::lock_guard<std::mutex> lk(g_mu);
  g_chans.push_back(std::move(c));
  return static_cast<int64_t>(g_chans.size() - 1);
}

Channel& channel_from_handle(int64_t h) {
  std::lock_guard<std::mutex> lk(g_mu);
  TORCH_CHECK(h >= 0 && h < static_cast<int64_t>(g_chans.size()) && g_chans[h],
              "rmm_comm: invalid or closed channel handle ", h);
  return *g_chans[h];
}

int64_t channel_mapped(int64_t h) {
  Channel& c = channel_from_handle(h);
  return (c.hdr->pids[0] > 0 ? 1 : 0) + (c.hdr->pids[1] > 0 ? 1 : 0);
}

// Step boundary: move this side's counter to the next multiple of the ring size, so the next step
// starts at slot 0 again. A ring holds a whole step's messages, but left alone a step's few
// messages would walk through all of it step after step: every page of a 64 MiB ring faulted in
// on first use (~20 us per 32 KiB message) and the slots never warm in cache. Each side rewinds
// after its own last message of the step; both reach the same value, as the receiver has by then
// consumed exactly what the sender wrote. The positions jumped over hold no message, and the usual
// checks still hold across the jump: the sender writes a position only once the receiver has
// consumed the one a ring earlier, the receiver reads one only once it is written.
void channel_rewind(int64_t h) {
  Channel& c = channel_from_handle(h);
  uint64_t* ctr = c.side == 0 ? &c.hdr->written.v : &c.hdr->consumed.v;  // only this side writes it
  const uint64_t slots = static_cast<uint64_t>(c.hdr->slots);
  const uint64_t v = __atomic_load_n(ctr, __ATOMIC_RELAXED);
  __atomic_store_n(ctr, (v + slots - 1) / slots * slots, __ATOMIC_RELEASE);
}

void channel_close(int64_t h) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (h < 0 || h >= static_cast<int64_t>(g_chans.size()) || !g_chans[h]) return;
  munmap(g_chans[h]->hdr, g_chans[h]->map_bytes);
  g_chans[h].reset();
}

void shm_unlink_name(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) {
    TORCH_CHECK(false, "rmm_comm: shm_unlink(", name, ") failed: ", std::strerror(errno));
  }
}

}  // namespace rmm_comm
