/* Fused CPU kernel for the clipped-surrogate objectives (cegppo.objectives: ce_gppo, gppo, ppo_clip and its
 * grpo / dapo settings). One pass over [B, T] reads log_prob, old_log_prob, the mask and the advantages and
 * writes d loss / d log_prob; the loss value and the region metrics are reduced in the same pass.
 *
 * Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)) (cegppo.objectives.LOG_RATIO_CLAMP):
 *   A < 0 and r < 1 - eps_low    value v_low,  grad weight g_low    (the beta1 region)
 *   A > 0 and r > 1 + eps_high   value v_high, grad weight g_high   (the beta2 region)
 *   A < 0 and r > c              value c,      grad weight 0        (dual clip; c = inf disables it)
 *   otherwise                    value r,      grad weight r
 * loss = sum(-A * value * mask) / denom, grad = -A * weight * mask / denom. The Python definitions in
 * objectives.py are the reference; tests/test_cpu_kernel.py checks this kernel against them.
 *
 * Written branch-free with `omp simd` reductions so that the compiler vectorizes it; the row's advantage
 * sign is hoisted out of the loop when advantages are per sequence.
 */
#include <stdint.h>
#include <stdlib.h>

typedef union { int32_t i; float f; } bits32;

/* exp(x) for x in [-20, 20]: 2^k * p(x - k ln2), Cephes' degree-7 polynomial (about 1 ulp). The clamp keeps
 * 2^k a normal float, so no overflow or denormal handling is needed. NaN propagates. */
static inline float exp_clamped(float x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to the nearest integer, held in the low bits */
    bits32 k;
    k.f = x * 1.44269504088896341f + shifter;
    float fk = k.f - shifter;
    float r = (x - fk * 0.693359375f) + fk * 2.12194440e-4f; /* ln 2 split in two so fk * ln2_hi is exact */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    bits32 scale;
    scale.i = (k.i - 0x4B400000 + 127) << 23;
    return p * scale.f;
}

typedef struct { float lo, hi, v_low, g_low, v_high, g_high, c; } regions;

/* the clamped log-ratio d, the ratio r and the mask m of token t, and the three sums every row needs */
#define TOKEN(t)                              \
    float d = lp[t] - old[t];                 \
    d = d < -20.0f ? -20.0f : d;              \
    d = d > 20.0f ? 20.0f : d;                \
    float r = exp_clamped(d);                 \
    float m = mask[t];                        \
    s_m += m; s_kl -= d * m; s_r += r * m;

/* one row; s = {sum -A*value*m, sum m, low, high, dual, -log_ratio, ratio}, all masked */
static void row(const float *restrict lp, const float *restrict old, const float *restrict adv, int per_token,
                const float *restrict mask, int64_t T, regions g, float inv_denom, float *restrict grad,
                double *restrict s) {
    float s_v = 0, s_m = 0, s_lo = 0, s_hi = 0, s_du = 0, s_kl = 0, s_r = 0;
    const float a = adv[0], ka = -a * inv_denom;
    if (per_token) {
        #pragma omp simd reduction(+ : s_v, s_m, s_lo, s_hi, s_du, s_kl, s_r)
        for (int64_t t = 0; t < T; t++) {
            TOKEN(t)
            float at = adv[t];
            int low = (at < 0.0f) & (r < g.lo), high = (at > 0.0f) & (r > g.hi), dual = (at < 0.0f) & (r > g.c);
            grad[t] = -at * (low ? g.g_low : (high ? g.g_high : (dual ? 0.0f : r))) * m * inv_denom;
            s_v -= at * (low ? g.v_low : (high ? g.v_high : (dual ? g.c : r))) * m;
            s_lo += low ? m : 0.0f;
            s_hi += high ? m : 0.0f;
            s_du += dual ? m : 0.0f;
        }
    } else if (a < 0.0f) { /* only the low region and the dual clip can apply */
        #pragma omp simd reduction(+ : s_v, s_m, s_lo, s_du, s_kl, s_r)
        for (int64_t t = 0; t < T; t++) {
            TOKEN(t)
            int low = r < g.lo, dual = r > g.c;
            grad[t] = ka * (low ? g.g_low : (dual ? 0.0f : r)) * m;
            s_v += (low ? g.v_low : (dual ? g.c : r)) * m;
            s_lo += low ? m : 0.0f;
            s_du += dual ? m : 0.0f;
        }
        s_v *= -a;
    } else if (a > 0.0f) { /* only the high region can apply */
        #pragma omp simd reduction(+ : s_v, s_m, s_hi, s_kl, s_r)
        for (int64_t t = 0; t < T; t++) {
            TOKEN(t)
            int high = r > g.hi;
            grad[t] = ka * (high ? g.g_high : r) * m;
            s_v += (high ? g.v_high : r) * m;
            s_hi += high ? m : 0.0f;
        }
        s_v *= -a;
    } else { /* A = 0, or NaN, which propagates through ka */
        #pragma omp simd reduction(+ : s_m, s_kl, s_r)
        for (int64_t t = 0; t < T; t++) {
            TOKEN(t)
            grad[t] = ka * r * m;
        }
        s_v = -a * s_r;
    }
    s[0] = s_v; s[1] = s_m; s[2] = s_lo; s[3] = s_hi; s[4] = s_du; s[5] = s_kl; s[6] = s_r;
}

/* out = {loss, clip/low_frac, clip/high_frac, clip/dual_frac, ppo_kl, ratio/mean}; fractions and means are
 * over the masked tokens. Returns 0, or -1 if scratch memory could not be allocated (nothing is written). */
int clip_surrogate(const float *lp, const float *old, const float *adv, int64_t adv_per_token, const float *mask,
                   int64_t B, int64_t T, float eps_low, float eps_high, float v_low, float g_low, float v_high,
                   float g_high, float c, double denom, int nthreads, float *grad, float *out) {
    double *sums = malloc(sizeof(double) * 7 * (B > 0 ? B : 1));
    if (!sums) return -1;
    regions g = {1.0f - eps_low, 1.0f + eps_high, v_low, g_low, v_high, g_high, c};
    const float inv_denom = (float)(1.0 / denom);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        const int64_t o = b * T;
        row(lp + o, old + o, adv + (adv_per_token ? o : b), (int)adv_per_token, mask + o, T, g, inv_denom,
            grad + o, sums + 7 * b);
    }
    double tot[7] = {0};
    for (int64_t b = 0; b < B; b++)
        for (int j = 0; j < 7; j++) tot[j] += sums[7 * b + j];
    free(sums);
    const double n = tot[1] > 1.0 ? tot[1] : 1.0;
    out[0] = (float)(tot[0] / denom);
    for (int j = 2; j < 7; j++) out[j - 1] = (float)(tot[j] / n);
    return 0;
}
