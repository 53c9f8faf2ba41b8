// Work decomposition shared by the CPU kernels: every layout becomes a list of "groups"
// (one (sequence, head) pair with its own row offset) and "items" (a block of query rows plus the
// contiguous key interval those rows may see). The retrieval layout needs no mask tensor: every
// row attends to one contiguous key interval (a document row: its document; a query row: keys
// [0, row], i.e. all documents and causally its own prefix), so items never visit a key block
// that is fully masked.
#pragma once

#include <ATen/ATen.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace rag_attn {

struct Group {
  int64_t off;      // element offset of row 0 in q/k/v/out (all share one layout)
  int64_t lse_off;  // element offset of row 0 in lse
  int64_t len;      // rows (= keys) in this sequence
};

struct Item {
  int32_t group;
  int32_t r0, r1;      // query rows [r0, r1), relative to the group
  int32_t k_lo, k_hi;  // keys [k_lo, k_hi) ...
  bool causal;         // ... and additionally key <= row
  int64_t cost() const {
    const int64_t k_end = causal ? std::min<int64_t>(k_hi, r1) : k_hi;
    return int64_t(r1 - r0) * std::max<int64_t>(k_end - k_lo, 0);
  }
};

struct Plan {
  std::vector<Group> groups;
  std::vector<Item> items;          // grouped: items of group g are [item_begin[g], item_begin[g+1])
  std::vector<int64_t> item_begin;  // size groups + 1
  int64_t row_stride = 0;           // elements between consecutive rows of one sequence
  bool has_padding = false;         // some rows belong to no item (zero output)
};

inline void add_rows(Plan& p, int32_t g, int64_t a, int64_t e, int64_t k_lo, int64_t k_hi, bool causal,
                     int64_t block_q) {
  for (int64_t r = a; r < e; r += block_q) {
    p.items.push_back(Item{g, int32_t(r), int32_t(std::min(r + block_q, e)), int32_t(k_lo),
                           int32_t(k_hi), causal});
  }
}

// q: (B, H, S, D) or, with cu_seqlens, (T, H, D). Offsets tensors are read on the host.
inline Plan make_plan(const at::Tensor& q, const c10::optional<at::Tensor>& seg_offsets,
                      const c10::optional<at::Tensor>& cu_seqlens, bool causal, int64_t block_q) {
  Plan p;
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(!seg_offsets.has_value(), "rag_attn: pass seg_offsets or cu_seqlens, not both");
    TORCH_CHECK(q.dim() == 3, "rag_attn varlen: q must be (T, H, D)");
    const auto cu = cu_seqlens->to(at::kCPU, at::kLong).contiguous();
    TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, "rag_attn: cu_seqlens must be (B + 1,)");
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
    const int64_t* c = cu.data_ptr<int64_t>();
    const int64_t B = cu.size(0) - 1;
    TORCH_CHECK(c[0] == 0, "rag_attn: cu_seqlens[0] must be 0");
    TORCH_CHECK(c[B] <= T, "rag_attn: cu_seqlens[-1] exceeds the number of tokens");
    p.row_stride = H * D;
    p.has_padding = c[B] < T;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(c[b + 1] >= c[b], "rag_attn: cu_seqlens must be non-decreasing");
      for (int64_t h = 0; h < H; ++h) {
        const int32_t g = int32_t(p.groups.size());
        const int64_t L = c[b + 1] - c[b];
        p.groups.push_back(Group{c[b] * H * D + h * D, h * T + c[b], L});
        p.item_begin.push_back(int64_t(p.items.size()));
        add_rows(p, g, 0, L, 0, L, causal, block_q);
      }
    }
  } else {
    TORCH_CHECK(q.dim() == 4, "rag_attn: q must be (B, H, S, D)");
    const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
    p.row_stride = D;
    at::Tensor so;
    int64_t n = 0;
    if (seg_offsets.has_value()) {
      so = seg_offsets->to(at::kCPU, at::kLong).contiguous();
      TORCH_CHECK(so.dim() == 2 && so.size(0) == B && so.size(1) >= 2,
                  "rag_attn: seg_offsets must be (B, n_seg + 1) with n_seg >= 1");
      n = so.size(1) - 1;
    }
    for (int64_t b = 0; b < B; ++b) {
      const int64_t* o = seg_offsets.has_value() ? so.data_ptr<int64_t>() + b * (n + 1) : nullptr;
      if (o != nullptr) {
        TORCH_CHECK(o[0] == 0, "rag_attn: seg_offsets[:, 0] must be 0");
        TORCH_CHECK(o[n] <= S, "rag_attn: seg_offsets[:, -1] exceeds the sequence length");
        for (int64_t s = 0; s < n; ++s) TORCH_CHECK(o[s + 1] >= o[s], "rag_attn: seg_offsets must be non-decreasing");
        if (o[n] < S) p.has_padding = true;
      }
      for (int64_t h = 0; h < H; ++h) {
        const int32_t g = int32_t(p.groups.size());
        p.groups.push_back(Group{(b * H + h) * S * D, (b * H + h) * S, S});
        p.item_begin.push_back(int64_t(p.items.size()));
        if (o == nullptr) {
          add_rows(p, g, 0, S, 0, S, causal, block_q);
        } else {
          for (int64_t s = 0; s + 1 < n; ++s)  // documents: within themselves
            add_rows(p, g, o[s], o[s + 1], o[s], o[s + 1], false, block_q);
          // query: every document plus its own causal prefix = keys [0, row]
          add_rows(p, g, o[n - 1], o[n], 0, o[n], true, block_q);
        }
      }
    }
  }
  p.item_begin.push_back(int64_t(p.items.size()));
  return p;
}

}  // namespace rag_attn
