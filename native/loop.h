/* loop.h - one native thread polling several stages in turn.
 *
 * On a machine with few cores, a busy-polling thread per stage (ingress
 * consumer, router, responder) would take every core from the workers. The
 * loop runs the stages' single-pass poll functions one after the other in one
 * thread (each returns the work it did), so the whole data path costs one
 * core; when nothing moved for a while it yields, so a worker sharing the
 * core still runs. Stages from other extensions hand in their poll function
 * as an address (cffi: ffi.cast("uintptr_t", ffi.addressof(lib, name))).
 */
#ifndef DP_LOOP_H
#define DP_LOOP_H

#include <stdint.h>

/* CDEF BEGIN */
#define DP_LOOP_MAX_STAGES 8

struct dp_loop {
    uintptr_t fn[DP_LOOP_MAX_STAGES];     /* uint32_t (*)(void *): one pass, returns work done */
    uintptr_t arg[DP_LOOP_MAX_STAGES];
    uint32_t n;
    int cpu;                               /* pinned there, or -1 */
    uint32_t yield_after;                  /* idle passes before each sched_yield (default 256) */
    unsigned long thread;                  /* pthread_t */
    int stop, running;
    uint64_t passes, busy_passes, yields;
};

int dp_loop_start(struct dp_loop *l);
void dp_loop_stop(struct dp_loop *l);
/* CDEF END */

#endif /* DP_LOOP_H */
