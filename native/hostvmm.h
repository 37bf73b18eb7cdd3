/* hostvmm: VMM primitives over host memory (Linux memfd + mmap).
 *
 * One pool = one memfd. A physical *handle* is a byte offset into that memfd (never 0: the
 * first granule of the file is never handed out), committed eagerly with fallocate so that a
 * lack of memory is an error code now rather than SIGBUS or the OOM killer later, and freed by
 * punching a hole. A *reservation* is a PROT_NONE/MAP_NORESERVE anonymous range aligned to the
 * granule. Mapping a handle replaces part of a reservation with MAP_SHARED|MAP_FIXED of the
 * memfd; unmapping re-maps PROT_NONE anonymous memory over it, so the range stays reserved.
 *
 * The pool keeps its own table of reservations, handles and mappings and refuses misuse that a
 * device would refuse (MAP_FIXED would silently replace). Handles are always mapped whole.
 *
 * Every function returning int returns 0 on success or a positive errno-style code:
 *   EINVAL  misuse: zero/unaligned size or address, size mismatch
 *   EFAULT  address not inside any reservation of this pool
 *   EBADF   unknown handle (never created, already freed, or pending free)
 *   EEXIST  mapping onto a range that already has a mapping
 *   ENOENT  unmapping an address that is not the start of a mapping
 *   EBUSY   releasing a reservation with mappings / freeing a mapped handle
 *   ENOMEM  out of memory (the configured limit, fallocate ENOSPC/ENOMEM, or mmap ENOMEM)
 *   other   errno of a failed system call
 * and leaves a human-readable message for the calling thread in hv_last_error().
 * All sizes and addresses are bytes. Thread-safe: one mutex per pool (copies take no lock).
 */
#ifndef XLLM_HOSTVMM_H
#define XLLM_HOSTVMM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hv_pool hv_pool;

/* Statistics filled by hv_stats, in this order (bytes unless named otherwise). */
enum {
    HV_STAT_COMMITTED = 0,   /* bytes of live handles (fallocated) */
    HV_STAT_HANDLES,         /* number of live handles */
    HV_STAT_RESERVATIONS,    /* number of reservations */
    HV_STAT_RESERVED,        /* bytes reserved */
    HV_STAT_MAPPED,          /* bytes mapped (a handle mapped twice counts twice) */
    HV_STAT_MAPPINGS,        /* number of mappings */
    HV_STAT_LIMIT,           /* configured limit on committed bytes, 0 = none */
    HV_STAT_FILE_END,        /* end of the used offset range of the memfd */
    HV_STAT_MAX_MAPPINGS,    /* cap on live mappings, 0 = none */
    HV_STAT_RELEASE_PENDING, /* deferred-freed handles whose release failed, retried later */
    HV_STAT_BACKING,         /* HV_BACKING_* of the pool's memfd */
    HV_STAT_COUNT
};

/* What the pool's memfd pages are (hv_pool_open_backed). */
enum {
    HV_BACKING_SMALL = 0,   /* 4 KiB shmem pages (hv_pool_open) */
    HV_BACKING_HUGETLB = 1, /* memfd_create(MFD_HUGETLB|MFD_HUGE_2MB): needs vm.nr_hugepages;
                             * ENOMEM once the free huge pages run out */
    HV_BACKING_THP = 2      /* shmem transparent huge pages: handles are committed through a
                             * MADV_HUGEPAGE scratch mapping (needs shmem_enabled advise/always;
                             * the kernel falls back to 4 KiB pages where it finds no 2 MiB one) */
};

const char *hv_last_error(void);

int hv_pool_open(hv_pool **out, uint64_t granule, uint64_t limit);
/* hv_pool_open with the memfd backed by ``backing`` (HV_BACKING_*); huge-page backings need a
 * granule that is a multiple of 2 MiB. Handles, maps and hole-punching frees work the same on
 * every backing (2 MiB-aligned, so whole huge pages). */
int hv_pool_open_backed(hv_pool **out, uint64_t granule, uint64_t limit, int backing);
void hv_pool_close(hv_pool *p);
int hv_pool_fd(hv_pool *p);
uint64_t hv_granule(hv_pool *p);
void hv_stats(hv_pool *p, uint64_t *out);
void hv_set_limit(hv_pool *p, uint64_t limit);
/* Cap on live mappings (ENOMEM beyond it), 0 = none. */
void hv_set_max_mappings(hv_pool *p, uint64_t max_mappings);
/* Populate new mappings: 1 = on, 0 = off (the default). The page tables of a mapped handle are
 * filled at map time, so the first writes into a freshly mapped page take no page faults: the
 * first map of a handle uses madvise(MADV_POPULATE_WRITE) (Linux >= 5.14; it also zeroes the
 * fallocated pages), later maps MAP_POPULATE (read fault-around, 16 pages per fault; on older
 * kernels every map). Best effort: a page that could not be populated faults later as usual. */
void hv_set_populate(hv_pool *p, int on);

int hv_create(hv_pool *p, uint64_t size, uint64_t *handle_out);
int hv_free(hv_pool *p, uint64_t handle);
/* Free now if unmapped, else free when the last mapping goes (ACL/CUDA release semantics). */
int hv_free_deferred(hv_pool *p, uint64_t handle);
int hv_handle_info(hv_pool *p, uint64_t handle, uint64_t *size, uint64_t *mapcount);

int hv_reserve(hv_pool *p, uint64_t size, uint64_t *va_out);
/* size 0: release whatever was reserved at va (ACL); otherwise it must equal the reserved size. */
int hv_release(hv_pool *p, uint64_t va, uint64_t size);
int hv_reservation_size(hv_pool *p, uint64_t va, uint64_t *size);

int hv_map(hv_pool *p, uint64_t va, uint64_t handle);
int hv_unmap(hv_pool *p, uint64_t va, uint64_t *handle_out);
/* All or nothing: on failure every mapping this call made is undone; *failed = index.
 * Entries contiguous in address and memfd offset are mapped with one mmap per run (and
 * hv_unmap_batch unmaps adjacent mappings with one call per run); the bookkeeping stays per
 * handle, so each entry is still unmapped, checked and rolled back on its own. Runs are found
 * in C by a scan of the arrays; a run of one-granule handles (and an unmap batch that is one
 * run of one-granule mappings) is checked and recorded in one pass, as hv_map_runs does. */
int hv_map_batch(hv_pool *p, const uint64_t *vas, const uint64_t *handles, uint64_t n,
                 uint64_t *failed);
/* All or nothing: every entry is checked first (a start of a mapping, none listed twice), so
 * misuse unmaps nothing; a kernel failure after that re-maps what this call unmapped. A handle
 * freed with hv_free_deferred is released only once the batch has succeeded. */
int hv_unmap_batch(hv_pool *p, const uint64_t *vas, uint64_t n, uint64_t *failed);
/* Run records: the batched calls with one record per run instead of one entry per handle.
 * ``runs`` holds ``n`` triples (va, handle, size): the live handles that tile
 * [handle, handle+size) of the memfd (contiguous handles, each mapped whole) are mapped at
 * va + (their offset - handle) with one mmap per run; the bookkeeping stays per handle (each
 * can be unmapped on its own later). All or nothing: on failure every run this call mapped is
 * unmapped again; *failed = the run's index. */
int hv_map_runs(hv_pool *p, const uint64_t *runs, uint64_t n, uint64_t *failed);
/* ``runs`` holds ``n`` pairs (va, size): unmaps every mapping in [va, va+size), which must be
 * tiled exactly by mappings (none listed twice), with one system call per run. All or nothing
 * as hv_unmap_batch: every run is checked before anything is unmapped; a kernel failure after
 * that maps back what this call unmapped; deferred-freed handles are released at the end. */
int hv_unmap_runs(hv_pool *p, const uint64_t *runs, uint64_t n, uint64_t *failed);
/* A prepared run batch: the arguments of hv_map_runs and hv_unmap_runs for one layout in one
 * struct, so that a caller through ctypes passes one prebuilt pointer per call and converts
 * nothing (each argument converted costs tens of nanoseconds, a whole run's bookkeeping about
 * as much). ``pool`` NULL (its owner closed the pool) is EBADF. ``failed`` receives the failing
 * run's index. The arrays are read, never written. */
typedef struct {
    hv_pool *pool;
    const uint64_t *maps;   /* nmaps (va, handle, size) triples for hv_map_runs */
    uint64_t nmaps;
    const uint64_t *unmaps; /* nunmaps (va, size) pairs for hv_unmap_runs */
    uint64_t nunmaps;
    uint64_t failed;
} hv_prepared;
/* hv_map_runs(b->pool, b->maps, b->nmaps, &b->failed). */
int hv_map_prepared(hv_prepared *b);
/* hv_unmap_runs(b->pool, b->unmaps, b->nunmaps, &b->failed). */
int hv_unmap_prepared(hv_prepared *b);

/* 0 when every byte of [va, va+len) lies in mapped pages of this pool, else ENOENT/EFAULT. */
int hv_check_mapped(hv_pool *p, uint64_t va, uint64_t len);

/* Checks that every device-side range (dst when check_dst, src when check_src) is mapped in
 * this pool, then copies with no lock held. Nothing is copied when a check fails. The caller
 * must keep the ranges mapped until the call returns. */
int hv_copy_batch_checked(hv_pool *p, const uint64_t *dsts, const uint64_t *srcs,
                          const uint64_t *sizes, uint64_t n, int check_dst, int check_src,
                          uint64_t *failed);
void hv_copy(uint64_t dst, uint64_t src, uint64_t n);
void hv_copy_batch(const uint64_t *dsts, const uint64_t *srcs, const uint64_t *sizes, uint64_t n);

/* Anonymous page-aligned host buffer (the host "pinned" buffer). */
int hv_host_alloc(uint64_t size, uint64_t *ptr_out);
int hv_host_free(uint64_t ptr, uint64_t size);

/* Benchmark baseline: the same system calls as hv_map/hv_unmap with no bookkeeping.
 * Maps offs[i] at va + i*page then unmaps, for every i, `rounds` times; `populate` adds
 * MAP_POPULATE to the maps, as hv_set_populate does for the pool. */
int hv_bench_raw_map_unmap(int fd, uint64_t va, const uint64_t *offs, uint64_t n, uint64_t page,
                           uint64_t rounds, int populate);
/* The same at explicit addresses: maps offs[i] at vas[i] then unmaps each (one system call
 * per page each way, whatever the layout). */
int hv_bench_raw_map_unmap_at(int fd, const uint64_t *vas, const uint64_t *offs, uint64_t n,
                              uint64_t page, uint64_t rounds, int populate);
/* The same with one mmap per run of offsets contiguous in the memfd (one call for contiguous
 * pages) and one re-reserving mmap for the whole range: the limit a batch can reach when its
 * pages are contiguous in address and memfd offset. */
int hv_bench_raw_map_unmap_coalesced(int fd, uint64_t va, const uint64_t *offs, uint64_t n,
                                     uint64_t page, uint64_t rounds, int populate);

#ifdef __cplusplus
}
#endif
#endif
