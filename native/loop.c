/* loop.c - see loop.h. */
#define _GNU_SOURCE
#include "loop.h"
#include "clock.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>

typedef uint32_t (*poll_fn)(void *);

#define DRAIN_NS 100000000ull            /* 100 ms: the drain after stop */

static void *loop_main(void *arg)
{
    struct dp_loop *l = arg;
    uint32_t idle = 0;
    while (!__atomic_load_n(&l->stop, __ATOMIC_ACQUIRE)) {
        uint32_t work = 0;
        for (uint32_t i = 0; i < l->n; i++)
            work += ((poll_fn)l->fn[i])((void *)l->arg[i]);
        l->passes++;
        if (work) {
            l->busy_passes++;
            idle = 0;
        } else if (++idle >= l->yield_after) {
            idle = 0;
            l->yields++;
            sched_yield();
        }
    }
    /* What arrived before stop, drained until two passes in a row find nothing (the second for
     * what a stage counts at its next call: the consumer's stats), within DRAIN_NS: two passes
     * alone sent at most 64 answers of a full egress ring, and the rest were never counted. What
     * a blocked socket or a stream still flowing leaves stays in its ring, in its counters. */
    uint64_t until = now_ns() + DRAIN_NS;
    for (uint32_t quiet = 0; quiet < 2 && now_ns() < until; ) {
        uint32_t work = 0;
        for (uint32_t i = 0; i < l->n; i++)
            work += ((poll_fn)l->fn[i])((void *)l->arg[i]);
        quiet = work ? 0 : quiet + 1;
    }
    return NULL;
}

int dp_loop_start(struct dp_loop *l)
{
    _Static_assert(sizeof(pthread_t) == sizeof(unsigned long), "pthread_t fits the thread field");
    if (l->running)
        return -EBUSY;
    if (l->n == 0 || l->n > DP_LOOP_MAX_STAGES)
        return -EINVAL;
    if (!l->yield_after)
        l->yield_after = 256;
    l->stop = 0;
    /* pinned from its first instruction, and a CPU it cannot run on is an error: set after the
     * start and unchecked, a bad cpu left the loop on a worker's core, said nowhere */
    pthread_attr_t attr;
    int rc = pthread_attr_init(&attr);
    if (rc)
        return -rc;
    if (l->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        if (l->cpu >= CPU_SETSIZE) {
            pthread_attr_destroy(&attr);
            return -EINVAL;
        }
        CPU_SET(l->cpu, &set);
        rc = pthread_attr_setaffinity_np(&attr, sizeof(set), &set);
    }
    pthread_t t;
    if (!rc)
        rc = pthread_create(&t, &attr, loop_main, l);
    pthread_attr_destroy(&attr);
    if (rc)
        return -rc;
    l->thread = (unsigned long)t;
    l->running = 1;
    return 0;
}

void dp_loop_stop(struct dp_loop *l)
{
    if (!l->running)
        return;
    __atomic_store_n(&l->stop, 1, __ATOMIC_RELEASE);
    pthread_join((pthread_t)l->thread, NULL);
    l->running = 0;
}
