// Comm over NCCL for the CUDA backend. Compiled only when CUDA and NCCL are found (GPT2CORE_HAS_NCCL);
// the CMake object library gpt2core_dist_nccl holds it for the CUDA backend to link.
//
// Rank 0 creates the ncclUniqueId and hands it to the others through the rendezvous store at
// MASTER_ADDR:MASTER_PORT (dist/rendezvous.h). Buffers are device pointers on `device`; every collective is
// enqueued on `stream` and then waited for, polling so that a peer that died or hangs aborts the
// communicator and throws DistError after the timeout instead of spinning forever.
#pragma once
#include <memory>

#include "comm/comm.h"

typedef struct CUstream_st* cudaStream_t;

namespace gpt2::dist {

std::unique_ptr<Comm> make_nccl_comm(const RendezvousOptions& opts, int device, cudaStream_t stream);

}  // namespace gpt2::dist
