// The quantized matmul's AVX2 tier (CPUs without AVX-512 VNNI, e.g. Zen 3): decode rows with the
// activations rounded to int8 in two levels (quant_matmul.h: quantize_x_q8) and integer dot
// products (maddubs + madd), up to MAX_Q8_M rows of x.
#include "quant_matmul.h"

#include "parallel.h"

#if defined(__AVX2__) && !defined(PLAIT_VNNI512)

namespace plait::qmm {

namespace {

// Two int4 groups against one row of x in two levels (see pair_x_q8): lo / hi are the weights'
// low and high nibbles, xp / rp the pair's 64 q1 and q2 values. The int32 dots of group g are
// in lanes 0-3, of g + 1 in lanes 4-7; each int16 before `madd` is at most 2 x 2 x 15 x 127 in
// magnitude, so the two halves add exactly.
inline __m256i int4_pair_dot(__m256i lo, __m256i hi, const int8_t* xp, const int8_t* rp) {
    const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(xp)), _mm256_maddubs_epi16(hi, load256(xp + 32)));
    const __m256i s2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(rp)), _mm256_maddubs_epi16(hi, load256(rp + 32)));
    return _mm256_add_epi32(_mm256_madd_epi16(s1, _mm256_set1_epi16(128)), _mm256_madd_epi16(s2, _mm256_set1_epi16(1)));
}

// The minimum's term of float32-scaled rows, sum_b mn[b] * xs[b], eight blocks per FMA, into
// each row of x's accumulator
template <int M>
inline void add_min_term(const float* mf, const float* xs, int64_t blocks, __m256* acc) {
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8)
        for (int m = 0; m < M; ++m)
            acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(mf + b), _mm256_loadu_ps(xs + m * blocks + b), acc[m]);
    for (; b < blocks; ++b)
        for (int m = 0; m < M; ++m)
            acc[m] = _mm256_add_ps(acc[m], _mm256_setr_ps(mf[b] * xs[m * blocks + b], 0, 0, 0, 0, 0, 0, 0));
}

// Format 1 (int4, float16 scales), 0 (int8, float16 scales) or 3 (int8, float32 scales in groups
// of 16 or 32, minimums where set); 5 and 6 as 0 and 3 on five-bit values unpacked per block
// (int5_block256).
template <int M>
void q8_rows(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t K, int64_t n_begin, int64_t n_end,
             int64_t N, const void* qweight, int format, int64_t group, const void* scales, const void* mins,
             const float* bias, float* y) {
    const int64_t groups = K / group, blocks = K / XBLOCK;
    const __m256i ones = _mm256_set1_epi16(1), k128 = _mm256_set1_epi16(128);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    const bool int5 = int5_values(format);
    const int64_t row_bytes = int5 ? int5_row_bytes(K) : K;  // int8 values
    const int offset = int5_offset(format);
    auto weights = [&](const int8_t* row, int64_t b) {  // block b as int8 values
        return int5 ? int5_block256(reinterpret_cast<const uint8_t*>(row), K, b, offset)
                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
    };
    for (int64_t n = n_begin; n < n_end; ++n) {
        const half* sc = static_cast<const half*>(scales) + n * groups;
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        if (format == PLAIT_FORMAT_INT4) {  // int4, groups of 32: one block per group, two groups per step (see pair_x_q8)
            const uint8_t* row = static_cast<const uint8_t*>(qweight) + n * (K / 2);
            const half* mn = static_cast<const half*>(mins) + n * groups;
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
        } else if (format == PLAIT_FORMAT_INT8_F32 || format == PLAIT_FORMAT_INT5_F32) {  // groups of 16 (two scales per block) or 32
            const int8_t* row = static_cast<const int8_t*>(qweight) + n * row_bytes;
            const float* sf = static_cast<const float*>(scales) + n * groups;
            const float* mf = mins ? static_cast<const float*>(mins) + n * blocks : nullptr;
            for (int64_t b = 0; b < blocks; ++b) {
                const __m256i w = weights(row, b);
                const __m256i aw = _mm256_sign_epi8(w, w);
                // lanes 0-3 hold weights 0..15 of the block, lanes 4-7 weights 16..31
                const __m256 s = group == 16 ? _mm256_set_m128(_mm_set1_ps(sf[2 * b + 1]), _mm_set1_ps(sf[2 * b]))
                                             : _mm256_set1_ps(sf[b]);
                for (int m = 0; m < M; ++m) {
                    const __m256i xv = load256(xq + m * K + b * 32), rv = load256(xr + m * K + b * 32);
                    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), k128),
                                                         _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(rv, w)), ones));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, _mm256_set1_ps(xd[m * blocks + b])), acc[m]);
                }
            }
            if (mf) add_min_term<M>(mf, xs, blocks, acc);
        } else {  // int8, groups a multiple of 32
            const int8_t* row = static_cast<const int8_t*>(qweight) + n * row_bytes;
            for (int64_t b = 0; b < blocks; ++b) {
                const __m256i w = weights(row, b);
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


// int8-valued weights (every format but int4) against M >= 2 rows of x. Each block of 32 weights
// is widened to int16 once for all M rows, and meets x's two levels joined into one int16 (128 q1
// + q2, exact: at most 16320 in magnitude) in two `madd`s per row.
//
// x is laid out in tiles of up to Q16_ROWS rows, block by block ([block][row][32], one pointer
// plus constant offsets in the inner loop); the blocks' scales of x go in the same tiles
// ([block][row]). Which weights each int32 lane sums depends on the format, and every kernel that
// takes the format sums the same ones, in the same order of blocks and FMAs, so that a row's
// result does not depend on how many rows run beside it:
// - int8 values with scales per 32 or more (Q8_0; `natural_lanes`): the weights widened straight
//   from memory (`vpmovsxbw` of each half), lane j summing weights 2j, 2j + 1, 16 + 2j, 17 + 2j,
//   x's block in its own order. One row of x takes q16_int8_row_tiles.
// - int5 values, and scales per 16 (Q6_K; lanes 0-3 must hold weights 0..15): lane j sums
//   weights 4j..4j+3, q8_rows's and q8_int5_row_tiles's lanes, the weights in registers widened
//   after one byte shuffle and two unpacks, x's block in the order that leaves them: [0, 1, 4, 5,
//   8, 9, 12, 13 | 16, 17, 20, ... 29] then [2, 3, 6, 7 ... 15 | 18 ... 31].
#ifndef PLAIT_Q16_ROWS
#define PLAIT_Q16_ROWS 8
#endif
constexpr int64_t Q16_ROWS = PLAIT_Q16_ROWS;  // rows of x per tile
constexpr int64_t Q16_TILE = 16;  // weight rows whose results q16_rows stores together

// Whether the format's int32 lanes are natural_lanes's (see above)
inline bool natural_lanes(int format, int64_t group) {
    return format == PLAIT_FORMAT_INT8 || (format == PLAIT_FORMAT_INT8_F32 && group == XBLOCK);
}

// Row i of a tile of `rows` rows, x's blocks in natural or shuffled order; xd_tile as x16's
inline void join_x_q16(const int8_t* xq, const int8_t* xr, const float* xd, int64_t K, int64_t rows, int64_t i,
                       bool natural, int16_t* x16_tile, float* xd_tile) {
    for (int64_t b = 0; b < K / XBLOCK; ++b) {
        int16_t* out = x16_tile + (b * rows + i) * XBLOCK;
        for (int p = 0; p < 32; ++p) {
            const int j = p % 8, lane = (p % 16) / 8;
            const int64_t src = b * XBLOCK + (natural ? p : lane * 16 + (j / 2) * 4 + (p >= 16 ? 2 : 0) + j % 2);
            out[p] = static_cast<int16_t>(128 * xq[src] + xr[src]);
        }
        xd_tile[b * rows + i] = xd[b];
    }
}

// Block b of an int8 row widened to int16 in natural_lanes's order: weights 0..15, 16..31
inline void widen_natural(const int8_t* row, int64_t b, __m256i& lo, __m256i& hi) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32 + 16)));
}

// SCALES: 0 float16 per group of a multiple of 32, 1 float32 per 32, 2 float32 per 16 (two per
// block: lanes 0-3 hold weights 0..15, lanes 4-7 16..31)
template <int M, int SCALES, bool NATURAL>
void q16_rows(const int16_t* x16, const float* xd, const float* xs, int64_t K, int64_t n_begin, int64_t n_end,
              const void* qweight, int format, int64_t group, const void* scales, const void* mins,
              const float* bias, int64_t N, float* y, bool prefetch) {
    const int64_t groups = K / group, blocks = K / XBLOCK, per_group = group / XBLOCK;
    const bool int5 = int5_values(format);
    const int64_t row_bytes = int5 ? int5_row_bytes(K) : K;
    const int offset = int5_offset(format);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / row_bytes);
    const int64_t scale_bytes = groups * (SCALES == 0 ? 2 : 4);
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    // results gathered per row of x and stored a line at a time: rows of y a multiple of 64 KiB
    // apart (an LM head's) share one set of L1 and L2, so storing each result as it comes misses
    float tile[M][Q16_TILE];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const int8_t* row = static_cast<const int8_t*>(qweight) + n * row_bytes;
        const float* sf = static_cast<const float*>(scales) + n * groups;
        const half* sh = static_cast<const half*>(scales) + n * groups;
        if (prefetch && n + ahead < N) {  // the first tile of x to meet this chunk reads it from memory
            const char* w = reinterpret_cast<const char*>(row + ahead * row_bytes);
            for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
            const char* sa = static_cast<const char*>(scales) + (n + ahead) * scale_bytes;
            for (int64_t off = 0; off < scale_bytes; off += 64) _mm_prefetch(sa + off, _MM_HINT_T0);
        }
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        // block b, sb its weight scale (SCALES 0 and 1)
        auto block = [&](int64_t b, float sb) {
            __m256i lo, hi;
            if constexpr (NATURAL) {
                widen_natural(row, b, lo, hi);
            } else {
                const __m256i w = int5 ? int5_block256(reinterpret_cast<const uint8_t*>(row), K, b, offset)
                                       : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
                const __m256i ws = _mm256_shuffle_epi8(w, order);
                lo = _mm256_srai_epi16(_mm256_unpacklo_epi8(ws, ws), 8);
                hi = _mm256_srai_epi16(_mm256_unpackhi_epi8(ws, ws), 8);
            }
            const __m256i* xv = reinterpret_cast<const __m256i*>(x16 + b * M * XBLOCK);
            const float* xdb = xd + b * M;
            // q8_rows's scale products, weight scale x block scale of x, one rounding each
            alignas(32) float d[M];
            __m256 s16 = _mm256_setzero_ps();
            if constexpr (SCALES == 2) {
                s16 = _mm256_set_m128(_mm_set1_ps(sf[2 * b + 1]), _mm_set1_ps(sf[2 * b]));
            } else if constexpr (M == 8) {
                _mm256_store_ps(d, _mm256_mul_ps(_mm256_set1_ps(sb), _mm256_loadu_ps(xdb)));
            } else {
                for (int m = 0; m < M; ++m) d[m] = sb * xdb[m];
            }
            for (int m = 0; m < M; ++m) {
                const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_load_si256(xv + 2 * m)),
                                                     _mm256_madd_epi16(hi, _mm256_load_si256(xv + 2 * m + 1)));
                const __m256 sm = SCALES == 2 ? _mm256_mul_ps(s16, _mm256_set1_ps(xdb[m])) : _mm256_broadcast_ss(d + m);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sm, acc[m]);
            }
        };
        if constexpr (SCALES == 0) {  // float16 scales, one per group of per_group blocks
            for (int64_t g = 0, b = 0; g < groups; ++g)
                for (const float sb = h2f(sh[g]); b < (g + 1) * per_group; ++b) block(b, sb);
        } else {
            for (int64_t b = 0; b < blocks; ++b) block(b, SCALES == 1 ? sf[b] : 0.0f);
        }
        if (SCALES != 0 && mins) add_min_term<M>(static_cast<const float*>(mins) + n * blocks, xs, blocks, acc);
        for (int m = 0; m < M; ++m) tile[m][(n - n_begin) % Q16_TILE] = hsum256(acc[m]) + (bias ? bias[n] : 0.0f);
        if ((n - n_begin) % Q16_TILE == Q16_TILE - 1 || n + 1 == n_end) {
            const int64_t first = n - (n - n_begin) % Q16_TILE;
            for (int m = 0; m < M; ++m) std::memcpy(y + m * N + first, tile[m], (n + 1 - first) * sizeof(float));
        }
    }
}

template <int M>
void q16_rows_for(int format, int64_t group, const int16_t* x16, const float* xd, const float* xs, int64_t K,
                  int64_t n_begin, int64_t n_end, const void* qweight, const void* scales, const void* mins,
                  const float* bias, int64_t N, float* y, bool prefetch) {
    const bool f32 = format == PLAIT_FORMAT_INT8_F32 || format == PLAIT_FORMAT_INT5_F32;
    const bool natural = natural_lanes(format, group);
    if (!f32 && natural)
        q16_rows<M, 0, true>(x16, xd, xs, K, n_begin, n_end, qweight, format, group, scales, mins, bias, N, y, prefetch);
    else if (!f32)
        q16_rows<M, 0, false>(x16, xd, xs, K, n_begin, n_end, qweight, format, group, scales, mins, bias, N, y, prefetch);
    else if (group == 16)
        q16_rows<M, 2, false>(x16, xd, xs, K, n_begin, n_end, qweight, format, group, scales, mins, bias, N, y, prefetch);
    else if (natural)
        q16_rows<M, 1, true>(x16, xd, xs, K, n_begin, n_end, qweight, format, group, scales, mins, bias, N, y, prefetch);
    else
        q16_rows<M, 1, false>(x16, xd, xs, K, n_begin, n_end, qweight, format, group, scales, mins, bias, N, y, prefetch);
}


// int4 weights, an even number of groups, M <= 4 rows of x, on AVX2. The pair loop is q8_rows's;
// what changes is the cost around it, which SmolLM2's K = 576 (nine pairs a row) pays on every
// row: the minimum's term rides in the eight-group loop (the last pair's with it, no masked tail),
// and eight weight rows' sums are reduced together (hsum8) rather than one by one: fewer cycles
// per pair of groups where K is short, where that cost weighs most. Every row count takes it (odd
// group counts take q8_rows), so that a row's result does not depend on the rows beside it.
template <int M, class S>
void q8_int4_rows(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t K, int64_t n_begin,
                  int64_t n_end, int64_t N, const uint8_t* qweight, const S* scales, const S* mins,
                  const float* bias, float* y) {
    const int64_t groups = K / 32, blocks = K / XBLOCK;
    const __m256i low4 = _mm256_set1_epi8(0x0F), spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    RowSums8 rows[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const S* sc = scales + n * groups;
        const S* mn = mins + n * groups;
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
            const __m256 m8 = load8s(mn + g), s8 = load8s(sc + g);
            for (int m = 0; m < M; ++m) {
                acc_min[m] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + m * blocks + g), acc_min[m]);
                d[m] = _mm256_mul_ps(s8, _mm256_loadu_ps(xd + m * blocks + g));
            }
            for (int p = 0; p < 4; ++p) pair(g + 2 * p, _mm256_add_epi32(spread, _mm256_set1_epi32(2 * p)));
        }
        for (; g < groups; g += 2) {
            const __m128 m2 = load2s(mn + g), s2 = load2s(sc + g);
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

// Weight rows of the one-row kernels at a time, and how far ahead of its tile each prefetches
constexpr int64_t INT8_TILE = 4;
constexpr int64_t PREFETCH_AHEAD = 2 * INT8_TILE;  // rows

// Scale products (weight scale x block scale of x) of weight row n's blocks into d: float16 per
// group of a multiple of 32 (SCALES 0) or float32 per 32 (1), widened eight (then four) at a time
template <int SCALES>
inline void row_scale_products(const void* scales, int64_t n, int64_t groups, int64_t per_group, const float* xd,
                               int64_t blocks, float* d) {
    int64_t b = 0;
    if (SCALES == 0 && per_group != 1) {
        const half* sc = static_cast<const half*>(scales) + n * groups;
        for (int64_t g = 0; g < groups; ++g)
            for (const float sg = h2f(sc[g]); b < (g + 1) * per_group; ++b) d[b] = sg * xd[b];
        return;
    }
    const half* sh = static_cast<const half*>(scales) + n * groups;
    const float* sf = static_cast<const float*>(scales) + n * groups;
    for (; b + 8 <= blocks; b += 8) {
        const __m256 s8 = SCALES == 0 ? load8h(sh + b) : _mm256_loadu_ps(sf + b);
        _mm256_storeu_ps(d + b, _mm256_mul_ps(s8, _mm256_loadu_ps(xd + b)));
    }
    for (; b + 4 <= blocks; b += 4) {
        const __m128 s4 = SCALES == 0 ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sh + b)))
                                      : _mm_loadu_ps(sf + b);
        _mm_storeu_ps(d + b, _mm_mul_ps(s4, _mm_loadu_ps(xd + b)));
    }
    for (; b < blocks; ++b) d[b] = (SCALES == 0 ? h2f(sh[b]) : sf[b]) * xd[b];
}

// int8 weights with natural_lanes (float16 scales per group of a multiple of 32, SCALES 0, or
// float32 scales per 32 and their minimums, 1), one row of x joined (x16): R <= INT8_TILE weight
// rows at a time. x's block is loaded once for the tile, the weights are widened straight from
// memory, the R accumulators are independent chains, and the weights two tiles ahead are
// prefetched (four rows read side by side defeat the hardware's stream detection). A result is
// q16_rows's for the same row of x, bit for bit.
template <int R, int SCALES>
inline void q16_int8_tile(const int16_t* x16, const float* xd, const float* xs, int64_t K, int64_t n, const int8_t* qweight,
                          int64_t group, const void* scales, const float* mins, const float* bias, float* d, float* y) {
    const int64_t groups = K / group, blocks = K / XBLOCK, per_group = group / XBLOCK;
    const int8_t* rows = qweight + n * K;
    const char* ahead = reinterpret_cast<const char*>(rows + PREFETCH_AHEAD * K);
    for (int64_t off = 0; off < R * K; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) row_scale_products<SCALES>(scales, n + r, groups, per_group, xd, blocks, d + r * blocks);
    __m256 acc[R];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i xlo = _mm256_load_si256(reinterpret_cast<const __m256i*>(x16 + b * XBLOCK));
        const __m256i xhi = _mm256_load_si256(reinterpret_cast<const __m256i*>(x16 + b * XBLOCK + 16));
        for (int r = 0; r < R; ++r) {
            __m256i lo, hi;
            widen_natural(rows + r * K, b, lo, hi);
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, xlo), _mm256_madd_epi16(hi, xhi));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(d + r * blocks + b), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        if (SCALES == 1 && mins) add_min_term<1>(mins + (n + r) * blocks, xs, blocks, acc + r);
        y[n + r] = hsum256(acc[r]) + (bias ? bias[n + r] : 0.0f);
    }
}

template <int SCALES>
void q16_int8_row_tiles(const int16_t* x16, const float* xd, const float* xs, int64_t K, int64_t n_begin, int64_t n_end,
                        const int8_t* qweight, int64_t group, const void* scales, const float* mins, const float* bias,
                        float* y) {
    thread_local std::vector<float> dbuf;  // the tile's scale products [INT8_TILE, blocks]
    dbuf.resize(INT8_TILE * (K / XBLOCK));
    int64_t n = n_begin;
    for (; n + INT8_TILE <= n_end; n += INT8_TILE)
        q16_int8_tile<INT8_TILE, SCALES>(x16, xd, xs, K, n, qweight, group, scales, mins, bias, dbuf.data(), y);
    switch (n_end - n) {
        case 3: q16_int8_tile<3, SCALES>(x16, xd, xs, K, n, qweight, group, scales, mins, bias, dbuf.data(), y); break;
        case 2: q16_int8_tile<2, SCALES>(x16, xd, xs, K, n, qweight, group, scales, mins, bias, dbuf.data(), y); break;
        case 1: q16_int8_tile<1, SCALES>(x16, xd, xs, K, n, qweight, group, scales, mins, bias, dbuf.data(), y); break;
        default: break;
    }
}

// int5 weights (Q5_0, Q5_K), one row of x, INT8_TILE weight rows at a time. The values are
// unpacked as unsigned bytes q in [0, 31], two blocks per load of nibbles, and meet x's levels in
// maddubs without the sign trick (a pair of products is at most 2 x 31 x 127); the centered
// format's offset comes off as 16 x the lane sums of x (`lane_sums`, exact). Each lane's int32
// is then q8_rows<1>'s, and so is each result, bit for bit, in about two thirds of the work.
// SCALES: 0 float16 per 32, centered (format 5); 1 float32 per 32 and minimums (format 6).
template <int SCALES>
void q8_int5_row_tiles(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, const int32_t* lane_sums,
                       int64_t K, int64_t n_begin, int64_t n_end, const uint8_t* qweight, const void* scales,
                       const float* mins, const float* bias, float* y) {
    const int64_t blocks = K / XBLOCK, row_bytes = int5_row_bytes(K);
    const __m256i ones = _mm256_set1_epi16(1), k128 = _mm256_set1_epi16(128);
    const __m256i low4 = _mm256_set1_epi8(0x0F), k16 = _mm256_set1_epi8(16);
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    // byte j of block 2c takes byte j / 8 of the pair's eight bytes of fifth bits, of 2c + 1 byte 4 + j / 8
    const __m256i spread0 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i spread1 = _mm256_add_epi8(spread0, _mm256_set1_epi8(4));
    thread_local std::vector<float> dbuf;  // each tile's scale products [INT8_TILE, blocks]
    dbuf.resize(INT8_TILE * blocks);
    for (int64_t n = n_begin; n < n_end; n += INT8_TILE) {
        const uint8_t* rows = qweight + n * row_bytes;
        const char* ahead = reinterpret_cast<const char*>(rows + PREFETCH_AHEAD * row_bytes);
        for (int64_t off = 0; off < INT8_TILE * row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        for (int r = 0; r < INT8_TILE; ++r) {
            float* d = dbuf.data() + r * blocks;
            int64_t b = 0;
            if constexpr (SCALES == 0) {
                const half* sc = static_cast<const half*>(scales) + (n + r) * blocks;
                for (; b + 8 <= blocks; b += 8) _mm256_storeu_ps(d + b, _mm256_mul_ps(load8h(sc + b), _mm256_loadu_ps(xd + b)));
                for (; b < blocks; ++b) d[b] = h2f(sc[b]) * xd[b];
            } else {
                const float* sc = static_cast<const float*>(scales) + (n + r) * blocks;
                for (; b + 8 <= blocks; b += 8) _mm256_storeu_ps(d + b, _mm256_mul_ps(_mm256_loadu_ps(sc + b), _mm256_loadu_ps(xd + b)));
                for (; b < blocks; ++b) d[b] = sc[b] * xd[b];
            }
        }
        __m256 acc[INT8_TILE];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b += 2) {
            const __m256i x0 = load256(xq + b * 32), r0 = load256(xr + b * 32);
            const __m256i x1 = load256(xq + b * 32 + 32), r1 = load256(xr + b * 32 + 32);
            for (int r = 0; r < INT8_TILE; ++r) {
                const uint8_t* row = rows + r * row_bytes;
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 16));
                uint64_t bits;
                std::memcpy(&bits, row + K / 2 + b * 4, sizeof bits);
                const __m256i fifth = _mm256_set1_epi64x(static_cast<int64_t>(bits));
                const __m256i set0 = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(fifth, spread0), bit), bit);
                const __m256i set1 = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(fifth, spread1), bit), bit);
                const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(set0, k16));
                const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(set1, k16));
                __m256i dot0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q0, x0), k128),
                                                _mm256_madd_epi16(_mm256_maddubs_epi16(q0, r0), ones));
                __m256i dot1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q1, x1), k128),
                                                _mm256_madd_epi16(_mm256_maddubs_epi16(q1, r1), ones));
                if constexpr (SCALES == 0) {
                    dot0 = _mm256_sub_epi32(dot0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_sums + b * 8)));
                    dot1 = _mm256_sub_epi32(dot1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_sums + b * 8 + 8)));
                }
                const float* d = dbuf.data() + r * blocks + b;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_broadcast_ss(d), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_broadcast_ss(d + 1), acc[r]);
            }
        }
        for (int r = 0; r < INT8_TILE; ++r) {
            if (SCALES == 1 && mins) add_min_term<1>(mins + (n + r) * blocks, xs, blocks, acc + r);
            y[n + r] = hsum256(acc[r]) + (bias ? bias[n + r] : 0.0f);
        }
    }
}

// 16 x the sums of x's joined levels (128 q1 + q2) over each lane's four values, block by block:
// what the centered int5 format's offset takes off each lane of q8_int5_row_tiles's dots
inline void int5_lane_sums(const int8_t* xq, const int8_t* xr, int64_t K, int32_t* out) {
    const __m256i u1 = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < K / XBLOCK; ++b) {
        const __m256i s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, load256(xq + b * 32)), _mm256_set1_epi16(128));
        const __m256i s2 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, load256(xr + b * 32)), _mm256_set1_epi16(1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 8), _mm256_slli_epi32(_mm256_add_epi32(s1, s2), 4));
    }
}

}  // namespace

void q8_qmatmul_avx2(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                   const void* scales, const void* mins, const float* bias, float* y, int num_threads) {
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
        const bool int4_even = int4_values(format) && blocks % 2 == 0;  // q8_int4_rows
        const bool natural = natural_lanes(format, group);
        const bool joined = !int4_values(format) && (M >= 2 || natural);  // q16_rows, q16_int8_row_tiles
        std::unique_ptr<int16_t[]> x16_buf(joined ? new int16_t[M * K + 32] : nullptr);
        int16_t* const x16 = joined ? reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(x16_buf.get()) + 63) & ~uintptr_t(63)) : nullptr;
        std::unique_ptr<float[]> xd16(joined ? new float[M * blocks] : nullptr);
        plait::parallel_for(M, M >= 8 ? num_threads : 1, false, [&](int64_t m) {
            quantize_x_q8(x + m * K, K, xq + m * K, xr + m * K, xd + m * blocks, xs + m * blocks);
            const int64_t m0 = m / Q16_ROWS * Q16_ROWS, rows = std::min<int64_t>(Q16_ROWS, M - m0);
            if (int4_values(format)) {
                pair_x_q8(xq + m * K, K);
                pair_x_q8(xr + m * K, K);
            }
            if (joined) {
                join_x_q16(xq + m * K, xr + m * K, xd + m * blocks, K, rows, m - m0, natural, x16 + m0 * K,
                           xd16.get() + m0 * blocks);
            }
        });
        std::unique_ptr<int32_t[]> lane_sums(M == 1 && format == PLAIT_FORMAT_INT5 ? new int32_t[blocks * 8] : nullptr);
        if (lane_sums) int5_lane_sums(xq, xr, K, lane_sums.get());
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
                    auto run = [&](auto* sc, auto* mn) {
                        switch (std::min<int64_t>(4, M - m0)) {
                            case 1: q8_int4_rows<1>(q, r, d, sx, K, b, e, N, w4, sc, mn, bias, out); break;
                            case 2: q8_int4_rows<2>(q, r, d, sx, K, b, e, N, w4, sc, mn, bias, out); break;
                            case 3: q8_int4_rows<3>(q, r, d, sx, K, b, e, N, w4, sc, mn, bias, out); break;
                            default: q8_int4_rows<4>(q, r, d, sx, K, b, e, N, w4, sc, mn, bias, out); break;
                        }
                    };
                    if (format == PLAIT_FORMAT_INT4_F32)
                        run(static_cast<const float*>(scales), static_cast<const float*>(mins));
                    else
                        run(static_cast<const half*>(scales), static_cast<const half*>(mins));
                }
                return;
            }
            if (M == 1 && int5_values(format)) {
                const int64_t tiled = b + (e - b) / INT8_TILE * INT8_TILE;
                const uint8_t* w5 = static_cast<const uint8_t*>(qweight);
                if (format == PLAIT_FORMAT_INT5)
                    q8_int5_row_tiles<0>(xq, xr, xd, xs, lane_sums.get(), K, b, tiled, w5, scales, nullptr, bias, y);
                else
                    q8_int5_row_tiles<1>(xq, xr, xd, xs, nullptr, K, b, tiled, w5, scales,
                                         static_cast<const float*>(mins), bias, y);
                q8_rows<1>(xq, xr, xd, xs, K, tiled, e, N, qweight, format, group, scales, mins, bias, y);
                return;
            }
            if (M == 1 && natural) {
                const int8_t* w8 = static_cast<const int8_t*>(qweight);
                if (format == PLAIT_FORMAT_INT8)
                    q16_int8_row_tiles<0>(x16, xd, xs, K, b, e, w8, group, scales, nullptr, bias, y);
                else
                    q16_int8_row_tiles<1>(x16, xd, xs, K, b, e, w8, group, scales, static_cast<const float*>(mins), bias, y);
                return;
            }
            if (joined) {
                for (int64_t m0 = 0; m0 < M; m0 += Q16_ROWS) {
                    const int16_t* q = x16 + m0 * K;
                    const float *d = xd16.get() + m0 * blocks, *sx = xs + m0 * blocks;
                    float* out = y + m0 * N;
                    const bool first = m0 == 0;
                    switch (std::min<int64_t>(Q16_ROWS, M - m0)) {
                        case 1: q16_rows_for<1>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                        case 2: q16_rows_for<2>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                        case 3: q16_rows_for<3>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                        case 4: q16_rows_for<4>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                        case 5: q16_rows_for<5>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                        case 6: q16_rows_for<6>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                        case 7: q16_rows_for<7>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                        default: q16_rows_for<Q16_ROWS>(format, group, q, d, sx, K, b, e, qweight, scales, mins, bias, N, out, first); break;
                    }
                }
                return;
            }
            // more rows of x go through in fours, each four against the whole chunk: the chunk's
            // 16 weight rows are unpacked once per four rows of x and stay in L1 meanwhile
            // (faster than dequantizing tiles of weight rows to float for these rows)
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
}

}  // namespace plait::qmm

#endif
