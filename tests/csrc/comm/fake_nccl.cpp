// fake_nccl.cpp: the NCCL communicator of csrc/comm/comm_nccl.cpp against a scripted NCCL (this file) and the
// CUDA-on-CPU emulator, one rank. The fake follows nccl.h's non-blocking contract: init and finalize return
// ncclInProgress, and ncclCommGetAsyncError reports ncclInProgress until the scripted number of polls has passed,
// then the scripted result. It logs every call, so the checks below see the lifecycle NCCL would:
//   - a clean shutdown polls finalize while it is in progress, then destroys (never aborts);
//   - a peer error or a timeout while waiting aborts the communicator inside the failing call, before DistError
//     reaches the caller (the object is still alive then), and the destructor adds nothing;
//   - a failing NCCL call aborts too; an init that never completes aborts the half-built communicator;
//   - collectives run on a stream of the communicator's own, neither the legacy stream nor the compute stream.
// Usage: fake_nccl <free TCP port>; it uses that port and the next five. Prints "ok <check>" lines.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../emu/check.h"
#include "comm/comm_nccl.h"

using gpt2::dist::DistError;

// ------------------------------------------------------------------------------------------------ the fake
struct ncclComm {
  int polls_in_progress = 0;  // polls that still report ncclInProgress (-1: forever)
  ncclResult_t then = ncclSuccess;
};

namespace fake {
std::vector<std::string> calls;  // "init", "finalize", "destroy", "abort", "allreduce"...
std::vector<cudaStream_t> streams;  // the stream of each collective
int init_polls = 2;                 // scripted: ncclInProgress polls after init (-1: never completes)
int finalize_polls = 3;             // after finalize
ncclResult_t after_collective = ncclSuccess;  // what the poll after a collective reports
ncclResult_t collective_returns = ncclSuccess;

int count(const char* what) {
  int n = 0;
  for (auto& c : calls) n += c == what;
  return n;
}
void reset() {
  calls.clear();
  streams.clear();
  init_polls = 2, finalize_polls = 3;
  after_collective = collective_returns = ncclSuccess;
}
ncclResult_t collective(ncclComm_t comm, const char* name, cudaStream_t stream) {
  calls.push_back(name);
  streams.push_back(stream);
  if (collective_returns != ncclSuccess) return collective_returns;
  comm->polls_in_progress = 1;  // enqueued: in progress for one poll
  comm->then = after_collective;
  return ncclSuccess;
}
}  // namespace fake

extern "C" {
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof(*id));
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int, ncclUniqueId, int, ncclConfig_t* cfg) {
  TEST_TRUE(cfg && cfg->blocking == 0, "the communicator must be non-blocking");
  fake::calls.push_back("init");
  *comm = new ncclComm{fake::init_polls, ncclSuccess};
  return ncclInProgress;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* st) {
  if (!comm) return ncclInvalidArgument;
  if (comm->polls_in_progress != 0) {
    if (comm->polls_in_progress > 0) comm->polls_in_progress--;
    *st = ncclInProgress;
  } else {
    *st = comm->then;
  }
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  fake::calls.push_back("finalize");
  comm->polls_in_progress = fake::finalize_polls;
  comm->then = ncclSuccess;
  return ncclInProgress;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  fake::calls.push_back("destroy");
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  fake::calls.push_back("abort");
  delete comm;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t r) { return r == ncclRemoteError ? "remote process exited" : "fake error"; }
const char* ncclGetLastError(ncclComm_t) { return ""; }
ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }
ncclResult_t ncclAllReduce(const void* in, void* out, size_t n, ncclDataType_t, ncclRedOp_t, ncclComm_t comm,
                           cudaStream_t stream) {
  if (in != out) std::memmove(out, in, n * sizeof(float));  // one rank: sum and mean are the input
  return fake::collective(comm, "allreduce", stream);
}
ncclResult_t ncclReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t comm,
                               cudaStream_t stream) {
  return fake::collective(comm, "reduce_scatter", stream);
}
ncclResult_t ncclReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t comm,
                        cudaStream_t stream) {
  return fake::collective(comm, "reduce", stream);
}
ncclResult_t ncclAllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t comm, cudaStream_t stream) {
  return fake::collective(comm, "all_gather", stream);
}
ncclResult_t ncclBroadcast(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t comm, cudaStream_t stream) {
  return fake::collective(comm, "broadcast", stream);
}
// Not in the emulator (its "device memory" is host memory): every pointer these checks pass is device memory.
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void*) {
  std::memset(a, 0, sizeof(*a));
  a->type = cudaMemoryTypeDevice;
  return cudaSuccess;
}
}

// ------------------------------------------------------------------------------------------------ checks
static int g_port = 0;
static std::unique_ptr<gpt2::dist::Comm> make(cudaStream_t compute, int timeout_ms = 2000) {
  gpt2::dist::RendezvousOptions o;
  o.master_port = g_port++;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return gpt2::dist::make_nccl_comm(o, 0, compute);
}

static void clean_shutdown_waits_for_finalize(cudaStream_t compute) {
  fake::reset();
  make(compute).reset();
  TEST_TRUE(fake::count("finalize") == 1 && fake::count("destroy") == 1 && fake::count("abort") == 0,
            "finalize in progress for 3 polls must end in destroy, not abort (finalize %d destroy %d abort %d)",
            fake::count("finalize"), fake::count("destroy"), fake::count("abort"));
  printf("ok clean shutdown polls finalize while ncclInProgress, then destroys\n");
}

static void peer_error_aborts_inside_the_call(cudaStream_t compute, float* buf) {
  fake::reset();
  auto comm = make(compute);
  fake::after_collective = ncclRemoteError;
  bool threw = false;
  try {
    comm->allreduce(buf, 4, gpt2::dist::ReduceOp::Avg);
  } catch (const DistError& e) {
    threw = true;
    TEST_TRUE(std::string(e.what()).find("remote process exited") != std::string::npos, "message: %s", e.what());
    TEST_TRUE(fake::count("abort") == 1, "the communicator must be aborted before DistError leaves the call");
  }
  TEST_TRUE(threw, "a peer's error must raise DistError");
  try {
    comm->barrier();
    TEST_TRUE(false, "a broken communicator must refuse further collectives");
  } catch (const DistError& e) {
    TEST_TRUE(std::string(e.what()).find("broken") != std::string::npos, "message: %s", e.what());
  }
  comm.reset();
  TEST_TRUE(fake::count("abort") == 1 && fake::count("finalize") == 0 && fake::count("destroy") == 0,
            "the destructor of an aborted communicator must not touch it again");
  printf("ok a peer error aborts the communicator inside the failing call\n");
}

static void timeout_aborts(cudaStream_t compute, float* buf) {
  fake::reset();
  auto comm = make(compute, 200);
  fake::after_collective = ncclInProgress;  // a peer that hangs: the collective never completes
  const auto t0 = std::chrono::steady_clock::now();
  try {
    comm->allreduce(buf, 4, gpt2::dist::ReduceOp::Sum);
    TEST_TRUE(false, "a hung collective must time out");
  } catch (const DistError& e) {
    TEST_TRUE(std::string(e.what()).find("timed out") != std::string::npos, "message: %s", e.what());
    TEST_TRUE(fake::count("abort") == 1, "a timeout must abort the communicator before DistError leaves the call");
  }
  TEST_TRUE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5), "the timeout is 0.2 s");
  printf("ok a timed-out collective aborts the communicator\n");
}

static void failing_call_aborts(cudaStream_t compute, float* buf) {
  fake::reset();
  auto comm = make(compute);
  fake::collective_returns = ncclInvalidUsage;
  try {
    comm->broadcast(buf, 4, 0);
    TEST_TRUE(false, "a failing NCCL call must raise DistError");
  } catch (const DistError&) {
    TEST_TRUE(fake::count("abort") == 1, "a failing NCCL call must abort the communicator");
  }
  printf("ok a failing NCCL call aborts the communicator\n");
}

static void init_timeout_aborts(cudaStream_t compute) {
  fake::reset();
  fake::init_polls = -1;  // init never completes
  try {
    make(compute, 200);
    TEST_TRUE(false, "an init that never completes must time out");
  } catch (const DistError& e) {
    TEST_TRUE(std::string(e.what()).find("ncclCommInitRank") != std::string::npos, "message: %s", e.what());
  }
  TEST_TRUE(fake::count("init") == 1 && fake::count("abort") == 1, "the half-built communicator must be aborted");
  printf("ok an init timeout aborts the half-built communicator\n");
}

static void collectives_use_a_comm_stream(cudaStream_t compute, float* buf) {
  fake::reset();
  auto comm = make(compute);
  comm->allreduce(buf, 4, gpt2::dist::ReduceOp::Avg);
  comm->reduce_scatter(buf, 4, gpt2::dist::ReduceOp::Sum);
  comm->reduce_scatter_v(buf, {3}, gpt2::dist::ReduceOp::Avg);  // ZeRO-2's bucket: one ncclReduce per piece
  TEST_TRUE(fake::count("reduce") == 1, "reduce_scatter_v: %d ncclReduce calls", fake::count("reduce"));
  comm->reduce_scatter_v(buf, {0}, gpt2::dist::ReduceOp::Avg);  // an empty bucket: no call
  try {
    comm->reduce_scatter_v(buf, {1, 1}, gpt2::dist::ReduceOp::Avg);
    TEST_TRUE(false, "counts for 2 ranks in a group of 1 must be refused");
  } catch (const DistError& e) {
    TEST_TRUE(std::string(e.what()).find("2 counts for 1 ranks") != std::string::npos, "message: %s", e.what());
  }
  comm->all_gather(buf, 4);
  comm->broadcast(buf, 4, 0);
  comm->barrier();
  TEST_TRUE(fake::streams.size() == 6, "%zu collectives", fake::streams.size());
  for (cudaStream_t s : fake::streams) {
    TEST_TRUE(s != nullptr && s != cudaStreamLegacy && s != cudaStreamPerThread, "a collective on the legacy stream");
    TEST_TRUE(s != compute, "a collective on the compute stream");
    TEST_TRUE(s == fake::streams[0], "collectives on different streams");
  }
  printf("ok collectives run on the communicator's own stream\n");
}

int main(int argc, char** argv) {
  TEST_TRUE(argc == 2, "usage: fake_nccl <port>");
  g_port = std::atoi(argv[1]);
  cudaStream_t compute = nullptr;
  float* buf = nullptr;
  TEST_TRUE(cudaStreamCreate(&compute) == cudaSuccess && cudaMalloc(&buf, 4 * sizeof(float)) == cudaSuccess, "setup");
  clean_shutdown_waits_for_finalize(compute);
  peer_error_aborts_inside_the_call(compute, buf);
  timeout_aborts(compute, buf);
  failing_call_aborts(compute, buf);
  init_timeout_aborts(compute);
  collectives_use_a_comm_stream(compute, buf);
  return 0;
}
