// parallel_for over OpenMP. torch is loaded first, so `libgomp.so.1` resolves to the runtime torch
// already uses: the kernels and torch's own ops share one team per thread and never oversubscribe
// the cores (a separate spinning pool would compete with torch's for them). See
// `runtime/engine.py:off_main_thread` for the one libgomp pitfall that remains.
#pragma once
#include <cstdint>
#include <omp.h>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace plait {

// Flush-to-zero and denormals-are-zero for the current thread while in scope.
struct FlushDenormals {
#if defined(__SSE__) || defined(__x86_64__)
    unsigned int saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }
    ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// The processors OpenMP may use (fixed for the process, unlike the per-call thread count).
// NOTE: cached: libgomp asks the kernel for the affinity mask on every call (a syscall that was
// a tenth of a small model's decode step).
inline int num_procs() {
    static const int n = omp_get_num_procs();
    return n;
}

// f(i) for every i in [0, n): `dynamic` for tasks of uneven cost (attention rows).
template <class F>
void parallel_for(int64_t n, int num_threads, bool dynamic, F&& f) {
    if (num_threads <= 1 || n <= 1) {
        for (int64_t i = 0; i < n; ++i) f(i);
        return;
    }
    if (dynamic) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) f(i);
    } else {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t i = 0; i < n; ++i) f(i);
    }
}

}  // namespace plait
