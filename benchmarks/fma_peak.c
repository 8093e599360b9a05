/* One core's float32 FMA peak (x86-64 with AVX2 and FMA): twelve independent 8-lane fused multiply-adds per
 * iteration, in registers (inline assembly, so the compiler can neither fold nor spill them), timed over 3.6e9 of
 * them. What a matrix product's GFLOP/s is measured against in docs/benchmarks.md ("At 4 clients the engine is at
 * this machine's floors"):
 *
 *     gcc -O2 -o /tmp/fma_peak benchmarks/fma_peak.c && /tmp/fma_peak
 */
#include <stdio.h>
#include <time.h>

#define FMA(r) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #r "\n"
#define ZERO(r) "vxorps %%ymm" #r ", %%ymm" #r ", %%ymm" #r "\n"
#define TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define CLOBBERED "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"

int main(void) {
    const long iterations = 300000000;
    struct timespec start, end;
    __asm__ volatile(TWELVE(ZERO) ZERO(14) ZERO(15) ::: CLOBBERED, "xmm14", "xmm15");
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < iterations; ++i) __asm__ volatile(TWELVE(FMA) ::: CLOBBERED);
    clock_gettime(CLOCK_MONOTONIC, &end);
    double seconds = (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) * 1e-9;
    printf("%.1f GFLOP/s (%.2f G FMA instructions/s, 16 FLOP each)\n", iterations * 12.0 * 16 / seconds / 1e9,
           iterations * 12.0 / seconds / 1e9);
    return 0;
}
