// Schemas of the fused attention op family (implementations: cpu/attention_cpu.cpp,
// cuda/attention_cuda.cu). One forward/backward pair covers every layout:
//
//   dense      q, k, v (B, H, S, D); seg_offsets = None, cu_seqlens = None; causal or not
//   retrieval  q, k, v (B, H, S, D); seg_offsets int32 (B, n_seg + 1): segments 0..n_seg-2 are
//              documents attending within themselves, the last segment is the query attending to
//              every document and causally to itself, rows >= seg_offsets[:, -1] are padding
//              (zero output, lse = -inf)
//   varlen     q, k, v (T, H, D); cu_seqlens int32 (B + 1,) as in FlashAttention's varlen API;
//              max_seqlen bounds the longest sequence (the CUDA grid uses it)
//
// fwd returns (out, lse): out like q, lse float32 (float64 for float64 inputs) of shape (B, H, S) or, for varlen, (H, T).
// bwd recomputes the probabilities from lse (FlashAttention-2) and returns (dq, dk, dv).
// The CPU build adds cpu_isa / cpu_set_isa / cpu_kernel (cpu/attention_cpu.cpp): which vector ISA
// the CPU kernels run, chosen at run time (cpu/isa.h).
#include <torch/library.h>

TORCH_LIBRARY(rag_attn, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? seg_offsets, Tensor? cu_seqlens, "
      "int max_seqlen, bool causal, float scale) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? seg_offsets, Tensor? cu_seqlens, int max_seqlen, bool causal, float scale) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
}
