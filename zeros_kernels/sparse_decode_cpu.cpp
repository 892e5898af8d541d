// The CPU kernel of block-sparse decode attention (zeros_kernels/block_sparse_decode.py,
// `sparse_decode_cpu`, which builds it on first use with torch.utils.cpp_extension).
//
// PyTorch on a CPU can read selected pages only by gathering them into a new tensor first, and on
// a memory-bound decode step the gather (a read and a write) costs more than the attention that
// follows. This kernel reads each selected page where it lies in the pool, once for K and once
// for V, as the Triton kernel does on a GPU.
//
// One (row, KV head) at a time, in one pass over its selected pages with a running softmax
// (`Online`: a block of keys scored, then their values read; the group's G queries and outputs
// held in vector registers, G and the head dim being template constants), prefetching the K and
// V pages a few ahead into L2: a selection jumps around the pool, and the hardware prefetcher
// only follows long runs. Shapes without an instance return None: the caller gathers the pages and
// runs SDPA instead.
//
// The contract is the Python one (block_sparse_decode.py's docstring), with the cache seen as
// (rows, P * D) pages of one KV head each (float32, bf16 or fp16) and the queries as float32
// (B, H_kv, G, D); a (row, head) with no token to read gives zeros. Compiled with -ffast-math: the
// loops see no inf or NaN (the running max starts finite, and a cache holds finite values).
//
// `attend_runs` is dense decode where each (row, KV head)'s keys are one contiguous run (the
// engine's lanes), through the same `Online` pass, in place of SDPA's CPU flash kernel, which is
// built for many queries where a row of decode has one.
//
// A speculative verify brings G * T queries a KV head (T = k + 1 new tokens, G query heads), and
// `Online` would take them in chunks of 8, each reading the run again, with a sum across the
// vector lanes for every query and key. `attend_runs` takes them (and any M > 8) through
// `attend_block` instead, as flash attention does: a block of 32 keys is read once for all M
// queries, its scores S = Q K^T are one small GEMM with the queries across the lanes (no sum
// across them), then the running softmax, then a second GEMM adds P V with the head dim across the
// lanes. The T new tokens lie in the run right after the cached ones; a mask on the block(s)
// holding them keeps each new token's query causal.
//
// A decode step's dense read has a third form, `Few`: its G <= 4 queries would fill 2 of 16 lanes
// in attend_block's score GEMM, so there a block of 16 keys is transposed in the registers instead
// (K^T: a vector holds one dimension of 16 keys) and every lane scores a key. The Python side
// (run_path) picks per head dim: on AVX-512 Few at 32, `Online` at 64 and 128 (its one sum
// across a register is cheap there); either reads a long lane of fp32 keys at about the memory's
// speed, where the blocks took 1.7-3.6x that.
//
// `attend_lanes` is attend_runs with the lanes found from the pool's shape and offsets instead of
// views, and `write_tokens` puts a step's new keys and values into their slots: a small model's
// decode step made about twenty PyTorch ops a layer of those (views, index_copy_, casts).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// how far ahead the pages are prefetched: 16 KB of K and V (8 pages of 8 fp32 tokens of 32 dims;
// for pages of 4 KB, 2 pages ahead measured faster than 8)
constexpr int64_t kAheadBytes = 16384;
// tokens read (and prefetched ahead) a pass: one slice of a page (1 KB of fp32 keys of 32 dims);
// in slices, pages of 4 KB at random read 1.2x faster than prefetched whole
constexpr int64_t kSlice = 8;
// no prefetch inside a run of this many pages adjacent in memory: the hardware prefetcher follows
// it, and prefetching it too made a full selection 1.5x slower (shorter runs still want it: the
// hardware guesses wrong where a selection skips pages)
constexpr int64_t kRun = 8;

inline void prefetch(const void* p, int64_t bytes) {  // into L2: room for many lines in flight
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(p) + i, 0, 1);
}

// e^x for x <= 0 without a library call, so that the compiler vectorizes the loop around it
// (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the exponent bits); relative
// error about 1e-7. Below -80 it returns 0: a weight of e^-80 changes nothing, and one near the
// bottom of the float range would make denormal products in P @ V, which run 100x slower.
inline float exp_nonpositive(float x0) {
  const float x = std::max(x0, -80.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x0 < -80.0f ? 0.0f : y * scale;
}

struct Pages {  // the selection of one (row, KV head), read through the row's page table
  const int32_t* sel;  // logical page ids
  int64_t n_sel;
  const int32_t* table;  // logical -> physical page
  int64_t len, P, head;  // tokens cached, page size, KV head

  // the tokens to read from logical page j of the selection (0: padding or past the end)
  int64_t tokens(int64_t j) const {
    const int64_t page = sel[j];
    return page < 0 || page * P >= len ? 0 : std::min(P, len - page * P);
  }
  // its row in a (rows, P * D) view with row strides s (page) and h (head)
  int64_t row(int64_t j, int64_t s, int64_t h) const { return table[sel[j]] * s + head * h; }
};

// GCC/Clang vector of 16 floats: one AVX-512 register (two AVX2 ones)
typedef float vec16 __attribute__((vector_size(64)));

template <typename T>
inline vec16 load16(const T* p) {
  vec16 r;
  for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(p[i]);
  return r;
}
template <>
inline vec16 load16<float>(const float* p) {
  vec16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline float hsum(vec16 a) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a[i];
  return s;
}

constexpr int64_t kBlock = 32;  // keys scored before their values are read (fits in L1)

// The one-pass attention of M queries (flash-decoding's running softmax): blocks of at most kBlock
// contiguous keys and values go in (`add`), the output and log-sum-exp come out (`finish`). The M
// queries and M running outputs stay in vector registers (M and D are template constants).
template <typename T, int M, int D>
struct Online {
  static constexpr int C = D / 16;
  vec16 qv[M][C], acc[M][C];
  float mx[M], sum[M], s[M][kBlock];

  Online(const float* q, float scale) {
    for (int g = 0; g < M; ++g) {
      for (int c = 0; c < C; ++c) {
        qv[g][c] = load16(q + g * D + c * 16) * scale;
        acc[g][c] = vec16{};
      }
      mx[g] = -3.0e38f;
      sum[g] = 0.f;
    }
  }

  // the scores of n keys (token stride D) into the block's slots at .. at + n - 1 (<= kBlock)
  void score(const T* k, int64_t at, int64_t n) {
    for (int64_t t = 0; t < n; ++t) {
      vec16 kc[C];
      for (int c = 0; c < C; ++c) kc[c] = load16(k + t * D + c * 16);
      for (int g = 0; g < M; ++g) {
        vec16 a = qv[g][0] * kc[0];
        for (int c = 1; c < C; ++c) a += qv[g][c] * kc[c];
        s[g][at + t] = hsum(a);
      }
    }
  }

  // the block's nb scored keys: the running max, their weights rescaled to it, then P @ V over
  // their values, given as `segs` runs v[i] of n[i] tokens (a page each, or one run)
  void flush(const T* const* v, const int64_t* n, int segs, int64_t nb) {
    for (int g = 0; g < M; ++g) {
      float bm = mx[g];
      for (int64_t t = 0; t < nb; ++t) bm = std::max(bm, s[g][t]);
      const float alpha = exp_nonpositive(mx[g] - bm);
      float added = 0.f;
#pragma omp simd reduction(+ : added)
      for (int64_t t = 0; t < nb; ++t) {
        s[g][t] = exp_nonpositive(s[g][t] - bm);
        added += s[g][t];
      }
      sum[g] = sum[g] * alpha + added;
      mx[g] = bm;
      for (int c = 0; c < C; ++c) acc[g][c] *= alpha;
    }
    for (int i = 0, at = 0; i < segs; at += n[i++]) {
      for (int64_t t = 0; t < n[i]; ++t) {
        vec16 vc[C];
        for (int c = 0; c < C; ++c) vc[c] = load16(v[i] + t * D + c * 16);
        for (int g = 0; g < M; ++g)
          for (int c = 0; c < C; ++c) acc[g][c] += s[g][at + t] * vc[c];
      }
    }
  }

  void add(const T* k, const T* v, int64_t nb) {  // nb <= kBlock contiguous keys
    score(k, 0, nb);
    flush(&v, &nb, 1, nb);
  }

  void add_run(const T* k, const T* v, int64_t n) {  // n contiguous keys, in blocks
    for (int64_t t0 = 0; t0 < n; t0 += kBlock)
      add(k + t0 * D, v + t0 * D, std::min(kBlock, n - t0));
  }

  void finish(float* o, float* lse) const {  // no key added: zeros, and lse -inf
    for (int g = 0; g < M; ++g) {
      const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
      for (int c = 0; c < C; ++c) {
        const vec16 y = acc[g][c] * inv;
        std::memcpy(o + g * D + c * 16, &y, sizeof(y));
      }
      if (lse) lse[g] = sum[g] > 0.f ? mx[g] + std::log(sum[g]) : -INFINITY;
    }
  }
};

// f(M, D) with M and D as compile-time constants (std::integral_constant) for the shapes of the
// models in use: GQA groups of 1 to 4 and 8 query heads, head dims 32, 64 and 128; false: no
// instance (the caller takes a generic path)
template <int D, typename F>
bool with_m(int64_t M, F&& f) {
  using std::integral_constant;
  switch (M) {
    case 1: f(integral_constant<int, 1>{}, integral_constant<int, D>{}); return true;
    case 2: f(integral_constant<int, 2>{}, integral_constant<int, D>{}); return true;
    case 3: f(integral_constant<int, 3>{}, integral_constant<int, D>{}); return true;
    case 4: f(integral_constant<int, 4>{}, integral_constant<int, D>{}); return true;
    case 8: f(integral_constant<int, 8>{}, integral_constant<int, D>{}); return true;
    default: return false;
  }
}
template <typename F>
bool with_shape(int64_t M, int64_t D, F&& f) {
  switch (D) {
    case 32: return with_m<32>(M, f);
    case 64: return with_m<64>(M, f);
    case 128: return with_m<128>(M, f);
    default: return false;
  }
}

// sparse_decode's (row, KV head) in one pass: the selected pages' tokens, page by page, read in
// place; the pages a few ahead prefetched into L2 (a selection jumps around the pool)
template <typename T, int M, int D>
void attend_pages(const float* q, const T* k, const T* v, const Pages& pg, int64_t ks, int64_t kh,
                  int64_t vs, int64_t vh, float scale, float* o) {
  const int64_t P = pg.P;
  Online<T, M, D> acc(q, scale);
  const T* vseg[kBlock];  // the block so far: runs of values, kBlock keys at most
  int64_t nseg[kBlock], nb = 0;
  int segs = 0;
  const int64_t ahead = std::clamp<int64_t>(kAheadBytes / (2 * P * D * sizeof(T)), 1, 8);
  int64_t run = 0;  // pages adjacent in memory, up to page j + ahead
  for (int64_t j = 0; j < pg.n_sel; ++j) {
    if (j + ahead < pg.n_sel && j + ahead > 0)
      run = pg.row(j + ahead, ks, kh) == pg.row(j + ahead - 1, ks, kh) + ks ? run + 1 : 0;
    const bool pf = j + ahead < pg.n_sel && pg.tokens(j + ahead) && run < kRun;
    const T* kn = pf ? k + pg.row(j + ahead, ks, kh) * P * D : nullptr;  // prefetched, a slice
    const T* vn = pf ? v + pg.row(j + ahead, vs, vh) * P * D : nullptr;  // at a time (below)
    const int64_t c = pg.tokens(j);
    const T *kp = k + pg.row(j, ks, kh) * P * D, *vp = v + pg.row(j, vs, vh) * P * D;
    for (int64_t t0 = 0; t0 < c;) {  // pages fill blocks of kBlock keys: one rescale a block
      // at most kSlice tokens a pass: the page ahead is prefetched by the same slices, so that
      // a large page's prefetches spread over its reading instead of coming in one burst
      const int64_t take = std::min({c - t0, kBlock - nb, kSlice});
      if (pf) {
        const int64_t bytes = (t0 + take < c ? take : P - t0) * D * sizeof(T);
        prefetch(kn + t0 * D, bytes);
        prefetch(vn + t0 * D, bytes);
      }
      acc.score(kp + t0 * D, nb, take);
      vseg[segs] = vp + t0 * D;
      nseg[segs++] = take;
      nb += take;
      t0 += take;
      if (nb == kBlock) {
        acc.flush(vseg, nseg, segs, nb);
        nb = segs = 0;
      }
    }
  }
  if (nb) acc.flush(vseg, nseg, segs, nb);
  acc.finish(o, nullptr);
}

}  // namespace

namespace {

// the score of logical page j of row b for KV head h: the group's mean query against the mean
// key (centroid), or Quest's bound, the max over the group's queries (lo, hi non-null)
template <typename T, int64_t DD>
float page_score(const float* q, const float* qm, const T* mean, const T* lo, const T* hi,
                 int64_t row, int64_t G, int64_t D_) {
  const int64_t D = DD > 0 ? DD : D_;  // DD > 0: a constant, so that the loop unrolls
  if (lo == nullptr) {
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qm[d] * static_cast<float>(mean[row * D + d]);
    return dot;
  }
  float best = -3.0e38f;
  for (int64_t g = 0; g < G; ++g) {
    float bound = 0.f;
#pragma omp simd reduction(+ : bound)
    for (int64_t d = 0; d < D; ++d) {
      const float a = q[g * D + d] * static_cast<float>(lo[row * D + d]);
      const float c = q[g * D + d] * static_cast<float>(hi[row * D + d]);
      bound += std::max(a, c);
    }
    best = std::max(best, bound);
  }
  return best;
}

constexpr float kUnscored = 3.0e38f;  // finite: the kernels are built with -ffast-math

}  // namespace

// sparsity.select_pages over centroid or Quest scores, for every (row, KV head) at once, the
// metadata read in place through the page tables: q (B, H, G, D) float32; meta (num_pages, H, D)
// of one layer, [kmean] or [kmin, kmax]; page_table (B, max_pages), n_pages, n_full, n_read (B,)
// contiguous int32 -> sel (B, H, S) int32 ascending, zero-padded. `scores` (B, H, W) float32
// contiguous, W >= the pages of every row: with rescore, the pages' scores are written there
// (+inf for a page not full yet); without, they are read from there and meta is not read
torch::Tensor select_pages(torch::Tensor q, std::vector<torch::Tensor> meta,
                           torch::Tensor page_table, torch::Tensor n_pages, torch::Tensor n_full,
                           torch::Tensor n_read, int64_t keep_first, int64_t keep_recent,
                           int64_t S, c10::optional<torch::Tensor> scores, bool rescore) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 (B, H, G, D) tensor");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(meta.size() == 1 || meta.size() == 2, "meta must be [kmean] or [kmin, kmax]");
  for (const auto& t : meta)
    TORCH_CHECK(t.dim() == 3 && t.size(1) == H && t.size(2) == D && t.is_contiguous() &&
                    t.scalar_type() == meta[0].scalar_type(),
                "page metadata must be contiguous (num_pages, H_kv, D) of one dtype");
  for (const auto& t : {page_table, n_pages, n_full, n_read})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(),
                "page_table and the counts must be contiguous int32");
  const int64_t max_pages = page_table.size(1);
  float* kept_scores = nullptr;  // (B, H, W): written (rescore) or read
  int64_t W = 0;
  if (scores.has_value()) {
    TORCH_CHECK(scores->dim() == 3 && scores->size(0) == B && scores->size(1) == H &&
                    scores->scalar_type() == at::kFloat && scores->is_contiguous(),
                "scores must be a contiguous float32 (B, H, W) tensor");
    kept_scores = scores->data_ptr<float>();
    W = scores->size(2);
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(n_pages.data_ptr<int32_t>()[b] <= W, "scores is narrower than a row's pages");
  }
  auto sel = torch::zeros({B, H, S}, page_table.options());
  const int32_t *tab = page_table.data_ptr<int32_t>(), *np = n_pages.data_ptr<int32_t>();
  const int32_t *nf = n_full.data_ptr<int32_t>(), *nr = n_read.data_ptr<int32_t>();
  int32_t* out = sel.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, meta[0].scalar_type(), "select", [&] {
    const scalar_t* m0 = meta[0].data_ptr<scalar_t>();
    const scalar_t* m1 = meta.size() == 2 ? meta[1].data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<std::pair<float, int32_t>> cand;
      std::vector<char> take;
      std::vector<float> qm(D);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H, n = np[b];
        const float* qb = qp + bh * G * D;
        for (int64_t d = 0; d < D; ++d) {
          float x = 0.f;
          for (int64_t g = 0; g < G; ++g) x += qb[g * D + d];
          qm[d] = x / G;
        }
        take.assign(n, 0);
        cand.clear();
        int64_t kept = 0;
        for (int64_t j = 0; j < n; ++j) {
          const bool keep = j < keep_first || j >= n - keep_recent || j >= nf[b];
          const bool store = kept_scores && rescore;  // every full page's score, kept or not
          float score = 0.f;
          if (kept_scores && !rescore) {  // the scores of an earlier step
            score = kept_scores[bh * W + j];
          } else if (!keep || (store && j < nf[b])) {
            const int64_t row = tab[b * max_pages + j] * H + h;
            const scalar_t* lo = m1 ? m0 : nullptr;
            score = D == 32    ? page_score<scalar_t, 32>(qb, qm.data(), m0, lo, m1, row, G, D)
                    : D == 64  ? page_score<scalar_t, 64>(qb, qm.data(), m0, lo, m1, row, G, D)
                    : D == 128 ? page_score<scalar_t, 128>(qb, qm.data(), m0, lo, m1, row, G, D)
                               : page_score<scalar_t, 0>(qb, qm.data(), m0, lo, m1, row, G, D);
          }
          // a page not full yet has no score: the largest float, so it is read until rescored
          if (store) kept_scores[bh * W + j] = j < nf[b] ? score : kUnscored;
          if (keep) {  // always read: the first keep_first, the last keep_recent, the partial
            take[j] = 1;
            ++kept;
          } else {
            cand.emplace_back(score, static_cast<int32_t>(j));
          }
        }
        // then the best-scored pages, up to n_read
        const int64_t want = std::clamp<int64_t>(nr[b] - kept, 0, cand.size());
        auto better = [](const auto& x, const auto& y) { return x.first > y.first; };
        std::nth_element(cand.begin(), cand.begin() + want, cand.end(), better);
        for (int64_t i = 0; i < want; ++i) take[cand[i].second] = 1;
        int32_t* o = out + bh * S;
        for (int64_t j = 0, i = 0; j < n && i < S; ++j)
          if (take[j]) o[i++] = static_cast<int32_t>(j);
      }
    });
  });
  return sel;
}

namespace {

// ---- many queries a key (a verify): a block of keys against all of them at once

// floats a vector register holds (the build's instruction set)
#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vecw __attribute__((vector_size(kW * sizeof(float))));
typedef int32_t veci __attribute__((vector_size(kW * sizeof(int32_t))));
inline vecw ldw(const float* p) {
  vecw r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void stw(float* p, vecw x) { std::memcpy(p, &x, sizeof(x)); }
inline vecw vmax(vecw a, vecw b) { return a > b ? a : b; }

// exp_nonpositive on a whole vector, written out: the compiler leaves the scalar one a call a
// lane inside these loops
inline vecw vexp(vecw x0) {
  const vecw x = vmax(x0, vecw{} - 80.0f);
  const vecw y0 = x * 1.44269504088896341f + 0.5f;
  vecw n = __builtin_convertvector(__builtin_convertvector(y0, veci), vecw);  // toward zero
  n = n > y0 ? n - 1.0f : n;                                                  // so: floor
  const vecw r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vecw p = vecw{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vecw y = p * r * r + r + 1.0f;
  const veci bits = (__builtin_convertvector(n, veci) + 127) << 23;  // 2^n
  return x0 < -80.0f ? vecw{} : y * (vecw)bits;
}

constexpr int64_t kKeys = 32;     // keys a block: its K, V and scores stay in L1
constexpr int kAcc = 12;          // accumulator registers a tile (of AVX2's 16)
constexpr int kMaxMV = 6;         // query vectors a pass: 48 queries (AVX2), 96 (AVX-512)
constexpr float kMasked = -3.0e38f;  // a masked score: finite, the build being -ffast-math

// S (KT keys, MV * kW queries) = K Q^T: the queries go across the lanes (qt is Q transposed,
// (D, MV * kW)), and each key element is broadcast to all of them
template <int MV, int KT>
inline void block_scores(const float* qt, const float* k, int64_t D, float* s) {
  constexpr int MP = MV * kW;
  vecw acc[KT][MV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vecw qv[MV];
    for (int j = 0; j < MV; ++j) qv[j] = ldw(qt + d * MP + j * kW);
    for (int t = 0; t < KT; ++t) {
      const float kd = k[t * D + d];
      for (int j = 0; j < MV; ++j) acc[t][j] += qv[j] * kd;
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int j = 0; j < MV; ++j) stw(s + t * MP + j * kW, acc[t][j]);
}

// O = alpha O + P V for MT queries and DV * kW dims over nb keys: the dims go across the lanes,
// and each weight p[t, i] (row stride MP) is broadcast; O, rows of D, is rescaled as it loads
template <int MT, int DV>
inline void block_values(const float* p, int64_t MP, const float* alpha, const float* v,
                         int64_t D, int64_t nb, float* o) {
  vecw acc[MT][DV];
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < DV; ++c) acc[i][c] = ldw(o + i * D + c * kW) * alpha[i];
  for (int64_t t = 0; t < nb; ++t) {
    vecw vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = ldw(v + t * D + c * kW);
    for (int i = 0; i < MT; ++i)
      for (int c = 0; c < DV; ++c) acc[i][c] += p[t * MP + i] * vv[c];
  }
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < DV; ++c) stw(o + i * D + c * kW, acc[i][c]);
}

template <int DV>
void block_values_all(const float* p, int64_t MP, const float* alpha, const float* v, int64_t D,
                      int64_t nb, float* o, int64_t M) {
  constexpr int MT = kAcc / DV;
  for (int64_t d0 = 0; d0 < D; d0 += DV * kW) {
    int64_t m = 0;
    for (; m + MT <= M; m += MT)
      block_values<MT, DV>(p + m, MP, alpha + m, v + d0, D, nb, o + m * D + d0);
    for (; m < M; ++m) block_values<1, DV>(p + m, MP, alpha + m, v + d0, D, nb, o + m * D + d0);
  }
}

// The attention of M <= MV * kW queries q (M, D) of one (row, KV head), queries m0 .. m0 + M - 1
// of its verify, over n contiguous keys and values (n, D), a block of kKeys keys at a time: a GEMM
// scores the block against all M queries, the running softmax takes it in, a GEMM adds P V.
// Query m sees the keys before n - tail + 1 + (m0 + m) % tail: with tail = T the last T keys are
// the new tokens, each query sees those up to its own (queries ordered g * T + i); tail = 1: all
// n. -> o (M, D), lse (M,). work: D * kMaxMV * kW + 2 * kKeys * D floats
template <typename T, int MV>
void attend_block(const float* q, int64_t M, int64_t m0, const T* k, const T* v, int64_t n,
                  int64_t tail, int64_t D, float scale, float* o, float* lse, float* work) {
  constexpr int MP = MV * kW;
  float* qt = work;  // (D, MP): the queries, scaled and transposed; padding lanes zero
  for (int64_t d = 0; d < D; ++d)
    for (int m = 0; m < MP; ++m) qt[d * MP + m] = m < M ? q[m * D + d] * scale : 0.f;
  float *kf = qt + D * MP, *vf = kf + kKeys * D;  // a block of a bf16 or fp16 cache, in fp32
  float s[kKeys * MP], mx[MP], sum[MP], alpha[MP];
  veci lim[MV];  // query m sees the keys before lim[m]
  for (int m = 0; m < MP; ++m) {
    mx[m] = kMasked;
    sum[m] = 0.f;
    lim[m / kW][m % kW] = static_cast<int32_t>(m < M ? n - tail + 1 + (m0 + m) % tail : n);
  }
  std::fill(o, o + M * D, 0.f);
  const int64_t DV = (D / kW) % 4 == 0 ? 4 : (D / kW) % 2 == 0 ? 2 : 1;
  for (int64_t t0 = 0; t0 < n; t0 += kKeys) {
    const int64_t nb = std::min(kKeys, n - t0);
    const float *kb = kf, *vb = vf;
    if constexpr (std::is_same<T, float>::value) {  // fp32: read in place
      kb = k + t0 * D;
      vb = v + t0 * D;
    } else {
#pragma omp simd
      for (int64_t i = 0; i < nb * D; ++i) {
        kf[i] = static_cast<float>(k[t0 * D + i]);
        vf[i] = static_cast<float>(v[t0 * D + i]);
      }
      kb = kf;
      vb = vf;
    }
    constexpr int KT = std::max(1, kAcc / MV);
    int64_t t = 0;
    for (; t + KT <= nb; t += KT) block_scores<MV, KT>(qt, kb + t * D, D, s + t * MP);
    for (; t < nb; ++t) block_scores<MV, 1>(qt, kb + t * D, D, s + t * MP);
    // the causal mask, on the block that holds the new tokens (two, where they straddle)
    const bool masked = t0 + nb > n - tail + 1;
    for (int j = 0; j < MV; ++j) {  // the running max, the old weights' rescale, the weights
      vecw bm = ldw(mx + j * kW);
      if (masked)
        for (int64_t i = 0; i < nb; ++i) {
          const vecw x = ldw(s + i * MP + j * kW);
          stw(s + i * MP + j * kW, lim[j] > static_cast<int32_t>(t0 + i) ? x : vecw{} + kMasked);
        }
      for (int64_t i = 0; i < nb; ++i) bm = vmax(bm, ldw(s + i * MP + j * kW));
      const vecw a = vexp(ldw(mx + j * kW) - bm);
      vecw added = {};
      for (int64_t i = 0; i < nb; ++i) {
        vecw p = vexp(ldw(s + i * MP + j * kW) - bm);
        // a masked key has no weight, also for a query that has seen none yet (max kMasked)
        if (masked) p = lim[j] > static_cast<int32_t>(t0 + i) ? p : vecw{};
        stw(s + i * MP + j * kW, p);
        added += p;
      }
      stw(alpha + j * kW, a);
      stw(sum + j * kW, ldw(sum + j * kW) * a + added);
      stw(mx + j * kW, bm);
    }
    if (DV == 4) block_values_all<4>(s, MP, alpha, vb, D, nb, o, M);
    else if (DV == 2) block_values_all<2>(s, MP, alpha, vb, D, nb, o, M);
    else block_values_all<1>(s, MP, alpha, vb, D, nb, o, M);
  }
  for (int64_t m = 0; m < M; ++m) {  // no key seen: zeros, and lse -inf
    const float inv = sum[m] > 0.f ? 1.f / sum[m] : 0.f;
    for (int64_t d = 0; d < D; ++d) o[m * D + d] *= inv;
    lse[m] = sum[m] > 0.f ? mx[m] + std::log(sum[m]) : -INFINITY;
  }
}

// f(MV) with MV a compile-time constant, 1 to kMaxMV
template <typename F>
void with_mv(int64_t MV, F&& f) {
  using std::integral_constant;
  switch (MV) {
    case 1: f(integral_constant<int, 1>{}); break;
    case 2: f(integral_constant<int, 2>{}); break;
    case 3: f(integral_constant<int, 3>{}); break;
    case 4: f(integral_constant<int, 4>{}); break;
    case 5: f(integral_constant<int, 5>{}); break;
    default: f(integral_constant<int, kMaxMV>{}); break;
  }
}

// ---- few queries a key (a decode step): the keys across the lanes
//
// A decode step brings G <= 4 queries a KV head. attend_block puts the queries across the vector
// lanes, so 2 queries fill 2 of 16 and the score GEMM computes 8x the work it needs; `Online` sums
// across the lanes once for every key and query. Here a block of kW keys is transposed in the
// registers (K^T: a vector holds one dimension of kW keys), so each query's scores for the block
// are D FMAs with every lane used, the running softmax takes kW keys at a time, and P V adds each
// key's value row. What is left per key is about what reading its K and V costs.

// rows a (bit w of the row clear) and b = the row w further: the lanes with bit w swap over, so
// that after w = 1, 2, 4 (and 8) the kW rows are transposed
template <int W>
inline void swap_lanes(vecw& a, vecw& b) {
#if defined(__AVX512F__)
  vecw lo, hi;
  if constexpr (W == 1) {
    lo = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    hi = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  } else if constexpr (W == 2) {
    lo = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    hi = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  } else if constexpr (W == 4) {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  } else {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    hi = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15,  //
                                 24, 25, 26, 27, 28, 29, 30, 31);
  }
#else
  vecw lo, hi;
  if constexpr (W == 1) {
    lo = __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14);
    hi = __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
  } else if constexpr (W == 2) {
    lo = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
    hi = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  } else {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
    hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
#endif
  a = lo;
  b = hi;
}

template <int W>
inline void swap_stage(vecw* r) {
  for (int i = 0; i < kW; ++i)
    if (!(i & W)) swap_lanes<W>(r[i], r[i + W]);
}

// r[t] lane d -> r[d] lane t: kW vectors, in place
inline void transpose(vecw* r) {
  swap_stage<1>(r);
  swap_stage<2>(r);
  swap_stage<4>(r);
#if defined(__AVX512F__)
  swap_stage<8>(r);
#endif
}

template <typename T>
inline vecw ldw_as_float(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    return ldw(p);
  } else {
    vecw r;
    for (int i = 0; i < kW; ++i) r[i] = static_cast<float>(p[i]);
    return r;
  }
}

inline float hmaxw(vecw a) {
  float m = a[0];
  for (int i = 1; i < kW; ++i) m = std::max(m, a[i]);
  return m;
}
inline float hsumw(vecw a) {
  float s = 0.f;
  for (int i = 0; i < kW; ++i) s += a[i];
  return s;
}

// The running attention of M <= 4 queries (M, D) over blocks of at most kW keys, the keys across
// the lanes (flash-decoding's softmax, as `Online`): `add` takes a block of contiguous keys and
// values, `finish` gives the output
// and log-sum-exp (no key: zeros and -inf)
template <typename T, int M, int D>
struct Few {
  static constexpr int C = D / kW;
  float qs[M][D], p[M][kW], mx[M], sum[M];
  vecw acc[M][C];
  veci lane;

  Few(const float* q, float scale) {
    for (int m = 0; m < M; ++m) {
      for (int d = 0; d < D; ++d) qs[m][d] = q[m * D + d] * scale;
      for (int c = 0; c < C; ++c) acc[m][c] = vecw{};
      mx[m] = kMasked;
      sum[m] = 0.f;
    }
    for (int i = 0; i < kW; ++i) lane[i] = i;
  }

  void add(const T* k, const T* v, int64_t nb) {  // 1 <= nb <= kW keys, rows of D
    vecw s[M] = {};
    for (int c = 0; c < C; ++c) {  // scores: kW dims of the block's keys at a time, transposed
      vecw r[kW];
      for (int t = 0; t < kW; ++t) r[t] = t < nb ? ldw_as_float(k + t * D + c * kW) : vecw{};
      transpose(r);
      for (int d = 0; d < kW; ++d)
        for (int m = 0; m < M; ++m) s[m] += qs[m][c * kW + d] * r[d];
    }
    for (int m = 0; m < M; ++m) {  // the running softmax, kW keys at once
      const vecw x = nb < kW ? (lane < static_cast<int32_t>(nb) ? s[m] : vecw{} + kMasked) : s[m];
      const float bm = std::max(mx[m], hmaxw(x));
      const float alpha = exp_nonpositive(mx[m] - bm);
      const vecw w = vexp(x - bm);
      stw(p[m], w);
      sum[m] = sum[m] * alpha + hsumw(w);
      mx[m] = bm;
      for (int c = 0; c < C; ++c) acc[m][c] *= alpha;
    }
    for (int64_t t = 0; t < nb; ++t) {  // P V: each key's value row, weighted for every query
      vecw vr[C];
      for (int c = 0; c < C; ++c) vr[c] = ldw_as_float(v + t * D + c * kW);
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) acc[m][c] += p[m][t] * vr[c];
    }
  }

  void finish(float* o, float* lse) const {
    for (int m = 0; m < M; ++m) {
      const float inv = sum[m] > 0.f ? 1.f / sum[m] : 0.f;
      for (int c = 0; c < C; ++c) stw(o + m * D + c * kW, acc[m][c] * inv);
      if (lse) lse[m] = sum[m] > 0.f ? mx[m] + std::log(sum[m]) : -INFINITY;
    }
  }
};

// Few over n contiguous keys and values (n, D) of one (row, KV head): a lane
template <typename T, int M, int D>
void attend_few(const float* q, const T* k, const T* v, int64_t n, float scale, float* o,
                float* lse) {
  Few<T, M, D> f(q, scale);
  for (int64_t t0 = 0; t0 < n; t0 += kW)
    f.add(k + t0 * D, v + t0 * D, std::min<int64_t>(kW, n - t0));
  f.finish(o, lse);
}

// f(M, D) for the shapes attend_few has: M 1 to 4, D 32, 64 or 128; false: none
template <typename F>
bool with_few(int64_t M, int64_t D, F&& f) {
  return M <= 4 && D % kW == 0 && with_shape(M, D, f);
}

// Each (row, KV head)'s keys and values as one contiguous run: row b, head h at k + b * sb + h * sh
// (elements), T tokens of D each
struct Runs {
  const void* k;
  const void* v;
  int64_t sb, sh, T;
  at::ScalarType dtype;
};

// Dense decode over contiguous runs (the engine's lanes): q, the M queries of each of the B * H
// (row, KV head)s, float32 and contiguous, query m of (b, h) at ((b * H + h) * M + m) * D; lens
// (B,) int32 or int64 keys of each row (an undefined tensor: all T). tail = T > 1: a verify, its
// M = G * T queries ordered g * T + i, the last T of a row's keys its new tokens, seen causally.
// path: kFew, attend_few (a decode step: at most 4 queries, tail 1); kBlocks, all M queries
// through attend_block (a verify, more than 8 queries); kOnline, `Online` in chunks (tail 1; the
// decode path before kFew). -> [out (q's shape) float32, lse (B, H, M) float32], or [] where the
// path has no instance (kFew: M > 4 or a head dim not in 32, 64, 128; kOnline: a head dim not in
// those; kBlocks: not a multiple of kW): the caller falls back
constexpr int64_t kOnline = 0, kBlocks = 1, kFew = 2;

std::vector<torch::Tensor> runs_attention(const torch::Tensor& q, int64_t B, int64_t H, int64_t M,
                                          int64_t D, const Runs& r,
                                          const c10::optional<torch::Tensor>& lens, double scale,
                                          int64_t tail, int64_t path) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.numel() == B * H * M * D,
              "q must be a contiguous float32 tensor of B * H * M * D floats");
  TORCH_CHECK(tail >= 1 && M % tail == 0 && (path == kBlocks || tail == 1),
              "tail must divide the queries M = G * T, and needs the blocks' path");
  const bool blocks = path == kBlocks, few = path == kFew;
  const int32_t* lp32 = nullptr;
  const int64_t* lp64 = nullptr;
  if (lens.has_value() && lens->defined()) {
    TORCH_CHECK(lens->is_contiguous() && lens->numel() == B &&
                    (lens->scalar_type() == at::kInt || lens->scalar_type() == at::kLong),
                "lens must be a contiguous int32 or int64 (B,) tensor");
    if (lens->scalar_type() == at::kInt) lp32 = lens->data_ptr<int32_t>();
    else lp64 = lens->data_ptr<int64_t>();
  }
  // blocks (the caller's choice, sparse_decode_cpu.attend_runs_cpu: a verify, more queries than
  // one decode instance holds, or a long context): blocks of keys for all M queries
  const auto none = [](auto, auto) {};
  if (blocks ? D % kW != 0 : few ? !with_few(M, D, none) : !with_shape(1, D, none)) return {};
  // the block kernel's passes: at most kMaxMV vectors of queries each, as even as lanes allow
  const int64_t passes = (M + kMaxMV * kW - 1) / (kMaxMV * kW);
  const int64_t per = ((M + passes - 1) / passes + kW - 1) / kW * kW;
  auto out = torch::empty_like(q);
  auto lse = torch::empty({B, H, M}, q.options());
  const float sc = static_cast<float>(scale);
  const int64_t T_ = r.T;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, r.dtype, "runs", [&] {
    const scalar_t *kp = static_cast<const scalar_t*>(r.k), *vp = static_cast<const scalar_t*>(r.v);
    const float* qp = q.data_ptr<float>();
    float *op = out.data_ptr<float>(), *lsp = lse.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> work(blocks ? D * kMaxMV * kW + 2 * kKeys * D : 0);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        const int64_t n = lp32 ? std::min<int64_t>(lp32[b], T_) : lp64 ? std::min(lp64[b], T_) : T_;
        const scalar_t *kr = kp + b * r.sb + h * r.sh, *vr = vp + b * r.sb + h * r.sh;
        if (few) {
          with_few(M, D, [&](auto m, auto d) {
            attend_few<scalar_t, decltype(m)::value, decltype(d)::value>(
                qp + bh * M * D, kr, vr, n, sc, op + bh * M * D, lsp + bh * M);
          });
          continue;
        }
        for (int64_t m0 = 0; blocks && m0 < M; m0 += per) {
          const int64_t mc = std::min(per, M - m0);
          with_mv((mc + kW - 1) / kW, [&](auto mv) {
            attend_block<scalar_t, decltype(mv)::value>(qp + (bh * M + m0) * D, mc, m0, kr, vr,
                                                        n, tail, D, sc, op + (bh * M + m0) * D,
                                                        lsp + bh * M + m0, work.data());
          });
        }
        // a decode step: the M queries in chunks that have an instance (8, 4, 3, 2, 1), each
        // chunk reading the run while the one before left it in cache
        for (int64_t m0 = 0; path == kOnline && m0 < M;) {
          const int64_t mc = M - m0 >= 8 ? 8 : M - m0 >= 4 ? 4 : M - m0;
          with_shape(mc, D, [&](auto m, auto d) {
            constexpr int MM = decltype(m)::value, DD = decltype(d)::value;
            Online<scalar_t, MM, DD> acc(qp + (bh * M + m0) * DD, sc);
            acc.add_run(kr, vr, n);
            acc.finish(op + (bh * M + m0) * DD, lsp + bh * M + m0);
          });
          m0 += mc;
        }
      }
    });
  });
  return {out, lse};
}

}  // namespace

// q (B, H, G, D) float32; k_rows, v_rows (rows, P * D); page_table (B, max_pages), seq_lens (B,),
// sel (B, H, S), n_sel (B, H): contiguous int32, the Python contract; ks, kh, vs, vh: the row
// strides of a page and a head in k_rows and v_rows (`page_rows`) -> (B, H, G, D) float32, or an
// undefined tensor (None) where G or D has no instance here (the caller gathers the pages
// instead). The pages go through `Online`: `Few` (above), which reads a dense lane twice as
// fast, read 1/8 or 1/4 of the pages of 16 tokens 1.1-1.3x slower than it in the engine (pages
// at random: their memory's latency, not the arithmetic, bounds that read)
torch::Tensor sparse_decode(torch::Tensor q, torch::Tensor k_rows, torch::Tensor v_rows,
                            torch::Tensor page_table, torch::Tensor seq_lens, torch::Tensor sel,
                            torch::Tensor n_sel, int64_t P, int64_t ks, int64_t kh, int64_t vs,
                            int64_t vh, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 (B, H, G, D) tensor");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = sel.size(2);
  TORCH_CHECK(k_rows.scalar_type() == v_rows.scalar_type(), "K and V must share a dtype");
  for (const auto& t : {k_rows, v_rows})
    TORCH_CHECK(t.dim() == 2 && t.size(1) == P * D && t.stride(0) == P * D && t.stride(1) == 1,
                "k_rows and v_rows must be (rows, page_size * D) with contiguous rows");
  for (const auto& t : {page_table, seq_lens, sel, n_sel})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(),
                "page_table, seq_lens, sel and n_sel must be contiguous int32");
  if (!with_shape(G, D, [](auto, auto) {})) return torch::Tensor();
  const int64_t max_pages = page_table.size(1);
  auto out = torch::empty({B, H, G, D}, q.options());
  const int32_t *tab = page_table.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  const int32_t *sl = sel.data_ptr<int32_t>(), *ns = n_sel.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_rows.scalar_type(), "sparse", [&] {
    const scalar_t *k = k_rows.data_ptr<scalar_t>(), *v = v_rows.data_ptr<scalar_t>();
    const float* qp = q.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H;
        const Pages pg{sl + bh * S, std::min<int64_t>(ns[bh], S), tab + b * max_pages, lens[b], P,
                       bh % H};
        const float* qb = qp + bh * G * D;
        float* ob = op + bh * G * D;
        const float sc = static_cast<float>(scale);
        with_shape(G, D, [&](auto m, auto d) {
          attend_pages<scalar_t, decltype(m)::value, decltype(d)::value>(qb, k, v, pg, ks, kh, vs,
                                                                        vh, sc, ob);
        });
      }
    });
  });
  return out;
}

// runs_attention over k, v (B, H, T, D) views with any row and head strides and contiguous
// tokens; q (B, H, M, D) float32 contiguous
std::vector<torch::Tensor> attend_runs(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                       c10::optional<torch::Tensor> lens, double scale,
                                       int64_t tail, int64_t path) {
  TORCH_CHECK(q.dim() == 4, "q must be a (B, H, M, D) tensor");
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  for (const auto& t : {k, v})
    TORCH_CHECK(t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(3) == D &&
                    t.stride(3) == 1 && t.stride(2) == D && t.scalar_type() == k.scalar_type(),
                "k and v must be (B, H, T, D) views with contiguous tokens, of one dtype");
  TORCH_CHECK(k.stride(0) == v.stride(0) && k.stride(1) == v.stride(1),
              "k and v must have the same strides");
  const Runs r{k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.size(2), k.scalar_type()};
  return runs_attention(q, B, H, M, D, r, lens, scale, tail, path);
}

// A decode step's dense attention on the engine's lanes, read where they lie in the pool:
// kpool, vpool (L, H, N, D) contiguous; row b's lane of head h in layer `layer` is the T token
// slots from first + b * size. q: the B * H * M * D floats of (B, Hq, 1, D) (M = Hq / H query
// heads a KV head, in order). -> [out (q's shape), lse (B, H, M)], as attend_runs
std::vector<torch::Tensor> attend_lanes(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool,
                                        int64_t layer, int64_t first, int64_t size, int64_t T,
                                        c10::optional<torch::Tensor> lens, double scale,
                                        int64_t path) {
  TORCH_CHECK(kpool.dim() == 4 && kpool.is_contiguous() && vpool.is_contiguous() &&
                  kpool.sizes() == vpool.sizes() && kpool.scalar_type() == vpool.scalar_type(),
              "kpool and vpool must be contiguous (L, H, N, D) tensors of one shape and dtype");
  const int64_t H = kpool.size(1), N = kpool.size(2), D = kpool.size(3), B = q.size(0);
  TORCH_CHECK(layer >= 0 && layer < kpool.size(0) && first >= 0 && T <= size &&
                  first + B * size <= N,
              "the lanes lie outside the pool");
  const int64_t M = q.numel() / (B * H * D), at = (layer * H * N + first) * D;
  const auto es = kpool.element_size();
  const Runs r{static_cast<const char*>(kpool.data_ptr()) + at * es,
               static_cast<const char*>(vpool.data_ptr()) + at * es, size * D, N * D, T,
               kpool.scalar_type()};
  return runs_attention(q, B, H, M, D, r, lens, scale, 1, path);
}

// The new tokens' keys and values into their slots: k, v (B, H, T, D) float32 (any strides);
// token t of row b into slot dst[b * T + t] of every head of layer `layer` of kpool, vpool
// (L, H, N, D) contiguous, in their dtype. As PagedKVCache.attend's index_copy_, in one call
void write_tokens(torch::Tensor kpool, torch::Tensor vpool, int64_t layer, torch::Tensor k,
                  torch::Tensor v, torch::Tensor dst) {
  TORCH_CHECK(kpool.dim() == 4 && kpool.is_contiguous() && vpool.is_contiguous() &&
                  kpool.sizes() == vpool.sizes() && kpool.scalar_type() == vpool.scalar_type(),
              "kpool and vpool must be contiguous (L, H, N, D) tensors of one shape and dtype");
  const int64_t H = kpool.size(1), N = kpool.size(2), D = kpool.size(3);
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(1) == H && k.size(3) == D &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "k and v must be float32 (B, H, T, D) tensors of the pool's heads");
  const int64_t B = k.size(0), T = k.size(2);
  TORCH_CHECK(dst.scalar_type() == at::kLong && dst.is_contiguous() && dst.numel() == B * T,
              "dst must be a contiguous int64 tensor of B * T slots");
  TORCH_CHECK(layer >= 0 && layer < kpool.size(0), "layer out of range");
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(dp[i] >= 0 && dp[i] < N, "a slot outside the pool");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kpool.scalar_type(), "write", [&] {
    for (const auto& pair : {std::make_pair(kpool, k), std::make_pair(vpool, v)}) {
      scalar_t* pool = pair.first.data_ptr<scalar_t>() + layer * H * N * D;
      const auto& x = pair.second;
      const float* xp = x.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < T; ++t) {
            const float* src = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
            scalar_t* to = pool + (h * N + dp[b * T + t]) * D;
            for (int64_t d = 0; d < D; ++d) to[d] = static_cast<scalar_t>(src[d * x.stride(3)]);
          }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the interface's version, bumped with a signature: sparse_decode_cpu.cpu_kernel refuses a
  // build of another one (torch's build cache is named by the kernel, not by its source)
  m.attr("version") = 5;
  m.attr("lanes") = kW;  // floats a vector register holds in this build: 16 (AVX-512) or 8
  m.def("sparse_decode", &sparse_decode, "block-sparse decode attention over a paged pool");
  m.def("select_pages", &select_pages, "page selection over centroid or Quest scores");
  m.def("attend_runs", &attend_runs, "dense decode and verify attention over contiguous runs");
  m.def("attend_lanes", &attend_lanes, "dense decode attention on the lanes, read in the pool");
  m.def("write_tokens", &write_tokens, "new tokens' keys and values into their pool slots");
}
