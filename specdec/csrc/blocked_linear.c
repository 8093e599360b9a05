/* specdec's float32 linear for decode-sized products: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for a few
 * rows m, on the weight re-laid in blocks of LANES output columns, [ceil(N / LANES), K, LANES]
 * (specdec/kernels.py). Each pass over a block streams its K * LANES floats once, contiguously, and multiplies
 * them by up to ROWS rows of x at a time (x[m, k] broadcast), so the weights are read from memory once per
 * product however many rows it has. Where every weight is a bfloat16 number (a model stored in bfloat16 and run in
 * float32) the copy may hold them as such, two blocks in one (specdec_blocked_linear_bf16: [ceil(N / LANES / 2), K,
 * LANES] 32-bit words, block 2p's weight in the upper half of each word and block 2p + 1's in the lower, which is
 * a float32's bits in bfloat16): one load and two bit operations (a mask, a shift) give both blocks' floats, exactly
 * the float32 numbers they stand for, so the results are the float32 kernel's (the same products, summed in the same
 * order) from half the bytes. Built at first use with the machine's C compiler (-O3 -march=native);
 * GCC/Clang vector extensions and __builtin_prefetch, no intrinsics: the same source builds for AVX-512 (16
 * lanes) and AVX2 (8). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define ROWS 12 /* 2 blocks x 12 rows = 24 accumulators of the 32 vector registers */
#define ONE_PASS 14 /* up to this many rows in one pass (28 accumulators): 13 rows, a prompt-lookup verification,
                       took 8.8 ms a pass over code-target's weights against 9.8 as 12 + 1; more rows go by 12,
                       faster than by 13 or 14 (64 rows 26.0 ms against 27.5-27.9) */
#else
#define LANES 8
#define ROWS 6 /* 2 x 6 = 12 of the 16 */
#define ONE_PASS 6
#endif
#define BLOCKS 2 /* output blocks per pass: two weight streams */
/* A bfloat16 pair is widened as it is read for up to this many rows (two passes over it); for more, once into a float32
 * scratch block that every pass reads (the AMD EPYC, AVX2, 1 thread, code-target's layers: widened as read, 7-12 rows
 * took 0.68-0.74 of the float32 copy's time but 64 rows 1.35-1.55; widened once, 13-20 rows 0.99-1.00, 64 rows 0.91) */
#define WIDEN_ROWS (2 * ROWS)
/* Each stream is prefetched this many floats (4 KiB) ahead, into L2: without it, at 5-13 rows the products' arithmetic
 * kept the core from asking for the next lines early enough, and a pass took 1.2-1.7x a 1-row pass (8.9-12.1 ms
 * against 7.3 for code-target's weights read from memory; 7.8-9.9 ms with it). A prefetch past the end is harmless
 * (it never faults). A pass over the widened scratch block (more than WIDEN_ROWS rows), which is read from L2, asks
 * no prefetch: one per vector read took two of the ten loads a step issued, and 13-150 rows took 0.90-0.95 of the time
 * without them (code-target's weights in bfloat16 pairs, the AMD EPYC, 1 thread). */
#define AHEAD (4096 / sizeof(float))
/* Up to STREAM_ROWS rows, the weight is read as STREAMS(M) streams side by side: its blocks (float32) or pairs of
 * blocks (bfloat16) split into that many runs of consecutive ones, one of each run per pass (``streamed``). One core's
 * hardware prefetcher follows each stream apart, and one stream alone capped the read at 7.5-8 GB/s on the AMD EPYC
 * (AVX2, 1 thread; a plain sum over 96 MB: 7.5 GB/s as one stream, 10.0 as two, 14.0 as four). A pass over
 * code-target's weights in bfloat16 pairs (47 MB) from memory, the same process, interleaved (``python
 * benchmarks/linear_kernels.py --rows 1 2 3 4 --blocked-source OLD``): 1 row 5.46-6.31 -> 4.51-5.13 ms (0.81-0.83x),
 * 2 rows 5.40-5.42 -> 4.51-4.59 (0.84x), 3 rows (two streams) 4.45-5.73 -> 4.46-5.25 (0.92-1.00x); 4-6 rows over two
 * streams (16-24 accumulators, spilled on AVX2) took 1.0-1.5x, read twice in row groups 1.3-1.6x, so they read one.
 * Each output column sums its products in the same order as before: the same floats. */
#define STREAM_ROWS 3
#define MAX_STREAMS 4
#define STREAMS(M) ((M) <= 2 ? 4 : 2)

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t words __attribute__((vector_size(LANES * sizeof(uint32_t))));

int specdec_lanes(void) { return LANES; }

/* output columns n0 .. n0 + cols (of the whole product) into the row ``y``, whose first column is column c0 */
static inline __attribute__((always_inline)) void store(float *y, vec v, const float *bias, int64_t n0, int64_t cols,
                                                        int64_t c0) {
    float out[LANES];
    memcpy(out, &v, sizeof(vec));
    for (int64_t i = 0; i < cols; ++i) y[n0 - c0 + i] = out[i] + (bias ? bias[n0 + i] : 0.0f);
}

/* the floats of a pair's LANES words at ``at``: block 2p's (the upper halves) and block 2p + 1's (the lower) */
static inline __attribute__((always_inline)) void widen(const uint32_t *at, vec *upper, vec *lower) {
    words both, high, low;
    memcpy(&both, at, sizeof(words));
    high = both & 0xFFFF0000u;
    low = both << 16;
    memcpy(upper, &high, sizeof(vec));
    memcpy(lower, &low, sizeof(vec));
}

/* rows m0 .. m0 + M of x against NB blocks at ``w`` (float32, or where HALF a pair of bfloat16 ones), which are the
 * weight's blocks b .. b + NB; y's rows are ``ys`` floats apart and start at output column c0 */
static inline __attribute__((always_inline)) void pass(const float *x, const void *w, const float *bias, float *y,
                                                       int64_t N, int64_t K, int64_t b, const int NB, const int M,
                                                       const int HALF, const int FETCH, int64_t ys, int64_t c0) {
    vec acc[BLOCKS][ONE_PASS > ROWS ? ONE_PASS : ROWS];
    for (int i = 0; i < NB; ++i)
        for (int m = 0; m < M; ++m) acc[i][m] = (vec){0};
    const float *block = w;
    const uint32_t *pair = w;
    for (int64_t k = 0; k < K; ++k) {
        vec wk[BLOCKS];
        if (HALF) { /* NB == 2 */
            widen(pair + k * LANES, &wk[0], &wk[1]);
            __builtin_prefetch(pair + k * LANES + AHEAD, 0, 2);
        } else {
            for (int i = 0; i < NB; ++i) memcpy(&wk[i], block + (i * K + k) * LANES, sizeof(vec));
            if (FETCH)
                for (int i = 0; i < NB; ++i) __builtin_prefetch(block + (i * K + k) * LANES + AHEAD, 0, 2);
        }
        for (int m = 0; m < M; ++m) {
            float xs = x[m * K + k];
            for (int i = 0; i < NB; ++i) acc[i][m] += wk[i] * xs;
        }
    }
    for (int i = 0; i < NB; ++i) {
        int64_t n0 = (b + i) * LANES, cols = N - n0 < LANES ? N - n0 : LANES;
        for (int m = 0; m < M; ++m) store(y + m * ys, acc[i][m], bias, n0, cols, c0);
    }
}

/* rows m0 .. m0 + M of x against P streams of the weight, each read apart (STREAMS): stream p's block (float32) or
 * pair of blocks (HALF: bfloat16) at ``w + p * apart * K * LANES`` (in units of floats, or of 32-bit words), which is
 * the weight's block b + p * apart (or blocks b + 2 p apart and the next) */
static inline __attribute__((always_inline)) void pass_streams(const float *x, const void *w, const float *bias,
                                                              float *y, int64_t N, int64_t K, int64_t b, int64_t apart,
                                                              const int P, const int M, const int HALF, int64_t ys,
                                                              int64_t c0) {
    const int W = HALF ? 2 : 1; /* blocks a stream holds */
    vec acc[2 * MAX_STREAMS][STREAM_ROWS];
    for (int i = 0; i < W * P; ++i)
        for (int m = 0; m < M; ++m) acc[i][m] = (vec){0};
    for (int64_t k = 0; k < K; ++k) {
        for (int p = 0; p < P; ++p) {
            vec wk[2];
            if (HALF) {
                const uint32_t *at = (const uint32_t *)w + p * apart * K * LANES + k * LANES;
                widen(at, &wk[0], &wk[1]);
                __builtin_prefetch(at + AHEAD, 0, 2);
            } else {
                const float *at = (const float *)w + p * apart * K * LANES + k * LANES;
                memcpy(&wk[0], at, sizeof(vec));
                __builtin_prefetch(at + AHEAD, 0, 2);
            }
            for (int m = 0; m < M; ++m) {
                float xs = x[m * K + k];
                for (int i = 0; i < W; ++i) acc[W * p + i][m] += wk[i] * xs;
            }
        }
    }
    for (int i = 0; i < W * P; ++i) {
        int64_t n0 = (b + i / W * W * apart + i % W) * LANES, cols = N - n0 < LANES ? N - n0 : LANES;
        for (int m = 0; m < M; ++m) store(y + m * ys, acc[i][m], bias, n0, cols, c0);
    }
}

#define STREAMS_CASE(R) case R: pass_streams(x, w + q * K * LANES, bias, y, N, K, b0 + W * q, apart, STREAMS(R), R, HALF, \
                                             ys, c0); break;

/* the first ``W * STREAMS(M) * apart`` of the ``blocks`` blocks at ``w_``, the weight's blocks from b0 on (W blocks a
 * stream's unit), read as STREAMS(M) streams of ``apart`` units each (M <= STREAM_ROWS); the blocks done */
static inline __attribute__((always_inline)) int64_t streamed(const float *x, const void *w_, const float *bias,
                                                             float *y, int64_t M, int64_t N, int64_t K, int64_t blocks,
                                                             const int HALF, int64_t b0, int64_t ys, int64_t c0) {
    const int W = HALF ? 2 : 1;
    const int64_t apart = (blocks + W - 1) / W / STREAMS(M);
    for (int64_t q = 0; q < apart; ++q) {
        if (HALF) {
            const uint32_t *w = w_;
            switch (M) { STREAMS_CASE(1) STREAMS_CASE(2) STREAMS_CASE(3) default: break; }
        } else {
            const float *w = w_;
            switch (M) { STREAMS_CASE(1) STREAMS_CASE(2) STREAMS_CASE(3) default: break; }
        }
    }
    return W * apart * STREAMS(M);
}

#define ROWS_CASE(R) case R: pass(x, w, bias, y, N, K, b, NB, R, HALF, FETCH, ys, c0); break;

static inline __attribute__((always_inline)) void rows(const float *x, const void *w, const float *bias, float *y,
                                                       int64_t N, int64_t K, int64_t b, const int NB, int64_t r,
                                                       const int HALF, const int FETCH, int64_t ys, int64_t c0) {
    switch (r) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#if ROWS > 6
        ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14)
#endif
        default: break;
    }
}

/* blocks b0 .. b1 of the product (output columns b0 * LANES .. min(b1 * LANES, N)) from the float32 copy, into y, whose
 * rows are ``ys`` floats apart and start at output column c0 */
static void float_range(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                        int64_t b0, int64_t b1, int64_t ys, int64_t c0) {
    int64_t b = b0, group = M <= ONE_PASS ? M : ROWS;
    if (M <= STREAM_ROWS) /* the blocks left over by BLOCKS, below */
        b += streamed(x, w + b0 * K * LANES, bias, y, M, N, K, b1 - b0, 0, b0, ys, c0);
    for (; b + BLOCKS <= b1; b += BLOCKS)
        for (int64_t m = 0; m < M; m += group)
            rows(x + m * K, w + b * K * LANES, bias, y + m * ys, N, K, b, BLOCKS, M - m < group ? M - m : group, 0, 1,
                 ys, c0);
    for (; b < b1; ++b)
        for (int64_t m = 0; m < M; m += group)
            rows(x + m * K, w + b * K * LANES, bias, y + m * ys, N, K, b, 1, M - m < group ? M - m : group, 0, 1, ys,
                 c0);
}

/* the same from pairs of bfloat16 blocks (b0 even); more than WIDEN_ROWS rows read each pair widened into a scratch
 * block */
static void pair_range(const float *x, const uint32_t *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t b0, int64_t b1, int64_t ys, int64_t c0) {
    int64_t group = M <= ONE_PASS ? M : ROWS;
    float *wide = M > WIDEN_ROWS ? malloc(2 * K * LANES * sizeof(float)) : NULL;
    int64_t b = b0;
    if (M <= STREAM_ROWS) /* the pairs left over one by one, below */
        b += streamed(x, w + b0 / 2 * K * LANES, bias, y, M, N, K, b1 - b0, 1, b0, ys, c0);
    for (; b < b1; b += 2) {
        const uint32_t *pair = w + b / 2 * K * LANES;
        if (wide)
            for (int64_t k = 0; k < K; ++k) {
                vec upper, lower;
                widen(pair + k * LANES, &upper, &lower);
                memcpy(wide + k * LANES, &upper, sizeof(vec));
                memcpy(wide + (K + k) * LANES, &lower, sizeof(vec));
            }
        for (int64_t m = 0; m < M; m += group) {
            int64_t r = M - m < group ? M - m : group;
            if (wide) rows(x + m * K, wide, bias, y + m * ys, N, K, b, 2, r, 0, 0, ys, c0);
            else rows(x + m * K, pair, bias, y + m * ys, N, K, b, 2, r, 1, 1, ys, c0);
        }
    }
    free(wide);
}

/* x [M, K] (rows contiguous), w [ceil(N / LANES), K, LANES], bias [N] or NULL, y [M, N] */
void specdec_blocked_linear(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K) {
    float_range(x, w, bias, y, M, N, K, 0, (N + LANES - 1) / LANES, N, 0);
}

/* the same from pairs of bfloat16 blocks, w [ceil(N / LANES / 2), K, LANES] 32-bit words (an odd last block paired
 * with zeros, whose columns are not stored) */
void specdec_blocked_linear_bf16(const float *x, const uint32_t *w, const float *bias, float *y, int64_t M, int64_t N,
                                 int64_t K) {
    pair_range(x, w, bias, y, M, N, K, 0, (N + LANES - 1) / LANES, N, 0);
}

/* blocks b0 .. b1 of either product (HALF: w holds bfloat16 pairs, b0 even) into y, whose rows are ``ys`` floats apart
 * and start at output column b0 * LANES: a share of the product for one thread (blocked_op.cpp, ``Helper``). Each
 * column's sum is the whole product's, in the same order, whatever share computes it */
void specdec_blocked_range(const float *x, const void *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                           int64_t b0, int64_t b1, int64_t ys, int HALF) {
    if (HALF) pair_range(x, w, bias, y, M, N, K, b0, b1, ys, b0 * LANES);
    else float_range(x, w, bias, y, M, N, K, b0, b1, ys, b0 * LANES);
}
