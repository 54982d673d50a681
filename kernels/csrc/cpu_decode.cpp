// The decoder layers of a decode step in one call: for every layer, residual-add + RMSNorm, the
// quantized qkv projection, q/k norms where the family has them, rotary embedding with the
// layer's frequencies, the KV store, paged attention rows (in the pool's pages or, for the sliding
// layers of a model that has both kinds, in the window pages), the output projection (and its
// norm, Gemma's), the second norm, gate/up, SiLU- or GELU-mul and down (or a mixture of experts)
// (and its norm). Each stage is one of the library's own
// kernels; running them back to back here removes the ~10 Python-to-C round trips (and their
// tensor allocations) per layer that otherwise cost a third of a small model's quantized decode
// step. Used only when every token of the batch is an attention row (decode tokens and short
// extends) and every projection is quantized or float32; see `kernels/decode_stack.py`.
//
// `plait_decode_burst` runs several whole decode steps in one call (embedding, layers, final norm,
// LM head, then the argmax or a draw), feeding each step's tokens to the next: a burst of
// continuous decode steps, with no Python between them.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "plait_kernels.h"
#include "vec_math.h"

namespace {

inline void linear(const PlaitQLinear& l, const float* x, int64_t m, float* y, int threads, bool invariant) {
    (invariant ? plait_qmatmul_rows_f32 : plait_qmatmul_f32)(x, m, l.in_features, l.out_features, l.qweight,
                                                             static_cast<int>(l.format), l.group, l.scales, l.mins,
                                                             l.bias, y, threads);
}

// The index of the first maximum of row[0, n), as numpy's and torch's argmax (NaN-free rows).
// NOTE: vectorized: a scalar compare-and-branch loop over a vocabulary's logits is a visible share
// of a small decode step.
inline int64_t first_argmax(const float* row, int64_t n) {
    float best = row[0];
    int64_t v = 1;
#ifdef __AVX2__
    using V = plait::F8;
    if (n >= 2 * V::W) {
        V::R m = V::load(row);
        for (v = V::W; v + V::W <= n; v += V::W) m = V::max(m, V::load(row + v));
        best = V::hmax(m);
    }
#endif
    for (; v < n; ++v) best = row[v] > best ? row[v] : best;
    v = 0;
#ifdef __AVX2__
    const __m256 target = _mm256_set1_ps(best);
    for (; v + V::W <= n; v += V::W) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(V::load(row + v), target, _CMP_EQ_OQ));
        if (hit) return v + __builtin_ctz(hit);
    }
#endif
    for (; v < n; ++v)
        if (row[v] == best) return v;
    return 0;
}

// Each query and key head of qkv [T, qkv_width] RMS-normalized in place (before rotary).
void norm_qk(const PlaitDecodeLayer& L, const PlaitDecodeShape* s, float* qkv, int64_t qkv_width) {
    const int64_t hd = s->head_dim, q_size = s->num_heads * hd;
    for (int64_t t = 0; t < s->tokens; ++t) {
        float* row = qkv + t * qkv_width;
        plait_rms_norm_f32(row, L.q_norm, row, s->num_heads, hd, s->eps, 1);
        plait_rms_norm_f32(row + q_size, L.k_norm, row + q_size, s->num_kv_heads, hd, s->eps, 1);
    }
}

// act(gate_up[:, :inter]) * gate_up[:, inter:] for rows of width 2 * inter
void gated(int64_t activation, const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads) {
    if (activation == PLAIT_ACT_GELU_TANH)
        plait_gelu_tanh_mul_f32(gate_up, out, rows, inter, num_threads);
    else
        plait_silu_mul_f32(gate_up, out, rows, inter, num_threads);
}

// out [T, D] = the mixture's output for h [T, D] (PlaitMoE): each expert once, over the tokens
// that picked it; each token's picks summed in the order of their weights, as torch sums them.
void mixture(const PlaitMoE& m, const PlaitDecodeShape* s, const float* h, float* out, int num_threads) {
    const int64_t T = s->tokens, D = s->hidden, E = m.num_experts, K = m.top_k, I = m.intermediate;
    std::vector<float> probs(T * E), weights(T * K), picked(T * K * D);
    std::vector<int64_t> ids(T * K);
    linear(m.router, h, T, probs.data(), num_threads, s->invariant != 0);
    for (int64_t t = 0; t < T; ++t) {
        float* p = probs.data() + t * E;
        float top = p[0], sum = 0.0f;
        for (int64_t e = 1; e < E; ++e) top = p[e] > top ? p[e] : top;
        for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
        for (int64_t e = 0; e < E; ++e) p[e] /= sum;
        std::vector<char> taken(E, 0);
        float kept = 0.0f;
        for (int64_t j = 0; j < K; ++j) {  // the largest left, the lowest index among equals
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            ids[t * K + j] = best;
            kept += weights[t * K + j] = p[best];
        }
        if (m.normalize)
            for (int64_t j = 0; j < K; ++j) weights[t * K + j] /= kept;
    }
    std::vector<float> rows, gate_up, act, y;
    std::vector<int64_t> pairs;
    for (int64_t e = 0; e < E; ++e) {
        pairs.clear();
        for (int64_t i = 0; i < T * K; ++i)
            if (ids[i] == e) pairs.push_back(i);
        const int64_t n = static_cast<int64_t>(pairs.size());
        if (n == 0) continue;
        rows.resize(n * D), gate_up.resize(n * 2 * I), act.resize(n * I), y.resize(n * D);
        for (int64_t r = 0; r < n; ++r) std::memcpy(rows.data() + r * D, h + pairs[r] / K * D, D * sizeof(float));
        linear(m.gate_up[e], rows.data(), n, gate_up.data(), num_threads, s->invariant != 0);
        gated(s->activation, gate_up.data(), act.data(), n, I, num_threads);
        linear(m.down[e], act.data(), n, y.data(), num_threads, s->invariant != 0);
        for (int64_t r = 0; r < n; ++r) std::memcpy(picked.data() + pairs[r] * D, y.data() + r * D, D * sizeof(float));
    }
    for (int64_t t = 0; t < T; ++t) {
        float* o = out + t * D;
        for (int64_t d = 0; d < D; ++d) o[d] = picked[(t * K) * D + d] * weights[t * K];
        for (int64_t j = 1; j < K; ++j) {
            const float w = weights[t * K + j];
            const float* v = picked.data() + (t * K + j) * D;
            for (int64_t d = 0; d < D; ++d) o[d] += v[d] * w;
        }
    }
}

}  // namespace

// x [T, hidden]: in, the embeddings (or the previous layer's MLP output when `has_residual`); out,
// the last layer's MLP output. residual [T, hidden]: the residual stream before that output.
// rows[space] and slots [2, T] (space * T + t): the attention rows and the KV slots of the tokens
// in each space's pages (PlaitDecodeLayer.space; rows[1] and slots[T, 2T) are read only where a
// layer lives in the window pages). scratch holds
// T * (hidden + qkv width + 2 * q width + 3 * intermediate) floats. Returns -1, or the index of the
// first token whose slot lies outside a layer's KV cache (then nothing has run).
extern "C" int64_t plait_decode_layers(const PlaitDecodeLayer* layers, int64_t num_layers, const PlaitDecodeShape* s,
                                    const PlaitDecodeRows* rows, const int64_t* positions, const int64_t* slots,
                                    float* x, float* residual, int has_residual, float* scratch,
                                    int num_threads) {
    const int64_t T = s->tokens, D = s->hidden, hd = s->head_dim;
    const int64_t q_size = s->num_heads * hd, kv_size = s->num_kv_heads * hd;
    const int64_t qkv_width = q_size + 2 * kv_size, inter = s->intermediate;
    const int kv_type = static_cast<int>(s->kv_type);
    float* h = scratch;                   // [T, D]
    float* qkv = h + T * D;               // [T, qkv_width]
    float* q = qkv + T * qkv_width;       // [T, q_size], contiguous for the attention rows
    float* attn = q + T * q_size;         // [T, q_size]
    float* gate_up = attn + T * q_size;   // [T, 2 * inter]
    float* act = gate_up + T * 2 * inter; // [T, inter]
    for (int64_t i = 0; i < num_layers; ++i) {
        const PlaitDecodeLayer& L = layers[i];
        if (const int64_t bad = plait_first_bad_slot(slots + L.space * T, T, L.num_slots); bad >= 0) return bad;
    }
    for (int64_t i = 0; i < num_layers; ++i) {
        const PlaitDecodeLayer& L = layers[i];
        const PlaitDecodeRows& R = rows[L.space];
        if (i == 0 && !has_residual) {
            std::memcpy(residual, x, T * D * sizeof(float));
            plait_rms_norm_f32(x, L.input_norm, h, T, D, s->eps, num_threads);
        } else {
            plait_add_rms_norm_f32(x, residual, L.input_norm, h, T, D, s->eps, num_threads);
        }
        linear(L.qkv, h, T, qkv, num_threads, s->invariant != 0);
        if (L.q_norm != nullptr) norm_qk(L, s, qkv, qkv_width);
        plait_rope_f32(qkv, qkv + q_size, positions, L.inv_freq, T, s->num_heads, s->num_kv_heads, hd, qkv_width,
                       qkv_width, num_threads);
        plait_store_kv(qkv + q_size, qkv + q_size + kv_size, qkv_width, slots + L.space * T, T, s->num_kv_heads, hd,
                       kv_type, L.k_cache, L.v_cache, L.k_scale, L.v_scale, L.num_slots);
        for (int64_t t = 0; t < T; ++t) std::memcpy(q + t * q_size, qkv + t * qkv_width, q_size * sizeof(float));
        plait_paged_attention_rows(q, L.k_cache, L.v_cache, L.k_scale, L.v_scale, kv_type, R.tables, R.table_width,
                                   R.q_index, R.table_index, R.first, R.kv_len, attn, R.num_rows, s->num_heads,
                                   s->num_kv_heads, hd, s->attn_scale, static_cast<int>(s->invariant), num_threads);
        linear(L.o, attn, T, x, num_threads, s->invariant != 0);
        if (L.attn_out_norm != nullptr) plait_rms_norm_f32(x, L.attn_out_norm, x, T, D, s->eps, num_threads);
        plait_add_rms_norm_f32(x, residual, L.post_norm, h, T, D, s->eps, num_threads);
        if (L.moe != nullptr) {
            mixture(*L.moe, s, h, x, num_threads);
        } else {
            linear(L.gate_up, h, T, gate_up, num_threads, s->invariant != 0);
            gated(s->activation, gate_up, act, T, inter, num_threads);
            linear(L.down, act, T, x, num_threads, s->invariant != 0);
        }
        if (L.mlp_out_norm != nullptr) plait_rms_norm_f32(x, L.mlp_out_norm, x, T, D, s->eps, num_threads);
    }
    return -1;
}

namespace {

// Row `id` of the burst's embedding table, times its scale, into out [hidden].
void embed_row(const PlaitDecodeBurst* g, int64_t id, int64_t D, float* out) {
    if (g->embed != nullptr) {
        std::memcpy(out, g->embed + id * D, D * sizeof(float));
    } else {
        const PlaitQLinear& b = g->embed_blocks;
        const auto* q = static_cast<const char*>(b.qweight) + id * g->embed_row_bytes[0];
        const auto* sc = static_cast<const char*>(b.scales) + id * g->embed_row_bytes[1];
        const char* mn = b.mins == nullptr ? nullptr : static_cast<const char*>(b.mins) + id * g->embed_row_bytes[2];
        plait_dequantize_f32(q, static_cast<int>(b.format), 1, D, b.group, sc, mn, out, 1);
    }
    if (g->embed_scale != 1.0f)
        for (int64_t i = 0; i < D; ++i) out[i] *= g->embed_scale;
}

}  // namespace

// Up to `steps` decode steps for `s->tokens` rows. ids [rows]: the tokens fed first. out [rows,
// steps]: the tokens picked (each row's first maximum, or its draw when sampled, among the tokens
// its grammar mask allows). Stops early once every row has picked one of its stop ids, once
// `interrupt` is set, or when `mask_fn` says so before a step. scratch:
// `plait_decode_layers`' scratch, then rows * (3 * hidden + vocab) floats. Returns the steps run,
// or -1 - r when row r has a slot outside the pool or a token outside the embedding (then nothing
// has run).
extern "C" int64_t plait_decode_burst(const PlaitDecodeLayer* layers, int64_t num_layers, const PlaitDecodeShape* s,
                                      const PlaitDecodeBurst* g, const int64_t* ids, int64_t steps, int64_t* out,
                                      float* scratch, int64_t scratch_floats, int num_threads) {
    const int64_t B = s->tokens, D = s->hidden, V = g->head.out_features, W = g->table_width;
    for (int64_t r = 0; r < B; ++r) {
        const int64_t len = g->lens[r];
        if (len < 1 || len + steps - 1 > W || ids[r] < 0 || ids[r] >= g->embed_rows) return -1 - r;
        for (int sp = 0; sp < 2; ++sp)
            if (g->tables[sp] != nullptr &&
                plait_first_bad_slot(g->tables[sp] + r * W + len - 1, steps, g->num_slots[sp]) >= 0)
                return -1 - r;
    }
    for (int64_t i = 0; i < num_layers; ++i) {  // every layer's space has its table, as large as its cache
        const int64_t sp = layers[i].space;
        if (g->tables[sp] == nullptr || layers[i].num_slots < g->num_slots[sp]) return -1;
    }
    const int64_t layer_floats = scratch_floats - B * (3 * D + V);
    float* x = scratch + layer_floats;  // [B, D]
    float* residual = x + B * D;         // [B, D]
    float* h = residual + B * D;         // [B, D]
    float* logits = h + B * D;           // [B, V]
    std::vector<int64_t> fed(ids, ids + B), positions(B), slots(2 * B, 0), rows(B), first(2 * B), kv_len(B);
    std::vector<char> stopped(B, 0);
    for (int64_t r = 0; r < B; ++r) rows[r] = r;
    PlaitDecodeRows table[2];
    for (int sp = 0; sp < 2; ++sp)
        table[sp] = {g->tables[sp], W, rows.data(), rows.data(), first.data() + sp * B, kv_len.data(), B};
    int64_t step = 0;
    while (step < steps) {
        if (g->mask_fn != nullptr && g->mask_fn(step) != 0) break;
        for (int64_t r = 0; r < B; ++r) {
            const int64_t pos = g->lens[r] - 1 + step;
            positions[r] = pos;
            kv_len[r] = pos + 1;
            for (int sp = 0; sp < 2; ++sp) {
                if (g->tables[sp] != nullptr) slots[sp * B + r] = g->tables[sp][r * W + pos];
                const int64_t window = g->sliding_window[sp];
                first[sp * B + r] = window > 0 && kv_len[r] > window ? kv_len[r] - window : 0;
            }
            embed_row(g, fed[r], D, x + r * D);
        }
        if (num_layers == 0) std::memset(residual, 0, B * D * sizeof(float));  // the norm sees x alone
        plait_decode_layers(layers, num_layers, s, table, positions.data(), slots.data(), x, residual, 0, scratch,
                            num_threads);
        plait_add_rms_norm_f32(x, residual, g->final_norm, h, B, D, s->eps, num_threads);
        linear(g->head, h, B, logits, num_threads, s->invariant != 0);
        if (g->logit_softcap > 0.0f)
            for (int64_t i = 0; i < B * V; ++i) logits[i] = g->logit_softcap * std::tanh(logits[i] / g->logit_softcap);
        bool all_stopped = true;
        for (int64_t r = 0; r < B; ++r) {
            float* row = logits + r * V;
            if (g->mask_fn != nullptr && g->masked[r]) plait_apply_bitmask_row(row, V, g->bitmask + r * g->mask_words, g->mask_words);
            int64_t best = -1;
            if (g->temperature != nullptr && g->temperature[r] > 0.0f)
                best = plait_sample_row(row, V, g->temperature[r], g->top_k[r], g->top_p[r], g->min_p[r],
                                        g->uniforms[r * steps + step]);
            if (best < 0) best = first_argmax(row, V);  // greedy, or no finite distribution
            out[r * steps + step] = best;
            fed[r] = best < g->embed_rows ? best : 0;
            for (int64_t i = g->stop_offsets[r]; i < g->stop_offsets[r + 1] && !stopped[r]; ++i)
                stopped[r] = g->stop_ids[i] == best;
            all_stopped = all_stopped && stopped[r];
        }
        ++step;
        if (all_stopped || (g->interrupt != nullptr && __atomic_load_n(g->interrupt, __ATOMIC_RELAXED) != 0)) break;
    }
    return step;
}
