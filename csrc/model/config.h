// GPT-2 shape and the parameter layout shared by every backend.
//
// Parameters live in one contiguous buffer, in llm.c's order (so checkpoints move between the two):
//   wte (Vp, C), wpe (maxT, C), ln1w (L, C), ln1b (L, C), qkvw (L, 3C, C), qkvb (L, 3C),
//   attprojw (L, C, C), attprojb (L, C), ln2w (L, C), ln2b (L, C), fcw (L, 4C, C), fcb (L, 4C),
//   fcprojw (L, C, 4C), fcprojb (L, C), lnfw (C), lnfb (C)
// Linear weights are stored (out, in). The lm_head is tied to wte.
//
// The modern architecture (ModelConfig's position .. logit_softcap; defaults = GPT-2) changes which tensors
// exist, never the order: a tensor the config does not have has size 0 and takes no room (no wpe with rotary
// positions, no ln weights with RMSNorm, no biases without bias), and an untied head appends lm_head (Vp, C) after
// lnfb. A GPT-2 config therefore has exactly llm.c's layout.
#pragma once
#include <array>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/optimizer.h"  // LrGroup

namespace gpt2 {

// The 16 parameter tensors by name, in layout order.
enum ParamTensor : int {
  kWte, kWpe, kLn1w, kLn1b, kQkvw, kQkvb, kAttprojw, kAttprojb,
  kLn2w, kLn2b, kFcw, kFcb, kFcprojw, kFcprojb, kLnfw, kLnfb,
  kLmHead,  // only with tie_embeddings = false
  kNumParamTensors
};
// GPT-2's (llm.c's) tensors are the first 16.
constexpr int kNumGpt2Tensors = kLmHead;
// The per-layer tensors (L, ...) are kLn1w..kFcprojb: layer l's slice of each is one layer's parameters.
constexpr int kFirstLayerTensor = kLn1w, kLastLayerTensor = kFcprojb;

struct ModelConfig {
  int max_seq_len = 1024;        // maxT, the block size
  int vocab_size = 50257;        // V: real tokens
  int padded_vocab_size = 50304; // Vp: V rounded up for fast GEMMs; rows V..Vp-1 are never predicted
  int n_layer = 12;              // L
  int n_head = 12;               // NH
  int n_embd = 768;              // C
  // The architecture, GPT-2 by default (python/gpt2core/config.py documents each field and where it comes from).
  enum class Position { Learned, Rope };
  enum class Norm { LayerNorm, RmsNorm };
  enum class Activation { Gelu, Relu2 };
  Position position = Position::Learned;  // Rope: no wpe; rotary embeddings on q and k (Backend::rope_forward)
  float rope_base = 10000.0f;             // the rotary base (with Rope only)
  Norm norm = Norm::LayerNorm;            // RmsNorm: no gain, no bias (every block norm and the final norm)
  bool qk_norm = false;                   // RMSNorm of q and k per head, after rotary, before attention
  Activation activation = Activation::Gelu;  // MLP activation: tanh-GELU or relu(x)^2
  bool bias = true;                       // biases in every linear layer and in the LayerNorms
  bool tie_embeddings = true;             // false: a separate lm_head (Vp, C)
  float logit_softcap = 0.0f;             // > 0: logits = cap * tanh(logits / cap) before the loss; 0: none

  // The GPT-2 architecture (every field above at its default): what llm.c's and Hugging Face's GPT-2 formats hold.
  bool is_gpt2() const {
    return position == Position::Learned && norm == Norm::LayerNorm && !qk_norm && activation == Activation::Gelu &&
           bias && tie_embeddings && logit_softcap == 0.0f;
  }
  int head_size() const { return n_embd / n_head; }

  void validate() const {
    auto bad = [](const std::string& m) { throw std::invalid_argument("ModelConfig: " + m); };
    if (max_seq_len <= 0) bad("max_seq_len must be > 0");
    if (vocab_size <= 0) bad("vocab_size must be > 0");
    if (padded_vocab_size < vocab_size) bad("padded_vocab_size must be >= vocab_size");
    if (n_layer <= 0) bad("n_layer must be > 0");
    if (n_head <= 0 || n_embd <= 0) bad("n_head and n_embd must be > 0");
    if (n_embd % n_head != 0) bad("n_embd must be divisible by n_head");
    if (position == Position::Rope && head_size() % 2 != 0)
      bad("rotary positions need an even head size (n_embd / n_head), got " + std::to_string(head_size()));
    if (position == Position::Rope && !(rope_base > 1.0f && std::isfinite(rope_base)))
      bad("rope_base must be a finite number > 1");
    if (!(logit_softcap >= 0.0f && std::isfinite(logit_softcap))) bad("logit_softcap must be a finite number >= 0");
  }
};

// The epsilon of LayerNorm, RMSNorm and QK-norm: 1e-5 (GPT-2's LayerNorm; PyTorch's LayerNorm default).
constexpr double kNormEps = 1e-5;

inline const std::array<const char*, kNumParamTensors>& param_names() {
  static const std::array<const char*, kNumParamTensors> names = {
      "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
      "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb", "lm_head"};
  return names;
}

// Whether config c has tensor i (GPT-2 has the first 16).
inline bool param_present(const ModelConfig& c, int i) {
  using P = ModelConfig::Position;
  using N = ModelConfig::Norm;
  switch (i) {
    case kWpe: return c.position == P::Learned;
    case kLn1w: case kLn2w: case kLnfw: return c.norm == N::LayerNorm;
    case kLn1b: case kLn2b: case kLnfb: return c.norm == N::LayerNorm && c.bias;
    case kQkvb: case kAttprojb: case kFcb: case kFcprojb: return c.bias;
    case kLmHead: return !c.tie_embeddings;
    default: return true;
  }
}

// Shapes of the tensors (up to 3 dims; unused trailing dims are 0; all 0 for a tensor c does not have).
inline std::array<std::array<size_t, 3>, kNumParamTensors> param_shapes(const ModelConfig& c) {
  const size_t Vp = c.padded_vocab_size, C = c.n_embd, L = c.n_layer, maxT = c.max_seq_len;
  std::array<std::array<size_t, 3>, kNumParamTensors> s = {{{Vp, C, 0}, {maxT, C, 0}, {L, C, 0}, {L, C, 0},
           {L, 3 * C, C}, {L, 3 * C, 0}, {L, C, C}, {L, C, 0},
           {L, C, 0}, {L, C, 0}, {L, 4 * C, C}, {L, 4 * C, 0},
           {L, C, 4 * C}, {L, C, 0}, {C, 0, 0}, {C, 0, 0}, {Vp, C, 0}}};
  for (int i = 0; i < kNumParamTensors; i++)
    if (!param_present(c, i)) s[i] = {0, 0, 0};
  return s;
}

inline std::array<size_t, kNumParamTensors> param_sizes(const ModelConfig& c) {
  std::array<size_t, kNumParamTensors> out{};
  auto shapes = param_shapes(c);
  for (int i = 0; i < kNumParamTensors; i++) {
    size_t n = 1;
    for (size_t d : shapes[i]) if (d) n *= d;
    out[i] = param_present(c, i) ? n : 0;
  }
  return out;
}

// Weight decay applies to 2-D weights only: embeddings and matmul weights (per layer they are 2-D).
inline bool param_decays(int i) {
  switch (i) {
    case kWte: case kWpe: case kQkvw: case kAttprojw: case kFcw: case kFcprojw: case kLmHead: return true;
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

// AdamW's LR group of each tensor (model/optimizer.h LrGroup; only the optimizer sets them apart, under Muon): the
// embeddings (wte, which is also a tied head, and wpe), the untied head, and the rest (gains, biases; the Muon
// tensors are never AdamW's under Muon).
inline int param_lr_group(int i) {
  switch (i) {
    case kWte: case kWpe: return kLrEmbedding;
    case kLmHead: return kLrHead;
    default: return kLrRest;
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
