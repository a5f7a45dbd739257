// float8_e4m3fn decoding, shared by the native CPU kernels: CPUs have no fp8 arithmetic, so
// each byte is widened through a 256-entry table (as cheap as an int8 convert).
#pragma once

#include <array>
#include <cmath>

namespace jaxllm {

// Sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff are NaN.
inline std::array<float, 256> MakeE4M3Table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
    if (e == 15 && m == 7) v = NAN;
    t[b] = (b & 128) ? -v : v;
  }
  return t;
}

inline const std::array<float, 256> kE4M3 = MakeE4M3Table();

}  // namespace jaxllm
