/* tests/test_tp_devsim.c: tests/test_tensor_parallel.c with every tensor-parallel rank's
 * context on the simulated device of tests/devsim.h (the single-device reference stays on
 * the CPU): the communication ops run on host images of device tensors, as on a GPU, and a
 * code path of the tensor-parallel layers that touches device memory directly dies here. */
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS (tests/devsim.h) */
#define DTRAIN_INTERNAL_API
#define TP_DEVSIM
#include "test_tensor_parallel.c"
