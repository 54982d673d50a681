// The machine's roofs the benchmarks measure against (kernels/roofs.py). A plain streaming read of
// given buffers: the fastest a decode step could read its weights where they lie in memory;
// benchmarks divide the bytes one step reads by this time for their roofline. A fixed 1 GiB probe
// is not enough on a virtual machine: the same sum reads at very different rates depending on
// which allocation it was given. And the int8 dot products' peak: the rate of the instruction the
// quantized kernels multiply with, from registers, on every thread.
#include <cstdint>

#include "parallel.h"
#include "plait_kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

// Reads every byte of buffers [0, n), in one parallel region: each thread reads its contiguous
// block of every buffer in turn, as the decode kernels split each matrix's rows. Returns a
// checksum so that the reads cannot be elided.
extern "C" uint64_t plait_read_buffers(const void* const* ptrs, const int64_t* bytes, int64_t n, int num_threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total) if (num_threads > 1)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int64_t b = 0; b < n; ++b) {
            const char* base = static_cast<const char*>(ptrs[b]);
            const int64_t words = bytes[b] / 32, lo = words * t / T, hi = words * (t + 1) / T;
#ifdef __AVX2__
            __m256i a = _mm256_setzero_si256(), c = a;
            int64_t i = lo;
            for (; i + 2 <= hi; i += 2) {
                a = _mm256_add_epi64(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32 * i)));
                c = _mm256_add_epi64(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32 * i + 32)));
            }
            if (i < hi) a = _mm256_add_epi64(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32 * i)));
            a = _mm256_add_epi64(a, c);
            total += static_cast<uint64_t>(_mm256_extract_epi64(a, 0) + _mm256_extract_epi64(a, 1) +
                                           _mm256_extract_epi64(a, 2) + _mm256_extract_epi64(a, 3));
#else
            const uint64_t* w = reinterpret_cast<const uint64_t*>(base);
            for (int64_t i = lo * 4; i < hi * 4; ++i) total += w[i];
#endif
            if (t == T - 1)
                for (int64_t i = words * 32; i < bytes[b]; ++i) total += static_cast<unsigned char>(base[i]);
        }
    }
    return total;
}

// `iters` rounds of twelve independent int8 dot products per thread, from registers: `vpdpbusd`
// (64 multiply-adds each) with AVX-512 VNNI, `maddubs` + `madd` + `add` (32) with AVX2, a scalar
// multiply-add elsewhere. Returns the multiply-adds run (their sum is kept so that none is elided;
// `checksum` receives it).
extern "C" int64_t plait_int8_dot_peak(int64_t iters, int num_threads, int64_t* checksum) {
    constexpr int CHAINS = 12;
    int64_t total = 0, sum = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total, sum) if (num_threads > 1)
    {
        const int seed = omp_get_thread_num() + 1;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        const __m512i a = _mm512_set1_epi8(static_cast<char>(seed)), b = _mm512_set1_epi8(3);
        __m512i acc[CHAINS];
        for (auto& c : acc) c = _mm512_setzero_si512();
        for (int64_t i = 0; i < iters; ++i)
            for (auto& c : acc) c = _mm512_dpbusd_epi32(c, a, b);
        for (auto& c : acc) sum += _mm512_reduce_add_epi32(c);
        total += iters * CHAINS * 64;
#elif defined(__AVX2__)
        const __m256i a = _mm256_set1_epi8(static_cast<char>(seed)), b = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
        __m256i acc[CHAINS];
        for (auto& c : acc) c = a;
        for (int64_t i = 0; i < iters; ++i)
            // each product takes its chain's own bytes, so that none is computed once and hoisted
            for (auto& c : acc) c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(c, b), ones));
        for (auto& c : acc) sum += _mm256_extract_epi32(c, 0);
        total += iters * CHAINS * 32;
#else
        int32_t acc[CHAINS] = {};
        for (int64_t i = 0; i < iters; ++i)
            for (int c = 0; c < CHAINS; ++c) acc[c] += static_cast<int32_t>(seed + c) * 3;
        for (int c = 0; c < CHAINS; ++c) sum += acc[c];
        total += iters * CHAINS;
#endif
    }
    *checksum = sum;
    return total;
}
