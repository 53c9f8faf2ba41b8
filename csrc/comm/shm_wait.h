// The waiting policy shared by collectives and channels (included from shm.h).
//
// Ranks may outnumber cores (4 ranks on a 2-core box), so a pure spin would starve the very
// peer we wait for. We spin for a few microseconds (the common case when each rank has a core),
// then sched_yield, then sleep in short naps; liveness and the deadline are checked every ~2 ms.
#pragma once

#include <sched.h>
#include <time.h>

#include <cstdint>

namespace rmm_comm {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

template <class Ready, class Check>
void wait_until(Ready ready, Check check) {
  // ~2k pause instructions is a few microseconds: long enough to catch a peer that is running
  // on another core, short enough not to burn a shared core.
  constexpr int kSpin = 2048;
  // Yield for up to 1 ms (a peer that shares our core gets it at once), then nap.
  constexpr double kYieldFor = 1e-3;
  for (int i = 0; i < kSpin; ++i) {
    if (ready()) return;
    cpu_relax();
  }
  const double start = now_s();
  double last_check = start;
  for (;;) {
    if (ready()) return;
    double t = now_s();
    if (t - start < kYieldFor) {
      sched_yield();
    } else {
      // 20 us naps (plus timer slack): small next to a stalled peer, and they free the core.
      timespec nap{0, 20000};
      nanosleep(&nap, nullptr);
    }
    if (t - last_check > 2e-3) {
      last_check = t;
      check(t - start);
    }
  }
}

}  // namespace rmm_comm
