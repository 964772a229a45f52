/* ============================================================================
 * SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the rendezvous handshake.
 *
 * Plain, portable C: no tables beyond the 64 round constants, no SIMD, byte order handled
 * explicitly, so the result is the same on every machine. Speed does not matter here (a few
 * hashes per connection). Checked against the FIPS 180-4 examples and the RFC 4231 HMAC
 * vectors in tests/test_rendezvous.c.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DTR__SHA256_BYTES 32
#define DTR__SHA256_BLOCK 64

typedef struct dtr__sha256 {
    uint32_t h[8];
    uint64_t bytes;                  /* message length so far */
    uint8_t buf[DTR__SHA256_BLOCK];  /* partial block */
    size_t fill;
} dtr__sha256;

static void dtr__sha256_init(dtr__sha256 *s);
static void dtr__sha256_update(dtr__sha256 *s, const void *data, size_t n);
static void dtr__sha256_final(dtr__sha256 *s, uint8_t out[DTR__SHA256_BYTES]);
/** SHA-256 of one buffer. */
void dtr__sha256_once(const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]);

/** HMAC-SHA256 (RFC 2104), incremental: init with the key (any length), update, final. */
typedef struct dtr__hmac {
    dtr__sha256 inner, outer;
} dtr__hmac;
static void dtr__hmac_init(dtr__hmac *h, const void *key, size_t keylen);
static void dtr__hmac_update(dtr__hmac *h, const void *data, size_t n);
static void dtr__hmac_final(dtr__hmac *h, uint8_t out[DTR__SHA256_BYTES]);
/** HMAC-SHA256 of one buffer. */
void dtr__hmac_sha256(const void *key, size_t keylen, const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]);
/** 1 when the n bytes of a and b are equal; the time taken does not depend on where they differ. */
static int dtr__ct_equal(const void *a, const void *b, size_t n);

/* ---- SHA-256 ---- */

static const uint32_t dtr__sha256_k[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u
};

static uint32_t dtr__rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

/* One 64-byte block into the state. */
static void dtr__sha256_block(uint32_t h[8], const uint8_t *p) {
    uint32_t w[64], a, b, c, d, e, f, g, hh, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) | ((uint32_t)p[4 * i + 2] << 8) |
               (uint32_t)p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = dtr__rotr32(w[i - 15], 7) ^ dtr__rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = dtr__rotr32(w[i - 2], 17) ^ dtr__rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = h[0]; b = h[1]; c = h[2]; d = h[3]; e = h[4]; f = h[5]; g = h[6]; hh = h[7];
    for (i = 0; i < 64; i++) {
        uint32_t S1 = dtr__rotr32(e, 6) ^ dtr__rotr32(e, 11) ^ dtr__rotr32(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t S0 = dtr__rotr32(a, 2) ^ dtr__rotr32(a, 13) ^ dtr__rotr32(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        t1 = hh + S1 + ch + dtr__sha256_k[i] + w[i];
        t2 = S0 + maj;
        hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}

static void dtr__sha256_init(dtr__sha256 *s) {
    static const uint32_t iv[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(s->h, iv, sizeof iv);
    s->bytes = 0;
    s->fill = 0;
}

static void dtr__sha256_update(dtr__sha256 *s, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    s->bytes += n;
    if (s->fill) {
        size_t take = DTR__SHA256_BLOCK - s->fill;
        if (take > n) take = n;
        memcpy(s->buf + s->fill, p, take);
        s->fill += take; p += take; n -= take;
        if (s->fill < DTR__SHA256_BLOCK) return;
        dtr__sha256_block(s->h, s->buf);
        s->fill = 0;
    }
    while (n >= DTR__SHA256_BLOCK) {
        dtr__sha256_block(s->h, p);
        p += DTR__SHA256_BLOCK; n -= DTR__SHA256_BLOCK;
    }
    if (n) {
        memcpy(s->buf, p, n);
        s->fill = n;
    }
}

static void dtr__sha256_final(dtr__sha256 *s, uint8_t out[DTR__SHA256_BYTES]) {
    uint64_t bits = s->bytes * 8;
    int i;
    s->buf[s->fill++] = 0x80;
    if (s->fill > DTR__SHA256_BLOCK - 8) {
        memset(s->buf + s->fill, 0, DTR__SHA256_BLOCK - s->fill);
        dtr__sha256_block(s->h, s->buf);
        s->fill = 0;
    }
    memset(s->buf + s->fill, 0, DTR__SHA256_BLOCK - 8 - s->fill);
    for (i = 0; i < 8; i++) s->buf[DTR__SHA256_BLOCK - 1 - i] = (uint8_t)(bits >> (8 * i));
    dtr__sha256_block(s->h, s->buf);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
    memset(s, 0, sizeof *s);
}

void dtr__sha256_once(const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]) {
    dtr__sha256 s;
    dtr__sha256_init(&s);
    dtr__sha256_update(&s, data, n);
    dtr__sha256_final(&s, out);
}

/* ---- HMAC-SHA256: H((K ^ opad) || H((K ^ ipad) || m)) ---- */

static void dtr__hmac_init(dtr__hmac *h, const void *key, size_t keylen) {
    uint8_t k[DTR__SHA256_BLOCK], pad[DTR__SHA256_BLOCK];
    int i;
    memset(k, 0, sizeof k);
    if (keylen > DTR__SHA256_BLOCK) dtr__sha256_once(key, keylen, k);   /* long keys are hashed first */
    else if (keylen) memcpy(k, key, keylen);
    for (i = 0; i < DTR__SHA256_BLOCK; i++) pad[i] = (uint8_t)(k[i] ^ 0x36);
    dtr__sha256_init(&h->inner);
    dtr__sha256_update(&h->inner, pad, sizeof pad);
    for (i = 0; i < DTR__SHA256_BLOCK; i++) pad[i] = (uint8_t)(k[i] ^ 0x5c);
    dtr__sha256_init(&h->outer);
    dtr__sha256_update(&h->outer, pad, sizeof pad);
    memset(k, 0, sizeof k);
    memset(pad, 0, sizeof pad);
}

static void dtr__hmac_update(dtr__hmac *h, const void *data, size_t n) { dtr__sha256_update(&h->inner, data, n); }

static void dtr__hmac_final(dtr__hmac *h, uint8_t out[DTR__SHA256_BYTES]) {
    uint8_t ih[DTR__SHA256_BYTES];
    dtr__sha256_final(&h->inner, ih);
    dtr__sha256_update(&h->outer, ih, sizeof ih);
    dtr__sha256_final(&h->outer, out);
}

void dtr__hmac_sha256(const void *key, size_t keylen, const void *data, size_t n, uint8_t out[DTR__SHA256_BYTES]) {
    dtr__hmac h;
    dtr__hmac_init(&h, key, keylen);
    dtr__hmac_update(&h, data, n);
    dtr__hmac_final(&h, out);
}

static int dtr__ct_equal(const void *a, const void *b, size_t n) {
    const volatile uint8_t *x = (const volatile uint8_t *)a, *y = (const volatile uint8_t *)b;
    uint8_t d = 0;
    size_t i;
    for (i = 0; i < n; i++) d = (uint8_t)(d | (x[i] ^ y[i]));
    return d == 0;
}

#ifdef __cplusplus
}
#endif
