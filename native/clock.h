/* clock.h - the data path's one clock: CLOCK_MONOTONIC in ns, the stamps' and the deadlines'. */
#ifndef DP_CLOCK_H
#define DP_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif /* DP_CLOCK_H */
