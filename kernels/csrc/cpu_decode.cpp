// The decoder layers of a decode step in one call: for every layer, residual-add + RMSNorm, the
// quantized qkv projection, rotary embedding, the KV store, paged attention rows, the output
// projection, the second norm, gate/up, SiLU-mul and down. Each stage is one of the library's own
// kernels; running them back to back here removes the ~10 Python-to-C round trips (and their
// tensor allocations) per layer that otherwise cost a third of a small model's quantized decode
// step. Used only when every token of the batch is an attention row (decode tokens and short
// extends) and every projection is quantized; see `kernels/decode_stack.py`.
#include <cstdint>
#include <cstring>

extern "C" {
void plait_rms_norm_f32(const float* x, const float* w, float* out, int64_t rows, int64_t d, float eps,
                        int num_threads);
void plait_add_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t d,
                            float eps, int num_threads);
void plait_rope_f32(float* q, float* k, const int64_t* positions, const float* inv_freq, int64_t tokens, int64_t hq,
                    int64_t hk, int64_t head_dim, int64_t q_stride, int64_t k_stride, int num_threads);
void plait_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads);
void plait_qmatmul_f32(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format,
                       int64_t group, const uint16_t* scales, const uint16_t* mins, const float* bias, float* y,
                       int num_threads);
int64_t plait_first_bad_slot(const int64_t* slots, int64_t num_tokens, int64_t num_slots);
int64_t plait_store_kv(const float* k, const float* v, int64_t row_stride, const int64_t* slots, int64_t num_tokens,
                       int64_t num_kv_heads, int64_t head_dim, int kv_type, void* k_cache, void* v_cache,
                       float* k_scale, float* v_scale, int64_t num_slots);
void plait_paged_attention_rows(const float* q, const void* k, const void* v, const float* k_scale,
                                const float* v_scale, int kv_type, const int64_t* tables, int64_t table_width,
                                const int64_t* q_index, const int64_t* table_index, const int64_t* first,
                                const int64_t* kv_len, float* out, int64_t num_rows, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, float scale, int num_threads);
}

// Mirrored by ctypes structures in kernels/decode_stack.py: keep the two in the same order.
struct PlaitQLinear {
    const void* qweight;
    const uint16_t* scales;  // float16
    const uint16_t* mins;    // float16, int4 only
    const float* bias;  // may be null
    int64_t out_features, in_features, group;
    int64_t format;  // 0 int8, 1 int4
};

struct PlaitDecodeLayer {
    const float* input_norm;
    const float* post_norm;
    PlaitQLinear qkv, o, gate_up, down;
    void* k_cache;
    void* v_cache;
    float* k_scale;  // int8 caches only
    float* v_scale;
};

struct PlaitDecodeShape {
    int64_t tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, attn_scale;
    int64_t kv_type;
    int64_t num_slots;  // the KV pool's slots per layer
};

struct PlaitDecodeRows {  // the attention rows (kernels/attention_cpu.py: CpuRows)
    const int64_t* tables;
    int64_t table_width;
    const int64_t* q_index;
    const int64_t* table_index;
    const int64_t* first;
    const int64_t* kv_len;
    int64_t num_rows;
};

namespace {

inline void linear(const PlaitQLinear& l, const float* x, int64_t m, float* y, int threads) {
    plait_qmatmul_f32(x, m, l.in_features, l.out_features, l.qweight, static_cast<int>(l.format), l.group,
                      l.scales, l.mins, l.bias, y, threads);
}

}  // namespace

// x [T, hidden]: in, the embeddings (or the previous layer's MLP output when `has_residual`); out,
// the last layer's MLP output. residual [T, hidden]: the residual stream before that output.
// scratch holds T * (hidden + qkv width + 2 * q width + 3 * intermediate) floats. Returns -1, or
// the index of the first token whose slot lies outside the pool (then nothing has run).
extern "C" int64_t plait_decode_layers(const PlaitDecodeLayer* layers, int64_t num_layers, const PlaitDecodeShape* s,
                                    const PlaitDecodeRows* rows, const int64_t* positions, const float* inv_freq,
                                    const int64_t* slots, float* x, float* residual, int has_residual,
                                    float* scratch, int num_threads) {
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
    if (const int64_t bad = plait_first_bad_slot(slots, T, s->num_slots); bad >= 0) return bad;
    for (int64_t i = 0; i < num_layers; ++i) {
        const PlaitDecodeLayer& L = layers[i];
        if (i == 0 && !has_residual) {
            std::memcpy(residual, x, T * D * sizeof(float));
            plait_rms_norm_f32(x, L.input_norm, h, T, D, s->eps, num_threads);
        } else {
            plait_add_rms_norm_f32(x, residual, L.input_norm, h, T, D, s->eps, num_threads);
        }
        linear(L.qkv, h, T, qkv, num_threads);
        plait_rope_f32(qkv, qkv + q_size, positions, inv_freq, T, s->num_heads, s->num_kv_heads, hd, qkv_width,
                       qkv_width, num_threads);
        plait_store_kv(qkv + q_size, qkv + q_size + kv_size, qkv_width, slots, T, s->num_kv_heads, hd, kv_type,
                       L.k_cache, L.v_cache, L.k_scale, L.v_scale, s->num_slots);
        for (int64_t t = 0; t < T; ++t) std::memcpy(q + t * q_size, qkv + t * qkv_width, q_size * sizeof(float));
        plait_paged_attention_rows(q, L.k_cache, L.v_cache, L.k_scale, L.v_scale, kv_type, rows->tables,
                                   rows->table_width, rows->q_index, rows->table_index, rows->first, rows->kv_len,
                                   attn, rows->num_rows, s->num_heads, s->num_kv_heads, hd, s->attn_scale,
                                   num_threads);
        linear(L.o, attn, T, x, num_threads);
        plait_add_rms_norm_f32(x, residual, L.post_norm, h, T, D, s->eps, num_threads);
        linear(L.gate_up, h, T, gate_up, num_threads);
        plait_silu_mul_f32(gate_up, act, T, inter, num_threads);
        linear(L.down, act, T, x, num_threads);
    }
    return -1;
}
