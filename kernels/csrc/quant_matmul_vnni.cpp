// The quantized matmul's AVX-512 VNNI tier (Intel since Ice Lake, Zen 4 and 5): `vpdpbusd`
// multiplies u8 by s8 four at a time and adds into int32, one instruction for the AVX2 tier's
// maddubs + madd, 64 bytes wide. Activations rounded to int8 in two levels at any row count.
#include "quant_matmul.h"

#include "parallel.h"

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
inline __m128 load4s(const half* p) { return load4h(p); }
inline __m128 load4s(const float* p) { return _mm_loadu_ps(p); }
// The first `mask` of four scales (float16 or float32), zeros past them.
inline __m128 maskz_load4s(__mmask8 mask, const half* p) { return _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, p)); }
inline __m128 maskz_load4s(__mmask8 mask, const float* p) { return _mm_maskz_loadu_ps(mask, p); }

// q8_int4_rows<1> on AVX-512 VNNI: four groups per step, x in quad layout. From L1 on one thread
// a pair of groups costs ~2.3 cycles here against the AVX2 loop's ~4.4 (Zen 5), and from L2 at
// SmolLM2's K = 576, 3.0-3.5 against 5.1.
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
// same order of sums), ~9% faster from L2 and ~3% from memory on SmolLM2's layers (K = 576).
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
// `row_bytes` / `row_floats` a row's share of the tiles), then chunks of `task_rows` weight rows
// against X_TILE_M rows of x at a time (the chunk stays in cache across the passes over x, and x
// is read from L2 or memory once per chunk, so many rows of x want larger chunks): `rows(mt, tile, tile_ds,
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
    const int64_t chunk = task_rows(M, N, num_threads), chunks = (N + chunk - 1) / chunk;
    plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
        const int64_t b = c * chunk, e = std::min(N, b + chunk);
        for (int64_t m0 = 0; m0 < M; m0 += X_TILE_M)
            with_tile_rows(std::min(X_TILE_M, M - m0), [&](auto mt) {
                rows(mt, q + m0 * row_bytes, ds + m0 * row_floats, b, e, y + m0 * N);
            });
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

// A tile of Mt <= X_TILE_M rows of x for int8 weights, its two levels joined into int16 values
// v = 128 q1 + q2. Per 64 weights p (two blocks) and row m, 128 bytes at (p * Mt + m) * 128: two
// runs of 32 int16, one per `vpdpwssd` (see int8_pairs), lane j of run 0 holding the x values of
// weights 4j and 4j + 2, of run 1 those of 4j + 1 and 4j + 3. Per sixteen blocks j and row m, the
// block scales: 16 floats at (j * Mt + m) * 16.
struct Int8X {
    const char* q;
    const float* ds;
};
constexpr int64_t INT8_X_BYTES = 128;

// Row i of a tile of Mt rows (see layout_int4_x). With `xs` (int8f_rows_vnni's minimums), each
// sixteen blocks' scales are followed by their sixteen sums: 32 floats at (j * Mt + m) * 32.
inline void layout_int8_x(const int8_t* xq, const int8_t* xr, const float* xd, int64_t K, int64_t Mt, int64_t i,
                          char* q, float* ds, const float* xs = nullptr) {
    const int64_t stride = xs ? 32 : 16;
    for (int64_t b = 0; b < K / 32; ++b) {
        int16_t* p = reinterpret_cast<int16_t*>(q + ((b / 2) * Mt + i) * INT8_X_BYTES);
        for (int64_t w = 0; w < 32; ++w) {
            const int64_t at = (b % 2) * 32 + w, j = at / 4, r = at % 4;
            p[(r % 2) * 32 + 2 * j + r / 2] = static_cast<int16_t>(128 * xq[b * 32 + w] + xr[b * 32 + w]);
        }
        float* d = ds + ((b / 16) * Mt + i) * stride + b % 16;
        d[0] = xd[b];
        if (xs) d[16] = xs[b];
    }
}

// The two int16 runs of 64 int8 weights (v) that meet an Int8X pair of blocks: in each 32-bit
// lane, bytes 0 and 2, then 1 and 3, sign-extended.
inline void int8_pairs(__m512i v, __m512i* w) {
    w[0] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
    w[1] = _mm512_srai_epi16(v, 8);
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
// over the weights, as int4_rows_vnni: each 64 weights widened once into two runs of int16
// (int8_pairs) that meet x's joined levels in `vpdpwssd`. Per 64 weights and row: two vpdpwssd, a
// convert, the permute that spreads two blocks' scale products and an FMA. `vpdpbusd` on the two
// levels apart would want one unsigned side (the weights as w + 128, lane biases in x to cancel
// the 128): an instruction more per row and half as many x bytes again.
template <int M>
void int8_rows_vnni(const Int8X& x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const int8_t* qweight,
                    int64_t group, const half* scales, const float* bias, float* y) {
    const int64_t blocks = K / XBLOCK, groups = K / group;
    const __m512i spread2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
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
                __m512i w[2];
                int8_pairs(v, w);  // a masked-off half is zeros
                const __m512i at = _mm512_add_epi32(spread2, _mm512_set1_epi32(static_cast<int>(b)));
                const char* p = q;
                for (int m = 0; m < M; ++m, p += INT8_X_BYTES) {
                    const __m512i dot = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w[0], _mm512_load_si512(p)),
                                                            w[1], _mm512_load_si512(p + 64));
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

// int8 weights with float32 scales per 16 (Q6_K) or 32 (Q5_K) weights, and float32 minimums per 32
// where `mins` is set (Q5_K: w = q * scale + min, q in 0..31), against M <= X_TILE_M rows of x:
// int8_rows_vnni's dot products (weights widened to int16 runs against x's joined levels), with
// the scale products built per eight blocks: sixteen per-16-weight scales times x's
// block scales, each 64 weights' dot lanes (four weights a lane) spread over four of them. The
// minimums' term is sum_b min[b] * xs[b] over x's exact block sums, as the int4 rows compute it.
template <int M>
void int8f_rows_vnni(const Int8X& x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const int8_t* qweight,
                     int64_t group, const float* scales, const float* mins, const float* bias, float* y) {
    const int64_t blocks = K / XBLOCK, groups = K / group;
    const __m512i halves = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // lane l: block l / 2
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane l: 16 weights l / 4
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / K);
    RowSums8 sums[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const int8_t* row = qweight + n * K;
        const float* sc = scales + n * groups;
        const float* mn = mins ? mins + n * blocks : nullptr;
        if (n + ahead < N) {
            const char* w = reinterpret_cast<const char*>(row + ahead * K);
            for (int64_t off = 0; off < K; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
            const char* s = reinterpret_cast<const char*>(sc + ahead * groups);
            for (int64_t off = 0; off < groups * int64_t(sizeof(float)); off += 64) _mm_prefetch(s + off, _MM_HINT_T0);
        }
        __m512 acc[M];
        __m256 acc_min[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), acc_min[m] = _mm256_setzero_ps();
        const char* q = x.q;
        for (int64_t j = 0; j < blocks; j += 16) {
            const float* ds = x.ds + (j / 16) * M * 32;
            for (int64_t h = j; h < std::min(blocks, j + 16); h += 8) {  // eight blocks: sixteen scales of 16 weights
                const int64_t left = std::min<int64_t>(8, blocks - h);
                const __mmask8 mask8 = static_cast<__mmask8>((1u << left) - 1);
                const __m512 ws = group == 16
                    ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (2 * left)) - 1), sc + 2 * h)
                    : _mm512_permutexvar_ps(halves, _mm512_castps256_ps512(_mm256_maskz_loadu_ps(mask8, sc + h)));
                __m512 d[M];
                for (int m = 0; m < M; ++m) {
                    const float* dm = ds + m * 32 + (h - j);
                    d[m] = _mm512_mul_ps(ws, _mm512_permutexvar_ps(halves, _mm512_castps256_ps512(_mm256_maskz_loadu_ps(mask8, dm))));
                    if (mn) acc_min[m] = _mm256_fmadd_ps(_mm256_maskz_loadu_ps(mask8, mn + h), _mm256_maskz_loadu_ps(mask8, dm + 16), acc_min[m]);
                }
                for (int64_t b = 0; b < left; b += 2, q += M * INT8_X_BYTES) {
                    const __m512i v = left - b >= 2 ? _mm512_loadu_si512(row + (h + b) * XBLOCK)
                                                    : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + (h + b) * XBLOCK);
                    __m512i w[2];
                    int8_pairs(v, w);
                    const __m512i at = _mm512_add_epi32(quarters, _mm512_set1_epi32(static_cast<int>(2 * b)));
                    const char* p = q;
                    for (int m = 0; m < M; ++m, p += INT8_X_BYTES) {
                        const __m512i dot = _mm512_dpwssd_epi32(
                            _mm512_dpwssd_epi32(_mm512_setzero_si512(), w[0], _mm512_load_si512(p)), w[1], _mm512_load_si512(p + 64));
                        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(at, d[m]), acc[m]);
                    }
                }
            }
        }
        for (int m = 0; m < M; ++m) sums[m].push(n, _mm256_add_ps(reduce512(acc[m]), acc_min[m]), bias, y + m * N);
    }
    for (int m = 0; m < M; ++m) sums[m].flush(n_end, bias, y + m * N);
}

void int8f_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const int8_t* qweight, int64_t group,
                       const float* scales, const float* mins, const float* bias, float* y, int num_threads) {
    const int64_t blocks = K / XBLOCK, pairs = (blocks + 1) / 2, sixteens = (blocks + 15) / 16;
    tiled_matmul_vnni(
        x, M, K, N, pairs * INT8_X_BYTES, sixteens * 32, y, num_threads,
        [&](const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t Mt, int64_t i, char* tile,
            float* tile_ds) {
            if (blocks % 2) std::memset(tile + ((pairs - 1) * Mt + i) * INT8_X_BYTES, 0, INT8_X_BYTES);  // read padding
            layout_int8_x(xq, xr, xd, K, Mt, i, tile, tile_ds, xs);
        },
        [&](auto mt, const char* tile, const float* tile_ds, int64_t b, int64_t e, float* out) {
            int8f_rows_vnni<decltype(mt)::value>(Int8X{tile, tile_ds}, K, b, e, N, qweight, group, scales, mins, bias, out);
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
    const int8_t* w8 = static_cast<const int8_t*>(qweight);
    switch (format) {
        case PLAIT_FORMAT_INT4: int4(static_cast<const half*>(scales), static_cast<const half*>(mins)); break;
        case PLAIT_FORMAT_INT4_F32: int4(static_cast<const float*>(scales), static_cast<const float*>(mins)); break;
        case PLAIT_FORMAT_INT8_F32:
            int8f_matmul_vnni(x, M, K, N, w8, group, static_cast<const float*>(scales), static_cast<const float*>(mins),
                              bias, y, num_threads);
            break;
        default: int8_matmul_vnni(x, M, K, N, w8, group, static_cast<const half*>(scales), bias, y, num_threads);
    }
}

}  // namespace plait::qmm

#endif
