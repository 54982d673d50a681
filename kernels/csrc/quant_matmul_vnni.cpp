// The quantized matmul's AVX-512 VNNI tier (Intel since Ice Lake, Zen 4 and 5): `vpdpbusd`
// multiplies u8 by s8 four at a time and adds into int32, one instruction for the AVX2 tier's
// maddubs + madd, 64 bytes wide. Activations rounded to int8 in two levels at any row count. This
// file holds the int4 weights (Q4_0, Q4_1, Q4_K) and the tier's entry point; the int8 and five-bit
// weights are in quant_matmul_vnni_int8.cpp, the tiled driver both use in quant_matmul_vnni.h.
#include "quant_matmul_vnni.h"

#ifdef PLAIT_VNNI512

namespace plait::qmm {

namespace {

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

// The second level is summed onto the first one's shifted sums: 128 (w . q1) + w . q2 in one chain,
// an add fewer per quad than summing the levels apart (the same int32 values).
inline __m512i int4_quad_dot(__m512i lo, __m512i hi, const int8_t* xp, const int8_t* rp) {
    const __m512i q1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp)), hi,
                                           _mm512_loadu_si512(xp + 64));
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(q1, 7), lo, _mm512_loadu_si512(rp)), hi,
                               _mm512_loadu_si512(rp + 64));
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
inline __m128 load4s(const half* p) { return load4h(p); }
inline __m128 load4s(const float* p) { return _mm_loadu_ps(p); }
// The first `mask` of four scales (float16 or float32), zeros past them.
inline __m128 maskz_load4s(__mmask8 mask, const half* p) { return _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, p)); }
inline __m128 maskz_load4s(__mmask8 mask, const float* p) { return _mm_maskz_loadu_ps(mask, p); }

// q8_int4_rows<1> on AVX-512 VNNI: four groups per step, x in quad layout. A pair of groups costs
// fewer cycles here than in the AVX2 loop, from L1 and from L2.
template <class S>
void q8_int4_rows_x1_vnni(const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t K,
                          int64_t n_begin, int64_t n_end, int64_t N, const uint8_t* qweight, const S* scales,
                          const S* mins, const float* bias, float* y) {
    const int64_t groups = K / 32;
    // lanes 4i..4i+3 take scale product i (spread_lo) or 4 + i (spread_hi)
    const __m512i spread_lo = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i spread_hi = _mm512_add_epi32(spread_lo, _mm512_set1_epi32(4));
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    RowSums8 rows;
    for (int64_t n = n_begin; n < n_end; ++n) {
        const S* sc = scales + n * groups;
        const S* mn = mins + n * groups;
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
            acc_min = _mm256_fmadd_ps(load8s(mn + g), _mm256_loadu_ps(xs + g), acc_min);
            const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(load8s(sc + g), _mm256_loadu_ps(xd + g)));
            acc = _mm512_fmadd_ps(quad(g), _mm512_permutexvar_ps(spread_lo, d), acc);
            acc = _mm512_fmadd_ps(quad(g + 4), _mm512_permutexvar_ps(spread_hi, d), acc);
        }
        if (g + 4 <= groups) {
            acc_min = _mm256_add_ps(acc_min, _mm256_zextps128_ps256(_mm_mul_ps(load4s(mn + g), _mm_loadu_ps(xs + g))));
            const __m512 d = _mm512_castps128_ps512(_mm_mul_ps(load4s(sc + g), _mm_loadu_ps(xd + g)));
            acc = _mm512_fmadd_ps(quad(g), _mm512_permutexvar_ps(spread_lo, d), acc);
            g += 4;
        }
        __m256 acc8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
        if (g < groups) {  // a last pair, in pair layout
            acc_min = _mm256_add_ps(acc_min, _mm256_zextps128_ps256(_mm_mul_ps(load2s(mn + g), load2(xs + g))));
            const __m256 d = _mm256_castps128_ps256(_mm_mul_ps(load2s(sc + g), load2(xd + g)));
            acc8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int4_pair_dot_vnni(row + g * 16, xq + g * 32, xr + g * 32)),
                                   _mm256_permutevar8x32_ps(d, spread), acc8);
        }
        rows.push(n, _mm256_add_ps(acc8, acc_min), bias, y);
    }
    rows.flush(n_end, bias, y);
}


// A tile of Mt <= X_TILE_M rows of x. Per quad k and row m, 256 bytes at (k * Mt + m) * 256:
// q1's 64 low-nibble bytes and 64 high, then q2's the same. Per sixteen groups j and row m, 32
// floats at (j * Mt + m) * 32: the sixteen block scales, then the sixteen block sums (zero past
// the last group). Interleaved so that the kernel's loads are one base pointer plus constant
// offsets (eight rows' separate pointers would spill to the stack and slow the loop).
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
// share two pipes on Zen 5, so the permute is cheaper there than a multiply per quad and row. A
// last pair of groups runs 256 bits wide, three groups are a masked load. For one row this is
// exactly q8_int4_rows_x1_vnni's arithmetic, in the same order (the tests hold the two to the bit).
template <int M, class S>
void int4_rows_vnni(const Int4X& x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const uint8_t* qweight,
                    const S* scales, const S* mins, const float* bias, float* y) {
    const int64_t groups = K / 32;
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / (K / 2));
    const __m512i spread_hi = _mm512_add_epi32(spread, _mm512_set1_epi32(4));
    const __m256i spread8 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i low4y = _mm256_set1_epi8(0x0F);
    RowSums8 sums[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const S* sc = scales + n * groups;
        const S* mn = mins + n * groups;
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
            const __m256 s8 = load8s(sc + g), m8 = load8s(mn + g);
            for (int m = 0; m < M; ++m) {
                acc_min[m] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xd(m, g) + 16), acc_min[m]);
                d[m] = _mm512_castps256_ps512(_mm256_mul_ps(s8, _mm256_loadu_ps(xd(m, g))));
            }
            quad(_mm512_loadu_si512(row + g * 16), spread);
            quad(_mm512_loadu_si512(row + (g + 4) * 16), spread_hi);
        }
        if (const int64_t left = std::min<int64_t>(4, groups - g); left >= 3) {  // three or four groups: a (masked) quad
            const __mmask8 mask = static_cast<__mmask8>((1u << left) - 1);
            const __m128 s4 = maskz_load4s(mask, sc + g), m4 = maskz_load4s(mask, mn + g);
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
            const __m128 s2 = maskz_load4s(mask, sc + g), m2 = maskz_load4s(mask, mn + g);
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
// same order of sums), a little faster, most of all from L2.
template <class S>
void int4_row_x1_vnni(const float* x, int64_t K, int64_t N, const uint8_t* qweight, const S* scales,
                      const S* mins, const float* bias, float* y, int num_threads) {
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

template <class S>
void int4_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qweight, const S* scales,
                      const S* mins, const float* bias, float* y, int num_threads) {
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

}  // namespace

void q8_qmatmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                   const void* scales, const void* mins, const float* bias, float* y, int num_threads) {
    // every row count, one row included: a row's result does not depend on the rows beside it
    auto int4 = [&](auto* sc, auto* mn) {
        const uint8_t* w = static_cast<const uint8_t*>(qweight);
        if (M == 1 && K / XBLOCK % 2 == 0)
            int4_row_x1_vnni(x, K, N, w, sc, mn, bias, y, num_threads);
        else
            int4_matmul_vnni(x, M, K, N, w, sc, mn, bias, y, num_threads);
    };
    switch (format) {
        case PLAIT_FORMAT_INT4: int4(static_cast<const half*>(scales), static_cast<const half*>(mins)); break;
        case PLAIT_FORMAT_INT4_F32: int4(static_cast<const float*>(scales), static_cast<const float*>(mins)); break;
        default: int8_qmatmul_vnni(x, M, K, N, qweight, format, group, scales, mins, bias, y, num_threads);
    }
}

}  // namespace plait::qmm

#endif
