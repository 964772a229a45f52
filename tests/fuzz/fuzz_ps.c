/* tests/fuzz/fuzz_ps.c: libFuzzer target for the parameter server's message parser
 * (dtr__ps_parse, src/engine/ps.c). Input layout:
 *     byte 0        the sender's worker index (0..3) in bits 0-1, the server in bit 2
 *     byte 1        the server's range length in floats / 4 (the range starts at 16 * server)
 *                   (ROWS messages: segments of floats of that range, then the values)
 *     then          the bytes of the message as the server's receive buffer holds them
 * Checked: no crash or out-of-bounds read; a refusal says why; an accepted message is a
 * request of a known kind from the right worker whose announced size (header, payload,
 * trailer) fits the buffer, a push matches the server's range and has a gradient dtype
 * (f32, bf16, f16 or int8 blocks; its payload is then decoded as the server does, so every
 * byte of it is read), and the segments of a ROWS
 * message lie inside the range and sum to its value count.
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_ps.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/ps */
#define DTRAIN_IMPLEMENTATION
#include "../../dtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dtr__ps_expect e;
    dtr__ps_hdr h;
    char why[200];
    float out[1024];
    int from;
    size_t n;
    if (size < 2) return 0;
    from = data[0] & 3;
    e.server = (data[0] >> 2) & 1;
    e.workers = 4;
    e.begin = 16 * e.server;
    e.count = 4 * (int64_t)data[1];
    why[0] = 0;
    if (dtr__ps_parse(data + 2, size - 2, from, &e, &h, why, sizeof why) != DTR_OK) {
        if (!why[0]) __builtin_trap();
        return 0;
    }
    n = dtr__ps_message_bytes(&h);
    if (n == 0 || n > size - 2 || h.worker != from) __builtin_trap();
    if (h.kind == DTR__PS_REPLY || h.kind < DTR__PS_PUSH || h.kind > DTR__PS_PULL_ROWS) __builtin_trap();
    if (h.kind == DTR__PS_PUSH) {
        if (h.begin != e.begin || h.count != e.count ||
            (h.dtype != DTR_F32 && h.dtype != DTR_BF16 && h.dtype != DTR_F16 && h.dtype != DTR__PS_INT8))
            __builtin_trap();
        dtr__ps_decode(out, data + 2 + sizeof h, h.dtype, h.count);   /* as the server does (int8: blocks) */
    } else if (h.kind == DTR__PS_PUSH_ROWS || h.kind == DTR__PS_PULL_ROWS) {
        int64_t i, sum = 0, seg[2];
        for (i = 0; i < h.begin; i++) {   /* every segment inside the range, as the server will write them */
            memcpy(seg, data + 2 + sizeof h + (size_t)i * 16, 16);
            if (seg[1] < 1 || seg[0] < e.begin || seg[0] + seg[1] > e.begin + e.count) __builtin_trap();
            sum += seg[1];
        }
        if (sum != h.count || h.count > e.count) __builtin_trap();
    } else if (h.count != 0) {
        __builtin_trap();
    }
    return 0;
}
