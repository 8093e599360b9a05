/* specdec's float32 attention for a compiled decode step: a few new tokens per row against a static cache whose
 * slots are not all live (specdec/compiled.py, ``specdec_attention``). The step's additive mask says which slots
 * each query sees; a slot no query of its row sees (a shorter row's padding, the holes of ragged acceptance, a dead
 * row's slots) is skipped: its keys and values are never read. At 16 rows of code prompts the cache's attended slots were
 * about twice the live ones, and reading them took half the step (docs/benchmarks.md, "Attention over the live
 * slots"). Per row and key-value head: the scores of its G * n queries (G query heads a key-value head serves, n
 * new tokens), a softmax, the weighted values; each live key and value read once for all of them. A row's live slots
 * are found once, as runs, for all its heads (``live_runs``), and the scores of four slots are summed side by side
 * (four independent sums in flight; each the same sum, in the same order, as one at a time): on the AMD EPYC (AVX2,
 * 1 thread; 6 layers of code-target's 8 heads, from memory) 4 rows of 250 slots took 3.33-3.50 ms against
 * 3.87-3.96, 4 rows x 5 tokens 4.73 against 5.11, 1 row of 480 slots 1.75 against 1.95; the same floats. Reading
 * the keys of several heads side by side (several streams, as blocked_linear.c does) gained nothing more here. Built
 * like blocked_linear.c (-O3 -march=native, vector extensions, no intrinsics). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define DEAD (-1e30f) /* a mask value at or below this hides its slot (transformers masks with float32's lowest) */
#define MAX_ACC 8192  /* floats of the output accumulators held on the stack: G * n * head dim at most */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float uvec __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias)); /* unaligned */
#define AHEAD 16 /* slots prefetched ahead (4 KiB of a 64-float head) */

static inline vec load(const float *p) { return *(const uvec *)p; }
static inline void put(float *p, vec x) { *(uvec *)p = x; }

int specdec_attention_max_acc(void) { return MAX_ACC; }

static inline vec splat(float x) { return (vec){0} + x; }

static inline vec pick(ivec which, vec a, vec b) { /* a where which is true (all ones), else b */
    ivec ia, ib;
    memcpy(&ia, &a, sizeof(vec));
    memcpy(&ib, &b, sizeof(vec));
    ivec r = (which & ia) | (~which & ib);
    vec out;
    memcpy(&out, &r, sizeof(vec));
    return out;
}

/* exp(x) for x <= 0 (Cephes' expf: x = m ln 2 + r, a degree-5 polynomial in r, times 2^m), 0 below -87.3 (and for
 * -inf, a skipped slot); the attention stays within 2e-6 of float64 softmax attention (tests/test_attention.py) */
static inline vec vexp(vec x) {
    ivec under = x < splat(-87.3f);
    x = pick(under, splat(-87.3f), x);
    vec fx = x * splat(1.44269504088896341f) + splat(0.5f);
    vec m = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);  /* truncated toward 0 */
    m = pick(m > fx, m - splat(1.0f), m); /* floor */
    vec r = x - m * splat(0.693359375f) + m * splat(2.12194440e-4f);
    vec y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * r * r + r + splat(1.0f);
    ivec bits = (__builtin_convertvector(m, ivec) + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof(vec));
    y = y * scale;
    return pick(under, splat(0.0f), y);
}

#if defined(__clang__)
#define HALF(v, n) __builtin_shufflevector(v, v, SHIFT##n)
#else
#define HALF(v, n) __builtin_shuffle(v, (ivec){SHIFT##n})
#endif
#if LANES == 16
#define SHIFT8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define SHIFT4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define SHIFT2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define SHIFT1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#else
#define SHIFT4 4, 5, 6, 7, 0, 1, 2, 3
#define SHIFT2 2, 3, 0, 1, 6, 7, 4, 5
#define SHIFT1 1, 0, 3, 2, 5, 4, 7, 6
#endif

static inline float hsum(vec v) { /* a tree of shuffles and adds: every lane ends with the sum */
#if LANES == 16
    v += HALF(v, 8);
#endif
    v += HALF(v, 4);
    v += HALF(v, 2);
    v += HALF(v, 1);
    return v[0];
}

static inline int live(const float *mask, int64_t n, int64_t S, int64_t j) {
    for (int64_t i = 0; i < n; ++i)
        if (mask[i * S + j] > DEAD) return 1;
    return 0;
}

/* row r's live runs: [start, end) pairs (runs[2i], runs[2i + 1]) of the slots some query of the row sees; their
 * number. Found once per row, for every head: the slots between runs are never read */
static int64_t live_runs(const float *mr, int64_t n, int64_t S, int64_t *runs) {
    int64_t count = 0, j = 0;
    while (j < S) {
        while (j < S && !live(mr, n, S, j)) ++j;
        if (j == S) break;
        runs[2 * count] = j;
        while (j < S && live(mr, n, S, j)) ++j;
        runs[2 * count + 1] = j;
        ++count;
    }
    return count;
}

static inline __attribute__((always_inline)) void prefetch_slots(const float *base, int64_t from, int64_t to,
                                                                 const int64_t D) {
    for (const char *p = (const char *)(base + from * D), *e = (const char *)(base + to * D); p < e; p += 64)
        __builtin_prefetch(p, 0, 2);
}

static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k, const float *v, const float *mask, float *out, float *scores, int64_t *runs,
    int64_t R, int64_t H, int64_t Hkv, int64_t n, int64_t S, const int64_t D, int64_t k_row, int64_t k_head,
    int64_t v_row, int64_t v_head, float scale, const int64_t Qc) {
    const int64_t G = H / Hkv, Q = Qc ? Qc : G * n, V = D / LANES;
    for (int64_t r = 0; r < R; ++r) {
        const float *mr = mask + r * n * S;
        const int64_t count = live_runs(mr, n, S, runs);
        for (int64_t hk = 0; hk < Hkv; ++hk) {
            const float *kb = k + r * k_row + hk * k_head, *vb = v + r * v_row + hk * v_head;
            const float *qb = q + (r * H + hk * G) * n * D; /* query (g, i) at qb + (g * n + i) * D */
            for (int64_t c = 0; c < Q; ++c)
                for (int64_t j = 0; j < S; ++j) scores[c * S + j] = -INFINITY;
            for (int64_t u = 0; u < count; ++u) {
                const int64_t a = runs[2 * u], b = runs[2 * u + 1];
                prefetch_slots(kb, a, a + AHEAD < b ? a + AHEAD : b, D);
                int64_t j = a;
                for (; j + 4 <= b; j += 4) { /* four slots at a time: four independent sums in flight */
                    if (j + 4 + AHEAD <= b) prefetch_slots(kb, j + AHEAD, j + 4 + AHEAD, D);
                    const float *k0 = kb + j * D;
                    for (int64_t c = 0; c < Q; ++c) {
                        const float *qc = qb + c * D;
                        vec s0 = (vec){0}, s1 = (vec){0}, s2 = (vec){0}, s3 = (vec){0};
                        for (int64_t d = 0; d < V; ++d) {
                            vec x = load(qc + d * LANES);
                            s0 += x * load(k0 + d * LANES);
                            s1 += x * load(k0 + D + d * LANES);
                            s2 += x * load(k0 + 2 * D + d * LANES);
                            s3 += x * load(k0 + 3 * D + d * LANES);
                        }
                        const float *mc = mr + (c % n) * S + j;
                        float *sc = scores + c * S + j;
                        sc[0] = hsum(s0) * scale + mc[0];
                        sc[1] = hsum(s1) * scale + mc[1];
                        sc[2] = hsum(s2) * scale + mc[2];
                        sc[3] = hsum(s3) * scale + mc[3];
                    }
                }
                for (; j < b; ++j) {
                    for (int64_t c = 0; c < Q; ++c) {
                        const float *qc = qb + c * D;
                        vec acc = (vec){0};
                        for (int64_t d = 0; d < V; ++d) acc += load(qc + d * LANES) * load(kb + j * D + d * LANES);
                        scores[c * S + j] = hsum(acc) * scale + mr[(c % n) * S + j];
                    }
                }
            }
            float total[Q > 0 ? Q : 1];
            for (int64_t c = 0; c < Q; ++c) { /* softmax numerators in place; their sum */
                float *sc = scores + c * S, top = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < S; ++j) top = sc[j] > top ? sc[j] : top;
                int64_t j = 0;
                vec sums = (vec){0};
                for (; j + LANES <= S; j += LANES) {
                    vec x = vexp(load(sc + j) - splat(top));
                    put(sc + j, x);
                    sums += x;
                }
                sum = hsum(sums);
                for (; j < S; ++j) {
                    vec x = vexp(splat(sc[j] - top));
                    float e;
                    memcpy(&e, &x, sizeof(float));
                    sc[j] = e;
                    sum += e;
                }
                total[c] = sum;
            }
            vec acc[Qc ? Qc * (D / LANES) : MAX_ACC / LANES];
            for (int64_t i = 0; i < Q * V; ++i) acc[i] = (vec){0};
            for (int64_t u = 0; u < count; ++u) {
                const int64_t a = runs[2 * u], b = runs[2 * u + 1];
                prefetch_slots(vb, a, a + AHEAD < b ? a + AHEAD : b, D);
                for (int64_t j = a; j < b; ++j) {
                    if (j + AHEAD < b) prefetch_slots(vb, j + AHEAD, j + AHEAD + 1, D);
                    const float *vj = vb + j * D;
                    for (int64_t c = 0; c < Q; ++c) {
                        vec p = splat(scores[c * S + j]);
                        for (int64_t d = 0; d < V; ++d) acc[c * V + d] += p * load(vj + d * LANES);
                    }
                }
            }
            for (int64_t c = 0; c < Q; ++c) {
                int64_t g = c / n, i = c % n;
                float *o = out + ((r * n + i) * H + hk * G + g) * D;
                vec inv = splat(total[c] > 0.0f ? 1.0f / total[c] : 0.0f);
                for (int64_t d = 0; d < V; ++d) put(o + d * LANES, acc[c * V + d] * inv);
            }
        }
    }
}

/* the head dimensions computed (multiples of 16: of the vector width either way; specdec/compiled.py, ATTENTION_DIMS) */
#define HEAD_DIMS(X) X(32) X(64) X(80) X(96) X(128) X(256)
/* one query per key-value head (plain decoding without grouped heads) is its own case: its accumulators in registers */
#define HEAD_CASE(D_)                                                                                                   \
    case D_:                                                                                                            \
        if (G * n == 1)                                                                                                 \
            attend(q, k, v, mask, out, scores, runs, R, H, Hkv, n, S, D_, k_row, k_head, v_row, v_head, scale, 1);      \
        else                                                                                                            \
            attend(q, k, v, mask, out, scores, runs, R, H, Hkv, n, S, D_, k_row, k_head, v_row, v_head, scale, 0);      \
        break;
#define IS_DIM(D_) || D == D_

/* q [R, H, n, D] contiguous; k, v: slot j of row r, head h at base + r * row + h * head + j * D (D contiguous);
 * mask [R, n, S] contiguous, additive; out [R, n, H, D]; scores: room for G * n * S floats; runs: room for
 * 2 (S + 1) integers. D one of
 * ``HEAD_DIMS`` (``specdec_attention_dims``), H % Hkv == 0, G * n * D <= MAX_ACC (the caller checks). */
void specdec_attention(const float *q, const float *k, const float *v, const float *mask, float *out, float *scores,
                       int64_t *runs, int64_t R, int64_t H, int64_t Hkv, int64_t n, int64_t S, int64_t D, int64_t k_row,
                       int64_t k_head, int64_t v_row, int64_t v_head, float scale) {
    const int64_t G = H / Hkv;
    switch (D) {
        HEAD_DIMS(HEAD_CASE)
        default: break;
    }
}

/* whether specdec_attention computes heads of dimension D */
int specdec_attention_dims(int64_t D) { return 0 HEAD_DIMS(IS_DIM); }
