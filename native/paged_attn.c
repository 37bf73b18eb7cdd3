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
 * check runs before anything is written, and the one allocation (per-thread score buffers) is
 * freed on every path.
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

/* one (sequence, KV head) work item, bf16 q/K/V/out; D a constant where inlined with one */
TGT static AI void item_bf16_impl(const job_t *j, int64_t b, int64_t g, float *sc,
                                  int64_t *offa, const int64_t D) {
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

TGT static void item_bf16_d64(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, 64); }
TGT static void item_bf16_d128(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, 128); }
TGT static void item_bf16_any(const job_t *j, int64_t b, int64_t g, float *sc, int64_t *o) { item_bf16_impl(j, b, g, sc, o, j->D); }
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
    for (;;) {
        int64_t w0 = __atomic_fetch_add(&j->next, j->chunk, __ATOMIC_RELAXED);
        if (w0 >= j->nitems) break;
        for (int64_t w = w0, we = w0 + j->chunk < j->nitems ? w0 + j->chunk : j->nitems; w < we; w++)
            fn(j, w / j->Hkv, w % j->Hkv, sc, offs);
    }
}

/* Bit 0: the AVX-512 float32 path can run here; bit 1: the AVX-512 bfloat16 path can. */
int xllm_paged_attn_isa(void) { return isa_bits(); }

/* Which implementation a call with these arguments takes: 0 portable, 1 AVX-512 float32,
   2 AVX-512 bfloat16. */
int xllm_paged_decode_impl(int64_t D, int qtype, int kvtype, int flags) {
    int bits = isa_bits();
    if ((flags & XLLM_PA_PORTABLE) || qtype != kvtype || D % 16) return 0;
    if (kvtype == 1 && (bits & 2)) return 2;
    if (kvtype == 0 && (bits & 1)) return 1;
    return 0;
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
    j.scratch = malloc((size_t)nthreads * (size_t)j.scratch_stride);
    if (!j.scratch) return -2;
    xt_pool_run(nthreads, run_items, &j);
    free(j.scratch);
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
