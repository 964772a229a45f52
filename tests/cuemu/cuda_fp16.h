/* cuemu's fp16 type (see cuda_runtime.h): its bits, for wmma's operands in shared memory */
#ifndef CUEMU_CUDA_FP16_H
#define CUEMU_CUDA_FP16_H
#include "cuda_runtime.h"
#include <vector>
struct __half { unsigned short bits; };
/* f16 bits as a float, from a table (the compiler's _Float16 conversion is a library call on
   hosts without F16C: the emulator's hottest call before) */
inline float cuemu_half_to_float(unsigned short bits) {
    static const std::vector<float> table = [] {
        std::vector<float> t(65536);
        for (unsigned u = 0; u < 65536; u++) {
            _Float16 h;
            unsigned short b = (unsigned short)u;
            memcpy(&h, &b, 2);
            t[u] = (float)h;
        }
        return t;
    }();
    return table[bits];
}
#endif
