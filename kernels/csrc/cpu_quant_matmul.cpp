// Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
//
// Formats (groups run along K; `group` divides K; format 2 is plain float32 weights [N, K]):
//   0  int8: qweight int8 [N, K]; w = q * scale[n, k / group]   (per-channel: group == K)
//   1  int4: qweight uint8 [N, K / 2]; in each group of `group` weights, byte j holds weight j in
//      its low nibble and weight j + group / 2 in its high nibble (GGUF Q4_1 order);
//      w = q * scale[n, g] + min[n, g]
//   3  int8 with float32 scales [N, K / group], groups of 16 or 32 (Q6_K's values q - 32), and
//      float32 minimums [N, K / 32] where set, w = q * scale + min (int4 and int5 parts of a fused
//      matrix widened to stack with int8 ones)
//   4  int4 as format 1 with float32 scales and minimums (Q4_K, groups of 32)
//   5  int5: five-bit values q (0..31) packed in 64-weight chunks, qweight uint8 [N, K / 2 + K / 8]
//      (quant_matmul.h: int5 rows), groups of 32, float16 scales; w = (q - 16) * scale (Q5_0)
//   6  int5 as format 5 with float32 scales and minimums; w = q * scale + min (Q5_K)
// Scales and minimums of formats 0 and 1 are IEEE float16 [N, K / group], as GGUF stores them:
// float32 ones would be a third of the bytes an int4 matrix reads (8 of 24 per 32 weights, where
// float16 ones are 4 of 20). The k-quants' effective scales (a 6- or 8-bit sub-block scale times
// the superblock's float16 one) are exact in float32 and not in float16, so formats 3 and 4 keep
// them in float32: the weights are the file's, to the bit, for 4 (or 2, Q6_K's 16-wide
// sub-blocks) more bytes per 32 weights than the file holds. Packed five-bit values read 20 bytes
// per 32 weights where int8 would read 32: Q5_0 reads 22 bytes per 32 weights, as the file holds
// them.
//
// This file holds the exported functions and picks a path per call; the paths live in one file per
// tier (see quant_matmul.h): int8 activations with AVX-512 VNNI (quant_matmul_vnni.cpp) or AVX2
// (quant_matmul_avx2.cpp) for the rows they take, float tiles elsewhere (quant_matmul_float.cpp),
// and the float32 GEMV (dense_gemv.cpp).
#include "plait_kernels.h"
#include "quant_matmul.h"

#include "parallel.h"

#include <algorithm>
#include <climits>

using namespace plait::qmm;

namespace {

// The tuning table (kernels/tuning.py: QMATMUL_TASK_ROWS, set once as the library loads): up to
// eight (M at most, weight rows per task) entries, by increasing M.
constexpr int64_t MAX_TUNING = 8;
struct TaskRowsTable {
    int64_t n = 0;
    int64_t max_m[MAX_TUNING] = {};
    int64_t rows[MAX_TUNING] = {};
};
TaskRowsTable task_rows_table;

}  // namespace

int64_t plait::qmm::task_rows(int64_t M, int64_t N, int num_threads) {
    int64_t rows = 16;
    for (int64_t i = 0; i < task_rows_table.n; ++i)
        if (M <= task_rows_table.max_m[i]) {
            rows = task_rows_table.rows[i];
            break;
        }
    // as few tasks per thread as these rows allow, the rows then spread evenly over them
    const int64_t threads = std::max(1, num_threads);
    const int64_t per_thread = std::max<int64_t>(1, (N + threads * rows - 1) / (threads * rows));
    const int64_t even = (N + threads * per_thread - 1) / (threads * per_thread);
    return std::max<int64_t>(16, (even + 15) / 16 * 16);
}

// Sets the tuning table: entry i covers M <= max_m[i] (the last one every larger M too), rows[i]
// weight rows per task, each a positive multiple of 8.
extern "C" void plait_qmatmul_set_task_rows(const int64_t* max_m, const int64_t* rows, int64_t n) {
    TaskRowsTable t;
    t.n = std::min(n, MAX_TUNING);
    for (int64_t i = 0; i < t.n; ++i) {
        t.max_m[i] = i + 1 == t.n ? INT64_MAX : max_m[i];
        t.rows[i] = std::max<int64_t>(8, rows[i] / 8 * 8);
    }
    task_rows_table = t;
}

// The weight rows per task a (M, N) matmul on this many threads takes (for tests and benchmarks).
extern "C" int64_t plait_qmatmul_task_rows(int64_t M, int64_t N, int num_threads) {
    return task_rows(M, N, num_threads);
}

extern "C" void plait_qmatmul_f32(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight,
                                  int format, int64_t group, const void* scales, const void* mins,
                                  const float* bias, float* y, int num_threads) {
    if (format == PLAIT_FORMAT_FLOAT32) {
        dense_matmul(x, M, K, N, static_cast<const float*>(qweight), bias, y, num_threads);
        return;
    }
#ifdef __AVX2__
    if (M <= MAX_Q8_M && q8_usable(K, format, group)) {
#ifdef PLAIT_VNNI512
        // every row count, one row included: a row's result does not depend on the rows beside it
        q8_qmatmul_vnni(x, M, K, N, qweight, format, group, scales, mins, bias, y, num_threads);
#else
        q8_qmatmul_avx2(x, M, K, N, qweight, format, group, scales, mins, bias, y, num_threads);
#endif
        return;
    }
#endif
    float_qmatmul(x, M, K, N, qweight, format, group, scales, mins, bias, y, num_threads);
}

// plait_qmatmul_f32 where each row of y is what that row of x alone gives (batch-invariant
// inference): the integer rows at every M (on AVX2 in runs of MAX_Q8_M rows, each row rounded to
// int8 and summed alone there), float32 weights by dense_matmul_rows, and the formats the integer
// rows do not take one row of x at a time.
extern "C" void plait_qmatmul_rows_f32(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight,
                                       int format, int64_t group, const void* scales, const void* mins,
                                       const float* bias, float* y, int num_threads) {
    if (format == PLAIT_FORMAT_FLOAT32) {
        dense_matmul_rows(x, M, K, N, static_cast<const float*>(qweight), bias, y, num_threads);
        return;
    }
#ifdef __AVX2__
    if (q8_usable(K, format, group)) {
        for (int64_t m0 = 0; m0 < M; m0 += MAX_Q8_M) {
            const int64_t m = std::min(MAX_Q8_M, M - m0);
#ifdef PLAIT_VNNI512
            q8_qmatmul_vnni(x + m0 * K, m, K, N, qweight, format, group, scales, mins, bias, y + m0 * N, num_threads);
#else
            q8_qmatmul_avx2(x + m0 * K, m, K, N, qweight, format, group, scales, mins, bias, y + m0 * N, num_threads);
#endif
        }
        return;
    }
#endif
    for (int64_t m = 0; m < M; ++m)
        float_qmatmul(x + m * K, 1, K, N, qweight, format, group, scales, mins, bias, y + m * N, num_threads);
}

// Dequantizes rows [0, N) into out[N, K] (the reference, and the large-M path: one pass over the
// weights, then a float32 GEMM whose cost dwarfs it).
extern "C" void plait_dequantize_f32(const void* qweight, int format, int64_t N, int64_t K, int64_t group,
                                     const void* scales, const void* mins, float* out, int num_threads) {
    plait::parallel_for(N, num_threads, false,
                        [&](int64_t n) { dequant_row(qweight, format, n, K, group, scales, mins, out + n * K); });
}

// The same, rounded to bfloat16 (to nearest, ties to even) for a bfloat16 GEMM: each row is
// dequantized to float32 in a per-thread buffer first, so both outputs agree to the rounding.
extern "C" void plait_dequantize_bf16(const void* qweight, int format, int64_t N, int64_t K, int64_t group,
                                      const void* scales, const void* mins, uint16_t* out, int num_threads) {
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
