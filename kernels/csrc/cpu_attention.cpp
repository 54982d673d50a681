// Paged attention for single-token and short queries on the CPU, reading K/V in place through
// per-row slot tables (no gather copy). float32, GQA, any head_dim; AVX2 exp when available.
//
// Row r attends query q[q_index[r]] (all H heads) over slots tables[table_index[r]][first[r] ..
// kv_len[r]) and writes out[q_index[r]]. One task per (row, kv head) handles the whole query
// group of that KV head, so each K/V row is read once per group. Three passes over the row's
// context: scores (dot products), softmax, weighted sum of V.
#include <cmath>
#include <cstdint>
#include <vector>
#include <algorithm>

#include "parallel.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX2__
// exp for 8 floats: Cody-Waite range reduction and a degree-5 polynomial (~1 ulp over the range
// softmax uses, inputs <= 0).
inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504019f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// p[i] = exp(p[i] - m) for i < n; returns the sum.
inline float exp_shift_sum(float* p, int64_t n, float m) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 vm = _mm256_set1_ps(m), vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
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

inline float dot(const float* a, const float* b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

}  // namespace

extern "C" void plait_paged_attention_rows_f32(
    const float* q, const float* k, const float* v, const int64_t* tables, int64_t table_width,
    const int64_t* q_index, const int64_t* table_index, const int64_t* first, const int64_t* kv_len,
    float* out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;  // floats between consecutive slots
    // A task is one row and a range of KV heads: all of them when there are enough rows to keep
    // every thread busy (each slot's K/V row is then read as one contiguous run), else one.
    const int64_t heads_per_task = num_rows >= 2 * num_threads ? num_kv_heads : 1;
    const int64_t tasks_per_row = num_kv_heads / heads_per_task;
    plait::parallel_for(num_rows * tasks_per_row, num_threads, true, [&](int64_t t) {
        thread_local std::vector<float> scores, acc, inv;
        const int64_t r = t / tasks_per_row, h0 = (t % tasks_per_row) * heads_per_task;
        const int64_t rows = heads_per_task * group;  // query heads of this task
        const int64_t lo = first[r], n = kv_len[r] - first[r];
        const int64_t* slots = tables + table_index[r] * table_width + lo;
        const float* qh = q + q_index[r] * num_heads * head_dim + h0 * group * head_dim;
        float* oh = out + q_index[r] * num_heads * head_dim + h0 * group * head_dim;
        if (n <= 0) {
            std::fill(oh, oh + rows * head_dim, 0.0f);
            return;
        }
        scores.resize(rows * n);
        acc.assign(rows * head_dim, 0.0f);
        inv.resize(rows);
        for (int64_t j = 0; j < n; ++j) {
            const float* kr = k + slots[j] * slot_stride + h0 * head_dim;
            for (int64_t i = 0; i < rows; ++i)  // query head i reads KV head i / group
                scores[i * n + j] = dot(qh + i * head_dim, kr + (i / group) * head_dim, head_dim) * scale;
        }
        for (int64_t i = 0; i < rows; ++i) {
            float* p = scores.data() + i * n;
            inv[i] = 1.0f / exp_shift_sum(p, n, *std::max_element(p, p + n));
        }
        for (int64_t j = 0; j < n; ++j) {
            const float* vr = v + slots[j] * slot_stride + h0 * head_dim;
            for (int64_t i = 0; i < rows; ++i) {
                const float p = scores[i * n + j];
                const float* vh = vr + (i / group) * head_dim;
                float* a = acc.data() + i * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
            }
        }
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t d = 0; d < head_dim; ++d) oh[i * head_dim + d] = acc[i * head_dim + d] * inv[i];
    });
}
