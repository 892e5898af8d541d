// The weight matmuls of a small decode batch on a CPU (zeros_kernels/linear_cpu.py builds and calls it).
//
// At decode, a forward multiplies a few rows (one token per live sequence) by every weight of the
// model, so the time goes into streaming the weights. oneDNN's packed kernel is built for larger
// batches; at 8 rows or fewer this simple loop streams each weight once.
//
// `pack` lays a weight W (N, K) out as (ceil(N / 32), K, 32): the 32 output columns of a block,
// k-major, zero-padded, so that one pass reads the weights once, in order. `linear` keeps the
// M x 32 outputs of a block in vector registers (M <= 8: 16 accumulators of 16 floats) and adds
// x[m, k] * W[block, k, :] for each k: no horizontal sums, one fused multiply-add a weight and row.
// The sum over k runs in order, as a plain dot product does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

namespace {

typedef float vec16 __attribute__((vector_size(64)));  // one AVX-512 register (two AVX2 ones)
constexpr int64_t kCols = 32;                            // output columns a block

template <int M>
void block(const float* x, int64_t xs, const float* w, int64_t K, float* y, int64_t ys) {
  vec16 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = vec16{};
  for (int64_t k = 0; k < K; ++k) {
    vec16 w0, w1;
    std::memcpy(&w0, w + k * kCols, sizeof(w0));
    std::memcpy(&w1, w + k * kCols + 16, sizeof(w1));
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * xs + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
    }
  }
  for (int m = 0; m < M; ++m) {
    std::memcpy(y + m * ys, &acc[m][0], sizeof(vec16));
    std::memcpy(y + m * ys + 16, &acc[m][1], sizeof(vec16));
  }
}

template <int M>
void all_blocks(const float* x, int64_t xs, const float* w, int64_t K, int64_t NB, float* y,
                int64_t ys) {
  at::parallel_for(0, NB, 8, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) block<M>(x, xs, w + j * K * kCols, K, y + j * kCols, ys);
  });
}

}  // namespace

// w (N, K) float32 -> (ceil(N / 32), K, 32), zero-padded
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w must be a float32 (N, K) matrix");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kCols - 1) / kCols;
  auto padded = torch::zeros({NB * kCols, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({NB, kCols, K}).transpose(1, 2).contiguous();
}

// x (M, K) float32 with contiguous rows, M <= 8; packed from `pack` -> (M, ceil(N / 32) * 32)
torch::Tensor linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a float32 (M, K) matrix with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.size(1) == x.size(1) &&
                  packed.is_contiguous() && packed.scalar_type() == at::kFloat,
              "packed must come from pack() of a weight with x's K columns");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), xs = x.stride(0);
  auto y = torch::empty({M, NB * kCols}, x.options());
  const float *xp = x.data_ptr<float>(), *w = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ys = NB * kCols;
  switch (M) {
    case 1: all_blocks<1>(xp, xs, w, K, NB, yp, ys); break;
    case 2: all_blocks<2>(xp, xs, w, K, NB, yp, ys); break;
    case 3: all_blocks<3>(xp, xs, w, K, NB, yp, ys); break;
    case 4: all_blocks<4>(xp, xs, w, K, NB, yp, ys); break;
    case 5: all_blocks<5>(xp, xs, w, K, NB, yp, ys); break;
    case 6: all_blocks<6>(xp, xs, w, K, NB, yp, ys); break;
    case 7: all_blocks<7>(xp, xs, w, K, NB, yp, ys); break;
    case 8: all_blocks<8>(xp, xs, w, K, NB, yp, ys); break;
    default: TORCH_CHECK(false, "linear takes 1 to 8 rows, got ", M);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a weight laid out for linear");
  m.def("linear", &linear, "x @ W.T for 1 to 8 rows of x");
}
