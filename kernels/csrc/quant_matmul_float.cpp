// The quantized matmul's float tier, on every CPU: the weights dequantized in registers (fused
// rows, up to MAX_FUSED_M rows of x) or in L1 tiles of TILE_N rows, against float32 activations.
// Each task dequantizes a tile of 4 weight rows into a float buffer that stays in L1, then runs
// every row of x against it (2 x 4 register tile). The weights are read once per call, as int8
// or int4, never inflated to a float32 matrix in memory.
#include "quant_matmul.h"

#include "parallel.h"

namespace plait::qmm {

// y[m, n0 + i] = x[m] . w[i] for i < nt (nt <= 4), m < M. `next`, if set, is the tile to come: its
// lines are prefetched while this one computes (without it, float32 weights read from memory run
// well behind the same weights from cache).
void tile_matmul(const float* x, int64_t M, int64_t K, const float* w, int64_t nt, float* y, int64_t ldy,
                 const float* next) {
    int64_t m = 0;
#ifdef __AVX2__
    if (nt == TILE_N && K % 8 == 0) {
        const char* ahead = reinterpret_cast<const char*>(next);
        const int64_t lines = next ? TILE_N * K * int64_t(sizeof(float)) / 64 : 0;
        const int64_t per_pair = (lines + M / 2) / std::max<int64_t>(1, M / 2);  // lines per 2 rows of x
        int64_t line = 0;
        const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
        auto hsum = [](__m256 v) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            s = _mm_hadd_ps(s, s);
            s = _mm_hadd_ps(s, s);
            return _mm_cvtss_f32(s);
        };
        for (; m + 2 <= M; m += 2) {
            for (const int64_t stop = std::min(lines, line + per_pair); line < stop; ++line)
                _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
            const float *xa = x + m * K, *xb = xa + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
                __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
                __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
                a0 = _mm256_fmadd_ps(va, v0, a0); a1 = _mm256_fmadd_ps(va, v1, a1);
                a2 = _mm256_fmadd_ps(va, v2, a2); a3 = _mm256_fmadd_ps(va, v3, a3);
                b0 = _mm256_fmadd_ps(vb, v0, b0); b1 = _mm256_fmadd_ps(vb, v1, b1);
                b2 = _mm256_fmadd_ps(vb, v2, b2); b3 = _mm256_fmadd_ps(vb, v3, b3);
            }
            float* ya = y + m * ldy;
            float* yb = ya + ldy;
            ya[0] = hsum(a0); ya[1] = hsum(a1); ya[2] = hsum(a2); ya[3] = hsum(a3);
            yb[0] = hsum(b0); yb[1] = hsum(b1); yb[2] = hsum(b2); yb[3] = hsum(b3);
        }
        for (; m < M; ++m) {
            const float* xa = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                __m256 va = _mm256_loadu_ps(xa + k);
                a0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w0 + k), a0);
                a1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w1 + k), a1);
                a2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w2 + k), a2);
                a3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w3 + k), a3);
            }
            float* ya = y + m * ldy;
            ya[0] = hsum(a0); ya[1] = hsum(a1); ya[2] = hsum(a2); ya[3] = hsum(a3);
        }
        return;
    }
#endif
    for (; m < M; ++m)
        for (int64_t i = 0; i < nt; ++i) {
            float s = 0.0f;
            const float* xr = x + m * K;
            const float* wr = w + i * K;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; ++k) s += xr[k] * wr[k];
            y[m * ldy + i] = s;
        }
}

namespace {

// Few rows of x (decode): no tile buffer. Each weight row is unpacked in registers and dotted
// with every row of x directly; group scales multiply a per-group partial sum, and the int4
// minimum multiplies the precomputed sum of x over the group (sum_g q*s*x + m*x = s*(q.x) + m*sum x).

template <int M>
void fused_rows(const float* x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const void* qweight,
                int format, int64_t group, const void* scales, const void* mins, const float* xsum,
                const float* bias, float* y) {
    const int64_t groups = K / group;
    for (int64_t n = n_begin; n < n_end; ++n) {
        float out[M];
        for (int m = 0; m < M; ++m) out[m] = 0.0f;
        const half* sc = static_cast<const half*>(scales) + n * groups;  // formats 0 and 1
#ifdef __AVX2__
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        if (format == PLAIT_FORMAT_INT4 && group == 32) {
            const uint8_t* row = static_cast<const uint8_t*>(qweight) + n * (K / 2);
            const half* mn = static_cast<const half*>(mins) + n * groups;
            const __m128i low4 = _mm_set1_epi8(0x0F);
            for (int64_t g = 0; g < groups; ++g) {
                __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
                __m128i lo = _mm_and_si128(bytes, low4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                const __m256 s = _mm256_set1_ps(h2f(sc[g]));
                const float mg = h2f(mn[g]);
                for (int m = 0; m < M; ++m) {
                    const float* xg = x + m * K + g * 32;
                    __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xg));
                    t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xg + 8), t);
                    t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xg + 16), t);
                    t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xg + 24), t);
                    acc[m] = _mm256_fmadd_ps(t, s, acc[m]);
                    out[m] += mg * xsum[m * groups + g];
                }
            }
        } else if (format == PLAIT_FORMAT_INT8 && group % 8 == 0) {
            const int8_t* row = static_cast<const int8_t*>(qweight) + n * K;
            for (int64_t g = 0; g < groups; ++g) {
                __m256 t[M];
                for (int m = 0; m < M; ++m) t[m] = _mm256_setzero_ps();
                for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
                    __m256 q = _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
                    for (int m = 0; m < M; ++m) t[m] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x + m * K + k), t[m]);
                }
                const __m256 s = _mm256_set1_ps(h2f(sc[g]));
                for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(t[m], s, acc[m]);
            }
        } else
#endif
        {
            std::vector<float> w(K);
            dequant_row(qweight, format, n, K, group, scales, mins, w.data());
            for (int m = 0; m < M; ++m) {
                float d = 0.0f;
                for (int64_t k = 0; k < K; ++k) d += x[m * K + k] * w[k];
                out[m] = d;
            }
            for (int m = 0; m < M; ++m) y[m * N + n] = out[m] + (bias ? bias[n] : 0.0f);
            continue;
        }
#ifdef __AVX2__
        for (int m = 0; m < M; ++m) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
            h = _mm_hadd_ps(h, h);
            h = _mm_hadd_ps(h, h);
            y[m * N + n] = out[m] + _mm_cvtss_f32(h) + (bias ? bias[n] : 0.0f);
        }
#endif
    }
}

}  // namespace

void float_qmatmul(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                   const void* scales, const void* mins, const float* bias, float* y, int num_threads) {
    const int64_t groups = K / group;
    if (M <= MAX_FUSED_M) {
        std::vector<float> xsum(M * groups, 0.0f);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group] += x[m * K + k];
        const int64_t chunk = 16;
        const int64_t chunks = (N + chunk - 1) / chunk;
        plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
            const int64_t b = c * chunk, e = std::min(N, b + chunk);
            switch (M) {
                case 1: fused_rows<1>(x, K, b, e, N, qweight, format, group, scales, mins, xsum.data(), bias, y); break;
                case 2: fused_rows<2>(x, K, b, e, N, qweight, format, group, scales, mins, xsum.data(), bias, y); break;
                case 3: fused_rows<3>(x, K, b, e, N, qweight, format, group, scales, mins, xsum.data(), bias, y); break;
                default: fused_rows<4>(x, K, b, e, N, qweight, format, group, scales, mins, xsum.data(), bias, y); break;
            }
        });
        return;
    }
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
    plait::parallel_for(tiles, num_threads, false, [&](int64_t t) {
            thread_local std::vector<float> wbuf;
            wbuf.resize(TILE_N * K);
            const int64_t n0 = t * TILE_N, nt = std::min(TILE_N, N - n0);
            for (int64_t i = 0; i < nt; ++i) dequant_row(qweight, format, n0 + i, K, group, scales, mins, wbuf.data() + i * K);
            tile_matmul(x, M, K, wbuf.data(), nt, y + n0, N);
            if (bias != nullptr)
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t i = 0; i < nt; ++i) y[m * N + n0 + i] += bias[n0 + i];
    });
}

}  // namespace plait::qmm
