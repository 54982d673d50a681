// Paged attention for single-token and short queries on the CPU, reading K/V in place through
// per-row slot tables (no gather copy). GQA, any head_dim; AVX2 exp when available. The cache
// holds float32, bfloat16, or int8 with one float32 scale per (slot, kv head); queries and
// outputs are float32.
//
// Row r attends query q[q_index[r]] (all H heads) over slots tables[table_index[r]][first[r] ..
// kv_len[r]) and writes out[q_index[r]]. One task per row covers every head, so each slot's K/V
// row is read once. Three passes over the row's context: scores (dot products), softmax,
// weighted sum of V.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>

#include "parallel.h"
#include "plait_kernels.h"
#include "vec_math.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

// p[i] = exp(p[i] - m) for i < n; returns the sum.
inline float exp_shift_sum(float* p, int64_t n, float m) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    const __m512 wm = _mm512_set1_ps(m);
    __m512 ws = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 e = plait::exp512(_mm512_sub_ps(_mm512_loadu_ps(p + i), wm));
        _mm512_storeu_ps(p + i, e);
        ws = _mm512_add_ps(ws, e);
    }
    sum = _mm512_reduce_add_ps(ws);
#endif
#ifdef __AVX2__
    __m256 vm = _mm256_set1_ps(m), vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = plait::exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
        _mm256_storeu_ps(p + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vs);
    for (float l : lanes) sum += l;
#endif
    for (; i < n; ++i) {
        p[i] = std::exp(p[i] - m);
        sum += p[i];
    }
    return sum;
}

// The cache's element types, read as float32: float, bfloat16 (the high half of a float32) and
// int8 (times the slot's scale, which the caller applies).
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline float to_float(int8_t x) { return static_cast<float>(x); }

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
#endif

template <class T>
inline float dot(const float* a, const T* b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX2__
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
    s = plait::F8::hsum(_mm256_add_ps(s0, s1));
#endif
    for (; i < n; ++i) s += a[i] * to_float(b[i]);
    return s;
}

// a[0..n) += p * b[0..n)
template <class T>
inline void axpy(float* a, float p, const T* b, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 vp = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, _mm256_fmadd_ps(vp, load8(b + i), _mm256_loadu_ps(a + i)));
#endif
    for (; i < n; ++i) a[i] += p * to_float(b[i]);
}

// The maximum of p[0, n), n >= 1.
// NOTE: vectorized by hand: std::max_element compiled to a scalar loop through the stack, a third
// of a short row's attention.
inline float row_max(const float* p, int64_t n) {
    int64_t i = 0;
    float best = p[0];
#ifdef __AVX2__
    if (n >= 8) {
        __m256 b = _mm256_loadu_ps(p);
        for (i = 8; i + 8 <= n; i += 8) b = _mm256_max_ps(b, _mm256_loadu_ps(p + i));
        best = plait::F8::hmax(b);
    }
#endif
    for (; i < n; ++i) best = std::max(best, p[i]);
    return best;
}

// scores [H, n] -> exp(score - max) per head, in place; m [H] gets each head's max, l [H] the sum.
inline void softmax_numerators(float* scores, int64_t num_heads, int64_t n, float* m, float* l) {
    for (int64_t i = 0; i < num_heads; ++i) {
        float* p = scores + i * n;
        m[i] = row_max(p, n);
        l[i] = exp_shift_sum(p, n, m[i]);
    }
}

// Slots are single tokens scattered over the pool (a batch's decode tokens interleave), so the
// hardware sees no stream: the K/V rows a few slots ahead are prefetched by hand.
constexpr int64_t PREFETCH_SLOTS = 4;

inline void prefetch_row(const void* row, int64_t bytes) {
    const char* p = static_cast<const char*>(row);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// Attention of all query heads of row r over its slots [j0, j1): unnormalized accumulators
// acc [H, D], per-head running max m [H] and sum l [H]. Each slot's K/V row (all KV heads) is read
// as one contiguous run. `ks`/`vs` are the int8 scales [slots, Hkv] (null for float caches).
template <class T>
void attend_chunk(const float* qr, const T* k, const T* v, const float* ks,
                  const float* vs, const int64_t* slots, int64_t j0, int64_t j1, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, float scale, float* acc, float* m, float* l) {
    thread_local std::vector<float> scores;
    const int64_t n = j1 - j0, group = num_heads / num_kv_heads, slot_stride = num_kv_heads * head_dim;
    const int64_t row_bytes = slot_stride * int64_t(sizeof(T));
    scores.resize(num_heads * n);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = slots[j0 + j];
        if (j + PREFETCH_SLOTS < n) prefetch_row(k + slots[j0 + j + PREFETCH_SLOTS] * slot_stride, row_bytes);
        const T* kr = k + slot * slot_stride;
        for (int64_t i = 0; i < num_heads; ++i) {  // query head i reads KV head i / group
            const int64_t h = i / group;
            const float s = ks ? scale * ks[slot * num_kv_heads + h] : scale;
            scores[i * n + j] = dot(qr + i * head_dim, kr + h * head_dim, head_dim) * s;
        }
    }
    softmax_numerators(scores.data(), num_heads, n, m, l);
    std::fill(acc, acc + num_heads * head_dim, 0.0f);
    for (int64_t j = 0; j < std::min(n, PREFETCH_SLOTS); ++j) prefetch_row(v + slots[j0 + j] * slot_stride, row_bytes);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = slots[j0 + j];
        if (j + PREFETCH_SLOTS < n) prefetch_row(v + slots[j0 + j + PREFETCH_SLOTS] * slot_stride, row_bytes);
        const T* vr = v + slot * slot_stride;
        for (int64_t i = 0; i < num_heads; ++i) {
            const int64_t h = i / group;
            const float p = vs ? scores[i * n + j] * vs[slot * num_kv_heads + h] : scores[i * n + j];
            axpy(acc + i * head_dim, p, vr + h * head_dim, head_dim);
        }
    }
}

#ifdef __AVX2__
// The vector width of attend_chunk_gqa: 8 floats (AVX2) or 16 (AVX-512, for head_dim % 16 == 0),
// with loads that convert the cache's element type.
struct Vec8 : plait::F8 {
    template <class T>
    static R load(const T* p) { return load8(p); }
    // Lane i holds the sum of v[i]'s lanes, for i < W: W dot products summed together in a
    // transposing tree (about 3 operations each instead of a horizontal sum's 8).
    static R row_sums(const R* v) {
        R a[4], b[2];
        for (int i = 0; i < 4; ++i)  // [v0's low + high half, v1's]
            a[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
        for (int i = 0; i < 2; ++i)
            b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                                 _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
        const R c = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));
        return _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // lanes held v 0,2,4,6,1,3,5,7
    }
};

#ifdef __AVX512F__
struct Vec16 : plait::F16 {
    static R load(const float* p) { return _mm512_loadu_ps(p); }
    static R load(const uint16_t* p) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static R load(const int8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    // Vec8::row_sums for 16 vectors: 256-bit halves, then 128-bit quarters, then within quarters.
    static R row_sums(const R* v) {
        R a[8], b[4], c[2];
        for (int i = 0; i < 8; ++i)
            a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
        for (int i = 0; i < 4; ++i)
            b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
        for (int i = 0; i < 2; ++i)
            c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
        const R d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
        // lane 4k + m held v[k + 4m]
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
    }
};
#endif

// attend_chunk for G query heads per KV head (GQA, G <= 8), the same results: each slot's K and V
// row of a KV head is loaded (and converted from bfloat16 or int8) once for its G query heads
// instead of G times. A loop per query head is compute-bound well below memory's pace, and more so
// for the smaller types, whose conversion it repeats per query head (a bfloat16 cache would decode
// slower than a float32 one). V is the vector width.
template <class T, int G, class V>
void attend_chunk_gqa(const float* qr, const T* k, const T* v, const float* ks, const float* vs,
                      const int64_t* slots, int64_t j0, int64_t j1, int64_t num_kv_heads, int64_t head_dim,
                      float scale, float* acc, float* m, float* l) {
    using R = typename V::R;
    thread_local std::vector<float> scores;
    const int64_t n = j1 - j0, num_heads = G * num_kv_heads, slot_stride = num_kv_heads * head_dim;
    const int64_t row_bytes = slot_stride * int64_t(sizeof(T)), DW = head_dim / V::W * V::W;
    scores.resize(num_heads * n);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = slots[j0 + j];
        if (j + PREFETCH_SLOTS < n) prefetch_row(k + slots[j0 + j + PREFETCH_SLOTS] * slot_stride, row_bytes);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const T* kh = k + slot * slot_stride + h * head_dim;
            const float* qh = qr + h * G * head_dim;  // query heads h * G .. h * G + G - 1
            R a[G];
            for (int g = 0; g < G; ++g) a[g] = V::zero();
            for (int64_t d = 0; d < DW; d += V::W) {
                const R kv = V::load(kh + d);
                for (int g = 0; g < G; ++g) a[g] = V::fma(V::load(qh + g * head_dim + d), kv, a[g]);
            }
            const float s = ks ? scale * ks[slot * num_kv_heads + h] : scale;
            for (int g = 0; g < G; ++g) {
                float t = V::hsum(a[g]);
                for (int64_t d = DW; d < head_dim; ++d) t += qh[g * head_dim + d] * to_float(kh[d]);
                scores[(h * G + g) * n + j] = t * s;
            }
        }
    }
    softmax_numerators(scores.data(), num_heads, n, m, l);
    std::fill(acc, acc + num_heads * head_dim, 0.0f);
    for (int64_t j = 0; j < std::min(n, PREFETCH_SLOTS); ++j) prefetch_row(v + slots[j0 + j] * slot_stride, row_bytes);
    int64_t j = 0;
    // two slots at a time: one load and store of the accumulators per two FMAs
    for (; j + 2 <= n; j += 2) {
        const int64_t s0 = slots[j0 + j], s1 = slots[j0 + j + 1];
        for (int64_t a = j + PREFETCH_SLOTS; a < std::min(n, j + PREFETCH_SLOTS + 2); ++a)
            prefetch_row(v + slots[j0 + a] * slot_stride, row_bytes);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const T *v0 = v + s0 * slot_stride + h * head_dim, *v1 = v + s1 * slot_stride + h * head_dim;
            float* ah = acc + h * G * head_dim;
            const float w0 = vs ? vs[s0 * num_kv_heads + h] : 1.0f, w1 = vs ? vs[s1 * num_kv_heads + h] : 1.0f;
            float p0[G], p1[G];
            R vp0[G], vp1[G];
            for (int g = 0; g < G; ++g) {
                p0[g] = scores[(h * G + g) * n + j] * w0;
                p1[g] = scores[(h * G + g) * n + j + 1] * w1;
                vp0[g] = V::set1(p0[g]);
                vp1[g] = V::set1(p1[g]);
            }
            for (int64_t d = 0; d < DW; d += V::W) {
                const R x0 = V::load(v0 + d), x1 = V::load(v1 + d);
                for (int g = 0; g < G; ++g) {
                    float* o = ah + g * head_dim + d;
                    V::store(o, V::fma(vp1[g], x1, V::fma(vp0[g], x0, V::load(o))));
                }
            }
            for (int64_t d = DW; d < head_dim; ++d)
                for (int g = 0; g < G; ++g) ah[g * head_dim + d] += p0[g] * to_float(v0[d]) + p1[g] * to_float(v1[d]);
        }
    }
    for (; j < n; ++j) {
        const int64_t slot = slots[j0 + j];
        if (j + PREFETCH_SLOTS < n) prefetch_row(v + slots[j0 + j + PREFETCH_SLOTS] * slot_stride, row_bytes);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const T* vh = v + slot * slot_stride + h * head_dim;
            float* ah = acc + h * G * head_dim;
            const float sv = vs ? vs[slot * num_kv_heads + h] : 1.0f;
            float p[G];
            R vp[G];
            for (int g = 0; g < G; ++g) {
                p[g] = scores[(h * G + g) * n + j] * sv;
                vp[g] = V::set1(p[g]);
            }
            for (int64_t d = 0; d < DW; d += V::W) {
                const R x = V::load(vh + d);
                for (int g = 0; g < G; ++g) {
                    float* o = ah + g * head_dim + d;
                    V::store(o, V::fma(vp[g], x, V::load(o)));
                }
            }
            for (int64_t d = DW; d < head_dim; ++d)
                for (int g = 0; g < G; ++g) ah[g * head_dim + d] += p[g] * to_float(vh[d]);
        }
    }
}

#endif

// The weighted sum of V over slots [b, e) for NG query heads of KV head h, whose D = C * W
// accumulators stay in registers. p: the first head's softmax numerators (head g's at p[g * n]).
// Prefetches the rows `ahead` slots on (below `end`) when `ahead` is non-zero.
template <class T, int NG, int C, class V>
inline void accumulate_v(const float* p, int64_t n, const T* v, const float* vs, const int64_t* sl, int64_t b,
                         int64_t e, int64_t h, int64_t num_kv_heads, int64_t ahead, int64_t end, float* acc) {
    using R = typename V::R;
    constexpr int W = V::W, D = C * W;
    const int64_t slot_stride = num_kv_heads * D, row_bytes = slot_stride * int64_t(sizeof(T));
    R a[NG][C];
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < C; ++c) a[g][c] = V::load(acc + g * D + c * W);
    for (int64_t j = b; j < e; ++j) {
        if (ahead && j + ahead < end) prefetch_row(v + sl[j + ahead] * slot_stride, row_bytes);
        const T* vr = v + sl[j] * slot_stride + h * D;
        const float w = vs ? vs[sl[j] * num_kv_heads + h] : 1.0f;
        R x[C];
        for (int c = 0; c < C; ++c) x[c] = V::load(vr + c * W);
        for (int g = 0; g < NG; ++g) {
            const R pg = V::set1(p[g * n + j] * w);
            for (int c = 0; c < C; ++c) a[g][c] = V::fma(pg, x[c], a[g][c]);
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < C; ++c) V::store(acc + g * D + c * W, a[g][c]);
}

// accumulate_v for ng <= NG query heads.
template <class T, int NG, int C, class V>
inline void accumulate_v_upto(int64_t ng, const float* p, int64_t n, const T* v, const float* vs, const int64_t* sl,
                              int64_t b, int64_t e, int64_t h, int64_t num_kv_heads, int64_t ahead, int64_t end,
                              float* acc) {
    if constexpr (NG > 1) {
        if (ng < NG)
            return accumulate_v_upto<T, NG - 1, C, V>(ng, p, n, v, vs, sl, b, e, h, num_kv_heads, ahead, end, acc);
    }
    accumulate_v<T, NG, C, V>(p, n, v, vs, sl, b, e, h, num_kv_heads, ahead, end, acc);
}

// attend_chunk for a head_dim D known at compile time (64 or 128, where W-float vectors make C =
// D / W of a row) and `group` query heads per KV head. Scores come W slots at a time, their dot
// products summed across lanes together (V::row_sums); the V sum runs in blocks of VB slots, each
// KV head's query heads in groups whose accumulators stay in registers, the block's V rows read
// from L1 after the first group: faster than attend_chunk_gqa, from cache and from memory. The
// next block's K rows are prefetched a few per query head, spread over the block: all at its start
// would crowd the loads from memory.
template <class T, int D, class V>
void attend_chunk_fixed(int64_t group, const float* qr, const T* k, const T* v, const float* ks, const float* vs,
                        const int64_t* slots, int64_t j0, int64_t j1, int64_t num_kv_heads, float scale, float* acc,
                        float* m, float* l) {
    using R = typename V::R;
    // GS query heads' C accumulators each at a time: 16 of AVX-512's 32 registers, 8 of AVX2's 16
    constexpr int W = V::W, C = D / W, GS = (W == 16 ? 16 : 8) / C;
    constexpr int64_t VB = 32;
    static_assert(D % W == 0 && GS >= 1, "a row must fill whole vectors, and few enough");
    thread_local std::vector<float> scores;
    const int64_t n = j1 - j0, num_heads = group * num_kv_heads, slot_stride = num_kv_heads * D;
    const int64_t row_bytes = slot_stride * int64_t(sizeof(T));
    const int64_t* sl = slots + j0;
    scores.resize(num_heads * n);
    float* sc = scores.data();
    for (int64_t i = 0; i < std::min<int64_t>(n, W); ++i) prefetch_row(k + sl[i] * slot_stride, row_bytes);
    int64_t j = 0;
    const int64_t per_head = (W + num_heads - 1) / num_heads;  // next block's rows to prefetch per head
    for (; j + W <= n; j += W) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            for (int64_t g = 0; g < group; ++g) {
                const int64_t pf = j + W + (h * group + g) * per_head;
                for (int64_t i = pf; i < std::min({n, pf + per_head, j + 2 * W}); ++i)
                    prefetch_row(k + sl[i] * slot_stride, row_bytes);
                const float* qh = qr + (h * group + g) * D;
                R q[C], part[W];
                for (int c = 0; c < C; ++c) q[c] = V::load(qh + c * W);
                for (int i = 0; i < W; ++i) {
                    const T* kr = k + sl[j + i] * slot_stride + h * D;
                    R a = V::mul(q[0], V::load(kr));
                    for (int c = 1; c < C; ++c) a = V::fma(q[c], V::load(kr + c * W), a);
                    part[i] = a;
                }
                V::store(sc + (h * group + g) * n + j, V::mul(V::row_sums(part), V::set1(scale)));
            }
            if (ks)
                for (int64_t i = j; i < j + W; ++i)
                    for (int64_t g = 0; g < group; ++g) sc[(h * group + g) * n + i] *= ks[sl[i] * num_kv_heads + h];
        }
    }
    for (; j < n; ++j) {  // the last n % W slots, one horizontal sum each
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const T* kr = k + sl[j] * slot_stride + h * D;
            const float s = ks ? scale * ks[sl[j] * num_kv_heads + h] : scale;
            for (int64_t g = 0; g < group; ++g) {
                const float* qh = qr + (h * group + g) * D;
                R a = V::mul(V::load(qh), V::load(kr));
                for (int c = 1; c < C; ++c) a = V::fma(V::load(qh + c * W), V::load(kr + c * W), a);
                sc[(h * group + g) * n + j] = V::hsum(a) * s;
            }
        }
    }
    softmax_numerators(sc, num_heads, n, m, l);
    std::fill(acc, acc + num_heads * D, 0.0f);
    for (int64_t i = 0; i < std::min(n, VB); ++i) prefetch_row(v + sl[i] * slot_stride, row_bytes);
    for (int64_t b = 0; b < n; b += VB) {
        const int64_t e = std::min(n, b + VB);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            for (int64_t g = 0; g < group; g += GS) {
                const float* p = sc + (h * group + g) * n;
                float* a = acc + (h * group + g) * D;
                const int64_t ahead = h == 0 && g == 0 ? VB : 0;  // the first pass brings the next block
                accumulate_v_upto<T, GS, C, V>(std::min<int64_t>(GS, group - g), p, n, v, vs, sl, b, e, h,
                                               num_kv_heads, ahead, n, a);
            }
        }
    }
}

#ifdef __AVX2__
// attend_chunk_gqa<T, group, V> for the compiled group sizes (1-8); false for others.
template <class T, class V>
bool attend_gqa(int64_t group, const float* qr, const T* k, const T* v, const float* ks, const float* vs,
                const int64_t* slots, int64_t j0, int64_t j1, int64_t num_kv_heads, int64_t head_dim, float scale,
                float* acc, float* m, float* l) {
    switch (group) {
#define PLAIT_GQA(G) \
    case G: attend_chunk_gqa<T, G, V>(qr, k, v, ks, vs, slots, j0, j1, num_kv_heads, head_dim, scale, acc, m, l); return true;
        PLAIT_GQA(1) PLAIT_GQA(2) PLAIT_GQA(3) PLAIT_GQA(4) PLAIT_GQA(5) PLAIT_GQA(6) PLAIT_GQA(7) PLAIT_GQA(8)
#undef PLAIT_GQA
        default: return false;
    }
}
#endif

// attend_chunk_gqa where G is one of the compiled group sizes, else attend_chunk.
template <class T>
void attend(const float* qr, const T* k, const T* v, const float* ks, const float* vs, const int64_t* slots,
            int64_t j0, int64_t j1, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
            float* acc, float* m, float* l) {
#ifdef __AVX2__
    const int64_t group = num_heads % num_kv_heads == 0 ? num_heads / num_kv_heads : 0;
#ifdef __AVX512F__
    if (group && head_dim == 64)
        return attend_chunk_fixed<T, 64, Vec16>(group, qr, k, v, ks, vs, slots, j0, j1, num_kv_heads, scale, acc, m, l);
    if (group && head_dim == 128)
        return attend_chunk_fixed<T, 128, Vec16>(group, qr, k, v, ks, vs, slots, j0, j1, num_kv_heads, scale, acc, m,
                                                 l);
    // 16 floats a vector: half the instructions of 8
    if (head_dim % 16 == 0 && attend_gqa<T, Vec16>(group, qr, k, v, ks, vs, slots, j0, j1, num_kv_heads, head_dim,
                                                    scale, acc, m, l))
        return;
#else
    if (group && head_dim == 64)
        return attend_chunk_fixed<T, 64, Vec8>(group, qr, k, v, ks, vs, slots, j0, j1, num_kv_heads, scale, acc, m, l);
#endif
    if (attend_gqa<T, Vec8>(group, qr, k, v, ks, vs, slots, j0, j1, num_kv_heads, head_dim, scale, acc, m, l)) return;
#endif
    attend_chunk<T>(qr, k, v, ks, vs, slots, j0, j1, num_heads, num_kv_heads, head_dim, scale, acc, m, l);
}

}  // namespace

namespace {

// The slots of each chunk a row's context is split in where results must not depend on the batch:
// a row's chunks, and so the order its partial sums merge in, then follow its own length alone.
constexpr int64_t INVARIANT_SPLIT_SLOTS = 256;

template <class T>
void attention_rows(const float* q, const T* k, const T* v, const float* ks,
                    const float* vs, const int64_t* tables, int64_t table_width, const int64_t* q_index,
                    const int64_t* table_index, const int64_t* first, const int64_t* kv_len, float* out,
                    int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                    int invariant, int num_threads) {
    const int64_t hd = num_heads * head_dim;
    int64_t longest = 0, slots_read = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
        longest = std::max(longest, kv_len[r] - first[r]);
        slots_read += kv_len[r] - first[r];
    }
    // With too few rows to occupy every core, each row's context is split in chunks (at least
    // 32 slots) whose partial softmax results are merged afterwards (split-K). The split follows
    // the machine's cores, not this call's thread count, so that results do not change when the
    // engine changes its threads (runtime/governor.py). One decode row reads its K/V from memory
    // at one core's pace, so even a short context is split (from 64 slots) to read it on every
    // core.
    // `invariant`: chunks of INVARIANT_SPLIT_SLOTS for every row instead, whatever the batch.
    const int64_t cores = plait::num_procs();
    int64_t splits = 1;
    if (!invariant && num_rows < 2 * cores)
        splits = std::max<int64_t>(1, std::min<int64_t>((2 * cores + num_rows - 1) / num_rows, longest / 32));
    if (slots_read < 64) num_threads = 1;  // one short row: waking the team costs more
    const int64_t chunk = invariant ? INVARIANT_SPLIT_SLOTS : (longest + splits - 1) / splits;
    std::vector<int64_t> task0(num_rows + 1, 0);  // row r's chunks are tasks [task0[r], task0[r + 1])
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t n = kv_len[r] - first[r];
        task0[r + 1] = task0[r] + (invariant ? std::max<int64_t>(1, (n + chunk - 1) / chunk) : splits);
    }
    const int64_t tasks = task0[num_rows];
    std::vector<int64_t> task_row(tasks);
    for (int64_t r = 0; r < num_rows; ++r)
        for (int64_t t = task0[r]; t < task0[r + 1]; ++t) task_row[t] = r;
    std::vector<float> part_acc, part_m, part_l;
    if (tasks > num_rows) {
        part_acc.resize(tasks * hd);
        part_m.assign(tasks * num_heads, -INFINITY);
        part_l.assign(tasks * num_heads, 0.0f);
    }
    plait::parallel_for(tasks, num_threads, true, [&](int64_t t) {
        plait::FlushDenormals ftz;  // far-off keys' weights underflow; denormal math is ~100x slower
        thread_local std::vector<float> acc, m, l;
        const int64_t r = task_row[t], s = t - task0[r];
        const int64_t n = kv_len[r] - first[r];
        const int64_t j0 = std::min(n, s * chunk), j1 = std::min(n, (s + 1) * chunk);
        const int64_t* slots = tables + table_index[r] * table_width + first[r];
        const float* qr = q + q_index[r] * hd;
        if (task0[r + 1] - task0[r] > 1) {
            if (j1 > j0)
                attend<T>(qr, k, v, ks, vs, slots, j0, j1, num_heads, num_kv_heads, head_dim, scale,
                          part_acc.data() + t * hd, part_m.data() + t * num_heads, part_l.data() + t * num_heads);
            return;
        }
        float* o = out + q_index[r] * hd;
        if (n <= 0) {
            std::fill(o, o + hd, 0.0f);
            return;
        }
        acc.resize(hd);
        m.resize(num_heads);
        l.resize(num_heads);
        attend<T>(qr, k, v, ks, vs, slots, 0, n, num_heads, num_kv_heads, head_dim, scale, acc.data(), m.data(),
                  l.data());
        for (int64_t i = 0; i < num_heads; ++i) {
            const float inv = 1.0f / l[i];
            for (int64_t d = 0; d < head_dim; ++d) o[i * head_dim + d] = acc[i * head_dim + d] * inv;
        }
    });
    for (int64_t r = 0; r < num_rows; ++r) {  // merge the chunks of each split row
        if (task0[r + 1] - task0[r] == 1) continue;
        float* o = out + q_index[r] * hd;
        for (int64_t i = 0; i < num_heads; ++i) {
            float mx = -INFINITY;
            for (int64_t t = task0[r]; t < task0[r + 1]; ++t) mx = std::max(mx, part_m[t * num_heads + i]);
            float total = 0.0f;
            float* oi = o + i * head_dim;
            std::fill(oi, oi + head_dim, 0.0f);
            for (int64_t t = task0[r]; t < task0[r + 1]; ++t) {
                const float w = part_l[t * num_heads + i] > 0.0f ? std::exp(part_m[t * num_heads + i] - mx) : 0.0f;
                total += w * part_l[t * num_heads + i];
                const float* a = part_acc.data() + t * hd + i * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) oi[d] += w * a[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) oi[d] *= inv;
        }
    }
}

}  // namespace

// kv_type: 0 float32, 1 bfloat16, 2 int8 (with k_scale / v_scale [slots, Hkv]).
extern "C" void plait_paged_attention_rows(
    const float* q, const void* k, const void* v, const float* k_scale, const float* v_scale, int kv_type,
    const int64_t* tables, int64_t table_width, const int64_t* q_index, const int64_t* table_index,
    const int64_t* first, const int64_t* kv_len, float* out, int64_t num_rows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, float scale, int invariant, int num_threads) {
    switch (kv_type) {
        case 0:
            attention_rows<float>(q, static_cast<const float*>(k), static_cast<const float*>(v), nullptr, nullptr,
                                tables, table_width, q_index, table_index, first, kv_len, out, num_rows,
                                num_heads, num_kv_heads, head_dim, scale, invariant, num_threads);
            break;
        case 1:
            attention_rows<uint16_t>(q, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), nullptr,
                                 nullptr, tables, table_width, q_index, table_index, first, kv_len, out,
                                 num_rows, num_heads, num_kv_heads, head_dim, scale, invariant, num_threads);
            break;
        case 2:
            attention_rows<int8_t>(q, static_cast<const int8_t*>(k), static_cast<const int8_t*>(v), k_scale, v_scale,
                               tables, table_width, q_index, table_index, first, kv_len, out, num_rows,
                               num_heads, num_kv_heads, head_dim, scale, invariant, num_threads);
            break;
    }
}

// The first t whose slot lies outside a pool of `num_slots`, or -1 when every slot is inside.
extern "C" int64_t plait_first_bad_slot(const int64_t* slots, int64_t num_tokens, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return t;
    return -1;
}

// Stores new K/V rows (float32 [T, Hkv, D], row stride in floats) at `slots`, converting to the
// cache's type; int8 rows get a symmetric per-(slot, head) scale = max|x| / 127. A slot outside
// the pool's `num_slots` stores nothing and returns its token's index (else -1): the caller raises.
extern "C" int64_t plait_store_kv(const float* k, const float* v, int64_t row_stride, const int64_t* slots,
                                  int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int kv_type,
                                  void* k_cache, void* v_cache, float* k_scale, float* v_scale, int64_t num_slots) {
    if (const int64_t bad = plait_first_bad_slot(slots, num_tokens, num_slots); bad >= 0) return bad;
    const int64_t width = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        for (int which = 0; which < 2; ++which) {
            const float* src = (which ? v : k) + t * row_stride;
            void* cache = which ? v_cache : k_cache;
            if (kv_type == 0) {
                std::memcpy(static_cast<float*>(cache) + slot * width, src, width * sizeof(float));
            } else if (kv_type == 1) {
                uint16_t* dst = static_cast<uint16_t*>(cache) + slot * width;
                for (int64_t i = 0; i < width; ++i) {  // round to nearest even, as torch does
                    uint32_t u;
                    std::memcpy(&u, src + i, sizeof u);
                    if ((u & 0x7fffffffu) > 0x7f800000u) {
                        dst[i] = static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
                    } else {
                        dst[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                    }
                }
            } else {
                int8_t* dst = static_cast<int8_t*>(cache) + slot * width;
                float* scales = (which ? v_scale : k_scale) + slot * num_kv_heads;
                for (int64_t h = 0; h < num_kv_heads; ++h) {
                    const float* x = src + h * head_dim;
                    float amax = 0.0f;
                    for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
                    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
                    const float inv = 1.0f / s;
                    scales[h] = s;
                    for (int64_t d = 0; d < head_dim; ++d) {
                        const float r = std::nearbyint(x[d] * inv);
                        dst[h * head_dim + d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
                    }
                }
            }
        }
    }
    return -1;
}
