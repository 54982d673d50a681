// The native kernels' ABI: every function the library exports, the structures passed to them,
// and the codes and limits shared with Python. Every .cpp of the library includes this header, so
// a kernel that calls another (the decode stack calls most of them) sees the one declaration the
// definition is checked against.
//
// Python calls these through ctypes (kernels/*.py). The structures are mirrored there by ctypes
// Structures; `plait_abi_struct_size` / `plait_abi_field_offset` report this side's layout and
// `plait_abi_constant` the codes and limits, and tests/unit/test_native_abi.py compares the two.
// Plain C types only: the library includes nothing from torch.
#pragma once

#include <cstdint>

// Weight formats of plait_qmatmul_f32 and PlaitQLinear.format (kernels/quant_weights.py: FORMAT_CODE):
// int8 / int4 values with float16 scales (0, 1), float32 weights (2), int8 / int4 values with
// float32 scales (3, 4: the k-quants' sub-block scales), packed five-bit values with float16 scales
// (5: Q5_0) or float32 scales and minimums (6: Q5_K); see cpu_quant_matmul.cpp.
enum PlaitWeightFormat : int {
    PLAIT_FORMAT_INT8 = 0,
    PLAIT_FORMAT_INT4 = 1,
    PLAIT_FORMAT_FLOAT32 = 2,
    PLAIT_FORMAT_INT8_F32 = 3,
    PLAIT_FORMAT_INT4_F32 = 4,
    PLAIT_FORMAT_INT5 = 5,
    PLAIT_FORMAT_INT5_F32 = 6,
};
// The gated MLP's activation (kernels/decode_stack.py: ACTIVATION_CODE).
enum PlaitActivation : int { PLAIT_ACT_SILU = 0, PLAIT_ACT_GELU_TANH = 1 };
// KV cache storage types (kernels/kv_cache.py: kv_type_code).
enum PlaitKVType : int { PLAIT_KV_FLOAT32 = 0, PLAIT_KV_BFLOAT16 = 1, PLAIT_KV_INT8 = 2 };
// Activations round to int8 in blocks of this many values (kernels/quant_weights.py: Q8_BLOCK).
constexpr int64_t PLAIT_Q8_BLOCK = 32;
// On AVX2 (no VNNI), up to this many rows of x round to int8; more keep float32 activations
// (see cpu_quant_matmul.cpp). kernels/tuning.py's DEQUANT_GEMM_MIN_ROWS starts right after it.
constexpr int64_t PLAIT_AVX2_MAX_Q8_ROWS = 47;

// A linear layer's weight: quantized (int8, int4) or plain float32 [out_features, in_features].
struct PlaitQLinear {  // kernels/decode_stack.py: QLinear
    const void* qweight;
    const void* scales;  // float16 (formats 0, 1, 5) or float32 (3, 4, 6)
    const void* mins;    // the same type, one per 32 weights; int4, format 6, and format 3 where set
    const float* bias;       // may be null
    int64_t out_features, in_features, group;
    int64_t format;  // PlaitWeightFormat
};

// A mixture of experts in place of a layer's MLP: the router's softmax over the experts, the top
// `top_k` of them per token (their weights renormalized to sum 1 where `normalize`), each expert
// run once over the tokens that picked it, and the picks' outputs summed by their weights.
struct PlaitMoE {  // kernels/decode_stack.py: MoE
    PlaitQLinear router;          // [num_experts, hidden]
    const PlaitQLinear* gate_up;  // [num_experts] of [2 * intermediate, hidden]
    const PlaitQLinear* down;     // [num_experts] of [hidden, intermediate]
    int64_t num_experts, top_k, intermediate, normalize;
};

// One decoder layer: x += attn_out_norm(o(attention(rope(qk_norm(qkv(input_norm(x))))))), then
// x += mlp_out_norm(down(act(gate) * up)) of post_norm(x). The Llama layer has no q/k norms and
// no output norms (null); Gemma 3 has all four norms, Qwen3 the q/k ones.
struct PlaitDecodeLayer {  // kernels/decode_stack.py: DecodeLayer
    const float* input_norm;     // [hidden]
    const float* post_norm;      // [hidden]: before the MLP
    const float* q_norm;         // [head_dim], shared by every query head; may be null
    const float* k_norm;         // [head_dim]; null exactly when q_norm is
    const float* attn_out_norm;  // [hidden]: on the attention's output; may be null
    const float* mlp_out_norm;   // [hidden]: on the MLP's output; may be null
    const float* inv_freq;       // [head_dim / 2]: the layer's rotary frequencies
    PlaitQLinear qkv, o, gate_up, down;
    void* k_cache;
    void* v_cache;
    float* k_scale;  // int8 caches only
    float* v_scale;
    int64_t num_slots;  // the slots of its KV cache
    int64_t space;      // which pages its KV lives in: 0, the pool's; 1, the window pages
    const PlaitMoE* moe;  // a mixture of experts instead of gate_up and down; null: the dense MLP
};

struct PlaitDecodeShape {  // kernels/decode_stack.py: DecodeShape
    int64_t tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, attn_scale;
    int64_t kv_type;     // PlaitKVType
    int64_t activation;  // PlaitActivation
    int64_t invariant;   // 1: each row's results as that row alone gets them (batch-invariant)
};

struct PlaitDecodeBurst {  // kernels/decode_stack.py: DecodeBurst
    const float* embed;       // [embed_rows, hidden] float32, or null: rows of embed_blocks
    int64_t embed_rows;
    PlaitQLinear embed_blocks;   // a quantized table (a tied head's blocks), where embed is null
    int64_t embed_row_bytes[3];  // bytes from one row of its qweight, scales, mins to the next
    float embed_scale;        // embeddings are multiplied by it (1: plain)
    float logit_softcap;      // logits = cap * tanh(logits / cap) where > 0
    const float* final_norm;  // [hidden]
    PlaitQLinear head;        // [vocab, hidden]
    // per space (PlaitDecodeLayer.space): [rows, table_width], each row's slots of positions
    // [0, len + steps - 1) in that space's pages, the slots those pages hold (0, and tables null:
    // no layer's KV lives there), and the window its layers attend through (0: none)
    const int64_t* tables[2];
    int64_t num_slots[2];
    int64_t sliding_window[2];
    int64_t table_width;
    const int64_t* lens;      // [rows]: tokens before the burst; the first fed token sits at len - 1
    const int64_t* stop_ids;  // row r stops at any of stop_ids[stop_offsets[r], stop_offsets[r + 1])
    const int64_t* stop_offsets;
    const int32_t* interrupt; // may be null; once another thread sets it non-zero, the burst ends
    // Sampling, all null when every row is greedy. Row r with temperature[r] > 0 draws its token
    // at step s with uniforms[r * steps + s] (plait_sample_row); the others take the argmax.
    const float* temperature;  // [rows]
    const int64_t* top_k;      // [rows]
    const float* top_p;        // [rows]
    const float* min_p;        // [rows]
    const float* uniforms;     // [rows, steps]
    // Grammar masks, all null when no row is constrained. Before step s runs, mask_fn(s) is
    // called (the tokens of steps < s are in `out` by then): a non-zero return ends the burst
    // before step s; otherwise it has set masked[r] (non-zero: row r is constrained at step s)
    // and, for such rows, the allowed tokens in bitmask[r * mask_words, ...) (bit v % 32 of word
    // v / 32, as kernels/constraint_mask.py), which the step applies before it picks.
    int32_t (*mask_fn)(int64_t step);
    const int32_t* bitmask;    // [rows, mask_words]
    const int32_t* masked;     // [rows]
    int64_t mask_words;
};

struct PlaitDecodeRows {  // the attention rows (kernels/decode_stack.py: DecodeRows)
    const int64_t* tables;
    int64_t table_width;
    const int64_t* q_index;
    const int64_t* table_index;
    const int64_t* first;
    const int64_t* kv_len;
    int64_t num_rows;
};

extern "C" {

// cpu_abi.cpp: this side's layout and constants, by name; -1 for a name it does not know.
int64_t plait_abi_struct_size(const char* name);
int64_t plait_abi_field_offset(const char* name, const char* field);
int64_t plait_abi_constant(const char* name);

// cpu_attention.cpp
void plait_paged_attention_rows(const float* q, const void* k, const void* v, const float* k_scale,
                                const float* v_scale, int kv_type, const int64_t* tables, int64_t table_width,
                                const int64_t* q_index, const int64_t* table_index, const int64_t* first,
                                const int64_t* kv_len, float* out, int64_t num_rows, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, float scale, int invariant,
                                int num_threads);
int64_t plait_first_bad_slot(const int64_t* slots, int64_t num_tokens, int64_t num_slots);
int64_t plait_store_kv(const float* k, const float* v, int64_t row_stride, const int64_t* slots, int64_t num_tokens,
                       int64_t num_kv_heads, int64_t head_dim, int kv_type, void* k_cache, void* v_cache,
                       float* k_scale, float* v_scale, int64_t num_slots);

// cpu_extend_attention.cpp
int plait_extend_attention_f32(const float* q, const float* k, const float* v, float* out, int64_t q_len,
                               int64_t prefix_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               float scale, int64_t window, int num_threads);

// cpu_fused.cpp
void plait_rms_norm_f32(const float* x, const float* w, float* out, int64_t rows, int64_t d, float eps,
                        int num_threads);
void plait_add_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t d,
                            float eps, int num_threads);
void plait_rope_f32(float* q, float* k, const int64_t* positions, const float* inv_freq, int64_t tokens, int64_t hq,
                    int64_t hk, int64_t head_dim, int64_t q_stride, int64_t k_stride, int num_threads);
void plait_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads);
void plait_gelu_tanh_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads);

// cpu_quant_matmul.cpp (its ISA tiers in quant_matmul_*.cpp, the float32 GEMV in dense_gemv.cpp)
void plait_qmatmul_f32(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format,
                       int64_t group, const void* scales, const void* mins, const float* bias, float* y,
                       int num_threads);
void plait_qmatmul_rows_f32(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format,
                            int64_t group, const void* scales, const void* mins, const float* bias, float* y,
                            int num_threads);
void plait_dequantize_f32(const void* qweight, int format, int64_t N, int64_t K, int64_t group,
                          const void* scales, const void* mins, float* out, int num_threads);
void plait_dequantize_bf16(const void* qweight, int format, int64_t N, int64_t K, int64_t group,
                           const void* scales, const void* mins, uint16_t* out, int num_threads);
int64_t plait_qmatmul_max_q8_rows();
int plait_qmatmul_isa();
void plait_qmatmul_set_task_rows(const int64_t* max_m, const int64_t* rows, int64_t n);
int64_t plait_qmatmul_task_rows(int64_t M, int64_t N, int num_threads);
int plait_qmatmul_q8_rows(int64_t K, int format, int64_t group);

// cpu_decode.cpp
int64_t plait_decode_layers(const PlaitDecodeLayer* layers, int64_t num_layers, const PlaitDecodeShape* s,
                            const PlaitDecodeRows* rows, const int64_t* positions, const int64_t* slots, float* x,
                            float* residual, int has_residual, float* scratch, int num_threads);
int64_t plait_decode_burst(const PlaitDecodeLayer* layers, int64_t num_layers, const PlaitDecodeShape* s,
                           const PlaitDecodeBurst* g, const int64_t* ids, int64_t steps, int64_t* out,
                           float* scratch, int64_t scratch_floats, int num_threads);

// cpu_sampling.cpp
int64_t plait_sample_row(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p,
                         float min_p, float uniform);
int64_t plait_filtered_probs_row(const float* logits, int64_t vocab, float temperature, int64_t top_k,
                                 float top_p, float min_p, float* out);
void plait_sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                       const int64_t* top_k, const float* top_p, const float* min_p, const float* uniform,
                       int64_t* out, int num_threads);

void plait_apply_bitmask_row(float* row, int64_t vocab, const int32_t* words, int64_t num_words);
void plait_apply_bitmask_rows(float* logits, int64_t stride, int64_t vocab, const int32_t* bitmask,
                              int64_t num_words, const int64_t* indices, int64_t n, int num_threads);

// cpu_threads.cpp
int plait_release_thread_team();

// cpu_roofs.cpp
uint64_t plait_read_buffers(const void* const* ptrs, const int64_t* bytes, int64_t n, int num_threads);
int64_t plait_int8_dot_peak(int64_t iters, int num_threads, int64_t* checksum);

}  // extern "C"
