// Products of a few rows with weights streamed once: y[M, N] = x[M, K] W^T + b, W either int8
// copies (rows_linear_i8, below) or a float32 model's own row-major matrices (rows_linear_f32,
// further below).
//
// A draft model's decoding step multiplies M <= 8 rows by every matrix of the model: its time
// is the weights' bytes over the memory bandwidth, if the kernel keeps up with it.  Weights
// are int8, stored *blocked*: Q [N, K] -> Qb [ceil(N/8), K, 8] (output rows zero-padded to a
// multiple of 8), so that 8 bytes hold the weights of 8 outputs at one input index k and each
// block is one sequential stream.  Per tile of G blocks (8G outputs) the kernel keeps M*G
// float accumulators in vector registers and, for k = 0, 1, ..., K-1 in order,
//
//     acc[m][g] += broadcast(x[m, k]) * float(Qb[n/8 + g, k, :])
//
// then y[m, n] = s_n * acc + b_n.  Every output is a plain left-to-right float sum over k,
// the same for every M and thread split: a row's result does not depend on the other rows.
// The input arrives transposed, xT [K, M], so the M broadcasts of one k read one cache line.
// While a tile streams its G blocks the next tile's are prefetched at the same k (a tile
// starts with its streams in cache: measured 15-20 % faster a step on the 0.5B).
//
// Built by specflow.cpu.rows_kernel with -O3 -mavx2 -mfma -fopenmp and used only where
// the CPU reports AVX2 and FMA.  In both kernels the tiles are split over OpenMP threads: loaded into a
// process that has loaded torch, the library binds to torch's own libgomp.so.1, so its
// parallel region runs on the thread pool torch's operators use (a pool of its own would
// fight torch's spinning workers for the cores).

#include <immintrin.h>

#include <cstdint>

namespace {

inline __m256 widen8(const int8_t* q) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Output blocks [nb, nb_end) of y, G blocks a tile, then the rest one block a tile.
template <int M, int G>
void run_tiles(const float* xt, long K, const int8_t* qb, const float* scale, const float* bias,
               float* y, long N, long nb, long nb_end) {
  for (; nb + G <= nb_end; nb += G) {
    __m256 acc[M][G];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[m][g] = _mm256_setzero_ps();
    }
    const int8_t* tile = qb + nb * K * 8;
    for (long k = 0; k < K; ++k) {
      __m256 w[G];
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        w[g] = widen8(tile + (g * K + k) * 8);
        // the next tile's block g at this k: its stream is in cache when that tile starts
        // (a prefetch past the matrix's end is a no-op, it never faults)
        _mm_prefetch(reinterpret_cast<const char*>(tile + ((G + g) * K + k) * 8), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(xt + k * M + m);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) acc[m][g] = _mm256_fmadd_ps(xv, w[g], acc[m][g]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const long n0 = (nb + g) * 8;
      const long count = N - n0 < 8 ? N - n0 : 8;
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        alignas(32) float out[8];
        _mm256_store_ps(out, acc[m][g]);
        for (long j = 0; j < count; ++j) {
          const float v = out[j] * scale[n0 + j];
          y[m * N + n0 + j] = bias ? v + bias[n0 + j] : v;
        }
      }
    }
  }
  if constexpr (G > 1) {
    if (nb < nb_end) run_tiles<M, 1>(xt, K, qb, scale, bias, y, N, nb, nb_end);
  }
}

// Blocks a tile: enough accumulators (M*G <= 12 of the 16 vector registers) to hide the FMA
// latency, as few as that needs so that each weight vector feeds M FMAs.
template <int M>
constexpr int tile_blocks() {
  return M <= 2 ? 4 : M <= 4 ? 3 : M <= 6 ? 2 : 1;
}

void run_range(int M, const float* xt, long K, const int8_t* qb, const float* scale,
               const float* bias, float* y, long N, long nb0, long nb1) {
  switch (M) {
#define ROWS_CASE(m)                                                                       \
  case m:                                                                                  \
    run_tiles<m, tile_blocks<m>()>(xt, K, qb, scale, bias, y, N, nb0, nb1);              \
    break;
    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
    ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
  }
}


// ---------------------------------------------------------------------------------------
// Float32 weights in their own row-major layout W [N, K] (a target's fp32 matrices, used as
// they are: no copy).  Per tile of G outputs the kernel keeps M*G accumulators of 8 lanes
// and, for k = 0, 8, 16, ... in order,
//
//     acc[m][g] += x[m, k:k+8] * W[n + g, k:k+8]           (lane-wise FMA)
//
// then y[m, n+g] = ((lane 0 + lane 4) + (lane 2 + lane 6)) + ((lane 1 + lane 5) + (lane 3 +
// lane 7)) (hsum8), the K mod 8 tail added left to right, then the bias.  Every output is
// that fixed sum whatever M, the tile or the thread split.  While it streams one tile's G
// rows it prefetches the next tile's at the same k and its own 512 floats ahead: without
// that a few rows ran at a third of the memory bandwidth.

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // j + j+4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // + j+2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                            // + j+1
  return _mm_cvtss_f32(s);
}

constexpr long kAhead = 512;  // floats of its own rows prefetched ahead of k

template <int M, int G>
void run_tiles_f32(const float* x, long K, const float* w, const float* bias, float* y,
                   long ldy, long n, long n_end) {
  const long K8 = K & ~7L;
  for (; n + G <= n_end; n += G) {
    __m256 acc[M][G];
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[m][g] = _mm256_setzero_ps();
    }
    const float* rows = w + n * K;
    for (long k = 0; k < K8; k += 8) {
      __m256 wv[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        wv[g] = _mm256_loadu_ps(rows + g * K + k);
        _mm_prefetch(reinterpret_cast<const char*>(rows + (G + g) * K + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(rows + g * K + k + kAhead), _MM_HINT_T0);
      }
#pragma GCC unroll 12
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[m][g] = _mm256_fmadd_ps(xv, wv[g], acc[m][g]);
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int g = 0; g < G; ++g) {
        float s = hsum8(acc[m][g]);
        for (long k = K8; k < K; ++k) s += x[m * K + k] * rows[g * K + k];
        y[m * ldy + n + g] = bias ? s + bias[n + g] : s;
      }
    }
  }
  if constexpr (G > 1) {
    if (n < n_end) run_tiles_f32<M, 1>(x, K, w, bias, y, ldy, n, n_end);
  }
}


// Rows 7..12: two chunks (6 rows, then the rest) over each tile of 2 outputs; the second
// reads the tile's weights from cache, so the weights still stream from memory once (one
// chunk of 8 rows with 8 accumulators ran 15 % slower at 8 rows, 15 % at 12).
template <int M2>
void run_tiles_f32_two(const float* x, long K, const float* w, const float* bias, float* y,
                       long ldy, long n, long n_end) {
  constexpr int G = 2;
  for (; n + G <= n_end; n += G) {
    run_tiles_f32<6, G>(x, K, w, bias, y, ldy, n, n + G);
    run_tiles_f32<M2, G>(x + 6 * K, K, w, bias, y + 6 * ldy, ldy, n, n + G);
  }
  if (n < n_end) {
    run_tiles_f32<6, 1>(x, K, w, bias, y, ldy, n, n_end);
    run_tiles_f32<M2, 1>(x + 6 * K, K, w, bias, y + 6 * ldy, ldy, n, n_end);
  }
}

// Outputs a tile (M <= 6): M*G <= 12 accumulators, each weight vector feeding M FMAs.
template <int M>
constexpr int tile_rows_f32() {
  return M <= 2 ? 4 : M <= 4 ? 3 : M <= 6 ? 2 : 1;
}

void run_range_f32(int M, const float* x, long K, const float* w, const float* bias, float* y,
                   long ldy, long n0, long n1) {
  switch (M) {
#define ROWS_CASE(m)                                                                       \
  case m:                                                                                  \
    run_tiles_f32<m, tile_rows_f32<m>()>(x, K, w, bias, y, ldy, n0, n1);                 \
    break;
    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#undef ROWS_CASE
#define TWO_CASE(m) case m: run_tiles_f32_two<m - 6>(x, K, w, bias, y, ldy, n0, n1); break;
    TWO_CASE(7) TWO_CASE(8) TWO_CASE(9) TWO_CASE(10) TWO_CASE(11) TWO_CASE(12)
#undef TWO_CASE
  }
}

}  // namespace

extern "C" {

// y [M, N] = x Q^T * scale + bias: xt [K, M] (x transposed, float), qb [ceil(N/8), K, 8]
// int8, scale [N] float, bias [N] float or null.  Returns 0, or 1 for M outside 1..8 or an
// empty shape.
int rows_linear_i8(int M, const float* xt, long K, const int8_t* qb, const float* scale,
                   const float* bias, float* y, long N, int threads) {
  if (M < 1 || M > 8 || K < 1 || N < 1) return 1;
  const long blocks = (N + 7) / 8;
  if (threads < 1) threads = 1;
  // Whole tiles of 4 blocks a thread, so that only the last thread ends on a ragged tile.
  const long per = ((blocks + threads - 1) / threads + 3) / 4 * 4;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    const long a = t * per, b = a + per < blocks ? a + per : blocks;
    if (a < b) run_range(M, xt, K, qb, scale, bias, y, N, a, b);
  }
  return 0;
}

// y[m, 0:N] (row stride ldy) = x W^T + bias: x [M, K] float row-major, w [N, K] float
// row-major, bias [N] float or null.  Returns 0, or 1 for M outside 1..12 or an empty shape.
int rows_linear_f32(int M, const float* x, long K, const float* w, const float* bias, float* y,
                    long ldy, long N, int threads) {
  if (M < 1 || M > 12 || K < 1 || N < 1 || ldy < N) return 1;
  if (threads < 1) threads = 1;
  // Whole tiles of 12 outputs a thread (a multiple of every G), the last thread's ragged.
  const long per = ((N + threads - 1) / threads + 11) / 12 * 12;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    const long a = t * per, b = a + per < N ? a + per : N;
    if (a < b) run_range_f32(M, x, K, w, bias, y, ldy, a, b);
  }
  return 0;
}
}
