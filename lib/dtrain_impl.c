/* lib/dtrain_impl.c: the one translation unit that compiles dtrain's CPU implementation
 * (from the single header) for libdtrain.a / libdtrain.so, the tests, examples and benches.
 * Built by the Makefile and by CMakeLists.txt; an application that copies dtrain.h into its
 * own tree does the same two lines in one of its files instead. */
/* POSIX 2008 before any system header: getaddrinfo (IPv6 host names) and clock_gettime in
 * the rendezvous store. */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
