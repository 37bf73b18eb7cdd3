/* Fused elementwise layer ops of the engine's decoder (xllm_vmm.engine.layers.layer_ops):
 *
 *   xllm_rms_norm      out = w * rms_norm(x)             (optionally residual += x first: the
 *                                                          fused_add_rms_norm pattern of vLLM)
 *   xllm_silu_and_mul  out = silu(gate) * up              (the gated MLP's activation)
 *   xllm_rope          q, k rotated in place at positions (neox "rotate half" or GPT-J pairs,
 *                                                          partial rotary: the first rot_dim dims)
 *   xllm_rope_out      the same with q's result written to another tensor (a fused q/k/v
 *                      product's strided q into the contiguous q attention reads: one pass)
 *
 * Each is one pass over its rows, computed in float32 with the roundings Hugging Face's torch
 * formulas make in the activations' dtype, so bfloat16 results equal torch's op-by-op results
 * except where an exp/sum differs in its last float32 bit before rounding:
 *   rms_norm:  s = src (residual: s = round(r + x), stored back into r);
 *              h = round(s * (1 / sqrt(sum(s^2) / H + eps)));  out = round(w * h)
 *   silu*mul:  a = round(g / (1 + exp(-g)));  out = round(a * u)
 *   rope:      neox:  y_i = round(round(x_i c_i) - round(x_{i+h} s_i)),
 *                     y_{i+h} = round(round(x_{i+h} c_{i+h}) + round(x_i s_{i+h}))  (h = rot/2)
 *              GPT-J: y_2i = round(round(x_2i c_i) - round(x_2i+1 s_i)),
 *                     y_2i+1 = round(round(x_2i+1 c_i) + round(x_2i s_i))
 * where round() is float32 -> bfloat16 round-to-nearest-even (NaN -> 0x7fc0, torch's) for
 * bfloat16 and the identity for float32.
 *
 * dtype codes: 0 float32, 1 bfloat16 (tensors, weights and cos/sin tables of one call share it).
 * Strides are in elements. Every entry point returns 0, or -1 for arguments it refuses (null
 * pointers, sizes < 0, an unknown dtype) without touching memory.
 *
 * Instruction sets: an AVX-512 (F + BW + VL) path chosen at run time (__builtin_cpu_supports)
 * and a portable C path for every other CPU (any x86-64 or aarch64 gcc). Both evaluate the same
 * float32 expressions in the same order (16-lane partial sums, the same exp polynomial, no
 * fused multiply-add), so they give the same bits; xllm_layer_ops_set_isa(0) forces the portable
 * path (tests). No -march flags are needed or used.
 *
 * Threads: rows are split between nthreads threads of the persistent pool in threadpool.h when
 * the work is large enough to pay for the hand-off (else the caller does it alone). ctypes
 * releases the GIL around every call.
 */
#pragma GCC optimize("fp-contract=off", "no-math-errno")

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define XLO_X86 1
#endif

#if defined(__has_include)
#if __has_include("threadpool.h")
#include "threadpool.h" /* the engine's one persistent native pool (one per library) */
#define XLO_HAVE_POOL 1
#endif
#endif

#define ABI_VERSION 2 /* 2: xllm_rope_out */

/* ---------------------------------------------------------------- scalar helpers */

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ld(const void *p, int64_t i, int dt) {
    return dt ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rnd(float f, int dt) { return dt ? bf2f(f2bf(f)) : f; }

static inline void st(void *p, int64_t i, float f, int dt) {
    if (dt) ((uint16_t *)p)[i] = f2bf(f);
    else ((float *)p)[i] = f;
}

/* exp on [-87.3, 88.0] (clamped): Cephes' expf, the same expression in both paths. */
#define EXP_HI 88.0f
#define EXP_LO -87.3f
#define LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define P0 1.9875691500E-4f
#define P1 1.3981999507E-3f
#define P2 8.3334519073E-3f
#define P3 4.1665795894E-2f
#define P4 1.6666665459E-1f
#define P5 5.0000001201E-1f

static inline float exp_s(float x) {
    x = x > EXP_HI ? EXP_HI : (x < EXP_LO ? EXP_LO : x);
    float t = x * LOG2E + 0.5f, fx = (float)(int32_t)t;
    if (fx > t) fx -= 1.0f; /* floor (t is within +-128) */
    float r = x - fx * EXP_C1;
    r = r - fx * EXP_C2;
    float z = r * r;
    float y = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5;
    y = y * z + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)fx + 127) << 23;
    float p2;
    memcpy(&p2, &bits, 4);
    return y * p2;
}

/* 16 partial sums reduced in a fixed order (the vector path stores its lanes and does this). */
static inline float reduce16(const float *a) {
    float b[8];
    for (int i = 0; i < 8; i++) b[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) b[i] = b[i] + b[i + 4];
    for (int i = 0; i < 2; i++) b[i] = b[i] + b[i + 2];
    return b[0] + b[1];
}

/* ---------------------------------------------------------------- portable rows */

static void rms_row_c(void *out, const void *x, void *res, const void *w, int64_t H, float eps,
                      int dt) {
    float acc[16] = {0};
    const void *src = x;
    if (res) {
        for (int64_t i = 0; i < H; i++) st(res, i, ld(res, i, dt) + ld(x, i, dt), dt);
        src = res;
    }
    for (int64_t i = 0; i < H; i++) {
        float v = ld(src, i, dt);
        acc[i & 15] += v * v;
    }
    float inv = 1.0f / __builtin_sqrtf(reduce16(acc) / (float)H + eps);
    for (int64_t i = 0; i < H; i++) st(out, i, ld(w, i, dt) * rnd(ld(src, i, dt) * inv, dt), dt);
}

static void silu_row_c(void *out, const void *g, const void *u, int64_t n, int dt) {
    for (int64_t i = 0; i < n; i++) {
        float a = ld(g, i, dt);
        a = rnd(a / (1.0f + exp_s(-a)), dt);
        st(out, i, a * ld(u, i, dt), dt);
    }
}

/* dst = rope(src) over the first rot dims (dst may be src: in place) */
static void rope_head_c(void *x, const void *src, const void *c, const void *s, int64_t rot,
                        int neox, int dt) {
    int64_t h = rot / 2;
    if (neox) {
        for (int64_t i = 0; i < h; i++) {
            float a = ld(src, i, dt), b = ld(src, i + h, dt);
            float y0 = rnd(a * ld(c, i, dt), dt) - rnd(b * ld(s, i, dt), dt);
            float y1 = rnd(b * ld(c, i + h, dt), dt) + rnd(a * ld(s, i + h, dt), dt);
            st(x, i, y0, dt);
            st(x, i + h, y1, dt);
        }
    } else {
        for (int64_t i = 0; i < h; i++) {
            float a = ld(src, 2 * i, dt), b = ld(src, 2 * i + 1, dt);
            float ci = ld(c, i, dt), si = ld(s, i, dt);
            float y0 = rnd(a * ci, dt) - rnd(b * si, dt);
            float y1 = rnd(b * ci, dt) + rnd(a * si, dt);
            st(x, 2 * i, y0, dt);
            st(x, 2 * i + 1, y1, dt);
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 rows */

#ifdef XLO_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define AINL __attribute__((always_inline))

static inline __mmask16 AVX512 AINL tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

static inline __m512 AVX512 AINL vld(const void *p, int64_t i, __mmask16 m, int dt) {
    if (dt) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* float32 -> bfloat16 bits, round to nearest even (vcvtneps2bf16; a NaN stays a quiet NaN). */
static inline __m256i AVX512 AINL vbf16(__m512 f) { return (__m256i)_mm512_cvtneps_pbh(f); }

static inline __m512 AVX512 AINL vrnd(__m512 f, int dt) {
    if (!dt) return f;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vbf16(f)), 16));
}

static inline void AVX512 AINL vst(void *p, int64_t i, __m512 f, __mmask16 m, int dt) {
    if (dt) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, vbf16(f));
    else _mm512_mask_storeu_ps((float *)p + i, m, f);
}

static inline __m512 AVX512 AINL vexp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_C1), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_C2), r);
    __m512 z = _mm512_mul_ps(r, r);
    __m512 y = _mm512_set1_ps(P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P5));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, fx); /* y * 2^fx: the portable path's exact power-of-two product */
}

/* 1 / sqrt(mean of squares + eps) in every lane, from the 16 partial sums of squares of a row
 * of H elements (reduce16's fixed order: the portable rows' sum) */
static inline __m512 AVX512 AINL rms_scale_v(__m512 acc, int64_t H, float eps) {
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    return _mm512_set1_ps(1.0f / __builtin_sqrtf(reduce16(lanes) / (float)H + eps));
}

static inline void AVX512 AINL rms_row_v_t(void *out, const void *x, void *res, const void *w, int64_t H,
                             float eps, int dt) {
    const void *src = x;
    __m512 acc = _mm512_setzero_ps();
    if (res) { /* the sum stored back, rounded, and its squares summed in the same pass */
        for (int64_t i = 0; i < H; i += 16) {
            __mmask16 m = tail_mask(H - i);
            __m512 v = vrnd(_mm512_add_ps(vld(res, i, m, dt), vld(x, i, m, dt)), dt);
            vst(res, i, v, m, dt);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        src = res;
    } else {
        for (int64_t i = 0; i < H; i += 16) {
            __m512 v = vld(src, i, tail_mask(H - i), dt);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
    }
    __m512 inv = rms_scale_v(acc, H, eps);
    for (int64_t i = 0; i < H; i += 16) {
        __mmask16 m = tail_mask(H - i);
        __m512 h = vrnd(_mm512_mul_ps(vld(src, i, m, dt), inv), dt);
        vst(out, i, _mm512_mul_ps(vld(w, i, m, dt), h), m, dt);
    }
}

static void AVX512 rms_row_v(void *out, const void *x, void *res, const void *w, int64_t H,
                             float eps, int dt) {
    if (dt) rms_row_v_t(out, x, res, w, H, eps, 1);
    else rms_row_v_t(out, x, res, w, H, eps, 0);
}

/* bfloat16 rows of H <= RMS_BUF elements: rms_row_v_t's arithmetic, with the weight widened to
 * float32 once per call of a thread (wf) and each row's source values kept in float32 (buf)
 * between the sum and the scaling pass instead of being loaded and widened again. */
#define RMS_BUF 8192

static void AVX512 rms_rows_bf16_v(void *out, int64_t out_s, const void *x, int64_t x_s,
                                   void *res, int64_t res_s, const void *w, int64_t H,
                                   float eps, int64_t r0, int64_t r1) {
    float wf[RMS_BUF], buf[RMS_BUF];
    for (int64_t i = 0; i < H; i += 16) {
        __mmask16 m = tail_mask(H - i);
        _mm512_mask_storeu_ps(wf + i, m, vld(w, i, m, 1));
    }
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = (const uint16_t *)x + r * x_s;
        uint16_t *rr = res ? (uint16_t *)res + r * res_s : NULL;
        uint16_t *orow = (uint16_t *)out + r * out_s;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            __mmask16 m = tail_mask(H - i);
            __m512 v = vld(xr, i, m, 1);
            if (rr) {
                v = vrnd(_mm512_add_ps(vld(rr, i, m, 1), v), 1);
                vst(rr, i, v, m, 1);
            }
            _mm512_mask_storeu_ps(buf + i, m, v);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        __m512 inv = rms_scale_v(acc, H, eps);
        for (int64_t i = 0; i < H; i += 16) {
            __mmask16 m = tail_mask(H - i);
            __m512 h = vrnd(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, buf + i), inv), 1);
            vst(orow, i, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wf + i), h), m, 1);
        }
    }
}

static inline void AVX512 AINL silu_row_v_t(void *out, const void *g, const void *u, int64_t n, int dt) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 a = vld(g, i, m, dt);
        __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), a));
        a = vrnd(_mm512_div_ps(a, _mm512_add_ps(one, e)), dt);
        vst(out, i, _mm512_mul_ps(a, vld(u, i, m, dt)), m, dt);
    }
}

static void AVX512 silu_row_v(void *out, const void *g, const void *u, int64_t n, int dt) {
    if (dt) silu_row_v_t(out, g, u, n, 1);
    else silu_row_v_t(out, g, u, n, 0);
}

static inline void AVX512 AINL rope_head_v_t(void *x, const void *src, const void *c,
                                             const void *s, int64_t rot, int neox, int dt) {
    if (!neox) {  /* GPT-J pairs: strided, scalar (not on a hot path of the supported families) */
        rope_head_c(x, src, c, s, rot, neox, dt);
        return;
    }
    int64_t h = rot / 2;
    for (int64_t i = 0; i < h; i += 16) {
        __mmask16 m = tail_mask(h - i);
        __m512 a = vld(src, i, m, dt), b = vld(src, i + h, m, dt);
        __m512 y0 = _mm512_sub_ps(vrnd(_mm512_mul_ps(a, vld(c, i, m, dt)), dt),
                                  vrnd(_mm512_mul_ps(b, vld(s, i, m, dt)), dt));
        __m512 y1 = _mm512_add_ps(vrnd(_mm512_mul_ps(b, vld(c, i + h, m, dt)), dt),
                                  vrnd(_mm512_mul_ps(a, vld(s, i + h, m, dt)), dt));
        vst(x, i, y0, m, dt);
        vst(x, i + h, y1, m, dt);
    }
}

static void AVX512 rope_head_v(void *x, const void *src, const void *c, const void *s,
                               int64_t rot, int neox, int dt) {
    if (dt) rope_head_v_t(x, src, c, s, rot, neox, 1);
    else rope_head_v_t(x, src, c, s, rot, neox, 0);
}
#endif

/* ---------------------------------------------------------------- dispatch */

static int g_isa = -1; /* -1 unknown, 0 portable, 1 AVX-512 */

static int detect_isa(void) {
#ifdef XLO_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
        __builtin_cpu_supports("fma"))
        return 1;
#endif
    return 0;
}

/* Run the row splits on this OpenMP runtime (threadpool.h, xt_pool_use_omp_); returns 1 when it
   is in use, 0 when the library's own pool is (any argument NULL) or there is no pool. */
int xllm_layer_ops_use_omp(void *parallel, void *thread_num, void *num_threads) {
#ifdef XLO_HAVE_POOL
    return xt_pool_use_omp_(parallel, thread_num, num_threads);
#else
    (void)parallel; (void)thread_num; (void)num_threads;
    return 0;
#endif
}

/* The path in use: 1 AVX-512, 0 portable. */
int xllm_layer_ops_isa(void) {
    if (g_isa < 0) g_isa = detect_isa();
    return g_isa;
}

/* Force the portable path (isa 0) or go back to what the CPU supports (any other value).
 * Returns the path now in use. */
int xllm_layer_ops_set_isa(int isa) {
    g_isa = isa == 0 ? 0 : detect_isa();
    return g_isa;
}

int xllm_layer_ops_abi(void) { return ABI_VERSION; }

/* ---------------------------------------------------------------- row splitting */

typedef struct {
    int op; /* 0 rms, 1 silu, 2 rope */
    int dt, isa, neox;
    int64_t rows;
    /* rms / silu */
    void *out; int64_t out_s;
    const void *x; int64_t x_s;
    void *res; int64_t res_s;
    const void *w; const void *u; int64_t u_s;
    int64_t n; float eps;
    /* rope */
    void *q; int64_t q_s, hq; void *k; int64_t k_s, hk, head_s;
    void *qo; int64_t qo_s, qo_hs, hd; /* rope out of place for q (NULL: in place) */
    const int64_t *pos; const void *cos, *sin; int64_t cs_s, rot;
} job_t;

static void run_rows(const job_t *j, int64_t r0, int64_t r1) {
    const int dt = j->dt;
    const size_t el = dt ? 2 : 4;
#ifdef XLO_X86
    if (j->op == 0 && j->isa && dt && j->n <= RMS_BUF) {
        rms_rows_bf16_v(j->out, j->out_s, j->x, j->x_s, j->res, j->res_s, j->w, j->n, j->eps,
                        r0, r1);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        if (j->op == 0) {
            void *out = (char *)j->out + (size_t)(r * j->out_s) * el;
            const void *x = (const char *)j->x + (size_t)(r * j->x_s) * el;
            void *res = j->res ? (char *)j->res + (size_t)(r * j->res_s) * el : NULL;
#ifdef XLO_X86
            if (j->isa) { rms_row_v(out, x, res, j->w, j->n, j->eps, dt); continue; }
#endif
            rms_row_c(out, x, res, j->w, j->n, j->eps, dt);
        } else if (j->op == 1) {
            void *out = (char *)j->out + (size_t)(r * j->out_s) * el;
            const void *g = (const char *)j->x + (size_t)(r * j->x_s) * el;
            const void *u = (const char *)j->u + (size_t)(r * j->u_s) * el;
#ifdef XLO_X86
            if (j->isa) { silu_row_v(out, g, u, j->n, dt); continue; }
#endif
            silu_row_c(out, g, u, j->n, dt);
        } else {
            int64_t p = j->pos[r];
            const void *c = (const char *)j->cos + (size_t)(p * j->cs_s) * el;
            const void *s = (const char *)j->sin + (size_t)(p * j->cs_s) * el;
            for (int64_t hh = 0; hh < j->hq + j->hk; hh++) {
                void *x = hh < j->hq ? (char *)j->q + (size_t)(r * j->q_s + hh * j->head_s) * el
                                     : (char *)j->k + (size_t)(r * j->k_s + (hh - j->hq) * j->head_s) * el;
                const void *src = x;
                if (hh < j->hq && j->qo) { /* q's head into q_out; dims past rot copied as is */
                    x = (char *)j->qo + (size_t)(r * j->qo_s + hh * j->qo_hs) * el;
                    if (j->hd > j->rot)
                        memcpy((char *)x + (size_t)j->rot * el, (const char *)src + (size_t)j->rot * el,
                               (size_t)(j->hd - j->rot) * el);
                }
#ifdef XLO_X86
                if (j->isa) { rope_head_v(x, src, c, s, j->rot, j->neox, dt); continue; }
#endif
                rope_head_c(x, src, c, s, j->rot, j->neox, dt);
            }
        }
    }
}

#ifdef XLO_HAVE_POOL
static void pool_fn(void *ctx, int tid, int n) {
    const job_t *j = (const job_t *)ctx;
    int64_t per = (j->rows + n - 1) / n, r0 = per * tid, r1 = r0 + per;
    if (r1 > j->rows) r1 = j->rows;
    if (r0 < r1) run_rows(j, r0, r1);
}
#endif

/* Elements below which one thread does the whole call: a decode step's rows (T = 40 of 512:
 * a few microseconds) stay on the caller, since a hand-off costs about a microsecond even to a
 * team that is awake; larger calls are split. With the kernels on torch's OpenMP team
 * (engine/native_threads.py), the team is awake from the product before, so the split pays
 * from here: at 128 rows of 512 (an RMS norm) 21 against 30 us, SiLU-and-mul at 128 of 1,536
 * 73 against 122 us (bf16, 2 threads; it was 262,144 with the libraries' own pools). */
#define PARALLEL_MIN_ELEMS 32768

static void run(job_t *j, int64_t elems, int nthreads) {
    j->isa = xllm_layer_ops_isa();
#ifdef XLO_HAVE_POOL
    if (nthreads > 1 && elems >= PARALLEL_MIN_ELEMS && j->rows > 1) {
        if (nthreads > j->rows) nthreads = (int)j->rows;
        xt_pool_run(nthreads, pool_fn, j);
        return;
    }
#else
    (void)nthreads;
    (void)elems;
#endif
    run_rows(j, 0, j->rows);
}

/* ---------------------------------------------------------------- entry points */

/* out[t] = w * rms_norm(src[t]) for t < T rows of H elements, src = x, or with residual:
 * residual[t] = round(residual[t] + x[t]) first and src = residual. out may alias x (not
 * residual). */
int xllm_rms_norm(void *out, int64_t out_stride, const void *x, int64_t x_stride, void *residual,
                  int64_t res_stride, const void *w, int64_t T, int64_t H, float eps, int dtype,
                  int nthreads) {
    if (!out || !x || !w || T < 0 || H < 1 || (dtype != 0 && dtype != 1) || !(eps >= 0.0f))
        return -1;
    job_t j;
    memset(&j, 0, sizeof j);
    j.op = 0; j.dt = dtype; j.rows = T; j.out = out; j.out_s = out_stride; j.x = x;
    j.x_s = x_stride; j.res = residual; j.res_s = res_stride; j.w = w; j.n = H; j.eps = eps;
    run(&j, T * H, nthreads);
    return 0;
}

/* out[t, i] = silu(gate[t, i]) * up[t, i] for t < T, i < n. out may alias gate or up. */
int xllm_silu_and_mul(void *out, int64_t out_stride, const void *gate, int64_t gate_stride,
                      const void *up, int64_t up_stride, int64_t T, int64_t n, int dtype,
                      int nthreads) {
    if (!out || !gate || !up || T < 0 || n < 0 || (dtype != 0 && dtype != 1)) return -1;
    job_t j;
    memset(&j, 0, sizeof j);
    j.op = 1; j.dt = dtype; j.rows = T; j.out = out; j.out_s = out_stride; j.x = gate;
    j.x_s = gate_stride; j.u = up; j.u_s = up_stride; j.n = n;
    run(&j, T * n, nthreads);
    return 0;
}

/* Rotate, in place, the first rot_dim elements of each of hq heads of q[t] and hk heads of k[t]
 * (head h of token t at q + t*q_stride + h*head_stride) by the angles of positions[t]: cos and
 * sin rows at positions[t] * cs_stride (neox: rot_dim entries, the row's halves both read;
 * GPT-J: the first rot_dim / 2). positions must lie inside the tables (the caller checks). */
int xllm_rope(void *q, int64_t q_stride, int64_t hq, void *k, int64_t k_stride, int64_t hk,
              int64_t head_stride, const int64_t *positions, int64_t T, const void *cos,
              const void *sin, int64_t cs_stride, int64_t rot_dim, int neox, int dtype,
              int nthreads) {
    if (!q || !positions || !cos || !sin || T < 0 || hq < 0 || hk < 0 || (hk && !k) ||
        rot_dim < 2 || rot_dim % 2 || (dtype != 0 && dtype != 1))
        return -1;
    job_t j;
    memset(&j, 0, sizeof j);
    j.op = 2; j.dt = dtype; j.rows = T; j.neox = neox != 0; j.q = q; j.q_s = q_stride;
    j.hq = hq; j.k = k; j.k_s = k_stride; j.hk = hk; j.head_s = head_stride; j.pos = positions;
    j.cos = cos; j.sin = sin; j.cs_s = cs_stride; j.rot = rot_dim;
    run(&j, T * (hq + hk) * rot_dim, nthreads);
    return 0;
}

/* xllm_rope with q written out of place: head h of token t of the result at
 * q_out + t*q_out_stride + h*q_out_head_stride (its first rot_dim elements rotated, the rest of
 * the head_dim elements copied), q itself left as it is; k rotated in place as xllm_rope does.
 * q_out must not overlap q or k (a fused q/k/v product's q lands in a contiguous tensor: one
 * pass instead of a rotation in place and a copy). */
int xllm_rope_out(void *q_out, int64_t q_out_stride, int64_t q_out_head_stride, const void *q,
                  int64_t q_stride, int64_t hq, void *k, int64_t k_stride, int64_t hk,
                  int64_t head_stride, int64_t head_dim, const int64_t *positions, int64_t T,
                  const void *cos, const void *sin, int64_t cs_stride, int64_t rot_dim, int neox,
                  int dtype, int nthreads) {
    if (!q_out || !q || !positions || !cos || !sin || T < 0 || hq < 0 || hk < 0 || (hk && !k) ||
        rot_dim < 2 || rot_dim % 2 || head_dim < rot_dim || (dtype != 0 && dtype != 1))
        return -1;
    job_t j;
    memset(&j, 0, sizeof j);
    j.op = 2; j.dt = dtype; j.rows = T; j.neox = neox != 0; j.q = (void *)q; j.q_s = q_stride;
    j.hq = hq; j.k = k; j.k_s = k_stride; j.hk = hk; j.head_s = head_stride; j.pos = positions;
    j.cos = cos; j.sin = sin; j.cs_s = cs_stride; j.rot = rot_dim;
    j.qo = q_out; j.qo_s = q_out_stride; j.qo_hs = q_out_head_stride; j.hd = head_dim;
    run(&j, T * (hq + hk) * rot_dim, nthreads);
    return 0;
}
