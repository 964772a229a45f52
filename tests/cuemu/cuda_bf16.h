/* cuemu's bf16 type (see cuda_runtime.h): its bits, for wmma's operands in shared memory */
#ifndef CUEMU_CUDA_BF16_H
#define CUEMU_CUDA_BF16_H
#include "cuda_runtime.h"
struct __nv_bfloat16 { unsigned short bits; };
#endif
