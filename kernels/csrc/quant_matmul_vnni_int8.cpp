// The AVX-512 VNNI tier's int8 weights (Q8_0, Q6_K, int8) and five-bit ones (Q5_0, Q5_K), unpacked
// to int8 in registers: each 64 weights widened to int16 meet x's two levels joined into int16 in
// `vpdpwssd`. The tiled driver and the int4 weights are in quant_matmul_vnni.cpp.
#include "quant_matmul_vnni.h"

#ifdef PLAIT_VNNI512

namespace plait::qmm {

namespace {

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

// The int8 rows' weights, two blocks (64 weights) from an even block j at a time, as int8 values
// in order. Int8Weights: stored as int8 (formats 0 and 3; a last odd block is a masked load), rows
// [first, end) from `base` (a whole matrix, or a task's rows widened to int8 by `widen`).
// Int5Weights: five-bit values (5 and 6, quant_matmul.h: int5 rows), unpacked here: the chunk's
// nibble bytes broadcast to both halves, the upper half's shifted down, each byte's fifth bit added
// from a mask, less the offset.
struct Int8Weights {
    const uint8_t* base;
    int64_t row_bytes;
    int64_t first = 0, end = INT64_MAX;
    const uint8_t* row(int64_t n) const { return base + (n - first) * row_bytes; }
    bool holds(int64_t n) const { return n < end; }
    __m512i pair(const uint8_t* row, int64_t j, bool whole) const {
        const uint8_t* p = row + j * XBLOCK;
        return whole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p);
    }
};
struct Int5Weights {
    const uint8_t* base;
    int64_t K, row_bytes;
    __m512i offset;
    Int5Weights(const uint8_t* base, int64_t K, int offset)
        : base(base), K(K), row_bytes(int5_row_bytes(K)), offset(_mm512_set1_epi8(static_cast<char>(offset))) {}
    const uint8_t* row(int64_t n) const { return base + n * row_bytes; }
    bool holds(int64_t) const { return true; }
    __m512i pair(const uint8_t* row, int64_t j, bool) const {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * 16)));
        const __m512i nib = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(0x0F));
        uint64_t bits;
        std::memcpy(&bits, row + K / 2 + j * 4, sizeof bits);
        return _mm512_sub_epi8(_mm512_mask_add_epi8(nib, _cvtu64_mask64(bits), nib, _mm512_set1_epi8(16)), offset);
    }
    // rows [b, e) as int8 values into `out`, a view of them
    Int8Weights widen(int64_t b, int64_t e, std::vector<uint8_t>& out) const {
        out.resize((e - b) * K);
        for (int64_t n = b; n < e; ++n)
            for (int64_t j = 0; j < K / XBLOCK; j += 2)
                _mm512_storeu_si512(out.data() + (n - b) * K + j * XBLOCK, pair(row(n), j, true));
        return Int8Weights{out.data(), K, b, e};
    }
};

// The int8 rows' tasks (tiled_matmul_vnni's `task`): a task's weight rows [b, e) as the passes over
// x read them. Five-bit weights that several tiles of x pass over (more than X_TILE_M rows of x:
// prefill) are widened to int8 once per task, in L2, rather than unpacked on every pass; the
// values, and so the results, are the same either way.
template <class W>
struct TaskWeights {
    const W& weights;
    int64_t M;
    template <class Passes>
    void operator()(int64_t b, int64_t e, Passes&& passes) const {
        if constexpr (std::is_same_v<W, Int5Weights>) {
            if (M > X_TILE_M) {
                thread_local std::vector<uint8_t> wide;
                passes(weights.widen(b, e, wide));
                return;
            }
        }
        passes(weights);
    }
};

// Weight row n + ahead and its scales (row n's at `sc`, `groups` a row), where the weights hold it
template <class W, class S>
inline void prefetch_ahead(const W& weights, const S* sc, int64_t n, int64_t ahead, int64_t N, int64_t groups) {
    if (n + ahead >= N || !weights.holds(n + ahead)) return;
    const char* w = reinterpret_cast<const char*>(weights.row(n + ahead));
    for (int64_t off = 0; off < weights.row_bytes; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
    const char* s = reinterpret_cast<const char*>(sc + ahead * groups);
    for (int64_t off = 0; off < groups * int64_t(sizeof(S)); off += 64) _mm_prefetch(s + off, _MM_HINT_T0);
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
template <int M, class W>
void int8_rows_vnni(const Int8X& x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const W& weights,
                    int64_t group, const half* scales, const float* bias, float* y) {
    const int64_t blocks = K / XBLOCK, groups = K / group;
    const __m512i spread2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / weights.row_bytes);
    RowSums8 sums[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const uint8_t* row = weights.row(n);
        const half* sc = scales + n * groups;
        prefetch_ahead(weights, sc, n, ahead, N, groups);
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
                __m512i w[2];
                int8_pairs(weights.pair(row, j + b, left - b >= 2), w);  // a masked-off half is zeros
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

template <class W>
void int8_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const W& weights, int64_t group,
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
        [&](auto mt, const char* tile, const float* tile_ds, int64_t b, int64_t e, float* out, const auto& w) {
            int8_rows_vnni<decltype(mt)::value>(Int8X{tile, tile_ds}, K, b, e, N, w, group, scales, bias, out);
        },
        TaskWeights<W>{weights, M});
}

// int8 weights with float32 scales per 16 (Q6_K) or 32 (Q5_K) weights, and float32 minimums per 32
// where `mins` is set (Q5_K: w = q * scale + min, q in 0..31), against M <= X_TILE_M rows of x:
// int8_rows_vnni's dot products (weights widened to int16 runs against x's joined levels), with
// the scale products built per eight blocks: sixteen per-16-weight scales times x's
// block scales, each 64 weights' dot lanes (four weights a lane) spread over four of them. The
// minimums' term is sum_b min[b] * xs[b] over x's exact block sums, as the int4 rows compute it.
template <int M, class W>
void int8f_rows_vnni(const Int8X& x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const W& weights,
                     int64_t group, const float* scales, const float* mins, const float* bias, float* y) {
    const int64_t blocks = K / XBLOCK, groups = K / group;
    const __m512i halves = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // lane l: block l / 2
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane l: 16 weights l / 4
    const int64_t ahead = std::max<int64_t>(1, INT4_PREFETCH_BYTES / weights.row_bytes);
    RowSums8 sums[M];
    for (int64_t n = n_begin; n < n_end; ++n) {
        const uint8_t* row = weights.row(n);
        const float* sc = scales + n * groups;
        const float* mn = mins ? mins + n * blocks : nullptr;
        prefetch_ahead(weights, sc, n, ahead, N, groups);
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
                    __m512i w[2];
                    int8_pairs(weights.pair(row, h + b, left - b >= 2), w);
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

template <class W>
void int8f_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const W& weights, int64_t group,
                       const float* scales, const float* mins, const float* bias, float* y, int num_threads) {
    const int64_t blocks = K / XBLOCK, pairs = (blocks + 1) / 2, sixteens = (blocks + 15) / 16;
    tiled_matmul_vnni(
        x, M, K, N, pairs * INT8_X_BYTES, sixteens * 32, y, num_threads,
        [&](const int8_t* xq, const int8_t* xr, const float* xd, const float* xs, int64_t Mt, int64_t i, char* tile,
            float* tile_ds) {
            if (blocks % 2) std::memset(tile + ((pairs - 1) * Mt + i) * INT8_X_BYTES, 0, INT8_X_BYTES);  // read padding
            layout_int8_x(xq, xr, xd, K, Mt, i, tile, tile_ds, xs);
        },
        [&](auto mt, const char* tile, const float* tile_ds, int64_t b, int64_t e, float* out, const auto& w) {
            int8f_rows_vnni<decltype(mt)::value>(Int8X{tile, tile_ds}, K, b, e, N, w, group, scales, mins, bias, out);
        },
        TaskWeights<W>{weights, M});
}

}  // namespace

void int8_qmatmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                       const void* scales, const void* mins, const float* bias, float* y, int num_threads) {
    const uint8_t* w8 = static_cast<const uint8_t*>(qweight);
    const half* sh = static_cast<const half*>(scales);
    const float *sf = static_cast<const float*>(scales), *mf = static_cast<const float*>(mins);
    switch (format) {
        case PLAIT_FORMAT_INT8_F32: int8f_matmul_vnni(x, M, K, N, Int8Weights{w8, K}, group, sf, mf, bias, y, num_threads); break;
        case PLAIT_FORMAT_INT5: int8_matmul_vnni(x, M, K, N, Int5Weights(w8, K, 16), group, sh, bias, y, num_threads); break;
        case PLAIT_FORMAT_INT5_F32: int8f_matmul_vnni(x, M, K, N, Int5Weights(w8, K, 0), group, sf, mf, bias, y, num_threads); break;
        default: int8_matmul_vnni(x, M, K, N, Int8Weights{w8, K}, group, sh, bias, y, num_threads);
    }
}

}  // namespace plait::qmm

#endif
