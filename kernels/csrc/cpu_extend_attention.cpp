// Causal attention of one extend sequence (a prefill chunk) on the CPU: q [q_len, H, D] at
// positions prefix_len .. prefix_len + q_len - 1 over k / v [kv_len, Hkv, D] from position 0,
// optionally within a sliding window. Flash-attention style: a task takes one KV head and a block
// of QB query positions (its G query heads stacked, G * QB rows) and walks the visible keys in
// blocks of KB with an online softmax, so no score matrix larger than [G * QB, KB] exists and the
// keys a block cannot see are never touched. 16 floats a vector on AVX-512, 8 on AVX2 (fewer rows
// per register tile there: 16 registers); elsewhere `plait_extend_attention_f32` returns -1 and the
// caller keeps torch's blocked attention.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "plait_kernels.h"
#include "vec_math.h"

namespace {

#ifdef __AVX2__
constexpr int64_t QB = 32;  // query positions per task
constexpr int64_t KB = 32;  // keys per block

struct Shape {
    int64_t q_len, kv_len, prefix_len, num_heads, num_kv_heads, head_dim, window;  // window 0: none
    float scale;
};

// The vector width (plait::F8 / F16) with RT rows per score tile and PC vectors of columns per
// pass of P V (AVX2 has 16 registers, AVX-512 32).
struct V8 : plait::F8 {
    static constexpr int RT = 2, PC = 4;
};

#ifdef __AVX512F__
struct V16 : plait::F16 {
    static constexpr int RT = 4, PC = 4;
};
#endif

// Scores of T query rows (qs, scaled, [T, D]) against KB keys (kt: [D, ld], from the block's
// first key) into sc [T, KB].
template <class V, int T>
inline void score_tile(const float* qs, const float* kt, int64_t ld, int64_t D, float* sc) {
    constexpr int KV = KB / V::W;
    typename V::R a[T][KV];
    for (int i = 0; i < T; ++i)
        for (int c = 0; c < KV; ++c) a[i][c] = V::zero();
    for (int64_t d = 0; d < D; ++d) {
        typename V::R kv[KV];
        for (int c = 0; c < KV; ++c) kv[c] = V::load(kt + d * ld + c * V::W);
        for (int i = 0; i < T; ++i) {
            const typename V::R b = V::set1(qs[i * D + d]);
            for (int c = 0; c < KV; ++c) a[i][c] = V::fma(b, kv[c], a[i][c]);
        }
    }
    for (int i = 0; i < T; ++i)
        for (int c = 0; c < KV; ++c) V::store(sc + i * KB + c * V::W, a[i][c]);
}

// acc [T, D] += p [T, KB] (its first nk columns) times V rows v + j * ld, PC vectors of columns
// at a time (then one at a time).
template <class V, int T>
inline void pv_tile(const float* p, const float* v, int64_t ld, int64_t nk, int64_t D, float* acc) {
    constexpr int PC = V::PC, W = V::W;
    int64_t c0 = 0;
    for (; c0 + PC * W <= D; c0 += PC * W) {
        typename V::R o[T][PC];
        for (int i = 0; i < T; ++i)
            for (int c = 0; c < PC; ++c) o[i][c] = V::load(acc + i * D + c0 + W * c);
        for (int64_t j = 0; j < nk; ++j) {
            typename V::R vv[PC];
            for (int c = 0; c < PC; ++c) vv[c] = V::load(v + j * ld + c0 + W * c);
            for (int i = 0; i < T; ++i) {
                const typename V::R b = V::set1(p[i * KB + j]);
                for (int c = 0; c < PC; ++c) o[i][c] = V::fma(b, vv[c], o[i][c]);
            }
        }
        for (int i = 0; i < T; ++i)
            for (int c = 0; c < PC; ++c) V::store(acc + i * D + c0 + W * c, o[i][c]);
    }
    for (; c0 < D; c0 += W) {
        typename V::R o[T];
        for (int i = 0; i < T; ++i) o[i] = V::load(acc + i * D + c0);
        for (int64_t j = 0; j < nk; ++j) {
            const typename V::R vv = V::load(v + j * ld + c0);
            for (int i = 0; i < T; ++i) o[i] = V::fma(V::set1(p[i * KB + j]), vv, o[i]);
        }
        for (int i = 0; i < T; ++i) V::store(acc + i * D + c0, o[i]);
    }
}

// Runs f<t>() for t = min(V::RT, rows) (1 to 4).
template <class V, class F>
inline void with_rows(int64_t rows, F&& f) {
    switch (std::min<int64_t>(V::RT, rows)) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        default: f(std::integral_constant<int, (V::RT >= 4 ? 4 : V::RT)>{}); break;
    }
}

// One task: KV head h, query positions [p0, p1) of the extend (relative to its first token). kt is
// K transposed once per call, [Hkv, D, kv_pad] with kv_pad a multiple of KB (the pad is zeros).
template <class V>
void attend_block(const float* q, const float* kt_all, int64_t kv_pad, const float* v, float* out, const Shape& s,
                  int64_t h, int64_t p0, int64_t p1) {
    constexpr int KV = KB / V::W;
    const int64_t D = s.head_dim, G = s.num_heads / s.num_kv_heads, n = p1 - p0, R = G * n;
    const int64_t q_stride = s.num_heads * D, kv_stride = s.num_kv_heads * D;
    thread_local std::vector<float> buf;
    buf.resize(R * KB + R * D + 2 * R + R * D);
    const float* kt = kt_all + h * D * kv_pad;  // [D, kv_pad]
    float* sc = buf.data();    // [R, KB]: scores, then probabilities
    float* acc = sc + R * KB;  // [R, D]: unnormalized outputs
    float* m = acc + R * D;    // [R]: running max
    float* l = m + R;          // [R]: running sum
    float* qs = l + R;         // [R, D]: the rows' queries, scaled
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
        for (int64_t r0 = 0; r0 < R; r0 += V::RT)
            with_rows<V>(R - r0, [&](auto t) { score_tile<V, decltype(t)::value>(qs + r0 * D, kt + j0, kv_pad, D, sc + r0 * KB); });
        // mask, online softmax; acc rows rescaled by exp(m_old - m_new)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t pos = s.prefix_len + p0 + r % n;  // this row's absolute position
            float* row = sc + r * KB;
            const int64_t visible_hi = std::min(nk, pos - j0 + 1);  // keys j0 + [0, visible_hi) <= pos
            const int64_t visible_lo = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1 - j0) : 0;
            if (visible_lo > 0 || visible_hi < KB)  // the diagonal, a window's edge, the last block
                for (int64_t j = 0; j < KB; ++j)
                    if (j < visible_lo || j >= visible_hi) row[j] = -INFINITY;
            typename V::R sv[KV];
            typename V::R mx = V::set1(-INFINITY);
            for (int c = 0; c < KV; ++c) mx = V::max(mx, sv[c] = V::load(row + c * V::W));
            const float m_new = std::max(m[r], V::hmax(mx));
            if (m_new == -INFINITY) {  // nothing visible yet
                std::fill(row, row + KB, 0.0f);
                continue;
            }
            const float alpha = std::exp(m[r] - m_new);  // 0 when m[r] is -inf
            const typename V::R mv = V::set1(m_new);
            typename V::R total = V::zero();
            for (int c = 0; c < KV; ++c) {
                const typename V::R e = V::exp_shifted(sv[c], mv);
                V::store(row + c * V::W, e);
                total = V::add(total, e);
            }
            l[r] = l[r] * alpha + V::hsum(total);
            m[r] = m_new;
            if (alpha != 1.0f) {
                const typename V::R av = V::set1(alpha);
                for (int64_t c = 0; c < D; c += V::W) V::store(acc + r * D + c, V::mul(av, V::load(acc + r * D + c)));
            }
        }
        // acc += P V, RT rows at a time
        const float* vb = v + j0 * kv_stride + h * D;
        for (int64_t r0 = 0; r0 < R; r0 += V::RT)
            with_rows<V>(R - r0, [&](auto t) { pv_tile<V, decltype(t)::value>(sc + r0 * KB, vb, kv_stride, nk, D, acc + r0 * D); });
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / n, i = r % n;
        float* dst = out + (p0 + i) * q_stride + (h * G + g) * D;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
    }
}

template <class V>
void extend_attention(const float* q, const float* k, const float* v, float* out, const Shape& s, int num_threads) {
    const int64_t blocks = (s.q_len + QB - 1) / QB, kv_pad = (s.kv_len + KB - 1) / KB * KB;
    const int64_t D = s.head_dim, Hk = s.num_kv_heads, kv_stride = Hk * D;
    std::vector<float> kt(Hk * D * kv_pad);  // [Hkv, D, kv_pad], zero past kv_len
    plait::parallel_for(Hk * D, num_threads, false, [&](int64_t t) {
        const int64_t h = t / D, d = t % D;
        float* dst = kt.data() + t * kv_pad;
        const float* src = k + h * D + d;
        for (int64_t j = 0; j < s.kv_len; ++j) dst[j] = src[j * kv_stride];
    });
    // later query blocks see more keys: dynamic scheduling, the longest first
    plait::parallel_for(blocks * Hk, num_threads, true, [&](int64_t t) {
        plait::FlushDenormals ftz;
        const int64_t b = blocks - 1 - t / Hk, h = t % Hk;
        attend_block<V>(q, kt.data(), kv_pad, v, out, s, h, b * QB, std::min(s.q_len, (b + 1) * QB));
    });
}
#endif

}  // namespace

// q [q_len, H, D] at positions prefix_len.., k / v [kv_len, Hkv, D] from 0 (kv_len = prefix_len +
// q_len), out [q_len, H, D], all float32 and contiguous; window <= 0: none. Returns 0, or -1 when
// this build or shape is not served (no AVX2, D not a multiple of the vector width, H not a
// multiple of Hkv).
extern "C" int plait_extend_attention_f32(const float* q, const float* k, const float* v, float* out, int64_t q_len,
                                          int64_t prefix_len, int64_t num_heads, int64_t num_kv_heads,
                                          int64_t head_dim, float scale, int64_t window, int num_threads) {
#ifdef __AVX2__
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    const Shape s{q_len, prefix_len + q_len, prefix_len, num_heads, num_kv_heads, head_dim, window > 0 ? window : 0,
                  scale};
#ifdef __AVX512F__
    if (head_dim % 16 == 0) {
        extend_attention<V16>(q, k, v, out, s, num_threads);
        return 0;
    }
#endif
    if (head_dim % 8 != 0) return -1;
    extend_attention<V8>(q, k, v, out, s, num_threads);
    return 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)q_len, (void)prefix_len, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)scale, (void)window, (void)num_threads;
    return -1;
#endif
}
