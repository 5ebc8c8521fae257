"""The C source of invariant numerics' attention on a CPU (invariant_attention.py calls it; cpu_kernels.build
compiles it with the GEMM into one library). Every row (one query head of one token) alone, in a fixed order:

    s_j   = (q · k_j) * scale for each visible key j (from the window's first to the token's position): the dot
            product in 16 lanes (lane l adds d = l, l + 16, ... by fused multiply-adds), folded as a fixed tree
    m     = max_j s_j (exact in any order)
    e_j   = exp(s_j - m), by one polynomial written out below (the same operations, so the same bits, on the
            vector path and the portable one; 0 below -87)
    denom = e_0 + e_1 + ... in key order (float32)
    out_d = (e_0 v_0d + e_1 v_1d + ...) / denom, one chain of fused multiply-adds in key order per d

so a row's result depends only on its query, its visible keys and values, whatever the batch, the chunking of its
prompt or the other rows. AVX-512 (F, BW) where the CPU has it, the portable C of the same order elsewhere.
"""

SOURCE = r"""
#define EXP_LOW -87.0f  /* exp below it: 0 (2^n stays a normal number above it) */
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define LOG2E 1.44269504088896341f

static inline float exp_scalar(float x) {
    if (x < EXP_LOW) return 0.0f;
    float n = rintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float fold16(const float *acc) {
    return ((((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])))
            + (((acc[8] + acc[9]) + (acc[10] + acc[11])) + ((acc[12] + acc[13]) + (acc[14] + acc[15]))));
}

static inline float element(const void *p, int64_t i, int bf16) {
    if (bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

#ifdef VECTOR
static inline __m512 vload(const void *p, int64_t i, __mmask16 m, int bf16) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
static inline __m512 exp_vector(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LOW), _CMP_GE_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
}
#endif

/* One row: query q (D elements), keys/values of slots[0..L) in the cache (row of a slot: slot * row + head * D),
   out (D floats). s: scratch of L floats. */
static void attend_row(const float *q, const void *k, const void *v, const int64_t *slots, int64_t L, int64_t row,
                       int64_t head, int64_t D, float scale, int bf16, float *s, float *out) {
    if (L <= 0) {
        memset(out, 0, D * sizeof(float));
        return;
    }
    float m = -INFINITY;
    for (int64_t j = 0; j < L; j++) {
        const int64_t base = slots[j] * row + head * D;
        float lanes[16];
#ifdef VECTOR
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            __mmask16 mask = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
            acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(mask, q + d), vload(k, base + d, mask, bf16), acc, mask);
        }
        _mm512_storeu_ps(lanes, acc);
#else
        memset(lanes, 0, sizeof lanes);
        for (int64_t d = 0; d < D; d++) lanes[d % 16] = fmaf(q[d], element(k, base + d, bf16), lanes[d % 16]);
#endif
        s[j] = fold16(lanes) * scale;
        m = s[j] > m ? s[j] : m;
    }
    int64_t j = 0;
#ifdef VECTOR
    for (; j + 16 <= L; j += 16)
        _mm512_storeu_ps(s + j, exp_vector(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(m))));
#endif
    for (; j < L; j++) s[j] = exp_scalar(s[j] - m);
    float denominator = 0.0f;
    for (j = 0; j < L; j++) denominator += s[j];
#ifdef VECTOR
    for (int64_t d = 0; d < D; d += 16) {
        __mmask16 mask = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (j = 0; j < L; j++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), vload(v, slots[j] * row + head * D + d, mask, bf16), acc);
        _mm512_mask_storeu_ps(out + d, mask, _mm512_div_ps(acc, _mm512_set1_ps(denominator)));
    }
#else
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (j = 0; j < L; j++)
        for (int64_t d = 0; d < D; d++) out[d] = fmaf(s[j], element(v, slots[j] * row + head * D + d, bf16), out[d]);
    for (int64_t d = 0; d < D; d++) out[d] = out[d] / denominator;
#endif
}

/* Attention of T tokens: token t's keys are slots[first[t] + j] for j in [lo, pos[t]], lo = max(0, pos[t] -
   window + 1) (window 0: no window). q [T, Hq, D] float32; k, v: a layer's cache halves [S, Hkv, D] (bfloat16 when
   p[5]); out [T, Hq, D] float32. p: T, Hq, Hkv, D, window, kv_bf16, threads. */
void ordered_attention(const float *q, const void *k, const void *v, const int64_t *slots, const int64_t *first,
                       const int64_t *pos, float *out, const int64_t *p, float scale) {
    const int64_t T = p[0], Hq = p[1], Hkv = p[2], D = p[3], window = p[4], threads = p[6];
    const int bf16 = p[5] != 0;
    const int64_t group = Hq / Hkv;
    int64_t longest = 0;
    for (int64_t t = 0; t < T; t++) longest = pos[t] + 1 > longest ? pos[t] + 1 : longest;
    int parallel = threads > 1 && T * Hq * longest * D >= (1 << 16);
    #pragma omp parallel num_threads(threads) if(parallel)
    {
        float *scratch = malloc((longest > 0 ? longest : 1) * sizeof(float));
        #pragma omp for collapse(2) schedule(dynamic, 4)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < Hq; h++) {
                const int64_t lo = window > 0 && pos[t] - window + 1 > 0 ? pos[t] - window + 1 : 0;
                attend_row(q + (t * Hq + h) * D, k, v, slots + first[t] + lo, pos[t] + 1 - lo, Hkv * D, h / group,
                           D, scale, bf16, scratch, out + (t * Hq + h) * D);
            }
        free(scratch);
    }
}
"""
