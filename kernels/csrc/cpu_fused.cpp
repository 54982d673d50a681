// Fused elementwise ops of a decoder layer, float32 on the CPU: RMSNorm (optionally after the
// residual add), rotate-half rotary embedding in place, and act(gate) * up (SiLU or GELU-tanh).
// At decode sizes each torch op costs a few microseconds of dispatch for almost no arithmetic;
// these do each step in one call.
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "plait_kernels.h"
#include "vec_math.h"

namespace {

inline void rms_norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

inline int threads_for(int64_t rows, int num_threads) { return rows >= 8 ? num_threads : 1; }

}  // namespace

// out[t] = rmsnorm(x[t]) * w
extern "C" void plait_rms_norm_f32(const float* x, const float* w, float* out, int64_t rows, int64_t d, float eps,
                                   int num_threads) {
    plait::parallel_for(rows, threads_for(rows, num_threads), false,
                        [&](int64_t t) { rms_norm_row(x + t * d, w, out + t * d, d, eps); });
}

// residual[t] += x[t]; out[t] = rmsnorm(residual[t]) * w
extern "C" void plait_add_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int64_t rows,
                                       int64_t d, float eps, int num_threads) {
    plait::parallel_for(rows, threads_for(rows, num_threads), false, [&](int64_t t) {
        float* r = residual + t * d;
        const float* xr = x + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) r[i] += xr[i];
        rms_norm_row(r, w, out + t * d, d, eps);
    });
}

// Rotate-half rotary embedding in place on q [T, hq, D] and k [T, hk, D] (rows `q_stride` /
// `k_stride` floats apart, so q and k may be views into one fused qkv row), from the token's
// position and inv_freq [D / 2]: angle = pos * inv_freq[i] for dims i and i + D / 2.
extern "C" void plait_rope_f32(float* q, float* k, const int64_t* positions, const float* inv_freq, int64_t tokens,
                               int64_t hq, int64_t hk, int64_t head_dim, int64_t q_stride, int64_t k_stride,
                               int num_threads) {
    const int64_t half = head_dim / 2;
    plait::parallel_for(tokens, threads_for(tokens, num_threads), false, [&](int64_t t) {
        float cs[512], sn[512];  // head_dim <= 1024
        const float pos = static_cast<float>(positions[t]);
        for (int64_t i = 0; i < half; ++i) {
            const float a = pos * inv_freq[i];
            cs[i] = std::cos(a);
            sn[i] = std::sin(a);
        }
        auto rotate = [&](float* base, int64_t heads) {
            for (int64_t h = 0; h < heads; ++h) {
                float* x = base + h * head_dim;
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = x[i], x2 = x[i + half];
                    x[i] = x1 * cs[i] - x2 * sn[i];
                    x[i + half] = x2 * cs[i] + x1 * sn[i];
                }
            }
        };
        rotate(q + t * q_stride, hq);
        rotate(k + t * k_stride, hk);
    });
}

namespace {

// gelu_tanh(g) = 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), written as
// g * sigmoid(2 u) = g / (1 + exp(-2 u)): the same function through the one exp the SiLU uses.
constexpr float GELU_C = 0.7978845608028654f, GELU_A = 0.044715f;

// out[t, i] = act(gate_up[t, i]) * gate_up[t, inter + i]
template <bool Gelu>
void gated_mul(const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads) {
    plait::parallel_for(rows, threads_for(rows, num_threads), false, [&](int64_t t) {
        const float* g = gate_up + t * 2 * inter;
        const float* u = g + inter;
        float* o = out + t * inter;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= inter; i += 8) {  // libm's scalar expf was most of this op's time
            const __m256 gv = _mm256_loadu_ps(g + i);
            __m256 arg = gv;  // silu: g / (1 + exp(-g))
            if constexpr (Gelu) {
                const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
                arg = _mm256_mul_ps(_mm256_set1_ps(2.0f * GELU_C),
                                    _mm256_fmadd_ps(_mm256_set1_ps(GELU_A), cube, gv));
            }
            const __m256 e = plait::exp256(_mm256_sub_ps(_mm256_setzero_ps(), arg));
            _mm256_storeu_ps(o + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), _mm256_add_ps(one, e)));
        }
#endif
        for (; i < inter; ++i) {
            const float arg = Gelu ? 2.0f * GELU_C * (g[i] + GELU_A * g[i] * g[i] * g[i]) : g[i];
            o[i] = g[i] / (1.0f + std::exp(-arg)) * u[i];
        }
    });
}

}  // namespace

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]
extern "C" void plait_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads) {
    gated_mul<false>(gate_up, out, rows, inter, num_threads);
}

// out[t, i] = gelu_tanh(gate_up[t, i]) * gate_up[t, inter + i]
extern "C" void plait_gelu_tanh_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter,
                                        int num_threads) {
    gated_mul<true>(gate_up, out, rows, inter, num_threads);
}
