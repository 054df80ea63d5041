// Products of a few rows with a GGUF-quantized matrix kept in its published values:
// y[M, N] = x[M, K] W^T, W [N, K] in one of ggml's block types (Q4_0, Q4_1, Q5_0, Q8_0,
// Q4_K, Q6_K), no float weights.
//
// The activations are quantized to 8 bits first (as llama.cpp's quantized dot products do):
// per block of B = 256 values for the K-quants (Q4_K, Q6_K), B = 32 for the others,
//
//     dx = max|x| / 127,   x8 = round_half_even(x / dx)  in [-127, 127],
//     bsum[j] = sum of x8 over the 16 values j*16 .. j*16+15 (int16).
//
// K-quants (the bulk of a Q4_K_M file) are repacked once, at load, into tiles of 16 weight
// rows (quant_repack; the same bits as the file, laid out for the product): per super-block
// of 256 values, the 16 rows' scales side by side and their codes interleaved 4 values a
// row, so one vector holds 4 values of each of the 16 rows.  A product then broadcasts 4 of
// an activation row's 8-bit values against that vector (VNNI's u8 x s8 dot of 4 on AVX-512,
// maddubs on AVX2): the vector lanes are weight rows, a tile's codes are decoded once per
// group of activation rows, and a lane ends holding its whole (weight row, activation row)
// sum.  Per super-block, for weight row n and activation row m (codes c, 8-bit x, all
// integer sums exact in int32):
//
//   Q4_K (w = d s_ch c - dmin m_ch, one scale and min per 32 values, ch = 0..7):
//     L   = sum_ch s_ch * sum_{e in ch} c_e x_e,    low = sum_ch m_ch * (bsum[2ch] + bsum[2ch+1])
//     acc = fma(float(L), d * dx, acc);   acc = fma(float(low), -(dmin * dx), acc)
//   Q6_K (w = d s_g (c - 32), one scale per 16 values, g = 0..15):
//     L   = sum_g s_g * sum_{e in g} c_e x_e  -  32 * sum_g s_g bsum[g]
//     acc = fma(float(L), d * dx, acc)
//
// and y = acc after the last super-block.  32-blocks (Q4_0, Q4_1, Q5_0, Q8_0), repacked into
// tiles of 16 rows as well, per weight row and activation row and block (as ggml's q4_0 x q8_0
// dot: one integer sum a block, one float step):
//
//     w = d * c + a                      (Q4_0: a = -8d; Q4_1: a = m; Q5_0: a = -16d; Q8_0: c signed, a = 0)
//     S = sum_{e < 32} c_e x8_e;   acc = fma(float(S), d * dx, acc)
//     off = fma(a * dx, float(bsum[0] + bsum[1]), off)
//     y = acc + off.
//
// Every integer sum is exact (no int16 saturation: |c| <= 63 or signed 8-bit with
// |x8| <= 127; AVX2 sums at most 8 Q4_K, 2 Q6_K, 8 Q4_0 / Q4_1 or 4 Q5_0 maddubs pairs in
// int16, < 32768); every
// float step is the fixed sequence above, so a row's result does not depend on the other
// rows, their number, the block of rows a call takes or the thread split: the same bits at 1
// row (decoding) and at k+1 rows (verification).  The AVX-512 build (BW + VNNI), the AVX2
// build and the portable build compute the same integers and the same float sequence: the
// same bits.
//
// Memory: a pass streams the weights once (a 1.5B Q4_K_M file is 1 GiB; a Q4_K tile is 2.8%
// larger than its rows in the file, a Q6_K tile and a 32-block tile the same size).
//
// Threads: OpenMP over tiles; loaded into a process that has loaded
// torch the library binds to torch's libgomp, so it runs on the pool torch's operators use.

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
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

constexpr int kRowsChunk = 16;  // activation rows a tile is multiplied into at a time
// Activation rows whose 8-bit values (K bytes a row) a product keeps in a core's cache while
// every tile passes them (quant_rows_linear_parts): 256 KiB of them, whole chunks, at least one.
constexpr long kRowsCacheBytes = 256 * 1024;
inline int rows_in_cache(long K) {
  const long rows = kRowsCacheBytes / K / kRowsChunk * kRowsChunk;
  return rows > kRowsChunk ? static_cast<int>(rows) : kRowsChunk;
}
// Values a call multiplies (or quantizes) below which it runs on one thread: a parallel
// region costs more than a small matrix's product, and far more where other processes hold
// the cores (a thread the barrier waits for is not running).
constexpr long kParallelWork = 1L << 20;
// The same for a 32-block matrix, whose values cost several times a K-quant's (a block's
// float steps every 32 values, not 256): measured on SmolLM2's 576 x 960 q/k/v (Q4_1, 1 row,
// 2-core EPYC Zen 3) two threads already pay.
constexpr long kParallelWork32 = 1L << 17;

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
  // 8-bit values: [M, K] for 32-blocks; [K / 256, M, 256] for the K-quants, so the rows of a
  // super-block lie side by side at a fixed distance (block_at)
  std::vector<int8_t> q;
  long row_stride = 0, block_stride = 0;  // q's distance from row m to m + 1, block b to b + 1
  std::vector<float> d;      // [M, K / block]
  std::vector<int16_t> bsum; // [M, K / 16]
  std::vector<int16_t> bsum32; // [M, K / 32]: bsum[2i] + bsum[2i+1]
  std::vector<float> dt;     // [K / block, M + 8]: d transposed (the rows of a block side by side)
};

// One block of `block` values (a multiple of 32) -> q (8-bit), bs (sums of 16) and its scale
// dx (returned): the header's formulas, in this order of float steps whatever the build.
inline float quantize_block(const float* xs, int block, int8_t* q, int16_t* bs) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  // max_ps(a, b) returns b where a is NaN: a NaN value is skipped, as fmax skips it
  for (int i = 0; i < block; i += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xs + i)), vmax);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
#else
  float amax = 0.0f;
  for (int i = 0; i < block; ++i) amax = std::fmax(amax, std::fabs(xs[i]));
#endif
  const float d = amax / 127.0f;
  // 0 where 1 / d is not finite (d = 0, or a block of values below about 4e-37)
  const float id = d != 0.0f && std::isfinite(1.0f / d) ? 1.0f / d : 0.0f;
#if defined(__AVX2__)
  // round half to even (the default rounding mode, as nearbyint), clamped to [-127, 127]; a
  // NaN (max_ps(NaN, lo) is lo) to -127, as the scalar fmax gives
  const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < block; i += 32) {
    __m256i v[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xs + i + 8 * k), vid),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    for (int h = 0; h < 2; ++h) {  // the sums of values i + 16h .. i + 16h + 15
      const __m256i s8 = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      bs[i / 16 + h] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(packed, order));
  }
#else
  for (int i = 0; i < block; ++i) {
    const float v = std::nearbyint(xs[i] * id);
    q[i] = static_cast<int8_t>(std::fmin(std::fmax(v, -127.0f), 127.0f));  // NaN: -127
  }
  for (int j = 0; j < block / 16; ++j) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += q[16 * j + i];
    bs[j] = static_cast<int16_t>(s);
  }
#endif
  return d;
}

void quantize_rows(const float* x, int M, long K, int block, int threads, Q8Rows* out) {
  out->M = M;
  out->K = K;
  out->block = block;
  out->q.resize(static_cast<size_t>(M) * K);
  out->row_stride = block == 256 ? 256 : K;
  out->block_stride = block == 256 ? 256L * M : block;
  out->d.resize(static_cast<size_t>(M) * (K / block));
  out->bsum.resize(static_cast<size_t>(M) * (K / 16));
  out->bsum32.resize(static_cast<size_t>(M) * (K / 32));
  const long nb = K / block;
  out->dt.assign(static_cast<size_t>(nb) * (M + 8), 0.0f);
#pragma omp parallel for schedule(static) collapse(2) num_threads(threads) \
    if (static_cast<long>(M) * K >= kParallelWork)
  for (int m = 0; m < M; ++m) {
    for (long b = 0; b < nb; ++b) {
      const float* xs = x + m * K + b * block;
      int8_t* q = out->q.data() + b * out->block_stride + m * out->row_stride;
      int16_t* bs = out->bsum.data() + m * (K / 16) + b * (block / 16);
      const float d = quantize_block(xs, block, q, bs);
      out->d[m * nb + b] = d;
      out->dt[b * (M + 8) + m] = d;
      int16_t* b32 = out->bsum32.data() + m * (K / 32) + b * (block / 32);
      for (int j = 0; j < block / 32; ++j) b32[j] = static_cast<int16_t>(bs[2 * j] + bs[2 * j + 1]);
    }
  }
}

// Row m's 8-bit values of block b (block values, consecutive).
inline const int8_t* block_at(const Q8Rows& xq, int m, long b) {
  return xq.q.data() + b * xq.block_stride + m * xq.row_stride;
}

// ---------------------------------------------------------------- per-row accumulation
struct Acc {
  float sum;
  float off;
};

inline float finish(const Acc& a) { return a.sum + a.off; }

// One 32-block into one row's accumulator (the header's sequence).
inline void block32_row(const Block32& blk, bool is_signed, const int8_t* x, const int16_t* bsum,
                        float dx, Acc* acc) {
  int32_t s = 0;
  for (int e = 0; e < 32; ++e) {
    const int32_t c = is_signed ? static_cast<int8_t>(blk.c[e]) : blk.c[e];
    s += c * x[e];
  }
  acc->sum = std::fma(static_cast<float>(s), blk.d * dx, acc->sum);
  acc->off = std::fma(blk.a * dx, static_cast<float>(bsum[0] + bsum[1]), acc->off);
}

// ---------------------------------------------------------------- K-quant tiles
// A tile is 16 weight rows; its super-blocks follow one another, each laid out as below
// (r a row of the tile, st a step of 4 values, e one of them; pairs hold sub-blocks 2p, 2p+1):
//   Q4_K: d fp16[16] | dmin fp16[16] | scales u8[4 pairs][16 r][2] | mins u8[4][16][2]
//         | codes[4 j][8 st][16 r][4 e]: c(64j + 4st + e) | c(64j + 32 + 4st + e) << 4
//   Q6_K: d fp16[16] | scales s8[8 pairs][16 r][2] | for h = 0, 1: high bits[8 st][16 r][4 e] (the
//         top 2 bits of chunk 4h + q at bit 2q) | low nibbles[2 j][8 st][16 r][4 e] of pairs
//         j = 2h, 2h+1 (as Q4_K's codes)
constexpr int kTileRows = 16;
struct TileLayout { int bytes, d, dmin, scales, mins, codes, high; };
constexpr TileLayout kQ4KTile{2368, 0, 32, 64, 192, 320, -1};
constexpr TileLayout kQ6KTile{3360, 0, -1, 32, -1, 288, 288};
inline const TileLayout& tile_layout(int type) { return type == kQ4_K ? kQ4KTile : kQ6KTile; }
// Where the 64 bytes of step st of chunk pair j start: Q4_K's codes in order; Q6_K's in two
// runs of [high bits of pairs 2h, 2h+1 | low nibbles of 2h | of 2h+1] (h = j / 2), so a
// super-block is read front to back.
constexpr int code_at(int type, int j, int st) {
  return type == kQ4_K ? 320 + (j * 8 + st) * 64 : 288 + (j / 2) * 1536 + 512 + (j % 2) * 512 + st * 64;
}
constexpr int high_at(int j, int st) { return 288 + (j / 2) * 1536 + st * 64; }

// ---------------------------------------------------------------- 32-block tiles
// The 32-block types are kept in tiles of 16 rows as well; a tile's 32-blocks follow one
// another, each laid out as (r a row of the tile, st a step of 4 code bytes):
//   d fp16[16] | Q4_1: m fp16[16] | Q5_0: fifth bits u32[16 r]
//   | code bytes[st][16 r][4]: the row's code bytes 4st .. 4st+3
// (Q4_0, Q4_1, Q5_0: 4 steps, byte e holding value e in its low nibble and value e + 16 in its
// high; Q8_0: 8 steps of signed values): the file's bytes, 16 rows side by side, so one vector
// holds 4 code bytes (or the fifth bits) of each of 8 rows and its lanes are weight rows, as in
// the K-quant tiles.
constexpr int tile32_codes(int type) { return type == kQ4_1 ? 64 : type == kQ5_0 ? 96 : 32; }
constexpr int tile32_steps(int type) { return type == kQ8_0 ? 8 : 4; }
constexpr int file32_codes(int type) { return type == kQ4_1 ? 4 : type == kQ5_0 ? 6 : 2; }

// Row r's block as the file lays it (`bytes` bytes) -> its place in a tile block t.
void pack_tile32_row(int type, const uint8_t* file_block, int r, uint8_t* t) {
  std::memcpy(t + 2 * r, file_block, 2);
  if (type == kQ4_1) std::memcpy(t + 32 + 2 * r, file_block + 2, 2);
  if (type == kQ5_0) std::memcpy(t + 32 + 4 * r, file_block + 2, 4);
  const uint8_t* qs = file_block + file32_codes(type);
  for (int st = 0; st < tile32_steps(type); ++st) {
    std::memcpy(t + tile32_codes(type) + st * 64 + 4 * r, qs + 4 * st, 4);
  }
}

// The inverse: row r of tile block t -> its block as the file lays it.
void unpack_tile32_row(int type, const uint8_t* t, int r, uint8_t* file_block) {
  std::memcpy(file_block, t + 2 * r, 2);
  if (type == kQ4_1) std::memcpy(file_block + 2, t + 32 + 2 * r, 2);
  if (type == kQ5_0) std::memcpy(file_block + 2, t + 32 + 4 * r, 4);
  uint8_t* qs = file_block + file32_codes(type);
  for (int st = 0; st < tile32_steps(type); ++st) {
    std::memcpy(qs + 4 * st, t + tile32_codes(type) + st * 64 + 4 * r, 4);
  }
}

// One super-block of one weight row, in natural order.
struct RowSuper {
  uint8_t c[256];    // codes
  int s[16];         // Q4_K: scale per 32 (s[0..7]); Q6_K: per 16
  int m[8];          // Q4_K: min per 32
  uint16_t d, dmin;  // fp16 bits
};

void unpack_file_block(int type, const uint8_t* b, RowSuper* r) {
  std::memset(r, 0, sizeof(RowSuper));
  if (type == kQ4_K) {
    r->d = load_u16(b);
    r->dmin = load_u16(b + 2);
    uint8_t sc[8], m[8];
    q4k_scales_mins(b + 4, sc, m);
    for (int g = 0; g < 8; ++g) { r->s[g] = sc[g]; r->m[g] = m[g]; }
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        r->c[64 * j + l] = qs[32 * j + l] & 0xF;
        r->c[64 * j + 32 + l] = qs[32 * j + l] >> 4;
      }
    }
    return;
  }
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  r->d = load_u16(b + 208);
  for (int g = 0; g < 16; ++g) r->s[g] = sc[g];
  for (int h = 0; h < 2; ++h) {
    const uint8_t* l = ql + 64 * h;
    const uint8_t* hb = qh + 32 * h;
    uint8_t* c = r->c + 128 * h;
    for (int i = 0; i < 32; ++i) {
      c[i] = (l[i] & 0xF) | (((hb[i] >> 0) & 3) << 4);
      c[i + 32] = (l[i + 32] & 0xF) | (((hb[i] >> 2) & 3) << 4);
      c[i + 64] = (l[i] >> 4) | (((hb[i] >> 4) & 3) << 4);
      c[i + 96] = (l[i + 32] >> 4) | (((hb[i] >> 6) & 3) << 4);
    }
  }
}

void pack_tile_row(int type, const RowSuper& s, int r, uint8_t* t) {
  const TileLayout& L = tile_layout(type);
  std::memcpy(t + L.d + 2 * r, &s.d, 2);
  const int pairs = type == kQ4_K ? 4 : 8;
  for (int p = 0; p < pairs; ++p) {
    for (int q = 0; q < 2; ++q) {
      t[L.scales + (p * 16 + r) * 2 + q] = static_cast<uint8_t>(s.s[2 * p + q]);
      if (type == kQ4_K) t[L.mins + (p * 16 + r) * 2 + q] = static_cast<uint8_t>(s.m[2 * p + q]);
    }
  }
  if (type == kQ4_K) std::memcpy(t + L.dmin + 2 * r, &s.dmin, 2);
  for (int j = 0; j < 4; ++j) {
    for (int st = 0; st < 8; ++st) {
      for (int e = 0; e < 4; ++e) {
        const int a = s.c[64 * j + 4 * st + e], b = s.c[64 * j + 32 + 4 * st + e];
        t[code_at(type, j, st) + r * 4 + e] = static_cast<uint8_t>((a & 0xF) | ((b & 0xF) << 4));
        if (type == kQ6_K) {
          t[high_at(j, st) + r * 4 + e] |=
              static_cast<uint8_t>(((a >> 4) << (4 * (j % 2))) | ((b >> 4) << (4 * (j % 2) + 2)));
        }
      }
    }
  }
}

void unpack_tile_row(int type, const uint8_t* t, int r, RowSuper* s) {
  const TileLayout& L = tile_layout(type);
  std::memset(s, 0, sizeof(RowSuper));
  std::memcpy(&s->d, t + L.d + 2 * r, 2);
  const int pairs = type == kQ4_K ? 4 : 8;
  for (int p = 0; p < pairs; ++p) {
    for (int q = 0; q < 2; ++q) {
      const uint8_t v = t[L.scales + (p * 16 + r) * 2 + q];
      s->s[2 * p + q] = type == kQ4_K ? v : static_cast<int8_t>(v);
      if (type == kQ4_K) s->m[2 * p + q] = t[L.mins + (p * 16 + r) * 2 + q];
    }
  }
  if (type == kQ4_K) std::memcpy(&s->dmin, t + L.dmin + 2 * r, 2);
  for (int j = 0; j < 4; ++j) {
    for (int st = 0; st < 8; ++st) {
      for (int e = 0; e < 4; ++e) {
        const uint8_t v = t[code_at(type, j, st) + r * 4 + e];
        int a = v & 0xF, b = v >> 4;
        if (type == kQ6_K) {
          const uint8_t h = t[high_at(j, st) + r * 4 + e];
          a |= ((h >> (4 * (j % 2))) & 3) << 4;
          b |= ((h >> (4 * (j % 2) + 2)) & 3) << 4;
        }
        s->c[64 * j + 4 * st + e] = static_cast<uint8_t>(a);
        s->c[64 * j + 32 + 4 * st + e] = static_cast<uint8_t>(b);
      }
    }
  }
}

// One super-block of one (weight row, activation row) into acc: the header's sequence.
inline float tile_step(int type, const RowSuper& s, const int8_t* x, const int16_t* bsum,
                       float dx, float acc) {
  const float d = fp16_to_f32(s.d);
  int32_t sum = 0, low = 0;
  if (type == kQ4_K) {
    for (int ch = 0; ch < 8; ++ch) {
      int32_t t = 0;
      for (int e = 32 * ch; e < 32 * ch + 32; ++e) t += s.c[e] * x[e];
      sum += s.s[ch] * t;
      low += s.m[ch] * (bsum[2 * ch] + bsum[2 * ch + 1]);
    }
    acc = std::fma(static_cast<float>(sum), d * dx, acc);
    return std::fma(static_cast<float>(low), -(fp16_to_f32(s.dmin) * dx), acc);
  }
  for (int g = 0; g < 16; ++g) {
    int32_t t = 0;
    for (int e = 16 * g; e < 16 * g + 16; ++e) t += s.c[e] * x[e];
    sum += s.s[g] * t;
    low += s.s[g] * bsum[g];
  }
  return std::fma(static_cast<float>(sum - 32 * low), d * dx, acc);
}

// Activation rows a tile's codes are decoded for at a time (AVX-512 keeps their sums in 8 of
// its 32 registers; AVX2's 16 spill some of them, still cheaper than decoding twice).
constexpr int kTileGroup = 8;

constexpr long kTilePrefetch = 3360;  // how far ahead of the super-block in use a tile is fetched

inline int32_t load_i32(const void* p) { int32_t v; std::memcpy(&v, p, 4); return v; }
#if defined(__AVX2__)
// Part `part` of `parts` of the cache lines of the super-block of BYTES kTilePrefetch bytes
// ahead of t, fetched into cache.  A product fetches its next super-block a part at a time
// between its chunks' dot products: fetched all at once (37 or 53 lines), the fetches filled
// the core's outstanding-miss slots and stalled its products behind them, so memory and
// arithmetic took turns instead of overlapping.  Whole 1.5B passes on a 2-vCPU EPYC Zen 4,
// alternating with the one-burst library: the AVX-512 build 16-17 % cheaper at 1 row, 32-35 %
// at 3, 28-32 % at 5, 31-40 % at 8 (two runs); the AVX2 build on the same CPU 18-26 % at 2
// rows and 10-21 % at 5 (three and two runs), its 1 row kept as it was (below).  The same
// bits: only when a line is fetched moved.
template <int BYTES>
__attribute__((always_inline)) inline void fetch_ahead(const uint8_t* t, int part, int parts) {
  constexpr int kLines = (BYTES + 63) / 64;
  const int per = (kLines + parts - 1) / parts;
  const int end = (part + 1) * per < kLines ? (part + 1) * per : kLines;
  for (int line = part * per; line < end; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(t + kTilePrefetch + 64 * line), _MM_HINT_T0);
  }
}

// 4 bytes at p (four 8-bit values, or two 16-bit sums) in every 32-bit lane.
inline __m256i bcast4(const void* p) { return _mm256_set1_epi32(load_i32(p)); }
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// MC activation rows (m0 ..) times one tile (16 weight rows, nvalid of them real):
// y[m0 + r, n0 + i] for i < nvalid.  Lanes are the tile's weight rows.
template <int MC, bool Q6>
void tile_rows(const uint8_t* tile, long nblocks, const Q8Rows& xq, int m0, float* y, long ldy,
               long n0, int nvalid, bool fetch) {
  constexpr TileLayout L = Q6 ? kQ6KTile : kQ4KTile;
  const long K = xq.K, n16 = K / 16, n32 = K / 32;
  const int16_t* bs[MC];
  const int16_t* bs32[MC];
  __m512 acc[MC];
  for (int r = 0; r < MC; ++r) {
    bs[r] = xq.bsum.data() + (m0 + r) * n16;
    bs32[r] = xq.bsum32.data() + (m0 + r) * n32;
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  for (long b = 0; b < nblocks; ++b) {
    const uint8_t* t = tile + b * L.bytes;
    __m512i sum[MC], low[MC];
    for (int r = 0; r < MC; ++r) sum[r] = low[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      if (fetch) fetch_ahead<L.bytes>(t, j, 4);
      __m512i lo[8], hi[8];
      for (int st = 0; st < 8; ++st) {
        const __m512i q = _mm512_loadu_si512(t + code_at(Q6 ? kQ6_K : kQ4_K, j, st));
        lo[st] = _mm512_and_si512(q, m4);
        hi[st] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        if (Q6) {  // the top 2 bits (at bits 4(j % 2) and 4(j % 2) + 2) moved to bits 4-5
          const __m512i h = _mm512_loadu_si512(t + high_at(j, st));
          const __m512i ha = j % 2 ? h : _mm512_slli_epi16(h, 4);
          const __m512i hb = j % 2 ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);
          lo[st] = _mm512_ternarylogic_epi32(q, m4, _mm512_and_si512(ha, m30), 0xEA);  // (q & m4) | h
          hi[st] = _mm512_or_si512(hi[st], _mm512_and_si512(hb, m30));
        }
      }
      if (!Q6) {
        const __m512i sp = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L.scales + j * 32)));
        const __m512i sa = _mm512_and_si512(sp, low16), sb = _mm512_srli_epi32(sp, 16);
        for (int r = 0; r < MC; ++r) {
          const int8_t* xr = block_at(xq, m0 + r, b) + 64 * j;
          // four chains of four dots (each dot waits on the one before it in its chain)
          __m512i ta = _mm512_setzero_si512(), tb = ta, tc = ta, td = ta;
          for (int st = 0; st < 8; st += 2) {
            ta = _mm512_dpbusd_epi32(ta, lo[st], _mm512_set1_epi32(load_i32(xr + 4 * st)));
            tb = _mm512_dpbusd_epi32(tb, hi[st], _mm512_set1_epi32(load_i32(xr + 32 + 4 * st)));
            tc = _mm512_dpbusd_epi32(tc, lo[st + 1], _mm512_set1_epi32(load_i32(xr + 4 * st + 4)));
            td = _mm512_dpbusd_epi32(td, hi[st + 1], _mm512_set1_epi32(load_i32(xr + 36 + 4 * st)));
          }
          sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(
              _mm512_mullo_epi32(_mm512_add_epi32(ta, tc), sa),
              _mm512_mullo_epi32(_mm512_add_epi32(tb, td), sb)));
        }
      } else {
        const __m512i p0 = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L.scales + 2 * j * 32)));
        const __m512i p1 = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L.scales + (2 * j + 1) * 32)));
        const __m512i s0 = _mm512_srai_epi32(_mm512_slli_epi32(p0, 16), 16);
        const __m512i s1 = _mm512_srai_epi32(p0, 16);
        const __m512i s2 = _mm512_srai_epi32(_mm512_slli_epi32(p1, 16), 16);
        const __m512i s3 = _mm512_srai_epi32(p1, 16);
        for (int r = 0; r < MC; ++r) {
          const int8_t* xr = block_at(xq, m0 + r, b) + 64 * j;
          __m512i t0 = _mm512_setzero_si512(), t1 = t0, t2 = t0, t3 = t0;
          for (int st = 0; st < 4; ++st) {
            t0 = _mm512_dpbusd_epi32(t0, lo[st], _mm512_set1_epi32(load_i32(xr + 4 * st)));
            t1 = _mm512_dpbusd_epi32(t1, lo[st + 4], _mm512_set1_epi32(load_i32(xr + 16 + 4 * st)));
            t2 = _mm512_dpbusd_epi32(t2, hi[st], _mm512_set1_epi32(load_i32(xr + 32 + 4 * st)));
            t3 = _mm512_dpbusd_epi32(t3, hi[st + 4], _mm512_set1_epi32(load_i32(xr + 48 + 4 * st)));
          }
          const __m512i a = _mm512_add_epi32(_mm512_mullo_epi32(t0, s0), _mm512_mullo_epi32(t1, s1));
          const __m512i c = _mm512_add_epi32(_mm512_mullo_epi32(t2, s2), _mm512_mullo_epi32(t3, s3));
          sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(a, c));
          const int16_t* bj = bs[r] + b * 16 + 4 * j;
          low[r] = _mm512_dpwssd_epi32(low[r], _mm512_set1_epi32(load_i32(bj)), p0);
          low[r] = _mm512_dpwssd_epi32(low[r], _mm512_set1_epi32(load_i32(bj + 2)), p1);
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L.d)));
    const long dt = b * (xq.M + 8) + m0;
    if (Q6) {
      for (int r = 0; r < MC; ++r) {
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(xq.dt[dt + r]));
        const __m512i v = _mm512_sub_epi32(sum[r], _mm512_slli_epi32(low[r], 5));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), dd, acc[r]);
      }
    } else {
      const __m512 dmin = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L.dmin)));
      __m512i mp[4];
      for (int p = 0; p < 4; ++p) {
        mp[p] = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + L.mins + 32 * p)));
      }
      for (int r = 0; r < MC; ++r) {
        const __m512 dx = _mm512_set1_ps(xq.dt[dt + r]);
        __m512i lw = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {
          lw = _mm512_dpwssd_epi32(lw, _mm512_set1_epi32(load_i32(bs32[r] + b * 8 + 2 * p)), mp[p]);
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, dx), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(lw), _mm512_mul_ps(dmin, dx), acc[r]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << nvalid) - 1);
  for (int r = 0; r < MC; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, keep, acc[r]);
}
#elif defined(__AVX2__)
// As the AVX-512 tile_rows, 8 weight rows (half h of the tile) a vector; the u8 x s8 dots of
// 4 by maddubs (pairs in int16) summed in int16 over up to 8 steps (Q4_K) or 2 (Q6_K), then
// scaled into int32 by madd against (s, s) pairs.  With 16 vector registers the loop runs
// step by step: each step's code vector is decoded once and multiplied into all MC rows
// before the next, so the live registers are the rows' int16 sums, one or two code vectors
// and a broadcast; the rows' values of a super-block lie 256 bytes apart (Q8Rows), one base
// pointer for all of them.  A group of 2-7 rows (kPairHalves) takes both halves of a full
// tile in one pass, each broadcast multiplied into two code vectors (tile_chunk_pair).

// The 4 codes of step st of each of the 8 weight rows of half h, chunk (j, side): the low (side
// 0) or high (side 1) nibbles, and for Q6_K the top 2 bits of pair j (JODD = j % 2).
template <bool Q6, int SIDE, int JODD>
__attribute__((always_inline)) inline __m256i chunk_codes(const uint8_t* t, int j, int st, int h) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i q = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(t + code_at(Q6 ? kQ6_K : kQ4_K, j, st) + 32 * h));
  __m256i c = _mm256_and_si256(SIDE ? _mm256_srli_epi16(q, 4) : q, m4);
  if (Q6) {
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + high_at(j, st) + 32 * h));
    const __m256i hs = _mm256_srli_epi16(hb, 4 * JODD + 2 * SIDE);
    c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(hs, _mm256_set1_epi8(3)), 4));
  }
  return c;
}


// v as it is, in a register, here: the compiler may not re-associate a sum across it (it would
// otherwise turn a row's chain of 8 adds into a tree over all 8 products, live at once and
// spilled for several rows).
__attribute__((always_inline)) inline void settle(__m256i& v) { asm("" : "+x"(v)); }

// Half h's scales of chunk (j, SIDE), widened to int16: Q4_K's pair j (unsigned), Q6_K's pair
// of groups 2j + SIDE (signed); each weight row's two scales side by side.
template <bool Q6, int SIDE>
__attribute__((always_inline)) inline __m256i chunk_scales(const uint8_t* t, int j, int h) {
  constexpr TileLayout L = Q6 ? kQ6KTile : kQ4KTile;
  const __m128i v = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(t + L.scales + (Q6 ? 2 * j + SIDE : j) * 32 + 16 * h));
  return Q6 ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
}

// Each weight row's first (second = false) or second scale of its pair in sp, as the (s, s)
// int16 pairs that madd multiplies a row's maddubs sums by.
__attribute__((always_inline)) inline __m256i scale_pairs(__m256i sp, bool second) {
  const __m256i first_of = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i second_of = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                             2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
  return _mm256_shuffle_epi8(sp, second ? second_of : first_of);
}

// Chunk (j, side) of half h of super-block t into sum[r] (and Q6_K's low[r]) for MC rows
// whose values of this chunk start at x (row r at x + 256 r).
template <int MC, bool Q6, int SIDE, int JODD>
__attribute__((always_inline)) inline void tile_chunk(const uint8_t* t, int j, int h,
                                                      const int8_t* x, const int16_t* bsum,
                                                      long bsum_stride, __m256i* sum, __m256i* low) {
  const int p = 2 * j + SIDE;  // Q6_K: the pair of groups 2p, 2p+1 (this chunk)
  const __m256i sp = chunk_scales<Q6, SIDE>(t, j, h);
  if (!Q6) {  // 8 steps summed in int16 (8 maddubs pairs of 4-bit codes: < 32768)
    __m256i t16[MC];
    const __m256i c0 = chunk_codes<Q6, SIDE, JODD>(t, j, 0, h);
    for (int r = 0; r < MC; ++r) t16[r] = _mm256_maddubs_epi16(c0, bcast4(x + 256 * r));
    for (int st = 1; st < 8; ++st) {
      const __m256i c = chunk_codes<Q6, SIDE, JODD>(t, j, st, h);
      for (int r = 0; r < MC; ++r) {
        t16[r] = _mm256_add_epi16(t16[r], _mm256_maddubs_epi16(c, bcast4(x + 256 * r + 4 * st)));
        settle(t16[r]);
      }
    }
    const __m256i sv = scale_pairs(sp, SIDE);
    for (int r = 0; r < MC; ++r) sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(t16[r], sv));
    return;
  }
  for (int k = 0; k < 4; ++k) {  // steps 2k, 2k + 1 in int16 (2 maddubs pairs of 6-bit codes)
    const __m256i c0 = chunk_codes<Q6, SIDE, JODD>(t, j, 2 * k, h);
    const __m256i c1 = chunk_codes<Q6, SIDE, JODD>(t, j, 2 * k + 1, h);
    const __m256i sv = scale_pairs(sp, k >= 2);
    for (int r = 0; r < MC; ++r) {
      const int8_t* xr = x + 256 * r + 8 * k;
      const __m256i t16 = _mm256_add_epi16(_mm256_maddubs_epi16(c0, bcast4(xr)),
                                           _mm256_maddubs_epi16(c1, bcast4(xr + 4)));
      sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(t16, sv));
    }
  }
  for (int r = 0; r < MC; ++r) {
    low[r] = _mm256_add_epi32(low[r], _mm256_madd_epi16(bcast4(bsum + r * bsum_stride + 2 * p), sp));
  }
}

// tile_chunk for both halves of a full tile at once, into sum[h][r] (and low[h][r]): each
// broadcast of an activation row's 4 values is multiplied into both halves' code vectors, half
// the broadcasts of two tile_chunk calls (on AVX2 the broadcasts, more than the products, bound
// these loops at a few rows); the same integer sums as those two calls.
template <int MC, bool Q6, int SIDE, int JODD>
__attribute__((always_inline)) inline void tile_chunk_pair(const uint8_t* t, int j, const int8_t* x,
                                                           const int16_t* bsum, long bsum_stride,
                                                           __m256i (*sum)[MC], __m256i (*low)[MC]) {
  const int p = 2 * j + SIDE;  // Q6_K: the pair of groups 2p, 2p+1 (this chunk)
  const __m256i sp0 = chunk_scales<Q6, SIDE>(t, j, 0), sp1 = chunk_scales<Q6, SIDE>(t, j, 1);
  if (!Q6) {  // 8 steps summed in int16 (8 maddubs pairs of 4-bit codes: < 32768)
    __m256i a16[MC], b16[MC];
    {
      const __m256i ca = chunk_codes<Q6, SIDE, JODD>(t, j, 0, 0);
      const __m256i cb = chunk_codes<Q6, SIDE, JODD>(t, j, 0, 1);
      for (int r = 0; r < MC; ++r) {
        const __m256i xv = bcast4(x + 256 * r);
        a16[r] = _mm256_maddubs_epi16(ca, xv);
        b16[r] = _mm256_maddubs_epi16(cb, xv);
      }
    }
    for (int st = 1; st < 8; ++st) {
      const __m256i ca = chunk_codes<Q6, SIDE, JODD>(t, j, st, 0);
      const __m256i cb = chunk_codes<Q6, SIDE, JODD>(t, j, st, 1);
      for (int r = 0; r < MC; ++r) {
        const __m256i xv = bcast4(x + 256 * r + 4 * st);
        a16[r] = _mm256_add_epi16(a16[r], _mm256_maddubs_epi16(ca, xv));
        b16[r] = _mm256_add_epi16(b16[r], _mm256_maddubs_epi16(cb, xv));
        settle(a16[r]);
        settle(b16[r]);
      }
    }
    const __m256i sva = scale_pairs(sp0, SIDE), svb = scale_pairs(sp1, SIDE);
    for (int r = 0; r < MC; ++r) {
      sum[0][r] = _mm256_add_epi32(sum[0][r], _mm256_madd_epi16(a16[r], sva));
      sum[1][r] = _mm256_add_epi32(sum[1][r], _mm256_madd_epi16(b16[r], svb));
    }
    return;
  }
  for (int k = 0; k < 4; ++k) {  // steps 2k, 2k + 1 in int16 (2 maddubs pairs of 6-bit codes)
    const __m256i a0 = chunk_codes<Q6, SIDE, JODD>(t, j, 2 * k, 0);
    const __m256i a1 = chunk_codes<Q6, SIDE, JODD>(t, j, 2 * k + 1, 0);
    const __m256i b0 = chunk_codes<Q6, SIDE, JODD>(t, j, 2 * k, 1);
    const __m256i b1 = chunk_codes<Q6, SIDE, JODD>(t, j, 2 * k + 1, 1);
    const __m256i sva = scale_pairs(sp0, k >= 2), svb = scale_pairs(sp1, k >= 2);
    for (int r = 0; r < MC; ++r) {
      const int8_t* xr = x + 256 * r + 8 * k;
      const __m256i x0 = bcast4(xr), x1 = bcast4(xr + 4);
      const __m256i ta = _mm256_add_epi16(_mm256_maddubs_epi16(a0, x0), _mm256_maddubs_epi16(a1, x1));
      const __m256i tb = _mm256_add_epi16(_mm256_maddubs_epi16(b0, x0), _mm256_maddubs_epi16(b1, x1));
      sum[0][r] = _mm256_add_epi32(sum[0][r], _mm256_madd_epi16(ta, sva));
      sum[1][r] = _mm256_add_epi32(sum[1][r], _mm256_madd_epi16(tb, svb));
    }
  }
  for (int r = 0; r < MC; ++r) {
    const __m256i bl = bcast4(bsum + r * bsum_stride + 2 * p);
    low[0][r] = _mm256_add_epi32(low[0][r], _mm256_madd_epi16(bl, sp0));
    low[1][r] = _mm256_add_epi32(low[1][r], _mm256_madd_epi16(bl, sp1));
  }
}

// Whether a group of MC rows takes both halves of a full tile per broadcast
// (tile_chunk_pair): where whole 1.5B passes measured faster, alternating with the
// half-at-a-time loop on a 2-vCPU Zen 3 (3-7 rows 8-20 % faster); not Q4_K's 3 rows nor
// Q6_K's 1 (slower alone, no faster in a pass), nor a group of 8 (its 16 int16 sums spill).
template <int MC, bool Q6>
constexpr bool kPairHalves = Q6 ? MC >= 2 && MC <= 7 : MC == 2 || (MC >= 4 && MC <= 7);

template <int MC, bool Q6>
void tile_rows(const uint8_t* tile, long nblocks, const Q8Rows& xq, int m0, float* y, long ldy,
               long n0, int nvalid, bool fetch) {
  constexpr TileLayout L = Q6 ? kQ6KTile : kQ4KTile;
  const long n16 = xq.K / 16, n32 = xq.K / 32;
  const int halves = nvalid > 8 ? 2 : 1;
  __m256 acc[2][MC];
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < MC; ++r) acc[h][r] = _mm256_setzero_ps();
  }
  for (long b = 0; b < nblocks; ++b) {
    const uint8_t* t = tile + b * L.bytes;
    const int8_t* xb = block_at(xq, m0, b);  // row m0 + r's values of this super-block: xb + 256 r
    const int16_t* bsum = xq.bsum.data() + m0 * n16 + b * 16;
    const long dt = b * (xq.M + 8) + m0;
    // the float steps of half h's sums into acc[h] (the header's sequence)
    auto finish = [&](int h, const __m256i* sum, const __m256i* low) __attribute__((always_inline)) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + L.d + 16 * h)));
      if (Q6) {
        for (int r = 0; r < MC; ++r) {
          const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(xq.dt[dt + r]));
          const __m256i v = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(low[r], 5));
          acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), dd, acc[h][r]);
        }
      } else {
        const __m256 dmin = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + L.dmin + 16 * h)));
        __m256i mp[4];
        for (int p = 0; p < 4; ++p) {
          mp[p] = _mm256_cvtepu8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + L.mins + 32 * p + 16 * h)));
        }
        for (int r = 0; r < MC; ++r) {
          const __m256 dx = _mm256_set1_ps(xq.dt[dt + r]);
          const int16_t* b32 = xq.bsum32.data() + (m0 + r) * n32 + b * 8;
          __m256i lw = _mm256_setzero_si256();
          for (int p = 0; p < 4; ++p) lw = _mm256_add_epi32(lw, _mm256_madd_epi16(bcast4(b32 + 2 * p), mp[p]));
          acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, dx), acc[h][r]);
          acc[h][r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(lw), _mm256_mul_ps(dmin, dx), acc[h][r]);
        }
      }
    };
    if constexpr (kPairHalves<MC, Q6>) {
      if (halves == 2) {  // weight rows 0 .. 15, both halves per broadcast
        __m256i sum[2][MC], low[2][MC];
        for (int h = 0; h < 2; ++h) {
          for (int r = 0; r < MC; ++r) sum[h][r] = low[h][r] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 4; j += 2) {
          if (fetch) fetch_ahead<L.bytes>(t, j, 4);
          tile_chunk_pair<MC, Q6, 0, 0>(t, j, xb + 64 * j, bsum, n16, sum, low);
          tile_chunk_pair<MC, Q6, 1, 0>(t, j, xb + 64 * j + 32, bsum, n16, sum, low);
          if (fetch) fetch_ahead<L.bytes>(t, j + 1, 4);
          tile_chunk_pair<MC, Q6, 0, 1>(t, j + 1, xb + 64 * j + 64, bsum, n16, sum, low);
          tile_chunk_pair<MC, Q6, 1, 1>(t, j + 1, xb + 64 * j + 96, bsum, n16, sum, low);
        }
        finish(0, sum[0], low[0]);
        finish(1, sum[1], low[1]);
        continue;
      }
    }
    for (int h = 0; h < halves; ++h) {  // weight rows 8h .. 8h + 7
      __m256i sum[MC], low[MC];
      for (int r = 0; r < MC; ++r) sum[r] = low[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; j += 2) {
        // one row (decoding) fetches the whole block as one part, at the first chunk, as
        // before: spread fetches measured 36 % and 9 % dearer and 4 % cheaper in three runs
        // there, within this VM's noise (this same code ran 14 % dearer than the old library
        // in one run), so it stays
        const int parts = MC == 1 ? 1 : 2 * halves, part = 2 * h + j / 2;
        if (fetch && part < parts) fetch_ahead<L.bytes>(t, part, parts);
        tile_chunk<MC, Q6, 0, 0>(t, j, h, xb + 64 * j, bsum, n16, sum, low);
        tile_chunk<MC, Q6, 1, 0>(t, j, h, xb + 64 * j + 32, bsum, n16, sum, low);
        tile_chunk<MC, Q6, 0, 1>(t, j + 1, h, xb + 64 * j + 64, bsum, n16, sum, low);
        tile_chunk<MC, Q6, 1, 1>(t, j + 1, h, xb + 64 * j + 96, bsum, n16, sum, low);
      }
      finish(h, sum, low);
    }
  }
  for (int h = 0; h < halves; ++h) {
    const int here = nvalid - 8 * h < 8 ? nvalid - 8 * h : 8;
    for (int r = 0; r < MC; ++r) {
      float* out = y + (m0 + r) * ldy + n0 + 8 * h;
      if (here == 8) {
        _mm256_storeu_ps(out, acc[h][r]);
      } else {
        alignas(32) float v[8];
        _mm256_store_ps(v, acc[h][r]);
        for (int i = 0; i < here; ++i) out[i] = v[i];
      }
    }
  }
}
#endif

#if defined(__AVX2__)
// tile_rows<MC, Q6> by (Q6, MC - 1): a group of MC rows runs the instance that keeps MC rows.
using TileRowsFn = void (*)(const uint8_t*, long, const Q8Rows&, int, float*, long, long, int, bool);
template <bool Q6, int... I>
constexpr std::array<TileRowsFn, sizeof...(I)> tile_rows_table(std::integer_sequence<int, I...>) {
  return {{&tile_rows<I + 1, Q6>...}};
}
constexpr std::array<TileRowsFn, kTileGroup> kTileRowsFns[2] = {
    tile_rows_table<false>(std::make_integer_sequence<int, kTileGroup>()),
    tile_rows_table<true>(std::make_integer_sequence<int, kTileGroup>())};
#endif

// Tile tt of a K-quant matrix (N rows) for activation rows [m0, m0 + mc); fetch: these are
// the first rows of a span to meet this tile (its bytes still in memory: fetched ahead).
void tile_outputs(int type, const uint8_t* w, long tile_bytes, const Q8Rows& xq, int m0, int mc,
                  float* y, long ldy, long tt, long N, bool fetch) {
  const long nblocks = xq.K / 256;
  const long n0 = tt * kTileRows;
  const int nvalid = N - n0 < kTileRows ? static_cast<int>(N - n0) : kTileRows;
  const uint8_t* tile = w + tt * tile_bytes;
#if defined(__AVX2__)
  const auto& fns = kTileRowsFns[type == kQ6_K];
  for (int g = 0; g < mc; g += kTileGroup) {  // the tile's next super-block fetched by the first
    const int rows = mc - g < kTileGroup ? mc - g : kTileGroup;
    fns[rows - 1](tile, nblocks, xq, m0 + g, y, ldy, n0, nvalid, fetch && g == 0);
  }
#else  // portable: each tile row's super-block unpacked once, then multiplied into every row
  (void)fetch;
  const TileLayout& L = tile_layout(type);
  const long K = xq.K, n16 = K / 16;
  RowSuper s;
  float acc[kRowsChunk];
  for (int i = 0; i < nvalid; ++i) {
    for (int r = 0; r < mc; ++r) acc[r] = 0.0f;
    for (long b = 0; b < nblocks; ++b) {
      unpack_tile_row(type, tile + b * L.bytes, i, &s);
      for (int r = 0; r < mc; ++r) {
        const int m = m0 + r;
        acc[r] = tile_step(type, s, block_at(xq, m, b), xq.bsum.data() + m * n16 + b * 16,
                           xq.dt[b * (xq.M + 8) + m], acc[r]);
      }
    }
    for (int r = 0; r < mc; ++r) y[(m0 + r) * ldy + n0 + i] = acc[r];
  }
#endif
}

#if defined(__AVX2__)
// Rows [m0, m0 + mc) times one 32-block tile (16 weight rows, nvalid of them real), 8 weight
// rows (half h) a vector: per activation row, half and block, the vector's lanes (weight
// rows) hold the block's integer sums S, then the header's float steps into an accumulator
// and an offset; each weight row's float sequence is block32_row's, finish included.  A
// tile's bytes are read once per activation row and half (from cache after the first).
constexpr int tile32_bytes(int type) {  // a row's block in the file (and in a tile)
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ5_0 ? 22 : 34;
}

// Step st of half h of a Q4_0 / Q4_1 / Q5_0 tile block t: the codes of lane st (the low
// nibbles) and of lane st + 4 (the high ones) of 8 weight rows; Q5_0's fifth bits (qh, the
// half's 32 bytes of them) added as 0x10 (values 4st + e and 16 + 4st + e: bits 4st + e and
// 16 + 4st + e).
template <int TYPE>
__attribute__((always_inline)) inline void nibble_codes(const uint8_t* t, int st, int h,
                                                        __m256i qh, __m256i* lo, __m256i* hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(t + tile32_codes(TYPE) + st * 64 + 32 * h));
  *lo = _mm256_and_si256(v, m4);
  *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  if (TYPE == kQ5_0) {  // byte e of a row's 4 takes bit e of the byte broadcast to them
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const __m256i bit = _mm256_set1_epi32(0x08040201), fifth = _mm256_set1_epi8(0x10);
    const __m256i bl = _mm256_and_si256(
        _mm256_shuffle_epi8(_mm256_srli_epi32(qh, 4 * st), spread), bit);
    const __m256i bh = _mm256_and_si256(
        _mm256_shuffle_epi8(_mm256_srli_epi32(qh, 16 + 4 * st), spread), bit);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(bl, bit), fifth));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(bh, bit), fifth));
  }
}

// A block's sums S for 8 weight rows against one activation row's block xb, from its codes
// (lo[st], hi[st]: step st's low and high nibbles).  maddubs' pairs are summed in int16 while
// they cannot overflow it (codes below 16: all 8 pairs of a lane, |sum| <= 8 * 2 * 15 * 127
// < 32768; Q5_0's codes below 32: 4 of them), then widened by madd.
template <int TYPE>
__attribute__((always_inline)) inline __m256i nibble_sums(const __m256i* lo, const __m256i* hi,
                                                          const int8_t* xb) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[2];
  for (int st = 0; st < 4; ++st) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[st], bcast4(xb + 4 * st)),
                                       _mm256_maddubs_epi16(hi[st], bcast4(xb + 16 + 4 * st)));
    const int g = TYPE == kQ5_0 ? st / 2 : 0;
    s16[g] = st == 0 || (TYPE == kQ5_0 && st == 2) ? p : _mm256_add_epi16(s16[g], p);
  }
  const __m256i s = _mm256_madd_epi16(s16[0], ones);
  return TYPE == kQ5_0 ? _mm256_add_epi32(s, _mm256_madd_epi16(s16[1], ones)) : s;
}

// The `here` outputs of 8 weight rows at out: acc + off.
inline void store_rows(__m256 acc, __m256 off, float* out, int here) {
  alignas(32) float v[8];
  _mm256_store_ps(v, _mm256_add_ps(acc, off));
  for (int i = 0; i < here; ++i) out[i] = v[i];
}

template <int TYPE>
void tile32_rows(const uint8_t* tile, long nblocks, const Q8Rows& xq, int m0, int mc, float* y,
                 long ldy, long n0, int nvalid) {
  constexpr int kBytes = tile32_bytes(TYPE);
  constexpr int kCodes = tile32_codes(TYPE);
  const long nd = xq.K / 32, n16 = xq.K / 16;
  const __m256i ones = _mm256_set1_epi16(1);
  const int halves = nvalid > 8 ? 2 : 1;
  for (int r = 0; r < mc; ++r) {
    const int m = m0 + r;
    const int8_t* x = block_at(xq, m, 0);  // 32-blocks lie [M, K]: block b at x + 32 b
    for (int h = 0; h < halves; ++h) {
      __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
      for (long b = 0; b < nblocks; ++b) {
        const uint8_t* t = tile + b * (16 * kBytes);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
        const __m256 dx = _mm256_set1_ps(xq.d[m * nd + b]);
        const __m256 dd = _mm256_mul_ps(d, dx);
        const __m256 a = TYPE == kQ4_0 ? _mm256_mul_ps(_mm256_set1_ps(-8.0f), d)
                       : TYPE == kQ5_0 ? _mm256_mul_ps(_mm256_set1_ps(-16.0f), d)
                       : TYPE == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                             reinterpret_cast<const __m128i*>(t + 32 + 16 * h)))
                                       : _mm256_setzero_ps();
        const int16_t* bs = xq.bsum.data() + m * n16 + 2 * b;
        const int8_t* xb = x + 32 * b;
        __m256i sum;
        if (TYPE == kQ8_0) {  // |c| as unsigned, x carrying c's sign (block32_row's products)
          sum = _mm256_setzero_si256();
          for (int st = 0; st < 8; ++st) {
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kCodes + st * 64 + 32 * h));
            const __m256i xs = _mm256_sign_epi8(bcast4(xb + 4 * st), c);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c, c), xs), ones));
          }
        } else {
          __m256i qh = _mm256_setzero_si256();
          if (TYPE == kQ5_0) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 + 32 * h));
          __m256i lo[4], hi[4];
          for (int st = 0; st < 4; ++st) nibble_codes<TYPE>(t, st, h, qh, &lo[st], &hi[st]);
          sum = nibble_sums<TYPE>(lo, hi, xb);
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, acc);
        off = _mm256_fmadd_ps(_mm256_mul_ps(a, dx), _mm256_set1_ps(static_cast<float>(bs[0] + bs[1])), off);
      }
      store_rows(acc, off, y + m * ldy + n0 + 8 * h, nvalid - 8 * h < 8 ? nvalid - 8 * h : 8);
    }
  }
}

// tile32_rows for several activation rows of Q5_0, whose codes take the most decoding (the
// fifth bits spread to their bytes): each block's codes are decoded once (8 code vectors)
// and multiplied into every row, whose accumulators stay in memory between blocks.  Each
// (weight row, activation row)'s float sequence is tile32_rows' (the same operations in the
// same order); only the decoding is shared.  The 0.5B's passes over 300 positions,
// alternating with one-row-at-a-time on one model (the same logits, two runs): 3 rows 6-14 %,
// 5 rows 16-17 %, 8 rows 19-21 % cheaper; 1 and 2 rows level.  Q4_0 and Q4_1, whose nibbles
// take two instructions, gained nothing from it (SmolLM2's Q4_1: 2 rows 25.0 -> 27.5 ms), so
// they keep tile32_rows.
constexpr int kQ5GroupFrom = 3;  // activation rows from which Q5_0 tiles take this path

void tile32_rows_q5_group(const uint8_t* tile, long nblocks, const Q8Rows& xq, int m0, int mc,
                          float* y, long ldy, long n0, int nvalid) {
  constexpr int kBytes = tile32_bytes(kQ5_0);
  const long nd = xq.K / 32, n16 = xq.K / 16;
  const int halves = nvalid > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    __m256 acc[kRowsChunk], off[kRowsChunk];
    for (int r = 0; r < mc; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    for (long b = 0; b < nblocks; ++b) {
      const uint8_t* t = tile + b * (16 * kBytes);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
      const __m256 a = _mm256_mul_ps(_mm256_set1_ps(-16.0f), d);
      __m256i lo[4], hi[4];
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 + 32 * h));
      for (int st = 0; st < 4; ++st) nibble_codes<kQ5_0>(t, st, h, qh, &lo[st], &hi[st]);
      for (int r = 0; r < mc; ++r) {
        const int m = m0 + r;
        const __m256 dx = _mm256_set1_ps(xq.d[m * nd + b]);
        const __m256 dd = _mm256_mul_ps(d, dx);
        const int16_t* bs = xq.bsum.data() + m * n16 + 2 * b;
        const __m256i sum = nibble_sums<kQ5_0>(lo, hi, block_at(xq, m, 0) + 32 * b);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, acc[r]);
        off[r] = _mm256_fmadd_ps(_mm256_mul_ps(a, dx), _mm256_set1_ps(static_cast<float>(bs[0] + bs[1])), off[r]);
      }
    }
    const int here = nvalid - 8 * h < 8 ? nvalid - 8 * h : 8;
    for (int r = 0; r < mc; ++r) store_rows(acc[r], off[r], y + (m0 + r) * ldy + n0 + 8 * h, here);
  }
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// AVX-512: a Q4_0, Q4_1 or Q8_0 tile's 16 weight rows in one vector, G activation rows at a
// time, each block's codes decoded once for the G rows: S by VNNI's dot of 4 (u8 x s8, no
// int16 step), then tile32_rows' float steps (the same bits).  Q8_0's signed codes go in as
// c + 128 and S = sum (c + 128) x - 128 sum x (sum x = bsum[0] + bsum[1]), exact in int32.
template <int TYPE, int G>
void tile32_rows_512(const uint8_t* tile, long nblocks, const Q8Rows& xq, int m0, float* y,
                     long ldy, long n0, int nvalid) {
  constexpr int kBytes = tile32_bytes(TYPE);
  constexpr int kCodes = tile32_codes(TYPE);
  const long nd = xq.K / 32, n16 = xq.K / 16;
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[G], off[G];
  for (int r = 0; r < G; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (long b = 0; b < nblocks; ++b) {
    const uint8_t* t = tile + b * (16 * kBytes);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 a = TYPE == kQ4_0 ? _mm512_mul_ps(_mm512_set1_ps(-8.0f), d)
                   : TYPE == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(t + 32)))
                                   : _mm512_setzero_ps();
    __m512i c[8];  // Q4_0 / Q4_1: step st's low nibbles in c[st], high in c[st + 4]; Q8_0: c + 128
    for (int st = 0; st < (TYPE == kQ8_0 ? 8 : 4); ++st) {
      const __m512i v = _mm512_loadu_si512(t + kCodes + st * 64);
      if (TYPE == kQ8_0) {
        c[st] = _mm512_xor_si512(v, flip);
      } else {
        c[st] = _mm512_and_si512(v, m4);
        c[st + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
    }
    for (int r = 0; r < G; ++r) {
      const int m = m0 + r;
      const int8_t* xb = block_at(xq, m, 0) + 32 * b;
      const int16_t* bs = xq.bsum.data() + m * n16 + 2 * b;
      __m512i sum = _mm512_setzero_si512();
      if (TYPE == kQ8_0) {
        for (int st = 0; st < 8; ++st) {
          sum = _mm512_dpbusd_epi32(sum, c[st], _mm512_set1_epi32(load_i32(xb + 4 * st)));
        }
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * (bs[0] + bs[1])));
      } else {
        for (int st = 0; st < 4; ++st) {
          sum = _mm512_dpbusd_epi32(sum, c[st], _mm512_set1_epi32(load_i32(xb + 4 * st)));
          sum = _mm512_dpbusd_epi32(sum, c[st + 4], _mm512_set1_epi32(load_i32(xb + 16 + 4 * st)));
        }
      }
      const __m512 dx = _mm512_set1_ps(xq.d[m * nd + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), acc[r]);
      off[r] = _mm512_fmadd_ps(_mm512_mul_ps(a, dx), _mm512_set1_ps(static_cast<float>(bs[0] + bs[1])), off[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << nvalid) - 1);
  for (int r = 0; r < G; ++r) {
    _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, keep, _mm512_add_ps(acc[r], off[r]));
  }
}

// Rows [m0, m0 + mc) of a Q4_0, Q4_1 or Q8_0 tile, 4 at a time.
template <int TYPE>
void tile32_rows_512_groups(const uint8_t* tile, long nblocks, const Q8Rows& xq, int m0, int mc,
                            float* y, long ldy, long n0, int nvalid) {
  int r = 0;
  for (; r + 4 <= mc; r += 4) tile32_rows_512<TYPE, 4>(tile, nblocks, xq, m0 + r, y, ldy, n0, nvalid);
  switch (mc - r) {
    case 3: tile32_rows_512<TYPE, 3>(tile, nblocks, xq, m0 + r, y, ldy, n0, nvalid); break;
    case 2: tile32_rows_512<TYPE, 2>(tile, nblocks, xq, m0 + r, y, ldy, n0, nvalid); break;
    case 1: tile32_rows_512<TYPE, 1>(tile, nblocks, xq, m0 + r, y, ldy, n0, nvalid); break;
    default: break;
  }
}
#endif

// Tile tt of a tiled 32-block matrix (N rows, tile_bytes a tile) for rows [m0, m0 + mc).
void tile32_outputs(int type, const TypeInfo& info, const uint8_t* w, long tile_bytes,
                    const Q8Rows& xq, int m0, int mc, float* y, long ldy, long tt, long N) {
  const long nblocks = xq.K / 32;
  const long n0 = tt * kTileRows;
  const int nvalid = N - n0 < kTileRows ? static_cast<int>(N - n0) : kTileRows;
  const uint8_t* tile = w + tt * tile_bytes;
#if defined(__AVX2__)
  (void)info;
  switch (type) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    case kQ4_0: tile32_rows_512_groups<kQ4_0>(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid); break;
    case kQ4_1: tile32_rows_512_groups<kQ4_1>(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid); break;
    case kQ8_0: tile32_rows_512_groups<kQ8_0>(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid); break;
#else
    case kQ4_0: tile32_rows<kQ4_0>(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid); break;
    case kQ4_1: tile32_rows<kQ4_1>(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid); break;
    case kQ8_0: tile32_rows<kQ8_0>(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid); break;
#endif
    case kQ5_0:
      if (mc >= kQ5GroupFrom) {
        tile32_rows_q5_group(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid);
      } else {
        tile32_rows<kQ5_0>(tile, nblocks, xq, m0, mc, y, ldy, n0, nvalid);
      }
      break;
    default: break;
  }
#else  // portable: each tile row's block back in the file's layout, decoded once, then every row
  const long n16 = xq.K / 16;
  const long block_bytes = 16L * info.bytes;
  uint8_t file_block[34];
  Block32 blk;
  Acc acc[kRowsChunk];
  for (int i = 0; i < nvalid; ++i) {
    for (int r = 0; r < mc; ++r) acc[r] = Acc{0.0f, 0.0f};
    for (long b = 0; b < nblocks; ++b) {
      unpack_tile32_row(type, tile + b * block_bytes, i, file_block);
      decode_block32(type, file_block, &blk);
      for (int r = 0; r < mc; ++r) {
        const int m = m0 + r;
        block32_row(blk, info.is_signed, block_at(xq, m, b), xq.bsum.data() + m * n16 + b * 2,
                    xq.d[m * nblocks + b], &acc[r]);
      }
    }
    for (int r = 0; r < mc; ++r) y[(m0 + r) * ldy + n0 + i] = finish(acc[r]);
  }
#endif
}

// The calling thread's activation buffers, reused from call to call (no allocation per
// product).  Out of line, and passed to the parallel regions as a pointer: a thread_local
// named inside a region would be each worker's own.
__attribute__((noinline)) Q8Rows* thread_buffers(int which) {
  static thread_local Q8Rows buffers[2];  // 256-blocks (K-quants), 32-blocks
  return &buffers[which];
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

// Bytes a row of K values of `type` takes in the file, or -1 for a type this kernel does not
// know or a K that is not a whole number of its blocks.
long quant_row_bytes(int type, long K) {
  TypeInfo info;
  if (!type_info(type, &info) || K <= 0 || K % info.block) return -1;
  return K / info.block * info.bytes;
}

// Bytes a tile of 16 rows of K values takes for `type` (every type here is tiled), -1 for an
// unknown type or a bad K.
long quant_tile_bytes(int type, long K) {
  TypeInfo info;
  if (!type_info(type, &info) || K <= 0 || K % info.block) return -1;
  if (info.k_quant) return K / 256 * tile_layout(type).bytes;
  return K / 32 * kTileRows * info.bytes;
}

// A tiled type's matrix of N rows as the file lays them (`w`, rows of quant_row_bytes) -> its
// ceil(N / 16) tiles into `out` (quant_tile_bytes each; rows past N zero).  0, or -1.
int quant_repack(int type, const uint8_t* w, long N, long K, uint8_t* out, int threads) {
  const long tile_bytes = quant_tile_bytes(type, K);
  if (tile_bytes <= 0 || N <= 0) return -1;
  const long row_bytes = quant_row_bytes(type, K);
  const long tiles = (N + kTileRows - 1) / kTileRows;
  TypeInfo info;
  type_info(type, &info);
  const long nblocks = K / info.block;
  const long block_bytes = info.k_quant ? tile_layout(type).bytes : kTileRows * info.bytes;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long tt = 0; tt < tiles; ++tt) {
    uint8_t* tile = out + tt * tile_bytes;
    std::memset(tile, 0, tile_bytes);
    RowSuper s;
    for (int r = 0; r < kTileRows && tt * kTileRows + r < N; ++r) {
      const uint8_t* row = w + (tt * kTileRows + r) * row_bytes;
      for (long b = 0; b < nblocks; ++b) {
        if (info.k_quant) {
          unpack_file_block(type, row + b * info.bytes, &s);
          pack_tile_row(type, s, r, tile + b * block_bytes);
        } else {
          pack_tile32_row(type, row + b * info.bytes, r, tile + b * block_bytes);
        }
      }
    }
  }
  return 0;
}

// y[m, col_p + n] = sum_k x[m, k] W_p[n, k] for m < M and each part p's rows n < rows[p]
// (col_p = the rows of the parts before p): a matrix stacked from parts (a fused q/k/v or
// gate/up), x [M, K] float32 row-major, y with row stride ldy; part p in types[p], as its
// tiles (quant_repack).  The activations are quantized once per block size, and all the parts'
// outputs are shared out over the threads in one parallel region (a tile of 16 rows a unit).
// Rows go in spans that fit a core's cache (rows_in_cache): per span, a thread takes every
// row of it through its tile, kRowsChunk rows at a time, before the next tile, so the weights
// stream from memory once per span, not once per chunk of rows (the 1.5B's 64-row passes
// 7-12 % cheaper than chunks outermost; at 1024 rows level; the same bits).
// Returns 0, or -1 for a bad type or shape.
int quant_rows_linear_parts(int parts, const int* types, const uint8_t* const* blocks,
                            const long* rows, int M, const float* x, long K, float* y, long ldy,
                            int threads) {
  constexpr int kMaxParts = 8;
  if (parts <= 0 || parts > kMaxParts || M <= 0 || K <= 0) return -1;
  TypeInfo info[kMaxParts];
  long col[kMaxParts], first[kMaxParts + 1], bytes[kMaxParts];
  double work_a_row = 0.0;  // an activation row's work, in units of what pays a thread region
  bool need256 = false, need32 = false;
  first[0] = 0;
  for (int p = 0; p < parts; ++p) {
    if (!type_info(types[p], &info[p]) || K % info[p].block || rows[p] <= 0) return -1;
    col[p] = p ? col[p - 1] + rows[p - 1] : 0;
    const bool kq = info[p].k_quant;
    bytes[p] = quant_tile_bytes(types[p], K);
    first[p + 1] = first[p] + (rows[p] + kTileRows - 1) / kTileRows;
    work_a_row += static_cast<double>(rows[p]) * K / static_cast<double>(kq ? kParallelWork : kParallelWork32);
    (kq ? need256 : need32) = true;
  }
  Q8Rows* const x256 = need256 ? thread_buffers(0) : nullptr;
  Q8Rows* const x32 = need32 ? thread_buffers(1) : nullptr;
  if (x256) quantize_rows(x, M, K, 256, threads, x256);
  if (x32) quantize_rows(x, M, K, 32, threads, x32);
  const long units = first[parts];
  const int span = rows_in_cache(K);
  for (int b0 = 0; b0 < M; b0 += span) {
    const int b1 = M - b0 < span ? M : b0 + span;
#pragma omp parallel for schedule(static) num_threads(threads) if ((b1 - b0) * work_a_row >= 1.0)
    for (long u = 0; u < units; ++u) {
      int p = 0;
      while (u >= first[p + 1]) ++p;
      const long local = u - first[p];
      for (int m0 = b0; m0 < b1; m0 += kRowsChunk) {
        const int mc = b1 - m0 < kRowsChunk ? b1 - m0 : kRowsChunk;
        if (info[p].k_quant) {
          tile_outputs(types[p], blocks[p], bytes[p], *x256, m0, mc, y + col[p], ldy, local,
                       rows[p], m0 == b0);
        } else {
          tile32_outputs(types[p], info[p], blocks[p], bytes[p], *x32, m0, mc, y + col[p], ldy,
                         local, rows[p]);
        }
      }
    }
  }
  return 0;
}

// One part: y[m, n] = sum_k x[m, k] W[n, k] (quant_rows_linear_parts).
int quant_rows_linear(int type, int M, const float* x, long K, const uint8_t* w, long N,
                      float* y, long ldy, int threads) {
  return quant_rows_linear_parts(1, &type, &w, &N, M, x, K, y, ldy, threads);
}

// out[r, :] = the float32 values of rows ids[r] of W (an embedding lookup), R rows; W as
// quant_rows_linear takes it (its tiles).
int quant_dequantize_rows(int type, const uint8_t* w, long K, const long* ids, long R,
                          float* out) {
  TypeInfo info;
  if (!type_info(type, &info) || K <= 0 || K % info.block) return -1;
  const long tile_bytes = quant_tile_bytes(type, K);
  for (long r = 0; r < R; ++r) {
    float* o = out + r * K;
    const uint8_t* tile = w + ids[r] / kTileRows * tile_bytes;
    if (info.k_quant) {  // as ggml dequantizes: Q4_K (d s) c - dmin m, Q6_K (d s) (c - 32)
      const TileLayout& L = tile_layout(type);
      RowSuper s;
      for (long b = 0; b < K / 256; ++b) {
        unpack_tile_row(type, tile + b * L.bytes, static_cast<int>(ids[r] % kTileRows), &s);
        const float d = fp16_to_f32(s.d), dmin = fp16_to_f32(s.dmin);
        for (int e = 0; e < 256; ++e) {
          o[b * 256 + e] = type == kQ6_K
              ? d * static_cast<float>(s.s[e / 16]) * static_cast<float>(s.c[e] - 32)
              : d * static_cast<float>(s.s[e / 32]) * static_cast<float>(s.c[e]) -
                    dmin * static_cast<float>(s.m[e / 32]);
        }
      }
      continue;
    }
    // a 32-block type's row: each block back in the file's layout first
    uint8_t file_block[34];
    for (long b = 0; b < K / 32; ++b) {
      Block32 blk;
      unpack_tile32_row(type, tile + b * kTileRows * info.bytes,
                        static_cast<int>(ids[r] % kTileRows), file_block);
      decode_block32(type, file_block, &blk);
      for (int e = 0; e < 32; ++e) {
        const float c = info.is_signed ? static_cast<int8_t>(blk.c[e]) : blk.c[e];
        o[b * 32 + e] = blk.d * c + blk.a;
      }
    }
  }
  return 0;
}

}  // extern "C"
