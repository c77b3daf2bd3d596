/* loop.c - see loop.h. */
#define _GNU_SOURCE
#include "loop.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>

typedef uint32_t (*poll_fn)(void *);

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
    for (int pass = 0; pass < 2; pass++)   /* what arrived before stop; a second pass for what a */
        for (uint32_t i = 0; i < l->n; i++)   /* stage counts at its next call (the consumer's stats) */
            ((poll_fn)l->fn[i])((void *)l->arg[i]);
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
    pthread_t t;
    int rc = pthread_create(&t, NULL, loop_main, l);
    if (rc)
        return -rc;
    l->thread = (unsigned long)t;
    if (l->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(l->cpu, &set);
        pthread_setaffinity_np(t, sizeof(set), &set);
    }
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
