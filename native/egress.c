/* egress.c - see egress.h. */
#define _GNU_SOURCE
#include "egress.h"
#include "clock.h"

#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* A response packet for rec in pkt, to dst; its length. */
static uint32_t encode(const struct dp_responder *r, const struct dp_response_rec *rec, uint8_t *pkt,
                       struct sockaddr_in *dst)
{
    struct dp_resp_hdr *h = (struct dp_resp_hdr *)pkt;
    uint32_t body = rec->n_out ? rec->n_out * 4u : rec->body_len;   /* output tokens, or admission's JSON */
    if (body > DP_MAX_RESP_BODY)
        body = DP_MAX_RESP_BODY;
    memcpy(pkt + DP_RESP_HDR_LEN, rec->body, body);
    /* the trace goes after the body if there is room: the body itself is never cut for it */
    int trace = (rec->flags & DP_FLAG_TRACE) && body + DP_RESP_TRACE_LEN <= DP_MAX_RESP_BODY;
    if (trace) {
        struct dp_resp_trace tr = { rec->t_xdp, rec->t_first_lane, rec->t_done, now_ns(), rec->worker,
                                    rec->pool, 0 };
        memcpy(pkt + DP_RESP_HDR_LEN + body, &tr, sizeof(tr));
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
    *dst = (struct sockaddr_in){ .sin_family = AF_INET,
                                 .sin_port = rec->client_ip ? rec->client_port : r->dst_port,
                                 .sin_addr.s_addr = rec->client_ip ? rec->client_ip : r->dst_ip };
    return DP_RESP_HDR_LEN + body;
}

/* A refusal that may pass: no route or link for the moment, or a firewall's drop (EPERM). */
static int may_pass(int err)
{
    return err == EPERM || err == ENETUNREACH || err == EHOSTUNREACH || err == ENETDOWN;
}

/* The socket has no room for now: what is left waits for the next pass. */
static int no_room(int err)
{
    return err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS || err == ENOMEM;
}

static void count_sent(struct dp_responder *r, const struct dp_response_rec *rec, uint64_t t)
{
    r->sent++;
    r->by_status[dp_status_slot(rec->status)]++;
    if (r->traced < r->trace_cap) {   /* the row, then the count: trace() reads from another thread */
        r->trace[r->traced] = (struct dp_trace){ rec->request_id, rec->t_send, rec->t_xdp, rec->t_first_lane,
                                                 rec->t_done, t, rec->status, rec->n_out };
        __atomic_store_n(&r->traced, r->traced + 1, __ATOMIC_RELEASE);
    }
}

/* The held answers whose time has come, each tried once more: sent, dropped past its deadline or
 * refused for good, or kept with a longer wait. Returns those settled; *blocked if the socket had
 * no room (the ring's wait too). */
static uint32_t retry_held(struct dp_responder *r, uint64_t now, int *blocked)
{
    static __thread uint8_t pkt[DP_RESP_HDR_LEN + DP_MAX_RESP_BODY];
    uint32_t kept = 0, settled = 0;
    uint64_t next = UINT64_MAX;
    for (uint32_t i = 0; i < r->n_held; i++) {
        struct dp_held_response *hr = &r->held[i];
        int keep = 0;
        if (now > hr->deadline) {
            r->send_errors++;
        } else if (*blocked || now < hr->next_try) {
            keep = 1;
        } else {
            struct sockaddr_in dst;
            uint32_t len = encode(r, &hr->rec, pkt, &dst);
            ssize_t k;
            r->held_tries++;
            do
                k = sendto(r->fd, pkt, len, MSG_DONTWAIT, (struct sockaddr *)&dst, sizeof(dst));
            while (k < 0 && errno == EINTR);
            if (k >= 0) {
                count_sent(r, &hr->rec, now_ns());
            } else if (no_room(errno)) {
                keep = *blocked = 1;     /* tried again at the next pass */
            } else if (may_pass(errno)) {
                keep = 1;
                hr->wait *= 2;
                hr->next_try = now + hr->wait < hr->deadline ? now + hr->wait : hr->deadline + 1;
            } else {
                r->send_errors++;
            }
        }
        if (keep) {
            if (kept != i)
                r->held[kept] = *hr;
            next = hr->next_try < next ? hr->next_try : next;
            kept++;
        } else {
            settled++;
        }
    }
    r->n_held = kept;
    r->held_next = next;
    return settled;
}

uint32_t dp_responder_poll(struct dp_responder *r)
{
    static __thread uint8_t pkt[DP_EGRESS_BURST][DP_RESP_HDR_LEN + DP_MAX_RESP_BODY];
    struct mmsghdr msgs[DP_EGRESS_BURST];
    struct iovec iov[DP_EGRESS_BURST];
    struct sockaddr_in dst[DP_EGRESS_BURST];
    int blocked = 0;
    uint64_t now = r->n_held ? now_ns() : 0;
    uint32_t settled = r->n_held && now >= r->held_next ? retry_held(r, now, &blocked) : 0;
    if (blocked) {
        r->send_blocked++;
        return settled;
    }
    uint32_t n = dp_ring_cons_peek(r->egress, DP_EGRESS_BURST);
    if (!n)
        return settled;
    for (uint32_t i = 0; i < n; i++) {
        const struct dp_response_rec *rec = dp_ring_cons_slot(r->egress, i);
        iov[i] = (struct iovec){ pkt[i], encode(r, rec, pkt[i], &dst[i]) };
        msgs[i] = (struct mmsghdr){ .msg_hdr = { .msg_name = &dst[i], .msg_namelen = sizeof(dst[i]),
                                                 .msg_iov = &iov[i], .msg_iovlen = 1 } };
    }
    uint32_t done = 0;
    uint8_t unsent[DP_EGRESS_BURST] = { 0 };
    while (done < n) {
        /* never blocking: this pass shares its thread with the router and the ingress consumer,
         * which a full send buffer stopped until the kernel drained it */
        int k = sendmmsg(r->fd, msgs + done, n - done, MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (no_room(errno)) {
                r->send_blocked++;   /* the rest stay in the ring for the next pass */
                break;
            }
            /* the message at `done` was refused: it alone, the burst's others still go (all of
             * them were dropped with it before). One that may pass is held aside and tried
             * again (it was dropped before, its request already run and charged, and a retry
             * of it is a late duplicate: found by review); one refused for good (an address
             * this socket cannot send to) is counted and dropped. */
            if (may_pass(errno) && r->n_held < DP_EGRESS_HELD) {
                struct dp_held_response *hr = &r->held[r->n_held++];
                uint64_t t = now_ns();
                hr->deadline = t + DP_EGRESS_HOLD_NS;
                hr->wait = DP_EGRESS_RETRY_NS;
                hr->next_try = t + hr->wait;
                r->held_next = r->n_held == 1 || hr->next_try < r->held_next ? hr->next_try : r->held_next;
                memcpy(&hr->rec, dp_ring_cons_slot(r->egress, done), sizeof(hr->rec));
                r->send_held++;
            } else {
                r->send_errors++;
            }
            unsent[done++] = 1;
            continue;
        }
        done += (uint32_t)k;
    }
    uint64_t t = now_ns();
    for (uint32_t i = 0; i < done; i++)
        if (!unsent[i])              /* held or dropped: in no count of what went out (yet) */
            count_sent(r, dp_ring_cons_slot(r->egress, i), t);
    dp_ring_cons_release(r->egress, done);
    return settled + done;
}
