/* admission.c - see admission.h. No locking: the router calls it under its own lock. */
#include "admission.h"
#include "clock.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>

#include "chunk.h"
#include "policy.h"
#include "wire.h"

#define MINUTE_NS 60000000000ull
#define DAY_NS ((uint64_t)DP_ADM_DAY_S * 1000000000ull)
#define ENTROPY_MAX_BITS 7.0              /* log2(DP_MAX_CHUNK_TOKENS) */

struct tenant {
    uint32_t id;
    uint8_t used, own;
    struct dp_tenant_cfg cfg;             /* valid if own */
    uint64_t day_start, spent;            /* the budget's day and what it spent */
    uint64_t tat_minute, tat_high;        /* GCRA virtual clocks: per-minute tokens, high-entropy requests */
    struct dp_adm_tenant_stats st;
};

/* The token counts of one entropy pass: open addressing (load <= 1/2), a slot live when its
 * generation is the pass's, so a pass clears nothing (the table is the admission's own). */
#define COUNT_SLOTS (2 * DP_MAX_CHUNK_TOKENS)   /* 256: the hash below gives 8 bits */
_Static_assert(COUNT_SLOTS == 256, "entropy_bits hashes a token to 8 bits");
struct count_table {
    struct { uint32_t token; uint16_t count, gen; } slot[COUNT_SLOTS];
    uint16_t gen;
};

/* Tenant state: open addressing with linear probing in a table of SLOTS, mapped once (its pages
 * come as they are first touched), at most half full so a miss ends in a few probes (the operator's
 * tenants may take it to 3/4: ~8 probes a miss); full, it is swept of its idle tenants in place.
 * Before, 1,024 slots were never freed and a full table scanned all of them per decision (~2.4 us). */
#define SLOTS (2u * DP_ADM_MAX_TENANTS)
#define MASK (SLOTS - 1)
_Static_assert(DP_ADM_MAX_ALL_TENANTS == SLOTS / 4 * 3, "the operator's tenants fill 3/4 of the slots at most");
#define TABLE_BYTES ((size_t)SLOTS * sizeof(struct tenant))
#define SWEEP_QUIET_NS 1000000000ull      /* after a sweep that freed little, none for a second */

struct dp_admission {
    struct dp_tenant_cfg dflt;
    uint32_t max_chunks;                  /* chunks a request may have (a tenant's share of the router's
                                           * pool; 0: any) */
    uint32_t used;                        /* < SLOTS, so every probe ends */
    uint64_t key;                         /* random per table: where a tenant's slot is (home) */
    struct tenant *t;                     /* [SLOTS] */
    uint64_t next_idle;                   /* no default-settings tenant is idle before this */
    uint64_t quiet_until;                 /* no sweep before this */
    struct count_table counts;            /* entropy's scratch (the router calls under its lock) */
};

/* c x log2(c) in fixed point (2^-50), and the step from c to c + 1 occurrences: counting a
 * token's occurrence adds step[c], so a token seen k times has added clog2c[k] exactly (the
 * steps telescope), and entropy is one pass of integer adds (no FP chain, never log2). */
#define CLOG_SCALE 1125899906842624.0      /* 2^50: 128 x 7 x 2^50 < 2^60 fits the sum */

/* ns between high-entropy requests kept on the primary (hi_per_second > 0), at most a year: the
 * cast of 1e9 / a tiny rate past 2^64 was undefined (found by review) */
static uint64_t hi_interval_ns(const struct dp_tenant_cfg *cfg)
{
    double ns = 1e9 / cfg->hi_per_second;
    return ns < 3.2e16 ? (uint64_t)ns : 32000000000000000ull;
}

static uint64_t clog2c[DP_MAX_CHUNK_TOKENS + 1], step[DP_MAX_CHUNK_TOKENS];

__attribute__((constructor)) static void clog2c_init(void)   /* at load */
{
    for (int c = 1; c <= DP_MAX_CHUNK_TOKENS; c++)
        clog2c[c] = (uint64_t)llround(c * log2((double)c) * CLOG_SCALE);
    for (int c = 0; c < DP_MAX_CHUNK_TOKENS; c++)
        step[c] = clog2c[c + 1] - clog2c[c];
}

struct dp_admission *dp_adm_create(void)
{
    struct dp_admission *a = calloc(1, sizeof(*a));
    if (!a)
        return NULL;
    /* mmap, not calloc: after a free of this size glibc serves the next from its heap, zeroing
     * all 20 MiB at once and keeping them (found by review) */
    a->t = mmap(NULL, TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a->t == MAP_FAILED) {
        free(a);
        return NULL;
    }
    madvise(a->t, TABLE_BYTES, MADV_DONTFORK);   /* as the router's state: no copy-on-write faults after
                                                    a fork of its process (best effort) */
    a->next_idle = UINT64_MAX;
    if (getrandom(&a->key, sizeof(a->key), 0) != sizeof(a->key))
        a->key = dp_hash64((uint64_t)(uintptr_t)a ^ now_ns());
    return a;
}

void dp_adm_destroy(struct dp_admission *a)
{
    if (a)
        munmap(a->t, TABLE_BYTES);
    free(a);
}

/* A tenant's home slot, keyed by a secret of this table's as the router's tables are: with a fixed
 * hash anyone could choose tenant ids that all share one home, and every request of theirs (or of the
 * tenant they aimed at) walked the run, and a sweep of it moved the run back once per idle tenant
 * (a review: 16,384 such ids, 47 us a decision, a 2.2 s sweep on the router's thread). */
static uint32_t home(const struct dp_admission *a, uint32_t id)
{
    return (uint32_t)dp_hash64(id ^ a->key) & MASK;
}

uint32_t dp_adm_home(const struct dp_admission *a, uint32_t tenant)
{
    return home(a, tenant);
}

enum { FIND, INSERT, INSERT_OWN };

/* When a default-settings tenant's state comes to say nothing a fresh one's would not (nothing
 * spent today, no bucket debt): from then on it is idle and a sweep may drop it. */
static uint64_t idle_at(const struct tenant *t)
{
    if (t->own)
        return UINT64_MAX;
    /* (a day_start of 0 is a new day to dp_adm_decide too) */
    uint64_t at = t->spent && t->day_start ? (t->day_start < UINT64_MAX - DAY_NS ? t->day_start + DAY_NS : UINT64_MAX) : 0;
    at = t->tat_minute > at ? t->tat_minute : at;
    return t->tat_high > at ? t->tat_high : at;
}

/* Called whenever a tenant's state changes: a refund can make it idle sooner. */
static void note_idle(struct dp_admission *a, const struct tenant *t)
{
    uint64_t at = idle_at(t);
    if (at < a->next_idle)
        a->next_idle = at;
}

/* The tenant's slot, or the empty one its probe ends at. */
static struct tenant *probe(const struct dp_admission *a, uint32_t id)
{
    for (uint32_t i = home(a, id);; i = (i + 1) & MASK)
        if (!a->t[i].used || a->t[i].id == id)
            return &a->t[i];
}

/* Empties slot i, moving back each later tenant of its run that may sit earlier (backward-shift
 * deletion: no tombstones, so probes stay as short as the load says). */
static void vacate(struct dp_admission *a, uint32_t i)
{
    for (uint32_t j = (i + 1) & MASK; a->t[j].used; j = (j + 1) & MASK) {
        uint32_t h = home(a, a->t[j].id);
        if (((j - h) & MASK) < ((j - i) & MASK))
            continue;                     /* its home lies after i: it must stay past it */
        a->t[i] = a->t[j];
        i = j;
    }
    memset(&a->t[i], 0, sizeof(a->t[i]));
    a->used--;
}

/* Drops the idle tenants. It starts past an empty slot, so no run wraps across the start, and a
 * tenant moved back into a slot is looked at there. */
static void sweep(struct dp_admission *a, uint64_t now)
{
    uint32_t start = 0, before = a->used;
    while (a->t[start].used)
        start++;
    a->next_idle = UINT64_MAX;
    for (uint32_t n = 1; n <= SLOTS;) {
        uint32_t i = (start + n) & MASK;
        uint64_t at = a->t[i].used ? idle_at(&a->t[i]) : UINT64_MAX;
        if (at <= now) {
            vacate(a, i);
            continue;
        }
        if (at < a->next_idle)
            a->next_idle = at;
        n++;
    }
    /* Bounds the cost (a pass over the table): one that freed little, as when tenants turn idle
     * one by one, is not redone at every new tenant; those refused meanwhile get a 503 (retry). */
    if (before - a->used < SLOTS / 32)
        a->quiet_until = now + SWEEP_QUIET_NS;
}

/* Room for one more default-settings tenant under the load cap (half the slots, the operator's
 * tenants counted too), swept if need be; if may_sweep is 0, a sweep that is due counts as room
 * (optimistic: it may free too little). */
static int room(struct dp_admission *a, uint64_t now, int may_sweep)
{
    if (a->used < SLOTS / 2)
        return 1;
    if (now < a->next_idle || now < a->quiet_until)
        return 0;
    if (!may_sweep)
        return 1;
    sweep(a, now);
    return a->used < SLOTS / 2;
}

/* The tenant's slot, or NULL. INSERT gives a new tenant a slot if there is room (see room); the
 * operator's tenants (INSERT_OWN) may fill the table past the load cap, to 3/4. */
static struct tenant *find(struct dp_admission *a, uint32_t id, int insert, uint64_t now)
{
    struct tenant *t = probe(a, id);
    if (t->used)
        return t;
    uint32_t before = a->used;
    if (insert == FIND || !(insert == INSERT ? room(a, now, 1) : a->used < DP_ADM_MAX_ALL_TENANTS))
        return NULL;
    if (a->used != before)
        t = probe(a, id);                 /* a sweep emptied slots: it may have moved its run */
    t->used = 1;
    t->id = id;
    a->used++;
    return t;
}

/* Settings whose decisions need the tenant's state kept (spending, buckets). */
static int limited(const struct dp_tenant_cfg *cfg)
{
    return cfg->budget_per_day || cfg->tokens_per_minute || (cfg->hi_entropy_factor > 0 && cfg->hi_per_second > 0);
}

void dp_adm_set_max_chunks(struct dp_admission *a, uint32_t max_chunks)
{
    a->max_chunks = max_chunks;
}

static const struct dp_tenant_cfg *cfg_of(const struct dp_admission *a, const struct tenant *t)
{
    return t && t->own ? &t->cfg : &a->dflt;
}

int dp_adm_set_tenant(struct dp_admission *a, uint32_t tenant, const struct dp_tenant_cfg *cfg)
{
    struct tenant *t = find(a, tenant, INSERT_OWN, 0);
    if (!t)
        return -ENOSPC;
    t->cfg = *cfg;
    t->own = 1;
    return 0;
}

void dp_adm_set_default(struct dp_admission *a, const struct dp_tenant_cfg *cfg)
{
    a->dflt = *cfg;
}

int dp_adm_tenant_stats(struct dp_admission *a, uint32_t tenant, uint64_t now, struct dp_adm_tenant_stats *s)
{
    struct tenant *t = find(a, tenant, FIND, 0);
    memset(s, 0, sizeof(*s));
    if (!t)
        return -ENOENT;
    *s = t->st;
    s->own_settings = t->own;
    /* today's: the day's reset happens at the tenant's next decision, which may not come */
    s->spent = t->day_start && now - t->day_start < DAY_NS ? t->spent : 0;
    return 0;
}

/* --- pricing ----------------------------------------------------------------------- */

static double entropy_bits(struct count_table *t, const uint32_t *tokens, uint32_t n)
{
    if (n > DP_MAX_CHUNK_TOKENS)
        n = DP_MAX_CHUNK_TOKENS;
    if (n < 2)
        return 0.0;
    if (++t->gen == 0) {                  /* generations wrapped: every slot is stale again */
        memset(t->slot, 0, sizeof(t->slot));
        t->gen = 1;
    }
    uint16_t g = t->gen;
    uint64_t s = 0;                       /* sum over distinct tokens of c log2 c, fixed point */
    for (uint32_t i = 0; i < n; i++) {
        uint32_t h = (uint32_t)((tokens[i] * 0x9e3779b97f4a7c15ull) >> 56);   /* Fibonacci hashing: 8 bits */
        while (t->slot[h].gen == g && t->slot[h].token != tokens[i])
            h = (h + 1) & (COUNT_SLOTS - 1);
        uint16_t c = t->slot[h].gen == g ? t->slot[h].count : 0;
        s += step[c];
        t->slot[h].token = tokens[i];
        t->slot[h].count = (uint16_t)(c + 1);
        t->slot[h].gen = g;
    }
    /* H = -sum (c/n) log2(c/n) = (n log2 n - sum c log2 c) / n */
    return (double)(clog2c[n] - s) / (CLOG_SCALE * n);
}

static double output_factor(uint32_t max_output)
{
    uint32_t o = max_output < DP_ADM_OUTPUT_SCALE ? max_output : DP_ADM_OUTPUT_SCALE;
    return 1.0 + (double)o / DP_ADM_OUTPUT_SCALE;
}

/* ceil(cost): what is charged. price x tokens x (1024 + output) is a whole number (exact in 128 bits),
 * and with a whole entropy factor (1.0 for one repeated token, 5.0 for distinct ones or none seen)
 * so is the division's dividend: an exact integer ceiling. In doubles 1322 x 640 / 1000 x 6.25 read
 * 5288.000000000001, charged 5289, and a request costing exactly the day's budget got a 422 (a review). */
static uint64_t charge_of(uint32_t price, uint32_t input, uint32_t max_output, double entropy_factor)
{
    uint32_t o = max_output < DP_ADM_OUTPUT_SCALE ? max_output : DP_ADM_OUTPUT_SCALE;
    unsigned __int128 whole = (unsigned __int128)price * ((uint64_t)input + max_output) * (DP_ADM_OUTPUT_SCALE + o);
    const uint64_t per = 1000ull * DP_ADM_OUTPUT_SCALE;
    if (entropy_factor == (double)(uint32_t)entropy_factor)
        return (uint64_t)((whole * (uint32_t)entropy_factor + per - 1) / per);
    return (uint64_t)ceill((long double)whole * entropy_factor / per);
}

/* Every factor but the entropy's. */
static void price_base(const struct dp_tenant_cfg *cfg, uint32_t n_tokens, uint32_t chunk_count, uint32_t max_output,
                       struct dp_adm_price *p)
{
    memset(p, 0, sizeof(*p));
    p->price_per_1k = cfg->price_per_1k;
    p->chunk_count = chunk_count;
    p->input_tokens = chunk_count * DP_MAX_CHUNK_TOKENS;
    p->max_output = max_output;
    p->sample_tokens = n_tokens < DP_MAX_CHUNK_TOKENS ? n_tokens : DP_MAX_CHUNK_TOKENS;
    /* A request of several chunks is sampled on a full chunk only: otherwise a 1-token first
     * record (entropy 0) priced all its chunks at factor 1.0 and kept it off the secondary pool. */
    if (chunk_count > 1 && p->sample_tokens < DP_MAX_CHUNK_TOKENS)
        p->sample_tokens = 0;             /* assumed the maximum, as for OPEN */
    p->output_factor = output_factor(max_output);
}

/* The entropy's factors (tokens: the sample price_base was given); the charge is charge_of's. */
static void price_entropy(struct count_table *t, const uint32_t *tokens, struct dp_adm_price *p)
{
    p->entropy_bits = p->sample_tokens ? entropy_bits(t, tokens, p->sample_tokens) : ENTROPY_MAX_BITS;
    p->entropy_factor = 1.0 + 4.0 * p->entropy_bits / ENTROPY_MAX_BITS;
    p->complexity = p->entropy_factor * p->output_factor;
}

static void price(const struct dp_tenant_cfg *cfg, struct count_table *t, const uint32_t *tokens, uint32_t n_tokens,
                  uint32_t chunk_count, uint32_t max_output, struct dp_adm_price *p)
{
    price_base(cfg, n_tokens, chunk_count, max_output, p);
    price_entropy(t, tokens, p);
}

void dp_adm_price(const struct dp_tenant_cfg *cfg, const uint32_t *tokens, uint32_t n_tokens, uint32_t chunk_count,
                  uint32_t max_output, struct dp_adm_price *p)
{
    struct count_table t;
    memset(&t, 0, sizeof(t));
    price(cfg, &t, tokens, n_tokens, chunk_count, max_output, p);
}

/* Why a request is refused 400, the first that applies (FITS: it is not): more output than an
 * answer carries, more chunks than the router holds for a tenant, over its context limit, more tokens
 * than the tenant's whole minute (a 429 would name a retry that never succeeds). */
enum oversize { FITS, OVER_OUTPUT, OVER_CHUNKS, OVER_CONTEXT, OVER_MINUTE };

static enum oversize oversize(const struct dp_admission *a, const struct dp_tenant_cfg *cfg,
                              const struct dp_adm_price *p)
{
    if (p->max_output > DP_MAX_OUTPUT_TOKENS)
        return OVER_OUTPUT;
    if (a->max_chunks && p->chunk_count > a->max_chunks)
        return OVER_CHUNKS;
    if (cfg->max_request_tokens && (uint64_t)p->input_tokens + p->max_output > cfg->max_request_tokens)
        return OVER_CONTEXT;
    if (cfg->tokens_per_minute && (uint64_t)p->input_tokens + p->max_output > cfg->tokens_per_minute)
        return OVER_MINUTE;
    return FITS;
}

/* --- the body (JSON, <= cap bytes) -------------------------------------------------- */

struct jw {
    char *b;
    uint32_t n, cap;
    int over;
};

static void put(struct jw *w, const char *fmt, ...)
{
    if (w->over)
        return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(w->b + w->n, w->cap - w->n, fmt, ap);
    va_end(ap);
    if (k < 0 || (uint32_t)k >= w->cap - w->n)
        w->over = 1;
    else
        w->n += (uint32_t)k;
}

static int fits(const struct dp_adm_decision *d, uint32_t chunks, uint32_t out)
{
    uint64_t c = charge_of(d->p.price_per_1k, chunks * DP_MAX_CHUNK_TOKENS, out, d->p.entropy_factor);
    return c <= d->remaining;
}

/* The largest x in [lo, hi] with ok(x), or lo - 1 (ok is monotone: true, then false). */
#define LARGEST(lo, hi, ok)                                                                                    \
    ({                                                                                                         \
        int64_t a_ = (int64_t)(lo) - 1, b_ = (int64_t)(hi);                                                    \
        while (a_ < b_) {                                                                                      \
            int64_t m_ = (a_ + b_ + 1) / 2;                                                                    \
            uint32_t x = (uint32_t)m_;                                                                         \
            if (ok)                                                                                            \
                a_ = m_;                                                                                       \
            else                                                                                               \
                b_ = m_ - 1;                                                                                   \
        }                                                                                                      \
        a_;                                                                                                    \
    })

/* Whole seconds, rounded up: 0.4 s left of the day read "wait 0 s", and a retry then was refused again. */
static uint64_t secs_up(uint64_t ns)
{
    return (ns + 999999999ull) / 1000000000ull;
}

/* The factors as computed (%.17g: the double itself), so price / 1000 x tokens x them gives the
 * estimate: rounded to 4 places, 5% of bodies recomputed 1 micro-USD off it (a review). */
static void breakdown(struct jw *w, const struct dp_tenant_cfg *cfg, const struct dp_adm_decision *d)
{
    const struct dp_adm_price *p = &d->p;
    put(w, "\"cost_breakdown\":{\"price_per_1k_tokens_micro_usd\":%" PRIu32 ",\"chunk_count\":%" PRIu32
           ",\"input_tokens_estimate\":%" PRIu32 ",\"max_output_tokens\":%" PRIu32 ",\"entropy_bits\":%.4f"
           ",\"entropy_sample_tokens\":%" PRIu32 ",\"entropy_factor\":%.17g,\"output_factor\":%.17g"
           ",\"complexity\":%.17g,\"estimate_micro_usd\":%" PRIu64,
        p->price_per_1k, p->chunk_count, p->input_tokens, p->max_output, p->entropy_bits, p->sample_tokens,
        p->entropy_factor, p->output_factor, p->complexity, d->charge);
    if (cfg->budget_per_day)
        put(w, ",\"budget_per_day_micro_usd\":%" PRIu64 ",\"spent_today_micro_usd\":%" PRIu64
               ",\"remaining_micro_usd\":%" PRIu64 ",\"budget_resets_in_s\":%" PRIu64 "}",
            cfg->budget_per_day, d->spent, d->remaining, secs_up(d->resets_in_ns));
    else
        put(w, ",\"budget_per_day_micro_usd\":null,\"remaining_micro_usd\":null}");
}

/* The most tokens (prompt estimate and output) a request of this tenant may have: the smaller of
 * its request and minute limits (0: neither set). A hint checked against one limit alone was
 * refused by the other at the retry (found by review). */
static uint32_t token_limit(const struct dp_tenant_cfg *cfg)
{
    uint32_t a = cfg->max_request_tokens, b = cfg->tokens_per_minute;
    return !a ? b : !b ? a : a < b ? a : b;
}

/* "split into K requests of <= M prompt tokens", M a whole number of chunks under `limit` with
 * max_output, and no more chunks than the router holds for one tenant; with `with_output`, the
 * max_output_tokens that then fits beside M too (max_output was not the request's own). */
static void split_hint(struct jw *w, int *first, uint32_t limit, const struct dp_admission *a,
                       const struct dp_adm_price *p, int with_output)
{
    if (limit <= p->max_output || limit - p->max_output < DP_MAX_CHUNK_TOKENS)
        return;
    uint32_t m = (limit - p->max_output) / DP_MAX_CHUNK_TOKENS * DP_MAX_CHUNK_TOKENS;
    if (a->max_chunks && m / DP_MAX_CHUNK_TOKENS > a->max_chunks)
        m = a->max_chunks * DP_MAX_CHUNK_TOKENS;
    uint32_t k = (p->input_tokens + m - 1) / m;
    if (k > 1) {
        put(w, "%s\"split into %" PRIu32 " requests of <= %" PRIu32 " prompt tokens", *first ? "" : ",", k, m);
        if (with_output)
            put(w, " with max_output_tokens <= %" PRIu32,
                limit - m < DP_MAX_OUTPUT_TOKENS ? limit - m : DP_MAX_OUTPUT_TOKENS);
        put(w, "\"");
        *first = 0;
    }
}

/* A limit under one chunk's estimate: every request is over it, whatever it carries. */
#define NO_FIT "the limit is %" PRIu32 " tokens, under one chunk's estimate (%d prompt tokens, whatever it " \
               "carries) and its output: no request fits it, ask for a higher one"

static void suggestions(struct jw *w, const struct dp_admission *a, const struct dp_tenant_cfg *cfg,
                        const struct dp_adm_decision *d, uint16_t st)
{
    const struct dp_adm_price *p = &d->p;
    int first = 1;
#define HINT(...) (put(w, first ? "\"" : ",\""), put(w, __VA_ARGS__), put(w, "\""), first = 0)
    put(w, ",\"suggestions\":[");
    enum oversize why = st == DP_STATUS_BAD_REQUEST ? oversize(a, cfg, p) : FITS;
    uint32_t limit = token_limit(cfg);          /* every 400 hint fits all of them, not only the one hit */
    if (why == OVER_OUTPUT) {
        uint32_t out = DP_MAX_OUTPUT_TOKENS;
        if (limit && p->input_tokens < limit && limit - p->input_tokens < out)
            out = limit - p->input_tokens;
        if ((!limit || p->input_tokens < limit) && a->max_chunks && p->chunk_count > a->max_chunks)
            /* each part's prompt is a piece of this one's: with out it fits the limit too */
            HINT("lower max_output_tokens to %" PRIu32 " and split into requests of at most %" PRIu32 " chunks",
                 out, a->max_chunks);
        else if (!limit || p->input_tokens < limit)
            HINT("lower max_output_tokens to %" PRIu32 " and ask for the rest in a further request on the session",
                 out);
        else
            /* the prompt alone is over the limit: the parts' output must come down too (the hint
             * named the split alone, and its retry was refused for the output, found by review) */
            split_hint(w, &first, limit, a, &(struct dp_adm_price){ .input_tokens = p->input_tokens,
                                                                    .max_output = 1 }, 1);
    } else if (why == OVER_CHUNKS) {
        uint32_t chunks = a->max_chunks;
        /* the chunks the limit leaves room for beside this output: none when the output alone is
         * over it (the hint named max_chunks then, and its retry was refused, found by review) */
        uint32_t room = limit > p->max_output ? (limit - p->max_output) / DP_MAX_CHUNK_TOKENS : 0;
        if (limit && room < chunks)
            chunks = room;
        if (chunks)
            HINT("split into requests of at most %" PRIu32 " chunks", chunks);
        else if (limit > DP_MAX_CHUNK_TOKENS) {   /* the output alone leaves no chunk room: both give */
            chunks = (limit - 1) / DP_MAX_CHUNK_TOKENS < a->max_chunks ? (limit - 1) / DP_MAX_CHUNK_TOKENS
                                                                        : a->max_chunks;
            HINT("split into requests of at most %" PRIu32 " chunks with max_output_tokens <= %" PRIu32, chunks,
                 limit - chunks * DP_MAX_CHUNK_TOKENS);
        } else
            HINT(NO_FIT, limit, DP_MAX_CHUNK_TOKENS);
    } else if (why == OVER_MINUTE || why == OVER_CONTEXT) {
        split_hint(w, &first, limit, a, p, 0);
        if (p->input_tokens < limit && p->max_output > limit - p->input_tokens)
            HINT("lower max_output_tokens to %" PRIu32, limit - p->input_tokens);
        if (first && why == OVER_MINUTE)
            HINT("the tenant's limit is %" PRIu32 " tokens per minute: ask for a higher one",
                 cfg->tokens_per_minute);
        else if (first && limit > DP_MAX_CHUNK_TOKENS)
            /* several chunks, and this output leaves no chunk room: one chunk each, less output
             * (it said "at most limit - 1 prompt tokens", which as chunks of 128 was over it) */
            HINT("split into requests of one chunk (<= %d prompt tokens) with max_output_tokens <= %" PRIu32,
                 DP_MAX_CHUNK_TOKENS, limit - DP_MAX_CHUNK_TOKENS < DP_MAX_OUTPUT_TOKENS
                                      ? limit - DP_MAX_CHUNK_TOKENS : DP_MAX_OUTPUT_TOKENS);
        else if (first)
            HINT(NO_FIT, limit, DP_MAX_CHUNK_TOKENS);
    } else if (st == DP_STATUS_UNPROCESSABLE) {
        /* the minute's bucket short too (decide's retry_after): a smaller request sent at once was
         * refused 429 (found by review). The whole request's wait bounds a smaller one's. */
        char then[80] = "";
        if (d->retry_after_ns)
            snprintf(then, sizeof(then), ", after %" PRIu64 " ms (the tenant's tokens per minute)",
                     (d->retry_after_ns + 999999) / 1000000);
        int64_t out = LARGEST(1, p->max_output ? p->max_output - 1 : 0, fits(d, p->chunk_count, x));
        if (out >= 1)
            HINT("lower max_output_tokens to %" PRId64 "%s", out, then);
        int64_t chunks = LARGEST(1, p->chunk_count - 1, fits(d, x, p->max_output));
        if (chunks >= 1)
            HINT("send fewer chunks: at most %" PRId64 " (%" PRId64 " prompt tokens)%s", chunks,
                 chunks * DP_MAX_CHUNK_TOKENS, then);
        if (out < 1 && chunks < 1) {
            int64_t both = LARGEST(1, p->max_output, fits(d, 1, x));
            if (both >= 1)
                HINT("send one chunk (128 prompt tokens) with max_output_tokens <= %" PRId64 "%s", both, then);
        }
        if (!p->sample_tokens)           /* assumed, not measured: the prompt itself may be cheap */
            HINT("no full first chunk was seen (an OPEN), so the entropy factor is the most, 5.00: send the "
                 "first chunk instead, priced on its tokens");
        else if (p->entropy_factor > 1.5)
            HINT("a less varied prompt costs less: entropy factor %.2f of 1.00..5.00", p->entropy_factor);
        if (d->charge > cfg->budget_per_day)    /* a whole day's budget would not cover it either */
            HINT("it costs more than a whole day's budget (%" PRIu64 " micro-USD): only a smaller request, or a "
                 "larger budget, fits", cfg->budget_per_day);
        else
            HINT("wait %" PRIu64 " s for the daily budget to reset, or raise it",
                 secs_up(d->resets_in_ns > d->retry_after_ns ? d->resets_in_ns : d->retry_after_ns));
    } else if (st == DP_STATUS_RATE_LIMITED) {
        HINT("retry after %" PRIu64 " ms", (d->retry_after_ns + 999999) / 1000000);
    }
    put(w, "]");
#undef HINT
}

static const char *reason(const struct dp_admission *a, const struct dp_tenant_cfg *cfg,
                          const struct dp_adm_decision *d)
{
    switch (d->status) {
    case DP_STATUS_BAD_REQUEST:
        switch (oversize(a, cfg, &d->p)) {
        case OVER_OUTPUT: return "max_output_tokens is more than one answer carries";
        case OVER_CHUNKS: return "more chunks than the router holds for one tenant";
        case OVER_MINUTE: return "the request is larger than the tenant's tokens per minute";
        default: return "the request is larger than the tenant's context limit";
        }
    case DP_STATUS_UNAVAILABLE: return "the tenant table is full: this tenant's limits cannot be kept";
    case DP_STATUS_UNPROCESSABLE: return "the estimated cost exceeds the remaining daily budget";
    case DP_STATUS_RATE_LIMITED: return "over the tenant's tokens per minute";
    default: return "";
    }
}

static uint32_t write_body(const struct dp_admission *a, const struct dp_tenant_cfg *cfg,
                           const struct dp_adm_decision *d, int count_only, char *body, uint32_t cap)
{
    struct jw w = { body, 0, cap, 0 };
    uint64_t tokens = (uint64_t)d->p.input_tokens + d->p.max_output;
    if (count_only)
        put(&w, "{\"status\":200,\"count_tokens\":true,\"would_be\":%u", d->status);
    else
        put(&w, "{\"status\":%u,\"error\":\"%s\"", d->status, reason(a, cfg, d));
    put(&w, ",\"request_tokens\":%" PRIu64, tokens);
    enum oversize why = d->status == DP_STATUS_BAD_REQUEST ? oversize(a, cfg, &d->p) : FITS;
    if (why == OVER_OUTPUT)
        put(&w, ",\"max_output_tokens_limit\":%d", DP_MAX_OUTPUT_TOKENS);
    else if (why == OVER_CHUNKS)
        put(&w, ",\"limit_chunks\":%" PRIu32, a->max_chunks);
    else if (why == OVER_CONTEXT)
        put(&w, ",\"limit_tokens\":%" PRIu32, cfg->max_request_tokens);
    else if (why == OVER_MINUTE)
        put(&w, ",\"tokens_per_minute\":%" PRIu32, cfg->tokens_per_minute);
    if (d->status == DP_STATUS_RATE_LIMITED || (d->status == DP_STATUS_UNPROCESSABLE && d->retry_after_ns))
        put(&w, ",\"tokens_per_minute\":%" PRIu32 ",\"retry_after_ms\":%" PRIu64, cfg->tokens_per_minute,
            (d->retry_after_ns + 999999) / 1000000);
    put(&w, ",");
    breakdown(&w, cfg, d);
    suggestions(&w, a, cfg, d, d->status);
    put(&w, "}");
    if (w.over) {                     /* cannot happen with these fields; a short valid body if it did */
        int k = snprintf(body, cap, "{\"status\":%u,\"error\":\"body too long\"}", d->status);
        return k > 0 && (uint32_t)k < cap ? (uint32_t)k : 0;
    }
    return w.n;
}

/* --- decisions ----------------------------------------------------------------------- */

void dp_adm_finish(struct dp_admission *a, struct dp_adm_decision *d, const uint32_t *tokens)
{
    if (d->priced)
        return;
    price_entropy(&a->counts, tokens, &d->p);
    d->charge = charge_of(d->p.price_per_1k, d->p.input_tokens, d->p.max_output, d->p.entropy_factor);
    d->priced = 1;
}

void dp_adm_measure(struct dp_admission *a, struct dp_adm_decision *d, const uint32_t *tokens, uint32_t n_tokens)
{
    if (!d->priced || d->p.sample_tokens)
        return;                           /* measured at its decision (or to be, lazily) */
    uint32_t n = n_tokens < DP_MAX_CHUNK_TOKENS ? n_tokens : DP_MAX_CHUNK_TOKENS;
    if (!n || (d->p.chunk_count > 1 && n < DP_MAX_CHUNK_TOKENS))
        return;                           /* no sample a decision would take (price_base) */
    struct dp_adm_price m = d->p;
    m.sample_tokens = n;
    price_entropy(&a->counts, tokens, &m);
    if (m.entropy_factor < d->p.entropy_factor)
        d->p = m;
}

uint32_t dp_adm_decide(struct dp_admission *a, uint32_t tenant, const uint32_t *tokens, uint32_t n_tokens,
                       uint32_t chunk_count, uint32_t max_output, int flags, uint64_t now,
                       struct dp_adm_decision *d, char *body, uint32_t cap)
{
    struct tenant *t = find(a, tenant, FIND, 0);
    const struct dp_tenant_cfg *cfg = cfg_of(a, t);
    int count_only = flags & DP_ADM_COUNT_ONLY;
    memset(d, 0, sizeof(*d));
    d->count_only = count_only ? 1 : 0;
    price_base(cfg, n_tokens, chunk_count, max_output, &d->p);
    uint64_t tokens_all = (uint64_t)d->p.input_tokens + max_output;
    int new_day = !t || !t->day_start || now - t->day_start >= DAY_NS;
    d->spent = new_day ? 0 : t->spent;
    d->resets_in_ns = new_day ? DAY_NS : t->day_start + DAY_NS - now;
    d->remaining = !cfg->budget_per_day ? UINT64_MAX
                   : cfg->budget_per_day > d->spent ? cfg->budget_per_day - d->spent : 0;
    /* The entropy is measured now unless the decision cannot depend on it: no high-entropy threshold
     * above 1 (at or below it every request is high, whatever its factor in 1..5), and the cost fits
     * the budget even at factor 5. */
    int hi_rule = cfg->hi_entropy_factor > 1.0;
    if (!(flags & DP_ADM_LAZY) || count_only || hi_rule ||
        charge_of(cfg->price_per_1k, d->p.input_tokens, max_output, 5.0) > d->remaining)
        dp_adm_finish(a, d, tokens);
    uint64_t minute_wait = 0;            /* till the minute's bucket holds this request */
    if (cfg->tokens_per_minute) {
        uint64_t tat = t && t->tat_minute > now ? t->tat_minute : now;
        uint64_t next = tat + (uint64_t)((double)tokens_all * MINUTE_NS / cfg->tokens_per_minute);
        minute_wait = next - now > MINUTE_NS ? next - now - MINUTE_NS : 0;
    }
    d->status = DP_STATUS_OK;
    if (oversize(a, cfg, &d->p) != FITS)
        d->status = DP_STATUS_BAD_REQUEST;
    else if (limited(cfg) && !t && !room(a, now, !(flags & (DP_ADM_NO_SWEEP | DP_ADM_COUNT_ONLY))))
        d->status = DP_STATUS_UNAVAILABLE;   /* its limits could not be kept: refused, not run unlimited */
    else if (d->priced && d->charge > d->remaining) {
        d->status = DP_STATUS_UNPROCESSABLE;
        /* its hint's wait: the day's reset, or the minute's bucket if that is later (a retry the
         * hint timed by the reset alone, a few seconds before it, was refused 429) */
        d->retry_after_ns = minute_wait;
    } else if (minute_wait) {
        d->status = DP_STATUS_RATE_LIMITED;
        d->retry_after_ns = minute_wait;
    }
    d->high = cfg->hi_entropy_factor > 0 && (!hi_rule || d->p.entropy_factor >= cfg->hi_entropy_factor);
    if (d->status == DP_STATUS_OK && d->high) {
        if (cfg->hi_per_second <= 0)
            d->spill = 1;
        else {
            double inc = (double)hi_interval_ns(cfg);
            uint64_t tat = t && t->tat_high > now ? t->tat_high : now;
            d->spill = (double)(tat - now) + inc > inc * cfg->hi_burst;
        }
    }
    if (d->status == DP_STATUS_OK && !count_only)
        return 0;
    dp_adm_finish(a, d, tokens);      /* the body shows the whole price */
    return write_body(a, cfg, d, count_only, body, cap);
}

void dp_adm_commit(struct dp_admission *a, uint32_t tenant, struct dp_adm_decision *d, uint64_t now)
{
    /* Only an admitted request needs state kept (refusals and counts change none): a tenant id
     * seen only in refusals or counts takes no slot, and keeps no per-tenant counts either. */
    int admitted = !d->count_only && d->status == DP_STATUS_OK;
    struct tenant *t = find(a, tenant, admitted ? INSERT : FIND, now);
    if (!t)
        return;                       /* no room (decide refused the limited; these need no state) */
    const struct dp_tenant_cfg *cfg = cfg_of(a, t);
    if (d->count_only) {
        t->st.counted++;
        return;
    }
    switch (d->status) {
    case DP_STATUS_BAD_REQUEST: t->st.oversized++; return;
    case DP_STATUS_UNPROCESSABLE: t->st.over_budget++; return;
    case DP_STATUS_RATE_LIMITED: t->st.rate_limited++; return;
    }
    t->st.admitted++;
    if (!t->day_start || now - t->day_start >= DAY_NS) {
        t->day_start = now;
        t->spent = 0;
    }
    t->spent += d->charge;
    t->st.charged += d->charge;
    d->charged_day = t->day_start;
    if (cfg->tokens_per_minute) {
        uint64_t tat = t->tat_minute > now ? t->tat_minute : now;
        d->minute_ns = (uint64_t)((double)(d->p.input_tokens + d->p.max_output) * MINUTE_NS / cfg->tokens_per_minute);
        t->tat_minute = tat + d->minute_ns;
    }
    if (d->spill)
        t->st.spilled++;
    else if (d->high && cfg->hi_per_second > 0) {
        uint64_t tat = t->tat_high > now ? t->tat_high : now;
        uint64_t inc = hi_interval_ns(cfg);
        t->tat_high = tat < UINT64_MAX - inc ? tat + inc : UINT64_MAX;     /* a huge burst saturates */
    }
    note_idle(a, t);
}

void dp_adm_settle(struct dp_admission *a, uint32_t tenant, const struct dp_adm_decision *admitted, uint32_t input,
                   uint32_t output, int ok)
{
    struct tenant *t = find(a, tenant, FIND, 0);
    if (!t)
        return;
    const struct dp_adm_price *p = &admitted->p;
    uint64_t exact = ok ? charge_of(p->price_per_1k, input, output, p->entropy_factor) : 0;
    /* a charge of a day that has ended is not given back to the new one (the tenant could spend
     * more than its budget in that day) */
    if (exact < admitted->charge && admitted->charged_day == t->day_start) {
        uint64_t back = admitted->charge - exact;
        t->spent = t->spent > back ? t->spent - back : 0;
        t->st.refunded += back;
    }
    /* the unused share of what the bucket was charged, at the rate of then: the rate now (a limit
     * lowered or switched on meanwhile) gave back up to 100x the charge, or what was never charged.
     * Used: the tokens that came and ran, answered 200 or not (money is given back for a failure,
     * the limit's room is not: a tenant that never sent its last chunk had every prefill run and
     * the whole minute back, round after round; found by review). */
    uint32_t estimate = p->input_tokens + p->max_output, used = input + output;
    if (admitted->minute_ns && estimate > used) {
        uint64_t back = (uint64_t)((double)admitted->minute_ns * (estimate - used) / estimate);
        t->tat_minute = t->tat_minute > back ? t->tat_minute - back : 0;
    }
    note_idle(a, t);
}

/* --- benchmarks (bench ring) -------------------------------------------------------------------- */

#define BENCH_T0 1000000000000ull         /* the run's "now": any time past the first day */

/* A table with tenants 1..fill admitted once at BENCH_T0 (each spent today); *first: tenant 1's decision. */
static struct dp_admission *bench_table(uint32_t fill, struct dp_adm_decision *first)
{
    struct dp_admission *a = dp_adm_create();
    if (!a)
        return NULL;
    struct dp_tenant_cfg cfg = { .price_per_1k = 1000, .budget_per_day = 1000000 };
    dp_adm_set_default(a, &cfg);
    uint32_t token = 1;
    char body[DP_MAX_RESP_BODY];
    struct dp_adm_decision d;
    for (uint32_t t = 1; t <= fill && (t == 1 || d.status == DP_STATUS_OK); t++) {
        dp_adm_decide(a, t, &token, 1, 1, 1, 0, BENCH_T0, &d, body, sizeof(body));
        dp_adm_commit(a, t, &d, BENCH_T0);
        if (t == 1)
            *first = d;
    }
    return a;
}

double dp_adm_decide_bench(uint32_t fill, uint32_t decisions)
{
    struct dp_adm_decision first, d;
    if (fill >= DP_ADM_MAX_TENANTS || !decisions)
        return -1;
    struct dp_admission *a = bench_table(fill, &first);
    if (!a)
        return -1;
    uint32_t token = 1;
    uint64_t admitted = 0, filled = a->used;
    char body[DP_MAX_RESP_BODY];
    uint64_t t0 = now_ns();
    for (uint32_t i = 0; i < decisions; i++) {    /* ids past 2^31: never one of the table's 1..fill */
        dp_adm_decide(a, (uint32_t)dp_hash64(i) | 0x80000000u, &token, 1, 1, 1, 0, BENCH_T0, &d, body, sizeof(body));
        admitted += d.status == DP_STATUS_OK;
    }
    double ns = (double)(now_ns() - t0) / decisions;
    dp_adm_destroy(a);
    return admitted == decisions && filled == fill ? ns : -2;
}

double dp_adm_sweep_bench(double *read_us)
{
    struct dp_adm_decision first, d;
    struct dp_admission *a = bench_table(DP_ADM_MAX_TENANTS, &first);
    if (!a)
        return -1;
    uint32_t token = 1, before = a->used;
    char body[DP_MAX_RESP_BODY];
    dp_adm_settle(a, 1, &first, 0, 0, 0);   /* tenant 1's request failed: nothing spent, idle */
    uint64_t t0 = now_ns();
    dp_adm_decide(a, 0x80000000u, &token, 1, 1, 1, 0, BENCH_T0 + 1, &d, body, sizeof(body));
    uint64_t t1 = now_ns();
    int ok = before == DP_ADM_MAX_TENANTS && a->used == before - 1 && d.status == DP_STATUS_OK;
    const volatile uint64_t *w = (const volatile uint64_t *)a->t;
    uint64_t words = TABLE_BYTES / 8;
    uint64_t t2 = now_ns();
    for (uint64_t i = 0; i < words; i += 8)
        (void)w[i];
    *read_us = (double)(now_ns() - t2) / 1e3;
    dp_adm_destroy(a);
    return ok ? (double)(t1 - t0) / 1e3 : -2;
}
