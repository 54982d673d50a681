// The library's own account of its ABI (plait_kernels.h): structure sizes, field offsets and the
// shared constants, by name, so that Python checks its ctypes mirrors against what this compiler
// laid out (tests/unit/test_native_abi.py) and reads the limits instead of copying them.
#include <cstddef>
#include <cstring>

#include "plait_kernels.h"

namespace {

struct Field {
    const char* structure;
    const char* field;
    int64_t offset;
};

#define PLAIT_FIELD(S, F) {#S, #F, static_cast<int64_t>(offsetof(S, F))}

constexpr Field FIELDS[] = {
    PLAIT_FIELD(PlaitQLinear, qweight), PLAIT_FIELD(PlaitQLinear, scales), PLAIT_FIELD(PlaitQLinear, mins),
    PLAIT_FIELD(PlaitQLinear, bias), PLAIT_FIELD(PlaitQLinear, out_features), PLAIT_FIELD(PlaitQLinear, in_features),
    PLAIT_FIELD(PlaitQLinear, group), PLAIT_FIELD(PlaitQLinear, format),

    PLAIT_FIELD(PlaitDecodeLayer, input_norm), PLAIT_FIELD(PlaitDecodeLayer, post_norm),
    PLAIT_FIELD(PlaitDecodeLayer, q_norm), PLAIT_FIELD(PlaitDecodeLayer, k_norm),
    PLAIT_FIELD(PlaitDecodeLayer, attn_out_norm), PLAIT_FIELD(PlaitDecodeLayer, mlp_out_norm),
    PLAIT_FIELD(PlaitDecodeLayer, inv_freq),
    PLAIT_FIELD(PlaitDecodeLayer, qkv), PLAIT_FIELD(PlaitDecodeLayer, o), PLAIT_FIELD(PlaitDecodeLayer, gate_up),
    PLAIT_FIELD(PlaitDecodeLayer, down), PLAIT_FIELD(PlaitDecodeLayer, k_cache), PLAIT_FIELD(PlaitDecodeLayer, v_cache),
    PLAIT_FIELD(PlaitDecodeLayer, k_scale), PLAIT_FIELD(PlaitDecodeLayer, v_scale),
    PLAIT_FIELD(PlaitDecodeLayer, num_slots), PLAIT_FIELD(PlaitDecodeLayer, space), PLAIT_FIELD(PlaitDecodeLayer, moe),

    PLAIT_FIELD(PlaitMoE, router), PLAIT_FIELD(PlaitMoE, gate_up), PLAIT_FIELD(PlaitMoE, down),
    PLAIT_FIELD(PlaitMoE, num_experts), PLAIT_FIELD(PlaitMoE, top_k), PLAIT_FIELD(PlaitMoE, intermediate),
    PLAIT_FIELD(PlaitMoE, normalize),

    PLAIT_FIELD(PlaitDecodeShape, tokens), PLAIT_FIELD(PlaitDecodeShape, hidden),
    PLAIT_FIELD(PlaitDecodeShape, num_heads), PLAIT_FIELD(PlaitDecodeShape, num_kv_heads),
    PLAIT_FIELD(PlaitDecodeShape, head_dim), PLAIT_FIELD(PlaitDecodeShape, intermediate),
    PLAIT_FIELD(PlaitDecodeShape, eps), PLAIT_FIELD(PlaitDecodeShape, attn_scale),
    PLAIT_FIELD(PlaitDecodeShape, kv_type), PLAIT_FIELD(PlaitDecodeShape, activation),
    PLAIT_FIELD(PlaitDecodeShape, invariant),

    PLAIT_FIELD(PlaitDecodeBurst, embed), PLAIT_FIELD(PlaitDecodeBurst, embed_rows),
    PLAIT_FIELD(PlaitDecodeBurst, embed_blocks), PLAIT_FIELD(PlaitDecodeBurst, embed_row_bytes),
    PLAIT_FIELD(PlaitDecodeBurst, embed_scale), PLAIT_FIELD(PlaitDecodeBurst, logit_softcap),
    PLAIT_FIELD(PlaitDecodeBurst, final_norm), PLAIT_FIELD(PlaitDecodeBurst, head),
    PLAIT_FIELD(PlaitDecodeBurst, tables), PLAIT_FIELD(PlaitDecodeBurst, num_slots),
    PLAIT_FIELD(PlaitDecodeBurst, sliding_window),
    PLAIT_FIELD(PlaitDecodeBurst, table_width), PLAIT_FIELD(PlaitDecodeBurst, lens),
    PLAIT_FIELD(PlaitDecodeBurst, stop_ids), PLAIT_FIELD(PlaitDecodeBurst, stop_offsets),
    PLAIT_FIELD(PlaitDecodeBurst, interrupt), PLAIT_FIELD(PlaitDecodeBurst, temperature),
    PLAIT_FIELD(PlaitDecodeBurst, top_k), PLAIT_FIELD(PlaitDecodeBurst, top_p), PLAIT_FIELD(PlaitDecodeBurst, min_p),
    PLAIT_FIELD(PlaitDecodeBurst, uniforms), PLAIT_FIELD(PlaitDecodeBurst, mask_fn),
    PLAIT_FIELD(PlaitDecodeBurst, bitmask), PLAIT_FIELD(PlaitDecodeBurst, masked),
    PLAIT_FIELD(PlaitDecodeBurst, mask_words),

    PLAIT_FIELD(PlaitDecodeRows, tables), PLAIT_FIELD(PlaitDecodeRows, table_width),
    PLAIT_FIELD(PlaitDecodeRows, q_index), PLAIT_FIELD(PlaitDecodeRows, table_index),
    PLAIT_FIELD(PlaitDecodeRows, first), PLAIT_FIELD(PlaitDecodeRows, kv_len), PLAIT_FIELD(PlaitDecodeRows, num_rows),
};

#undef PLAIT_FIELD

struct Named {
    const char* name;
    int64_t value;
};

constexpr Named SIZES[] = {
    {"PlaitQLinear", sizeof(PlaitQLinear)},         {"PlaitDecodeLayer", sizeof(PlaitDecodeLayer)},
    {"PlaitDecodeShape", sizeof(PlaitDecodeShape)}, {"PlaitDecodeBurst", sizeof(PlaitDecodeBurst)},
    {"PlaitDecodeRows", sizeof(PlaitDecodeRows)},   {"PlaitMoE", sizeof(PlaitMoE)},
};

constexpr Named CONSTANTS[] = {
    {"format_int8", PLAIT_FORMAT_INT8},
    {"format_int4", PLAIT_FORMAT_INT4},
    {"format_float32", PLAIT_FORMAT_FLOAT32},
    {"format_int8-f32", PLAIT_FORMAT_INT8_F32},
    {"format_int4-f32", PLAIT_FORMAT_INT4_F32},
    {"format_int5", PLAIT_FORMAT_INT5},
    {"format_int5-f32", PLAIT_FORMAT_INT5_F32},
    {"act_silu", PLAIT_ACT_SILU},
    {"act_gelu_tanh", PLAIT_ACT_GELU_TANH},
    {"kv_float32", PLAIT_KV_FLOAT32},
    {"kv_bfloat16", PLAIT_KV_BFLOAT16},
    {"kv_int8", PLAIT_KV_INT8},
    {"q8_block", PLAIT_Q8_BLOCK},
    {"avx2_max_q8_rows", PLAIT_AVX2_MAX_Q8_ROWS},
};

int64_t lookup(const Named* table, size_t n, const char* name) {
    for (size_t i = 0; i < n; ++i)
        if (std::strcmp(table[i].name, name) == 0) return table[i].value;
    return -1;
}

}  // namespace

extern "C" int64_t plait_abi_struct_size(const char* name) {
    return lookup(SIZES, sizeof SIZES / sizeof *SIZES, name);
}

extern "C" int64_t plait_abi_field_offset(const char* name, const char* field) {
    for (const Field& f : FIELDS)
        if (std::strcmp(f.structure, name) == 0 && std::strcmp(f.field, field) == 0) return f.offset;
    return -1;
}

extern "C" int64_t plait_abi_constant(const char* name) {
    return lookup(CONSTANTS, sizeof CONSTANTS / sizeof *CONSTANTS, name);
}
