/* Paged decode attention over the virtual KV cache, reading K/V blocks in place.
 *
 * One query token per sequence (a decode): for sequence b and query head h (KV head
 * g = h / (H / Hkv)), out[b, h] = softmax(scale * q[b, h] . K[b, :L_b, g]) @ V[b, :L_b, g],
 * accumulated in float32, where key t of sequence b lives in block table[b, t / block_size]
 * at element  (blk / bps) * page_elems + (blk % bps) * block_size * Hkv * D
 *             + (t % block_size) * Hkv * D + g * D  of the layer's flat K (and V) tensor
 * (the KVCacheViews geometry: slot = blk / bps, one page of page_elems elements per slot).
 *
 * Element types: 0 = float32, 1 = bfloat16, for q/out (qtype) and K/V (kvtype) separately;
 * bfloat16 results are rounded to nearest even. Work is split over (sequence, KV head) pairs
 * between `nthreads` threads (the caller's thread plus nthreads - 1 pthreads per call); the
 * Python side calls it through ctypes, which releases the GIL. No allocation beyond one
 * float32 score buffer per thread (max_len * heads-per-group floats).
 *
 * Returns 0, or -1 (bad arguments) / -2 (out of memory); nothing is written then.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#pragma GCC optimize("O3")
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 512
#define MAX_G 16

typedef struct {
    const void *q; void *out; const void *k; const void *v;
    const int64_t *table; int64_t max_blocks; const int64_t *lens;
    int64_t B, H, Hkv, D, bs, bps, page_elems;
    float scale; int qtype, kvtype;
    int64_t max_len;
    int nthreads, tid;
    int rc;
} job_t;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __attribute__((always_inline)) void load_row(const void *base, int64_t off, int type, int64_t D, float *dst) {
    if (type == 0) {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        uint32_t u[MAX_D];
        for (int64_t d = 0; d < D; d++) u[d] = (uint32_t)s[d] << 16;
        memcpy(dst, u, (size_t)D * sizeof(float)); /* bf16 is the high half of a float32 */
    }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t D) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[d + j] * b[d + j];
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline __attribute__((always_inline)) void axpy(float *acc, const float *x, float w, int64_t D) {
    for (int64_t d = 0; d < D; d++) acc[d] += w * x[d];
}

/* one (sequence, KV head) pair; head_dim D is a compile-time constant in the common cases
   (one_impl inlined into one_d64 / one_d128, the loops unrolled), run time otherwise */
static inline __attribute__((always_inline)) void one_impl(const job_t *j, int64_t b, int64_t g,
                                                            float *scores, const int64_t D) {
    const int64_t G = j->H / j->Hkv, L = j->lens[b], bs = j->bs;
    const int64_t hd = j->Hkv * D;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], row[MAX_D];
    for (int64_t i = 0; i < G; i++) {
        load_row(j->q, (b * j->H + g * G + i) * D, j->qtype, D, qf[i]);
        for (int64_t d = 0; d < D; d++) qf[i][d] *= j->scale;
        memset(acc[i], 0, (size_t)D * sizeof(float));
    }
    const int64_t *tab = j->table + b * j->max_blocks;
    const int64_t nblk = (L + bs - 1) / bs;
    float mx[MAX_G];
    for (int64_t i = 0; i < G; i++) mx[i] = -INFINITY;
    /* pass 1: scores, block by block (one address computation per block) */
    for (int64_t n = 0; n < nblk; n++) {
        const int64_t blk = tab[n];
        const int64_t base = (blk / j->bps) * j->page_elems + (blk % j->bps) * bs * hd + g * D;
        const int64_t t0 = n * bs, tn = (L - t0 < bs) ? L - t0 : bs;
        for (int64_t u = 0; u < tn; u++) {
            load_row(j->k, base + u * hd, j->kvtype, D, row);
            for (int64_t i = 0; i < G; i++) {
                float s = dot(qf[i], row, D);
                scores[i * j->max_len + t0 + u] = s;
                if (s > mx[i]) mx[i] = s;
            }
        }
    }
    float sum[MAX_G];
    for (int64_t i = 0; i < G; i++) {
        float *sc = scores + i * j->max_len, z = 0.f;
        for (int64_t t = 0; t < L; t++) { float e = expf(sc[t] - mx[i]); sc[t] = e; z += e; }
        sum[i] = z;
    }
    /* pass 2: probabilities times V */
    for (int64_t n = 0; n < nblk; n++) {
        const int64_t blk = tab[n];
        const int64_t base = (blk / j->bps) * j->page_elems + (blk % j->bps) * bs * hd + g * D;
        const int64_t t0 = n * bs, tn = (L - t0 < bs) ? L - t0 : bs;
        for (int64_t u = 0; u < tn; u++) {
            load_row(j->v, base + u * hd, j->kvtype, D, row);
            for (int64_t i = 0; i < G; i++) axpy(acc[i], row, scores[i * j->max_len + t0 + u], D);
        }
    }
    for (int64_t i = 0; i < G; i++) {
        float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
        int64_t o = (b * j->H + g * G + i) * D;
        if (j->qtype == 0) {
            float *dst = (float *)j->out + o;
            for (int64_t d = 0; d < D; d++) dst[d] = acc[i][d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)j->out + o;
            for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[i][d] * inv);
        }
    }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
static void one_d64(const job_t *j, int64_t b, int64_t g, float *scores) { one_impl(j, b, g, scores, 64); }
__attribute__((target_clones("avx512f", "avx2", "default")))
static void one_d128(const job_t *j, int64_t b, int64_t g, float *scores) { one_impl(j, b, g, scores, 128); }
__attribute__((target_clones("avx512f", "avx2", "default")))
static void one_any(const job_t *j, int64_t b, int64_t g, float *scores) { one_impl(j, b, g, scores, j->D); }

static void one(const job_t *j, int64_t b, int64_t g, float *scores) {
    if (j->D == 64) one_d64(j, b, g, scores);
    else if (j->D == 128) one_d128(j, b, g, scores);
    else one_any(j, b, g, scores);
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    int64_t G = j->H / j->Hkv;
    float *scores = malloc((size_t)(j->max_len > 0 ? j->max_len : 1) * G * sizeof(float));
    if (!scores) { j->rc = -2; return NULL; }
    int64_t n = j->B * j->Hkv;
    for (int64_t w = j->tid; w < n; w += j->nthreads) one(j, w / j->Hkv, w % j->Hkv, scores);
    free(scores);
    j->rc = 0;
    return NULL;
}

int xllm_paged_decode(const void *q, void *out, const void *k, const void *v,
                      const int64_t *block_table, int64_t max_blocks, const int64_t *seq_lens,
                      int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                      int64_t blocks_per_slot, int64_t page_elems, float scale, int qtype,
                      int kvtype, int nthreads) {
    if (!q || !out || !k || !v || !block_table || !seq_lens || B < 0 || H < 1 || Hkv < 1 ||
        H % Hkv || H / Hkv > MAX_G || D < 1 || D > MAX_D || block_size < 1 ||
        blocks_per_slot < 1 || (qtype != 0 && qtype != 1) || (kvtype != 0 && kvtype != 1))
        return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * block_size) return -1;
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (nthreads > B * Hkv) nthreads = (int)(B * Hkv > 0 ? B * Hkv : 1);
    job_t jobs[64];
    memset(jobs, 0, sizeof jobs);
    pthread_t th[64];
    int started[64] = {0};
    for (int i = 0; i < nthreads; i++) {
        job_t j = {q, out, k, v, block_table, max_blocks, seq_lens, B, H, Hkv, D, block_size,
                   blocks_per_slot, page_elems, scale, qtype, kvtype, max_len, nthreads, i, -1};
        jobs[i] = j;
    }
    for (int i = 1; i < nthreads; i++)
        started[i] = pthread_create(&th[i], NULL, worker, &jobs[i]) == 0;
    /* threads that failed to start: their share runs here */
    worker(&jobs[0]);
    int rc = jobs[0].rc;
    for (int i = 1; i < nthreads; i++) {
        if (started[i]) {
            pthread_join(th[i], NULL);
        } else {
            worker(&jobs[i]);
        }
        if (jobs[i].rc) rc = jobs[i].rc;
    }
    return rc;
}
