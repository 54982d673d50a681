// Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
//
// Formats (groups run along K; `group` divides K; format 2 is plain float32 weights [N, K]):
//   0  int8: qweight int8 [N, K]; w = q * scale[n, k / group]   (per-channel: group == K)
//   1  int4: qweight uint8 [N, K / 2]; in each group of `group` weights, byte j holds weight j in
//      its low nibble and weight j + group / 2 in its high nibble (GGUF Q4_1 order);
//      w = q * scale[n, g] + min[n, g]
// Scales and minimums are IEEE float16 [N, K / group], as GGUF stores them: float32 ones were a
// third of the bytes an int4 matrix reads (8 of 24 per 32 weights; 4 of 20 now).
//
// Each task dequantizes a tile of 4 weight rows into a float buffer that stays in L1, then runs
// every row of x against it (2 x 4 register tile). The weights are read once per call, as int8
// or int4, never inflated to a float32 matrix in memory.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "parallel.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__AVX2__) && !defined(__F16C__)
#error "the AVX2 paths read float16 scales with F16C (every AVX2 processor has it)"
#endif

// AVX-512 with VNNI (Zen 4 and 5, Intel since Ice Lake): `vpdpbusd` multiplies u8 by s8 four at
// a time and adds into int32, one instruction for the AVX2 paths' maddubs + madd, 64 bytes wide.
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PLAIT_VNNI512 1
#endif

namespace {

using half = uint16_t;  // IEEE float16 bits

inline float h2f(half h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t u = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
}

#ifdef __AVX2__
inline __m256 load8h(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Two float16 values into the low half of an SSE register.
inline __m128 load2h(const half* p) {
    uint32_t u;
    std::memcpy(&u, p, sizeof u);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u)));
}
#endif

constexpr int64_t TILE_N = 4;

void dequant_int8_row(const int8_t* q, const half* scales, int64_t K, int64_t group, float* out) {
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        const float s = h2f(scales[g0 / group]);
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

void dequant_int4_row(const uint8_t* q, const half* scales, const half* mins, int64_t K, int64_t group,
                      float* out) {
    const int64_t half_group = group / 2;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
        const float s = h2f(scales[gi]), m = h2f(mins[gi]);
        const uint8_t* b = q + g0 / 2;
        float* o = out + g0;
        int64_t j = 0;
#ifdef __AVX2__
        const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
        const __m128i low4 = _mm_set1_epi8(0x0F);
        for (; j + 8 <= half_group; j += 8) {
            __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + j));
            __m128i lo = _mm_and_si128(bytes, low4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
            __m256 flo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            __m256 fhi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            _mm256_storeu_ps(o + j, _mm256_fmadd_ps(flo, vs, vm));
            _mm256_storeu_ps(o + half_group + j, _mm256_fmadd_ps(fhi, vs, vm));
        }
#endif
        for (; j < half_group; ++j) {
            o[j] = static_cast<float>(b[j] & 0x0F) * s + m;
            o[half_group + j] = static_cast<float>(b[j] >> 4) * s + m;
        }
    }
}

// y[m, n0 + i] = x[m] . w[i] for i < nt (nt <= 4), m < M. `next`, if set, is the tile to come: its
// lines are prefetched while this one computes (float32 weights read from memory ran 20% slower
// than from cache without it).
void tile_matmul(const float* x, int64_t M, int64_t K, const float* w, int64_t nt, float* y, int64_t ldy,
                 const float* next = nullptr) {
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

// Few rows of x (decode): no tile buffer. Each weight row is unpacked in registers and dotted
// with every row of x directly; group scales multiply a per-group partial sum, and the int4
// minimum multiplies the precomputed sum of x over the group (sum_g q*s*x + m*x = s*(q.x) + m*sum x).
constexpr int64_t MAX_FUSED_M = 4;

template <int M>
void fused_rows(const float* x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const void* qweight,
                int format, int64_t group, const half* scales, const half* mins, const float* xsum,
                const float* bias, float* y) {
    const int64_t groups = K / group;
    for (int64_t n = n_begin; n < n_end; ++n) {
        float out[M];
        for (int m = 0; m < M; ++m) out[m] = 0.0f;
        const half* sc = scales + n * groups;
#ifdef __AVX2__
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        if (format == 1 && group == 32) {
            const uint8_t* row = static_cast<const uint8_t*>(qweight) + n * (K / 2);
            const half* mn = mins + n * groups;
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
        } else if (format == 0 && group % 8 == 0) {
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
            if (format == 0)
                dequant_int8_row(static_cast<const int8_t*>(qweight) + n * K, sc, K, group, w.data());
            else
                dequant_int4_row(static_cast<const uint8_t*>(qweight) + n * (K / 2), sc, mins + n * groups, K,
                                 group, w.data());
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

#ifdef __AVX2__
// Decode rows with integer dot products: each row of x is rounded to int8 in blocks of 32 (scale
// d = max|x| / 127, plus the block's exact float sum for the int4 minimum), and 32 weights at a
// time meet 32 activations in one `maddubs` (u8 x s8 -> pairs summed in int16), one `madd` (->
// int32) and one float FMA with the two scales: about a third of the instructions of converting
// every weight to float. int8 weights use |w| and sign(x, w) (maddubs wants one unsigned side).
//
// x is rounded in two levels, q1 = round(x / d) and q2 = round((x / d - q1) * 128), so that
// x = d / 128 * (128 q1 + q2) to 1/256 of a step: w . x = d / 128 * (128 (w . q1) + w . q2), two
// more maddubs and one more madd per 32 weights. One level alone (llama.cpp's Q8 activations)
// changed SmolLM2's greedy tokens against the same weights with float activations, 58% of tokens
// agreeing over the e2e prompts, and raised its int4 perplexity on our text by 3%; with the
// second level 100% agreed. It costs int4 single-stream decode ~9% (3.01 -> 3.29 ms a step, in
// one process), which is close to compute-bound on this machine.
constexpr int64_t XBLOCK = 32;

// 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes; the permute undoes it)
inline void pack_q8(const __m256i* q, int8_t* out) {
    __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p);
}

// xq, xr: the two levels; xd: d / 128, the scale of the integer dot per block; xs: the block's
// float sum
inline void quantize_x_q8(const float* x, int64_t K, int8_t* xq, int8_t* xr, float* xd, float* xs) {
    for (int64_t b = 0; b < K / XBLOCK; ++b) {
        const float* xb = x + b * XBLOCK;
        __m256 v[4], vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v[i]));
            vsum = _mm256_add_ps(vsum, v[i]);
        }
        alignas(32) float lanes[8], sums[8];
        _mm256_store_ps(lanes, vmax);
        _mm256_store_ps(sums, vsum);
        float amax = 0.0f, total = 0.0f;
        for (int i = 0; i < 8; ++i) {
            amax = std::max(amax, lanes[i]);
            total += sums[i];
        }
        const float d = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f), k128 = _mm256_set1_ps(128.0f);
        xd[b] = d / 128.0f;
        xs[b] = total;
        __m256i q[4], r[4];
        for (int i = 0; i < 4; ++i) {
            const __m256 t = _mm256_mul_ps(v[i], id);
            q[i] = _mm256_cvtps_epi32(t);  // round to nearest even; |q| <= 127
            r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(q[i])), k128));  // |r| <= 64
        }
        pack_q8(q, xq + b * XBLOCK);
        pack_q8(r, xr + b * XBLOCK);
    }
}

inline float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(h);
}

inline __m256i load256(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Two floats into the low half of an SSE register.
inline __m128 load2(const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); }

// The int4 rows take two groups of x per step: one 32-byte load of weights holds weights 0..15 of
// groups g and g + 1 in its low nibbles and 16..31 in its high ones, so x is laid out to match,
// [g: 0..15 | g+1: 0..15 | g: 16..31 | g+1: 16..31] per pair (an odd last group stays as it was).
// That is about half the instructions per group of unpacking one group at a time.
inline void pair_x_q8(int8_t* xq, int64_t K) {
    int8_t tmp[64];
    for (int64_t g = 0; g + 2 <= K / XBLOCK; g += 2) {
        int8_t* p = xq + g * XBLOCK;
        std::memcpy(tmp, p, 16);
        std::memcpy(tmp + 16, p + 32, 16);
        std::memcpy(tmp + 32, p + 16, 16);
        std::memcpy(tmp + 48, p + 48, 16);
        std::memcpy(p, tmp, 64);
    }
}

#ifdef PLAIT_VNNI512
// The 512-bit int4 rows take four groups per load: 64 bytes of weights hold weights 0..15 of groups
// g..g+3 in their low nibbles and 16..31 in their high ones, so x, already paired, is laid out
// [g, g+1: 0..15 | g+2, g+3: 0..15 | g, g+1: 16..31 | g+2, g+3: 16..31] per four groups (the two
// pairs' middle halves swap); a last pair stays paired.
inline void quad_x_q8(int8_t* xq, int64_t K) {
    int8_t tmp[32];
    for (int64_t g = 0; g + 4 <= K / XBLOCK; g += 4) {
        int8_t* p = xq + g * XBLOCK;
        std::memcpy(tmp, p + 32, 32);
        std::memcpy(p + 32, p + 64, 32);
        std::memcpy(p + 64, tmp, 32);
    }
}
#endif

// Weights read row after row still ran at ~75% of a plain read of the same bytes: three streams
// per thread (weights, scales, minimums) that restart at every matrix. Prefetching ~8 KB ahead by
// hand, past the end of this task's rows into the next task's (the same thread's, under static
// scheduling), brought the 30 int4 layers of SmolLM2 to the plain read's pace (1.75 -> 1.33 ms).
constexpr int64_t INT4_PREFETCH_BYTES = 8192;

// Row n's loop prefetches row n + ahead (computed once per call: a division per row cost 25%).
inline void prefetch_int4_row(const uint8_t* row, const half* sc, const half* mn, int64_t row_bytes, int64_t groups,
                              int64_t ahead) {
    const char* w = reinterpret_cast<const char*>(row + ahead * row_bytes);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
    const char* s = reinterpret_cast<const char*>(sc + ahead * groups);
    const char* m = reinterpret_cast<const char*>(mn + ahead * groups);
    for (int64_t off = 0; off < groups * int64_t(sizeof(half)); off += 64) {
        _mm_prefetch(s + off, _MM_HINT_T0);
        _mm_prefetch(m + off, _MM_HINT_T0);
    }
}

// Two int4 groups against one row of x in two levels (see pair_x_q8): lo / hi are the weights'
// low and high nibbles, xp / rp the pair's 64 q1 and q2 values. The int32 dots of group g are
// in lanes 0-3, of g + 1 in lanes 4-7; each int16 before `madd` is at most 2 x 2 x 15 x 127 in
// magnitude, so the two halves add exactly.
inline __m256i int4_pair_dot(__m256i lo, __m256i hi, const int8_t* xp, const int8_t* rp) {
    const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(xp)), _mm256_maddubs_epi16(hi, load256(xp + 32)));
    const __m256i s2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(rp)), _mm256_maddubs_epi16(hi, load256(rp + 32)));
    return _mm256_add_epi32(_mm256_madd_epi16(s1, _mm256_set1_epi16(128)), _mm256_madd_epi16(s2, _mm256_set1_epi16(1)));
}

template <int M>
void q8_rows(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t K, int64_t n_begin, int64_t n_end,
             int64_t N, const void* qweight, int format, int64_t group, const half* scales, const half* mins,
             const float* bias, float* y) {
    const int64_t groups = K / group, blocks = K / XBLOCK;
    const __m256i ones = _mm256_set1_epi16(1), k128 = _mm256_set1_epi16(128);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    for (int64_t n = n_begin; n < n_end; ++n) {
        const half* sc = scales + n * groups;
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        if (format == 1) {  // int4, groups of 32: one block per group, two groups per step (see pair_x_q8)
            const uint8_t* row = static_cast<const uint8_t*>(qweight) + n * (K / 2);
            const half* mn = mins + n * groups;
            if (n + ahead < N) prefetch_int4_row(row, sc, mn, K / 2, groups, ahead);
            // the minimum's term, sum_g mn[g] * xs[g]: eight groups per FMA, in the same accumulator
            int64_t g = 0;
            for (; g + 8 <= groups; g += 8) {
                const __m256 mv = load8h(mn + g);
                for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + m * blocks + g), acc[m]);
            }
            for (; g + 2 <= groups; g += 2) {  // the rest two at a time (a partial 16-byte load of
                const __m128 mv = load2h(mn + g);  // float16 through the stack stalled every row)
                for (int m = 0; m < M; ++m)
                    acc[m] = _mm256_add_ps(acc[m], _mm256_zextps128_ps256(_mm_mul_ps(mv, load2(xs + m * blocks + g))));
            }
            if (g < groups) {
                const float mg = h2f(mn[g]);
                for (int m = 0; m < M; ++m)
                    acc[m] = _mm256_add_ps(acc[m], _mm256_setr_ps(mg * xs[m * blocks + g], 0, 0, 0, 0, 0, 0, 0));
            }
            const __m256i low4 = _mm256_set1_epi8(0x0F);
            // groups g, g + 1: d holds their scale products (weight scale x block scale of x) in
            // lanes 2i and 2i + 1 of each row's vector; `at` spreads them over lanes 0-3 and 4-7
            auto pair = [&](int64_t g, const __m256* d, __m256i at) {
                // low nibbles: weights 0..15 of group g | of group g + 1; high nibbles: 16..31 of each
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 16));
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int m = 0; m < M; ++m) {
                    const __m256i dot = int4_pair_dot(lo, hi, xq + m * K + g * 32, xr + m * K + g * 32);
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(d[m], at), acc[m]);
                }
            };
            const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
            __m256 d[M];
            g = 0;
            for (; g + 8 <= groups; g += 8) {  // four pairs share one multiply of scales
                const __m256 s8 = load8h(sc + g);
                for (int m = 0; m < M; ++m) d[m] = _mm256_mul_ps(s8, _mm256_loadu_ps(xd + m * blocks + g));
                for (int p = 0; p < 4; ++p) pair(g + 2 * p, d, _mm256_add_epi32(spread, _mm256_set1_epi32(2 * p)));
            }
            for (; g + 2 <= groups; g += 2) {
                for (int m = 0; m < M; ++m) d[m] = _mm256_castps128_ps256(_mm_mul_ps(load2h(sc + g), load2(xd + m * blocks + g)));
                pair(g, d, spread);
            }
            if (g < groups) {  // an odd last group, x in plain order
                const __m128i low4x = _mm_set1_epi8(0x0F);
                const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
                const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4x),
                                                   _mm_and_si128(bytes, low4x));  // weights 0..15 | 16..31
                for (int m = 0; m < M; ++m) {
                    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w, load256(xq + m * K + g * 32)), k128),
                                                         _mm256_madd_epi16(_mm256_maddubs_epi16(w, load256(xr + m * K + g * 32)), ones));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(h2f(sc[g]) * xd[m * blocks + g]),
                                             acc[m]);
                }
            }
        } else {  // int8, groups a multiple of 32
            const int8_t* row = static_cast<const int8_t*>(qweight) + n * K;
            for (int64_t b = 0; b < blocks; ++b) {
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
                const __m256i aw = _mm256_sign_epi8(w, w);
                const float s = h2f(sc[(b * XBLOCK) / group]);
                for (int m = 0; m < M; ++m) {
                    const __m256i xv = load256(xq + m * K + b * 32), rv = load256(xr + m * K + b * 32);
                    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), k128),
                                                         _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(rv, w)), ones));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * xd[m * blocks + b]), acc[m]);
                }
            }
        }
        for (int m = 0; m < M; ++m) y[m * N + n] = hsum256(acc[m]) + (bias ? bias[n] : 0.0f);
    }
}

// Eight rows' accumulators summed at once: lane i of the result is the sum of a[i]'s lanes.
inline __m256 hsum8(const __m256* a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0 = _mm256_hadd_ps(h01, h23), h1 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// One x row's results for consecutive weight rows, eight reduced at once (hsum8): `push` row n's
// accumulator, `flush` the rows left when a task ends.
struct RowSums8 {
    __m256 sums[8];
    int64_t pending = 0;  // rows in `sums` not yet written, ending at the last pushed row
    void push(int64_t n, __m256 v, const float* bias, float* y) {
        sums[pending++] = v;
        if (pending == 8) {
            __m256 out = hsum8(sums);
            if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + n - 7));
            _mm256_storeu_ps(y + n - 7, out);
            pending = 0;
        }
    }
    void flush(int64_t n_end, const float* bias, float* y) {
        for (int64_t i = 0; i < pending; ++i) {
            const int64_t n = n_end - pending + i;
            y[n] = hsum256(sums[i]) + (bias ? bias[n] : 0.0f);
        }
    }
};

// int4 weights, an even number of groups, M <= 4 rows of x, on AVX2. The pair loop is q8_rows's;
// what changes is the cost around it, which SmolLM2's K = 576 (nine pairs a row) pays on every
// row: the minimum's term rides in the eight-group loop (the last pair's with it, no masked tail),
// and eight weight rows' sums are reduced together (hsum8) rather than one by one. From L2, one
// thread, one row of x: 5.6-5.8 -> 5.2-5.4 cycles per pair of groups at K = 576, no change at
// 1,536. Every row count takes it (odd group counts take q8_rows), so that a row's result does not
// depend on the rows beside it.
template <int M>
void q8_int4_rows(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t K, int64_t n_begin,
                  int64_t n_end, int64_t N, const uint8_t* qweight, const half* scales, const half* mins,
                  const float* bias, float* y) {
    const int64_t groups = K / 32, blocks = K / XBLOCK;
    const __m256i low4 = _mm256_set1_epi8(0x0F), spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    RowSums8 rows[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const half* sc = scales + n * groups;
        const half* mn = mins + n * groups;
        const uint8_t* row = qweight + n * (K / 2);
        if (n + ahead < N) prefetch_int4_row(row, sc, mn, K / 2, groups, ahead);
        __m256 acc[M], acc_min[M], d[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), acc_min[m] = _mm256_setzero_ps();
        // groups g, g + 1 (see pair_x_q8): int32 dots of group g in lanes 0-3, g + 1 in 4-7
        auto pair = [&](int64_t g, __m256i at) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 16));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int m = 0; m < M; ++m) {
                const __m256 dot = _mm256_cvtepi32_ps(int4_pair_dot(lo, hi, xq + m * K + g * 32, xr + m * K + g * 32));
                acc[m] = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(d[m], at), acc[m]);
            }
        };
        int64_t g = 0;
        for (; g + 8 <= groups; g += 8) {
            const __m256 m8 = load8h(mn + g), s8 = load8h(sc + g);
            for (int m = 0; m < M; ++m) {
                acc_min[m] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + m * blocks + g), acc_min[m]);
                d[m] = _mm256_mul_ps(s8, _mm256_loadu_ps(xd + m * blocks + g));
            }
            for (int p = 0; p < 4; ++p) pair(g + 2 * p, _mm256_add_epi32(spread, _mm256_set1_epi32(2 * p)));
        }
        for (; g < groups; g += 2) {
            const __m128 m2 = load2h(mn + g), s2 = load2h(sc + g);
            for (int m = 0; m < M; ++m) {
                acc_min[m] = _mm256_add_ps(acc_min[m], _mm256_zextps128_ps256(_mm_mul_ps(m2, load2(xs + m * blocks + g))));
                d[m] = _mm256_castps128_ps256(_mm_mul_ps(s2, load2(xd + m * blocks + g)));
            }
            pair(g, spread);
        }
        for (int m = 0; m < M; ++m) rows[m].push(n, _mm256_add_ps(acc[m], acc_min[m]), bias, y + m * N);
    }
    for (int m = 0; m < M; ++m) rows[m].flush(n_end, bias, y + m * N);
}

#ifdef PLAIT_VNNI512
// Four int4 groups (64 bytes of weights, see quad_x_q8) against one row of x in two levels: the
// int32 dots of group g + i in lanes 4i..4i+3. `vpdpbusd` sums in int32, so the two levels
// combine exactly as 128 (w . q1) + w . q2.
// lo / hi: the weights' low and high nibbles (unpack_int4_quad).
inline void unpack_int4_quad(const uint8_t* w, __m512i& lo, __m512i& hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(w);
    lo = _mm512_and_si512(v, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
}

inline __m512i int4_quad_dot(__m512i lo, __m512i hi, const int8_t* xp, const int8_t* rp) {
    const __m512i q1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp)), hi,
                                           _mm512_loadu_si512(xp + 64));
    const __m512i q2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(rp)), hi,
                                           _mm512_loadu_si512(rp + 64));
    return _mm512_add_epi32(_mm512_slli_epi32(q1, 7), q2);
}

// The same for one pair of groups (pair layout), 32 bytes wide.
inline __m256i int4_pair_dot_vnni(const uint8_t* w, const int8_t* xp, const int8_t* rp) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i q1 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, load256(xp)), hi, load256(xp + 32));
    const __m256i q2 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, load256(rp)), hi, load256(rp + 32));
    return _mm256_add_epi32(_mm256_slli_epi32(q1, 7), q2);
}

// Four float16 values into an SSE register.
inline __m128 load4h(const half* p) { return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// q8_int4_rows<1> on AVX-512 VNNI: four groups per step, x in quad layout. From L1 on one thread
// a pair of groups costs ~2.3 cycles here against the AVX2 loop's ~4.4 (Zen 5), and from L2 at
// SmolLM2's K = 576, 3.0-3.5 against 5.1.
void q8_int4_rows_x1_vnni(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t K,
                          int64_t n_begin, int64_t n_end, int64_t N, const uint8_t* qweight, const half* scales,
                          const half* mins, const float* bias, float* y) {
    const int64_t groups = K / 32;
    // lanes 4i..4i+3 take scale product i (spread_lo) or 4 + i (spread_hi)
    const __m512i spread_lo = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i spread_hi = _mm512_add_epi32(spread_lo, _mm512_set1_epi32(4));
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    RowSums8 rows;
    for (int64_t n = n_begin; n < n_end; ++n) {
        const half* sc = scales + n * groups;
        const half* mn = mins + n * groups;
        const uint8_t* row = qweight + n * (K / 2);
        if (n + ahead < N) prefetch_int4_row(row, sc, mn, K / 2, groups, ahead);
        auto quad = [&](int64_t g) {  // groups g..g+3, as floats
            __m512i lo, hi;
            unpack_int4_quad(row + g * 16, lo, hi);
            return _mm512_cvtepi32_ps(int4_quad_dot(lo, hi, xq + g * 32, xr + g * 32));
        };
        __m512 acc = _mm512_setzero_ps();
        __m256 acc_min = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= groups; g += 8) {
            acc_min = _mm256_fmadd_ps(load8h(mn + g), _mm256_loadu_ps(xs + g), acc_min);
            const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(load8h(sc + g), _mm256_loadu_ps(xd + g)));
            acc = _mm512_fmadd_ps(quad(g), _mm512_permutexvar_ps(spread_lo, d), acc);
            acc = _mm512_fmadd_ps(quad(g + 4), _mm512_permutexvar_ps(spread_hi, d), acc);
        }
        if (g + 4 <= groups) {
            acc_min = _mm256_add_ps(acc_min, _mm256_zextps128_ps256(_mm_mul_ps(load4h(mn + g), _mm_loadu_ps(xs + g))));
            const __m512 d = _mm512_castps128_ps512(_mm_mul_ps(load4h(sc + g), _mm_loadu_ps(xd + g)));
            acc = _mm512_fmadd_ps(quad(g), _mm512_permutexvar_ps(spread_lo, d), acc);
            g += 4;
        }
        __m256 acc8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
        if (g < groups) {  // a last pair, in pair layout
            acc_min = _mm256_add_ps(acc_min, _mm256_zextps128_ps256(_mm_mul_ps(load2h(mn + g), load2(xs + g))));
            const __m256 d = _mm256_castps128_ps256(_mm_mul_ps(load2h(sc + g), load2(xd + g)));
            acc8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int4_pair_dot_vnni(row + g * 16, xq + g * 32, xr + g * 32)),
                                   _mm256_permutevar8x32_ps(d, spread), acc8);
        }
        rows.push(n, _mm256_add_ps(acc8, acc_min), bias, y);
    }
    rows.flush(n_end, bias, y);
}
#endif

// int8 weights, one row of x: R = 4 weight rows at a time. The x block is loaded once for four
// rows, the four accumulators are independent chains, and the weights two tiles ahead are
// prefetched (four rows read side by side defeat the hardware's stream detection). Measured on
// [3072, 576]: 2x faster from L2, 1.25x from memory, than one row at a time.
constexpr int64_t INT8_TILE = 4;
constexpr int64_t PREFETCH_AHEAD = 2 * INT8_TILE;  // rows

[[maybe_unused]] void q8_int8_row_tiles(const int8_t* xq, const int8_t* xr, const float* xd, int64_t K, int64_t n_begin, int64_t n_end,
                       const int8_t* qweight, int64_t group, const half* scales, const float* bias, float* y) {
    const int64_t groups = K / group, blocks = K / XBLOCK, per_group = group / XBLOCK;
    const __m256i ones = _mm256_set1_epi16(1), k128 = _mm256_set1_epi16(128);
    // each tile's scale products (weight scale x block scale of x) [INT8_TILE, blocks], widened
    // from float16 eight at a time: one scalar conversion per block and row cost the Q8_0 LM head
    // 6% over its float32 scales
    thread_local std::vector<float> dbuf;
    dbuf.resize(INT8_TILE * blocks);
    for (int64_t n = n_begin; n < n_end; n += INT8_TILE) {
        const int8_t* rows = qweight + n * K;
        const char* ahead = reinterpret_cast<const char*>(rows + PREFETCH_AHEAD * K);
        const char* scales_ahead = reinterpret_cast<const char*>(scales + (n + PREFETCH_AHEAD) * groups);
        for (int64_t off = 0; off < INT8_TILE * groups * int64_t(sizeof(half)); off += 64)
            _mm_prefetch(scales_ahead + off, _MM_HINT_T0);
        for (int r = 0; r < INT8_TILE; ++r) {
            const half* sc = scales + (n + r) * groups;
            float* d = dbuf.data() + r * blocks;
            if (per_group == 1) {
                int64_t b = 0;
                for (; b + 8 <= blocks; b += 8) _mm256_storeu_ps(d + b, _mm256_mul_ps(load8h(sc + b), _mm256_loadu_ps(xd + b)));
                for (; b < blocks; ++b) d[b] = h2f(sc[b]) * xd[b];
            } else {
                for (int64_t g = 0, b = 0; g < groups; ++g)
                    for (const float sg = h2f(sc[g]); b < (g + 1) * per_group; ++b) d[b] = sg * xd[b];
            }
        }
        __m256 acc[INT8_TILE];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            _mm_prefetch(ahead + b * INT8_TILE * 32, _MM_HINT_T0);
            _mm_prefetch(ahead + b * INT8_TILE * 32 + 64, _MM_HINT_T0);
            const __m256i xv = load256(xq + b * 32), rv = load256(xr + b * 32);
            for (int r = 0; r < INT8_TILE; ++r) {
                const __m256i w = load256(rows + r * K + b * 32), aw = _mm256_sign_epi8(w, w);
                const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), k128),
                                                     _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(rv, w)), ones));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(dbuf.data() + r * blocks + b), acc[r]);
            }
        }
        for (int r = 0; r < INT8_TILE; ++r) y[n + r] = hsum256(acc[r]) + (bias ? bias[n + r] : 0.0f);
    }
}

#ifdef PLAIT_VNNI512
inline __m256 reduce512(__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

constexpr int64_t X_TILE_M = 8;  // rows of x per pass over a chunk of weights (int4_rows_vnni, int8_rows_vnni)

// A tile of Mt <= X_TILE_M rows of x. Per quad k and row m, 256 bytes at (k * Mt + m) * 256:
// q1's 64 low-nibble bytes and 64 high, then q2's the same. Per sixteen groups j and row m, 32
// floats at (j * Mt + m) * 32: the sixteen block scales, then the sixteen block sums (zero past
// the last group). Interleaved so that the kernel's loads are one base pointer plus constant
// offsets (eight rows' separate pointers spilled to the stack and ran the loop 2x slower).
struct Int4X {
    const char* q;
    const float* ds;
};
constexpr int64_t INT4_X_BYTES = 256;

// Row i of a tile of Mt rows, from plain-order q1, q2, scales and sums (quantize_x_q8's). The
// tile's padding (a last partial quad, groups past the last sixteen) must be zero already.
inline void layout_int4_x(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t K,
                          int64_t Mt, int64_t i, char* q, float* ds) {
    for (int64_t g = 0; g < K / 32; ++g) {
        char* p = q + ((g / 4) * Mt + i) * INT4_X_BYTES + (g % 4) * 16;
        std::memcpy(p, xq + g * 32, 16);
        std::memcpy(p + 64, xq + g * 32 + 16, 16);
        std::memcpy(p + 128, xr + g * 32, 16);
        std::memcpy(p + 192, xr + g * 32 + 16, 16);
        float* d = ds + ((g / 16) * Mt + i) * 32 + g % 16;
        d[0] = xd[g];
        d[16] = xs[g];
    }
}

// int4 weights (groups of 32) against M <= X_TILE_M rows of x on AVX-512 VNNI: one pass over the
// weights for all M rows, each weight quad (64 bytes, four groups) unpacked once. Per eight groups,
// each row's scale products (weight scale x block scale of x) take one multiply and its minimums'
// term one FMA (in an accumulator of its own); per quad and row: four dpbusd (two levels of x
// against the low and high nibbles), the shift and add that join the levels, a convert, a permute
// that spreads the four groups' products to their lanes, and an FMA. dpbusd, multiplies and FMAs
// share two pipes on Zen 5: a multiply per quad and row instead of the permute ran 20% slower. A
// last pair of groups runs 256 bits wide, three groups are a masked load. For one row this is
// exactly q8_int4_rows_x1_vnni's arithmetic, in the same order (the tests hold the two to the bit).
template <int M>
void int4_rows_vnni(const Int4X& x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const uint8_t* qweight,
                    const half* scales, const half* mins, const float* bias, float* y) {
    const int64_t groups = K / 32;
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    const __m512i spread_hi = _mm512_add_epi32(spread, _mm512_set1_epi32(4));
    const __m256i spread8 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i low4y = _mm256_set1_epi8(0x0F);
    RowSums8 sums[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const half* sc = scales + n * groups;
        const half* mn = mins + n * groups;
        const uint8_t* row = qweight + n * (K / 2);
        if (n + ahead < N) prefetch_int4_row(row, sc, mn, K / 2, groups, ahead);
        __m512 acc[M], d[M];
        __m256 acc_min[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), acc_min[m] = _mm256_setzero_ps();
        const char* q = x.q;
        // row m's block scales (xd) and sums (xs) of group g
        auto xd = [&](int m, int64_t g) { return x.ds + (g / 16) * M * 32 + m * 32 + g % 16; };
        // four groups (64 bytes of weights v) whose scale products d lanes `at` spreads
        auto quad = [&](__m512i v, __m512i at) {
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            const int8_t* p = reinterpret_cast<const int8_t*>(q);
            for (int m = 0; m < M; ++m, p += INT4_X_BYTES) {
                const __m512 dot = _mm512_cvtepi32_ps(int4_quad_dot(lo, hi, p, p + 128));  // q1 at p, q2 at p + 128
                acc[m] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(at, d[m]), acc[m]);
            }
            q += M * INT4_X_BYTES;
        };
        int64_t g = 0;
        for (; g + 8 <= groups; g += 8) {  // eight groups: one multiply of scales, two quads
            const __m256 s8 = load8h(sc + g), m8 = load8h(mn + g);
            for (int m = 0; m < M; ++m) {
                acc_min[m] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xd(m, g) + 16), acc_min[m]);
                d[m] = _mm512_castps256_ps512(_mm256_mul_ps(s8, _mm256_loadu_ps(xd(m, g))));
            }
            quad(_mm512_loadu_si512(row + g * 16), spread);
            quad(_mm512_loadu_si512(row + (g + 4) * 16), spread_hi);
        }
        if (const int64_t left = std::min<int64_t>(4, groups - g); left >= 3) {  // three or four groups: a (masked) quad
            const __mmask8 mask = static_cast<__mmask8>((1u << left) - 1);
            const __m128 s4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, sc + g)), m4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, mn + g));
            for (int m = 0; m < M; ++m) {
                acc_min[m] = _mm256_add_ps(acc_min[m], _mm256_zextps128_ps256(_mm_mul_ps(m4, _mm_loadu_ps(xd(m, g) + 16))));
                d[m] = _mm512_castps128_ps512(_mm_mul_ps(s4, _mm_loadu_ps(xd(m, g))));
            }
            quad(left == 4 ? _mm512_loadu_si512(row + g * 16) : _mm512_maskz_loadu_epi8((__mmask64(1) << 48) - 1, row + g * 16), spread);
            g += left;
        }
        __m256 acc8[M];
        for (int m = 0; m < M; ++m) acc8[m] = reduce512(acc[m]);
        if (const int64_t left = groups - g; left > 0) {  // one or two groups (SmolLM2's K = 576: two), 256 bits wide
            const __mmask16 wmask = left == 2 ? __mmask16(0xFFFF) : __mmask16(0x00FF);  // 16-bit lanes of weights
            const __m256i v = _mm256_maskz_loadu_epi16(wmask, row + g * 16);
            const __m256i lo = _mm256_and_si256(v, low4y), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4y);
            const __mmask8 mask = static_cast<__mmask8>((1u << left) - 1);
            const __m128 s2 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, sc + g)), m2 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, mn + g));
            const int8_t* p = reinterpret_cast<const int8_t*>(q);
            for (int m = 0; m < M; ++m, p += INT4_X_BYTES) {
                acc_min[m] = _mm256_add_ps(acc_min[m], _mm256_zextps128_ps256(_mm_mul_ps(m2, _mm_maskz_loadu_ps(mask, xd(m, g) + 16))));
                const __m256 dm = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_mul_ps(s2, _mm_maskz_loadu_ps(mask, xd(m, g)))), spread8);
                const __m256i q1 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, load256(p)), hi, load256(p + 64));
                const __m256i q2 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, load256(p + 128)), hi,
                                                       load256(p + 192));
                const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(q1, 7), q2);
                acc8[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dm, acc8[m]);
            }
        }
        for (int m = 0; m < M; ++m) sums[m].push(n, _mm256_add_ps(acc8[m], acc_min[m]), bias, y + m * N);
    }
    for (int m = 0; m < M; ++m) sums[m].flush(n_end, bias, y + m * N);
}

// One row of x against int4 weights with an even number of groups (single-stream decode):
// q8_int4_rows_x1_vnni, x in quad layout. It computes exactly int4_rows_vnni's row (same products,
// same order of sums), ~9% faster from L2 and ~3% from memory on SmolLM2's layers (K = 576).
void int4_row_x1_vnni(const float* x, int64_t K, int64_t N, const uint8_t* qweight, const half* scales,
                      const half* mins, const float* bias, float* y, int num_threads) {
    const int64_t blocks = K / XBLOCK;
    thread_local std::vector<int8_t> xbuf;
    thread_local std::vector<float> scale_buf;
    xbuf.resize(2 * ((K + 63) / 64 * 64) + 64);
    scale_buf.resize(2 * blocks);
    int8_t* const xq = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(xbuf.data()) + 63) & ~uintptr_t(63));
    int8_t* const xr = xq + (K + 63) / 64 * 64;  // 64-byte aligned
    float* const xd = scale_buf.data();
    float* const xs = xd + blocks;
    quantize_x_q8(x, K, xq, xr, xd, xs);
    pair_x_q8(xq, K), pair_x_q8(xr, K), quad_x_q8(xq, K), quad_x_q8(xr, K);
    const int64_t chunk = 16, chunks = (N + chunk - 1) / chunk;
    plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
        const int64_t b = c * chunk, e = std::min(N, b + chunk);
        q8_int4_rows_x1_vnni(xq, xr, xd, xs, K, b, e, N, qweight, scales, mins, bias, y);
    });
}

// f(std::integral_constant<int, mt>) for the tile's row count mt (1..X_TILE_M): the kernels take it
// as a template argument.
template <class F>
void with_tile_rows(int64_t mt, F&& f) {
    switch (mt) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// The driver of int4_rows_vnni and int8_rows_vnni (decode rows, verification, prefill): each row of
// x quantized in two levels and laid out in its tile (`layout(xq, xr, xd, xs, Mt, i, tile, tile_ds)`,
// `row_bytes` / `row_floats` a row's share of the tiles), then 16-row chunks of the weights against
// X_TILE_M rows of x at a time (a chunk stays in L1 across the passes): `rows(mt, tile, tile_ds,
// n_begin, n_end, y_rows)`.
template <class Layout, class Rows>
void tiled_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, int64_t row_bytes, int64_t row_floats,
                       float* y, int num_threads, Layout&& layout, Rows&& rows) {
    std::unique_ptr<char[]> xbuf(new char[M * row_bytes + 64]);
    char* const q = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(xbuf.get()) + 63) & ~uintptr_t(63));
    std::unique_ptr<float[]> dbuf(new float[M * row_floats + 16]);
    float* const ds = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(dbuf.get()) + 63) & ~uintptr_t(63));
    plait::parallel_for(M, M >= 8 ? num_threads : 1, false, [&](int64_t m) {
        thread_local std::vector<int8_t> tq, tr;
        thread_local std::vector<float> td, ts;
        tq.resize(K), tr.resize(K), td.resize(K / XBLOCK), ts.resize(K / XBLOCK);
        quantize_x_q8(x + m * K, K, tq.data(), tr.data(), td.data(), ts.data());
        const int64_t m0 = m / X_TILE_M * X_TILE_M;
        layout(tq.data(), tr.data(), td.data(), ts.data(), std::min(X_TILE_M, M - m0), m - m0, q + m0 * row_bytes,
               ds + m0 * row_floats);
    });
    const int64_t chunk = 16, chunks = (N + chunk - 1) / chunk;
    plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
        const int64_t b = c * chunk, e = std::min(N, b + chunk);
        for (int64_t m0 = 0; m0 < M; m0 += X_TILE_M)
            with_tile_rows(std::min(X_TILE_M, M - m0), [&](auto mt) {
                rows(mt, q + m0 * row_bytes, ds + m0 * row_floats, b, e, y + m0 * N);
            });
    });
}

void int4_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qweight, const half* scales,
                      const half* mins, const float* bias, float* y, int num_threads) {
    const int64_t groups = K / 32, quads = (groups + 3) / 4, sixteens = (groups + 15) / 16;
    tiled_matmul_vnni(
        x, M, K, N, quads * INT4_X_BYTES, sixteens * 32, y, num_threads,
        [&](const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t Mt, int64_t i, char* tile,
            float* tile_ds) {
            // this row's padding is read: zero the row's slots first
            if (groups % 4) std::memset(tile + ((quads - 1) * Mt + i) * INT4_X_BYTES, 0, INT4_X_BYTES);
            if (groups % 16) std::memset(tile_ds + ((sixteens - 1) * Mt + i) * 32, 0, 32 * sizeof(float));
            layout_int4_x(xq, xr, xd, xs, K, Mt, i, tile, tile_ds);
        },
        [&](auto mt, const char* tile, const float* tile_ds, int64_t b, int64_t e, float* out) {
            int4_rows_vnni<decltype(mt)::value>(Int4X{tile, tile_ds}, K, b, e, N, qweight, scales, mins, bias, out);
        });
}

// A tile of Mt <= X_TILE_M rows of x for int8 weights. Per 64 weights p (two blocks) and row m,
// 192 bytes at (p * Mt + m) * 192: q1, q2, then sixteen int32 lane biases -(128 q1 + q2), each
// summed over its lane's four values: a dpbusd chain of the weights + 128 (w ^ 0x80) against q1
// from that bias, shifted by 7, then against q2, is exactly 128 (w . q1) + w . q2. Per sixteen
// blocks j and row m, the block scales: 16 floats at (j * Mt + m) * 16.
struct Int8X {
    const char* q;
    const float* ds;
};
constexpr int64_t INT8_X_BYTES = 192;

// Row i of a tile of Mt rows (see layout_int4_x).
inline void layout_int8_x(const int8_t* xq, const int8_t* xr, const float* xd, int64_t K, int64_t Mt, int64_t i,
                          char* q, float* ds) {
    for (int64_t b = 0; b < K / 32; ++b) {
        char* p = q + ((b / 2) * Mt + i) * INT8_X_BYTES;
        std::memcpy(p + (b % 2) * 32, xq + b * 32, 32);
        std::memcpy(p + 64 + (b % 2) * 32, xr + b * 32, 32);
        int32_t* c = reinterpret_cast<int32_t*>(p + 128) + (b % 2) * 8;
        for (int l = 0; l < 8; ++l) {
            int32_t t = 0;
            for (int u = 0; u < 4; ++u) t += 128 * xq[b * 32 + 4 * l + u] + xr[b * 32 + 4 * l + u];
            c[l] = -t;
        }
        ds[((b / 16) * Mt + i) * 16 + b % 16] = xd[b];
    }
}

// Sixteen blocks' weight scales of row `sc` from block j (float16, one per `group` weights). Of a
// last run only the first `left` lanes count (x's scales are zero past them).
inline __m512 block_scales16(const half* sc, int64_t j, int64_t left, int64_t group) {
    if (group == XBLOCK) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << left) - 1), sc + j));
    const int64_t first = j * XBLOCK / group;
    if (first == (j + left - 1) * XBLOCK / group) return _mm512_set1_ps(h2f(sc[first]));  // one group (per channel)
    alignas(64) float s[16] = {};
    for (int64_t i = 0; i < left; ++i) s[i] = h2f(sc[(j + i) * XBLOCK / group]);
    return _mm512_load_ps(s);
}

// int8 weights (groups a multiple of 32) against M <= X_TILE_M rows of x on AVX-512 VNNI, one pass
// over the weights, as int4_rows_vnni. `vpdpbusd` wants one unsigned side, so the weights go in as
// w + 128 (w ^ 0x80, once per 64 weights for all rows) and the lane biases of the x tile cancel
// the 128. Per 64 weights and row: two dpbusd, the shift, a convert, the permute that spreads two
// blocks' scale products and an FMA. Against the kernels it replaced (four rows of x at a time,
// a scalar sum per row, two bias vectors per row and step), SmolLM2's Q8_0 LM head at 8 rows of x
// went from 6.3x to 3.3x one row's time, at 5 rows from 4.4x to 2.7x.
template <int M>
void int8_rows_vnni(const Int8X& x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const int8_t* qweight,
                    int64_t group, const half* scales, const float* bias, float* y) {
    const int64_t blocks = K / XBLOCK, groups = K / group;
    const __m512i spread2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / K);
    RowSums8 sums[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const int8_t* row = qweight + n * K;
        const half* sc = scales + n * groups;
        if (n + ahead < N) {
            const char* w = reinterpret_cast<const char*>(row + ahead * K);
            for (int64_t off = 0; off < K; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
            const char* s = reinterpret_cast<const char*>(sc + ahead * groups);
            for (int64_t off = 0; off < groups * int64_t(sizeof(half)); off += 64) _mm_prefetch(s + off, _MM_HINT_T0);
        }
        __m512 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        const char* q = x.q;
        const float* ds = x.ds;
        for (int64_t j = 0; j < blocks; j += 16, ds += M * 16) {
            const int64_t left = std::min<int64_t>(16, blocks - j);
            const __m512 s16 = block_scales16(sc, j, left, group);
            __m512 d[M];
            for (int m = 0; m < M; ++m) d[m] = _mm512_mul_ps(s16, _mm512_load_ps(ds + m * 16));
            for (int64_t b = 0; b < left; b += 2, q += M * INT8_X_BYTES) {
                const __m512i v = left - b >= 2 ? _mm512_loadu_si512(row + (j + b) * XBLOCK)
                                                : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + (j + b) * XBLOCK);
                const __m512i wu = _mm512_xor_si512(v, flip);  // a masked-off half meets zeros of x
                const __m512i at = _mm512_add_epi32(spread2, _mm512_set1_epi32(static_cast<int>(b)));
                const char* p = q;
                for (int m = 0; m < M; ++m, p += INT8_X_BYTES) {
                    const __m512i q1 = _mm512_dpbusd_epi32(_mm512_load_si512(p + 128), wu, _mm512_load_si512(p));
                    const __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(q1, 7), wu, _mm512_load_si512(p + 64));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(at, d[m]), acc[m]);
                }
            }
        }
        for (int m = 0; m < M; ++m) sums[m].push(n, reduce512(acc[m]), bias, y + m * N);
    }
    for (int m = 0; m < M; ++m) sums[m].flush(n_end, bias, y + m * N);
}

void int8_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const int8_t* qweight, int64_t group,
                      const half* scales, const float* bias, float* y, int num_threads) {
    const int64_t blocks = K / XBLOCK, pairs = (blocks + 1) / 2, sixteens = (blocks + 15) / 16;
    tiled_matmul_vnni(
        x, M, K, N, pairs * INT8_X_BYTES, sixteens * 16, y, num_threads,
        [&](const int8_t* xq, const int8_t* xr, const float* xd, const float*, int64_t Mt, int64_t i, char* tile,
            float* tile_ds) {
            if (blocks % 2) std::memset(tile + ((pairs - 1) * Mt + i) * INT8_X_BYTES, 0, INT8_X_BYTES);  // read padding
            if (blocks % 16) std::memset(tile_ds + ((sixteens - 1) * Mt + i) * 16, 0, 16 * sizeof(float));
            layout_int8_x(xq, xr, xd, K, Mt, i, tile, tile_ds);
        },
        [&](auto mt, const char* tile, const float* tile_ds, int64_t b, int64_t e, float* out) {
            int8_rows_vnni<decltype(mt)::value>(Int8X{tile, tile_ds}, K, b, e, N, qweight, group, scales, bias, out);
        });
}

#endif

// Rows of x up to this many round x to int8 (mirrored by kernels/quant_matmul.py: q8_max_rows).
// On AVX2: decode batches and short extends; more (prefill chunks, an LM head's prompt logprobs)
// keep float32 activations, since rounding them in one level ran prefill 1.3x faster but raised
// SmolLM2's int4 perplexity on our text from 44.1 to 45.6 (the error is spread over every
// projection) and in two levels it ran no faster than the GEMM. With VNNI, two levels run
// 164-201 GMAC/s at 512 rows on SmolLM2's int4 shapes where torch's float32 GEMM runs 92-105
// (before dequantizing the matrix), so every row count takes them.
#ifdef PLAIT_VNNI512
constexpr int64_t MAX_Q8_M = int64_t(1) << 40;
#else
constexpr int64_t MAX_Q8_M = 47;
#endif

inline bool q8_usable(int64_t K, int format, int64_t group) {
    return K % XBLOCK == 0 && ((format == 1 && group == 32) || (format == 0 && group % XBLOCK == 0));
}
#endif

// float32 weights (format 2), for the decode stack and the LM head: torch's GEMV for one row of x
// read the weights at 16-36 GB/s on this machine. Each weight row is read in one sequential pass
// against up to 4 rows of x (independent accumulators: 4 for one row of x, 2 per row otherwise),
// with the row `ahead` rows on prefetched, past this task's end into the next task's (the same
// thread's under static scheduling). Two rows side by side, prefetched only within the task, read
// SmolLM2's 30 float32 layers at 0.76-0.85 of a plain read of the same bytes; this runs at 1.02.
constexpr int64_t DENSE_PREFETCH_BYTES = 8192;

template <int M>
void dense_rows(const float* x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const float* w,
                const float* bias, float* y) {
    int64_t n = n_begin;
#ifdef __AVX2__
    constexpr int ACC = M == 1 ? 4 : 2;
    if (K % 8 == 0) {
        const int64_t K_acc = K / (8 * ACC) * (8 * ACC);  // then single vectors to K
        const int64_t ahead = std::max<int64_t>(1, DENSE_PREFETCH_BYTES / (K * int64_t(sizeof(float))));
        for (; n < n_end; ++n) {
            const float* row = w + n * K;
            const char* next = reinterpret_cast<const char*>(n + ahead < N ? row + ahead * K : row);
            __m256 a[M][ACC];
            for (int m = 0; m < M; ++m)
                for (int j = 0; j < ACC; ++j) a[m][j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K_acc; k += 8 * ACC) {
                for (int64_t line = 0; line < 8 * ACC * int64_t(sizeof(float)); line += 64)
                    _mm_prefetch(next + k * int64_t(sizeof(float)) + line, _MM_HINT_T0);
                for (int j = 0; j < ACC; ++j) {
                    const __m256 v = _mm256_loadu_ps(row + k + 8 * j);
                    for (int m = 0; m < M; ++m) a[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * j), v, a[m][j]);
                }
            }
            for (int64_t k = K_acc; k < K; k += 8) {
                _mm_prefetch(next + k * int64_t(sizeof(float)), _MM_HINT_T0);
                const __m256 v = _mm256_loadu_ps(row + k);
                for (int m = 0; m < M; ++m) a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), v, a[m][0]);
            }
            for (int m = 0; m < M; ++m) {
                __m256 t = a[m][0];
                for (int j = 1; j < ACC; ++j) t = _mm256_add_ps(t, a[m][j]);
                y[m * N + n] = hsum256(t) + (bias ? bias[n] : 0.0f);
            }
        }
    }
#endif
    for (; n < n_end; ++n)
        for (int m = 0; m < M; ++m) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
            y[m * N + n] = s + (bias ? bias[n] : 0.0f);
        }
}

void dense_matmul(const float* x, int64_t M, int64_t K, int64_t N, const float* w, const float* bias, float* y,
                  int num_threads) {
    if (M <= MAX_FUSED_M) {
        const int64_t chunk = 16, chunks = (N + chunk - 1) / chunk;
        plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
            const int64_t b = c * chunk, e = std::min(N, b + chunk);
            switch (M) {
                case 1: dense_rows<1>(x, K, b, e, N, w, bias, y); break;
                case 2: dense_rows<2>(x, K, b, e, N, w, bias, y); break;
                case 3: dense_rows<3>(x, K, b, e, N, w, bias, y); break;
                default: dense_rows<4>(x, K, b, e, N, w, bias, y); break;
            }
        });
        return;
    }
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
    plait::parallel_for(tiles, num_threads, false, [&](int64_t t) {
        const int64_t n0 = t * TILE_N, nt = std::min(TILE_N, N - n0);
        tile_matmul(x, M, K, w + n0 * K, nt, y + n0, N, n0 + 2 * TILE_N <= N ? w + (n0 + TILE_N) * K : nullptr);
        if (bias != nullptr)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t i = 0; i < nt; ++i) y[m * N + n0 + i] += bias[n0 + i];
    });
}

}  // namespace

extern "C" void plait_qmatmul_f32(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight,
                                  int format, int64_t group, const half* scales, const half* mins,
                                  const float* bias, float* y, int num_threads) {
    if (format == 2) {
        dense_matmul(x, M, K, N, static_cast<const float*>(qweight), bias, y, num_threads);
        return;
    }
    const int64_t groups = K / group;
#ifdef __AVX2__
    if (M <= MAX_Q8_M && q8_usable(K, format, group)) {
#ifdef PLAIT_VNNI512
        // every row count, one row included: a row's result does not depend on the rows beside it
        if (format == 1 && M == 1 && K / XBLOCK % 2 == 0)
            int4_row_x1_vnni(x, K, N, static_cast<const uint8_t*>(qweight), scales, mins, bias, y, num_threads);
        else if (format == 1)
            int4_matmul_vnni(x, M, K, N, static_cast<const uint8_t*>(qweight), scales, mins, bias, y, num_threads);
        else
            int8_matmul_vnni(x, M, K, N, static_cast<const int8_t*>(qweight), group, scales, bias, y, num_threads);
        return;
#else
        const int64_t blocks = K / XBLOCK;
        // q1 [M, K], then q2 [M, K], each 64-byte aligned: a 64-byte load of x that straddles two
        // cache lines cost the 512-bit int4 rows a quarter of their time
        const int64_t stride = (M * K + 63) / 64 * 64;
        // (left uninitialized: every byte read is written first)
        std::unique_ptr<int8_t[]> xbuf(new int8_t[2 * stride + 64]);
        int8_t* const xq = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(xbuf.get()) + 63) & ~uintptr_t(63));
        int8_t* const xr = xq + stride;
        std::unique_ptr<float[]> xd_buf(new float[M * blocks]), xs_buf(new float[M * blocks]);
        float* const xd = xd_buf.get();
        float* const xs = xs_buf.get();
        const bool int4_even = format == 1 && blocks % 2 == 0;  // q8_int4_rows
        plait::parallel_for(M, M >= 8 ? num_threads : 1, false, [&](int64_t m) {
            quantize_x_q8(x + m * K, K, xq + m * K, xr + m * K, xd + m * blocks, xs + m * blocks);
            if (format == 1) {
                pair_x_q8(xq + m * K, K);
                pair_x_q8(xr + m * K, K);
            }
        });
        const int64_t chunk = 16;
        const int64_t chunks = (N + chunk - 1) / chunk;
        plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
            const int64_t b = c * chunk, e = std::min(N, b + chunk);
            if (int4_even) {
                for (int64_t m0 = 0; m0 < M; m0 += 4) {
                    const int8_t *q = xq + m0 * K, *r = xr + m0 * K;
                    const float *d = xd + m0 * blocks, *sx = xs + m0 * blocks;
                    const uint8_t* w4 = static_cast<const uint8_t*>(qweight);
                    float* out = y + m0 * N;
                    switch (std::min<int64_t>(4, M - m0)) {
                        case 1: q8_int4_rows<1>(q, r, d, sx, K, b, e, N, w4, scales, mins, bias, out); break;
                        case 2: q8_int4_rows<2>(q, r, d, sx, K, b, e, N, w4, scales, mins, bias, out); break;
                        case 3: q8_int4_rows<3>(q, r, d, sx, K, b, e, N, w4, scales, mins, bias, out); break;
                        default: q8_int4_rows<4>(q, r, d, sx, K, b, e, N, w4, scales, mins, bias, out); break;
                    }
                }
                return;
            }
            if (M == 1 && format == 0) {
                const int64_t tiled = b + (e - b) / INT8_TILE * INT8_TILE;
                q8_int8_row_tiles(xq, xr, xd, K, b, tiled, static_cast<const int8_t*>(qweight), group,
                                  scales, bias, y);
                q8_rows<1>(xq, xr, xd, xs, K, tiled, e, N, qweight, format, group, scales,
                           mins, bias, y);
                return;
            }
            // more rows of x go through in fours, each four against the whole chunk: the chunk's
            // 16 weight rows are unpacked once per four rows of x and stay in L1 meanwhile
            // (80-105 GMAC/s on SmolLM2's shapes, where the float tile path it replaced ran 37-90)
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int8_t *q = xq + m0 * K, *r = xr + m0 * K;
                const float *d = xd + m0 * blocks, *sx = xs + m0 * blocks;
                float* out = y + m0 * N;
                switch (std::min<int64_t>(4, M - m0)) {
                    case 1: q8_rows<1>(q, r, d, sx, K, b, e, N, qweight, format, group, scales, mins, bias, out); break;
                    case 2: q8_rows<2>(q, r, d, sx, K, b, e, N, qweight, format, group, scales, mins, bias, out); break;
                    case 3: q8_rows<3>(q, r, d, sx, K, b, e, N, qweight, format, group, scales, mins, bias, out); break;
                    default: q8_rows<4>(q, r, d, sx, K, b, e, N, qweight, format, group, scales, mins, bias, out); break;
                }
            }
        });
        return;
#endif
    }
#endif
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
    });
}

// Row n of an int8 (format 0) or int4 (1) matrix, dequantized to float32.
inline void dequant_row(const void* qweight, int format, int64_t n, int64_t K, int64_t group, const half* scales,
                        const half* mins, float* out) {
    const int64_t groups = K / group;
    if (format == 0)
        dequant_int8_row(static_cast<const int8_t*>(qweight) + n * K, scales + n * groups, K, group, out);
    else
        dequant_int4_row(static_cast<const uint8_t*>(qweight) + n * (K / 2), scales + n * groups, mins + n * groups, K,
                         group, out);
}

// Dequantizes rows [0, N) into out[N, K] (the reference, and the large-M path: one pass over the
// weights, then a float32 GEMM whose cost dwarfs it).
extern "C" void plait_dequantize_f32(const void* qweight, int format, int64_t N, int64_t K, int64_t group,
                                     const half* scales, const half* mins, float* out, int num_threads) {
    plait::parallel_for(N, num_threads, false,
                        [&](int64_t n) { dequant_row(qweight, format, n, K, group, scales, mins, out + n * K); });
}

// The same, rounded to bfloat16 (to nearest, ties to even) for a bfloat16 GEMM: each row is
// dequantized to float32 in a per-thread buffer first, so both outputs agree to the rounding.
extern "C" void plait_dequantize_bf16(const void* qweight, int format, int64_t N, int64_t K, int64_t group,
                                      const half* scales, const half* mins, uint16_t* out, int num_threads) {
    plait::parallel_for(N, num_threads, false, [&](int64_t n) {
        thread_local std::vector<float> row;
        if (static_cast<int64_t>(row.size()) < K) row.resize(K);
        dequant_row(qweight, format, n, K, group, scales, mins, row.data());
        uint16_t* o = out + n * K;
        for (int64_t k = 0; k < K; ++k) {  // finite values only: weights
            uint32_t u;
            std::memcpy(&u, &row[k], sizeof u);
            o[k] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        }
    });
}

// The most rows of x that round to int8 (MAX_Q8_M), 0 without AVX2.
extern "C" int64_t plait_qmatmul_max_q8_rows() {
#ifdef __AVX2__
    return MAX_Q8_M;
#else
    return 0;
#endif
}

// Which integer dot products the decode rows were built with: 2 AVX-512 VNNI, 1 AVX2, 0 none (the
// float paths alone).
extern "C" int plait_qmatmul_isa() {
#if defined(PLAIT_VNNI512)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

// Whether a (K, format, group) matmul rounds x to int8 (for up to MAX_Q8_M rows of x).
extern "C" int plait_qmatmul_q8_rows(int64_t K, int format, int64_t group) {
#ifdef __AVX2__
    return q8_usable(K, format, group) ? 1 : 0;
#else
    (void)K, (void)format, (void)group;
    return 0;
#endif
}
