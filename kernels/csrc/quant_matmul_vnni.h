// What the AVX-512 VNNI tier's two files share (quant_matmul_vnni.cpp: int4 weights and the entry
// point; quant_matmul_vnni_int8.cpp: int8 and five-bit weights): the tiled driver that rounds rows
// of x and runs chunks of weight rows against tiles of them.
#pragma once

#include "quant_matmul.h"

#include "parallel.h"

#ifdef PLAIT_VNNI512

namespace plait::qmm {

inline __m256 reduce512(__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

constexpr int64_t X_TILE_M = 8;  // rows of x per pass over a chunk of weights (int4_rows_vnni, int8_rows_vnni)

// f(std::integral_constant<int, mt>) for the tile's row count mt (1..X_TILE_M): the kernels take it
// as a template argument.
template <class F>
void with_tile_rows(int64_t mt, F&& f) {
    switch (mt) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// The driver of int4_rows_vnni and int8_rows_vnni (decode rows, verification, prefill): each row of
// x quantized in two levels and laid out in its tile (`layout(xq, xr, xd, xs, Mt, i, tile, tile_ds)`,
// `row_bytes` / `row_floats` a row's share of the tiles), then chunks of `task_rows` weight rows
// against X_TILE_M rows of x at a time (the chunk stays in cache across the passes over x, and x
// is read from L2 or memory once per chunk, so many rows of x want larger chunks): `rows(mt, tile, tile_ds,
// n_begin, n_end, y_rows, extra...)`. `task(n_begin, n_end, passes)` runs a chunk's passes over x as
// `passes(extra...)`: TaskWeights hands them the chunk's weights (the default, none).
struct AllPasses {
    template <class Passes>
    void operator()(int64_t, int64_t, Passes&& passes) const { passes(); }
};
template <class Layout, class Rows, class Task = AllPasses>
void tiled_matmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, int64_t row_bytes, int64_t row_floats,
                       float* y, int num_threads, Layout&& layout, Rows&& rows, Task&& task = Task{}) {
    std::unique_ptr<char[]> xbuf(new char[M * row_bytes + 64]);
    char* const q = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(xbuf.get()) + 63) & ~uintptr_t(63));
    std::unique_ptr<float[]> dbuf(new float[M * row_floats + 16]);
    float* const ds = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(dbuf.get()) + 63) & ~uintptr_t(63));
    plait::parallel_for(M, M >= 8 ? num_threads : 1, false, [&](int64_t m) {
        thread_local std::vector<int8_t> tq, tr;
        thread_local std::vector<float> td, ts;
        tq.resize(K), tr.resize(K), td.resize(K / XBLOCK), ts.resize(K / XBLOCK);
        quantize_x_q8(x + m * K, K, tq.data(), tr.data(), td.data(), ts.data());
        const int64_t m0 = m / X_TILE_M * X_TILE_M;
        layout(tq.data(), tr.data(), td.data(), ts.data(), std::min(X_TILE_M, M - m0), m - m0, q + m0 * row_bytes,
               ds + m0 * row_floats);
    });
    const int64_t chunk = task_rows(M, N, num_threads), chunks = (N + chunk - 1) / chunk;
    plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
        const int64_t b = c * chunk, e = std::min(N, b + chunk);
        task(b, e, [&](const auto&... extra) {
            for (int64_t m0 = 0; m0 < M; m0 += X_TILE_M)
                with_tile_rows(std::min(X_TILE_M, M - m0), [&](auto mt) {
                    rows(mt, q + m0 * row_bytes, ds + m0 * row_floats, b, e, y + m0 * N, extra...);
                });
        });
    });
}

// int8 (formats 0, 3) and five-bit (5, 6) weights against any number of rows of x
// (quant_matmul_vnni_int8.cpp)
void int8_qmatmul_vnni(const float* x, int64_t M, int64_t K, int64_t N, const void* qweight, int format, int64_t group,
                       const void* scales, const void* mins, const float* bias, float* y, int num_threads);

}  // namespace plait::qmm

#endif
