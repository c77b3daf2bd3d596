/* egress.h - the response path: router egress ring -> UDP responses to the client.
 *
 * A C thread drains struct dp_response_rec records from the router's egress
 * ring, encodes each as a response packet (bpf/wire.h: header, then the
 * output tokens as little-endian uint32, or the JSON body admission wrote) and sends them with sendmmsg from a
 * UDP socket Python opened in the host namespace (bound to the ingress
 * address and port, so a client's connected socket accepts the answer), to
 * the client address its request came from (or a default one).
 * It keeps a trace of every response's stamps for the report. Nothing per
 * response runs in Python; the pass is a stage of a native poll loop.
 */
#ifndef DP_EGRESS_H
#define DP_EGRESS_H

#include <stdint.h>

#include "chunk.h"
#include "ring.h"

/* CDEF BEGIN */
#define DP_EGRESS_BURST 32

struct dp_trace {            /* one response's life, for the report */
    uint64_t request_id;
    uint64_t t_send;         /* client stamp of the first chunk */
    uint64_t t_xdp;
    uint64_t t_first_lane;
    uint64_t t_done;         /* router saw the last completion */
    uint64_t t_out;          /* response handed to the kernel */
    uint32_t status;
    uint32_t n_out;
};

/* An answer the kernel refused for a reason that may pass (no route for the moment, a link down,
 * a firewall's drop): kept aside and sent again until its deadline, 1 ms after the refusal, then
 * at doubling waits (7 tries in the 200 ms: 1, 3, 7, ... 127 ms after). Kept in the ring instead,
 * one unroutable client's answers held every other answer back; tried again at every pass, 32 of
 * them cost each pass of the poll loop (router and consumer too) ~5 us of failing sendto calls,
 * ~40x an idle pass, and every tenant's chunks waited on them (found by review). */
#define DP_EGRESS_HELD 32
#define DP_EGRESS_HOLD_NS 200000000ull   /* 200 ms: a route being changed, a link flapping */
#define DP_EGRESS_RETRY_NS 1000000ull    /* the first try again's wait, doubled after each refusal */

struct dp_held_response {
    uint64_t deadline;       /* now_ns() past which it is dropped (send_errors) */
    uint64_t next_try;       /* not tried again before (at most the deadline) */
    uint64_t wait;           /* from the next refusal to the try after it */
    struct dp_response_rec rec;
};

struct dp_responder {
    struct dp_ring *egress;  /* router -> here (this thread consumes) */
    int fd;                  /* UDP socket, not connected */
    uint32_t dst_ip;         /* network order: where responses go whose request named no client */
    uint16_t dst_port;       /* network order */
    uint64_t sent, send_errors, by_status[DP_N_STATUSES];   /* of those sent (dp_status_slot) */
    uint64_t send_blocked;   /* passes that met a full send buffer (what was left is sent next pass) */
    uint64_t send_held;      /* answers a refusal that may pass held aside (sent later, or send_errors) */
    uint64_t held_tries;     /* sends of held answers tried again */
    struct dp_trace *trace;  /* the first trace_cap responses */
    uint64_t trace_cap, traced;
    uint32_t n_held;
    uint64_t held_next;      /* the earliest held answer's next_try: no pass looks at them before */
    struct dp_held_response held[DP_EGRESS_HELD];
};

/* One pass: the answers held aside tried again, then the records taken off the egress ring (sent,
 * held aside, or refused by the socket for good and dropped); a full send buffer leaves the rest
 * there. Returns the records taken off the ring and the held answers settled (sent or dropped).
 * It runs as a stage of a native poll loop (loop.h). */
uint32_t dp_responder_poll(struct dp_responder *r);
/* CDEF END */

#endif /* DP_EGRESS_H */
