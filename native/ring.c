/* ring.c - the control path of ring.h: create, attach, roles, stats, waiting. */
#define _GNU_SOURCE
#include "ring.h"
#include "clock.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define DP_RING_MAX_BYTES (1ull << 34)   /* 16 GiB: a sanity bound, not a design limit */
#define SPIN_ITERS 2000                  /* ~1-2 us of polling before yielding */
#define YIELD_ITERS 200

static int shm_path(const char *name, char *out, size_t n)
{
    if (!name || !*name || strchr(name, '/') || strlen(name) > 200)
        return -EINVAL;
    snprintf(out, n, "/dp-%s", name);
    return 0;
}

static int pid_alive(int32_t pid)
{
    return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

/* Take a role: free, or held by a dead process (taken over): 0; this process's already, through
 * another handle: MINE (nothing to take over, and that handle's to release); else -EBUSY. */
#define MINE 1
static int claim(int32_t *slot)
{
    int32_t me = getpid();
    for (;;) {
        int32_t cur = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        if (cur == me)
            return MINE;
        if (pid_alive(cur))
            return -EBUSY;
        if (__atomic_compare_exchange_n(slot, &cur, me, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 0;
    }
}

static struct dp_ring *map_ring(int fd, size_t size, int role, int *err)
{
    /* MAP_POPULATE: every page faulted in now, not by the data path. Without it the
     * first lap around a fresh ring took a page fault every few slots (35-58 us each
     * in these VMs, measured in the consumer's copy into the router's input ring:
     * 15-20% of chunks at 10 requests/s, which never complete a lap in a run). */
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
        *err = -errno;
        return NULL;
    }
    struct dp_ring *r = calloc(1, sizeof(*r));
    if (!r) {
        munmap(p, size);
        *err = -ENOMEM;
        return NULL;
    }
    r->h = p;
    r->map_len = size;
    r->slots = (uint8_t *)p + r->h->data_offset;
    r->role = role;
    r->fd = fd;
    return r;
}

/* A producer that died inside a commit (ring.h: its slots published last to first, then tail):
 * published whole, its records may already be read and released, so the commit stands and tail
 * moves past it (left behind, tail would fall below head, and the successor would rewrite slots
 * already read and count free room past the capacity); published in part (its later slots, not
 * the first), those slots would be read as published once the successor published tail's: they
 * are cleared. The run of published slots at tail is whole commits only, since a commit's first
 * slot is its last published. */
static void settle_dead_commit(struct dp_ring *r)
{
    struct dp_ring_hdr *h = r->h;
    uint64_t start = h->tail, tail = start;
    while (tail - start < h->capacity && __atomic_load_n(dp_ring_seq(r, tail), __ATOMIC_ACQUIRE) == tail + 1)
        tail++;
    __atomic_store_n(&h->tail, tail, __ATOMIC_RELEASE);
    for (uint64_t i = 0; i < h->capacity; i++)
        if (__atomic_load_n(dp_ring_seq(r, tail + i), __ATOMIC_RELAXED) == tail + i + 1)
            __atomic_store_n(dp_ring_seq(r, tail + i), 0, __ATOMIC_RELAXED);
}

/* A role taken (0: r's to release at close), already this process's (MINE: acted under, neither
 * settled, since the take-over steps would run under the live handle's feet, nor released), or
 * an error. getpid each call, not a cached bit, so a forked child is not its parent. */
static int take_role(struct dp_ring *r, int role)
{
    int rc;
    if (role == DP_ROLE_PRODUCER) {
        if ((rc = claim(&r->h->producer_pid)) == 0)
            settle_dead_commit(r);
    } else if (role == DP_ROLE_CONSUMER) {
        /* a new consumer starts from the released head, whatever the dead one cached, and awake:
         * a dead sleeper's flag made every later commit a futex wake */
        if ((rc = claim(&r->h->consumer_pid)) == 0) {
            r->h->tail_cache = r->h->head;
            __atomic_store_n(&r->h->sleeping, 0, __ATOMIC_RELAXED);
        }
    } else
        return role == DP_ROLE_OBSERVER ? 0 : -EINVAL;
    if (rc == 0)
        r->acts |= 1u << role;
    return rc < 0 ? rc : 0;
}

int dp_ring_claim(struct dp_ring *r, int role)
{
    int rc = take_role(r, role);
    if (rc == 0)
        r->role = role;
    return rc;
}

int dp_ring_act(struct dp_ring *r, int role)
{
    if (role != DP_ROLE_PRODUCER && role != DP_ROLE_CONSUMER)
        return -EINVAL;
    return take_role(r, role);
}

struct dp_ring *dp_ring_create(const char *name, uint32_t slot_size, uint32_t capacity, int wait_mode, int *err)
{
    char path[256];
    int rc = shm_path(name, path, sizeof(path));
    if (rc) {
        *err = rc;
        return NULL;
    }
    uint64_t stride = (DP_RING_SEQ_BYTES + (uint64_t)slot_size + DP_CACHELINE - 1) & ~(uint64_t)(DP_CACHELINE - 1);
    if (slot_size == 0 || slot_size % 8 || capacity < 2 || (capacity & (capacity - 1)) ||
        wait_mode < DP_WAIT_SPIN || wait_mode > DP_WAIT_SLEEP || stride > UINT32_MAX || stride * capacity > DP_RING_MAX_BYTES) {
        *err = -EINVAL;
        return NULL;
    }
    uint64_t data_off = (sizeof(struct dp_ring_hdr) + 4095) & ~4095ull;
    uint64_t size = data_off + stride * capacity;
    int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        *err = -errno;
        return NULL;
    }
    /* posix_fallocate, not ftruncate alone: tmpfs reserves no pages for a truncated file, and
     * MAP_POPULATE ignores the ones it cannot fill, so a full /dev/shm let create succeed and the
     * data path die of SIGBUS at its first touch of such a page; this way it is ENOSPC here */
    rc = posix_fallocate(fd, 0, (off_t)size);
    if (rc) {
        *err = -rc;
        close(fd);
        shm_unlink(path);
        return NULL;
    }
    struct dp_ring *r = map_ring(fd, size, DP_ROLE_OBSERVER, err);
    if (!r) {
        close(fd);
        shm_unlink(path);
        return NULL;
    }
    struct dp_ring_hdr *h = r->h;   /* fresh pages are zero: indices, counters, pids */
    h->version = DP_RING_VERSION;
    h->slot_size = slot_size;
    h->capacity = capacity;
    h->mask = capacity - 1;
    h->wait_mode = (uint32_t)wait_mode;
    h->stride = (uint32_t)stride;
    h->data_offset = data_off;
    h->map_size = size;
    r->slots = (uint8_t *)h + data_off;
    __atomic_store_n(&h->magic, DP_RING_MAGIC, __ATOMIC_RELEASE);  /* attachers check it last */
    return r;
}

/* The geometry create wrote, checked before any slot is touched: the mapping's bounds and the
 * sequence words' alignment rest on it (no sum here can wrap: each term is checked first). A
 * header without its magic yet (create writes it last) is -EAGAIN: being made, or its maker died. */
static int check_header(int fd, uint64_t size)
{
    const struct dp_ring_hdr *h = mmap(NULL, sizeof(*h), PROT_READ, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED)
        return -errno;
    uint64_t magic = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE);
    int ok = magic == DP_RING_MAGIC && h->version == DP_RING_VERSION && h->map_size == size &&
             h->capacity >= 2 && !(h->capacity & (h->capacity - 1)) && h->mask == h->capacity - 1 &&
             h->slot_size && !(h->slot_size % 8) && !(h->stride % DP_CACHELINE) &&
             h->stride >= DP_RING_SEQ_BYTES + (uint64_t)h->slot_size && h->data_offset >= sizeof(*h) &&
             !(h->data_offset % DP_CACHELINE) && h->data_offset <= h->map_size &&
             (uint64_t)h->stride * h->capacity <= h->map_size - h->data_offset;
    munmap((void *)h, sizeof(*h));
    return ok ? 0 : magic ? -EPROTO : -EAGAIN;
}

struct dp_ring *dp_ring_attach(const char *name, int role, int *err)
{
    char path[256];
    struct stat st;
    int rc = shm_path(name, path, sizeof(path));
    if (rc) {
        *err = rc;
        return NULL;
    }
    int fd = shm_open(path, O_RDWR, 0);
    if (fd < 0) {
        *err = -errno;
        return NULL;
    }
    if (fstat(fd, &st) < 0) {
        *err = -errno;
        close(fd);
        return NULL;
    }
    /* the header alone first, unpopulated: a segment that is no ring is refused before the whole
     * of it is faulted in (MAP_POPULATE allocated every page of a sparse one in /dev/shm) */
    rc = st.st_size < (off_t)sizeof(struct dp_ring_hdr) ? -EAGAIN : check_header(fd, (uint64_t)st.st_size);
    if (rc) {
        *err = rc;
        close(fd);
        return NULL;
    }
    struct dp_ring *r = map_ring(fd, (size_t)st.st_size, role, err);
    if (!r) {
        close(fd);
        return NULL;
    }
    rc = take_role(r, role);
    if (rc) {
        *err = rc;
        dp_ring_close(r);
        return NULL;
    }
    return r;
}

void dp_ring_close(struct dp_ring *r)
{
    if (!r)
        return;
    int32_t me = getpid(), also = me;
    if (r->acts & (1u << DP_ROLE_PRODUCER))
        __atomic_compare_exchange_n(&r->h->producer_pid, &me, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    if (r->acts & (1u << DP_ROLE_CONSUMER))
        __atomic_compare_exchange_n(&r->h->consumer_pid, &also, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    munmap(r->h, r->map_len);
    close(r->fd);
    free(r);
}

int dp_ring_unlink(const char *name)
{
    char path[256];
    int rc = shm_path(name, path, sizeof(path));
    if (rc)
        return rc;
    return shm_unlink(path) < 0 ? -errno : 0;
}

struct dp_ring *dp_ring_create_private(uint32_t slot_size, uint32_t capacity, int wait_mode, int role, int *err)
{
    static uint32_t seq;
    char name[64];
    snprintf(name, sizeof(name), "private.%d.%u", (int)getpid(), __atomic_fetch_add(&seq, 1, __ATOMIC_RELAXED));
    struct dp_ring *r = dp_ring_create(name, slot_size, capacity, wait_mode, err);
    if (!r)
        return NULL;
    dp_ring_unlink(name);                /* the mapping is all it needs */
    int other = role == DP_ROLE_PRODUCER ? DP_ROLE_CONSUMER : DP_ROLE_PRODUCER;
    if ((*err = dp_ring_claim(r, other)) || (*err = dp_ring_claim(r, role))) {
        dp_ring_close(r);
        return NULL;
    }
    return r;
}

void dp_ring_get_stats(const struct dp_ring *r, struct dp_ring_stats *s)
{
    const struct dp_ring_hdr *h = r->h;
    s->capacity = h->capacity;
    s->slot_size = h->slot_size;
    /* head first: read after tail, a consumer could have passed that tail; and the consumer reads
     * a commit's slots before the producer moves tail past them, so head can lead tail a moment */
    s->dequeued = __atomic_load_n(&h->head, __ATOMIC_ACQUIRE);
    s->enqueued = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
    if (s->enqueued < s->dequeued)
        s->enqueued = s->dequeued;
    s->depth = s->enqueued - s->dequeued;
    s->full_events = h->full_events;
    s->refused = h->refused;
    s->sleeps = h->sleeps;
    s->sleep_timeouts = h->sleep_timeouts;
    s->producer_pid = h->producer_pid;
    s->consumer_pid = h->consumer_pid;
}

/* The role's check, then the burst; an if, not a ?: (in one with the uint32_t count, -EBUSY came
 * back as 2^32 - 16). */
int64_t dp_ring_enqueue_copy(struct dp_ring *r, const void *recs, uint32_t n, uint32_t rec_len, uint32_t stride)
{
    int rc = dp_ring_act(r, DP_ROLE_PRODUCER);
    if (rc)
        return rc;
    return dp_ring_enqueue_burst(r, recs, n, rec_len, stride);
}

int64_t dp_ring_dequeue_copy(struct dp_ring *r, void *out, uint32_t max)
{
    int rc = dp_ring_act(r, DP_ROLE_CONSUMER);
    if (rc)
        return rc;
    return dp_ring_dequeue_burst(r, out, max);
}

void dp_ring_wake_consumer(struct dp_ring *r)
{
    __atomic_fetch_add(&r->h->futex, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, &r->h->futex, FUTEX_WAKE, 1, NULL, NULL, 0);
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

uint32_t dp_ring_wait(struct dp_ring *r, int64_t timeout_ns)
{
    struct dp_ring_hdr *h = r->h;
    uint64_t deadline = timeout_ns < 0 ? UINT64_MAX : now_ns() + (uint64_t)timeout_ns;
    uint32_t n;
    for (unsigned i = 0;; i++) {
        if ((n = dp_ring_cons_peek(r, UINT32_MAX)))
            return n;
        if (timeout_ns == 0 || ((i & 63) == 0 && now_ns() >= deadline))
            return 0;
        if (i < SPIN_ITERS || h->wait_mode == DP_WAIT_SPIN) {
            cpu_relax();
        } else if (i < SPIN_ITERS + YIELD_ITERS || h->wait_mode == DP_WAIT_YIELD) {
            sched_yield();
        } else {
            /* Read the futex word before announcing the sleep: a producer that
             * commits after our last look at tail bumps it, so the wait returns. */
            uint32_t seen = __atomic_load_n(&h->futex, __ATOMIC_ACQUIRE);
            __atomic_store_n(&h->sleeping, 1, __ATOMIC_RELAXED);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            uint64_t t = now_ns();
            if (!(n = dp_ring_cons_peek(r, UINT32_MAX)) && t < deadline) {
                uint64_t left = deadline - t;
                if (left > 100000000ull)
                    left = 100000000ull;   /* re-check the deadline at least every 100 ms */
                struct timespec ts = { .tv_sec = (time_t)(left / 1000000000ull), .tv_nsec = (long)(left % 1000000000ull) };
                h->sleeps++;
                if (syscall(SYS_futex, &h->futex, FUTEX_WAIT, seen, &ts, NULL, 0) < 0 && errno == ETIMEDOUT)
                    h->sleep_timeouts++;
            }
            __atomic_store_n(&h->sleeping, 0, __ATOMIC_RELAXED);
            if (n)
                return n;
        }
    }
}
