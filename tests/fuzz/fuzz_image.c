/* tests/fuzz/fuzz_image.c: libFuzzer target for image decoding (dtr_image_info and
 * dtr_image_decode: stb_image's PNG, JPEG, BMP and GIF decoders behind dtrain's checks, then
 * the resampler). The first byte picks the output channels and size, the rest is the file
 * (so the files of tests/fuzz/corpus/image/ are one option byte followed by an image;
 * jpeg_dht_over_256_codes.jpg is the input that found stb_image 2.27's Huffman overflow).
 * Any input must decode into finite values in [0, 1] or fail with a message; never crash,
 * leak or read out of bounds. Images are limited to 2^22 pixels here to keep the fuzzer's
 * memory small. Needs stb_image (libstb-dev); without it the target checks the
 * DTR_UNSUPPORTED path only. Linked with the implementation (lib/dtrain_impl.c, under the same
 * sanitizers):
 *     clang -g -O1 -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_image.c lib/dtrain_impl.c -lm -lpthread
 *     ./a.out -max_total_time=60 tests/fuzz/corpus/image */
#define DTR_IMAGE_MAX_PIXELS ((int64_t)1 << 22)
#if !defined(DTR_USE_STB_IMAGE) && defined(__has_include)
#if __has_include(<stb/stb_image.h>) || __has_include("stb_image.h")
#define DTR_USE_STB_IMAGE
#endif
#endif
#include "../../dtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static float out[3 * 40 * 40];
    char err[512];
    uint8_t opt = size ? data[0] : 0;
    int ch = (opt & 1) ? 3 : 1, w = 1 + ((opt >> 1) & 7) * 5, h = 1 + ((opt >> 4) & 7) * 5, iw, ih, ic, k;
    dtr_result r;
    if (size) { data++; size--; }
    r = dtr_image_info(data, size, &iw, &ih, &ic, err, sizeof err);
    if (r != DTR_OK && err[0] == '\0') __builtin_trap();
    r = dtr_image_decode(data, size, ch, w, h, out, NULL, err, sizeof err);
    if (r != DTR_OK) {
        if (err[0] == '\0') __builtin_trap();
        return 0;
    }
    for (k = 0; k < ch * w * h; k++)
        if (!(out[k] >= 0.0f && out[k] <= 1.0f + 1e-6f)) __builtin_trap();
    return 0;
}
