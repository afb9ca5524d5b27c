// describe.cpp: a C entry point (for ctypes) that assembles the real cuDNN frontend graph of one attention seam
// call (attention_graph / attention_pack in csrc/cuda/seams_cudnn.cu, linked against cuDNN) and returns what
// Graph::print() says about it (every tensor's uid, dims, strides and type; the SDPA node's scale, causal band
// and stats) plus the variant pack the seam would execute it with. No handle, no GPU (validate() and the plans
// need a device): tests/csrc/cuda/test_cudnn_graph.py evaluates the description with its own interpreter.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "cuda/seams_cudnn_graph.h"

using namespace gpt2core::seams;

// dtype: a gpt2core::seams::DType (1 = BF16, 2 = F16); deterministic: AttentionBackwardParams::deterministic.
extern "C" int gpt2_describe_attention(int B, int T, int NH, int HS, float scale, int backward, int dtype,
                                       int deterministic, uint64_t qkv,
                                       uint64_t out, uint64_t stats, uint64_t dout, uint64_t dqkv, char* json,
                                       int json_len, int64_t* uids, uint64_t* addrs, int max_pack, int* n_pack,
                                       char* err, int errlen) {
  try {
    const std::string text = attention_graph(B, T, NH, HS, scale, backward != 0, DType(dtype), deterministic != 0)->print();
    if (int(text.size()) >= json_len) throw std::runtime_error("the graph's description does not fit");
    std::snprintf(json, size_t(json_len), "%s", text.c_str());
    std::unordered_map<int64_t, void*> pack;
    if (backward) {
      AttentionBackwardParams p;
      p.dqkv = reinterpret_cast<void*>(dqkv), p.dout = reinterpret_cast<const void*>(dout);
      p.qkv = reinterpret_cast<const void*>(qkv), p.out = reinterpret_cast<const void*>(out);
      p.stats = reinterpret_cast<const float*>(stats);
      p.dtype = DType(dtype), p.B = B, p.T = T, p.NH = NH, p.HS = HS, p.scale = scale;
      p.deterministic = deterministic != 0;
      pack = attention_pack(p);
    } else {
      AttentionForwardParams p;
      p.out = reinterpret_cast<void*>(out), p.stats = reinterpret_cast<float*>(stats);
      p.qkv = reinterpret_cast<const void*>(qkv);
      p.dtype = DType(dtype), p.B = B, p.T = T, p.NH = NH, p.HS = HS, p.scale = scale;
      pack = attention_pack(p);
    }
    if (int(pack.size()) > max_pack) throw std::runtime_error("variant pack larger than expected");
    int i = 0;
    for (const auto& [uid, ptr] : pack) uids[i] = uid, addrs[i] = reinterpret_cast<uint64_t>(ptr), i++;
    *n_pack = i;
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, size_t(errlen), "%s", e.what());
    return 1;
  }
}
