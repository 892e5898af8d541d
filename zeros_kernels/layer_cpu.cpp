// A decoder layer's work outside attention, for a decode step on a CPU, in two calls
// (zeros_kernels/layer_cpu.py builds and calls it; model.py's Block is the reference).
//
// An eager decode step of a small model spends most of its time outside attention dispatching
// about a hundred small PyTorch ops a layer (RMS norms of five ops each, RoPE's halves, views,
// residual adds), each a few microseconds of Python and dispatcher for a few hundred floats of work.
// Here those are plain loops, and only the weight matmuls go through ATen:
//
//   pre_attn   x -> RMSNorm -> q|k|v matmul -> q and k RMS-normalised per head -> RoPE
//              -> q (B, Hq, T, D), k and v (B, Hkv, T, D), as Attention.forward gives them
//   post_attn  x, the attention's y -> x + o(y) = x1 -> x1 + down(silu(gate) * up) of
//              RMSNorm(x1): Block.forward's second half and the residuals
//   rms_norm   the final norm
//
// A group of linears comes as `kind` and weights: kind 0, plain (N_i, K) weights, one at::linear
// each (as F.linear); kind 1, the group's weights stacked and packed for oneDNN
// (model.Packed.onednn), one call of mkldnn::_linear_pointwise. The loops' sums run in another
// order than ATen's: the results differ from the reference in the last bits.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <vector>

namespace {

// a group's outputs: pieces of columns, each at a pointer to its row 0 with a row stride
struct Piece {
  const float* p;
  int64_t ld;
};

std::vector<at::Tensor> matmul(const at::Tensor& x, int64_t kind, const std::vector<at::Tensor>& ws) {
  if (kind == 0) {
    std::vector<at::Tensor> out;
    for (const auto& w : ws) out.push_back(at::linear(x, w).contiguous());
    return out;
  }
  TORCH_CHECK(kind == 1 && ws.size() == 1, "kind 1 takes one oneDNN-packed weight");
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, ws[0], c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return {stack[0].toTensor().contiguous()};
}

// the pieces of a group's output with column widths `n`: one tensor each (kind 0), or slices of one
std::vector<Piece> pieces(const std::vector<at::Tensor>& out, const std::vector<int64_t>& n) {
  std::vector<Piece> p;
  if (out.size() == n.size()) {
    for (const auto& t : out) p.push_back({t.data_ptr<float>(), t.size(1)});
    return p;
  }
  int64_t at = 0;
  for (int64_t w : n) {
    p.push_back({out[0].data_ptr<float>() + at, out[0].size(1)});
    at += w;
  }
  return p;
}

// y = w * (x / sqrt(mean(x^2) + eps)), n floats: RMSNorm's forward
inline void rms(const float* x, const float* w, float* y, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// one head of q or k: RMS-normalised with w, then rotated (HF's rotate_half: i pairs with i + D/2)
inline void norm_rope(const float* x, const float* w, const float* cos, const float* sin, float* y,
                      float* tmp, int64_t D, float eps) {
  rms(x, w, tmp, D, eps);
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) y[i] = tmp[i] * cos[i] + (-tmp[i + h]) * sin[i];
  for (int64_t i = h; i < D; ++i) y[i] = tmp[i] * cos[i] + tmp[i - h] * sin[i];
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              " must be a contiguous float32 (B, T, C) tensor");
}

}  // namespace

// x (B, T, C) -> [q (B, Hq, T, D), k (B, Hkv, T, D), v (B, Hkv, T, D)]; cos, sin (B, T, D)
std::vector<at::Tensor> pre_attn(at::Tensor x, at::Tensor ln_w, int64_t kind,
                                 std::vector<at::Tensor> ws, at::Tensor qn_w, at::Tensor kn_w,
                                 at::Tensor cos, at::Tensor sin, int64_t Hq, int64_t Hkv,
                                 double eps) {
  check_rows(x, "x");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), M = B * T, D = cos.size(2);
  const float e = static_cast<float>(eps);
  auto h = torch::empty({M, C}, x.options());
  const float *xp = x.data_ptr<float>(), *lw = ln_w.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) rms(xp + m * C, lw, h.data_ptr<float>() + m * C, C, e);
  auto out = matmul(h, kind, ws);
  auto pc = pieces(out, {Hq * D, Hkv * D, Hkv * D});
  auto q = torch::empty({B, Hq, T, D}, x.options());
  auto k = torch::empty({B, Hkv, T, D}, x.options());
  auto v = torch::empty({B, Hkv, T, D}, x.options());
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *qw = qn_w.data_ptr<float>(), *kw = kn_w.data_ptr<float>();
  std::vector<float> tmp(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t m = b * T + t;
      const float *c = cos.data_ptr<float>() + m * D, *s = sin.data_ptr<float>() + m * D;
      for (int64_t hd = 0; hd < Hq; ++hd)
        norm_rope(pc[0].p + m * pc[0].ld + hd * D, qw, c, s, qp + ((b * Hq + hd) * T + t) * D,
                  tmp.data(), D, e);
      for (int64_t hd = 0; hd < Hkv; ++hd) {
        norm_rope(pc[1].p + m * pc[1].ld + hd * D, kw, c, s, kp + ((b * Hkv + hd) * T + t) * D,
                  tmp.data(), D, e);
        const float* src = pc[2].p + m * pc[2].ld + hd * D;
        std::copy(src, src + D, vp + ((b * Hkv + hd) * T + t) * D);
      }
    }
  return {q, k, v};
}

// x (B, T, C), y (B, Hq, T, D) the attention's output -> the layer's output (B, T, C)
at::Tensor post_attn(at::Tensor x, at::Tensor y, int64_t kind_o, std::vector<at::Tensor> wo,
                     at::Tensor ln_w, int64_t kind_gu, std::vector<at::Tensor> wgu,
                     int64_t kind_d, std::vector<at::Tensor> wd, int64_t inter, double eps) {
  check_rows(x, "x");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), M = B * T;
  const float e = static_cast<float>(eps);
  auto ys = y.transpose(1, 2).reshape({M, -1});  // heads -> channels (a view where T = 1)
  auto o = matmul(ys.stride(1) == 1 ? ys : ys.contiguous(), kind_o, wo)[0];
  auto x1 = torch::empty({B, T, C}, x.options());
  auto h = torch::empty({M, C}, x.options());
  float *x1p = x1.data_ptr<float>(), *hp = h.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *op = o.data_ptr<float>(), *lw = ln_w.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < C; ++c) x1p[m * C + c] = xp[m * C + c] + op[m * C + c];
    rms(x1p + m * C, lw, hp + m * C, C, e);
  }
  auto gu = matmul(h, kind_gu, wgu);
  auto pc = pieces(gu, {inter, inter});
  auto a = torch::empty({M, inter}, x.options());
  float* ap = a.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float *g = pc[0].p + m * pc[0].ld, *u = pc[1].p + m * pc[1].ld;
    for (int64_t i = 0; i < inter; ++i) ap[m * inter + i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  auto d = matmul(a, kind_d, wd)[0];
  const float* dp = d.data_ptr<float>();
  for (int64_t i = 0; i < M * C; ++i) x1p[i] += dp[i];
  return x1;
}

// x (B, T, C) -> RMSNorm(x) with weight w
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, "x");
  const int64_t M = x.size(0) * x.size(1), C = x.size(2);
  auto y = torch::empty_like(x);
  for (int64_t m = 0; m < M; ++m)
    rms(x.data_ptr<float>() + m * C, w.data_ptr<float>(), y.data_ptr<float>() + m * C, C,
        static_cast<float>(eps));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pre_attn", &pre_attn, "RMSNorm, q|k|v, q/k norms and RoPE of a decoder layer");
  m.def("post_attn", &post_attn, "o, residual, RMSNorm, SwiGLU MLP, residual of a decoder layer");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
}
