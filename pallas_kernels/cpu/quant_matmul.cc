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
// Work: output rows in blocks of kRows, spread over OpenMP threads. A block's rows are
// dequantized into an f32 buffer once (at most kRows x I floats, L1/L2-resident), then every
// block of up to kT input rows runs a register micro-kernel over I: kT x kRows vector
// accumulators, each buffer vector loaded once per kT rows and each x vector once per kRows
// rows. A decode (T = 1) is bound by reading q; a prefill reuses each buffer T / kT times.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "e4m3.h"
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
constexpr int kT = 4;     // input rows per micro-kernel call

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

template <Format kFormat, typename ST>
void Run(const float* x, const uint8_t* q, const ST* scale, const ST* offset,
         bool has_offset, int64_t num_t, int64_t in, int64_t num_out, int64_t groups, float* out) {
  const int64_t num_blocks = (num_out + kRows - 1) / kRows;
  const int64_t group_size = in / groups;
  auto dequant = group_size == 32   ? DequantRow<kFormat, ST, 32>
                 : group_size == 16 ? DequantRow<kFormat, ST, 16>
                                    : DequantRow<kFormat, ST, 0>;
#pragma omp parallel
  {
    // Rows past the last real one are zero, so the micro-kernel may always run kRows rows.
    float* buf = new float[kRows * in]();
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      const int64_t o0 = blk * kRows;
      const int nr = static_cast<int>(std::min<int64_t>(kRows, num_out - o0));
      for (int r = 0; r < nr; ++r)
        dequant(q, scale, offset, has_offset, o0 + r, in, groups, buf + r * in);
      for (int r = nr; r < kRows; ++r) std::fill(buf + r * in, buf + (r + 1) * in, 0.f);
      int64_t t0 = 0;
      for (; t0 + kT <= num_t; t0 += kT) MicroKernel<kT>(x, t0, buf, nr, in, out, num_out, o0);
      switch (num_t - t0) {
        case 3: MicroKernel<3>(x, t0, buf, nr, in, out, num_out, o0); break;
        case 2: MicroKernel<2>(x, t0, buf, nr, in, out, num_out, o0); break;
        case 1: MicroKernel<1>(x, t0, buf, nr, in, out, num_out, o0); break;
        default: break;
      }
    }
    delete[] buf;
  }
}

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                ffi::AnyBuffer offset, int64_t format, bool has_offset,
                ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: x, q and scale must be 2-D");
  const int64_t num_t = xd[0], in = xd[1], num_out = qd[0], groups = sd[1];
  if (sd[0] != num_out || groups < 1 || in % groups)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: scale must be [O, G], G dividing I");
  if (has_offset && (offset.dimensions().size() != 2 || offset.dimensions()[0] != num_out ||
                     offset.dimensions()[1] != groups))
    return ffi::Error::InvalidArgument("quant_matmul_cpu: offset must be shaped as scale");
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.untyped_data());
  if (scale.element_type() != offset.element_type() ||
      (scale.element_type() != ffi::F32 && scale.element_type() != ffi::F16))
    return ffi::Error::InvalidArgument(
        "quant_matmul_cpu: scale and offset must both be float32 or both float16");
  const bool half = scale.element_type() == ffi::F16;
  auto run = [&](auto fmt) {
    constexpr Format F = decltype(fmt)::value;
    if (half)
      Run<F, uint16_t>(x.typed_data(), qp, static_cast<const uint16_t*>(scale.untyped_data()),
                       static_cast<const uint16_t*>(offset.untyped_data()), has_offset, num_t,
                       in, num_out, groups, out->typed_data());
    else
      Run<F, float>(x.typed_data(), qp, static_cast<const float*>(scale.untyped_data()),
                    static_cast<const float*>(offset.untyped_data()), has_offset, num_t, in,
                    num_out, groups, out->typed_data());
  };
  if (format == kInt8) {
    if (q.element_type() != ffi::S8 || qd[1] != in)
      return ffi::Error::InvalidArgument("quant_matmul_cpu: int8 q must be int8 [O, I]");
    run(std::integral_constant<Format, kInt8>());
  } else if (format == kInt4) {
    if (q.element_type() != ffi::U8 || qd[1] * 2 != in || (in / groups) % 32)
      return ffi::Error::InvalidArgument(
          "quant_matmul_cpu: int4 q must be uint8 [O, I / 2] with groups of 32k elements");
    run(std::integral_constant<Format, kInt4>());
  } else if (format == kFp8) {
    if (q.element_type() != ffi::F8E4M3FN || qd[1] != in)
      return ffi::Error::InvalidArgument("quant_matmul_cpu: fp8 q must be float8_e4m3fn [O, I]");
    run(std::integral_constant<Format, kFp8>());
  } else {
    return ffi::Error::InvalidArgument("quant_matmul_cpu: format must be 0, 1 or 2");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmQuantMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, I]
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // scale [O, G]
                                  .Arg<ffi::AnyBuffer>()         // offset [O, G] or [1, 1]
                                  .Attr<int64_t>("format")
                                  .Attr<bool>("has_offset")
                                  .Ret<ffi::Buffer<ffi::F32>>());
