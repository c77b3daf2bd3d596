/* loadgen.c - open-loop Poisson sender (sendmmsg) and the ping-pong reference.
 *
 * Open loop: send times come from the Poisson schedule alone, never from
 * replies, so a slow server cannot slow the offered load down. Packets due
 * together go out in one sendmmsg, each stamped with send_ns just before the
 * call. Bounded by count and time.
 *
 * Two latencies per answer. rtt: from the packet's own send_ns (the path's
 * round trip). lat_ok: from the request's scheduled send (its Poisson arrival),
 * so a send that ran late (this core busy: it is shared with a worker) adds
 * its lateness instead of hiding it (no coordinated omission), and a request
 * still unanswered when the drain ends counts with the time it had waited
 * then (a lower bound) instead of dropping out of the tail.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stddef.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "chunk.h"
#include "ingress.h"
#include "siphash.h"

#define TX_BATCH_MAX 64

static uint64_t xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* xorshift started from a small seed gives tiny numbers for its first dozens of
 * draws (and so huge exponential gaps): mix the seed first (splitmix64) */
static uint64_t seed_state(uint64_t seed)
{
    uint64_t z = seed + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z ? z : 1;
}

uint64_t dp_req_tag_of(const uint8_t *hdr, const uint8_t *key)
{
    uint64_t w[DP_REQ_TAGGED_LEN / 8], k[2];
    memcpy(w, hdr, sizeof(w));            /* aligned words (a packet's header may sit anywhere) */
    memcpy(k, key, sizeof(k));
    return dp_req_tag(w, k[0], k[1]);
}

static uint16_t chunk_of(const uint8_t *pkts, uint32_t stride, uint32_t n_pkts, uint64_t seq)
{
    uint16_t chunk;
    memcpy(&chunk, pkts + (size_t)(seq % n_pkts) * stride + offsetof(struct dp_req_hdr, chunk_index), 2);
    return chunk;
}

/* exponential gap with mean 1 (the schedule at rate 1/s, in seconds) */
static double unit_gap(uint64_t *rng)
{
    double u = ((xorshift(rng) >> 11) + 1) * (1.0 / 9007199254740993.0);   /* (0, 1] */
    return -log(u);
}

/* exponential gap with mean 1/rate, in ns */
static uint64_t next_gap(uint64_t *rng, double rate)
{
    double gap = unit_gap(rng) / rate * 1e9;
    return gap < 1e18 ? (uint64_t)gap : (uint64_t)1e18;   /* a cast past uint64_t is undefined */
}

double dp_poisson_unit_span(uint64_t seed, uint64_t count)
{
    uint64_t rng = seed_state(seed);
    double span = 0;
    while (count--)
        span += unit_gap(&rng);
    return span;
}

/* Sleep until t, or until a response arrives (so its round trip is stamped when it lands,
 * not when the next send is due). */
static void wait_until(int fd, uint64_t t)
{
    uint64_t now = dp_now_ns();
    if (now >= t)
        return;
    struct pollfd p = { .fd = fd, .events = POLLIN };
    struct timespec ts = { .tv_sec = (t - now) / 1000000000ull, .tv_nsec = (t - now) % 1000000000ull };
    ppoll(&p, 1, &ts, NULL);
}

/* The schedule, per packet seq (stamp_seq only: an answer names its request's first packet).
 * merge > 1: waits[seq * merge + j] is how long arrival j of packet seq waited for the packet. */
enum { SEQ_NONE, SEQ_SENT, SEQ_ANSWERED, SEQ_UNSENT };   /* UNSENT: its first packet's send failed */
struct sched {
    uint32_t merge;
    uint64_t seq_base, count;
    uint64_t *waits;
    uint64_t *at;          /* the time packet seq's latency counts from: its scheduled send
                            * (merge > 1: its actual send, the waits add each arrival's wait) */
    uint8_t *state;        /* SEQ_SENT once a request's first packet is out, SEQ_ANSWERED once answered */
};

/* A second answer to a request already answered (stamp_seq): counted apart, nothing else. */
static int repeated(const struct sched *m, const struct dp_resp_hdr *h)
{
    uint64_t seq = h->request_id - m->seq_base;
    return m->state && seq < m->count && m->state[seq] == SEQ_ANSWERED;
}

/* Latency samples of one answer; lat_ok from the schedule. */
static void add_rtt(struct dp_send_stats *st, struct sched *m, const struct dp_resp_hdr *h, uint64_t now)
{
    uint64_t seq = h->request_id - m->seq_base;
    int known = m->state && seq < m->count && m->state[seq] != SEQ_NONE;
    uint32_t each = m->merge > 1 && known ? m->merge : 1;
    for (uint32_t j = 0; j < each; j++) {   /* a merged answer answers every request it carried */
        uint64_t wait = each > 1 ? m->waits[seq * m->merge + j] : 0;
        if (h->send_ns && now > h->send_ns)
            dp_lat_add(&st->rtt, now - h->send_ns + wait);
        if (h->send_ns && now > h->send_ns && h->status == DP_STATUS_OK)
            dp_lat_add(&st->rtt_ok, now - h->send_ns + wait);
        if (known && h->status == DP_STATUS_OK)
            dp_lat_add(&st->lat_ok, now - m->at[seq] + wait);
    }
    if (known)
        m->state[seq] = SEQ_ANSWERED;
}

static void read_responses(int fd, struct dp_send_stats *st, uint64_t start, struct sched *m)
{
    uint8_t buf[2048];
    struct dp_resp_hdr h;
    ssize_t n;
    while ((n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0) {
        uint64_t now = dp_now_ns();
        if ((size_t)n < sizeof(h))
            continue;
        memcpy(&h, buf, sizeof(h));
        if (h.magic != DP_WIRE_MAGIC || h.version != DP_WIRE_VERSION || h.kind != DP_KIND_RESPONSE ||
            (h.flags & ~DP_FLAGS_KNOWN) || !dp_status_known(h.status) ||
            h.body_len > DP_MAX_RESP_BODY || sizeof(h) + h.body_len != (size_t)n ||
            ((h.flags & DP_FLAG_TRACE) && h.body_len < DP_RESP_TRACE_LEN)) {
            st->malformed++;            /* not an answer the decoder takes (wire.decode_response): an
                                         * unknown status was counted as a 503, trailing bytes passed */
            continue;
        }
        if (h.send_ns && h.send_ns < start) {
            st->strays++;               /* stamped before this run began: an earlier run's late answer
                                         * (its request ids may be this run's too: counted as ours) */
            continue;
        }
        if (repeated(m, &h)) {
            st->duplicates++;           /* not a response more: counts, rates and samples see it once */
            continue;
        }
        uint64_t seq = h.request_id - m->seq_base;
        if (m->state && (seq >= m->count || m->state[seq] == SEQ_NONE)) {
            st->strays++;               /* no request of this run: its send_ns is another run's */
            continue;
        }
        if (m->state && m->state[seq] == SEQ_UNSENT)
            continue;                   /* a request whose first packet never left (its later ones
                                         * did, and the router refused the rest): in no count */
        st->responses++;
        st->last_resp_ns = now - start;
        st->by_status[dp_status_slot(h.status)]++;
        if (h.status != DP_STATUS_OK && !st->sample_status) {
            uint32_t len = h.body_len <= (size_t)n - sizeof(h) ? h.body_len : (uint32_t)((size_t)n - sizeof(h));
            if ((h.flags & DP_FLAG_TRACE) && len >= DP_RESP_TRACE_LEN)
                len -= DP_RESP_TRACE_LEN;   /* the body, not the stamps that end it */
            st->sample_status = h.status;
            st->sample_len = (uint16_t)(len < DP_MAX_RESP_BODY ? len : DP_MAX_RESP_BODY);
            memcpy(st->sample_body, buf + sizeof(h), st->sample_len);
        }
        if (h.status == DP_STATUS_RATE_LIMITED)
            st->resp_429++;
        else if (h.status == DP_STATUS_OK) {
            if (!st->resp_ok++)
                st->first_ok_ns = now - start;
            st->last_ok_ns = now - start;
        }
        else
            st->resp_other++;
        add_rtt(st, m, &h, now);
    }
}

int dp_send_poisson(int fd, const uint8_t *pkts, uint32_t stride, const uint16_t *lens, uint32_t n_pkts,
                    const struct dp_send_cfg *cfg, struct dp_send_stats *st)
{
    struct mmsghdr msgs[TX_BATCH_MAX];
    struct iovec iov[TX_BATCH_MAX];
    uint8_t *bufs;
    uint64_t rng = seed_state(cfg->seed), start, due, deadline, i = 0;
    uint32_t batch = cfg->batch < 1 ? 1 : cfg->batch > TX_BATCH_MAX ? TX_BATCH_MAX : cfg->batch;
    struct sched m = { cfg->merge > 1 ? cfg->merge : 1, cfg->seq_base, cfg->count, NULL, NULL, NULL };
    uint64_t arrival[DP_MAX_BATCH_CHUNKS];   /* merge > 1: arrival times of the next packet's requests */

    if (!n_pkts || !(cfg->rate_pps > 0) || !isfinite(cfg->rate_pps) || stride < DP_REQ_HDR_LEN || m.merge > DP_MAX_BATCH_CHUNKS ||
        (m.merge > 1 && !cfg->stamp_seq) || (cfg->stamp_seq && cfg->count > (1u << 24)))
        return -EINVAL;
    if (m.merge > 1)
        batch = 1;                       /* one packet per merge: its stamp is its last arrival's send */
    if (!(bufs = malloc((size_t)batch * stride)))
        return -ENOMEM;
    if ((m.merge > 1 && !(m.waits = calloc(cfg->count * m.merge, sizeof(uint64_t)))) ||
        (cfg->stamp_seq && (!(m.at = calloc(cfg->count, sizeof(uint64_t))) || !(m.state = calloc(cfg->count, 1))))) {
        free(bufs);
        free(m.waits);
        free(m.at);
        return -ENOMEM;
    }
    memset(msgs, 0, sizeof(msgs));
    start = dp_now_ns();
    deadline = start + cfg->max_ns;
    due = start;
    for (uint32_t j = 0; j < m.merge; j++)   /* a packet is due when the last of its requests arrives */
        arrival[j] = due += next_gap(&rng, cfg->rate_pps);
    while (i < cfg->count) {
        uint64_t now = dp_now_ns();
        uint32_t k = 0;
        /* the duration ends the run between requests: one begun is sent whole (its first chunks
         * alone were a 400 at the router's expiry, counted against the server) */
        int between = !cfg->stamp_seq || chunk_of(pkts, stride, n_pkts, i) == 0;   /* (whole requests then) */
        if (now >= deadline) {
            if (between)
                break;
            due = now;                  /* a begun request's other chunks at once, not at their gaps:
                                         * at 0.1 req/s a 3-chunk request held a 2 s run 10.5 s */
        }
        if (now < due) {
            read_responses(fd, st, start, &m);
            if (due - now > cfg->spin_ns) {    /* give the core back; spin only the last stretch */
                uint64_t until = due - cfg->spin_ns;
                wait_until(fd, until > deadline ? deadline : until);   /* (the deadline's rule above) */
            }
            continue;
        }
        if (now - due > st->max_late_ns)
            st->max_late_ns = now - due;
        /* everything due by now, up to a batch */
        while (k < batch && i + k < cfg->count && due <= now) {
            uint64_t seq = i + k;
            const uint8_t *src = pkts + (size_t)(seq % n_pkts) * stride;
            uint8_t *dst = bufs + (size_t)k * stride;
            uint16_t len = lens[seq % n_pkts], chunk;
            memcpy(dst, src, len);
            memcpy(&chunk, src + offsetof(struct dp_req_hdr, chunk_index), 2);
            if (cfg->stamp_seq) {        /* every chunk of a request gets its first chunk's number */
                uint64_t id = cfg->seq_base + seq - chunk;
                memcpy(dst + offsetof(struct dp_req_hdr, request_id), &id, 8);
            }
            st->requests += chunk == 0;
            if (m.state) {
                m.at[seq] = due;             /* merge > 1: replaced by the send time below */
                m.state[seq] = chunk == 0 ? SEQ_SENT : SEQ_NONE;
            }
            iov[k].iov_base = dst;
            iov[k].iov_len = len;
            msgs[k].msg_hdr.msg_iov = &iov[k];
            msgs[k].msg_hdr.msg_iovlen = 1;
            k++;
            if (m.merge > 1)
                break;                   /* batch is 1: the waits below are this packet's */
            due += next_gap(&rng, cfg->rate_pps);
        }
        now = dp_now_ns();
        for (uint32_t j = 0; j < k; j++) {
            uint8_t *dst = bufs + (size_t)j * stride;
            memcpy(dst + offsetof(struct dp_req_hdr, send_ns), &now, 8);
            if (cfg->keys) {             /* last: the tag covers the id and the stamp */
                uint64_t tag = dp_req_tag_of(dst, cfg->keys + (size_t)((i + j) % n_pkts) * DP_TAG_KEY_LEN);
                memcpy(dst + offsetof(struct dp_req_hdr, tag), &tag, 8);
            }
        }
        if (m.merge > 1 && k) {          /* each request waited from its arrival to this send */
            if (m.state)
                m.at[i] = now;
            for (uint32_t j = 0; j < m.merge; j++) {
                m.waits[i * m.merge + j] = now - arrival[j];
                st->merge_wait_ns += now - arrival[j];
            }
            due = arrival[m.merge - 1];
            for (uint32_t j = 0; j < m.merge; j++)
                arrival[j] = due += next_gap(&rng, cfg->rate_pps);
        }
        for (uint32_t off = 0; off < k;) {
            int n = sendmmsg(fd, msgs + off, k - off, 0);
            if (n <= 0) {
                /* counted, not retried (open loop), and taken back: a request whose first packet
                 * never left is no request, never unanswered, and has no latency (it was both
                 * a send error and an unanswered request with a made-up wait before) */
                st->send_errors += k - off;
                for (uint32_t j = off; j < k; j++) {
                    uint64_t seq = i + j;
                    uint16_t chunk;
                    memcpy(&chunk, bufs + (size_t)j * stride + offsetof(struct dp_req_hdr, chunk_index), 2);
                    /* a request with a chunk unsent is no request either (its first went, the
                     * router answers 400 at expiry): taken back once, by its first chunk's seq */
                    if (chunk == 0 || (m.state && seq >= chunk && m.state[seq - chunk] == SEQ_SENT)) {
                        st->requests--;
                        if (m.state)
                            m.state[seq - chunk] = SEQ_UNSENT;
                    }
                    for (uint32_t q = 0; m.merge > 1 && q < m.merge; q++)
                        st->merge_wait_ns -= m.waits[seq * m.merge + q];
                }
                break;
            }
            if (m.state && m.merge == 1)   /* the lag of what went out (sent_ns divides it) */
                for (int j = 0; j < n; j++)
                    st->late_ns_sum += now - m.at[i + off + (uint32_t)j];
            st->sent += n;
            off += n;
        }
        i += k;
        /* and what came back meanwhile: a sender behind its schedule never reached the read
         * above, the socket's buffer filled and the kernel dropped answers, counted unanswered */
        read_responses(fd, st, start, &m);
    }
    st->elapsed_ns = dp_now_ns() - start;
    for (uint64_t end = dp_now_ns() + (uint64_t)cfg->drain_ms * 1000000; dp_now_ns() < end;) {
        read_responses(fd, st, start, &m);
        if (st->responses >= st->requests)
            break;                 /* every request answered: no need to wait out the drain */
        wait_until(fd, end);
    }
    /* the tail keeps what the drain did not see answered: each at the time it had waited */
    uint64_t given_up = dp_now_ns();
    for (uint64_t seq = 0; m.state && seq < i; seq++) {
        if (m.state[seq] != SEQ_SENT)
            continue;
        st->unanswered += m.merge;       /* a merged packet carried merge requests */
        for (uint32_t j = 0; j < m.merge; j++)
            dp_lat_add(&st->lat_ok, given_up - m.at[seq] + (m.merge > 1 ? m.waits[seq * m.merge + j] : 0));
    }
    free(bufs);
    free(m.waits);
    free(m.at);
    free(m.state);
    return 0;
}

