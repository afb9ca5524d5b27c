// GPT-2 shape and the parameter layout shared by every backend.
//
// Parameters live in one contiguous buffer, in llm.c's order (so checkpoints move between the two):
//   wte (Vp, C), wpe (maxT, C), ln1w (L, C), ln1b (L, C), qkvw (L, 3C, C), qkvb (L, 3C),
//   attprojw (L, C, C), attprojb (L, C), ln2w (L, C), ln2b (L, C), fcw (L, 4C, C), fcb (L, 4C),
//   fcprojw (L, C, 4C), fcprojb (L, C), lnfw (C), lnfb (C)
// Linear weights are stored (out, in). The lm_head is tied to wte.
#pragma once
#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpt2 {

// The 16 parameter tensors by name, in layout order.
enum ParamTensor : int {
  kWte, kWpe, kLn1w, kLn1b, kQkvw, kQkvb, kAttprojw, kAttprojb,
  kLn2w, kLn2b, kFcw, kFcb, kFcprojw, kFcprojb, kLnfw, kLnfb,
  kNumParamTensors
};
// The per-layer tensors (L, ...) are kLn1w..kFcprojb: layer l's slice of each is one layer's parameters.
constexpr int kFirstLayerTensor = kLn1w, kLastLayerTensor = kFcprojb;

struct ModelConfig {
  int max_seq_len = 1024;        // maxT, the block size
  int vocab_size = 50257;        // V: real tokens
  int padded_vocab_size = 50304; // Vp: V rounded up for fast GEMMs; rows V..Vp-1 are never predicted
  int n_layer = 12;              // L
  int n_head = 12;               // NH
  int n_embd = 768;              // C

  void validate() const {
    auto bad = [](const std::string& m) { throw std::invalid_argument("ModelConfig: " + m); };
    if (max_seq_len <= 0) bad("max_seq_len must be > 0");
    if (vocab_size <= 0) bad("vocab_size must be > 0");
    if (padded_vocab_size < vocab_size) bad("padded_vocab_size must be >= vocab_size");
    if (n_layer <= 0) bad("n_layer must be > 0");
    if (n_head <= 0 || n_embd <= 0) bad("n_head and n_embd must be > 0");
    if (n_embd % n_head != 0) bad("n_embd must be divisible by n_head");
  }
};

inline const std::array<const char*, kNumParamTensors>& param_names() {
  static const std::array<const char*, kNumParamTensors> names = {
      "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
      "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"};
  return names;
}

// Shapes of the 16 tensors (up to 3 dims; unused trailing dims are 0).
inline std::array<std::array<size_t, 3>, kNumParamTensors> param_shapes(const ModelConfig& c) {
  const size_t Vp = c.padded_vocab_size, C = c.n_embd, L = c.n_layer, maxT = c.max_seq_len;
  return {{{Vp, C, 0}, {maxT, C, 0}, {L, C, 0}, {L, C, 0},
           {L, 3 * C, C}, {L, 3 * C, 0}, {L, C, C}, {L, C, 0},
           {L, C, 0}, {L, C, 0}, {L, 4 * C, C}, {L, 4 * C, 0},
           {L, C, 4 * C}, {L, C, 0}, {C, 0, 0}, {C, 0, 0}}};
}

inline std::array<size_t, kNumParamTensors> param_sizes(const ModelConfig& c) {
  std::array<size_t, kNumParamTensors> out{};
  auto shapes = param_shapes(c);
  for (int i = 0; i < kNumParamTensors; i++) {
    size_t n = 1;
    for (size_t d : shapes[i]) if (d) n *= d;
    out[i] = n;
  }
  return out;
}

// Weight decay applies to 2-D weights only: embeddings and matmul weights (per layer they are 2-D).
inline bool param_decays(int i) {
  switch (i) {
    case kWte: case kWpe: case kQkvw: case kAttprojw: case kFcw: case kFcprojw: return true;
    default: return false;
  }
}

// Which tensors Muon updates (when the optimizer is Muon; model/optimizer.h): the 2-D hidden matrices of every
// layer (attention q, k, v and output projection, the MLP's two matrices). Everything else (embeddings, which are
// also the tied head, gains and biases) stays with AdamW.
inline bool param_uses_muon(int i) {
  switch (i) {
    case kQkvw: case kAttprojw: case kFcw: case kFcprojw: return true;
    default: return false;
  }
}

// One matrix Muon orthogonalises: rows x cols values at flat offset `offset` of the parameter buffer, row-major
// (out, in). qkvw's layer slice is three matrices (q, k and v, C x C each: orthogonalised separately, as the
// reference recipes do).
struct MuonMatrix {
  size_t offset;
  int rows, cols;
  int tensor, layer;  // ParamTensor, and the layer (q/k/v: the same layer three times)
};

// Every Muon matrix in flat-offset order (qkvw's q, k, v of layer 0, 1, ..., then attprojw's, fcw's, fcprojw's).
inline std::vector<MuonMatrix> muon_matrices(const ModelConfig& c) {
  const auto sizes = param_sizes(c);
  const auto shapes = param_shapes(c);
  std::vector<MuonMatrix> out;
  size_t offset = 0;
  const int C = c.n_embd;
  for (int i = 0; i < kNumParamTensors; i++) {
    if (param_uses_muon(i)) {
      const int rows = int(shapes[i][1]), cols = int(shapes[i][2]);
      const int parts = i == kQkvw ? 3 : 1;  // q, k, v
      const int prow = rows / parts;
      for (int l = 0; l < c.n_layer; l++)
        for (int p = 0; p < parts; p++)
          out.push_back({offset + (size_t(l) * rows + size_t(p) * prow) * cols, i == kQkvw ? C : prow, cols, i, l});
    }
    offset += sizes[i];
  }
  return out;
}

}  // namespace gpt2
