/* ============================================================================
 * CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every tensor in the
 * files dtrain writes (weights and checkpoints) and of checkpoint files in their manifest.
 * Slicing by 8: eight 256-entry tables built once on first use (a spin on an atomic flag,
 * so threads that race to the first call all see complete tables). 2-3 GB/s on one core.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

#define DTR__CRC32C_POLY 0x82F63B78u

static uint32_t dtr__crc_table[8][256];
static int dtr__crc_state;   /* 0: not built, 1: being built, 2: ready */

static void dtr__crc_build(void) {
    uint32_t i, k, c;
    for (i = 0; i < 256; i++) {
        c = i;
        for (k = 0; k < 8; k++) c = (c >> 1) ^ ((c & 1u) ? DTR__CRC32C_POLY : 0u);
        dtr__crc_table[0][i] = c;
    }
    for (i = 0; i < 256; i++) {
        c = dtr__crc_table[0][i];
        for (k = 1; k < 8; k++) {
            c = dtr__crc_table[0][c & 0xFFu] ^ (c >> 8);
            dtr__crc_table[k][i] = c;
        }
    }
}

static void dtr__crc_ready(void) {
#if DTR__HAVE_ATOMICS
    int expected = 0;
    if (DTR__ATOMIC_LOAD(&dtr__crc_state) == 2) return;
    if (DTR__ATOMIC_CAS(&dtr__crc_state, &expected, 1)) {
        dtr__crc_build();
        DTR__ATOMIC_STORE(&dtr__crc_state, 2);
        return;
    }
    while (DTR__ATOMIC_LOAD(&dtr__crc_state) != 2) { /* another thread is building them */ }
#else
    if (!dtr__crc_state) { dtr__crc_build(); dtr__crc_state = 2; }   /* no atomics: build before threads */
#endif
}

/** CRC-32C of `n` bytes, continuing from `crc` (0 to start; pass the previous result to
 *  checksum data in pieces). See api.h. */
uint32_t dtr_crc32c(uint32_t crc, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    const uint32_t (*t)[256] = (const uint32_t (*)[256])dtr__crc_table;
    uint32_t c = ~crc;
    if (!p) return crc;
    dtr__crc_ready();
    for (; n && ((uintptr_t)p & 7u); n--) c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
            t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
    }
    for (; n; n--) c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    return ~c;
}
