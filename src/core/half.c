/* ============================================================================
 * dtypes: sizes, names, and f32 <-> bf16 / f16 conversion (round to nearest even); the
 * largest value of an f32 array.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"
#include "formulas.h"

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

uint16_t dtr_f32_to_bf16(float x) { return dtr__f_to_bf16(x); }
float dtr_bf16_to_f32(uint16_t x) { return dtr__f_from_bf16(x); }
uint16_t dtr_f32_to_f16(float x) { return dtr__f_to_f16(x); }
float dtr_f16_to_f32(uint16_t h) { return dtr__f_from_f16(h); }

/* f32 <-> bf16 over arrays, branch-free so that compilers vectorize them (the rule of
 * dtr_f32_to_bf16: NaN stays a quiet NaN, the rest rounds to nearest even) */
static void dtr__f32_to_bf16_n(uint16_t *d, const float *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u = dtr__f_bits(s[i]), nan = (u & 0x7fffffffu) > 0x7f800000u;
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, q = (u >> 16) | 0x40u;
        d[i] = (uint16_t)(nan ? q : r);
    }
}

static void dtr__bf16_to_f32_n(float *d, const uint16_t *s, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) d[i] = dtr__f_from_bits((uint32_t)s[i] << 16);
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
    for (i = 0; i < n; i++) dtr__f_store(dst, dst_dtype, (int64_t)i, dtr__f_load(src, src_dtype, (int64_t)i));
    return DTR_OK;
}

float dtr__max_f32(const float *x, int64_t n, float init, int absval) {
    float m8[8], mx = init;
    int64_t k = 0;
    int i;
    for (i = 0; i < 8; i++) m8[i] = init;
    if (absval)
        for (; k + 8 <= n; k += 8)
            for (i = 0; i < 8; i++) m8[i] = fabsf(x[k + i]) > m8[i] ? fabsf(x[k + i]) : m8[i];
    else
        for (; k + 8 <= n; k += 8)
            for (i = 0; i < 8; i++) m8[i] = x[k + i] > m8[i] ? x[k + i] : m8[i];
    for (; k < n; k++) {
        float a = absval ? fabsf(x[k]) : x[k];
        mx = a > mx ? a : mx;
    }
    for (i = 0; i < 8; i++) mx = m8[i] > mx ? m8[i] : mx;
    return mx;
}
