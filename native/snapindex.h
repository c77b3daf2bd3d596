/* snapindex.h - the snapshot store's index, packed (snapshotstore/log.py keeps it here).
 *
 * Two tables, each a flat array of fixed-size entries, so a session costs bytes and not
 * Python objects (757 bytes per one-record session as dicts, lists and small objects):
 *
 *   the log: a struct six_rec per record from the log's head to its tail, dead ones and
 *     pads too, in log order: a ring of records named by their rid (records appended
 *     before them since the index was made), popped at the head as the log reclaims;
 *   the sessions: a struct six_session per chain in the index: its key, its records
 *     (linked through six_rec.next, oldest first) and what a put must know of the chain
 *     without reading it; found by an open-addressing hash of the key, kept in LRU order.
 *
 * What else a record's header on the device says (its parent, token and layer ranges,
 * lengths, codec) is read from there when needed: relocation copies a record it reads
 * anyway, and `inspect` reads the headers. Not thread-safe: the caller locks.
 */
#ifndef SIX_H
#define SIX_H

#include <stddef.h>
#include <stdint.h>

/* CDEF BEGIN: the API the cffi binding sees (native/ffi_snapindex.py reads it verbatim) */
#define SIX_NONE 0xffffffff     /* no session */
#define SIX_KEY_LEN 32          /* snapshotstore.format.KEY_LEN */

struct six_rec {
    uint64_t lpos;              /* logical block position (it grows across the log's laps) */
    uint64_t seq;               /* sequence number (0: a pad) */
    uint32_t nblocks;
    uint32_t next;              /* the next record of its chain (a rid's low 32 bits), unless the last */
    uint32_t sess;              /* its session, while live */
    uint8_t kind;               /* snapshotstore.format.KIND_* */
    uint8_t live;               /* a record of a chain in the index */
    uint16_t reserved;
};

struct six_session {
    uint8_t key[SIX_KEY_LEN];
    uint32_t first, last;       /* the chain's records, oldest and newest (rids' low 32 bits): no
                                 * value of them means none (every one is some rid's), nrec does */
    uint32_t nrec;
    uint32_t token_start, token_end;
    uint32_t raw_len;           /* the chain's payload bytes before compression */
    uint32_t gen;               /* this chain's own number: a put checks its chain is still there */
    uint16_t layer_start, layer_end;
    uint32_t codec;             /* the caller's number for the chain's codec name */
    uint32_t lru_prev, lru_next;    /* least recently used first; a free slot's lru_next: the next free */
};

struct six {
    struct six_rec *rec;        /* the log's records: rid's slot is rid % rec_cap */
    uint64_t rec_cap, head, tail;   /* the records in the log: rids [head, tail) */
    struct six_session *sess;
    uint32_t sess_cap, sessions;
    uint32_t free_sess;         /* free session slots, linked through lru_next */
    uint32_t lru_first, lru_last;
    uint32_t *slot;             /* the hash: session + 1 (0: empty), linear probing, no tombstones */
    uint32_t slot_mask;
    uint32_t next_gen;
    uint64_t live_blocks, live_records;
};

struct six *six_new(void);      /* NULL: no memory */
void six_free(struct six *ix);
size_t six_bytes(const struct six *ix);         /* what the index has allocated */

/* the log */
int six_append(struct six *ix, uint64_t lpos, uint64_t seq, uint32_t nblocks, uint8_t kind);  /* -1: no memory */
void six_pop(struct six *ix);                   /* the head record (dead) leaves */
struct six_rec *six_rec(struct six *ix, uint64_t rid);   /* valid until the next append */
uint64_t six_rid(const struct six *ix, uint32_t low);    /* a record's whole rid from a link */

/* the sessions */
uint32_t six_find(const struct six *ix, const uint8_t *key);    /* SIX_NONE: not in the index */
uint32_t six_add(struct six *ix, const uint8_t *key);   /* a new empty chain, most recently used; SIX_NONE: no memory */
void six_drop(struct six *ix, uint32_t s);      /* the chain leaves the index, its records dead */
void six_touch(struct six *ix, uint32_t s);     /* most recently used */
/* rid, a record of the log, joins s's chain at its end (most recently used) */
void six_link(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
              uint32_t raw_len, uint16_t layer_start, uint16_t layer_end);
/* rid, a base record, becomes s's whole chain: its records before are dead */
void six_rebase(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
                uint32_t raw_len, uint16_t layer_start, uint16_t layer_end);
/* the live record old is replaced in its chain by its copy new */
void six_swap(struct six *ix, uint64_t old_rid, uint64_t new_rid);
/* CDEF END */

#endif /* SIX_H */
