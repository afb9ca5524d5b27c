// The cuDNN frontend graph behind one gpt2core::seams attention call (csrc/cuda/seams_cudnn.cu), split from
// validating, planning and executing it so the translation can be checked without a GPU: assembling the graph
// needs neither a handle nor a device (validate() and everything after it do), and Graph::print() shows every
// tensor (uid, dims, strides, type) and the SDPA node (scale, causal band, stats). GPU build and its tests only.
#pragma once
#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "cuda/seams.h"

namespace gpt2core::seams {

// The forward (or backward) SDPA graph for qkv (B, T, 3, NH, HS) with this scale and dtype (BF16 or F16), as the
// seam builds it; deterministic: the backward's set_deterministic_algorithm (ignored for the forward).
std::shared_ptr<cudnn_frontend::graph::Graph> attention_graph(int B, int T, int NH, int HS, float scale,
                                                              bool backward, DType dtype, bool deterministic);
// The variant packs (tensor uid -> address) the seam executes those graphs with.
std::unordered_map<int64_t, void*> attention_pack(const AttentionForwardParams& p);
std::unordered_map<int64_t, void*> attention_pack(const AttentionBackwardParams& p);

}  // namespace gpt2core::seams
