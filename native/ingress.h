/* ingress.h - the ingress consumers: BPF ring buffers (XDP path) or a UDP
 * socket (no root, no bcc), both pushing struct dp_chunk records downstream.
 *
 * Each consumer is a C thread started from Python that busy-polls its source,
 * stamps t_consumer, records latencies (log2 histogram + raw samples) and
 * writes every record into the router's input ring (native/ring.h, this
 * thread is its producer): in place, header plus the tokens it carries,
 * published once per burst of up to DP_INGRESS_BURST records. Or the BPF
 * consumer is a router's feed (dp_consumer_feed): no thread, the router's pass
 * runs it and takes each record from where XDP wrote it. Nothing per chunk
 * runs in Python. Records leave in on_record() in ingress.c.
 */
#ifndef DP_INGRESS_H
#define DP_INGRESS_H

#include <stdint.h>
#include <pthread.h>

#include "ring.h"
#include "steer.h"

/* CDEF BEGIN: what the cffi binding sees (native/ffi_ingress.py reads it verbatim) */
#define DP_INGRESS_BURST 32

/* Latency record: bucket 0 counts v = 0, bucket b >= 1 counts 2^(b-1) <= v < 2^b (bcc's log2). */
struct dp_lat {
    uint64_t hist[DP_LAT_BUCKETS];
    uint64_t count;
    uint64_t *samples;     /* the first `cap` values, in arrival order */
    uint64_t cap;
    uint64_t n;
};

/* One BPF ring buffer as mapped for reading (the kernel's ABI, Documentation/bpf/ringbuf.rst):
 * the consumer position page (ours to write), the producer position page and the data area
 * after it, mapped twice in a row so a record is contiguous even where it wraps. */
struct dp_bpf_ring {
    unsigned long *consumer_pos;
    const unsigned long *producer_pos;
    const uint8_t *data;
    unsigned long mask;        /* data size - 1 (a power of two) */
    size_t map_len;            /* of the producer page and the data area */
    uint32_t map_id;           /* the kernel's id of the map: one consumer per ring buffer */
};

/* Where a consumer writes: the router's input ring, and what it could not place. */
struct dp_out {
    struct dp_ring *ring;      /* slot_size >= sizeof(struct dp_chunk) */
    uint32_t reserved;         /* slots reserved for this burst */
    uint32_t pending;          /* of them, filled and not yet published */
    uint64_t full;             /* records that found the ring full, each once: the UDP receiver dropped
                                  them, a ring-buffer consumer left them in their ring buffer for a later
                                  pass */
    int stalled;               /* the record being placed found it full already (counted) */
};

struct dp_consumer {
    struct dp_bpf_ring rings[8];   /* the steering program's ring buffers (DP_MAX_QUEUES) */
    uint32_t n_rings;
    struct dp_out out;
    pthread_t thread;
    int stop;                  /* set by Python, read with __atomic_load_n */
    int running;
    int cpu;                   /* pinned there, or -1 */
    int rt_priority;           /* SCHED_FIFO priority while running, 0: the normal scheduler */
    uint64_t records;          /* records taken from the ring buffers */
    uint64_t malformed;        /* records skipped: not a chunk record (never one of steer.bpf.c's) */
    uint64_t per_queue[8];
    uint64_t polls;            /* passes over the ring buffers */
    struct dp_lat xdp_lat;     /* t_consumer - t_xdp */
    struct dp_lat send_lat;    /* t_consumer - t_send */
    uint64_t *map_hist;        /* the program's lat_hist array, mmapped (or NULL) */
    uint64_t pend[DP_INGRESS_BURST][2];   /* (xdp, send) latencies not yet counted (ingress.c, lat_flush) */
    uint32_t n_pend;
    uint32_t idle_polls;       /* polls in a row that found nothing */
    uint64_t rehearsals;       /* idle dry runs of a record's path (ingress.c, rehearse) */
    struct dp_chunk rehearsal; /* the last record's header (its tokens: zeros, as many as it had) */
    struct dp_consumer *shadow; /* runs on_record on the rehearsal, into a ring of its own */
    int (*take)(void *, const struct dp_chunk *, uint64_t);   /* feeding a router: dp_consumer_feed's */
    void *take_arg;
    uint32_t next_ring;        /* where the next pass starts */
    struct dp_consumer *next_holder;   /* the process's consumers holding ring buffers (ingress.c) */
};

struct dp_udp_rx {
    int fd;                    /* a bound UDP socket (non-blocking reads) */
    int queues;                /* records are spread by the same session hash as XDP */
    struct dp_out out;
    pthread_t thread;
    int stop;                  /* set by Python, read with __atomic_load_n */
    int running;
    int cpu;
    int rt_priority;
    uint64_t records;
    uint64_t bad;              /* datagrams that failed validation */
    uint64_t drops[18];        /* by enum dp_drop (DP_DROP_MAX) */
    struct dp_lat send_lat;    /* t_consumer - t_send */
    uint32_t reply_status;     /* answer each valid request with this status (0: never); measures
                                  the user-space alternative to the XDP_TX 429 */
    uint64_t replies;
};

int dp_lat_init(struct dp_lat *l, uint64_t cap);
void dp_lat_reset(struct dp_lat *l);
void dp_lat_free(struct dp_lat *l);

/* Consumer of the steering program's ring buffers (map fds from bcc). */
/* hist_fd: the program's mmapable lat_hist array (or -1), counted into as well; out: NULL for a
 * consumer that only feeds a router (dp_consumer_feed) */
struct dp_consumer *dp_consumer_new(const int *ring_fds, int n, int hist_fd, struct dp_ring *out, uint64_t samples);
int dp_consumer_start(struct dp_consumer *c, int cpu, int rt_priority);
/* One pass without the thread (for a shared poll loop, native/loop.h): records taken. */
uint32_t dp_consumer_poll(struct dp_consumer *c);
/* One pass handing each record, stamped, to take(arg, record, t_consumer) instead of the output ring:
 * a router's feed (router.h, dp_router_add_feed) calls it in its drain, so a record goes from the BPF
 * ring buffer into the router's pool with no copy or publish between. A record take refuses (0: no
 * room) stays in its ring buffer for the next pass. Never while the consumer's thread runs. The
 * record handed is valid for DP_CHUNK_HDR_LEN + 4 * n_tokens bytes only (steer.bpf.c sizes it to its
 * tokens): never copy sizeof(struct dp_chunk) from it, the rest is the next record's. */
uint32_t dp_consumer_feed(struct dp_consumer *c, int (*take)(void *, const struct dp_chunk *, uint64_t), void *arg);
void dp_consumer_stop(struct dp_consumer *c);
void dp_consumer_free(struct dp_consumer *c);

/* UDP socket ingress with the same downstream interface. */
struct dp_udp_rx *dp_udp_rx_new(int fd, int queues, struct dp_ring *out, uint64_t samples);
int dp_udp_rx_start(struct dp_udp_rx *r, int cpu, int rt_priority);
void dp_udp_rx_stop(struct dp_udp_rx *r);
void dp_udp_rx_free(struct dp_udp_rx *r);

/* Validate a request datagram like the XDP program; 0 or 1 + enum dp_drop. */
int dp_req_check(const uint8_t *buf, uint32_t len);

/* Load generator (loadgen.c): open-loop Poisson sender on a connected UDP socket. */
struct dp_send_cfg {
    double rate_pps;           /* mean arrival rate */
    uint64_t count;            /* packets to send (bound 1) */
    uint64_t max_ns;           /* run time limit (bound 2) */
    uint64_t seed;
    uint32_t batch;            /* sendmmsg batch limit */
    uint32_t drain_ms;         /* keep reading responses this long after the last send */
    int stamp_seq;             /* request_id = seq_base + the sequence number of the request's first chunk
                                  (a request's chunks are consecutive packets, chunk 0 first) */
    uint64_t seq_base;         /* so successive runs never reuse a request id */
    uint32_t spin_ns;          /* sleep through gaps longer than this, spin the rest */
    uint32_t merge;            /* client-side batching: requests arrive at rate_pps, and every `merge`
                                  of them go out as one packet when the last has arrived; each answer
                                  then counts `merge` latencies, from each one's own arrival
                                  (0 or 1: one packet per arrival). Needs stamp_seq, one-chunk requests. */
    const uint8_t *keys;       /* NULL, or DP_TAG_KEY_LEN bytes per packet: its tenant's tag key, the tag set as it
                                  leaves (after request_id and send_ns; bpf/siphash.h) */
};

/* The tag of a request header (its first DP_REQ_TAGGED_LEN bytes) under a DP_TAG_KEY_LEN-byte key. */
uint64_t dp_req_tag_of(const uint8_t *hdr, const uint8_t *key);

struct dp_send_stats {
    uint64_t sent;
    uint64_t send_errors;
    uint64_t elapsed_ns;
    uint64_t max_late_ns;      /* worst lag behind the Poisson schedule */
    uint64_t responses;
    uint64_t resp_429;
    uint64_t resp_ok;          /* status 200 */
    uint64_t resp_other;       /* any other status */
    uint64_t last_resp_ns;     /* from the start to the last response */
    uint64_t first_ok_ns, last_ok_ns;   /* from the start to the first and the last 200: the answer rate */
    uint64_t requests;         /* packets sent that start a request (chunk_index 0): one answer each
                                  (one whose send failed is a send error, in no other count) */
    uint64_t merge_wait_ns;    /* merge > 1: the time arrivals waited for their packet, summed */
    uint64_t by_status[DP_N_STATUSES];   /* responses by status (dp_status_slot) */
    uint16_t sample_status;    /* the first response other than 200 ... */
    uint16_t sample_len;
    uint8_t sample_body[DP_MAX_RESP_BODY];   /* ... and its body (an admission answer's JSON, or the
                                                router's {"status", "error"}; docs/wire.md) */
    uint64_t late_ns_sum;      /* each packet's lag behind its scheduled send, summed (merge 1) */
    uint64_t duplicates;       /* answers to a request already answered (stamp_seq): in no other count */
    uint64_t strays;           /* answers to no request this run sent (stamp_seq: another run's late
                                  answer to a client that had the same port): in no other count */
    uint64_t unanswered;       /* requests without an answer when the drain ended */
    uint64_t malformed;        /* datagrams that are no answer wire.decode_response takes: in no other count */
    struct dp_lat rtt;         /* now - echoed send_ns, per response: the path's round trip (merge > 1:
                                  per request it answered, plus that request's wait for the packet) */
    struct dp_lat rtt_ok;      /* the same, for 200 responses only */
    struct dp_lat lat_ok;      /* stamp_seq: now - the request's scheduled send, per 200 (a repeat
                                  once), then per unanswered request the time it had waited when
                                  the drain ended: the open-loop latency, lateness and tail kept */
};

int dp_send_poisson(int fd, const uint8_t *pkts, uint32_t stride, const uint16_t *lens, uint32_t n_pkts,
                    const struct dp_send_cfg *cfg, struct dp_send_stats *st);
/* The schedule dp_send_poisson draws from `seed` (merge 1), at rate 1/s: the time of its
 * count-th packet, in seconds. At rate r that packet is due span/r after the start, so
 * the run offers count * r / span packets/s: a short run's draws stray from r. */
double dp_poisson_unit_span(uint64_t seed, uint64_t count);

/* CDEF END */

uint64_t dp_now_ns(void);
void dp_lat_add(struct dp_lat *l, uint64_t v);

#endif /* DP_INGRESS_H */
