// Vector math shared by the CPU kernels (AVX2, and AVX-512 where built for it).
#pragma once
#ifdef __AVX2__
#include <immintrin.h>

#include <cmath>

namespace plait {
// exp for 8 floats: Cody-Waite range reduction and a degree-5 polynomial (~1 ulp over the range
// softmax uses, inputs <= 0; inputs are clamped to [-87.3, 88.4]).
inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504019f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
// exp256 for 16 floats (the same reduction and polynomial).
inline __m512 exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365447504019f);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

// Float vectors by width, for kernels templated over it (8 floats on AVX2, 16 on AVX-512).
struct F8 {
    using R = __m256;
    static constexpr int W = 8;
    static R zero() { return _mm256_setzero_ps(); }
    static R set1(float x) { return _mm256_set1_ps(x); }
    static R load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
    static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
    static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
    static R add(R a, R b) { return _mm256_add_ps(a, b); }
    static R max(R a, R b) { return _mm256_max_ps(a, b); }
    static float hsum(R v) {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
    }
    static float hmax(R v) {
        __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_max_ps(x, _mm_movehl_ps(x, x));
        return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
    }
    // exp(s - m), and 0 where s is -inf (exp clamps its input, which would leave a tiny positive)
    static R exp_shifted(R s, R m) {
        return _mm256_and_ps(exp256(_mm256_sub_ps(s, m)), _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    }
};

#ifdef __AVX512F__
struct F16 {
    using R = __m512;
    static constexpr int W = 16;
    static R zero() { return _mm512_setzero_ps(); }
    static R set1(float x) { return _mm512_set1_ps(x); }
    static R load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
    static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
    static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
    static R add(R a, R b) { return _mm512_add_ps(a, b); }
    static R max(R a, R b) { return _mm512_max_ps(a, b); }
    static float hsum(R v) { return _mm512_reduce_add_ps(v); }
    static float hmax(R v) { return _mm512_reduce_max_ps(v); }
    static R exp_shifted(R s, R m) {
        return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                   exp512(_mm512_sub_ps(s, m)));
    }
};
#endif

}  // namespace plait
#endif
