/* specdec's weight-only int8 and int4 linears for decode-sized products (specdec/qlinear.py): y[m, n] = sum_k x[m, k]
 * * W[n, k] (+ bias[n]) for float32 rows x, where W is a torchao tensor's own dequantised weight:
 *
 *   int8 (torchao Int8Tensor, one scale per output column): W[n, k] = q[n, k] * s[n]; the column's sum of x * q is
 *        scaled once at its end, as torchao's own product does (x @ q.T, then * s);
 *   int4 (torchao IntxUnpackedToInt8Tensor, int4 in groups of G input columns): W[n, k] = (q[n, k] - z[n, g]) * s[n, g],
 *        g = k / G; q - z is formed exactly in float32 in registers (small integers), multiplied into the rows and
 *        summed over the group, and the group's sum is scaled once (the product distributed: float rounding only).
 *
 * Activations stay float32 (quantizing them would change the model); the sums are float32, column by column in the
 * order of k. The weight is re-laid by qlinear.py in blocks of QL = 16 output columns, k-major within a block, so
 * each pass streams it once and contiguously, however many rows: int8 [ceil(N / 16), K, 16] bytes; int4
 * [ceil(N / 16), K / 8, 16] 32-bit words, the word (b, j, l) holding q[16b + l, 8j + i] + 8 in its nibble i (eight
 * values a word, two a byte: half an int8's bytes). The scales: int8 [16 ceil(N / 16)] float32; int4
 * [K / G, 16 ceil(N / 16)] float32, and the zero points as 2^23 + z + 8 likewise (or none where every zero point is
 * zero). A nibble v becomes q - z either by one table lookup (v - 8 = q, zero points zero: torchao's symmetric int4)
 * or by ORing v into the mantissa of the float 2^23 and subtracting 2^23 + z + 8 (both exact). Padding columns have
 * scale 0.
 *
 * Two blocks a pass (two weight streams, each prefetched ahead), up to ROWS (int8) or ROWS4 (int4) rows at a time:
 * more rows take the same two blocks again, read from the core's L2 (a pair of blocks is at most 32 K bytes of int8
 * per 1024 k), so the weight is read from memory once per product. int8 at up to ROWS_WIDE rows takes four blocks a
 * pass (four streams: one core reads memory faster with more in flight); each column's sum is the same either way. AVX-512 intrinsics, and GCC/Clang vector
 * extensions for AVX2 and other CPUs (compiled, not timed here). Built into specdec's operator library
 * (kernels.blocked_op); the measurements: docs/journal/2026-12-07-quantized-kernels.md. */
#include <stdint.h>
#include <string.h>

#define QL 16
#define ROWS 8 /* rows a pass: 2 blocks x 8 rows = 16 accumulators (AVX-512 has 32 registers) */
#define ROWS_WIDE 4 /* up to this many rows, int8 takes 4 blocks a pass (4 x 4 = 16 accumulators) */
#define ROWS4 6 /* int4: rows a pass: 2 blocks x 6 rows x (a group's sum + the total) = 24 accumulators */
#define AHEAD 2048 /* bytes prefetched ahead on each stream */
#define MAGIC 0x4B000000 /* the float 2^23: ORing an integer 0 .. 15 into its mantissa gives 2^23 + it, exactly */

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 qvec; /* one register a block */

static inline __attribute__((always_inline)) qvec vzero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) qvec load(const float *at) { return _mm512_loadu_ps(at); }
static inline __attribute__((always_inline)) qvec fma_x(float x, qvec w, qvec acc) {
    return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc);
}
static inline __attribute__((always_inline)) qvec dequant(qvec q, qvec z, qvec s) {
    return _mm512_mul_ps(_mm512_sub_ps(q, z), s);
}
static inline __attribute__((always_inline)) qvec scaled(qvec v, const float *s) { return _mm512_mul_ps(v, load(s)); }
static inline __attribute__((always_inline)) qvec from_int8(const int8_t *at) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
}
typedef __m512i qwords;
static inline __attribute__((always_inline)) qwords words(const uint32_t *at) { return _mm512_loadu_si512(at); }
/* nibble i of each word as the float 2^23 + nibble (its bits ORed into 2^23's mantissa: one ternary-logic op) */
static inline __attribute__((always_inline)) qvec nibble(qwords w, int i) {
    const __m512i shifted = i ? _mm512_srli_epi32(w, 4 * i) : w;
    return _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi32(15), _mm512_set1_epi32(MAGIC), 0xEA));  /* (a & b) | c */
}
/* nibble i of each word, minus 8, by table (zero points all zero): vpermps reads an index's low 4 bits only */
static inline __attribute__((always_inline)) qvec centred(qwords w, int i, qvec table) {
    return _mm512_permutexvar_ps(i ? _mm512_srli_epi32(w, 4 * i) : w, table);
}
static inline __attribute__((always_inline)) qvec table_of(const float *t) { return _mm512_loadu_ps(t); }
static inline __attribute__((always_inline)) qvec sub(qvec a, qvec b) { return _mm512_sub_ps(a, b); }
static inline __attribute__((always_inline)) qvec fma_v(qvec a, qvec b, qvec acc) { return _mm512_fmadd_ps(a, b, acc); }
#else /* GCC/Clang vector extensions: AVX2 and others */
typedef float qvec __attribute__((vector_size(QL * sizeof(float))));
typedef int8_t qbytes __attribute__((vector_size(QL)));
typedef int32_t qints __attribute__((vector_size(QL * sizeof(int32_t))));

static inline __attribute__((always_inline)) qvec vzero(void) { return (qvec){0}; }
static inline __attribute__((always_inline)) qvec load(const float *at) {
    qvec v;
    memcpy(&v, at, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) qvec fma_x(float x, qvec w, qvec acc) { return acc + x * w; }
static inline __attribute__((always_inline)) qvec dequant(qvec q, qvec z, qvec s) { return (q - z) * s; }
static inline __attribute__((always_inline)) qvec scaled(qvec v, const float *s) { return v * load(s); }
static inline __attribute__((always_inline)) qvec from_int8(const int8_t *at) {
    qbytes b;
    memcpy(&b, at, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, qints), qvec);
}
typedef uint32_t qwords __attribute__((vector_size(QL * sizeof(uint32_t))));
static inline __attribute__((always_inline)) qwords words(const uint32_t *at) {
    qwords w;
    memcpy(&w, at, sizeof w);
    return w;
}
static inline __attribute__((always_inline)) qvec nibble(qwords w, int i) {
    qwords bits = ((w >> (4 * i)) & 15) | MAGIC;
    qvec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) qvec table_of(const float *t) { return load(t); }
static inline __attribute__((always_inline)) qvec centred(qwords w, int i, qvec table) {
    (void)table;
    return __builtin_convertvector((qints)((w >> (4 * i)) & 15), qvec) - 8.0f;
}
static inline __attribute__((always_inline)) qvec sub(qvec a, qvec b) { return a - b; }
static inline __attribute__((always_inline)) qvec fma_v(qvec a, qvec b, qvec acc) { return acc + a * b; }
#endif

int specdec_q_lanes(void) { return QL; }

/* the accumulators of rows 0 .. R of block i, scaled (int8), into y (rows ys apart, its first column c0) */
static inline __attribute__((always_inline)) void put(float *y, int64_t ys, int64_t c0, int64_t n0, int64_t N,
                                                      const qvec *acc, const float *scale, const float *bias, int R) {
    const int64_t cols = N - n0 < QL ? N - n0 : QL;
    if (cols <= 0) return;
    for (int m = 0; m < R; ++m) {
        qvec v = acc[m];
        if (scale) v = scaled(v, scale + n0);
        float out[QL];
        memcpy(out, &v, sizeof out);
        float *row = y + m * ys + (n0 - c0);
        for (int64_t i = 0; i < cols; ++i) row[i] = out[i] + (bias ? bias[n0 + i] : 0.0f);
    }
}

/* rows x[0 .. R) (K floats apart) against blocks b .. b + NB (1 to 4 of them; 4 only for R <= ROWS_WIDE) of the int8
 * weight */
static inline __attribute__((always_inline)) void q8_pass(const float *x, const int8_t *w, const float *scale,
                                                          const float *bias, float *y, int64_t N, int64_t K, int64_t b,
                                                          const int NB, const int R, int64_t ys, int64_t c0, int fetch) {
    qvec acc[4][ROWS];
    for (int i = 0; i < NB; ++i)
        for (int m = 0; m < R; ++m) acc[i][m] = vzero();
    const int8_t *w0 = w + b * K * QL;
    for (int64_t k = 0; k < K; ++k) {
        if (fetch && (k & 3) == 0)
            for (int i = 0; i < NB; ++i) __builtin_prefetch(w0 + i * K * QL + k * QL + AHEAD, 0, 0);
        qvec a[4];
        for (int i = 0; i < NB; ++i) a[i] = from_int8(w0 + i * K * QL + k * QL);
        for (int m = 0; m < R; ++m) {
            const float xm = x[m * K + k];
            for (int i = 0; i < NB; ++i) acc[i][m] = fma_x(xm, a[i], acc[i][m]);
        }
    }
    for (int i = 0; i < NB; ++i) put(y, ys, c0, (b + i) * QL, N, acc[i], scale, bias, R);
}

/* the same for the int4 weight, groups of G input columns (G a multiple of 8): each 32-bit word holds one column's
 * eight consecutive k (nibble i: k = 8j + i); a group's products with q - z are summed apart, then scaled. SYM: the
 * zero points are all zero (torchao's symmetric int4), and a nibble v becomes v - 8 = q by one table lookup */
static inline __attribute__((always_inline)) void q4_pass(const float *x, const uint32_t *w, const float *scales,
                                                          const float *zeros, const float *bias, float *y, int64_t N,
                                                          int64_t K, int64_t G, int64_t stride, int64_t b, const int NB,
                                                          const int R, const int SYM, int64_t ys, int64_t c0,
                                                          int fetch) {
    static const float centre[QL] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
    const qvec table = table_of(centre);
    qvec acc[2][ROWS4], part[2][ROWS4];
    for (int i = 0; i < NB; ++i)
        for (int m = 0; m < R; ++m) acc[i][m] = vzero();
    const int64_t eighths = K / 8;
    const uint32_t *w0 = w + b * eighths * QL, *w1 = w0 + eighths * QL;
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        const int64_t at = (g0 / G) * stride + b * QL;
        const qvec z0 = SYM ? vzero() : load(zeros + at), z1 = NB > 1 && !SYM ? load(zeros + at + QL) : z0;
        for (int i = 0; i < NB; ++i)
            for (int m = 0; m < R; ++m) part[i][m] = vzero();
        for (int64_t j = g0 / 8; j < (g0 + G) / 8; ++j) {
            if (fetch) {
                __builtin_prefetch((const char *)(w0 + j * QL) + AHEAD, 0, 0);
                if (NB > 1) __builtin_prefetch((const char *)(w1 + j * QL) + AHEAD, 0, 0);
            }
            const qwords a = words(w0 + j * QL), c = NB > 1 ? words(w1 + j * QL) : a;
            for (int i = 0; i < 8; ++i) {
                const qvec d0 = SYM ? centred(a, i, table) : sub(nibble(a, i), z0);
                const qvec d1 = NB < 2 ? d0 : SYM ? centred(c, i, table) : sub(nibble(c, i), z1);
                for (int m = 0; m < R; ++m) {
                    const float xm = x[m * K + 8 * j + i];
                    part[0][m] = fma_x(xm, d0, part[0][m]);
                    if (NB > 1) part[1][m] = fma_x(xm, d1, part[1][m]);
                }
            }
        }
        const qvec s0 = load(scales + at), s1 = NB > 1 ? load(scales + at + QL) : s0;
        for (int m = 0; m < R; ++m) {
            acc[0][m] = fma_v(part[0][m], s0, acc[0][m]);
            if (NB > 1) acc[1][m] = fma_v(part[1][m], s1, acc[1][m]);
        }
    }
    for (int i = 0; i < NB; ++i) put(y, ys, c0, (b + i) * QL, N, acc[i], 0, bias, R);
}

#define ROW_CASES(CALL) \
    switch (R) {        \
    case 8: CALL(8); break; \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    case 4: CALL(4); break; \
    case 5: CALL(5); break; \
    case 6: CALL(6); break; \
    default: CALL(7); break; \
    }

#define ROW_CASES4(CALL) \
    switch (R) {        \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    case 4: CALL(4); break; \
    case 5: CALL(5); break; \
    default: CALL(6); break; \
    }

/* x [M, K] against the int8 weight's blocks b0 .. b1 into y (rows ys floats apart, its first column 16 b0) */
void specdec_q8_range(const float *x, const int8_t *w, const float *scale, const float *bias, float *y, int64_t M,
                      int64_t N, int64_t K, int64_t b0, int64_t b1, int64_t ys) {
    const int64_t c0 = b0 * QL;
    if (M <= 0) return;
    if (M <= ROWS_WIDE) { /* four streams; the last pass takes what is left (1 to 3 blocks) */
        for (int64_t b = b0; b < b1; b += 4) {
            const int64_t nb = b1 - b < 4 ? b1 - b : 4;
#define Q8W(r) (nb == 4 ? q8_pass(x, w, scale, bias, y, N, K, b, 4, r, ys, c0, 1) \
                : nb == 3 ? q8_pass(x, w, scale, bias, y, N, K, b, 3, r, ys, c0, 1) \
                : nb == 2 ? q8_pass(x, w, scale, bias, y, N, K, b, 2, r, ys, c0, 1) \
                          : q8_pass(x, w, scale, bias, y, N, K, b, 1, r, ys, c0, 1))
            const int R = (int)M;
            switch (R) {
            case 1: Q8W(1); break;
            case 2: Q8W(2); break;
            case 3: Q8W(3); break;
            default: Q8W(4); break;
            }
#undef Q8W
        }
        return;
    }
    for (int64_t b = b0; b < b1; b += 2) {
        const int two = b + 1 < b1;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int R = M - m0 < ROWS ? (int)(M - m0) : ROWS, fetch = m0 == 0;
            const float *xs = x + m0 * K;
            float *ym = y + m0 * ys;
#define Q8(r) (two ? q8_pass(xs, w, scale, bias, ym, N, K, b, 2, r, ys, c0, fetch) \
                   : q8_pass(xs, w, scale, bias, ym, N, K, b, 1, r, ys, c0, fetch))
            ROW_CASES(Q8)
#undef Q8
        }
    }
}

/* x [M, K] against the int4 weight's blocks b0 .. b1 (groups of G; scales and zeros ``stride`` floats a group; zeros
 * NULL where every zero point is zero) */
void specdec_q4_range(const float *x, const uint32_t *w, const float *scales, const float *zeros, const float *bias,
                      float *y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t stride, int64_t b0, int64_t b1,
                      int64_t ys) {
    const int64_t c0 = b0 * QL;
    for (int64_t b = b0; b < b1; b += 2) {
        const int two = b + 1 < b1;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS4) {
            const int R = M - m0 < ROWS4 ? (int)(M - m0) : ROWS4, fetch = m0 == 0;
            const float *xs = x + m0 * K;
            float *ym = y + m0 * ys;
#define Q4(r) (zeros ? (two ? q4_pass(xs, w, scales, zeros, bias, ym, N, K, G, stride, b, 2, r, 0, ys, c0, fetch) \
                            : q4_pass(xs, w, scales, zeros, bias, ym, N, K, G, stride, b, 1, r, 0, ys, c0, fetch)) \
                     : (two ? q4_pass(xs, w, scales, zeros, bias, ym, N, K, G, stride, b, 2, r, 1, ys, c0, fetch) \
                            : q4_pass(xs, w, scales, zeros, bias, ym, N, K, G, stride, b, 1, r, 1, ys, c0, fetch)))
            ROW_CASES4(Q4)
#undef Q4
        }
    }
}
