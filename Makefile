# Makefile for dtrain (GNU make). `make help` lists the targets.
#
# dtrain ships as three generated files (dtrain.h, dtrain_cuda.cu, dtrain_comm.c; see
# ./amalgamate). This Makefile builds the CPU library from dtrain.h, the tests, examples and
# benchmarks, the two optional units, and installs everything with a pkg-config file and a
# CMake package. Variables can be set on the command line: `make OPT=-O3 ARCH= test`.

# ---- configuration -----------------------------------------------------------------------

CC      ?= cc
CXX     ?= c++
AR      ?= ar
CLANG   ?= clang
OPT     ?= -O2
# Builds are portable by default: the GEMM picks its AVX-512 / AVX2 kernels at run time, so
# the library and the programs run on any x86-64 (or other) CPU of the target. ARCH=-march=native
# tunes everything for this machine's CPU (opt-in: such a build, installed or copied, can die
# with SIGILL on an older CPU; never use it for packages or shared installs).
ARCH    ?=
# Warnings are errors on our own sources; WERROR= turns that off (e.g. a newer compiler).
WERROR  ?= -Werror
# Extra compiler flags (sanitizers etc.); test-sanitize sets it.
SANITIZE ?=
EXTRA_CFLAGS ?=
# Output folder; test-sanitize uses build-asan.
BUILD   ?= build
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)

# Install layout (DESTDIR is honoured by install and uninstall).
PREFIX     ?= /usr/local
INCLUDEDIR ?= $(PREFIX)/include
LIBDIR     ?= $(PREFIX)/lib
DATADIR    ?= $(PREFIX)/share
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
CMAKEDIR   ?= $(LIBDIR)/cmake/dtrain

# Optional features, detected unless set on the command line (1 = on, 0 = off).
#   USE_ZLIB   gzip-compressed IDX files (zlib1g-dev): defines DTR_USE_ZLIB, links -lz
#   USE_CBLAS  GEMM through cblas_sgemm: defines DTR_USE_CBLAS, links $(BLAS_LIBS) (off by default)
#   USE_FABRIC dtrain_comm.c with libfabric (pkg-config libfabric): defines DTR_USE_LIBFABRIC
#   USE_NCCL   dtrain_comm.c with NCCL (nccl.h found): defines DTR_USE_NCCL
#   USE_CUDA   install builds and installs libdtrain_cuda from dtrain_cuda.cu (nvcc found)
HASH := \#
probe_header = $(shell printf '$(HASH)include <$(1)>\n' | $(CC) -E -x c $(2) - >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(origin USE_ZLIB),undefined)
USE_ZLIB := $(call probe_header,zlib.h)
endif
#   USE_STB_IMAGE image decoding (libstb-dev: stb/stb_image.h): defines DTR_USE_STB_IMAGE (no library)
ifeq ($(origin USE_STB_IMAGE),undefined)
USE_STB_IMAGE := $(call probe_header,stb/stb_image.h)
endif
USE_CBLAS ?= 0
BLAS_LIBS ?= -lopenblas
ifeq ($(origin USE_FABRIC),undefined)
USE_FABRIC := $(shell pkg-config --exists libfabric 2>/dev/null && echo 1 || echo 0)
endif
CUDA_HOME ?= /usr/local/cuda
ifeq ($(origin USE_NCCL),undefined)
USE_NCCL := $(call probe_header,nccl.h,-I$(CUDA_HOME)/include)
endif
ifeq ($(origin NVCC),undefined)
NVCC := $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
endif
USE_CUDA ?= $(if $(NVCC),1,0)
# OpenBLAS is the reference peer of bench/gemm; without it that benchmark is left out.
HAVE_OPENBLAS := $(if $(and $(filter 1,$(call probe_header,cblas.h)),$(filter /%,$(shell $(CC) -print-file-name=libopenblas.so))),1,0)
# Open MPI is the peer of bench/allreduce: bench/allreduce_mpi.c is built with MPICC when it exists.
MPICC ?= mpicc
HAVE_MPICC := $(if $(shell command -v $(MPICC) 2>/dev/null),1,0)

DEFS   :=
LDLIBS := -lm -lpthread
ifeq ($(USE_ZLIB),1)
DEFS   += -DDTR_USE_ZLIB
LDLIBS := -lz $(LDLIBS)
endif
ifeq ($(USE_STB_IMAGE),1)
DEFS   += -DDTR_USE_STB_IMAGE
endif
ifeq ($(USE_CBLAS),1)
DEFS   += -DDTR_USE_CBLAS
LDLIBS := $(BLAS_LIBS) $(LDLIBS)
endif

# CFLAGS is the whole compile line (the environment's CFLAGS is ignored; use EXTRA_CFLAGS).
CFLAGS = -std=c99 -Wall -Wextra $(WERROR) -pthread -I. $(OPT) $(ARCH) $(SANITIZE) $(DEFS) $(EXTRA_CFLAGS)

# CUDA: real code for sm_80 (A100) and sm_90 (H100/H200), plus PTX for newer GPUs to JIT.
NVCC_ARCH  ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
              -gencode arch=compute_90,code=compute_90
NVCC_WERROR ?= $(if $(WERROR),-Werror all-warnings -Xcompiler -Werror)
# --threads 0: the architectures compiled side by side (the unit's compile is a serial step of
# check: 95 s -> 52 s on 2 cores)
NVCCFLAGS  ?= -std=c++17 -O2 --threads 0 $(NVCC_ARCH) -I. -Xcompiler -Wall,-Wextra,-pthread,-fPIC $(NVCC_WERROR) $(DEFS)

FABRIC_CFLAGS := $(if $(filter 1,$(USE_FABRIC)),-DDTR_USE_LIBFABRIC $(shell pkg-config --cflags libfabric 2>/dev/null))
FABRIC_LIBS   := $(if $(filter 1,$(USE_FABRIC)),$(shell pkg-config --libs libfabric 2>/dev/null))
# NCCL and the CUDA runtime it needs: the libraries of build/dtrain_comm_nccl.o (below).
NCCL_LIBS     := $(if $(filter 1,$(USE_NCCL)),-L$(CUDA_HOME)/lib64 -lnccl -lcudart)
COMM_LIBS     := $(FABRIC_LIBS)
NCCL_CFLAGS   := $(if $(filter 1,$(USE_NCCL)),-DDTR_USE_NCCL -I$(CUDA_HOME)/include)

# Fuzzing: clang with libFuzzer (libclang-rt-*-dev), built against dtrain.h.
FUZZ_SECONDS ?= 30
FUZZ_CFLAGS  ?= -std=c99 -g -O1 -Wall -Wextra $(WERROR) -pthread -I. $(DEFS)

# Version, from the generated header (src/public/api.h before the first ./amalgamate).
VERSION := $(shell sed -n 's/^$(HASH)define DTR_VERSION_STRING "\(.*\)"/\1/p' dtrain.h 2>/dev/null || \
                   sed -n 's/^$(HASH)define DTR_VERSION_STRING "\(.*\)"/\1/p' src/public/api.h)
VERSION_MAJOR := $(word 1,$(subst ., ,$(VERSION)))
VERSION_MINOR := $(word 2,$(subst ., ,$(VERSION)))
# While the major version is 0 every minor release may break the ABI.
SOVERSION := $(if $(filter 0,$(VERSION_MAJOR)),0.$(VERSION_MINOR),$(VERSION_MAJOR))

# The test data (Fashion-MNIST), handed to the demo and the tests as DTR_FMNIST_DIR.
ifeq ($(origin DTR_FMNIST_DIR),undefined)
DTR_FMNIST_DIR := $(shell scripts/fetch-fmnist.sh --find 2>/dev/null)
endif
export DTR_FMNIST_DIR

# ---- what gets built ---------------------------------------------------------------------

# The generated files follow src/: editing a source and running make regenerates them
# (./amalgamate rewrites only the files whose content changed; the touch records that they
# are current). Commit them with the change: CI's `./amalgamate --check` fails on drift.
GENERATED := dtrain.h dtrain_cuda.cu dtrain_comm.c
SOURCES   := $(shell find src -type f 2>/dev/null) amalgamate
$(GENERATED) &: $(SOURCES)
	./amalgamate
	@touch $(GENERATED)

IMPL_OBJ := $(BUILD)/dtrain_impl.o
LIBA     := $(BUILD)/libdtrain.a
LIBSO    := $(BUILD)/libdtrain.so
CUDA_OBJ := $(BUILD)/dtrain_cuda.o
COMM_OBJ := $(BUILD)/dtrain_comm.o
COMM_NCCL_OBJ := $(BUILD)/dtrain_comm_nccl.o
# The optional units as libraries (installed beside libdtrain when their feature is built):
# libdtrain_comm (dtrain_comm.c: the libfabric transport) and libdtrain_cuda (dtrain_cuda.cu).
COMM_LIBA  := $(BUILD)/libdtrain_comm.a
COMM_LIBSO := $(BUILD)/libdtrain_comm.so
CUDA_LIBA  := $(BUILD)/libdtrain_cuda.a
CUDA_LIBSO := $(BUILD)/libdtrain_cuda.so
DTRUN    := $(BUILD)/dtrun

# Every tests/test_*.c, examples/*.c and bench/*.c is a program: new files need no edit here.
TESTS    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c))
EXAMPLES := $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))
BENCHES  := $(patsubst bench/%.c,$(BUILD)/bench/%,$(filter-out bench/allreduce_mpi.c bench/gpu.c bench/gpu_gemm.c bench/gpu_attention.c,$(wildcard bench/*.c)))
ifneq ($(HAVE_OPENBLAS),1)
BENCHES  := $(filter-out $(BUILD)/bench/gemm,$(BENCHES))
endif
ifeq ($(HAVE_MPICC),1)
BENCHES  += $(BUILD)/bench/allreduce_mpi
endif
FUZZERS  := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(wildcard tests/fuzz/fuzz_*.c))

# Per-program extras. A program links every .o among its prerequisites, so a program that
# needs a unit adds it as a prerequisite, and libraries go in its EXTRA_LIBS, e.g.
#   $(BUILD)/bench/allreduce: $(COMM_OBJ)
#   $(BUILD)/bench/allreduce: EXTRA_LIBS += $(COMM_LIBS)
EXTRA_LIBS :=
$(BUILD)/bench/gemm: EXTRA_LIBS += -lopenblas
# tests/test_fabric: the libfabric transport across processes (without libfabric it still
# builds, against dtrain_comm.c's stubs, and says loudly that it skipped).
$(BUILD)/tests/test_fabric: $(COMM_OBJ)
$(BUILD)/tests/test_fabric: EXTRA_LIBS += $(COMM_LIBS)
# tests/test_nccl: the NCCL transport's watchdog logic, and its open without a GPU.
$(BUILD)/tests/test_nccl: $(if $(filter 1,$(USE_NCCL)),$(COMM_NCCL_OBJ),$(COMM_OBJ))
$(BUILD)/tests/test_nccl: EXTRA_LIBS += $(COMM_LIBS) $(NCCL_LIBS)
# tests/test_ckpt: one case resumes ranks that are processes over libfabric.
$(BUILD)/tests/test_ckpt: $(COMM_OBJ)
$(BUILD)/tests/test_ckpt: EXTRA_LIBS += $(COMM_LIBS)
# tests/test_elastic: restarts under dtrun, its ranks over libfabric.
$(BUILD)/tests/test_elastic: $(COMM_OBJ)
$(BUILD)/tests/test_elastic: EXTRA_LIBS += $(COMM_LIBS)
# The programs that take --transport libfabric (under dtrun) link dtrain_comm.c's object.
COMM_PROGRAMS := $(BUILD)/bench/fmnist_dp $(BUILD)/examples/fmnist_dp $(BUILD)/bench/pipeline $(BUILD)/examples/gpt \
                 $(BUILD)/bench/restart $(BUILD)/examples/fmnist_ps $(BUILD)/bench/ps
$(COMM_PROGRAMS): $(COMM_OBJ)
$(COMM_PROGRAMS): EXTRA_LIBS += $(COMM_LIBS)
$(BUILD)/bench/allreduce: $(COMM_OBJ)
$(BUILD)/bench/allreduce: EXTRA_LIBS += $(COMM_LIBS)

# A change of compiler or flags rebuilds everything built with them.
FLAGS_ID    := $(strip $(CC) $(CFLAGS) $(LDLIBS) | $(NVCC) $(NVCCFLAGS) $(FABRIC_CFLAGS) $(NCCL_CFLAGS))
FLAGS_STAMP := $(BUILD)/.flags
ifneq ($(FLAGS_ID),$(shell cat $(FLAGS_STAMP) 2>/dev/null))
$(shell mkdir -p $(BUILD) && echo '$(FLAGS_ID)' > $(FLAGS_STAMP))
endif

.PHONY: examples-gpu test-cuemu
.PHONY: all lib tests examples bench bench-allreduce cuda cuda-check comm test check deps bench-deps demo comm-lib cuda-lib api-doc api-doc-check private-check \
        demo-run header-check header-only readme-check test-sanitize fuzz fuzz-build fuzz-smoke \
        fuzz-smoke-if-available cmake-consumer install uninstall clean help test-compress-full test-elastic-full soak \
        test-arm64 test-arm64-if-available test-tsan
.DEFAULT_GOAL := all

# all: the library, every test, example and benchmark.
all: lib tests examples bench

# lib: build/libdtrain.a and build/libdtrain.so (the CPU implementation from dtrain.h).
lib: $(LIBA) $(LIBSO)

# tests, examples, bench: the programs of each folder.
tests: $(TESTS)
examples: $(EXAMPLES)
bench: $(BENCHES)
ifneq ($(HAVE_OPENBLAS),1)
	@test ! -f bench/gemm.c || echo "*** OpenBLAS (libopenblas-dev) not found: bench/gemm SKIPPED ***"
endif
ifneq ($(HAVE_MPICC),1)
	@echo "*** $(MPICC) (libopenmpi-dev) not found: bench/allreduce_mpi SKIPPED ***"
endif

# The implementation object: lib/dtrain_impl.c is `#define DTRAIN_IMPLEMENTATION` +
# `#include "dtrain.h"`. Compiled -fPIC once and used by both libraries.
$(IMPL_OBJ): lib/dtrain_impl.c dtrain.h $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -fPIC -c $< -o $@

$(LIBA): $(IMPL_OBJ)
	rm -f $@
	$(AR) rcs $@ $^

$(LIBSO): $(IMPL_OBJ)
	$(CC) $(CFLAGS) -shared -Wl,-soname,libdtrain.so.$(SOVERSION) -Wl,--no-undefined -o $@ $^ $(LDLIBS)

# Programs: one .c each, linked with libdtrain.a (plus any .o prerequisite and EXTRA_LIBS).
$(BUILD)/tests/%: tests/%.c tests/test.h $(LIBA) $(FLAGS_STAMP)
	@mkdir -p $(@D)/.deps
	$(CC) $(CFLAGS) -MMD -MP -MF $(@D)/.deps/$(@F).d -o $@ $< $(filter %.o,$^) $(LIBA) $(EXTRA_LIBS) $(LDLIBS)

$(BUILD)/examples/%: examples/%.c $(LIBA) $(FLAGS_STAMP)
	@mkdir -p $(@D)/.deps
	$(CC) $(CFLAGS) -MMD -MP -MF $(@D)/.deps/$(@F).d -o $@ $< $(filter %.o,$^) $(LIBA) $(EXTRA_LIBS) $(LDLIBS)

$(BUILD)/bench/%: bench/%.c $(LIBA) $(FLAGS_STAMP)
	@mkdir -p $(@D)/.deps
	$(CC) $(CFLAGS) -MMD -MP -MF $(@D)/.deps/$(@F).d -o $@ $< $(filter %.o,$^) $(LIBA) $(EXTRA_LIBS) $(LDLIBS)

# bench/allreduce_mpi.c uses MPI only (no dtrain): mpicc, the same flags.
$(BUILD)/bench/allreduce_mpi: bench/allreduce_mpi.c $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(MPICC) $(CFLAGS) -o $@ $< -lm

# Header dependencies found by the compiler (-MMD), kept out of the way of tests/run.sh's glob.
-include $(wildcard $(BUILD)/*/.deps/*.d)

# cuda: build/dtrain_cuda.o with nvcc for sm_80 and sm_90 (no GPU needed to compile).
cuda: $(CUDA_OBJ)
$(CUDA_OBJ): dtrain_cuda.cu dtrain.h $(FLAGS_STAMP)
	@test -n "$(NVCC)" || { echo "make cuda: nvcc not found (PATH, $(CUDA_HOME)/bin); set NVCC=" >&2; exit 1; }
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

# The CUDA runtime and cuBLAS, for programs linked with dtrain_cuda.o.
CUDA_LDLIBS := -L$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++

# test-gpu: tests/test_grad.c linked with dtrain_cuda.o: every op case, forward and backward,
# on the GPU against the CPU (cases whose op has no CUDA kernel yet are listed as SKIPPED).
# Without a GPU it says loudly that it skipped. The program is built by cuda-check (so CI
# compiles and links the CUDA unit) and run here.
GPU_TESTS := $(BUILD)/tests/gpu/test_grad_gpu $(BUILD)/tests/gpu/test_train_gpu $(BUILD)/tests/gpu/test_tp_gpu \
             $(BUILD)/tests/gpu/test_comm_gpu $(BUILD)/tests/gpu/test_graph_gpu $(BUILD)/tests/gpu/test_cuemu
test-gpu: $(GPU_TESTS)
	tests/run.sh $(GPU_TESTS)
$(BUILD)/tests/gpu/test_grad_gpu: tests/test_grad.c $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -DDTR_TEST_CUDA -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
# tests/test_tensor_parallel.c with the tensor-parallel ranks on the GPU (threads sharing it).
$(BUILD)/tests/gpu/test_tp_gpu: tests/test_tensor_parallel.c tests/test.h $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -D_DEFAULT_SOURCE -DDTRAIN_INTERNAL_API -DTP_CUDA -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
# tests/gpu/test_comm_gpu.c: tests/test_comm_devsim.c (device-memory groups) on the GPU.
$(BUILD)/tests/gpu/test_comm_gpu: tests/gpu/test_comm_gpu.c tests/test_comm_devsim.c tests/staged_coll.h tests/test.h $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
# tests/gpu/test_graph_gpu.c: tests/test_graph.c (captured steps) replaying CUDA graphs.
$(BUILD)/tests/gpu/test_graph_gpu: tests/gpu/test_graph_gpu.c tests/test_graph.c tests/test.h $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
# tests/cuemu/test_cuemu.cu on the device: the semantics the CPU executor of test-cuemu assumes.
$(BUILD)/tests/gpu/test_cuemu: tests/cuemu/test_cuemu.cu $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -o $@ $< -lcublas
# tests/gpu/test_train_gpu.c: optimizers, the loss scaler and weights files on the GPU against the CPU.
$(BUILD)/tests/gpu/test_train_gpu: tests/gpu/test_train_gpu.c tests/test.h $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)

# test-cuemu: the GPU test programs with their CUDA kernels run on the CPU (tests/cuemu: the
# CUDA runtime and cuBLAS stood in for by a fiber-per-thread executor and reference products;
# dtrain_cuda.cu compiled by the host C++ compiler after tests/cuemu/launch.pl rewrote its
# launches). No GPU or CUDA toolkit needed; never a substitute for test-gpu on a device, which
# runs tests/cuemu/test_cuemu.cu too (the executor's assumptions, checked by the hardware).
# `check` runs them with the unit tests (about 40 s), and the kernel tests again under the
# reversed schedule (EMU_REVERSED, about 40 s).
EMU_DIR      := $(BUILD)/cuemu
EMU_OBJ      := $(EMU_DIR)/dtrain_cuda_emu.o $(EMU_DIR)/cuemu.o
EMU_CXXFLAGS  = -std=c++17 -Wall -Wextra $(WERROR) -pthread -ffp-contract=off -Itests/cuemu -I. $(OPT) $(SANITIZE) $(DEFS)
EMU_LIBS     := -lstdc++
EMU_TESTS    := $(EMU_DIR)/test_cuemu $(EMU_DIR)/test_grad_emu $(EMU_DIR)/test_train_emu $(EMU_DIR)/test_graph_emu $(EMU_DIR)/test_tp_emu \
                $(EMU_DIR)/test_comm_emu
# the kernel tests again under the reversed schedule (each warp alone up to a block barrier,
# last to first; tests/cuemu/cuemu.cpp): a missing __syncthreads or __syncwarp changes results.
# Quick (DTR_TEST_QUICK=1: test_grad's large device cases in f32 only; its small cases keep
# every kind of operand, so every kernel template still runs reversed)
EMU_REVERSED := $(EMU_DIR)/test_grad_emu_reversed $(EMU_DIR)/test_train_emu_reversed $(EMU_DIR)/test_graph_emu_reversed \
                $(EMU_DIR)/test_tp_emu_reversed $(EMU_DIR)/test_comm_emu_reversed $(EMU_DIR)/test_cuemu_reversed
$(EMU_DIR)/%_reversed: $(EMU_DIR)/%
	printf '#!/bin/sh\n# %s with CUEMU_SCHEDULE=reverse, quick (made by the Makefile)\nCUEMU_SCHEDULE=reverse DTR_TEST_QUICK=1 exec "$$(dirname "$$0")/%s" "$$@"\n' $* $* > $@
	chmod +x $@
$(EMU_DIR)/dtrain_cuda_emu.cpp: dtrain_cuda.cu tests/cuemu/launch.pl
	@mkdir -p $(@D)
	perl tests/cuemu/launch.pl $< > $@
$(EMU_DIR)/dtrain_cuda_emu.o: $(EMU_DIR)/dtrain_cuda_emu.cpp dtrain.h tests/cuemu/cuda_runtime.h tests/cuemu/cublas_v2.h tests/cuemu/cuda.h tests/cuemu/mma.h tests/cuemu/cuda_fp16.h $(FLAGS_STAMP)
	$(CXX) $(EMU_CXXFLAGS) -c $< -o $@
$(EMU_DIR)/cuemu.o: tests/cuemu/cuemu.cpp tests/cuemu/cuda_runtime.h tests/cuemu/cublas_v2.h tests/cuemu/cuda.h tests/cuemu/cuda_fp16.h $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(EMU_CXXFLAGS) -c $< -o $@
$(EMU_DIR)/test_cuemu: tests/cuemu/test_cuemu.cu $(EMU_DIR)/cuemu.o tests/cuemu/launch.pl tests/cuemu/mma.h
	perl tests/cuemu/launch.pl $< > $@.cpp
	$(CXX) $(EMU_CXXFLAGS) -o $@ $@.cpp $(EMU_DIR)/cuemu.o
$(EMU_DIR)/test_grad_emu: tests/test_grad.c $(EMU_OBJ) $(LIBA)
	$(CC) $(CFLAGS) -DDTR_TEST_CUDA -o $@ $< $(EMU_OBJ) $(LIBA) $(EMU_LIBS) $(LDLIBS)
$(EMU_DIR)/test_tp_emu: tests/test_tensor_parallel.c tests/test.h $(EMU_OBJ) $(LIBA)
	$(CC) $(CFLAGS) -D_DEFAULT_SOURCE -DDTRAIN_INTERNAL_API -DTP_CUDA -o $@ $< $(EMU_OBJ) $(LIBA) $(EMU_LIBS) $(LDLIBS)
$(EMU_DIR)/test_comm_emu: tests/gpu/test_comm_gpu.c tests/test_comm_devsim.c tests/staged_coll.h tests/test.h $(EMU_OBJ) $(LIBA)
	$(CC) $(CFLAGS) -o $@ $< $(EMU_OBJ) $(LIBA) $(EMU_LIBS) $(LDLIBS)
$(EMU_DIR)/test_graph_emu: tests/gpu/test_graph_gpu.c tests/test_graph.c tests/test.h $(EMU_OBJ) $(LIBA)
	$(CC) $(CFLAGS) -o $@ $< $(EMU_OBJ) $(LIBA) $(EMU_LIBS) $(LDLIBS)
$(EMU_DIR)/test_train_emu: tests/gpu/test_train_gpu.c tests/test.h $(EMU_OBJ) $(LIBA)
	$(CC) $(CFLAGS) -o $@ $< $(EMU_OBJ) $(LIBA) $(EMU_LIBS) $(LDLIBS)
test-cuemu: $(EMU_TESTS) $(EMU_REVERSED)
	tests/run.sh $(EMU_TESTS) $(EMU_REVERSED)

# bench-gpu: bench/gpu.c (MLP, CNN, a small GPT and GPT-2 small's shape; JSON lines) on the
# GPU, then bench/gpu_torch.py, PyTorch's eager and compiled runs of the same models, when
# torch with CUDA is there. BENCH_ARGS are passed to both.
$(BUILD)/bench/gpu: bench/gpu.c $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
# bench/gpu_gemm.c: the GPTs' linear layers (forward; forward and backward) beside
# bench/gpu_gemm_torch.py (F.linear on the same shapes).
$(BUILD)/bench/gpu_gemm: bench/gpu_gemm.c $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
# bench/gpu_attention.c: the GPTs' causal attention (fused kernels with --bf16) beside
# bench/gpu_attention_torch.py (scaled_dot_product_attention on the same shapes).
$(BUILD)/bench/gpu_attention: bench/gpu_attention.c $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
# bench/generate.c with CUDA (-DGEN_CUDA): generation through a KV cache on the GPU, beside
# bench/generate_torch.py --backend cuda.
$(BUILD)/bench/gpu_generate: bench/generate.c $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -DGEN_CUDA -o $@ $< $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(LDLIBS)
bench-gpu: $(BUILD)/bench/gpu $(BUILD)/bench/gpu_gemm $(BUILD)/bench/gpu_attention $(BUILD)/bench/gpu_generate
	$(BUILD)/bench/gpu $(BENCH_ARGS)
	-python3 bench/gpu_torch.py $(BENCH_ARGS)
	$(BUILD)/bench/gpu_gemm
	-python3 bench/gpu_gemm_torch.py
	$(BUILD)/bench/gpu_attention --bf16
	-python3 bench/gpu_attention_torch.py --bf16
	$(BUILD)/bench/gpu_generate --backend cuda
	-python3 bench/generate_torch.py --backend cuda

# examples-gpu: the Fashion-MNIST MLP and CNN linked with dtrain_cuda.o; --gpu trains on the GPU.
# fmnist_dp's ranks too (with dtrain_comm.o: --transport libfabric under dtrun).
GPU_EXAMPLES := $(BUILD)/examples/gpu/fmnist_mlp $(BUILD)/examples/gpu/fmnist_cnn $(BUILD)/examples/gpu/fmnist_dp \
                $(BUILD)/examples/gpu/fmnist_ps
examples-gpu: $(GPU_EXAMPLES)
$(BUILD)/examples/gpu/%: examples/%.c examples/common.h $(CUDA_OBJ) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) $(FABRIC_CFLAGS) -DFM_CUDA -o $@ $< $(EXTRA_OBJ) $(CUDA_OBJ) $(LIBA) $(CUDA_LDLIBS) $(EXTRA_LIBS) $(LDLIBS)
$(BUILD)/examples/gpu/fmnist_dp: $(COMM_OBJ)
$(BUILD)/examples/gpu/fmnist_dp: EXTRA_OBJ = $(COMM_OBJ)
$(BUILD)/examples/gpu/fmnist_dp: EXTRA_LIBS += $(COMM_LIBS)
$(BUILD)/examples/gpu/fmnist_ps: $(COMM_OBJ)
$(BUILD)/examples/gpu/fmnist_ps: EXTRA_OBJ = $(COMM_OBJ)
$(BUILD)/examples/gpu/fmnist_ps: EXTRA_LIBS += $(COMM_LIBS)

# cuda-check: `make cuda` and the GPU test program linked when nvcc exists, a loud notice when
# it does not (used by check).
cuda-check:
ifneq ($(NVCC),)
	@$(MAKE) --no-print-directory cuda $(GPU_TESTS) $(BUILD)/bench/gpu $(BUILD)/bench/gpu_gemm $(BUILD)/bench/gpu_attention \
	    $(BUILD)/bench/gpu_generate $(GPU_EXAMPLES)
else
	@echo "*****************************************************************"
	@echo "*** nvcc NOT FOUND: dtrain_cuda.cu was NOT compiled.           ***"
	@echo "*** Install the CUDA toolkit (or set NVCC=) to check it.       ***"
	@echo "*****************************************************************"
endif

# comm: build/dtrain_comm.o (with libfabric when pkg-config finds it) and, when nccl.h is
# there, build/dtrain_comm_nccl.o: the same unit with the NCCL transport (DTR_USE_NCCL), for
# programs that link -lnccl -lcudart (tests/test_nccl; an app's GPU build). The default object
# leaves NCCL out, so processes that do not use NCCL do not load it (loading it made the
# start-up message loss that the libfabric transport's first contact now prevents far more
# frequent: docs/distributed.md).
comm: $(COMM_OBJ) $(if $(filter 1,$(USE_NCCL)),$(COMM_NCCL_OBJ))
$(COMM_OBJ): dtrain_comm.c dtrain.h $(FLAGS_STAMP)
	@mkdir -p $(@D)
	@test "$(USE_FABRIC)" = 1 || echo "*** libfabric not found (pkg-config libfabric): dtrain_comm.c built WITHOUT it ***"
	$(CC) $(CFLAGS) -fPIC $(FABRIC_CFLAGS) -c $< -o $@
$(COMM_NCCL_OBJ): dtrain_comm.c dtrain.h $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -fPIC $(FABRIC_CFLAGS) $(NCCL_CFLAGS) -c $< -o $@

# comm-lib, cuda-lib: the optional units as libraries, each linked against libdtrain.so
# (build/libdtrain_comm.{a,so} needs libfabric; build/libdtrain_cuda.{a,so} needs nvcc; the
# shared one carries the CUDA runtime statically, so it needs only the driver at run time).
comm-lib: $(COMM_LIBA) $(COMM_LIBSO)
cuda-lib: $(CUDA_LIBA) $(CUDA_LIBSO)
$(COMM_LIBA): $(COMM_OBJ)
$(CUDA_LIBA): $(CUDA_OBJ)
$(COMM_LIBA) $(CUDA_LIBA):
	rm -f $@
	$(AR) rcs $@ $^

$(COMM_LIBSO): $(COMM_OBJ) $(LIBSO)
	$(CC) $(CFLAGS) -shared -Wl,-soname,libdtrain_comm.so.$(SOVERSION) -Wl,--no-undefined -o $@ $< \
	    -L$(BUILD) -ldtrain $(COMM_LIBS) $(LDLIBS)

$(CUDA_LIBSO): $(CUDA_OBJ) $(LIBSO)
	$(NVCC) -shared -cudart static -Xlinker -soname=libdtrain_cuda.so.$(SOVERSION) -Xlinker --no-undefined \
	    -o $@ $< -L$(BUILD) -ldtrain -lcublas $(LDLIBS)

# deps: installs the Debian packages the tests need (nothing when all are there; see the script).
deps:
	@scripts/install-deps.sh test

# bench-deps: the test packages plus those only the benchmarks need (PyTorch, Open MPI).
bench-deps:
	@scripts/install-deps.sh bench

# bench-allreduce: dtrain's all-reduce (local, libfabric shm and tcp;ofi_rxm under dtrun)
# against Open MPI and PyTorch's gloo, JSON lines then a summary with the targets
# (bench/run-allreduce.sh; BENCH_ARGS="--world 4 --max 1048576" etc. are passed to it).
BENCH_ARGS ?=
bench-allreduce: $(BUILD)/bench/allreduce $(DTRUN) $(if $(filter 1,$(HAVE_MPICC)),$(BUILD)/bench/allreduce_mpi)
ifneq ($(HAVE_MPICC),1)
	@echo "*** $(MPICC) (libopenmpi-dev) not found: bench/allreduce_mpi SKIPPED (make bench-deps) ***"
endif
	bench/run-allreduce.sh --build $(BUILD) $(BENCH_ARGS)

# demo: data-parallel Fashion-MNIST (examples/fmnist_dp, 2 epochs) on DEMO_RANKS ranks (found
# or fetched by deps). TRANSPORT=local (default): the ranks are threads of one process;
# another transport (TRANSPORT=libfabric, PROVIDER=shm, tcp;ofi_rxm, ...): one process per
# rank, started by build/dtrun.
TRANSPORT  ?= local
PROVIDER   ?=
DEMO_RANKS ?= 2
# DEMO_BATCH: the global batch (default 128), a multiple of DEMO_RANKS (DEMO_RANKS=3 DEMO_BATCH=129).
DEMO_BATCH ?=
DEMO_ARGS = $(if $(DEMO_BATCH),--batch $(DEMO_BATCH))
demo: deps
	@$(MAKE) --no-print-directory demo-run

demo-run: $(BUILD)/examples/fmnist_dp $(if $(filter-out local,$(TRANSPORT)),$(DTRUN))
	@test -n "$(DTR_FMNIST_DIR)" || { echo "demo: Fashion-MNIST not found; run scripts/fetch-fmnist.sh" >&2; exit 1; }
ifeq ($(TRANSPORT),local)
	$(BUILD)/examples/fmnist_dp "$(DTR_FMNIST_DIR)" --world $(DEMO_RANKS) $(DEMO_ARGS)
else
	@test "$(TRANSPORT)" != libfabric || test "$(USE_FABRIC)" = 1 || { echo "demo: TRANSPORT=libfabric needs libfabric (libfabric-dev; make deps)" >&2; exit 1; }
	$(DTRUN) -n $(DEMO_RANKS) -- $(BUILD)/examples/fmnist_dp "$(DTR_FMNIST_DIR)" --transport $(TRANSPORT) $(if $(PROVIDER),--provider '$(PROVIDER)') $(DEMO_ARGS)
endif

# test: the whole check (what CI runs): deps first, then `check` in a fresh make so that
# features installed by deps are detected.
test: deps
	@$(MAKE) --no-print-directory check

# check: everything `test` does except installing packages. The unit tests run last, so the
# last line is their total ("N passed, N failed").
check:
	./amalgamate --check
	scripts/gen-api-doc --check --lint
	@$(MAKE) --no-print-directory -j$(JOBS) all $(EMU_TESTS) $(EMU_REVERSED)
	@$(MAKE) --no-print-directory header-check header-only readme-check
	@$(MAKE) --no-print-directory cuda-check comm
	@$(MAKE) --no-print-directory private-check
	@$(MAKE) --no-print-directory cmake-consumer
	@$(MAKE) --no-print-directory fuzz-smoke-if-available
	@$(MAKE) --no-print-directory test-arm64-if-available
	tests/run.sh $(TESTS) $(EMU_TESTS) $(EMU_REVERSED)

# soak: tests/test_fabric's SIGKILL of a rank in the middle of collectives over libfabric's shm
# provider, SOAK_KILLS times (default 100): 0 hangs; prints one JSON line (kills, hangs, slowest
# time to error). Not in test/check (minutes).
SOAK_KILLS ?= 100
soak: $(BUILD)/tests/test_fabric
	DTR_SOAK=$(SOAK_KILLS) DTR_TEST_ONLY=shm_soak $<

# test-elastic-full: tests/test_elastic.c's fault matrices (SIGKILL and SIGSTOP of every rank at
# start-up, mid-training and inside a checkpoint write) over both providers, shm and tcp (make
# test runs each fault over one of them, alternating). About 2.5 minutes.
test-elastic-full: $(BUILD)/tests/test_elastic $(BUILD)/dtrun
	DTR_ELASTIC_FULL=1 $<

# test-compress-full: tests/test_compress.c with whole Fashion-MNIST epochs (3 per codec; make
# test runs 100 batches per epoch).
test-compress-full: $(BUILD)/tests/test_compress
	DTR_COMPRESS_FULL=1 $<

# api-doc: docs/api.md from the public headers' doc comments (check runs api-doc-check; --lint
# lists public functions without a thread-safety line).
api-doc:
	scripts/gen-api-doc --lint
api-doc-check:
	scripts/gen-api-doc --check --lint

# private-check: the library exports only the dtr__ symbols another unit or a test needs, and
# none of those is DTR__PRIVATE (scripts/private-check says which).
private-check: $(LIBA) $(COMM_OBJ)
	scripts/private-check $(LIBA) $(COMM_OBJ)

# header-check: dtrain.h compiles alone as pedantic C99 and as C++, with and without the
# implementation.
HEADER_CHECK = tests/header_only/syntax.c
header-check:
	$(CC) -std=c99 -Wall -Wextra -Wpedantic -Werror -fsyntax-only $(HEADER_CHECK)
	$(CC) -std=c99 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -DDTRAIN_IMPLEMENTATION $(HEADER_CHECK)
	$(CXX) -Wall -Wextra -Werror -fsyntax-only -x c++ $(HEADER_CHECK)
	$(CXX) -Wall -Wextra -Werror -fsyntax-only -x c++ -DDTRAIN_IMPLEMENTATION $(HEADER_CHECK)

# readme-check: every C block of README.md compiles; those with a main() are built from dtrain.h
# alone and run (tests/readme_blocks.sh).
readme-check:
	tests/readme_blocks.sh $(BUILD)/readme_blocks

# header-only: an app built from dtrain.h alone, the way a user would (`cc app.c -lm -lpthread`),
# trains a tiny model and checks that the loss goes down.
header-only:
	@mkdir -p $(BUILD)/header_only
	$(CC) tests/header_only/app.c -o $(BUILD)/header_only/app -lm -lpthread
	$(BUILD)/header_only/app

# cmake-consumer: a consumer project built with add_subdirectory, with find_package against
# a `make install DESTDIR=` staging prefix, and with pkg-config (tests/cmake_consumer/check.sh).
cmake-consumer: lib
	tests/cmake_consumer/check.sh $(BUILD)/cmake_consumer

# test-sanitize: the tests (and the CUDA kernels through cuemu) built with AddressSanitizer and UBSan into build-asan/, run with
# DTR_TEST_QUICK=1 (slow tests shrink their workloads) and 1500 s a program (emulated GPU kernels under ASan: test_grad_emu
# takes minutes).
test-sanitize: deps
	@$(MAKE) --no-print-directory -j$(JOBS) BUILD=build-asan OPT="-O1 -g" \
	    SANITIZE="-fsanitize=address,undefined -fno-omit-frame-pointer" tests
	@$(MAKE) --no-print-directory -j$(JOBS) BUILD=build-asan OPT="-O1 -g" \
	    SANITIZE="-fsanitize=address,undefined -fno-omit-frame-pointer" $(patsubst $(BUILD)/%,build-asan/%,$(EMU_TESTS))
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 DTR_TEST_QUICK=1 TEST_TIMEOUT=1500 \
	    tests/run.sh $(patsubst $(BUILD)/%,build-asan/%,$(TESTS) $(EMU_TESTS))

# test-tsan: the multi-threaded tests (thread pool, local and libfabric transports, loader,
# data-parallel, pipeline, ZeRO, parameter servers, compression, observability) built with ThreadSanitizer
# into build-tsan/ and run with DTR_TEST_QUICK=1: a data race fails the program (x86's strong
# memory order hides races that ARM's weaker one shows). Not in check (minutes).
TSAN_TESTS ?= test_gemm test_core test_comm test_data_loader test_dp test_pipeline test_zero test_ps test_obs \
              test_compress test_tensor_parallel test_health test_fabric
test-tsan:
	@$(MAKE) --no-print-directory -j$(JOBS) BUILD=build-tsan OPT="-O1 -g" SANITIZE="-fsanitize=thread" \
	    $(addprefix build-tsan/tests/,$(TSAN_TESTS))
	TSAN_OPTIONS="halt_on_error=1 report_signal_unsafe=0" DTR_TEST_QUICK=1 TEST_TIMEOUT=1500 \
	    tests/run.sh $(addprefix build-tsan/tests/,$(TSAN_TESTS))

# test-arm64: the library and ARM_TESTS cross-compiled for AArch64 by ARM_CC (warnings are
# errors there too) into ARM_BUILD, and run under qemu-aarch64 in user mode (QEMU_LD_PREFIX: the
# cross C library), DTR_TEST_QUICK=1. The default set checks what differs on ARM: the NEON GEMM
# kernel and the portable one, the element formulas, the optimizers against PyTorch, and every
# op's forward and backward (test_grad: finite differences, the generic element loops). About 3
# minutes on 2 cores; check runs it (test-arm64-if-available). ARM_TESTS="$(notdir $(TESTS))" runs
# every program: those that start other programs need qemu-aarch64 registered with binfmt_misc
# (Debian's qemu-user-binfmt), and the data tests Fashion-MNIST unpacked (DTR_FMNIST_DIR), as
# the arm64 build has no zlib; libfabric's tests skip loudly.
ARM_CC      ?= aarch64-linux-gnu-gcc
ARM_BUILD   ?= build-arm64
ARM_SYSROOT ?= /usr/aarch64-linux-gnu
QEMU_ARM    ?= qemu-aarch64
ARM_TESTS   ?= test_gemm test_formulas test_optim test_autograd test_grad
ARM_PROGRAMS = $(addprefix $(ARM_BUILD)/tests/,$(ARM_TESTS))
test-arm64:
	@$(MAKE) --no-print-directory -j$(JOBS) BUILD=$(ARM_BUILD) CC=$(ARM_CC) USE_ZLIB=0 USE_STB_IMAGE=0 \
	    USE_FABRIC=0 USE_NCCL=0 USE_CUDA=0 NVCC= HAVE_MPICC=0 HAVE_OPENBLAS=0 $(ARM_BUILD)/libdtrain.a $(ARM_PROGRAMS)
	QEMU_LD_PREFIX=$(ARM_SYSROOT) TEST_WRAPPER=$(QEMU_ARM) DTR_TEST_QUICK=1 DTR_TEST_KERNELS=neon tests/run.sh $(ARM_PROGRAMS)

# test-arm64-if-available: test-arm64 when the cross compiler and qemu are there (used by check).
test-arm64-if-available:
	@if command -v $(ARM_CC) >/dev/null 2>&1 && command -v $(QEMU_ARM) >/dev/null 2>&1; then \
	    $(MAKE) --no-print-directory test-arm64; \
	else echo "*** $(ARM_CC) or $(QEMU_ARM) not found (gcc-aarch64-linux-gnu, qemu-user; make deps): test-arm64 SKIPPED ***"; fi

# fuzz: builds every tests/fuzz/fuzz_*.c with libFuzzer + ASan + UBSan and runs each for
# FUZZ_SECONDS over tests/fuzz/corpus/<name>/ (new inputs go to $(BUILD)/fuzz/work/, crashes
# to $(BUILD)/fuzz/artifacts/).
fuzz: fuzz-build
	scripts/run-fuzz.sh run $(FUZZ_SECONDS) $(BUILD)/fuzz $(FUZZERS)

# fuzz-smoke: runs each fuzz target once over its corpus only (-runs=0): a quick regression check.
fuzz-smoke: fuzz-build
	scripts/run-fuzz.sh smoke 0 $(BUILD)/fuzz $(FUZZERS)

# fuzz-smoke-if-available: fuzz-smoke when clang's libFuzzer runtime works (used by check).
fuzz-smoke-if-available:
	@if [ -z "$(FUZZERS)" ]; then echo "fuzz-smoke: no tests/fuzz/fuzz_*.c yet"; \
	elif printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' | \
	     $(CLANG) -fsanitize=fuzzer,address,undefined -x c - -o $(BUILD)/.fuzzer-probe >/dev/null 2>&1; then \
	    $(MAKE) --no-print-directory -j$(JOBS) fuzz-build && $(MAKE) --no-print-directory fuzz-smoke; \
	else echo "*** clang's libFuzzer runtime not available (clang, libclang-rt-*-dev): fuzz-smoke SKIPPED ***"; fi

fuzz-build: $(FUZZERS)

# A fuzz target either compiles the implementation itself (#define DTRAIN_IMPLEMENTATION
# before #include "dtrain.h") or is linked with this fuzz-flavoured implementation object.
$(BUILD)/fuzz/dtrain_impl.o: lib/dtrain_impl.c dtrain.h $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CLANG) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link,address,undefined -c $< -o $@

$(BUILD)/fuzz/%: tests/fuzz/%.c $(BUILD)/fuzz/dtrain_impl.o
	$(CLANG) $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined -o $@ $< \
	    $(if $(shell grep -lE '^\s*.\s*define\s+DTRAIN_IMPLEMENTATION' $<),,$(BUILD)/fuzz/dtrain_impl.o) $(LDLIBS)

# install: header, libraries, pkg-config files and CMake package under $(DESTDIR)$(PREFIX),
# plus the optional units built here as libraries of their own: libdtrain_comm (the libfabric
# transport, USE_FABRIC=1) and libdtrain_cuda (USE_CUDA=1), with dtrain-comm.pc, dtrain-cuda.pc
# and the CMake components dtrain::comm, dtrain::cuda. The sources of the units go to
# share/dtrain/src for builds of your own; `dtrun` goes to $(BINDIR). Portable unless ARCH is set.
INSTALL_UNITS := $(if $(filter 1,$(USE_FABRIC)),comm) $(if $(filter 1,$(USE_CUDA)),cuda)
UNIT_DESC_comm := dtrain libfabric transport (dtrain_comm.c)
UNIT_LIBS_comm := $(COMM_LIBS)
UNIT_DESC_cuda := dtrain CUDA backend (dtrain_cuda.cu)
UNIT_LIBS_cuda := -L$(CUDA_HOME)/lib64 -lcublas -lcudart_static -ldl -lrt -lstdc++
# The .pc files are relocatable: prefix is found from the file's own folder.
PC_SED = sed -e "s|@DTRAIN_PC_PREFIX@|\$${pcfiledir}/$$(realpath -m --relative-to=$(PKGCONFIGDIR) $(PREFIX))|g" \
    -e "s|@DTRAIN_PC_LIBDIR@|\$${prefix}/$$(realpath -m --relative-to=$(PREFIX) $(LIBDIR))|g" \
    -e "s|@DTRAIN_PC_INCLUDEDIR@|\$${prefix}/$$(realpath -m --relative-to=$(PREFIX) $(INCLUDEDIR))|g" \
    -e 's|@DTRAIN_VERSION@|$(VERSION)|g'
# $(call install_lib,NAME): libNAME.a, libNAME.so.$(VERSION) and its two links.
install_lib = install -m 644 $(BUILD)/lib$(1).a $(DESTDIR)$(LIBDIR)/lib$(1).a && \
    install -m 755 $(BUILD)/lib$(1).so $(DESTDIR)$(LIBDIR)/lib$(1).so.$(VERSION) && \
    ln -sf lib$(1).so.$(VERSION) $(DESTDIR)$(LIBDIR)/lib$(1).so.$(SOVERSION) && \
    ln -sf lib$(1).so.$(SOVERSION) $(DESTDIR)$(LIBDIR)/lib$(1).so
install: lib $(patsubst %,%-lib,$(INSTALL_UNITS))
	install -d $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PKGCONFIGDIR) \
	    $(DESTDIR)$(CMAKEDIR) $(DESTDIR)$(DATADIR)/dtrain/src $(DESTDIR)$(DATADIR)/doc/dtrain
	install -m 644 dtrain.h $(DESTDIR)$(INCLUDEDIR)/dtrain.h
	install -m 644 dtrain_cuda.cu dtrain_comm.c $(DESTDIR)$(DATADIR)/dtrain/src/
	install -m 644 LICENSE $(DESTDIR)$(DATADIR)/doc/dtrain/LICENSE
	$(call install_lib,dtrain)
	$(PC_SED) -e 's|@DTRAIN_PC_LIBS@|$(LDLIBS)|g' -e 's| *@DTRAIN_PC_STATIC_LIBS@||' dtrain.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/dtrain.pc
	$(foreach u,$(INSTALL_UNITS),$(call install_lib,dtrain_$(u)) && \
	    $(PC_SED) -e 's|@DTRAIN_PC_NAME@|dtrain-$(u)|g' -e 's|@DTRAIN_PC_DESCRIPTION@|$(UNIT_DESC_$(u))|g' \
	    -e 's|@DTRAIN_PC_LIB@|dtrain_$(u)|g' -e 's|@DTRAIN_PC_LIBS@|$(UNIT_LIBS_$(u))|g' \
	    dtrain-unit.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/dtrain-$(u).pc;)
	sed -e "s|@DTRAIN_REL_INCLUDEDIR@|$$(realpath -m --relative-to=$(CMAKEDIR) $(INCLUDEDIR))|g" \
	    -e "s|@DTRAIN_REL_LIBDIR@|$$(realpath -m --relative-to=$(CMAKEDIR) $(LIBDIR))|g" \
	    -e 's|@DTRAIN_VERSION@|$(VERSION)|g' -e 's|@DTRAIN_SOVERSION@|$(SOVERSION)|g' \
	    -e 's|@DTRAIN_LINK_LIBS@|Threads::Threads;m$(if $(filter 1,$(USE_ZLIB)),;z)$(if $(filter 1,$(USE_CBLAS)),;$(patsubst -l%,%,$(BLAS_LIBS)))|g' \
	    -e 's|@DTRAIN_COMM_LIBS@|$(subst $(eval) ,;,$(strip $(UNIT_LIBS_comm)))|g' \
	    -e 's|@DTRAIN_CUDA_LIBS@|$(subst $(eval) ,;,$(strip $(UNIT_LIBS_cuda)))|g' \
	    cmake/dtrainConfig-make.cmake.in > $(DESTDIR)$(CMAKEDIR)/dtrainConfig.cmake
	sed -e 's|@PROJECT_VERSION@|$(VERSION)|g' \
	    -e "s|@DTRAIN_SIZEOF_VOID_P@|$$($(CC) -dM -E -x c /dev/null | sed -n 's/^#define __SIZEOF_POINTER__ //p')|g" \
	    cmake/dtrainConfigVersion.cmake.in \
	    > $(DESTDIR)$(CMAKEDIR)/dtrainConfigVersion.cmake
	@# A real install as root: refresh the dynamic linker's cache so libdtrain.so is found.
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ] && command -v ldconfig >/dev/null; then ldconfig; fi

# uninstall: removes what install put there (every unit, built or not).
uninstall:
	rm -f $(DESTDIR)$(INCLUDEDIR)/dtrain.h $(DESTDIR)$(CMAKEDIR)/dtrainConfig.cmake \
	    $(DESTDIR)$(CMAKEDIR)/dtrainConfigVersion.cmake \
	    $(DESTDIR)$(DATADIR)/dtrain/src/dtrain_cuda.cu $(DESTDIR)$(DATADIR)/dtrain/src/dtrain_comm.c \
	    $(DESTDIR)$(DATADIR)/doc/dtrain/LICENSE
	for l in dtrain dtrain_comm dtrain_cuda; do rm -f $(DESTDIR)$(LIBDIR)/lib$$l.a $(DESTDIR)$(LIBDIR)/lib$$l.so \
	    $(DESTDIR)$(LIBDIR)/lib$$l.so.$(SOVERSION) $(DESTDIR)$(LIBDIR)/lib$$l.so.$(VERSION); done
	rm -f $(DESTDIR)$(PKGCONFIGDIR)/dtrain.pc $(DESTDIR)$(PKGCONFIGDIR)/dtrain-comm.pc $(DESTDIR)$(PKGCONFIGDIR)/dtrain-cuda.pc
	-rmdir $(DESTDIR)$(CMAKEDIR) $(DESTDIR)$(DATADIR)/dtrain/src $(DESTDIR)$(DATADIR)/dtrain \
	    $(DESTDIR)$(DATADIR)/doc/dtrain 2>/dev/null

# clean: removes the build folders.
clean:
	rm -rf $(BUILD) build-asan build-tsan $(ARM_BUILD)

# help: this list.
help:
	@echo "dtrain $(VERSION): make [target] [VAR=value ...]"
	@echo "Build:"
	@echo "  all              library, tests, examples, benchmarks (default)"
	@echo "  lib              $(BUILD)/libdtrain.a and $(BUILD)/libdtrain.so"
	@echo "  tests            $(BUILD)/tests/test_* and $(BUILD)/dtrun"
	@echo "  examples         $(BUILD)/examples/* (fmnist_mlp, fmnist_cnn, fmnist_dp, gpt, csv_regression, image_folder_cnn)"
	@echo "  bench            $(BUILD)/bench/* (JSON lines; peers: make bench-deps)"
	@echo "  cuda, comm       $(BUILD)/dtrain_cuda.o (nvcc, sm_80+sm_90), $(BUILD)/dtrain_comm.o (libfabric), dtrain_comm_nccl.o (+ NCCL when found)"
	@echo "  cuda-lib, comm-lib  the same as libraries: $(BUILD)/libdtrain_cuda.{a,so}, $(BUILD)/libdtrain_comm.{a,so}"
	@echo "  test-gpu         on a GPU machine: every op and the training checks on the GPU against the CPU (skips loudly without one)"
	@echo "  test-cuemu       the GPU tests with the CUDA kernels executed on the CPU (tests/cuemu; part of test)"
	@echo "  examples-gpu     $(BUILD)/examples/gpu/{fmnist_mlp,fmnist_cnn,fmnist_dp}: the examples with --gpu (CUDA backend)"
	@echo "  bench-gpu        bench/gpu beside bench/gpu_torch.py (BENCH_ARGS, e.g. --tf32)"
	@echo "Run and check:"
	@echo "  demo             deps, then data-parallel Fashion-MNIST (examples/fmnist_dp), 2 epochs, on DEMO_RANKS ranks:"
	@echo "                   TRANSPORT=local (threads; default) or libfabric [PROVIDER=shm|'tcp;ofi_rxm'] (processes, dtrun)"
	@echo "  test             deps + check: what CI runs"
	@echo "  check            amalgamate --check, build with -Werror, header checks, header-only app, nvcc/comm"
	@echo "                   compile, install + CMake and pkg-config consumers (built and run), fuzz smoke, AArch64"
	@echo "                   tests under qemu, unit tests"
	@echo "  cmake-consumer   only the install and consumer checks (tests/cmake_consumer/check.sh)"
	@echo "  api-doc          docs/api.md from the headers' doc comments (api-doc-check: is it current?)"
	@echo "  header-check, header-only   dtrain.h as C99 and C++; an app built from dtrain.h alone"
	@echo "  private-check    the library exports only the dtr__ symbols other units and tests use"
	@echo "  readme-check     every C block of README.md compiles (those with main() also run)"
	@echo "  test-sanitize    tests under ASan+UBSan in build-asan/ (DTR_TEST_QUICK=1)"
	@echo "  test-tsan        the multi-threaded tests under ThreadSanitizer in build-tsan/ (TSAN_TESTS)"
	@echo "  test-arm64       ARM_TESTS cross-compiled for AArch64 ($(ARM_BUILD)/), run under qemu-aarch64 (part of check)"
	@echo "  test-compress-full  gradient compression accuracy over whole epochs (minutes)"
	@echo "  test-elastic-full   every fault of the kill matrix over both providers (minutes)"
	@echo "  soak                SIGKILL mid-collective over libfabric shm SOAK_KILLS times (default 100), JSON summary"
	@echo "  fuzz             libFuzzer targets for FUZZ_SECONDS each (default 30); fuzz-smoke: corpus only"
	@echo "  bench-allreduce  all-reduce: dtrain local/libfabric vs Open MPI and gloo, then a summary (BENCH_ARGS=)"
	@echo "Install:"
	@echo "  install          dtrain.h, libdtrain.{a,so}, dtrain.pc, CMake package, dtrun in BINDIR; with libfabric"
	@echo "                   libdtrain_comm + dtrain-comm.pc (dtrain::comm), with nvcc libdtrain_cuda (dtrain::cuda)"
	@echo "  uninstall        removes it all (DESTDIR honoured by both)"
	@echo "  deps, bench-deps install the Debian packages for the tests / the benchmarks"
	@echo "  clean            remove $(BUILD)/, build-asan/, build-tsan/ and $(ARM_BUILD)/"
	@echo "Variables (current value):"
	@echo "  CC=$(CC) CXX=$(CXX) OPT=$(OPT) ARCH=$(ARCH) (portable when empty; ARCH=-march=native tunes for this CPU)"
	@echo "  WERROR=$(WERROR) EXTRA_CFLAGS=$(EXTRA_CFLAGS) BUILD=$(BUILD) JOBS=$(JOBS)"
	@echo "  PREFIX=$(PREFIX) DESTDIR=$(DESTDIR) BINDIR=$(BINDIR) LIBDIR=$(LIBDIR) INCLUDEDIR=$(INCLUDEDIR)"
	@echo "  DATADIR=$(DATADIR) PKGCONFIGDIR=$(PKGCONFIGDIR) CMAKEDIR=$(CMAKEDIR)"
	@echo "  USE_ZLIB=$(USE_ZLIB) USE_STB_IMAGE=$(USE_STB_IMAGE) USE_CBLAS=$(USE_CBLAS) BLAS_LIBS=$(BLAS_LIBS)"
	@echo "  USE_FABRIC=$(USE_FABRIC) USE_NCCL=$(USE_NCCL) USE_CUDA=$(USE_CUDA) NVCC=$(NVCC) CUDA_HOME=$(CUDA_HOME)"
	@echo "  TRANSPORT=$(TRANSPORT) PROVIDER=$(PROVIDER) DEMO_RANKS=$(DEMO_RANKS) DEMO_BATCH=$(DEMO_BATCH) (a multiple of DEMO_RANKS)"
	@echo "  BENCH_ARGS=$(BENCH_ARGS) MPICC=$(MPICC) CLANG=$(CLANG) FUZZ_SECONDS=$(FUZZ_SECONDS)"
	@echo "  DTR_FMNIST_DIR=$(DTR_FMNIST_DIR)"

# ---- dtrun (rendezvous) ----
# build/dtrun: the local launcher (src/tools/dtrun.c, a standalone program: libdtrain.a is linked
# in for `dtrun --merge-traces`). tests/test_dtrun runs it, so `tests` builds it; `install` puts it in
# $(BINDIR). DTRUN is named with the other outputs at the top.
BINDIR ?= $(PREFIX)/bin
$(DTRUN): src/tools/dtrun.c dtrain.h $(LIBA) $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(LIBA) $(LDLIBS)
tests: $(DTRUN)
$(BUILD)/tests/test_dtrun: $(DTRUN)
.PHONY: install-dtrun uninstall-dtrun
install: install-dtrun
uninstall: uninstall-dtrun
install-dtrun: $(DTRUN)
	install -d $(DESTDIR)$(BINDIR)
	install -m 755 $(DTRUN) $(DESTDIR)$(BINDIR)/dtrun
uninstall-dtrun:
	rm -f $(DESTDIR)$(BINDIR)/dtrun
# ---- end dtrun ----

# ---- dtrain-plot ----
# build/dtrain-plot: metrics JSON lines and Chrome traces as SVG (src/tools/dtrain_plot.c; it
# compiles the implementation for the library's JSON reader). tests/test_plot runs it.
PLOT := $(BUILD)/dtrain-plot
$(PLOT): src/tools/dtrain_plot.c dtrain.h $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)
tests: $(PLOT)
$(BUILD)/tests/test_plot: $(PLOT)
.PHONY: install-plot uninstall-plot
install: install-plot
uninstall: uninstall-plot
install-plot: $(PLOT)
	install -d $(DESTDIR)$(BINDIR)
	install -m 755 $(PLOT) $(DESTDIR)$(BINDIR)/dtrain-plot
uninstall-plot:
	rm -f $(DESTDIR)$(BINDIR)/dtrain-plot
# ---- end dtrain-plot ----
