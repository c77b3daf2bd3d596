/* egress.c - see egress.h. */
#define _GNU_SOURCE
#include "egress.h"
#include "clock.h"

#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

uint32_t dp_responder_poll(struct dp_responder *r)
{
    static __thread uint8_t pkt[DP_EGRESS_BURST][DP_RESP_HDR_LEN + DP_MAX_RESP_BODY];
    struct mmsghdr msgs[DP_EGRESS_BURST];
    struct iovec iov[DP_EGRESS_BURST];
    struct sockaddr_in dst[DP_EGRESS_BURST];
    uint32_t n = dp_ring_cons_peek(r->egress, DP_EGRESS_BURST);
    if (!n)
        return 0;
    for (uint32_t i = 0; i < n; i++) {
        const struct dp_response_rec *rec = dp_ring_cons_slot(r->egress, i);
        struct dp_resp_hdr *h = (struct dp_resp_hdr *)pkt[i];
        uint32_t body = rec->n_out ? rec->n_out * 4u : rec->body_len;   /* output tokens, or admission's JSON */
        if (body > DP_MAX_RESP_BODY)
            body = DP_MAX_RESP_BODY;
        memcpy(pkt[i] + DP_RESP_HDR_LEN, rec->body, body);
        /* the trace goes after the body if there is room: the body itself is never cut for it */
        int trace = (rec->flags & DP_FLAG_TRACE) && body + DP_RESP_TRACE_LEN <= DP_MAX_RESP_BODY;
        if (trace) {
            struct dp_resp_trace tr = { rec->t_xdp, rec->t_first_lane, rec->t_done, now_ns(), rec->worker,
                                        rec->pool, 0 };
            memcpy(pkt[i] + DP_RESP_HDR_LEN + body, &tr, sizeof(tr));
            body += DP_RESP_TRACE_LEN;
        }
        h->magic = DP_WIRE_MAGIC;
        h->version = DP_WIRE_VERSION;
        h->kind = DP_KIND_RESPONSE;
        h->flags = trace ? DP_FLAG_TRACE : 0;
        h->tenant = rec->tenant;
        h->status = rec->status;
        h->body_len = (uint16_t)body;
        h->session_id = rec->session_id;
        h->request_id = rec->request_id;
        h->send_ns = rec->t_send;
        iov[i] = (struct iovec){ pkt[i], DP_RESP_HDR_LEN + body };
        dst[i] = (struct sockaddr_in){ .sin_family = AF_INET,
                                       .sin_port = rec->client_ip ? rec->client_port : r->dst_port,
                                       .sin_addr.s_addr = rec->client_ip ? rec->client_ip : r->dst_ip };
        msgs[i] = (struct mmsghdr){ .msg_hdr = { .msg_name = &dst[i], .msg_namelen = sizeof(dst[i]),
                                                 .msg_iov = &iov[i], .msg_iovlen = 1 } };
    }
    uint32_t done = 0, sent = 0;
    uint8_t refused[DP_EGRESS_BURST] = { 0 };
    while (done < n) {
        /* never blocking: this pass shares its thread with the router and the ingress consumer,
         * which a full send buffer stopped until the kernel drained it */
        int k = sendmmsg(r->fd, msgs + done, n - done, MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS || errno == ENOMEM) {
                r->send_blocked++;   /* the rest stay in the ring for the next pass */
                break;
            }
            /* the message at `done` was refused (its client's address is one this socket cannot
             * send to): it alone is counted and dropped, the burst's others still go (all of
             * them were dropped with it before) */
            r->send_errors++;
            refused[done++] = 1;
            continue;
        }
        done += (uint32_t)k;
        sent += (uint32_t)k;
    }
    uint64_t t = now_ns();
    for (uint32_t i = 0; i < done; i++) {
        const struct dp_response_rec *rec = dp_ring_cons_slot(r->egress, i);
        if (refused[i])
            continue;                /* in no count of what went out */
        r->by_status[dp_status_slot(rec->status)]++;
        if (r->traced < r->trace_cap) {   /* the row, then the count: trace() reads from another thread */
            r->trace[r->traced] = (struct dp_trace){ rec->request_id, rec->t_send, rec->t_xdp, rec->t_first_lane,
                                                     rec->t_done, t, rec->status, rec->n_out };
            __atomic_store_n(&r->traced, r->traced + 1, __ATOMIC_RELEASE);
        }
    }
    r->sent += sent;
    dp_ring_cons_release(r->egress, done);
    return done;
}
