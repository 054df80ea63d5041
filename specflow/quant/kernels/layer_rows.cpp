// A quantized decoder layer's work around its attention, in two calls: what a Llama/Qwen2
// layer (specflow.models.native) does before attending and after, for T rows, with the
// quantized products of quant_rows.cpp.  One call replaces about 15 torch operators (two RMS
// norms, the bias adds, RoPE, SiLU, the products of the parts, the residual adds), whose
// dispatch cost a decoding step more than a tenth of its time.
//
//   before:  x = rms(h) * ln1;  qkv = x Wqkv^T + bqkv;  q, k = rope(q, k) at the rows' positions
//   after:   h1 = h + (a Wo^T + bo);  x = rms(h1) * ln2;  [g, u] = x Wgu^T + bgu
//            h' = h1 + ((silu(g) * u) Wdown^T + bdown)
//
// with, per row (all float32, each step rounded as written):
//
//   rms(h)  = h * (1 / sqrt(ss / H + eps)),  ss = sum of h_e * h_e in 8 lanes by e mod 8,
//             left to right, reduced as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
//   rope(x) = x_e * cos_e + x_{e +- D/2} * sin_signed_e   (two products, then their sum)
//   silu(g) = g / (1 + exp(-g))   (rowexact::exp_clamped, vec_math.h)
//
// A row's result reads only that row (and the weights), so it is the same bits whatever the
// rows beside it, their number or the threads (the products guarantee that for themselves);
// the AVX2 and portable forms of each loop compute the same bits.

#include <cmath>
#include <cstdint>
#include <vector>

#include "vec_math.h"

extern "C" int quant_rows_linear_parts(int parts, const int* types, const uint8_t* const* blocks,
                                       const long* rows, int M, const float* x, long K, float* y,
                                       long ldy, int threads);

namespace {

using rowexact::exp_clamped;
using rowexact::kLanes;
using rowexact::lanes_sum;

constexpr int kMaxParts = 4;
// Values a row loop below (norms, RoPE, SiLU, residuals) takes before it runs on the threads:
// a prompt's rows, not a decoding step's (a 1024-token prefill of the 1.5B spent 7 % of its
// time in these loops on one thread while the other waited).  Rows are independent: the
// same bits on any number of threads.
constexpr long kParallelRowWork = 1L << 16;

// W [N, K] stacked from parts (each a K-quant's tiles or a 32-block type's rows).
struct MatrixDesc {
  int parts;
  int type[kMaxParts];
  const uint8_t* blocks[kMaxParts];
  long rows[kMaxParts];
  long cols;
  const float* bias;  // [N] or null
};

struct LayerDesc {
  long hidden, heads, kv_heads, head_dim, inner;
  float eps;
  const float* ln1;
  const float* ln2;
  MatrixDesc wqkv, wo, w_gate_up, w_down;
};

long total_rows(const MatrixDesc& m) {
  long n = 0;
  for (int p = 0; p < m.parts; ++p) n += m.rows[p];
  return n;
}

// y [T, N] = x [T, K] W^T + bias.
int linear(const MatrixDesc& m, int T, const float* x, float* y, int threads) {
  const long n = total_rows(m);
  if (quant_rows_linear_parts(m.parts, m.type, m.blocks, m.rows, T, x, m.cols, y, n, threads)) return 1;
  if (m.bias) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * n >= kParallelRowWork)
    for (long i = 0; i < static_cast<long>(T) * n; ++i) y[i] = y[i] + m.bias[i % n];
  }
  return 0;
}

// y [T, H] = rms(x) * w, per row (module doc).
void rms_norm(const float* x, const float* w, int T, long H, float eps, float* y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * H >= kParallelRowWork)
  for (int t = 0; t < T; ++t) {
    const float* xr = x + t * H;
    float* yr = y + t * H;
    float l[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
    long e = 0;
    for (; e + kLanes <= H; e += kLanes) {
      for (int u = 0; u < kLanes; ++u) l[u] = l[u] + xr[e + u] * xr[e + u];
    }
    for (; e < H; ++e) l[e % kLanes] = l[e % kLanes] + xr[e] * xr[e];
    const float r = 1.0f / std::sqrt(lanes_sum(l) / static_cast<float>(H) + eps);
    for (long i = 0; i < H; ++i) yr[i] = (xr[i] * r) * w[i];
  }
}

// x [heads, D] of one row rotated in place at one position's cos, sin_signed [D].
void rope(float* x, long heads, long d, const float* cos, const float* sin_signed) {
  const long half = d / 2;
  for (long h = 0; h < heads; ++h) {
    float* xh = x + h * d;
    for (long e = 0; e < half; ++e) {
      const float a = xh[e], b = xh[e + half];
      xh[e] = a * cos[e] + b * sin_signed[e];
      xh[e + half] = b * cos[e + half] + a * sin_signed[e + half];
    }
  }
}

// act [T, I] = silu(g) * u for gu [T, 2I] = [g, u] per row.
void silu_mul(const float* gu, int T, long inner, float* act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * inner >= kParallelRowWork)
  for (int t = 0; t < T; ++t) {
    const float* g = gu + t * 2 * inner;
    const float* u = g + inner;
    float* a = act + t * inner;
    long e = 0;
#if defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; e + kLanes <= inner; e += kLanes) {
      const __m256 gv = _mm256_loadu_ps(g + e);
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp_clamped(_mm256_sub_ps(zero, gv))));
      _mm256_storeu_ps(a + e, _mm256_mul_ps(s, _mm256_loadu_ps(u + e)));
    }
#endif
    for (; e < inner; ++e) a[e] = (g[e] / (1.0f + exp_clamped(0.0f - g[e]))) * u[e];
  }
}

thread_local std::vector<float> scratch_a, scratch_b;

float* buffer(std::vector<float>& v, long n) {
  if (static_cast<long>(v.size()) < n) v.resize(n);
  return v.data();
}

}  // namespace

extern "C" {

// qkv [T, (NH + 2 KH) D] = the layer's q, k, v of rows h [T, H], q and k rotated at
// positions[t] (cos, sin_signed: [positions, D] tables).  Returns 0, or 1 on a bad shape.
int quant_layer_before_attention(const LayerDesc* L, int T, const float* h, const float* cos,
                                 const float* sin_signed, const long* positions, float* qkv,
                                 int threads) {
  const long H = L->hidden, D = L->head_dim;
  const long width = (L->heads + 2 * L->kv_heads) * D;
  if (total_rows(L->wqkv) != width || L->wqkv.cols != H || D % 2) return 1;
  float* x = buffer(scratch_a, T * H);
  rms_norm(h, L->ln1, T, H, L->eps, x, threads);
  if (linear(L->wqkv, T, x, qkv, threads)) return 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * width >= kParallelRowWork)
  for (int t = 0; t < T; ++t) {
    rope(qkv + t * width, L->heads + L->kv_heads, D, cos + positions[t] * D,
         sin_signed + positions[t] * D);
  }
  return 0;
}

// out [T, H] = the layer's output for rows h [T, H] whose attention is a [T, NH D].
int quant_layer_after_attention(const LayerDesc* L, int T, const float* h, const float* a,
                                float* out, int threads) {
  const long H = L->hidden, I = L->inner;
  if (total_rows(L->wo) != H || total_rows(L->w_gate_up) != 2 * I || L->w_down.cols != I ||
      total_rows(L->w_down) != H) {
    return 1;
  }
  float* o = buffer(scratch_a, T * (2 * I > H ? 2 * I : H));
  if (linear(L->wo, T, a, o, threads)) return 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * H >= kParallelRowWork)
  for (long i = 0; i < T * H; ++i) out[i] = h[i] + o[i];
  float* x = buffer(scratch_b, T * (I > H ? I : H));
  rms_norm(out, L->ln2, T, H, L->eps, x, threads);
  if (linear(L->w_gate_up, T, x, o, threads)) return 1;
  silu_mul(o, T, I, x, threads);
  if (linear(L->w_down, T, x, o, threads)) return 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * H >= kParallelRowWork)
  for (long i = 0; i < T * H; ++i) out[i] = out[i] + o[i];
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------- a whole forward
// Every layer of a quantized model for a batch of B sequences, sequence b's T_b rows at
// positions start_b .. start_b + T_b - 1 (N = sum T_b rows, sequence by sequence): per layer,
// quant_layer_before_attention of all N rows, each sequence's keys and values written into
// its contiguous cache of that layer and its rows attended row-exact (attend_rows.cpp: row t
// over positions 0 .. start_b + t), and quant_layer_after_attention of all N rows -- the
// calls (and so the bits) of the model's layer function (specflow.models.native) run one by
// one from Python, without the interpreter between them.

extern "C" int quant_attend_rows(int T, int NH, int KH, int D, const float* q, long ldq,
                                 const float* k, const float* v, long ldg, const long* prefix,
                                 const long* extra_off, const long* extra, float scale,
                                 float* out, int threads);

namespace {

struct ModelDesc {
  int layers;
  const LayerDesc* const* layer;  // [layers]
  const float* cos;               // [table_rows, D]
  const float* sin_signed;        // [table_rows, D]
  long table_rows;
  float scale;                    // the attention's 1 / sqrt(D)
};

thread_local std::vector<float> forward_qkv, forward_att, forward_h;
thread_local std::vector<long> forward_pos, forward_prefix;

}  // namespace

extern "C" {

// out [N, H] = the last layer's output for the rows h [N, H] (the embeddings of the batch's
// tokens, sequence by sequence); keys[b * layers + l], values[...]: sequence b's cache of
// layer l, [KH, max_len[b], D], which gets the keys and values of its rows at positions
// starts[b] .. starts[b] + rows[b] - 1.  positions [N]: each row's RoPE position (null: its
// cache position); prefix [N]: the keys 0 .. prefix - 1 each row sees (null: its own and
// those before it); extra_off[b], extra[b] (null, or a null entry: a chain): a token tree's
// rows, row t of sequence b also seeing extra[b][extra_off[b][t] .. extra_off[b][t + 1] - 1]
// in that order (attend_rows.cpp).  Returns 0, or 1
// on a bad shape or positions beyond a cache or the RoPE tables (checked before anything is
// written; a failure of a layer's call after that leaves the positions past the caches'
// lengths written, which the next forward overwrites).
int quant_model_forward(const ModelDesc* M, int B, const int* rows, const long* starts,
                        float* const* keys, float* const* values, const long* max_len,
                        const long* positions, const long* prefix,
                        const long* const* extra_off, const long* const* extra,
                        const float* h, float* out, int threads) {
  if (B <= 0 || M->layers <= 0) return 1;
  const LayerDesc* first = M->layer[0];
  const long H = first->hidden, NH = first->heads, KH = first->kv_heads, D = first->head_dim;
  int N = 0;
  for (int b = 0; b < B; ++b) {
    if (rows[b] <= 0 || starts[b] < 0 || starts[b] + rows[b] > max_len[b] ||
        starts[b] + rows[b] > M->table_rows) {
      return 1;
    }
    N += rows[b];
  }
  for (int l = 0; l < M->layers; ++l) {
    const LayerDesc* L = M->layer[l];
    if (L->hidden != H || L->heads != NH || L->kv_heads != KH || L->head_dim != D) return 1;
  }
  const long width = (NH + 2 * KH) * D;
  float* qkv = buffer(forward_qkv, N * width);
  float* att = buffer(forward_att, N * NH * D);
  float* other = buffer(forward_h, N * H);
  if (static_cast<long>(forward_pos.size()) < N) forward_pos.resize(N);
  if (static_cast<long>(forward_prefix.size()) < N) forward_prefix.resize(N);
  for (int b = 0, row = 0; b < B; ++b) {
    const long end = starts[b] + rows[b];
    for (int t = 0; t < rows[b]; ++t, ++row) {
      forward_pos[row] = positions ? positions[row] : starts[b] + t;
      forward_prefix[row] = prefix ? prefix[row] : starts[b] + t + 1;
      if (forward_pos[row] < 0 || forward_pos[row] >= M->table_rows ||
          forward_prefix[row] < 0 || forward_prefix[row] > end) {
        return 1;
      }
    }
    if (extra_off && extra_off[b]) {
      for (long i = extra_off[b][0]; i < extra_off[b][rows[b]]; ++i) {
        if (extra[b][i] < 0 || extra[b][i] >= end) return 1;
      }
    }
  }
  // the layers alternate between `out` and `other`, the last one writing `out`
  float* cur_out = M->layers % 2 ? out : other;
  const float* in = h;
  for (int l = 0; l < M->layers; ++l) {
    const LayerDesc* L = M->layer[l];
    if (quant_layer_before_attention(L, N, in, M->cos, M->sin_signed, forward_pos.data(), qkv,
                                     threads)) {
      return 1;
    }
    for (int b = 0, row0 = 0; b < B; row0 += rows[b], ++b) {
      float* kc = keys[static_cast<long>(b) * M->layers + l];
      float* vc = values[static_cast<long>(b) * M->layers + l];
      const long ldg = max_len[b] * D;
      for (int t = 0; t < rows[b]; ++t) {
        const float* row = qkv + (row0 + t) * width;
        for (long g = 0; g < KH; ++g) {
          float* kd = kc + g * ldg + (starts[b] + t) * D;
          float* vd = vc + g * ldg + (starts[b] + t) * D;
          const float* ks = row + (NH + g) * D;
          const float* vs = row + (NH + KH + g) * D;
          for (long e = 0; e < D; ++e) {
            kd[e] = ks[e];
            vd[e] = vs[e];
          }
        }
      }
      if (quant_attend_rows(rows[b], static_cast<int>(NH), static_cast<int>(KH),
                            static_cast<int>(D), qkv + row0 * width, width, kc, vc, ldg,
                            forward_prefix.data() + row0,
                            extra_off ? extra_off[b] : nullptr, extra_off ? extra[b] : nullptr,
                            M->scale,
                            att + row0 * NH * D, threads)) {
        return 1;
      }
    }
    if (quant_layer_after_attention(L, N, in, att, cur_out, threads)) return 1;
    in = cur_out;
    cur_out = cur_out == out ? other : out;
  }
  return 0;
}

}  // extern "C"
