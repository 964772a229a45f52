/* cuemu: the CUDA runtime and cuBLAS on a CPU (see cuda_runtime.h). One grid runs at a
 * time (a process-wide lock: ranks on threads share the "device"); a block's threads are
 * fibers (ucontext) scheduled round-robin until each finishes or waits at a barrier. */
#include "cuda_runtime.h"
#include "cublas_v2.h"
#include "cuda.h"
#include "cuda_fp16.h"
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <mutex>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include <unistd.h>
#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUEMU_ASAN 1
#else
#define CUEMU_ASAN 0
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace {

/* ---- fibers ----
 * On x86-64 a fiber switch saves the callee-saved registers and the FP control words on the
 * fiber's stack and swaps stack pointers (no system call; swapcontext costs two); elsewhere
 * ucontext. With AddressSanitizer every switch is announced to it. */

enum { F_RUN, F_WAIT_BLOCK, F_WAIT_WARP, F_DONE };
const size_t STACK = 256 << 10;

struct fiber {
    void *sp;                             /* the saved stack pointer (x86-64) */
    ucontext_t uc;                        /* or the saved context */
    int state;
    char *stack;
};

struct block_run {
    int n;                                /* threads of the block */
    int cur;                              /* the running fiber */
    std::vector<fiber> f;
    void *sched_sp, *dead_sp;
    ucontext_t sched;
    const std::function<void()> *body;
    uint64_t slot[1024];                  /* the warp and block operations' values */
    std::vector<double> dyn;              /* dynamic shared memory (doubles: aligned) */
    size_t dyn_bytes;
    alignas(128) unsigned char shared[48 << 10];   /* static shared memory (shared_slot) */
    size_t shared_used;
    std::vector<std::pair<const void *, size_t>> shared_sites;   /* declaration, offset */
    void *fake_stack;                     /* AddressSanitizer's bookkeeping of the switch */
};

block_run R;
std::recursive_mutex exec_mu;             /* one grid or product at a time */
thread_local cudaError_t last_error = cudaSuccess;

#if defined(__x86_64__)
extern "C" void cuemu_switch(void **save_sp, void *load_sp);
asm(R"(
    .text
    .globl cuemu_switch
    .type cuemu_switch, @function
cuemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuemu_switch, .-cuemu_switch
    .section .note.GNU-stack, "", @progbits
    .text
)");
#define CUEMU_ASM_SWITCH 1
#else
#define CUEMU_ASM_SWITCH 0
#endif

void fiber_main() {
#if CUEMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    (*R.body)();
    R.f[R.cur].state = F_DONE;
#if CUEMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, nullptr, 0);   /* this fiber's stack is done with */
#endif
#if CUEMU_ASM_SWITCH
    cuemu_switch(&R.dead_sp, R.sched_sp);   /* no local: the frame leaves no redzone behind */
#else
    setcontext(&R.sched);
#endif
}

/* a fresh fiber t that runs fiber_main when first switched to */
void fiber_prepare(int t) {
    fiber &f = R.f[t];
#if CUEMU_ASM_SWITCH
    uint64_t *top = (uint64_t *)(((uintptr_t)f.stack + STACK) & ~(uintptr_t)15), ctl = 0;
    __asm__ volatile("stmxcsr %0\n\tfnstcw 4%0" : "=m"(ctl));
    top[-1] = 0;                              /* fiber_main's return address: never used */
    top[-2] = (uint64_t)(uintptr_t)fiber_main;
    for (int i = 3; i <= 8; i++) top[-i] = 0; /* rbp rbx r12-r15 */
    top[-9] = ctl;
    f.sp = top - 9;
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = STACK;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, fiber_main, 0);
#endif
    f.state = F_RUN;
}

void to_sched() {
    fiber &f = R.f[R.cur];
#if CUEMU_ASAN
    __sanitizer_start_switch_fiber(&R.fake_stack, nullptr, 0);
#endif
#if CUEMU_ASM_SWITCH
    cuemu_switch(&f.sp, R.sched_sp);
#else
    swapcontext(&f.uc, &R.sched);
#endif
#if CUEMU_ASAN
    __sanitizer_finish_switch_fiber(R.fake_stack, nullptr, nullptr);
#endif
}

void wait_at(int kind) {
    R.f[R.cur].state = kind;
    to_sched();
}

void resume(int t) {
    unsigned bx = blockDim.x, by = blockDim.y;
    R.cur = t;
    threadIdx.x = (unsigned)t % bx;
    threadIdx.y = (unsigned)t / bx % by;
    threadIdx.z = (unsigned)t / (bx * by);
#if CUEMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, R.f[t].stack, STACK);
#endif
#if CUEMU_ASM_SWITCH
    cuemu_switch(&R.sched_sp, R.f[t].sp);
#else
    swapcontext(&R.sched, &R.f[t].uc);
#endif
#if CUEMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

/* Release the waiters whose barrier every live thread of its scope reached: a warp's first,
   then the block's. false: the live threads wait at different barriers (a kernel bug). */
bool release() {
    bool any = false;
    int live = 0, at_block = 0;
    for (int w = 0; w < R.n; w += 32) {
        int lanes = 0, waiting = 0;
        for (int t = w; t < R.n && t < w + 32; t++) {
            if (R.f[t].state == F_DONE) continue;
            lanes++;
            waiting += R.f[t].state == F_WAIT_WARP;
        }
        if (lanes && waiting == lanes) {
            for (int t = w; t < R.n && t < w + 32; t++)
                if (R.f[t].state == F_WAIT_WARP) R.f[t].state = F_RUN;
            any = true;
        }
    }
    if (any) return true;
    for (int t = 0; t < R.n; t++) {
        if (R.f[t].state == F_DONE) continue;
        live++;
        at_block += R.f[t].state == F_WAIT_BLOCK;
    }
    if (live && at_block == live) {
        for (int t = 0; t < R.n; t++)
            if (R.f[t].state == F_WAIT_BLOCK) R.f[t].state = F_RUN;
        return true;
    }
    return live == 0;
}

/* CUEMU_SCHEDULE=reverse: a schedule as unlike the default as CUDA allows. Each warp runs
   alone up to the next block barrier (its lanes together through warp operations), the last
   warp first and its lanes last to first, and the blocks of a grid last to first. A kernel
   whose result changes with the schedule reads what another thread writes without a barrier
   between (a missing __syncthreads or __syncwarp), or its blocks race on global memory: the
   same program run both ways shows it. */
bool reversed() {
    static const bool r = getenv("CUEMU_SCHEDULE") && !strcmp(getenv("CUEMU_SCHEDULE"), "reverse");
    return r;
}

/* the default: every running thread in order, then whichever barrier all have reached */
bool run_lockstep() {
    for (;;) {
        bool done = true;
        for (int t = 0; t < R.n; t++)
            if (R.f[t].state == F_RUN) resume(t);
        for (int t = 0; t < R.n; t++) done = done && R.f[t].state == F_DONE;
        if (done) return true;
        if (!release()) return false;
    }
}

/* warp w's lanes (last to first) until each is done or waits at a block barrier; false when
   they wait at different barriers */
bool run_warp(int w) {
    int hi = w + 32 < R.n ? w + 32 : R.n;
    for (;;) {
        int live = 0, at_warp = 0;
        for (int t = hi - 1; t >= w; t--)
            if (R.f[t].state == F_RUN) resume(t);
        for (int t = w; t < hi; t++) {
            live += R.f[t].state != F_DONE && R.f[t].state != F_WAIT_BLOCK;
            at_warp += R.f[t].state == F_WAIT_WARP;
        }
        if (live == 0) return true;
        if (at_warp != live) return false;
        for (int t = w; t < hi; t++)
            if (R.f[t].state == F_WAIT_WARP) R.f[t].state = F_RUN;
    }
}

bool run_reversed() {
    for (;;) {
        int live = 0, at_block = 0;
        for (int w = (R.n - 1) / 32 * 32; w >= 0; w -= 32)
            if (!run_warp(w)) return false;
        for (int t = 0; t < R.n; t++) {
            live += R.f[t].state != F_DONE;
            at_block += R.f[t].state == F_WAIT_BLOCK;
        }
        if (live == 0) return true;
        if (at_block != live) return false;
        for (int t = 0; t < R.n; t++)
            if (R.f[t].state == F_WAIT_BLOCK) R.f[t].state = F_RUN;
    }
}

bool run_block() {
    for (int t = 0; t < R.n; t++) fiber_prepare(t);
    return reversed() ? run_reversed() : run_lockstep();
}

void ensure_fibers(int n) {
    while ((int)R.f.size() < n) {
        fiber f;
        void *p = mmap(nullptr, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) { fprintf(stderr, "cuemu: no memory for fiber stacks\n"); abort(); }
        f.stack = (char *)p;
        f.state = F_DONE;
        R.f.push_back(f);
    }
}

const int SHARED_DEFAULT = 48 << 10, SHARED_OPTIN = 227 << 10;   /* an H100's limits per block */
std::map<const void *, int> shared_limit;                         /* raised by cudaFuncSetAttribute */

bool valid(const cuemu::config &c) {
    unsigned long long threads = (unsigned long long)c.block.x * c.block.y * c.block.z;
    return threads >= 1 && threads <= 1024 && c.block.z <= 64 && c.grid.x >= 1 && c.grid.x <= 0x7fffffffu && c.grid.y >= 1 &&
           c.grid.y <= 65535 && c.grid.z >= 1 && c.grid.z <= 65535;
}

bool shared_fits(const cuemu::config &c) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    auto it = shared_limit.find(c.fn);
    return c.shmem <= (size_t)(it == shared_limit.end() ? SHARED_DEFAULT : it->second);
}

cudaError_t run_grid(const cuemu::config &c, const std::function<void()> &body) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    int n = (int)(c.block.x * c.block.y * c.block.z);
    ensure_fibers(n);
    R.n = n;
    R.body = &body;
    blockDim = c.block;
    gridDim = c.grid;
    R.dyn.resize((c.shmem + 7) / 8);
    R.dyn_bytes = c.shmem;
    for (unsigned zi = 0; zi < c.grid.z; zi++)
        for (unsigned yi = 0; yi < c.grid.y; yi++)
            for (unsigned xi = 0; xi < c.grid.x; xi++) {
                bool rv = reversed();
                unsigned x = rv ? c.grid.x - 1 - xi : xi, y = rv ? c.grid.y - 1 - yi : yi, z = rv ? c.grid.z - 1 - zi : zi;
                blockIdx.x = x, blockIdx.y = y, blockIdx.z = z;
                if (R.dyn_bytes) memset(R.dyn.data(), 0xff, R.dyn_bytes);   /* what a block finds there is undefined */
                R.shared_sites.clear(), R.shared_used = 0;
                if (!run_block()) {
#if CUEMU_ASAN
                    for (int t = 0; t < n; t++) __asan_unpoison_memory_region(R.f[t].stack, STACK);   /* frames left */
#endif
                    fprintf(stderr, "cuemu: block (%u,%u,%u) of a (%u,%u,%u) x (%u,%u,%u) launch: its threads wait at "
                                    "different barriers\n", x, y, z, c.grid.x, c.grid.y, c.grid.z, c.block.x, c.block.y, c.block.z);
                    return cudaErrorLaunchFailure;
                }
            }
    return cudaSuccess;
}

/* ---- streams, events and graphs ----
 * Work queued on a stream runs as late as CUDA allows: when the host synchronises with the
 * stream (cudaStreamSynchronize, an event of it, a copy to pageable memory, cudaFree), or when
 * another stream's work that waits on its event runs. So a host that reads results without
 * waiting, or a stream that uses another's results without an event, gets stale memory here
 * as it could on a GPU. The legacy stream (0) runs at once; a capturing stream records. */

struct op_list { std::vector<std::function<void()>> ops; };

}  // namespace

struct cuemu_stream {
    std::deque<std::function<void()>> queue;
    uint64_t queued, done;                /* ops ever queued, and run */
    bool capturing, invalidated;
    op_list *graph;
};
struct cuemu_event { cudaStream_t stream; uint64_t at; };   /* complete when stream has run `at` ops */
struct cuemu_graph { op_list ops; };

namespace {

std::set<cudaStream_t> streams;
cudaError_t async_error = cudaSuccess;    /* a failure of queued work, reported at a synchronisation */

/* runs s's queued work until `upto` ops of it have run */
void drain(cudaStream_t s, uint64_t upto) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    while (s && s->done < upto && !s->queue.empty()) {
        std::function<void()> op = std::move(s->queue.front());
        s->queue.pop_front();
        s->done++;
        op();
    }
}

void drain_all() {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    for (cudaStream_t s : streams) drain(s, s->queued);
}

/* queues op on s (records it when s captures; runs it now on the legacy stream) */
void submit(cudaStream_t s, std::function<void()> op) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    if (s && s->capturing) {
        s->graph->ops.push_back(std::move(op));
    } else if (s) {
        s->queue.push_back(std::move(op));
        s->queued++;
    } else {
        op();
    }
}

cudaError_t take_async_error() {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    cudaError_t e = async_error;
    async_error = cudaSuccess;
    return e == cudaSuccess ? e : (last_error = e);
}

/* ---- memory ---- */

struct region { size_t bytes; cudaMemoryType type; };
std::mutex mem_mu;
std::map<uintptr_t, region> regions;

void *mem_new(size_t bytes, cudaMemoryType type) {
    void *p = nullptr;
    if (bytes > ((size_t)16 << 30) || posix_memalign(&p, 256, bytes ? bytes : 1) != 0) return nullptr;
    if (type == cudaMemoryTypeDevice) memset(p, 0xff, bytes);   /* NaN: device memory starts undefined */
    std::lock_guard<std::mutex> g(mem_mu);
    regions[(uintptr_t)p] = region{bytes, type};
    return p;
}

cudaError_t mem_delete(void *p, cudaMemoryType type) {
    if (!p) return cudaSuccess;
    {
        std::lock_guard<std::mutex> g(mem_mu);
        auto it = regions.find((uintptr_t)p);
        if (it == regions.end() || it->second.type != type) return last_error = cudaErrorInvalidValue;
        regions.erase(it);
    }
    free(p);
    return cudaSuccess;
}

}  // namespace

void cuemu::launch(const config &c, std::function<void()> body) {
    if (!valid(c) || !shared_fits(c)) {
        last_error = valid(c) ? cudaErrorInvalidValue : cudaErrorInvalidConfiguration;
        return;
    }
    submit(c.stream, [c, body]() {
        cudaError_t e = run_grid(c, body);
        if (e != cudaSuccess) async_error = e;
    });
}

/* ---- warp and block operations ---- */

uint64_t cuemu::shfl(uint64_t mine, int kind, int arg, int width) {
    int t = R.cur, lane = t & 31, src = kind == SHFL_DOWN ? lane + arg : lane ^ arg, base = t & ~31;
    uint64_t v = mine;
    R.slot[t] = mine;
    wait_at(F_WAIT_WARP);
    if (src / width == lane / width && base + src < R.n && R.f[base + src].state != F_DONE) v = R.slot[base + src];
    wait_at(F_WAIT_WARP);   /* every lane has read before a lane writes again */
    return v;
}

void __syncwarp(unsigned mask) {
    (void)mask;
    wait_at(F_WAIT_WARP);
}

unsigned __ballot_sync(unsigned mask, int pred) {
    int t = R.cur, base = t & ~31;
    unsigned bits = 0;
    R.slot[t] = pred != 0;
    wait_at(F_WAIT_WARP);
    for (int l = 0; l < 32 && base + l < R.n; l++)
        if (R.f[base + l].state != F_DONE && R.slot[base + l]) bits |= 1u << l;
    wait_at(F_WAIT_WARP);
    return bits & mask;
}

void __syncthreads(void) { wait_at(F_WAIT_BLOCK); }

int __syncthreads_or(int pred) {
    int any = 0;
    R.slot[R.cur] = pred != 0;
    wait_at(F_WAIT_BLOCK);
    for (int t = 0; t < R.n; t++) any |= R.f[t].state != F_DONE && R.slot[t];
    wait_at(F_WAIT_BLOCK);
    return any;
}

/* ---- the runtime ---- */

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

void *cuemu::dynamic_shared() { return R.dyn.data(); }

void *cuemu::shared_slot(const void *site, size_t bytes) {
    size_t at = (R.shared_used + 127) & ~(size_t)127;
    for (const auto &s : R.shared_sites)
        if (s.first == site) return R.shared + s.second;
    if (at + bytes > sizeof R.shared) {   /* nvcc refuses such a kernel */
        fprintf(stderr, "cuemu: a block's static shared memory over %zu bytes\n", sizeof R.shared);
        abort();
    }
    memset(R.shared + at, 0xff, bytes);   /* what a block finds there is undefined */
    R.shared_sites.push_back({site, at});
    R.shared_used = at + bytes;
    return R.shared + at;
}

cudaError_t cuemu::set_attribute(const void *fn, enum cudaFuncAttribute attr, int value) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    if (!fn || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > SHARED_OPTIN)
        return last_error = cudaErrorInvalidValue;
    shared_limit[fn] = value;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    if (device != 0) return last_error = cudaErrorInvalidDevice;
    if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return last_error = cudaErrorInvalidValue;
    *value = SHARED_OPTIN;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : (last_error = cudaErrorInvalidDevice); }

cudaError_t cudaMalloc(void **p, size_t bytes) {
    *p = bytes ? mem_new(bytes, cudaMemoryTypeDevice) : nullptr;
    return bytes && !*p ? (last_error = cudaErrorMemoryAllocation) : cudaSuccess;
}
cudaError_t cudaFree(void *p) {   /* synchronises the device, as CUDA's does */
    drain_all();
    return mem_delete(p, cudaMemoryTypeDevice);
}
cudaError_t cudaMallocHost(void **p, size_t bytes) {
    *p = mem_new(bytes, cudaMemoryTypeHost);
    return *p ? cudaSuccess : (last_error = cudaErrorMemoryAllocation);
}
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags) { (void)flags; return cudaMallocHost(p, bytes); }
cudaError_t cudaHostGetDevicePointer(void **dev, void *host, unsigned flags) { (void)flags; *dev = host; return cudaSuccess; }
cudaError_t cudaFreeHost(void *p) {
    drain_all();
    return mem_delete(p, cudaMemoryTypeHost);
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *at, const void *p) {
    std::lock_guard<std::mutex> g(mem_mu);
    auto it = regions.upper_bound((uintptr_t)p);
    memset(at, 0, sizeof *at);
    at->type = cudaMemoryTypeUnregistered;
    if (it != regions.begin()) {
        --it;
        if ((uintptr_t)p < it->first + (it->second.bytes ? it->second.bytes : 1)) {
            at->type = it->second.type;
            at->devicePointer = at->hostPointer = (void *)p;
        }
    }
    return cudaSuccess;
}

namespace {
enum cudaMemoryType kind_of(const void *p) {
    struct cudaPointerAttributes at;
    cudaPointerGetAttributes(&at, p);
    return at.type;
}
bool on_device(const void *p) { return kind_of(p) == cudaMemoryTypeDevice; }
bool pageable(const void *p) { return kind_of(p) == cudaMemoryTypeUnregistered; }
/* the copy's kind against the pointers (cudaMemcpyDefault: any) */
bool kind_ok(void *dst, const void *src, enum cudaMemcpyKind kind) {
    switch (kind) {
    case cudaMemcpyHostToDevice: return on_device(dst) && !on_device(src);
    case cudaMemcpyDeviceToHost: return !on_device(dst) && on_device(src);
    case cudaMemcpyDeviceToDevice: return on_device(dst) && on_device(src);
    case cudaMemcpyHostToHost: return !on_device(dst) && !on_device(src);
    default: return true;
    }
}
}  // namespace

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
    if (bytes && !kind_ok(dst, src, kind)) {
        fprintf(stderr, "cuemu: a copy of %zu bytes of kind %d from %p to %p: the pointers are not of that kind\n", bytes, (int)kind, src, dst);
        return last_error = cudaErrorInvalidValue;
    }
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    if (bytes) memmove(dst, src, bytes);
    return cudaSuccess;
}

/* CUDA's rules for pageable host memory: a copy from it may be reused at return (its bytes are
   taken now), a copy into it has landed at return (the stream runs up to it) */
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t s) {
    if (bytes && !kind_ok(dst, src, kind)) return cudaMemcpy(dst, src, bytes, kind);   /* reports it */
    if (!bytes) return cudaSuccess;
    if (pageable(src) && !(s && s->capturing)) {
        std::shared_ptr<std::vector<char>> copy = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + bytes);
        submit(s, [=]() { cudaMemcpy(dst, copy->data(), bytes, cudaMemcpyDefault); });
    } else {
        submit(s, [=]() { cudaMemcpy(dst, src, bytes, kind); });
    }
    if (pageable(dst) && s && !s->capturing) drain(s, s->queued);
    return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
    if (width > dpitch || width > spitch) return last_error = cudaErrorInvalidValue;
    auto op = [=]() {
        for (size_t r = 0; r < rows; r++) cudaMemcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width, kind);
    };
    submit(s, op);
    if (pageable(dst) && s && !s->capturing) drain(s, s->queued);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    auto op = [=]() {
        std::lock_guard<std::recursive_mutex> g(exec_mu);
        memset(p, value, bytes);
    };
    submit(s, op);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    (void)flags;
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    *s = new cuemu_stream{{}, 0, 0, false, false, nullptr};
    streams.insert(*s);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    if (!s) return cudaSuccess;
    drain(s, s->queued);   /* queued work still runs */
    streams.erase(s);
    delete s->graph;
    delete s;
    return cudaSuccess;
}
/* a host synchronisation inside a capture is not allowed: it invalidates the capture */
static cudaError_t not_while_capturing(cudaStream_t s) {
    if (!s || !s->capturing) return cudaSuccess;
    s->invalidated = true;
    return last_error = cudaErrorStreamCaptureUnsupported;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (not_while_capturing(s) != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
    if (s) drain(s, s->queued);
    return take_async_error();
}
cudaError_t cudaDeviceSynchronize(void) {
    drain_all();
    return take_async_error();
}
/* s's later work runs after the event's stream has run up to the record */
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)flags;
    if (!e->stream) return cudaSuccess;
    cudaStream_t on = e->stream;
    uint64_t at = e->at;
    submit(s, [on, at]() { drain(on, at); });
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) { (void)flags; *e = new cuemu_event{nullptr, 0}; return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    if (s && s->capturing) return cudaSuccess;   /* a node of the graph: ordering only */
    e->stream = s;
    e->at = s ? s->queued : 0;
    return cudaSuccess;
}
/* a query completes the work before the event (a GPU may have, any time) */
cudaError_t cudaEventQuery(cudaEvent_t e) {
    if (e->stream) drain(e->stream, e->at);
    return take_async_error();
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return cudaEventQuery(e); }

cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    (void)mode;
    if (!s || s->capturing) return last_error = cudaErrorInvalidValue;
    s->capturing = true;
    s->invalidated = false;
    s->graph = new op_list;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    *g = nullptr;
    if (!s || !s->capturing) return last_error = cudaErrorInvalidValue;
    s->capturing = false;
    if (s->invalidated) {
        delete s->graph;
        s->graph = nullptr;
        return last_error = cudaErrorStreamCaptureInvalidated;
    }
    *g = new cuemu_graph{*s->graph};
    delete s->graph;
    s->graph = nullptr;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags) {
    (void)flags;
    *x = new cuemu_graph{g->ops};
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s) {
    submit(s, [x]() { for (auto &op : x->ops.ops) op(); });
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x) { delete x; return cudaSuccess; }

/* ---- cuBLAS ---- */

struct cuemu_blas { cudaStream_t stream; cublasMath_t math; };

namespace {

float round_bits(float x, int keep) {   /* round to nearest even, keeping `keep` mantissa bits */
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return x;
    uint32_t drop = 23 - keep, half = 1u << (drop - 1);
    u += half - 1 + ((u >> drop) & 1u);
    u &= ~((1u << drop) - 1);
    memcpy(&x, &u, 4);
    return x;
}

float load(const void *p, cudaDataType_t t, size_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    if (t == CUDA_R_16F) return cuemu_half_to_float(((const uint16_t *)p)[i]);
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void store(void *p, cudaDataType_t t, size_t i, float v) {
    if (t == CUDA_R_32F) { ((float *)p)[i] = v; return; }
    if (t == CUDA_R_16F) { ((_Float16 *)p)[i] = (_Float16)v; return; }
    float r = round_bits(v, 7);
    uint32_t u;
    memcpy(&u, &r, 4);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

/* the operand rounding of a compute type on f32 operands */
float operand(float x, cudaDataType_t t, cublasComputeType_t c) {
    if (t != CUDA_R_32F) return x;
    if (c == CUBLAS_COMPUTE_32F_FAST_16BF) return round_bits(x, 7);
    if (c == CUBLAS_COMPUTE_32F_FAST_16F) return (float)(_Float16)x;
    if (c == CUBLAS_COMPUTE_32F_FAST_TF32) return round_bits(x, 10);
    return x;
}

struct gemm_args {
    cublasOperation_t ta, tb;
    int m, n, k;
    float alpha, beta;
    cudaDataType_t at, bt, ct;
    int lda, ldb, ldc;
    cublasComputeType_t compute;
};

bool gemm_valid(const gemm_args &a) {
    int arows = a.ta == CUBLAS_OP_N ? a.m : a.k, brows = a.tb == CUBLAS_OP_N ? a.k : a.n;
    if (a.m < 0 || a.n < 0 || a.k < 0) return false;
    if (a.lda < (arows > 1 ? arows : 1) || a.ldb < (brows > 1 ? brows : 1) || a.ldc < (a.m > 1 ? a.m : 1)) return false;
    return (a.ta == CUBLAS_OP_N || a.ta == CUBLAS_OP_T) && (a.tb == CUBLAS_OP_N || a.tb == CUBLAS_OP_T);
}

/* C (m x n) = alpha op(A) op(B) + beta C, column-major; beta 0: C is not read. The operands
   are read and rounded once, into rows of op(A) and columns of op(B) (k each), then each entry
   sums its k products in double in the order of k */
void gemm_one(const gemm_args &a, const void *A, const void *B, void *C) {
    std::lock_guard<std::recursive_mutex> g(exec_mu);
    std::vector<double> ra((size_t)a.m * a.k), rb((size_t)a.n * a.k);
    for (int i = 0; i < a.m; i++)
        for (int p = 0; p < a.k; p++) {
            size_t ai = a.ta == CUBLAS_OP_N ? (size_t)i + (size_t)p * a.lda : (size_t)p + (size_t)i * a.lda;
            ra[(size_t)i * a.k + p] = operand(load(A, a.at, ai), a.at, a.compute);
        }
    for (int j = 0; j < a.n; j++)
        for (int p = 0; p < a.k; p++) {
            size_t bi = a.tb == CUBLAS_OP_N ? (size_t)p + (size_t)j * a.ldb : (size_t)j + (size_t)p * a.ldb;
            rb[(size_t)j * a.k + p] = operand(load(B, a.bt, bi), a.bt, a.compute);
        }
    for (int j = 0; j < a.n; j++)
        for (int i = 0; i < a.m; i++) {
            const double *x = ra.data() + (size_t)i * a.k, *y = rb.data() + (size_t)j * a.k;
            double acc = 0.0;
            for (int p = 0; p < a.k; p++) acc += x[p] * y[p];
            size_t ci = (size_t)i + (size_t)j * a.ldc;
            float v = (float)(a.alpha * acc);
            if (a.beta != 0.0f) v = (float)(a.alpha * acc + (double)a.beta * load(C, a.ct, ci));
            store(C, a.ct, ci, v);
        }
}

size_t elem(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

cublasStatus_t gemm_run(cublasHandle_t h, const gemm_args &a, const void *const *As, const void *const *Bs, void *const *Cs,
                        const void *A, const void *B, void *C, long long sa, long long sb, long long sc, int count) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!gemm_valid(a) || count < 0) return CUBLAS_STATUS_INVALID_VALUE;
    /* the pointer arrays are read when the product runs (a kernel before it may fill them) */
    auto op = [a, As, Bs, Cs, A, B, C, sa, sb, sc, count]() {
        for (int b = 0; b < count; b++)
            gemm_one(a, As ? As[b] : (const char *)A + (size_t)(b * sa) * elem(a.at),
                     Bs ? Bs[b] : (const char *)B + (size_t)(b * sb) * elem(a.bt),
                     Cs ? Cs[b] : (char *)C + (size_t)(b * sc) * elem(a.ct));
    };
    submit(h->stream, op);
    return CUBLAS_STATUS_SUCCESS;
}

gemm_args args_of(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *alpha,
                  cudaDataType_t at, int lda, cudaDataType_t bt, int ldb, const void *beta, cudaDataType_t ct, int ldc,
                  cublasComputeType_t compute) {
    gemm_args a = {ta, tb, m, n, k, *(const float *)alpha, *(const float *)beta, at, bt, ct, lda, ldb, ldc, compute};
    if (h && h->math == CUBLAS_TF32_TENSOR_OP_MATH && compute == CUBLAS_COMPUTE_32F && at == CUDA_R_32F) a.compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    return a;
}

}  // namespace

cublasStatus_t cublasCreate(cublasHandle_t *h) { *h = new cuemu_blas{nullptr, CUBLAS_DEFAULT_MATH}; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasDestroy(cublasHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) { h->stream = s; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) { h->math = mode; return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta, float *C, int ldc) {
    gemm_args a = args_of(h, ta, tb, m, n, k, alpha, CUDA_R_32F, lda, CUDA_R_32F, ldb, beta, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F);
    return gemm_run(h, a, nullptr, nullptr, nullptr, A, B, C, 0, 0, 0, 1);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda, long long sa, const float *B, int ldb,
                                         long long sb, const float *beta, float *C, int ldc, long long sc, int count) {
    gemm_args a = args_of(h, ta, tb, m, n, k, alpha, CUDA_R_32F, lda, CUDA_R_32F, ldb, beta, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F);
    return gemm_run(h, a, nullptr, nullptr, nullptr, A, B, C, sa, sb, sc, count);
}

cublasStatus_t cublasSgemmBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                  const float *alpha, const float *const A[], int lda, const float *const B[], int ldb,
                                  const float *beta, float *const C[], int ldc, int count) {
    gemm_args a = args_of(h, ta, tb, m, n, k, alpha, CUDA_R_32F, lda, CUDA_R_32F, ldb, beta, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F);
    return gemm_run(h, a, (const void *const *)A, (const void *const *)B, (void *const *)C, nullptr, nullptr, nullptr, 0, 0, 0,
                    count);
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType_t at, int lda, const void *B, cudaDataType_t bt, int ldb,
                            const void *beta, void *C, cudaDataType_t ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
    (void)algo;
    gemm_args a = args_of(h, ta, tb, m, n, k, alpha, at, lda, bt, ldb, beta, ct, ldc, compute);
    return gemm_run(h, a, nullptr, nullptr, nullptr, A, B, C, 0, 0, 0, 1);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType_t at, int lda, long long sa,
                                          const void *B, cudaDataType_t bt, int ldb, long long sb, const void *beta, void *C,
                                          cudaDataType_t ct, int ldc, long long sc, int count, cublasComputeType_t compute,
                                          cublasGemmAlgo_t algo) {
    (void)algo;
    gemm_args a = args_of(h, ta, tb, m, n, k, alpha, at, lda, bt, ldb, beta, ct, ldc, compute);
    return gemm_run(h, a, nullptr, nullptr, nullptr, A, B, C, sa, sb, sc, count);
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void *alpha, const void *const A[], cudaDataType_t at, int lda, const void *const B[],
                                   cudaDataType_t bt, int ldb, const void *beta, void *const C[], cudaDataType_t ct, int ldc,
                                   int count, cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    (void)algo;
    gemm_args a = args_of(h, ta, tb, m, n, k, alpha, at, lda, bt, ldb, beta, ct, ldc, compute);
    return gemm_run(h, a, A, B, C, nullptr, nullptr, nullptr, 0, 0, 0, count);
}

/* ---- the driver's virtual memory calls (tests/cuemu/cuda.h) ---- */

namespace {
struct vm_handle { int fd; size_t size; int maps; bool released; };
struct vm_map { size_t size; CUmemGenericAllocationHandle h; };
std::mutex vm_mu;
std::map<CUmemGenericAllocationHandle, vm_handle> vm_handles;
std::map<uintptr_t, vm_map> vm_maps;      /* mapped ranges by their start */
std::map<uintptr_t, size_t> vm_ranges;    /* reserved ranges */
CUmemGenericAllocationHandle vm_next = 1;

size_t vm_granule() {
    const char *e = getenv("CUEMU_GRANULE");
    size_t page = (size_t)sysconf(_SC_PAGESIZE), g = e ? strtoull(e, nullptr, 10) : 0;
    return g && g % page == 0 ? g : page;
}

bool vm_reserved(uintptr_t p, size_t n) {
    auto it = vm_ranges.upper_bound(p);
    if (it == vm_ranges.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}

/* the mapping that overlaps [p, p + n) first, or end() */
std::map<uintptr_t, vm_map>::iterator vm_overlap(uintptr_t p, size_t n) {
    auto it = vm_maps.lower_bound(p);
    if (it != vm_maps.begin()) {
        auto prev = std::prev(it);
        if (prev->first + prev->second.size > p) return prev;
    }
    return it != vm_maps.end() && it->first < p + n ? it : vm_maps.end();
}

void vm_close_if_unused(CUmemGenericAllocationHandle h) {
    auto it = vm_handles.find(h);
    if (it == vm_handles.end() || !it->second.released || it->second.maps) return;
    close(it->second.fd);
    vm_handles.erase(it);
}

bool vm_device_prop(const CUmemAllocationProp *p) {
    return p && p->type == CU_MEM_ALLOCATION_TYPE_PINNED && p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && p->location.id == 0;
}
}  // namespace

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_VALUE;
    *d = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute attr, CUdevice d) {
    const char *e = getenv("CUEMU_NO_VMM");
    if (d != 0 || attr != CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) return CUDA_ERROR_INVALID_VALUE;
    *v = !(e && e[0] == '1');
    return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags option) {
    (void)option;
    if (!vm_device_prop(prop)) return CUDA_ERROR_INVALID_VALUE;
    *g = vm_granule();
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
    size_t G = vm_granule(), align = alignment > G ? alignment : G;
    if (!size || size % G || alignment % G || addr || flags) return CUDA_ERROR_INVALID_VALUE;
    char *raw = (char *)mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    char *p = (char *)(((uintptr_t)raw + align - 1) / align * align);
    if (p > raw) munmap(raw, (size_t)(p - raw));
    munmap(p + size, (size_t)(raw + size + align - (p + size)));
    {
        std::lock_guard<std::mutex> g(vm_mu);
        vm_ranges[(uintptr_t)p] = size;
    }
    std::lock_guard<std::mutex> g(mem_mu);
    regions[(uintptr_t)p] = region{size, cudaMemoryTypeDevice};
    *ptr = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    {
        std::lock_guard<std::mutex> g(vm_mu);
        auto it = vm_ranges.find((uintptr_t)ptr);
        if (it == vm_ranges.end() || it->second != size || vm_overlap((uintptr_t)ptr, size) != vm_maps.end())
            return CUDA_ERROR_INVALID_VALUE;   /* not a reserved range, or still mapped */
        vm_ranges.erase(it);
        munmap((void *)ptr, size);
    }
    std::lock_guard<std::mutex> g(mem_mu);
    regions.erase((uintptr_t)ptr);
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
    size_t G = vm_granule();
    if (!size || size % G || flags || !vm_device_prop(prop)) return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("cuemu", 0);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    void *t = ftruncate(fd, (off_t)size) == 0 ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (t == MAP_FAILED) { close(fd); return CUDA_ERROR_OUT_OF_MEMORY; }
    memset(t, 0xff, size);   /* NaN: device memory starts undefined */
    munmap(t, size);
    std::lock_guard<std::mutex> g(vm_mu);
    *h = vm_next++;
    vm_handles[*h] = vm_handle{fd, size, 0, false};
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    std::lock_guard<std::mutex> g(vm_mu);
    auto it = vm_handles.find(h);
    if (it == vm_handles.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
    it->second.released = true;
    vm_close_if_unused(h);
    return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
    size_t G = vm_granule();
    std::lock_guard<std::mutex> g(vm_mu);
    auto it = vm_handles.find(h);
    if (it == vm_handles.end() || it->second.released || flags || !size || ptr % G || size % G || offset % G ||
        offset + size > it->second.size || !vm_reserved((uintptr_t)ptr, size) || vm_overlap((uintptr_t)ptr, size) != vm_maps.end())
        return CUDA_ERROR_INVALID_VALUE;
    if (mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, it->second.fd, (off_t)offset) == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    vm_maps[(uintptr_t)ptr] = vm_map{size, h};
    it->second.maps++;
    return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {   /* waits for the device, as CUDA's does */
    drain_all();
    std::lock_guard<std::mutex> g(vm_mu);
    auto it = vm_maps.find((uintptr_t)ptr);
    if (it == vm_maps.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;   /* exactly one mapping */
    mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    CUmemGenericAllocationHandle h = it->second.h;
    vm_maps.erase(it);
    vm_handles[h].maps--;
    vm_close_if_unused(h);
    return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    std::lock_guard<std::mutex> g(vm_mu);
    if (count != 1 || !desc || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc->location.id != 0) return CUDA_ERROR_INVALID_VALUE;
    for (uintptr_t at = (uintptr_t)ptr; at < (uintptr_t)ptr + size;) {   /* mapped throughout */
        auto it = vm_maps.find(at);
        if (it == vm_maps.end()) return CUDA_ERROR_INVALID_VALUE;
        at += it->second.size;
    }
    int prot = desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
             : desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READ ? PROT_READ : PROT_NONE;
    return mprotect((void *)ptr, size, prot) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version, unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
    static const struct { const char *name; void *fn; } table[] = {
        {"cuDeviceGet", (void *)cuDeviceGet}, {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
        {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity},
        {"cuMemAddressReserve", (void *)cuMemAddressReserve}, {"cuMemAddressFree", (void *)cuMemAddressFree},
        {"cuMemCreate", (void *)cuMemCreate}, {"cuMemRelease", (void *)cuMemRelease}, {"cuMemMap", (void *)cuMemMap},
        {"cuMemUnmap", (void *)cuMemUnmap}, {"cuMemSetAccess", (void *)cuMemSetAccess}};
    *fn = nullptr;
    if (status) *status = cudaDriverEntryPointSymbolNotFound;
    if (!symbol || flags != cudaEnableDefault || version < 12000) return last_error = cudaErrorInvalidValue;
    for (const auto &e : table)
        if (strcmp(e.name, symbol) == 0) *fn = e.fn;
    if (*fn && status) *status = cudaDriverEntryPointSuccess;
    return cudaSuccess;
}
