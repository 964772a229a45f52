/* cuemu's fp16 type (see cuda_runtime.h): its bits, for wmma's operands in shared memory */
#ifndef CUEMU_CUDA_FP16_H
#define CUEMU_CUDA_FP16_H
#include "cuda_runtime.h"
struct __half { unsigned short bits; };
#endif
