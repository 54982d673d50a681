// The calling thread's OpenMP team. libgomp keeps a team of worker threads for every thread that
// has opened a parallel region, for as long as that thread lives, and once the threads it
// manages outnumber the CPUs it throttles every team's spin-wait to ~100 iterations: each parallel
// region then wakes its workers through a futex (an inter-processor interrupt each), and a decode
// step opens hundreds. A team left behind on the thread that submits requests (a user's own
// parallel torch op before creating the engine, say) thus slowed a 2-thread decode step on 2
// cores to below a 1-thread one. Releasing that thread's team (its workers exit) lifts it.
#include <omp.h>

#include "plait_kernels.h"

// Frees the calling thread's OpenMP team, if it has one and is not inside a parallel region;
// 0 on success (nothing to free included).
extern "C" int plait_release_thread_team() {
    if (omp_in_parallel()) return -1;
    return omp_pause_resource(omp_pause_soft, omp_get_initial_device());
}
