// One token per row from float32 logits on the CPU: temperature, min-p, top-k and top-p, then an
// inverse-CDF draw with a uniform the caller takes from the request's generator. The semantics
// are `kernels/sampling_triton.py: filter_probs_ref`'s (kernels/sampling_cpu.py spells out the
// draw). torch's path sorts the whole vocabulary for top-k / top-p and draws with
// torch.multinomial, each slow next to a decode step; this finds the kept tokens from a
// histogram of the probabilities' float32 bit patterns and sorts only the one bucket where the
// top-k or top-p boundary falls.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "parallel.h"
#include "plait_kernels.h"
#include "vec_math.h"

namespace {

// 2,048 buckets: a probability in (0, 1] by its exponent and its 3 leading mantissa bits
// (float32 bits >> 20, monotone in the value for non-negative floats).
constexpr int KEY_SHIFT = 20;
constexpr int BUCKETS = (0x3F800000 >> KEY_SHIFT) + 1;

// sum of p[0, n), vectorized (float lanes, then added up in double)
inline double sum_of(const float* p, int64_t n) {
    double total = 0.0;
    for (int64_t b = 0; b < n; b += 4096) {
        float s = 0.0f;
        const int64_t e = std::min(n, b + 4096);
#pragma omp simd reduction(+ : s)
        for (int64_t i = b; i < e; ++i) s += p[i];
        total += s;
    }
    return total;
}

inline uint32_t bits_of(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}

// p[i] = exp((l[i] - m) * inv) (0 for -inf logits); returns the sum.
double exp_scaled(const float* l, int64_t n, float m, float inv, float* p) {
    int64_t i = 0;
    double sum = 0.0;
#ifdef __AVX512F__
    using V = plait::F16;
    const V::R vm = V::set1(m), vinv = V::set1(inv);
    for (; i + V::W <= n; i += V::W) {
        const V::R x = V::load(l + i);
        const V::R e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, V::set1(-INFINITY), _CMP_NEQ_OQ),
                                           plait::exp512(_mm512_mul_ps(_mm512_sub_ps(x, vm), vinv)));
        V::store(p + i, e);
        sum += V::hsum(e);
    }
#elif defined(__AVX2__)
    using V = plait::F8;
    const V::R vm = V::set1(m), vinv = V::set1(inv);
    for (; i + V::W <= n; i += V::W) {
        const V::R x = V::load(l + i);
        const V::R e = _mm256_and_ps(plait::exp256(_mm256_mul_ps(_mm256_sub_ps(x, vm), vinv)),
                                     _mm256_cmp_ps(x, V::set1(-INFINITY), _CMP_NEQ_OQ));
        V::store(p + i, e);
        sum += V::hsum(e);
    }
#endif
    for (; i < n; ++i) {
        p[i] = l[i] == -INFINITY ? 0.0f : std::exp((l[i] - m) * inv);
        sum += p[i];
    }
    return sum;
}

// Zeroes the probabilities outside the top-k / top-p support: in descending order a token stays
// when its rank is below k and the mass strictly before it is below `target` (the first always
// stays). Tokens in buckets above the one where either bound is crossed all stay and those below
// all go; only that bucket is sorted.
void keep_top(float* p, int64_t n, int64_t k, double target) {
    std::vector<double> mass(BUCKETS, 0.0);
    std::vector<int64_t> count(BUCKETS, 0);
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t key = bits_of(p[i]) >> KEY_SHIFT;
        mass[key] += p[i];
        ++count[key];
    }
    double above = 0.0;  // the mass and count of the buckets above b
    int64_t ranked = 0;
    int b = BUCKETS - 1;
    for (; b > 0; --b) {
        if (ranked + count[b] >= k || above + mass[b] >= target) break;
        above += mass[b];
        ranked += count[b];
    }
    if (b == 0) return;  // every non-zero probability stays
    std::vector<std::pair<float, int64_t>> edge;
    edge.reserve(count[b]);
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t key = bits_of(p[i]) >> KEY_SHIFT;
        if (key < static_cast<uint32_t>(b)) {
            p[i] = 0.0f;
        } else if (key == static_cast<uint32_t>(b)) {
            edge.emplace_back(p[i], i);
        }
    }
    // descending by probability; equal ones by index, as a stable sort of the vocabulary would
    std::sort(edge.begin(), edge.end(), [](const auto& x, const auto& y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
    double before = above;
    for (size_t j = 0; j < edge.size(); ++j) {
        const int64_t rank = ranked + static_cast<int64_t>(j);
        if (rank > 0 && (rank >= k || before >= target)) p[edge[j].second] = 0.0f;
        before += edge[j].first;
    }
}

// The first index whose running sum of p passes u * total (in index order), or the last non-zero
// one when rounding leaves the sum short.
int64_t draw(const float* p, int64_t n, double total, float u) {
    const double x = static_cast<double>(u) * total;
    constexpr int64_t BLOCK = 256;
    double run = 0.0;
    int64_t b = 0;
    for (; b < n; b += BLOCK) {  // the block where the running sum passes x
        const double block = sum_of(p + b, std::min(BLOCK, n - b));
        if (run + block > x) break;
        run += block;
    }
    for (int64_t i = b; i < std::min(n, b + BLOCK); ++i) {
        run += p[i];
        if (p[i] > 0.0f && run > x) return i;
    }
    for (int64_t i = n - 1; i >= 0; --i)  // rounding: the last token with any probability
        if (p[i] > 0.0f) return i;
    return -1;
}

// The row's kept probabilities, unnormalized, into p [vocab]: temperature, min-p, then top-k and
// top-p. Returns their sum, or -1 when the row has no finite distribution (NaN logits, every logit
// -inf, a temperature not above 0).
double filtered(const float* l, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p, float* p) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < vocab; ++i) {
        nan |= l[i] != l[i];
        m = l[i] > m ? l[i] : m;
    }
    if (nan || m == -INFINITY || !(temperature > 0.0f)) return -1.0;
    double total = exp_scaled(l, vocab, m, 1.0f / temperature, p);
    if (!std::isfinite(total)) return -1.0;
    if (min_p > 0.0f) {  // relative to the largest probability, exp(0) = 1
#pragma omp simd
        for (int64_t i = 0; i < vocab; ++i) p[i] = p[i] < min_p ? 0.0f : p[i];
        total = sum_of(p, vocab);
    }
    if (top_k < vocab || top_p < 1.0f) {
        keep_top(p, vocab, top_k, static_cast<double>(top_p) * total);
        total = sum_of(p, vocab);
    }
    return total > 0.0 ? total : -1.0;
}

}  // namespace

// One row: logits [vocab] (not modified), temperature > 0, top_k (>= vocab: off), top_p, min_p
// and a uniform in [0, 1). Returns the drawn token, or -1 when the row has no finite distribution
// (NaN logits, every logit -inf). Also the draw of `plait_decode_burst`'s sampled rows.
extern "C" int64_t plait_sample_row(const float* l, int64_t vocab, float temperature, int64_t top_k, float top_p,
                                    float min_p, float uniform) {
    thread_local std::vector<float> probs;
    probs.resize(vocab);
    const double total = filtered(l, vocab, temperature, top_k, top_p, min_p, probs.data());
    return total > 0.0 ? draw(probs.data(), vocab, total, uniform) : -1;
}

// The distribution plait_sample_row draws from, normalized, into out [vocab] (speculative
// verification weighs drafts against it). Returns 0, or -1 (out untouched) when the row has no
// finite distribution.
extern "C" int64_t plait_filtered_probs_row(const float* l, int64_t vocab, float temperature, int64_t top_k,
                                            float top_p, float min_p, float* out) {
    thread_local std::vector<float> probs;
    probs.resize(vocab);
    const double total = filtered(l, vocab, temperature, top_k, top_p, min_p, probs.data());
    if (!(total > 0.0)) return -1;
    const float inv = static_cast<float>(1.0 / total);
#pragma omp simd
    for (int64_t i = 0; i < vocab; ++i) out[i] = probs[i] * inv;
    return 0;
}

// plait_sample_row for rows [rows, vocab] with per-row parameters; out [rows]. Rows run in parallel.
extern "C" void plait_sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                                  const int64_t* top_k, const float* top_p, const float* min_p,
                                  const float* uniform, int64_t* out, int num_threads) {
    plait::parallel_for(rows, num_threads, false, [&](int64_t r) {
        out[r] = plait_sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r], uniform[r]);
    });
}

// Sets row[v] to -inf for each token v whose bit (v % 32 of word v / 32) is 0 in `words`, and for
// the tokens past the mask's num_words * 32 (kernels/constraint_mask.py's layout).
extern "C" void plait_apply_bitmask_row(float* row, int64_t vocab, const int32_t* words, int64_t num_words) {
    const float minus_inf = -std::numeric_limits<float>::infinity();
    const int64_t covered = std::min<int64_t>(vocab, num_words * 32);
    for (int64_t w = 0; w * 32 < covered; ++w) {
        uint32_t blocked = ~static_cast<uint32_t>(words[w]);
        if (blocked == 0) continue;  // most words of a loose mask: nothing to clear
        float* base = row + w * 32;
        const int64_t width = std::min<int64_t>(32, covered - w * 32);
        if (width < 32) blocked &= (1u << width) - 1u;
        while (blocked) {
            base[__builtin_ctz(blocked)] = minus_inf;
            blocked &= blocked - 1;
        }
    }
    for (int64_t v = covered; v < vocab; ++v) row[v] = minus_inf;
}

// plait_apply_bitmask_row for rows `indices[0, n)` of logits [.., vocab] (row stride `stride`
// floats) with bitmask rows of the same index; rows run in parallel.
extern "C" void plait_apply_bitmask_rows(float* logits, int64_t stride, int64_t vocab, const int32_t* bitmask,
                                         int64_t num_words, const int64_t* indices, int64_t n, int num_threads) {
    plait::parallel_for(n, num_threads, false, [&](int64_t i) {
        const int64_t r = indices[i];
        plait_apply_bitmask_row(logits + r * stride, vocab, bitmask + r * num_words, num_words);
    });
}
