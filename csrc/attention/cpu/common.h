// Pieces shared by every CPU attention kernel (generic, AVX2, AVX-512): tile sizes, the causal
// visibility of a key block, the work queue and the accumulation type.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../layout.h"

namespace rag_attn::cpu {

// Query rows per item and keys per inner step. 64 x 256 fp32 scores (64 KiB) plus the output
// accumulator stay in L2 (1 MiB per core here); larger key blocks amortise the BLAS call overhead.
inline int64_t env_or(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : dflt;
}
const int64_t kBlockQ = env_or("RAG_ATTN_BQ", 64);
const int64_t kBlockK = env_or("RAG_ATTN_BK", 256);

// Number of keys in [kb, kb + n) that row `row` may see (all of them unless causal).
inline int64_t visible(bool causal, int64_t row, int64_t kb, int64_t n) {
  return causal ? std::min<int64_t>(std::max<int64_t>(row - kb + 1, 0), n) : n;
}

// The work queue of every kernel here: indices costliest first (ragged layouts balance when the
// big items start early), pulled from an atomic counter by one task per thread.
class WorkQueue {
 public:
  explicit WorkQueue(const std::vector<int64_t>& cost) : order_(cost.size()) {
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  }
  int64_t tasks() const {  // one per thread, at most one per index
    return std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(int64_t(order_.size()), 1));
  }
  bool pop(int64_t& index) {  // the next index to work on; false when none is left
    const int64_t w = next_.fetch_add(1);
    if (w >= int64_t(order_.size())) return false;
    index = order_[w];
    return true;
  }

 private:
  std::vector<int64_t> order_;
  std::atomic<int64_t> next_{0};
};

inline std::vector<int64_t> item_costs(const Plan& plan) {
  std::vector<int64_t> cost(plan.items.size());
  for (size_t x = 0; x < cost.size(); ++x) cost[x] = plan.items[x].cost();
  return cost;
}

// Backward works per (sequence, head) group: a group costs the sum of its items.
inline std::vector<int64_t> group_costs(const Plan& plan) {
  std::vector<int64_t> cost(plan.groups.size(), 0);
  for (size_t gi = 0; gi < cost.size(); ++gi)
    for (int64_t x = plan.item_begin[gi]; x < plan.item_begin[gi + 1]; ++x) cost[gi] += plan.items[x].cost();
  return cost;
}

// Accumulation type: fp32 for fp32/bf16 inputs (FlashAttention), fp64 for gradcheck inputs.
template <typename T>
using acc_of = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Tiles of the vector (AVX2 / AVX-512) kernels: kFastBQ query rows per item (the width of the
// transposed score tile S^T, keys x queries) and keys per step, kFastBK for AVX-512 and
// kFastBKAvx2 for AVX2 (64 x 128 fp32 scores = 32 KiB, the L1 of the AVX2 EPYC this was tuned on;
// 256 ran 10-25% slower there). RAG_ATTN_FAST_BK sets both; RAG_ATTN_FAST=0 sends every call to
// the generic kernels.
constexpr int64_t kFastBQ = 64;
const int64_t kFastBK = env_or("RAG_ATTN_FAST_BK", 256);
const int64_t kFastBKAvx2 = env_or("RAG_ATTN_FAST_BK", 128);
const bool kFastEnabled = env_or("RAG_ATTN_FAST", 1) != 0;

}  // namespace rag_attn::cpu
