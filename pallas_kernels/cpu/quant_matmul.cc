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
// The integer path (int8 and int4, where the CPU has 8-bit dot products: AVX-512 VNNI, else
// AVX-VNNI): x is quantized to int8 per sub-block of 16 inputs (one float scale each; finer
// than llama.cpp's blocks of 32), and each weight vector is multiplied with it by `vpdpbusd`
// (64 multiply-adds of u8 x s8 into int32 per instruction), as llama.cpp's CPU backend
// does. Per 16 inputs the int32 sums become float once, times weight scale x input scale:
//   sum_i w[o,i] x[t,i] ~= sum_sub s[o,g] dx[t,sub] sum_{i in sub} code[o,i] xq[t,i]
//                          + sum_sub m'[o,g] dx[t,sub] sum_{i in sub} xq[t,i]
// `vpdpbusd` takes the weight side unsigned: int4 codes are 0..15 already, and int8 codes
// are flipped to code + 128 (one xor), the 128 x sum(xq) this adds being taken back through
// the offset term (m' = offset - 128 s). Nothing of the weight is expanded in memory: each
// 64 codes are loaded (and int4 unpacked) in registers once per block of kT input rows.
// Its error is that of rounding x to 8 bits per 16 values (the tests bound it; the demo's
// perplexity is checked by scripts/quant_quality.py). On a 2-core AMD EPYC (Zen 4) a [1, 4096]
// x [4096, 4096] int4 matmul went 9.3 -> 2.1 ms against the float path, int8 6.3 -> 2.2 ms,
// and a batch-1 decode of the demo GGUF kept quantized 142 -> 40 ms (benchmarks/results/
// qmatmul-int-path-cpu.json).
//
// One call takes any number of matrices of the same x (a layer's q, k and v; its gate and
// up): x is rounded once, and their row blocks, numbered one after another, are spread over
// the threads together (`Weights`). Each thread prefetches its codes kPrefetchBytes ahead.
//
// The float path (fp8, shapes the integer path does not take, CPUs without 8-bit dot
// products): output rows in blocks of kRows, spread over XLA's intra-op threads (parallel.h,
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
// Their row blocks are numbered one after another, so one ParallelFor spreads all of them
// (q, k and v in one call: fewer calls, one quantization of x, and work enough for every
// thread).
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

  void Add(const uint8_t* q, const ST* scale, const ST* offset, int64_t num_out, float* out) {
    w.push_back({q, scale, offset, num_out, out, num_blocks});
    num_blocks += (num_out + kRows - 1) / kRows;
  }
  // The matrix holding block b (they are few: a scan), and the block's first row in it.
  const One& Of(int64_t b, int64_t* o0) const {
    size_t i = 0;
    while (i + 1 < w.size() && w[i + 1].first_block <= b) ++i;
    *o0 = (b - w[i].first_block) * kRows;
    return w[i];
  }
  // Prefetches block `next` of a thread's blocks [.., end).
  void Prefetch(int64_t next, int64_t end) const {
    if (next >= end) return;
    int64_t o0;
    const One& m = Of(next, &o0);
    const char* p = reinterpret_cast<const char*>(m.q + o0 * row_bytes);
    const int64_t bytes = std::min<int64_t>(kRows, m.num_out - o0) * row_bytes;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
  }
  int64_t Ahead() const { return std::max<int64_t>(1, kPrefetchBytes / (kRows * row_bytes)); }
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

// kernel(NT, t0) over the input rows in blocks of kT, then one block of the 1-3 left: NT is a
// std::integral_constant, so each micro-kernel is compiled for its row count.
template <typename Kernel>
void ForInputRowBlocks(int64_t num_t, const Kernel& kernel) {
  int64_t t0 = 0;
  for (; t0 + kT <= num_t; t0 += kT) kernel(std::integral_constant<int, kT>(), t0);
  switch (num_t - t0) {
    case 3: kernel(std::integral_constant<int, 3>(), t0); break;
    case 2: kernel(std::integral_constant<int, 2>(), t0); break;
    case 1: kernel(std::integral_constant<int, 1>(), t0); break;
    default: break;
  }
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
      const auto& m = ws.Of(blk, &o0);
      const int nr = static_cast<int>(std::min<int64_t>(kRows, m.num_out - o0));
      ws.Prefetch(blk + ahead, b1);
      for (int r = 0; r < nr; ++r)
        dequant(m.q, m.scale, m.offset, has_offset, o0 + r, in, groups, buf + r * in);
      // Rows past the last real one are zero, so the micro-kernel may always run kRows rows.
      for (int r = nr; r < kRows; ++r) std::fill(buf + r * in, buf + (r + 1) * in, 0.f);
      ForInputRowBlocks(num_t, [&](auto nt, int64_t t0) {
        MicroKernel<decltype(nt)::value>(x, t0, buf, nr, in, m.out, m.num_out, o0);
      });
    }
  });
}

// ---- The integer path -------------------------------------------------------------------

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define JAXLLM_INT_PATH_ENABLED 1
#define JAXLLM_INT_PATH "avx512_vnni"
// 64 codes per vector; 16 int32 lanes, 4 per sub-block of 16 inputs.
struct Vec {
  static constexpr int kChunk = 64;
  using I = __m512i;
  using F = __m512;
  static I LoadInt8(const uint8_t* p) {  // int8 codes + 128, as u8
    return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static I LoadInt4(const uint8_t* p) {  // 32 bytes: two blocks of 32, in element order
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, m);  // [block 0: 0..15, block 1: 0..15]
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);  // [.. 16..31, .. 16..31]
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));  // lo 0, hi 0, lo 1, hi 1
  }
  static I LoadX(const int8_t* p) { return _mm512_loadu_si512(p); }
  static F Dot(I w, I x) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x));
  }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static F Expand(const float* p) {  // 4 sub-block values, each over its 4 lanes
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(p)));
  }
  static F Expand32(const float* p) {  // groups of 32: 2 values, each over 8 lanes
    return _mm512_insertf32x8(_mm512_set1_ps(p[0]), _mm256_set1_ps(p[1]), 1);
  }
  static F Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static F Zero() { return _mm512_setzero_ps(); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static float Sum(F v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#define JAXLLM_INT_PATH_ENABLED 1
#define JAXLLM_INT_PATH "avx_vnni"
// 32 codes per vector; 8 int32 lanes, 4 per sub-block of 16 inputs.
struct Vec {
  static constexpr int kChunk = 32;
  using I = __m256i;
  using F = __m256;
  static I LoadInt8(const uint8_t* p) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  static I LoadInt4(const uint8_t* p) {  // 16 bytes: one block of 32
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
  }
  static I LoadX(const int8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static F Dot(I w, I x) {
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x));
  }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static F Expand(const float* p) { return _mm256_set_m128(_mm_set1_ps(p[1]), _mm_set1_ps(p[0])); }
  static F Expand32(const float* p) { return _mm256_set1_ps(*p); }  // a chunk is one group
  static F Broadcast(const float* p) { return _mm256_set1_ps(*p); }
  static F Zero() { return _mm256_setzero_ps(); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static float Sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

#ifdef JAXLLM_INT_PATH_ENABLED
constexpr int kSub = 16;  // inputs per activation scale (and per float conversion)

// x quantized: codes [T, I], the scale of each int32 lane's sub-block [T, I / 4] (so the
// micro-kernel loads it as a vector), scale x sum of codes per sub-block [T, I / 16].
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> lane_scale, scaled_sum;
};

QuantizedX QuantizeX(ffi::ThreadPool& pool, const float* x, int64_t num_t, int64_t in) {
  const int64_t subs = in / kSub;
  QuantizedX r{std::vector<int8_t>(num_t * in), std::vector<float>(num_t * in / 4),
               std::vector<float>(num_t * subs)};
  jaxllm::ParallelFor(pool, num_t, jaxllm::Grain(pool, num_t), [&](int64_t t_begin, int64_t t_end) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t s = 0; s < subs; ++s) {
      const float* v = x + t * in + s * kSub;
      float amax = 0.f;
      for (int i = 0; i < kSub; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int i = 0; i < kSub; ++i) {
        const int c = static_cast<int>(std::nearbyint(v[i] * inv));
        r.q[t * in + s * kSub + i] = static_cast<int8_t>(c);
        sum += c;
      }
      for (int l = 0; l < kSub / 4; ++l) r.lane_scale[t * in / 4 + s * kSub / 4 + l] = d;
      r.scaled_sum[t * subs + s] = d * static_cast<float>(sum);
    }
  }
  });
  return r;
}

// Factors to float32: n of them from p.
inline void ToFloats(const float* p, int64_t n, float* out) { std::memcpy(out, p, n * 4); }
inline void ToFloats(const uint16_t* p, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
  for (; i + 4 <= n; i += 4)
    _mm_storeu_ps(out + i, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < n; ++i) out[i] = to_float(p[i]);
}

// How a chunk's lanes find their weight scales: groups of 16 (4 or 2 per chunk), of 32, or
// of whole chunks.
enum ScaleMode { kGroup16, kGroup32, kGroupChunks };

// out[t0 + a, o0 + r] for a < NT, r < nr. The codes' term by vector sums over chunks (gf:
// each row's group scales, as float32; chunk_group: each chunk's first group); the offset
// term (the offsets gm, and for int8 the -128 x scale of the flipped codes) by a plain sum
// over groups against x's per-group sums.
template <Format kFormat, ScaleMode kMode, int NT>
void IntMicroKernel(const QuantizedX& xq, const float* group_sum, int64_t t0,
                    const uint8_t* const* rows, const float* gf, const float* gm,
                    const int32_t* chunk_group, bool has_offset, int nr, int64_t in,
                    int64_t groups, float* out, int64_t num_out, int64_t o0) {
  typename Vec::F acc[NT][kRows];
  for (int a = 0; a < NT; ++a)
    for (int r = 0; r < kRows; ++r) acc[a][r] = Vec::Zero();
  constexpr int64_t kBytes = kFormat == kInt4 ? Vec::kChunk / 2 : Vec::kChunk;
  for (int64_t c = 0; c < in / Vec::kChunk; ++c) {
    typename Vec::I xv[NT];
    typename Vec::F dv[NT];
    for (int a = 0; a < NT; ++a) {
      xv[a] = Vec::LoadX(xq.q.data() + (t0 + a) * in + c * Vec::kChunk);
      dv[a] = Vec::Load(xq.lane_scale.data() + (t0 + a) * in / 4 + c * Vec::kChunk / 4);
    }
    const int64_t g = chunk_group[c];
    for (int r = 0; r < kRows; ++r) {
      const typename Vec::I w = kFormat == kInt4 ? Vec::LoadInt4(rows[r] + c * kBytes)
                                                 : Vec::LoadInt8(rows[r] + c * kBytes);
      const float* f = gf + r * groups + g;
      const typename Vec::F s = kMode == kGroup16   ? Vec::Expand(f)
                                : kMode == kGroup32 ? Vec::Expand32(f)
                                                    : Vec::Broadcast(f);
      for (int a = 0; a < NT; ++a)
        acc[a][r] = Vec::Fma(Vec::Dot(w, xv[a]), Vec::Mul(s, dv[a]), acc[a][r]);
    }
  }
  for (int a = 0; a < NT; ++a) {
    const float* xs = group_sum + (t0 + a) * groups;
    for (int r = 0; r < nr; ++r) {
      float sum = Vec::Sum(acc[a][r]);
      if (has_offset) {
        float off = 0.f;
        for (int64_t j = 0; j < groups; ++j) off += gm[r * groups + j] * xs[j];
        sum += off;
      }
      if constexpr (kFormat == kInt8) {
        float flip = 0.f;
        for (int64_t j = 0; j < groups; ++j) flip += gf[r * groups + j] * xs[j];
        sum -= 128.f * flip;
      }
      out[(t0 + a) * num_out + o0 + r] = sum;
    }
  }
}

template <Format kFormat, ScaleMode kMode, typename ST>
void RunInt(ffi::ThreadPool& pool, const float* x, const Weights<ST>& ws, bool has_offset,
            int64_t num_t, int64_t in, int64_t groups) {
  const QuantizedX xq = QuantizeX(pool, x, num_t, in);
  const int64_t subs = in / kSub, group_size = in / groups, subs_per_group = group_size / kSub;
  const int64_t row_bytes = ws.row_bytes;
  std::vector<int32_t> chunk_group(in / Vec::kChunk);
  for (size_t c = 0; c < chunk_group.size(); ++c)
    chunk_group[c] = static_cast<int32_t>(c * Vec::kChunk / group_size);
  std::vector<float> group_sum(num_t * groups, 0.f);  // x's scale x code sums per weight group
  for (int64_t t = 0; t < num_t; ++t)
    for (int64_t s = 0; s < subs; ++s)
      group_sum[t * groups + s / subs_per_group] += xq.scaled_sum[t * subs + s];
  const int64_t grain = jaxllm::Grain(pool, ws.num_blocks);
  jaxllm::ParallelFor(pool, ws.num_blocks, grain, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> gf, gm;
    gf.resize(kRows * groups);
    gm.resize(has_offset ? kRows * groups : 0);
    const int64_t ahead = ws.Ahead();
    for (int64_t blk = b0; blk < b1; ++blk) {
      int64_t o0;
      const auto& m = ws.Of(blk, &o0);
      const int nr = static_cast<int>(std::min<int64_t>(kRows, m.num_out - o0));
      ws.Prefetch(blk + ahead, b1);
      // The block's rows are contiguous in q, scale and offset: their factors convert in one
      // run. Past the last row: repeat it (computed, never written).
      const uint8_t* rows[kRows];
      for (int r = 0; r < kRows; ++r) rows[r] = m.q + (o0 + std::min(r, nr - 1)) * row_bytes;
      ToFloats(m.scale + o0 * groups, nr * groups, gf.data());
      if (has_offset) ToFloats(m.offset + o0 * groups, nr * groups, gm.data());
      for (int r = nr; r < kRows; ++r) {
        std::copy_n(gf.data() + (nr - 1) * groups, groups, gf.data() + r * groups);
        if (has_offset) std::copy_n(gm.data() + (nr - 1) * groups, groups, gm.data() + r * groups);
      }
      ForInputRowBlocks(num_t, [&](auto nt, int64_t t0) {
        IntMicroKernel<kFormat, kMode, decltype(nt)::value>(
            xq, group_sum.data(), t0, rows, gf.data(), gm.data(), chunk_group.data(),
            has_offset, nr, in, groups, m.out, m.num_out, o0);
      });
    }
  });
}
#else
#define JAXLLM_INT_PATH "float"
#endif

// Whether the integer path takes this matmul (int8 or int4 codes, whole vectors of inputs,
// weight groups of 16, 32 or whole vectors), and how its scales are read.
bool IntPathTakes(Format format, int64_t in, int64_t groups, int* mode) {
#ifdef JAXLLM_INT_PATH_ENABLED
  const int64_t group_size = in / groups;
  if (format == kFp8 || in % Vec::kChunk) return false;
  if (group_size == 16) return *mode = kGroup16, true;
  if (group_size == 32) return *mode = kGroup32, true;
  if (group_size % Vec::kChunk == 0) return *mode = kGroupChunks, true;
#endif
  (void)format, (void)in, (void)groups, (void)mode;
  return false;
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
    if constexpr (F != kFp8) {
#ifdef JAXLLM_INT_PATH_ENABLED
      int mode = 0;
      if (IntPathTakes(F, in, groups, &mode)) {
        const float* xp = x.typed_data();
        if (mode == kGroup16)
          RunInt<F, kGroup16, ST>(pool, xp, ws, has_offset, num_t, in, groups);
        else if (mode == kGroup32)
          RunInt<F, kGroup32, ST>(pool, xp, ws, has_offset, num_t, in, groups);
        else
          RunInt<F, kGroupChunks, ST>(pool, xp, ws, has_offset, num_t, in, groups);
        return;
      }
#endif
    }
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

// Which path int8 and int4 matmuls take in this build: "avx512_vnni", "avx_vnni" or "float".
extern "C" const char* JaxllmQuantMatmulPath() { return JAXLLM_INT_PATH; }
