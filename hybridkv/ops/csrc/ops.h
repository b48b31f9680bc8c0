// The kernels' entry points, callable from another file of this library: `decode_layer`
// (layer.cpp) composes them into one call per decoder layer. Each is the op of the same name
// (kernels.cpp, kquant.cpp, quant.cpp), the same code and checks, without the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace hybridkv::ops {

at::Tensor rows_matmul(const at::Tensor& x, const at::Tensor& w);
at::Tensor moe_block(const at::Tensor& x, const at::Tensor& gate_in, const at::Tensor& gate_up, const at::Tensor& down,
                     const at::Tensor& shared_down, int64_t top_k, bool norm_topk);
at::Tensor gdn_forward(const at::Tensor& mixed, const at::Tensor& conv_weight, const at::Tensor& A_log,
                       const at::Tensor& dt_bias, const at::Tensor& norm_weight, double eps, int64_t Hk, int64_t dk,
                       at::Tensor conv_pool, at::Tensor delta_pool, const at::Tensor& slots,
                       const at::Tensor& cu_seqlens, at::Tensor snap_conv, at::Tensor snap_delta,
                       const at::Tensor& snap_tokens, const at::Tensor& snap_ids, bool tiled);
at::Tensor attention_decode(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, double eps,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& kv_lens,
                            double scale, int64_t H);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& shared, const at::Tensor& gate);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
at::Tensor kq_matmul_parts(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, const std::string& isa);
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, const std::string& isa);
at::Tensor kq_experts_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, int64_t ggml_type,
                             const std::string& isa);
at::Tensor q8_experts_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, int64_t ggml_type,
                             const std::string& isa);

}  // namespace hybridkv::ops
