/* tests/gpu/test_comm_gpu.c: tests/test_comm_devsim.c on the GPU (make test-gpu), the ranks
 * threads sharing it: device buffers of groups over the local transport staged through
 * page-locked host memory (cudaPointerGetAttributes telling them from host buffers), and the
 * stand-in for NCCL (the local transport taking device memory only) with the collectives'
 * scratch, copies and sums on the GPU, ZeRO, local SGD, the codecs, the tensor-parallel ops
 * and pipeline stages over it; models trained so against CPU ranks within 2e-3 (the GPU's
 * kernels sum in other orders), buffers of collectives bit for bit. Without a GPU it says
 * loudly that it skipped. */
#define COMM_CUDA
#include "../test_comm_devsim.c"
