// Row-exact attention over a contiguous KV cache: the attention of the quantized models.
//
// A quantized model's 8-bit activations can turn a last-bit difference into another token,
// so a verified row must be attended exactly as a one-row decoding step attends it.  Here
// every (query row, KV group) is one task that reads only its own row's queries and its own
// visible keys, in a fixed order, so a row's result does not depend on the rows beside it,
// their number or the thread split -- and one call attends all T rows and all heads (a
// verify of k+1 rows was k+1 x 8 torch operators a layer).
//
// Shapes: q [T, NH, D] (row stride ldq floats, head stride D), the cache's keys and values
// [KH, L, D] (group stride ldg floats, position stride D), out [T, NH, D] contiguous; the
// r = NH / KH query heads h = g r .. g r + r - 1 share KV group g.  Row i sees the keys
// 0 .. prefix[i] - 1, then (a token tree) extra[off[i]] .. extra[off[i + 1] - 1] in the
// order given.  Per head, over its visible keys j = 0 .. n - 1 (all float32):
//
//   s_j = dot8(q, k_j) * scale          dot8: 8 lanes, lane l sums q[8c + l] k_j[8c + l]
//                                       over c left to right (a product rounded, then added),
//                                       then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
//   m   = max_j s_j,   e_j = exp(s_j - m)    (rowexact::exp_clamped, vec_math.h: Cody-Waite
//                                            reduction and a degree-6 polynomial; 1-2 ulp)
//   z   = sum of e_j in 8 lanes by j mod 8, left to right, reduced as dot8's lanes
//   out = (sum_j e_j v_j, left to right per element) / z
//
// Only +, *, / and bit operations (no fma, no libm): every build computes the same bits, and
// the compiler's vectorisation of the lane loops changes no result (-ffp-contract=off).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

using rowexact::exp_clamped;
using rowexact::kLanes;
using rowexact::lanes_sum;

// Multiply-adds a call does below which it runs on one thread (a parallel region's start
// costs more than a short row's attention).
constexpr long kParallelWork = 1L << 18;
// Query heads a KV group may have.
constexpr int kMaxHeads = 64;

#if defined(__AVX2__)
// The AVX2 path attends a group's heads together, so each key and value row is read once for
// all of them (per head, a group's keys and values were streamed r times: from memory once a
// long context's cache outgrows the core's cache).  Each head's float sequence is the
// portable path's below (the same operations in the same order), only interleaved with its
// neighbours'.

// Heads a pass over the keys scores together (one accumulator each), and whose weighted
// values a pass over the values sums together (two vectors each: 16 columns).
constexpr int kScoreHeads = 8;
constexpr int kValueHeads = 6;

// s[h * n + j] = dot8(q_h, key j) * scale for the H heads at q (head stride d).
template <int H, typename Keys>
void scores_heads(const float* q, const float* kg, long n, int d, const Keys& keys, float scale,
                  float* s) {
  for (long j = 0; j < n; ++j) {
    const float* kp = kg + keys(j) * d;
    __m256 l[H];
    for (int h = 0; h < H; ++h) l[h] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += kLanes) {
      const __m256 kc = _mm256_loadu_ps(kp + c);
      for (int h = 0; h < H; ++h) {
        l[h] = _mm256_add_ps(l[h], _mm256_mul_ps(_mm256_loadu_ps(q + h * d + c), kc));
      }
    }
    for (int h = 0; h < H; ++h) s[h * n + j] = lanes_sum(l[h]) * scale;
  }
}

// out_h[c] = (sum_j p[h * n + j] v_j[c], left to right) / z[h] for the H heads at out (head
// stride d), columns c0 .. c0 + 8 V - 1 (V vectors).
template <int H, int V, typename Keys>
void values_heads(const float* p, const float* vg, long n, int d, int c0, const Keys& keys,
                  const float* z, float* out) {
  __m256 a[H][V];
  for (int h = 0; h < H; ++h) {
    for (int u = 0; u < V; ++u) a[h][u] = _mm256_setzero_ps();
  }
  for (long j = 0; j < n; ++j) {
    const float* vj = vg + keys(j) * d + c0;
    __m256 vv[V];
    for (int u = 0; u < V; ++u) vv[u] = _mm256_loadu_ps(vj + u * kLanes);
    for (int h = 0; h < H; ++h) {
      const __m256 e = _mm256_set1_ps(p[h * n + j]);
      for (int u = 0; u < V; ++u) a[h][u] = _mm256_add_ps(a[h][u], _mm256_mul_ps(e, vv[u]));
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 zv = _mm256_set1_ps(z[h]);
    for (int u = 0; u < V; ++u) {
      _mm256_storeu_ps(out + h * d + c0 + u * kLanes, _mm256_div_ps(a[h][u], zv));
    }
  }
}

template <typename Keys>
void scores_chunk(int heads, const float* q, const float* kg, long n, int d, const Keys& keys,
                  float scale, float* s) {
  switch (heads) {
    case 1: scores_heads<1>(q, kg, n, d, keys, scale, s); break;
    case 2: scores_heads<2>(q, kg, n, d, keys, scale, s); break;
    case 3: scores_heads<3>(q, kg, n, d, keys, scale, s); break;
    case 4: scores_heads<4>(q, kg, n, d, keys, scale, s); break;
    case 5: scores_heads<5>(q, kg, n, d, keys, scale, s); break;
    case 6: scores_heads<6>(q, kg, n, d, keys, scale, s); break;
    case 7: scores_heads<7>(q, kg, n, d, keys, scale, s); break;
    default: scores_heads<8>(q, kg, n, d, keys, scale, s); break;
  }
}

template <int V, typename Keys>
void values_chunk(int heads, const float* p, const float* vg, long n, int d, int c0,
                  const Keys& keys, const float* z, float* out) {
  switch (heads) {
    case 1: values_heads<1, V>(p, vg, n, d, c0, keys, z, out); break;
    case 2: values_heads<2, V>(p, vg, n, d, c0, keys, z, out); break;
    case 3: values_heads<3, V>(p, vg, n, d, c0, keys, z, out); break;
    case 4: values_heads<4, V>(p, vg, n, d, c0, keys, z, out); break;
    case 5: values_heads<5, V>(p, vg, n, d, c0, keys, z, out); break;
    default: values_heads<6, V>(p, vg, n, d, c0, keys, z, out); break;
  }
}
#else
// The portable path, one head at a time: a head's score of one key (module doc).
inline float dot8(const float* a, const float* b, int d) {
  float l[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int c = 0; c < d; c += kLanes) {
    for (int e = 0; e < kLanes; ++e) l[e] = l[e] + a[c + e] * b[c + e];
  }
  return lanes_sum(l);
}

// Keys whose scores one pass takes together: independent sums, so the adds overlap.
constexpr int kKeysAtOnce = 4;
// Output elements one pass over the keys accumulates.
constexpr int kOutAtOnce = 32;

// s[j] = dot8(q, key j) * scale for the n visible keys (keys(j) -> its position).
template <typename Keys>
void scores(const float* q, const float* kg, long n, int d, const Keys& keys, float scale,
            float* s) {
  long j = 0;
  for (; j + kKeysAtOnce <= n; j += kKeysAtOnce) {
    const float* kp[kKeysAtOnce];
    for (int u = 0; u < kKeysAtOnce; ++u) kp[u] = kg + keys(j + u) * d;
    float l[kKeysAtOnce][kLanes] = {};
    for (int c = 0; c < d; c += kLanes) {
      for (int u = 0; u < kKeysAtOnce; ++u) {
        for (int e = 0; e < kLanes; ++e) l[u][e] = l[u][e] + q[c + e] * kp[u][c + e];
      }
    }
    for (int u = 0; u < kKeysAtOnce; ++u) s[j + u] = lanes_sum(l[u]) * scale;
  }
  for (; j < n; ++j) s[j] = dot8(q, kg + keys(j) * d, d) * scale;
}

// out[c] = (sum_j p[j] v_j[c], left to right) / z for the n visible values, columns c0 ..
// in blocks of W.
template <int W, typename Keys>
void weighted_values(const float* p, const float* vg, long n, int d, int c0, const Keys& keys,
                     float z, float* out) {
  for (int c = c0; c + W <= d; c += W) {
    float a[W] = {};
    for (long j = 0; j < n; ++j) {
      const float e = p[j];
      const float* vj = vg + keys(j) * d + c;
      for (int u = 0; u < W; ++u) a[u] = a[u] + e * vj[u];
    }
    for (int u = 0; u < W; ++u) out[c + u] = a[u] / z;
  }
}
#endif

// exp(s_j - max_j s_j) in place over one head's n scores; their sum z (module doc).
inline float softmax_weights(float* sh, long n) {
  float m = -3.0e38f;
  for (long j = 0; j < n; ++j) m = std::max(m, sh[j]);
  long j0 = 0;
#if defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  for (; j0 + kLanes <= n; j0 += kLanes) {
    _mm256_storeu_ps(sh + j0, exp_clamped(_mm256_sub_ps(_mm256_loadu_ps(sh + j0), mv)));
  }
#endif
  for (; j0 < n; ++j0) sh[j0] = exp_clamped(sh[j0] - m);
  float zl[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  long j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int e = 0; e < kLanes; ++e) zl[e] = zl[e] + sh[j + e];
  }
  for (; j < n; ++j) zl[j % kLanes] = zl[j % kLanes] + sh[j];
  return lanes_sum(zl);
}

// One (row, group): the r heads' outputs.  keys(j) -> the position of visible key j.
template <typename Keys>
void attend_group(const float* q, int r, int d, const float* kg, const float* vg, long n,
                  const Keys& keys, float scale, float* out, std::vector<float>& s) {
  s.resize(static_cast<size_t>(r) * static_cast<size_t>(n));
  float z[kMaxHeads];
#if defined(__AVX2__)
  for (int h0 = 0; h0 < r; h0 += kScoreHeads) {
    scores_chunk(std::min(kScoreHeads, r - h0), q + static_cast<long>(h0) * d, kg, n, d, keys,
                 scale, s.data() + h0 * n);
  }
  for (int h = 0; h < r; ++h) z[h] = softmax_weights(s.data() + h * n, n);
  const int wide = d / 16 * 16;
  for (int h0 = 0; h0 < r; h0 += kValueHeads) {
    const int heads = std::min(kValueHeads, r - h0);
    const float* ph = s.data() + h0 * n;
    float* oh = out + static_cast<long>(h0) * d;
    for (int c = 0; c < wide; c += 16) values_chunk<2>(heads, ph, vg, n, d, c, keys, z + h0, oh);
    if (wide < d) values_chunk<1>(heads, ph, vg, n, d, wide, keys, z + h0, oh);
  }
#else
  for (int h = 0; h < r; ++h) {
    float* sh = s.data() + h * n;
    scores(q + static_cast<long>(h) * d, kg, n, d, keys, scale, sh);
    z[h] = softmax_weights(sh, n);
    float* oh = out + static_cast<long>(h) * d;
    const int wide = d / kOutAtOnce * kOutAtOnce;
    weighted_values<kOutAtOnce>(sh, vg, n, d, 0, keys, z[h], oh);
    weighted_values<kLanes>(sh, vg, n, d, wide, keys, z[h], oh);
  }
#endif
}

}  // namespace

extern "C" {

// out [T, NH, D] = the attention of q's rows over the cache (module doc); extra_off/extra
// may be null (a chain).  Returns 0, or 1 for shapes it does not take (D not a multiple of
// 8, NH not a multiple of KH, more than kMaxHeads query heads a group).
int quant_attend_rows(int T, int NH, int KH, int D, const float* q, long ldq, const float* k,
                      const float* v, long ldg, const long* prefix, const long* extra_off,
                      const long* extra, float scale, float* out, int threads) {
  if (D % kLanes || KH <= 0 || NH % KH || NH / KH > kMaxHeads) return 1;
  const int r = NH / KH;
  long work = 0;
  for (int i = 0; i < T; ++i) {
    long n = prefix[i] + (extra_off ? extra_off[i + 1] - extra_off[i] : 0);
    work += n * NH * D * 2L;
  }
  const int nthreads = work < kParallelWork ? 1 : threads;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> s;
#pragma omp for schedule(static) collapse(2)
    for (int i = 0; i < T; ++i) {
      for (int g = 0; g < KH; ++g) {
        const float* qg = q + i * ldq + static_cast<long>(g) * r * D;
        float* og = out + (static_cast<long>(i) * NH + static_cast<long>(g) * r) * D;
        const float* kg = k + g * ldg;
        const float* vg = v + g * ldg;
        const long p = prefix[i];
        if (!extra_off) {
          attend_group(qg, r, D, kg, vg, p, [](long j) { return j; }, scale, og, s);
        } else {
          const long* ex = extra + extra_off[i];
          const long n = p + extra_off[i + 1] - extra_off[i];
          attend_group(qg, r, D, kg, vg, n, [p, ex](long j) { return j < p ? j : ex[j - p]; },
                       scale, og, s);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
