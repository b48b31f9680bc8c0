// A decoder layer's decode step in one call (`hybridkv.ops.native.decode_layer`): the same
// kernels and ATen ops, in the same order, that the layer's Python runs one call at a time, so the
// same numbers; only the Python and dispatch between them go (README: "Where decode time goes").
//
//   h, n = post_norm.add(x, mixer(normed));  x', normed' = next_norm.add(h, ffn(n))
//
// The layer is described once, when first run, by `weights` (its tensors in the order read) and
// `plan` (integers, read in order):
//
//   plan    = mixer kind, ffn kind, mixer ints, then for each projection in turn its descriptor
//   mixer   DELTANET: Hk, dk, tiled  (in_proj, conv_weight, A_log, dt_bias, norm_weight, out_proj)
//           ATTENTION: H             (qkv_proj, q_norm, k_norm, o_proj)
//   ffn     NONE: return (h, n) after the mixer; the caller runs its feed-forward
//           DENSE: (gate_up, down, next_norm)   MOE: top_k, norm_topk  (gate_in, gate_up, down,
//           shared_down, next_norm: float experts, the `moe_block` kernel)
//           BLOCK_MOE: top_k, norm_topk, E  (gate_in, gate_up experts, down experts,
//           shared_down, next_norm: experts in a file's blocks, `ops.moe.moe_block`'s ops)
//   projection descriptor: FLOAT (one [in, out] tensor: rows_matmul) | K_PARTS n type_1..type_n
//           (n K-quant row blocks: kq_matmul_parts) | Q8 type (one 32-weight type's rows: q8_matmul)
//           | PARTS n (kind_i [type_i]) × n (parts of those kinds, each its own call, side by side)
//   experts descriptor: n, then (is a 32-weight type, ggml type) per part  (n [E, N_i, row bytes])
//
// `scalars`: the mixer's norm eps (DELTANET) or its q/k norm eps and softmax scale (ATTENTION),
// post_norm's eps, next_norm's eps. `step`: this step's cache tensors, DELTANET: conv, delta,
// snap_conv, snap_delta pools, slots, cu_seqlens, snapshot_at, snapshot_ids; ATTENTION: cos, sin,
// k_pool, v_pool, slot_mapping, block_tables, kv_lens.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

enum : int64_t { DELTANET = 0, ATTENTION = 1 };
enum : int64_t { FFN_NONE = 0, FFN_DENSE = 1, FFN_MOE = 2, FFN_BLOCK_MOE = 3 };
enum : int64_t { FLOAT = 0, K_PARTS = 1, Q8 = 2, PARTS = 3 };

// Reads `weights` and `plan` front to back, checking that neither runs out.
struct Reader {
  at::TensorList weights;
  at::IntArrayRef plan;
  size_t w = 0, p = 0;

  at::Tensor tensor() {
    TORCH_CHECK(w < weights.size(), "decode_layer: the plan reads more than the ", weights.size(), " weights given");
    return weights[w++];
  }
  int64_t integer() {
    TORCH_CHECK(p < plan.size(), "decode_layer: the plan ends early (", plan.size(), " integers)");
    return plan[p++];
  }
};

// A projection as its descriptor says: FLOAT or Q8 (one tensor), K_PARTS (n), or PARTS (n parts
// of those three kinds, each its own call, the results side by side: `QuantLinear.matmul`'s loop).
struct Projection {
  int64_t kind = FLOAT;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> kinds, types;  // per part (K_PARTS: its types; PARTS: each part's kind and type)

  explicit Projection(Reader& r) : kind(r.integer()) {
    TORCH_CHECK(kind >= FLOAT && kind <= PARTS, "decode_layer: unknown projection kind ", kind);
    const int64_t n = kind == K_PARTS || kind == PARTS ? r.integer() : 1;
    TORCH_CHECK(n > 0, "decode_layer: a projection of ", n, " parts");
    for (int64_t i = 0; i < n; ++i) {
      kinds.push_back(kind == PARTS ? r.integer() : kind == K_PARTS ? K_PARTS : kind);
      TORCH_CHECK(kinds.back() >= FLOAT && kinds.back() <= Q8, "decode_layer: unknown projection part kind ",
                  kinds.back());
      types.push_back(kinds.back() == FLOAT ? 0 : r.integer());
    }
    for (int64_t i = 0; i < n; ++i) parts.push_back(r.tensor());
  }

  // x [T, in] @ W → [T, out] float32
  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == K_PARTS) return hybridkv::ops::kq_matmul_parts(x, parts, types, "auto");
    std::vector<at::Tensor> ys;
    for (size_t i = 0; i < parts.size(); ++i) {
      if (kinds[i] == FLOAT)
        ys.push_back(hybridkv::ops::rows_matmul(x, parts[i]));
      else if (kinds[i] == Q8)
        ys.push_back(hybridkv::ops::q8_matmul(x, parts[i], types[i], "auto"));
      else
        ys.push_back(hybridkv::ops::kq_matmul_parts(x, {parts[i]}, {types[i]}, "auto"));
    }
    return ys.size() == 1 ? ys[0] : at::cat(ys, -1);
  }
};

// Experts in a file's blocks, as descriptor `n, (is_32_weight_type, ggml type) × n` and n tensors
// [E, N_i, row bytes]: row p of x times expert ids[p]'s rows, each part one kernel call
// (`QuantExperts.pairs_matmul`).
struct BlockExperts {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types, small;

  explicit BlockExperts(Reader& r) {
    const int64_t n = r.integer();
    TORCH_CHECK(n > 0, "decode_layer: experts of ", n, " parts");
    for (int64_t i = 0; i < n; ++i) small.push_back(r.integer()), types.push_back(r.integer());
    for (int64_t i = 0; i < n; ++i) parts.push_back(r.tensor());
  }

  at::Tensor operator()(const at::Tensor& x, const at::Tensor& ids) const {
    std::vector<at::Tensor> ys;
    for (size_t i = 0; i < parts.size(); ++i)
      ys.push_back(small[i] ? hybridkv::ops::q8_experts_matmul(x, parts[i], ids, types[i], "auto")
                            : hybridkv::ops::kq_experts_matmul(x, parts[i], ids, types[i], "auto"));
    return ys.size() == 1 ? ys[0] : at::cat(ys, -1);
  }
};

// The whole plan read (and its counts checked) before anything runs: a bad plan changes no cache.
struct Layer {
  int64_t mixer, ffn, Hk = 0, dk = 0, H = 0, top_k = 0, E = 0;
  bool tiled = false, norm_topk = false;
  std::vector<Projection> projections;  // in_proj, out_proj | qkv_proj, o_proj; then gate_up, down
                                        // (DENSE) or gate_in, shared_down (BLOCK_MOE)
  std::vector<BlockExperts> experts;    // gate_up, down (BLOCK_MOE)
  std::vector<at::Tensor> tensors;      // conv_weight, A_log, dt_bias, norm | q_norm, k_norm; post_norm;
                                        // gate_in, gate_up, down, shared_down (MOE); next_norm

  Layer(at::TensorList weights, at::IntArrayRef plan) {
    Reader r{weights, plan};
    mixer = r.integer(), ffn = r.integer();
    TORCH_CHECK(mixer == DELTANET || mixer == ATTENTION, "decode_layer: unknown mixer kind ", mixer);
    TORCH_CHECK(ffn >= FFN_NONE && ffn <= FFN_BLOCK_MOE, "decode_layer: unknown feed-forward kind ", ffn);
    if (mixer == DELTANET) {
      Hk = r.integer(), dk = r.integer(), tiled = r.integer() != 0;
      projections.emplace_back(r);
      for (int i = 0; i < 4; ++i) tensors.push_back(r.tensor());
    } else {
      H = r.integer();
      projections.emplace_back(r);
      for (int i = 0; i < 2; ++i) tensors.push_back(r.tensor());
    }
    projections.emplace_back(r);
    tensors.push_back(r.tensor());  // post_norm
    if (ffn == FFN_DENSE) {
      projections.emplace_back(r);
      projections.emplace_back(r);
    } else if (ffn == FFN_MOE) {
      top_k = r.integer(), norm_topk = r.integer() != 0;
      for (int i = 0; i < 4; ++i) tensors.push_back(r.tensor());
    } else if (ffn == FFN_BLOCK_MOE) {
      top_k = r.integer(), norm_topk = r.integer() != 0, E = r.integer();
      projections.emplace_back(r);  // gate_in
      experts.emplace_back(r);
      experts.emplace_back(r);
      projections.emplace_back(r);  // shared_down
    }
    if (ffn != FFN_NONE) tensors.push_back(r.tensor());  // next_norm
    TORCH_CHECK(r.w == weights.size() && r.p == plan.size(), "decode_layer: the plan reads ", r.w, " of ",
                weights.size(), " weights and ", r.p, " of ", plan.size(), " integers");
  }
};

// `ops.moe.moe_block` on experts in a file's blocks, op for op (router softmax and top-k, every
// (token, expert) pair of the step in one kernel call per part, each token's row quantized once
// for its k pairs; the gated shared expert; `moe_combine`).
at::Tensor block_moe(const Layer& l, const at::Tensor& x) {
  const int64_t k = l.top_k;
  const at::Tensor logits = l.projections[2](x);
  const auto parts = logits.split_with_sizes({l.E, 1, logits.size(-1) - l.E - 1}, -1);
  const at::Tensor probs = at::softmax(parts[0], -1, at::kFloat);
  auto [weights, chosen] = probs.topk(k, -1);
  if (l.norm_topk) weights = weights / weights.sum(-1, true);
  const at::Tensor ids = chosen.flatten();
  const at::Tensor y = l.experts[1](hybridkv::ops::silu_mul(l.experts[0](x, ids)), ids);  // x's row t: pairs tk..
  const at::Tensor shared = l.projections[3](hybridkv::ops::silu_mul(parts[2]));
  return hybridkv::ops::moe_combine(y, weights, shared, parts[1]);
}

// The layer's checks that need its inputs: scalars and step tensors counted, x and normed alike.
void check_inputs(const Layer& l, const at::Tensor& x, const at::Tensor& normed, at::ArrayRef<double> scalars,
                  at::TensorList step) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && normed.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.sizes() == normed.sizes(),
              "decode_layer: x and normed must be float32 [T, D] alike, got ", x.sizes(), " and ", normed.sizes());
  // the mixer's scalars, then post_norm's eps, then next_norm's unless the caller runs the ffn
  const size_t wanted = (l.mixer == DELTANET ? 1 : 2) + (l.ffn == FFN_NONE ? 1 : 2);
  TORCH_CHECK(scalars.size() == wanted, "decode_layer: this layer takes ", wanted, " scalars, got ", scalars.size());
  const size_t steps = l.mixer == DELTANET ? 8 : 7;
  TORCH_CHECK(step.size() == steps, "decode_layer: this layer takes ", steps, " step tensors, got ", step.size());
}

std::tuple<at::Tensor, at::Tensor> run_layer(const Layer& l, const at::Tensor& x, const at::Tensor& normed,
                                             at::ArrayRef<double> scalars, at::TensorList step) {
  const size_t s = l.mixer == DELTANET ? 1 : 2;  // post_norm's eps in scalars
  const std::vector<at::Tensor>& t = l.tensors;
  at::Tensor o;
  size_t next = 0;  // the next of l.tensors after the mixer's
  if (l.mixer == DELTANET) {
    o = hybridkv::ops::gdn_forward(l.projections[0](normed), t[0], t[1], t[2], t[3], scalars[0], l.Hk, l.dk, step[0],
                                   step[1], step[4], step[5], step[2], step[3], step[6], step[7], l.tiled);
    next = 4;
  } else {
    o = hybridkv::ops::attention_decode(l.projections[0](normed), t[0], t[1], scalars[0], step[0], step[1], step[2],
                                        step[3], step[4], step[5], step[6], scalars[1], l.H);
    next = 2;
  }
  auto [h, n] = hybridkv::ops::add_rms_norm(x, l.projections[1](o), t[next], scalars[s]);
  if (l.ffn == FFN_NONE) return {h, n};
  at::Tensor out;
  if (l.ffn == FFN_DENSE)
    out = l.projections[3](hybridkv::ops::silu_mul(l.projections[2](n)));
  else if (l.ffn == FFN_MOE)
    out = hybridkv::ops::moe_block(n, t[next + 1], t[next + 2], t[next + 3], t[next + 4], l.top_k, l.norm_topk);
  else
    out = block_moe(l, n);
  return hybridkv::ops::add_rms_norm(h, out, t.back(), scalars[s + 1]);
}

std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const at::Tensor& normed, at::TensorList weights,
                                                at::IntArrayRef plan, at::ArrayRef<double> scalars,
                                                at::TensorList step) {
  const Layer l(weights, plan);
  check_inputs(l, x, normed, scalars, step);
  return run_layer(l, x, normed, scalars, step);
}

// Every layer of a forward, one after the other: layer i's weights, plan, scalars and step tensors
// are the next counts[4i .. 4i+4) of each list. Every plan is read and checked before any runs.
std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& x, const at::Tensor& normed, at::TensorList weights,
                                                 at::IntArrayRef plan, at::ArrayRef<double> scalars,
                                                 at::TensorList step, at::IntArrayRef counts) {
  TORCH_CHECK(counts.size() % 4 == 0, "decode_layers: counts are 4 a layer, got ", counts.size());
  std::vector<Layer> layers;
  std::vector<at::ArrayRef<double>> layer_scalars;
  std::vector<at::TensorList> layer_steps;
  size_t w = 0, p = 0, s = 0, t = 0;
  for (size_t i = 0; i < counts.size(); i += 4) {
    const auto cw = static_cast<size_t>(counts[i]), cp = static_cast<size_t>(counts[i + 1]),
               cs = static_cast<size_t>(counts[i + 2]), ct = static_cast<size_t>(counts[i + 3]);
    TORCH_CHECK(w + cw <= weights.size() && p + cp <= plan.size() && s + cs <= scalars.size() && t + ct <= step.size(),
                "decode_layers: layer ", i / 4, "'s counts run past the lists");
    layers.emplace_back(weights.slice(w, cw), plan.slice(p, cp));
    layer_scalars.push_back(scalars.slice(s, cs));
    layer_steps.push_back(step.slice(t, ct));
    check_inputs(layers.back(), x, normed, layer_scalars.back(), layer_steps.back());
    TORCH_CHECK(layers.back().ffn != FFN_NONE, "decode_layers: layer ", i / 4, " leaves its feed-forward to the caller");
    w += cw, p += cp, s += cs, t += ct;
  }
  TORCH_CHECK(w == weights.size() && p == plan.size() && s == scalars.size() && t == step.size(),
              "decode_layers: the counts leave part of the lists unread");
  at::Tensor h = x, n = normed;
  for (size_t i = 0; i < layers.size(); ++i) std::tie(h, n) = run_layer(layers[i], h, n, layer_scalars[i], layer_steps[i]);
  return {h, n};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def(
      "decode_layer(Tensor x, Tensor normed, Tensor[] weights, int[] plan, float[] scalars, Tensor(a!)[] step) "
      "-> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor x, Tensor normed, Tensor[] weights, int[] plan, float[] scalars, Tensor(a!)[] step, "
      "int[] counts) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hybridkv, CPU, m) {
  m.impl("decode_layer", decode_layer);
  m.impl("decode_layers", decode_layers);
}
