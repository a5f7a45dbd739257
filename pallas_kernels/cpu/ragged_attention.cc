// Ragged paged attention for the CPU, called from JAX through the XLA FFI.
//
// The contract is the one of every backend in pallas_kernels (see __init__.py): q [T, N, H],
// the paged cache [L, num_pages, K, page_size, 2H] (per page and kv head, a row per token: its key
// then its value),
// seq_lens [R], block_tables [R, P], cu_q_lens [R + 1], num_seqs [1], sliding_window [1];
// request r's queries are rows cu_q_lens[r]:cu_q_lens[r + 1], the last of its seq_lens[r]
// tokens, whose K/V are already in the cache. Rows of padding requests (r >= num_seqs) are
// zero. The window is an operand, not an attribute, so a layer scan can pass each layer's own
// (w >= 1: a query at position q sees keys q - w < k <= q; <= 0: no window).
// sinks [N] (gpt-oss; a dummy [0] for none): each head's sink logit joins its softmax's
// denominator as one more key with a zero value, folded in when a work item's rows are written.
// attention_chunk C (an attribute; 0: none; Llama 4): a query at q sees keys k >= (q / C) * C.
//
// Why a kernel of our own: in XLA on the CPU, attention over a paged cache means gathering the
// pages into a copy, then transposing it for batched matmuls whose "M" is the GQA group (3 for
// the demo model), which XLA runs at a few GFLOP/s; 64 decodes of 256 tokens took ~7 ms per
// layer for 25 MB of K/V. Here each page is read in place, once per work item.
//
// Work items: (request, block of up to kQueryBlock query rows, kv head), spread over XLA's
// intra-op threads (parallel.h). An item walks the tokens its rows can see (causal, and the
// sliding window: no token before its first row's window is read) in tiles of kTile tokens,
// each token's row found through the block table (any page size):
//   - the tile's K and V rows for the item's kv head are read once into f32 buffers;
//   - scores: a decode item has few query vectors (the GQA group of one row), so each score is
//     a dot product over H; a prefill item has many, so the keys are transposed to [H][kTile]
//     and four queries at a time accumulate H broadcast multiply-adds over a vector of kTile
//     lanes (no horizontal sums);
//   - an online softmax per query vector (row, q head of the group) folds the tile in, and the
//     values are added as p[j] * v[j][:], a vector over H.
// The head size is a template parameter for the usual sizes, so those loops unroll.
// Only tokens below a request's length are read, so whatever unused slots hold (stale data, or
// NaN in the tests) never reaches a result.
//
// An 8-bit cache (int8, or float8_e4m3fn stored as its bytes, uint8, and read through a 256-entry
// table) comes with its scales
// f32[L, num_pages, 1, 2K * page_size] (the same order as [2K][page_size] per page): each
// token's K and V rows are widened and scaled as the tile
// is read, so the rest of the item is the float code. A float cache passes a dummy f32[1].

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "e4m3.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kQueryBlock = 32;     // query rows per work item
constexpr float kMasked = -1e30f;   // a score that exp() turns into 0; finite on purpose

struct E4M3 {  // float8_e4m3fn, as stored
  uint8_t bits;
};

using jaxllm::kE4M3;  // e4m3.h

inline float to_float(E4M3 x) { return kE4M3[x.bits]; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

struct Shape {
  int64_t num_tokens, num_heads, head_dim, num_pages, page_size, num_kv_heads, group;
  int64_t max_reqs, pages_per_seq;
};

struct Item {
  int32_t req, row0, num_rows, kv_head;
};

struct Params {
  float sm_scale;
  int64_t sliding_window;  // <= 0: none
  float soft_cap;          // 0: none
  const int32_t* attend_to;  // [T]: the last key each query sees past itself; null: causal
  const float* sinks;        // [N]: each head's sink logit (gpt-oss); null: none
  int64_t attention_chunk;   // 0: none
};

constexpr int kTile = 16;        // tokens per step of the online softmax
constexpr int kDirectVecs = 4;   // up to this many query vectors: dot products, no transpose

// One work item. HD is the head size when known at compile time (0: use s.head_dim), so the
// loops over it unroll and vectorize.
// `layer_scales`: this layer's [num_pages, 2K * page_size] scales of an 8-bit cache, else null.
template <int HD, typename QT, typename CT>
void RunItem(const Item& item, const Shape& s, const Params& prm, const QT* q, const CT* layer_kv,
             const float* layer_scales, const int32_t* seq_lens, const int32_t* block_tables,
             const int32_t* cu, QT* out) {
  const int64_t H = HD > 0 ? HD : s.head_dim;
  const int64_t G = s.group, PS = s.page_size;
  const int64_t row = 2 * H;  // elements of a token's K and V row
  const int64_t num_vecs = item.num_rows * G;            // query vectors: (row, head of group)
  const int64_t q_len = cu[item.req + 1] - cu[item.req];
  const int64_t seq_len = seq_lens[item.req];
  const int64_t first_pos = seq_len - q_len + (item.row0 - cu[item.req]);

  std::vector<float> qv(num_vecs * H), acc(num_vecs * H, 0.0f);
  std::vector<float> m(num_vecs, kMasked), l(num_vecs, 0.0f);
  std::vector<float> kt(H * kTile), kf(kTile * H), vf(kTile * H), sc(num_vecs * kTile);
  for (int64_t i = 0; i < item.num_rows; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const QT* src = q + ((item.row0 + i) * s.num_heads + item.kv_head * G + g) * H;
      float* dst = &qv[(i * G + g) * H];
      for (int64_t h = 0; h < H; ++h) dst[h] = to_float(src[h]) * prm.sm_scale;
    }
  }
  // The last key each row sees: its own position, or past it in this step (attend_to).
  std::vector<int64_t> last(item.num_rows);
  int64_t last_pos = first_pos + item.num_rows - 1;
  for (int64_t i = 0; i < item.num_rows; ++i) {
    last[i] = first_pos + i;
    if (prm.attend_to != nullptr)
      last[i] = std::min<int64_t>(std::max<int64_t>(last[i], prm.attend_to[item.row0 + i]),
                                  seq_len - 1);
    last_pos = std::max(last_pos, last[i]);
  }
  // Keys the item's rows may see: [lo, hi).
  const int64_t hi = std::min(last_pos + 1, seq_len);
  int64_t lo =
      prm.sliding_window > 0 ? std::max<int64_t>(0, first_pos - prm.sliding_window + 1) : 0;
  if (prm.attention_chunk > 0)  // the first row's chunk starts first
    lo = std::max<int64_t>(lo, first_pos / prm.attention_chunk * prm.attention_chunk);
  const int32_t* table = block_tables + item.req * s.pages_per_seq;
  const CT* rows[kTile];
  float k_scale[kTile], v_scale[kTile];

  for (int64_t t0 = lo - lo % kTile; t0 < hi; t0 += kTile) {
    // The tile's valid tokens [j0, j1) (relative to t0), their K and V rows as f32.
    const int64_t j0 = std::max<int64_t>(lo - t0, 0), j1 = std::min<int64_t>(hi - t0, kTile);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t t = t0 + j, page = table[t / PS];
      rows[j] = layer_kv + ((page * s.num_kv_heads + item.kv_head) * PS + t % PS) * row;
      if (layer_scales != nullptr) {
        const float* sp = layer_scales + (page * 2 * s.num_kv_heads + 2 * item.kv_head) * PS;
        k_scale[j] = sp[t % PS];
        v_scale[j] = sp[PS + t % PS];
      }
    }
    for (int64_t j = 0; j < kTile; ++j) {
      float* kd = &kf[j * H];
      float* vd = &vf[j * H];
      if (j < j0 || j >= j1) {
        for (int64_t h = 0; h < H; ++h) kd[h] = vd[h] = 0.0f;
        continue;
      }
      const CT* kr = rows[j];
      if (layer_scales != nullptr) {
        const float ks = k_scale[j], vs = v_scale[j];
        for (int64_t h = 0; h < H; ++h) kd[h] = to_float(kr[h]) * ks;
        for (int64_t h = 0; h < H; ++h) vd[h] = to_float(kr[H + h]) * vs;
        continue;
      }
      for (int64_t h = 0; h < H; ++h) kd[h] = to_float(kr[h]);
      for (int64_t h = 0; h < H; ++h) vd[h] = to_float(kr[H + h]);
    }
    // Scores sc[vec][j] for the whole tile (masking comes after).
    if (num_vecs <= kDirectVecs) {
      for (int64_t vec = 0; vec < num_vecs; ++vec) {
        const float* qq = &qv[vec * H];
        for (int64_t j = 0; j < kTile; ++j) {
          const float* kd = &kf[j * H];
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t h = 0; h < H; ++h) dot += qq[h] * kd[h];
          sc[vec * kTile + j] = dot;
        }
      }
    } else {
      for (int64_t j = 0; j < kTile; ++j)
        for (int64_t h = 0; h < H; ++h) kt[h * kTile + j] = kf[j * H + h];
      int64_t vec = 0;
      for (; vec + 4 <= num_vecs; vec += 4) {  // four independent accumulators
        float a0[kTile] = {}, a1[kTile] = {}, a2[kTile] = {}, a3[kTile] = {};
        const float *q0 = &qv[vec * H], *q1 = q0 + H, *q2 = q1 + H, *q3 = q2 + H;
        for (int64_t h = 0; h < H; ++h) {
          const float* kr = &kt[h * kTile];
#pragma omp simd
          for (int j = 0; j < kTile; ++j) {
            a0[j] += q0[h] * kr[j];
            a1[j] += q1[h] * kr[j];
            a2[j] += q2[h] * kr[j];
            a3[j] += q3[h] * kr[j];
          }
        }
        for (int j = 0; j < kTile; ++j) {
          sc[vec * kTile + j] = a0[j];
          sc[(vec + 1) * kTile + j] = a1[j];
          sc[(vec + 2) * kTile + j] = a2[j];
          sc[(vec + 3) * kTile + j] = a3[j];
        }
      }
      for (; vec < num_vecs; ++vec) {
        float a0[kTile] = {};
        const float* q0 = &qv[vec * H];
        for (int64_t h = 0; h < H; ++h) {
          const float* kr = &kt[h * kTile];
#pragma omp simd
          for (int j = 0; j < kTile; ++j) a0[j] += q0[h] * kr[j];
        }
        for (int j = 0; j < kTile; ++j) sc[vec * kTile + j] = a0[j];
      }
    }
    // Online softmax and values, per query vector.
    for (int64_t vec = 0; vec < num_vecs; ++vec) {
      const int64_t pos = first_pos + vec / G;
      // Tokens this query sees in the tile: [a, b).
      int64_t a = j0, b = std::min<int64_t>(j1, last[vec / G] + 1 - t0);
      if (prm.sliding_window > 0) a = std::max<int64_t>(a, pos - prm.sliding_window + 1 - t0);
      if (prm.attention_chunk > 0)
        a = std::max<int64_t>(a, pos / prm.attention_chunk * prm.attention_chunk - t0);
      if (b <= a) continue;
      float* st = &sc[vec * kTile];
      if (prm.soft_cap > 0)
        for (int j = 0; j < kTile; ++j) st[j] = prm.soft_cap * std::tanh(st[j] / prm.soft_cap);
      float tile_max = kMasked;
      for (int j = 0; j < kTile; ++j)
        tile_max = std::max(tile_max, (j >= a && j < b) ? st[j] : kMasked);
      const float m_new = std::max(m[vec], tile_max);
      const float alpha = std::exp(m[vec] - m_new);
      float p[kTile];
      float psum = 0.0f;
#pragma omp simd reduction(+ : psum)
      for (int j = 0; j < kTile; ++j) {
        const float e = std::exp(st[j] - m_new);
        p[j] = (j >= a && j < b) ? e : 0.0f;
        psum += p[j];
      }
      l[vec] = alpha * l[vec] + psum;
      m[vec] = m_new;
      float* o = &acc[vec * H];
      for (int64_t h = 0; h < H; ++h) o[h] *= alpha;
      for (int64_t j = a; j < b; ++j) {
        const float pj = p[j];
        const float* vd = &vf[j * H];
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) o[h] += pj * vd[h];
      }
    }
  }
  for (int64_t i = 0; i < item.num_rows; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t vec = i * G + g;
      float denom = l[vec], alpha = 1.0f;
      if (prm.sinks != nullptr) {  // one more key, of score `sink` and value zero
        const float sink = prm.sinks[item.kv_head * G + g], top = std::max(m[vec], sink);
        alpha = std::exp(m[vec] - top);
        denom = alpha * denom + std::exp(sink - top);
      }
      const float inv = denom > 0 ? alpha / denom : 0.0f;
      QT* dst = out + ((item.row0 + i) * s.num_heads + item.kv_head * G + g) * H;
      for (int64_t h = 0; h < H; ++h) from_float(acc[vec * H + h] * inv, &dst[h]);
    }
  }
}

template <typename QT, typename CT>
void Run(ffi::ThreadPool& pool, const Shape& s, const Params& prm, const QT* q, const CT* kv,
         const float* scales, int64_t layer, const int32_t* seq_lens,
         const int32_t* block_tables, const int32_t* cu, int64_t num_seqs, QT* out) {
  std::memset(out, 0, sizeof(QT) * s.num_tokens * s.num_heads * s.head_dim);
  std::vector<Item> items;
  for (int32_t r = 0; r < num_seqs; ++r) {
    for (int32_t row = cu[r]; row < cu[r + 1]; row += kQueryBlock) {
      const int32_t n = std::min<int32_t>(kQueryBlock, cu[r + 1] - row);
      for (int32_t k = 0; k < s.num_kv_heads; ++k) items.push_back({r, row, n, k});
    }
  }
  const int64_t layer_tokens = layer * s.num_pages * s.page_size * 2 * s.num_kv_heads;
  const CT* layer_kv = kv + layer_tokens * s.head_dim;
  const float* layer_scales = scales == nullptr ? nullptr : scales + layer_tokens;
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto run = [&](auto head_dim) {
    constexpr int HD = decltype(head_dim)::value;
    jaxllm::ParallelFor(pool, num_items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        RunItem<HD, QT, CT>(items[i], s, prm, q, layer_kv, layer_scales, seq_lens, block_tables,
                            cu, out);
    });
  };
  switch (s.head_dim) {
    case 16: run(std::integral_constant<int, 16>()); break;
    case 32: run(std::integral_constant<int, 32>()); break;
    case 64: run(std::integral_constant<int, 64>()); break;
    case 128: run(std::integral_constant<int, 128>()); break;
    case 256: run(std::integral_constant<int, 256>()); break;
    default: run(std::integral_constant<int, 0>()); break;
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                ffi::Buffer<ffi::F32> kv_scales,
                ffi::Buffer<ffi::S32> layer,
                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> block_tables,
                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                ffi::Buffer<ffi::S32> sliding_window, ffi::Buffer<ffi::S32> attend_to,
                ffi::Buffer<ffi::F32> sinks, float sm_scale, float soft_cap,
                int64_t attention_chunk, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions();
  auto cd = kv_cache.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || bd.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: bad ranks");
  if (cd[4] != 2 * qd[2] || qd[1] % cd[2])
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: q and cache shapes disagree");
  Shape s{qd[0], qd[1], qd[2], cd[1], cd[3], cd[2], qd[1] / cd[2], bd[0], bd[1]};
  // attend_to: [T], or a dummy [1] for plain causal attention (a one-token batch never
  // needs it: a token's block is itself).
  const bool attends = attend_to.element_count() == static_cast<size_t>(s.num_tokens) &&
                       s.num_tokens > 1;
  // sinks: [N], or a dummy [0] for none.
  if (sinks.element_count() != 0 && sinks.element_count() != static_cast<size_t>(s.num_heads))
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: sinks must be [num_heads]");
  Params prm{sm_scale, sliding_window.typed_data()[0], soft_cap,
             attends ? attend_to.typed_data() : nullptr,
             sinks.element_count() != 0 ? sinks.typed_data() : nullptr, attention_chunk};
  const int64_t lay = layer.typed_data()[0];
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], s.max_reqs);
  const int32_t* sl = seq_lens.typed_data();
  const int32_t* bt = block_tables.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  if (lay < 0 || lay >= cd[0])
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: layer out of range");
  // Checked here so that a bad batch is an error, not a read outside the cache.
  for (int64_t r = 0; r < n; ++r) {
    if (cu[r] < 0 || cu[r + 1] < cu[r] || cu[r + 1] > s.num_tokens ||
        sl[r] < cu[r + 1] - cu[r] || sl[r] > s.pages_per_seq * s.page_size)
      return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: bad request lengths");
    for (int64_t p = 0; p * s.page_size < sl[r]; ++p)
      if (bt[r * s.pages_per_seq + p] < 0 || bt[r * s.pages_per_seq + p] >= s.num_pages)
        return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: page id out of range");
  }
  const auto qt = q.element_type(), ct = kv_cache.element_type();
  const bool quantized = ct == ffi::S8 || ct == ffi::U8;
  if (quantized) {
    auto sd = kv_scales.dimensions();
    if (sd.size() != 4 || sd[0] != cd[0] || sd[1] != cd[1] || sd[2] != 1 ||
        sd[3] != 2 * cd[2] * cd[3])
      return ffi::Error::InvalidArgument(
          "ragged_paged_attention_cpu: an 8-bit cache needs scales "
          "[L, num_pages, 1, 2K * page_size]");
    if (qt != ffi::F32)
      return ffi::Error::InvalidArgument(
          "ragged_paged_attention_cpu: q must be float32 with an 8-bit cache");
  }
  const float* scales = quantized ? kv_scales.typed_data() : nullptr;
  if (qt == ffi::F32 && ct == ffi::F32) {
    Run<float, float>(pool, s, prm, q.typed_data<float>(), kv_cache.typed_data<float>(),
                      nullptr, lay, sl, bt, cu, n, out->typed_data<float>());
  } else if (qt == ffi::BF16 && ct == ffi::BF16) {
    Run<uint16_t, uint16_t>(pool, s, prm, reinterpret_cast<const uint16_t*>(q.untyped_data()),
                            reinterpret_cast<const uint16_t*>(kv_cache.untyped_data()), nullptr,
                            lay, sl, bt, cu, n, reinterpret_cast<uint16_t*>(out->untyped_data()));
  } else if (ct == ffi::S8) {
    Run<float, int8_t>(pool, s, prm, q.typed_data<float>(),
                       reinterpret_cast<const int8_t*>(kv_cache.untyped_data()), scales, lay, sl,
                       bt, cu, n, out->typed_data<float>());
  } else if (ct == ffi::U8) {  // float8_e4m3fn, as its bytes
    Run<float, E4M3>(pool, s, prm, q.typed_data<float>(),
                     reinterpret_cast<const E4M3*>(kv_cache.untyped_data()), scales, lay, sl, bt,
                     cu, n, out->typed_data<float>());
  } else {
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention_cpu: q and the cache must both be float32 or both bfloat16, or "
        "the cache int8 / uint8 (float8_e4m3fn bytes) with its scales");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmRaggedPagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // kv_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // kv_scales (or a dummy [1])
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding_window
                                  .Arg<ffi::Buffer<ffi::S32>>()   // attend_to (or a dummy [1])
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks (or a dummy [0])
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("attention_chunk")
                                  .Ret<ffi::AnyBuffer>());
