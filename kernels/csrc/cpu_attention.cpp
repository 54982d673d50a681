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
    const int64_t tasks = num_rows * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;
        std::vector<float> acc(group * head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t r = t / num_kv_heads, h = t % num_kv_heads;
            const int64_t lo = first[r], n = kv_len[r] - first[r];
            const int64_t* slots = tables + table_index[r] * table_width + lo;
            const float* qh = q + q_index[r] * num_heads * head_dim + h * group * head_dim;
            float* oh = out + q_index[r] * num_heads * head_dim + h * group * head_dim;
            if (n <= 0) {
                std::fill(oh, oh + group * head_dim, 0.0f);
                continue;
            }
            scores.resize(group * n);
            for (int64_t j = 0; j < n; ++j) {
                const float* kr = k + slots[j] * slot_stride + h * head_dim;
                for (int64_t g = 0; g < group; ++g)
                    scores[g * n + j] = dot(qh + g * head_dim, kr, head_dim) * scale;
            }
            std::vector<float> inv(group);
            for (int64_t g = 0; g < group; ++g) {
                float* p = scores.data() + g * n;
                float m = *std::max_element(p, p + n);
                inv[g] = 1.0f / exp_shift_sum(p, n, m);
            }
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t j = 0; j < n; ++j) {
                const float* vr = v + slots[j] * slot_stride + h * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    const float p = scores[g * n + j];
                    float* a = acc.data() + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vr[d];
                }
            }
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < head_dim; ++d) oh[g * head_dim + d] = acc[g * head_dim + d] * inv[g];
        }
    }
}
