/* lib/dtrain_impl.c: the one translation unit that compiles dtrain's CPU implementation
 * (from the single header) for libdtrain.a / libdtrain.so, the tests, examples and benches.
 * Built by the Makefile and by CMakeLists.txt; an application that copies dtrain.h into its
 * own tree does the same two lines in one of its files instead. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
