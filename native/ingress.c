/* ingress.c - ring-buffer and UDP-socket consumers, their output and latency records. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <linux/bpf.h>
#include <bpf/bpf.h>

#include "chunk.h"
#include "clock.h"
#include "steer.h"
#include "ingress.h"

#define RX_BATCH 32

_Static_assert(DP_DROP_MAX == sizeof(((struct dp_udp_rx *)0)->drops) / 8, "drops[] has a slot per reason");
_Static_assert(DP_MAX_QUEUES == sizeof(((struct dp_consumer *)0)->per_queue) / 8, "per_queue[] has a slot per queue");
_Static_assert(DP_MAX_QUEUES == sizeof(((struct dp_consumer *)0)->rings) / sizeof(struct dp_bpf_ring),
               "rings[] has a slot per queue");

uint64_t dp_now_ns(void)
{
    return now_ns();   /* CLOCK_MONOTONIC: the clock bpf_ktime_get_ns() reads */
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Pin the calling thread and, if asked, make it SCHED_FIFO: a busy-poller
 * sharing a core with other work under the normal scheduler waits whole time
 * slices (milliseconds) for the core. The kernel's RT throttling
 * (sched_rt_runtime_us) still leaves the other tasks their share. */
static void pin(int cpu, int rt_priority)
{
    if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    if (rt_priority > 0) {
        struct sched_param sp = { .sched_priority = rt_priority };
        pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp);
    }
}

/* --- latency records ----------------------------------------------------------- */

int dp_lat_init(struct dp_lat *l, uint64_t cap)
{
    memset(l, 0, sizeof(*l));
    if (cap && !(l->samples = malloc(cap * sizeof(uint64_t))))
        return -ENOMEM;
    if (cap)   /* written now, so the data path never takes a fault on a fresh page (tens of us here) */
        memset(l->samples, 0, cap * sizeof(uint64_t));
    l->cap = cap;
    return 0;
}

void dp_lat_reset(struct dp_lat *l)
{
    memset(l->hist, 0, sizeof(l->hist));
    l->count = l->n = 0;
}

void dp_lat_free(struct dp_lat *l)
{
    free(l->samples);
    l->samples = NULL;
    l->cap = l->n = 0;
}

static inline int lat_bucket(uint64_t v)
{
    return v ? 64 - __builtin_clzll(v) : 0;   /* bucket b holds 2^(b-1) .. 2^b - 1 */
}

void dp_lat_add(struct dp_lat *l, uint64_t v)
{
    l->hist[lat_bucket(v)]++;
    l->count++;
    if (l->n < l->cap)
        l->samples[l->n++] = v;
}

/* --- downstream: the router's input ring ----------------------------------------- */

static void out_flush(struct dp_out *o)
{
    if (o->pending)
        dp_ring_prod_commit(o->ring, o->pending);
    o->reserved = o->pending = 0;
}

/* A record found the output ring full: counted once (in `full` and the ring's refusals), however
 * many passes it then waits (a ring-buffer consumer's: it counted each retry, millions a second,
 * as a refused record; a review). */
static void out_full(struct dp_out *o)
{
    if (o->stalled)
        return;
    dp_ring_note_full(o->ring, 1, 0);
    o->full++;
    o->stalled = 1;
}

/* The one place records leave a consumer. Copies the header and the tokens the
 * record carries into a reserved slot (never the unused tail) and stamps
 * t_consumer in the copy (libbpf maps ring-buffer data read-only). 0: the ring
 * was full (out_full): the UDP receiver drops the record, a ring-buffer
 * consumer leaves it where it is for its next pass. */
static int out_put(struct dp_out *o, const struct dp_chunk *c, uint64_t now)
{
    struct dp_chunk *slot;
    if (o->pending == o->reserved) {
        out_flush(o);
        o->reserved = dp_ring_prod_reserve(o->ring, DP_INGRESS_BURST);
        if (!o->reserved) {
            out_full(o);
            return 0;
        }
    }
    o->stalled = 0;
    slot = dp_ring_prod_slot(o->ring, o->pending++);
    memcpy(slot, c, DP_CHUNK_HDR_LEN + (size_t)c->n_tokens * sizeof(uint32_t));
    slot->t_consumer = now;
    if (o->pending == o->reserved)
        out_flush(o);
    return 1;
}

static int out_init(struct dp_out *o, struct dp_ring *ring)
{
    memset(o, 0, sizeof(*o));
    if (!ring || ring->h->slot_size < sizeof(struct dp_chunk) || ring->role != DP_ROLE_PRODUCER)
        return -EINVAL;
    o->ring = ring;
    return 0;
}

/* --- BPF ring-buffer consumer ---------------------------------------------------- */

/* The latency records of the records taken so far. Counted at the consumer's next poll, after the
 * router's pass has placed them, not between the consumer's stamp and the router's (~20-30 ns of
 * histogram and sample writes per record, measured off the chunk's way to its lane). */
static void lat_flush(struct dp_consumer *c)
{
    for (uint32_t i = 0; i < c->n_pend; i++) {
        dp_lat_add(&c->xdp_lat, c->pend[i][0]);
        if (c->map_hist)
            c->map_hist[lat_bucket(c->pend[i][0])]++;
        if (c->pend[i][1] != UINT64_MAX)
            dp_lat_add(&c->send_lat, c->pend[i][1]);
    }
    c->n_pend = 0;
}

/* A record, stamped: to the router (a feed's take), else into the output ring. 0: not taken (the
 * router or its input ring had no room): it stays in its ring buffer for the next pass, and when
 * that one fills, XDP counts what it refuses (drop_ring_full). Taken out of the ring buffer and
 * dropped for want of room downstream (as the threaded consumer did), 1,928 of 2,000 records left
 * one review's test with rings that had room, counted only in this process. */
static int on_record(struct dp_consumer *c, const void *data, size_t size)
{
    const struct dp_chunk *rec = data;   /* XDP wrote the header and n_tokens tokens (steer.h) */
    uint64_t now = dp_now_ns();

    /* not one of steer.bpf.c's (out_put copies n_tokens into a chunk's slot): skipped, counted */
    if (size < DP_CHUNK_HDR_LEN || rec->n_tokens > DP_MAX_CHUNK_TOKENS ||
        size < DP_CHUNK_HDR_LEN + (size_t)rec->n_tokens * sizeof(uint32_t)) {
        c->malformed++;
        return 1;
    }
    if (c->take) {
        if (!c->take(c->take_arg, rec, now))
            return 0;
    } else if (!c->out.ring || !out_put(&c->out, rec, now))
        return 0;
    if (c->n_pend == DP_INGRESS_BURST)   /* a long pass: count the earlier ones now */
        lat_flush(c);
    c->pend[c->n_pend][0] = now - rec->t_xdp;
    c->pend[c->n_pend++][1] = rec->t_send ? now - rec->t_send : UINT64_MAX;
    c->records++;
    c->per_queue[rec->queue & 7]++;
    memcpy(&c->rehearsal, rec, DP_CHUNK_HDR_LEN);   /* one record's header: two lines */
    return 1;
}

/* --- the BPF ring buffers, read as libbpf's ring_buffer__consume does ---------------- */

#define RB_LEN(hdr) ((hdr) & ~(uint32_t)(BPF_RINGBUF_BUSY_BIT | BPF_RINGBUF_DISCARD_BIT))

/* The records committed so far, in order, up to `budget` of them; a record still being written
 * (busy) ends the pass, as does one not taken. 1: the ring's pass stopped for want of room. */
static int bpf_ring_consume(struct dp_consumer *c, struct dp_bpf_ring *r, uint32_t budget)
{
    unsigned long cons = *r->consumer_pos;   /* ours alone to write (dp_consumer_new: one per ring) */
    unsigned long prod = __atomic_load_n(r->producer_pos, __ATOMIC_ACQUIRE);
    uint32_t n = 0;
    while (cons < prod && n < budget) {
        const uint32_t *hdr = (const uint32_t *)(r->data + (cons & r->mask));
        /* the record's lines (XDP wrote them on another core) fetched together, not one by one as
         * the copy reaches them: header, then up to a 64-token chunk (the typical prompt) */
        for (size_t off = 0; off < BPF_RINGBUF_HDR_SZ + DP_CHUNK_HDR_LEN + 64 * sizeof(uint32_t); off += 64)
            __builtin_prefetch((const uint8_t *)hdr + off);
        uint32_t len = __atomic_load_n(hdr, __ATOMIC_ACQUIRE);
        if (len & BPF_RINGBUF_BUSY_BIT)
            break;
        if (!(len & BPF_RINGBUF_DISCARD_BIT)) {
            if (!on_record(c, (const uint8_t *)hdr + BPF_RINGBUF_HDR_SZ, RB_LEN(len)))
                return 1;                /* not taken: read again next pass */
            n++;
        }
        cons += (RB_LEN(len) + BPF_RINGBUF_HDR_SZ + 7) & ~7ul;
        __atomic_store_n(r->consumer_pos, cons, __ATOMIC_RELEASE);   /* the space is the kernel's again */
    }
    return 0;
}

/* The consumers holding ring buffers in this process: a ring buffer has one reader, as it has one
 * consumer position. Two consumers of one program (a router's feed beside a thread, two routers
 * fed from one ingress) both read each record and raced the position: a review's probe delivered
 * 44,110 records of 40,000. */
static pthread_mutex_t holders_lock = PTHREAD_MUTEX_INITIALIZER;
static struct dp_consumer *holders;

static int held(uint32_t map_id)
{
    for (struct dp_consumer *h = holders; h; h = h->next_holder)
        for (uint32_t i = 0; i < h->n_rings; i++)
            if (h->rings[i].map_id == map_id)
                return 1;
    return 0;
}

static void unhold(struct dp_consumer *c)
{
    pthread_mutex_lock(&holders_lock);
    for (struct dp_consumer **p = &holders; *p; p = &(*p)->next_holder)
        if (*p == c) {
            *p = c->next_holder;
            break;
        }
    pthread_mutex_unlock(&holders_lock);
}

static int bpf_ring_map(struct dp_bpf_ring *r, int fd)
{
    struct bpf_map_info info;
    uint32_t len = sizeof(info);
    long page = sysconf(_SC_PAGESIZE);
    memset(&info, 0, sizeof(info));
    if (bpf_obj_get_info_by_fd(fd, &info, &len) || info.type != BPF_MAP_TYPE_RINGBUF ||
        !info.max_entries || (info.max_entries & (info.max_entries - 1)))
        return -EINVAL;
    void *cons = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (cons == MAP_FAILED)
        return -errno;
    r->map_len = page + 2 * (size_t)info.max_entries;
    void *prod = mmap(NULL, r->map_len, PROT_READ, MAP_SHARED, fd, page);
    if (prod == MAP_FAILED) {
        int err = -errno;
        munmap(cons, page);
        return err;
    }
    r->map_id = info.id;
    r->consumer_pos = cons;
    r->producer_pos = prod;
    r->data = (const uint8_t *)prod + page;
    r->mask = info.max_entries - 1;
    return 0;
}

static void bpf_ring_unmap(struct dp_bpf_ring *r)
{
    if (r->consumer_pos)
        munmap(r->consumer_pos, sysconf(_SC_PAGESIZE));
    if (r->producer_pos)
        munmap((void *)r->producer_pos, r->map_len);
    memset(r, 0, sizeof(*r));
}

/* What the router does for its path (router.c, rehearse), for this one: after a
 * few ms without traffic the first record's bookkeeping and copy ran cold (~1 us
 * here before the router saw it). So every REHEARSE_EVERY idle polls the consumer
 * reads, through its own mapping, where each ring buffer's next record will land
 * (the first read of a fresh place there cost a TLB walk: XDP->consumer p50
 * 0.35-0.41 -> 0.28-0.31 us), writes the last record's header and as many (zero)
 * tokens into the input ring's next free slot, not committed (the producer's own
 * until then), and
 * touches the latency records' next sample and buckets. Then, as the router's
 * shadow does for its path, the record goes through on_record itself, on a
 * shadow consumer whose output ring is private to this process (drained at
 * once) and whose latency records keep no samples: the code a record runs is
 * the code that ran. Nothing of the live consumer changes. Measured in the
 * pipeline at 10 req/s (4 runs of 60 chunks each way): XDP->consumer p50
 * 0.67-1.1 -> 0.36-0.40 us, consumer->router 0.37-0.45 -> 0.18-0.21 us. */
#define REHEARSE_EVERY 256

static void shadow_run(struct dp_consumer *c)
{
    struct dp_consumer *s = c->shadow;
    on_record(s, &c->rehearsal, sizeof(c->rehearsal));
    lat_flush(s);
    out_flush(&s->out);
    dp_ring_cons_release(s->out.ring, dp_ring_cons_peek(s->out.ring, UINT32_MAX));
}

static void rehearse(struct dp_consumer *c)
{
    static volatile uint64_t sink;
    struct dp_out *o = &c->out;
    const struct dp_chunk *t = &c->rehearsal;
    for (uint32_t i = 0; i < c->n_rings; i++) {   /* the next record's place (mapped twice: no wrap) */
        const struct dp_bpf_ring *r = &c->rings[i];
        const uint8_t *next = r->data + (*r->consumer_pos & r->mask);
        for (size_t off = 0; off < BPF_RINGBUF_HDR_SZ + sizeof(struct dp_chunk); off += 64)
            sink += next[off];
    }
    if (!t->n_tokens || t->n_tokens > DP_MAX_CHUNK_TOKENS)
        return;
    if (!c->take) {                      /* (a feed hands records on from where they are) */
        if (!o->ring || o->pending || dp_ring_prod_reserve(o->ring, 1) < 1)
            return;
        memcpy(dp_ring_prod_slot(o->ring, 0), t, DP_CHUNK_HDR_LEN + (size_t)t->n_tokens * sizeof(uint32_t));
    }
    c->rehearsals++;
    struct dp_lat *lats[2] = { &c->xdp_lat, &c->send_lat };
    for (int k = 0; k < 2; k++) {
        struct dp_lat *l = lats[k];
        if (l->n < l->cap)
            l->samples[l->n] = 0;        /* the next sample's place, written before it is counted */
        for (int b = 0; b < DP_LAT_BUCKETS; b += 8)
            sink += l->hist[b];
    }
    for (int b = 0; c->map_hist && b < DP_LAT_BUCKETS; b += 8)   /* every line: a bucket's first count */
        sink += c->map_hist[b];
    if (c->shadow)
        shadow_run(c);
}

uint32_t dp_consumer_feed(struct dp_consumer *c, int (*take)(void *, const struct dp_chunk *, uint64_t), void *arg)
{
    if (__atomic_load_n(&c->running, __ATOMIC_RELAXED))
        return 0;                        /* its thread owns the ring buffers */
    c->take = take;
    c->take_arg = arg;
    uint32_t n = dp_consumer_poll(c);
    c->take = NULL;
    return n;
}

uint32_t dp_consumer_poll(struct dp_consumer *c)
{
    uint32_t n = 0;
    if (__atomic_load_n(&c->running, __ATOMIC_RELAXED) && !pthread_equal(pthread_self(), c->thread))
        return 0;                        /* its thread owns the ring buffers and the output ring */
    if (c->n_pend)
        lat_flush(c);   /* the last pass's, its records placed by now */
    /* Each ring buffer up to a burst a pass, the first one in turn: drained in a fixed order to
     * its end, a burst on queue 0 held every other queue's records behind it (a review: one
     * written first came 5,000th, 0.56 ms late), and queue 3 got none of a full ring's room. */
    uint64_t before = c->records;
    for (uint32_t k = 0; k < c->n_rings; k++)
        if (bpf_ring_consume(c, &c->rings[(c->next_ring + k) % c->n_rings], DP_INGRESS_BURST))
            break;                       /* no room downstream: none for the other rings either */
    c->next_ring = c->next_ring + 1 < c->n_rings ? c->next_ring + 1 : 0;
    n = (uint32_t)(c->records - before);
    out_flush(&c->out);   /* publish what this pass found */
    c->polls++;
    if (n)
        c->idle_polls = 0;
    else if (++c->idle_polls % REHEARSE_EVERY == 0)
        rehearse(c);
    return n;
}

static void *consumer_main(void *arg)
{
    struct dp_consumer *c = arg;
    pin(c->cpu, c->rt_priority);
    while (!__atomic_load_n(&c->stop, __ATOMIC_RELAXED))
        if (!dp_consumer_poll(c))
            cpu_relax();
    /* what arrived before stop: a pass takes a burst a ring buffer, so passes until one takes
     * nothing (bounded: a sender still going, or no room downstream, ends it) */
    for (int i = 0; i < 4096 && dp_consumer_poll(c); i++)
        ;
    lat_flush(c);
    return NULL;
}

#define HIST_MAP_BYTES 4096   /* DP_LAT_BUCKETS u64s, a page: what mmap of the array gives */
_Static_assert(DP_LAT_BUCKETS * 8 <= HIST_MAP_BYTES, "lat_hist fits one page");

static void shadow_free(struct dp_consumer *s)
{
    if (!s)
        return;
    if (s->out.ring)
        dp_ring_close(s->out.ring);
    free(s);
}

/* The shadow: a consumer with no ring buffers, writing into a private ring. */
static struct dp_consumer *shadow_new(void)
{
    int err;
    struct dp_consumer *s = calloc(1, sizeof(*s));
    struct dp_ring *r = s ? dp_ring_create_private(sizeof(struct dp_chunk), 2 * DP_INGRESS_BURST, DP_WAIT_SPIN,
                                                   DP_ROLE_PRODUCER, &err) : NULL;
    if (!r || out_init(&s->out, r)) {
        if (r)
            dp_ring_close(r);
        free(s);
        return NULL;
    }
    s->cpu = -1;
    return s;
}

struct dp_consumer *dp_consumer_new(const int *ring_fds, int n, int hist_fd, struct dp_ring *out, uint64_t samples)
{
    struct dp_consumer *c = calloc(1, sizeof(*c));
    if (!c || n < 1 || (out && out_init(&c->out, out)))
        goto fail;
    if (hist_fd >= 0) {
        void *p = mmap(NULL, HIST_MAP_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, hist_fd, 0);
        if (p == MAP_FAILED)
            goto fail;
        c->map_hist = p;
    }
    c->cpu = -1;
    if (dp_lat_init(&c->xdp_lat, samples) || dp_lat_init(&c->send_lat, samples))
        goto fail;
    if (n > DP_MAX_QUEUES || !(c->shadow = shadow_new()))
        goto fail;
    for (int i = 0; i < n; i++, c->n_rings++)
        if (bpf_ring_map(&c->rings[i], ring_fds[i]))
            goto fail;
    pthread_mutex_lock(&holders_lock);
    for (uint32_t i = 0; i < c->n_rings; i++)
        if (held(c->rings[i].map_id)) {
            pthread_mutex_unlock(&holders_lock);
            dp_consumer_free(c);
            errno = EBUSY;
            return NULL;
        }
    c->next_holder = holders;
    holders = c;
    pthread_mutex_unlock(&holders_lock);
    return c;
fail:
    dp_consumer_free(c);
    return NULL;
}

int dp_consumer_start(struct dp_consumer *c, int cpu, int rt_priority)
{
    if (c->running)
        return -EBUSY;
    if (!c->out.ring)
        return -EINVAL;                  /* it feeds a router: the router's pass runs it */
    c->cpu = cpu;
    c->rt_priority = rt_priority;
    c->stop = 0;
    int rc = pthread_create(&c->thread, NULL, consumer_main, c);
    if (rc)
        return -rc;                      /* its error, not errno (which it leaves as it was) */
    c->running = 1;
    return 0;
}

void dp_consumer_stop(struct dp_consumer *c)
{
    if (!c->running)
        return;
    __atomic_store_n(&c->stop, 1, __ATOMIC_RELAXED);
    pthread_join(c->thread, NULL);
    c->running = 0;
}

void dp_consumer_free(struct dp_consumer *c)
{
    if (!c)
        return;
    dp_consumer_stop(c);
    unhold(c);
    shadow_free(c->shadow);
    for (uint32_t i = 0; i < c->n_rings; i++)
        bpf_ring_unmap(&c->rings[i]);
    if (c->map_hist)
        munmap(c->map_hist, HIST_MAP_BYTES);
    dp_lat_free(&c->xdp_lat);
    dp_lat_free(&c->send_lat);
    free(c);
}

/* --- UDP socket ingress ---------------------------------------------------------- */

int dp_req_check(const uint8_t *buf, uint32_t len)
{
    struct dp_req_hdr h;
    if (len < sizeof(h))
        return 1 + DP_DROP_TRUNCATED;
    memcpy(&h, buf, sizeof(h));
    if (h.magic != DP_WIRE_MAGIC)
        return 1 + DP_DROP_BAD_MAGIC;
    if (h.version != DP_WIRE_VERSION)
        return 1 + DP_DROP_BAD_VERSION;
    if (h.flags & ~DP_FLAGS_KNOWN)
        return 1 + DP_DROP_BAD_FLAGS;
    if (h.kind != DP_KIND_CHUNK && h.kind != DP_KIND_COUNT_TOKENS && h.kind != DP_KIND_OPEN &&
        h.kind != DP_KIND_CLOSE)
        return 1 + DP_DROP_BAD_KIND;
    if (h.reserved)
        return 1 + DP_DROP_BAD_FLAGS;
    if (h.chunk_count == 0 || h.chunk_index >= h.chunk_count)
        return 1 + DP_DROP_BAD_CHUNK;
    if (h.kind == DP_KIND_CHUNK || h.kind == DP_KIND_COUNT_TOKENS) {
        if (h.n_tokens < 1 || h.n_tokens > DP_MAX_CHUNK_TOKENS)
            return 1 + DP_DROP_BAD_TOKENS;
    } else if (h.n_tokens) {
        return 1 + DP_DROP_BAD_TOKENS;
    }
    if (len != sizeof(h) + h.n_tokens * 4u)
        return 1 + DP_DROP_LENGTH;
    return 0;
}

static void udp_reply(struct dp_udp_rx *r, const struct dp_req_hdr *h, const struct msghdr *from)
{
    struct dp_resp_hdr resp = {
        .magic = DP_WIRE_MAGIC, .version = DP_WIRE_VERSION, .kind = DP_KIND_RESPONSE, .flags = 0,   /* no trace */
        .tenant = h->tenant, .status = r->reply_status, .body_len = 0, .session_id = h->session_id,
        .request_id = h->request_id, .send_ns = h->send_ns,
    };
    if (sendto(r->fd, &resp, sizeof(resp), MSG_DONTWAIT, from->msg_name, from->msg_namelen) == sizeof(resp))
        r->replies++;
}

static void udp_record(struct dp_udp_rx *r, const uint8_t *buf, uint32_t len, uint64_t now,
                       const struct msghdr *from)
{
    const struct dp_req_hdr *h = (const void *)buf;
    struct dp_chunk c;
    int why = dp_req_check(buf, len);

    if (why) {
        r->bad++;
        r->drops[why - 1]++;
        return;
    }
    if (r->reply_status) {
        udp_reply(r, h, from);
        return;
    }
    c.session_id = h->session_id;
    c.request_id = h->request_id;
    c.tenant = h->tenant;
    c.max_output_tokens = h->max_output_tokens;
    c.chunk_index = h->chunk_index;
    c.chunk_count = h->chunk_count;
    c.n_tokens = h->n_tokens;
    c.kind = h->kind;
    c.queue = (uint32_t)((h->session_id * DP_SESSION_HASH_MUL) >> 32) % r->queues;
    c.batch_seq = c.batch_len = c.batch_pos = 0;
    c.t_send = h->send_ns;
    c.t_xdp = 0;                   /* the stage did not run */
    c.t_consumer = 0;              /* out_put stamps it */
    c.t_router = c.t_lane = c.t_xdp_in = 0;
    c.flags = h->flags;
    c.client_ip = 0;               /* where the response goes (an AF_INET socket: UdpIngress checks) */
    c.client_port = 0;
    if (((const struct sockaddr *)from->msg_name)->sa_family == AF_INET) {
        const struct sockaddr_in *sin = from->msg_name;
        c.client_ip = sin->sin_addr.s_addr;
        c.client_port = sin->sin_port;
    }
    memcpy(c.tokens, buf + sizeof(*h), h->n_tokens * 4u);
    if (!out_put(&r->out, &c, now)) {
        r->out.stalled = 0;              /* dropped: the next datagram is another record */
        return;                          /* (out.full): no record taken, no latency of one */
    }
    if (c.t_send)
        dp_lat_add(&r->send_lat, now - c.t_send);
    r->records++;
}

static void *udp_rx_main(void *arg)
{
    struct dp_udp_rx *r = arg;
    static __thread uint8_t bufs[RX_BATCH][DP_REQ_HDR_LEN + DP_MAX_CHUNK_TOKENS * 4 + 1];
    struct mmsghdr msgs[RX_BATCH];
    struct iovec iov[RX_BATCH];
    struct sockaddr_storage from[RX_BATCH];

    pin(r->cpu, r->rt_priority);
    for (int i = 0; i < RX_BATCH; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = sizeof(bufs[i]);   /* one byte more than a valid request: too long shows */
        memset(&msgs[i].msg_hdr, 0, sizeof(msgs[i].msg_hdr));
        msgs[i].msg_hdr.msg_name = &from[i];
        msgs[i].msg_hdr.msg_namelen = sizeof(from[i]);
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    /* busy-polls like the ring-buffer consumer, so the two differ in path, not in waiting */
    while (!__atomic_load_n(&r->stop, __ATOMIC_RELAXED)) {
        int n = recvmmsg(r->fd, msgs, RX_BATCH, MSG_DONTWAIT, NULL);
        if (n <= 0) {
            cpu_relax();
            continue;
        }
        uint64_t now = dp_now_ns();
        for (int i = 0; i < n; i++) {
            udp_record(r, bufs[i], msgs[i].msg_len, now, &msgs[i].msg_hdr);
            msgs[i].msg_hdr.msg_namelen = sizeof(from[i]);   /* recvmmsg shrank it */
        }
        out_flush(&r->out);
    }
    return NULL;
}

struct dp_udp_rx *dp_udp_rx_new(int fd, int queues, struct dp_ring *out, uint64_t samples)
{
    struct dp_udp_rx *r = calloc(1, sizeof(*r));
    if (!r || queues < 1 || queues > DP_MAX_QUEUES || out_init(&r->out, out))
        goto fail;
    r->fd = fd;
    r->queues = queues;
    r->cpu = -1;
    if (dp_lat_init(&r->send_lat, samples))
        goto fail;
    return r;
fail:
    dp_udp_rx_free(r);
    return NULL;
}

int dp_udp_rx_start(struct dp_udp_rx *r, int cpu, int rt_priority)
{
    if (r->running)
        return -EBUSY;
    r->cpu = cpu;
    r->rt_priority = rt_priority;
    r->stop = 0;
    int rc = pthread_create(&r->thread, NULL, udp_rx_main, r);
    if (rc)
        return -rc;
    r->running = 1;
    return 0;
}

void dp_udp_rx_stop(struct dp_udp_rx *r)
{
    if (!r->running)
        return;
    __atomic_store_n(&r->stop, 1, __ATOMIC_RELAXED);
    pthread_join(r->thread, NULL);
    r->running = 0;
}

void dp_udp_rx_free(struct dp_udp_rx *r)
{
    if (!r)
        return;
    dp_udp_rx_stop(r);
    dp_lat_free(&r->send_lat);
    free(r);
}
