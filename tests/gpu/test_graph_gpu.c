/* tests/gpu/test_graph_gpu.c: tests/test_graph.c on the GPU (make test-gpu), where a launch
 * replays a CUDA graph (dtr_graph_native 1): the MLP and the small GPT trained by capture and
 * replays within 1e-5 of the eager twin on the same GPU, host values copied in during the
 * capture replayed from the device, every refusal, inputs and dtr_context_reset. Without a GPU
 * it says loudly that it skipped. */
#define GRAPH_CUDA
#include "../test_graph.c"
