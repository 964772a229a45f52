/* ============================================================================
 * dtypes: sizes, names, and f32 <-> bf16 / f16 conversion (round to nearest even).
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

size_t dtr_dtype_size(dtr_dtype dt) {
    switch (dt) {
    case DTR_F32: case DTR_I32: return 4;
    case DTR_BF16: case DTR_F16: return 2;
    case DTR_U8: return 1;
    }
    return 0;
}

const char *dtr_dtype_name(dtr_dtype dt) {
    switch (dt) {
    case DTR_F32: return "f32";
    case DTR_BF16: return "bf16";
    case DTR_F16: return "f16";
    case DTR_I32: return "i32";
    case DTR_U8: return "u8";
    }
    return "unknown";
}

static uint32_t dtr__fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float dtr__bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t dtr_f32_to_bf16(float x) {
    uint32_t u = dtr__fbits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float dtr_bf16_to_f32(uint16_t x) { return dtr__bitsf((uint32_t)x << 16); }

uint16_t dtr_f32_to_f16(float x) {
    uint32_t u = dtr__fbits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (a < 0x38800000u) {  /* subnormal or zero in f16 */
        /* value = a as float; f16 subnormal unit = 2^-24 */
        float f = dtr__bitsf(a) * 16777216.0f; /* scale by 2^24 */
        /* round half to even */
        uint32_t i = (uint32_t)f;
        float rem = f - (float)i;
        if (rem > 0.5f || (rem == 0.5f && (i & 1u))) i++;
        return (uint16_t)(sign | i);
    }
    {
        uint32_t mant_odd = (a >> 13) & 1u;
        a += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round */
        return (uint16_t)(sign | (a >> 13));
    }
}

float dtr_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (exp == 31) return dtr__bitsf(sign | 0x7f800000u | (mant << 13));
    return dtr__bitsf(sign | ((exp + 112u) << 23) | (mant << 13));
}

static float dtr__load_f32(const void *src, dtr_dtype dt, size_t i) {
    switch (dt) {
    case DTR_F32: return ((const float *)src)[i];
    case DTR_BF16: return dtr_bf16_to_f32(((const uint16_t *)src)[i]);
    case DTR_F16: return dtr_f16_to_f32(((const uint16_t *)src)[i]);
    case DTR_I32: return (float)((const int32_t *)src)[i];
    case DTR_U8: return (float)((const uint8_t *)src)[i];
    }
    return 0.0f;
}

/* f32 <-> bf16 over arrays, branch-free so that compilers vectorize them (the rule of
 * dtr_f32_to_bf16: NaN stays a quiet NaN, the rest rounds to nearest even) */
static void dtr__f32_to_bf16_n(uint16_t *d, const float *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u = dtr__fbits(s[i]), nan = (u & 0x7fffffffu) > 0x7f800000u;
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, q = (u >> 16) | 0x40u;
        d[i] = (uint16_t)(nan ? q : r);
    }
}

static void dtr__bf16_to_f32_n(float *d, const uint16_t *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) d[i] = dtr__bitsf((uint32_t)s[i] << 16);
}

dtr_result dtr_convert(void *dst, dtr_dtype dst_dtype, const void *src, dtr_dtype src_dtype, size_t n) {
    size_t i;
    if (!dtr_dtype_size(dst_dtype) || !dtr_dtype_size(src_dtype)) return DTR_DTYPE_MISMATCH;
    if (n == 0) return DTR_OK; /* dst/src may be NULL: memcpy(NULL, NULL, 0) is undefined */
    if (!dst || !src) return DTR_NULL_HANDLE;
    if (dst_dtype == src_dtype) { memcpy(dst, src, n * dtr_dtype_size(dst_dtype)); return DTR_OK; }
    if (src_dtype == DTR_F32 && dst_dtype == DTR_BF16) { dtr__f32_to_bf16_n((uint16_t *)dst, (const float *)src, n); return DTR_OK; }
    if (src_dtype == DTR_BF16 && dst_dtype == DTR_F32) { dtr__bf16_to_f32_n((float *)dst, (const uint16_t *)src, n); return DTR_OK; }
    if (src_dtype == DTR_I32 && dst_dtype == DTR_U8) {
        for (i = 0; i < n; i++) ((uint8_t *)dst)[i] = (uint8_t)((const int32_t *)src)[i];
        return DTR_OK;
    }
    if (src_dtype == DTR_U8 && dst_dtype == DTR_I32) {
        for (i = 0; i < n; i++) ((int32_t *)dst)[i] = ((const uint8_t *)src)[i];
        return DTR_OK;
    }
    for (i = 0; i < n; i++) {
        float f = dtr__load_f32(src, src_dtype, i);
        switch (dst_dtype) {
        case DTR_F32: ((float *)dst)[i] = f; break;
        case DTR_BF16: ((uint16_t *)dst)[i] = dtr_f32_to_bf16(f); break;
        case DTR_F16: ((uint16_t *)dst)[i] = dtr_f32_to_f16(f); break;
        case DTR_I32: ((int32_t *)dst)[i] = (int32_t)f; break;
        case DTR_U8: ((uint8_t *)dst)[i] = (uint8_t)(f < 0 ? 0 : f > 255 ? 255 : f); break;
        }
    }
    return DTR_OK;
}
