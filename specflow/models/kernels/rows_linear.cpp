// Products of a few rows with int8 weights streamed once: y[M, N] = x[M, K] (s * Q)^T + b.
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
//
// Built by specflow.models.rows_kernel with -O3 -mavx2 -mfma -fopenmp and used only where
// the CPU reports AVX2 and FMA.  The tiles are split over OpenMP threads: loaded into a
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
      for (int g = 0; g < G; ++g) w[g] = widen8(tile + (g * K + k) * 8);
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
}
