// Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
//
// Formats (groups run along K; `group` divides K):
//   0  int8: qweight int8 [N, K]; w = q * scale[n, k / group]   (per-channel: group == K)
//   1  int4: qweight uint8 [N, K / 2]; in each group of `group` weights, byte j holds weight j in
//      its low nibble and weight j + group / 2 in its high nibble (GGUF Q4_1 order);
//      w = q * scale[n, g] + min[n, g]
//
// Each task dequantizes a tile of 4 weight rows into a float buffer that stays in L1, then runs
// every row of x against it (2 x 4 register tile). The weights are read once per call, as int8
// or int4, never inflated to a float32 matrix in memory.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE_N = 4;

void dequant_int8_row(const int8_t* q, const float* scales, int64_t K, int64_t group, float* out) {
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        const float s = scales[g0 / group];
        int64_t k = g0;
        const int64_t end = g0 + group;
#ifdef __AVX2__
        const __m256 vs = _mm256_set1_ps(s);
        for (; k + 8 <= end; k += 8) {
            __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
            _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(qi), vs));
        }
#endif
        for (; k < end; ++k) out[k] = static_cast<float>(q[k]) * s;
    }
}

void dequant_int4_row(const uint8_t* q, const float* scales, const float* mins, int64_t K, int64_t group,
                      float* out) {
    const int64_t half = group / 2;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
        const float s = scales[gi], m = mins[gi];
        const uint8_t* b = q + g0 / 2;
        float* o = out + g0;
        int64_t j = 0;
#ifdef __AVX2__
        const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
        const __m128i low4 = _mm_set1_epi8(0x0F);
        for (; j + 8 <= half; j += 8) {
            __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + j));
            __m128i lo = _mm_and_si128(bytes, low4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
            __m256 flo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            __m256 fhi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            _mm256_storeu_ps(o + j, _mm256_fmadd_ps(flo, vs, vm));
            _mm256_storeu_ps(o + half + j, _mm256_fmadd_ps(fhi, vs, vm));
        }
#endif
        for (; j < half; ++j) {
            o[j] = static_cast<float>(b[j] & 0x0F) * s + m;
            o[half + j] = static_cast<float>(b[j] >> 4) * s + m;
        }
    }
}

// y[m, n0 + i] = x[m] . w[i] for i < nt (nt <= 4), m < M.
void tile_matmul(const float* x, int64_t M, int64_t K, const float* w, int64_t nt, float* y, int64_t ldy) {
    int64_t m = 0;
#ifdef __AVX2__
    if (nt == TILE_N && K % 8 == 0) {
        const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
        auto hsum = [](__m256 v) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            s = _mm_hadd_ps(s, s);
            s = _mm_hadd_ps(s, s);
            return _mm_cvtss_f32(s);
        };
        for (; m + 2 <= M; m += 2) {
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

}  // namespace

extern "C" void plait_qmatmul_f32(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight,
                                  int format, int64_t group, const float* scales, const float* mins,
                                  const float* bias, float* y, int num_threads) {
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
    const int64_t groups = K / group;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> wbuf(TILE_N * K);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t n0 = t * TILE_N, nt = std::min(TILE_N, N - n0);
            for (int64_t i = 0; i < nt; ++i) {
                const int64_t n = n0 + i;
                if (format == 0)
                    dequant_int8_row(static_cast<const int8_t*>(qweight) + n * K, scales + n * groups, K, group,
                                     wbuf.data() + i * K);
                else
                    dequant_int4_row(static_cast<const uint8_t*>(qweight) + n * (K / 2), scales + n * groups,
                                     mins + n * groups, K, group, wbuf.data() + i * K);
            }
            tile_matmul(x, M, K, wbuf.data(), nt, y + n0, N);
            if (bias != nullptr)
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t i = 0; i < nt; ++i) y[m * N + n0 + i] += bias[n0 + i];
        }
    }
}

// Dequantizes rows [0, N) into out[N, K] (the reference, and the large-M path: one pass over the
// weights, then a float32 GEMM whose cost dwarfs it).
extern "C" void plait_dequantize_f32(const void* qweight, int format, int64_t N, int64_t K, int64_t group,
                                     const float* scales, const float* mins, float* out, int num_threads) {
    const int64_t groups = K / group;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        if (format == 0)
            dequant_int8_row(static_cast<const int8_t*>(qweight) + n * K, scales + n * groups, K, group, out + n * K);
        else
            dequant_int4_row(static_cast<const uint8_t*>(qweight) + n * (K / 2), scales + n * groups,
                             mins + n * groups, K, group, out + n * K);
    }
}
