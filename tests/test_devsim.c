/* tests/test_devsim.c: tests/gpu/test_train_gpu.c's checks (every optimizer, the loss
 * scaler, weights files, two data-parallel ranks) on the simulated device of tests/devsim.h:
 * the CPU kernels over memory the core may only reach through the backend, so a code path
 * that touches device memory directly fails here, on machines without a GPU. */
#define TRAIN_DEVSIM
#include "gpu/test_train_gpu.c"
