"""The C source of the ordered GEMM (ordered_gemm.py calls it; cpu_kernels.build compiles it): out[m, n] = sum over
k of a[m, k] * b[k, n], each element one chain of fused multiply-adds in k order from 0 (C's fmaf: one rounding,
exactly specified, so every CPU computes the same bits), or, in pieces of a fixed number of k's, one chain a piece
and the pieces' sums added in order. Tiles of 8 rows x 32 columns (a panel of b), vectorised across the columns
where the CPU has AVX-512 (F, BW, VL); the portable C of the same order elsewhere.
"""

PANEL = 32  # columns of b per panel (the C's NR)

SOURCE = r"""
#define MR 8   /* rows of a tile */
#define NR 32  /* columns of a tile: a panel of b */

/* A tile: out[i, j] = sum over k of a[i, k] * b(k, j) for i < R, j < nr (<= NR): each piece of `step` k's (the
   last may be shorter) a chain of fused multiply-adds in k order from 0, the pieces' sums added in piece order
   (float32). a: float32, row stride lda; b(k, j) at b[k * ldb + j] (float32 or bfloat16); out: row stride ldo. */
#ifdef VECTOR
static inline __mmask16 first(int64_t n) {  /* the first n of 16 lanes */
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}
/* float32 b: columns [0, 16) and [16, 32) of the tile. */
#define MASKS_F32(nr) const __mmask16 mlo = first(nr), mhi = first((nr) - 16);
#define LOAD_F32(b, i, lo, hi) {                                                                      \
    lo = _mm512_maskz_loadu_ps(mlo, (const float *)(b) + (i));                                        \
    hi = _mm512_maskz_loadu_ps(mhi, (const float *)(b) + (i) + 16); }
#define NATURAL_F32(lo, hi, v0, v1) { v0 = lo; v1 = hi; }
/* bfloat16 b: 32 columns in one load; the even columns (each 32-bit lane's low half) and the odd ones. */
#define MASKS_BF16(nr)                                                                                \
    const __mmask16 mlo = first(nr), mhi = first((nr) - 16);                                          \
    const __mmask32 mall = (nr) >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (nr)) - 1);      \
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);                                         \
    const __m512i first_half = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);   \
    const __m512i second_half = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#define LOAD_BF16(b, i, lo, hi) {                                                                     \
    __m512i x = _mm512_maskz_loadu_epi16(mall, (const uint16_t *)(b) + (i));                          \
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));                                               \
    hi = _mm512_castsi512_ps(_mm512_and_si512(x, high)); }
#define NATURAL_BF16(lo, hi, v0, v1) {                                                                \
    v0 = _mm512_permutex2var_ps(lo, first_half, hi);                                                  \
    v1 = _mm512_permutex2var_ps(lo, second_half, hi); }
/* A row of the tile into out (its columns in order), or added to what a previous piece left there. */
#define STORE(T, o, lo, hi, add) {                                                                    \
    __m512 v0, v1;                                                                                    \
    NATURAL_##T(lo, hi, v0, v1)                                                                       \
    if (add) {                                                                                        \
        v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(mlo, o), v0);                                        \
        v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(mhi, (o) + 16), v1);                                 \
    }                                                                                                 \
    _mm512_mask_storeu_ps(o, mlo, v0);                                                                \
    _mm512_mask_storeu_ps((o) + 16, mhi, v1); }
#define KERNEL(NAME, R, T)                                                                            \
static void NAME(const float *a, int64_t lda, const void *b, int64_t ldb, float *out, int64_t ldo,    \
                 int64_t K, int64_t step, int64_t nr) {                                               \
    MASKS_##T(nr)                                                                                     \
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += step) {                                             \
        const int64_t k1 = k0 + step < K ? k0 + step : K;                                             \
        __m512 lo[R], hi[R], blo, bhi;                                                                \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm512_setzero_ps();      \
        for (int64_t k = k0; k < k1; k++) {                                                           \
            LOAD_##T(b, k * ldb, blo, bhi)                                                            \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                     \
                __m512 av = _mm512_set1_ps(a[i * lda + k]);                                           \
                lo[i] = _mm512_fmadd_ps(av, blo, lo[i]);                                              \
                hi[i] = _mm512_fmadd_ps(av, bhi, hi[i]);                                              \
            }                                                                                         \
        }                                                                                             \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) STORE(T, out + i * ldo, lo[i], hi[i], k0 > 0) \
    }                                                                                                 \
}
#else
static inline float scalar_F32(const void *b, int64_t i) { return ((const float *)b)[i]; }
static inline float scalar_BF16(const void *b, int64_t i) {
    uint32_t bits = (uint32_t)((const uint16_t *)b)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define KERNEL(NAME, R, T)                                                                            \
static void NAME(const float *a, int64_t lda, const void *b, int64_t ldb, float *out, int64_t ldo,    \
                 int64_t K, int64_t step, int64_t nr) {                                               \
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += step) {                                             \
        const int64_t k1 = k0 + step < K ? k0 + step : K;                                             \
        float acc[R][NR];                                                                             \
        memset(acc, 0, sizeof acc);                                                                   \
        for (int64_t k = k0; k < k1; k++)                                                             \
            for (int i = 0; i < R; i++)                                                               \
                for (int64_t j = 0; j < nr; j++)                                                      \
                    acc[i][j] = fmaf(a[i * lda + k], scalar_##T(b, k * ldb + j), acc[i][j]);          \
        for (int i = 0; i < R; i++)                                                                   \
            for (int64_t j = 0; j < nr; j++) out[i * ldo + j] = k0 > 0 ? out[i * ldo + j] + acc[i][j] : acc[i][j]; \
    }                                                                                                 \
}
#endif

#define KERNELS(T)                                                                                    \
    KERNEL(kernel_##T##_1, 1, T) KERNEL(kernel_##T##_2, 2, T) KERNEL(kernel_##T##_3, 3, T)             \
    KERNEL(kernel_##T##_4, 4, T) KERNEL(kernel_##T##_5, 5, T) KERNEL(kernel_##T##_6, 6, T)             \
    KERNEL(kernel_##T##_7, 7, T) KERNEL(kernel_##T##_8, 8, T)
KERNELS(F32)
KERNELS(BF16)

typedef void (*kernel_fn)(const float *, int64_t, const void *, int64_t, float *, int64_t, int64_t, int64_t,
                          int64_t);
static const kernel_fn KERNEL_FNS[2][MR] = {
    {kernel_F32_1, kernel_F32_2, kernel_F32_3, kernel_F32_4, kernel_F32_5, kernel_F32_6, kernel_F32_7, kernel_F32_8},
    {kernel_BF16_1, kernel_BF16_2, kernel_BF16_3, kernel_BF16_4, kernel_BF16_5, kernel_BF16_6, kernel_BF16_7,
     kernel_BF16_8}};

int ordered_gemm_vector(void) {
#ifdef VECTOR
    return 1;
#else
    return 0;
#endif
}

/* out[g1, g2] = a[g1, g2] b[g1, g2] for every (g1, g2) < (G1, G2): a [M, K] float32, b [K, N] float32 or
   bfloat16, out [M, N] float32. p: G1, G2, M, N, K, b_bf16, threads, then strides in elements: a's g1, g2 and
   row; b's g1, g2, row (k) and panel (b's columns come in panels of NR: column n of row k at
   (n / NR) * panel + k * row + n % NR; NR for a plain row-major b); out's g1, g2 and row; then the piece (0: K,
   one chain): the reduction in pieces of that many k's, their sums added in order. Tiles of MR x NR; the row tiles
   meet one panel of b in turn, so it stays in cache. */
void ordered_gemm(const float *a, const void *b, float *out, const int64_t *p) {
    const int64_t G1 = p[0], G2 = p[1], M = p[2], N = p[3], K = p[4], threads = p[6];
    const int64_t *st = p + 7, step = p[17] > 0 && p[17] < K ? p[17] : (K > 0 ? K : 1);
    const kernel_fn *kernels = KERNEL_FNS[p[5] != 0];
    const int64_t eb = p[5] ? 2 : 4, mt = (M + MR - 1) / MR, nt = (N + NR - 1) / NR;
    int parallel = threads > 1 && G1 * G2 * M * N * K >= (1 << 18);  /* a small product is not worth waking threads */
    #pragma omp parallel for collapse(4) schedule(static) num_threads(threads) if(parallel)
    for (int64_t g1 = 0; g1 < G1; g1++)
        for (int64_t g2 = 0; g2 < G2; g2++)
            for (int64_t tj = 0; tj < nt; tj++)
                for (int64_t ti = 0; ti < mt; ti++) {
                    const int64_t m0 = ti * MR, n0 = tj * NR;
                    const int64_t mr = M - m0 < MR ? M - m0 : MR, nr = N - n0 < NR ? N - n0 : NR;
                    kernels[mr - 1](a + g1 * st[0] + g2 * st[1] + m0 * st[2], st[2],
                                    (const char *)b + (g1 * st[3] + g2 * st[4] + tj * st[6]) * eb, st[5],
                                    out + g1 * st[7] + g2 * st[8] + m0 * st[9] + n0, st[9], K, step, nr);
                }
}
"""
