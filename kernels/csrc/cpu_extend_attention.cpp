// Causal attention of one extend sequence (a prefill chunk) on the CPU, on AVX-512: q [q_len, H, D]
// at positions prefix_len .. prefix_len + q_len - 1 over k / v [kv_len, Hkv, D] from position 0,
// optionally within a sliding window. Flash-attention style: a task takes one KV head and a block
// of QB query positions (its G query heads stacked, G * QB rows) and walks the visible keys in
// blocks of KB with an online softmax, so no score matrix larger than [G * QB, KB] exists and the
// keys a block cannot see are never touched. Built only where AVX-512 is; elsewhere
// `plait_extend_attention_f32` returns -1 and the caller keeps torch's blocked attention.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "vec_math.h"

namespace {

#ifdef __AVX512F__
constexpr int64_t QB = 32;  // query positions per task
constexpr int64_t KB = 32;  // keys per block: two vectors of scores per row
constexpr int64_t RT = 4;   // rows per register tile

struct Shape {
    int64_t q_len, kv_len, prefix_len, num_heads, num_kv_heads, head_dim, window;  // window 0: none
    float scale;
};

// Scores of T query rows (qs, scaled, [T, D]) against KB keys (kt: [D, ld], from the block's
// first key) into sc [T, KB].
template <int T>
inline void score_tile(const float* qs, const float* kt, int64_t ld, int64_t D, float* sc) {
    __m512 a[T][2];
    for (int i = 0; i < T; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * ld), k1 = _mm512_loadu_ps(kt + d * ld + 16);
        for (int i = 0; i < T; ++i) {
            const __m512 b = _mm512_set1_ps(qs[i * D + d]);
            a[i][0] = _mm512_fmadd_ps(b, k0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(b, k1, a[i][1]);
        }
    }
    for (int i = 0; i < T; ++i) {
        _mm512_storeu_ps(sc + i * KB, a[i][0]);
        _mm512_storeu_ps(sc + i * KB + 16, a[i][1]);
    }
}

// acc [T, D] += p [T, KB] (its first nk columns) times V rows v + j * ld, 64 columns at a time.
template <int T>
inline void pv_tile(const float* p, const float* v, int64_t ld, int64_t nk, int64_t D, float* acc) {
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        if (c0 + 64 <= D) {
            __m512 o[T][4];
            for (int i = 0; i < T; ++i)
                for (int c = 0; c < 4; ++c) o[i][c] = _mm512_loadu_ps(acc + i * D + c0 + 16 * c);
            for (int64_t j = 0; j < nk; ++j) {
                const float* vr = v + j * ld + c0;
                const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
                const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
                for (int i = 0; i < T; ++i) {
                    const __m512 b = _mm512_set1_ps(p[i * KB + j]);
                    o[i][0] = _mm512_fmadd_ps(b, v0, o[i][0]);
                    o[i][1] = _mm512_fmadd_ps(b, v1, o[i][1]);
                    o[i][2] = _mm512_fmadd_ps(b, v2, o[i][2]);
                    o[i][3] = _mm512_fmadd_ps(b, v3, o[i][3]);
                }
            }
            for (int i = 0; i < T; ++i)
                for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + i * D + c0 + 16 * c, o[i][c]);
        } else {  // 16 to 48 columns left
            for (int64_t c = c0; c < D; c += 16) {
                __m512 o[T];
                for (int i = 0; i < T; ++i) o[i] = _mm512_loadu_ps(acc + i * D + c);
                for (int64_t j = 0; j < nk; ++j) {
                    const __m512 vv = _mm512_loadu_ps(v + j * ld + c);
                    for (int i = 0; i < T; ++i) o[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * KB + j]), vv, o[i]);
                }
                for (int i = 0; i < T; ++i) _mm512_storeu_ps(acc + i * D + c, o[i]);
            }
        }
    }
}

// One task: KV head h, query positions [p0, p1) of the extend (relative to its first token). kt is
// K transposed once per call, [Hkv, D, kv_pad] with kv_pad a multiple of KB (the pad is zeros).
void attend_block(const float* q, const float* kt_all, int64_t kv_pad, const float* v, float* out, const Shape& s,
                  int64_t h, int64_t p0, int64_t p1) {
    const int64_t D = s.head_dim, G = s.num_heads / s.num_kv_heads, n = p1 - p0, R = G * n;
    const int64_t q_stride = s.num_heads * D, kv_stride = s.num_kv_heads * D, DV = D / 16;
    thread_local std::vector<float> buf;
    buf.resize(R * KB + R * D + 2 * R + R * D);
    const float* kt = kt_all + h * D * kv_pad;  // [D, kv_pad]
    float* sc = buf.data();         // [R, KB]: scores, then probabilities
    float* acc = sc + R * KB;       // [R, D]: unnormalized outputs
    float* m = acc + R * D;         // [R]: running max
    float* l = m + R;               // [R]: running sum
    float* qs = l + R;              // [R, D]: the rows' queries, scaled
    // row r = g * n + i: query position p0 + i, query head h * G + g
    for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < n; ++i) {
            const float* src = q + (p0 + i) * q_stride + (h * G + g) * D;
            float* dst = qs + (g * n + i) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * s.scale;
        }
    std::fill(acc, acc + R * D, 0.0f);
    std::fill(m, m + R, -INFINITY);
    std::fill(l, l + R, 0.0f);
    const int64_t first_pos = s.prefix_len + p0, last_pos = s.prefix_len + p1 - 1;  // absolute
    // key blocks start at multiples of KB (kt's rows are padded to one); keys before the window mask
    const int64_t lo = s.window > 0 ? std::max<int64_t>(0, first_pos - s.window + 1) / KB * KB : 0;
    const int64_t hi = last_pos + 1;
    for (int64_t j0 = lo; j0 < hi; j0 += KB) {
        const int64_t nk = std::min(KB, hi - j0);
        // scores of RT rows at a time against the block's 32 keys
        for (int64_t r0 = 0; r0 < R; r0 += RT) {
            switch (std::min(RT, R - r0)) {
                case 1: score_tile<1>(qs + r0 * D, kt + j0, kv_pad, D, sc + r0 * KB); break;
                case 2: score_tile<2>(qs + r0 * D, kt + j0, kv_pad, D, sc + r0 * KB); break;
                case 3: score_tile<3>(qs + r0 * D, kt + j0, kv_pad, D, sc + r0 * KB); break;
                default: score_tile<4>(qs + r0 * D, kt + j0, kv_pad, D, sc + r0 * KB); break;
            }
        }
        // mask, online softmax; acc rows rescaled by exp(m_old - m_new)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t pos = s.prefix_len + p0 + r % n;  // this row's absolute position
            float* row = sc + r * KB;
            const int64_t visible_hi = std::min(nk, pos - j0 + 1);  // keys j0 + [0, visible_hi) <= pos
            const int64_t visible_lo = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1 - j0) : 0;
            if (visible_lo > 0 || visible_hi < KB)  // the diagonal, a window's edge, the last block
                for (int64_t j = 0; j < KB; ++j)
                    if (j < visible_lo || j >= visible_hi) row[j] = -INFINITY;
            const __m512 s0 = _mm512_loadu_ps(row), s1 = _mm512_loadu_ps(row + 16);
            const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            const float m_new = std::max(m[r], block_max);
            if (m_new == -INFINITY) {  // nothing visible yet
                std::fill(row, row + KB, 0.0f);
                continue;
            }
            const float alpha = std::exp(m[r] - m_new);  // 0 when m[r] is -inf
            const __m512 mv = _mm512_set1_ps(m_new);
            const __m512 e0 = plait::exp512(_mm512_sub_ps(s0, mv)), e1 = plait::exp512(_mm512_sub_ps(s1, mv));
            // exp512 clamps its input, so a masked -inf becomes a tiny positive: zero it
            const __mmask16 v0 = _mm512_cmp_ps_mask(s0, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __mmask16 v1 = _mm512_cmp_ps_mask(s1, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 p0v = _mm512_maskz_mov_ps(v0, e0), p1v = _mm512_maskz_mov_ps(v1, e1);
            _mm512_storeu_ps(row, p0v);
            _mm512_storeu_ps(row + 16, p1v);
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0v, p1v));
            m[r] = m_new;
            if (alpha != 1.0f) {
                const __m512 av = _mm512_set1_ps(alpha);
                for (int64_t c = 0; c < DV; ++c)
                    _mm512_storeu_ps(acc + r * D + 16 * c, _mm512_mul_ps(av, _mm512_loadu_ps(acc + r * D + 16 * c)));
            }
        }
        // acc += P V, RT rows at a time, 64 columns of D at a time
        for (int64_t r0 = 0; r0 < R; r0 += RT) {
            const float* vb = v + j0 * kv_stride + h * D;
            switch (std::min(RT, R - r0)) {
                case 1: pv_tile<1>(sc + r0 * KB, vb, kv_stride, nk, D, acc + r0 * D); break;
                case 2: pv_tile<2>(sc + r0 * KB, vb, kv_stride, nk, D, acc + r0 * D); break;
                case 3: pv_tile<3>(sc + r0 * KB, vb, kv_stride, nk, D, acc + r0 * D); break;
                default: pv_tile<4>(sc + r0 * KB, vb, kv_stride, nk, D, acc + r0 * D); break;
            }
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / n, i = r % n;
        float* dst = out + (p0 + i) * q_stride + (h * G + g) * D;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
    }
}
#endif

}  // namespace

// q [q_len, H, D] at positions prefix_len.., k / v [kv_len, Hkv, D] from 0 (kv_len = prefix_len +
// q_len), out [q_len, H, D], all float32 and contiguous; window <= 0: none. Returns 0, or -1 when
// this build or shape is not served (no AVX-512, D not a multiple of 16, H not a multiple of Hkv).
extern "C" int plait_extend_attention_f32(const float* q, const float* k, const float* v, float* out, int64_t q_len,
                                          int64_t prefix_len, int64_t num_heads, int64_t num_kv_heads,
                                          int64_t head_dim, float scale, int64_t window, int num_threads) {
#ifdef __AVX512F__
    if (head_dim % 16 != 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    const Shape s{q_len, prefix_len + q_len, prefix_len, num_heads, num_kv_heads, head_dim, window > 0 ? window : 0,
                  scale};
    const int64_t blocks = (q_len + QB - 1) / QB, kv_len = prefix_len + q_len;
    const int64_t kv_pad = (kv_len + KB - 1) / KB * KB, D = head_dim, kv_stride = num_kv_heads * head_dim;
    std::vector<float> kt(num_kv_heads * D * kv_pad);  // [Hkv, D, kv_pad], zero past kv_len
    plait::parallel_for(num_kv_heads * D, num_threads, false, [&](int64_t t) {
        const int64_t h = t / D, d = t % D;
        float* dst = kt.data() + t * kv_pad;
        const float* src = k + h * D + d;
        for (int64_t j = 0; j < kv_len; ++j) dst[j] = src[j * kv_stride];
    });
    plait::FlushDenormals ftz;
    // later query blocks see more keys: dynamic scheduling, the longest first
    plait::parallel_for(blocks * num_kv_heads, num_threads, true, [&](int64_t t) {
        plait::FlushDenormals inner;
        const int64_t b = blocks - 1 - t / num_kv_heads, h = t % num_kv_heads;
        attend_block(q, kt.data(), kv_pad, v, out, s, h, b * QB, std::min(q_len, (b + 1) * QB));
    });
    return 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)q_len, (void)prefix_len, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)scale, (void)window, (void)num_threads;
    return -1;
#endif
}
