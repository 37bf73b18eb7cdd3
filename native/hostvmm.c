/* hostvmm: see hostvmm.h for the model and the error convention. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "hostvmm.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef FALLOC_FL_KEEP_SIZE
#define FALLOC_FL_KEEP_SIZE 0x01
#endif
#ifndef FALLOC_FL_PUNCH_HOLE
#define FALLOC_FL_PUNCH_HOLE 0x02
#endif

#define HV_START_BIT 1ull /* page-table entry: this page is the first page of its mapping */
#define HV_CLAIM_BIT 2ull /* page-table entry, only inside hv_unmap_batch's check: listed already */
#define HV_PENDING_FREE 1u
#define HV_USED 2u  /* the handle has been mapped before: its pages are no longer fresh */
#define HV_STUCK 4u /* pending-free, unmapped, its hole punch failed: on the stuck list */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux >= 5.14 */
#endif

typedef struct {
    uint64_t va, size, npages, mapped_pages;
    uint64_t *ent; /* per page: 0 = unmapped, else handle offset | HV_START_BIT on the first page */
} hv_resv;

typedef struct {
    uint64_t slot, pages;
} hv_extent;

struct hv_pool {
    pthread_mutex_t mu;
    int fd;
    int backing;           /* HV_BACKING_*: what the memfd's pages are */
    uint64_t granule, limit, committed, nhandles, mapped, nmappings, reserved;
    uint64_t gshift, gmask; /* granule = 1 << gshift, gmask = granule - 1 (no divisions) */
    uint64_t max_mappings; /* 0 = no cap; keeps the process under vm.max_map_count */
    int populate;          /* fill the page tables of new mappings (hv_set_populate) */
    int no_populate_write; /* MADV_POPULATE_WRITE is not supported by this kernel */
    /* handle table, indexed by slot = offset / granule */
    uint64_t cap_slots, end_slot;
    uint32_t *hpages; /* pages of the handle starting at this slot, 0 = none */
    uint32_t *hmaps;  /* live mappings of that handle */
    uint8_t *hflags;
    hv_extent *freelist; /* freed extents, oldest first from ffirst: reused in the order freed,
                          * so handles freed in ascending order come back ascending (contiguous
                          * in the memfd again: one mmap per run when they are mapped together) */
    uint64_t ffirst, nfree, cap_free;
    hv_resv *resv;
    uint64_t nresv, cap_resv, last_resv;
    /* slots of deferred-freed handles whose hole punch failed when their last mapping went:
     * unmapped, still committed; retried by retry_stuck() (create, free, unmap, stats) */
    uint64_t *stuck;
    uint64_t nstuck, cap_stuck;
};

static __thread char hv_err[512];

const char *hv_last_error(void) { return hv_err; }

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(hv_err, sizeof hv_err, fmt, ap);
    va_end(ap);
    return code;
}

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)
#endif
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif
#define HV_HUGE_2M (2ull << 20)

int hv_pool_open(hv_pool **out, uint64_t granule, uint64_t limit) {
    return hv_pool_open_backed(out, granule, limit, HV_BACKING_SMALL);
}

int hv_pool_open_backed(hv_pool **out, uint64_t granule, uint64_t limit, int backing) {
    *out = NULL;
    long pg = sysconf(_SC_PAGESIZE);
    if (granule == 0 || granule % (uint64_t)pg != 0 || (granule & (granule - 1)) != 0)
        return fail(EINVAL, "granule %llu is not a power-of-two multiple of the page size %ld",
                    (unsigned long long)granule, pg);
    if (backing != HV_BACKING_SMALL && backing != HV_BACKING_HUGETLB && backing != HV_BACKING_THP)
        return fail(EINVAL, "unknown backing %d", backing);
    if (backing != HV_BACKING_SMALL && granule % HV_HUGE_2M)
        return fail(EINVAL, "huge-page backing needs a granule that is a multiple of 2 MiB, got %llu",
                    (unsigned long long)granule);
    hv_pool *p = calloc(1, sizeof *p);
    if (!p) return fail(ENOMEM, "out of host memory for the pool state");
    unsigned flags = MFD_CLOEXEC | (backing == HV_BACKING_HUGETLB ? MFD_HUGETLB | MFD_HUGE_2MB : 0);
    p->fd = memfd_create("xllm-vmm-host", flags);
    if (p->fd < 0) {
        int e = errno;
        free(p);
        if (backing == HV_BACKING_HUGETLB)
            return fail(e, "memfd_create(MFD_HUGETLB|MFD_HUGE_2MB): %s (does this kernel have "
                        "hugetlbfs with 2 MiB pages?)", strerror(e));
        return fail(e, "memfd_create: %s (check `ulimit -n`)", strerror(e));
    }
    pthread_mutex_init(&p->mu, NULL);
    p->backing = backing;
    p->granule = granule;
    p->gshift = (uint64_t)__builtin_ctzll(granule);
    p->gmask = granule - 1;
    p->limit = limit;
    p->end_slot = 1; /* slot 0 is never handed out, so no handle is 0 */
    *out = p;
    return 0;
}

void hv_pool_close(hv_pool *p) {
    if (!p) return;
    for (uint64_t i = 0; i < p->nresv; i++) {
        munmap((void *)p->resv[i].va, p->resv[i].size);
        free(p->resv[i].ent);
    }
    free(p->resv);
    free(p->hpages);
    free(p->hmaps);
    free(p->hflags);
    free(p->freelist);
    free(p->stuck);
    close(p->fd);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int hv_pool_fd(hv_pool *p) { return p->fd; }
uint64_t hv_granule(hv_pool *p) { return p->granule; }

void hv_stats(hv_pool *p, uint64_t *out) {
    pthread_mutex_lock(&p->mu);
    out[HV_STAT_COMMITTED] = p->committed;
    out[HV_STAT_HANDLES] = p->nhandles;
    out[HV_STAT_RESERVATIONS] = p->nresv;
    out[HV_STAT_RESERVED] = p->reserved;
    out[HV_STAT_MAPPED] = p->mapped;
    out[HV_STAT_MAPPINGS] = p->nmappings;
    out[HV_STAT_LIMIT] = p->limit;
    out[HV_STAT_FILE_END] = p->end_slot * p->granule;
    out[HV_STAT_MAX_MAPPINGS] = p->max_mappings;
    out[HV_STAT_RELEASE_PENDING] = p->nstuck;
    out[HV_STAT_BACKING] = (uint64_t)p->backing;
    pthread_mutex_unlock(&p->mu);
}

void hv_set_max_mappings(hv_pool *p, uint64_t max_mappings) {
    pthread_mutex_lock(&p->mu);
    p->max_mappings = max_mappings;
    pthread_mutex_unlock(&p->mu);
}

void hv_set_populate(hv_pool *p, int on) {
    pthread_mutex_lock(&p->mu);
    p->populate = on != 0;
    pthread_mutex_unlock(&p->mu);
}

void hv_set_limit(hv_pool *p, uint64_t limit) {
    pthread_mutex_lock(&p->mu);
    p->limit = limit;
    pthread_mutex_unlock(&p->mu);
}

/* ---- handles ------------------------------------------------------------------------------ */

static int grow_slots(hv_pool *p, uint64_t need) {
    if (need <= p->cap_slots) return 0;
    uint64_t cap = p->cap_slots ? p->cap_slots : 1024;
    while (cap < need) cap *= 2;
    uint32_t *a = realloc(p->hpages, cap * sizeof *a);
    if (!a) return ENOMEM;
    p->hpages = a;
    uint32_t *b = realloc(p->hmaps, cap * sizeof *b);
    if (!b) return ENOMEM;
    p->hmaps = b;
    uint8_t *c = realloc(p->hflags, cap);
    if (!c) return ENOMEM;
    p->hflags = c;
    memset(p->hpages + p->cap_slots, 0, (cap - p->cap_slots) * sizeof *a);
    memset(p->hmaps + p->cap_slots, 0, (cap - p->cap_slots) * sizeof *b);
    memset(p->hflags + p->cap_slots, 0, cap - p->cap_slots);
    p->cap_slots = cap;
    return 0;
}

static int push_free(hv_pool *p, uint64_t slot, uint64_t pages) {
    if (p->nfree == p->cap_free && p->ffirst) { /* room at the front: close the gap */
        memmove(p->freelist, p->freelist + p->ffirst, (p->nfree - p->ffirst) * sizeof *p->freelist);
        p->nfree -= p->ffirst;
        p->ffirst = 0;
    }
    if (p->nfree == p->cap_free) {
        uint64_t cap = p->cap_free ? p->cap_free * 2 : 256;
        hv_extent *f = realloc(p->freelist, cap * sizeof *f);
        if (!f) return ENOMEM;
        p->freelist = f;
        p->cap_free = cap;
    }
    p->freelist[p->nfree].slot = slot;
    p->freelist[p->nfree].pages = pages;
    p->nfree++;
    return 0;
}

/* Looks up a live handle; returns its slot or UINT64_MAX. Caller holds the lock. */
static uint64_t handle_slot(hv_pool *p, uint64_t handle) {
    if (handle == 0 || handle & p->gmask) return UINT64_MAX;
    uint64_t slot = (handle >> p->gshift);
    if (slot >= p->end_slot || p->hpages[slot] == 0) return UINT64_MAX;
    return slot;
}

static void retry_stuck(hv_pool *p);

/* fallocate, restarted when a signal interrupts it (hugetlbfs and shmem return EINTR while a
 * signal is pending, e.g. a profiler's timer or SIGCHLD under load; nothing is half done then). */
static int fallocate_eintr(int fd, int mode, off_t off, off_t len) {
    int rc;
    do rc = fallocate(fd, mode, off, len);
    while (rc != 0 && errno == EINTR);
    return rc;
}

/* MADV_POPULATE_WRITE, restarted on EINTR (it returns it with a signal pending; the pages it
 * populated stay populated, so the restart only does the rest). */
static int populate_write_eintr(void *at, size_t size) {
    int rc;
    do rc = madvise(at, size, MADV_POPULATE_WRITE);
    while (rc != 0 && errno == EINTR);
    return rc;
}

/* Commits [off, off+size) of the memfd; -1 with errno on failure (what was committed may be
 * left: the caller punches the range). 4 KiB pages and hugetlb: fallocate (hugetlbfs allocates
 * and zeroes whole huge pages). Shmem THP: fallocate allocates no huge pages when
 * shmem_enabled=advise (it has no VMA to advise), so the range is mapped once at a 2 MiB-aligned
 * scratch address with MADV_HUGEPAGE and written with MADV_POPULATE_WRITE (Linux >= 5.14),
 * which allocates (and zeroes) 2 MiB folios where the kernel can, 4 KiB pages otherwise. */
static int commit_range(hv_pool *p, uint64_t off, uint64_t size) {
    if (p->backing != HV_BACKING_THP) return fallocate_eintr(p->fd, 0, (off_t)off, (off_t)size);
    struct stat st;
    if (fstat(p->fd, &st) != 0) return -1;
    if ((uint64_t)st.st_size < off + size && ftruncate(p->fd, (off_t)(off + size)) != 0) return -1;
    uint64_t span = size + HV_HUGE_2M;
    void *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return -1;
    uint64_t at = ((uint64_t)raw + HV_HUGE_2M - 1) & ~(HV_HUGE_2M - 1);
    int rc = 0, e = 0;
    if (mmap((void *)at, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)off) ==
            MAP_FAILED ||
        madvise((void *)at, size, MADV_HUGEPAGE) != 0 ||
        populate_write_eintr((void *)at, size) != 0) {
        e = errno == EFAULT || errno == EHWPOISON ? ENOMEM : errno; /* a failed populate fault */
        rc = -1;
    }
    munmap(raw, span);
    if (rc) errno = e;
    return rc;
}

int hv_create(hv_pool *p, uint64_t size, uint64_t *handle_out) {
    if (size == 0 || size & p->gmask)
        return fail(EINVAL, "handle size %llu is not a positive multiple of the granularity %llu",
                    (unsigned long long)size, (unsigned long long)p->granule);
    uint64_t pages = (size >> p->gshift);
    if (pages > UINT32_MAX) return fail(EINVAL, "handle size %llu is too large", (unsigned long long)size);
    pthread_mutex_lock(&p->mu);
    retry_stuck(p);
    int rc = 0;
    if (p->limit && p->committed + size > p->limit) {
        rc = fail(ENOMEM,
                  "out of device memory: %llu bytes in use of %llu, %llu more requested",
                  (unsigned long long)p->committed, (unsigned long long)p->limit,
                  (unsigned long long)size);
        goto out;
    }
    uint64_t slot = UINT64_MAX, fi = UINT64_MAX;
    for (uint64_t i = p->ffirst; i < p->nfree; i++) { /* the oldest extent of this size */
        if (p->freelist[i].pages == pages) {
            fi = i;
            slot = p->freelist[i].slot;
            break;
        }
    }
    int from_free = slot != UINT64_MAX;
    if (!from_free) {
        slot = p->end_slot;
        if (grow_slots(p, slot + pages)) {
            rc = fail(ENOMEM, "out of host memory for the handle table");
            goto out;
        }
    }
    if (commit_range(p, slot * p->granule, size) != 0) {
        int e = errno;
        /* undo whatever fallocate managed to commit */
        fallocate_eintr(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(slot * p->granule),
                  (off_t)size);
        if (e == ENOSPC || e == ENOMEM || e == EFBIG)
            rc = fail(ENOMEM, "out of host memory: fallocate of %llu bytes failed: %s",
                      (unsigned long long)size, strerror(e));
        else
            rc = fail(e, "fallocate of %llu bytes failed: %s", (unsigned long long)size, strerror(e));
        goto out;
    }
    if (from_free) {
        if (fi == p->ffirst)
            p->ffirst++;
        else
            p->freelist[fi] = p->freelist[--p->nfree];
        if (p->ffirst == p->nfree) p->ffirst = p->nfree = 0;
    } else {
        p->end_slot = slot + pages;
    }
    p->hpages[slot] = (uint32_t)pages;
    p->hmaps[slot] = 0;
    p->hflags[slot] = p->backing == HV_BACKING_THP ? HV_USED : 0; /* THP: written (zeroed) already */
    p->committed += size;
    p->nhandles++;
    *handle_out = slot * p->granule;
out:
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Caller holds the lock; the handle is live and unmapped. */
static int release_slot(hv_pool *p, uint64_t slot) {
    uint64_t pages = p->hpages[slot];
    uint64_t size = pages * p->granule;
    if (fallocate_eintr(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(slot * p->granule),
                  (off_t)size) != 0) {
        int e = errno;
        return fail(e, "punching a hole of %llu bytes failed: %s", (unsigned long long)size,
                    strerror(e));
    }
    p->hpages[slot] = 0;
    p->hflags[slot] = 0;
    p->committed -= size;
    p->nhandles--;
    if (push_free(p, slot, pages)) {
        /* the extent is lost to reuse (only file offsets, not memory) */
    }
    return 0;
}

/* Caller holds the lock. Releases a deferred-freed handle whose last mapping just went. When
 * punching its hole fails, the handle goes on the stuck list (still committed and counted) and
 * retry_stuck() tries again later; nobody can use it meanwhile (it stays pending-free). */
static void release_unmapped(hv_pool *p, uint64_t slot) {
    if (p->hmaps[slot] != 0 || !(p->hflags[slot] & HV_PENDING_FREE) || (p->hflags[slot] & HV_STUCK))
        return;
    char saved[sizeof hv_err];
    memcpy(saved, hv_err, sizeof saved);
    int rc = release_slot(p, slot);
    memcpy(hv_err, saved, sizeof saved);
    if (rc == 0) return;
    if (p->nstuck == p->cap_stuck) {
        uint64_t cap = p->cap_stuck ? p->cap_stuck * 2 : 16;
        uint64_t *s = realloc(p->stuck, cap * sizeof *s);
        if (!s) return; /* no room to remember it: its memory is released at hv_pool_close */
        p->stuck = s;
        p->cap_stuck = cap;
    }
    p->hflags[slot] |= HV_STUCK;
    p->stuck[p->nstuck++] = slot;
}

/* Caller holds the lock. Retries the releases that failed before (see release_unmapped). */
static void retry_stuck(hv_pool *p) {
    if (!p->nstuck) return;
    char saved[sizeof hv_err];
    memcpy(saved, hv_err, sizeof saved);
    uint64_t keep = 0;
    for (uint64_t i = 0; i < p->nstuck; i++) {
        uint64_t slot = p->stuck[i];
        if (release_slot(p, slot) != 0) p->stuck[keep++] = slot; /* flags kept: still stuck */
    }
    p->nstuck = keep;
    memcpy(hv_err, saved, sizeof saved);
}

static int free_impl(hv_pool *p, uint64_t handle, int deferred) {
    pthread_mutex_lock(&p->mu);
    retry_stuck(p);
    int rc = 0;
    uint64_t slot = handle_slot(p, handle);
    if (slot == UINT64_MAX || (p->hflags[slot] & HV_PENDING_FREE)) {
        rc = fail(EBADF, "unknown handle %#llx (never created, or already freed)",
                  (unsigned long long)handle);
    } else if (p->hmaps[slot]) {
        if (deferred)
            p->hflags[slot] |= HV_PENDING_FREE;
        else
            rc = fail(EBUSY, "handle %#llx is still mapped %u time(s); unmap it before freeing",
                      (unsigned long long)handle, p->hmaps[slot]);
    } else {
        rc = release_slot(p, slot);
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int hv_free(hv_pool *p, uint64_t handle) { return free_impl(p, handle, 0); }
int hv_free_deferred(hv_pool *p, uint64_t handle) { return free_impl(p, handle, 1); }

int hv_handle_info(hv_pool *p, uint64_t handle, uint64_t *size, uint64_t *mapcount) {
    pthread_mutex_lock(&p->mu);
    int rc = 0;
    uint64_t slot = handle_slot(p, handle);
    if (slot == UINT64_MAX || (p->hflags[slot] & HV_PENDING_FREE)) {
        rc = fail(EBADF, "unknown handle %#llx", (unsigned long long)handle);
    } else {
        if (size) *size = (uint64_t)p->hpages[slot] * p->granule;
        if (mapcount) *mapcount = p->hmaps[slot];
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* ---- reservations ------------------------------------------------------------------------- */

int hv_reserve(hv_pool *p, uint64_t size, uint64_t *va_out) {
    if (size == 0 || size & p->gmask)
        return fail(EINVAL, "reservation size %llu is not a positive multiple of the granularity %llu",
                    (unsigned long long)size, (unsigned long long)p->granule);
    uint64_t npages = (size >> p->gshift);
    uint64_t *ent = calloc(npages, sizeof *ent);
    if (!ent) return fail(ENOMEM, "out of host memory for the page table of %llu pages",
                          (unsigned long long)npages);
    uint64_t span = size + p->granule;
    void *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
        int e = errno;
        free(ent);
        return fail(e == ENOMEM ? ENOMEM : e, "reserving %llu bytes of address space failed: %s",
                    (unsigned long long)size, strerror(e));
    }
    uint64_t start = ((uint64_t)raw + p->granule - 1) & ~(p->granule - 1);
    uint64_t head = start - (uint64_t)raw, tail = span - head - size;
    if (head) munmap(raw, head);
    if (tail) munmap((void *)(start + size), tail);

    pthread_mutex_lock(&p->mu);
    int rc = 0;
    if (p->nresv == p->cap_resv) {
        uint64_t cap = p->cap_resv ? p->cap_resv * 2 : 8;
        hv_resv *r = realloc(p->resv, cap * sizeof *r);
        if (!r) {
            rc = fail(ENOMEM, "out of host memory for the reservation table");
            goto out;
        }
        p->resv = r;
        p->cap_resv = cap;
    }
    /* keep the table sorted by address */
    uint64_t i = p->nresv;
    while (i > 0 && p->resv[i - 1].va > start) {
        p->resv[i] = p->resv[i - 1];
        i--;
    }
    p->resv[i] = (hv_resv){.va = start, .size = size, .npages = npages, .mapped_pages = 0, .ent = ent};
    p->nresv++;
    p->reserved += size;
    p->last_resv = i;
    *va_out = start;
out:
    pthread_mutex_unlock(&p->mu);
    if (rc) {
        munmap((void *)start, size);
        free(ent);
    }
    return rc;
}

/* Finds the reservation containing va; caller holds the lock. */
static hv_resv *find_resv(hv_pool *p, uint64_t va) {
    if (p->last_resv < p->nresv) {
        hv_resv *r = &p->resv[p->last_resv];
        if (va >= r->va && va - r->va < r->size) return r;
    }
    uint64_t lo = 0, hi = p->nresv;
    while (lo < hi) {
        uint64_t mid = (lo + hi) / 2;
        hv_resv *r = &p->resv[mid];
        if (va < r->va)
            hi = mid;
        else if (va - r->va >= r->size)
            lo = mid + 1;
        else {
            p->last_resv = mid;
            return r;
        }
    }
    return NULL;
}

int hv_reservation_size(hv_pool *p, uint64_t va, uint64_t *size) {
    pthread_mutex_lock(&p->mu);
    hv_resv *r = find_resv(p, va);
    int rc = 0;
    if (!r || r->va != va)
        rc = fail(EFAULT, "%#llx is not the start of a reservation", (unsigned long long)va);
    else
        *size = r->size;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int hv_release(hv_pool *p, uint64_t va, uint64_t size) {
    pthread_mutex_lock(&p->mu);
    int rc = 0;
    hv_resv *r = find_resv(p, va);
    if (!r || r->va != va) {
        rc = fail(EFAULT, "%#llx is not the start of a reservation", (unsigned long long)va);
        goto out;
    }
    if (size && size != r->size) {
        rc = fail(EINVAL, "release size %llu differs from the reserved size %llu at %#llx",
                  (unsigned long long)size, (unsigned long long)r->size, (unsigned long long)va);
        goto out;
    }
    if (r->mapped_pages) {
        rc = fail(EBUSY, "reservation at %#llx still has %llu mapped page(s); unmap them first",
                  (unsigned long long)va, (unsigned long long)r->mapped_pages);
        goto out;
    }
    if (munmap((void *)r->va, r->size) != 0) {
        int e = errno;
        rc = fail(e, "munmap of the reservation at %#llx failed: %s", (unsigned long long)va,
                  strerror(e));
        goto out;
    }
    free(r->ent);
    p->reserved -= r->size;
    uint64_t idx = (uint64_t)(r - p->resv);
    memmove(&p->resv[idx], &p->resv[idx + 1], (p->nresv - idx - 1) * sizeof *r);
    p->nresv--;
    p->last_resv = 0;
out:
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* ---- mappings ----------------------------------------------------------------------------- */

/* Caller holds the lock. What a map of ``handle`` at ``va`` must satisfy (no side effect):
 * aligned, a live handle (``restore``: hv_unmap_batch putting back a mapping it just removed,
 * which may belong to a deferred-freed handle), inside one reservation, over unmapped pages,
 * under the mapping cap counting ``pending`` maps of this batch not yet recorded. */
static int check_map_locked(hv_pool *p, uint64_t va, uint64_t handle, int restore,
                            uint64_t pending, uint64_t *slot_out, hv_resv **r_out,
                            uint64_t *first_out) {
    if (va & p->gmask)
        return fail(EINVAL, "map address %#llx is not aligned to the granularity %llu",
                    (unsigned long long)va, (unsigned long long)p->granule);
    uint64_t slot = handle_slot(p, handle);
    if (slot == UINT64_MAX || ((p->hflags[slot] & HV_PENDING_FREE) && !restore))
        return fail(EBADF, "unknown handle %#llx (never created, or already freed)",
                    (unsigned long long)handle);
    uint64_t pages = p->hpages[slot], size = pages * p->granule;
    hv_resv *r = find_resv(p, va);
    if (!r) return fail(EFAULT, "map address %#llx is not inside a reservation", (unsigned long long)va);
    uint64_t first = ((va - r->va) >> p->gshift);
    if (first + pages > r->npages)
        return fail(EINVAL, "mapping %llu bytes at %#llx runs past the end of its reservation [%#llx, %#llx)",
                    (unsigned long long)size, (unsigned long long)va, (unsigned long long)r->va,
                    (unsigned long long)(r->va + r->size));
    for (uint64_t i = 0; i < pages; i++)
        if (r->ent[first + i])
            return fail(EEXIST, "address %#llx is already mapped; unmap it first",
                        (unsigned long long)(va + i * p->granule));
    if (p->max_mappings && p->nmappings + pending >= p->max_mappings)
        return fail(ENOMEM, "mapping limit of %llu mappings reached (it keeps the process under "
                    "vm.max_map_count); use larger handles or raise the limit",
                    (unsigned long long)p->max_mappings);
    *slot_out = slot;
    *r_out = r;
    *first_out = first;
    return 0;
}

/* Populating: the first map of a handle writes-faults its fresh (fallocated, not yet zeroed)
 * pages with MADV_POPULATE_WRITE; later maps read-populate (MAP_POPULATE), which maps 16
 * already-initialised pages per fault (fault-around). MADV_POPULATE_WRITE needs Linux 5.14;
 * without it every populated map uses MAP_POPULATE. */
static int write_populates(hv_pool *p, uint64_t slot) {
    return p->populate && !(p->hflags[slot] & HV_USED) && !p->no_populate_write;
}

/* One mmap of ``size`` bytes of the memfd at ``off`` over ``va`` (one handle, or a run of
 * handles contiguous in address and offset); on failure the range is reserved again. */
static int mmap_range(hv_pool *p, uint64_t va, uint64_t size, uint64_t off, int write_populate) {
    int flags = MAP_SHARED | MAP_FIXED | (p->populate && !write_populate ? MAP_POPULATE : 0);
    void *got = mmap((void *)va, size, PROT_READ | PROT_WRITE, flags, p->fd, (off_t)off);
    if (got == MAP_FAILED) {
        int e = errno;
        /* A failed MAP_FIXED may have removed the old mapping: put the reservation back. */
        mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        return fail(e, "mmap of %llu bytes at %#llx failed: %s%s", (unsigned long long)size,
                    (unsigned long long)va, strerror(e),
                    e == ENOMEM ? " (too many mappings? check vm.max_map_count)" : "");
    }
    if (write_populate && madvise((void *)va, size, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
        p->no_populate_write = 1; /* older kernel; other errors: best effort, pages fault later */
    return 0;
}

/* Caller holds the lock: the bookkeeping of a mapping whose mmap succeeded. */
static void record_map_locked(hv_pool *p, hv_resv *r, uint64_t first, uint64_t slot,
                              uint64_t handle) {
    uint64_t pages = p->hpages[slot];
    p->hflags[slot] |= HV_USED;
    r->ent[first] = handle | HV_START_BIT;
    for (uint64_t i = 1; i < pages; i++) r->ent[first + i] = handle;
    r->mapped_pages += pages;
    p->hmaps[slot]++;
    p->mapped += pages * p->granule;
    p->nmappings++;
}

/* Caller holds the lock. */
static int map_locked(hv_pool *p, uint64_t va, uint64_t handle, int restore) {
    uint64_t slot, first;
    hv_resv *r;
    int rc = check_map_locked(p, va, handle, restore, 0, &slot, &r, &first);
    if (rc) return rc;
    rc = mmap_range(p, va, p->hpages[slot] * p->granule, handle, write_populates(p, slot));
    if (rc) return rc;
    record_map_locked(p, r, first, slot, handle);
    return 0;
}

/* Caller holds the lock. Finds the mapping that starts at ``va`` (no side effect). */
static int find_mapping_locked(hv_pool *p, uint64_t va, hv_resv **r_out, uint64_t *first_out,
                               uint64_t *handle_out) {
    hv_resv *r = find_resv(p, va);
    if (!r) return fail(EFAULT, "unmap address %#llx is not inside a reservation", (unsigned long long)va);
    if ((va - r->va) & p->gmask)
        return fail(EINVAL, "unmap address %#llx is not aligned to the granularity %llu",
                    (unsigned long long)va, (unsigned long long)p->granule);
    uint64_t first = ((va - r->va) >> p->gshift);
    uint64_t e0 = r->ent[first];
    if (!(e0 & HV_START_BIT))
        return fail(ENOENT, e0 ? "address %#llx is inside a mapping but not its start"
                               : "address %#llx is not mapped",
                    (unsigned long long)va);
    *r_out = r;
    *first_out = first;
    *handle_out = e0 & ~HV_START_BIT;
    return 0;
}

/* Replaces ``size`` bytes at ``va`` (one mapping, or a run of adjacent ones) by the
 * reservation's inaccessible placeholder. */
static int unmap_range(uint64_t va, uint64_t size) {
    void *got = mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                     -1, 0);
    if (got == MAP_FAILED) {
        int e = errno;
        return fail(e, "re-reserving %llu bytes at %#llx failed: %s", (unsigned long long)size,
                    (unsigned long long)va, strerror(e));
    }
    return 0;
}

/* Caller holds the lock: the bookkeeping of an unmapped mapping. ``keep``: do not release a
 * deferred-freed handle whose last mapping this was (hv_unmap_batch releases them once the
 * whole batch is done). */
static void record_unmap_locked(hv_pool *p, hv_resv *r, uint64_t first, uint64_t handle,
                                int keep) {
    uint64_t slot = (handle >> p->gshift);
    uint64_t pages = p->hpages[slot];
    if (pages == 1)
        r->ent[first] = 0;
    else
        memset(&r->ent[first], 0, pages * sizeof *r->ent);
    r->mapped_pages -= pages;
    p->hmaps[slot]--;
    p->mapped -= pages * p->granule;
    p->nmappings--;
    if (!keep) release_unmapped(p, slot);
}

/* Caller holds the lock. */
static int unmap_locked(hv_pool *p, uint64_t va, uint64_t *handle_out, int keep) {
    hv_resv *r;
    uint64_t first, handle;
    int rc = find_mapping_locked(p, va, &r, &first, &handle);
    if (rc) return rc;
    rc = unmap_range(va, p->hpages[(handle >> p->gshift)] * p->granule);
    if (rc) return rc;
    record_unmap_locked(p, r, first, handle, keep);
    if (handle_out) *handle_out = handle;
    return 0;
}

int hv_map(hv_pool *p, uint64_t va, uint64_t handle) {
    pthread_mutex_lock(&p->mu);
    int rc = map_locked(p, va, handle, 0);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int hv_unmap(hv_pool *p, uint64_t va, uint64_t *handle_out) {
    pthread_mutex_lock(&p->mu);
    int rc = unmap_locked(p, va, handle_out, 0);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Caller holds the lock. Maps entries [i, n) from ``i`` as one run: the longest prefix whose
 * addresses and memfd offsets both continue the previous entry's (one reservation, one
 * populate mode), checked entry by entry, then one mmap for all of it. Returns the entries
 * mapped (*done) or an error with *bad the failing entry. A failed coalesced mmap is retried
 * entry by entry, so the error names the exact entry. */
static int map_run_locked(hv_pool *p, const uint64_t *vas, const uint64_t *handles, uint64_t i,
                          uint64_t n, uint64_t *done, uint64_t *bad) {
    uint64_t slot, first;
    hv_resv *r;
    int rc = check_map_locked(p, vas[i], handles[i], 0, 0, &slot, &r, &first);
    if (rc) {
        *bad = i;
        return rc;
    }
    int wp = write_populates(p, slot);
    uint64_t total = p->hpages[slot] * p->granule, j = i + 1;
    while (j < n && vas[j] == vas[i] + total && handles[j] == handles[i] + total) {
        uint64_t s2, f2;
        hv_resv *r2;
        if (check_map_locked(p, vas[j], handles[j], 0, j - i, &s2, &r2, &f2) || r2 != r ||
            write_populates(p, s2) != wp)
            break; /* entry j starts the next run (and fails there, if it is wrong) */
        total += p->hpages[s2] * p->granule;
        j++;
    }
    if (j - i > 1 && mmap_range(p, vas[i], total, handles[i], wp) == 0) {
        for (uint64_t k = i; k < j; k++) {
            uint64_t sk = (handles[k] >> p->gshift);
            record_map_locked(p, r, first + ((vas[k] - vas[i]) >> p->gshift), sk, handles[k]);
        }
        *done = j - i;
        return 0;
    }
    for (uint64_t k = i; k < j; k++) { /* one entry (or the run's mmap failed): one by one */
        rc = map_locked(p, vas[k], handles[k], 0);
        if (rc) {
            *bad = k;
            return rc;
        }
    }
    *done = j - i;
    return 0;
}

static int check_map_run_locked(hv_pool *p, uint64_t va, uint64_t off, uint64_t size,
                                hv_resv **r_out, uint64_t *first_out, uint64_t *count,
                                int *fresh, int *single);
static void record_map_run_locked(hv_pool *p, hv_resv *r, uint64_t first, uint64_t off,
                                  uint64_t pages, uint64_t count, int single);
static int check_unmap_run_locked(hv_pool *p, uint64_t va, uint64_t size, int claim,
                                  uint64_t *pending, int *single);
static void record_unmap_single_run_locked(hv_pool *p, hv_resv *r, uint64_t first,
                                           uint64_t pages);

/* Entries [i, j) continuing each other by one granule both in address and in memfd offset,
 * from ``i`` (a pure scan of the two arrays: no table is read). Returns j. */
static uint64_t granule_run_end(const hv_pool *p, const uint64_t *vas, const uint64_t *handles,
                                uint64_t i, uint64_t n) {
    uint64_t j = i + 1;
    if (handles)
        while (j < n && vas[j] == vas[j - 1] + p->granule && handles[j] == handles[j - 1] + p->granule)
            j++;
    else
        while (j < n && vas[j] == vas[j - 1] + p->granule) j++;
    return j;
}

/* Caller holds the lock. The run fast path of hv_map_batch: entries [i, j) (j - i >= 2,
 * contiguous by one granule in address and offset) checked and recorded as one run record
 * when every handle there is one granule (the pool's pages), mapped with one mmap. Returns 0
 * when done; nonzero (nothing changed) sends the caller to the entry-by-entry path, which
 * names the failing entry. */
static int map_granule_run_locked(hv_pool *p, uint64_t va, uint64_t off, uint64_t pages) {
    hv_resv *r = NULL;
    uint64_t first = 0, count = 0;
    int fresh = 0, single = 0;
    if (check_map_run_locked(p, va, off, pages << p->gshift, &r, &first, &count, &fresh, &single)
        || !single)
        return EAGAIN;
    if (mmap_range(p, va, pages << p->gshift, off, p->populate && fresh && !p->no_populate_write))
        return EAGAIN; /* the range is reserved again: the entry path retries one by one */
    record_map_run_locked(p, r, first, off, pages, count, 1);
    return 0;
}

/* All or nothing. Entries contiguous in address and in memfd offset are mapped with one mmap
 * per run (fewer system calls and VMAs); the bookkeeping stays per handle. Runs of
 * one-granule handles are found by a scan of the two arrays and checked and recorded in one
 * pass per run (as hv_map_runs does); anything else goes entry by entry. */
int hv_map_batch(hv_pool *p, const uint64_t *vas, const uint64_t *handles, uint64_t n,
                 uint64_t *failed) {
    pthread_mutex_lock(&p->mu);
    int rc = 0;
    for (uint64_t i = 0; i < n;) {
        uint64_t done = 0, bad = i, j = granule_run_end(p, vas, handles, i, n);
        if (j - i > 1 && map_granule_run_locked(p, vas[i], handles[i], j - i) == 0) {
            i = j;
            continue;
        }
        rc = map_run_locked(p, vas, handles, i, n, &done, &bad);
        if (rc) {
            char saved[sizeof hv_err];
            memcpy(saved, hv_err, sizeof saved);
            uint64_t left = 0; /* entries the kernel would not unmap again (ENOMEM on a VMA split) */
            for (uint64_t j = bad; j-- > 0;) left += unmap_locked(p, vas[j], NULL, 0) != 0;
            snprintf(hv_err, sizeof hv_err, "batch entry %llu of %llu: %s%s", (unsigned long long)bad,
                     (unsigned long long)n, saved,
                     left ? " (and the rollback could not unmap every earlier entry)" : "");
            if (failed) *failed = bad;
            break;
        }
        i += done;
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Caller holds the lock. Checks that va is the start of a mapping not yet claimed by this
 * batch; returns its first page-table entry through *ent. */
static int check_unmap_locked(hv_pool *p, uint64_t va, uint64_t **ent) {
    hv_resv *r = find_resv(p, va);
    if (!r) return fail(EFAULT, "unmap address %#llx is not inside a reservation", (unsigned long long)va);
    if ((va - r->va) & p->gmask)
        return fail(EINVAL, "unmap address %#llx is not aligned to the granularity %llu",
                    (unsigned long long)va, (unsigned long long)p->granule);
    uint64_t *e = &r->ent[((va - r->va) >> p->gshift)];
    if (*e & HV_CLAIM_BIT)
        return fail(ENOENT, "address %#llx is listed twice in the batch", (unsigned long long)va);
    if (!(*e & HV_START_BIT))
        return fail(ENOENT, *e ? "address %#llx is inside a mapping but not its start"
                               : "address %#llx is not mapped",
                    (unsigned long long)va);
    *ent = e;
    return 0;
}

/* All or nothing: every entry is checked (each must start a mapping, none listed twice) before
 * anything is unmapped, so misuse changes nothing. Entries that are adjacent mappings (each
 * starting where the previous one ends, in one reservation) are unmapped with one system call
 * per run. Only the kernel can fail after the checks (ENOMEM splitting a VMA); a failed run is
 * retried entry by entry, and on a failure the entries already unmapped are mapped back.
 * Deferred-freed handles whose last mapping goes are released once the batch has succeeded,
 * so the rollback can map them back. */
int hv_unmap_batch(hv_pool *p, const uint64_t *vas, uint64_t n, uint64_t *failed) {
    if (n == 0) return 0;
    uint64_t *undone = NULL; /* claimed entries, then unmapped handles (the entry path) */
    pthread_mutex_lock(&p->mu);
    int rc = 0;
    uint64_t i = 0;
    char saved[sizeof hv_err];
    if (n > 1 && granule_run_end(p, vas, NULL, 0, n) == n) {
        /* one run of adjacent one-granule mappings (the pool's pages): checked in one pass,
         * one system call; a deferred-freed handle is released after it, as below */
        hv_resv *r = find_resv(p, vas[0]);
        uint64_t pending = 0;
        int single = 0;
        if (r && check_unmap_run_locked(p, vas[0], n << p->gshift, 0, &pending, &single) == 0 &&
            single && unmap_range(vas[0], n << p->gshift) == 0) {
            uint64_t first = (vas[0] - r->va) >> p->gshift;
            if (!pending) {
                record_unmap_single_run_locked(p, r, first, n);
            } else {
                for (uint64_t k = 0; k < n; k++)
                    record_unmap_locked(p, r, first + k, r->ent[first + k] & ~HV_START_BIT, 0);
            }
            goto out;
        }
        /* a check failed (nothing changed) or the kernel refused the one call: entry by entry */
    }
    undone = malloc(n * sizeof *undone);
    if (!undone) {
        if (failed) *failed = 0;
        rc = fail(ENOMEM, "out of host memory for the batch rollback record");
        goto out;
    }
    for (; i < n; i++) {
        uint64_t *e = NULL;
        rc = check_unmap_locked(p, vas[i], &e);
        if (rc) break;
        *e |= HV_CLAIM_BIT;
        undone[i] = (uint64_t)(uintptr_t)e;
    }
    for (uint64_t j = 0; j < i; j++) *(uint64_t *)(uintptr_t)undone[j] &= ~HV_CLAIM_BIT;
    if (rc) {
        memcpy(saved, hv_err, sizeof saved);
        snprintf(hv_err, sizeof hv_err, "batch entry %llu of %llu: %s (nothing was unmapped)",
                 (unsigned long long)i, (unsigned long long)n, saved);
        if (failed) *failed = i;
        goto out;
    }
    for (i = 0; i < n && !rc;) {
        hv_resv *r, *r2;
        uint64_t first, handle, f2, h2;
        find_mapping_locked(p, vas[i], &r, &first, &handle); /* checked above */
        uint64_t total = p->hpages[(handle >> p->gshift)] * p->granule, j = i + 1;
        while (j < n && vas[j] == vas[i] + total &&
               find_mapping_locked(p, vas[j], &r2, &f2, &h2) == 0 && r2 == r) {
            total += p->hpages[(h2 >> p->gshift)] * p->granule;
            j++;
        }
        if (j - i > 1 && unmap_range(vas[i], total) == 0) {
            for (uint64_t k = i; k < j; k++) {
                find_mapping_locked(p, vas[k], &r2, &f2, &h2);
                record_unmap_locked(p, r2, f2, h2, 1);
                undone[k] = h2;
            }
            i = j;
            continue;
        }
        for (; i < j; i++) { /* one entry (or the run's system call failed): one by one */
            rc = unmap_locked(p, vas[i], &undone[i], 1);
            if (rc) break;
        }
    }
    if (rc) {
        memcpy(saved, hv_err, sizeof saved);
        uint64_t left = 0; /* entries the kernel would not map back */
        for (uint64_t j = i; j-- > 0;) left += map_locked(p, vas[j], undone[j], 1) != 0;
        snprintf(hv_err, sizeof hv_err, "batch entry %llu of %llu: %s%s", (unsigned long long)i,
                 (unsigned long long)n, saved,
                 left ? " (and the rollback could not map every earlier entry back)" : "");
        if (failed) *failed = i;
    }
    /* deferred-freed handles left with no mapping (all of them on success) are released now */
    for (uint64_t j = 0; j < i; j++) release_unmapped(p, (undone[j] >> p->gshift));
out:
    pthread_mutex_unlock(&p->mu);
    free(undone);
    return rc;
}

/* ---- run records ------------------------------------------------------------------------ */

/* A run is checked, mapped and recorded with one pass over its pages when every handle in it
 * is one granule (the common case: the pool's 2 MiB pages): no loop-carried dependency, the
 * counters updated once per run. Runs with larger handles take the general walk. */

/* Caller holds the lock. Checks run (va, off, size) of hv_map_runs: the live handles tiling
 * [off, off+size) of the memfd, mapped whole at va + (offset - off), in one reservation over
 * unmapped pages, under the mapping cap. No side effect. *count = handles, *fresh = 1 when
 * one was never mapped (populate writes then), *single = 1 when every handle is one granule. */
static int check_map_run_locked(hv_pool *p, uint64_t va, uint64_t off, uint64_t size,
                                hv_resv **r_out, uint64_t *first_out, uint64_t *count,
                                int *fresh, int *single) {
    if (size == 0 || size & p->gmask || va & p->gmask || off & p->gmask)
        return fail(EINVAL, "run at %#llx of %llu bytes from handle %#llx is not a positive, "
                    "aligned multiple of the granularity %llu", (unsigned long long)va,
                    (unsigned long long)size, (unsigned long long)off, (unsigned long long)p->granule);
    hv_resv *r = find_resv(p, va);
    if (!r) return fail(EFAULT, "map address %#llx is not inside a reservation", (unsigned long long)va);
    uint64_t first = (va - r->va) >> p->gshift, pages = size >> p->gshift, slot0 = off >> p->gshift;
    if (pages > r->npages - first)
        return fail(EINVAL, "run of %llu bytes at %#llx runs past the end of its reservation "
                    "[%#llx, %#llx)", (unsigned long long)size, (unsigned long long)va,
                    (unsigned long long)r->va, (unsigned long long)(r->va + r->size));
    const uint64_t *e = &r->ent[first];
    uint64_t n = 0, busy = 0, bad = 0;
    int stale = 0;
    if (slot0 != 0 && slot0 < p->end_slot && pages <= p->end_slot - slot0) {
        const uint32_t *hp = &p->hpages[slot0];
        const uint8_t *hf = &p->hflags[slot0];
        /* independent checks, eight pages per step read as 64-bit words (two page counts or
         * eight flag bytes per word), the rest one by one */
        const uint64_t ones = 0x0000000100000001ull, bytes = 0x0101010101010101ull;
        uint64_t i = 0, hbad = 0, fany = 0, fall = ~0ull;
        for (; i + 8 <= pages; i += 8) {
            uint64_t f, h[4];
            memcpy(&f, hf + i, sizeof f);
            memcpy(h, hp + i, sizeof h);
            hbad |= (h[0] ^ ones) | (h[1] ^ ones) | (h[2] ^ ones) | (h[3] ^ ones);
            fany |= f;
            fall &= f;
            busy |= e[i] | e[i + 1] | e[i + 2] | e[i + 3] | e[i + 4] | e[i + 5] | e[i + 6] | e[i + 7];
        }
        bad = hbad | (fany & (bytes * HV_PENDING_FREE));
        stale = (fall & (bytes * HV_USED)) != bytes * HV_USED;
        for (; i < pages; i++) {
            bad |= (uint64_t)(hp[i] != 1) | (hf[i] & HV_PENDING_FREE);
            stale |= !(hf[i] & HV_USED);
            busy |= e[i];
        }
    } else {
        bad = 1;
    }
    *single = !bad;
    if (bad) { /* handles of several granules, or an invalid one: the general walk says which */
        stale = 0;
        for (uint64_t pg = 0; pg < pages;) {
            uint64_t h = off + (pg << p->gshift), slot = handle_slot(p, h);
            if (slot == UINT64_MAX || (p->hflags[slot] & HV_PENDING_FREE))
                return fail(EBADF, "unknown handle %#llx (never created, or already freed) in the "
                            "run at %#llx", (unsigned long long)h, (unsigned long long)va);
            uint64_t hpg = p->hpages[slot];
            if (hpg > pages - pg)
                return fail(EINVAL, "handle %#llx of %llu bytes runs past the end of the run at "
                            "%#llx (%llu bytes)", (unsigned long long)h,
                            (unsigned long long)(hpg << p->gshift), (unsigned long long)va,
                            (unsigned long long)size);
            stale |= !(p->hflags[slot] & HV_USED);
            pg += hpg;
            n++;
        }
        for (uint64_t i = 0; i < pages; i++) busy |= e[i];
    } else {
        n = pages;
    }
    if (busy)
        for (uint64_t i = 0; i < pages; i++)
            if (e[i])
                return fail(EEXIST, "address %#llx is already mapped; unmap it first",
                            (unsigned long long)(va + (i << p->gshift)));
    if (p->max_mappings && p->nmappings + n > p->max_mappings)
        return fail(ENOMEM, "mapping limit of %llu mappings reached (it keeps the process under "
                    "vm.max_map_count); use larger handles or raise the limit",
                    (unsigned long long)p->max_mappings);
    *r_out = r;
    *first_out = first;
    *count = n;
    *fresh = stale;
    return 0;
}

/* Caller holds the lock: the bookkeeping of a mapped run (``single``: one-granule handles). */
static void record_map_run_locked(hv_pool *p, hv_resv *r, uint64_t first, uint64_t off,
                                  uint64_t pages, uint64_t count, int single) {
    if (!single) {
        for (uint64_t pg = 0; pg < pages;) {
            uint64_t slot = (off >> p->gshift) + pg;
            record_map_locked(p, r, first + pg, slot, off + (pg << p->gshift));
            pg += p->hpages[slot];
        }
        return;
    }
    /* locals and restrict: the stores cannot alias the pool's fields (no reload per page) */
    const uint64_t sh = p->gshift, slot0 = off >> sh;
    uint64_t *restrict e = &r->ent[first];
    uint32_t *restrict hm = &p->hmaps[slot0];
    uint8_t *restrict hf = &p->hflags[slot0];
    for (uint64_t i = 0; i < pages; i++) e[i] = (off + (i << sh)) | HV_START_BIT;
    uint64_t i = 0; /* the counters and flags eight pages per step as 64-bit words */
    for (; i + 8 <= pages; i += 8) {
        uint64_t m[4], f;
        memcpy(m, hm + i, sizeof m);
        memcpy(&f, hf + i, sizeof f);
        for (int k = 0; k < 4; k++) m[k] += 0x0000000100000001ull; /* < 2^32 mappings each */
        f |= 0x0101010101010101ull * HV_USED;
        memcpy(hm + i, m, sizeof m);
        memcpy(hf + i, &f, sizeof f);
    }
    for (; i < pages; i++) {
        hm[i]++;
        hf[i] |= HV_USED;
    }
    r->mapped_pages += pages;
    p->mapped += pages << p->gshift;
    p->nmappings += count;
}

/* Caller holds the lock: maps back, from its page-table entries (left as they were), every
 * mapping of [va, va+size) that the kernel unmapped. Returns how many could not be. */
static uint64_t remap_from_entries(hv_pool *p, hv_resv *r, uint64_t va, uint64_t size) {
    uint64_t first = (va - r->va) >> p->gshift, pages = size >> p->gshift, left = 0;
    for (uint64_t pg = 0; pg < pages;) {
        uint64_t h = r->ent[first + pg] & ~HV_START_BIT, hp = p->hpages[h >> p->gshift];
        left += mmap_range(p, va + (pg << p->gshift), hp << p->gshift, h, 0) != 0;
        pg += hp ? hp : 1;
    }
    return left;
}

int hv_map_runs(hv_pool *p, const uint64_t *runs, uint64_t n, uint64_t *failed) {
    pthread_mutex_lock(&p->mu);
    int rc = 0;
    uint64_t k = 0;
    for (; k < n; k++) {
        uint64_t va = runs[3 * k], off = runs[3 * k + 1], size = runs[3 * k + 2], first = 0, count = 0;
        hv_resv *r = NULL;
        int fresh = 0, single = 0;
        rc = check_map_run_locked(p, va, off, size, &r, &first, &count, &fresh, &single);
        if (!rc) rc = mmap_range(p, va, size, off, p->populate && fresh && !p->no_populate_write);
        if (rc) break;
        record_map_run_locked(p, r, first, off, size >> p->gshift, count, single);
    }
    if (rc) {
        char saved[sizeof hv_err];
        memcpy(saved, hv_err, sizeof saved);
        uint64_t left = 0; /* mappings the kernel would not unmap again (ENOMEM on a VMA split) */
        for (uint64_t j = k; j-- > 0;) {
            uint64_t va = runs[3 * j], pages = runs[3 * j + 2] >> p->gshift;
            hv_resv *r = find_resv(p, va);
            uint64_t first = (va - r->va) >> p->gshift;
            if (unmap_range(va, runs[3 * j + 2]) == 0) {
                for (uint64_t pg = 0; pg < pages;) {
                    uint64_t h = r->ent[first + pg] & ~HV_START_BIT, hp = p->hpages[h >> p->gshift];
                    record_unmap_locked(p, r, first + pg, h, 0);
                    pg += hp;
                }
            } else {
                for (uint64_t pg = pages; pg-- > 0;)
                    if (r->ent[first + pg] & HV_START_BIT)
                        left += unmap_locked(p, va + (pg << p->gshift), NULL, 0) != 0;
            }
        }
        snprintf(hv_err, sizeof hv_err, "run %llu of %llu: %s%s", (unsigned long long)k,
                 (unsigned long long)n, saved,
                 left ? " (and the rollback could not unmap every earlier run)" : "");
        if (failed) *failed = k;
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Caller holds the lock. Checks run (va, size) of hv_unmap_runs: inside one reservation and
 * tiled exactly by mappings; with ``claim`` (several runs in the call) none of them claimed by
 * an earlier run, and claims their first pages (HV_CLAIM_BIT, cleared by the caller).
 * *pending += how many of their handles are deferred-freed; *single = every mapping is one
 * granule. */
static int check_unmap_run_locked(hv_pool *p, uint64_t va, uint64_t size, int claim,
                                  uint64_t *pending, int *single) {
    if (size == 0 || size & p->gmask || va & p->gmask)
        return fail(EINVAL, "unmap run at %#llx of %llu bytes is not a positive, aligned multiple "
                    "of the granularity %llu", (unsigned long long)va, (unsigned long long)size,
                    (unsigned long long)p->granule);
    hv_resv *r = find_resv(p, va);
    if (!r) return fail(EFAULT, "unmap address %#llx is not inside a reservation", (unsigned long long)va);
    uint64_t first = (va - r->va) >> p->gshift, pages = size >> p->gshift;
    if (pages > r->npages - first)
        return fail(EINVAL, "unmap run of %llu bytes at %#llx runs past the end of its reservation",
                    (unsigned long long)size, (unsigned long long)va);
    uint64_t *e = &r->ent[first], bad = 0, pend = 0;
    if (!claim && p->cap_slots) { /* one pass, no dependency: every page starts a one-granule
                                    * mapping (no handle table yet: nothing can be mapped) */
        const uint64_t sh = p->gshift, e0 = e[0], s0 = (e0 & ~HV_START_BIT) >> sh;
        uint64_t step = 0;
        for (uint64_t i = 0; i < pages; i++) step |= e[i] ^ (e0 + (i << sh));
        if (!step && (e0 & HV_START_BIT) && s0 < p->end_slot && pages <= p->end_slot - s0 &&
            !(pages & 7)) {
            /* each page starts the handle after the previous one's (a run mapped together):
             * their table rows are contiguous, read eight per step as 64-bit words */
            const uint32_t *hp = &p->hpages[s0];
            const uint8_t *hf = &p->hflags[s0];
            uint64_t hbad = 0, fany = 0;
            for (uint64_t i = 0; i < pages; i += 8) {
                uint64_t f, h[4];
                memcpy(&f, hf + i, sizeof f);
                memcpy(h, hp + i, sizeof h);
                hbad |= (h[0] ^ 0x0000000100000001ull) | (h[1] ^ 0x0000000100000001ull) |
                        (h[2] ^ 0x0000000100000001ull) | (h[3] ^ 0x0000000100000001ull);
                fany |= f;
            }
            bad = hbad;
            if (fany & (0x0101010101010101ull * HV_PENDING_FREE))
                for (uint64_t i = 0; i < pages; i++) pend += (hf[i] & HV_PENDING_FREE) != 0;
        } else {
            for (uint64_t i = 0; i < pages; i++) {
                uint64_t v = e[i], slot = (v & ~HV_START_BIT) >> sh;
                bad |= (uint64_t)!(v & HV_START_BIT) | (uint64_t)(p->hpages[slot] != 1);
                pend += (p->hflags[slot] & HV_PENDING_FREE) != 0;
            }
        }
        if (!bad) {
            *single = 1;
            *pending += pend;
            return 0;
        }
    }
    *single = 0;
    for (uint64_t pg = 0; pg < pages;) {
        uint64_t v = e[pg];
        if (v & HV_CLAIM_BIT)
            return fail(ENOENT, "address %#llx is listed twice in the batch",
                        (unsigned long long)(va + (pg << p->gshift)));
        if (!(v & HV_START_BIT))
            return fail(ENOENT, v ? "address %#llx is inside a mapping but not its start"
                                  : "address %#llx is not mapped",
                        (unsigned long long)(va + (pg << p->gshift)));
        uint64_t slot = (v & ~HV_START_BIT) >> p->gshift, hp = p->hpages[slot];
        if (hp > pages - pg)
            return fail(EINVAL, "the mapping at %#llx runs past the end of the unmap run at %#llx "
                        "(%llu bytes)", (unsigned long long)(va + (pg << p->gshift)),
                        (unsigned long long)va, (unsigned long long)size);
        if (claim) e[pg] = v | HV_CLAIM_BIT;
        *pending += (p->hflags[slot] & HV_PENDING_FREE) != 0;
        pg += hp;
    }
    return 0;
}

static void unclaim_runs_locked(hv_pool *p, const uint64_t *runs, uint64_t n) {
    for (uint64_t k = 0; k < n; k++) {
        hv_resv *r = find_resv(p, runs[2 * k]);
        if (!r) continue;
        uint64_t first = (runs[2 * k] - r->va) >> p->gshift;
        uint64_t pages = runs[2 * k + 1] >> p->gshift;
        if (pages > r->npages - first) pages = r->npages - first;
        for (uint64_t i = 0; i < pages; i++) r->ent[first + i] &= ~HV_CLAIM_BIT;
    }
}

/* Caller holds the lock: the bookkeeping of an unmapped run whose mappings are all one
 * granule and none deferred-freed (checked). */
static void record_unmap_single_run_locked(hv_pool *p, hv_resv *r, uint64_t first,
                                           uint64_t pages) {
    uint64_t *restrict e = &r->ent[first];
    uint32_t *restrict hm = p->hmaps;
    const uint64_t sh = p->gshift;
    for (uint64_t i = 0; i < pages; i++) {
        hm[(e[i] & ~HV_START_BIT) >> sh]--;
        e[i] = 0;
    }
    r->mapped_pages -= pages;
    p->mapped -= pages << p->gshift;
    p->nmappings -= pages;
}

/* Caller holds the lock: unmaps the mappings of run [va, va+size) (checked) mapping by
 * mapping, after the run's one system call failed. On failure maps back what it unmapped and
 * returns the error; the page-table entries are not changed either way. */
static int unmap_run_one_by_one(hv_pool *p, hv_resv *r, uint64_t va, uint64_t size) {
    uint64_t first = (va - r->va) >> p->gshift, pages = size >> p->gshift;
    for (uint64_t pg = 0; pg < pages;) {
        uint64_t h = r->ent[first + pg] & ~HV_START_BIT, hp = p->hpages[h >> p->gshift];
        int rc = unmap_range(va + (pg << p->gshift), hp << p->gshift);
        if (rc) {
            char saved[sizeof hv_err];
            memcpy(saved, hv_err, sizeof saved);
            if (pg) remap_from_entries(p, r, va, pg << p->gshift);
            memcpy(hv_err, saved, sizeof saved);
            return rc;
        }
        pg += hp;
    }
    return 0;
}

int hv_unmap_runs(hv_pool *p, const uint64_t *runs, uint64_t n, uint64_t *failed) {
    pthread_mutex_lock(&p->mu);
    int rc = 0, claim = n > 1, all_single = 1;
    uint64_t k = 0, pending = 0;
    char saved[sizeof hv_err];
    for (; k < n; k++) { /* every run checked before anything is unmapped */
        int single = 0;
        rc = check_unmap_run_locked(p, runs[2 * k], runs[2 * k + 1], claim, &pending, &single);
        if (rc) break;
        all_single &= single;
    }
    if (claim) unclaim_runs_locked(p, runs, rc ? k + 1 : n);
    if (rc) {
        memcpy(saved, hv_err, sizeof saved);
        snprintf(hv_err, sizeof hv_err, "run %llu of %llu: %s (nothing was unmapped)",
                 (unsigned long long)k, (unsigned long long)n, saved);
        if (failed) *failed = k;
        goto out;
    }
    /* the system calls first, the bookkeeping once all succeeded: a failure maps the earlier
     * runs back from their page-table entries, which are still intact */
    for (k = 0; k < n; k++) {
        uint64_t va = runs[2 * k], size = runs[2 * k + 1];
        if (unmap_range(va, size) == 0) continue;
        rc = unmap_run_one_by_one(p, find_resv(p, va), va, size);
        if (rc) break;
    }
    if (rc) {
        memcpy(saved, hv_err, sizeof saved);
        uint64_t left = 0; /* mappings the kernel would not map back */
        for (uint64_t j = k; j-- > 0;)
            left += remap_from_entries(p, find_resv(p, runs[2 * j]), runs[2 * j], runs[2 * j + 1]);
        snprintf(hv_err, sizeof hv_err, "run %llu of %llu: %s%s", (unsigned long long)k,
                 (unsigned long long)n, saved,
                 left ? " (and the rollback could not map every earlier mapping back)" : "");
        if (failed) *failed = k;
        goto out;
    }
    for (k = 0; k < n; k++) {
        uint64_t va = runs[2 * k], pages = runs[2 * k + 1] >> p->gshift;
        hv_resv *r = find_resv(p, va);
        uint64_t first = (va - r->va) >> p->gshift;
        if (all_single && !pending) {
            record_unmap_single_run_locked(p, r, first, pages);
            continue;
        }
        for (uint64_t pg = 0; pg < pages;) { /* releases deferred-freed handles as it goes */
            uint64_t h = r->ent[first + pg] & ~HV_START_BIT, hp = p->hpages[h >> p->gshift];
            record_unmap_locked(p, r, first + pg, h, 0);
            pg += hp;
        }
    }
out:
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int hv_map_prepared(hv_prepared *b) {
    if (!b->pool) return fail(EBADF, "the prepared batch's pool is closed");
    return hv_map_runs(b->pool, b->maps, b->nmaps, &b->failed);
}

int hv_unmap_prepared(hv_prepared *b) {
    if (!b->pool) return fail(EBADF, "the prepared batch's pool is closed");
    return hv_unmap_runs(b->pool, b->unmaps, b->nunmaps, &b->failed);
}

/* Caller holds the lock. */
static int check_mapped_locked(hv_pool *p, uint64_t va, uint64_t len) {
    uint64_t end = va + len, cur = va;
    if (end < va) return fail(EINVAL, "range at %#llx of %llu bytes wraps around",
                              (unsigned long long)va, (unsigned long long)len);
    while (cur < end) {
        hv_resv *r = find_resv(p, cur);
        if (!r) return fail(EFAULT, "address %#llx is not inside a reservation", (unsigned long long)cur);
        uint64_t page = ((cur - r->va) >> p->gshift);
        if (!r->ent[page]) return fail(ENOENT, "address %#llx is not mapped", (unsigned long long)cur);
        cur = r->va + (page + 1) * p->granule;
    }
    return 0;
}

int hv_check_mapped(hv_pool *p, uint64_t va, uint64_t len) {
    if (len == 0) return 0;
    pthread_mutex_lock(&p->mu);
    int rc = check_mapped_locked(p, va, len);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int hv_copy_batch_checked(hv_pool *p, const uint64_t *dsts, const uint64_t *srcs,
                          const uint64_t *sizes, uint64_t n, int check_dst, int check_src,
                          uint64_t *failed) {
    if (check_dst || check_src) {
        pthread_mutex_lock(&p->mu);
        for (uint64_t i = 0; i < n; i++) {
            int rc = 0;
            if (sizes[i] && check_dst) rc = check_mapped_locked(p, dsts[i], sizes[i]);
            if (!rc && sizes[i] && check_src) rc = check_mapped_locked(p, srcs[i], sizes[i]);
            if (rc) {
                char saved[sizeof hv_err];
                memcpy(saved, hv_err, sizeof saved);
                snprintf(hv_err, sizeof hv_err, "copy %llu of %llu (%s side): %s",
                         (unsigned long long)i, (unsigned long long)n,
                         check_dst && check_mapped_locked(p, dsts[i], sizes[i]) ? "destination" : "source",
                         saved);
                if (failed) *failed = i;
                pthread_mutex_unlock(&p->mu);
                return rc;
            }
        }
        pthread_mutex_unlock(&p->mu);
    }
    hv_copy_batch(dsts, srcs, sizes, n);
    return 0;
}

/* ---- copies and host buffers -------------------------------------------------------------- */

void hv_copy(uint64_t dst, uint64_t src, uint64_t n) { memmove((void *)dst, (const void *)src, n); }

void hv_copy_batch(const uint64_t *dsts, const uint64_t *srcs, const uint64_t *sizes, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) memcpy((void *)dsts[i], (const void *)srcs[i], sizes[i]);
}

int hv_host_alloc(uint64_t size, uint64_t *ptr_out) {
    if (size == 0) return fail(EINVAL, "host buffer size must be positive");
    /* populated: the buffer's memory is committed now (the driver checked it fits) */
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        return fail(e == ENOMEM ? ENOMEM : e, "allocating a host buffer of %llu bytes failed: %s",
                    (unsigned long long)size, strerror(e));
    }
    *ptr_out = (uint64_t)m;
    return 0;
}

int hv_host_free(uint64_t ptr, uint64_t size) {
    if (munmap((void *)ptr, size) != 0) {
        int e = errno;
        return fail(e, "freeing the host buffer at %#llx failed: %s", (unsigned long long)ptr, strerror(e));
    }
    return 0;
}

int hv_bench_raw_map_unmap_coalesced(int fd, uint64_t va, const uint64_t *offs, uint64_t n,
                                     uint64_t page, uint64_t rounds, int populate) {
    int flags = MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0);
    for (uint64_t k = 0; k < rounds; k++) {
        for (uint64_t i = 0, j; i < n; i = j) { /* one mmap per run contiguous in offset */
            for (j = i + 1; j < n && offs[j] == offs[i] + (j - i) * page; j++) {}
            if (mmap((void *)(va + i * page), (j - i) * page, PROT_READ | PROT_WRITE, flags, fd,
                     (off_t)offs[i]) == MAP_FAILED)
                return fail(errno, "raw mmap failed: %s", strerror(errno));
        }
        if (mmap((void *)va, n * page, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
            return fail(errno, "raw re-reserve failed: %s", strerror(errno));
    }
    return 0;
}

int hv_bench_raw_map_unmap_at(int fd, const uint64_t *vas, const uint64_t *offs, uint64_t n,
                              uint64_t page, uint64_t rounds, int populate) {
    int flags = MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0);
    for (uint64_t k = 0; k < rounds; k++) {
        for (uint64_t i = 0; i < n; i++)
            if (mmap((void *)vas[i], page, PROT_READ | PROT_WRITE, flags, fd, (off_t)offs[i]) ==
                MAP_FAILED)
                return fail(errno, "raw mmap failed: %s", strerror(errno));
        for (uint64_t i = 0; i < n; i++)
            if (mmap((void *)vas[i], page, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
                return fail(errno, "raw re-reserve failed: %s", strerror(errno));
    }
    return 0;
}

int hv_bench_raw_map_unmap(int fd, uint64_t va, const uint64_t *offs, uint64_t n, uint64_t page,
                           uint64_t rounds, int populate) {
    int flags = MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0);
    for (uint64_t k = 0; k < rounds; k++) {
        for (uint64_t i = 0; i < n; i++)
            if (mmap((void *)(va + i * page), page, PROT_READ | PROT_WRITE, flags, fd,
                     (off_t)offs[i]) == MAP_FAILED)
                return fail(errno, "raw mmap failed: %s", strerror(errno));
        for (uint64_t i = 0; i < n; i++)
            if (mmap((void *)(va + i * page), page, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
                return fail(errno, "raw re-reserve failed: %s", strerror(errno));
    }
    return 0;
}
