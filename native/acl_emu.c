/* libascendcl_emu: the subset of the libascendcl ABI that xllm-vmm's acl driver uses, over host
 * memory (one hostvmm pool per emulated device), with the real constraints:
 *   - aclInit once (a repeat returns ACL_ERROR_REPEAT_INITIALIZE); calls before it fail with
 *     ACL_ERROR_UNINITIALIZE; aclFinalize releases every device's memory.
 *   - the current device is per thread: calls that need one fail with ACL_ERROR_RT_CONTEXT_NULL
 *     until aclrtSetDevice (or aclrtSetCurrentContext) in that thread.
 *   - physical memory: handle sizes are multiples of the 2 MiB granularity (HUGE1G reports a
 *     1 GiB granularity but allocating it is ACL_ERROR_RT_FEATURE_NOT_SUPPORT here),
 *     flags 0, a supported memAttr, location {id = device, type = DEVICE}, handleType NONE,
 *     allocationType PINNED (0); beyond the device size: ACL_ERROR_RT_MEMORY_ALLOCATION.
 *   - aclrtReserveMemAddress: size > 0 (rounded up to 2 MiB), alignment 0, expectPtr NULL,
 *     flags 0 or 1.
 *   - aclrtMapMem: size equal to the handle's size, offset 0, inside a reservation of the
 *     handle's device, onto unmapped pages only.
 *   - aclrtUnmapMem(va): the start address of one earlier mapping, nothing else.
 *   - aclrtFreePhysical of a mapped handle frees it once the last mapping is gone.
 *   - aclrtReleaseMemAddress: only when nothing in the range is mapped.
 *   - copies check that the device side is mapped memory of an emulated device.
 *   - every failure leaves a message for aclGetRecentErrMsg (per thread, cleared on read).
 * Configuration (read by aclInit): XLLM_VMM_ACL_EMU_DEVICE_COUNT (1 to 16, default 1) and
 * XLLM_VMM_ACL_EMU_DEVICE_MEMORY (per device: bytes, or a number with K/M/G/T or KiB/MiB/GiB/TiB,
 * powers of 1024; default: the host's physical memory). A value that is not one of these makes
 * aclInit fail with ACL_ERROR_INVALID_PARAM and a message naming the variable.
 * Host bound: whatever the device size, the emulated devices' physical memory and the buffers of
 * aclrtMallocHost together never exceed what the host had available at the last reading — the
 * smaller of MemAvailable and the memory cgroup's limit − usage (v2 memory.max/memory.current,
 * v1 memory.limit_in_bytes/memory.usage_in_bytes; XLLM_VMM_ACL_EMU_CGROUP_ROOT overrides
 * /sys/fs/cgroup, for tests) — less what they committed since, less a safety margin (1/32 of
 * the host's memory, at least 512 MiB — the host driver's margin). The reading is taken at
 * aclInit, again when it is over a second old, and before refusing a request that does not fit
 * it. Beyond the bound aclrtMallocPhysical and aclrtMallocHost answer 207001 like a full
 * device. Memory that other code commits after a reading is only seen at the next one.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "hostvmm.h"

#define EXPORT __attribute__((visibility("default")))

typedef int aclError;
enum {
    ACL_SUCCESS = 0,
    ACL_ERROR_INVALID_PARAM = 100000,
    ACL_ERROR_UNINITIALIZE = 100001,
    ACL_ERROR_REPEAT_INITIALIZE = 100002,
    ACL_ERROR_REPEAT_FINALIZE = 100037,
    ACL_ERROR_RT_PARAM_INVALID = 107000,
    ACL_ERROR_RT_INVALID_DEVICEID = 107001,
    ACL_ERROR_RT_CONTEXT_NULL = 107002,
    ACL_ERROR_RT_ADDR_UNALIGNED = 107008,
    ACL_ERROR_RT_INVALID_MEMORY_TYPE = 107016,
    ACL_ERROR_RT_INVALID_HANDLE = 107017,
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000,
    ACL_ERROR_RT_MEMORY_ALLOCATION = 207001,
    ACL_ERROR_RT_INTERNAL_ERROR = 507000,
};

typedef struct {
    uint32_t id;
    int32_t type;
} aclrtMemLocation;

typedef struct {
    int32_t handleType;
    int32_t allocationType;
    int32_t memAttr;
    aclrtMemLocation location;
    uint64_t reserve;
} aclrtPhysicalMemProp;

#define GRANULE_2M (2ull << 20)
#define GRANULE_1G (1ull << 30)
#define MAX_DEVICES 16
#define HANDLE_DEV_SHIFT 48

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_inited;
static uint32_t g_ndev = 1;
static uint64_t g_devmem;
static uint64_t g_margin;      /* host bytes never committed (the host driver's margin) */
static uint64_t g_read_avail;  /* host bytes available at the last reading */
static uint64_t g_read_used;   /* bytes the emulation held at the last reading */
static double g_read_at;       /* CLOCK_MONOTONIC seconds of the last reading */
static uint64_t g_hostbuf;     /* bytes of live aclrtMallocHost buffers */
static hv_pool *g_pool[MAX_DEVICES];   /* 2 MiB pools */

static __thread int t_dev = -1;
static __thread char t_msg[1024];
static __thread int t_has_msg;
static __thread char t_ret[1024];

static aclError err(aclError code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static aclError err(aclError code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(t_msg, sizeof t_msg, "EE%d: ", code);
    vsnprintf(t_msg + n, sizeof t_msg - (size_t)n, fmt, ap);
    va_end(ap);
    t_has_msg = 1;
    return code;
}

EXPORT const char *aclGetRecentErrMsg(void) {
    if (!t_has_msg) return NULL;
    memcpy(t_ret, t_msg, sizeof t_ret);
    t_has_msg = 0;
    return t_ret;
}

/* A size: decimal bytes, or a number with K/M/G/T or KiB/MiB/GiB/TiB (powers of 1024, any case,
 * optional B and spaces before the suffix). 0 on success, -1 when not a size or above 2^64. */
static int parse_size(const char *v, uint64_t *out) {
    if (!isdigit((unsigned char)v[0])) return -1;
    char *end = NULL;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno) return -1;
    while (*end == ' ') end++;
    static const struct { const char *s; int shift; } units[] = {
        {"", 0}, {"b", 0}, {"k", 10}, {"kib", 10}, {"m", 20}, {"mib", 20},
        {"g", 30}, {"gib", 30}, {"t", 40}, {"tib", 40},
    };
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(end, units[i].s) != 0) continue;
        if (units[i].shift && x > (UINT64_MAX >> units[i].shift)) return -1;
        *out = (uint64_t)x << units[i].shift;
        return 0;
    }
    return -1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* An unsigned number in a file ("max" or a missing file: *ok = 0). */
static uint64_t read_u64_file(const char *path, int *ok) {
    *ok = 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char buf[64] = {0};
    char *r = fgets(buf, sizeof buf, f);
    fclose(f);
    if (!r || !isdigit((unsigned char)buf[0])) return 0;
    unsigned long long x = strtoull(buf, NULL, 10);
    if (x >= (1ull << 62)) return 0; /* "unlimited" in cgroup v1 */
    *ok = 1;
    return (uint64_t)x;
}

/* limit − usage of this process's memory cgroup (v2, else v1), in *room; 0 when unlimited. */
static int cgroup_room(uint64_t *room) {
    const char *root = getenv("XLLM_VMM_ACL_EMU_CGROUP_ROOT");
    if (!root || !*root) root = "/sys/fs/cgroup";
    char rel[512] = "", base[600];
    snprintf(base, sizeof base, "%s", root);
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (f) {
        char line[1024];
        while (fgets(line, sizeof line, f)) {
            char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
            if (!c2) continue;
            *c1 = 0;
            *c2 = 0;
            int v2 = strcmp(line, "0") == 0 && c2 == c1 + 1;
            int v1 = strstr(c1 + 1, "memory") != NULL;
            if (!v2 && !v1) continue;
            char *path = c2 + 1;
            path[strcspn(path, "\n")] = 0;
            while (*path == '/') path++;
            snprintf(rel, sizeof rel, "%s", path);
            if (v1) snprintf(base, sizeof base, "%s/memory", root);
            break;
        }
        fclose(f);
    }
    static const char *files[2][2] = {{"memory.max", "memory.current"},
                                      {"memory.limit_in_bytes", "memory.usage_in_bytes"}};
    for (int pass = 0; pass < 2; pass++) {
        char dir[1200], path[1300];
        if (pass == 0 && rel[0]) snprintf(dir, sizeof dir, "%s/%s", base, rel);
        else if (pass == 0) continue;
        else snprintf(dir, sizeof dir, "%s", base);
        for (int k = 0; k < 2; k++) {
            int ok, ok2;
            snprintf(path, sizeof path, "%s/%s", dir, files[k][0]);
            uint64_t limit = read_u64_file(path, &ok);
            if (!ok) continue;
            snprintf(path, sizeof path, "%s/%s", dir, files[k][1]);
            uint64_t usage = read_u64_file(path, &ok2);
            *room = limit > usage ? limit - usage : 0;
            return 1;
        }
    }
    return 0;
}

/* Host bytes available now: the smaller of MemAvailable and the cgroup's limit − usage;
 * the physical memory when neither can be read. */
static uint64_t host_available(uint64_t phys) {
    FILE *f = fopen("/proc/meminfo", "r");
    unsigned long long kib = 0;
    int have = 0;
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
                have = 1;
                break;
            }
        }
        fclose(f);
    }
    uint64_t avail = have ? (uint64_t)kib * 1024ull : phys, room;
    if (cgroup_room(&room) && room < avail) avail = room;
    return avail;
}

static uint64_t used_bytes(int dev);

/* Everything the emulation holds: physical memory of every device + host buffers (g_mu held). */
static uint64_t emu_used_locked(void) {
    uint64_t total = g_hostbuf;
    for (uint32_t i = 0; i < g_ndev; i++) total += used_bytes((int)i);
    return total;
}

static uint64_t phys_bytes(void) {
    return (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Host bytes the emulation may still commit (may be negative; g_mu held): available at the last
 * reading, less what the emulation committed since, less the margin. Re-reads the host when
 * `fresh` or when the reading is over a second old. */
static int64_t host_room_locked(int fresh) {
    uint64_t used = emu_used_locked();
    double t = now_s();
    if (fresh || t - g_read_at > 1.0) {
        g_read_avail = host_available(phys_bytes());
        g_read_used = used;
        g_read_at = t;
    }
    return (int64_t)g_read_avail - (int64_t)g_margin - ((int64_t)used - (int64_t)g_read_used);
}

/* Refuses `size` more bytes beyond the host bound (g_mu held); re-reads before refusing. */
static aclError check_host_room_locked(const char *fn, uint64_t size) {
    if ((int64_t)size <= host_room_locked(0)) return ACL_SUCCESS;
    int64_t room = host_room_locked(1);
    if ((int64_t)size <= room) return ACL_SUCCESS;
    return err(ACL_ERROR_RT_MEMORY_ALLOCATION,
               "%s: out of host memory for the emulation: %llu bytes requested, %llu can be committed "
               "(%llu available on this host at the last reading, %llu kept as a safety margin, %llu held "
               "by the emulation)",
               fn, (unsigned long long)size, (unsigned long long)(room > 0 ? room : 0),
               (unsigned long long)g_read_avail, (unsigned long long)g_margin,
               (unsigned long long)emu_used_locked());
}

EXPORT aclError aclInit(const char *configPath) {
    (void)configPath;
    pthread_mutex_lock(&g_mu);
    if (g_inited) {
        pthread_mutex_unlock(&g_mu);
        return err(ACL_ERROR_REPEAT_INITIALIZE, "aclInit: repeated initialization");
    }
    uint64_t phys = phys_bytes(), ndev = 1, devmem = phys;
    const char *v = getenv("XLLM_VMM_ACL_EMU_DEVICE_COUNT");
    if (v && *v) {
        char *end = NULL;
        errno = 0;
        unsigned long long n = isdigit((unsigned char)v[0]) ? strtoull(v, &end, 10) : 0;
        if (errno || !end || *end || n < 1 || n > MAX_DEVICES) {
            pthread_mutex_unlock(&g_mu);
            return err(ACL_ERROR_INVALID_PARAM,
                       "aclInit: XLLM_VMM_ACL_EMU_DEVICE_COUNT='%.64s' is not a device count: use 1 to %d", v,
                       MAX_DEVICES);
        }
        ndev = n;
    }
    v = getenv("XLLM_VMM_ACL_EMU_DEVICE_MEMORY");
    if (v && *v && (parse_size(v, &devmem) || devmem == 0)) {
        pthread_mutex_unlock(&g_mu);
        return err(ACL_ERROR_INVALID_PARAM,
                   "aclInit: XLLM_VMM_ACL_EMU_DEVICE_MEMORY='%.64s' is not a positive size: use bytes or a "
                   "number with K/M/G/T or KiB/MiB/GiB/TiB (e.g. 16GiB), or unset it for the host's memory",
                   v);
    }
    g_ndev = (uint32_t)ndev;
    g_devmem = devmem;
    g_margin = phys / 32 > (512ull << 20) ? phys / 32 : (512ull << 20);
    host_room_locked(1);
    g_inited = 1;
    pthread_mutex_unlock(&g_mu);
    return ACL_SUCCESS;
}

EXPORT aclError aclFinalize(void) {
    pthread_mutex_lock(&g_mu);
    if (!g_inited) {
        pthread_mutex_unlock(&g_mu);
        return err(ACL_ERROR_REPEAT_FINALIZE, "aclFinalize: not initialized");
    }
    for (int i = 0; i < MAX_DEVICES; i++) {
        hv_pool_close(g_pool[i]);
        g_pool[i] = NULL;
    }
    g_inited = 0;
    pthread_mutex_unlock(&g_mu);
    t_dev = -1;
    return ACL_SUCCESS;
}

/* Emulation-only: set the memory of one device (bytes) at run time. */
EXPORT aclError xllmEmuSetDeviceMemory(int32_t deviceId, uint64_t bytes) {
    if (!g_inited) return err(ACL_ERROR_UNINITIALIZE, "aclInit has not been called");
    if (deviceId < 0 || (uint32_t)deviceId >= g_ndev)
        return err(ACL_ERROR_RT_INVALID_DEVICEID, "invalid device id %d", deviceId);
    pthread_mutex_lock(&g_mu);
    g_devmem = bytes;
    for (uint32_t i = 0; i < g_ndev; i++) {
        if (g_pool[i]) hv_set_limit(g_pool[i], bytes);
    }
    pthread_mutex_unlock(&g_mu);
    return ACL_SUCCESS;
}

/* The pool of a device, created on first use. */
static aclError pool_of(int dev, hv_pool **out) {
    pthread_mutex_lock(&g_mu);
    hv_pool **slot = &g_pool[dev];
    aclError rc = ACL_SUCCESS;
    if (!*slot) {
        int e = hv_pool_open(slot, GRANULE_2M, g_devmem);
        if (e) rc = err(ACL_ERROR_RT_INTERNAL_ERROR, "cannot create device memory: %s", hv_last_error());
    }
    *out = *slot;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static uint64_t used_bytes(int dev) {
    uint64_t total = 0, st[HV_STAT_COUNT];
    if (g_pool[dev]) {
        hv_stats(g_pool[dev], st);
        total += st[HV_STAT_COMMITTED];
    }
    return total;
}

#define NEED_INIT()                                                                                  \
    do {                                                                                             \
        if (!g_inited) return err(ACL_ERROR_UNINITIALIZE, "%s: aclInit has not been called", __func__); \
    } while (0)
#define NEED_DEVICE()                                                                                \
    do {                                                                                             \
        NEED_INIT();                                                                                 \
        if (t_dev < 0)                                                                               \
            return err(ACL_ERROR_RT_CONTEXT_NULL,                                                    \
                       "%s: no device is set in this thread; call aclrtSetDevice first", __func__);  \
    } while (0)

EXPORT aclError aclrtSetDevice(int32_t deviceId) {
    NEED_INIT();
    if (deviceId < 0 || (uint32_t)deviceId >= g_ndev)
        return err(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtSetDevice: invalid device id %d (devices: %u)",
                   deviceId, g_ndev);
    t_dev = deviceId;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtResetDevice(int32_t deviceId) {
    NEED_INIT();
    if (deviceId < 0 || (uint32_t)deviceId >= g_ndev)
        return err(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtResetDevice: invalid device id %d", deviceId);
    if (t_dev == deviceId) t_dev = -1;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtGetDevice(int32_t *deviceId) {
    NEED_DEVICE();
    if (!deviceId) return err(ACL_ERROR_INVALID_PARAM, "aclrtGetDevice: deviceId is NULL");
    *deviceId = t_dev;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtGetDeviceCount(uint32_t *count) {
    NEED_INIT();
    if (!count) return err(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceCount: count is NULL");
    *count = g_ndev;
    return ACL_SUCCESS;
}

/* A context is the token (device + 1). */
EXPORT aclError aclrtGetCurrentContext(void **ctx) {
    NEED_INIT();
    if (!ctx) return err(ACL_ERROR_INVALID_PARAM, "aclrtGetCurrentContext: ctx is NULL");
    *ctx = t_dev < 0 ? NULL : (void *)(uintptr_t)(t_dev + 1);
    if (t_dev < 0) return err(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetCurrentContext: no context in this thread");
    return ACL_SUCCESS;
}

EXPORT aclError aclrtCreateContext(void **ctx, int32_t deviceId) {
    NEED_INIT();
    if (!ctx || deviceId < 0 || (uint32_t)deviceId >= g_ndev)
        return err(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtCreateContext: invalid device id %d", deviceId);
    *ctx = (void *)(uintptr_t)(deviceId + 1);
    t_dev = deviceId;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtSetCurrentContext(void *ctx) {
    NEED_INIT();
    uintptr_t v = (uintptr_t)ctx;
    if (v == 0 || v > g_ndev) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtSetCurrentContext: invalid context");
    t_dev = (int)(v - 1);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtGetMemInfo(int32_t attr, size_t *freeBytes, size_t *totalBytes) {
    NEED_DEVICE();
    if (attr < 0 || attr > 11)
        return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtGetMemInfo: invalid memory attribute %d", attr);
    if (!freeBytes || !totalBytes) return err(ACL_ERROR_INVALID_PARAM, "aclrtGetMemInfo: NULL output");
    pthread_mutex_lock(&g_mu);
    uint64_t used = used_bytes(t_dev);
    int64_t room = host_room_locked(0);
    uint64_t dev_free = used >= g_devmem ? 0 : g_devmem - used;
    uint64_t host_free = room > 0 ? (uint64_t)room : 0;
    *totalBytes = g_devmem;
    *freeBytes = dev_free < host_free ? dev_free : host_free; /* what a malloc may still get */
    pthread_mutex_unlock(&g_mu);
    return ACL_SUCCESS;
}

static int granule_for(int32_t memAttr, uint64_t *g) {
    switch (memAttr) {
    case 0: case 1: case 2: case 3: case 4: case 5:
        *g = GRANULE_2M;
        return 0;
    case 10:
        *g = GRANULE_1G;
        return 0;
    default:
        return -1;
    }
}

EXPORT aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int32_t option, size_t *granularity) {
    NEED_INIT();
    if (!prop || !granularity)
        return err(ACL_ERROR_INVALID_PARAM, "aclrtMemGetAllocationGranularity: NULL argument");
    if (option != 0 && option != 1)
        return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemGetAllocationGranularity: invalid option %d", option);
    uint64_t g;
    if (granule_for(prop->memAttr, &g))
        return err(ACL_ERROR_RT_INVALID_MEMORY_TYPE, "aclrtMemGetAllocationGranularity: unsupported memAttr %d",
                   prop->memAttr);
    *granularity = g;
    return ACL_SUCCESS;
}

/* ---- virtual ranges: every reservation lives in the current device's 2 MiB pool ------------ */

EXPORT aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                       uint64_t flags) {
    NEED_DEVICE();
    if (!virPtr) return err(ACL_ERROR_INVALID_PARAM, "aclrtReserveMemAddress: virPtr is NULL");
    if (size == 0) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: size must not be 0");
    if (alignment != 0)
        return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: alignment is reserved and must be 0");
    if (expectPtr != NULL)
        return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: expectPtr must be NULL");
    if (flags > 1) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: invalid flags %llu",
                              (unsigned long long)flags);
    hv_pool *p;
    aclError rc = pool_of(t_dev, &p);
    if (rc) return rc;
    uint64_t rounded = (size + GRANULE_2M - 1) & ~(GRANULE_2M - 1), va = 0;
    int e = hv_reserve(p, rounded, &va);
    if (e)
        return err(e == ENOMEM ? ACL_ERROR_RT_MEMORY_ALLOCATION : ACL_ERROR_RT_PARAM_INVALID,
                   "aclrtReserveMemAddress: %s", hv_last_error());
    *virPtr = (void *)va;
    return ACL_SUCCESS;
}

static hv_pool *resv_pool(uint64_t va, int *dev_out) {
    for (uint32_t d = 0; d < g_ndev; d++) {
        uint64_t sz;
        if (g_pool[d] && hv_reservation_size(g_pool[d], va, &sz) == 0) {
            if (dev_out) *dev_out = (int)d;
            return g_pool[d];
        }
    }
    return NULL;
}

EXPORT aclError aclrtReleaseMemAddress(void *virPtr) {
    NEED_INIT();
    hv_pool *p = resv_pool((uint64_t)virPtr, NULL);
    if (!p) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtReleaseMemAddress: %p is not a reserved address", virPtr);
    if (hv_release(p, (uint64_t)virPtr, 0))
        return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtReleaseMemAddress: %s", hv_last_error());
    return ACL_SUCCESS;
}

/* ---- physical memory: handle = (device + 1) << 48 | offset in that device's pool ----------- */

static aclError decode(void *handle, const char *fn, hv_pool **pool, int *dev) {
    uint64_t v = (uint64_t)handle;
    uint64_t d = v >> HANDLE_DEV_SHIFT;
    if (d == 0 || d > g_ndev) return err(ACL_ERROR_RT_INVALID_HANDLE, "%s: invalid handle %p", fn, handle);
    hv_pool *p = g_pool[d - 1];
    uint64_t off = v & ((1ull << HANDLE_DEV_SHIFT) - 1);
    if (!p || hv_handle_info(p, off, NULL, NULL))
        return err(ACL_ERROR_RT_INVALID_HANDLE, "%s: invalid handle %p (never allocated or already freed)", fn,
                   handle);
    *pool = p;
    if (dev) *dev = (int)d - 1;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMallocPhysical(void **handle, size_t size, const aclrtPhysicalMemProp *prop, uint64_t flags) {
    NEED_DEVICE();
    if (!handle || !prop) return err(ACL_ERROR_INVALID_PARAM, "aclrtMallocPhysical: NULL argument");
    if (flags != 0) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtMallocPhysical: flags must be 0");
    if (prop->handleType != 0)
        return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtMallocPhysical: handleType must be ACL_MEM_HANDLE_TYPE_NONE (0)");
    if (prop->allocationType != 0)
        return err(ACL_ERROR_RT_PARAM_INVALID,
                   "aclrtMallocPhysical: allocationType must be ACL_MEM_ALLOCATION_TYPE_PINNED (0), got %d",
                   prop->allocationType);
    if (prop->location.type != 1)
        return err(ACL_ERROR_RT_PARAM_INVALID,
                   "aclrtMallocPhysical: location.type must be ACL_MEM_LOCATION_TYPE_DEVICE (1), got %d",
                   prop->location.type);
    if (prop->location.id >= g_ndev)
        return err(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtMallocPhysical: invalid location.id %u", prop->location.id);
    uint64_t g;
    if (granule_for(prop->memAttr, &g))
        return err(ACL_ERROR_RT_INVALID_MEMORY_TYPE, "aclrtMallocPhysical: unsupported memAttr %d", prop->memAttr);
    if (g != GRANULE_2M)
        return err(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "aclrtMallocPhysical: 1 GiB pages are not emulated");
    if (size == 0 || size % g)
        return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtMallocPhysical: size %zu is not a positive multiple of %llu",
                   size, (unsigned long long)g);
    int dev = (int)prop->location.id;
    hv_pool *p;
    aclError rc = pool_of(dev, &p);
    if (rc) return rc;
    /* The check and the create under one lock: two threads cannot both pass the check. */
    pthread_mutex_lock(&g_mu);
    uint64_t used = used_bytes(dev);
    if (used + size > g_devmem) {
        pthread_mutex_unlock(&g_mu);
        return err(ACL_ERROR_RT_MEMORY_ALLOCATION,
                   "aclrtMallocPhysical: out of memory on device %d: %llu of %llu bytes in use, %zu requested",
                   dev, (unsigned long long)used, (unsigned long long)g_devmem, size);
    }
    aclError hrc = check_host_room_locked("aclrtMallocPhysical", size);
    if (hrc) {
        pthread_mutex_unlock(&g_mu);
        return hrc;
    }
    uint64_t off;
    int e = hv_create(p, size, &off);
    pthread_mutex_unlock(&g_mu);
    if (e)
        return err(e == ENOMEM ? ACL_ERROR_RT_MEMORY_ALLOCATION : ACL_ERROR_RT_PARAM_INVALID,
                   "aclrtMallocPhysical: %s", hv_last_error());
    *handle = (void *)((uint64_t)(dev + 1) << HANDLE_DEV_SHIFT | off);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtFreePhysical(void *handle) {
    NEED_INIT();
    hv_pool *p;
    aclError rc = decode(handle, "aclrtFreePhysical", &p, NULL);
    if (rc) return rc;
    uint64_t off = (uint64_t)handle & ((1ull << HANDLE_DEV_SHIFT) - 1);
    if (hv_free_deferred(p, off)) return err(ACL_ERROR_RT_INVALID_HANDLE, "aclrtFreePhysical: %s", hv_last_error());
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, void *handle, uint64_t flags) {
    NEED_INIT();
    hv_pool *p;
    int dev;
    aclError rc = decode(handle, "aclrtMapMem", &p, &dev);
    if (rc) return rc;
    if (flags != 0) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: flags must be 0");
    if (offset != 0) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: offset must be 0, got %zu", offset);
    uint64_t off = (uint64_t)handle & ((1ull << HANDLE_DEV_SHIFT) - 1), hsize = 0;
    hv_handle_info(p, off, &hsize, NULL);
    if (size != hsize)
        return err(ACL_ERROR_RT_PARAM_INVALID,
                   "aclrtMapMem: size %zu must equal the size of the physical allocation (%llu)", size,
                   (unsigned long long)hsize);
    if ((uint64_t)virPtr % GRANULE_2M)
        return err(ACL_ERROR_RT_ADDR_UNALIGNED, "aclrtMapMem: address %p is not 2 MiB aligned", virPtr);
    int e = hv_map(p, (uint64_t)virPtr, off);
    if (e)
        return err(e == ENOMEM ? ACL_ERROR_RT_MEMORY_ALLOCATION : ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: %s%s",
                   hv_last_error(), e == EFAULT ? " (a reservation of the handle's device is required)" : "");
    return ACL_SUCCESS;
}

EXPORT aclError aclrtUnmapMem(void *virPtr) {
    NEED_INIT();
    for (uint32_t d = 0; d < g_ndev; d++) {
        if (!g_pool[d] || hv_check_mapped(g_pool[d], (uint64_t)virPtr, 1) == EFAULT) continue;
        if (hv_unmap(g_pool[d], (uint64_t)virPtr, NULL))
            return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtUnmapMem: %s", hv_last_error());
        return ACL_SUCCESS;
    }
    return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtUnmapMem: %p is not inside a reserved range", virPtr);
}

/* ---- copies --------------------------------------------------------------------------------- */

static aclError check_device_range(const void *ptr, size_t n, const char *fn, const char *side) {
    if (n == 0) return ACL_SUCCESS;
    for (uint32_t d = 0; d < g_ndev; d++) {
        if (!g_pool[d]) continue;
        int e = hv_check_mapped(g_pool[d], (uint64_t)ptr, n);
        if (e == 0) return ACL_SUCCESS;
        if (e != EFAULT)
            return err(ACL_ERROR_RT_PARAM_INVALID, "%s: %s range of %zu bytes at %p is not mapped device memory: %s", fn,
                       side, n, ptr, hv_last_error());
    }
    return err(ACL_ERROR_RT_PARAM_INVALID, "%s: %s %p is not device memory", fn, side, ptr);
}

static aclError do_memcpy(void *dst, size_t destMax, const void *src, size_t count, int kind, const char *fn) {
    NEED_DEVICE();
    if (count > destMax)
        return err(ACL_ERROR_RT_PARAM_INVALID, "%s: count %zu exceeds destMax %zu", fn, count, destMax);
    if (kind < 0 || kind > 4) return err(ACL_ERROR_RT_PARAM_INVALID, "%s: invalid memcpy kind %d", fn, kind);
    if (count && (!dst || !src)) return err(ACL_ERROR_INVALID_PARAM, "%s: NULL pointer", fn);
    aclError rc = ACL_SUCCESS;
    if (kind == 1 || kind == 3) rc = check_device_range(dst, count, fn, "destination");
    if (!rc && (kind == 2 || kind == 3)) rc = check_device_range(src, count, fn, "source");
    if (rc) return rc;
    memmove(dst, src, count);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int32_t kind) {
    return do_memcpy(dst, destMax, src, count, kind, "aclrtMemcpy");
}

EXPORT aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, int32_t kind,
                                 void *stream) {
    (void)stream;
    return do_memcpy(dst, destMax, src, count, kind, "aclrtMemcpyAsync");
}

EXPORT aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    NEED_DEVICE();
    if (count > maxCount) return err(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemset: count exceeds maxCount");
    aclError rc = check_device_range(devPtr, count, "aclrtMemset", "destination");
    if (rc) return rc;
    memset(devPtr, value, count);
    return ACL_SUCCESS;
}

/* ---- streams, synchronisation and host memory ---------------------------------------------- */

EXPORT aclError aclrtCreateStream(void **stream) {
    NEED_DEVICE();
    if (!stream) return err(ACL_ERROR_INVALID_PARAM, "aclrtCreateStream: NULL");
    *stream = malloc(16);
    return *stream ? ACL_SUCCESS : err(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtCreateStream: out of memory");
}

EXPORT aclError aclrtDestroyStream(void *stream) {
    NEED_INIT();
    free(stream);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtSynchronizeStream(void *stream) {
    (void)stream;
    NEED_DEVICE();
    return ACL_SUCCESS;
}

EXPORT aclError aclrtSynchronizeDevice(void) {
    NEED_DEVICE();
    return ACL_SUCCESS;
}

/* A host buffer is one page of header (magic, size) followed by the caller's bytes. */
#define HOSTBUF_HDR 4096ull
#define HOSTBUF_MAGIC 0x786c6c6d686f7374ull /* "xllmhost" */

EXPORT aclError aclrtMallocHost(void **hostPtr, size_t size) {
    NEED_INIT();
    if (!hostPtr) return err(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost: hostPtr is NULL");
    if (size == 0 || size > (1ull << 60))
        return err(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost: size %zu is not a positive size", size);
    pthread_mutex_lock(&g_mu);
    aclError rc = check_host_room_locked("aclrtMallocHost", size + HOSTBUF_HDR);
    void *p = NULL;
    if (!rc && posix_memalign(&p, 4096, size + HOSTBUF_HDR))
        rc = err(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMallocHost: out of memory for %zu bytes", size);
    if (!rc) {
        uint64_t *hdr = p;
        hdr[0] = HOSTBUF_MAGIC;
        hdr[1] = size + HOSTBUF_HDR;
        g_hostbuf += size + HOSTBUF_HDR;
        *hostPtr = (char *)p + HOSTBUF_HDR;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

EXPORT aclError aclrtFreeHost(void *hostPtr) {
    NEED_INIT();
    if (!hostPtr || (uintptr_t)hostPtr % 4096)
        return err(ACL_ERROR_INVALID_PARAM, "aclrtFreeHost: %p is not a buffer from aclrtMallocHost", hostPtr);
    uint64_t *hdr = (uint64_t *)((char *)hostPtr - HOSTBUF_HDR);
    pthread_mutex_lock(&g_mu);
    if (hdr[0] != HOSTBUF_MAGIC) {
        pthread_mutex_unlock(&g_mu);
        return err(ACL_ERROR_INVALID_PARAM, "aclrtFreeHost: %p is not a buffer from aclrtMallocHost", hostPtr);
    }
    hdr[0] = 0;
    g_hostbuf -= hdr[1];
    pthread_mutex_unlock(&g_mu);
    free(hdr);
    return ACL_SUCCESS;
}
