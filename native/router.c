/* router.c - see router.h. Single-threaded by design: one router thread owns
 * all of this state; control calls from Python take the same mutex the
 * thread holds for one poll pass (uncontended: ~20 ns a pass, not a chunk). */
#define _GNU_SOURCE
#include "router.h"
#include "clock.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/bpf.h>
#include <sys/syscall.h>
#include <zmq.h>

#define NIL UINT32_MAX
#define INPUT_BURST 32
#define RECENT_SET_BITS 9           /* finished request keys remembered, to spot late duplicates: */
#define RECENT_WAYS 8               /* 512 sets of 8 (a set is one cache line), first in first out */
#define LOST_SLOTS 256              /* tries lost in a failover, remembered for their retry (lost_note) */
#define LOST_TTL_NS 60000000000ull  /* ... for a minute: a client retries a 503 soon, or not at all */
#define COUNTED_SLOTS 256           /* COUNT_TOKENS answered lately, to drop a repeat (count_tokens) */
#define LAST_RUN_BITS 12            /* sessions whose last worker is remembered (DP_CHUNK_F_MOVED) */
#define EXPIRY_SCAN_NS 10000000ull  /* look for stalled reassemblies every 10 ms */

enum { REQ_FREE = 0, REQ_PREFILL, REQ_DECODE, REQ_DONE };

struct pooled {                 /* a buffered chunk, linked into its request's pending or sent list */
    uint32_t next;
    uint32_t prev;              /* in its request's ooo list only (unlinked from the middle) */
    uint16_t sent;              /* tokens of it already placed in lanes (a split chunk goes out in pieces) */
    struct dp_chunk c;
};

struct req {
    uint64_t key;                                /* req_key(tenant, session, request_id) */
    uint64_t request_id, session_id;
    uint32_t tenant, max_output;
    uint16_t chunk_count, received, next_index;  /* chunks seen; next index to schedule in order */
    uint16_t n_out;
    uint16_t status;                             /* 0 while all is well, else the error to answer with */
    uint16_t flags;                              /* DP_FLAG_TRACE: the response carries its stamps */
    uint8_t state, in_fifo, in_set;
    uint8_t held, in_session;                    /* waits for an earlier request of its session; linked */
    int16_t worker;
    uint32_t decode_left;                        /* decode steps still to schedule */
    uint32_t pending_head, pending_tail;         /* in-order chunks waiting (pool indices) */
    uint32_t sent_head, sent_tail;               /* chunks all sent: kept until the request ends, to replay
                                                    it on another worker if its worker fails */
    uint32_t ooo;                                /* chunks that came early, unsorted list (and rt->early) */
    uint32_t fifo_next;                          /* worker's prefill (dynamic) or ready (static) FIFO */
    uint32_t inflight;                           /* records in the worker's current batch */
    uint32_t session_prev, session_next;         /* the session's unfinished requests, in arrival order */
    uint64_t t_send, t_xdp, t_first_lane, t_ready, t_last;   /* t_send: its first record's, on every record
                                                    to its worker (which tells a request by id and stamp) */
    uint64_t t_try;                              /* the client's try: its first record's stamp, or its
                                                    retry's (sent_by); the answer carries it */
    uint64_t t_send_max;                         /* the latest send stamp of its records, repeats too: a
                                                    retry's, once one passed XDP's cut (xdp_cut) */
    uint64_t t_in;                               /* the router's first sight of it (its policy's latency) */
    uint64_t t_worker;                           /* its first record in its current worker's lane (0: none yet) */
    uint32_t client_ip;                          /* where the response goes (from the first chunk) */
    uint16_t client_port;
    uint16_t pool;                               /* the pool it was placed on */
    uint8_t spill;                               /* admission throttled it to the secondary pool */
    uint8_t moved;                               /* its session last ran elsewhere: DP_CHUNK_F_MOVED */
    uint8_t replayed;                            /* failover replayed it once already (see failover) */
    uint8_t parked;                              /* enum park: it waits for a worker to come up (park) */
    uint8_t waited;                              /* it has (counted once: waited_for_worker) */
    uint8_t unsure;                              /* a worker that had some of it died: its turn may be in
                                                    the store (lost_note, if it then fails) */
    uint8_t retake;                              /* a client's retry of a try lost so: sent to its worker
                                                    under that try's stamp, flagged DP_CHUNK_F_REPLAY; 2 until
                                                    its first record is out (DP_CHUNK_F_RETAKE), again at a
                                                    replay */
    uint8_t why;                                 /* enum why: what its failure's body says (WHY_NONE: no body);
                                                    WHY_REPLAY_DIED: its replay's worker died too, its own doing */
    uint8_t kv_moving;                           /* refused so: its other records in that batch are ignored,
                                                    then it moves on (kv_move) */
    uint16_t kv_moves;                           /* workers it moved on from so (kv_move) */
    int16_t kv_first;                            /* the first of them, where the walk stops */
    uint8_t close;                               /* a CLOSE record's (close_session) */
    uint8_t by_open;                             /* its first record here was an OPEN (recently_done) */
    int16_t was_on;                              /* the worker its session's request before it went to, as it
                                                    was placed (-1: none known): its CLOSE's home if it fails */
    uint32_t arr;                                /* its tenant's entry in `arr` while it misses chunks (NIL:
                                                    none missing) */
    uint32_t tokens_in, generated;               /* what ran: settled against the admission's charge */
    struct dp_adm_decision adm;
    uint32_t out[DP_MAX_OUTPUT_TOKENS];
};

/* req.parked (park): a new request; a dead worker's, none or some of it run there */
enum park { PARK_NONE, PARK_NEW, PARK_MOVED, PARK_RAN };

struct batch_meta {             /* what the router remembers of each record it sent */
    uint32_t req;
    uint8_t kind, final;
    uint8_t releases;           /* the record carries a chunk's last piece: its depth ends on completion */
    uint16_t tokens;            /* and that chunk's tokens, which its depth held (releases only) */
};

struct worker {
    int kind;                           /* DP_LANE_SHM or DP_LANE_ZMQ */
    uint16_t pool, local;               /* its pool, and its index in the pool's view */
    struct dp_ring *lane, *done;        /* shm */
    void *zsock;                        /* zmq: a DEALER connected to the worker's */
    void *zmon;                         /* zmq: a PAIR its monitor reports lost connections on */
    uint64_t t_lost;                    /* zmq: when its monitor last reported one (zmq_health) */
    char *endpoint;                     /* zmq: the worker's, for a fresh socket when it goes down */
    uint8_t *stage;                     /* zmq: the batch being built, sent as one message */
    struct dp_completion *cbuf;         /* zmq: the last completion received */
    uint64_t t_busy;                    /* when its batch was placed (zmq: its answer's deadline counts
                                         * from here) */
    uint64_t batch_peak_ns;             /* its recent longest batch, placed to answered (find_stalls) */
    uint8_t stalled;                    /* its batch unanswered too long (find_stalls): hidden from
                                         * placement while another is up and not (stall_hides) */
    uint32_t unsent;                    /* zmq: records of a built batch the socket refused */
    uint8_t timed_out;                  /* zmq: marked down by zmq_timeouts (not by the control plane):
                                         * probed, and back up once it answers (zmq_health) */
    uint64_t t_probe;                   /* zmq: when it was last probed */
    uint32_t fifo_head, fifo_tail;      /* requests with pending chunks (dynamic) / complete requests (static) */
    uint32_t *decoding;                 /* requests in decode on this worker */
    uint32_t n_decoding, decode_cursor;
    uint32_t set[DP_MAX_BATCH_CHUNKS];  /* static: the batch being run */
    uint32_t n_set;
    uint32_t busy, batch_seq, batch_len;
    uint32_t budget;                    /* its own token budget per step; 0: the router's */
    uint32_t promised;                  /* chunks still to come of the requests on it (their OPEN,
                                         * their first chunk came): its pool's room (pool_promised) */
    uint8_t no_store;                   /* its answers say it has no snapshot store (DP_CE_NO_STORE), or
                                         * the control plane did, before its first answer */
    uint8_t no_store_said;              /* the control plane's word (dp_router_set_worker_store) */
    struct batch_meta meta[DP_MAX_BATCH_CHUNKS];
    struct dp_worker_stats st;
};

struct index {
    struct { uint64_t key; uint32_t slot; } *e;   /* never full: 2 x max_requests entries (early: >= 2 x pool_chunks) */
    uint32_t mask;
};

/* A tenant's requests still missing chunks or held behind their session's (see TENANT_SHARE). */
struct arriving {
    uint32_t tenant;
    uint32_t requests;                  /* its requests still missing chunks, or held */
    uint32_t chunks;                    /* theirs, come (held in the pool) or promised (room reserved) */
    uint32_t next_free;                 /* a free entry's next */
};

/* A pool of workers: its own view and policy instance, so the policy picks among its members only. */
struct pool {
    struct dp_workers view;
    struct dp_policy policy;
    uint16_t member[DP_MAX_WORKERS];    /* view index -> worker index */
    uint32_t price, room;
    uint64_t requests, spilled;
};

struct last_run {               /* the worker a session's latest request went to */
    uint64_t session;           /* session_key(tenant, session) */
    int32_t worker;
};

struct dp_router {
    struct dp_router_config cfg;
    pthread_mutex_t lock;
    struct dp_workers view;             /* every worker (the pools' views are slices of it) */
    struct pool pools[DP_MAX_POOLS];
    uint8_t order[DP_MAX_POOLS];        /* pools by price, cheapest first */
    struct dp_admission *adm;
    struct worker w[DP_MAX_WORKERS];
    struct dp_ring *in[DP_MAX_INPUTS];
    uint32_t n_in, in_cursor;
    uintptr_t feed, feed_src;           /* dp_router_add_feed (0: none) */
    int cuts_fd;                        /* the XDP program's `cuts` map (dp_router_watch_cuts; -1: none) */
    int buckets_fd;                     /* and its `buckets` (-1: every tenant taken as having one) */
    int others_fd;                      /* and its `others_bucket` (-1: none) */
    struct dp_ring *egress;
    void *zctx;                         /* created with the first zmq lane */
    uint32_t n_zmq;                     /* zmq workers (their answers have a deadline) */
    struct req *reqs;                   /* slab of cfg.max_requests */
    uint32_t req_free;                  /* free slots, linked through fifo_next */
    struct index by_id, by_session;     /* request key -> slot; session key -> its latest request */
    struct index kv_homes;              /* session key -> the worker a kv_move (or a failover, one without
                                         * a store) sent it to (its slot) */
    struct pooled *pool;
    uint32_t pool_free;                 /* free list head */
    uint32_t done_head, done_tail;      /* finished requests waiting for egress room (via fifo_next) */
    uint64_t key_secret;                /* random per router: req_key, session_key */
    _Alignas(64) uint64_t recent[(1u << RECENT_SET_BITS) * RECENT_WAYS];   /* keys of requests that finished lately */
    uint64_t recent_sent[(1u << RECENT_SET_BITS) * RECENT_WAYS];           /* ... each one's try (DP_TRY_OF) */
    uint8_t recent_next[1u << RECENT_SET_BITS];                             /* each set's oldest way */
    uint8_t recent_ran[1u << RECENT_SET_BITS];                              /* ... the ways whose try ran (200) */
    struct lost { uint64_t key, attempt, try, at; } lost[LOST_SLOTS];       /* direct-mapped, by request key */
    uint64_t counted[COUNTED_SLOTS];    /* direct-mapped: a hash of each count's ids and send stamp */
    struct last_run last_run[1u << LAST_RUN_BITS];   /* direct-mapped, by session key */
    uint32_t reserved;                  /* pool slots promised to chunks of admitted requests not here yet */
    struct arriving *arr;               /* max_requests entries: the tenants with requests still arriving */
    struct index by_tenant;             /* tenant key -> its entry in arr */
    struct index early;                 /* early_key(request slot, chunk index) -> its parked chunk */
    uint32_t arr_free;
    uint64_t next_expiry_scan;
    uint64_t now;                       /* the clock as read in this poll pass (0: not yet): pass_clock */
    int in_pass;                        /* dp_router_poll is running (else a control call: no pass clock) */
    uint32_t idle_polls, warm_region; /* idle passes in a row; warm_step's place in the working set */
    size_t warm_off;
    struct dp_chunk rehearsal;          /* the last admitted request's first chunk: rehearse() runs it dry */
    uint32_t rehearsal_from;            /* its pool slot, copied to `rehearsal` once its batch is out (NIL) */
    uint32_t unpriced, unpriced_chunk;  /* a request admitted by a lazy decision (NIL: none), and the pool
                                           slot of the chunk it was decided on (its t_router: when) */
    struct shadow *shadow;              /* the live router's rehearsal stage (NULL in a shadow) */
    uint64_t hold_until;                /* till then, a request no worker is up to take waits (dp_router_hold;
                                         * 0: none does) */
    struct dp_router_stats st;
    char done_body[DP_MAX_RESP_BODY];   /* emit_done's (not on the stack of the path every response takes) */
};

/* The router's state (request slab, index, chunk pool): faulted in at create,
 * on transparent huge pages, and not inherited by fork (MADV_DONTFORK). The
 * control plane forks worker and client processes while the router runs; a
 * page they share copy-on-write costs the router a page fault (a 2 MiB copy
 * for a huge page) the first time it writes there: measured here, a lone
 * chunk's ingest took ~20 us that way instead of under a microsecond. */
#define HUGE_PAGE (2u << 20)

static void *hot_alloc(size_t n)
{
    size_t len = ((n + HUGE_PAGE - 1) & ~(size_t)(HUGE_PAGE - 1)) + HUGE_PAGE;
    uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    uint8_t *a = (uint8_t *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (a > p)
        munmap(p, (size_t)(a - p));                    /* keep the 2 MiB-aligned part */
    size_t keep = len - (size_t)(a - p);
    size_t use = (n + HUGE_PAGE - 1) & ~(size_t)(HUGE_PAGE - 1);
    if (keep > use)
        munmap(a + use, keep - use);
    madvise(a, use, MADV_HUGEPAGE);
    madvise(a, use, MADV_DONTFORK);
    memset(a, 0, n);                                   /* fault it in now, not on the fast path */
    return a;
}

static void hot_free(void *p, size_t n)
{
    if (p)
        munmap(p, (n + HUGE_PAGE - 1) & ~(size_t)(HUGE_PAGE - 1));
}

/* The clock read at most once per poll pass for what needs a time but is no stamp of a stage
 * (a request's ready time, a batch's start, the expiry scan): the drain's stamp when records came,
 * else read when first asked. A read costs ~25 ns here, and a chunk's way to its lane read it
 * twice more before (make_ready, send_batches), an idle pass twice. Outside a pass: fresh. */
static uint64_t pass_clock(struct dp_router *rt)
{
    if (!rt->in_pass)
        return now_ns();
    if (!rt->now)
        rt->now = now_ns();
    return rt->now;
}

/* --- request table: a slab of request slots (indices stay put while a request
 * lives), indexed twice by open addressing with backward-shift deletion (so
 * lookups never cross a hole and need no tombstones): by request, and by
 * session (to the session's latest unfinished request). Each index has twice
 * the slab's size, so it is never full. ------------------------------------ */

/* A request is named by (tenant, session, request_id), not by its id alone:
 * two clients that reuse an id never meet, and no tenant can touch another's.
 * The hash is keyed by the router's random secret: recent[] holds keys alone,
 * and with a public hash (a bijection) a tenant could pick a request_id whose
 * key is another tenant's request's, then have that one dropped as "done". */
static uint64_t req_key(const struct dp_router *rt, uint32_t tenant, uint64_t session, uint64_t request_id)
{
    return dp_hash64(request_id ^ dp_hash64(session ^ dp_hash64(tenant ^ rt->key_secret)));
}

static uint64_t session_key(const struct dp_router *rt, uint32_t tenant, uint64_t session)
{
    return dp_hash64(session ^ dp_hash64(tenant ^ 0x5e55104ull ^ rt->key_secret));
}

static uint64_t chunk_key(const struct dp_router *rt, const struct dp_chunk *c)
{
    return req_key(rt, c->tenant, c->session_id, c->request_id);
}

/* The first slot under key whose request has the same tenant and session (and request id, if by_id). */
static uint32_t index_find(const struct dp_router *rt, const struct index *ix, uint64_t key,
                           const struct dp_chunk *c, int by_id)
{
    for (uint32_t i = (uint32_t)key & ix->mask;; i = (i + 1) & ix->mask) {
        if (ix->e[i].slot == NIL)
            return NIL;
        const struct req *r = &rt->reqs[ix->e[i].slot];
        if (ix->e[i].key == key && r->session_id == c->session_id && r->tenant == c->tenant &&
            (!by_id || r->request_id == c->request_id))
            return ix->e[i].slot;
    }
}

static void index_add(struct index *ix, uint64_t key, uint32_t slot)
{
    uint32_t i = (uint32_t)key & ix->mask;
    while (ix->e[i].slot != NIL)
        i = (i + 1) & ix->mask;
    ix->e[i].key = key;
    ix->e[i].slot = slot;
}

/* Entry (key, slot) now points at `to` (NIL: removed). */
static void index_move(struct index *ix, uint64_t key, uint32_t slot, uint32_t to)
{
    uint32_t i = (uint32_t)key & ix->mask;
    while (ix->e[i].slot != slot || ix->e[i].key != key)
        i = (i + 1) & ix->mask;
    ix->e[i].slot = to;
    if (to != NIL)
        return;
    for (uint32_t j = (i + 1) & ix->mask; ix->e[j].slot != NIL; j = (j + 1) & ix->mask) {
        uint32_t home = (uint32_t)ix->e[j].key & ix->mask;
        /* entry j may fill the hole at i unless its home lies in the cyclic range (i, j] */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            ix->e[i] = ix->e[j];
            ix->e[j].slot = NIL;
            i = j;
        }
    }
}

static uint32_t req_insert(struct dp_router *rt, uint64_t key)
{
    uint32_t r = rt->req_free;
    if (r == NIL)
        return NIL;
    rt->req_free = rt->reqs[r].fifo_next;
    index_add(&rt->by_id, key, r);
    rt->st.active_requests++;
    return r;
}

/* r waits for a worker no longer (park): placed, answered, or expired */
static void unpark(struct dp_router *rt, struct req *r)
{
    if (r->parked) {
        r->parked = 0;
        rt->st.waiting_for_worker--;
    }
}

static void req_free(struct dp_router *rt, uint32_t r)
{
    unpark(rt, &rt->reqs[r]);            /* (expire_stalled frees one without finish) */
    index_move(&rt->by_id, rt->reqs[r].key, r, NIL);
    rt->reqs[r].state = REQ_FREE;
    rt->reqs[r].fifo_next = rt->req_free;
    rt->req_free = r;
    rt->st.active_requests--;
}

/* --- chunk pool ----------------------------------------------------------------- */

static uint32_t pool_get(struct dp_router *rt)
{
    uint32_t i = rt->pool_free;
    if (i != NIL) {
        rt->pool_free = rt->pool[i].next;
        rt->pool[i].next = NIL;
        rt->pool[i].sent = 0;
        rt->st.pool_free--;
    }
    return i;
}

static void pool_put(struct dp_router *rt, uint32_t i)
{
    rt->pool[i].next = rt->pool_free;
    rt->pool_free = i;
    rt->st.pool_free++;
}

/* --- per-worker queues ----------------------------------------------------------- */

static void fifo_push(struct dp_router *rt, struct worker *w, uint32_t r)
{
    rt->reqs[r].fifo_next = NIL;
    rt->reqs[r].in_fifo = 1;
    if (w->fifo_tail == NIL)
        w->fifo_head = r;
    else
        rt->reqs[w->fifo_tail].fifo_next = r;
    w->fifo_tail = r;
}

static uint32_t fifo_pop(struct dp_router *rt, struct worker *w)
{
    uint32_t r = w->fifo_head;
    if (r != NIL) {
        w->fifo_head = rt->reqs[r].fifo_next;
        if (w->fifo_head == NIL)
            w->fifo_tail = NIL;
        rt->reqs[r].in_fifo = 0;
    }
    return r;
}

/* A worker's depth moves by d chunks and tok tokens (the policies' view: policy.h), in the router's
 * view and its pool's alike. A pool view's totals count only the workers it shows up: a hidden
 * worker's queue is no load the others can share (counted, it raised affinity's mean, and so its
 * load bound, for the workers left). */
static void depth_add(struct dp_router *rt, int worker, int32_t d, int32_t tok)
{
    struct worker *w = &rt->w[worker];
    struct dp_workers *pv = &rt->pools[w->pool].view;
    rt->view.depth[worker] += (uint32_t)d;
    rt->view.total_depth += (uint32_t)d;
    rt->view.tokens[worker] += (uint32_t)tok;
    rt->view.total_tokens += (uint64_t)(int64_t)tok;
    pv->depth[w->local] += (uint32_t)d;
    pv->tokens[w->local] += (uint32_t)tok;
    if (pv->up[w->local]) {
        pv->total_depth += (uint32_t)d;
        pv->total_tokens += (uint64_t)(int64_t)tok;
    }
    w->st.depth = rt->view.depth[worker];
    w->st.queued_tokens = rt->view.tokens[worker];
}

/* a pending chunk's weight in depth_add: one chunk, its tokens */
static int32_t chunk_tokens(const struct dp_router *rt, uint32_t p)
{
    return (int32_t)rt->pool[p].c.n_tokens;
}

/* --- pools ------------------------------------------------------------------------- */

/* Whether stalled worker w is to be hidden from the placement rule and the policies: not if it is
 * known to have no snapshot store (its sessions could not be restored elsewhere, and a stall may
 * end), nor while no other worker is up and not stalled (brisk). is_hidden reads the outcome. */
static int stall_hides(const struct worker *w, int brisk)
{
    return w->stalled && !w->no_store && brisk;
}

/* The pools' views again from the workers' (after a worker joins or changes pool, goes up or down,
 * stalls or answers again): a hidden worker is down in them, up in the router's own view. */
static void rebuild_pools(struct dp_router *rt)
{
    uint32_t was[DP_MAX_POOLS];
    int brisk = 0;
    for (uint32_t k = 0; k < rt->view.n; k++)
        brisk |= rt->view.up[k] && !rt->w[k].stalled;
    for (uint32_t p = 0; p < DP_MAX_POOLS; p++) {
        was[p] = rt->pools[p].view.n;
        rt->pools[p].view.n = rt->pools[p].view.total_depth = 0;
        rt->pools[p].view.total_tokens = 0;
        rt->pools[p].view.generation++;
    }
    for (uint32_t k = 0; k < rt->view.n; k++) {
        struct worker *w = &rt->w[k];
        struct dp_workers *pv = &rt->pools[w->pool].view;
        uint32_t i = pv->n++;
        if (i >= was[w->pool] || rt->pools[w->pool].member[i] != k)
            pv->membership++;            /* index i means another worker now */
        rt->pools[w->pool].member[i] = (uint16_t)k;
        w->local = (uint16_t)i;
        pv->depth[i] = rt->view.depth[k];
        pv->tokens[i] = rt->view.tokens[k];
        pv->weight[i] = rt->view.weight[k];
        pv->up[i] = rt->view.up[k] && !stall_hides(w, brisk);
        pv->id[i] = (uint16_t)k;
        pv->total_depth += pv->up[i] ? pv->depth[i] : 0;        /* (depth_add) */
        pv->total_tokens += pv->up[i] ? pv->tokens[i] : 0;
    }
    for (uint32_t p = 0; p < DP_MAX_POOLS; p++)
        rt->pools[p].view.membership += rt->pools[p].view.n < was[p];
}

static uint32_t pool_up(const struct pool *pl)
{
    uint32_t up = 0;
    for (uint32_t i = 0; i < pl->view.n; i++)
        up += pl->view.up[i];
    return up;
}

/* The chunks still to come of the requests on pl's workers (shown_only: of those its view shows
 * up, as total_depth counts: a stalled worker hidden from placement takes none of its room). */
static uint64_t pool_promised(const struct dp_router *rt, const struct pool *pl, int shown_only)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < pl->view.n; i++)
        n += !shown_only || pl->view.up[i] ? rt->w[pl->member[i]].promised : 0;
    return n;
}

/* The placement rule (router.h): the cheapest pool with an up worker and room; for a request
 * admission throttled (spill), the secondary (the next pool with an up worker after the cheapest)
 * if it has room; else the cheapest with an up worker; the policy then picks inside the pool.
 * -1: none is up. (A spill whose secondary was full went on to the next pool with room, a dearer
 * third past a primary with room, found by review.) */
static int choose_pool(const struct dp_router *rt, int spill, int *spilled)
{
    int first = -1, secondary = -1, secondary_room = 0, healthy = -1;
    for (uint32_t i = 0; i < DP_MAX_POOLS; i++) {
        int p = rt->order[i];
        const struct pool *pl = &rt->pools[p];
        uint32_t up = pool_up(pl);
        if (!up)
            continue;
        /* (total_depth leaves a hidden worker's queue out, depth_add: counted, a stalled worker's
         * two chunks filled a pool of room 2 a worker, and new requests went to a dearer pool) */
        /* with the chunks still to come of the requests placed here: a burst of OPENs (no chunk
         * queued yet) all went to the cheapest pool, 6x its room, the next one idle (review) */
        int room = !pl->room || pl->view.total_depth + pool_promised(rt, pl, 1) < (uint64_t)pl->room * up;
        if (healthy < 0)
            healthy = p;
        else if (secondary < 0)
            secondary = p, secondary_room = room;
        if (room && first < 0)
            first = p;                   /* a full pool's requests go to the next with room */
    }
    *spilled = spill && secondary >= 0 && secondary_room;
    return *spilled ? secondary : first >= 0 ? first : healthy;
}

/* The policy's pick in pool pl, checked: a policy (the researchers' own code) that returns a worker
 * out of range or down would strand the request on a lane nobody serves; -2 then, -1 for none up. */
static int policy_pick(struct pool *pl, const struct dp_request *rq)
{
    int k = dp_policy_pick(&pl->policy, &pl->view, rq);
    if (k >= 0 ? (uint32_t)k >= pl->view.n || !pl->view.up[k] : pool_up(pl) != 0)
        return -2;                       /* -1 with a worker up breaks the contract too (policy.h) */
    return k;
}

static int kv_home(struct dp_router *rt, uint64_t session, uint32_t tenant, int wk, int p);

/* A worker for a request: its pool by the placement rule, then the policy's pick there (or the
 * session's kv_home). -1 none up, -2 the policy's bad pick, which its caller counts (bad_picks)
 * once the request's fate is settled: a refusal that finds no egress room is decided again on the
 * next pass (it counted twice). */
static int pick_worker(struct dp_router *rt, const struct dp_request *rq, int spill, uint16_t *pool, int *spilled)
{
    int p = choose_pool(rt, spill, spilled);
    if (p < 0)
        return -1;
    struct pool *pl = &rt->pools[p];
    int k = policy_pick(pl, rq);
    if (k < 0)
        return k;
    *pool = (uint16_t)p;
    pl->requests++;
    pl->spilled += (uint64_t)*spilled;
    return rt->st.kv_homes ? kv_home(rt, rq->session, rq->tenant, pl->member[k], p) : pl->member[k];
}

/* r on worker k from now: its chunks still to come count in k's pool's room (pool_promised). */
static void set_worker(struct dp_router *rt, struct req *r, int k)
{
    uint32_t missing = (uint32_t)(r->chunk_count - r->received);
    rt->w[r->worker].promised -= missing;
    rt->w[k].promised += missing;
    r->worker = (int16_t)k;
}

/* Request r's prompt at most: the tokens come, 128 for each chunk still to come. */
static uint32_t prompt_bound(const struct req *r)
{
    return r->tokens_in + (uint32_t)(r->chunk_count - r->received) * DP_MAX_CHUNK_TOKENS;
}

/* Request r ends: its pool's policy learns how (policy.h, done), told the worker it ended on while
 * that worker is still in the pool (a worker moved to another pool since is not the pool's to learn
 * of). */
static void policy_done(struct dp_router *rt, const struct req *r)
{
    struct pool *pl = &rt->pools[r->pool];
    const struct worker *w = &rt->w[r->worker];
    if (!pl->policy.ops->done || w->pool != r->pool || r->parked == PARK_NEW)   /* (never placed) */
        return;
    uint64_t t = pass_clock(rt);
    struct dp_outcome o = { r->session_id, r->tenant, r->status ? r->status : DP_STATUS_OK, r->tokens_in,
                            r->generated, t > r->t_in ? t - r->t_in : 0,
                            r->t_worker && t > r->t_worker ? t - r->t_worker : 0, t };
    dp_policy_done(&pl->policy, &pl->view, w->local, &o);
}

/* What the policy sees of the request whose first record (a chunk or its OPEN) is c, at time t: its
 * size from the header, the prompt exact only when it is all in this chunk. */
static struct dp_request request_of(const struct dp_chunk *c, uint64_t t)
{
    uint32_t prompt = c->kind == DP_KIND_CHUNK && c->chunk_count == 1 ? c->n_tokens
                      : (uint32_t)c->chunk_count * DP_MAX_CHUNK_TOKENS;
    return (struct dp_request){ c->session_id, c->tenant, prompt, c->max_output_tokens, c->chunk_count, t };
}

/* Session sk's request now runs on worker wk: did it last run elsewhere? A worker holding the
 * session resident checks the store for a newer copy only when told so (DP_CHUNK_F_MOVED): one
 * store lookup per moved request, none while a session stays on its worker. A session the table
 * does not hold (never seen, or its entry taken by another) counts as moved: never a false "no". */
static struct last_run *last_run_of(struct dp_router *rt, uint64_t sk)
{
    return &rt->last_run[(sk >> 20) & ((1u << LAST_RUN_BITS) - 1)];
}

/* --- a store-less worker's full KV ---------------------------------------------------------
 * A worker without a store can evict nothing: over its KV budget it refuses a session new to it
 * 503 flagged DP_CE_KV_FULL, having run none of the request (worker.py). The request then moves
 * to the next up worker of its pool, and on, each tried once: the policy would pick the full one
 * again (an affinity policy does, by design). Only when every one has refused is the client
 * answered 503, with a body saying why. The session lives where the request ran, which only the
 * router knows: its held requests follow the request, and its later ones are placed there, not
 * at the policy's pick, remembered in `kv_homes` (not in the lossy last-run table: a session that
 * lost its entry to another would begin again, without its turns, on a worker with room) until
 * its CLOSE is answered 200, or the request that made the entry found no worker at all, or the
 * worker dies (kv_homes_forget; not a zmq worker that only timed out, which may come back). A
 * failover that replays a request on a worker without a store makes an entry too (failover).
 * Full, it takes no more: a request that would need an entry is answered 503 as if every worker
 * were full (a failover makes none then). */
#define KV_HOMES 4096

/* The worker kv_homes holds for session sk, NIL if none. */
static uint32_t kv_home_of(const struct dp_router *rt, uint64_t sk)
{
    if (!rt->kv_homes.e)
        return NIL;
    for (uint32_t i = (uint32_t)sk & rt->kv_homes.mask;; i = (i + 1) & rt->kv_homes.mask)
        if (rt->kv_homes.e[i].slot == NIL || rt->kv_homes.e[i].key == sk)
            return rt->kv_homes.e[i].slot;
}

/* 0 if the table is full */
static int kv_home_set(struct dp_router *rt, uint64_t sk, int wk)
{
    uint32_t old = kv_home_of(rt, sk);
    if (old != NIL) {
        index_move(&rt->kv_homes, sk, old, (uint32_t)wk);
        return 1;
    }
    if (rt->st.kv_homes >= KV_HOMES)
        return 0;
    if (!rt->kv_homes.e) {               /* the first move: a router that never makes one holds no table */
        rt->kv_homes.e = hot_alloc(2 * KV_HOMES * sizeof(*rt->kv_homes.e));
        if (!rt->kv_homes.e)
            return 0;
        rt->kv_homes.mask = 2 * KV_HOMES - 1;
        for (uint32_t i = 0; i <= rt->kv_homes.mask; i++)
            rt->kv_homes.e[i].slot = NIL;
    }
    index_add(&rt->kv_homes, sk, (uint32_t)wk);
    rt->st.kv_homes++;
    return 1;
}

static void kv_home_drop(struct dp_router *rt, uint64_t sk)
{
    uint32_t old = kv_home_of(rt, sk);
    if (old != NIL) {
        index_move(&rt->kv_homes, sk, old, NIL);
        rt->st.kv_homes--;
    }
}

/* Session sk's entry as a request of it ends for good (its CLOSE answered, or a KV-full walk that
 * found no worker): dropped, unless a later request of the session, `next`, is already placed
 * (held behind it at the home, or carried along by kv_move): then it follows that request, which
 * begins the session again where it runs. Dropped, the session's request after that went to the
 * policy's pick, away from the copy that request made, its turn lost (found by review). */
static void kv_home_follow(struct dp_router *rt, uint64_t sk, uint32_t next)
{
    if (next == NIL || !kv_home_set(rt, sk, rt->reqs[next].worker))
        kv_home_drop(rt, sk);
}

/* Where a request of the session goes instead of wk, the policy's pick in pool p: the worker a
 * kv_move sent the session to, if it is up and in that pool. Else the request goes to wk, and so
 * does the entry: the session's newest copy will be there (a failover's replay, a request placed
 * in another pool); left as it was, the entry drew the session's later requests and its CLOSE to
 * a worker that no longer held it, and the copy that did was never closed (found by review). */
static int kv_home(struct dp_router *rt, uint64_t session, uint32_t tenant, int wk, int p)
{
    uint64_t sk = session_key(rt, tenant, session);
    uint32_t h = kv_home_of(rt, sk);
    if (h == NIL || (int)h == wk)
        return wk;
    if (rt->view.up[h] && rt->w[h].pool == p)
        return (int)h;
    index_move(&rt->kv_homes, sk, h, (uint32_t)wk);
    return wk;
}

/* The up worker session sk lives on as far as the router knows, whatever its pool: that of its
 * request `before` (unfinished: NIL if none), else where its latest request went, else its
 * kv_move's home (the last-run table is lossy); -1 if it knows none. */
static int session_home(struct dp_router *rt, uint64_t sk, uint32_t before)
{
    if (before != NIL && rt->view.up[rt->reqs[before].worker])
        return rt->reqs[before].worker;
    const struct last_run *e = last_run_of(rt, sk);
    if (e->session == sk && e->worker >= 0 && rt->view.up[e->worker])
        return e->worker;
    uint32_t h = kv_home_of(rt, sk);
    return h != NIL && rt->view.up[h] ? (int)h : -1;
}

static uint8_t note_run(struct dp_router *rt, uint64_t sk, int wk)
{
    struct last_run *e = last_run_of(rt, sk);
    uint8_t moved = !(e->session == sk && e->worker == wk);
    rt->st.moved += e->session == sk && e->worker != wk && e->worker >= 0;   /* a move seen, not a first sight */
    e->session = sk;
    e->worker = wk;
    return moved;
}

/* Session sk's request placed on wk failed: it may never have run there, so where the session
 * last ran is unknown now (the next request is flagged moved and its worker asks the store). */
static void forget_run(struct dp_router *rt, uint64_t sk, int wk)
{
    struct last_run *e = last_run_of(rt, sk);
    if (e->session == sk && e->worker == wk)
        e->worker = -1;
}

/* --- responses -------------------------------------------------------------------- */

/* A response: r's output tokens, or (no r) a refusal of chunk c's request with an optional JSON body.
 * An error carries no tokens: a request failed part-way (its worker died with no other to take it,
 * a record refused) is not charged, and its partial output is not an answer. */
static int emit(struct dp_router *rt, const struct req *r, uint16_t status, uint64_t request_id, uint64_t session,
                uint32_t tenant, const struct dp_chunk *c, const char *body, uint32_t body_len)
{
    if (!rt->egress)
        return 1;  /* no egress attached: responses are counted only */
    if (dp_ring_prod_reserve(rt->egress, 1) != 1) {
        dp_ring_note_full(rt->egress, 1, 0);
        return 0;
    }
    struct dp_response_rec *o = dp_ring_prod_slot(rt->egress, 0);
    uint16_t n = r && status == DP_STATUS_OK ? r->n_out : 0;
    o->request_id = request_id;
    o->session_id = session;
    o->tenant = tenant;
    o->status = status;
    o->n_out = n;
    o->t_send = r ? r->t_try : c->t_send;
    o->t_xdp = r ? r->t_xdp : c->t_xdp;
    o->t_first_lane = r ? r->t_first_lane : 0;
    o->t_done = now_ns();
    o->worker = r ? (uint16_t)r->worker : 0xffff;
    o->client_ip = r ? r->client_ip : c->client_ip;
    o->client_port = r ? r->client_port : c->client_port;
    o->pool = r ? r->pool : 0xffff;
    o->flags = (r ? r->flags : c->flags) & DP_FLAG_TRACE;
    o->reserved = 0;
    o->body_len = 0;
    if (n)
        memcpy(o->tokens, r->out, n * sizeof(uint32_t));
    else if (body_len) {
        o->body_len = (uint16_t)(body_len < DP_MAX_RESP_BODY ? body_len : DP_MAX_RESP_BODY);
        memcpy(o->body, body, o->body_len);
    }
    dp_ring_prod_commit(rt->egress, 1);
    return 1;
}

/* Why the router answers an error that admission did not decide: said in its body, so a client can
 * tell a router full for now from a pool with no worker, a retry worth making from a request that
 * will never run (all these were answered with no body at all once; a 503 a worker gives no
 * reason for still is: WHY_NONE). */
enum why {
    WHY_NONE,
    WHY_POOL, WHY_TABLE, WHY_NO_WORKER, WHY_BAD_PICK, WHY_SHARE,     /* 503 at the request's first sight */
    WHY_BAD_CHUNK,                                                  /* 400 */
    WHY_WORKER_DIED, WHY_REPLAY_DIED,                               /* a failover's 503 */
    WHY_KV_FULL, WHY_STORE, WHY_KV_LOST, WHY_UNANSWERED,            /* 503 for a worker's reason */
    WHY_CONFLICT, WHY_CONTEXT, WHY_TOKENS, WHY_ORDER,               /* a worker's 409, 413, 400, 422 */
    WHY_RAN,                                                        /* 409: a retry after a 200 */
};

#define SAID_NUMBER(n) SAID_DIGITS(n)   /* a macro's value in a string */
#define SAID_DIGITS(n) #n
static const char *const said[] = {
    [WHY_POOL] = "the router's chunk pool is full: retry shortly",
    [WHY_TABLE] = "the router's request table is full: retry shortly",
    [WHY_NO_WORKER] = "no worker is up to take the request",
    [WHY_BAD_PICK] = "the routing policy picked no worker that is up (bad_picks: a fault of the policy)",
    [WHY_SHARE] = "the tenant's requests still arriving hold its share of the router",
    [WHY_BAD_CHUNK] = "a chunk of the request is malformed (its token count is not 1 to " SAID_NUMBER(DP_MAX_CHUNK_TOKENS)
                      ", its index is not below its chunk count, or its chunk count is not its first record's)",
    [WHY_WORKER_DIED] = "the request's worker died or stopped answering, and no other worker is up to run it "
                        "again",
    [WHY_REPLAY_DIED] = "the request's worker died or stopped answering, and so did the one it was run again on: "
                        "not tried a third time",
    [WHY_KV_FULL] = "the worker's KV cache is full and it has no snapshot store to evict sessions to: no new "
                    "session until a CLOSE frees one",
    [WHY_STORE] = "the worker's snapshot store failed on this request's session (a restore, the put of its "
                  "turn, a CLOSE's delete): retry it",
    [WHY_KV_LOST] = "the session's KV in the snapshot store cannot be used (a corrupt or foreign delta, a damaged "
                    "record, or a chain too large for one record): a retry meets it again, start a new session",
    [WHY_UNANSWERED] = "the worker's completion did not answer this request (a fault of the worker)",
    [WHY_CONFLICT] = "this request (its id and send stamp) already ran on its session and was answered: not run "
                     "again",
    [WHY_CONTEXT] = "the session's context and this prompt would pass the model's context length: start a new "
                    "session, or send less",
    [WHY_TOKENS] = "a token of the prompt is outside the model's vocabulary",
    [WHY_ORDER] = "the worker found this request's records out of order (a fault of the data path, not of the "
                  "request)",
    [WHY_RAN] = "this request already ran and was answered 200 (that answer may have been lost on its way): not "
                "run again, its turn is in the session; send it under a new request id to run it again",
};

/* {"status": status, "error": said[why]} in body (DP_MAX_RESP_BODY bytes); its length */
static int error_body(char *body, uint16_t status, enum why why)
{
    int n = snprintf(body, DP_MAX_RESP_BODY, "{\"status\":%u,\"error\":\"%s\"}", status, said[why]);
    return n < DP_MAX_RESP_BODY ? n : DP_MAX_RESP_BODY - 1;
}

/* A finished request's answer: its tokens, or its failure's status with a body saying why if the
 * router knows. */
static int emit_done(struct dp_router *rt, const struct req *r)
{
    int len = r->status && r->why ? error_body(rt->done_body, r->status, (enum why)r->why) : 0;
    return emit(rt, r, r->status ? r->status : DP_STATUS_OK, r->request_id, r->session_id, r->tenant, NULL,
                len ? rt->done_body : NULL, (uint32_t)len);
}

/* Why a worker refused a record of r, from its entry: its status tells, or for a 503 its flags (a
 * 503 whose reason the worker did not flag: WHY_NONE). A 400 is about the vocabulary: the router
 * never sends the worker's other 400s (a record not a chunk, a token count out of range). A KV-full
 * refusal of a decode step breaks the worker's contract (the session is there already): no reason
 * said, as "no new session" would be false. */
static enum why worker_why(const struct req *r, const struct dp_completion_entry *e)
{
    switch (e->status) {
    case DP_STATUS_CONFLICT: return WHY_CONFLICT;
    case DP_STATUS_TOO_LARGE: return WHY_CONTEXT;
    case DP_STATUS_BAD_REQUEST: return WHY_TOKENS;
    case DP_STATUS_UNPROCESSABLE: return WHY_ORDER;
    case DP_STATUS_UNAVAILABLE:
        return e->flags & DP_CE_KV_FULL ? (r->state == REQ_DECODE ? WHY_NONE : WHY_KV_FULL)
               : e->flags & DP_CE_STORE ? WHY_STORE : e->flags & DP_CE_KV_LOST ? WHY_KV_LOST
               : e->flags & DP_CE_UNANSWERED ? WHY_UNANSWERED : WHY_NONE;
    default: return WHY_NONE;
    }
}

/* Keys are 64-bit hashes: a false match needs two live keys to collide in all 64 bits. A key is
 * forgotten once 8 newer ones landed in its set. Direct-mapped (4096 entries), any one finishing
 * request with the same 12 bits made it forget: a refused request's later chunks were then taken
 * for a new request, admitted or refused again, its client answered twice. Each key keeps its
 * try (DP_TRY_OF), to tell a client's retry from a straggler (recently_done). */
static void remember_done(struct dp_router *rt, uint64_t key, uint64_t try, int ran)
{
    uint32_t set = (key >> 32) & ((1u << RECENT_SET_BITS) - 1), k = rt->recent_next[set];
    rt->recent[set * RECENT_WAYS + k] = key;
    rt->recent_sent[set * RECENT_WAYS + k] = try;
    rt->recent_ran[set] = (uint8_t)((rt->recent_ran[set] & ~(1u << k)) | (unsigned)!!ran << k);
    rt->recent_next[set] = (uint8_t)((k + 1) % RECENT_WAYS);
}

/* A request refused at its record c, before it had a slot: remembered as its try. */
static void remember_refused(struct dp_router *rt, uint64_t key, const struct dp_chunk *c)
{
    remember_done(rt, key, DP_TRY_OF(c->t_send, c->kind == DP_KIND_OPEN), 0);
}

enum done { NOT_DONE, DONE_REPEAT, DONE_RAN };

/* Has record c's request (key) finished lately? NOT_DONE if not, or if c is a client's retry of it
 * under the same ids (chunk.h, DP_REOPENS) after the latest try, which ended without running: a
 * retry the answer asked for (a 429's retry_after, a 503's "retry") was dropped unanswered as a
 * late duplicate for thousands of requests more (found by review). DONE_REPEAT if c is one of the
 * latest try's stragglers or repeats. DONE_RAN if c is a retry of a request whose turn ran
 * (answered 200): run again, it would put its turn in the session twice (ran_already). */
static enum done recently_done(const struct dp_router *rt, uint64_t key, const struct dp_chunk *c)
{
    uint32_t set = (key >> 32) & ((1u << RECENT_SET_BITS) - 1), base = set * RECENT_WAYS;
    uint64_t latest = 0;
    int hit = 0, ran = 0;
    for (uint32_t i = 0; i < RECENT_WAYS; i++)
        if (rt->recent[base + i] == key) {
            hit = 1;
            ran |= rt->recent_ran[set] >> i & 1;
            latest = rt->recent_sent[base + i] > latest ? rt->recent_sent[base + i] : latest;
        }
    if (!hit)
        return NOT_DONE;
    if (!DP_REOPENS(c->kind, c->chunk_index, c->t_send, latest))
        return DONE_REPEAT;
    return ran ? DONE_RAN : NOT_DONE;
}

/* A request that failed after a worker holding some of it died (a failover with nowhere to go, its
 * replay's worker dead too): that worker may have put its turn in the store before dying. The
 * client's retry under the same ids is a new request, and it ran on top of that turn: the prompt
 * twice in the context, a 200 with other tokens, and every later turn of the session off (a
 * review's probes: the only worker killed after its put; a replay's worker killed after its put).
 * Remembered here: the retry goes to its worker as this try's retake (lost_retake), and the
 * worker takes that turn back out of the store if it is the chain's last (worker.py, _restore:
 * by request id and this stamp, so a turn of another request is never taken). */
static void lost_note(struct dp_router *rt, const struct req *r)
{
    struct lost *l = &rt->lost[r->key % LOST_SLOTS];
    uint64_t now = pass_clock(rt);
    rt->st.lost_forgotten += l->key && l->key != r->key && now - l->at < LOST_TTL_NS;   /* its retry goes plain */
    *l = (struct lost){ r->key, r->t_send, DP_TRY_OF(r->t_try, r->by_open), now };
    rt->st.lost_tries++;
}

/* A new request r opened by record c: a client's retry of a try lost in a failover within the last
 * minute? It is sent to its worker under that try's stamp (r->t_send; the answer carries its own,
 * r->t_try), flagged REPLAY, its first record RETAKE too (the worker begins the request again
 * there). Once: the entry goes. (Kept for ever, a request that reused the id much later went as
 * a retake: a needless restore on its worker; a review.) */
static void lost_retake(struct dp_router *rt, struct req *r, const struct dp_chunk *c)
{
    struct lost *l = &rt->lost[r->key % LOST_SLOTS];
    if (l->key != r->key || !l->key || !DP_REOPENS(c->kind, c->chunk_index, c->t_send, l->try))
        return;
    if (pass_clock(rt) - l->at >= LOST_TTL_NS) {
        l->key = 0;
        return;
    }
    r->t_send = l->attempt;
    r->retake = 2;
    l->key = 0;
    rt->st.lost_retaken++;
}

static void free_list(struct dp_router *rt, uint32_t p)
{
    for (uint32_t next; p != NIL; p = next) {
        next = rt->pool[p].next;
        pool_put(rt, p);
    }
}

/* --- chunks that came early: each is on its request's ooo list (to free them all) and in the
 * early index, so a chunk's successor and a duplicate are found in one probe, not along the list:
 * a 2,048-chunk request sent in reverse took ~n^2/2 steps of the router's one thread (review). */
static size_t early_slots(uint32_t pool_chunks)   /* a power of two, at least twice the pool: never full */
{
    size_t n = 16;
    while (n < 2 * (size_t)pool_chunks)
        n <<= 1;
    return n;
}

static uint64_t early_key(uint32_t ri, uint16_t idx)
{
    return dp_hash64((uint64_t)ri << 16 | idx);     /* a bijection: equal keys, the same chunk */
}

static uint32_t early_find(const struct dp_router *rt, uint32_t ri, uint16_t idx)
{
    uint64_t key = early_key(ri, idx);
    uint32_t i = (uint32_t)key & rt->early.mask;
    while (rt->early.e[i].slot != NIL && rt->early.e[i].key != key)
        i = (i + 1) & rt->early.mask;
    return rt->early.e[i].slot;
}

static void early_park(struct dp_router *rt, uint32_t ri, uint32_t p)
{
    struct req *r = &rt->reqs[ri];
    rt->pool[p].prev = NIL;
    rt->pool[p].next = r->ooo;
    if (r->ooo != NIL)
        rt->pool[r->ooo].prev = p;
    r->ooo = p;
    index_add(&rt->early, early_key(ri, rt->pool[p].c.chunk_index), p);
}

static void early_take(struct dp_router *rt, uint32_t ri, uint32_t p)
{
    struct pooled *x = &rt->pool[p];
    if (x->prev != NIL)
        rt->pool[x->prev].next = x->next;
    else
        rt->reqs[ri].ooo = x->next;
    if (x->next != NIL)
        rt->pool[x->next].prev = x->prev;
    x->next = NIL;
    index_move(&rt->early, early_key(ri, x->c.chunk_index), p, NIL);
}

static void early_drop(struct dp_router *rt, uint32_t ri)
{
    while (rt->reqs[ri].ooo != NIL) {
        uint32_t p = rt->reqs[ri].ooo;
        early_take(rt, ri, p);
        pool_put(rt, p);
    }
}

static int is_hidden(const struct dp_router *rt, int k);
static int stall_move(struct dp_router *rt, uint32_t ri, int k);

/* Request ri goes on its worker's FIFO if it has something to schedule there and
 * waits for nothing: dynamic, pending chunks; static, all its chunks. */
static void make_ready(struct dp_router *rt, uint32_t ri)
{
    struct req *r = &rt->reqs[ri];
    /* a down worker's requests are being moved (failover): queued there, one stayed behind on
     * its queue after the move, and a worker set up again then read a freed slot */
    if (r->held || r->in_fifo || r->in_set || r->state != REQ_PREFILL || !rt->view.up[r->worker])
        return;
    /* let go (its session's request before ended), or its chunks come, on a stalled worker that
     * has none of it: placed again (left there, it waited for the worker while others idled) */
    if (rt->w[r->worker].stalled && !r->t_worker && !r->close && is_hidden(rt, r->worker) &&
        stall_move(rt, ri, r->worker))
        return;
    if (rt->cfg.batching == DP_BATCH_DYNAMIC ? r->pending_head != NIL : r->next_index == r->chunk_count) {
        r->t_ready = pass_clock(rt);
        fifo_push(rt, &rt->w[r->worker], ri);
    }
}

/* --- sessions: one request at a time ------------------------------------------------
 * A session's requests continue one KV cache, so they run in arrival order, one
 * at a time: a request arriving while an earlier one of its session is
 * unfinished is held (its chunks are buffered, nothing is scheduled) until that
 * one ends; then the worker that runs it has the predecessor's KV resident or
 * durable in the store (workers snapshot before they complete). Without this an
 * open-loop client outrunning the workers would have two requests of a session
 * interleave on one cache. */
/* The session's latest request, unfinished (NIL: none): the one a new request of it is held behind. */
static uint32_t session_latest(const struct dp_router *rt, const struct dp_chunk *c)
{
    return index_find(rt, &rt->by_session, session_key(rt, c->tenant, c->session_id), c, 0);
}

/* last: session_latest, asked before ri was taken */
static void session_join(struct dp_router *rt, uint32_t ri, const struct dp_chunk *c, uint32_t last)
{
    struct req *r = &rt->reqs[ri];
    uint64_t sk = session_key(rt, c->tenant, c->session_id);
    r->session_prev = last;
    r->session_next = NIL;
    r->in_session = 1;
    if (last == NIL) {
        index_add(&rt->by_session, sk, ri);
        return;
    }
    rt->reqs[last].session_next = ri;
    index_move(&rt->by_session, sk, last, ri);
    r->held = 1;
    rt->st.held++;
}

static void arriving_done(struct dp_router *rt, struct req *r);

/* Request ri has ended (answered, refused or expired): unlink it; the next one of its session may run. */
static void session_leave(struct dp_router *rt, uint32_t ri)
{
    struct req *r = &rt->reqs[ri];
    uint32_t prev = r->session_prev, next = r->session_next;
    if (!r->in_session)
        return;
    r->in_session = 0;
    if (next == NIL)                     /* it was the latest: the index points at the one before, if any */
        index_move(&rt->by_session, session_key(rt, r->tenant, r->session_id), ri, prev);
    else
        rt->reqs[next].session_prev = prev;
    if (prev != NIL) {
        rt->reqs[prev].session_next = next;
    } else if (next != NIL) {
        struct req *n = &rt->reqs[next];
        n->held = 0;
        if (n->received == n->chunk_count)
            arriving_done(rt, n);        /* neither missing chunks nor held: its tenant's share lets it go */
        make_ready(rt, next);
    }
}

/* --- a tenant's share of the router --------------------------------------------------------
 * An admitted request reserves pool room for every chunk it announces until they come, and a
 * request slot; one whose chunks never come is refunded whole when it expires. So that one
 * tenant cannot hold the router with requests it never completes (one OPEN announcing the whole
 * pool, a table of OPENs, requests sent but for their last chunk: at no cost, and again every
 * second), its requests still missing chunks may hold at most 1/TENANT_SHARE of the pool (their
 * chunks, come or promised) and of the request table; so may those held behind an earlier
 * request of their session (one-chunk requests and CLOSEs too: a session's requests sent faster
 * than they ran held every slot, and the others were refused 503 table_full; found by review);
 * beyond, a new one is answered 503
 * (tenant_share_refused), and a request of more chunks than a share is refused 400 by admission
 * (dp_adm_set_max_chunks). Tenant ids are the client's word: a client that makes them up still
 * fills the router, but one tenant's failure no longer takes the others down. */
#define TENANT_SHARE 4

static uint32_t share_chunks(const struct dp_router_config *c)
{
    return c->pool_chunks >= TENANT_SHARE ? c->pool_chunks / TENANT_SHARE : 1;
}

static uint64_t tenant_key(const struct dp_router *rt, uint32_t tenant)
{
    return dp_hash64(tenant ^ rt->key_secret);
}

/* The tenant's entry in arr (NIL: nothing of it arriving). */
static uint32_t arriving_find(const struct dp_router *rt, uint32_t tenant, uint64_t key)
{
    for (uint32_t i = (uint32_t)key & rt->by_tenant.mask;; i = (i + 1) & rt->by_tenant.mask) {
        uint32_t a = rt->by_tenant.e[i].slot;
        if (a == NIL || (rt->by_tenant.e[i].key == key && rt->arr[a].tenant == tenant))
            return a;
    }
}

static int over_share(const struct dp_router *rt, uint32_t tenant, uint32_t chunk_count, const struct arriving **e)
{
    uint32_t a = arriving_find(rt, tenant, tenant_key(rt, tenant));
    *e = a != NIL ? &rt->arr[a] : NULL;
    return *e && ((*e)->chunks + chunk_count > share_chunks(&rt->cfg) ||
                  (*e)->requests >= rt->cfg.max_requests / TENANT_SHARE);
}

/* Request r, just admitted, misses its chunks: its tenant's entry counts it (an entry is free:
 * fewer tenants have requests arriving than there are request slots, r's taken already). */
static void arriving_add(struct dp_router *rt, struct req *r)
{
    uint64_t key = tenant_key(rt, r->tenant);
    uint32_t a = arriving_find(rt, r->tenant, key);
    if (a == NIL) {
        a = rt->arr_free;
        rt->arr_free = rt->arr[a].next_free;
        rt->arr[a] = (struct arriving){ .tenant = r->tenant };
        index_add(&rt->by_tenant, key, a);
    }
    r->arr = a;
    rt->arr[a].requests++;
    rt->arr[a].chunks += r->chunk_count;
}

/* r misses no chunk any more (its last came, or it ended): its tenant's entry lets it go. */
static void arriving_done(struct dp_router *rt, struct req *r)
{
    if (r->arr == NIL)
        return;
    uint32_t a = r->arr;
    struct arriving *e = &rt->arr[a];
    e->chunks -= r->chunk_count;
    r->arr = NIL;
    if (--e->requests)
        return;
    index_move(&rt->by_tenant, tenant_key(rt, e->tenant), a, NIL);   /* nothing arriving: it goes */
    e->next_free = rt->arr_free;
    rt->arr_free = a;
}

/* A decision the chunk's placement did not depend on (admission.h, DP_ADM_LAZY) is priced and
 * committed after the pass placed the chunk: the entropy pass (~80 ns of a ~170 ns decision in the
 * path) off its way to the lane. It runs before anything else reads or writes the admission's state
 * or ends the request (the next decision, a failure, the request's end, the pass's end), so the
 * tenant's state and every charge are as if it had been committed at once. */
static void price_admitted(struct dp_router *rt)
{
    uint32_t ri = rt->unpriced;
    if (ri == NIL)
        return;
    rt->unpriced = NIL;
    struct req *r = &rt->reqs[ri];
    const struct dp_chunk *c = &rt->pool[rt->unpriced_chunk].c;
    dp_adm_finish(rt->adm, &r->adm, c->tokens);
    dp_adm_commit(rt->adm, r->tenant, &r->adm, c->t_router);
}

static int xdp_cut(const struct dp_router *rt, uint64_t session_id, uint64_t request_id, uint32_t tenant,
                   uint64_t t_xdp, uint64_t sent);
static void cut_at_xdp(const struct dp_router *rt, uint64_t session_id, uint64_t request_id, uint32_t tenant,
                       uint64_t try);
static int bucketed(const struct dp_router *rt, uint32_t tenant);
static void move_unrun(struct dp_router *rt, uint32_t ri, int nk);

/* Request r ends without having run whole (failed, expired): its worker's copy of the session may
 * lack turns run elsewhere, and the session's later requests were flagged as if r had run there.
 * Before session_leave (its later requests are still linked). */
static void not_run(struct dp_router *rt, const struct req *r)
{
    for (uint32_t n = r->session_next; n != NIL; n = rt->reqs[n].session_next)
        rt->reqs[n].moved = 1;
    uint64_t sk = session_key(rt, r->tenant, r->session_id);
    forget_run(rt, sk, r->worker);
    /* r never reached its worker's lane: a CLOSE held behind it went where r was to run
     * (close_session), a worker that never held the session, whose holder kept it (found by
     * review). It goes where the session is, as a failover's does: where the request before r is,
     * or was before r was placed (was_on). (On a worker down, failover places it, its pass having
     * taken that worker's depth back; one that ran some of r there may hold the session too.) */
    uint32_t ci = r->in_session ? r->session_next : NIL;
    if (ci != NIL && !r->t_worker && rt->reqs[ci].close && rt->reqs[ci].held && rt->reqs[ci].worker == r->worker &&
        rt->view.up[r->worker]) {
        int home = session_home(rt, sk, r->session_prev);
        if (home < 0 && r->was_on >= 0 && rt->view.up[r->was_on])
            home = r->was_on;
        if (home >= 0 && home != r->worker) {
            rt->reqs[ci].pool = rt->w[home].pool;
            rt->pools[rt->reqs[ci].pool].requests++;
            move_unrun(rt, ci, home);
        }
    }
}

/* static batching: ri leaves worker w's running batch */
static void set_remove(struct worker *w, uint32_t ri)
{
    for (uint32_t s = 0; s < w->n_set; s++)
        if (w->set[s] == ri) {
            w->set[s] = w->set[--w->n_set];
            return;
        }
}

static void finish(struct dp_router *rt, uint32_t ri)
{
    price_admitted(rt);
    struct req *r = &rt->reqs[ri];
    struct worker *w = &rt->w[r->worker];
    if (r->status)
        not_run(rt, r);
    /* failed before its last chunk came: cut at XDP as it is answered, or, cut there already (the
     * bucket's 429 was its answer), not answered again (found by review) */
    int silent = 0;
    if (r->status && r->received < r->chunk_count && bucketed(rt, r->tenant)) {
        silent = xdp_cut(rt, r->session_id, r->request_id, r->tenant, r->t_xdp, r->t_send_max);
        if (!silent)
            cut_at_xdp(rt, r->session_id, r->request_id, r->tenant, DP_TRY_OF(r->t_try, r->by_open));
    }
    uint32_t next = r->in_session ? r->session_next : NIL;   /* (session_leave unlinks it) */
    session_leave(rt, ri);
    remember_done(rt, r->key, DP_TRY_OF(r->t_try, r->by_open), !r->status);
    if (r->status && r->unsure)
        lost_note(rt, r);
    policy_done(rt, r);
    unpark(rt, r);                       /* (after: policy_done tells a parked one's apart) */
    if (!r->status)
        w->st.answered++;
    if (r->close && !r->status && rt->st.kv_homes)   /* done with the session: its id starts afresh */
        kv_home_follow(rt, session_key(rt, r->tenant, r->session_id), next);
    /* the minute's bucket keeps what came and ran, unless the failure is the system's (503: no
     * worker, a store that failed), which must not rate-limit the tenant; a request whose replay
     * killed a second worker is counted its own (it went free, again and again: found by review) */
    int theirs = r->status != DP_STATUS_UNAVAILABLE || r->why == WHY_REPLAY_DIED;
    dp_adm_settle(rt->adm, r->tenant, &r->adm, theirs ? r->tokens_in : 0, theirs ? r->generated : 0, r->status == 0);
    rt->reserved -= r->chunk_count - r->received;   /* a failed request's missing chunks need no room now */
    rt->w[r->worker].promised -= r->chunk_count - r->received;
    arriving_done(rt, r);
    r->received = r->chunk_count;
    free_list(rt, r->sent_head);        /* no replay needed any more */
    r->sent_head = r->sent_tail = NIL;
    if (r->in_set) {                    /* static: leave the running batch now, before the slot is reused */
        set_remove(w, ri);
        r->in_set = 0;
    }
    r->state = REQ_DONE;
    r->fifo_next = NIL;
    if (silent) {
        rt->st.xdp_cut++;
        req_free(rt, ri);
        return;
    }
    if (rt->done_head == NIL && emit_done(rt, r)) {
        rt->st.responses++;
        req_free(rt, ri);
        return;
    }
    rt->st.egress_stalls++;             /* keep it until the egress ring has room */
    if (rt->done_tail == NIL)
        rt->done_head = ri;
    else
        rt->reqs[rt->done_tail].fifo_next = ri;
    rt->done_tail = ri;
}

static uint32_t flush_done(struct dp_router *rt)
{
    uint32_t n = 0;
    while (rt->done_head != NIL) {
        uint32_t ri = rt->done_head;
        struct req *r = &rt->reqs[ri];
        if (!emit_done(rt, r))
            break;
        rt->done_head = r->fifo_next;
        if (rt->done_head == NIL)
            rt->done_tail = NIL;
        rt->st.responses++;
        req_free(rt, ri);
        n++;
    }
    return n;
}

/* --- ingest ------------------------------------------------------------------------- */

static void pending_append(struct dp_router *rt, struct req *r, uint32_t p)
{
    rt->pool[p].next = NIL;
    if (r->pending_tail == NIL)
        r->pending_head = p;
    else
        rt->pool[r->pending_tail].next = p;
    r->pending_tail = p;
}

/* Chunk p (pool index) of request ri arrived: queue it in order, then any early successors. */
static void accept_chunk(struct dp_router *rt, uint32_t ri, uint32_t p)
{
    struct req *r = &rt->reqs[ri];
    uint16_t idx = rt->pool[p].c.chunk_index;
    if (idx != r->next_index) {          /* early: park it */
        early_park(rt, ri, p);
        return;
    }
    for (;;) {
        pending_append(rt, r, p);
        depth_add(rt, r->worker, 1, chunk_tokens(rt, p));
        r->next_index++;
        /* is its successor parked? */
        if (r->ooo == NIL || (p = early_find(rt, ri, r->next_index)) == NIL)
            break;
        early_take(rt, ri, p);
    }
    make_ready(rt, ri);
}

static int bad_chunk(const struct dp_chunk *c)
{
    return c->n_tokens < 1 || c->n_tokens > DP_MAX_CHUNK_TOKENS || c->chunk_count < 1 ||
           c->chunk_index >= c->chunk_count;
}

static void fail_request(struct dp_router *rt, int wk, uint32_t ri, uint16_t status, enum why why);

/* Answered without a request slot: a refusal at first sight (with admission's body), or a price.
 * A refused request of several chunks is answered once: not at all if the XDP bucket has cut it
 * already (its 429 was the answer), and cut there once answered, so a bucket that runs dry on
 * one of its later chunks does not answer it a second time (found by review). */
static int answer(struct dp_router *rt, const struct dp_chunk *c, uint16_t status, const char *body, uint32_t len)
{
    /* as XDP's: a CLOSE or a COUNT_TOKENS is never cut there (found by review) */
    int several = status != DP_STATUS_OK && DP_CUTTABLE(c->kind, c->chunk_count) && bucketed(rt, c->tenant);
    if (several && xdp_cut(rt, c->session_id, c->request_id, c->tenant, c->t_xdp, c->t_send)) {
        rt->st.xdp_cut++;
        return 1;
    }
    if (!emit(rt, NULL, status, c->request_id, c->session_id, c->tenant, c, body, len))
        return 0;
    rt->st.responses++;
    if (several)
        cut_at_xdp(rt, c->session_id, c->request_id, c->tenant, DP_TRY_OF(c->t_send, c->kind == DP_KIND_OPEN));
    return 1;
}

/* Record c is a client's retry of its request (key), answered 200 lately (recently_done's DONE_RAN).
 * Its turn ran: run again, it would be in the session twice. It was dropped as a late duplicate,
 * and a client whose 200 was lost on its way (UDP; the responder's drops) heard nothing however
 * often it retried (found by review). Answered 409 once a retry, saying so, and remembered as a try
 * that ran: the retry's own repeats and stragglers are dropped. 0: no room for the answer now. */
static int ran_already(struct dp_router *rt, const struct dp_chunk *c, uint64_t key)
{
    char body[DP_MAX_RESP_BODY];
    if (!answer(rt, c, DP_STATUS_CONFLICT, body, (uint32_t)error_body(body, DP_STATUS_CONFLICT, WHY_RAN)))
        return 0;
    rt->st.retries_ran++;
    remember_done(rt, key, DP_TRY_OF(c->t_send, c->kind == DP_KIND_OPEN), 1);
    return 1;
}

/* Slot ri, just taken, becomes the request that chunk c (its first, or its OPEN or CLOSE) names,
 * placed on worker wk of pool `pool`. */
static struct req *req_init(struct dp_router *rt, uint32_t ri, const struct dp_chunk *c, uint64_t key, uint64_t t,
                            int wk, uint16_t pool)
{
    struct req *r = &rt->reqs[ri];
    memset(r, 0, offsetof(struct req, out));
    r->key = key;
    r->flags = c->flags & DP_FLAG_TRACE;   /* the first chunk's (or OPEN's) ask decides */
    r->request_id = c->request_id;
    r->session_id = c->session_id;
    r->tenant = c->tenant;
    r->max_output = c->max_output_tokens;
    r->chunk_count = c->chunk_count;
    r->worker = (int16_t)(wk < 0 ? 0 : wk);   /* -1: to be parked (park), on worker 0, down as every one */
    r->pool = pool;
    uint64_t sk = session_key(rt, c->tenant, c->session_id);
    const struct last_run *e = last_run_of(rt, sk);
    r->was_on = (int16_t)(e->session == sk ? e->worker : -1);
    if (wk >= 0) {                       /* (a parked one's, once placed: place_again) */
        r->moved = note_run(rt, sk, wk);
        rt->w[wk].st.placed++;
    }
    r->state = REQ_PREFILL;
    r->arr = NIL;
    r->pending_head = r->pending_tail = r->ooo = r->fifo_next = NIL;
    r->sent_head = r->sent_tail = NIL;
    r->t_send = r->t_try = r->t_send_max = c->t_send;
    r->by_open = c->kind == DP_KIND_OPEN;
    r->t_xdp = c->t_xdp;
    r->t_last = t;
    r->t_in = t;
    r->client_ip = c->client_ip;
    r->client_port = c->client_port;
    return r;
}

/* While no worker is up and the control plane says one is coming (dp_router_hold: a replacement is
 * starting), a request answered 503 for want of a worker waits instead: parked (park). */
static int holding(struct dp_router *rt)
{
    return rt->hold_until && rt->view.n && pass_clock(rt) < rt->hold_until;
}

static void park(struct dp_router *rt, struct req *r, int k, uint8_t how, enum why why);

/* e: for WHY_SHARE, the tenant's requests arriving, said too */
static int unavailable(struct dp_router *rt, const struct dp_chunk *c, enum why why, const struct arriving *e)
{
    char body[DP_MAX_RESP_BODY];
    int n = why == WHY_SHARE
        ? snprintf(body, sizeof(body), "{\"status\":503,\"error\":\"%s\",\"requests_arriving\":%u,"
                   "\"their_chunks\":%u,\"share_chunks\":%u,\"share_requests\":%u}", said[why],
                   e->requests, e->chunks, share_chunks(&rt->cfg), rt->cfg.max_requests / TENANT_SHARE)
        : error_body(body, DP_STATUS_UNAVAILABLE, why);
    return answer(rt, c, DP_STATUS_UNAVAILABLE, body, (uint32_t)(n < (int)sizeof(body) ? n : (int)sizeof(body) - 1));
}

/* A request seen for the first time (its first chunk, or its OPEN): admission, then a pool and a
 * worker. Returns 0 if its refusal found no egress room (nothing changed: the record is tried again),
 * else 1 with *out its new slot, or NIL if it was answered. */
static int admit(struct dp_router *rt, const struct dp_chunk *c, uint64_t t, uint64_t key, uint32_t *out)
{
    char body[DP_MAX_RESP_BODY];
    struct dp_adm_decision d;
    price_admitted(rt);
    /* lazy for a chunk (ingest keeps its tokens in the pool until price_admitted); an OPEN has none */
    uint32_t len = dp_adm_decide(rt->adm, c->tenant, c->tokens, c->n_tokens, c->chunk_count, c->max_output_tokens,
                                 c->kind == DP_KIND_CHUNK ? DP_ADM_LAZY : 0, t, &d, body, sizeof(body));
    *out = NIL;
    if (d.status != DP_STATUS_OK) {
        if (!answer(rt, c, d.status, body, len))
            return 0;
        dp_adm_commit(rt->adm, c->tenant, &d, t);
        remember_refused(rt, key, c);   /* its other chunks are not a new request */
        if (d.status == DP_STATUS_BAD_REQUEST)
            rt->st.adm_oversized++;
        else if (d.status == DP_STATUS_UNPROCESSABLE)
            rt->st.adm_over_budget++;
        else if (d.status == DP_STATUS_RATE_LIMITED)
            rt->st.adm_rate_limited++;
        else
            rt->st.adm_no_slot++;
        return 1;
    }
    /* a one-chunk request is whole as it is admitted: unless it is held behind an earlier request
     * of its session it holds nothing, so the share is neither asked nor kept for it (nothing
     * added to the path of most requests: the session lookup is session_join's, done earlier) */
    int whole = c->kind == DP_KIND_CHUNK && c->chunk_count == 1;
    uint32_t before = session_latest(rt, c);
    int shared = !whole || before != NIL;
    const struct arriving *e;
    if (shared && over_share(rt, c->tenant, c->chunk_count, &e)) {
        if (!unavailable(rt, c, WHY_SHARE, e))
            return 0;
        remember_refused(rt, key, c);
        rt->st.tenant_share_refused++;
        return 1;
    }
    /* the chunk pool must hold this request's chunks besides those promised to requests still
     * arriving, or it is refused now (a full pool would stall the chunks that finish them) */
    int room = rt->st.pool_free >= (uint32_t)c->chunk_count + rt->reserved, spilled = 0;
    uint16_t pool = 0;
    struct dp_request rq = request_of(c, t);
    int wk = room && rt->req_free != NIL ? pick_worker(rt, &rq, d.spill, &pool, &spilled) : -1;
    int parks = wk == -1 && room && rt->req_free != NIL && holding(rt);   /* no worker up, one coming */
    uint32_t ri = wk < 0 && !parks ? NIL : req_insert(rt, key);   /* a free slot was checked: cannot fail */
    if (ri == NIL) {
        if (!unavailable(rt, c, !room ? WHY_POOL : rt->req_free == NIL ? WHY_TABLE
                                : wk == -2 ? WHY_BAD_PICK : WHY_NO_WORKER, NULL))
            return 0;
        remember_refused(rt, key, c);
        if (!room)
            rt->st.pool_refused++;
        else if (rt->req_free == NIL)
            rt->st.table_full++;
        else
            rt->st.no_worker++;
        rt->st.bad_picks += wk == -2;
        return 1;
    }
    if (d.priced)
        dp_adm_commit(rt->adm, c->tenant, &d, t);
    rt->st.admitted++;
    rt->st.to_secondary += (uint64_t)spilled;
    rt->reserved += c->chunk_count;     /* each chunk takes one back as it comes */
    struct req *r = req_init(rt, ri, c, key, t, wk, pool);
    rt->w[r->worker].promised += c->chunk_count;
    if (parks)
        park(rt, r, 0, PARK_NEW, WHY_NO_WORKER);
    if (shared)
        arriving_add(rt, r);
    r->spill = d.spill;
    r->adm = d;
    session_join(rt, ri, c, before);
    if (rt->st.lost_tries)               /* (none lost, nothing to look up: the common path) */
        lost_retake(rt, r, c);
    rt->st.requests_in++;
    *out = ri;
    return 1;
}

/* COUNT_TOKENS: priced like the request it announces, answered 200 with the breakdown; nothing runs. */
static int count_tokens(struct dp_router *rt, const struct dp_chunk *c, uint64_t t)
{
    char body[DP_MAX_RESP_BODY];
    struct dp_adm_decision d;
    /* a repeat (its ids and send stamp: the network's duplicate) is answered once, as any other
     * record: it was answered every time (found by review). Not in the done cache: a count's ids
     * may be its request's, which must still run. */
    uint64_t seen = dp_hash64(chunk_key(rt, c) ^ c->t_send) | 1, *slot = &rt->counted[seen % COUNTED_SLOTS];
    if (*slot == seen) {
        rt->st.late_duplicates++;
        return 1;
    }
    price_admitted(rt);
    uint32_t len = dp_adm_decide(rt->adm, c->tenant, c->tokens, c->n_tokens, c->chunk_count, c->max_output_tokens,
                                 DP_ADM_COUNT_ONLY, t, &d, body, sizeof(body));
    if (!answer(rt, c, DP_STATUS_OK, body, len))
        return 0;
    *slot = seen;
    dp_adm_commit(rt->adm, c->tenant, &d, t);
    rt->st.adm_counted++;
    return 1;
}

/* CLOSE: the client is done with the session. It runs like a request of the session (after the
 * ones before it, one record, no tokens, nothing to generate, not priced) on the worker that holds
 * the session, whatever pool the placement rule would choose now (else the policy's pick), which
 * frees the session's KV and its snapshots; its completion is answered 200. Sent to the policy's
 * pick in the pool chosen now, the CLOSE of a session a spill had taken to the secondary pool went
 * to the primary, and a store-less secondary worker kept its copy for good (found by review). A
 * repeat of a CLOSE still running or just answered is counted, not run twice. */
static int close_session(struct dp_router *rt, const struct dp_chunk *c, uint64_t t, uint64_t key, uint32_t ri,
                         int fed)
{
    enum done done = ri == NIL ? recently_done(rt, key, c) : NOT_DONE;
    if (done == DONE_RAN)
        return ran_already(rt, c, key);
    if (ri != NIL || done) {
        rt->st.control_in++;
        return 1;
    }
    int spilled;
    uint16_t pool = 0;
    uint32_t before = session_latest(rt, c);
    const struct arriving *e = NULL;
    int over = before != NIL && over_share(rt, c->tenant, 1, &e);     /* held: in the tenant's share */
    int wk = -1;
    if (!over && rt->st.pool_free > rt->reserved && rt->req_free != NIL) {
        wk = session_home(rt, session_key(rt, c->tenant, c->session_id), before);
        if (wk >= 0) {
            pool = rt->w[wk].pool;
            rt->pools[pool].requests++;
        } else {
            struct dp_request rq = { c->session_id, c->tenant, 0, 0, 1, t };   /* one record, nothing to run */
            wk = pick_worker(rt, &rq, 0, &pool, &spilled);
        }
    }
    int parks = wk == -1 && !over && rt->st.pool_free > rt->reserved && rt->req_free != NIL && holding(rt);
    if (wk < 0 && !parks) {
        if (!unavailable(rt, c, over ? WHY_SHARE : rt->st.pool_free <= rt->reserved ? WHY_POOL
                                    : rt->req_free == NIL ? WHY_TABLE : wk == -2 ? WHY_BAD_PICK : WHY_NO_WORKER, e))
            return 0;
        remember_refused(rt, key, c);
        rt->st.tenant_share_refused += (uint64_t)over;
        rt->st.bad_picks += wk == -2;
        return 1;
    }
    ri = req_insert(rt, key);
    struct req *r = req_init(rt, ri, c, key, t, wk, pool);
    if (parks)
        park(rt, r, 0, PARK_NEW, WHY_NO_WORKER);
    r->close = 1;
    r->chunk_count = 1;                  /* one record, nothing to generate */
    r->max_output = 0;
    if (before != NIL)
        arriving_add(rt, r);
    session_join(rt, ri, c, before);
    uint32_t p = pool_get(rt);
    struct dp_chunk *pc = &rt->pool[p].c;
    memcpy(pc, c, DP_CHUNK_HDR_LEN);
    pc->n_tokens = 0;
    pc->chunk_index = 0;
    pc->chunk_count = 1;
    pc->max_output_tokens = 0;
    pc->t_router = t;
    if (fed)
        pc->t_consumer = t;
    r->received = 1;
    rt->st.closed++;
    accept_chunk(rt, ri, p);
    return 1;
}

/* Record c, one of r's (repeats too), was sent at: kept for xdp_cut, which tells by it whether r
 * holds a retry that passed XDP's cut. A record that opens r again, sent later than r's try
 * (DP_REOPENS), with its chunk count, is a client's retry of it while r still waits for chunks or
 * runs: XDP's cut let it by, or the client gave up waiting. Its repeats of what r holds are
 * dropped as duplicates and its other chunks complete r, which is now the retry's try: answered
 * to the retry's address under its stamp, remembered (and cut) as its try, and given the
 * reassembly timeout from now. The answer went to the first try's address (a retry from a new
 * socket, a new port, never had it), under a stamp that made its round trip the first try's; a
 * repeat of the retry then passed as a retry of the first try; and a retry whose chunks were all
 * repeats until r's expiry was answered 400 (found by review). */
static void sent_by(struct dp_router *rt, struct req *r, const struct dp_chunk *c, uint64_t t)
{
    if (c->chunk_count == r->chunk_count && DP_REOPENS(c->kind, c->chunk_index, c->t_send,
                                                       DP_TRY_OF(r->t_try, r->by_open))) {
        r->t_try = c->t_send;            /* (not t_send: the worker has had some of it under that) */
        r->by_open = c->kind == DP_KIND_OPEN;
        r->t_xdp = c->t_xdp;
        r->client_ip = c->client_ip;
        r->client_port = c->client_port;
        r->flags = c->flags & DP_FLAG_TRACE;
        r->t_last = t;
        rt->st.retries_taken++;
    }
    if (c->t_send > r->t_send_max)
        r->t_send_max = c->t_send;
}

/* Returns 0 if the router has no room for it now (the record stays in its ring). fed: from a feed,
 * whose take stamped it once for both stages (t is its t_consumer too). */
static int ingest(struct dp_router *rt, const struct dp_chunk *c, uint64_t t, int fed)
{
    if (c->kind == DP_KIND_COUNT_TOKENS)
        return count_tokens(rt, c, t);
    if (c->kind != DP_KIND_CHUNK && c->kind != DP_KIND_OPEN && c->kind != DP_KIND_CLOSE) {
        rt->st.control_in++;
        return 1;
    }
    uint64_t key = chunk_key(rt, c);
    uint32_t ri = index_find(rt, &rt->by_id, key, c, 1);
    if (c->kind == DP_KIND_CLOSE)
        return close_session(rt, c, t, key, ri, fed);
    if (c->kind == DP_KIND_OPEN) {       /* admits the request before its chunks come */
        /* a one-chunk request's OPEN is taken without effect: its chunk carries the request whole
         * and decides it. Admitted or refused here, the request could draw two answers: the
         * OPEN's refusal and the XDP bucket's 429 to its chunk, or that 429 and a 400 at the
         * reassembly timeout (found by review) */
        enum done done = c->chunk_count > 1 && ri == NIL ? recently_done(rt, key, c) : NOT_DONE;
        if (done == DONE_RAN)
            return ran_already(rt, c, key);
        if (c->chunk_count < 2 || ri != NIL || done) {
            rt->st.control_in++;         /* that, a repeat, or too late: its chunks decided already */
            if (c->chunk_count > 1 && ri != NIL)
                sent_by(rt, &rt->reqs[ri], c, t);
            return 1;
        }
        rt->st.opened++;
        return admit(rt, c, t, key, &ri);
    }
    if (bad_chunk(c)) {                  /* the whole request is refused, once */
        if (ri != NIL) {
            rt->st.bad_chunks++;
            if (rt->reqs[ri].state != REQ_DONE)
                fail_request(rt, rt->reqs[ri].worker, ri, DP_STATUS_BAD_REQUEST, WHY_BAD_CHUNK);
            return 1;
        }
        if (recently_done(rt, key, c)) {
            rt->st.bad_chunks++;
            return 1;
        }
        char body[DP_MAX_RESP_BODY];
        if (!answer(rt, c, DP_STATUS_BAD_REQUEST, body, (uint32_t)error_body(body, DP_STATUS_BAD_REQUEST,
                                                                             WHY_BAD_CHUNK)))
            return 0;                    /* tried again, and counted then */
        rt->st.bad_chunks++;
        remember_refused(rt, key, c);
        return 1;
    }
    enum done done = ri == NIL ? recently_done(rt, key, c) : NOT_DONE;
    if (done == DONE_RAN)
        return ran_already(rt, c, key);
    if (done) {
        rt->st.late_duplicates++;        /* a repeat of a request already answered (or refused) */
        return 1;
    }
    int admitted_now = ri == NIL;
    if (admitted_now) {
        int rc = admit(rt, c, t, key, &ri);
        if (ri == NIL)
            return rc;
    }
    struct req *r = &rt->reqs[ri];
    sent_by(rt, r, c, t);
    if (r->state == REQ_PREFILL && c->chunk_count != r->chunk_count && r->received < r->chunk_count) {
        /* its chunks disagree on their count: refused at once (it was dropped as a duplicate, and the
         * request answered 400 "chunks missing" at the reassembly timeout, every chunk sent: found
         * by review) */
        rt->st.bad_chunks++;
        fail_request(rt, r->worker, ri, DP_STATUS_BAD_REQUEST, WHY_BAD_CHUNK);
        return 1;
    }
    if (r->state != REQ_PREFILL || c->chunk_count != r->chunk_count || c->chunk_index < r->next_index ||
        r->received >= r->chunk_count) {
        rt->st.duplicate_chunks++;       /* a repeat or a chunk of a request already past prefill */
        return 1;
    }
    if (r->ooo != NIL && early_find(rt, ri, c->chunk_index) != NIL) {
        rt->st.duplicate_chunks++;
        return 1;
    }
    if (rt->pool_free == NIL)
        return 0;                        /* cannot happen to an admitted request: its room is reserved */
    uint32_t p = pool_get(rt);
    struct dp_chunk *pc = &rt->pool[p].c;
    /* read once and bounded: an input slot is shared memory, and a peer rewriting it after
     * bad_chunk's check must not size this copy past the pool slot */
    uint16_t n = __atomic_load_n(&c->n_tokens, __ATOMIC_RELAXED);
    if (n > DP_MAX_CHUNK_TOKENS)
        n = DP_MAX_CHUNK_TOKENS;
    memcpy(pc, c, DP_CHUNK_HDR_LEN + n * sizeof(uint32_t));
    pc->n_tokens = n;
    pc->t_router = t;
    if (fed)
        pc->t_consumer = t;
    if (c->chunk_index == 0) {
        rt->rehearsal_from = p;          /* (copied at the pass's end, off the chunk's way) */
        if (!r->adm.p.sample_tokens && r->adm.priced)   /* priced on an assumed entropy: measured now */
            dp_adm_measure(rt->adm, &r->adm, pc->tokens, n);
    }
    if (admitted_now && !r->adm.priced) {   /* admitted on this chunk: priced on its tokens after the batch */
        rt->unpriced = ri;
        rt->unpriced_chunk = p;
    }
    rt->reserved--;                      /* a promised chunk has come */
    rt->w[r->worker].promised--;
    if (r->received + 1 == r->chunk_count && !r->held)
        arriving_done(rt, r);            /* (a held one stays in its tenant's share until it runs) */
    r->received++;
    r->tokens_in += n;
    r->t_last = t;
    rt->st.chunks_in++;
    accept_chunk(rt, ri, p);
    return 1;
}

/* A feed's take (router.h, dp_router_add_feed). */
static int take_fed(void *arg, const struct dp_chunk *c, uint64_t t)
{
    struct dp_router *rt = arg;
    rt->now = t;                         /* this pass's clock: the latest record's stamp (each record
                                            has its own, later than any read before it) */
    if (ingest(rt, c, t, 1))
        return 1;
    rt->st.input_stalls++;
    return 0;
}

typedef uint32_t (*feed_fn)(void *src, int (*take)(void *, const struct dp_chunk *, uint64_t), void *arg);

static uint32_t drain_inputs(struct dp_router *rt)
{
    uint32_t total = 0;
    uint64_t t = 0;
    if (rt->feed)
        total += ((feed_fn)rt->feed)((void *)rt->feed_src, take_fed, rt);
    for (uint32_t k = 0; k < rt->n_in; k++) {
        struct dp_ring *in = rt->in[(rt->in_cursor + k) % rt->n_in];
        uint32_t n = dp_ring_cons_peek(in, INPUT_BURST), i;
        if (!n)
            continue;
        if (!t)
            t = rt->now = now_ns();   /* the records' stamp, and this pass's clock */
        for (i = 0; i < n; i++)
            if (!ingest(rt, dp_ring_cons_slot(in, i), t, 0))
                break;
        if (i < n)
            rt->st.input_stalls++;
        dp_ring_cons_release(in, i);
        total += i;
    }
    rt->in_cursor++;
    return total;
}

/* --- lanes: one interface over shm rings and zmq sockets ----------------------------- */

static void *lane_slot(struct worker *w, uint32_t i)
{
    return w->kind == DP_LANE_SHM ? dp_ring_prod_slot(w->lane, i) : w->stage + (size_t)i * sizeof(struct dp_chunk);
}

/* Room for a full batch? (shm: free slots; zmq: always, one batch at a time: a send the socket
 * refuses, with no connection up (ZMQ_IMMEDIATE), leaves the batch unsent, due like a sent one) */
static int lane_ready(struct dp_router *rt, struct worker *w)
{
    if (w->kind != DP_LANE_SHM)
        return 1;
    uint32_t room = dp_ring_prod_reserve(w->lane, rt->cfg.max_chunks);
    if (room < rt->cfg.max_chunks)       /* the worker has not taken its last batch yet */
        dp_ring_note_full(w->lane, rt->cfg.max_chunks, room);
    return room == rt->cfg.max_chunks;
}

uint32_t dp_lane_recv(struct dp_ring *lane, struct dp_chunk *out, uint32_t max, int64_t timeout_ns,
                      uint64_t *t_pickup)
{
    if (!dp_ring_wait(lane, timeout_ns))
        return 0;
    const struct dp_chunk *first = dp_ring_cons_slot(lane, 0);
    uint32_t n = first->batch_len ? first->batch_len : 1;
    n = dp_ring_cons_peek(lane, n < max ? n : max);   /* max >= DP_MAX_BATCH_CHUNKS holds any batch */
    for (uint32_t i = 0; i < n; i++)     /* a record's own size: out is records, whatever the slot */
        memcpy(&out[i], dp_ring_cons_slot(lane, i), sizeof(*out));
    dp_ring_cons_release(lane, n);
    *t_pickup = now_ns();
    return n;
}

static int zmq_lost(struct worker *w);

/* Publish n built records as one batch; 0 if a zmq socket refused it (kept for a retry). */
static int lane_commit(struct worker *w, uint32_t n)
{
    if (w->kind == DP_LANE_SHM) {
        dp_ring_prod_commit(w->lane, n);   /* the whole batch becomes visible at once */
        return 1;
    }
    zmq_lost(w);                         /* (a connection lost before this batch is not its) */
    if (!w->zsock || zmq_send(w->zsock, w->stage, (size_t)n * sizeof(struct dp_chunk), ZMQ_DONTWAIT) < 0) {
        w->unsent = n;
        return 0;
    }
    w->unsent = 0;
    return 1;
}

static const struct dp_completion *lane_completion(struct worker *w)
{
    if (w->kind == DP_LANE_SHM)
        return w->done && dp_ring_cons_peek(w->done, 1) ? dp_ring_cons_slot(w->done, 0) : NULL;
    int n = zmq_recv(w->zsock, w->cbuf, sizeof(*w->cbuf), ZMQ_DONTWAIT);
    if (n < (int)offsetof(struct dp_completion, e))
        return NULL;
    if (n > (int)sizeof(*w->cbuf))
        n = (int)sizeof(*w->cbuf);                  /* zmq_recv says how long the message was */
    uint32_t got = ((uint32_t)n - offsetof(struct dp_completion, e)) / sizeof(struct dp_completion_entry);
    if (w->cbuf->n > got)
        w->cbuf->n = (uint16_t)got;                 /* entries past the message's end were not sent */
    return w->cbuf;
}

static void lane_completion_done(struct worker *w)
{
    if (w->kind == DP_LANE_SHM)
        dp_ring_cons_release(w->done, 1);
}

/* --- completions -------------------------------------------------------------------- */

static void decoding_remove(struct worker *w, uint32_t ri)
{
    for (uint32_t d = 0; d < w->n_decoding; d++)
        if (w->decoding[d] == ri) {
            w->decoding[d] = w->decoding[--w->n_decoding];
            return;
        }
}

static void fifo_remove(struct dp_router *rt, struct worker *w, uint32_t ri);

static void drop_pending(struct dp_router *rt, struct req *r)
{
    for (uint32_t p = r->pending_head; p != NIL; p = rt->pool[p].next)
        depth_add(rt, r->worker, -1, -chunk_tokens(rt, p));
    free_list(rt, r->pending_head);
    early_drop(rt, (uint32_t)(r - rt->reqs));
    r->pending_head = r->pending_tail = NIL;
}

/* The worker refused a record of this request: it ends with that status once
 * nothing of it is in flight; chunks still to come count as late duplicates. */
static void fail_request(struct dp_router *rt, int wk, uint32_t ri, uint16_t status, enum why why)
{
    price_admitted(rt);                 /* (before its chunks go back to the pool) */
    struct req *r = &rt->reqs[ri];
    struct worker *w = &rt->w[wk];
    if (!r->status) {
        r->status = status;
        r->why = (uint8_t)why;
    }
    if (r->in_fifo)
        fifo_remove(rt, w, ri);
    drop_pending(rt, r);
    if (r->state == REQ_DECODE) {
        decoding_remove(w, ri);
        w->st.decoding = w->n_decoding;
        depth_add(rt, wk, -1, -1);
    }
    r->state = REQ_DONE;                /* nothing more is scheduled for it */
    r->decode_left = 0;
    if (r->inflight == 0)
        finish(rt, ri);
}

/* The up worker after wk in its pool that r has not tried (kv_move), -1 if none: the walk stops
 * at the first that refused it, and after as many moves as the pool has workers (its pools
 * rebuilt meanwhile, the first may be in no longer). */
static int kv_next(const struct dp_router *rt, int wk, const struct req *r)
{
    const struct pool *pl = &rt->pools[rt->w[wk].pool];
    uint32_t n = pl->view.n, from = rt->w[wk].local;
    int first = r->kv_moves ? r->kv_first : wk;
    if ((uint32_t)r->kv_moves + 1 >= n)
        return -1;
    for (uint32_t i = 1; i < n; i++) {
        uint32_t x = (from + i) % n;
        if (pl->member[x] == first)
            return -1;
        if (pl->view.up[x])
            return pl->member[x];
    }
    return -1;
}

/* r's sent chunks go back in front of its pending ones, all from their first token, each counted
 * in worker nk's depth (a failover, a kv_move) */
static void requeue_all(struct dp_router *rt, struct req *r, int nk)
{
    r->t_worker = 0;                     /* its time on nk starts with its first record there */
    if (r->sent_tail != NIL) {
        rt->pool[r->sent_tail].next = r->pending_head;
        if (r->pending_tail == NIL)
            r->pending_tail = r->sent_tail;
        r->pending_head = r->sent_head;
        r->sent_head = r->sent_tail = NIL;
    }
    for (uint32_t p = r->pending_head; p != NIL; p = rt->pool[p].next) {
        rt->pool[p].sent = 0;
        depth_add(rt, nk, 1, chunk_tokens(rt, p));
    }
}

/* Request ri, none of it run, goes to worker nk (requeue_all), the depth its pending chunks held on
 * its old worker given back there. */
static void move_unrun(struct dp_router *rt, uint32_t ri, int nk)
{
    struct req *r = &rt->reqs[ri];
    struct worker *w = &rt->w[r->worker];
    uint64_t sk = session_key(rt, r->tenant, r->session_id);
    if (r->in_fifo)
        fifo_remove(rt, w, ri);
    if (r->in_set) {
        set_remove(w, ri);
        r->in_set = 0;
    }
    for (uint32_t p = r->pending_head; p != NIL; p = rt->pool[p].next)
        depth_add(rt, r->worker, -1, -chunk_tokens(rt, p));
    requeue_all(rt, r, nk);
    forget_run(rt, sk, r->worker);
    set_worker(rt, r, nk);
    r->moved = note_run(rt, sk, nk);
    make_ready(rt, ri);
}

/* All of ri's records in worker wk's batch are answered, the first refused for want of KV room. */
static void kv_move(struct dp_router *rt, int wk, uint32_t ri)
{
    struct req *r = &rt->reqs[ri];
    uint64_t sk = session_key(rt, r->tenant, r->session_id);
    int nk = kv_next(rt, wk, r);
    r->kv_moving = 0;
    if (nk < 0 || !kv_home_set(rt, sk, nk)) {
        /* its walk made the entry, or a failover did at the worker that has just said it does not
         * hold the session: no worker holds it (a failover's entry stayed, found by review) */
        if (r->kv_moves || kv_home_of(rt, sk) == (uint32_t)wk)
            kv_home_follow(rt, sk, r->session_next);
        rt->st.refused_by_worker++;
        fail_request(rt, wk, ri, DP_STATUS_UNAVAILABLE, WHY_KV_FULL);
        return;
    }
    if (!r->kv_moves++)
        r->kv_first = (int16_t)wk;
    move_unrun(rt, ri, nk);              /* first: it, not a follower, is flagged moved */
    for (uint32_t n = r->session_next; n != NIL; n = rt->reqs[n].session_next)
        if (rt->reqs[n].worker == wk)    /* held behind it, placed on the full worker */
            move_unrun(rt, n, nk);
    rt->st.kv_moved++;
}

static void complete_entry(struct dp_router *rt, int wk, const struct batch_meta *m,
                           const struct dp_completion_entry *e)
{
    struct req *r = &rt->reqs[m->req];
    struct worker *w = &rt->w[wk];
    int ended = 0;
    r->inflight--;
    if (m->releases)
        depth_add(rt, wk, -1, -(int32_t)m->tokens);
    if (r->status) {                     /* already failed: finish once the last record is back */
        if (r->inflight == 0)
            finish(rt, m->req);
        return;
    }
    /* nothing of it ran there: another worker may have room. Not once it decodes: its prefill ran
     * there, and a move left it on that worker's decoding list and its chunks counted on both
     * (the worker broke its contract, worker.py; it is refused 503 as any other refusal) */
    if (e->status == DP_STATUS_UNAVAILABLE && (e->flags & DP_CE_KV_FULL) && r->state != REQ_DECODE)
        r->kv_moving = 1;
    if (r->kv_moving) {
        if (r->inflight == 0)
            kv_move(rt, wk, m->req);
        return;
    }
    if (e->status && e->status != DP_STATUS_OK) {
        rt->st.refused_by_worker++;
        fail_request(rt, wk, m->req, e->status, worker_why(r, e));
        return;
    }
    if (m->kind == DP_KIND_CHUNK && !m->final)
        return;
    if (r->max_output)
        r->generated++;
    if (r->max_output && r->n_out < DP_MAX_OUTPUT_TOKENS)
        r->out[r->n_out++] = e->token;
    if (m->kind == DP_KIND_CHUNK) {      /* prefill done: the first output token is sampled */
        r->decode_left = r->max_output > 1 ? r->max_output - 1 : 0;
        ended = r->decode_left == 0 || (e->flags & DP_CE_EOS);
        if (!ended) {
            r->state = REQ_DECODE;
            w->decoding[w->n_decoding++] = m->req;
            w->st.decoding = w->n_decoding;
            depth_add(rt, wk, 1, 1);
        }
    } else if (r->decode_left == 0 || (e->flags & DP_CE_EOS)) {
        ended = 1;
        decoding_remove(w, m->req);
        w->st.decoding = w->n_decoding;
        depth_add(rt, wk, -1, -1);
    }
    if (ended && r->inflight == 0)
        finish(rt, m->req);
}

static void set_up(struct dp_router *rt, uint32_t k, int up, int probe);

static void *zmq_dealer(void *zctx, const char *endpoint, void **mon, int ping);
/* w's socket, fresh, with its monitor's (NULL if it could not be made) */
static void *worker_dealer(struct dp_router *rt, struct worker *w)
{
    return zmq_dealer(rt->zctx, w->endpoint, &w->zmon, rt->cfg.zmq_timeout_ns != 0);
}
static void zmq_shut(struct worker *w);

/* The health of zmq workers, which no process of ours watches. One whose batch has gone
 * unanswered for zmq_timeout (or unsent, no peer took it, for ZMQ_UNSENT_NS) is marked down and
 * its requests replayed: nothing else would ever free it (a worker that died after taking the
 * batch, a dropped link: it stayed busy, and every request placed on it waited for ever), and its
 * socket is replaced (set_up), so the batch is not delivered when the worker is back. Then it is
 * probed, an empty message at most
 * every ZMQ_PROBE_NS, which its lane answers with an empty one from its receive loop (lanes.py):
 * any message from it (that answer, a late completion) brings it back up. Before, it stayed
 * down for good after a passing stall or a dropped link. */
#define ZMQ_PROBE_NS 1000000000ull
/* A batch no connection took (unsent) is due this soon, zmq_timeout if shorter: nothing of it
 * reached the worker, so it is replayed safely, and a worker restarting on its endpoint
 * reconnects within it (100 ms). Due at zmq_timeout, its requests waited 30 s for a worker that
 * was gone (found by review). */
#define ZMQ_UNSENT_NS 1000000000ull
/* A batch sent whose connection was lost after (the monitor's disconnect: the worker died, its
 * TCP connection closed) cannot be answered on it: due this long after the loss (an answer that
 * came before it is read first), not at zmq_timeout. Its requests waited 30 s, and a worker
 * restarted on the endpoint idled meanwhile (found by review). */
#define ZMQ_LOST_NS 50000000ull
static uint32_t zmq_health(struct dp_router *rt)
{
    if (!rt->n_zmq || !rt->cfg.zmq_timeout_ns)
        return 0;
    uint32_t n = 0;
    for (uint32_t k = 0; k < rt->view.n; k++) {
        struct worker *w = &rt->w[k];
        if (w->kind != DP_LANE_ZMQ)
            continue;
        if (rt->view.up[k]) {
            if (w->busy && !w->unsent && zmq_lost(w))   /* (read only with a batch out: a pass costs nothing idle) */
                w->t_lost = pass_clock(rt);
            uint64_t due = w->unsent && ZMQ_UNSENT_NS < rt->cfg.zmq_timeout_ns ? ZMQ_UNSENT_NS
                                                                             : rt->cfg.zmq_timeout_ns;
            int lost = w->busy && !w->unsent && w->t_lost >= w->t_busy && pass_clock(rt) - w->t_lost >= ZMQ_LOST_NS;
            if (!lost && (!(w->busy || w->unsent) || pass_clock(rt) - w->t_busy < due))
                continue;
            rt->st.zmq_timeouts++;
            rt->st.zmq_lost += (uint64_t)lost;
            set_up(rt, k, 0, 1);
            w->timed_out = 1;
            w->t_probe = 0;
            n++;
        } else if (w->timed_out) {
            int heard = 0;
            if (!w->zsock)                     /* its probe socket could not be made then: again */
                w->zsock = worker_dealer(rt, w);
            while (w->zsock && zmq_recv(w->zsock, w->cbuf, sizeof(*w->cbuf), ZMQ_DONTWAIT) >= 0)
                heard = 1;                     /* whatever it was (its batch was replayed): it lives */
            if (heard) {
                set_up(rt, k, 1, 0);           /* clears timed_out */
                rt->st.zmq_revived++;
                n++;
            } else if (w->zsock && pass_clock(rt) - w->t_probe >= (rt->cfg.zmq_timeout_ns < ZMQ_PROBE_NS ?
                                                                    rt->cfg.zmq_timeout_ns : ZMQ_PROBE_NS)) {
                zmq_send(w->zsock, "", 0, ZMQ_DONTWAIT);    /* a full queue: the next probe */
                w->t_probe = pass_clock(rt);
            }
        }
    }
    return n;
}

/* --- stalled workers ---------------------------------------------------------------
 * Health beyond up. A worker whose batch has gone unanswered for the larger of stall_ns and
 * STALL_FACTOR x its recent longest batch (a SIGSTOP, a host that stopped scheduling it, a store
 * call that hangs) is stalled: the pools' views, which the placement rule and the policies read,
 * show it down while another worker is up and not stalled, so new requests go elsewhere. It stays
 * up in the router's own view: it keeps what it holds and nothing is replayed (it may answer yet;
 * a hang is the control plane's to kill, worker_hang_s), and its next answer ends the stall.
 * Before, a stopped worker drew its share of new requests until the hang kill (30 s). Checked
 * every STALL_EVERY passes, the clock read only while a worker is busy. */
#define STALL_FACTOR 4
#define STALL_EVERY 64

static void move_unrun(struct dp_router *rt, uint32_t ri, int nk);

/* Worker k is stalled and hidden from placement: up in the router's view, down in its pool's. */
static int is_hidden(const struct dp_router *rt, int k)
{
    const struct worker *w = &rt->w[k];
    return w->stalled && rt->view.up[k] && !rt->pools[w->pool].view.up[w->local];
}

/* Request ri, on hidden worker k and none of it in k's lane, goes where the placement rule puts a
 * new request now, as a failover would place it but with nothing replayed; unless that is k, none,
 * or a worker known to have no store (the session's turns would not be there: waiting keeps them).
 * The requests of its session held behind it on k go with it, in order (a CLOSE too: it goes where
 * the session is). 1 if it moved. */
static int stall_move(struct dp_router *rt, uint32_t ri, int k)
{
    struct req *r = &rt->reqs[ri];
    struct dp_request rq = { r->session_id, r->tenant, prompt_bound(r), r->max_output, r->chunk_count,
                             pass_clock(rt) };
    uint16_t pool = 0;
    int spilled = 0, nk = pick_worker(rt, &rq, r->spill, &pool, &spilled);
    rt->st.bad_picks += nk == -2;
    if (nk < 0 || nk == k || rt->w[nk].no_store) {
        if (nk >= 0) {                   /* not placed there after all: the pool's counts as they were */
            rt->pools[pool].requests--;
            rt->pools[pool].spilled -= (uint64_t)spilled;
        }
        return 0;
    }
    r->pool = pool;
    move_unrun(rt, ri, nk);
    rt->st.stall_moved++;
    /* Every later request of the session is flagged moved, so its worker asks the store: its flag
     * was set against where the one before it was placed, which has changed. Moved alone, a request
     * left its followers on k, where a later turn then ran on k's stale copy and a CLOSE freed the
     * wrong one (review). The last-run table names the latest's worker again (move_unrun named
     * nk: a new request placed there ran, unflagged, before the ones left behind on another). */
    int follow = 1;
    uint32_t last = ri;
    r->moved = 1;
    for (uint32_t n = r->in_session ? r->session_next : NIL; n != NIL; n = rt->reqs[n].session_next) {
        struct req *q = &rt->reqs[n];
        follow = follow && q->worker == (int16_t)k && !q->t_worker && q->state == REQ_PREFILL && !q->inflight;
        if (follow) {
            q->pool = pool;
            rt->pools[pool].requests++;
            move_unrun(rt, n, nk);
            rt->st.stall_moved++;
        }
        q->moved = 1;
        last = n;
    }
    uint64_t sk = session_key(rt, r->tenant, r->session_id);
    struct last_run *e = last_run_of(rt, sk);
    if (e->session == sk)
        e->worker = rt->reqs[last].worker;
    return 1;
}

/* Worker k is hidden: its requests of which nothing reached its lane are placed again
 * (stall_move, with those held behind them). One held behind a request elsewhere moves when it is
 * let go (make_ready); a CLOSE not behind one of them stays (it goes where its session is); what is
 * in k's lane waits for it, or for the control plane's hang kill. A scan of the request table: once
 * a stall, or a change of the views while it lasts. */
static void move_queued(struct dp_router *rt, uint32_t k)
{
    for (uint32_t ri = 0; ri < rt->cfg.max_requests; ri++) {
        struct req *r = &rt->reqs[ri];
        if (r->state == REQ_PREFILL && r->worker == (int16_t)k && !r->t_worker && !r->held && !r->close &&
            !r->inflight)
            stall_move(rt, ri, (int)k);
    }
}

/* The views again (a worker joined, went up or down, stalled or answered again, changed pool or
 * weight), and what is queued for a worker now hidden moved: one stalled while every worker was is
 * hidden once another answers or comes up. */
static void views_changed(struct dp_router *rt)
{
    rt->view.generation++;
    rebuild_pools(rt);
    for (uint32_t k = 0; k < rt->view.n; k++)
        if (is_hidden(rt, (int)k))
            move_queued(rt, k);
}

/* How long worker w's batch may go unanswered before it is stalled: stall_ns, or STALL_FACTOR x
 * its recent longest batch if longer. */
static uint64_t stall_after(const struct dp_router *rt, const struct worker *w)
{
    uint64_t after = STALL_FACTOR * w->batch_peak_ns;
    return after > rt->cfg.stall_ns ? after : rt->cfg.stall_ns;
}

static uint32_t find_stalls(struct dp_router *rt)
{
    if (!rt->cfg.stall_ns || rt->st.loops % STALL_EVERY)
        return 0;
    uint32_t n = 0;
    uint64_t now = 0;
    for (uint32_t k = 0; k < rt->view.n; k++) {
        struct worker *w = &rt->w[k];
        if (w->stalled || !rt->view.up[k] || !(w->busy || w->unsent))
            continue;
        if (!now)
            now = pass_clock(rt);
        if (now - w->t_busy < stall_after(rt, w))
            continue;
        w->stalled = 1;
        w->st.stalled = 1;
        rt->st.stalls++;
        n++;
    }
    if (n)
        views_changed(rt);
    return n;
}

/* Worker w's batch is answered: a stall ends, and its time is learnt, the longest at once, then
 * decaying by 1/16 an answer. A stalled batch's only up to the wait it was found stalled at, so
 * patience grows at most 4x a stall: a device whose steps are long is judged stalled on its first
 * few only, and a stop lengthens the patience for a few dozen answers. */
static void batch_answered(struct dp_router *rt, struct worker *w, uint32_t *answered_stalled)
{
    uint64_t d = pass_clock(rt) - w->t_busy;
    if (w->stalled) {
        /* learnt up to the wait it was found stalled at: a stop's whole length, learnt, put the
         * next stall past the hang kill for dozens of answers (a 7.5 s stop: 4 x that; review) */
        if (d > stall_after(rt, w))
            d = stall_after(rt, w);
        w->stalled = 0;
        w->st.stalled = 0;
        (*answered_stalled)++;
    }
    if (d >= w->batch_peak_ns)
        w->batch_peak_ns = d;
    else
        w->batch_peak_ns -= (w->batch_peak_ns - d) / 16;
}

static uint32_t take_completions(struct dp_router *rt)
{
    uint32_t n = 0, answered_stalled = 0;
    for (uint32_t k = 0; k < rt->view.n; k++) {
        struct worker *w = &rt->w[k];
        const struct dp_completion *c;
        if (!w->busy || w->unsent || !(c = lane_completion(w)))
            continue;
        if (c->batch_seq == w->batch_seq) {
            uint32_t len = w->batch_len;
            w->busy = 0;
            batch_answered(rt, w, &answered_stalled);
            w->batch_len = 0;  /* meta stays valid below: nothing reuses it before the next batch */
            /* a record the completion does not cover was not answered: it fails, not succeeds */
            const struct dp_completion_entry missing = { .status = DP_STATUS_UNAVAILABLE, .flags = DP_CE_UNANSWERED };
            if (c->n)                  /* (from its own entry: the filler says nothing) */
                w->no_store = (c->e[0].flags & DP_CE_NO_STORE) != 0;
            for (uint32_t i = 0; i < len; i++)
                complete_entry(rt, (int)k, &w->meta[i], i < c->n ? &c->e[i] : &missing);
            w->st.completions++;
            rt->st.completions++;
            n++;
        }
        lane_completion_done(w);  /* a stale completion (wrong seq) is dropped */
        w->st.busy = w->busy;
    }
    if (answered_stalled)
        views_changed(rt);
    return n;
}

/* --- batching ----------------------------------------------------------------------- */

struct builder {
    struct worker *w;
    uint32_t n, tokens, budget, cap;
    uint64_t t;
};

static struct dp_chunk *add_record(struct dp_router *rt, struct builder *b, uint32_t ri, uint8_t kind, uint8_t final)
{
    struct dp_chunk *out = lane_slot(b->w, b->n);
    b->w->meta[b->n] = (struct batch_meta){ ri, kind, final, 0, 0 };
    rt->reqs[ri].inflight++;
    b->n++;
    return out;
}

static void add_decode(struct dp_router *rt, struct builder *b, uint32_t ri)
{
    struct req *r = &rt->reqs[ri];
    struct dp_chunk *out = add_record(rt, b, ri, DP_KIND_DECODE, 0);
    memset(out, 0, DP_CHUNK_HDR_LEN);
    out->session_id = r->session_id;
    out->request_id = r->request_id;
    out->tenant = r->tenant;
    out->max_output_tokens = r->max_output;
    out->kind = DP_KIND_DECODE;
    out->t_router = b->t;
    out->t_send = r->t_send;
    r->decode_left--;
    b->tokens++;
    b->w->st.decode_steps++;
    rt->st.decode_out++;
}

/* Move up to `room` tokens of r's first pending chunk into the batch; split if it does not fit,
 * unless what would be left for the next step is at most split_slack tokens: a split delays its
 * request's first token by a whole step (~67 ms on a simulated L4), the overrun lengthens this
 * step by slack/budget of a step at most, and only past the device's knee. */
static void add_prefill(struct dp_router *rt, struct builder *b, uint32_t ri, uint32_t room)
{
    struct req *r = &rt->reqs[ri];
    uint32_t p = r->pending_head;
    struct pooled *pc = &rt->pool[p];
    struct dp_chunk *c = &pc->c;
    uint32_t left = c->n_tokens - pc->sent;
    uint32_t take = left <= room || left - room <= rt->cfg.split_slack ? left : room;
    int whole = take == left;
    int final = whole && r->next_index == r->chunk_count && pc->next == NIL && r->received == r->chunk_count;
    struct dp_chunk *out = add_record(rt, b, ri, DP_KIND_CHUNK, (uint8_t)final);
    memcpy(out, c, DP_CHUNK_HDR_LEN);
    out->t_send = r->t_send;             /* the request's on every record: a worker tells a verbatim repeat of
                                          * it by (id, stamp), and a packet's own stamp differs per chunk */
    memcpy(out->tokens, c->tokens + pc->sent, take * sizeof(uint32_t));
    out->n_tokens = (uint16_t)take;
    /* the admitted answer length, not this packet's: chunks that disagreed made the worker stop
     * early (a 422 whose body was tokens) or never finish (the turn silently dropped) */
    out->max_output_tokens = r->max_output;
    out->flags = c->flags | (final ? DP_CHUNK_F_FINAL : 0) | (r->moved ? DP_CHUNK_F_MOVED : 0) |
                 (r->replayed || r->retake ? DP_CHUNK_F_REPLAY : 0) | (r->retake == 2 ? DP_CHUNK_F_RETAKE : 0);
    if (r->retake)
        r->retake = 1;                   /* (its first record is out: the rest continue it) */
    b->tokens += take;
    if (whole) {                         /* all of it is out: keep it aside for a replay */
        b->w->meta[b->n - 1].releases = 1;   /* in flight until its completion: still the worker's depth */
        b->w->meta[b->n - 1].tokens = c->n_tokens;
        r->pending_head = pc->next;
        if (r->pending_head == NIL)
            r->pending_tail = NIL;
        pc->next = NIL;
        if (r->sent_tail == NIL)
            r->sent_head = p;
        else
            rt->pool[r->sent_tail].next = p;
        r->sent_tail = p;
    } else {                             /* re-chunk: the rest stays first in line */
        pc->sent += (uint16_t)take;
        rt->st.splits++;
    }
}

/* Does request r have more than n prompt tokens queued here (walked until it is known)? */
static int queued_over(const struct dp_router *rt, const struct req *r, uint32_t n)
{
    uint32_t sum = 0;
    for (uint32_t p = r->pending_head; p != NIL; p = rt->pool[p].next)
        if ((sum += rt->pool[p].c.n_tokens - rt->pool[p].sent) > n)
            return 1;
    return 0;
}

/* One round over the worker's prefill queue, oldest first. most 0: each request takes what it has
 * queued, as the budget allows. Else a request with more queued than the step has left, one that
 * cannot be done in it, takes `most` at most, and only the first such: a request that can be done
 * takes it all (a prompt that would have gone whole is not split for fairness, and two long ones do
 * not halve the step between them ahead of a short one). The last in the queue, with none waiting
 * behind it, takes all. One whose chunks are all out leaves the queue (make_ready puts it back
 * when more come). */
static void prefill_round(struct dp_router *rt, struct builder *b, uint32_t most)
{
    struct worker *w = b->w;
    int long_one = 0;
    for (uint32_t ri = w->fifo_head, prev = NIL; ri != NIL && b->n < b->cap && b->tokens < b->budget;) {
        struct req *r = &rt->reqs[ri];
        uint32_t next = r->fifo_next, cap = b->budget, took = 0;
        if (most && next != NIL && queued_over(rt, r, b->budget - b->tokens)) {
            if (long_one) {              /* one long partial prefill a step: the rest in round two */
                prev = ri, ri = next;
                continue;
            }
            long_one = 1, cap = most;
        }
        while (r->pending_head != NIL && b->n < b->cap && b->tokens < b->budget && took < cap) {
            uint32_t before = b->tokens, room = b->budget - b->tokens;
            add_prefill(rt, b, ri, room < cap - took ? room : cap - took);
            took += b->tokens - before;
        }
        if (r->pending_head == NIL) {
            if (prev == NIL)
                w->fifo_head = next;
            else
                rt->reqs[prev].fifo_next = next;
            if (w->fifo_tail == ri)
                w->fifo_tail = prev;
            r->in_fifo = 0;
        } else
            prev = ri;
        ri = next;
    }
}

static void build_dynamic(struct dp_router *rt, struct builder *b)
{
    struct worker *w = b->w;
    /* decode first: one step per decoding request, fairly rotated when the budget is short: the
     * next step starts past the last one this one reached (moved on by one, each request got a
     * run of steps, then waited ~n_decoding steps: found by review) */
    uint32_t k = 0;
    for (; k < w->n_decoding && b->n < b->cap && b->tokens < b->budget; k++) {
        uint32_t ri = w->decoding[(w->decode_cursor + k) % w->n_decoding];
        if (rt->reqs[ri].decode_left)
            add_decode(rt, b, ri);
    }
    if (w->n_decoding)
        w->decode_cursor = (w->decode_cursor + (k ? k : 1)) % w->n_decoding;
    /* then prefill, first come first served, but while others wait behind it a request that cannot
     * be done in this step takes at most half of what the decodes left: taking it all until its
     * chunks ran out, a long prompt held every request behind it for its whole prefill (a review: a
     * 64-token request behind a 262,144-token prompt answered after 1,028 steps, 69 s on the L4;
     * vLLM bounds it so, long_prefill_token_threshold and one long partial prefill at a time).
     * Each keeps its place: the oldest still goes first at every step, and what the others leave
     * of the budget it takes in a second round. */
    uint32_t left = b->tokens < b->budget ? b->budget - b->tokens : 0;
    prefill_round(rt, b, left / 2 ? left / 2 : 1);
    prefill_round(rt, b, 0);
}

static void build_static(struct dp_router *rt, struct builder *b, uint64_t now)
{
    struct worker *w = b->w;
    if (w->n_set == 0) {                 /* form a batch: full, or the oldest waited long enough */
        uint32_t waiting = 0;
        for (uint32_t x = w->fifo_head; x != NIL && waiting < rt->cfg.max_batch_size; x = rt->reqs[x].fifo_next)
            waiting++;
        if (!waiting || (waiting < rt->cfg.max_batch_size &&
                         now - rt->reqs[w->fifo_head].t_ready < rt->cfg.batch_timeout_ns))
            return;
        while (w->n_set < waiting) {
            uint32_t ri = fifo_pop(rt, w);
            rt->reqs[ri].in_set = 1;
            w->set[w->n_set++] = ri;
        }
    }
    /* one step over the set: all its prefill (whole chunks, no budget), then a decode step each.
     * Prefill first across the whole set: member by member, the decodes of the first members took
     * a short chunk cap and the others' prefill waited for their whole answers (found by review) */
    for (uint32_t s = 0; s < w->n_set && b->n < b->cap; s++) {
        uint32_t ri = w->set[s];
        while (rt->reqs[ri].pending_head != NIL && b->n < b->cap)
            add_prefill(rt, b, ri, DP_MAX_CHUNK_TOKENS);
    }
    for (uint32_t s = 0; s < w->n_set && b->n < b->cap; s++) {
        uint32_t ri = w->set[s];
        struct req *r = &rt->reqs[ri];
        if (r->state == REQ_DECODE && r->decode_left && !r->inflight)
            add_decode(rt, b, ri);
    }
}

static uint32_t send_batches(struct dp_router *rt)
{
    uint32_t sent = 0;
    for (uint32_t k = 0; k < rt->view.n; k++) {
        struct worker *w = &rt->w[k];
        if (w->unsent) {                 /* a zmq batch the socket refused: it goes first, unchanged */
            if (lane_commit(w, w->unsent))
                w->busy = 1, w->st.busy = 1;
            continue;
        }
        if (w->busy || !rt->view.up[k])
            continue;
        if (rt->cfg.batching == DP_BATCH_DYNAMIC && !w->n_decoding && w->fifo_head == NIL)
            continue;
        if (!lane_ready(rt, w))
            continue;
        uint64_t now = pass_clock(rt);
        struct builder b = { w, 0, 0, w->budget ? w->budget : rt->cfg.token_budget, rt->cfg.max_chunks, now };
        if (rt->cfg.batching == DP_BATCH_DYNAMIC)
            build_dynamic(rt, &b);
        else
            build_static(rt, &b, now);
        if (!b.n)
            continue;
        w->batch_seq++;
        uint64_t t_lane = now_ns();
        for (uint32_t i = 0; i < b.n; i++) {
            struct dp_chunk *c = lane_slot(w, i);
            struct req *r = &rt->reqs[w->meta[i].req];
            if (!r->t_first_lane)
                r->t_first_lane = t_lane;
            if (!r->t_worker)
                r->t_worker = t_lane;
            c->batch_seq = w->batch_seq;
            c->batch_len = (uint16_t)b.n;
            c->batch_pos = (uint16_t)i;
            c->t_lane = t_lane;
        }
        w->batch_len = b.n;
        w->t_busy = t_lane;              /* a zmq batch's answer is due zmq_timeout from here, sent or not */
        if (lane_commit(w, b.n))
            w->busy = 1, w->st.busy = 1;
        w->st.batches++;
        w->st.records += b.n;
        w->st.tokens += b.tokens;
        rt->st.batches++;
        rt->st.records_out += b.n;
        rt->st.tokens_out += b.tokens;
        sent++;
    }
    return sent;
}

/* --- stalled reassemblies ------------------------------------------------------------- */

static void fifo_remove(struct dp_router *rt, struct worker *w, uint32_t ri)
{
    for (uint32_t x = w->fifo_head, prev = NIL; x != NIL; prev = x, x = rt->reqs[x].fifo_next) {
        if (x != ri)
            continue;
        if (prev == NIL)
            w->fifo_head = rt->reqs[x].fifo_next;
        else
            rt->reqs[prev].fifo_next = rt->reqs[x].fifo_next;
        if (w->fifo_tail == ri)
            w->fifo_tail = prev;
        rt->reqs[ri].in_fifo = 0;
        return;
    }
}

/* One element of a BPF map by its fd (cmd: BPF_MAP_LOOKUP_ELEM, value copied out, or
 * BPF_MAP_UPDATE_ELEM, value written); 1 if the kernel did it. */
static int map_op(int cmd, int fd, const void *key, void *value)
{
    union bpf_attr a;
    memset(&a, 0, sizeof(a));            /* the kernel refuses any byte set past the command's fields */
    a.map_fd = (uint32_t)fd;
    a.key = (uint64_t)(uintptr_t)key;
    a.value = (uint64_t)(uintptr_t)value;
    a.flags = cmd == BPF_MAP_UPDATE_ELEM ? BPF_ANY : 0;
    return syscall(__NR_bpf, cmd, &a, sizeof(a)) == 0;
}

/* Did the XDP program's bucket cut this request (chunk.h, dp_cut_key)? Then its client has
 * had the 429, and what passed of it is dropped without a second answer. The cut must be this
 * request's, not one of the same ids long before: no earlier than DP_CUT_TTL_NS before its first
 * record reached XDP (t_xdp). A syscall, on the refusal and expiry paths only. */
static int xdp_cut(const struct dp_router *rt, uint64_t session_id, uint64_t request_id, uint32_t tenant,
                   uint64_t t_xdp, uint64_t sent)
{
    if (rt->cuts_fd < 0 || !t_xdp)
        return 0;
    struct dp_cut_key key = { .session_id = session_id, .request_id = request_id, .tenant = tenant };
    struct dp_cut cut;
    if (!map_op(BPF_MAP_LOOKUP_ELEM, rt->cuts_fd, &key, &cut) || cut.t_cut + DP_CUT_TTL_NS < t_xdp)
        return 0;
    /* a client's retry passed the cut (chunk.h, dp_cut): the request is the retry's, or holds its
     * records (sent: its latest record's stamp), and owes the retry its answer */
    return !cut.retry_sent || (sent & ~1ull) < cut.retry_sent;
}

/* A request the router answered before all its chunks came (a refusal, an expiry, a failure):
 * the rest is cut at XDP as its bucket would (dropped, uncharged, unanswered, for DP_CUT_TTL_NS;
 * only for tenants with a bucket, whose chunks XDP checks), so the bucket running dry on one of
 * them does not answer the request again with a 429. Both sides stamp CLOCK_MONOTONIC. */
static void cut_at_xdp(const struct dp_router *rt, uint64_t session_id, uint64_t request_id, uint32_t tenant,
                       uint64_t try)
{
    if (rt->cuts_fd < 0)
        return;
    struct dp_cut_key key = { .session_id = session_id, .request_id = request_id, .tenant = tenant };
    struct dp_cut cut = { .t_cut = now_ns(), .try_sent = try };
    map_op(BPF_MAP_UPDATE_ELEM, rt->cuts_fd, &key, &cut);
}

/* Has the tenant an XDP bucket, its own or the one the others share while it is set? Only then
 * does XDP cut its requests or read a cut of them, so only then are the two calls above worth
 * making: for the others they cost a refusal ~2 us each, and their writes pushed live cuts out of
 * the LRU map (found by review). One or two lookups, on the refusal, expiry and failure paths of
 * requests of several chunks only. */
static int bucketed(const struct dp_router *rt, uint32_t tenant)
{
    if (rt->cuts_fd < 0)
        return 0;
    if (rt->buckets_fd < 0)
        return 1;
    /* a struct dp_bucket (bpf/steer.h, whose struct dp_policy is not policy.h's, so not included
     * here): ns_per_token first */
    uint64_t value[8];
    uint32_t zero = 0;
    if (map_op(BPF_MAP_LOOKUP_ELEM, rt->buckets_fd, &tenant, value))
        return 1;
    return rt->others_fd >= 0 && map_op(BPF_MAP_LOOKUP_ELEM, rt->others_fd, &zero, value) && value[0] != 0;
}

/* Requests still missing chunks, with nothing in flight, idle past the timeout:
 * answer 400 (unless the XDP bucket cut them: their 429 was the answer) and free what they hold. */
static uint32_t expire_stalled(struct dp_router *rt)
{
    uint32_t n = 0;
    /* reserved counts the chunks still missing from live requests: none, nothing to expire (the
     * scan reads every slot: 20-90 us here, and a quarter of L2 that the fast path wants), and
     * no clock read either */
    if (!rt->reserved)
        return 0;
    uint64_t now = pass_clock(rt);
    if (now < rt->next_expiry_scan)
        return 0;
    rt->next_expiry_scan = now + EXPIRY_SCAN_NS;
    for (uint32_t ri = 0; ri < rt->cfg.max_requests; ri++) {
        struct req *r = &rt->reqs[ri];
        if (r->state != REQ_PREFILL || r->received == r->chunk_count || r->inflight ||
            now - r->t_last < rt->cfg.reassembly_timeout_ns)
            continue;
        int cut = xdp_cut(rt, r->session_id, r->request_id, r->tenant, r->t_xdp, r->t_send_max);
        char body[128];
        int len = snprintf(body, sizeof(body), "{\"status\":400,\"error\":\"chunks missing after the reassembly "
                           "timeout\",\"received\":%u,\"chunk_count\":%u}", r->received, r->chunk_count);
        if (!cut && !emit(rt, NULL, DP_STATUS_BAD_REQUEST, r->request_id, r->session_id, r->tenant,
                          &(struct dp_chunk){ .t_send = r->t_try, .t_xdp = r->t_xdp, .client_ip = r->client_ip,
                                              .client_port = r->client_port, .flags = r->flags },
                          body, (uint32_t)len))
            break;                       /* egress full: try again at the next scan */
        if (!cut && bucketed(rt, r->tenant))
            cut_at_xdp(rt, r->session_id, r->request_id, r->tenant, DP_TRY_OF(r->t_try, r->by_open));
        dp_adm_settle(rt->adm, r->tenant, &r->adm, r->tokens_in, 0, 0);
        if (r->in_fifo)
            fifo_remove(rt, &rt->w[r->worker], ri);
        drop_pending(rt, r);
        free_list(rt, r->sent_head);
        r->sent_head = r->sent_tail = NIL;
        /* its late chunks are stragglers, not a new request; but a cut request's ids are free again
         * once XDP forgets the cut (DP_CUT_TTL_NS): remembered here too, a client's retry of them
         * passed XDP and was dropped as a late duplicate, unanswered (found by review). A straggler
         * that passed XDP before the cut begins a request whose own expiry finds the cut again. */
        if (!cut)
            remember_done(rt, r->key, DP_TRY_OF(r->t_try, r->by_open), 0);
        not_run(rt, r);
        session_leave(rt, ri);
        r->status = DP_STATUS_BAD_REQUEST;
        policy_done(rt, r);
        rt->reserved -= r->chunk_count - r->received;
        rt->w[r->worker].promised -= r->chunk_count - r->received;
        arriving_done(rt, r);
        if (cut) {
            rt->st.xdp_cut++;
        } else {
            rt->st.expired++;
            rt->st.responses++;
        }
        req_free(rt, ri);
        n++;
    }
    return n;
}

/* --- failover ----------------------------------------------------------------------------- */

/* Worker k is gone with the sessions kv_homes placed there: their entries go (a replay of one of
 * their requests makes its own again). Kept, each drew its session's next request to k's
 * replacement, where it began again anyway, and held its place in the table for good if the
 * session never closed: failovers filled it, and a KV-full move was then answered 503 (review). */
static void kv_homes_forget(struct dp_router *rt, uint32_t k)
{
    for (uint32_t i = 0; rt->st.kv_homes && i <= rt->kv_homes.mask;) {
        if (rt->kv_homes.e[i].slot == k) {
            index_move(&rt->kv_homes, rt->kv_homes.e[i].key, k, NIL);   /* may shift another into i */
            rt->st.kv_homes--;
        } else {
            i++;
        }
    }
}

/* --- waiting for a worker ------------------------------------------------------------------
 * With no worker up, a request was answered 503 at once: every one of the ~150 ms a dead spawner's
 * heir took to fork the workers again, and every one the dead workers held (bench e2e scenario 6,
 * session 42: 7 of 400). While the control plane says a replacement is coming (dp_router_hold),
 * such a request is parked instead: left on a down worker (make_ready queues nothing there), all
 * its chunks pending and counted in that worker's depth, its chunks still to come accepted so. The
 * first worker up (set_up) places every parked request as a failover would (place_again); a hold
 * that ends first answers them 503 as before. Parked requests exist only while no worker is up. */
static void park(struct dp_router *rt, struct req *r, int k, uint8_t how, enum why why)
{
    rt->st.waiting_for_worker += !r->parked;
    rt->st.waited_for_worker += !r->waited;   /* (once a request, however often it waits) */
    r->waited = 1;
    r->parked = how;
    r->why = why;                        /* its 503's, if the hold ends first */
    set_worker(rt, r, k);
    requeue_all(rt, r, k);               /* all of it again, from its first chunk */
    /* its prefill again: left decoding, a failure of it took a decode step's depth off the down
     * worker, whose depth failover had zeroed: it wrapped (found by review) */
    r->state = REQ_PREFILL;
    r->decode_left = r->n_out = 0;
    r->generated = 0;
}

/* Place again every request on worker k, gone (k >= 0: failover), or every parked one (k < 0): each
 * is replayed on another worker from its first chunk (kept for that until the request ends), where
 * the new worker restores the session from the snapshot store and runs the prompt again. With no
 * worker up, it is parked while one is coming (park), else answered 503, and so is one whose
 * replay's worker died too with some of it: a request that kills workers (a bug, a store that
 * hangs them) must not go round the pool killing every one. One still queued, none of it sent, had
 * no part in the death: it moves on however often (it was answered 503 at a second death before).
 * Nothing is dropped silently. */
static void place_again(struct dp_router *rt, int k)
{
    /* a session's earliest unfinished request first, then, pass by pass, each held behind one just
     * placed, which goes where the session now is (session_home), as close_session and kv_move
     * place them: each picked anew, a held CLOSE ran on a worker that did not hold the session,
     * which kept it for good (found by review, session 27); and in slot order alone, one whose
     * predecessor sat in a later slot (slots are reused) was placed before it, by the dead worker's
     * stale entries, elsewhere (found by review, session 29) */
    for (int pass = 0, placed = 1; placed; pass++) {
    placed = pass == 0;                  /* the first pass runs whatever it places */
    for (uint32_t ri = 0; ri < rt->cfg.max_requests; ri++) {
        struct req *r = &rt->reqs[ri];
        if (r->state == REQ_FREE || (k >= 0 ? r->worker != (int16_t)k || r->parked : !r->parked))
            continue;                    /* (parked on k: in this walk) */
        if (r->state == REQ_DONE) {      /* failed, waiting for records the dead worker will not answer */
            if (r->inflight) {
                r->inflight = 0;
                finish(rt, ri);
            }
            continue;                    /* else already answered, waiting for egress room */
        }
        if (r->in_session && r->session_prev != NIL) {   /* held: once its predecessor is placed */
            const struct req *prev = &rt->reqs[r->session_prev];
            if (pass == 0 || (k >= 0 ? prev->worker == (int16_t)k && prev->state != REQ_DONE && !prev->parked
                                     : prev->parked))
                continue;
        }
        int progress = placed;
        placed = 1;
        uint8_t how = r->parked;
        int ran;
        if (how) {                       /* parked: all of it pending, in its down worker's depth */
            ran = how == PARK_RAN;
            for (uint32_t p = r->pending_head; p != NIL; p = rt->pool[p].next)
                depth_add(rt, r->worker, -1, -chunk_tokens(rt, p));
        } else {
            r->inflight = r->in_fifo = r->in_set = 0;
            ran = r->sent_head != NIL    /* the dead worker had some of it */
                  || (r->pending_head != NIL && rt->pool[r->pending_head].sent);
            r->unsure |= (uint8_t)ran;
        }
        struct dp_request rq = { r->session_id, r->tenant, r->close ? 0 : prompt_bound(r), r->max_output,
                                 r->chunk_count, pass_clock(rt) };
        uint64_t sk = session_key(rt, r->tenant, r->session_id);
        int nk = -1, spilled = 0;
        if (!(r->replayed && ran)) {
            /* (a new CLOSE goes where its session is, as close_session sends it) */
            nk = pass || (how == PARK_NEW && r->close)
                 ? session_home(rt, sk, r->in_session ? r->session_prev : NIL) : -1;
            if (nk >= 0) {
                r->pool = rt->w[nk].pool;
                rt->pools[r->pool].requests++;
            } else {
                nk = pick_worker(rt, &rq, r->spill, &r->pool, &spilled);
            }
        }
        if (nk == -1 && !(r->replayed && ran) && holding(rt)) {
            park(rt, r, how ? r->worker : k, how ? how : ran ? PARK_RAN : PARK_MOVED,
                 how ? (enum why)r->why : WHY_WORKER_DIED);
            placed = how ? progress : 1; /* parked again (none up yet): no walk's progress */
            continue;
        }
        if (nk < 0) {
            rt->st.bad_picks += nk == -2;
            rt->st.replay_refused += r->replayed && ran;
            rt->st.no_worker += nk == -1 && !(r->replayed && ran);   /* (a review: counted nowhere) */
            free_list(rt, r->pending_head);
            early_drop(rt, ri);
            r->pending_head = r->pending_tail = NIL;
            r->status = DP_STATUS_UNAVAILABLE;
            r->why = r->replayed && ran ? WHY_REPLAY_DIED : nk == -2 ? WHY_BAD_PICK
                     : how ? r->why : WHY_WORKER_DIED;
            finish(rt, ri);
            continue;
        }
        unpark(rt, r);
        requeue_all(rt, r, nk);
        if (r->retake)
            r->retake = 2;               /* it begins again on the next worker too */
        set_worker(rt, r, nk);
        uint8_t moved = note_run(rt, sk, nk);
        /* a worker without a store: the session lives where this runs, and only the router knows
         * it, as after a kv_move. Left to the policy, its next request went to the dead worker's
         * replacement, which began it again, and this copy stayed here, never closed (found by
         * review, session 29). (With a store, the policy's pick restores it: no entry.) A full
         * table takes none: as before. */
        if (rt->w[nk].no_store && how != PARK_NEW)   /* (admit makes none for a new one: review) */
            kv_home_set(rt, sk, nk);
        r->kv_moves = 0;                 /* a KV-full walk begins again: the pool it walked has changed */
        if (how == PARK_NEW) {           /* placed now as it came (admit) */
            r->moved = moved;
            rt->w[nk].st.placed++;
            rt->st.to_secondary += (uint64_t)spilled;
        } else {
            r->moved = 1;                /* replayed elsewhere: its session moved for sure */
        }
        r->replayed |= (uint8_t)ran;     /* its turn may be in the store (DP_CHUNK_F_REPLAY) */
        r->state = REQ_PREFILL;
        r->n_out = 0;
        r->generated = 0;                /* what it ran on the dead worker is not what it returns */
        r->decode_left = 0;
        make_ready(rt, ri);
        rt->st.replayed += (uint64_t)ran;   /* a move of one it never had is no replay */
    }
    }
}

/* Worker k is gone (its process died): whatever it held is lost with it (place_again). */
static void failover(struct dp_router *rt, uint32_t k, int alive)
{
    struct worker *w = &rt->w[k];
    if (!alive) {                        /* (a zmq worker that only timed out may come back, holding them) */
        w->no_store = w->no_store_said;  /* its replacement's answers tell (till then, the control plane) */
        w->batch_peak_ns = 0;            /* and its own batches its patience (a dead one's inherited: review) */
        kv_homes_forget(rt, k);
    }
    w->busy = w->st.busy = 0;
    w->batch_len = w->unsent = 0;
    w->fifo_head = w->fifo_tail = NIL;
    w->n_decoding = w->st.decoding = 0;
    w->n_set = 0;
    depth_add(rt, (int)k, -(int32_t)rt->view.depth[k], -(int32_t)rt->view.tokens[k]);
    place_again(rt, (int)k);
}

/* --- keeping the fast path warm ------------------------------------------------------------
 * At low rates a chunk arrives after milliseconds of idle polling, and in a VM
 * shared with other work the tables it needs (request and session indexes, the
 * policy's state, the workers' lane headers and next slots) have left this
 * core's caches and TLB by then: measured here at 10 requests/s, each step of
 * ingest cost 0.4-2 us that way instead of tens of ns. So idle passes read the
 * working set back, a few cache lines per pass (a chunk arriving meanwhile
 * waits for at most those few lines). Reads only: a lane slot read here is
 * shared with the worker, never taken from it. */
#define WARM_LINES 8

/* Region i of the working set: the indexes, the view, the workers, the done cache, the sessions'
 * last workers, the tenants' share index, each pool's view and policy state, then each shm lane's
 * header and next slots. */
#define WARM_FIXED (7 + 2 * DP_MAX_POOLS)

static size_t warm_region(const struct dp_router *rt, uint32_t i, const uint8_t **base)
{
    size_t idx_bytes = 2 * (size_t)rt->cfg.max_requests * sizeof(*rt->by_id.e);
    if (i == 0 || i == 1) {
        *base = (const uint8_t *)(i == 0 ? rt->by_id.e : rt->by_session.e);
        return idx_bytes;
    }
    if (i == 2) {
        *base = (const uint8_t *)&rt->view;
        return sizeof(rt->view);
    }
    if (i == 3) {
        *base = (const uint8_t *)rt->w;
        return rt->view.n * sizeof(rt->w[0]);
    }
    if (i == 4 || i == 5) {
        *base = i == 4 ? (const uint8_t *)rt->recent : (const uint8_t *)rt->last_run;
        return i == 4 ? sizeof(rt->recent) : sizeof(rt->last_run);
    }
    if (i == 6) {
        *base = (const uint8_t *)rt->by_tenant.e;
        return idx_bytes;
    }
    if (i < WARM_FIXED) {
        const struct pool *pl = &rt->pools[(i - 7) / 2];
        if (pl->view.n == 0)
            return 0;
        if ((i - 7) % 2 == 0) {
            *base = (const uint8_t *)&pl->view;
            return sizeof(pl->view);
        }
        *base = pl->policy.warm;
        return pl->policy.warm_bytes;
    }
    const struct worker *w = &rt->w[(i - WARM_FIXED) / 2];
    if (w->kind != DP_LANE_SHM)
        return 0;
    const struct dp_ring_hdr *h = w->lane->h;
    if ((i - WARM_FIXED) % 2 == 0) {
        *base = (const uint8_t *)h;
        return sizeof(*h);
    }
    uint32_t to_end = h->capacity - (uint32_t)(h->tail & h->mask);   /* never past the mapping */
    *base = (const uint8_t *)dp_ring_seq(w->lane, h->tail);           /* whole slots, sequence words too */
    return (size_t)(rt->cfg.max_chunks < to_end ? rt->cfg.max_chunks : to_end) * h->stride;
}

static volatile uint32_t warm_sink;      /* what warming reads goes here, so it is not optimised away */

static void warm_step(struct dp_router *rt)
{
    uint32_t regions = WARM_FIXED + 2 * rt->view.n;
    for (uint32_t lines = 0, tries = 0; lines < WARM_LINES && tries < regions; ) {
        const uint8_t *base = NULL;
        size_t len = rt->warm_region < regions ? warm_region(rt, rt->warm_region, &base) : 0;
        if (!base || rt->warm_off >= len) {       /* this region done: on to the next */
            rt->warm_region = (rt->warm_region + 1) % regions;
            rt->warm_off = 0;
            tries++;
            continue;
        }
        warm_sink = ((const volatile uint8_t *)base)[rt->warm_off];
        rt->warm_off += 64;
        lines++;
    }
}

/* Warming data is not enough: after a few ms without traffic the first chunk's
 * admission alone took 2.5-4.4 us instead of 180 ns (an idle-spin loop calling it
 * after 0.01 / 3 / 100 ms measured 0.2 / 0.4-1.4 / 2.5-4.4 us; read as data every
 * 100 us its code and tables still gave 1-2 us, called every 100 us 0.2 us). The
 * code has to run. So every REHEARSE_EVERY idle passes (~30 us here) the router
 * runs the read-only part of a new request's path on a copy of the last admitted
 * first chunk: the index and done-cache lookups, the admission decision (not
 * committed), the pool choice and the policy's pick (its rng and cursor put
 * back), the chunk copied into the free pool slot and into the shm lane's next
 * free slot (neither taken nor committed: both are the router's own until then),
 * and the slot the next request takes read.
 * Nothing changes: a chunk that arrives meanwhile waits for at most one
 * rehearsal (270 ns on average, measured here). */
#define REHEARSE_EVERY 256

static void rehearse(struct dp_router *rt)
{
    const struct dp_chunk *c = &rt->rehearsal;
    if (!c->n_tokens)
        return;                          /* nothing admitted yet */
    /* The next input slot, read through this router's own mapping of the ring: the consumer
     * writes it through another, and the first read of a new record here took ~0.5 us (a TLB
     * walk; measured between the drain's stamp and ingest's first line: 490 -> 30 ns p50). */
    for (uint32_t k = 0; k < rt->n_in; k++)
        for (size_t off = 0; off < rt->in[k]->h->slot_size; off += 64)
            warm_sink = ((const volatile uint8_t *)dp_ring_cons_slot(rt->in[k], 0))[off];
    uint64_t key = chunk_key(rt, c);
    rt->st.rehearsals++;
    warm_sink = index_find(rt, &rt->by_id, key, c, 1) + index_find(rt, &rt->by_session,
                      session_key(rt, c->tenant, c->session_id), c, 0) + (uint32_t)recently_done(rt, key, c);
    char body[DP_MAX_RESP_BODY];
    struct dp_adm_decision d;
    dp_adm_decide(rt->adm, c->tenant, c->tokens, c->n_tokens, c->chunk_count, c->max_output_tokens,
                  DP_ADM_LAZY | DP_ADM_NO_SWEEP, now_ns(), &d, body, sizeof(body));
    dp_adm_finish(rt->adm, &d, c->tokens);   /* (price_admitted's part, after the pass) */
    int spilled, p = choose_pool(rt, d.spill, &spilled);
    if (p < 0)
        return;
    struct dp_policy *pol = &rt->pools[p].policy;
    uint64_t rng = pol->rng;
    uint32_t cursor = pol->cursor;
    struct dp_request rq = request_of(c, pass_clock(rt));
    int k = policy_pick(&rt->pools[p], &rq);
    pol->rng = rng;
    pol->cursor = cursor;
    size_t len = DP_CHUNK_HDR_LEN + c->n_tokens * sizeof(uint32_t);
    if (rt->pool_free != NIL)
        memcpy(&rt->pool[rt->pool_free].c, c, len);
    if (rt->req_free != NIL)              /* the slot the next request takes: read, it is written then */
        for (size_t off = 0; off < offsetof(struct req, out); off += 64)
            warm_sink = ((const volatile uint8_t *)&rt->reqs[rt->req_free])[off];
    if (k < 0)
        return;
    struct worker *w = &rt->w[rt->pools[p].member[k]];
    if (w->kind == DP_LANE_SHM && !w->busy && dp_ring_prod_reserve(w->lane, 1) == 1)
        memcpy(dp_ring_prod_slot(w->lane, 0), c, len);
}

/* --- the shadow: the live path's code run whole, on a router of its own ---------------
 * What rehearse() cannot run dry (the request and session tables written, the chunk
 * accepted and queued, the batch built and committed, the completion taken, the decode
 * step, the answer) still went cold: in an idle-spinning router fed from the other core,
 * requests 100 ms apart took 3.0-3.2 us from the router's stamp to the lane, 1 ms apart
 * 0.66 us (stamped inside the path, temporary build); reading that code as data every
 * rehearsal gave 2.0-2.4 us, so it is the code, not the tables, that has to run. So every
 * SHADOW_EVERY rehearsals the rehearsal chunk, as a one-chunk request with a two-token
 * answer, goes through dp_router_poll of a second router (8 request slots, one worker,
 * dynamic, the live policy) whose rings are private to this process: the rehearsal plays
 * its input, its worker and its egress. The same machine code runs, none of the live
 * router's state is written (warm_step and rehearse keep its tables warm). Measured: the
 * 100 ms case 0.53-0.60 us; in the pipeline at 10 req/s router->lane p50 2.9-3.1 -> 0.85-
 * 1.05 us; a shadow run costs ~0.94 us, one every ~86 us of idling (1.1% of the core). */
#define SHADOW_EVERY 4

struct shadow {
    struct dp_router *rt;
    struct dp_ring *in, *lane, *done, *egress;   /* one handle for both ends of each */
    uint64_t next_id;
};

static struct dp_router *router_new(const struct dp_router_config *cfg, const char *policy, double param, int *err);

static void shadow_destroy(struct shadow *s)
{
    if (!s)
        return;
    dp_router_destroy(s->rt);
    struct dp_ring *rings[] = { s->in, s->lane, s->done, s->egress };
    for (unsigned i = 0; i < 4; i++)
        if (rings[i])
            dp_ring_close(rings[i]);
    free(s);
}

static struct shadow *shadow_create(const struct dp_router_config *live, const char *policy, double param, int *err)
{
    struct dp_router_config c = *live;
    c.batching = DP_BATCH_DYNAMIC;
    if (c.token_budget < DP_MAX_CHUNK_TOKENS)
        c.token_budget = DP_MAX_CHUNK_TOKENS;   /* a whole chunk a step: each run answers its request */
    c.max_requests = 8;
    c.pool_chunks = 16;
    struct shadow *s = calloc(1, sizeof(*s));
    if (!s) {
        *err = -ENOMEM;
        return NULL;
    }
    if (!(s->rt = router_new(&c, policy, param, err)) ||
        !(s->in = dp_ring_create_private(sizeof(struct dp_chunk), 4, DP_WAIT_SPIN, DP_ROLE_CONSUMER, err)) ||
        !(s->lane = dp_ring_create_private(sizeof(struct dp_chunk), 2 * DP_MAX_BATCH_CHUNKS, DP_WAIT_SLEEP,
                                              DP_ROLE_PRODUCER, err)) ||
        !(s->done = dp_ring_create_private(sizeof(struct dp_completion), 4, DP_WAIT_SPIN, DP_ROLE_CONSUMER, err)) ||
        !(s->egress = dp_ring_create_private(sizeof(struct dp_response_rec), 8, DP_WAIT_SPIN, DP_ROLE_PRODUCER, err)) ||
        (*err = dp_router_add_input(s->rt, s->in)) < 0 || (*err = dp_router_add_worker(s->rt, s->lane, s->done, 1)) < 0 ||
        (*err = dp_router_set_egress(s->rt, s->egress)) < 0) {
        shadow_destroy(s);
        if (*err >= 0)
            *err = -ENOMEM;
        return NULL;
    }
    *err = 0;
    return s;
}

/* The shadow's worker: answer the batch in its lane, each record with token 1. */
static void shadow_answer(struct shadow *s)
{
    uint32_t n = dp_ring_cons_peek(s->lane, DP_MAX_BATCH_CHUNKS);
    if (!n || dp_ring_prod_reserve(s->done, 1) != 1)
        return;
    struct dp_completion *cp = dp_ring_prod_slot(s->done, 0);
    const struct dp_chunk *first = dp_ring_cons_slot(s->lane, 0);
    cp->batch_seq = first->batch_seq;
    cp->worker = 0;
    cp->n = (uint16_t)n;
    cp->t_start = cp->t_end = cp->kv_bytes = 0;
    for (uint32_t i = 0; i < n; i++) {
        const struct dp_chunk *r = dp_ring_cons_slot(s->lane, i);
        cp->e[i] = (struct dp_completion_entry){ .request_id = r->request_id, .token = 1, .status = DP_STATUS_OK };
    }
    dp_ring_prod_commit(s->done, 1);
    dp_ring_cons_release(s->lane, n);
}

static void shadow_run(struct dp_router *rt)
{
    struct shadow *s = rt->shadow;
    const struct dp_chunk *c = &rt->rehearsal;
    if (dp_ring_prod_reserve(s->in, 1) != 1)
        return;
    struct dp_chunk *in = dp_ring_prod_slot(s->in, 0);
    memcpy(in, c, DP_CHUNK_HDR_LEN + c->n_tokens * sizeof(uint32_t));
    in->kind = DP_KIND_CHUNK;
    in->request_id = ++s->next_id;       /* a new request every time, one chunk, two tokens out */
    in->chunk_index = 0;
    in->chunk_count = 1;
    in->max_output_tokens = 2;
    dp_ring_prod_commit(s->in, 1);
    /* the prefill batch; its completion and the decode step; the answer (3 passes) */
    for (int pass = 0; pass < 8 && !dp_ring_cons_peek(s->egress, 1); pass++) {
        dp_router_poll(s->rt);
        shadow_answer(s);
    }
    uint32_t n = dp_ring_cons_peek(s->egress, UINT32_MAX);
    for (uint32_t i = 0; i < n; i++)
        rt->st.shadow_answered += ((const struct dp_response_rec *)dp_ring_cons_slot(s->egress, i))->status == DP_STATUS_OK;
    dp_ring_cons_release(s->egress, n);
}

/* --- lifecycle and control ------------------------------------------------------------ */

uint32_t dp_router_poll(struct dp_router *rt)
{
    pthread_mutex_lock(&rt->lock);
    rt->in_pass = 1;
    uint32_t work = flush_done(rt);
    work += take_completions(rt);
    work += zmq_health(rt);              /* after: an answer that came in time is taken */
    work += find_stalls(rt);
    work += drain_inputs(rt);
    work += send_batches(rt);
    price_admitted(rt);
    if (rt->rehearsal_from != NIL) {     /* a new request's first chunk: the rehearsals' material */
        const struct dp_chunk *c = &rt->pool[rt->rehearsal_from].c;
        if (rt->shadow && c->n_tokens >= 1 && c->n_tokens <= DP_MAX_CHUNK_TOKENS)
            memcpy(&rt->rehearsal, c, DP_CHUNK_HDR_LEN + c->n_tokens * sizeof(uint32_t));
        rt->rehearsal_from = NIL;
    }
    work += expire_stalled(rt);
    if (rt->st.waiting_for_worker && !holding(rt)) {
        place_again(rt, -1);             /* the hold ended with no worker up: answered 503 */
        work++;
    }
    if (work)
        rt->idle_polls = 0;
    else if (rt->shadow) {               /* (a shadow's idle passes warm nothing) */
        warm_step(rt);
        if (++rt->idle_polls % REHEARSE_EVERY == 0) {
            rehearse(rt);
            if (rt->rehearsal.n_tokens && rt->idle_polls % (REHEARSE_EVERY * SHADOW_EVERY) == 0)
                shadow_run(rt);
        }
    }
    rt->st.loops++;
    rt->now = 0;                         /* the next pass reads its own */
    rt->in_pass = 0;
    pthread_mutex_unlock(&rt->lock);
    return work;
}

static int check_batching(uint32_t batching, uint32_t budget, uint32_t max_chunks, uint32_t max_batch)
{
    if (batching > DP_BATCH_STATIC || budget < 1 || max_chunks < 1 || max_chunks > DP_MAX_BATCH_CHUNKS ||
        max_batch < 1 || max_batch > DP_MAX_BATCH_CHUNKS)
        return -EINVAL;
    return 0;
}

struct dp_router *dp_router_create(const struct dp_router_config *cfg, const char *policy, double param, int *err)
{
    struct dp_router *rt = router_new(cfg, policy, param, err);
    if (rt && !(rt->shadow = shadow_create(&rt->cfg, policy, param, err))) {
        dp_router_destroy(rt);
        return NULL;
    }
    return rt;
}

static struct dp_router *router_new(const struct dp_router_config *cfg, const char *policy, double param, int *err)
{
    struct dp_router_config c = *cfg;
    if (!c.token_budget)
        c.token_budget = 512;
    if (!c.max_chunks)
        c.max_chunks = DP_MAX_BATCH_CHUNKS;
    if (!c.max_batch_size)
        c.max_batch_size = 32;
    if (!c.batch_timeout_ns)
        c.batch_timeout_ns = 50000000ull;
    if (!c.reassembly_timeout_ns)
        c.reassembly_timeout_ns = 1000000000ull;
    if (!c.max_requests)
        c.max_requests = 4096;
    if (!c.pool_chunks)
        c.pool_chunks = 8192;
    if (check_batching(c.batching, c.token_budget, c.max_chunks, c.max_batch_size) ||
        (c.max_requests & (c.max_requests - 1)) || c.max_requests < 8 || c.max_requests > (1u << 20) ||
        c.pool_chunks > (1u << 22) || c.split_slack > DP_MAX_CHUNK_TOKENS) {
        *err = -EINVAL;
        return NULL;
    }
    struct dp_router *rt = hot_alloc(sizeof(*rt));
    if (!rt) {
        *err = -ENOMEM;
        return NULL;
    }
    rt->cfg = c;
    rt->cuts_fd = rt->buckets_fd = rt->others_fd = -1;
    if (getrandom(&rt->key_secret, sizeof(rt->key_secret), 0) != sizeof(rt->key_secret))
        rt->key_secret = dp_hash64((uint64_t)(uintptr_t)rt ^ now_ns());
    pthread_mutex_init(&rt->lock, NULL);
    rt->reqs = hot_alloc(c.max_requests * sizeof(struct req));
    rt->by_id.e = hot_alloc(2 * (size_t)c.max_requests * sizeof(*rt->by_id.e));
    rt->by_session.e = hot_alloc(2 * (size_t)c.max_requests * sizeof(*rt->by_session.e));
    rt->pool = hot_alloc((size_t)c.pool_chunks * sizeof(struct pooled));
    rt->arr = hot_alloc(c.max_requests * sizeof(*rt->arr));
    rt->by_tenant.e = hot_alloc(2 * (size_t)c.max_requests * sizeof(*rt->by_tenant.e));
    rt->by_id.mask = rt->by_session.mask = rt->by_tenant.mask = 2 * c.max_requests - 1;
    rt->early.mask = early_slots(c.pool_chunks) - 1;
    rt->early.e = hot_alloc(early_slots(c.pool_chunks) * sizeof(*rt->early.e));
    if (!rt->reqs || !rt->pool || !rt->by_id.e || !rt->by_session.e || !rt->arr || !rt->by_tenant.e || !rt->early.e) {
        dp_router_destroy(rt);
        *err = -ENOMEM;
        return NULL;
    }
    rt->pool_free = NIL;
    for (uint32_t i = c.pool_chunks; i-- > 0;)
        pool_put(rt, i);
    for (uint32_t i = 0; i <= rt->by_id.mask; i++)
        rt->by_id.e[i].slot = rt->by_session.e[i].slot = rt->by_tenant.e[i].slot = NIL;
    for (uint32_t i = 0; i <= rt->early.mask; i++)
        rt->early.e[i].slot = NIL;
    rt->req_free = NIL;
    for (uint32_t i = c.max_requests; i-- > 0;) {
        rt->reqs[i].fifo_next = rt->req_free;
        rt->req_free = i;
    }
    rt->done_head = rt->done_tail = NIL;
    rt->rehearsal_from = rt->unpriced = NIL;
    for (uint32_t i = 0; i < c.max_requests; i++)
        rt->arr[i].next_free = i + 1 < c.max_requests ? i + 1 : NIL;
    for (uint32_t p = 0; p < DP_MAX_POOLS; p++) {
        rt->order[p] = (uint8_t)p;
        int rc = dp_policy_init(&rt->pools[p].policy, policy, c.seed, param);
        if (rc) {
            dp_router_destroy(rt);
            *err = rc;
            return NULL;
        }
    }
    if (!(rt->adm = dp_adm_create())) {
        dp_router_destroy(rt);
        *err = -ENOMEM;
        return NULL;
    }
    /* more than a tenant's share could never be held whole (a 503 at every try) */
    dp_adm_set_max_chunks(rt->adm, share_chunks(&c));
    return rt;
}

void dp_router_destroy(struct dp_router *rt)
{
    if (!rt)
        return;
    shadow_destroy(rt->shadow);
    for (uint32_t p = 0; p < DP_MAX_POOLS; p++)
        if (rt->pools[p].policy.ops)
            dp_policy_fini(&rt->pools[p].policy);
    dp_adm_destroy(rt->adm);
    for (uint32_t k = 0; k < rt->view.n; k++) {
        free(rt->w[k].decoding);
        free(rt->w[k].stage);
        free(rt->w[k].cbuf);
        free(rt->w[k].endpoint);
        zmq_shut(&rt->w[k]);
    }
    if (rt->zctx)
        zmq_ctx_term(rt->zctx);
    hot_free(rt->reqs, rt->cfg.max_requests * sizeof(struct req));
    hot_free(rt->by_id.e, 2 * (size_t)rt->cfg.max_requests * sizeof(*rt->by_id.e));
    hot_free(rt->by_session.e, 2 * (size_t)rt->cfg.max_requests * sizeof(*rt->by_session.e));
    hot_free(rt->pool, (size_t)rt->cfg.pool_chunks * sizeof(struct pooled));
    hot_free(rt->arr, rt->cfg.max_requests * sizeof(*rt->arr));
    hot_free(rt->by_tenant.e, 2 * (size_t)rt->cfg.max_requests * sizeof(*rt->by_tenant.e));
    hot_free(rt->early.e, early_slots(rt->cfg.pool_chunks) * sizeof(*rt->early.e));
    hot_free(rt->kv_homes.e, 2 * KV_HOMES * sizeof(*rt->kv_homes.e));
    if (rt->cuts_fd >= 0)
        close(rt->cuts_fd);
    if (rt->buckets_fd >= 0)
        close(rt->buckets_fd);
    if (rt->others_fd >= 0)
        close(rt->others_fd);
    pthread_mutex_destroy(&rt->lock);
    hot_free(rt, sizeof(*rt));
}

int dp_router_watch_cuts(struct dp_router *rt, int map_fd, int buckets_fd, int others_fd)
{
    if (rt->cuts_fd >= 0)
        return -EBUSY;                             /* one map, set before the router runs */
    int fd = fcntl(map_fd, F_DUPFD_CLOEXEC, 0);   /* its own: the ingress may close first */
    if (fd < 0)
        return -errno;
    int bfd = buckets_fd >= 0 ? fcntl(buckets_fd, F_DUPFD_CLOEXEC, 0) : -1;
    int ofd = others_fd >= 0 ? fcntl(others_fd, F_DUPFD_CLOEXEC, 0) : -1;
    if ((buckets_fd >= 0 && bfd < 0) || (others_fd >= 0 && ofd < 0)) {
        int e = errno;
        close(fd);
        if (bfd >= 0)
            close(bfd);
        if (ofd >= 0)
            close(ofd);
        return -e;
    }
    rt->cuts_fd = fd;
    rt->buckets_fd = bfd;
    rt->others_fd = ofd;
    return 0;
}

int dp_router_add_feed(struct dp_router *rt, uintptr_t feed, uintptr_t src)
{
    if (!feed || !src)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    int rc = rt->feed ? -EBUSY : 0;
    if (!rc) {
        rt->feed = feed;
        rt->feed_src = src;
    }
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

int dp_router_add_input(struct dp_router *rt, struct dp_ring *in)
{
    if (in->h->slot_size < sizeof(struct dp_chunk))
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    int rc = rt->n_in < DP_MAX_INPUTS ? (rt->in[rt->n_in++] = in, (int)rt->n_in - 1) : -ENOSPC;
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

static int add_worker(struct dp_router *rt, int kind, struct dp_ring *lane, struct dp_ring *done, void *zsock,
                      void *zmon, char *endpoint, uint32_t weight)
{
    pthread_mutex_lock(&rt->lock);
    int k = -ENOSPC;
    if (rt->view.n < DP_MAX_WORKERS) {
        k = (int)rt->view.n;
        struct worker *w = &rt->w[k];
        memset(w, 0, sizeof(*w));
        w->kind = kind;
        w->lane = lane;
        w->done = done;
        w->zsock = zsock;
        w->zmon = zmon;
        w->endpoint = endpoint;
        if (kind == DP_LANE_ZMQ) {
            w->stage = malloc((size_t)DP_MAX_BATCH_CHUNKS * sizeof(struct dp_chunk));
            w->cbuf = malloc(sizeof(*w->cbuf));
        }
        w->decoding = calloc(rt->cfg.max_requests, sizeof(uint32_t));
        if (!w->decoding || (kind == DP_LANE_ZMQ && (!w->stage || !w->cbuf))) {
            free(w->stage);              /* not added: the router thread would have read NULL */
            free(w->cbuf);
            free(w->decoding);
            memset(w, 0, sizeof(*w));
            pthread_mutex_unlock(&rt->lock);
            return -ENOMEM;
        }
        rt->n_zmq += kind == DP_LANE_ZMQ;
        w->fifo_head = w->fifo_tail = NIL;
        w->st.up = 1;
        rt->view.up[k] = 1;
        rt->view.weight[k] = weight;
        rt->view.id[k] = (uint16_t)k;
        rt->view.depth[k] = rt->view.tokens[k] = 0;
        rt->view.n++;
        w->pool = 0;
        views_changed(rt);
        if (rt->st.waiting_for_worker)
            place_again(rt, -1);        /* a worker up: it takes what waited (set_up's rule; review) */
    }
    pthread_mutex_unlock(&rt->lock);
    return k;
}

static int lane_fits(const struct dp_router *rt, const struct dp_ring *lane, const struct dp_ring *done)
{
    return lane->h->slot_size >= sizeof(struct dp_chunk) && lane->h->capacity >= rt->cfg.max_chunks &&
           done->h->slot_size >= sizeof(struct dp_completion);
}

int dp_router_add_worker(struct dp_router *rt, struct dp_ring *lane, struct dp_ring *done, uint32_t weight)
{
    if (!lane_fits(rt, lane, done))
        return -EINVAL;
    return add_worker(rt, DP_LANE_SHM, lane, done, NULL, NULL, NULL, weight);
}

/* ZMTP heartbeats on a zmq lane's connection (with a zmq_timeout: a router without one, as the
 * pipeline's, watches its workers' processes instead, and a stop past the heartbeats' timeout
 * would only cut the connection a woken worker's answer was to take): a PING every ZMQ_PING_MS;
 * one unanswered for ZMQ_PING_TIMEOUT_MS closes the connection, which the monitor reports as
 * lost (zmq_lost). The
 * peer's libzmq I/O thread answers, not the worker's loop, so a long step is not taken for a
 * silence, while a stopped process (SIGSTOP) or a link that drops without a FIN is: before, a
 * batch sent on such a connection waited zmq_timeout (30 s) and a stopped worker drew new
 * requests meanwhile. The worker is told to drop a router it has not heard from for as long
 * (the PING's TTL), so its answers do not go to a connection that is gone. */
#define ZMQ_PING_MS 500
#define ZMQ_PING_TIMEOUT_MS 2000

/* A DEALER connected to endpoint, dropping what it holds when closed (linger 0), and queueing
 * only to a connection that is up (ZMQ_IMMEDIATE: with none, a send is refused, the batch stays
 * unsent here and times out, never waits in the socket for a worker that comes back). What it
 * takes in is bounded: a message past a completion's size drops its peer, and a few wait at
 * most (a worker answers one batch at a time). Unbounded, a peer bound on the endpoint sent
 * 4 frames of 256 MiB and the router's RSS grew 72 MB -> 1.1 GB (found by review). NULL and
 * errno on failure. */
static void *zmq_dealer(void *zctx, const char *endpoint, void **mon, int ping)
{
    *mon = NULL;
    void *s = zmq_socket(zctx, ZMQ_DEALER);
    if (!s)
        return NULL;
    int linger = 0, hwm = 4, immediate = 1;
    int64_t most = sizeof(struct dp_completion);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &most, sizeof(most));
    zmq_setsockopt(s, ZMQ_IMMEDIATE, &immediate, sizeof(immediate));
    if (ping) {                          /* (no zmq_timeout: nothing would act on a loss) */
        int every = ZMQ_PING_MS, silent = ZMQ_PING_TIMEOUT_MS;
        zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &every, sizeof(every));
        zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &silent, sizeof(silent));
        zmq_setsockopt(s, ZMQ_HEARTBEAT_TTL, &silent, sizeof(silent));
    }
    if (zmq_connect(s, endpoint) < 0) {
        int e = errno;
        zmq_close(s);
        errno = e;
        return NULL;
    }
    /* its lost connections reported on *mon (none made: the timeout alone finds a dead peer) */
    static uint64_t monitors;            /* (a name of its own: a closed socket's may be taken still) */
    char addr[64];
    snprintf(addr, sizeof(addr), "inproc://dp-zmq-monitor-%llu",
             (unsigned long long)__atomic_add_fetch(&monitors, 1, __ATOMIC_RELAXED));
    if (zmq_socket_monitor(s, addr, ZMQ_EVENT_DISCONNECTED) == 0) {
        void *m = zmq_socket(zctx, ZMQ_PAIR);
        if (m && zmq_setsockopt(m, ZMQ_LINGER, &linger, sizeof(linger)) == 0 && zmq_connect(m, addr) == 0) {
            *mon = m;
        } else {
            if (m)
                zmq_close(m);
            zmq_socket_monitor(s, NULL, 0);
        }
    }
    return s;
}

/* w's socket and its monitor's, closed (linger 0: what they hold is dropped) */
static void zmq_shut(struct worker *w)
{
    if (w->zsock)
        zmq_close(w->zsock);
    if (w->zmon)
        zmq_close(w->zmon);
    w->zsock = w->zmon = NULL;
}

/* Whether w's monitor reported a connection lost since the last look (its events all read: a
 * 6-byte frame, the event's id and value, then the endpoint's). */
static int zmq_lost(struct worker *w)
{
    int lost = 0, more;
    uint8_t ev[6];
    while (w->zmon) {
        int n = zmq_recv(w->zmon, ev, sizeof(ev), ZMQ_DONTWAIT);
        if (n < 0)
            break;
        lost |= n >= 2 && (ev[0] | ev[1] << 8) == ZMQ_EVENT_DISCONNECTED;
        size_t len = sizeof(more);
        while (zmq_getsockopt(w->zmon, ZMQ_RCVMORE, &more, &len) == 0 && more)
            zmq_recv(w->zmon, ev, sizeof(ev), ZMQ_DONTWAIT);   /* (the endpoint, truncated) */
    }
    return lost;
}

int dp_router_add_zmq_worker(struct dp_router *rt, const char *endpoint, uint32_t weight)
{
    if (!rt->zctx && !(rt->zctx = zmq_ctx_new()))
        return -errno;
    char *ep = strdup(endpoint);
    if (!ep)
        return -ENOMEM;
    void *mon, *s = zmq_dealer(rt->zctx, endpoint, &mon, rt->cfg.zmq_timeout_ns != 0);
    if (!s) {
        int e = errno;
        free(ep);
        return -e;
    }
    int k = add_worker(rt, DP_LANE_ZMQ, NULL, NULL, s, mon, ep, weight);
    if (k < 0) {
        zmq_close(s);
        if (mon)
            zmq_close(mon);
        free(ep);
    }
    return k;
}

int dp_router_set_egress(struct dp_router *rt, struct dp_ring *egress)
{
    if (egress && egress->h->slot_size < sizeof(struct dp_response_rec))
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    rt->egress = egress;
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_policy(struct dp_router *rt, const char *policy, double param)
{
    if (rt->shadow) {                    /* the shadow runs the live policy's code */
        int rc = dp_router_set_policy(rt->shadow->rt, policy, param);
        if (rc)
            return rc;
    }
    struct dp_policy p[DP_MAX_POOLS];
    for (uint32_t i = 0; i < DP_MAX_POOLS; i++) {
        int rc = dp_policy_init(&p[i], policy, rt->cfg.seed, param);
        if (rc) {
            while (i-- > 0)
                dp_policy_fini(&p[i]);
            return rc;
        }
    }
    pthread_mutex_lock(&rt->lock);
    for (uint32_t i = 0; i < DP_MAX_POOLS; i++) {
        dp_policy_fini(&rt->pools[i].policy);
        rt->pools[i].policy = p[i];  /* requests already placed stay where their KV is */
    }
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_weight(struct dp_router *rt, uint32_t worker, uint32_t weight)
{
    if (worker >= rt->view.n)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    rt->view.weight[worker] = weight;
    views_changed(rt);
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_key_secret(struct dp_router *rt, uint64_t secret)
{
    pthread_mutex_lock(&rt->lock);
    int fresh = !rt->st.loops;           /* no pass yet, so no key made with the old one */
    if (fresh)
        rt->key_secret = secret;
    pthread_mutex_unlock(&rt->lock);
    return fresh ? 0 : -EBUSY;
}

static void mark_up(struct dp_router *rt, uint32_t k, int up)
{
    struct worker *w = &rt->w[k];
    rt->view.up[k] = up ? 1 : 0;
    w->timed_out = 0;                   /* the control plane's word, or zmq_health's, is the last */
    w->stalled = w->st.stalled = 0;     /* down: gone; up: the control plane's word (find_stalls may
                                         * find it stalled again) */
    w->st.up = rt->view.up[k];
    views_changed(rt);                  /* (a worker up: one stalled alone may be hidden now) */
}

/* Worker k marked up or down (mark_up), was_up before: what it held moves, its socket follows.
 * probe: a zmq worker going down keeps a socket, fresh, for zmq_health's probes; without (the
 * control plane's word) it keeps none until it is up again: a socket left connected to the
 * endpoint took the completions of the worker bound there next, which a DEALER sends to its
 * peers in turn (found by the CLI test, a second worker on the first one's endpoint) */
static void went(struct dp_router *rt, uint32_t k, int was_up, int up, int probe)
{
    struct worker *w = &rt->w[k];
    if (was_up && !up) {
        failover(rt, k, probe);
        /* A zmq worker's socket is replaced (linger 0 drops what it held): a connecting socket
         * keeps its queue, so the batch just replayed elsewhere reached the worker once it was
         * back (restarted, or its link healed), which ran it on the store's newer copy of the
         * sessions (found by review). A batch already in the worker's own buffers is not
         * reached: a stalled worker that wakes still runs it (docs/known-limits.md, left open). */
        if (w->kind == DP_LANE_ZMQ) {
            zmq_shut(w);
            if (probe)
                w->zsock = worker_dealer(rt, w);
            w->unsent = 0;
            rt->st.zmq_sockets_replaced++;
        }
    } else if (!was_up && !up && !probe && w->kind == DP_LANE_ZMQ && w->zsock) {
        /* down already, timed out, its probe socket connected: the control plane's word closes
         * that too. Left open, nobody read it, and it took every other completion and probe reply
         * of the worker bound at the endpoint next (found by review) */
        zmq_shut(w);
    } else if (!was_up && up && w->kind == DP_LANE_ZMQ && !w->zsock) {
        w->zsock = worker_dealer(rt, w);   /* NULL: its batches stay unsent, time out */
    }
    if (!was_up && up && rt->st.waiting_for_worker)
        place_again(rt, -1);            /* the first worker up takes what waited for one */
}

static void set_up(struct dp_router *rt, uint32_t k, int up, int probe)
{
    int was_up = rt->view.up[k];
    mark_up(rt, k, up);
    went(rt, k, was_up, up, probe);
}

int dp_router_set_stall(struct dp_router *rt, uint64_t stall_ns)
{
    pthread_mutex_lock(&rt->lock);
    rt->cfg.stall_ns = stall_ns;
    if (!stall_ns) {
        for (uint32_t k = 0; k < rt->view.n; k++)
            rt->w[k].stalled = rt->w[k].st.stalled = 0;
        views_changed(rt);
    }
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_down(struct dp_router *rt, const uint32_t *workers, uint32_t n)
{
    uint8_t was_up[DP_MAX_WORKERS];
    if (n > DP_MAX_WORKERS)
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (workers[i] >= rt->view.n)
            return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    for (uint32_t i = 0; i < n; i++) {  /* all down first: none's requests move onto another of them */
        was_up[i] = rt->view.up[workers[i]];
        mark_up(rt, workers[i], 0);
    }
    for (uint32_t i = 0; i < n; i++)
        went(rt, workers[i], was_up[i], 0, 0);
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_hold(struct dp_router *rt, uint64_t hold_ns)
{
    pthread_mutex_lock(&rt->lock);
    uint64_t now = now_ns(), until = hold_ns > UINT64_MAX - now ? UINT64_MAX : now + hold_ns;
    rt->hold_until = !hold_ns ? 0 : until > rt->hold_until ? until : rt->hold_until;   /* a later end kept */
    if (!hold_ns && rt->st.waiting_for_worker)
        place_again(rt, -1);            /* answered now (503, unless a worker is up) */
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_up(struct dp_router *rt, uint32_t worker, int up)
{
    if (worker >= rt->view.n)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    set_up(rt, worker, up, 0);
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_replace_lane(struct dp_router *rt, uint32_t worker, struct dp_ring *lane, struct dp_ring *done)
{
    if (worker >= rt->view.n || !lane_fits(rt, lane, done))
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    struct worker *w = &rt->w[worker];
    int rc = w->kind != DP_LANE_SHM ? -EINVAL : rt->view.up[worker] ? -EBUSY : 0;
    if (!rc) {                          /* down: failover() left it nothing in flight */
        w->lane = lane;
        w->done = done;
    }
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

int dp_router_set_worker_budget(struct dp_router *rt, uint32_t worker, uint32_t token_budget)
{
    if (worker >= rt->view.n)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    rt->w[worker].budget = token_budget;
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_worker_store(struct dp_router *rt, uint32_t worker, int has_store)
{
    if (worker >= rt->view.n)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    rt->w[worker].no_store_said = !has_store;
    if (!has_store)
        rt->w[worker].no_store = 1;      /* (declared with one: what was said stands till its next answer) */
    if (rt->w[worker].stalled)
        views_changed(rt);               /* a stalled worker without a store is not hidden */
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_pool(struct dp_router *rt, uint32_t pool, uint32_t price_per_1k, uint32_t room_per_worker)
{
    if (pool >= DP_MAX_POOLS)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    rt->pools[pool].price = price_per_1k;
    rt->pools[pool].room = room_per_worker;
    for (uint32_t i = 1; i < DP_MAX_POOLS; i++)       /* insertion sort: by price, then by number */
        for (uint32_t j = i; j > 0; j--) {
            uint8_t a = rt->order[j - 1], b = rt->order[j];
            if (rt->pools[a].price < rt->pools[b].price || (rt->pools[a].price == rt->pools[b].price && a < b))
                break;
            rt->order[j - 1] = b;
            rt->order[j] = a;
        }
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_worker_pool(struct dp_router *rt, uint32_t worker, uint32_t pool)
{
    if (worker >= rt->view.n || pool >= DP_MAX_POOLS)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    rt->w[worker].pool = (uint16_t)pool;   /* requests already placed stay on their worker */
    views_changed(rt);
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_pool_stats(struct dp_router *rt, uint32_t pool, struct dp_pool_stats *s)
{
    if (pool >= DP_MAX_POOLS)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    const struct pool *pl = &rt->pools[pool];
    *s = (struct dp_pool_stats){ pl->requests, pl->spilled, pl->price, pl->room, pl->view.n, pool_up(pl),
                                 pl->view.total_depth, (uint32_t)pool_promised(rt, pl, 0) };
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_router_set_tenant(struct dp_router *rt, uint32_t tenant, const struct dp_tenant_cfg *cfg)
{
    pthread_mutex_lock(&rt->lock);
    int rc = dp_adm_set_tenant(rt->adm, tenant, cfg);
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

void dp_router_set_default_tenant(struct dp_router *rt, const struct dp_tenant_cfg *cfg)
{
    pthread_mutex_lock(&rt->lock);
    dp_adm_set_default(rt->adm, cfg);
    pthread_mutex_unlock(&rt->lock);
}

int dp_router_tenant_stats(struct dp_router *rt, uint32_t tenant, struct dp_adm_tenant_stats *s)
{
    pthread_mutex_lock(&rt->lock);
    int rc = dp_adm_tenant_stats(rt->adm, tenant, now_ns(), s);
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

int dp_router_set_batching(struct dp_router *rt, uint32_t batching, uint32_t budget, uint32_t max_chunks,
                           uint32_t max_batch, uint64_t timeout_ns)
{
    int rc = check_batching(batching, budget, max_chunks, max_batch);
    if (rc)
        return rc;
    pthread_mutex_lock(&rt->lock);
    for (uint32_t k = 0; k < rt->view.n; k++)   /* a batch must fit each lane, as add_worker checks */
        if (rt->w[k].kind == DP_LANE_SHM && rt->w[k].lane->h->capacity < max_chunks)
            rc = -EINVAL;
    if (!rc && batching != rt->cfg.batching && rt->st.active_requests)
        rc = -EBUSY;             /* switching modes with requests in flight would strand them */
    if (!rc) {
        rt->cfg.batching = batching;
        rt->cfg.token_budget = budget;
        rt->cfg.max_chunks = max_chunks;
        rt->cfg.max_batch_size = max_batch;
        rt->cfg.batch_timeout_ns = timeout_ns;
    }
    pthread_mutex_unlock(&rt->lock);
    return rc;
}

void dp_router_get_stats(struct dp_router *rt, struct dp_router_stats *s)
{
    pthread_mutex_lock(&rt->lock);
    *s = rt->st;
    pthread_mutex_unlock(&rt->lock);
}

int dp_router_worker_stats(struct dp_router *rt, uint32_t worker, struct dp_worker_stats *s)
{
    if (worker >= rt->view.n)
        return -EINVAL;
    pthread_mutex_lock(&rt->lock);
    *s = rt->w[worker].st;
    s->token_budget = rt->w[worker].budget ? rt->w[worker].budget : rt->cfg.token_budget;
    if (rt->w[worker].kind == DP_LANE_SHM) {
        struct dp_ring_stats rs;
        dp_ring_get_stats(rt->w[worker].lane, &rs);
        s->lane_depth = rs.depth;
        s->lane_full_events = rs.full_events;
    }
    pthread_mutex_unlock(&rt->lock);
    return 0;
}

int dp_policy_map(const char *policy, double param, uint64_t seed, const struct dp_workers *w,
                  const struct dp_outcome *outcomes, const int32_t *ended_on, uint32_t n_outcomes,
                  const struct dp_request *reqs, int32_t *out, uint32_t n)
{
    struct dp_policy p;
    int rc = dp_policy_init(&p, policy, seed, param);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < n_outcomes; i++)
        dp_policy_done(&p, w, ended_on[i], &outcomes[i]);
    for (uint32_t i = 0; i < n; i++)
        out[i] = dp_policy_pick(&p, w, &reqs[i]);
    dp_policy_fini(&p);
    return 0;
}

/* The benchmark's reference: a worker drawn from the session's bits, reading no state, through
 * the same indirect call (a constant pick made every lane update hit one line: slower). */
static int random_pick(struct dp_policy *p, const struct dp_workers *w, const struct dp_request *rq)
{
    (void)p;
    return (int)(((uint64_t)(uint32_t)rq->session * w->n) >> 32);
}

static const struct dp_policy_ops random_policy = { .name = "", .pick = random_pick };

double dp_policy_bench(const char *policy, uint32_t n_workers, uint64_t decisions)
{
    struct dp_policy p = { .ops = &random_policy };
    static struct dp_workers w;
    if (n_workers < 1 || n_workers > DP_MAX_WORKERS || (policy[0] && dp_policy_init(&p, policy, 12345, 0)))
        return -1;
    memset(&w, 0, sizeof(w));
    w.n = n_workers;
    w.generation = 1;
    uint64_t x = 88172645463325252ull, sink = 0;
    for (uint32_t j = 0; j < n_workers; j++) {
        w.up[j] = 1;
        w.id[j] = (uint16_t)j;
        w.weight[j] = 1 + j % 4;
        w.depth[j] = (uint32_t)(dp_hash64(j) % 64);
        w.total_depth += w.depth[j];
        w.tokens[j] = w.depth[j] * 64;
        w.total_tokens += w.tokens[j];
    }
    struct dp_request rq = { 1, 0, 64, 4, 1, now_ns() };
    dp_policy_pick(&p, &w, &rq);      /* builds any policy tables outside the timing */
    for (uint32_t j = 0; j < n_workers; j++) {   /* one request ended on each: a policy that learns has figures */
        struct dp_outcome o = { j, 0, DP_STATUS_OK, 64, 4, 1000000, 1000000 + 1000 * (uint64_t)(j % 7), now_ns() };
        dp_policy_done(&p, &w, (int)j, &o);
    }
    uint64_t t = now_ns();
    for (uint64_t i = 0; i < decisions; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        rq.session = x;
        rq.tenant = (uint32_t)i;
        int k = dp_policy_pick(&p, &w, &rq);
        sink += (uint64_t)k;
        /* the chosen worker's lane grows and another drains, as under load (a chunk: 64 tokens) */
        w.depth[k]++;
        w.total_depth++;
        w.tokens[k] += 64;
        w.total_tokens += 64;
        uint32_t d = (uint32_t)(x % n_workers);
        if (w.depth[d]) {
            w.depth[d]--;
            w.total_depth--;
            w.tokens[d] -= 64;
            w.total_tokens -= 64;
        }
    }
    double ns = (double)(now_ns() - t) / (double)decisions;
    dp_policy_fini(&p);
    return sink == UINT64_MAX ? -2 : ns;   /* sink keeps the loop from being optimised away */
}
