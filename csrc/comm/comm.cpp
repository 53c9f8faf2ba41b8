// Schemas of the rmm_comm ops. Implementations: cpu/*.cpp (CPU), cuda/*.cu (CUDA); fake (meta)
// kernels and the plain-PyTorch references live in parallel/kernels/comm.py.
//
// Collectives take an integer handle to a mapped group segment (see shm.h); all ranks of the
// segment must call the same collectives in the same order, as with any process group.
#include <torch/library.h>

#include "shm.h"

TORCH_LIBRARY(rmm_comm, m) {
  // ---- segment control (no tensors: catch-all kernels)
  m.def("group_open(str name, int rank, int nranks, int half_bytes, bool create, float timeout_s) -> int",
        &rmm_comm::group_open);
  m.def("group_close(int handle) -> ()", &rmm_comm::group_close);
  m.def("group_mapped(int handle) -> int", &rmm_comm::group_mapped);
  m.def(
      "channel_open(str name, int side, int slot_bytes, int slots, bool create, float timeout_s, "
      "int src_rank, int dst_rank) -> int",
      &rmm_comm::channel_open);
  m.def("channel_close(int handle) -> ()", &rmm_comm::channel_close);
  m.def("channel_rewind(int handle) -> ()", &rmm_comm::channel_rewind);
  m.def("channel_mapped(int handle) -> int", &rmm_comm::channel_mapped);
  m.def("shm_unlink(str name) -> ()", &rmm_comm::shm_unlink_name);

  // ---- shared-memory collectives (sum; fp32 or bf16 with fp32 accumulation)
  m.def("all_reduce_(Tensor(a!) x, int handle) -> ()");
  m.def("all_reduce(Tensor x, int handle) -> Tensor");
  m.def("all_gather(Tensor x, int handle) -> Tensor");       // (W, *x.shape)
  m.def("reduce_scatter(Tensor x, int handle) -> Tensor");   // (x.shape[0] / W, *x.shape[1:])

  // ---- point to point through a channel segment
  m.def("send(Tensor x, int handle) -> ()");
  m.def("recv_(Tensor(a!) out, int handle) -> ()");

  // ---- block-wise int8 quantisation along the last dim (CPU and CUDA)
  m.def("quantize_int8(Tensor x, int block_size) -> (Tensor, Tensor)");
  m.def("quantize_int8_ef(Tensor x, Tensor(a!) error, int block_size) -> (Tensor, Tensor)");
  m.def("dequantize_int8(Tensor q, Tensor scales, int block_size) -> Tensor");
  m.def("dequantize_sum_int8(Tensor q, Tensor scales, int block_size) -> Tensor");
}
