/* specdec's weight-only int8 and int4 linears for decode-sized products (specdec/qlinear.py): y[m, n] = sum_k x[m, k]
 * * W[n, k] (+ bias[n]) for float32 rows x, where W is a torchao tensor's own dequantised weight:
 *
 *   int8 (torchao Int8Tensor, one scale per output column): W[n, k] = q[n, k] * s[n]; the column's sum of x * q is
 *        scaled once at its end, as torchao's own product does (x @ q.T, then * s);
 *   int4 (torchao IntxUnpackedToInt8Tensor, int4 in groups of G input columns):
 *        W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k / G; q - z is formed exactly in float32 in registers (small
 *        integers), multiplied into the rows and summed over the group, and the group's sum is scaled once (the
 *        product distributed: float rounding only). With AVX-512 VNNI, the group is summed in integers instead (the
 *        integer pass, below).
 *
 * Activations stay float32 (quantizing them would change the model); the sums are float32, column by column in the
 * order of k (int4's integer pass: exact integer sums of the activations in fixed point, within float32's rounding).
 * The weight is re-laid by qlinear.py in blocks of QL = 16 output columns, k-major within a block, so each pass
 * streams it once and contiguously, however many rows: int8 [ceil(N / 16), K, 16] bytes; int4 [ceil(N / 16), K / 8,
 * 16] 32-bit words, the word (b, j, l) holding q[16b + l, 8j + i] + 8 in its nibble i (eight
 * values a word, two a byte: half an int8's bytes). The scales: int8 [16 ceil(N / 16)] float32; int4
 * [K / G, 16 ceil(N / 16)] float32, and the zero points as 2^23 + z + 8 likewise (or none where every zero point is
 * zero). A nibble v becomes q - z either by one table lookup (v - 8 = q, zero points zero: torchao's symmetric int4)
 * or by ORing v into the mantissa of the float 2^23 and subtracting 2^23 + z + 8 (both exact). Padding columns have
 * scale 0.
 *
 * Two blocks a pass (two weight streams, each prefetched ahead), up to ROWS (int8) or ROWS4 (int4) rows at a time:
 * more rows take the same two blocks again, read from the core's L2 (a pair of blocks is at most 32 K bytes of int8
 * per 1024 k), so the weight is read from memory once per product. int8 at up to ROWS_WIDE rows takes four blocks a
 * pass (four streams: one core reads memory faster with more in flight); each column's sum is the same either way.
 * AVX-512 intrinsics, and GCC/Clang vector extensions for AVX2 and other CPUs (compiled, not timed here). Built
 * into specdec's operator library (kernels.blocked_op); the measurements: docs/journal/2026-12-07-quantized-kernels.md
 * and (the integer pass) docs/journal/2026-12-07-int4-integer-pass.md. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* int4 by integer products (VNNI). Each group of G values of a row is written in fixed point, X = round(x * 2^e),
 * 2^e the largest power of two keeping |X| <= 8355711 (what three signed-byte digits d2 2^16 + d1 2^8 + d0 reach):
 * each value moves by at most 2^-23 of the group's largest, the size of float32's own rounding of the products and
 * sums. vpdpbusd multiplies a digit plane by the nibbles v = q + 8 (four byte products summed a lane, exact in
 * int32); plane p's group sum S_p = sum d_p v is centred exactly, S_p - (8 + z) sum d_p = sum d_p (v - 8 - z), and the
 * group's column sum (S2 2^16 + S1 2^8 + S0) 2^-e is scaled once, as in the float pass. Three byte products a weight
 * and row replace a nibble's conversion to float and a float multiply-add, so int4's decode is no longer
 * compute-bound (docs/journal/2026-12-07-int4-integer-pass.md). Byte t of a word holds nibbles 2t (low) and 2t + 1
 * (high): a row's digits are laid per word j as two dwords, k = 8j + 0, 2, 4, 6 (against the low nibbles) and
 * 8j + 1, 3, 5, 7 (the high). A group not a multiple of 16, or a row holding inf or nan: the float pass. */
#define ROWSV 2 /* rows a pass: 2 blocks x 2 rows x (3 digit sums + the total) = 16 accumulators */

int specdec_q4_integer = 1; /* 0: the float pass (benchmarks/quantized_kernels.py times both, through ctypes) */

typedef struct {
    uint32_t *digits; /* [M][3][K / 8][2] */
    int32_t *groups;  /* [M][K / G][4]: 2^-e (a float's bits) and the sums of the digits of planes 0, 1, 2 */
} q4_digits;

static __thread uint8_t *digit_buffer;
static __thread size_t digit_bytes;

/* the rows' digits into the thread's buffer; 0 where a value is not finite (the float pass then computes) */
static int q4_digitise(const float *x, int64_t M, int64_t K, int64_t G, q4_digits *out) {
    if (G % 16) return 0;
    const size_t need = (size_t)M * (3 * (K / 8) * 2 * sizeof(uint32_t) + (K / G) * 4 * sizeof(int32_t));
    if (need > digit_bytes) {
        free(digit_buffer);
        digit_buffer = malloc(need);
        digit_bytes = digit_buffer ? need : 0;
        if (!digit_buffer) return 0;
    }
    out->digits = (uint32_t *)digit_buffer;
    out->groups = (int32_t *)(digit_buffer + (size_t)M * 3 * (K / 8) * 2 * sizeof(uint32_t));
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    /* a plane's 16 digits (k = 8j .. 8j + 15, as bytes in k order) into the words' order: k = 8j + 0, 2, 4, 6, then
       8j + 1, 3, 5, 7, then the same for word j + 1 */
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    for (int64_t m = 0; m < M; ++m) {
        const float *row = x + m * K;
        uint32_t *d = out->digits + m * 3 * (K / 8) * 2;
        for (int64_t g0 = 0; g0 < K; g0 += G) {
            __m512 top = _mm512_setzero_ps();
            for (int64_t k = g0; k < g0 + G; k += 16) top = _mm512_max_ps(top, _mm512_and_ps(load(row + k), magnitude));
            const float most = _mm512_reduce_max_ps(top);
            if (!(most <= 3.0e38f)) return 0; /* inf or nan */
            int e = 0;
            if (most > 0.0f) {
                frexpf(8355711.0f / most, &e); /* 8355711 / most = f 2^e, f in [0.5, 1): 2^(e - 1) <= it */
                e -= 1;
            }
            const __m512 up = _mm512_set1_ps(ldexpf(1.0f, e));
            __m512i sums[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int64_t k = g0; k < g0 + G; k += 16) {
                /* exact product by a power of two, rounded to the nearest integer (ties to even) */
                const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(load(row + k), up));
                const __m512i d0 = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
                const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(X, d0), 8);
                const __m512i d1 = _mm512_srai_epi32(_mm512_slli_epi32(r, 24), 24);
                const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(r, d1), 8);
                const __m512i planes[3] = {d0, d1, d2};
                for (int p = 0; p < 3; ++p) {
                    sums[p] = _mm512_add_epi32(sums[p], planes[p]);
                    const __m128i bytes = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(planes[p]), order);
                    _mm_storeu_si128((__m128i *)(d + (p * (K / 8) + k / 8) * 2), bytes);
                }
            }
            int32_t *gr = out->groups + (m * (K / G) + g0 / G) * 4;
            const float down = ldexpf(1.0f, -e);
            memcpy(gr, &down, sizeof down);
            for (int p = 0; p < 3; ++p) gr[1 + p] = _mm512_reduce_add_epi32(sums[p]);
        }
    }
    return 1;
}

static inline __attribute__((always_inline)) void q4v_pass(const q4_digits *dg, const uint32_t *w,
                                                           const float *scales, const float *zeros, const float *bias,
                                                           float *y, int64_t N, int64_t K, int64_t G, int64_t stride,
                                                           int64_t b, const int NB, const int R, const int SYM,
                                                           int64_t m0, int64_t ys, int64_t c0, int fetch) {
    const __m512i low = _mm512_set1_epi32(0x0F0F0F0F), eight = _mm512_set1_epi32(8);
    const __m512 magic = _mm512_set1_ps((float)(1 << 23)), p16 = _mm512_set1_ps(65536.0f), p8 = _mm512_set1_ps(256.f);
    const int64_t eighths = K / 8, groups = K / G;
    __m512 acc[2][ROWSV];
    __m512i s[2][ROWSV][3];
    for (int i = 0; i < NB; ++i)
        for (int m = 0; m < R; ++m) acc[i][m] = _mm512_setzero_ps();
    const uint32_t *w0 = w + b * eighths * QL;
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        for (int i = 0; i < NB; ++i)
            for (int m = 0; m < R; ++m)
                for (int p = 0; p < 3; ++p) s[i][m][p] = _mm512_setzero_si512();
        for (int64_t j = g0 / 8; j < (g0 + G) / 8; ++j) {
            __m512i lo[2], hi[2];
            for (int i = 0; i < NB; ++i) {
                const uint32_t *at = w0 + i * eighths * QL + j * QL;
                if (fetch) __builtin_prefetch((const char *)at + AHEAD, 0, 0);
                const __m512i word = _mm512_loadu_si512(at);
                lo[i] = _mm512_and_si512(word, low);
                hi[i] = _mm512_and_si512(_mm512_srli_epi32(word, 4), low);
            }
            for (int m = 0; m < R; ++m) {
                const uint32_t *d = dg->digits + (m0 + m) * 3 * eighths * 2 + j * 2;
                for (int p = 0; p < 3; ++p) {
                    const __m512i dl = _mm512_set1_epi32((int)d[p * eighths * 2]);
                    const __m512i dh = _mm512_set1_epi32((int)d[p * eighths * 2 + 1]);
                    for (int i = 0; i < NB; ++i)
                        s[i][m][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i][m][p], lo[i], dl), hi[i], dh);
                }
            }
        }
        const int64_t at = (g0 / G) * stride + b * QL;
        for (int i = 0; i < NB; ++i) {
            const __m512i centre = SYM ? eight : _mm512_cvtps_epi32(_mm512_sub_ps(load(zeros + at + i * QL), magic));
            const __m512 scale = load(scales + at + i * QL);
            for (int m = 0; m < R; ++m) {
                const int32_t *gr = dg->groups + ((m0 + m) * groups + g0 / G) * 4;
                float down;
                memcpy(&down, gr, sizeof down);
                __m512 planes[3];
                for (int p = 0; p < 3; ++p) /* S_p - (8 + z) sum d_p: exact in int32 */
                    planes[p] = _mm512_cvtepi32_ps(
                        _mm512_sub_epi32(s[i][m][p], _mm512_mullo_epi32(centre, _mm512_set1_epi32(gr[1 + p]))));
                const __m512 f = _mm512_fmadd_ps(planes[2], p16, _mm512_fmadd_ps(planes[1], p8, planes[0]));
                acc[i][m] = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(down)), scale, acc[i][m]);
            }
        }
    }
    for (int i = 0; i < NB; ++i) put(y + m0 * ys, ys, c0, (b + i) * QL, N, acc[i], 0, bias, R);
}
#endif

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
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    q4_digits dg;
    if (M > 0 && specdec_q4_integer && q4_digitise(x, M, K, G, &dg)) {
        for (int64_t b = b0; b < b1; b += 2) { /* two blocks (two weight streams) a pass, ROWSV rows */
            const int two = b + 1 < b1;
            for (int64_t m0 = 0; m0 < M; m0 += ROWSV) {
                const int R = M - m0 < ROWSV ? (int)(M - m0) : ROWSV, fetch = m0 == 0;
#define Q4V(NB, r) (zeros ? q4v_pass(&dg, w, scales, zeros, bias, y, N, K, G, stride, b, NB, r, 0, m0, ys, c0, fetch) \
                          : q4v_pass(&dg, w, scales, zeros, bias, y, N, K, G, stride, b, NB, r, 1, m0, ys, c0, fetch))
                if (R == 1) two ? Q4V(2, 1) : Q4V(1, 1);
                else two ? Q4V(2, 2) : Q4V(1, 2);
#undef Q4V
            }
        }
        return;
    }
#endif
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
