/* admission.h - per-request pricing and admission, once per request, in C.
 *
 * The router asks once per request, when it first sees it (its first chunk,
 * or an OPEN or COUNT_TOKENS record), never per chunk or token. Settings are
 * per tenant (API key), in an open-addressing table set live from Python
 * through the router (under its lock); a tenant without settings of its own
 * uses the default ones. The table holds DP_ADM_MAX_TENANTS tenants (the
 * operator's own count too, and may fill it further, to 1.5 times that);
 * full, it is swept of idle default-settings ones (nothing spent today, no
 * bucket debt: their state says nothing a fresh tenant's would not).
 *
 * The price (the article's "token price x (input + output tokens) x
 * complexity"), the one statement of the formula:
 *
 *   input_tokens   = chunk_count x 128         the conservative bound: only
 *                                              the first chunk is here yet
 *   entropy_bits   = Shannon entropy of the token ids of the first record
 *                    seen (H = -sum p log2 p over its n <= 128 tokens;
 *                    0 for one repeated token, log2(n) for n distinct ones);
 *                    a request of several chunks is sampled only on a full
 *                    first record (else the maximum: a 1-token first chunk
 *                    priced them all at 1.0). A sample is a sample: the
 *                    other chunks are not measured (never a per-chunk cost)
 *   entropy_factor = 1 + 4 x entropy_bits / 7   1.0 repetitive .. 5.0 for 128
 *                                              distinct tokens (log2 128 = 7);
 *                                              5.0 when no tokens are seen
 *                                              (OPEN): the system estimates high
 *   output_factor  = 1 + min(max_output_tokens, 1024) / 1024    1.0 .. 1.25
 *                    for any request admitted (max_output_tokens <= 256; the
 *                    bound only shows in a 400's body): each output token is
 *                    one decode step over the whole KV
 *   complexity     = entropy_factor x output_factor
 *   cost (micro-USD) = price_per_1k / 1000 x (input_tokens + max_output_tokens) x complexity
 *
 * Decision, in this order (the first that applies):
 *   400  max_output_tokens > DP_MAX_OUTPUT_TOKENS (256: what one answer
 *        carries, chunk.h), or chunk_count > what the router holds for
 *        one tenant (dp_adm_set_max_chunks: a quarter of its pool), or input_tokens + max_output_tokens >
 *        max_request_tokens (the context limit), or > tokens_per_minute (no
 *        retry would ever fit the minute): the body names the first that
 *        applies; refused whole and alone, never truncated;
 *   503  a tenant with limits (a budget, a per-minute or high-entropy rate)
 *        but no state slot, none free or idle (the table is full of tenants
 *        that spent today or owe a bucket): refused, not run unlimited;
 *   422  ceil(cost) > what is left of budget_per_day: a JSON body with the
 *        cost breakdown and suggestions;
 *   429  the request's tokens (input + max_output) exceed what is left of
 *        tokens_per_minute, a GCRA bucket of one minute's worth (request level, per key; the XDP
 *        program's bucket is per chunk, see docs/admission.md);
 *   200  admitted: ceil(cost) is charged to the day's budget and the tokens to
 *        the minute's bucket. A high-entropy request (entropy_factor >=
 *        hi_entropy_factor) beyond the tenant's hi_per_second rate (GCRA,
 *        bursts of up to hi_burst requests) is admitted with spill = 1: the router
 *        places it on the secondary pool.
 * At completion the router settles: the charge becomes the exact price of
 * what ran (the tokens received and generated; the same entropy factor, the
 * output factor of the tokens generated); a request that did not complete
 * with 200 is not charged (a charge to a day that has ended since stays in
 * that day).
 * COUNT_TOKENS records are priced and answered 200 with the same breakdown
 * (and the status the request would get); nothing is charged or run.
 */
#ifndef DP_ADMISSION_H
#define DP_ADMISSION_H

#include <stdint.h>

/* CDEF BEGIN */
#define DP_ADM_MAX_TENANTS 65536         /* tenants with state that take a default-settings tenant's
                                            room (power of two: as many as XDP's tenant_keys map holds) */
#define DP_ADM_MAX_ALL_TENANTS 98304     /* with the operator's own past that (set_tenant): 3/4 of the slots */
#define DP_ADM_OUTPUT_SCALE 1024         /* output_factor = 1 + min(max_output, this) / this */
#define DP_ADM_DAY_S 86400

struct dp_tenant_cfg {
    uint32_t price_per_1k;        /* micro-USD per 1,000 tokens (0: free) */
    uint32_t max_request_tokens;  /* context limit on input estimate + max_output (0: none) -> 400 */
    uint64_t budget_per_day;      /* micro-USD per day (0: unlimited) -> 422 */
    uint32_t tokens_per_minute;   /* request-level per-key limit (0: none) -> 429 */
    uint32_t hi_burst;            /* at the rate, bursts of up to this many on the primary (0: none) */
    double hi_entropy_factor;     /* entropy_factor from which a request is high-entropy (0: never) */
    double hi_per_second;         /* high-entropy requests per second kept on the primary (0: none is) */
};

struct dp_adm_price {             /* every factor of one request's price */
    uint32_t price_per_1k;
    uint32_t input_tokens;        /* the estimate: chunk_count x 128 */
    uint32_t chunk_count;
    uint32_t max_output;
    uint32_t sample_tokens;       /* tokens the entropy was measured on (0: none seen, assumed the maximum) */
    double entropy_bits, entropy_factor, output_factor, complexity;
};

struct dp_adm_decision {
    struct dp_adm_price p;
    uint16_t status;              /* 200, 400, 422, 429 or 503 */
    uint8_t spill;                /* admitted, to the secondary pool */
    uint8_t high;                 /* high-entropy */
    uint8_t count_only;           /* a COUNT_TOKENS record: answered, never charged */
    uint8_t priced;               /* 0: a lazy decision's entropy (p.entropy_*, complexity) and
                                     charge are not measured yet: dp_adm_finish */
    uint64_t charge;              /* ceil(cost): micro-USD charged if admitted */
    uint64_t remaining;           /* budget left before this request (UINT64_MAX: unlimited) */
    uint64_t spent;               /* spent today before it */
    uint64_t resets_in_ns;        /* until the budget's day ends */
    uint64_t retry_after_ns;      /* 429: until the minute's bucket has room */
    uint64_t charged_day;         /* set by dp_adm_commit: the start of the day charged */
    uint64_t minute_ns;           /* set by dp_adm_commit: what the minute's bucket was charged */
};

struct dp_adm_tenant_stats {
    uint32_t own_settings;        /* 1: set for this tenant, 0: the default ones */
    uint32_t pad;
    uint64_t admitted, oversized, over_budget, rate_limited, spilled, counted;
    uint64_t spent;               /* micro-USD today, after settlements */
    uint64_t charged, refunded;   /* micro-USD charged at admission, given back at settlement */
};

struct dp_admission;

struct dp_admission *dp_adm_create(void);
void dp_adm_destroy(struct dp_admission *a);
/* The slot where a tenant's probe starts: keyed by a random secret of the table's (tests). */
uint32_t dp_adm_home(const struct dp_admission *a, uint32_t tenant);
/* Settings of one tenant (kept with its spending), or the default for the others. -ENOSPC: no room
 * (the table holds DP_ADM_MAX_ALL_TENANTS tenants at most). */
int dp_adm_set_tenant(struct dp_admission *a, uint32_t tenant, const struct dp_tenant_cfg *cfg);
void dp_adm_set_max_chunks(struct dp_admission *a, uint32_t max_chunks);   /* 0: no limit */
void dp_adm_set_default(struct dp_admission *a, const struct dp_tenant_cfg *cfg);
int dp_adm_tenant_stats(struct dp_admission *a, uint32_t tenant, uint64_t now, struct dp_adm_tenant_stats *s);

void dp_adm_price(const struct dp_tenant_cfg *cfg, const uint32_t *tokens, uint32_t n_tokens, uint32_t chunk_count,
                  uint32_t max_output, struct dp_adm_price *out);
#define DP_ADM_COUNT_ONLY 1   /* a COUNT_TOKENS record */
#define DP_ADM_LAZY 2         /* measure the entropy only if the decision depends on it */
#define DP_ADM_NO_SWEEP 4     /* a rehearsal: never sweep (a sweep that is due counts as room) */
/* Price and decide, changing nothing but the admission's scratch table for counting tokens (so
 * one admission is not reentrant: the router calls it under its lock), unless a limited tenant
 * not in the full table makes it sweep out idle tenants (not for DP_ADM_NO_SWEEP, nor a count);
 * the JSON body (refusals, count_only) goes to body[cap]. Returns the body's length (0: none).
 * With DP_ADM_LAZY the entropy pass (~80 ns at 64 tokens, most of a decision) is left out when
 * no outcome can depend on it: no high-entropy threshold above 1 (the factor's least), and the
 * request fits its budget even at the highest factor. Refusals and counts are priced whole. */
uint32_t dp_adm_decide(struct dp_admission *a, uint32_t tenant, const uint32_t *tokens, uint32_t n_tokens,
                       uint32_t chunk_count, uint32_t max_output, int flags, uint64_t now,
                       struct dp_adm_decision *d, char *body, uint32_t cap);
/* Completes a lazy decision's price (tokens: the ones it was decided on, still unchanged); nothing
 * if it is priced. The same outcome as deciding with the price measured, before its commit. */
void dp_adm_finish(struct dp_admission *a, struct dp_adm_decision *d, const uint32_t *tokens);
/* An admitted request priced on an assumed entropy (its OPEN, or a short first record of several: no
 * sample), whose first chunk has come: its entropy measured on those tokens as a decision would, and
 * kept for its settlement if lower. The charge stands (the most, at admission); the settlement
 * gives back the difference. Priced at the most for good, an OPEN's request paid 5x (found by review). */
void dp_adm_measure(struct dp_admission *a, struct dp_adm_decision *d, const uint32_t *tokens, uint32_t n_tokens);
/* The decision stands (the router placed the request, or answered it): count it, charge an admission.
 * Its price is measured (priced), and nothing else of the tenant was decided since. */
void dp_adm_commit(struct dp_admission *a, uint32_t tenant, struct dp_adm_decision *d, uint64_t now);
/* Completion of an admitted request: the charge becomes the exact price of what ran (input tokens
 * received, output tokens generated, at the admission's price and entropy factor; never more than
 * charged), or nothing if it failed (ok = 0); the minute's bucket gets back the estimate's tokens
 * that never came or ran, failed or not (input + output are what did). */
void dp_adm_settle(struct dp_admission *a, uint32_t tenant, const struct dp_adm_decision *admitted, uint32_t input,
                   uint32_t output, int ok);
/* For `bench ring`: ns per decision for tenants never seen (under a priced default with a budget,
 * so the tenant table is probed for a room check) with `fill` (< DP_ADM_MAX_TENANTS) tenants that
 * spent today already in the table. < 0: failed. */
double dp_adm_decide_bench(uint32_t fill, uint32_t decisions);
/* us of the sweep of a full table that frees one tenant (the kind that recurs, at most once a
 * second: one that frees many costs more, and buys room for as many), and in *read_us its
 * reference: a pass reading one word of each cache line of the same table. < 0: failed. */
double dp_adm_sweep_bench(double *read_us);
/* CDEF END */

#endif /* DP_ADMISSION_H */
