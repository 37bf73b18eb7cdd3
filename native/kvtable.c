/* The block table of one cache group of xllm_vmm.kvcache.BlockAllocator: its allocation and
 * free passes in C, one call per allocation and one per free of a request's blocks.
 *
 * The state is not owned here: every array is allocated by the Python allocator (array /
 * bytearray objects it keeps for the group's lifetime) and this library only reads and writes
 * them through the pointers in `kvt` (a ctypes Structure, also Python-owned). Python reads the
 * same memory directly for everything that is not hot (introspection, compaction planning,
 * invariant checks), so there is one copy of the block state. Nothing here allocates memory,
 * so no error path has anything to release.
 *
 * The semantics are those of the pure-Python passes in kvcache/allocator.py, exactly (the same
 * block ids in the same order, the same slot choice, the same bucket order):
 *   - slot s holds blocks [s*bps, (s+1)*bps); slen[s] = its free blocks, -1 while inactive;
 *   - slot s's free stack is stk[s*bps .. s*bps + slen[s]) (top = last);
 *   - bucket k (1 <= k < bps) is an insertion-ordered list of the active slots with exactly k
 *     free blocks: a doubly linked list bhead[k] .. btail[k] through bnext / bprev (-1 = none);
 *   - heap[0 .. ctr[HEAPN]) is a binary min-heap of the inactive slots;
 *   - ctr[FA] free blocks in active slots, ctr[NC] cached blocks, ctr[NA] active slots.
 * Portable C11, no intrinsics. */

#include <stdint.h>

enum { FA = 0, NC = 1, NA = 2, HEAPN = 3, NREL = 4, NPIN = 5, ERRKIND = 6 };

typedef struct {
    int32_t nslots, bps, nblocks, in_cap;
    int32_t *ref;
    uint8_t *cached, *keep, *pinned;
    int32_t *stk, *slen, *bnext, *bprev, *bhead, *btail, *heap;
    int64_t *ctr;
    int32_t *out;   /* blocks handed out / kept (nblocks) */
    int32_t *out2;  /* slots released (nslots) */
    int32_t *out3;  /* pinned blocks of an LRU free (nblocks) */
    int64_t *in;    /* the blocks of a free (in_cap) */
    int32_t *runs;  /* scratch: (slot, free before, free after) per run (3 * in_cap) */
} kvt;

/* -- buckets -------------------------------------------------------------------------------- */
static void bucket_remove(kvt *t, int32_t k, int32_t s) {
    int32_t p = t->bprev[s], n = t->bnext[s];
    if (p >= 0) t->bnext[p] = n; else t->bhead[k] = n;
    if (n >= 0) t->bprev[n] = p; else t->btail[k] = p;
    t->bnext[s] = t->bprev[s] = -1;
}

static void bucket_append(kvt *t, int32_t k, int32_t s) {
    int32_t tail = t->btail[k];
    t->bprev[s] = tail;
    t->bnext[s] = -1;
    if (tail >= 0) t->bnext[tail] = s; else t->bhead[k] = s;
    t->btail[k] = s;
}

/* -- the inactive heap (lowest slot first) ---------------------------------------------------- */
static void heap_push(kvt *t, int32_t s) {
    int32_t *h = t->heap;
    int64_t i = t->ctr[HEAPN]++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (h[p] <= s) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = s;
}

static int32_t heap_pop(kvt *t) {
    int32_t *h = t->heap;
    int32_t top = h[0];
    int64_t n = --t->ctr[HEAPN];
    if (n > 0) {
        int32_t last = h[n];
        int64_t i = 0;
        for (;;) {
            int64_t c = 2 * i + 1;
            if (c >= n) break;
            if (c + 1 < n && h[c + 1] < h[c]) c++;
            if (h[c] >= last) break;
            h[i] = h[c];
            i = c;
        }
        h[i] = last;
    }
    return top;
}

int32_t kvt_pop_inactive(kvt *t, int32_t k) {
    /* k lowest inactive slots into out2, lowest first; -1 (nothing changed) when fewer. */
    if (k < 0 || k > t->ctr[HEAPN]) return -1;
    for (int32_t i = 0; i < k; i++) t->out2[i] = heap_pop(t);
    return k;
}

void kvt_push_inactive(kvt *t, int32_t k) {
    /* gives back out2[0 .. k) (slots popped but not activated) */
    for (int32_t i = 0; i < k; i++) heap_push(t, t->out2[i]);
}

/* -- taking blocks ------------------------------------------------------------------------------ */
static int32_t take_from(kvt *t, int32_t slot, int32_t k, int32_t take, int32_t *out) {
    /* take `take` (<= k = slen[slot]) blocks from the top of slot's stack, top first */
    int32_t *stk = t->stk + (int64_t)slot * t->bps;
    for (int32_t i = 0; i < take; i++) {
        int32_t b = stk[k - 1 - i];
        t->ref[b] = 1;
        out[i] = b;
    }
    t->slen[slot] = k - take;
    bucket_remove(t, k, slot);
    if (k - take) bucket_append(t, k - take, slot);
    return take;
}

static int32_t take_partial(kvt *t, int32_t n, int32_t *out) {
    /* up to n blocks from active slots, fullest first; returns how many were taken */
    int32_t got = 0;
    for (int32_t k = 1; k < t->bps && got < n; k++) {
        while (t->bhead[k] >= 0 && got < n) {
            int32_t slot = t->bhead[k];
            int32_t take = n - got < k ? n - got : k;
            got += take_from(t, slot, k, take, out + got);
        }
    }
    t->ctr[FA] -= got;
    return got;
}

static int32_t take_new_slot(kvt *t, int32_t slot, int32_t n, int32_t *out) {
    int32_t bps = t->bps, base = slot * bps;
    int32_t take = n < bps ? n : bps, left = bps - take;
    for (int32_t i = 0; i < take; i++) {
        t->ref[base + i] = 1;
        out[i] = base + i;
    }
    int32_t *stk = t->stk + base;
    for (int32_t i = 0; i < left; i++) stk[i] = base + bps - 1 - i;  /* top = lowest free */
    t->slen[slot] = left;
    t->ctr[NA] += 1;
    t->ctr[FA] += left;
    if (left) bucket_append(t, left, slot);
    return take;
}

int32_t kvt_take(kvt *t, int32_t n, int32_t hint, int32_t nnew) {
    /* n blocks (ref 1 each) into out: the hint's slot, partial slots fullest first, then the
     * nnew slots in out2 (just activated). The caller checked that they suffice. */
    int32_t got = 0;
    if (n <= 0) return 0;
    if (hint >= 0 && hint < t->nblocks) {
        int32_t slot = hint / t->bps, k = t->slen[slot];
        if (k > 0) {
            int32_t take = n < k ? n : k;
            got = take_from(t, slot, k, take, t->out);
            t->ctr[FA] -= take;
        }
    }
    if (got < n && t->ctr[FA] > 0) got += take_partial(t, n - got, t->out + got);
    for (int32_t i = 0; i < nnew && got < n; i++)
        got += take_new_slot(t, t->out2[i], n - got, t->out + got);
    return got;
}

int32_t kvt_alloc1(kvt *t, int32_t hint) {
    /* decode growth: one block from an active slot (the hint's slot, else the roomiest partial
     * slot; without a hint the fullest), or -1 when no active slot has a free block. */
    if (t->ctr[FA] <= 0) return -1;
    int32_t bps = t->bps, slot = -1, k = 0;
    int roomiest = 0;
    if (hint >= 0 && hint < t->nblocks) {
        slot = hint / bps;
        k = t->slen[slot];
        roomiest = 1;
    }
    if (k <= 0) {
        if (roomiest) {
            for (k = bps - 1; k >= 1 && t->bhead[k] < 0; k--) {}
        } else {
            for (k = 1; k < bps && t->bhead[k] < 0; k++) {}
        }
        slot = t->bhead[k];
    }
    int32_t b = t->stk[(int64_t)slot * bps + k - 1];
    t->slen[slot] = k - 1;
    t->ref[b] = 1;
    bucket_remove(t, k, slot);
    if (k > 1) bucket_append(t, k - 1, slot);
    t->ctr[FA] -= 1;
    return b;
}

int32_t kvt_alloc(kvt *t, int32_t n, int32_t hint) {
    /* allocate_group without new slots: n >= 0 blocks into out when the active slots hold
     * them (returns n); else -(slots to activate) - 1, nothing changed. */
    if (n == 1) {
        int32_t b = kvt_alloc1(t, hint);
        if (b >= 0) {
            t->out[0] = b;
            return 1;
        }
    }
    if (n <= t->ctr[FA]) return kvt_take(t, n, hint, 0);
    int64_t short_ = n - t->ctr[FA];
    return -(int32_t)((short_ + t->bps - 1) / t->bps) - 1;
}

/* -- freeing ------------------------------------------------------------------------------------ */
static int push_free(kvt *t, int32_t b) {
    /* block b (ref 0, not cached) onto its slot's stack; 1 when the slot emptied (released:
     * inactive, into out2[NREL]) */
    int32_t bps = t->bps, s = b / bps, k0 = t->slen[s];
    t->stk[(int64_t)s * bps + k0] = b;
    if (k0) bucket_remove(t, k0, s);
    if (k0 + 1 == bps) {
        t->slen[s] = -1;
        t->ctr[FA] -= k0;
        t->ctr[NA] -= 1;
        heap_push(t, s);
        return 1;
    }
    t->slen[s] = k0 + 1;
    bucket_append(t, k0 + 1, s);
    t->ctr[FA] += 1;
    return 0;
}

int32_t kvt_push_free(kvt *t, int32_t b) { return push_free(t, b); }

int32_t kvt_free(kvt *t, int32_t n, int32_t lru) {
    /* Drop one reference from each of in[0 .. n), in order. At 0 a block that is retained or
     * pinned becomes cached, any other goes onto its slot's stack; then one bucket move (or
     * release) per run of one slot. lru = 0: the cached blocks go to out (the caller's
     * "kept"); lru = 1: retained unpinned ones to out (the caller's LRU, in order), pinned ones
     * to out3 (ctr[NPIN]). Released slots go to out2 (ctr[NREL]), in order. Returns the count
     * in out, or -(i + 1) for a refused entry i (ctr[ERRKIND] 1: not a block of the group, 2:
     * no reference left), and then nothing changed. */
    int32_t bps = t->bps, nb = t->nblocks;
    int32_t *ref = t->ref, *slen = t->slen, *runs = t->runs;
    uint8_t *cached = t->cached, *keep = t->keep, *pinned = t->pinned;
    int32_t nk = 0, np = 0, nr = 0, cur = -1, k0 = 0, lo = 0, hi = 0;
    int32_t *stk = t->stk;
    int32_t i;
    for (i = 0; i < n; i++) {
        int64_t b64 = t->in[i];
        if (b64 < 0 || b64 >= nb) { t->ctr[ERRKIND] = 1; goto refuse; }
        int32_t b = (int32_t)b64;
        if (ref[b] <= 0) { t->ctr[ERRKIND] = 2; goto refuse; }
        if (--ref[b]) continue;
        if (keep[b] | pinned[b]) {
            cached[b] = 1;
            if (lru && pinned[b]) t->out3[np++] = b;
            else t->out[nk++] = b;
            continue;
        }
        if (b < lo || b >= hi) {
            if (cur >= 0) {
                runs[3 * nr] = cur;
                runs[3 * nr + 1] = k0;
                runs[3 * nr + 2] = slen[cur];
                nr++;
            }
            cur = b / bps;
            lo = cur * bps;
            hi = lo + bps;
            stk = t->stk + lo;
            k0 = slen[cur];
        }
        stk[slen[cur]++] = b;
    }
    if (cur >= 0) {
        runs[3 * nr] = cur;
        runs[3 * nr + 1] = k0;
        runs[3 * nr + 2] = slen[cur];
        nr++;
    }
    {
        int64_t fa = 0;
        int32_t released = 0;
        for (int32_t r = 0; r < nr; r++) {
            int32_t s = runs[3 * r], a = runs[3 * r + 1], k = runs[3 * r + 2];
            if (a) bucket_remove(t, a, s);
            if (k == bps) {
                slen[s] = -1;
                fa -= a;
                t->out2[released++] = s;
            } else {
                bucket_append(t, k, s);
                fa += k - a;
            }
        }
        t->ctr[FA] += fa;
        t->ctr[NA] -= released;
        for (int32_t r = 0; r < released; r++) heap_push(t, t->out2[r]);
        t->ctr[NC] += nk + np;
        t->ctr[NREL] = released;
        t->ctr[NPIN] = np;
    }
    return nk;
refuse:
    /* give back the references entries 0 .. i-1 dropped, un-cache what they cached and cut
     * the stacks back to their length before the call (the first run of a slot has it) */
    for (int32_t j = 0; j < i; j++) {
        int32_t b = (int32_t)t->in[j];
        if (ref[b] == 0) cached[b] = 0;
        ref[b]++;
    }
    if (cur >= 0) slen[cur] = k0;
    for (int32_t r = nr - 1; r >= 0; r--) slen[runs[3 * r]] = runs[3 * r + 1];
    return -(i + 1);
}

/* -- compaction's moves ------------------------------------------------------------------------ */
void kvt_drop_top(kvt *t, int32_t slot, int32_t take) {
    /* a compaction destination gives up the top `take` blocks of its stack (the caller moves
     * blocks into them and sets their state) */
    int32_t k = t->slen[slot];
    t->slen[slot] = k - take;
    bucket_remove(t, k, slot);
    if (k - take) bucket_append(t, k - take, slot);
    t->ctr[FA] -= take;
}

void kvt_release_slot(kvt *t, int32_t slot) {
    /* a compaction source, every block free now: inactive */
    int32_t k = t->slen[slot];
    if (k >= 1 && k < t->bps) bucket_remove(t, k, slot);
    t->slen[slot] = -1;
    t->ctr[FA] -= k;
    t->ctr[NA] -= 1;
    heap_push(t, slot);
}
