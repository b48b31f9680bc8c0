// A decoder layer's decode step in one call (see `hybridkv.ops.decode_layer`): the same kernels,
// in the same order, that the layer's Python runs one op at a time, so the same numbers; only the
// ~8 Python calls and their dispatch go (3-4 ms of a 20 ms Q4_K step on the 0.8B shape).
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
//   projection descriptor: FLOAT (one [in, out] tensor: rows_matmul) | K_PARTS n type_1..type_n
//           (n K-quant row blocks: kq_matmul_parts) | Q8 type (one 32-weight type's rows: q8_matmul)
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
enum : int64_t { FFN_NONE = 0, FFN_DENSE = 1, FFN_MOE = 2 };
enum : int64_t { FLOAT = 0, K_PARTS = 1, Q8 = 2 };

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

// A projection as its descriptor says: FLOAT or Q8 (one tensor) or K_PARTS (n).
struct Projection {
  int64_t kind = FLOAT, type = 0;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types;

  explicit Projection(Reader& r) : kind(r.integer()) {
    TORCH_CHECK(kind == FLOAT || kind == K_PARTS || kind == Q8, "decode_layer: unknown projection kind ", kind);
    if (kind == Q8) type = r.integer();
    const int64_t n = kind == K_PARTS ? r.integer() : 1;
    TORCH_CHECK(n > 0, "decode_layer: a projection of ", n, " parts");
    for (int64_t i = 0; kind == K_PARTS && i < n; ++i) types.push_back(r.integer());
    for (int64_t i = 0; i < n; ++i) parts.push_back(r.tensor());
  }

  // x [T, in] @ W → [T, out] float32
  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == FLOAT) return hybridkv::ops::rows_matmul(x, parts[0]);
    if (kind == Q8) return hybridkv::ops::q8_matmul(x, parts[0], type, "auto");
    return hybridkv::ops::kq_matmul_parts(x, parts, types, "auto");
  }
};

// The whole plan read (and its counts checked) before anything runs: a bad plan changes no cache.
struct Layer {
  int64_t mixer, ffn, Hk = 0, dk = 0, H = 0, top_k = 0;
  bool tiled = false, norm_topk = false;
  std::vector<Projection> projections;  // in_proj, out_proj | qkv_proj, o_proj; then gate_up, down
  std::vector<at::Tensor> tensors;      // conv_weight, A_log, dt_bias, norm | q_norm, k_norm; post_norm;
                                        // gate_in, gate_up, down, shared_down (MOE); next_norm

  Layer(at::TensorList weights, at::IntArrayRef plan) {
    Reader r{weights, plan};
    mixer = r.integer(), ffn = r.integer();
    TORCH_CHECK(mixer == DELTANET || mixer == ATTENTION, "decode_layer: unknown mixer kind ", mixer);
    TORCH_CHECK(ffn == FFN_NONE || ffn == FFN_DENSE || ffn == FFN_MOE, "decode_layer: unknown feed-forward kind ",
                ffn);
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
    }
    if (ffn != FFN_NONE) tensors.push_back(r.tensor());  // next_norm
    TORCH_CHECK(r.w == weights.size() && r.p == plan.size(), "decode_layer: the plan reads ", r.w, " of ",
                weights.size(), " weights and ", r.p, " of ", plan.size(), " integers");
  }
};

std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const at::Tensor& normed, at::TensorList weights,
                                                at::IntArrayRef plan, at::ArrayRef<double> scalars,
                                                at::TensorList step) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && normed.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.sizes() == normed.sizes(),
              "decode_layer: x and normed must be float32 [T, D] alike, got ", x.sizes(), " and ", normed.sizes());
  const Layer l(weights, plan);
  // the mixer's scalars, then post_norm's eps, then next_norm's unless the caller runs the ffn
  const size_t s = l.mixer == DELTANET ? 1 : 2, wanted = s + (l.ffn == FFN_NONE ? 1 : 2);
  TORCH_CHECK(scalars.size() == wanted, "decode_layer: this layer takes ", wanted, " scalars, got ", scalars.size());
  const size_t steps = l.mixer == DELTANET ? 8 : 7;
  TORCH_CHECK(step.size() == steps, "decode_layer: this layer takes ", steps, " step tensors, got ", step.size());
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
  const at::Tensor out = l.ffn == FFN_DENSE
                             ? l.projections[3](hybridkv::ops::silu_mul(l.projections[2](n)))
                             : hybridkv::ops::moe_block(n, t[next + 1], t[next + 2], t[next + 3], t[next + 4],
                                                        l.top_k, l.norm_topk);
  return hybridkv::ops::add_rms_norm(h, out, t.back(), scalars[s + 1]);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def(
      "decode_layer(Tensor x, Tensor normed, Tensor[] weights, int[] plan, float[] scalars, Tensor(a!)[] step) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hybridkv, CPU, m) { m.impl("decode_layer", decode_layer); }
