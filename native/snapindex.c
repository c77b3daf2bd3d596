/* snapindex.c - the snapshot store's packed index (snapindex.h). */
#include "snapindex.h"

#include <stdlib.h>
#include <string.h>

#define REC_MIN 256
#define SESS_MIN 256
#define SLOTS_MIN 512           /* a power of two */

struct six *six_new(void)
{
    struct six *ix = calloc(1, sizeof(*ix));
    if (!ix)
        return NULL;
    ix->slot = calloc(SLOTS_MIN, sizeof(*ix->slot));
    if (!ix->slot) {
        free(ix);
        return NULL;
    }
    ix->slot_mask = SLOTS_MIN - 1;
    ix->free_sess = ix->lru_first = ix->lru_last = SIX_NONE;
    return ix;
}

void six_free(struct six *ix)
{
    if (!ix)
        return;
    free(ix->rec);
    free(ix->sess);
    free(ix->slot);
    free(ix);
}

size_t six_bytes(const struct six *ix)
{
    return sizeof(*ix) + ix->rec_cap * sizeof(*ix->rec) + (size_t)ix->sess_cap * sizeof(*ix->sess)
           + ((size_t)ix->slot_mask + 1) * sizeof(*ix->slot);
}

/* --- the log ------------------------------------------------------------------------ */

struct six_rec *six_rec(struct six *ix, uint64_t rid)
{
    return &ix->rec[rid % ix->rec_cap];
}

/* Links hold a rid's low 32 bits: the log never holds 2^32 records at once, so the whole rid
 * is the one in [head, head + 2^32) with those bits. */
uint64_t six_rid(const struct six *ix, uint32_t low)
{
    return ix->head + (uint32_t)(low - (uint32_t)ix->head);
}

/* The tables grow by a quarter, not doubled: what is allocated is what the index costs a
 * session (a copy per growth is cheap beside the I/O a record took). */
#define GROWN(cap, min) ((cap) < (min) ? (min) : (cap) + (cap) / 4)

/* Every rid in [head, tail) keeps its own slot in the larger ring: fewer of them than either size. */
static int grow_log(struct six *ix)
{
    uint64_t cap = GROWN(ix->rec_cap, REC_MIN);
    struct six_rec *rec = malloc(cap * sizeof(*rec));
    if (!rec)
        return -1;
    for (uint64_t rid = ix->head; rid < ix->tail; rid++)
        rec[rid % cap] = ix->rec[rid % ix->rec_cap];
    free(ix->rec);
    ix->rec = rec;
    ix->rec_cap = cap;
    return 0;
}

int six_append(struct six *ix, uint64_t lpos, uint64_t seq, uint32_t nblocks, uint8_t kind)
{
    if (ix->tail - ix->head == ix->rec_cap && grow_log(ix))
        return -1;
    struct six_rec *r = six_rec(ix, ix->tail++);
    *r = (struct six_rec){ .lpos = lpos, .seq = seq, .nblocks = nblocks, .sess = SIX_NONE, .kind = kind };
    return 0;
}

void six_pop(struct six *ix)
{
    if (ix->head < ix->tail)
        ix->head++;
}

/* --- the sessions' hash ------------------------------------------------------------------ */

static uint64_t mix(uint64_t h)         /* murmur3's finalizer */
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
}

/* Keys are HMACs, but a caller may pass any 32 bytes (tests do: mostly zeros): all of it is mixed. */
static uint32_t home(const struct six *ix, const uint8_t *key)
{
    uint64_t w[4];
    memcpy(w, key, sizeof(w));
    return (uint32_t)mix(w[0] ^ mix(w[1] ^ mix(w[2] ^ mix(w[3])))) & ix->slot_mask;
}

/* The slot holding key, or the empty one where it would go. */
static uint32_t probe(const struct six *ix, const uint8_t *key)
{
    uint32_t i = home(ix, key);
    while (ix->slot[i] && memcmp(ix->sess[ix->slot[i] - 1].key, key, SIX_KEY_LEN))
        i = (i + 1) & ix->slot_mask;
    return i;
}

uint32_t six_find(const struct six *ix, const uint8_t *key)
{
    uint32_t v = ix->slot[probe(ix, key)];
    return v ? v - 1 : SIX_NONE;
}

/* At most 3/4 full; doubled (slots are 4 bytes: a few per session). */
static int grow_hash(struct six *ix)
{
    uint32_t n = (ix->slot_mask + 1) * 2;
    uint32_t *slot = calloc(n, sizeof(*slot)), *old = ix->slot, old_n = ix->slot_mask + 1;
    if (!slot)
        return -1;
    ix->slot = slot;
    ix->slot_mask = n - 1;
    for (uint32_t i = 0; i < old_n; i++)
        if (old[i])
            slot[probe(ix, ix->sess[old[i] - 1].key)] = old[i];
    free(old);
    return 0;
}

/* Backward-shift deletion: the entries after i in its run move up where their probe would
 * pass i, so a lookup never stops early at the hole and no tombstones pile up. */
static void unhash(struct six *ix, uint32_t s)
{
    uint32_t i = probe(ix, ix->sess[s].key), j = i;
    ix->slot[i] = 0;
    for (;;) {
        j = (j + 1) & ix->slot_mask;
        if (!ix->slot[j])
            return;
        uint32_t h = home(ix, ix->sess[ix->slot[j] - 1].key);
        /* j's entry stays if its home lies cyclically in (i, j] */
        if (i <= j ? (i < h && h <= j) : (i < h || h <= j))
            continue;
        ix->slot[i] = ix->slot[j];
        ix->slot[j] = 0;
        i = j;
    }
}

/* --- the sessions --------------------------------------------------------------------- */

static void lru_unlink(struct six *ix, uint32_t s)
{
    struct six_session *e = &ix->sess[s];
    if (e->lru_prev != SIX_NONE)
        ix->sess[e->lru_prev].lru_next = e->lru_next;
    else
        ix->lru_first = e->lru_next;
    if (e->lru_next != SIX_NONE)
        ix->sess[e->lru_next].lru_prev = e->lru_prev;
    else
        ix->lru_last = e->lru_prev;
}

static void lru_append(struct six *ix, uint32_t s)
{
    struct six_session *e = &ix->sess[s];
    e->lru_prev = ix->lru_last;
    e->lru_next = SIX_NONE;
    if (ix->lru_last != SIX_NONE)
        ix->sess[ix->lru_last].lru_next = s;
    else
        ix->lru_first = s;
    ix->lru_last = s;
}

void six_touch(struct six *ix, uint32_t s)
{
    if (ix->lru_last != s) {
        lru_unlink(ix, s);
        lru_append(ix, s);
    }
}

uint32_t six_add(struct six *ix, const uint8_t *key)
{
    if ((uint64_t)(ix->sessions + 1) * 4 > (uint64_t)(ix->slot_mask + 1) * 3 && grow_hash(ix))
        return SIX_NONE;
    if (ix->free_sess == SIX_NONE) {
        uint32_t cap = GROWN(ix->sess_cap, SESS_MIN);
        if (cap <= ix->sess_cap || cap == SIX_NONE)       /* 2^32 sessions: none is SIX_NONE */
            return SIX_NONE;
        struct six_session *sess = realloc(ix->sess, (size_t)cap * sizeof(*sess));
        if (!sess)
            return SIX_NONE;
        for (uint32_t s = cap; s-- > ix->sess_cap;) {     /* the new slots, lowest first out */
            sess[s].lru_next = ix->free_sess;
            ix->free_sess = s;
        }
        ix->sess = sess;
        ix->sess_cap = cap;
    }
    uint32_t s = ix->free_sess;
    struct six_session *e = &ix->sess[s];
    ix->free_sess = e->lru_next;
    if (++ix->next_gen == 0)            /* 0 is no chain's */
        ix->next_gen = 1;
    *e = (struct six_session){ .gen = ix->next_gen };
    memcpy(e->key, key, SIX_KEY_LEN);
    ix->slot[probe(ix, key)] = s + 1;
    lru_append(ix, s);
    ix->sessions++;
    return s;
}

/* Every record of s's chain dead; the chain empty. */
static void kill_chain(struct six *ix, uint32_t s)
{
    struct six_session *e = &ix->sess[s];
    uint32_t low = e->first;
    for (uint32_t i = 0; i < e->nrec; i++) {
        struct six_rec *r = six_rec(ix, six_rid(ix, low));
        r->live = 0;
        ix->live_blocks -= r->nblocks;
        ix->live_records--;
        low = r->next;
    }
    e->nrec = e->raw_len = 0;
}

void six_drop(struct six *ix, uint32_t s)
{
    kill_chain(ix, s);
    unhash(ix, s);
    lru_unlink(ix, s);
    ix->sess[s].lru_next = ix->free_sess;
    ix->free_sess = s;
    ix->sessions--;
}

void six_link(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
              uint32_t raw_len, uint16_t layer_start, uint16_t layer_end)
{
    struct six_session *e = &ix->sess[s];
    struct six_rec *r = six_rec(ix, rid);
    r->live = 1;
    r->sess = s;
    if (e->nrec == 0) {
        e->first = (uint32_t)rid;
        e->token_start = token_start;
        e->layer_start = layer_start;
        e->layer_end = layer_end;
    } else {
        six_rec(ix, six_rid(ix, e->last))->next = (uint32_t)rid;
        e->layer_start = layer_start < e->layer_start ? layer_start : e->layer_start;
        e->layer_end = layer_end > e->layer_end ? layer_end : e->layer_end;
    }
    e->last = (uint32_t)rid;
    e->token_end = token_end;
    e->raw_len += raw_len;
    e->nrec++;
    ix->live_blocks += r->nblocks;
    ix->live_records++;
    six_touch(ix, s);
}

void six_rebase(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
                uint32_t raw_len, uint16_t layer_start, uint16_t layer_end)
{
    kill_chain(ix, s);
    six_link(ix, s, rid, token_start, token_end, raw_len, layer_start, layer_end);
}

void six_swap(struct six *ix, uint64_t old_rid, uint64_t new_rid)
{
    struct six_rec *old = six_rec(ix, old_rid), *new = six_rec(ix, new_rid);
    uint32_t s = old->sess;
    struct six_session *e = &ix->sess[s];
    if (e->first == (uint32_t)old_rid) {
        e->first = (uint32_t)new_rid;
    } else {                            /* old is live: one of the chain's nrec records */
        struct six_rec *p = six_rec(ix, six_rid(ix, e->first));
        for (uint32_t i = 1; i < e->nrec && p->next != (uint32_t)old_rid; i++)
            p = six_rec(ix, six_rid(ix, p->next));
        p->next = (uint32_t)new_rid;
    }
    if (e->last == (uint32_t)old_rid)
        e->last = (uint32_t)new_rid;
    new->next = old->next;
    new->sess = s;
    new->live = 1;
    old->live = 0;
    ix->live_blocks += (uint64_t)new->nblocks - old->nblocks;
}
