/* Native tests of hostvmm and the ACL emulation, built and run under AddressSanitizer by
 * native/tests/run_asan.sh. Exercises every error path (each must release what it took). */
#define _GNU_SOURCE
#include <assert.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "../hostvmm.h"

#define G (2ull << 20)
#define CHECK(x) do { if (!(x)) { fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #x); return 1; } } while (0)

typedef struct { uint32_t id; int32_t type; } loc_t;
typedef struct { int32_t ht, at, attr; loc_t loc; uint64_t rsv; } prop_t;
int aclInit(const char *); int aclFinalize(void); int aclrtSetDevice(int32_t);
int aclrtReserveMemAddress(void **, size_t, size_t, void *, uint64_t); int aclrtReleaseMemAddress(void *);
int aclrtMallocPhysical(void **, size_t, const prop_t *, uint64_t); int aclrtFreePhysical(void *);
int aclrtMapMem(void *, size_t, size_t, void *, uint64_t); int aclrtUnmapMem(void *);
const char *aclGetRecentErrMsg(void);

int main(void) {
    hv_pool *p;
    CHECK(hv_pool_open(&p, G, 8 * G) == 0);
    uint64_t va, h[8], failed;
    CHECK(hv_reserve(p, 16 * G, &va) == 0);
    CHECK(hv_reserve(p, G + 1, &va) == EINVAL);
    CHECK(hv_reserve(p, 16 * G, &va) == 0);
    for (int i = 0; i < 8; i++) CHECK(hv_create(p, G, &h[i]) == 0);
    uint64_t extra;
    CHECK(hv_create(p, G, &extra) == ENOMEM);
    uint64_t vas[8];
    for (int i = 0; i < 8; i++) vas[i] = va + (uint64_t)i * 2 * G;
    CHECK(hv_map_batch(p, vas, h, 8, &failed) == 0);
    memset((void *)vas[3], 0xab, G);
    CHECK(hv_map(p, vas[3], h[0]) == EEXIST);
    CHECK(hv_unmap(p, vas[3] + G, NULL) == ENOENT);
    CHECK(hv_free(p, h[3]) == EBUSY);
    CHECK(hv_release(p, va, 0) == EBUSY);
    uint64_t bad[2] = {vas[0], vas[0]};
    CHECK(hv_unmap_batch(p, bad, 2, &failed) == ENOENT && failed == 1);
    CHECK(hv_check_mapped(p, vas[0], G) == 0);
    uint64_t d[2] = {vas[1], vas[2]}, s[2] = {vas[3], vas[3]}, n[2] = {4096, 4096};
    CHECK(hv_copy_batch_checked(p, d, s, n, 2, 1, 1, &failed) == 0);
    CHECK(((unsigned char *)vas[2])[100] == 0xab);
    uint64_t dbad[1] = {vas[1] + G}, nbig[1] = {8192};
    CHECK(hv_copy_batch_checked(p, dbad, s, nbig, 1, 1, 0, &failed) == ENOENT);
    CHECK(hv_unmap_batch(p, vas, 8, &failed) == 0);
    for (int i = 0; i < 8; i++) CHECK(hv_free(p, h[i]) == 0);
    CHECK(hv_free(p, h[0]) == EBADF);
    CHECK(hv_release(p, va, 16 * G) == 0);
    /* populated maps: same data through the handle, same rollback */
    hv_set_populate(p, 1);
    uint64_t pv, ph[2];
    CHECK(hv_reserve(p, 2 * G, &pv) == 0);
    CHECK(hv_create(p, G, &ph[0]) == 0 && hv_create(p, G, &ph[1]) == 0);
    uint64_t pvas[2] = {pv, pv + G};
    CHECK(hv_map_batch(p, pvas, ph, 2, &failed) == 0);
    memset((void *)pv, 0x5c, G);
    CHECK(hv_unmap(p, pv, NULL) == 0 && hv_map(p, pv + G, ph[0]) == EEXIST);
    CHECK(hv_unmap(p, pv + G, NULL) == 0 && hv_map(p, pv + G, ph[0]) == 0);
    CHECK(((unsigned char *)(pv + G))[G - 1] == 0x5c);
    uint64_t pbad[2] = {pv, pv};
    CHECK(hv_map_batch(p, pbad, ph, 2, &failed) == EEXIST && failed == 1);
    CHECK(hv_check_mapped(p, pv, 1) == ENOENT); /* the first entry was rolled back */
    CHECK(hv_unmap(p, pv + G, NULL) == 0);
    CHECK(hv_free(p, ph[0]) == 0 && hv_free(p, ph[1]) == 0 && hv_release(p, pv, 2 * G) == 0);
    hv_set_populate(p, 0);
    hv_set_max_mappings(p, 1);
    CHECK(hv_create(p, G, &h[0]) == 0 && hv_create(p, G, &h[1]) == 0);
    uint64_t v2[2] = {vas[0], vas[1]};
    uint64_t r2;
    CHECK(hv_reserve(p, 4 * G, &r2) == 0);
    v2[0] = r2; v2[1] = r2 + G;
    CHECK(hv_map_batch(p, v2, h, 2, &failed) == ENOMEM && failed == 1);
    CHECK(hv_check_mapped(p, r2, 1) == ENOENT);
    CHECK(hv_free_deferred(p, h[1]) == 0);
    /* unmap_batch with a bad second entry after a deferred-freed handle: nothing unmapped,
     * the handle stays mapped and pending; the good batch then releases it */
    hv_set_max_mappings(p, 0);
    uint64_t stats[HV_STAT_COUNT];
    CHECK(hv_map(p, r2, h[0]) == 0 && hv_free_deferred(p, h[0]) == 0);
    hv_stats(p, stats);
    uint64_t committed = stats[HV_STAT_COMMITTED];
    uint64_t ub[2] = {r2, r2 + G};
    CHECK(hv_unmap_batch(p, ub, 2, &failed) == ENOENT && failed == 1);
    CHECK(strstr(hv_last_error(), "nothing was unmapped") != NULL);
    CHECK(hv_check_mapped(p, r2, G) == 0);
    ((unsigned char *)r2)[7] = 0x42; /* still mapped, still writable */
    hv_stats(p, stats);
    CHECK(stats[HV_STAT_COMMITTED] == committed && stats[HV_STAT_MAPPINGS] == 1);
    uint64_t dup[2] = {r2, r2};
    CHECK(hv_unmap_batch(p, dup, 2, &failed) == ENOENT && failed == 1);
    CHECK(strstr(hv_last_error(), "listed twice") != NULL && hv_check_mapped(p, r2, G) == 0);
    CHECK(hv_unmap_batch(p, ub, 1, &failed) == 0 && hv_check_mapped(p, r2, 1) == ENOENT);
    hv_stats(p, stats);
    CHECK(stats[HV_STAT_COMMITTED] == committed - G && stats[HV_STAT_MAPPINGS] == 0);
    CHECK(stats[HV_STAT_RELEASE_PENDING] == 0);
    CHECK(hv_free(p, h[0]) == EBADF);
    hv_pool_close(p); /* with live handles and a reservation: close releases them */

    /* coalesced runs: handles contiguous in address and memfd offset map with one mmap, but
     * each stays its own mapping (unmapped, checked and rolled back one by one) */
    CHECK(hv_pool_open(&p, G, 8 * G) == 0);
    uint64_t cv, ch[4], cvas[4];
    CHECK(hv_reserve(p, 8 * G, &cv) == 0);
    for (int i = 0; i < 4; i++) {
        CHECK(hv_create(p, G, &ch[i]) == 0);
        cvas[i] = cv + (uint64_t)i * G;
    }
    CHECK(ch[1] == ch[0] + G && ch[3] == ch[0] + 3 * G); /* a fresh memfd: contiguous offsets */
    CHECK(hv_map_batch(p, cvas, ch, 4, &failed) == 0);
    for (int i = 0; i < 4; i++) memset((void *)cvas[i], 0x10 + i, G);
    hv_stats(p, stats);
    CHECK(stats[HV_STAT_MAPPINGS] == 4 && stats[HV_STAT_MAPPED] == 4 * G);
    CHECK(hv_unmap(p, cvas[1], NULL) == 0); /* a handle in the middle of the run */
    CHECK(hv_check_mapped(p, cvas[1], 1) == ENOENT && hv_check_mapped(p, cvas[2], G) == 0);
    CHECK(hv_map(p, cvas[1], ch[1]) == 0 && ((unsigned char *)cvas[1])[7] == 0x11);
    CHECK(((unsigned char *)cvas[3])[G - 1] == 0x13);
    uint64_t rev[4] = {ch[3], ch[2], ch[1], ch[0]}; /* the same handles elsewhere, reversed */
    uint64_t rvas[4] = {cv + 4 * G, cv + 5 * G, cv + 6 * G, cv + 7 * G};
    CHECK(hv_map_batch(p, rvas, rev, 4, &failed) == 0 && ((unsigned char *)rvas[0])[0] == 0x13);
    uint64_t clash[3] = {cv + 4 * G, cv + 5 * G, cv + 6 * G};
    CHECK(hv_unmap_batch(p, rvas, 4, &failed) == 0);
    /* a run whose third entry is already mapped: all or nothing, the index is exact */
    CHECK(hv_map(p, clash[2], ch[0]) == 0);
    CHECK(hv_map_batch(p, clash, ch + 1, 3, &failed) == EEXIST && failed == 2);
    CHECK(hv_check_mapped(p, clash[0], 1) == ENOENT && hv_check_mapped(p, clash[1], 1) == ENOENT);
    CHECK(hv_unmap(p, clash[2], NULL) == 0);
    CHECK(hv_unmap_batch(p, cvas, 4, &failed) == 0); /* one re-reserving call for the run */
    hv_stats(p, stats);
    CHECK(stats[HV_STAT_MAPPINGS] == 0 && stats[HV_STAT_MAPPED] == 0);
    for (int i = 0; i < 4; i++) CHECK(hv_free(p, ch[i]) == 0);
    CHECK(hv_release(p, cv, 8 * G) == 0);
    hv_pool_close(p);

    /* run records: one record per contiguous run, bookkeeping per handle, all or nothing */
    CHECK(hv_pool_open(&p, G, 16 * G) == 0);
    uint64_t rv, rh[6], big, stats2[HV_STAT_COUNT];
    CHECK(hv_reserve(p, 16 * G, &rv) == 0);
    for (int i = 0; i < 4; i++) CHECK(hv_create(p, G, &rh[i]) == 0);
    CHECK(hv_create(p, 2 * G, &big) == 0 && big == rh[3] + G); /* a two-granule handle after them */
    uint64_t run1[3] = {rv, rh[0], 4 * G}, unrun1[2] = {rv, 4 * G};
    CHECK(hv_map_runs(p, run1, 1, &failed) == 0);
    for (int i = 0; i < 4; i++) memset((void *)(rv + i * G), 0x20 + i, G);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_MAPPINGS] == 4 && stats2[HV_STAT_MAPPED] == 4 * G);
    CHECK(hv_unmap(p, rv + 2 * G, NULL) == 0); /* each handle is its own mapping */
    CHECK(hv_unmap_runs(p, unrun1, 1, &failed) == ENOENT && failed == 0); /* a hole: refused */
    CHECK(hv_check_mapped(p, rv, G) == 0); /* ... and nothing was unmapped */
    CHECK(hv_map(p, rv + 2 * G, rh[2]) == 0 && ((unsigned char *)rv)[2 * G + 5] == 0x22);
    CHECK(hv_unmap_runs(p, unrun1, 1, &failed) == 0);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_MAPPINGS] == 0 && stats2[HV_STAT_MAPPED] == 0);
    /* a run with the two-granule handle: the general walk */
    uint64_t run2[3] = {rv + 8 * G, rh[2], 4 * G}, unrun2[2] = {rv + 8 * G, 4 * G};
    CHECK(hv_map_runs(p, run2, 1, &failed) == 0);
    CHECK(((unsigned char *)rv)[8 * G + 1] == 0x22 && ((unsigned char *)rv)[9 * G + 1] == 0x23);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_MAPPINGS] == 3 && stats2[HV_STAT_MAPPED] == 4 * G);
    CHECK(hv_free(p, big) == EBUSY);
    CHECK(hv_unmap_runs(p, unrun2, 1, &failed) == 0);
    /* the second run fails (handle inside the big one's middle / a range already mapped):
     * the first is unmapped again, the index is exact */
    uint64_t two[6] = {rv, rh[0], 2 * G, rv + 4 * G, big + G, G};
    CHECK(hv_map_runs(p, two, 2, &failed) == EBADF && failed == 1);
    CHECK(hv_check_mapped(p, rv, 1) == ENOENT);
    uint64_t overlap[6] = {rv, rh[0], 2 * G, rv + G, rh[2], G};
    CHECK(hv_map_runs(p, overlap, 2, &failed) == EEXIST && failed == 1);
    CHECK(hv_check_mapped(p, rv, 1) == ENOENT);
    uint64_t past[3] = {rv + 14 * G, rh[0], 4 * G}; /* past the end of the reservation */
    CHECK(hv_map_runs(p, past, 1, &failed) == EINVAL);
    uint64_t odd[3] = {rv + 1, rh[0], G};
    CHECK(hv_map_runs(p, odd, 1, &failed) == EINVAL);
    uint64_t freed[3] = {rv, rh[3] + 3 * G, G}; /* past the last handle: never created */
    CHECK(hv_map_runs(p, freed, 1, &failed) == EBADF);
    /* unmap runs: listed twice, over a hole, through the middle of a mapping */
    CHECK(hv_map_runs(p, run1, 1, &failed) == 0);
    uint64_t twice[4] = {rv, 2 * G, rv + G, G};
    CHECK(hv_unmap_runs(p, twice, 2, &failed) == ENOENT && failed == 1);
    CHECK(hv_check_mapped(p, rv, 4 * G) == 0);
    uint64_t halves[4] = {rv + 2 * G, 2 * G, rv, 2 * G}; /* several runs, any order */
    CHECK(hv_unmap_runs(p, halves, 2, &failed) == 0);
    CHECK(hv_map_runs(p, run2, 1, &failed) == 0);
    uint64_t mid[2] = {rv + 8 * G, 3 * G}; /* ends inside the two-granule mapping */
    CHECK(hv_unmap_runs(p, mid, 1, &failed) == EINVAL);
    /* a deferred-freed handle is released when its run is unmapped */
    CHECK(hv_free_deferred(p, big) == 0);
    CHECK(hv_unmap_runs(p, unrun2, 1, &failed) == 0);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_HANDLES] == 4 && stats2[HV_STAT_COMMITTED] == 4 * G);
    /* the mapping cap counts every handle of a run */
    hv_set_max_mappings(p, 3);
    CHECK(hv_map_runs(p, run1, 1, &failed) == ENOMEM);
    hv_set_max_mappings(p, 0);
    hv_set_populate(p, 1);
    CHECK(hv_map_runs(p, run1, 1, &failed) == 0 && ((unsigned char *)rv)[3 * G] == 0x23);
    CHECK(hv_unmap_runs(p, unrun1, 1, &failed) == 0);
    /* prepared batches: the same calls through one struct; a closed owner (pool NULL) is EBADF */
    hv_prepared pb = {p, run1, 1, unrun1, 1, 0};
    CHECK(hv_map_prepared(&pb) == 0 && hv_check_mapped(p, rv, 4 * G) == 0);
    CHECK(hv_map_prepared(&pb) == EEXIST && pb.failed == 0);
    CHECK(hv_unmap_prepared(&pb) == 0 && hv_check_mapped(p, rv, 1) == ENOENT);
    pb.pool = NULL;
    CHECK(hv_map_prepared(&pb) == EBADF && hv_unmap_prepared(&pb) == EBADF);
    /* map_batch / unmap_batch on contiguous entries: the run path, deferred frees released
     * after the one unmap call, a failed run check going entry by entry */
    uint64_t bv[4] = {rv, rv + G, rv + 2 * G, rv + 3 * G};
    CHECK(hv_map_batch(p, bv, rh, 4, &failed) == 0 && ((unsigned char *)rv)[G + 7] == 0x21);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_MAPPINGS] == 4 && stats2[HV_STAT_MAPPED] == 4 * G);
    uint64_t spare;
    CHECK(hv_create(p, G, &spare) == 0);
    CHECK(hv_free_deferred(p, rh[1]) == 0);
    CHECK(hv_unmap_batch(p, bv, 4, &failed) == 0);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_MAPPINGS] == 0 && stats2[HV_STAT_HANDLES] == 4);
    CHECK(hv_handle_info(p, rh[1], NULL, NULL) == EBADF);
    CHECK(hv_create(p, G, &rh[1]) == 0); /* the freed extent comes back */
    CHECK(hv_map(p, rv + 2 * G, rh[0]) == 0);
    CHECK(hv_map_batch(p, bv, rh, 4, &failed) == EEXIST && failed == 2);
    CHECK(hv_check_mapped(p, rv, 1) == ENOENT);
    CHECK(hv_unmap_batch(p, bv, 4, &failed) == ENOENT && failed == 0); /* nothing unmapped */
    CHECK(hv_check_mapped(p, rv + 2 * G, G) == 0);
    CHECK(hv_unmap(p, rv + 2 * G, NULL) == 0 && hv_free(p, spare) == 0);
    for (int i = 0; i < 4; i++) CHECK(hv_free(p, rh[i]) == 0);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_MAPPINGS] == 0 && stats2[HV_STAT_HANDLES] == 0 && stats2[HV_STAT_BACKING] == 0);
    CHECK(hv_release(p, rv, 16 * G) == 0);
    hv_pool_close(p);

    /* long runs (eight pages per step in the checks, then a tail): every failure inside a
     * step or the tail is found, nothing changes; deferred frees inside a step are released */
    CHECK(hv_pool_open(&p, G, 0) == 0);
    uint64_t lv, lh[20], lrun[3], lun[2];
    CHECK(hv_reserve(p, 24 * G, &lv) == 0);
    for (int i = 0; i < 20; i++) CHECK(hv_create(p, G, &lh[i]) == 0 && (i == 0 || lh[i] == lh[i - 1] + G));
    lrun[0] = lv, lrun[1] = lh[0], lrun[2] = 20 * G, lun[0] = lv, lun[1] = 20 * G;
    for (int at = 0; at < 20; at += 3) { /* a page mapped already, inside a step or the tail */
        CHECK(hv_map(p, lv + (uint64_t)at * G, lh[at]) == 0);
        CHECK(hv_map_runs(p, lrun, 1, &failed) == EEXIST);
        CHECK(hv_unmap(p, lv + (uint64_t)at * G, NULL) == 0);
        hv_stats(p, stats2);
        CHECK(stats2[HV_STAT_MAPPINGS] == 0);
    }
    CHECK(hv_map_runs(p, lrun, 1, &failed) == 0 && hv_check_mapped(p, lv, 20 * G) == 0);
    memset((void *)(lv + 13 * G), 0x3d, 64);
    CHECK(hv_unmap_runs(p, lun, 1, &failed) == 0);
    CHECK(hv_free(p, lh[13]) == 0); /* a freed handle in the second step */
    CHECK(hv_map_runs(p, lrun, 1, &failed) == EBADF && hv_check_mapped(p, lv, 1) == ENOENT);
    CHECK(hv_create(p, G, &lh[13]) == 0 && lh[13] == lh[12] + G); /* its extent comes back */
    CHECK(hv_map_batch(p, (uint64_t[]){lv, lv + G}, lh, 2, &failed) == 0);
    CHECK(hv_unmap_batch(p, (uint64_t[]){lv, lv + G}, 2, &failed) == 0);
    CHECK(hv_map_runs(p, lrun, 1, &failed) == 0); /* a fresh handle among used ones */
    CHECK(((unsigned char *)lv)[13 * G] == 0 && hv_free_deferred(p, lh[9]) == 0);
    CHECK(hv_unmap_runs(p, lun, 1, &failed) == 0);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_MAPPINGS] == 0 && stats2[HV_STAT_HANDLES] == 19);
    CHECK(hv_handle_info(p, lh[9], NULL, NULL) == EBADF);
    for (int i = 0; i < 20; i++) if (i != 9) CHECK(hv_free(p, lh[i]) == 0);
    CHECK(hv_release(p, lv, 24 * G) == 0);
    hv_pool_close(p);

    /* huge-page backings: refused for a granule that is not a multiple of 2 MiB */
    CHECK(hv_pool_open_backed(&p, G / 2, 0, HV_BACKING_HUGETLB) == EINVAL && p == NULL);
    CHECK(hv_pool_open_backed(&p, G, 0, 7) == EINVAL && p == NULL);
    CHECK(hv_pool_open_backed(&p, G, 0, HV_BACKING_THP) == 0);
    hv_stats(p, stats2);
    CHECK(stats2[HV_STAT_BACKING] == HV_BACKING_THP);
    CHECK(hv_create(p, G, &rh[0]) == 0 && hv_free(p, rh[0]) == 0); /* committed, with or without THP */
    hv_pool_close(p);

    CHECK(aclInit(NULL) == 0 && aclInit(NULL) == 100002);
    CHECK(aclGetRecentErrMsg() != NULL && aclGetRecentErrMsg() == NULL);
    void *av, *ah;
    CHECK(aclrtReserveMemAddress(&av, G, 0, NULL, 0) == 107002);
    CHECK(aclrtSetDevice(0) == 0);
    CHECK(aclrtReserveMemAddress(&av, 2 * G, 0, NULL, 0) == 0);
    prop_t pr = {0, 0, 4, {0, 1}, 0};
    CHECK(aclrtMallocPhysical(&ah, G, &pr, 0) == 0);
    CHECK(aclrtMapMem(av, G, 0, ah, 0) == 0);
    CHECK(aclrtFreePhysical(ah) == 0);
    CHECK(aclrtUnmapMem(av) == 0);
    CHECK(aclrtReleaseMemAddress(av) == 0);
    CHECK(aclFinalize() == 0);
    printf("native tests passed\n");
    return 0;
}
