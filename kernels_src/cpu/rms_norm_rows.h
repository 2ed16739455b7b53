// RMSNorm row kernels for the CPU, written once over an 8-wide fp32 vector type `F8` and compiled three times by
// rms_norm.cpp: inside `#pragma GCC target("avx2,fma,f16c")` as namespace `avx2` with FUSED_MLP_ROWS_AVX2 = 1
// (F8 = __m256, F16C half conversions), the same with AVX-512 and FUSED_MLP_ROWS_AVX512BF16 = 1 as namespace
// `avx512` (VCVTNEPS2BF16 bf16 stores), and for baseline x86-64 as namespace `base` (F8 = float[8], Half/BFloat16
// conversions). The includer sets the macros: `#pragma GCC target` does not define __AVX2__/__F16C__ (GCC 12).
// No include guard: FUSED_MLP_ROWS_NS names the namespace of each copy. Per row only; threading is the caller's.
//
// Numerics: fp32 math, results rounded once (round-to-nearest-even, NaN preserved) on store.

namespace fused_mlp::cpu::FUSED_MLP_ROWS_NS {

#if FUSED_MLP_ROWS_AVX2
struct F8 {
  __m256 v;
};
inline F8 zero8() { return {_mm256_setzero_ps()}; }
inline F8 splat8(float s) { return {_mm256_set1_ps(s)}; }
inline F8 add(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F8 sub(F8 a, F8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F8 mul(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F8 fma(F8 a, F8 b, F8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline float hsum(F8 a) {
  alignas(32) float t[8];
  _mm256_store_ps(t, a.v);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
inline F8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline F8 load8(const Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline F8 load8(const BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline void store8(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
inline void store8(Half* p, F8 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}
// Round to nearest even like BFloat16(float): u + 0x7fff + lsb, NaN -> 0x7fc0.
inline void store8_bf16_int(BFloat16* p, F8 a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#if FUSED_MLP_ROWS_AVX512BF16
// VCVTNEPS2BF16 rounds to nearest even too, but reads denormal inputs as zero and keeps a NaN's sign and payload:
// a group of 8 values holding a NaN or a denormal takes the integer rounding, so every copy stores the same bits.
inline void store8(BFloat16* p, F8 a) {
  if (_mm256_fpclass_ps_mask(a.v, 0x01 | 0x20 | 0x80) != 0) {  // QNaN, denormal, SNaN
    store8_bf16_int(p, a);
    return;
  }
  const __m128bh b = _mm256_cvtneps_pbh(a.v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), reinterpret_cast<const __m128i&>(b));
}
#else
inline void store8(BFloat16* p, F8 a) { store8_bf16_int(p, a); }
#endif
#else
struct F8 {
  float v[8];
};
inline F8 zero8() { return F8{}; }
inline F8 splat8(float s) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = s;
  return r;
}
#define FUSED_MLP_F8_BINARY(name, expr)        \
  inline F8 name(F8 a, F8 b) {                  \
    F8 r;                                       \
    for (int j = 0; j < 8; ++j) r.v[j] = expr;  \
    return r;                                   \
  }
FUSED_MLP_F8_BINARY(add, a.v[j] + b.v[j])
FUSED_MLP_F8_BINARY(sub, a.v[j] - b.v[j])
FUSED_MLP_F8_BINARY(mul, a.v[j] * b.v[j])
#undef FUSED_MLP_F8_BINARY
inline F8 fma(F8 a, F8 b, F8 c) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = a.v[j] * b.v[j] + c.v[j];
  return r;
}
inline float hsum(F8 a) {
  const float* t = a.v;
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
template <typename T>
inline F8 load8(const T* p) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = static_cast<float>(p[j]);
  return r;
}
template <typename T>
inline void store8(T* p, F8 a) {
  for (int j = 0; j < 8; ++j) p[j] = static_cast<T>(a.v[j]);
}
#endif

// Scalar tail (N % 8): the same roundings as the vector stores (Half/BFloat16 and F16C both round to nearest even).
template <typename T>
inline float ld1(const T* p) { return static_cast<float>(*p); }
template <typename T>
inline void st1(T* p, float v) { *p = static_cast<T>(v); }

// Reductions over a row run in blocks of kBlock elements (vector accumulators), each block's sum added in
// fp64: the error stays at the level of a 32-term fp32 sum for any N (a plain running sum over N = 65536
// drifts by ~1e-6 relative, visible in fp32 outputs).
constexpr int64_t kBlock = 256;

// Forward of rows [begin, end): row r is x0 + r * xs ([N] TX), with a residual (kRes) also res0 + r * rss ([N] TH),
// whose h = round_TH(x + res) is written to h0 + r * N and normalised; s: [N] (offset + w) fp32 (kScale) or null;
// y: y0 + r * N ([N] TO); rstd: [M] fp32 or null.
// Each row takes two passes: the first sums the squares (and writes h), the output pass writes y. kOverlap runs row
// r's output pass together with row r + 1's first pass, so the next row streams in while y is written; without it
// the passes of a row run back to back. The sums (blocks of kBlock elements, fixed order) are the same either way.
template <bool kOverlap, bool kScale, bool kRes, typename TX, typename TH, typename TO>
void fwd_rows(const TX* x0, int64_t xs, const TH* res0, int64_t rss, TH* h0, const float* s, TO* y0, float* rstd,
              int64_t begin, int64_t end, int64_t N, float eps) {
  const int64_t n8 = N - N % 8;
  // Row q's first pass over the block [b, e) (q < 0: none), calling emit(i) for each 8 elements of the output pass
  // of the row before; returns the block's sum of squares.
  auto block = [&](int64_t q, int64_t b, int64_t e, auto&& emit) -> double {
    int64_t i = b;
    if (q < 0) {
      for (; i < e; i += 8) emit(i);
      return 0.0;
    }
    F8 a0 = zero8(), a1 = zero8();
    const TX* x = x0 + q * xs;
    if constexpr (kRes) {
      const TH* res = res0 + q * rss;
      TH* h = h0 + q * N;
      for (; i < e; i += 8) {
        store8(h + i, add(load8(x + i), load8(res + i)));
        const F8 hv = load8(h + i);  // exactly the rounded residual stream value
        a0 = fma(hv, hv, a0);
        emit(i);
      }
    } else {
      for (; i + 16 <= e; i += 16) {
        const F8 u = load8(x + i), v = load8(x + i + 8);
        a0 = fma(u, u, a0);
        a1 = fma(v, v, a1);
        emit(i);
        emit(i + 8);
      }
      for (; i < e; i += 8) {
        const F8 u = load8(x + i);
        a0 = fma(u, u, a0);
        emit(i);
      }
    }
    return static_cast<double>(hsum(add(a0, a1)));
  };
  // Row q's first pass over the tail (N % 8 elements).
  auto tail = [&](int64_t q) -> double {
    const TX* x = x0 + q * xs;
    float t = 0.f;
    for (int64_t i = n8; i < N; ++i) {
      float f;
      if constexpr (kRes) {
        TH* h = h0 + q * N;
        st1(h + i, ld1(x + i) + ld1(res0 + q * rss + i));
        f = ld1(h + i);
      } else {
        f = ld1(x + i);
      }
      t += f * f;
    }
    return static_cast<double>(t);
  };
  // Row q's first pass alone: its sum of squares.
  auto first = [&](int64_t q) -> double {
    double t = 0.0;
    for (int64_t b = 0; b < n8; b += kBlock) t += block(q, b, std::min(n8, b + kBlock), [](int64_t) {});
    return t + tail(q);
  };
  double ss = kOverlap ? first(begin) : 0.0;
  for (int64_t r = begin; r < end; ++r) {
    if constexpr (!kOverlap) ss = first(r);
    const float rs = 1.0f / std::sqrt(static_cast<float>(ss) / static_cast<float>(N) + eps);
    if (rstd != nullptr) rstd[r] = rs;
    const F8 rs8 = splat8(rs);
    const auto* src = [&] {
      if constexpr (kRes) {
        return static_cast<const TH*>(h0 + r * N);
      } else {
        return x0 + r * xs;
      }
    }();
    TO* y = y0 + r * N;
    auto emit = [&](int64_t i) {
      if constexpr (kScale) {
        store8(y + i, mul(mul(load8(src + i), rs8), load8(s + i)));
      } else {
        store8(y + i, mul(load8(src + i), rs8));
      }
    };
    const int64_t next = kOverlap && r + 1 < end ? r + 1 : -1;
    ss = 0.0;
    for (int64_t b = 0; b < n8; b += kBlock) ss += block(next, b, std::min(n8, b + kBlock), emit);
    for (int64_t i = n8; i < N; ++i) {
      if constexpr (kScale) {
        st1(y + i, ld1(src + i) * rs * s[i]);
      } else {
        st1(y + i, ld1(src + i) * rs);
      }
    }
    if (next >= 0) ss += tail(next);
  }
}

// Backward of one row: dx = rs * (g - xhat * mean(g * xhat)) + extra, g = dy * s, xhat = h * rs;
// dw_acc[i] += dy[i] * xhat[i] when dw_acc is given. s: (offset + w) fp32 or null.
template <typename TH, typename TD, typename TE, typename TX>
void bwd_row(const TH* h, const TD* dy, float rs, const float* s, const TE* extra, TX* dx, float* dw_acc,
             int64_t N) {
  const int64_t n8 = N - N % 8;
  const F8 rs8 = splat8(rs);
  double dot = 0.0;
  float tail = 0.f;
  for (int64_t b = 0; b < n8; b += kBlock) {
    const int64_t e = std::min(n8, b + kBlock);
    F8 d0 = zero8();
    for (int64_t i = b; i < e; i += 8) {
      const F8 xhat = mul(load8(h + i), rs8);
      const F8 d = load8(dy + i);
      const F8 g = s != nullptr ? mul(d, load8(s + i)) : d;
      d0 = fma(g, xhat, d0);
      if (dw_acc != nullptr) store8(dw_acc + i, fma(d, xhat, load8(dw_acc + i)));
    }
    dot += static_cast<double>(hsum(d0));
  }
  for (int64_t i = n8; i < N; ++i) {
    const float xhat = ld1(h + i) * rs;
    const float d = ld1(dy + i);
    tail += (s != nullptr ? d * s[i] : d) * xhat;
    if (dw_acc != nullptr) dw_acc[i] += d * xhat;
  }
  const float c = static_cast<float>(dot + static_cast<double>(tail)) / static_cast<float>(N);
  const F8 c8 = splat8(c);
  for (int64_t i = 0; i < n8; i += 8) {
    const F8 xhat = mul(load8(h + i), rs8);
    const F8 d = load8(dy + i);
    const F8 g = s != nullptr ? mul(d, load8(s + i)) : d;
    F8 o = mul(rs8, sub(g, mul(xhat, c8)));
    if (extra != nullptr) o = add(o, load8(extra + i));
    store8(dx + i, o);
  }
  for (int64_t i = n8; i < N; ++i) {
    const float xhat = ld1(h + i) * rs;
    const float d = ld1(dy + i);
    float o = rs * ((s != nullptr ? d * s[i] : d) - xhat * c);
    if (extra != nullptr) o += ld1(extra + i);
    st1(dx + i, o);
  }
}

// out[i] = sum_k parts[k * stride + i] for k in [0, K) (fixed order), rounded to T.
template <typename T>
void sum_columns(const float* parts, int64_t K, int64_t stride, int64_t begin, int64_t end, T* out) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    F8 t = zero8();
    for (int64_t k = 0; k < K; ++k) t = add(t, load8(parts + k * stride + i));
    store8(out + i, t);
  }
  for (; i < end; ++i) {
    float t = 0.f;
    for (int64_t k = 0; k < K; ++k) t += parts[k * stride + i];
    st1(out + i, t);
  }
}

}  // namespace fused_mlp::cpu::FUSED_MLP_ROWS_NS
