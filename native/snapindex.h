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
 *
 * Recovery's scan runs here too (six_scan): header checks, CRC32C and the index's
 * appends per record in C, the rare bad record handed back to the caller. The rule by
 * which a record joins its chain (six_apply_header) is the one the scan's records and a
 * put's record both go through.
 */
#ifndef SIX_H
#define SIX_H

#include <stddef.h>
#include <stdint.h>

/* CDEF BEGIN: the API the cffi binding sees (native/ffi_snapindex.py reads it verbatim) */
#define SIX_NONE 0xffffffff     /* no session */
#define SIX_KEY_LEN 32          /* snapshotstore.format.KEY_LEN */
#define SIX_CODEC_LEN 16        /* snapshotstore.format.CODEC_LEN */

/* A record's header on the device: snapshotstore.format.RECORD, which defines the format
 * (tests/test_snapshot_format.py pins the two together). Little-endian, as the host. */
#define SIX_HEADER_SIZE 128
#define SIX_RECORD_MAGIC 0x31524c5a     /* "ZLR1" */
#define SIX_KIND_DELTA 1
#define SIX_KIND_BASE 2
#define SIX_KIND_TOMBSTONE 3
#define SIX_KIND_PAD 4
#define SIX_KIND_DROPPED 0xFF   /* (a found record's, after six_scan_link: its chain was dropped as damaged) */

struct six_hdr {
    uint32_t magic;
    uint8_t kind, flags;
    uint16_t reserved0;
    uint64_t store_id, lpos, epoch, seq, parent_seq;
    uint8_t key[SIX_KEY_LEN];
    uint32_t token_start, token_end;
    uint16_t layer_start, layer_end;
    uint32_t nblocks, raw_len, stored_len;
    uint8_t codec[SIX_CODEC_LEN];
    uint32_t crc, reserved1;
};

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
    uint32_t codec;             /* the chain's codec: its name's number in six.codec */
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
    uint8_t (*codec)[SIX_CODEC_LEN];    /* the codec names met, each once (a session holds its number) */
    uint32_t codecs, codec_cap;
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
/* What a put or a restore must know of a chain without reading it (snapshotstore/index.py's Chain),
 * gathered in one call: field by field through cffi costs ~35 ns a field, more in a restore's
 * cold path. */
struct six_chain {
    uint64_t last_seq;          /* its last record's sequence number (0: no record) */
    uint32_t sid, gen, nrec;
    uint32_t token_start, token_end, raw_len, codec;
    uint16_t layer_start, layer_end;
};
/* key's chain into *c, made the most recently used if touch; SIX_NONE: not in the index */
uint32_t six_lookup(struct six *ix, const uint8_t *key, int touch, struct six_chain *c);
uint32_t six_add(struct six *ix, const uint8_t *key);   /* a new empty chain, most recently used; SIX_NONE: no memory */
void six_drop(struct six *ix, uint32_t s);      /* the chain leaves the index, its records dead */
void six_touch(struct six *ix, uint32_t s);     /* most recently used */
/* rid, a record of the log, joins s's chain at its end (most recently used) */
void six_link(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
              uint32_t raw_len, uint16_t layer_start, uint16_t layer_end);
/* rid, a base record, becomes s's whole chain: its records before are dead; its LRU place kept */
void six_rebase(struct six *ix, uint32_t s, uint64_t rid, uint32_t token_start, uint32_t token_end,
                uint32_t raw_len, uint16_t layer_start, uint16_t layer_end);
/* the live record old is replaced in its chain by its copy new */
void six_swap(struct six *ix, uint64_t old_rid, uint64_t new_rid);
/* a codec name's number (its 16 bytes as on the device); SIX_NONE: no memory */
uint32_t six_codec(struct six *ix, const uint8_t *name);

/* What applying a record to the index did (six_apply_header, six_scan_link). */
#define SIX_LINKED 0            /* joined its chain, began one, rebased it or (a tombstone) dropped it */
#define SIX_UNLINKED 1          /* a delta whose chain is not in the index: skipped */
#define SIX_DAMAGED 2           /* a delta whose parent is not its chain's end: the chain dropped, skipped */
#define SIX_NOMEM -1
/* The record rid, whose header is hdr, applied to the index: the one rule a staged record
 * and a recovered one follow. */
int six_apply_header(struct six *ix, uint64_t rid, const struct six_hdr *hdr);

/* Restore's read of session s's chain from the device's fd (snapshotstore/log.py _read_chain):
 * its records, oldest first, each read whole with one pread into buf at its own block-aligned
 * offset (so buf and the offsets suit O_DIRECT), and checked as the index expects it (magic,
 * position, sequence number, the session's key, the payload within the record, the CRC).
 * parts[i] says where record i's stored payload lies in buf. Returns the record count; or
 * SIX_READ_ROOM: buf holds fewer than *at bytes, or parts fewer than *at records;
 * SIX_READ_IO: the read of record *at failed (*err: its errno, 0 if short);
 * SIX_READ_DAMAGED: record *at is not the record the index expects there.
 * The caller holds the index's lock (this runs without the GIL). */
struct six_part {
    uint64_t off;               /* in buf */
    uint32_t len;               /* stored bytes (compressed if flags say so) */
    uint8_t flags, kind;        /* the header's flags; the index's kind (delta or base) */
    uint16_t reserved;
};
#define SIX_READ_ROOM -2
#define SIX_READ_IO -3
#define SIX_READ_DAMAGED -4
int64_t six_read_chain(struct six *ix, uint32_t s, int fd, uint64_t log_start, uint64_t log_blocks,
                       uint32_t block_size, uint8_t *buf, uint64_t cap, struct six_part *parts,
                       uint32_t max_parts, uint64_t *at, int *err);
/* A restore's index work in one call: key's chain into *c (six_lookup) and made the most recently
 * used, then read as six_read_chain reads it; SIX_READ_NONE: key has no chain. (Each call from
 * Python costs a restore, whose code runs cold after the read before it, ~0.5 us.) */
#define SIX_READ_NONE -5
int64_t six_restore(struct six *ix, const uint8_t *key, struct six_chain *c, int fd, uint64_t log_start,
                    uint64_t log_blocks, uint32_t block_size, uint8_t *buf, uint64_t cap, struct six_part *parts,
                    uint32_t max_parts, uint64_t *at, int *err);

/* A put's staging (snapshotstore/log.py _stage, _copy): records laid out at the log's tail in
 * the write buffer, header, payload, zeros to the block's end and CRC, and appended to the index,
 * in one call (in Python a staged record cost ~10 us, a tenth of a put). The tail's state is the
 * caller's struct: the store moves it here and reads it (its flush writes what is staged). */
struct six_tail {
    uint64_t store_id, epoch;   /* the store's, and this open's: every record carries them */
    uint64_t log_blocks;
    uint32_t block_size;
    uint64_t tail;              /* lpos where the next record goes */
    uint64_t durable;           /* lpos: the last flush's tail (records before it are on the device) */
    uint64_t last_seq;          /* the last sequence number handed out */
    uint8_t *wbuf;              /* the write buffer: the blocks [durable, tail) */
    uint64_t wcap, woff;        /* its size, and the bytes staged in it */
    uint64_t need;              /* after SIX_STAGE_ROOM: the bytes it must hold */
    uint64_t parent;            /* the last record six_stage staged: its parent (0: it begins its chain) */
};
#define SIX_STAGE_ROOM -2       /* nothing staged: the write buffer must hold t->need bytes */
#define SIX_STAGE_REFUSED -3    /* six_stage: staged, but the index did not link it (a bug);
                                 * six_stage_copy: nothing staged, the record's sizes are not what was read */
#define SIX_STAGE_CHANGED -4    /* nothing staged: key's chain is not the one the put saw */
/* key's record staged: unless it is a tombstone or begins its chain afresh, only if key's chain
 * is still numbered expect (0: none; an eviction or a delete since changes it); the next sequence
 * number, its parent (its chain's end, for a delta), its header, payload, zeros and CRC at the
 * tail (after a pad to the lap's end if it would not fit before it: records never wrap),
 * appended to the index and applied to its chain (six_apply_header: most recently used). Its
 * rid; SIX_STAGE_CHANGED, SIX_STAGE_ROOM, SIX_NOMEM (the record not staged, a pad before it
 * perhaps: the caller stops using the store) or SIX_STAGE_REFUSED.
 * codec: CODEC_LEN bytes, NUL-padded. */
int64_t six_stage(struct six *ix, struct six_tail *t, uint8_t kind, uint8_t flags, const uint8_t *key,
                  const uint8_t *payload, uint32_t stored_len, uint32_t raw_len, uint32_t token_start,
                  uint32_t token_end, uint16_t layer_start, uint16_t layer_end, const uint8_t *codec, int fresh,
                  uint32_t expect);
/* A copy of the record rec (its len bytes, its blocks as read and checked) staged at the tail as
 * it is but for its position and epoch (key, sequence number, parent kept) and appended to the
 * index, not applied (six_swap puts it in its original's place). Its rid; SIX_STAGE_ROOM,
 * SIX_NOMEM, or SIX_STAGE_REFUSED: its header's blocks are not those read, or its payload
 * runs past them. */
int64_t six_stage_copy(struct six *ix, struct six_tail *t, const uint8_t *rec, size_t len);

/* A put whole in one call when nothing stands in its way (snapshotstore/log.py _put_at_once):
 * in Python a put cost ~16 us over its I/O, run cold after it, against a goal of 1.2x a raw write
 * + fdatasync (~80-140 us). Python's put stays the rule and takes every case this declines. What
 * the store's put must respect is the caller's struct, kept up to date by it: */
struct six_room {
    int fd;                     /* the device (O_DIRECT) */
    uint64_t log_start;         /* the log's first block on it */
    uint64_t head;              /* lpos: the log's head, which the tail may not lap */
    uint64_t sb_head;           /* the head the superblocks record: a tail a lap past it needs new ones first */
    uint64_t floor;             /* blocks a put leaves free: the reserve, and room to relocate */
    uint64_t max_payload;       /* the bytes one record holds */
    uint32_t compact_after;     /* a chain of as many records is compacted by its next put */
    const uint8_t *sbuf;        /* a block: the superblock copy the caller laid out there ... */
    int64_t checkpoint;         /* ... written with the record, at this block (-1: none is due) */
};
#define SIX_PUT_DECLINED -6     /* nothing done: the put takes Python's path */
#define SIX_PUT_IO -7           /* staged, not durable: the write or the sync failed (*err: errno, 0: short) */
/* key's delta (payload, len bytes, stored as it is) checked against its chain as put checks it,
 * staged as six_stage stages it, written (a pad before it too, one pwrite per run: the lap's end
 * splits them; and r->checkpoint's superblock copy) and made durable (fdatasync; t->durable moves
 * with it). The caller holds the store's lock, with nothing staged unflushed and no other put
 * committing. Its rid; SIX_PUT_DECLINED, nothing changed, when put's own path must decide: the
 * delta does not start where its chain ends or has another codec, the chain is due to be
 * compacted, the record is too large or has no room above the floor, the superblocks must move
 * first, or the write buffer is too small; SIX_NOMEM or SIX_STAGE_REFUSED as six_stage's;
 * SIX_PUT_IO. Either of those three: the caller stops using the store. fresh: the delta replaces
 * key's chain (from token 0). */
int64_t six_put(struct six *ix, struct six_tail *t, const struct six_room *r, const uint8_t *key,
                const uint8_t *payload, uint32_t len, uint32_t token_start, uint32_t token_end,
                uint16_t layer_start, uint16_t layer_end, const uint8_t *codec, int fresh, int *err);

/* CRC32C (Castagnoli) of n bytes continuing from crc (0 to start), as the crc32c package */
uint32_t six_crc32c(uint32_t crc, const void *buf, size_t n);
uint32_t six_crc32c_soft(uint32_t crc, const void *buf, size_t n);    /* without SSE 4.2 */

/* Recovery's scan of the log from the superblock's head (snapshotstore/log.py _recover). */
struct six_found;               /* a record the scan found, until six_scan_link applied it */
struct six_scan {
    /* the caller's: the store, and the log from the superblock (tail: its checkpoint, which
     * tail_epoch's open wrote, so every record from tail on carries that epoch or a newer one) */
    uint64_t store_id, generation, log_blocks, head, tail, tail_epoch;
    uint32_t block_size;
    /* where the scan is: the record at pos comes next */
    uint64_t pos, last_epoch;
    uint64_t newest;            /* the highest sequence number found */
    uint32_t need;              /* SIX_SCAN_MORE: the blocks at pos the next window must hold */
    uint8_t named;              /* SIX_SCAN_BAD: the record at pos names this store and position */
    uint8_t bad_key[SIX_KEY_LEN];   /* and then its key and sequence number */
    uint64_t bad_seq;
    /* the records found (not pads), applied by six_scan_link */
    struct six_found *found;
    uint64_t nfound, found_cap;
    uint8_t unsorted;
    uint64_t unlinked, damaged;     /* six_scan_link's SIX_UNLINKED and SIX_DAMAGED records */
};
#define SIX_SCAN_END 0          /* pos is a lap past head: the whole log was scanned */
#define SIX_SCAN_MORE 1         /* the window ends before what pos needs: read `need` blocks at pos */
#define SIX_SCAN_BAD 2          /* the record at pos is not a valid one */
/* Scan the window (blocks [win_pos, win_pos + win_blocks) of the log, never across the lap's
 * end) from sc->pos: each valid record appended to the index; SIX_NOMEM: no memory. */
int six_scan(struct six *ix, struct six_scan *sc, const uint8_t *win, uint64_t win_pos, uint32_t win_blocks);
/* Apply the records found, in sequence-number order (the order they were first written; a
 * copy keeps its number): a later copy of a linked record takes its place. SIX_NOMEM or 0. */
int six_scan_link(struct six *ix, struct six_scan *sc);
/* The key of the next record from *i on whose chain six_scan_link dropped as damaged (a delta not
 * following its chain's end) and no later tombstone buried, into key; 1, with *i past it, or 0:
 * none left. (A search per dropped record: damage is rare.) */
int six_scan_dropped(const struct six_scan *sc, uint64_t *i, uint8_t *key);
/* Was the record linked under seq (its first copy) key's? After six_scan_link. */
int six_scan_has(const struct six_scan *sc, uint64_t seq, const uint8_t *key);
void six_scan_done(struct six_scan *sc);        /* frees what the scan found */
/* CDEF END */

#endif /* SIX_H */
