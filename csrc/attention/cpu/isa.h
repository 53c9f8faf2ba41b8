// Which vector ISA the CPU attention kernels run, chosen at run time.
//
// The AVX2 and AVX-512 kernels are both compiled into the extension whatever -march says (GCC's
// `#pragma GCC target` around each ISA's code, in namespaces rag_attn::cpu::avx2 / ::avx512), and
// the op picks one per call from the CPU's features (__builtin_cpu_supports):
//
//   avx512   AVX-512 F/BW/DQ/VL (fp32); bf16 also needs AVX512-BF16 (vdpbf16ps), else runs avx2
//   avx2     AVX2 + FMA (fp32, and bf16 widened to fp32)
//   generic  the portable kernels (BLAS per tile + loops), on every CPU
//
// RAG_ATTN_ISA=avx512|avx2|generic (read once, at the first call) or set_isa() caps the
// choice, so a lower ISA can be forced and measured on a CPU that has a higher one; asking for an
// ISA the CPU lacks is an error. Other compilers / architectures (clang, aarch64) build the
// generic kernels only.
#pragma once

#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define RAG_ATTN_X86_DISPATCH 1
// Every function defined between BEGIN and END is compiled for that ISA (templates and lambdas
// included); nothing outside calls them unless the CPU has the features.
#define RAG_ATTN_BEGIN_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define RAG_ATTN_BEGIN_AVX512 \
  _Pragma("GCC push_options")  \
      _Pragma("GCC target(\"avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16\")")
#define RAG_ATTN_END_ISA _Pragma("GCC pop_options")
#else
#define RAG_ATTN_X86_DISPATCH 0
#endif

namespace rag_attn::cpu {

enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
Isa isa_from_name(const std::string& name);  // TORCH_CHECKs the name
Isa best_isa();                              // the highest ISA this CPU (and this build) supports
bool cpu_has_avx512_bf16();                  // vdpbf16ps, for the AVX-512 bf16 kernels
Isa active_isa();                            // best_isa() capped by RAG_ATTN_ISA / set_isa()
void set_isa(Isa isa);                       // TORCH_CHECKs that the CPU supports it

}  // namespace rag_attn::cpu
