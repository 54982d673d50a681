// The dense float32 GEMV/GEMM of plait_qmatmul_f32's format 2 (plain float32 weights).
#include "quant_matmul.h"

#include "parallel.h"

namespace plait::qmm {

namespace {

// float32 weights (format 2), for the decode stack and the LM head, where torch's GEMV for a few
// rows of x reads the weights well below memory's pace. Each weight row is read in one sequential
// pass against up to 4 rows of x (independent accumulators: 4 for one row of x, 2 per row
// otherwise), with the row `ahead` rows on prefetched, past this task's end into the next task's
// (the same thread's under static scheduling), so that the read keeps a plain read's pace across
// tasks: two rows read side by side and prefetched only within the task fall short of it.
constexpr int64_t DENSE_PREFETCH_BYTES = 8192;

template <int M, int ACC = M == 1 ? 4 : 2>
void dense_rows(const float* x, int64_t K, int64_t n_begin, int64_t n_end, int64_t N, const float* w,
                const float* bias, float* y) {
    int64_t n = n_begin;
#ifdef __AVX2__
    if (K % 8 == 0) {
        const int64_t K_acc = K / (8 * ACC) * (8 * ACC);  // then single vectors to K
        const int64_t ahead = std::max<int64_t>(1, DENSE_PREFETCH_BYTES / (K * int64_t(sizeof(float))));
        for (; n < n_end; ++n) {
            const float* row = w + n * K;
            const char* next = reinterpret_cast<const char*>(n + ahead < N ? row + ahead * K : row);
            __m256 a[M][ACC];
            for (int m = 0; m < M; ++m)
                for (int j = 0; j < ACC; ++j) a[m][j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K_acc; k += 8 * ACC) {
                for (int64_t line = 0; line < 8 * ACC * int64_t(sizeof(float)); line += 64)
                    _mm_prefetch(next + k * int64_t(sizeof(float)) + line, _MM_HINT_T0);
                for (int j = 0; j < ACC; ++j) {
                    const __m256 v = _mm256_loadu_ps(row + k + 8 * j);
                    for (int m = 0; m < M; ++m) a[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * j), v, a[m][j]);
                }
            }
            for (int64_t k = K_acc; k < K; k += 8) {
                _mm_prefetch(next + k * int64_t(sizeof(float)), _MM_HINT_T0);
                const __m256 v = _mm256_loadu_ps(row + k);
                for (int m = 0; m < M; ++m) a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), v, a[m][0]);
            }
            for (int m = 0; m < M; ++m) {
                __m256 t = a[m][0];
                for (int j = 1; j < ACC; ++j) t = _mm256_add_ps(t, a[m][j]);
                y[m * N + n] = hsum256(t) + (bias ? bias[n] : 0.0f);
            }
        }
    }
#endif
    for (; n < n_end; ++n)
        for (int m = 0; m < M; ++m) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
            y[m * N + n] = s + (bias ? bias[n] : 0.0f);
        }
}

}  // namespace

void dense_matmul(const float* x, int64_t M, int64_t K, int64_t N, const float* w, const float* bias, float* y,
                  int num_threads) {
    if (M <= MAX_FUSED_M) {
        const int64_t chunk = 16, chunks = (N + chunk - 1) / chunk;
        plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
            const int64_t b = c * chunk, e = std::min(N, b + chunk);
            switch (M) {
                case 1: dense_rows<1>(x, K, b, e, N, w, bias, y); break;
                case 2: dense_rows<2>(x, K, b, e, N, w, bias, y); break;
                case 3: dense_rows<3>(x, K, b, e, N, w, bias, y); break;
                default: dense_rows<4>(x, K, b, e, N, w, bias, y); break;
            }
        });
        return;
    }
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
    plait::parallel_for(tiles, num_threads, false, [&](int64_t t) {
        const int64_t n0 = t * TILE_N, nt = std::min(TILE_N, N - n0);
        tile_matmul(x, M, K, w + n0 * K, nt, y + n0, N, n0 + 2 * TILE_N <= N ? w + (n0 + TILE_N) * K : nullptr);
        if (bias != nullptr)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t i = 0; i < nt; ++i) y[m * N + n0 + i] += bias[n0 + i];
    });
}

// The same product with each row of x summed in the same order whatever M: rows in fours, two
// accumulators each (one row alone takes four in dense_matmul), no tiles.
void dense_matmul_rows(const float* x, int64_t M, int64_t K, int64_t N, const float* w, const float* bias, float* y,
                       int num_threads) {
    const int64_t chunk = 16, chunks = (N + chunk - 1) / chunk;
    plait::parallel_for(chunks, num_threads, false, [&](int64_t c) {
        const int64_t b = c * chunk, e = std::min(N, b + chunk);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const float* xm = x + m0 * K;
            float* ym = y + m0 * N;
            switch (std::min<int64_t>(4, M - m0)) {
                case 1: dense_rows<1, 2>(xm, K, b, e, N, w, bias, ym); break;
                case 2: dense_rows<2, 2>(xm, K, b, e, N, w, bias, ym); break;
                case 3: dense_rows<3, 2>(xm, K, b, e, N, w, bias, ym); break;
                default: dense_rows<4, 2>(xm, K, b, e, N, w, bias, ym); break;
            }
        }
    });
}

}  // namespace plait::qmm
