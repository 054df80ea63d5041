// Products of a few rows with a GGUF-quantized matrix kept in its published blocks:
// y[M, N] = x[M, K] W^T, W [N, K] in one of ggml's block types (Q4_0, Q4_1, Q5_0, Q8_0,
// Q4_K, Q6_K), read as it lies in the file (no copy, no float weights).
//
// The activations are quantized to 8 bits first (as llama.cpp's quantized dot products do):
// per block of B = 256 values for the K-quants (Q4_K, Q6_K), B = 32 for the others,
//
//     dx = max|x| / 127,   x8 = round_half_even(x / dx)  in [-127, 127],
//     bsum[j] = sum of x8 over the 16 values j*16 .. j*16+15 (int16).
//
// Each weight block is decoded once per call into unsigned codes c in natural order and its
// integer or float scales, then multiplied into every row (the weights are read once for all
// M rows: that is what makes a verification of a few rows cost little more than one; the
// vector builds decode it into registers once per group of up to 4 (AVX2) or 8 (AVX-512)
// rows, whose accumulators stay in registers over the whole output row):
//
//   K-quants (a super-block of 256 = 16 groups of 16, scales s_j, offsets o_j small ints):
//     w = d * s_j * c - dmin * o_j       (Q4_K: s, o per 32; Q6_K: s_j, o_j = 32 s_j, dmin = d)
//     lane[i] = sum over the 8 chunks of 32 of   sum_{e = 4i..4i+3} c_e x8_e s_{j(e)}   (int32)
//     low[i]  = bsum[2i] o_{2i} + bsum[2i+1] o_{2i+1}                                  (int32)
//     acc[i] = fma(float(lane[i]), d * dx, acc[i]);  acc[i] = fma(float(low[i]), -(dmin * dx), acc[i])
//   32-blocks (a float scale d and offset a per block):
//     w = d * c + a                      (Q4_0: a = -8d; Q4_1: a = m; Q5_0: a = -16d; Q8_0: c signed, a = 0)
//     lane[i] = sum_{e = 4i..4i+3} c_e x8_e;   acc[i] = fma(float(lane[i]), d * dx, acc[i])
//     off = fma(a * dx, float(bsum[0] + bsum[1]), off)
//
// and finally y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) + off.
// Every integer sum is exact (no int16 saturation: |c| <= 63 or signed 8-bit with |x8| <= 127);
// every float step is the fixed sequence above, so a row's result does not depend on the
// other rows, their number, the block of rows a call takes or the thread split: the same
// bits at 1 row (decoding) and at k+1 rows (verification).  The AVX-512 build (BW + VNNI:
// 64 values a row in one product, up to 8 rows in registers), the AVX2 build and the
// portable build compute these same integer lanes and the same float sequence: the same bits.
//
// Memory: a pass streams the weights once (a 1.5B Q4_K_M file is 1 GiB); each super-block
// fetches its row's bytes kPrefetchBytes ahead, so the loads overlap the arithmetic.
//
// Threads: OpenMP over output rows; loaded into a process that has loaded torch the library
// binds to torch's libgomp, so it runs on the pool torch's operators use.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>  // _mm_prefetch
#endif

namespace {

enum GgmlType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14,
};

constexpr int kRowsChunk = 16;  // rows a pass over the weights takes at most
constexpr long kPrefetchBytes = 2048;  // how far ahead of the block in use its row's bytes are fetched
// Values a call multiplies (or quantizes) below which it runs on one thread: a parallel
// region costs more than a small matrix's product, and far more where other processes hold
// the cores (a thread the barrier waits for is not running).
constexpr long kParallelWork = 1L << 20;

inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

struct TypeInfo {
  int block;      // values a block
  int bytes;      // bytes a block
  bool k_quant;   // super-block of 256 with integer sub-scales
  bool is_signed; // codes are signed (Q8_0)
};

bool type_info(int type, TypeInfo* info) {
  switch (type) {
    case kQ4_0: *info = {32, 18, false, false}; return true;
    case kQ4_1: *info = {32, 20, false, false}; return true;
    case kQ5_0: *info = {32, 22, false, false}; return true;
    case kQ8_0: *info = {32, 34, false, true}; return true;
    case kQ4_K: *info = {256, 144, true, false}; return true;
    case kQ6_K: *info = {256, 210, true, false}; return true;
    default: return false;
  }
}

// ---------------------------------------------------------------- decoding a weight block
// A decoded K-quant super-block: codes in natural order, sub-scales and offsets per 16.
struct SuperBlock {
  alignas(32) uint8_t c[256];
  alignas(32) int16_t s[16];
  alignas(32) int16_t o[16];
  float d, dmin;
};

// A decoded 32-block: codes (unsigned, or signed for Q8_0), scale and offset.
struct Block32 {
  alignas(32) uint8_t c[32];
  float d, a;
};

// Q4_K's 12 bytes of 6-bit scales and mins -> sc[8], m[8] (ggml's packing: scales 0-3 and
// mins 0-3 in the low 6 bits of bytes 0-3 and 4-7; scales and mins 4-7 split between the
// nibbles of bytes 8-11 and the top 2 bits of bytes 0-7).
inline void q4k_scales_mins(const uint8_t* q, uint8_t sc[8], uint8_t m[8]) {
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, q, 12);
  const uint32_t s_lo = u[0] & k6, m_lo = u[1] & k6;
  const uint32_t s_hi = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
  std::memcpy(sc, &s_lo, 4);
  std::memcpy(sc + 4, &s_hi, 4);
  std::memcpy(m, &m_lo, 4);
  std::memcpy(m + 4, &m_hi, 4);
}

void decode_q4_K(const uint8_t* b, SuperBlock* sb) {
  sb->d = fp16_to_f32(load_u16(b));
  sb->dmin = fp16_to_f32(load_u16(b + 2));
  alignas(16) uint8_t sc[16], m[16];
  q4k_scales_mins(b + 4, sc, m);
  for (int g = 0; g < 8; ++g) {
    sb->s[2 * g] = sb->s[2 * g + 1] = sc[g];
    sb->o[2 * g] = sb->o[2 * g + 1] = m[g];
  }
  const uint8_t* qs = b + 16;
#if defined(__AVX2__)
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    _mm256_store_si256(reinterpret_cast<__m256i*>(sb->c + 64 * j), _mm256_and_si256(q, m4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(sb->c + 64 * j + 32),
                       _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
  }
#else
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      sb->c[64 * j + l] = qs[32 * j + l] & 0xF;
      sb->c[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
  }
#endif
}

void decode_q6_K(const uint8_t* b, SuperBlock* sb) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  sb->d = sb->dmin = fp16_to_f32(load_u16(b + 208));
  for (int j = 0; j < 16; ++j) {
    sb->s[j] = sc[j];
    sb->o[j] = static_cast<int16_t>(32 * sc[j]);
  }
  for (int h = 0; h < 2; ++h) {
    const uint8_t* l = ql + 64 * h;
    const uint8_t* hb = qh + 32 * h;
    uint8_t* c = sb->c + 128 * h;
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
    const __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 32));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb));
    auto high = [&](int shift) {  // ((qh >> shift) & 3) << 4, per byte
      return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, shift), m2), 4);
    };
    _mm256_store_si256(reinterpret_cast<__m256i*>(c),
                       _mm256_or_si256(_mm256_and_si256(a, m4), high(0)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(c + 32),
                       _mm256_or_si256(_mm256_and_si256(a2, m4), high(2)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(c + 64),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), high(4)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(c + 96),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a2, 4), m4), high(6)));
#else
    for (int i = 0; i < 32; ++i) {
      c[i] = (l[i] & 0xF) | (((hb[i] >> 0) & 3) << 4);
      c[i + 32] = (l[i + 32] & 0xF) | (((hb[i] >> 2) & 3) << 4);
      c[i + 64] = (l[i] >> 4) | (((hb[i] >> 4) & 3) << 4);
      c[i + 96] = (l[i + 32] >> 4) | (((hb[i] >> 6) & 3) << 4);
    }
#endif
  }
}

#if defined(__AVX2__)
// 16 bytes of nibble pairs -> the 32 codes: low nibbles first, then high nibbles.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

// 32 bits -> 32 bytes, 0x10 where bit e is set (Q5_0's fifth bits).
inline __m256i fifth_bits32(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i probe = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // all bits but bit e % 8
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, probe), _mm256_set1_epi8(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}
#endif

void decode_block32(int type, const uint8_t* b, Block32* blk) {
  const float d = fp16_to_f32(load_u16(b));
  blk->d = d;
  __attribute__((unused)) const uint8_t* qs = b + (type == kQ4_1 ? 4 : type == kQ5_0 ? 6 : 2);
  switch (type) {
    case kQ4_0:
    case kQ4_1:
      blk->a = type == kQ4_0 ? -8.0f * d : fp16_to_f32(load_u16(b + 2));
#if defined(__AVX2__)
      _mm256_store_si256(reinterpret_cast<__m256i*>(blk->c), nibbles32(qs));
#else
      for (int l = 0; l < 16; ++l) { blk->c[l] = qs[l] & 0xF; blk->c[l + 16] = qs[l] >> 4; }
#endif
      break;
    case kQ5_0: {
      blk->a = -16.0f * d;
#if defined(__AVX2__)
      _mm256_store_si256(reinterpret_cast<__m256i*>(blk->c),
                         _mm256_or_si256(nibbles32(qs), fifth_bits32(b + 2)));
#else
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int l = 0; l < 16; ++l) {
        blk->c[l] = (qs[l] & 0xF) | (((qh >> l) & 1) << 4);
        blk->c[l + 16] = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
      }
#endif
      break;
    }
    case kQ8_0:
      blk->a = 0.0f;
      std::memcpy(blk->c, qs, 32);
      break;
  }
}

// ---------------------------------------------------------------- quantized activations
struct Q8Rows {
  int M = 0;
  long K = 0;
  int block = 32;
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / block]
  std::vector<int16_t> bsum; // [M, K / 16]
  std::vector<float> dt;     // [K / block, M + 8]: d transposed (the rows of a block side by side)
};

void quantize_rows(const float* x, int M, long K, int block, int threads, Q8Rows* out) {
  out->M = M;
  out->K = K;
  out->block = block;
  out->q.resize(static_cast<size_t>(M) * K);
  out->d.resize(static_cast<size_t>(M) * (K / block));
  out->bsum.resize(static_cast<size_t>(M) * (K / 16));
  const long nb = K / block;
  out->dt.assign(static_cast<size_t>(nb) * (M + 8), 0.0f);
#pragma omp parallel for schedule(static) collapse(2) num_threads(threads) \
    if (static_cast<long>(M) * K >= kParallelWork)
  for (int m = 0; m < M; ++m) {
    for (long b = 0; b < nb; ++b) {
      const float* xs = x + m * K + b * block;
      float amax = 0.0f;
      for (int i = 0; i < block; ++i) amax = std::fmax(amax, std::fabs(xs[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = out->q.data() + m * K + b * block;
      for (int i = 0; i < block; ++i) {
        const float v = std::nearbyint(xs[i] * id);
        q[i] = static_cast<int8_t>(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
      }
      out->d[m * nb + b] = d;
      out->dt[b * (M + 8) + m] = d;
      int16_t* bs = out->bsum.data() + m * (K / 16) + b * (block / 16);
      for (int j = 0; j < block / 16; ++j) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += q[16 * j + i];
        bs[j] = static_cast<int16_t>(s);
      }
    }
  }
}

// ---------------------------------------------------------------- per-row accumulation
struct Acc {
  float lane[8];
  float off;
};

inline float finish(const Acc& a) {
  const float* l = a.lane;
  return (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))) + a.off;
}

// One K-quant super-block into one row's accumulator.
inline void superblock_row(const SuperBlock& sb, const int8_t* x, const int16_t* bsum, float dx,
                           Acc* acc) {
  int32_t lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int ch = 0; ch < 8; ++ch) {
    for (int i = 0; i < 8; ++i) {
      int32_t s = 0;
      for (int p = 0; p < 2; ++p) {  // the two int16 pairs of lane i, each scaled
        const int e = 32 * ch + 4 * i + 2 * p;
        const int32_t pair = sb.c[e] * x[e] + sb.c[e + 1] * x[e + 1];
        s += pair * sb.s[e / 16];
      }
      lanes[i] += s;
    }
  }
  for (int i = 0; i < 8; ++i) {
    const int32_t low = bsum[2 * i] * sb.o[2 * i] + bsum[2 * i + 1] * sb.o[2 * i + 1];
    float a = std::fma(static_cast<float>(lanes[i]), sb.d * dx, acc->lane[i]);
    acc->lane[i] = std::fma(static_cast<float>(low), -(sb.dmin * dx), a);
  }
}

// One 32-block into one row's accumulator.
inline void block32_row(const Block32& blk, bool is_signed, const int8_t* x, const int16_t* bsum,
                        float dx, Acc* acc) {
  for (int i = 0; i < 8; ++i) {
    int32_t s = 0;
    for (int e = 4 * i; e < 4 * i + 4; ++e) {
      const int32_t c = is_signed ? static_cast<int8_t>(blk.c[e]) : blk.c[e];
      s += c * x[e];
    }
    acc->lane[i] = std::fma(static_cast<float>(s), blk.d * dx, acc->lane[i]);
  }
  acc->off = std::fma(blk.a * dx, static_cast<float>(bsum[0] + bsum[1]), acc->off);
}

#if defined(__AVX2__)
// ---------------------------------------------------------------- K-quant rows in registers
// The same sums as decode_q4_K / decode_q6_K + superblock_row, with the codes kept in
// registers instead of a decoded block and a group of MC rows' accumulators kept in
// registers over a whole output row: the integer lanes are exact sums (any order gives the
// same int32), and each row's float sequence over the super-blocks is superblock_row's.

// Chunk ch's int16 scale vector from s16 (the 16 sub-scales as int16): s[2ch] in lanes 0..7,
// s[2ch+1] in lanes 8..15 (both sit in dword ch).
inline __m256i chunk_scales(__m256i s16, int ch) {
  const __m256i dw = _mm256_permutevar8x32_epi32(s16, _mm256_set1_epi32(ch));
  return _mm256_shuffle_epi8(dw, _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                                 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
}

// Two consecutive chunks of 32 codes (values k .. k+31 and k+32 .. k+63) into the MC rows'
// integer lanes.  AVX-512 (BW + VNNI): one 64-byte product a row, the two chunks' lanes side
// by side (lanes 0..7 the first chunk's, 8..15 the second's; added together when the
// super-block ends: the same exact int32 sums).  AVX2: a chunk at a time.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
using Lanes = __m512i;
inline __m512i pair512(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
template <int MC>
inline void chunk_pair_rows512(__m512i cv, __m512i sv, const int8_t* const* x, long k,
                               Lanes* lanes) {
  for (int r = 0; r < MC; ++r) {
    const __m512i xv = _mm512_loadu_si512(x[r] + k);
    lanes[r] = _mm512_dpwssd_epi32(lanes[r], _mm512_maddubs_epi16(cv, xv), sv);
  }
}
// Chunks ch and ch+1's int16 scales in one vector: lanes 8i..8i+7 take s[2ch + i] (one
// permutation of the 16 sub-scales s16).
inline __m512i pair_scales(__m256i s16, int ch) {
  const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(2 * ch)),
                                       _mm512_srli_epi16(_mm512_set_epi16(
      31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
      15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
  return _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(s16));
}
inline __m256i fold_lanes(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
inline __m512i zero_lanes() { return _mm512_setzero_si512(); }
#else
using Lanes = __m256i;
template <int MC>
inline void chunk_pair_rows(__m256i c0, __m256i s0, __m256i c1, __m256i s1,
                            const int8_t* const* x, long k, Lanes* lanes) {
  for (int r = 0; r < MC; ++r) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + k));
    lanes[r] = _mm256_add_epi32(lanes[r], _mm256_madd_epi16(_mm256_maddubs_epi16(c0, x0), s0));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + k + 32));
    lanes[r] = _mm256_add_epi32(lanes[r], _mm256_madd_epi16(_mm256_maddubs_epi16(c1, x1), s1));
  }
}
inline __m256i fold_lanes(__m256i v) { return v; }
inline __m256i zero_lanes() { return _mm256_setzero_si256(); }
#endif

// Chunks ch and ch+1 (codes c0, c1; the 16 sub-scales s16) into the MC rows' lanes.
template <int MC>
inline void scaled_pair_rows(__m256i c0, __m256i c1, __m256i s16, int ch,
                             const int8_t* const* x, long k, Lanes* lanes) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  chunk_pair_rows512<MC>(pair512(c0, c1), pair_scales(s16, ch), x, k, lanes);
#else
  chunk_pair_rows<MC>(c0, chunk_scales(s16, ch), c1, chunk_scales(s16, ch + 1), x, k, lanes);
#endif
}

// The float side of a super-block for MC rows: per row r (dx its activations' scale),
//   acc_r = fma(float(lane_r), d * dx, acc_r);  acc_r = fma(float(low_r), -(dmin * dx), acc_r)
// with low_r[i] = bsum_r[2i] o[2i] + bsum_r[2i+1] o[2i+1].  AVX-512 runs it for two rows in
// one 16-lane vector (rows r and r+1 side by side; an odd last row beside itself), the
// scales d * dx of the rows taken from the transposed dx at once; AVX2 (and one row) a row
// at a time.  The same products and fmas per lane: the same bits.  (-dmin) * dx is
// -(dmin * dx) exactly.
template <int MC>
struct RowAccSingles {
  __m256 acc[MC];
  RowAccSingles() {
    for (int r = 0; r < MC; ++r) acc[r] = _mm256_setzero_ps();
  }
  void add_superblock(const Lanes* lanes, __m256i o16, float d, float dmin, const Q8Rows& xq,
                      int m0, long b, const int16_t* bsum, long n16) {
    for (int r = 0; r < MC; ++r) {
      const float dx = xq.dt[b * (xq.M + 8) + m0 + r];
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum + r * n16));
      const __m256i low = _mm256_madd_epi16(bs, o16);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_lanes(lanes[r])), _mm256_set1_ps(d * dx),
                               acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), _mm256_set1_ps(-(dmin * dx)), acc[r]);
    }
  }
  void finish_rows(float* out) const {
    for (int r = 0; r < MC; ++r) {
      Acc a;
      _mm256_storeu_ps(a.lane, acc[r]);
      a.off = 0.0f;
      out[r] = finish(a);
    }
  }
};

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
template <int MC>
struct RowAccPairs {
  static constexpr int kPairs = (MC + 1) / 2;
  __m512 acc[kPairs];
  RowAccPairs() {
    for (int p = 0; p < kPairs; ++p) acc[p] = _mm512_setzero_ps();
  }
  static __m512i pair_index(int p) {  // lanes 0..7 from row 2p, 8..15 from row 2p+1 (or 2p)
    const int second = 2 * p + 1 < MC ? 2 * p + 1 : 2 * p;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * p)),
                              _mm256_set1_epi32(second), 1);
  }
  void add_superblock(const Lanes* lanes, __m256i o16, float d, float dmin, const Q8Rows& xq,
                      int m0, long b, const int16_t* bsum, long n16) {
    const __m256 dxv = _mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << MC) - 1),
                                             xq.dt.data() + b * (xq.M + 8) + m0);
    const __m512 dd = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(d), dxv));
    const __m512 dm = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(-dmin), dxv));
    const __m512i o512 = _mm512_inserti64x4(_mm512_castsi256_si512(o16), o16, 1);
    for (int p = 0; p < kPairs; ++p) {
      const int r0 = 2 * p, r1 = 2 * p + 1 < MC ? 2 * p + 1 : 2 * p;
      const __m512i lo = _mm512_shuffle_i64x2(lanes[r0], lanes[r1], 0x44);
      const __m512i hi = _mm512_shuffle_i64x2(lanes[r0], lanes[r1], 0xEE);
      const __m512i folded = _mm512_add_epi32(lo, hi);  // [row r0's 8 lanes, row r1's]
      const __m512i bs = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum + r0 * n16))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum + r1 * n16)), 1);
      const __m512i low = _mm512_madd_epi16(bs, o512);
      const __m512i idx = pair_index(p);
      acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(folded), _mm512_permutexvar_ps(idx, dd), acc[p]);
      acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_permutexvar_ps(idx, dm), acc[p]);
    }
  }
  void finish_rows(float* out) const {
    for (int r = 0; r < MC; ++r) {
      Acc a;
      const __m512 pair = acc[r / 2];
      const __m256 half = r % 2 ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(pair), 1))
                                : _mm512_castps512_ps256(pair);
      _mm256_storeu_ps(a.lane, half);
      a.off = 0.0f;
      out[r] = finish(a);
    }
  }
};
template <int MC>
using RowAcc = std::conditional_t<(MC > 1), RowAccPairs<MC>, RowAccSingles<MC>>;
#else
template <int MC>
using RowAcc = RowAccSingles<MC>;
#endif

// Output row `row` (nblocks super-blocks of `type`) for MC rows of the quantized activations
// starting at m0: out[r] = the row's value for activation row m0 + r.
template <int MC>
void ksuper_rows(int type, int bytes, const uint8_t* row, long nblocks, const Q8Rows& xq, int m0,
                 float* out) {
  const long K = xq.K;
  const long n16 = K / 16;
  const int8_t* x[MC];
  RowAcc<MC> acc;
  for (int r = 0; r < MC; ++r) x[r] = xq.q.data() + (m0 + r) * K;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (long b = 0; b < nblocks; ++b) {
    const uint8_t* src = row + b * bytes;
    for (int line = 0; line < bytes; line += 64) {  // the row's bytes ahead, into cache
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + line), _MM_HINT_T0);
    }
    const long k0 = b * 256;
    Lanes lanes[MC];
    for (int r = 0; r < MC; ++r) lanes[r] = zero_lanes();
    float d, dmin;
    __m256i o16;  // the offsets per 16 values, int16
    if (type == kQ4_K) {
      d = fp16_to_f32(load_u16(src));
      dmin = fp16_to_f32(load_u16(src + 2));
      alignas(16) uint8_t sc[16], m[16];
      q4k_scales_mins(src + 4, sc, m);
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
      const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
      const __m256i s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
      o16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
      const uint8_t* qs = src + 16;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
      const __m512i m4w = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; ++j) {  // 32 bytes: low nibbles (chunk 2j), high nibbles (2j+1)
        const __m512i q = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j)));
        const __m512i cv = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF0000u, q, 4), m4w);
        chunk_pair_rows512<MC>(cv, pair_scales(s16, 2 * j), x, k0 + 64 * j, lanes);
      }
#else
      for (int j = 0; j < 4; ++j) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        scaled_pair_rows<MC>(_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                             s16, 2 * j, x, k0 + 64 * j, lanes);
      }
#endif
    } else {  // Q6_K
      const uint8_t* ql = src;
      const uint8_t* qh = src + 128;
      d = dmin = fp16_to_f32(load_u16(src + 208));
      const __m256i s16 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 192)));
      o16 = _mm256_slli_epi16(s16, 5);
      const __m256i m2 = _mm256_set1_epi8(3);
      for (int h = 0; h < 2; ++h) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
        const __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
        auto high = [&](int shift) {  // ((qh >> shift) & 3) << 4, per byte
          return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, shift), m2), 4);
        };
        const long k = k0 + 128 * h;
        scaled_pair_rows<MC>(_mm256_or_si256(_mm256_and_si256(a, m4), high(0)),
                             _mm256_or_si256(_mm256_and_si256(a2, m4), high(2)),
                             s16, 4 * h, x, k, lanes);
        scaled_pair_rows<MC>(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), high(4)),
                             _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a2, 4), m4), high(6)),
                             s16, 4 * h + 2, x, k + 64, lanes);
      }
    }
    acc.add_superblock(lanes, o16, d, dmin, xq, m0, b, xq.bsum.data() + m0 * n16 + k0 / 16, n16);
  }
  acc.finish_rows(out);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kRegisterRows = 8;  // rows a group keeps in registers (32 vector registers)
#else
constexpr int kRegisterRows = 4;  // rows a group keeps in registers (16 vector registers)
#endif

// ---------------------------------------------------------------- 32-block rows in registers
// The same sums as decode_block32 + block32_row, with the codes in a register and a group of
// MC rows' accumulators (lanes and offset) kept in registers over a whole output row: each
// row's float sequence over the blocks is block32_row's.
template <int MC>
void block32_rows(int type, int bytes, const uint8_t* row, long nblocks, const Q8Rows& xq, int m0,
                  float* out) {
  const long K = xq.K;
  const long n16 = K / 16;
  const long nd = K / 32;
  const bool is_signed = type == kQ8_0;
  const int8_t* x[MC];
  __m256 acc[MC];
  float off[MC];
  for (int r = 0; r < MC; ++r) {
    x[r] = xq.q.data() + (m0 + r) * K;
    acc[r] = _mm256_setzero_ps();
    off[r] = 0.0f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (long b = 0; b < nblocks; ++b) {
    const uint8_t* src = row + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
    const float d = fp16_to_f32(load_u16(src));
    float a;
    __m256i cv;
    switch (type) {
      case kQ4_0: a = -8.0f * d; cv = nibbles32(src + 2); break;
      case kQ4_1: a = fp16_to_f32(load_u16(src + 2)); cv = nibbles32(src + 4); break;
      case kQ5_0:
        a = -16.0f * d;
        cv = _mm256_or_si256(nibbles32(src + 6), fifth_bits32(src + 2));
        break;
      default: a = 0.0f; cv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2)); break;
    }
    // signed codes (Q8_0): |c| as unsigned, x carrying c's sign -- the same products
    const __m256i cu = is_signed ? _mm256_sign_epi8(cv, cv) : cv;
    for (int r = 0; r < MC; ++r) {
      const int m = m0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + b * 32));
      const __m256i xs = is_signed ? _mm256_sign_epi8(xv, cv) : xv;
      const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(cu, xs), ones);
      const float dx = xq.d[m * nd + b];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(d * dx), acc[r]);
      const int16_t* bs = xq.bsum.data() + m * n16 + 2 * b;
      off[r] = std::fma(a * dx, static_cast<float>(bs[0] + bs[1]), off[r]);
    }
  }
  for (int r = 0; r < MC; ++r) {
    Acc res;
    _mm256_storeu_ps(res.lane, acc[r]);
    res.off = off[r];
    out[r] = finish(res);
  }
}

template <int MC>
inline void rows_in_registers(int type, const TypeInfo& info, const uint8_t* row, long nblocks,
                              const Q8Rows& xq, int m0, float* out) {
  if (info.k_quant) {
    ksuper_rows<MC>(type, info.bytes, row, nblocks, xq, m0, out);
  } else {
    block32_rows<MC>(type, info.bytes, row, nblocks, xq, m0, out);
  }
}

// Output rows [n0, n1) of one part for rows [m0, m0 + mc), in groups of <= kRegisterRows
// rows, each group's accumulators in registers.
void register_range(int type, const TypeInfo& info, const uint8_t* w, long row_bytes,
                    const Q8Rows& xq, int m0, int mc, float* y, long ldy, long n0, long n1) {
  const long nblocks = xq.K / info.block;
  float out[kRegisterRows];
  for (long n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int g = 0; g < mc; g += kRegisterRows) {
      const int rows = mc - g < kRegisterRows ? mc - g : kRegisterRows;
      switch (rows) {
        case 1: rows_in_registers<1>(type, info, row, nblocks, xq, m0 + g, out); break;
        case 2: rows_in_registers<2>(type, info, row, nblocks, xq, m0 + g, out); break;
        case 3: rows_in_registers<3>(type, info, row, nblocks, xq, m0 + g, out); break;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
        case 4: rows_in_registers<4>(type, info, row, nblocks, xq, m0 + g, out); break;
        case 5: rows_in_registers<5>(type, info, row, nblocks, xq, m0 + g, out); break;
        case 6: rows_in_registers<6>(type, info, row, nblocks, xq, m0 + g, out); break;
        case 7: rows_in_registers<7>(type, info, row, nblocks, xq, m0 + g, out); break;
        default: rows_in_registers<8>(type, info, row, nblocks, xq, m0 + g, out); break;
#else
        default: rows_in_registers<4>(type, info, row, nblocks, xq, m0 + g, out); break;
#endif
      }
      for (int r = 0; r < rows; ++r) y[(m0 + g + r) * ldy + n] = out[r];
    }
  }
}
#endif

// Output rows [n0, n1) of one part for rows [m0, m0 + mc) of the quantized activations.
void rows_range(int type, const TypeInfo& info, const uint8_t* w, long row_bytes, const Q8Rows& xq,
                int m0, int mc, float* y, long ldy, long n0, long n1) {
#if defined(__AVX2__)
  register_range(type, info, w, row_bytes, xq, m0, mc, y, ldy, n0, n1);
#else  // portable: each block decoded once, then multiplied into every row
  const long K = xq.K;
  const long nblocks = K / info.block;
  const long nd = K / xq.block;
  const long n16 = K / 16;
  Acc acc[kRowsChunk];
  SuperBlock sb;
  Block32 blk;
  for (long n = n0; n < n1; ++n) {
    for (int r = 0; r < mc; ++r) acc[r] = Acc{{0, 0, 0, 0, 0, 0, 0, 0}, 0};
    const uint8_t* row = w + n * row_bytes;
    for (long b = 0; b < nblocks; ++b) {
      const uint8_t* src = row + b * info.bytes;
#if defined(__SSE__)
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
#endif
      const long k0 = b * info.block;
      if (info.k_quant) {
        if (type == kQ4_K) decode_q4_K(src, &sb); else decode_q6_K(src, &sb);
        for (int r = 0; r < mc; ++r) {
          const int m = m0 + r;
          superblock_row(sb, xq.q.data() + m * K + k0, xq.bsum.data() + m * n16 + k0 / 16,
                         xq.d[m * nd + b], &acc[r]);
        }
      } else {
        decode_block32(type, src, &blk);
        for (int r = 0; r < mc; ++r) {
          const int m = m0 + r;
          block32_row(blk, info.is_signed, xq.q.data() + m * K + k0,
                      xq.bsum.data() + m * n16 + k0 / 16, xq.d[m * nd + b], &acc[r]);
        }
      }
    }
    for (int r = 0; r < mc; ++r) y[(m0 + r) * ldy + n] = finish(acc[r]);
  }
#endif
}

}  // namespace

extern "C" {

// The instructions this library was built for: 2 AVX-512 (BW + VNNI), 1 AVX2, 0 portable.
int quant_rows_isa() {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// Bytes a row of K values of `type` takes, or -1 for a type this kernel does not know or a K
// that is not a whole number of its blocks.
long quant_row_bytes(int type, long K) {
  TypeInfo info;
  if (!type_info(type, &info) || K <= 0 || K % info.block) return -1;
  return K / info.block * info.bytes;
}

// y[m, col0 + n] = sum_k x[m, k] W[n, k] for m < M, n < N, W [N, K] in `type`'s blocks
// (`w`, rows of quant_row_bytes(type, K) bytes), x [M, K] float32 row-major, y with row
// stride ldy.  Returns 0, or -1 for a bad type or shape.
int quant_rows_linear(int type, int M, const float* x, long K, const uint8_t* w, long N,
                      float* y, long ldy, int threads) {
  TypeInfo info;
  if (!type_info(type, &info) || M <= 0 || K <= 0 || K % info.block || N <= 0) return -1;
  const long row_bytes = K / info.block * info.bytes;
  Q8Rows xq;
  quantize_rows(x, M, K, info.block, threads, &xq);
  constexpr long kTile = 8;  // outputs a scheduling unit
  const long tiles = (N + kTile - 1) / kTile;
  for (int m0 = 0; m0 < M; m0 += kRowsChunk) {
    const int mc = M - m0 < kRowsChunk ? M - m0 : kRowsChunk;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (static_cast<long>(mc) * N * K >= kParallelWork)
    for (long t = 0; t < tiles; ++t) {
      const long n0 = t * kTile;
      const long n1 = n0 + kTile < N ? n0 + kTile : N;
      rows_range(type, info, w, row_bytes, xq, m0, mc, y, ldy, n0, n1);
    }
  }
  return 0;
}

// out[r, :] = the float32 values of rows ids[r] of W (an embedding lookup), R rows.
int quant_dequantize_rows(int type, const uint8_t* w, long K, const long* ids, long R,
                          float* out) {
  TypeInfo info;
  if (!type_info(type, &info) || K <= 0 || K % info.block) return -1;
  const long row_bytes = K / info.block * info.bytes;
  for (long r = 0; r < R; ++r) {
    const uint8_t* row = w + ids[r] * row_bytes;
    float* o = out + r * K;
    for (long b = 0; b < K / info.block; ++b) {
      const uint8_t* src = row + b * info.bytes;
      if (info.k_quant) {
        SuperBlock sb;
        if (type == kQ4_K) decode_q4_K(src, &sb); else decode_q6_K(src, &sb);
        for (int e = 0; e < 256; ++e) {  // as ggml dequantizes: Q4_K (d s) c - dmin m,
          const int j = e / 16;             // Q6_K (d s) (c - 32)
          o[b * 256 + e] = type == kQ6_K ? sb.d * sb.s[j] * (sb.c[e] - 32)
                                         : sb.d * sb.s[j] * sb.c[e] - sb.dmin * sb.o[j];
        }
      } else {
        Block32 blk;
        decode_block32(type, src, &blk);
        for (int e = 0; e < 32; ++e) {
          const float c = info.is_signed ? static_cast<int8_t>(blk.c[e]) : blk.c[e];
          o[b * 32 + e] = blk.d * c + blk.a;
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
