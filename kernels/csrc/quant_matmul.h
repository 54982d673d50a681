// Shared by the quantized matmul's files: cpu_quant_matmul.cpp (the exported functions, choosing a
// path), quant_matmul_float.cpp (float tiles and fused rows: every CPU), quant_matmul_avx2.cpp
// (int8 activations on AVX2), quant_matmul_vnni*.cpp (int8 activations on AVX-512 VNNI) and
// dense_gemv.cpp (float32 weights). It holds the formats' helpers, the activations' int8 rounding
// that both integer tiers use, and each tier's entry point. The tier is fixed at build time by the
// target (`-march`, see kernels/native.py), which is built for the CPU that runs it.
#pragma once

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

#include "plait_kernels.h"

namespace plait::qmm {

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

// Scales (and minimums) come as float16 (formats 0 and 1, as GGUF's Q8_0 / Q4_x store them) or
// float32 (formats 3 and 4: a k-quant's sub-block scale times its superblock's, exact in float32
// but not in float16). The kernels are templates over the scale type S; these read either.
inline float s2f(half h) { return h2f(h); }
inline float s2f(float f) { return f; }

#ifdef __AVX2__
inline __m256 load8h(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Two float16 values into the low half of an SSE register.
inline __m128 load2h(const half* p) {
    uint32_t u;
    std::memcpy(&u, p, sizeof u);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u)));
}
// Two floats into the low half of an SSE register.
inline __m128 load2(const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); }
inline __m256 load8s(const half* p) { return load8h(p); }
inline __m256 load8s(const float* p) { return _mm256_loadu_ps(p); }
inline __m128 load2s(const half* p) { return load2h(p); }
inline __m128 load2s(const float* p) { return load2(p); }
#endif

constexpr int64_t TILE_N = 4;
constexpr int64_t MAX_FUSED_M = 4;  // rows of x that fused_rows / dense_rows take (decode); more go in tiles

// w = q * scale (+ min, where `mins` is set: one per 32 weights), rounded as gguf rounds it
template <class S>
inline void dequant_int8_row(const int8_t* q, const S* scales, const S* mins, int64_t K, int64_t group, float* out) {
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        const float s = s2f(scales[g0 / group]), m = mins ? s2f(mins[g0 / PLAIT_Q8_BLOCK]) : 0.0f;
        int64_t k = g0;
        const int64_t end = g0 + group;
#ifdef __AVX2__
        const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
        for (; k + 8 <= end; k += 8) {
            __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
            _mm256_storeu_ps(out + k, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(qi), vs), vm));
        }
#endif
        for (; k < end; ++k) out[k] = static_cast<float>(q[k]) * s + m;
    }
}

template <class S>
inline void dequant_int4_row(const uint8_t* q, const S* scales, const S* mins, int64_t K, int64_t group,
                      float* out) {
    const int64_t half_group = group / 2;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
        const float s = s2f(scales[gi]), m = s2f(mins[gi]);
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

// Five-bit values (formats 5 and 6, GGUF's Q5_0 and Q5_K) in chunks of 64 weights. A row is K / 2
// bytes of nibbles, then K / 8 bytes of fifth bits: chunk c's 32 nibble bytes at c * 32 hold weight
// 64c + j in the low nibble of byte j and weight 64c + 32 + j in the high one, so that either half
// of the bytes is one block of 32 in order; its fifth bits are the 8 bytes at K / 2 + c * 8, bit i
// (little-endian) that of weight 64c + i. Format 5 has float16 scales and no minimums and is
// centered, w = (q - 16) * scale; format 6 has float32 scales and minimums, w = q * scale + min.
// K is a multiple of 64. The kernels read these as the int8 values q - 16 or q, unpacked in
// registers: the int8 paths' arithmetic on 5/8 of their bytes.
inline int64_t int5_row_bytes(int64_t K) { return K / 2 + K / 8; }
inline int int5_offset(int format) { return format == PLAIT_FORMAT_INT5 ? 16 : 0; }

// Block b (weights 32b..32b+31) of an int5 row, as int8 values q - offset
inline void int5_block(const uint8_t* row, int64_t K, int64_t b, int offset, int8_t* out) {
    const uint8_t* nib = row + (b / 2) * 32;
    uint32_t bits;
    std::memcpy(&bits, row + K / 2 + b * 4, sizeof bits);
    for (int j = 0; j < 32; ++j) {
        const int q = ((b % 2 ? nib[j] >> 4 : nib[j]) & 0x0F) | (((bits >> j) & 1u) << 4);
        out[j] = static_cast<int8_t>(q - offset);
    }
}

#ifdef __AVX2__
// int5_block in a register: the nibbles' half, the fifth bits spread to bytes (byte j takes byte
// j / 8 of the bits, then its own bit), less the offset.
inline __m256i int5_block256(const uint8_t* row, int64_t K, int64_t b, int offset) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b / 2) * 32));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i nib = b % 2 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
    uint32_t bits;
    std::memcpy(&bits, row + K / 2 + b * 4, sizeof bits);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread), bit), bit);
    const __m256i q = _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(static_cast<char>(offset)));
}
#endif

// w = q * scale (+ min) of an int5 row, block by block
template <class S>
inline void dequant_int5_row(const uint8_t* row, const S* scales, const S* mins, int64_t K, int offset, float* out) {
    for (int64_t b = 0; b < K / 32; ++b) {
        const float s = s2f(scales[b]), m = mins ? s2f(mins[b]) : 0.0f;
        float* o = out + b * 32;
#ifdef __AVX2__
        alignas(32) int8_t q[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(q), int5_block256(row, K, b, offset));
        const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
        for (int i = 0; i < 4; ++i) {
            const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)));
            _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(qi), vs), vm));
        }
#else
        int8_t q[32];
        int5_block(row, K, b, offset, q);
        for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * s + m;
#endif
    }
}

// The formats' scale type and value width (plait_kernels.h: PlaitWeightFormat).
inline bool float32_scales(int format) {
    return format == PLAIT_FORMAT_INT8_F32 || format == PLAIT_FORMAT_INT4_F32 || format == PLAIT_FORMAT_INT5_F32;
}
inline bool int4_values(int format) { return format == PLAIT_FORMAT_INT4 || format == PLAIT_FORMAT_INT4_F32; }
inline bool int5_values(int format) { return format == PLAIT_FORMAT_INT5 || format == PLAIT_FORMAT_INT5_F32; }

// Row n of a quantized matrix (any format but float32), dequantized to float32.
inline void dequant_row(const void* qweight, int format, int64_t n, int64_t K, int64_t group, const void* scales,
                        const void* mins, float* out) {
    const int64_t groups = K / group;
    auto run = [&](auto* sc, auto* mn) {
        sc += n * groups;
        mn = mn ? mn + n * (K / PLAIT_Q8_BLOCK) : nullptr;  // minimums: one per 32 weights
        if (int4_values(format))
            dequant_int4_row(static_cast<const uint8_t*>(qweight) + n * (K / 2), sc, mn, K, group, out);
        else if (int5_values(format))
            dequant_int5_row(static_cast<const uint8_t*>(qweight) + n * int5_row_bytes(K), sc, mn, K,
                             int5_offset(format), out);
        else
            dequant_int8_row(static_cast<const int8_t*>(qweight) + n * K, sc, mn, K, group, out);
    };
    if (float32_scales(format))
        run(static_cast<const float*>(scales), static_cast<const float*>(mins));
    else
        run(static_cast<const half*>(scales), static_cast<const half*>(mins));
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
// changes greedy tokens against the same weights with float activations and raises int4
// perplexity; with the second level the greedy tokens agree. The second level costs single-stream
// int4 decode a little, more where the decode is close to compute-bound (few cores).
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


// Weights read row after row fall short of a plain read of the same bytes: three streams per
// thread (weights, scales, minimums) that restart at every matrix, which the hardware prefetcher
// picks up late. Prefetching ~8 KB ahead by hand, past the end of this task's rows into the next
// task's (the same thread's, under static scheduling), brings them to the plain read's pace.
constexpr int64_t INT4_PREFETCH_BYTES = 8192;

// Row n's loop prefetches row n + ahead (computed once per call: a division per row would cost
// more than the row's prefetches).
template <class S>
inline void prefetch_int4_row(const uint8_t* row, const S* sc, const S* mn, int64_t row_bytes, int64_t groups,
                              int64_t ahead) {
    const char* w = reinterpret_cast<const char*>(row + ahead * row_bytes);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
    const char* s = reinterpret_cast<const char*>(sc + ahead * groups);
    const char* m = reinterpret_cast<const char*>(mn + ahead * groups);
    for (int64_t off = 0; off < groups * int64_t(sizeof(S)); off += 64) {
        _mm_prefetch(s + off, _MM_HINT_T0);
        _mm_prefetch(m + off, _MM_HINT_T0);
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

// Rows of x up to this many round x to int8 (plait_qmatmul_max_q8_rows).
// On AVX2: decode batches and short extends; more (prefill chunks, an LM head's prompt logprobs)
// keep float32 activations, since rounding them in one level speeds prefill but raises int4
// perplexity (the error is spread over every projection) and in two levels it runs no faster
// than the GEMM. With VNNI, two levels outrun torch's float32 GEMM at prefill's row counts too
// (before counting the matrix's dequantization for the GEMM), so every row count takes them.
#ifdef PLAIT_VNNI512
constexpr int64_t MAX_Q8_M = int64_t(1) << 40;
#else
constexpr int64_t MAX_Q8_M = PLAIT_AVX2_MAX_Q8_ROWS;
#endif
static_assert(XBLOCK == PLAIT_Q8_BLOCK, "the activations' blocks are the ABI's");

// Format 3 takes groups of 16 (Q6_K) or 32 (with minimums); formats 4 to 6 an even number of
// groups of 32.
inline bool q8_usable(int64_t K, int format, int64_t group) {
    if (K % XBLOCK) return false;
    switch (format) {
        case PLAIT_FORMAT_INT8: return group % XBLOCK == 0;
        case PLAIT_FORMAT_INT4: return group == 32;
        case PLAIT_FORMAT_INT8_F32: return group == 16 || group == 32;
        case PLAIT_FORMAT_INT4_F32: return group == 32 && K % 64 == 0;
        case PLAIT_FORMAT_INT5:
        case PLAIT_FORMAT_INT5_F32: return group == 32 && K % 64 == 0;
        default: return false;
    }
}
#endif

// Weight rows per task of the multi-row integer kernels for M rows of x, N weight rows and this
// many threads: the tuning table's entry for M (plait_qmatmul_set_task_rows; 16 until one is
// set), shrunk to a multiple of 16 that splits N evenly over the threads. Always a multiple of 8,
// so that every task reduces its weight rows in the same eights (RowSums8) and a row's result
// does not depend on the task size.
int64_t task_rows(int64_t M, int64_t N, int num_threads);  // cpu_quant_matmul.cpp

// The tiers' entry points: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), as plait_qmatmul_f32.
void tile_matmul(const float* x, int64_t M, int64_t K, const float* w, int64_t nt, float* y, int64_t ldy,
                 const float* next = nullptr);  // quant_matmul_float.cpp
void float_qmatmul(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                   const void* scales, const void* mins, const float* bias, float* y, int num_threads);  // quant_matmul_float.cpp
#if defined(__AVX2__) && !defined(PLAIT_VNNI512)
// M <= MAX_Q8_M and q8_usable(K, format, group)
void q8_qmatmul_avx2(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                   const void* scales, const void* mins, const float* bias, float* y, int num_threads);  // quant_matmul_avx2.cpp
#endif
#ifdef PLAIT_VNNI512
// q8_usable(K, format, group), any M
void q8_qmatmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                   const void* scales, const void* mins, const float* bias, float* y, int num_threads);  // quant_matmul_vnni.cpp
#endif
void dense_matmul(const float* x, int64_t M, int64_t K, int64_t N, const float* w, const float* bias, float* y,
                  int num_threads);  // dense_gemv.cpp
// dense_matmul with each row's sums in one order at every M (plait_qmatmul_rows_f32)
void dense_matmul_rows(const float* x, int64_t M, int64_t K, int64_t N, const float* w, const float* bias, float* y,
                       int num_threads);  // dense_gemv.cpp

}  // namespace plait::qmm
