/* snapindex.c - the snapshot store's packed index (snapindex.h). */
#include "snapindex.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    free(ix->codec);
    free(ix->rec);
    free(ix->sess);
    free(ix->slot);
    free(ix);
}

size_t six_bytes(const struct six *ix)
{
    return sizeof(*ix) + ix->rec_cap * sizeof(*ix->rec) + (size_t)ix->sess_cap * sizeof(*ix->sess)
           + ((size_t)ix->slot_mask + 1) * sizeof(*ix->slot) + (size_t)ix->codec_cap * SIX_CODEC_LEN;
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

uint32_t six_lookup(struct six *ix, const uint8_t *key, int touch, struct six_chain *c)
{
    uint32_t s = six_find(ix, key);
    if (s == SIX_NONE)
        return s;
    if (touch)
        six_touch(ix, s);
    const struct six_session *e = &ix->sess[s];
    *c = (struct six_chain){
        .last_seq = e->nrec ? six_rec(ix, six_rid(ix, e->last))->seq : 0,
        .sid = s, .gen = e->gen, .nrec = e->nrec,
        .token_start = e->token_start, .token_end = e->token_end, .raw_len = e->raw_len, .codec = e->codec,
        .layer_start = e->layer_start, .layer_end = e->layer_end,
    };
    return s;
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

static void link_record(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
                        uint32_t raw_len, uint16_t layer_start, uint16_t layer_end, int touch)
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
    if (touch)
        six_touch(ix, s);
}

void six_link(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
              uint32_t raw_len, uint16_t layer_start, uint16_t layer_end)
{
    link_record(ix, s, rid, token_start, token_end, raw_len, layer_start, layer_end, 1);
}

/* The chain keeps its place in LRU order: relocation's base rewrites a chain, nobody used it
 * (it moved cold sessions to the most recent end, so eviction took ones used since; found by
 * review). A put that compacts touches its chain itself. */
void six_rebase(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
                uint32_t raw_len, uint16_t layer_start, uint16_t layer_end)
{
    kill_chain(ix, s);
    link_record(ix, s, rid, token_start, token_end, raw_len, layer_start, layer_end, 0);
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

/* Codec names are few (one per encoding a worker uses): a list searched in order. */
uint32_t six_codec(struct six *ix, const uint8_t *name)
{
    for (uint32_t i = 0; i < ix->codecs; i++)
        if (!memcmp(ix->codec[i], name, SIX_CODEC_LEN))
            return i;
    if (ix->codecs == ix->codec_cap) {
        uint32_t cap = ix->codec_cap ? ix->codec_cap * 2 : 4;
        void *codec = realloc(ix->codec, (size_t)cap * SIX_CODEC_LEN);
        if (!codec)
            return SIX_NONE;
        ix->codec = codec;
        ix->codec_cap = cap;
    }
    memcpy(ix->codec[ix->codecs], name, SIX_CODEC_LEN);
    return ix->codecs++;
}

/* --- applying a record to the index ------------------------------------------------- */

/* What of a record's header applying it needs (a found record waits in this form for the
 * scan's end: the windows it was read from are gone by then). */
struct six_found {
    uint64_t seq, rid, parent;
    uint8_t key[SIX_KEY_LEN];
    uint32_t token_start, token_end, raw_len, codec;
    uint16_t layer_start, layer_end;
    uint8_t kind;
};

static void found_of(struct six_found *f, uint64_t rid, const struct six_hdr *h, uint32_t codec)
{
    *f = (struct six_found){ .seq = h->seq, .rid = rid, .parent = h->parent_seq,
                             .token_start = h->token_start, .token_end = h->token_end,
                             .raw_len = h->raw_len, .codec = codec, .layer_start = h->layer_start,
                             .layer_end = h->layer_end, .kind = h->kind };
    memcpy(f->key, h->key, SIX_KEY_LEN);
}

/* A tombstone drops its key's chain; a base replaces it (the chain staying, so a put that
 * read it before sees the same chain and tokens) or, with none, begins one; a delta with
 * no parent begins a new chain in place of any; any other delta must follow its chain's
 * last record, else the chain has a hole: recovery drops it (the store never gives back a
 * session with a turn missing), and the key's later deltas find no chain until a new start. */
static int apply(struct six *ix, const struct six_found *f)
{
    uint32_t s = six_find(ix, f->key);
    if (f->kind == SIX_KIND_BASE && s != SIX_NONE) {
        six_rebase(ix, s, f->rid, f->token_start, f->token_end, f->raw_len, f->layer_start, f->layer_end);
    } else if (f->kind == SIX_KIND_TOMBSTONE || f->parent == 0) {
        if (s != SIX_NONE)
            six_drop(ix, s);
        if (f->kind == SIX_KIND_TOMBSTONE)
            return SIX_LINKED;
        if ((s = six_add(ix, f->key)) == SIX_NONE)
            return SIX_NOMEM;
        six_link(ix, s, f->rid, f->token_start, f->token_end, f->raw_len, f->layer_start, f->layer_end);
    } else if (s == SIX_NONE) {
        return SIX_UNLINKED;      /* recovery only: its chain's start was reclaimed, or dropped */
    } else if (six_rec(ix, six_rid(ix, ix->sess[s].last))->seq != f->parent) {
        six_drop(ix, s);
        return SIX_DAMAGED;
    } else {
        six_link(ix, s, f->rid, f->token_start, f->token_end, f->raw_len, f->layer_start, f->layer_end);
    }
    ix->sess[s].codec = f->codec;
    return SIX_LINKED;
}

int six_apply_header(struct six *ix, uint64_t rid, const struct six_hdr *hdr)
{
    struct six_hdr h;               /* the caller's buffer may be unaligned */
    struct six_found f;
    memcpy(&h, hdr, sizeof(h));
    uint32_t codec = six_codec(ix, h.codec);
    if (codec == SIX_NONE)
        return SIX_NOMEM;
    found_of(&f, rid, &h, codec);
    return apply(ix, &f);
}

/* --- staging ------------------------------------------------------------------------- */

/* h (magic, crc and reserved fields set here) and its payload laid out at the buffer's end, its
 * blocks whole: a pad's zeros too (a pad whose first block alone was written, and whose header
 * was damaged later, let recovery take a torn batch's records under the rest of it for the
 * store's; found by review). */
static void lay_out(struct six_tail *t, struct six_hdr *h, const uint8_t *payload)
{
    uint8_t *at = t->wbuf + t->woff;
    size_t n = (size_t)h->nblocks * t->block_size, end = SIX_HEADER_SIZE + (size_t)h->stored_len;
    h->magic = SIX_RECORD_MAGIC;
    h->reserved0 = 0;
    h->crc = h->reserved1 = 0;
    memcpy(at, h, SIX_HEADER_SIZE);
    if (h->stored_len)              /* (a pad has no payload: no memcpy from NULL) */
        memcpy(at + SIX_HEADER_SIZE, payload, h->stored_len);
    memset(at + end, 0, n - end);
    uint32_t crc = six_crc32c(0, at, end);
    memcpy(at + offsetof(struct six_hdr, crc), &crc, sizeof(crc));
    t->woff += n;
}

/* h (its nblocks set) placed at the tail, a pad first if it would cross the lap's end; its rid.
 * Nothing is staged when the buffer is short (SIX_STAGE_ROOM). Each goes into the index before
 * the buffer, so one the index has no memory for is not laid out either: the buffer holds the
 * blocks [flushed tail, tail) whatever fails. */
static int64_t place(struct six *ix, struct six_tail *t, struct six_hdr *h, const uint8_t *payload)
{
    uint64_t L = t->log_blocks, phys = t->tail % L;
    uint64_t pad = phys + h->nblocks > L ? L - phys : 0;
    uint64_t need = t->woff + (pad + h->nblocks) * t->block_size;
    if (need > t->wcap) {
        t->need = need;
        return SIX_STAGE_ROOM;
    }
    if (pad) {
        struct six_hdr p = { .kind = SIX_KIND_PAD, .store_id = t->store_id, .lpos = t->tail,
                             .epoch = t->epoch, .nblocks = (uint32_t)pad };
        if (six_append(ix, p.lpos, 0, p.nblocks, SIX_KIND_PAD))
            return SIX_NOMEM;
        lay_out(t, &p, NULL);
        t->tail += pad;
    }
    h->lpos = t->tail;
    h->epoch = t->epoch;
    if (six_append(ix, h->lpos, h->seq, h->nblocks, h->kind))
        return SIX_NOMEM;
    lay_out(t, h, payload);
    t->tail += h->nblocks;
    return (int64_t)ix->tail - 1;
}

int64_t six_stage(struct six *ix, struct six_tail *t, uint8_t kind, uint8_t flags, const uint8_t *key,
                  const uint8_t *payload, uint32_t stored_len, uint32_t raw_len, uint32_t token_start,
                  uint32_t token_end, uint16_t layer_start, uint16_t layer_end, const uint8_t *codec, int fresh,
                  uint32_t expect)
{
    uint64_t parent = 0;
    if (kind != SIX_KIND_TOMBSTONE && !fresh) {
        uint32_t s = six_find(ix, key);
        if ((s == SIX_NONE ? 0 : ix->sess[s].gen) != expect)
            return SIX_STAGE_CHANGED;
        if (kind == SIX_KIND_DELTA && s != SIX_NONE && ix->sess[s].nrec)
            parent = six_rec(ix, six_rid(ix, ix->sess[s].last))->seq;
    }
    struct six_hdr h = {
        .kind = kind, .flags = flags, .store_id = t->store_id, .seq = t->last_seq + 1, .parent_seq = parent,
        .token_start = token_start, .token_end = token_end, .layer_start = layer_start, .layer_end = layer_end,
        .nblocks = (uint32_t)((SIX_HEADER_SIZE + (uint64_t)stored_len + t->block_size - 1) / t->block_size),
        .raw_len = raw_len, .stored_len = stored_len,
    };
    memcpy(h.key, key, SIX_KEY_LEN);
    memcpy(h.codec, codec, SIX_CODEC_LEN);
    int64_t rid = place(ix, t, &h, payload);
    if (rid < 0)
        return rid;
    t->last_seq = h.seq;
    t->parent = parent;
    int r = six_apply_header(ix, (uint64_t)rid, &h);    /* h as laid out: its position, magic, epoch */
    return r == SIX_LINKED ? rid : r == SIX_NOMEM ? SIX_NOMEM : SIX_STAGE_REFUSED;
}

int64_t six_stage_copy(struct six *ix, struct six_tail *t, const uint8_t *rec, size_t len)
{
    struct six_hdr h;
    if (len < sizeof(h))
        return SIX_STAGE_REFUSED;
    memcpy(&h, rec, sizeof(h));
    if ((uint64_t)h.nblocks * t->block_size != len || SIX_HEADER_SIZE + (uint64_t)h.stored_len > len)
        return SIX_STAGE_REFUSED;
    return place(ix, t, &h, rec + SIX_HEADER_SIZE);
}

/* --- a put in one call ----------------------------------------------------------------- */

static int write_at(int fd, const uint8_t *buf, size_t bytes, uint64_t at, int *err)
{
    ssize_t done;
    do
        done = pwrite(fd, buf, bytes, (off_t)at);
    while (done < 0 && errno == EINTR);
    if (done == (ssize_t)bytes)
        return 0;
    *err = done < 0 ? errno : 0;
    return -1;
}

/* The write buffer's blocks [t->durable, t->tail) written where they go in the log, one pwrite
 * per physically contiguous run, and the checkpoint if one is due, then one fdatasync
 * (snapshotstore/log.py _flush's, for a local device). 0, or -1 with *err: errno, 0 for a short
 * write. */
static int write_staged(const struct six_tail *t, const struct six_room *r, int *err)
{
    uint64_t L = t->log_blocks, off = 0;
    if (r->checkpoint >= 0 && write_at(r->fd, r->sbuf, t->block_size, (uint64_t)r->checkpoint * t->block_size, err))
        return -1;
    for (uint64_t lpos = t->durable; lpos < t->tail;) {
        uint64_t n = t->tail - lpos, left = L - lpos % L;
        if (n > left)
            n = left;
        size_t bytes = (size_t)n * t->block_size;
        if (write_at(r->fd, t->wbuf + off, bytes, (r->log_start + lpos % L) * t->block_size, err))
            return -1;
        lpos += n;
        off += bytes;
    }
    int rc;
    do
        rc = fdatasync(r->fd);
    while (rc && errno == EINTR);
    if (rc)
        *err = errno;
    return rc ? -1 : 0;
}

int64_t six_put(struct six *ix, struct six_tail *t, const struct six_room *r, const uint8_t *key,
                const uint8_t *payload, uint32_t len, uint32_t token_start, uint32_t token_end,
                uint16_t layer_start, uint16_t layer_end, const uint8_t *codec, int fresh, int *err)
{
    /* put's checks (log.py _put), each a decline: put's own path raises what it finds */
    uint32_t s = six_find(ix, key);
    const struct six_session *c = s == SIX_NONE || fresh ? NULL : &ix->sess[s];
    uint64_t total = (uint64_t)len + (c ? c->raw_len + 4 * ((uint64_t)c->nrec + 2) : 8);
    if (token_start != (c ? c->token_end : 0) || total > r->max_payload || t->woff || t->durable != t->tail)
        return SIX_PUT_DECLINED;
    if (c && (c->nrec >= r->compact_after || memcmp(ix->codec[c->codec], codec, SIX_CODEC_LEN)))
        return SIX_PUT_DECLINED;
    /* room (_fits, with _floor's floor) and the superblocks (_flush), as the tail would move */
    uint64_t L = t->log_blocks, phys = t->tail % L;
    uint64_t nblocks = (SIX_HEADER_SIZE + (uint64_t)len + t->block_size - 1) / t->block_size;
    uint64_t pad = phys + nblocks > L ? L - phys : 0, end = t->tail + pad + nblocks;
    if (end - r->head > L || L - (end - r->head) < r->floor || end > r->sb_head + L)
        return SIX_PUT_DECLINED;
    int64_t rid = six_stage(ix, t, SIX_KIND_DELTA, 0, key, payload, len, len, token_start, token_end, layer_start,
                            layer_end, codec, fresh, s == SIX_NONE ? 0 : ix->sess[s].gen);
    if (rid == SIX_STAGE_ROOM)
        return SIX_PUT_DECLINED;
    if (rid < 0)                    /* (not SIX_STAGE_CHANGED: the chain was looked up under the same lock) */
        return rid;
    if (write_staged(t, r, err))
        return SIX_PUT_IO;
    t->woff = 0;
    t->durable = t->tail;
    return rid;
}

/* --- CRC32C -------------------------------------------------------------------------- */

static uint32_t crc_table[256];

static void crc_table_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82f63b78 : c >> 1;      /* Castagnoli, reflected */
        crc_table[i] = c;
    }
}

uint32_t six_crc32c_soft(uint32_t crc, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    if (!crc_table[1])
        crc_table_init();           /* idempotent: a race writes the same values */
    crc = ~crc;
    while (n--)
        crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2")))
static uint32_t crc32c_sse42(uint32_t crc, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    uint64_t c = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
    }
    uint32_t c32 = (uint32_t)c;
    while (n--)
        c32 = __builtin_ia32_crc32qi(c32, *p++);
    return ~c32;
}
#endif

uint32_t six_crc32c(uint32_t crc, const void *buf, size_t n)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2"))
        return crc32c_sse42(crc, buf, n);
#endif
    return six_crc32c_soft(crc, buf, n);
}

/* The record's CRC: its header with the crc field zero, then its stored payload. */
/* The record at rec, its header as h says (h is rec's own, or rec's with the fields that name its
 * store and place put right: six_scan), checked against its CRC. */
static int crc_ok(const uint8_t *rec, const struct six_hdr *h)
{
    static const uint8_t zero[4];
    size_t at = offsetof(struct six_hdr, crc);
    uint32_t c = six_crc32c(0, (const uint8_t *)h, at);
    c = six_crc32c(c, zero, sizeof(zero));
    c = six_crc32c(c, rec + at + 4, SIX_HEADER_SIZE - at - 4 + (size_t)h->stored_len);
    return c == h->crc;
}

/* --- restore's read ------------------------------------------------------------------- */

int64_t six_read_chain(struct six *ix, uint32_t s, int fd, uint64_t log_start, uint64_t log_blocks,
                       uint32_t block_size, uint8_t *buf, uint64_t cap, struct six_part *parts,
                       uint32_t max_parts, uint64_t *at, int *err)
{
    const struct six_session *e = &ix->sess[s];
    uint64_t need = 0;
    uint32_t low = e->first;
    for (uint32_t i = 0; i < e->nrec; i++) {
        const struct six_rec *r = six_rec(ix, six_rid(ix, low));
        need += (uint64_t)r->nblocks * block_size;
        low = r->next;
    }
    if (need > cap || e->nrec > max_parts) {
        *at = need > cap ? need : e->nrec;
        return SIX_READ_ROOM;
    }
    uint64_t off = 0;
    low = e->first;
    for (uint32_t i = 0; i < e->nrec; i++) {
        const struct six_rec *r = six_rec(ix, six_rid(ix, low));
        size_t n = (size_t)r->nblocks * block_size;
        *at = i;
        ssize_t got = pread(fd, buf + off, n, (off_t)((log_start + r->lpos % log_blocks) * block_size));
        if (got != (ssize_t)n) {
            *err = got < 0 ? errno : 0;
            return SIX_READ_IO;
        }
        const struct six_hdr *h = (const struct six_hdr *)(buf + off);
        if (h->magic != SIX_RECORD_MAGIC || h->lpos != r->lpos || h->seq != r->seq
            || memcmp(h->key, e->key, SIX_KEY_LEN) || h->stored_len > n - SIX_HEADER_SIZE || !crc_ok(buf + off, h))
            return SIX_READ_DAMAGED;
        parts[i] = (struct six_part){ off + SIX_HEADER_SIZE, h->stored_len, h->flags, r->kind, 0 };
        off += n;
        low = r->next;
    }
    return e->nrec;
}

int64_t six_restore(struct six *ix, const uint8_t *key, struct six_chain *c, int fd, uint64_t log_start,
                    uint64_t log_blocks, uint32_t block_size, uint8_t *buf, uint64_t cap, struct six_part *parts,
                    uint32_t max_parts, uint64_t *at, int *err)
{
    if (six_lookup(ix, key, 1, c) == SIX_NONE)
        return SIX_READ_NONE;
    return six_read_chain(ix, c->sid, fd, log_start, log_blocks, block_size, buf, cap, parts, max_parts, at, err);
}

/* --- recovery's scan ------------------------------------------------------------------- */

_Static_assert(sizeof(struct six_hdr) == SIX_HEADER_SIZE, "the record header is 128 bytes");

/* The checks of snapshotstore/log.py's docstring (Recovery): this store's, at its own position,
 * an epoch no older than the record before it (from the checkpoint on, than the checkpoint's
 * writer: a resync past a damaged record has no record before it to compare) and no newer than
 * the superblock, within the lap and the log, its size what its payload takes (a pad: to the
 * lap's end, no payload). */
static int valid(const struct six_scan *sc, const struct six_hdr *h)
{
    uint64_t L = sc->log_blocks, phys = sc->pos % L;
    uint64_t floor = sc->pos >= sc->tail && sc->tail_epoch > sc->last_epoch ? sc->tail_epoch : sc->last_epoch;
    if (!(floor <= h->epoch && h->epoch <= sc->generation && h->nblocks >= 1
          && h->nblocks <= L - phys && sc->pos + h->nblocks - sc->head <= L))
        return 0;
    if (h->kind == SIX_KIND_PAD)
        return h->stored_len == 0 && phys + h->nblocks == L;
    uint64_t blocks = ((uint64_t)SIX_HEADER_SIZE + h->stored_len + sc->block_size - 1) / sc->block_size;
    return (h->kind == SIX_KIND_DELTA || h->kind == SIX_KIND_BASE || h->kind == SIX_KIND_TOMBSTONE)
           && h->nblocks == blocks;
}

static int found_push(struct six_scan *sc, const struct six_found *f)
{
    if (sc->nfound == sc->found_cap) {
        uint64_t cap = sc->found_cap ? sc->found_cap * 2 : 1024;
        struct six_found *found = realloc(sc->found, cap * sizeof(*found));
        if (!found)
            return -1;
        sc->found = found;
        sc->found_cap = cap;
    }
    if (sc->nfound && (f->seq < sc->found[sc->nfound - 1].seq))
        sc->unsorted = 1;           /* rids only grow: a lower seq is the only disorder */
    sc->found[sc->nfound++] = *f;
    return 0;
}

/* A header-only record (a tombstone, an empty delta) whose CRC fails by one flipped bit of its
 * header: the header with that bit put back, into *fixed (1). Its key damaged, a tombstone named
 * no session, and the one it deleted came back (found by review); the bit is found by trying
 * each (1,024 CRCs of 128 bytes, on damage only). A record with a payload is left to the
 * fields above: its CRC runs over the whole of it. */
static int one_bit_off(const struct six_scan *sc, const struct six_hdr *h, struct six_hdr *fixed)
{
    for (size_t bit = 0; bit < SIX_HEADER_SIZE * 8; bit++) {
        *fixed = *h;
        ((uint8_t *)fixed)[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        if (fixed->stored_len || fixed->magic != SIX_RECORD_MAGIC || fixed->store_id != sc->store_id
            || fixed->lpos != sc->pos || !valid(sc, fixed))
            continue;
        struct six_hdr z = *fixed;
        z.crc = 0;
        if (six_crc32c(0, &z, SIX_HEADER_SIZE) == fixed->crc)   /* (the bit in the CRC itself too) */
            return 1;
    }
    return 0;
}

int six_scan(struct six *ix, struct six_scan *sc, const uint8_t *win, uint64_t win_pos, uint32_t win_blocks)
{
    uint64_t bs = sc->block_size, end = win_pos + win_blocks;
    while (sc->pos - sc->head < sc->log_blocks) {
        if (!(win_pos <= sc->pos && sc->pos < end)) {
            sc->need = 1;
            return SIX_SCAN_MORE;
        }
        const uint8_t *rec = win + (sc->pos - win_pos) * bs;
        struct six_hdr h;
        memcpy(&h, rec, sizeof(h));
        int ok = h.magic == SIX_RECORD_MAGIC && h.store_id == sc->store_id && h.lpos == sc->pos;
        if (!ok) {
            /* The fields that name this store and place damaged alone (a flipped bit): its CRC,
             * which covers them, matches with the expected values put back, so its key and
             * number are its own: named, a hole (log.py), whose chain is dropped. Left unnamed, a
             * tombstone so damaged brought its deleted session back for good, and a chain's last
             * delta went missing, the chain served one turn short, with no error (found by
             * review). A stale record (of an earlier lap, of another store) was written with its
             * own values there and does not match. (Not taken whole: every read of it checks
             * those fields again.) */
            struct six_hdr as = h;
            as.magic = SIX_RECORD_MAGIC;
            as.store_id = sc->store_id;
            as.lpos = sc->pos;
            if (valid(sc, &as)) {
                if (sc->pos + as.nblocks > end) {
                    sc->need = as.nblocks;
                    return SIX_SCAN_MORE;
                }
                if (crc_ok(rec, &as)) {
                    sc->named = 1;
                    memcpy(sc->bad_key, h.key, SIX_KEY_LEN);
                    sc->bad_seq = h.seq;
                    return SIX_SCAN_BAD;
                }
            }
        }
        sc->named = (uint8_t)ok;
        ok = ok && valid(sc, &h);
        if (ok && sc->pos + h.nblocks > end) {
            sc->need = h.nblocks;
            return SIX_SCAN_MORE;
        }
        /* a pad is written whole, zeros after its header (its CRC covers the header alone): one
         * whose write tore after the header, taken whole, left what a torn batch had put under it
         * to pass below the checkpoint, where a resync past the pad's damaged header took it for
         * the store's (found by review). So past the checkpoint of a version 2 superblock, whose
         * writer zero-fills its pads, one must be zeros: else it is the torn end. (Not below it,
         * nor in a version 1 store: written by code before session 29's, whose pads kept what
         * the blocks held, a whole one read as torn cut off the acknowledged records after it.) */
        for (uint64_t i = SIX_HEADER_SIZE; ok && h.kind == SIX_KIND_PAD && sc->pos >= sc->tail && sc->tail_epoch
                                           && i < h.nblocks * bs; i++)
            ok = rec[i] == 0;
        if (!ok || !crc_ok(rec, &h)) {
            struct six_hdr one;
            if (h.kind != SIX_KIND_PAD && one_bit_off(sc, &h, &one)) {
                h = one;                 /* its key and number are its own: a hole (see above) */
                sc->named = 1;
            }
            memcpy(sc->bad_key, h.key, SIX_KEY_LEN);
            sc->bad_seq = h.seq;
            return SIX_SCAN_BAD;
        }
        sc->last_epoch = h.epoch;
        sc->newest = h.seq > sc->newest ? h.seq : sc->newest;
        uint64_t rid = ix->tail;
        if (six_append(ix, h.lpos, h.seq, h.nblocks, h.kind))
            return SIX_NOMEM;
        if (h.kind != SIX_KIND_PAD) {
            struct six_found f;
            uint32_t codec = six_codec(ix, h.codec);
            if (codec == SIX_NONE)
                return SIX_NOMEM;
            found_of(&f, rid, &h, codec);
            if (found_push(sc, &f))
                return SIX_NOMEM;
        }
        sc->pos += h.nblocks;
    }
    return SIX_SCAN_END;
}

static int by_seq_then_rid(const void *a, const void *b)
{
    const struct six_found *x = a, *y = b;
    if (x->seq != y->seq)
        return x->seq < y->seq ? -1 : 1;
    return x->rid < y->rid ? -1 : x->rid > y->rid;
}

int six_scan_link(struct six *ix, struct six_scan *sc)
{
    if (sc->unsorted)
        qsort(sc->found, sc->nfound, sizeof(*sc->found), by_seq_then_rid);
    const struct six_found *first = NULL;   /* the record linked under this seq, or its copy since */
    uint64_t first_rid = 0;
    for (uint64_t i = 0; i < sc->nfound; i++) {
        struct six_found *f = &sc->found[i];
        if (first && first->seq == f->seq) {
            /* a copy (reclaim's) of a record linked: the later one stays */
            if (six_rec(ix, first_rid)->live && !memcmp(first->key, f->key, SIX_KEY_LEN)) {
                six_swap(ix, first_rid, f->rid);
                first_rid = f->rid;
            }
            continue;
        }
        first = f;
        first_rid = f->rid;
        int r = apply(ix, f);
        if (r == SIX_NOMEM)
            return SIX_NOMEM;
        sc->unlinked += r != SIX_LINKED;
        sc->damaged += r == SIX_DAMAGED;
        if (r == SIX_DAMAGED)
            f->kind = SIX_KIND_DROPPED;   /* six_scan_dropped: the store writes its key's tombstone */
    }
    return 0;
}

/* Did a tombstone of f's key come after f (in the sorted order six_scan_link applied)? */
static int buried_after(const struct six_scan *sc, uint64_t i)
{
    for (uint64_t j = i + 1; j < sc->nfound; j++)
        if (sc->found[j].kind == SIX_KIND_TOMBSTONE && !memcmp(sc->found[j].key, sc->found[i].key, SIX_KEY_LEN))
            return 1;
    return 0;
}

int six_scan_dropped(const struct six_scan *sc, uint64_t *i, uint8_t *key)
{
    for (; *i < sc->nfound; (*i)++)
        if (sc->found[*i].kind == SIX_KIND_DROPPED && !buried_after(sc, *i)) {
            memcpy(key, sc->found[(*i)++].key, SIX_KEY_LEN);
            return 1;
        }
    return 0;
}

int six_scan_has(const struct six_scan *sc, uint64_t seq, const uint8_t *key)
{
    uint64_t lo = 0, hi = sc->nfound;        /* the first found with seq >= the one asked */
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (sc->found[mid].seq < seq)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < sc->nfound && sc->found[lo].seq == seq && !memcmp(sc->found[lo].key, key, SIX_KEY_LEN);
}

void six_scan_done(struct six_scan *sc)
{
    free(sc->found);
    sc->found = NULL;
    sc->nfound = sc->found_cap = 0;
}
