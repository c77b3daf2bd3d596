/* router.h - the micro-batching router: input rings -> per-worker lanes.
 *
 * It drains chunk records (struct dp_chunk) from its input rings, keeps
 * bounded per-request state, picks a worker per request with a routing policy
 * (policy.h), forms micro-batches and places each in the worker's lane with
 * one commit; completions come back on a per-worker completion ring (one SPSC
 * ring per producer), finished requests leave on the egress ring as
 * struct dp_response_rec.
 *
 *   dynamic (default): whenever a worker is free, its batch is built at once:
 *     one decode step for each of its decoding requests first, then prefill
 *     chunks in arrival order (the oldest request's first, until its chunks
 *     run out), up to a token budget and a chunk cap; a chunk that does not
 *     fit the remaining budget is split (re-chunked) unless it overruns it by
 *     at most split_slack tokens, so no batch waits to fill and no piece
 *     exceeds 128 tokens.
 *   static (the classic server, for comparison): a worker takes up to
 *     max_batch_size complete requests once that many wait or the oldest has
 *     waited batch_timeout; it runs them to the end (all prefill, then decode
 *     steps) before it takes new ones.
 *
 * A session's requests run one at a time, in arrival order: one that arrives
 * while an earlier request of its session is unfinished is held (buffered,
 * not scheduled) until that one ends, so two never interleave on one KV cache.
 *
 * Admission (admission.h) decides once per request, when the router first
 * sees it (its first chunk, or an OPEN record, which also reserves room for
 * its chunks): a refusal (400 oversized, 422 over budget, 429 over the
 * per-minute limit) is answered with a JSON body and the request's other
 * chunks count as late duplicates; COUNT_TOKENS records are answered 200
 * with the price and run nothing. An admitted request is placed on a pool
 * (dp_router_set_pool), then on a worker of it by the routing policy.
 *
 * A worker whose batch has gone unanswered too long (stall_ns) is stalled:
 * hidden from placement while another is up and not stalled, what is queued
 * for it (none of it in its lane) placed again; its next answer ends it.
 *
 * Nothing is dropped silently: a malformed chunk or a full request table
 * yields a 400/503 response record (once per request: its other chunks then
 * count as late duplicates); a new request whose chunks the pool could not
 * hold besides those promised to requests still arriving is refused 503; a
 * request still missing chunks reassembly_timeout after its last one came
 * (and nothing of it in flight) is answered 400 (unless the XDP bucket cut
 * it and answered 429: dp_router_watch_cuts) and its state freed; a chunk of
 * a request that has just finished is counted as a late duplicate, not run
 * again. A full lane only delays its worker's batches; input is held back
 * (input_stalls) only while a refusal or a price must be answered and the
 * egress ring is full. With no worker up, a request waits for one while the
 * control plane says one is coming (dp_router_hold), else it is answered 503.
 */
#ifndef DP_ROUTER_H
#define DP_ROUTER_H

#include <pthread.h>
#include <stdint.h>

#include "admission.h"
#include "chunk.h"
#include "policy.h"
#include "ring.h"

/* CDEF BEGIN */
#define DP_MAX_INPUTS 16
#define DP_LANE_SHM 0
#define DP_LANE_ZMQ 1
#define DP_MAX_POOLS 4

enum dp_batching { DP_BATCH_DYNAMIC = 0, DP_BATCH_STATIC = 1 };

struct dp_router_config {
    uint32_t batching;          /* enum dp_batching */
    uint32_t token_budget;      /* dynamic: tokens per step (default 512) */
    uint32_t max_chunks;        /* records per batch (<= DP_MAX_BATCH_CHUNKS) */
    uint32_t max_batch_size;    /* static: requests per batch (default 32) */
    uint64_t batch_timeout_ns;  /* static: the longest the oldest request waits for a full batch */
    uint32_t max_requests;      /* request table size (power of two) */
    uint32_t pool_chunks;       /* chunks buffered in the router */
    uint64_t seed;              /* policy randomness */
    uint64_t reassembly_timeout_ns;  /* a request missing chunks this long after its last one came is
                                      * answered 400 and freed */
    uint32_t split_slack;       /* dynamic: a prompt piece that overruns the step's budget by at most
                                 * this many tokens goes whole, not split (0: always split) */
    uint64_t zmq_timeout_ns;    /* a zmq worker whose batch is unanswered this long is marked down and
                                 * its requests replayed (0: never; shm workers: the control plane's
                                 * watcher, which sees their processes) */
    uint64_t stall_ns;          /* a worker whose batch has gone unanswered for the larger of this and
                                 * STALL_FACTOR x its recent longest batch is stalled: new requests go to
                                 * the others while one is up and not stalled; it keeps what it holds
                                 * until it answers (0: never) */
};

struct dp_worker_stats {
    uint64_t batches, records, tokens, decode_steps, completions;
    uint64_t placed;                         /* requests placed here as they came (the policy's pick,
                                              * or the worker holding the session's KV) */
    uint64_t answered;                       /* requests that ended 200 here (where a failover or a
                                              * KV move took them, not where they were placed) */
    uint32_t depth, busy, decoding, up;
    uint32_t stalled;                        /* up, but its batch unanswered too long (stall_ns) */
    uint32_t queued_tokens;                  /* depth in tokens (policy.h's dp_workers.tokens) */
    uint64_t lane_depth, lane_full_events;   /* shm lanes: the ring's own counters */
    uint32_t token_budget;                   /* dynamic batching's per-step budget on this worker */
};

struct dp_router_stats {
    uint64_t chunks_in, requests_in, control_in, bad_chunks, duplicate_chunks, table_full;
    uint64_t batches, records_out, tokens_out, decode_out, splits;
    uint64_t completions, responses, egress_stalls, input_stalls, loops, expired, late_duplicates;
    uint64_t refused_by_worker, replayed, pool_refused;
    uint64_t replay_refused;            /* 503: its replay's worker died too with some of it (a request
                                         * is replayed once; one a dead worker never had moves on) */
    uint64_t held;                      /* requests that waited for an earlier one of their session */
    uint64_t rehearsals;                /* idle dry runs of a new request's path (router.c, rehearse) */
    uint64_t shadow_answered;           /* rehearsal requests the shadow router ran whole and answered 200 */
    uint64_t closed;                    /* CLOSE records routed to their session's worker */
    uint64_t moved;                     /* requests placed on another worker than their session's last,
                                         * which restores the session from the store (if it has one); a
                                         * session whose entry in the last-run table another took counts
                                         * as new, not here (a pair of 61 sessions collides in ~36% of
                                         * offers: compare's restores are the store's exact count) */
    /* admission (admission.h), one count per request decided */
    uint64_t admitted, adm_oversized, adm_over_budget, adm_rate_limited, adm_counted, opened;
    uint64_t adm_no_slot;               /* 503: a limited tenant the admission's table had no slot for */
    uint64_t to_secondary;      /* admitted requests placed on the secondary pool (a tenant's high-entropy burst) */
    uint64_t xdp_cut;           /* requests the XDP bucket cut (answered 429 there), dropped at the reassembly
                                 * timeout without a 400, or refused at first sight without an answer
                                 * (dp_router_watch_cuts) */
    uint64_t no_worker;         /* 503: no worker up in any pool, or the policy picked none */
    uint64_t bad_picks;         /* a policy's picks of a worker out of range or down (its bug), once a
                                 * request: at admission (counted in no_worker too), a CLOSE, a
                                 * failover's replay */
    uint64_t zmq_timeouts;      /* zmq workers marked down: a batch unanswered for zmq_timeout */
    uint64_t zmq_revived;       /* zmq workers marked down so, back up: they answered a probe */
    uint64_t zmq_lost;          /* of zmq_timeouts, those found at once: the connection of a batch sent was
                                 * lost (the socket monitor's disconnect), ZMQ_LOST_NS after the loss */
    uint64_t stalls;            /* workers found stalled (dp_router_config.stall_ns), each time */
    uint64_t stall_moved;       /* requests moved off a stalled worker before any of them reached its lane */
    uint64_t zmq_sockets_replaced;  /* zmq workers' sockets closed as they went down (what they held dropped):
                                     * a fresh one for the probes after a timeout, none on the
                                     * control plane's word until it says up */
    uint64_t tenant_share_refused;  /* 503: the tenant's requests still arriving hold its share of the
                                     * chunk pool's room or of the request table (router.c, TENANT_SHARE) */
    uint64_t kv_moved;          /* requests a store-less worker refused for want of KV room, moved to
                                 * the next worker of their pool (router.c, kv_move) */
    uint64_t retries_taken;     /* live requests a client's retry under their ids reached, sent later:
                                 * answered to the retry's address, under its stamp (router.c, sent_by) */
    uint64_t retries_ran;       /* clients' retries of a request answered 200 lately, answered 409 that it
                                 * ran, not run again (router.c, ran_already) */
    uint64_t lost_tries;        /* requests failed after a worker holding some of them died: its turn may
                                 * be in the store (router.c, lost_note) */
    uint64_t lost_retaken;      /* clients' retries of such a try, sent as its replay so their worker takes
                                 * that turn back first (router.c, lost_retake) */
    uint64_t lost_forgotten;    /* such tries forgotten within their minute for another's (256 slots): their
                                 * retry goes as a plain request */
    uint64_t waited_for_worker; /* requests that waited, none up, for a worker coming (dp_router_hold)
                                 * instead of the 503: new ones, and those a dead worker held */
    uint32_t active_requests, pool_free;
    uint32_t waiting_for_worker;  /* active requests waiting so now (waited_for_worker) */
    uint32_t kv_homes;          /* sessions a kv_move sent to another worker, or a failover to one without
                                 * a store, placed there until their CLOSE (router.c, KV_HOMES at most) */
};

struct dp_pool_stats {
    uint64_t requests;          /* requests placed on the pool (replays included) */
    uint64_t spilled;           /* of them, throttled here from the primary */
    uint32_t price_per_1k;      /* micro-USD per 1,000 tokens: the placement order */
    uint32_t room_per_worker;   /* chunks queued per up worker before the next pool is used (0: no limit) */
    uint32_t workers, up, depth;  /* depth: chunks queued on or in flight to its workers up (not a hidden one) */
    uint32_t promised;          /* chunks still to come of the requests placed on it (counted in its room) */
};

struct dp_router;

struct dp_router *dp_router_create(const struct dp_router_config *cfg, const char *policy, double policy_param,
                                   int *err);
void dp_router_destroy(struct dp_router *rt);
int dp_router_add_input(struct dp_router *rt, struct dp_ring *in);
/* A feed: a source the drain calls first, each pass, as feed(src, take, take_arg), to hand it records
 * with take(take_arg, record, stamp) (0: no room, keep it): an ingress consumer
 * (ingress.h, dp_consumer_feed) hands them straight from its BPF ring buffers, stamped once for
 * both stages, with no input ring's copy, publish and hop between. feed is a
 * uint32_t (*)(void *, int (*)(void *, const struct dp_chunk *, uint64_t), void *), as an address. One per
 * router; the source must outlive it. A record handed is valid for its header and n_tokens tokens
 * only (ingress.h). */
int dp_router_add_feed(struct dp_router *rt, uintptr_t feed, uintptr_t src);
/* The XDP program's `cuts` map (chunk.h, dp_cut_key), as an fd (duplicated, kept): a request
 * still missing chunks at the reassembly timeout whose key is there was cut by the bucket and
 * answered 429 in the kernel, so it is dropped without the 400 (counted xdp_cut), and one refused
 * at first sight is not answered again (unless it holds a client's retry that passed the cut:
 * chunk.h, dp_cut). The router writes it too, for a request of several
 * chunks it answered before the last came, so XDP drops the rest unanswered and uncharged; both
 * only for tenants with a bucket in buckets_fd, the program's `buckets` map (-1: all), or, while
 * others_fd's one bucket is set (the program's `others_bucket`; -1: none), for every tenant. One
 * per router, set before it runs (add_feed does). */
int dp_router_watch_cuts(struct dp_router *rt, int map_fd, int buckets_fd, int others_fd);
/* A worker: its lane (router produces) and completion ring (router consumes),
 * Returns the worker index. */
int dp_router_add_worker(struct dp_router *rt, struct dp_ring *lane, struct dp_ring *done, uint32_t weight);
/* The worker's end of an shm lane: wait (the lane's wait mode) up to timeout_ns (< 0: no limit)
 * for the router's next micro-batch and copy all of it (batch_len records, published at once)
 * into out (room for max >= DP_MAX_BATCH_CHUNKS records); *t_pickup: the clock once it is copied.
 * Its record count, 0 on timeout. */
uint32_t dp_lane_recv(struct dp_ring *lane, struct dp_chunk *out, uint32_t max, int64_t timeout_ns,
                      uint64_t *t_pickup);
/* A worker on another host (or process) behind a ZeroMQ DEALER socket bound at
 * `endpoint` (tcp:// or ipc://): one message per micro-batch (batch_len
 * dp_chunk records), one dp_completion message back. */
int dp_router_add_zmq_worker(struct dp_router *rt, const char *endpoint, uint32_t weight);
int dp_router_set_egress(struct dp_router *rt, struct dp_ring *egress);
int dp_router_set_policy(struct dp_router *rt, const char *policy, double param);
int dp_router_set_weight(struct dp_router *rt, uint32_t worker, uint32_t weight);
/* Tests: a known key secret (req_key), to compute colliding ids; only before the first pass. */
int dp_router_set_key_secret(struct dp_router *rt, uint64_t secret);
/* The stall threshold (dp_router_config.stall_ns) live; 0: never stalled again, and every stall
 * now ends (its worker placed on again). */
int dp_router_set_stall(struct dp_router *rt, uint64_t stall_ns);
/* up = 0: the worker is gone; its unfinished requests are replayed on others (see failover). */
int dp_router_set_up(struct dp_router *rt, uint32_t worker, int up);
/* Several workers gone at once (their spawner's death): all marked down before any one's requests
 * move, so none moves onto another of them, where it counted as run and its replay's worker dead
 * too (a 503, failover). A worker listed twice is marked down once. */
int dp_router_set_down(struct dp_router *rt, const uint32_t *workers, uint32_t n);
/* The control plane's word that a worker is coming (a replacement starting): for hold_ns from now
 * (or to a later end already set), a request no worker is up to take, new or a dead worker's,
 * waits for the first one set up or added instead of being answered 503; one still waiting when
 * the hold ends (or 0 ends it) is answered 503 then, as it was at once before (router.c, park). */
int dp_router_hold(struct dp_router *rt, uint64_t hold_ns);
/* A fresh lane and completion ring for shm worker `worker`, while it is down (-EBUSY if up, -EINVAL
 * if a zmq worker or the rings are too small): its replacement process serves them, and nothing
 * the dead one was sent or wrote is read again. The old rings are the caller's to close. */
int dp_router_replace_lane(struct dp_router *rt, uint32_t worker, struct dp_ring *lane, struct dp_ring *done);
/* Dynamic batching's token budget per step on one worker (0: the router's token_budget again),
 * e.g. where its device's step stops being flat in tokens (serving.devices knee_tokens). */
int dp_router_set_worker_budget(struct dp_router *rt, uint32_t worker, uint32_t token_budget);
/* has_store 0: the control plane's word that worker `worker`, and each replacement on its lane,
 * runs without a snapshot store, so a session replayed there at a failover stays there (its
 * answers say so too, DP_CE_NO_STORE, but one replayed before its first answer was left to the
 * policy, which began it again elsewhere). 1 (the default): only its answers tell, from its next
 * one (what they, or an earlier declaration of none, said stands until then), and a replacement's
 * after a death. */
int dp_router_set_worker_store(struct dp_router *rt, uint32_t worker, int has_store);
/* Pools: a request goes to the cheapest pool (price_per_1k) with an up worker and room (depth below
 * room_per_worker x up workers; if none has room, the cheapest with an up worker); one that admission
 * marks spill goes to the secondary (the next pool with an up worker after the cheapest) if that has
 * room, else by the first rule. The routing policy then picks
 * the worker inside the pool. Every worker starts in pool 0. */
int dp_router_set_pool(struct dp_router *rt, uint32_t pool, uint32_t price_per_1k, uint32_t room_per_worker);
int dp_router_set_worker_pool(struct dp_router *rt, uint32_t worker, uint32_t pool);
int dp_router_pool_stats(struct dp_router *rt, uint32_t pool, struct dp_pool_stats *s);
/* Admission settings (admission.h), live: one tenant's, or the default for tenants without their own. */
int dp_router_set_tenant(struct dp_router *rt, uint32_t tenant, const struct dp_tenant_cfg *cfg);
void dp_router_set_default_tenant(struct dp_router *rt, const struct dp_tenant_cfg *cfg);
int dp_router_tenant_stats(struct dp_router *rt, uint32_t tenant, struct dp_adm_tenant_stats *s);
int dp_router_set_batching(struct dp_router *rt, uint32_t batching, uint32_t token_budget, uint32_t max_chunks,
                           uint32_t max_batch_size, uint64_t batch_timeout_ns);
/* One pass: drain inputs, take completions, send batches. Returns work done. */
uint32_t dp_router_poll(struct dp_router *rt);
/* Threads: dp_router_poll is a stage of a native poll loop (loop.h); datapath.router.Router.start runs one. */
void dp_router_get_stats(struct dp_router *rt, struct dp_router_stats *s);
int dp_router_worker_stats(struct dp_router *rt, uint32_t worker, struct dp_worker_stats *s);

/* Decisions of a fresh policy for reqs[] against a fixed view, after it learnt of n_outcomes requests
 * ended (outcomes[i] on worker ended_on[i]; tests). */
int dp_policy_map(const char *policy, double param, uint64_t seed, const struct dp_workers *w,
                  const struct dp_outcome *outcomes, const int32_t *ended_on, uint32_t n_outcomes,
                  const struct dp_request *reqs, int32_t *out, uint32_t n);
/* Policy cost: ns per decision over `decisions` random sessions with n workers at random depths
 * (the loop's xorshift and lane bookkeeping included); policy "": the reference, a worker drawn
 * from the session's bits (reading no state) in the same loop. */
double dp_policy_bench(const char *policy, uint32_t n_workers, uint64_t decisions);
/* CDEF END */

#endif /* DP_ROUTER_H */
