/* Paged decode attention over the virtual KV cache, reading K/V blocks in place.
 *
 * One query token per sequence (a decode): for sequence b and query head h (KV head
 * g = h / G, G = H / Hkv), out[r_b, h] = softmax(scale * q[r_b, h] . K[b, :L_b, g]) @ V[b, :L_b, g]
 * where r_b = rows[b] (rows == NULL: r_b = b) is the row of the step's (T, H, D) q and out
 * tensors, and key t of sequence b lives in block blk = table[b * table_stride + t / block_size]
 * at element  (blk / bps) * page_elems + (blk % bps) * block_size * Hkv * D
 *             + (t % block_size) * Hkv * D + g * D  of the layer's flat K (and V) tensor
 * (the KVCacheViews geometry: slot = blk / bps, one page of page_elems elements per slot).
 * Only the ceil(L_b / block_size) first entries of a table row are read, and only the L_b keys
 * of the sequence (a block's tail beyond L_b is never touched); the current token's K/V are
 * read from the arena (the caller wrote them first).
 *
 * Element types: 0 = float32, 1 = bfloat16, for q/out (qtype) and K/V (kvtype) separately;
 * scores, softmax and the V accumulation are float32; bfloat16 results are rounded to nearest
 * even.
 *
 * Two implementations, chosen at run time:
 * - AVX-512 (x86-64 with avx512f/bw/vl, and avx512_bf16 for bfloat16 K/V; same q and K/V
 *   type): one work item per (sequence, KV head) loads each K and V row once for all G query
 *   heads of the group; scores 16 keys at a time (bf16 pairs through vdpbf16ps, float32 through
 *   FMA; a transpose-tree reduction, no per-key horizontal sum), an exact two-pass softmax with
 *   a vectorised exp2 (polynomial + vscalefps), V accumulated in float32 registers;
 *   With bf16, a head_dim a multiple of 32 up to 128 and AMX-BF16 granted by Linux (impl 3,
 *   unless flags & XLLM_PA_NO_AMX), the scores of every whole 16-key tile inside one block go
 *   on the AMX tiles instead: S^T = K q^T with K's 16 rows loaded straight from the arena at the
 *   token stride (no packing of K) against the group's q^T packed once per item; a sequence's
 *   last partial tile, and tiles across blocks (block_size not a multiple of 16), keep the
 *   AVX-512 scores, so no key beyond L_b is read on either path;
 * - portable C (any other machine, mixed q/K types, or flags & XLLM_PA_PORTABLE): the same
 *   arithmetic in plain loops (expf per score).
 * Work items are taken dynamically (one atomic counter) by `nthreads` threads of the library's
 * persistent pool (threadpool.h; the caller's thread is one of them), so a thread slowed by
 * the machine's load takes fewer. Called through ctypes (the GIL is released).
 *
 * Building with -DXLLM_PA_NO_SIMD leaves only the portable code (what a non-x86 build compiles;
 * used to test that path on x86).
 *
 * Returns 0; -1 bad arguments (a shape, a type, a length outside [1, max_blocks * block_size]);
 * -2 out of memory; -3 a block id used outside [0, num_blocks) or a row outside [0, T). Every
 * check runs before anything is written. The per-thread score buffers are the calling thread's
 * (decode_scratch: kept between calls, grown to the largest call; nothing allocated per call
 * once warm).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#pragma GCC optimize("O3")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "threadpool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(XLLM_PA_NO_SIMD)
#define XLLM_PA_X86 1
#include <immintrin.h>
#endif

#define MAX_D 512
#define MAX_G 16
#define XLLM_PA_PORTABLE 1 /* flags: force the portable implementation */
#define XLLM_PA_NO_AMX 2   /* flags (prefill): the AVX-512 form even where AMX runs */
/* prefetch distance in keys (two tiles ahead into L1), and V rows into L2 during the score pass
   (the V pass then finds them there): measured 5-10 % off a 128-decode layer call */
#ifndef PF_KEYS
#define PF_KEYS 32
#endif
#ifndef CHUNK_SEQ
#define CHUNK_SEQ 1
#endif
#ifndef PF_V_IN_PASS1
#define PF_V_IN_PASS1 1
#endif

typedef struct {
    const void *q; void *out; const int64_t *rows;
    const void *k; const void *v;
    const int64_t *table; int64_t table_stride; const int64_t *lens;
    int64_t B, H, Hkv, D, bs, bps, page_elems;
    float scale; int qtype, kvtype;
    int impl;              /* 0 portable, 1 AVX-512 float32, 2 AVX-512 bfloat16 */
    char *scratch;         /* per thread `scratch_stride` bytes: G * lpad float32 scores, then
                              lpad + PF_KEYS + 16 int64 key offsets */
    int64_t scratch_stride;
    int64_t lpad;          /* longest length rounded up to 16 */
    int64_t nitems;        /* B * Hkv */
    int64_t next;          /* next work item (atomic) */
    int64_t chunk;         /* items per grab: a whole sequence's KV heads when there are enough
                              sequences to balance (its heads then share the core's caches) */
} job_t;

/* ------------------------------------------------------------------------------------------ */
/* key addressing: the element offsets of a sequence's keys, block by block                    */

typedef struct {
    const int64_t *tab;
    int64_t L, bs, bps, page_elems, hd, goff;
    int64_t n, u, t; /* block index, key within the block, keys handed out */
    int64_t base;    /* element offset of key 0 of block n */
} keyit_t;

static inline void keyit_init(keyit_t *it, const job_t *j, int64_t b, int64_t g) {
    it->tab = j->table + b * j->table_stride;
    it->L = j->lens[b];
    it->bs = j->bs;
    it->bps = j->bps;
    it->page_elems = j->page_elems;
    it->hd = j->Hkv * j->D;
    it->goff = g * j->D;
    it->n = 0;
    it->u = 0;
    it->t = 0;
    int64_t blk = it->tab[0];
    it->base = (blk / it->bps) * it->page_elems + (blk % it->bps) * it->bs * it->hd + it->goff;
}

/* offsets of the next min(16, L - t) keys into offs[0..]; offs[cnt..15] repeat offs[0] (a
   valid row, never a byte beyond the sequence); returns cnt */
static inline void keyit_advance(keyit_t *it) {
    it->n++;
    it->u = 0;
    int64_t blk = it->tab[it->n];
    it->base = (blk / it->bps) * it->page_elems + (blk % it->bps) * it->bs * it->hd + it->goff;
}

static inline int keyit_next16(keyit_t *it, int64_t *offs) {
    if (it->u == it->bs && it->t < it->L) keyit_advance(it);
    if (it->bs - it->u >= 16 && it->L - it->t >= 16) { /* 16 keys within one block */
        const int64_t o = it->base + it->u * it->hd, hd = it->hd;
        for (int i = 0; i < 16; i++) offs[i] = o + i * hd;
        it->u += 16;
        it->t += 16;
        return 16;
    }
    int cnt = 0;
    while (cnt < 16 && it->t < it->L) {
        if (it->u == it->bs) keyit_advance(it);
        offs[cnt++] = it->base + it->u * it->hd;
        it->u++;
        it->t++;
    }
    for (int i = cnt; i < 16; i++) offs[i] = offs[0];
    return cnt;
}

/* the element offsets of all L keys of (b, g) into offs[0 .. L), then offs[L .. lt + PF_KEYS)
   (lt = L rounded up to 16) repeat the last tile's first key: every entry read by a tile or by
   a prefetch ahead of it is a row of the sequence */
static inline void fill_offsets(const job_t *j, int64_t b, int64_t g, int64_t *offs) {
    keyit_t it;
    keyit_init(&it, j, b, g);
    const int64_t L = j->lens[b];
    for (int64_t t0 = 0; t0 < L; t0 += 16) keyit_next16(&it, offs + t0);
    const int64_t last = offs[(L - 1) / 16 * 16];
    for (int64_t t = L, lt = (L + 15) / 16 * 16 + PF_KEYS; t < lt; t++) offs[t] = last;
}

/* ------------------------------------------------------------------------------------------ */
/* portable implementation                                                                    */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void load_row(const void *base, int64_t off, int type, int64_t D, float *dst) {
    if (type == 0) {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]);
    }
}

static inline float dot(const float *a, const float *b, int64_t D) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[d + j] * b[d + j];
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

static void item_portable(const job_t *j, int64_t b, int64_t g, float *scores, int64_t *offa) {
    (void)offa;
    const int64_t G = j->H / j->Hkv, L = j->lens[b], D = j->D, lp = j->lpad;
    const int64_t row = j->rows ? j->rows[b] : b;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], kv[MAX_D];
    for (int64_t i = 0; i < G; i++) {
        load_row(j->q, (row * j->H + g * G + i) * D, j->qtype, D, qf[i]);
        for (int64_t d = 0; d < D; d++) qf[i][d] *= j->scale;
        memset(acc[i], 0, (size_t)D * sizeof(float));
    }
    float mx[MAX_G], sum[MAX_G];
    for (int64_t i = 0; i < G; i++) mx[i] = -INFINITY;
    keyit_t it;
    int64_t offs[16];
    keyit_init(&it, j, b, g);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        int cnt = keyit_next16(&it, offs);
        for (int u = 0; u < cnt; u++) {
            load_row(j->k, offs[u], j->kvtype, D, kv);
            for (int64_t i = 0; i < G; i++) {
                float s = dot(qf[i], kv, D);
                scores[i * lp + t0 + u] = s;
                if (s > mx[i]) mx[i] = s;
            }
        }
    }
    for (int64_t i = 0; i < G; i++) {
        float *sc = scores + i * lp, z = 0.f;
        for (int64_t t = 0; t < L; t++) { float e = expf(sc[t] - mx[i]); sc[t] = e; z += e; }
        sum[i] = z;
    }
    keyit_init(&it, j, b, g);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        int cnt = keyit_next16(&it, offs);
        for (int u = 0; u < cnt; u++) {
            load_row(j->v, offs[u], j->kvtype, D, kv);
            for (int64_t i = 0; i < G; i++) {
                float w = scores[i * lp + t0 + u];
                for (int64_t d = 0; d < D; d++) acc[i][d] += w * kv[d];
            }
        }
    }
    for (int64_t i = 0; i < G; i++) {
        float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
        int64_t o = (row * j->H + g * G + i) * D;
        if (j->qtype == 0) {
            float *dst = (float *)j->out + o;
            for (int64_t d = 0; d < D; d++) dst[d] = acc[i][d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)j->out + o;
            for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[i][d] * inv);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* AVX-512 implementation                                                                     */

#ifdef XLLM_PA_X86
#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AI __attribute__((always_inline)) inline

#define TGTA __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static int isa_bits(void);
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define XLLM_ARCH_REQ_XCOMP_PERM 0x1023
#define XLLM_XFEATURE_XTILEDATA 18

/* AMX-TILE and AMX-BF16 on this CPU and the kernel's permission for the tile data granted
   (Linux arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once per process) */
static int amx_ok(void) {
    static int ok = -1;
    int v = __atomic_load_n(&ok, __ATOMIC_ACQUIRE);
    if (v < 0) {
        unsigned a, b, c_, d;
        v = 0;
        if (__get_cpuid_count(7, 0, &a, &b, &c_, &d) && (d & (1u << 22)) && (d & (1u << 24)) &&
            (isa_bits() & 2))
            v = syscall(SYS_arch_prctl, XLLM_ARCH_REQ_XCOMP_PERM, XLLM_XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&ok, v, __ATOMIC_RELEASE);
    }
    return v;
}


/* r[i] = horizontal sum of v[i], i = 0..15 (a transpose tree: 45 shuffles/adds, no per-vector
   horizontal reduction) */
TGT static AI __m512 hsum16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
    for (int k = 0; k < 8; k++)
        x[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        __m512d a = _mm512_castps_pd(x[2 * k]), b = _mm512_castps_pd(x[2 * k + 1]);
        y[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int k = 0; k < 2; k++)
        z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                         _mm512_shuffle_f32x4(z[0], z[1], 0xdd));
}

/* 2^x for x <= 0 (x = -inf gives 0, NaN stays NaN): x = n + f, |f| <= 1/2, 2^f by its Taylor
   series to degree 7 (relative error < 4e-9), scaled by 2^n with vscalefps */
TGT static AI __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-160.f), x); /* second operand NaN -> NaN */
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define LOG2E 1.4426950408889634f

/* softmax numerators in place (sc[i*lp + t] = 2^(s - max) for t < lt, the tiles the score
   pass wrote), 1 / sum per head into inv */
TGT static AI void softmax2(float *sc, int64_t lp, int64_t lt, int64_t G, const __m512 *vmax,
                            float *inv) {
    for (int64_t i = 0; i < G; i++) {
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[i]));
        __m512 z = _mm512_setzero_ps();
        float *s = sc + i * lp;
        for (int64_t t = 0; t < lt; t += 16) {
            __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
            _mm512_storeu_ps(s + t, p);
            z = _mm512_add_ps(z, p);
        }
        float tot = _mm512_reduce_add_ps(z);
        inv[i] = tot > 0.f ? 1.f / tot : 0.f;
    }
}

/* V accumulation of one 16-key tile for HB heads from h0, bf16 K/V: acc holds, per head, D
   floats as chunks of 32 elements split even / odd (the two halves a bf16 pair's shift and mask
   give) */
#define PV_BF16(HB)                                                                           \
    TGT static AI void pv_bf16_##HB(const uint16_t *V, const int64_t *offs, const float *sc,  \
                                    int64_t lp, int64_t t0, int64_t h0, float *acc,           \
                                    int64_t D, int64_t nc, __mmask32 tail) {                  \
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);                               \
        for (int64_t c = 0; c < nc; c++) {                                                    \
            __mmask32 m = c == nc - 1 ? tail : (__mmask32)0xffffffffu;                        \
            __m512 ae[HB], ao[HB];                                                            \
            for (int h = 0; h < HB; h++) {                                                    \
                ae[h] = _mm512_loadu_ps(acc + (h0 + h) * 2 * nc * 16 + c * 32);               \
                ao[h] = _mm512_loadu_ps(acc + (h0 + h) * 2 * nc * 16 + c * 32 + 16);          \
            }                                                                                 \
            for (int u = 0; u < 16; u++) {                                                    \
                __m512i v = _mm512_maskz_loadu_epi16(m, V + offs[u] + c * 32);                \
                __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                    \
                __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));                     \
                for (int h = 0; h < HB; h++) {                                                \
                    __m512 w = _mm512_set1_ps(sc[(h0 + h) * lp + t0 + u]);                    \
                    ae[h] = _mm512_fmadd_ps(w, ve, ae[h]);                                    \
                    ao[h] = _mm512_fmadd_ps(w, vo, ao[h]);                                    \
                }                                                                             \
            }                                                                                 \
            for (int h = 0; h < HB; h++) {                                                    \
                _mm512_storeu_ps(acc + (h0 + h) * 2 * nc * 16 + c * 32, ae[h]);               \
                _mm512_storeu_ps(acc + (h0 + h) * 2 * nc * 16 + c * 32 + 16, ao[h]);          \
            }                                                                                 \
        }                                                                                     \
        (void)D;                                                                              \
    }
PV_BF16(1)
PV_BF16(2)
PV_BF16(4)
PV_BF16(8)

/* the same with the whole head_dim (NC chunks of 32) of HB heads in registers: 2 * HB * NC
   independent FMA chains (the chunk-at-a-time form above is bound by FMA latency) */
#define PV_BF16_R(HB, NC)                                                                     \
    TGT static AI void pv_bf16_r##HB##_##NC(const uint16_t *V, const int64_t *offs,           \
                                            const float *sc, int64_t lp, int64_t t0,          \
                                            int64_t h0, float *acc) {                         \
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);                               \
        __m512 ae[HB][NC], ao[HB][NC];                                                        \
        for (int h = 0; h < HB; h++)                                                          \
            for (int c = 0; c < NC; c++) {                                                    \
                ae[h][c] = _mm512_loadu_ps(acc + (h0 + h) * 2 * NC * 16 + c * 32);            \
                ao[h][c] = _mm512_loadu_ps(acc + (h0 + h) * 2 * NC * 16 + c * 32 + 16);       \
            }                                                                                 \
        for (int u = 0; u < 16; u++) {                                                        \
            __m512 w[HB];                                                                     \
            for (int h = 0; h < HB; h++) w[h] = _mm512_set1_ps(sc[(h0 + h) * lp + t0 + u]);   \
            for (int c = 0; c < NC; c++) {                                                    \
                __m512i v = _mm512_loadu_si512(V + offs[u] + c * 32);                         \
                __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                    \
                __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));                     \
                for (int h = 0; h < HB; h++) {                                                \
                    ae[h][c] = _mm512_fmadd_ps(w[h], ve, ae[h][c]);                           \
                    ao[h][c] = _mm512_fmadd_ps(w[h], vo, ao[h][c]);                           \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < HB; h++)                                                          \
            for (int c = 0; c < NC; c++) {                                                    \
                _mm512_storeu_ps(acc + (h0 + h) * 2 * NC * 16 + c * 32, ae[h][c]);            \
                _mm512_storeu_ps(acc + (h0 + h) * 2 * NC * 16 + c * 32 + 16, ao[h][c]);       \
            }                                                                                 \
    }
PV_BF16_R(1, 2)
PV_BF16_R(2, 2)
PV_BF16_R(4, 2)
PV_BF16_R(1, 4)
PV_BF16_R(2, 4)

/* AMX decode scores (impl 3): tile 0 = S^T (16 keys x G heads, float32), tiles 1 and 6 = A
   (16 K rows x 32 dims, loaded straight from the arena at the token stride), tiles 2 .. 2+nc-1
   = B (q^T of the G heads as bf16 pairs: 16 dim pairs x G), configured once per thread and
   call by damx_begin */
TGTA static void damx_begin(int64_t G, int64_t nc) {
    tilecfg_t cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16; cfg.colsb[0] = (uint16_t)(4 * G);
    cfg.rows[1] = 16; cfg.colsb[1] = 64;
    cfg.rows[6] = 16; cfg.colsb[6] = 64;
    for (int64_t c = 0; c < nc; c++) { cfg.rows[2 + c] = 16; cfg.colsb[2 + c] = (uint16_t)(4 * G); }
    /* GCC does not see ldtilecfg read its operand: keep the stores above */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

TGTA static void damx_end(void) { _tile_release(); }

/* the scores of a whole 16-key tile whose keys lie in one block (rows `hd` elements apart from
   K + o0) on the tiles: S^T = K q^T, then per head i the 16 scores (column i) into s[i] */
TGTA static AI void damx_scores(const uint16_t *K, int64_t o0, int64_t hd, int64_t G,
                                int64_t nc, float *sbuf, __m512 *s) {
    const uint16_t *kb = K + o0;
    const int64_t st = hd * 2;
    _tile_zero(0);
    _tile_loadd(1, kb, st);
    if (nc > 1) _tile_loadd(6, kb + 32, st);
    _tile_dpbf16ps(0, 1, 2);
    if (nc > 1) _tile_dpbf16ps(0, 6, 3);
    if (nc > 2) { _tile_loadd(1, kb + 64, st); _tile_dpbf16ps(0, 1, 4); }
    if (nc > 3) { _tile_loadd(6, kb + 96, st); _tile_dpbf16ps(0, 6, 5); }
    _tile_stored(0, sbuf, 4 * G);
    if (G == 1) {
        s[0] = _mm512_loadu_ps(sbuf);
    } else if (G == 2) {
        const __m512 z0 = _mm512_loadu_ps(sbuf), z1 = _mm512_loadu_ps(sbuf + 16);
        const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i od = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        s[0] = _mm512_permutex2var_ps(z0, ev, z1);
        s[1] = _mm512_permutex2var_ps(z0, od, z1);
    } else {
        const __m512i lane = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32((int)G));
        for (int64_t i = 0; i < G; i++)
            s[i] = _mm512_i32gather_ps(_mm512_add_epi32(lane, _mm512_set1_epi32((int)i)), sbuf, 4);
    }
}

/* one (sequence, KV head) work item, bf16 q/K/V/out; D a constant where inlined with one;
   amx (a constant): whole one-block tiles' scores on the AMX tiles (damx_scores), the others
   (a sequence's last partial tile, tiles across blocks) on AVX-512 */
TGTA static AI void item_bf16_impl(const job_t *j, int64_t b, int64_t g, float *sc,
                                   int64_t *offa, const int64_t D, const int amx) {
    const int64_t G = j->H / j->Hkv, L = j->lens[b], lp = j->lpad;
    const int64_t row = j->rows ? j->rows[b] : b;
    const int64_t nc = (D + 31) / 32;
    const __mmask32 tail = (D % 32) ? (__mmask32)((1u << (D % 32)) - 1) : (__mmask32)0xffffffffu;
    const uint16_t *q = (const uint16_t *)j->q + (row * j->H + g * G) * D;
    const uint16_t *K = (const uint16_t *)j->k, *V = (const uint16_t *)j->v;
    const uint16_t *KP = K, *VP = V;
    const int64_t ROWB = D * 2; /* bytes of a row (prefetch: its first two lines) */
    const float cmul = j->scale * LOG2E;
    __m512 vmax[MAX_G];
    for (int64_t i = 0; i < G; i++) vmax[i] = _mm512_set1_ps(-INFINITY);
    fill_offsets(j, b, g, offa);
    const int64_t hd = j->Hkv * D;
    float sbuf[16 * MAX_G] __attribute__((aligned(64)));
    if (amx) { /* q^T of the group as bf16 pairs: B tile c holds dword c * 16 + kp of each head */
        uint32_t qt[4 * 16 * MAX_G] __attribute__((aligned(64)));
        for (int64_t c = 0; c < nc; c++)
            for (int64_t kp = 0; kp < 16; kp++)
                for (int64_t i = 0; i < G; i++)
                    memcpy(&qt[(c * 16 + kp) * G + i], q + i * D + c * 32 + 2 * kp, 4);
        _tile_loadd(2, qt, 4 * G);
        if (nc > 1) _tile_loadd(3, qt + 16 * G, 4 * G);
        if (nc > 2) _tile_loadd(4, qt + 32 * G, 4 * G);
        if (nc > 3) _tile_loadd(5, qt + 48 * G, 4 * G);
    }
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t *offs = offa + t0;
        const int cnt = L - t0 < 16 ? (int)(L - t0) : 16;
        for (int u = 0; u < 16; u++) {
            for (int64_t l = 0; l < ROWB; l += 64)
                _mm_prefetch((const char *)(KP + offs[PF_KEYS + u]) + l, _MM_HINT_T0);
#if PF_V_IN_PASS1
            for (int64_t l = 0; l < ROWB; l += 64)
                _mm_prefetch((const char *)(VP + offs[u]) + l, _MM_HINT_T1);
#endif
        }
        __mmask16 km = (__mmask16)(cnt == 16 ? 0xffff : (1u << cnt) - 1);
        if (amx && cnt == 16 && offs[15] - offs[0] == 15 * hd) {
            __m512 s[MAX_G];
            damx_scores(K, offs[0], hd, G, nc, sbuf, s);
            for (int64_t i = 0; i < G; i++) {
                const __m512 si = _mm512_mul_ps(s[i], _mm512_set1_ps(cmul));
                _mm512_storeu_ps(sc + i * lp + t0, si);
                vmax[i] = _mm512_max_ps(vmax[i], si);
            }
            continue;
        }
        for (int64_t i = 0; i < G; i++) {
            const uint16_t *qi = q + i * D;
            __m512 acc[16];
            for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc; c++) {
                __mmask32 m = c == nc - 1 ? tail : (__mmask32)0xffffffffu;
                __m512bh qc = (__m512bh)_mm512_maskz_loadu_epi16(m, qi + c * 32);
                for (int u = 0; u < 16; u++)
                    acc[u] = _mm512_dpbf16_ps(
                        acc[u], qc, (__m512bh)_mm512_maskz_loadu_epi16(m, K + offs[u] + c * 32));
            }
            __m512 s = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(cmul));
            s = _mm512_mask_blend_ps(km, _mm512_set1_ps(-INFINITY), s);
            _mm512_storeu_ps(sc + i * lp + t0, s);
            vmax[i] = _mm512_max_ps(vmax[i], s);
        }
    }
    float inv[MAX_G];
    softmax2(sc, lp, (L + 15) / 16 * 16, G, vmax, inv);
    float acc[MAX_G * MAX_D];
    memset(acc, 0, (size_t)(G * 2 * nc * 16) * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t *offs = offa + t0;
        for (int u = 0; u < 16; u++) {
            for (int64_t l = 0; l < ROWB; l += 64)
                _mm_prefetch((const char *)(VP + offs[PF_KEYS + u]) + l, _MM_HINT_T0);
        }
        if (D == 64 && G % 4 == 0)
            for (int64_t h = 0; h < G; h += 4) pv_bf16_r4_2(V, offs, sc, lp, t0, h, acc);
        else if (D == 64 && G % 2 == 0)
            for (int64_t h = 0; h < G; h += 2) pv_bf16_r2_2(V, offs, sc, lp, t0, h, acc);
        else if (D == 64)
            for (int64_t h = 0; h < G; h++) pv_bf16_r1_2(V, offs, sc, lp, t0, h, acc);
        else if (D == 128 && G % 2 == 0)
            for (int64_t h = 0; h < G; h += 2) pv_bf16_r2_4(V, offs, sc, lp, t0, h, acc);
        else if (D == 128)
            for (int64_t h = 0; h < G; h++) pv_bf16_r1_4(V, offs, sc, lp, t0, h, acc);
        else if (G % 8 == 0)
            for (int64_t h = 0; h < G; h += 8) pv_bf16_8(V, offs, sc, lp, t0, h, acc, D, nc, tail);
        else if (G % 4 == 0)
            for (int64_t h = 0; h < G; h += 4) pv_bf16_4(V, offs, sc, lp, t0, h, acc, D, nc, tail);
        else if (G % 2 == 0)
            for (int64_t h = 0; h < G; h += 2) pv_bf16_2(V, offs, sc, lp, t0, h, acc, D, nc, tail);
        else
            for (int64_t h = 0; h < G; h++) pv_bf16_1(V, offs, sc, lp, t0, h, acc, D, nc, tail);
    }
    /* even / odd halves back to element order, scaled by 1 / sum, rounded to bf16 (RNE) */
    const __m512i ilo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ihi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t i = 0; i < G; i++) {
        uint16_t *dst = (uint16_t *)j->out + (row * j->H + g * G + i) * D;
        __m512 w = _mm512_set1_ps(inv[i]);
        for (int64_t c = 0; c < nc; c++) {
            __m512 e = _mm512_loadu_ps(acc + i * 2 * nc * 16 + c * 32);
            __m512 o = _mm512_loadu_ps(acc + i * 2 * nc * 16 + c * 32 + 16);
            __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(e, ilo, o), w);
            __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(e, ihi, o), w);
            __m512i r = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            _mm512_mask_storeu_epi16(dst + c * 32, c == nc - 1 ? tail : (__mmask32)0xffffffffu, r);
        }
    }
}

/* V accumulation of one tile for HB heads, float32 K/V: acc holds D floats per head as chunks
   of 16 */
#define PV_F32(HB)                                                                            \
    TGT static AI void pv_f32_##HB(const float *V, const int64_t *offs, const float *sc,      \
                                   int64_t lp, int64_t t0, int64_t h0, float *acc, int64_t nc,\
                                   __mmask16 tail) {                                          \
        for (int64_t c = 0; c < nc; c++) {                                                    \
            __mmask16 m = c == nc - 1 ? tail : (__mmask16)0xffff;                             \
            __m512 a[HB];                                                                     \
            for (int h = 0; h < HB; h++) a[h] = _mm512_loadu_ps(acc + (h0 + h) * nc * 16 + c * 16); \
            for (int u = 0; u < 16; u++) {                                                    \
                __m512 v = _mm512_maskz_loadu_ps(m, V + offs[u] + c * 16);                    \
                for (int h = 0; h < HB; h++)                                                  \
                    a[h] = _mm512_fmadd_ps(_mm512_set1_ps(sc[(h0 + h) * lp + t0 + u]), v, a[h]); \
            }                                                                                 \
            for (int h = 0; h < HB; h++) _mm512_storeu_ps(acc + (h0 + h) * nc * 16 + c * 16, a[h]); \
        }                                                                                     \
    }
PV_F32(1)
PV_F32(2)
PV_F32(4)
PV_F32(8)

#define PV_F32_R(HB, NC)                                                                      \
    TGT static AI void pv_f32_r##HB##_##NC(const float *V, const int64_t *offs,               \
                                           const float *sc, int64_t lp, int64_t t0,           \
                                           int64_t h0, float *acc) {                          \
        __m512 a[HB][NC];                                                                     \
        for (int h = 0; h < HB; h++)                                                          \
            for (int c = 0; c < NC; c++) a[h][c] = _mm512_loadu_ps(acc + (h0 + h) * NC * 16 + c * 16); \
        for (int u = 0; u < 16; u++) {                                                        \
            __m512 w[HB];                                                                     \
            for (int h = 0; h < HB; h++) w[h] = _mm512_set1_ps(sc[(h0 + h) * lp + t0 + u]);   \
            for (int c = 0; c < NC; c++) {                                                    \
                __m512 v = _mm512_loadu_ps(V + offs[u] + c * 16);                             \
                for (int h = 0; h < HB; h++) a[h][c] = _mm512_fmadd_ps(w[h], v, a[h][c]);     \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < HB; h++)                                                          \
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + (h0 + h) * NC * 16 + c * 16, a[h][c]); \
    }
PV_F32_R(1, 4)
PV_F32_R(2, 4)
PV_F32_R(4, 4)
PV_F32_R(1, 8)
PV_F32_R(2, 8)

TGT static AI void item_f32_impl(const job_t *j, int64_t b, int64_t g, float *sc,
                                  int64_t *offa, const int64_t D) {
    const int64_t G = j->H / j->Hkv, L = j->lens[b], lp = j->lpad;
    const int64_t row = j->rows ? j->rows[b] : b;
    const int64_t nc = (D + 15) / 16;
    const __mmask16 tail = (D % 16) ? (__mmask16)((1u << (D % 16)) - 1) : (__mmask16)0xffff;
    const float *q = (const float *)j->q + (row * j->H + g * G) * D;
    const float *K = (const float *)j->k, *V = (const float *)j->v;
    const float *KP = K, *VP = V;
    const int64_t ROWB = D * 4; /* bytes of a row (prefetch: its first two lines) */
    const float cmul = j->scale * LOG2E;
    __m512 vmax[MAX_G];
    for (int64_t i = 0; i < G; i++) vmax[i] = _mm512_set1_ps(-INFINITY);
    fill_offsets(j, b, g, offa);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t *offs = offa + t0;
        const int cnt = L - t0 < 16 ? (int)(L - t0) : 16;
        for (int u = 0; u < 16; u++) {
            for (int64_t l = 0; l < ROWB; l += 64)
                _mm_prefetch((const char *)(KP + offs[PF_KEYS + u]) + l, _MM_HINT_T0);
#if PF_V_IN_PASS1
            for (int64_t l = 0; l < ROWB; l += 64)
                _mm_prefetch((const char *)(VP + offs[u]) + l, _MM_HINT_T1);
#endif
        }
        __mmask16 km = (__mmask16)(cnt == 16 ? 0xffff : (1u << cnt) - 1);
        for (int64_t i = 0; i < G; i++) {
            const float *qi = q + i * D;
            __m512 acc[16];
            for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc; c++) {
                __mmask16 m = c == nc - 1 ? tail : (__mmask16)0xffff;
                __m512 qc = _mm512_maskz_loadu_ps(m, qi + c * 16);
                for (int u = 0; u < 16; u++)
                    acc[u] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, K + offs[u] + c * 16),
                                             acc[u]);
            }
            __m512 s = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(cmul));
            s = _mm512_mask_blend_ps(km, _mm512_set1_ps(-INFINITY), s);
            _mm512_storeu_ps(sc + i * lp + t0, s);
            vmax[i] = _mm512_max_ps(vmax[i], s);
        }
    }
    float inv[MAX_G];
    softmax2(sc, lp, (L + 15) / 16 * 16, G, vmax, inv);
    float acc[MAX_G * MAX_D];
    memset(acc, 0, (size_t)(G * nc * 16) * sizeof(float));
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t *offs = offa + t0;
        for (int u = 0; u < 16; u++) {
            for (int64_t l = 0; l < ROWB; l += 64)
                _mm_prefetch((const char *)(VP + offs[PF_KEYS + u]) + l, _MM_HINT_T0);
        }
        if (D == 64 && G % 4 == 0)
            for (int64_t h = 0; h < G; h += 4) pv_f32_r4_4(V, offs, sc, lp, t0, h, acc);
        else if (D == 64 && G % 2 == 0)
            for (int64_t h = 0; h < G; h += 2) pv_f32_r2_4(V, offs, sc, lp, t0, h, acc);
        else if (D == 64)
            for (int64_t h = 0; h < G; h++) pv_f32_r1_4(V, offs, sc, lp, t0, h, acc);
        else if (D == 128 && G % 2 == 0)
            for (int64_t h = 0; h < G; h += 2) pv_f32_r2_8(V, offs, sc, lp, t0, h, acc);
        else if (D == 128)
            for (int64_t h = 0; h < G; h++) pv_f32_r1_8(V, offs, sc, lp, t0, h, acc);
        else if (G % 8 == 0)
            for (int64_t h = 0; h < G; h += 8) pv_f32_8(V, offs, sc, lp, t0, h, acc, nc, tail);
        else if (G % 4 == 0)
            for (int64_t h = 0; h < G; h += 4) pv_f32_4(V, offs, sc, lp, t0, h, acc, nc, tail);
        else if (G % 2 == 0)
            for (int64_t h = 0; h < G; h += 2) pv_f32_2(V, offs, sc, lp, t0, h, acc, nc, tail);
        else
            for (int64_t h = 0; h < G; h++) pv_f32_1(V, offs, sc, lp, t0, h, acc, nc, tail);
    }
    for (int64_t i = 0; i < G; i++) {
        float *dst = (float *)j->out + (row * j->H + g * G + i) * D;
        __m512 w = _mm512_set1_ps(inv[i]);
        for (int64_t c = 0; c < nc; c++)
            _mm512_mask_storeu_ps(dst + c * 16, c == nc - 1 ? tail : (__mmask16)0xffff,
                                  _mm512_mul_ps(_mm512_loadu_ps(acc + i * nc * 16 + c * 16), w));
    }
}

TGTA static void item_bf16_d64(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, 64, 0); }
TGTA static void item_bf16_d128(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, 128, 0); }
TGTA static void item_bf16_any(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, j->D, 0); }
TGTA static void item_amx_d64(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, 64, 1); }
TGTA static void item_amx_d128(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, 128, 1); }
TGTA static void item_amx_any(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, j->D, 1); }
TGT static void item_f32_d64(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_f32_impl(j, b, g, sc, o, 64); }
TGT static void item_f32_d128(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_f32_impl(j, b, g, sc, o, 128); }
TGT static void item_f32_any(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_f32_impl(j, b, g, sc, o, j->D); }

static int isa_bits(void) {
    static int bits = -1;
    if (bits < 0) {
        __builtin_cpu_init();
        int f = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
        int bf = f && __builtin_cpu_supports("avx512bf16");
        bits = (f ? 1 : 0) | (bf ? 2 : 0);
    }
    return bits;
}
#else
static int isa_bits(void) { return 0; }
#endif

typedef void (*item_fn)(const job_t *, int64_t, int64_t, float *, int64_t *);

static item_fn pick(const job_t *j) {
    (void)j;
#ifdef XLLM_PA_X86
    if (j->impl == 3)
        return j->D == 64 ? item_amx_d64 : j->D == 128 ? item_amx_d128 : item_amx_any;
    if (j->impl == 2)
        return j->D == 64 ? item_bf16_d64 : j->D == 128 ? item_bf16_d128 : item_bf16_any;
    if (j->impl == 1)
        return j->D == 64 ? item_f32_d64 : j->D == 128 ? item_f32_d128 : item_f32_any;
#endif
    return item_portable;
}

static void run_items(void *ctx, int tid, int n) {
    (void)n;
    job_t *j = (job_t *)ctx;
    item_fn fn = pick(j);
    char *base = j->scratch + (int64_t)tid * j->scratch_stride;
    float *sc = (float *)base;
    int64_t *offs = (int64_t *)(base + (j->H / j->Hkv) * j->lpad * (int64_t)sizeof(float));
#ifdef XLLM_PA_X86
    if (j->impl == 3) damx_begin(j->H / j->Hkv, j->D / 32);
#endif
    for (;;) {
        int64_t w0 = __atomic_fetch_add(&j->next, j->chunk, __ATOMIC_RELAXED);
        if (w0 >= j->nitems) break;
        for (int64_t w = w0, we = w0 + j->chunk < j->nitems ? w0 + j->chunk : j->nitems; w < we; w++)
            fn(j, w / j->Hkv, w % j->Hkv, sc, offs);
    }
#ifdef XLLM_PA_X86
    if (j->impl == 3) damx_end();
#endif
}

/* Bit 0: the AVX-512 float32 path can run here; bit 1: the AVX-512 bfloat16 path can. */
int xllm_paged_attn_isa(void) { return isa_bits(); }

/* Run the kernels' threads on this OpenMP runtime (threadpool.h, xt_pool_use_omp_); returns 1
   when it is in use, 0 when the library's own pool is (any argument NULL). */
int xllm_paged_attn_use_omp(void *parallel, void *thread_num, void *num_threads) {
    return xt_pool_use_omp_(parallel, thread_num, num_threads);
}

#ifndef DECODE_AMX
#define DECODE_AMX 1 /* 0: the AVX-512 scores even where AMX runs (A/B builds) */
#endif

/* Which implementation a call with these arguments takes: 0 portable, 1 AVX-512 float32,
   2 AVX-512 bfloat16, 3 AVX-512 bfloat16 with the scores on the AMX tiles (bfloat16, head_dim
   a multiple of 32 up to 128, where the tiles run and the kernel grants them; flags &
   XLLM_PA_NO_AMX keeps 2). */
int xllm_paged_decode_impl(int64_t D, int qtype, int kvtype, int flags) {
    int bits = isa_bits();
    if ((flags & XLLM_PA_PORTABLE) || qtype != kvtype || D % 16) return 0;
#ifdef XLLM_PA_X86
    if (DECODE_AMX && kvtype == 1 && (bits & 2) && !(flags & XLLM_PA_NO_AMX) && D % 32 == 0 &&
        D <= 128 && amx_ok())
        return 3;
#endif
    if (kvtype == 1 && (bits & 2)) return 2;
    if (kvtype == 0 && (bits & 1)) return 1;
    return 0;
}

/* The calling thread's score / offset buffers, kept between calls and grown to the largest
   asked for (so a decode step's layer calls allocate nothing): thread-local, hence private to
   each concurrent caller (the pool's workers use slices of their caller's). NULL when it cannot
   grow (the old buffer is kept). */
static __thread char *decode_scratch_p;
static __thread size_t decode_scratch_cap;
static char *decode_scratch(size_t need) {
    if (need > decode_scratch_cap) {
        size_t cap = need + need / 2;
        char *p = malloc(cap);
        if (!p) return NULL;
        free(decode_scratch_p);
        decode_scratch_p = p;
        decode_scratch_cap = cap;
    }
    return decode_scratch_p;
}

int xllm_paged_decode(const void *q, void *out, const int64_t *rows, int64_t T, const void *k,
                      const void *v, const int64_t *block_table, int64_t table_stride,
                      int64_t max_blocks, const int64_t *seq_lens, int64_t B, int64_t H,
                      int64_t Hkv, int64_t D, int64_t block_size, int64_t blocks_per_slot,
                      int64_t page_elems, int64_t num_blocks, float scale, int qtype,
                      int kvtype, int nthreads, int flags) {
    if (!q || !out || !k || !v || !block_table || !seq_lens || B < 0 || H < 1 || Hkv < 1 ||
        H % Hkv || H / Hkv > MAX_G || D < 1 || D > MAX_D || block_size < 1 ||
        blocks_per_slot < 1 || max_blocks < 1 || table_stride < max_blocks || num_blocks < 1 ||
        page_elems < blocks_per_slot * block_size * Hkv * D || T < B ||
        (qtype != 0 && qtype != 1) || (kvtype != 0 && kvtype != 1))
        return -1;
    if (B == 0) return 0;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = seq_lens[b];
        if (L < 1 || L > max_blocks * block_size) return -1;
        if (L > max_len) max_len = L;
        const int64_t *tab = block_table + b * table_stride;
        for (int64_t n = 0, nb = (L + block_size - 1) / block_size; n < nb; n++)
            if (tab[n] < 0 || tab[n] >= num_blocks) return -3;
        if (rows && (rows[b] < 0 || rows[b] >= T)) return -3;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > XT_POOL_MAX) nthreads = XT_POOL_MAX;
    if (nthreads > B * Hkv) nthreads = (int)(B * Hkv);
    job_t j = {q, out, rows, k, v, block_table, table_stride, seq_lens, B, H, Hkv, D, block_size,
               blocks_per_slot, page_elems, scale, qtype, kvtype,
               xllm_paged_decode_impl(D, qtype, kvtype, flags), NULL, 0, (max_len + 15) / 16 * 16,
               B * Hkv, 0, CHUNK_SEQ && B >= 8 * nthreads ? Hkv : 1};
    j.scratch_stride = ((H / Hkv) * j.lpad * 4 + (j.lpad + PF_KEYS + 16) * 8 + 63) / 64 * 64;
    j.scratch = decode_scratch((size_t)nthreads * (size_t)j.scratch_stride);
    if (!j.scratch) return -2;
    xt_pool_run(nthreads, run_items, &j);
    return 0;
}

/* Store T new K and V rows into the arena: row t of k / v (Hkv * D elements of `elem` bytes,
 * the rows `src_stride` elements apart, each row contiguous) goes to token off[t] of slot
 * page[t] of the layer's K / V tensors (element (page * page_elems + off * Hkv * D)), the
 * slots views' layout. Returns 0, -1 (bad arguments) or -3 (a page outside [0, num_slots) or
 * an offset outside [0, tokens_per_slot)); every row is checked before the first is written. */
int xllm_write_kv(const void *k, const void *v, int64_t src_stride_k, int64_t src_stride_v,
                  void *k_dst, void *v_dst, const int64_t *page, const int64_t *off, int64_t T,
                  int64_t row_elems, int64_t elem, int64_t page_elems, int64_t num_slots,
                  int64_t tokens_per_slot) {
    if (!k || !v || !k_dst || !v_dst || !page || !off || T < 0 || row_elems < 1 ||
        (elem != 2 && elem != 4) || tokens_per_slot < 1 || page_elems < tokens_per_slot * row_elems ||
        src_stride_k < row_elems || src_stride_v < row_elems)
        return -1;
    for (int64_t t = 0; t < T; t++)
        if (page[t] < 0 || page[t] >= num_slots || off[t] < 0 || off[t] >= tokens_per_slot)
            return -3;
    const size_t n = (size_t)(row_elems * elem);
    for (int64_t t = 0; t < T; t++) {
        const int64_t d = (page[t] * page_elems + off[t] * row_elems) * elem;
        memcpy((char *)k_dst + d, (const char *)k + t * src_stride_k * elem, n);
        memcpy((char *)v_dst + d, (const char *)v + t * src_stride_v * elem, n);
    }
    return 0;
}

/* ========================================================================================== */
/* Multi-query (prefill / chunked-prefill) attention over paged K/V                           */
/*
 * C chunks: chunk c has n_c = q_end[c] - q_start[c] >= 1 query rows q_start[c] ..
 * q_end[c]-1 of the (T, H, D) q and out tensors (chunks in any order, rows not shared) and ends its sequence of L_c = seq_lens[c]
 * keys (n_c <= L_c): query i of the chunk (position L_c - n_c + i) sees the keys
 * j <= L_c - n_c + i of its sequence (causal, the chunk's offset included), read in place
 * through table row c (block_table + c * table_stride) with the decode kernel's addressing.
 * The chunk's own K/V are read from the arena: the caller writes them first (write_kv). Only
 * the ceil(L_c / block_size) first table entries and keys j < L_c are read; out rows outside
 * the chunks are left as they are.
 *
 * Work items: (chunk, tile of PF_QT = 16 queries, KV head), taken dynamically by the pool
 * (last tiles of a chunk, which see the most keys, first); in the AMX form an item is a group of
 * up to PF_QG = 4 consecutive tiles (64 queries), whose tiles share each key block's packed
 * K^T and V (packed once per block instead of once per tile: 0.88-0.95 of the CPU time at
 * head_dim 64, 2,048 queries per call). Per item, keys in blocks of
 * PF_KB = 64 with an online softmax (exp2 domain; running max and sum per query), all G query
 * heads of the KV head sharing each block's K/V reads. AVX-512 forms (same q and K/V type,
 * head_dim a multiple of 32):
 * - bfloat16 (avx512_bf16): scores with the 16 queries as the vector lanes, q packed once per
 *   item as bf16 pairs (vdpbf16ps against each key's pair broadcast from the arena row, no
 *   transpose of K, no horizontal sums; a block's max is a vertical max); probabilities
 *   rounded to bf16 pairs and V packed per block as key pairs, so P.V is vdpbf16ps too (SDPA's
 *   bf16 flash kernel also multiplies bf16 probabilities); float32 accumulation throughout;
 * - float32: the same loop in FMA over float32 (P and V unrounded).
 * Portable C (any other case, or flags & XLLM_PA_PORTABLE): an exact two-pass softmax per
 * query in plain loops.
 *
 * Returns 0; -1 bad arguments (shapes, types, a chunk with n < 1 or n > L, a length above
 * max_blocks * block_size, rows outside [0, T)); -2 out of memory; -3 a block id outside
 * [0, num_blocks). Every check runs before anything is written; the allocations are freed on
 * every path.
 */

#define PF_QT 16
#define PF_KB 64
#ifndef PF_QG
#define PF_QG 4 /* AMX form: query tiles per item sharing each key block's K^T / V packing */
#endif

typedef struct {
    const void *q; void *out; const int64_t *qs, *qe; const int64_t *lens;
    const void *k; const void *v;
    const int64_t *table; int64_t table_stride;
    int64_t C, H, Hkv, D, bs, bps, page_elems;
    float scale; int qtype, kvtype, impl;
    const int64_t *tile_start; /* (C + 1): tiles of the chunks before c */
    int64_t nitems, next;
    char *scratch; int64_t scratch_stride;
    int64_t offs_len;          /* int64 key offsets per thread (longest L + PF_KB, rounded) */
} pjob_t;

/* element offsets of keys 0 .. kend-1 of chunk c, KV head g, into offs; offs[kend ..
   round_up(kend, PF_KB)) repeat offs[0] (a row of the sequence) */
static void pfill_offsets(const pjob_t *j, int64_t c, int64_t g, int64_t kend, int64_t *offs) {
    const int64_t *tab = j->table + c * j->table_stride;
    const int64_t hd = j->Hkv * j->D, bs = j->bs;
    for (int64_t t0 = 0, n = 0; t0 < kend; t0 += bs, n++) {
        const int64_t blk = tab[n];
        const int64_t base = (blk / j->bps) * j->page_elems + (blk % j->bps) * bs * hd + g * j->D;
        const int64_t e = t0 + bs < kend ? t0 + bs : kend;
        for (int64_t t = t0; t < e; t++) offs[t] = base + (t - t0) * hd;
    }
    for (int64_t t = kend, e = (kend + PF_KB - 1) / PF_KB * PF_KB; t < e; t++) offs[t] = offs[0];
}

static void pitem_portable(const pjob_t *j, int64_t c, int64_t tile, int64_t g, char *scr) {
    const int64_t G = j->H / j->Hkv, D = j->D, L = j->lens[c], q0 = j->qs[c];
    const int64_t n = j->qe[c] - q0, i0 = tile * PF_QT;
    const int64_t nq = n - i0 < PF_QT ? n - i0 : PF_QT;
    const int64_t kend = L - n + i0 + nq;
    int64_t *offs = (int64_t *)scr;
    float *sc = (float *)(offs + j->offs_len);
    float qf[MAX_D], acc[MAX_D], kv[MAX_D];
    pfill_offsets(j, c, g, kend, offs);
    for (int64_t u = 0; u < nq; u++) {
        const int64_t lim = L - n + i0 + u; /* last visible key */
        const int64_t row = q0 + i0 + u;
        for (int64_t hh = 0; hh < G; hh++) {
            const int64_t o = (row * j->H + g * G + hh) * D;
            load_row(j->q, o, j->qtype, D, qf);
            for (int64_t d = 0; d < D; d++) qf[d] *= j->scale;
            float mx = -INFINITY;
            for (int64_t t = 0; t <= lim; t++) {
                load_row(j->k, offs[t], j->kvtype, D, kv);
                float s = dot(qf, kv, D);
                sc[t] = s;
                if (s > mx) mx = s;
            }
            float z = 0.f;
            for (int64_t t = 0; t <= lim; t++) { float e = expf(sc[t] - mx); sc[t] = e; z += e; }
            memset(acc, 0, (size_t)D * sizeof(float));
            for (int64_t t = 0; t <= lim; t++) {
                load_row(j->v, offs[t], j->kvtype, D, kv);
                const float w = sc[t];
                for (int64_t d = 0; d < D; d++) acc[d] += w * kv[d];
            }
            const float inv = z > 0.f ? 1.f / z : 0.f;
            if (j->qtype == 0) {
                float *dst = (float *)j->out + o;
                for (int64_t d = 0; d < D; d++) dst[d] = acc[d] * inv;
            } else {
                uint16_t *dst = (uint16_t *)j->out + o;
                for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[d] * inv);
            }
        }
    }
}

#ifdef XLLM_PA_X86
typedef int32_t __attribute__((may_alias)) i32a_t;

/* the causal mask of key jj for the 16 query lanes of a tile whose lane u sees keys
   j <= base + u (keys at or beyond kend: none) */
static inline __mmask16 pf_lanes(int64_t jj, int64_t base, int64_t kend) {
    if (jj >= kend) return 0;
    if (jj <= base) return 0xffff;
    return (__mmask16)(0xffffu << (jj - base));
}

/* online-softmax step of one head over a block of S^T rows (kn16 rows of 16 lanes, masked
   entries -inf): updates m and l, returns alpha (the factor O is rescaled by) into al; the
   probabilities overwrite S */
TGT static AI void pf_softmax(float *S, int64_t kn16, float *m, float *l, float *al) {
    __m512 mb = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < kn16; k++) mb = _mm512_max_ps(mb, _mm512_loadu_ps(S + k * 16));
    const __m512 mo = _mm512_loadu_ps(m);
    const __m512 mn = _mm512_max_ps(mo, mb);
    const __m512 a = exp2_ps(_mm512_sub_ps(mo, mn));
    __m512 z = _mm512_setzero_ps();
    for (int64_t k = 0; k < kn16; k++) {
        __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(S + k * 16), mn));
        _mm512_storeu_ps(S + k * 16, p);
        z = _mm512_add_ps(z, p);
    }
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), a, z));
    _mm512_storeu_ps(m, mn);
    _mm512_storeu_ps(al, a);
}

/* one work item, bf16 q/K/V/out, D a multiple of 32 (a constant where inlined with one) */
TGT static AI void pitem_bf16_impl(const pjob_t *j, int64_t c, int64_t tile, int64_t g,
                                   char *scr, const int64_t D) {
    const int64_t G = j->H / j->Hkv, L = j->lens[c], q0 = j->qs[c];
    const int64_t n = j->qe[c] - q0, i0 = tile * PF_QT;
    const int64_t nq = n - i0 < PF_QT ? n - i0 : PF_QT;
    const int64_t base = L - n + i0, kend = base + nq, D2 = D / 2;
    const uint16_t *K = (const uint16_t *)j->k, *V = (const uint16_t *)j->v;
    const float cmul = j->scale * LOG2E;
    int64_t *offs = (int64_t *)scr;
    uint32_t *Qt = (uint32_t *)(offs + j->offs_len);     /* G x D2 x 16 */
    float *S = (float *)(Qt + G * D2 * 16);              /* G x PF_KB x 16 */
    uint32_t *Pp = (uint32_t *)(S + G * PF_KB * 16);     /* G x PF_KB/2 x 16 */
    uint32_t *Vp = Pp + G * (PF_KB / 2) * 16;            /* PF_KB/2 x D */
    float *O = (float *)(Vp + (PF_KB / 2) * D);          /* G x 16 x D */
    float *M = O + G * 16 * D, *Lsum = M + G * 16, *AL = Lsum + G * 16;
    pfill_offsets(j, c, g, kend, offs);
    for (int64_t hh = 0; hh < G; hh++) {
        uint32_t *qt = Qt + hh * D2 * 16;
        for (int64_t u = 0; u < PF_QT; u++) {
            if (u < nq) {
                const uint32_t *qr = (const uint32_t *)((const uint16_t *)j->q +
                                                         ((q0 + i0 + u) * j->H + g * G + hh) * D);
                for (int64_t p = 0; p < D2; p++) qt[p * 16 + u] = qr[p];
            } else {
                for (int64_t p = 0; p < D2; p++) qt[p * 16 + u] = 0;
            }
        }
        _mm512_storeu_ps(M + hh * 16, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(Lsum + hh * 16, _mm512_setzero_ps());
    }
    memset(O, 0, (size_t)(G * 16 * D) * sizeof(float));
    const __m512i pidx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                          24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                          16, 0);
    const __m512i vlo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i vhi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    const int64_t nqg = (nq + 7) / 8; /* query groups of 8 holding real queries */
    for (int64_t kb0 = 0; kb0 < kend; kb0 += PF_KB) {
        const int64_t kn = kend - kb0 < PF_KB ? kend - kb0 : PF_KB;
        const int64_t kn16 = (kn + 15) / 16 * 16, kpn = (kn + 1) / 2;
        const int64_t *ob = offs + kb0;
        /* scores S^T[key][query lane], per head */
        for (int64_t hh = 0; hh < G; hh++) {
            const uint32_t *qt = Qt + hh * D2 * 16;
            float *Sh = S + hh * PF_KB * 16;
            for (int64_t k16 = 0; k16 < kn16; k16 += 16) {
                __m512 acc[16];
                for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
                const uint16_t *kr[16];
                for (int u = 0; u < 16; u++) kr[u] = K + ob[k16 + u];
                for (int64_t p = 0; p < D2; p++) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + p * 16);
                    for (int u = 0; u < 16; u++)
                        acc[u] = _mm512_dpbf16_ps(
                            acc[u], (__m512bh)_mm512_set1_epi32(*(const i32a_t *)(kr[u] + 2 * p)), qv);
                }
                for (int u = 0; u < 16; u++) {
                    const __mmask16 km = pf_lanes(kb0 + k16 + u, base, kend);
                    __m512 s = _mm512_mul_ps(acc[u], _mm512_set1_ps(cmul));
                    _mm512_storeu_ps(Sh + (k16 + u) * 16,
                                     _mm512_mask_blend_ps(km, _mm512_set1_ps(-INFINITY), s));
                }
            }
            pf_softmax(Sh, kn16, M + hh * 16, Lsum + hh * 16, AL + hh * 16);
            /* probabilities as bf16 pairs (key 2kp, 2kp+1) per query lane */
            uint32_t *pp = Pp + hh * (PF_KB / 2) * 16;
            for (int64_t kp = 0; kp < kpn; kp++) {
                __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(Sh + (2 * kp + 1) * 16),
                                                         _mm512_loadu_ps(Sh + 2 * kp * 16));
                _mm512_storeu_si512(pp + kp * 16, _mm512_permutexvar_epi16(pidx, b));
            }
        }
        /* V as key pairs: Vp[kp][d] = (V[2kp][d], V[2kp+1][d]); rows beyond kend are zero */
        for (int64_t kp = 0; kp < kpn; kp++) {
            const int64_t ka = kb0 + 2 * kp, kb = ka + 1;
            for (int64_t c32 = 0; c32 < D; c32 += 32) {
                __m512i va = _mm512_loadu_si512(V + ob[2 * kp] + c32);
                __m512i vb = kb < kend ? _mm512_loadu_si512(V + ob[2 * kp + 1] + c32)
                                       : _mm512_setzero_si512();
                (void)ka;
                __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
                _mm512_storeu_si512(Vp + kp * D + c32, _mm512_permutex2var_epi64(lo, vlo, hi));
                _mm512_storeu_si512(Vp + kp * D + c32 + 16, _mm512_permutex2var_epi64(lo, vhi, hi));
            }
        }
        /* O = O * alpha + P . V, 8 queries x 32 dims in registers */
        for (int64_t hh = 0; hh < G; hh++) {
            const uint32_t *pp = Pp + hh * (PF_KB / 2) * 16;
            const float *al = AL + hh * 16;
            for (int64_t qg = 0; qg < nqg; qg++) {
                for (int64_t c32 = 0; c32 < D; c32 += 32) {
                    __m512 a0[8], a1[8];
                    for (int r = 0; r < 8; r++) {
                        float *o = O + (hh * 16 + qg * 8 + r) * D + c32;
                        const __m512 w = _mm512_set1_ps(al[qg * 8 + r]);
                        a0[r] = _mm512_mul_ps(_mm512_loadu_ps(o), w);
                        a1[r] = _mm512_mul_ps(_mm512_loadu_ps(o + 16), w);
                    }
                    for (int64_t kp = 0; kp < kpn; kp++) {
                        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(Vp + kp * D + c32);
                        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(Vp + kp * D + c32 + 16);
                        const uint32_t *pr = pp + kp * 16 + qg * 8;
                        for (int r = 0; r < 8; r++) {
                            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pr[r]);
                            a0[r] = _mm512_dpbf16_ps(a0[r], w, v0);
                            a1[r] = _mm512_dpbf16_ps(a1[r], w, v1);
                        }
                    }
                    for (int r = 0; r < 8; r++) {
                        float *o = O + (hh * 16 + qg * 8 + r) * D + c32;
                        _mm512_storeu_ps(o, a0[r]);
                        _mm512_storeu_ps(o + 16, a1[r]);
                    }
                }
            }
        }
    }
    for (int64_t hh = 0; hh < G; hh++)
        for (int64_t u = 0; u < nq; u++) {
            const float ls = Lsum[hh * 16 + u];
            const __m512 w = _mm512_set1_ps(ls > 0.f ? 1.f / ls : 0.f);
            uint16_t *dst = (uint16_t *)j->out + ((q0 + i0 + u) * j->H + g * G + hh) * D;
            const float *o = O + (hh * 16 + u) * D;
            for (int64_t c32 = 0; c32 < D; c32 += 32) {
                __m512i r = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c32 + 16), w),
                                                         _mm512_mul_ps(_mm512_loadu_ps(o + c32), w));
                _mm512_storeu_si512(dst + c32, r);
            }
        }
}

/* one work item, float32 q/K/V/out, D a multiple of 32 */
TGT static AI void pitem_f32_impl(const pjob_t *j, int64_t c, int64_t tile, int64_t g,
                                  char *scr, const int64_t D) {
    const int64_t G = j->H / j->Hkv, L = j->lens[c], q0 = j->qs[c];
    const int64_t n = j->qe[c] - q0, i0 = tile * PF_QT;
    const int64_t nq = n - i0 < PF_QT ? n - i0 : PF_QT;
    const int64_t base = L - n + i0, kend = base + nq;
    const float *K = (const float *)j->k, *V = (const float *)j->v;
    const float cmul = j->scale * LOG2E;
    int64_t *offs = (int64_t *)scr;
    float *Qt = (float *)(offs + j->offs_len);           /* G x D x 16 */
    float *S = Qt + G * D * 16;                          /* G x PF_KB x 16 */
    float *O = S + G * PF_KB * 16;                       /* G x 16 x D */
    float *M = O + G * 16 * D, *Lsum = M + G * 16, *AL = Lsum + G * 16;
    pfill_offsets(j, c, g, kend, offs);
    for (int64_t hh = 0; hh < G; hh++) {
        float *qt = Qt + hh * D * 16;
        for (int64_t u = 0; u < PF_QT; u++) {
            if (u < nq) {
                const float *qr = (const float *)j->q + ((q0 + i0 + u) * j->H + g * G + hh) * D;
                for (int64_t d = 0; d < D; d++) qt[d * 16 + u] = qr[d];
            } else {
                for (int64_t d = 0; d < D; d++) qt[d * 16 + u] = 0.f;
            }
        }
        _mm512_storeu_ps(M + hh * 16, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(Lsum + hh * 16, _mm512_setzero_ps());
    }
    memset(O, 0, (size_t)(G * 16 * D) * sizeof(float));
    const int64_t nqg = (nq + 7) / 8;
    for (int64_t kb0 = 0; kb0 < kend; kb0 += PF_KB) {
        const int64_t kn = kend - kb0 < PF_KB ? kend - kb0 : PF_KB;
        const int64_t kn16 = (kn + 15) / 16 * 16;
        const int64_t *ob = offs + kb0;
        for (int64_t hh = 0; hh < G; hh++) {
            const float *qt = Qt + hh * D * 16;
            float *Sh = S + hh * PF_KB * 16;
            for (int64_t k16 = 0; k16 < kn16; k16 += 16) {
                __m512 acc[16];
                for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
                const float *kr[16];
                for (int u = 0; u < 16; u++) kr[u] = K + ob[k16 + u];
                for (int64_t d = 0; d < D; d++) {
                    const __m512 qv = _mm512_loadu_ps(qt + d * 16);
                    for (int u = 0; u < 16; u++)
                        acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(kr[u][d]), qv, acc[u]);
                }
                for (int u = 0; u < 16; u++) {
                    const __mmask16 km = pf_lanes(kb0 + k16 + u, base, kend);
                    __m512 s = _mm512_mul_ps(acc[u], _mm512_set1_ps(cmul));
                    _mm512_storeu_ps(Sh + (k16 + u) * 16,
                                     _mm512_mask_blend_ps(km, _mm512_set1_ps(-INFINITY), s));
                }
            }
            pf_softmax(Sh, kn16, M + hh * 16, Lsum + hh * 16, AL + hh * 16);
        }
        for (int64_t hh = 0; hh < G; hh++) {
            const float *Sh = S + hh * PF_KB * 16, *al = AL + hh * 16;
            for (int64_t qg = 0; qg < nqg; qg++) {
                for (int64_t c32 = 0; c32 < D; c32 += 32) {
                    __m512 a0[8], a1[8];
                    for (int r = 0; r < 8; r++) {
                        float *o = O + (hh * 16 + qg * 8 + r) * D + c32;
                        const __m512 w = _mm512_set1_ps(al[qg * 8 + r]);
                        a0[r] = _mm512_mul_ps(_mm512_loadu_ps(o), w);
                        a1[r] = _mm512_mul_ps(_mm512_loadu_ps(o + 16), w);
                    }
                    for (int64_t k = 0; k < kn; k++) {
                        const __m512 v0 = _mm512_loadu_ps(V + ob[k] + c32);
                        const __m512 v1 = _mm512_loadu_ps(V + ob[k] + c32 + 16);
                        const float *pr = Sh + k * 16 + qg * 8;
                        for (int r = 0; r < 8; r++) {
                            const __m512 w = _mm512_set1_ps(pr[r]);
                            a0[r] = _mm512_fmadd_ps(w, v0, a0[r]);
                            a1[r] = _mm512_fmadd_ps(w, v1, a1[r]);
                        }
                    }
                    for (int r = 0; r < 8; r++) {
                        float *o = O + (hh * 16 + qg * 8 + r) * D + c32;
                        _mm512_storeu_ps(o, a0[r]);
                        _mm512_storeu_ps(o + 16, a1[r]);
                    }
                }
            }
        }
    }
    for (int64_t hh = 0; hh < G; hh++)
        for (int64_t u = 0; u < nq; u++) {
            const float ls = Lsum[hh * 16 + u];
            const __m512 w = _mm512_set1_ps(ls > 0.f ? 1.f / ls : 0.f);
            float *dst = (float *)j->out + ((q0 + i0 + u) * j->H + g * G + hh) * D;
            const float *o = O + (hh * 16 + u) * D;
            for (int64_t c16 = 0; c16 < D; c16 += 16)
                _mm512_storeu_ps(dst + c16, _mm512_mul_ps(_mm512_loadu_ps(o + c16), w));
        }
}

/* ---- AMX-BF16 (tile) form of the bf16 item ---------------------------------------------- */

/* 16 rows of 16 dwords r[0..15] transposed in place (r[i] lane j <- r[j] lane i) */
TGTA static AI void tr16x16(__m512i *r) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(_mm512_castsi512_ps(r[2 * i]), _mm512_castsi512_ps(r[2 * i + 1]));
        t[2 * i + 1] = _mm512_unpackhi_ps(_mm512_castsi512_ps(r[2 * i]), _mm512_castsi512_ps(r[2 * i + 1]));
    }
    for (int i = 0; i < 4; i++) { /* rows 4i .. 4i+3 from t[4i .. 4i+3] */
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
        r[8 + i] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
    }
}

/* one work item on the AMX tiles: S = Q K^T as 16 queries x 64 keys (4 C tiles, K^T packed
   per block as bf16 pairs), a row-wise online softmax in AVX-512, O += P V (P as bf16 rows,
   V packed per block as key pairs) in up to 4 C tiles of 16 dims at a time */
/* the tile configuration of pitem_amx (tiles 0-5: 16 rows of 64 bytes), loaded once per
   thread and call; amx_end releases the tiles */
static const tilecfg_t amx_cfg __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16}};
TGTA static void amx_begin(void) { _tile_loadconfig(&amx_cfg); }
TGTA static void amx_end(void) { _tile_release(); }

TGTA static void pitem_amx(const pjob_t *j, int64_t c, int64_t grp, int64_t g, char *scr) {
    const int64_t G = j->H / j->Hkv, D = j->D, L = j->lens[c], q0 = j->qs[c];
    const int64_t n = j->qe[c] - q0, i0 = grp * PF_QT * PF_QG;
    const int64_t nqg = n - i0 < PF_QT * PF_QG ? n - i0 : PF_QT * PF_QG;
    const int64_t ntq = (nqg + PF_QT - 1) / PF_QT; /* query tiles of the group */
    const int64_t kend = L - n + i0 + nqg, D32 = D / 32;
    const uint16_t *K = (const uint16_t *)j->k, *V = (const uint16_t *)j->v;
    const float cmul = j->scale * LOG2E;
    int64_t *offs = (int64_t *)scr;
    uint16_t *Qa = (uint16_t *)(offs + j->offs_len);     /* PF_QG x G x 16 x D */
    uint32_t *Kt = (uint32_t *)(Qa + PF_QG * G * 16 * D); /* D32 x 4 x 256 */
    uint32_t *Vp = Kt + D32 * 4 * 256;                   /* 32 x D */
    float *S = (float *)(Vp + 32 * D);                   /* 16 x 64 */
    uint16_t *P = (uint16_t *)(S + 16 * 64);             /* 16 x 64 */
    float *Oa = (float *)(P + 16 * 64);                  /* PF_QG x G x 16 x D */
    float *Ma = Oa + PF_QG * G * 16 * D;                 /* PF_QG x 3 x G x 16: M, Lsum, AL */
    pfill_offsets(j, c, g, kend, offs);
    for (int64_t qt = 0; qt < ntq; qt++)
        for (int64_t hh = 0; hh < G; hh++) {
            for (int64_t u = 0; u < PF_QT; u++) {
                const int64_t qi = qt * PF_QT + u;
                uint16_t *dst = Qa + ((qt * G + hh) * 16 + u) * D;
                if (qi < nqg)
                    memcpy(dst, (const uint16_t *)j->q + ((q0 + i0 + qi) * j->H + g * G + hh) * D,
                           (size_t)D * 2);
                else
                    memset(dst, 0, (size_t)D * 2);
                Ma[qt * 3 * G * 16 + hh * 16 + u] = -INFINITY;
                Ma[qt * 3 * G * 16 + G * 16 + hh * 16 + u] = 0.f;
            }
        }
    memset(Oa, 0, (size_t)(ntq * G * 16 * D) * sizeof(float));
    const __m512i vlo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i vhi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t kb0 = 0; kb0 < kend; kb0 += PF_KB) {
        const int64_t kn = kend - kb0 < PF_KB ? kend - kb0 : PF_KB;
        const int nkt = (int)((kn + 15) / 16), nkc = (int)((kn + 31) / 32);
        const int64_t kpn = (kn + 1) / 2;
        const int64_t *ob = offs + kb0;
        /* K^T tiles: Kt[(c32 * 4 + t) * 256 + p * 16 + key] = dims (2p, 2p+1) of key 16t+key */
        for (int t = 0; t < nkt; t++)
            for (int64_t c32 = 0; c32 < D32; c32++) {
                __m512i r[16];
                for (int u = 0; u < 16; u++) r[u] = _mm512_loadu_si512(K + ob[16 * t + u] + c32 * 32);
                tr16x16(r);
                uint32_t *dst = Kt + (c32 * 4 + t) * 256;
                for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 16, r[p]);
            }
        /* V as key pairs (rows beyond the block's keys zero, to a whole 32-key tile) */
        for (int64_t kp = 0; kp < (int64_t)nkc * 16; kp++) {
            for (int64_t c32 = 0; c32 < D; c32 += 32) {
                __m512i va = kp < kpn ? _mm512_loadu_si512(V + ob[2 * kp] + c32) : _mm512_setzero_si512();
                __m512i vb = kp < kpn && kb0 + 2 * kp + 1 < kend
                                 ? _mm512_loadu_si512(V + ob[2 * kp + 1] + c32) : _mm512_setzero_si512();
                __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
                _mm512_storeu_si512(Vp + kp * D + c32, _mm512_permutex2var_epi64(lo, vlo, hi));
                _mm512_storeu_si512(Vp + kp * D + c32 + 16, _mm512_permutex2var_epi64(lo, vhi, hi));
            }
        }
        /* every query tile of the group that sees keys of this block, on the shared packs */
        for (int64_t qt = 0; qt < ntq; qt++) {
        const int64_t base = L - n + i0 + qt * PF_QT;
        const int64_t nq = nqg - qt * PF_QT < PF_QT ? nqg - qt * PF_QT : PF_QT;
        if (kb0 >= base + nq) continue; /* this tile sees no key of the block (later ones do) */
        const int64_t knt = base + nq - kb0 < kn ? base + nq - kb0 : kn; /* keys it sees here */
        const int tkt = (int)((knt + 15) / 16), tkc = (int)((knt + 31) / 32);
        const uint16_t *Qb = Qa + qt * G * 16 * D;
        float *O = Oa + qt * G * 16 * D;
        float *M = Ma + qt * 3 * G * 16, *Lsum = M + G * 16, *AL = Lsum + G * 16;
        for (int64_t hh = 0; hh < G; hh++) {
            /* S (16 x 64, row stride 256 bytes) = Q K^T */
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t c32 = 0; c32 < D32; c32++) {
                _tile_loadd(4, Qb + hh * 16 * D + c32 * 32, D * 2);
                const uint32_t *kt = Kt + c32 * 4 * 256;
                _tile_loadd(5, kt, 64); _tile_dpbf16ps(0, 4, 5);
                if (tkt > 1) { _tile_loadd(5, kt + 256, 64); _tile_dpbf16ps(1, 4, 5); }
                if (tkt > 2) { _tile_loadd(5, kt + 512, 64); _tile_dpbf16ps(2, 4, 5); }
                if (tkt > 3) { _tile_loadd(5, kt + 768, 64); _tile_dpbf16ps(3, 4, 5); }
            }
            _tile_stored(0, S, 256);
            if (tkt > 1) _tile_stored(1, S + 16, 256);
            if (tkt > 2) _tile_stored(2, S + 32, 256);
            if (tkt > 3) _tile_stored(3, S + 48, 256);
            /* online softmax per query row (visible keys: j <= base + q, j < kend) */
            float *Mh = M + hh * 16, *Lh = Lsum + hh * 16, *Ah = AL + hh * 16;
            float mo16[16] __attribute__((aligned(64))), z16[16] __attribute__((aligned(64)));
            for (int q = 0; q < 16; q++) {
                int64_t vis = base + q - kb0 + 1;
                if (vis > knt) vis = knt;
                __m512 x[4], mx = _mm512_set1_ps(-INFINITY);
                for (int v = 0; v < 4; v++) x[v] = _mm512_set1_ps(-INFINITY);
                for (int v = 0; v < tkt; v++) {
                    const int64_t r = vis - 16 * v;
                    const __mmask16 mk = r >= 16 ? 0xffff : r <= 0 ? 0 : (__mmask16)((1u << r) - 1);
                    x[v] = _mm512_maskz_mul_ps(mk, _mm512_maskz_loadu_ps(mk, S + q * 64 + 16 * v),
                                               _mm512_set1_ps(cmul));
                    x[v] = _mm512_mask_blend_ps(mk, _mm512_set1_ps(-INFINITY), x[v]);
                    mx = _mm512_max_ps(mx, x[v]);
                }
                const float mo = Mh[q], mb = _mm512_reduce_max_ps(mx);
                const float mn = mb > mo ? mb : mo;
                const __m512 mv = _mm512_set1_ps(mn);
                __m512 z = _mm512_setzero_ps(), pv[4];
                for (int v = 0; v < 4; v++) pv[v] = _mm512_setzero_ps();
                for (int v = 0; v < tkt; v++) {
                    pv[v] = exp2_ps(_mm512_sub_ps(x[v], mv));
                    z = _mm512_add_ps(z, pv[v]);
                }
                _mm512_storeu_si512(P + q * 64, (__m512i)_mm512_cvtne2ps_pbh(pv[1], pv[0]));
                if (tkc > 1)
                    _mm512_storeu_si512(P + q * 64 + 32, (__m512i)_mm512_cvtne2ps_pbh(pv[3], pv[2]));
                mo16[q] = mo;
                z16[q] = _mm512_reduce_add_ps(z);
                Mh[q] = mn;
            }
            { /* the 16 rows' rescale factors at once: alpha = 2^(m_old - m_new), 0 at first */
                const __m512 mo = _mm512_loadu_ps(mo16), mn = _mm512_loadu_ps(Mh);
                const __mmask16 first = _mm512_cmp_ps_mask(mo, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
                const __m512 a = _mm512_mask_blend_ps(first, exp2_ps(_mm512_sub_ps(mo, mn)),
                                                      _mm512_setzero_ps());
                _mm512_storeu_ps(Ah, a);
                _mm512_storeu_ps(Lh, _mm512_fmadd_ps(_mm512_loadu_ps(Lh), a, _mm512_loadu_ps(z16)));
            }
            /* O = O * alpha + P V */
            float *Oh = O + hh * 16 * D;
            for (int q = 0; q < 16; q++) {
                const __m512 w = _mm512_set1_ps(Ah[q]);
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(Oh + q * D + d, _mm512_mul_ps(_mm512_loadu_ps(Oh + q * D + d), w));
            }
            for (int64_t dc = 0; dc < D; dc += 64) {
                const int nt = D - dc >= 64 ? 4 : (int)((D - dc) / 16);
                float *oc = Oh + dc;
                _tile_loadd(0, oc, D * 4);
                _tile_loadd(1, oc + 16, D * 4);
                if (nt > 2) { _tile_loadd(2, oc + 32, D * 4); _tile_loadd(3, oc + 48, D * 4); }
                for (int kc = 0; kc < tkc; kc++) {
                    _tile_loadd(4, P + kc * 32, 128);
                    const uint32_t *vp = Vp + (int64_t)kc * 16 * D + dc;
                    _tile_loadd(5, vp, D * 4); _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(5, vp + 16, D * 4); _tile_dpbf16ps(1, 4, 5);
                    if (nt > 2) {
                        _tile_loadd(5, vp + 32, D * 4); _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(5, vp + 48, D * 4); _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, oc, D * 4);
                _tile_stored(1, oc + 16, D * 4);
                if (nt > 2) { _tile_stored(2, oc + 32, D * 4); _tile_stored(3, oc + 48, D * 4); }
            }
        }
        }
    }
    for (int64_t qi = 0; qi < nqg; qi++)
        for (int64_t hh = 0; hh < G; hh++) {
            const int64_t qt = qi / PF_QT, u = qi % PF_QT;
            const float ls = Ma[qt * 3 * G * 16 + G * 16 + hh * 16 + u];
            const __m512 w = _mm512_set1_ps(ls > 0.f ? 1.f / ls : 0.f);
            uint16_t *dst = (uint16_t *)j->out + ((q0 + i0 + qi) * j->H + g * G + hh) * D;
            const float *o = Oa + ((qt * G + hh) * 16 + u) * D;
            for (int64_t c32 = 0; c32 < D; c32 += 32) {
                __m512i r = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c32 + 16), w),
                                                         _mm512_mul_ps(_mm512_loadu_ps(o + c32), w));
                _mm512_storeu_si512(dst + c32, r);
            }
        }
}

TGT static void pitem_bf16_d64(const pjob_t *j, int64_t c, int64_t t, int64_t g, char *s) { pitem_bf16_impl(j, c, t, g, s, 64); }
TGT static void pitem_bf16_d128(const pjob_t *j, int64_t c, int64_t t, int64_t g, char *s) { pitem_bf16_impl(j, c, t, g, s, 128); }
TGT static void pitem_bf16_any(const pjob_t *j, int64_t c, int64_t t, int64_t g, char *s) { pitem_bf16_impl(j, c, t, g, s, j->D); }
TGT static void pitem_f32_d64(const pjob_t *j, int64_t c, int64_t t, int64_t g, char *s) { pitem_f32_impl(j, c, t, g, s, 64); }
TGT static void pitem_f32_d128(const pjob_t *j, int64_t c, int64_t t, int64_t g, char *s) { pitem_f32_impl(j, c, t, g, s, 128); }
TGT static void pitem_f32_any(const pjob_t *j, int64_t c, int64_t t, int64_t g, char *s) { pitem_f32_impl(j, c, t, g, s, j->D); }
#endif

typedef void (*pitem_fn)(const pjob_t *, int64_t, int64_t, int64_t, char *);

static pitem_fn ppick(const pjob_t *j) {
#ifdef XLLM_PA_X86
    if (j->impl == 3) return pitem_amx;
    if (j->impl == 2)
        return j->D == 64 ? pitem_bf16_d64 : j->D == 128 ? pitem_bf16_d128 : pitem_bf16_any;
    if (j->impl == 1)
        return j->D == 64 ? pitem_f32_d64 : j->D == 128 ? pitem_f32_d128 : pitem_f32_any;
#endif
    (void)j;
    return pitem_portable;
}

static void prun_items(void *ctx, int tid, int nthr) {
    (void)nthr;
    pjob_t *j = (pjob_t *)ctx;
    pitem_fn fn = ppick(j);
    char *scr = j->scratch + (int64_t)tid * j->scratch_stride;
#ifdef XLLM_PA_X86
    if (j->impl == 3) amx_begin();
#endif
    for (;;) {
        const int64_t w = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (w >= j->nitems) break;
        const int64_t gt = w / j->Hkv, g = w % j->Hkv;
        int64_t lo = 0, hi = j->C - 1; /* the chunk c with tile_start[c] <= gt < tile_start[c+1] */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (j->tile_start[mid] <= gt) lo = mid; else hi = mid - 1;
        }
        const int64_t ntiles = j->tile_start[lo + 1] - j->tile_start[lo];
        fn(j, lo, ntiles - 1 - (gt - j->tile_start[lo]), g, scr); /* last tiles first */
    }
#ifdef XLLM_PA_X86
    if (j->impl == 3) amx_end();
#endif
}

/* Which implementation a prefill call with these arguments takes: 0 portable, 1 AVX-512
   float32, 2 AVX-512 bfloat16, 3 AMX-BF16 (bfloat16 where the tiles run and the kernel grants
   them; flags & XLLM_PA_NO_AMX keeps the AVX-512 form). */
int xllm_paged_prefill_impl(int64_t D, int qtype, int kvtype, int flags) {
    int bits = isa_bits();
    if ((flags & XLLM_PA_PORTABLE) || qtype != kvtype || D % 32) return 0;
#ifdef XLLM_PA_X86
    if (kvtype == 1 && !(flags & XLLM_PA_NO_AMX) && amx_ok()) return 3;
#endif
    if (kvtype == 1 && (bits & 2)) return 2;
    if (kvtype == 0 && (bits & 1)) return 1;
    return 0;
}

int xllm_paged_prefill(const void *q, void *out, int64_t T, const void *k, const void *v,
                       const int64_t *block_table, int64_t table_stride, int64_t max_blocks,
                       const int64_t *q_start, const int64_t *q_end, const int64_t *seq_lens,
                       int64_t C, int64_t H,
                       int64_t Hkv, int64_t D, int64_t block_size, int64_t blocks_per_slot,
                       int64_t page_elems, int64_t num_blocks, float scale, int qtype,
                       int kvtype, int nthreads, int flags) {
    if (!q || !out || !k || !v || !block_table || !q_start || !q_end || !seq_lens || C < 0 || H < 1 ||
        Hkv < 1 || H % Hkv || H / Hkv > MAX_G || D < 1 || D > MAX_D || block_size < 1 ||
        blocks_per_slot < 1 || max_blocks < 1 || table_stride < max_blocks || num_blocks < 1 ||
        page_elems < blocks_per_slot * block_size * Hkv * D || T < 0 ||
        (qtype != 0 && qtype != 1) || (kvtype != 0 && kvtype != 1))
        return -1;
    if (C == 0) return 0;
    const int impl = xllm_paged_prefill_impl(D, qtype, kvtype, flags);
    const int64_t qg = impl == 3 ? PF_QG : 1; /* query tiles per work item */
    int64_t max_len = 0, tiles = 0;
    for (int64_t c = 0; c < C; c++) {
        const int64_t n = q_end[c] - q_start[c], L = seq_lens[c];
        if (q_start[c] < 0 || q_end[c] > T || n < 1 || L < n || L > max_blocks * block_size)
            return -1;
        if (L > max_len) max_len = L;
        tiles += (n + PF_QT * qg - 1) / (PF_QT * qg);
        const int64_t *tab = block_table + c * table_stride;
        for (int64_t b = 0, nb = (L + block_size - 1) / block_size; b < nb; b++)
            if (tab[b] < 0 || tab[b] >= num_blocks) return -3;
    }
    const int64_t G = H / Hkv;
    pjob_t j = {q, out, q_start, q_end, seq_lens, k, v, block_table, table_stride, C, H, Hkv, D,
                block_size, blocks_per_slot, page_elems, scale, qtype, kvtype,
                impl, NULL, tiles * Hkv, 0, NULL,
                0, (max_len + PF_KB + 15) / 16 * 16};
    int64_t floats; /* per-thread float32-sized words after the offsets */
    if (j.impl == 0)
        floats = max_len + 16;
    else if (j.impl == 3)
        floats = PF_QG * G * 16 * D / 2 + (D / 32) * 4 * 256 + 32 * D + 16 * 64 + 16 * 64 / 2 +
                 PF_QG * (G * 16 * D + 3 * G * 16);
    else if (j.impl == 1)
        floats = G * D * 16 + G * PF_KB * 16 + G * 16 * D + 3 * G * 16;
    else
        floats = G * (D / 2) * 16 + G * PF_KB * 16 + G * (PF_KB / 2) * 16 + (PF_KB / 2) * D +
                 G * 16 * D + 3 * G * 16;
    j.scratch_stride = (j.offs_len * 8 + floats * 4 + 63) / 64 * 64;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > XT_POOL_MAX) nthreads = XT_POOL_MAX;
    if (nthreads > j.nitems) nthreads = (int)j.nitems;
    int64_t *ts = malloc((size_t)(C + 1) * sizeof(int64_t));
    if (!ts) return -2;
    ts[0] = 0;
    for (int64_t c = 0; c < C; c++)
        ts[c + 1] = ts[c] + (q_end[c] - q_start[c] + PF_QT * qg - 1) / (PF_QT * qg);
    j.tile_start = ts;
    void *scr = NULL;
    if (posix_memalign(&scr, 64, (size_t)nthreads * (size_t)j.scratch_stride) != 0) {
        free(ts);
        return -2;
    }
    j.scratch = (char *)scr;
    xt_pool_run(nthreads, prun_items, &j);
    free(scr);
    free(ts);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Plain streaming read (the decode kernel's roofline, `bench attention`)                     */

typedef struct { const char *p; int64_t bytes; int64_t per; uint64_t out[XT_POOL_MAX]; } sjob_t;

#ifdef XLLM_PA_X86
TGT static uint64_t stream_part(const char *p, int64_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
    }
    uint64_t r = (uint64_t)_mm512_reduce_add_epi64(
        _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
    for (; i < n; i++) r += (unsigned char)p[i];
    return r;
}
#endif

static uint64_t stream_part_portable(const char *p, int64_t n) {
    uint64_t r = 0, w;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { memcpy(&w, p + i, 8); r ^= w; }
    for (; i < n; i++) r += (unsigned char)p[i];
    return r;
}

static void stream_run(void *ctx, int tid, int nthr) {
    (void)nthr;
    sjob_t *s = (sjob_t *)ctx;
    const int64_t a = (int64_t)tid * s->per, e = a + s->per < s->bytes ? a + s->per : s->bytes;
    if (a >= e) { s->out[tid] = 0; return; }
#ifdef XLLM_PA_X86
    if (isa_bits() & 1) { s->out[tid] = stream_part(s->p + a, e - a); return; }
#endif
    s->out[tid] = stream_part_portable(s->p + a, e - a);
}

/* Reads `bytes` bytes from p once (64-byte vector loads where AVX-512 runs), split evenly over
   `nthreads` threads of the pool; returns a checksum (so that the reads are not elided). */
uint64_t xllm_stream_read(const void *p, int64_t bytes, int nthreads) {
    if (!p || bytes <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > XT_POOL_MAX) nthreads = XT_POOL_MAX;
    sjob_t s;
    s.p = (const char *)p;
    s.bytes = bytes;
    s.per = (bytes / nthreads + 63) / 64 * 64;
    xt_pool_run(nthreads, stream_run, &s);
    uint64_t r = 0;
    for (int t = 0; t < nthreads; t++) r ^= s.out[t];
    return r;
}
