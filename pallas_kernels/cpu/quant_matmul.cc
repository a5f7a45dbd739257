// Quantized matmul for the CPU, called from JAX through the XLA FFI: out f32[T, O] =
// x f32[T, I] @ dequant(w).T, where w is output-major ([O, I], torch's and GGUF's layout) and
// dequant(w)[o, i] = float(q[o, i]) * scale[o, g] + offset[o, g] with g = i / group_size.
// The layout contract (bits, nibble order) is `jaxllm.quantization`'s; see there.
//   format 0 (int8): q int8 [O, I];
//   format 1 (int4): q uint8 [O, I / 2], values 0..15 in blocks of 32 along I: byte j of a
//           block holds element j in its low nibble and element j + 16 in its high nibble
//           (GGUF's Q4_0 order, so 16 loaded bytes unpack into two runs of 16, no shuffle);
//   format 2 (fp8): q float8_e4m3fn [O, I], read through a 256-entry table (CPUs have no
//           fp8 arithmetic; the table makes it as cheap as int8).
//   scale, offset: [O, G], both float32 or both float16; offset may be absent (has_offset =
//           false: a [1, 1] dummy of scale's type).
//
// Why a kernel of our own: XLA's CPU backend does not fuse a dequantization into a dot; it
// writes the whole float32 weight to memory first and reads it back, so an int8 GEMV ran 12x
// slower than the float32 one it should beat (80M weights, 2-core AMD EPYC: 131 ms vs 11 ms).
// Here each weight is read once as stored, dequantized in registers or L1, and used.
//
// Two paths, picked when the library is built (`-march=native`: the CPU's own features):
//
// The integer path (int8 and int4 in groups of whole 16s, where the CPU has 8-bit dot
// products: AVX-512 VNNI, else AVX-VNNI; or AVX2's `vpmaddubsw` in their place, see `Vec`
// there): x is quantized to int8 per sub-block of 16 inputs (one float scale each; finer than
// llama.cpp's blocks of 32) and multiplied with the codes by `vpdpbusd` (u8 x s8 multiply-adds
// into int32), as llama.cpp's CPU backend does:
//   sum_i w[o,i] x[t,i] ~= sum_sub s[o,g] dx[t,sub] sum_{i in sub} code[o,i] xq[t,i]
//                          + sum_sub m'[o,g] dx[t,sub] sum_{i in sub} xq[t,i]
// `vpdpbusd` takes the weight side unsigned: int4 codes are 0..15 already, and int8 codes
// are flipped to code + 128 (one xor), the 128 x sum(xq) this adds being taken back through
// the offset term (m' = offset - 128 s).
//
// Output rows go in panels of kP (16 with AVX-512, 8 with AVX2), one row per int32 lane:
// each row's codes are read in pieces of 4 kP bytes, transposed in registers (dwords; int4
// unpacked after), so that one vector holds 4 codes of every row of the panel for the same 4
// inputs, which `vpdpbusd` meets with those 4 inputs of x broadcast. Four such instructions sum
// a whole sub-block of 16 inputs in int32, exactly, for 16 rows; the sum then becomes float
// once, times weight scale x input scale. The first version kept 64 inputs of one row per
// vector, so every `vpdpbusd` (4 products per lane) needed its own conversion and two float
// operations: 4 instructions per 64 multiply-adds against about 1.75 here, which is what a
// batch of rows (prefill, many decodes) is bound by. The scales and offsets are transposed the
// same way, once per panel. With more than one block of kT input rows the panel's transposed
// codes are stored once (16 I bytes, L1/L2) and reused by every block; with fewer they go from
// registers to the dot products. Each thread prefetches the next panel's codes and factors as
// it reads its own: out of cache, the factors alone had cost as much as the codes.
// Its error is that of rounding x to 8 bits per 16 values (the tests bound it; the demo's
// perplexity is checked by scripts/quant_quality.py). Figures: benchmarks/results/
// qmatmul-int-path-cpu.json (against the float path) and qmatmul-panels-cpu.json (panels
// against the first version).
//
// One call takes any number of matrices of the same x (a layer's q, k and v; its gate and
// up): x is rounded once, and their row blocks, numbered one after another, are spread over
// the threads together (`Weights`).
//
// The float path (fp8, shapes the integer path does not take, CPUs without AVX2): output
// rows in blocks of kRows, spread over XLA's intra-op threads (parallel.h,
// as the integer path's). A block's rows are dequantized into an f32 buffer once (at most
// kRows x I floats, L1/L2-resident), then every
// block of up to kT input rows runs a register micro-kernel over I: kT x kRows vector
// accumulators, each buffer vector loaded once per kT rows and each x vector once per kRows
// rows. A decode (T = 1) is bound by reading q; a prefill reuses each buffer T / kT times.
//
// Both sum every output in the same order whatever T is (a request's tokens do not depend on
// what else is in the batch).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <vector>

#include "e4m3.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

constexpr int kRows = 4;  // output rows per block
// How far ahead of the block in use its thread prefetches codes. A decode reads each weight
// once, too fast for the hardware prefetcher alone: out of cache, a [1, 576] x [576, 1536]
// int4 matmul went 49 -> 33 us on one core, int8 71 -> 39 us (2-core AMD EPYC).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int kT = 4;  // input rows per micro-kernel call

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

enum Format : int64_t { kInt8 = 0, kInt4 = 1, kFp8 = 2 };

using jaxllm::kE4M3;  // e4m3.h

inline float to_float(float x) { return x; }
inline float to_float(uint16_t h) {  // IEEE half -> float, subnormals included
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; this runs once per group of 32 weights
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exp = (h >> 10) & 31;
  const uint32_t mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    const uint32_t bits = (static_cast<uint32_t>(exp + 112) << 23) | (mant << 13);
    std::memcpy(&v, &bits, sizeof(v));
  }
  return sign ? -v : v;
#endif
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}


// The matrices of one call, all multiplied by the same x: one format, input size, group
// count and factor type (float32 or float16 `ST`), each with its own output rows and result.
// Their blocks of output rows (`rows` high: the path's) are numbered one after another, so one
// ParallelFor spreads all of them (q, k and v in one call: fewer calls, one quantization of
// x, and work enough for every thread).
template <typename ST>
struct Weights {
  struct One {
    const uint8_t* q;
    const ST* scale;
    const ST* offset;
    int64_t num_out;
    float* out;
    int64_t first_block;
  };
  std::vector<One> w;
  int64_t num_blocks = 0;
  int64_t row_bytes = 0;  // of q
  int64_t rows = 1;       // per block

  void Add(const uint8_t* q, const ST* scale, const ST* offset, int64_t num_out, float* out) {
    w.push_back({q, scale, offset, num_out, out, 0});
  }
  // Numbers the blocks of `block_rows` rows.
  void Split(int64_t block_rows) {
    rows = block_rows;
    num_blocks = 0;
    for (One& m : w) {
      m.first_block = num_blocks;
      num_blocks += (m.num_out + rows - 1) / rows;
    }
  }
  // The matrix holding block b (they are few: a scan), the block's first row in it and its
  // number of rows (`rows`, fewer in a matrix's last block).
  const One& Of(int64_t b, int64_t* o0, int* nr) const {
    size_t i = 0;
    while (i + 1 < w.size() && w[i + 1].first_block <= b) ++i;
    *o0 = (b - w[i].first_block) * rows;
    *nr = static_cast<int>(std::min<int64_t>(rows, w[i].num_out - *o0));
    return w[i];
  }
  // Prefetches block `next` of a thread's blocks [.., end).
  void Prefetch(int64_t next, int64_t end) const {
    if (next >= end) return;
    int64_t o0;
    int nr;
    const One& m = Of(next, &o0, &nr);
    const char* p = reinterpret_cast<const char*>(m.q + o0 * row_bytes);
    const int64_t bytes = nr * row_bytes;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
  }
  int64_t Ahead() const { return std::max<int64_t>(1, kPrefetchBytes / (rows * row_bytes)); }
};

// Dequantizes output row o into buf[0:I].
template <Format kFormat, typename ST, int kGroup>
void DequantRow(const uint8_t* q, const ST* scale, const ST* offset, bool has_offset,
                int64_t o, int64_t in, int64_t groups, float* buf) {
  const int64_t group_size = in / groups;
  const ST* s = scale + o * groups;
  const ST* m = offset + o * groups;
  // kGroup > 0: the group size known at compile time (GGUF's 32 and 16), so each group's loop
  // is straight vector code with no set-up: with a run-time trip count the grouped formats
  // ran at half int8's per-channel speed. (Explicit GCC vector conversions were tried, and
  // were 2x slower still: GCC 12 splits int8 -> float vector conversions into scalars.)
  const int64_t gs = kGroup > 0 ? kGroup : group_size;
  if constexpr (kFormat == kInt8 || kFormat == kFp8) {
    const int8_t* row = reinterpret_cast<const int8_t*>(q) + o * in;
    for (int64_t g = 0; g < groups; ++g) {
      const float sg = to_float(s[g]), mg = has_offset ? to_float(m[g]) : 0.f;
      const int64_t i0 = g * gs;
      if constexpr (kFormat == kInt8) {
#pragma omp simd
        for (int64_t i = 0; i < gs; ++i) buf[i0 + i] = static_cast<float>(row[i0 + i]) * sg + mg;
      } else {
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
        for (int64_t i = 0; i < gs; ++i) buf[i0 + i] = kE4M3[bytes[i0 + i]] * sg + mg;
      }
    }
  } else {
    const uint8_t* row = q + o * (in / 2);
    for (int64_t g = 0; g < groups; ++g) {
      const float sg = to_float(s[g]), mg = has_offset ? to_float(m[g]) : 0.f;
      for (int64_t b = g * gs / 32; b < (g + 1) * gs / 32; ++b) {
        const uint8_t* bytes = row + b * 16;
        float* out = buf + b * 32;
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          out[j] = static_cast<float>(bytes[j] & 15) * sg + mg;
          out[j + 16] = static_cast<float>(bytes[j] >> 4) * sg + mg;
        }
      }
    }
  }
}

// out[t0 + a, o0 + r] = dot(x[t0 + a, :], buf[r, :]) for a < NT, r < nr (nr <= kRows).
template <int NT>
void MicroKernel(const float* x, int64_t t0, const float* buf, int nr, int64_t in, float* out,
                 int64_t num_out, int64_t o0) {
  vf acc[NT][kRows] = {};
  const int64_t vec_end = in - in % kLanes;
  for (int64_t i = 0; i < vec_end; i += kLanes) {
    vf w[kRows];
    for (int r = 0; r < kRows; ++r) w[r] = load(buf + r * in + i);
    for (int a = 0; a < NT; ++a) {
      const vf xv = load(x + (t0 + a) * in + i);
      for (int r = 0; r < kRows; ++r) acc[a][r] += xv * w[r];
    }
  }
  for (int a = 0; a < NT; ++a) {
    for (int r = 0; r < nr; ++r) {
      float sum = hsum(acc[a][r]);
      for (int64_t i = vec_end; i < in; ++i) sum += x[(t0 + a) * in + i] * buf[r * in + i];
      out[(t0 + a) * num_out + o0 + r] = sum;
    }
  }
}

// kernel(NT, t0) with NT = kBlock over the input rows, then NT = the 1 to kBlock - 1 left: NT
// is a std::integral_constant, so each micro-kernel is compiled for its row count.
template <int N, typename Kernel>
void ForLastRows(int64_t n, int64_t t0, const Kernel& kernel) {
  if constexpr (N > 0) {
    if (n == N) return kernel(std::integral_constant<int, N>(), t0);
    ForLastRows<N - 1>(n, t0, kernel);
  }
}

template <int kBlock, typename Kernel>
void ForInputRowBlocks(int64_t num_t, const Kernel& kernel) {
  int64_t t0 = 0;
  for (; t0 + kBlock <= num_t; t0 += kBlock) kernel(std::integral_constant<int, kBlock>(), t0);
  ForLastRows<kBlock - 1>(num_t - t0, t0, kernel);
}

template <Format kFormat, typename ST>
void Run(ffi::ThreadPool& pool, const float* x, const Weights<ST>& ws, bool has_offset,
         int64_t num_t, int64_t in, int64_t groups) {
  const int64_t group_size = in / groups;
  auto dequant = group_size == 32   ? DequantRow<kFormat, ST, 32>
                 : group_size == 16 ? DequantRow<kFormat, ST, 16>
                                    : DequantRow<kFormat, ST, 0>;
  const int64_t grain = jaxllm::Grain(pool, ws.num_blocks);
  jaxllm::ParallelFor(pool, ws.num_blocks, grain, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> buffer;
    buffer.resize(kRows * in);
    float* buf = buffer.data();
    const int64_t ahead = ws.Ahead();
    for (int64_t blk = b0; blk < b1; ++blk) {
      int64_t o0;
      int nr;
      const auto& m = ws.Of(blk, &o0, &nr);
      ws.Prefetch(blk + ahead, b1);
      for (int r = 0; r < nr; ++r)
        dequant(m.q, m.scale, m.offset, has_offset, o0 + r, in, groups, buf + r * in);
      // Rows past the last real one are zero, so the micro-kernel may always run kRows rows.
      for (int r = nr; r < kRows; ++r) std::fill(buf + r * in, buf + (r + 1) * in, 0.f);
      ForInputRowBlocks<kT>(num_t, [&](auto nt, int64_t t0) {
        MicroKernel<decltype(nt)::value>(x, t0, buf, nr, in, m.out, m.num_out, o0);
      });
    }
  });
}

// ---- The integer path -------------------------------------------------------------------

// A sub-block's 16 inputs against row r's codes, where the ISA has an 8-bit dot product (VNNI,
// both widths): four `V::Dot`s of 4 inputs, the codes taken unsigned (int8 flipped to u8).
template <typename V, bool kSigned>
typename V::I VnniDotSub(const typename V::I w[4], const int32_t x4[4]) {
  static_assert(!kSigned, "8-bit dot products take the codes unsigned");
  typename V::I d = V::Dot(V::ZeroI(), w[0], x4[0]);
  d = V::Dot(d, w[1], x4[1]);
  d = V::Dot(d, w[2], x4[2]);
  return V::Dot(d, w[3], x4[3]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define JAXLLM_INT_PATH_ENABLED 1
#define JAXLLM_INT_PATH "avx512_vnni"
// A panel of 16 output rows, one per int32 lane.
struct Vec {
  static constexpr int kP = 16;  // output rows per panel
  static constexpr int kT = 8;   // input rows per micro-kernel call
  using I = __m512i;
  using F = __m512;
  // 4 kP bytes of a row; past `bytes` (a multiple of 4 below that), zeros.
  static I LoadRow(const uint8_t* p, int64_t bytes) {
    if (bytes >= 4 * kP) return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (bytes / 4)) - 1), p);
  }
  // r[d] becomes the vector whose lane l is dword d of the old r[l].
  static void Transpose(I r[kP]) {
    I t[kP];
    for (int i = 0; i < kP; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < kP; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
      t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
      t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
      t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
      r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
  }
  static I Low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I High4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static I Flip(I v) {  // int8 codes + 128, as u8
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  // n <= kP factors as float32 bits (float16 converted), zeros after them.
  static I LoadFactors(const float* p, int64_t n) {
    if (n >= kP) return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static I LoadFactors(const uint16_t* p, int64_t n) {
    const __m256i h = n >= kP ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                              : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    return _mm512_castps_si512(_mm512_cvtph_ps(h));
  }
  static I LoadI(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void StoreI(uint8_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I ZeroI() { return _mm512_setzero_si512(); }
  static I Dot(I acc, I w, int32_t x4) {  // lane r += sum_j w[r][j] x4[j], u8 x s8
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
  }
  static constexpr bool kFlipInt8 = true;  // int8 codes go in as code + 128 (u8)
  // Lane r: sum over a sub-block's 16 inputs of row r's codes w[q] (u8) times x's codes.
  template <bool kSigned>
  static I DotSub(const I w[4], const int32_t x4[4]) {
    return VnniDotSub<Vec, kSigned>(w, x4);
  }
  static F ToFloat(I v) { return _mm512_cvtepi32_ps(v); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static F Broadcast(float v) { return _mm512_set1_ps(v); }
  static F Zero() { return _mm512_setzero_ps(); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void Store(float* p, F v, int n) {  // its first n lanes
    if (n == kP) return _mm512_storeu_ps(p, v);
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
};
#elif defined(__AVX2__) && !defined(JAXLLM_NO_AVX2_INT_PATH)
#define JAXLLM_INT_PATH_ENABLED 1
// A panel of 8 output rows, one per int32 lane: what AVX-VNNI and plain AVX2 share.
struct Vec256 {
  static constexpr int kP = 8;
  static constexpr int kT = 4;  // 16 registers: kT accumulators, 4 code vectors, temporaries
  using I = __m256i;
  using F = __m256;
  static __m256i FirstLanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static I LoadRow(const uint8_t* p, int64_t bytes) {
    if (bytes >= 4 * kP) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), FirstLanes(bytes / 4));
  }
  static void Transpose(I r[kP]) {
    I t[kP];
    for (int i = 0; i < kP; i += 2) {
      t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < kP; i += 4) {
      r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
      t[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < kP; ++i) r[i] = t[i];
  }
  static I Low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I High4(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static I LoadFactors(const float* p, int64_t n) {
    if (n >= kP) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), FirstLanes(n));
  }
  static I LoadFactors(const uint16_t* p, int64_t n) {  // no 16-bit masked loads: by copy
    alignas(16) uint16_t h[kP] = {};
    std::memcpy(h, p, std::min<int64_t>(n, kP) * sizeof(uint16_t));
    const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(h));
    return _mm256_castps_si256(_mm256_cvtph_ps(v));
  }
  static I LoadI(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void StoreI(uint8_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static I ZeroI() { return _mm256_setzero_si256(); }
  static F ToFloat(I v) { return _mm256_cvtepi32_ps(v); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static F Broadcast(float v) { return _mm256_set1_ps(v); }
  static F Zero() { return _mm256_setzero_ps(); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void Store(float* p, F v, int n) {
    if (n == kP) return _mm256_storeu_ps(p, v);
    _mm256_maskstore_ps(p, FirstLanes(n), v);
  }
};
#if defined(__AVXVNNI__)
#define JAXLLM_INT_PATH "avx_vnni"
struct Vec : Vec256 {
  static I Flip(I v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
  static I Dot(I acc, I w, int32_t x4) {
    return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(x4));
  }
  static constexpr bool kFlipInt8 = true;
  template <bool kSigned>
  static I DotSub(const I w[4], const int32_t x4[4]) {
    return VnniDotSub<Vec, kSigned>(w, x4);
  }
};
#else
// AVX2 without 8-bit dot products (most x86 servers before 2021): `vpmaddubsw` multiplies u8 by
// s8 and adds pairs into s16, saturating; `vpmaddwd` by ones adds pairs of those into s32, as
// llama.cpp's AVX2 path does. int4 codes (0..15) go in as they are: a pair of products is at
// most 2 x 15 x 127 = 3810, and a sub-block's four sums add up in s16 (at most 15240) before
// one `vpmaddwd`. int8 codes stay signed (no + 128: 255 x 127 twice would saturate): the
// unsigned side is |code| (at most 128, -128 included) and the signed one x with the code's
// sign (x is within +-127), at most 2 x 128 x 127 = 32512 a pair: exact for every code.
#define JAXLLM_INT_PATH "avx2"
struct Vec : Vec256 {
  static I Flip(I v) { return v; }  // int8 codes as DotSub takes them: as stored
  static constexpr bool kFlipInt8 = false;
  template <bool kSigned>
  static I DotSub(const I w[4], const int32_t x4[4]) {
    const I ones = _mm256_set1_epi16(1);
    if constexpr (kSigned) {
      I d = ZeroI();
      for (int q = 0; q < 4; ++q) {
        const I x = _mm256_set1_epi32(x4[q]);
        const I p = _mm256_maddubs_epi16(_mm256_abs_epi8(w[q]), _mm256_sign_epi8(x, w[q]));
        d = _mm256_add_epi32(d, _mm256_madd_epi16(p, ones));
      }
      return d;
    } else {
      I p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x4[0]));
      for (int q = 1; q < 4; ++q)
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[q], _mm256_set1_epi32(x4[q])));
      return _mm256_madd_epi16(p, ones);
    }
  }
};
#endif
#endif

#ifdef JAXLLM_INT_PATH_ENABLED
constexpr int kSub = 16;  // inputs per activation scale

// x rounded to int8 per sub-block of kSub inputs: codes [T, I], each sub-block's scale
// [T, I / kSub], and per weight group the sum of scale x code over its inputs [T, G] (for the
// offset term).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, group_sum;
};

// One sub-block of x: q[i] = round(v[i] * 127 / max|v|) (to nearest, ties to even: the
// rounding mode's, as std::nearbyint), the sum of the codes in *sum; returns the scale
// max|v| / 127. In vector registers: a prefill quantizes I x T values per matmul.
inline float QuantizeSub(const float* v, int8_t* q, int* sum) {
#if defined(__AVX512F__)
  const __m512 x = _mm512_loadu_ps(v);
  const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(x));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(c));
  *sum = _mm512_reduce_add_epi32(c);
#else  // AVX2 (with or without AVX-VNNI)
  const __m256 a = _mm256_loadu_ps(v), b = _mm256_loadu_ps(v + 8);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, a), _mm256_andnot_ps(sign, b));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 k = _mm256_set1_ps(inv);
  alignas(32) int32_t c[kSub];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), _mm256_cvtps_epi32(_mm256_mul_ps(a, k)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(c + 8), _mm256_cvtps_epi32(_mm256_mul_ps(b, k)));
  int total = 0;
  for (int i = 0; i < kSub; ++i) q[i] = static_cast<int8_t>(c[i]), total += c[i];
  *sum = total;
#endif
  return amax / 127.f;
}

QuantizedX QuantizeX(ffi::ThreadPool& pool, const float* x, int64_t num_t, int64_t in,
                     int64_t groups) {
  const int64_t subs = in / kSub, subs_per_group = subs / groups;
  QuantizedX r{std::vector<int8_t>(num_t * in), std::vector<float>(num_t * subs),
               std::vector<float>(num_t * groups, 0.f)};
  jaxllm::ParallelFor(pool, num_t, jaxllm::Grain(pool, num_t), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t s = 0; s < subs; ++s) {
        int sum;
        const float d = QuantizeSub(x + t * in + s * kSub, r.q.data() + t * in + s * kSub, &sum);
        r.scale[t * subs + s] = d;
        r.group_sum[t * groups + s / subs_per_group] += d * static_cast<float>(sum);
      }
    }
  });
  return r;
}

// The panel's codes by sub-block of 16 inputs, in order: visit(s, w) with w[q] (q < 4) the
// vector whose lane r holds row r's codes of inputs 16 s + 4 q .. + 3 as `Vec::DotSub` takes
// them (int8 codes + 128 as u8 where `Vec::kFlipInt8`, else as stored; int4 codes as they are). Each row's bytes are read in pieces of 4 kP, transposed in registers
// (dwords), and for int4 unpacked after the transpose, two codes per byte.
// `next` (next_bytes of them, contiguous): the codes of the panel to come, prefetched a share
// per piece as this panel's are read (a decode reads each code once: too fast for the
// hardware prefetcher alone, and 16 rows at once are more streams than it follows).
template <Format kFormat, typename Visit>
inline void ForPanelSubs(const uint8_t* const* rows, const uint8_t* next, int64_t next_bytes,
                         int64_t row_bytes, const Visit& visit) {
  constexpr int64_t kPiece = 4 * Vec::kP;
  const int64_t pieces = (row_bytes + kPiece - 1) / kPiece;
  const int64_t share = (next_bytes + pieces - 1) / pieces;
  typename Vec::I v[Vec::kP], w[4];
  for (int64_t c = 0; c < row_bytes; c += kPiece) {
    const int64_t bytes = std::min(kPiece, row_bytes - c);
    const int64_t from = c / kPiece * share, to = std::min(next_bytes, from + share);
    for (int64_t b = from; b < to; b += 64) __builtin_prefetch(next + b, 0, 3);
    for (int r = 0; r < Vec::kP; ++r) v[r] = Vec::LoadRow(rows[r] + c, bytes);
    Vec::Transpose(v);  // v[d], lane r: the piece's dword d of row r
    if constexpr (kFormat == kInt8) {
      for (int64_t j = 0; j < bytes / 16; ++j) {  // dwords 4j..4j+3: sub-block c / 16 + j
        for (int q = 0; q < 4; ++q) w[q] = Vec::Flip(v[4 * j + q]);
        visit(c / 16 + j, w);
      }
    } else {
      // A 16-byte block b holds inputs 32 b + j (low nibble of byte j) and 32 b + 16 + j (high).
      for (int64_t j = 0; j < bytes / 16; ++j) {
        const int64_t block = c / 16 + j;
        for (int q = 0; q < 4; ++q) w[q] = Vec::Low4(v[4 * j + q]);
        visit(2 * block, w);
        for (int q = 0; q < 4; ++q) w[q] = Vec::High4(v[4 * j + q]);
        visit(2 * block + 1, w);
      }
    }
  }
}

// A panel's factors (scales or offsets) as float32, group-major: out[g * kP + r] = row r's
// factor of group g, from its nr rows of [O, G] (rows past them repeat the last), loaded in
// pieces of kP groups per row (float16 converted on the way) and transposed in registers.
template <typename ST>
void PanelFactors(const ST* factors, int nr, int64_t groups, float* out) {
  const ST* rows[Vec::kP];
  for (int r = 0; r < Vec::kP; ++r) rows[r] = factors + std::min(r, nr - 1) * groups;
  typename Vec::I v[Vec::kP];
  for (int64_t g0 = 0; g0 < groups; g0 += Vec::kP) {
    const int64_t n = std::min<int64_t>(Vec::kP, groups - g0);
    for (int r = 0; r < Vec::kP; ++r) v[r] = Vec::LoadFactors(rows[r] + g0, n);
    Vec::Transpose(v);
    for (int64_t d = 0; d < n; ++d)
      Vec::StoreI(reinterpret_cast<uint8_t*>(out + (g0 + d) * Vec::kP), v[d]);
  }
}

// What the micro-kernels share: x and the panel's factors, group-major (`sc`: scales; `mv`:
// the offsets, and for int8 -128 x the scales, which the +128 of the codes added).
struct PanelArgs {
  const QuantizedX* xq;
  const float* sc;
  const float* mv;
  bool offset_term;
  const int32_t* sub_group;
  int64_t in, groups;
};

// acc[a] += sub-block s of token t0 + a against the panel's codes w: 4 `vpdpbusd` into one
// int32 sum per row (exact), then one float multiply-add with the row's weight scale times the
// token's x scale.
template <bool kSigned, int NT>
inline void SubStep(const PanelArgs& p, int64_t t0, int64_t s, const typename Vec::I* w,
                    typename Vec::F* acc) {
  const int64_t subs = p.in / kSub;
  const typename Vec::F sv = Vec::Load(p.sc + p.sub_group[s] * Vec::kP);
  for (int a = 0; a < NT; ++a) {
    int32_t x4[4];
    std::memcpy(x4, p.xq->q.data() + (t0 + a) * p.in + s * kSub, sizeof(x4));
    const typename Vec::I d = Vec::template DotSub<kSigned>(w, x4);
    const float dx = p.xq->scale[(t0 + a) * subs + s];
    acc[a] = Vec::Fma(Vec::ToFloat(d), Vec::Mul(sv, Vec::Broadcast(dx)), acc[a]);
  }
}

// The offset term (per weight group, `mv` against x's group sums), then out[t0 + a, o0 + r]
// for the panel's rows r < nr.
template <int NT>
inline void FinishRows(const PanelArgs& p, int64_t t0, typename Vec::F* acc, float* out,
                       int64_t num_out, int64_t o0, int nr) {
  if (p.offset_term) {
    const float* xs = p.xq->group_sum.data() + t0 * p.groups;
    for (int64_t g = 0; g < p.groups; ++g) {
      const typename Vec::F m = Vec::Load(p.mv + g * Vec::kP);
      for (int a = 0; a < NT; ++a)
        acc[a] = Vec::Fma(m, Vec::Broadcast(xs[a * p.groups + g]), acc[a]);
    }
  }
  for (int a = 0; a < NT; ++a) Vec::Store(out + (t0 + a) * num_out + o0, acc[a], nr);
}

// Tokens t0 .. t0 + NT against the panel: straight from its rows (`rows`, when every token of
// the call is in this one block: each code is used once, so it is not stored), or from the
// packed codes `buf` (ForPanelSubs's vectors, sub-block after sub-block). The arithmetic is
// SubStep's either way, in the same order: a row's result never depends on the batch.
template <Format kFormat, int NT>
void IntMicroKernel(const PanelArgs& p, int64_t t0, const uint8_t* const* rows,
                    const uint8_t* next, int64_t next_bytes, int64_t row_bytes,
                    const uint8_t* buf, float* out, int64_t num_out, int64_t o0, int nr) {
  constexpr bool kSigned = kFormat == kInt8 && !Vec::kFlipInt8;  // codes as stored
  typename Vec::F acc[NT];
  for (int a = 0; a < NT; ++a) acc[a] = Vec::Zero();
  if (buf == nullptr) {
    ForPanelSubs<kFormat>(rows, next, next_bytes, row_bytes,
                          [&](int64_t s, const typename Vec::I* w) {
                            SubStep<kSigned, NT>(p, t0, s, w, acc);
                          });
  } else {
    constexpr int64_t kSubBytes = 16 * Vec::kP;
    for (int64_t s = 0; s < p.in / kSub; ++s) {
      typename Vec::I w[4];
      for (int q = 0; q < 4; ++q) w[q] = Vec::LoadI(buf + s * kSubBytes + q * 4 * Vec::kP);
      SubStep<kSigned, NT>(p, t0, s, w, acc);
    }
  }
  FinishRows<NT>(p, t0, acc, out, num_out, o0, nr);
}

template <Format kFormat, typename ST>
void RunInt(ffi::ThreadPool& pool, const float* x, Weights<ST>& ws, bool has_offset,
            int64_t num_t, int64_t in, int64_t groups) {
  ws.Split(Vec::kP);
  const QuantizedX xq = QuantizeX(pool, x, num_t, in, groups);
  const int64_t group_size = in / groups, row_bytes = ws.row_bytes;
  std::vector<int32_t> sub_group(in / kSub);
  for (size_t s = 0; s < sub_group.size(); ++s)
    sub_group[s] = static_cast<int32_t>(s * kSub / group_size);
  // Up to one block of tokens, each code is used once: it goes from the rows to the dot
  // products in registers. More, and the panel is packed once into `buf` for every block.
  const bool pack = num_t > Vec::kT;
  const int64_t grain = jaxllm::Grain(pool, ws.num_blocks);
  jaxllm::ParallelFor(pool, ws.num_blocks, grain, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<uint8_t> buf;
    thread_local std::vector<float> sc, mv;
    if (pack) buf.resize(in * Vec::kP);
    sc.resize(groups * Vec::kP);
    mv.resize(groups * Vec::kP);
    constexpr bool kFlipped = kFormat == kInt8 && Vec::kFlipInt8;  // codes + 128
    const PanelArgs args{&xq, sc.data(), mv.data(), has_offset || kFlipped, sub_group.data(),
                         in, groups};
    const uint8_t* rows[Vec::kP];
    for (int64_t blk = b0; blk < b1; ++blk) {
      int64_t o0;
      int nr;
      const auto& m = ws.Of(blk, &o0, &nr);
      // Past the panel's last row: repeat it (computed, never written).
      for (int r = 0; r < Vec::kP; ++r)
        rows[r] = m.q + (o0 + std::min(r, nr - 1)) * row_bytes;
      const uint8_t* next = nullptr;  // the next panel's codes, to prefetch
      int64_t next_bytes = 0;
      if (blk + 1 < b1) {
        int64_t n0;
        int rows_next;
        const auto& n = ws.Of(blk + 1, &n0, &rows_next);
        next = n.q + n0 * row_bytes;
        next_bytes = rows_next * row_bytes;
        // Its factors too: out of cache, waiting for them cost as much as the codes.
        const int64_t factor_bytes = rows_next * groups * static_cast<int64_t>(sizeof(ST));
        for (int64_t b = 0; b < factor_bytes; b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(n.scale + n0 * groups) + b, 0, 3);
          if (has_offset)
            __builtin_prefetch(reinterpret_cast<const char*>(n.offset + n0 * groups) + b, 0, 3);
        }
      }
      PanelFactors(m.scale + o0 * groups, nr, groups, sc.data());
      if (has_offset)
        PanelFactors(m.offset + o0 * groups, nr, groups, mv.data());
      else
        std::fill(mv.begin(), mv.end(), 0.f);
      if constexpr (kFlipped)
        for (int64_t i = 0; i < groups * Vec::kP; ++i) mv[i] -= 128.f * sc[i];
      if (pack) {
        constexpr int64_t kSubBytes = 16 * Vec::kP;
        ForPanelSubs<kFormat>(rows, next, next_bytes, row_bytes,
                              [&](int64_t s, const typename Vec::I* w) {
                                uint8_t* to = buf.data() + s * kSubBytes;
                                for (int q = 0; q < 4; ++q) Vec::StoreI(to + q * 4 * Vec::kP, w[q]);
                              });
      }
      ForInputRowBlocks<Vec::kT>(num_t, [&](auto nt, int64_t t0) {
        IntMicroKernel<kFormat, decltype(nt)::value>(args, t0, rows, next, next_bytes, row_bytes,
                                                     pack ? buf.data() : nullptr, m.out,
                                                     m.num_out, o0, nr);
      });
    }
  });
}
#else
#define JAXLLM_INT_PATH "float"
#endif

// Whether the integer path takes this matmul: int8 or int4 codes, weight groups in whole
// sub-blocks of x (so inputs too).
bool IntPathTakes(Format format, int64_t in, int64_t groups) {
#ifdef JAXLLM_INT_PATH_ENABLED
  return format != kFp8 && (in / groups) % kSub == 0;
#else
  (void)format, (void)in, (void)groups;
  return false;
#endif
}

// Checks matrix i of the call (q, scale, offset, and its result) against x and the first
// matrix, and adds it to `ws`.
template <typename ST>
ffi::Error AddMatrix(Weights<ST>& ws, Format format, bool has_offset, int64_t in,
                     int64_t* groups, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                     ffi::AnyBuffer offset, ffi::Result<ffi::Buffer<ffi::F32>> out,
                     int64_t num_t) {
  auto qd = q.dimensions();
  auto sd = scale.dimensions();
  if (qd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: q and scale must be 2-D");
  const int64_t num_out = qd[0], g = sd[1];
  if (sd[0] != num_out || g < 1 || in % g)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: scale must be [O, G], G dividing I");
  if (*groups == 0) *groups = g;
  if (g != *groups)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: the matrices of a call must share G");
  if (has_offset && (offset.dimensions().size() != 2 || offset.dimensions()[0] != num_out ||
                     offset.dimensions()[1] != g))
    return ffi::Error::InvalidArgument("quant_matmul_cpu: offset must be shaped as scale");
  const ffi::DataType st = std::is_same_v<ST, float> ? ffi::F32 : ffi::F16;
  if (scale.element_type() != st || offset.element_type() != st)
    return ffi::Error::InvalidArgument(
        "quant_matmul_cpu: scale and offset must both be float32 or both float16, alike in "
        "every matrix of a call");
  auto od = out->dimensions();
  if (od.size() != 2 || od[0] != num_t || od[1] != num_out)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: each result must be f32[T, O]");
  if (format == kInt8) {
    if (q.element_type() != ffi::S8 || qd[1] != in)
      return ffi::Error::InvalidArgument("quant_matmul_cpu: int8 q must be int8 [O, I]");
  } else if (format == kInt4) {
    if (q.element_type() != ffi::U8 || qd[1] * 2 != in || (in / g) % 32)
      return ffi::Error::InvalidArgument(
          "quant_matmul_cpu: int4 q must be uint8 [O, I / 2] with groups of 32k elements");
  } else if (q.element_type() != ffi::F8E4M3FN || qd[1] != in) {
    return ffi::Error::InvalidArgument("quant_matmul_cpu: fp8 q must be float8_e4m3fn [O, I]");
  }
  ws.Add(reinterpret_cast<const uint8_t*>(q.untyped_data()),
         static_cast<const ST*>(scale.untyped_data()),
         static_cast<const ST*>(offset.untyped_data()), num_out, out->typed_data());
  return ffi::Error::Success();
}

template <typename ST>
ffi::Error RunAll(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs& mats,
                  ffi::RemainingRets& outs, Format format, bool has_offset) {
  const int64_t num_t = x.dimensions()[0], in = x.dimensions()[1];
  Weights<ST> ws;
  ws.row_bytes = format == kInt4 ? in / 2 : in;
  int64_t groups = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto q = mats.get<ffi::AnyBuffer>(3 * i);
    auto scale = mats.get<ffi::AnyBuffer>(3 * i + 1);
    auto offset = mats.get<ffi::AnyBuffer>(3 * i + 2);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (q.has_error() || scale.has_error() || offset.has_error() || out.has_error())
      return ffi::Error::InvalidArgument("quant_matmul_cpu: bad operands");
    ffi::Error error = AddMatrix(ws, format, has_offset, in, &groups, *q, *scale, *offset, *out,
                                 num_t);
    if (error.failure()) return error;
  }
  auto run = [&](auto fmt) {
    constexpr Format F = decltype(fmt)::value;
#ifdef JAXLLM_INT_PATH_ENABLED
    if constexpr (F != kFp8) {
      if (IntPathTakes(F, in, groups))
        return RunInt<F, ST>(pool, x.typed_data(), ws, has_offset, num_t, in, groups);
    }
#endif
    ws.Split(kRows);
    Run<F, ST>(pool, x.typed_data(), ws, has_offset, num_t, in, groups);
  };
  if (format == kInt8) run(std::integral_constant<Format, kInt8>());
  else if (format == kInt4) run(std::integral_constant<Format, kInt4>());
  else run(std::integral_constant<Format, kFp8>());
  return ffi::Error::Success();
}

// x [T, I] times each matrix of the call: operands (q, scale, offset) per matrix after x, one
// result f32[T, O] per matrix.
ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs mats,
                int64_t format, bool has_offset, ffi::RemainingRets outs) {
  if (x.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: x must be 2-D");
  if (outs.size() < 1 || mats.size() != 3 * outs.size())
    return ffi::Error::InvalidArgument(
        "quant_matmul_cpu: each matrix needs q, scale and offset, and one result");
  if (format != kInt8 && format != kInt4 && format != kFp8)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: format must be 0, 1 or 2");
  auto scale = mats.get<ffi::AnyBuffer>(1);
  if (scale.has_error()) return ffi::Error::InvalidArgument("quant_matmul_cpu: bad operands");
  const Format f = static_cast<Format>(format);
  if (scale->element_type() == ffi::F16)
    return RunAll<uint16_t>(pool, x, mats, outs, f, has_offset);
  return RunAll<float>(pool, x, mats, outs, f, has_offset);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmQuantMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, I]
                                  .RemainingArgs()  // per matrix: q, scale [O, G], offset
                                  .Attr<int64_t>("format")
                                  .Attr<bool>("has_offset")
                                  .RemainingRets());  // per matrix: f32[T, O]

// Which path int8 and int4 matmuls take in this build: "avx512_vnni", "avx_vnni", "avx2" or
// "float".
extern "C" const char* JaxllmQuantMatmulPath() { return JAXLLM_INT_PATH; }
