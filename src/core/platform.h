/* ============================================================================
 * Platform shims shared by the implementation and the two other units: compiler attributes
 * and atomics, each defined once. GCC and Clang builtins; other compilers get the portable
 * fall-backs noted at each macro.
 * ==========================================================================*/

/* ---- attributes ---- */

/** printf-style checking of a function's format (argument fmt_index) against its variadic
 *  arguments (from first_arg): -Wformat then finds every mismatched call. */
#if defined(__GNUC__) || defined(__clang__)
#define DTR__PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define DTR__PRINTF(fmt_index, first_arg)
#endif

/** An element-wise loop over [begin, end) as blocks of 16 (then the rest one by one) whose
 *  iterations the compiler may treat as independent: GCC's -O2 vectorises only loops that need
 *  no run-time alias check and whose trip count is a multiple of the vector width (its
 *  "very cheap" cost model), so a plain loop over three float arrays stays scalar. 16: one
 *  AVX-512 vector, or two AVX2 ones whose chains overlap (the LSTM's cell: 1.27x over 8). BODY sees
 *  the element's index as `i` (an int64_t the macro declares); it must not carry anything
 *  from one element to the next, and the arrays it writes must not overlap the ones it reads
 *  at other indices. The same operations in the same order: the bits equal the plain loop's. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 5   /* clang -O2 vectorises with a check */
#define DTR__IVDEP _Pragma("GCC ivdep")
#else
#define DTR__IVDEP
#endif
#define DTR__ELEMENTWISE(begin, end, BODY) \
    do { \
        int64_t i_0_ = (begin), i_n_ = (end), i; \
        int i_j_; \
        for (; i_0_ + 16 <= i_n_; i_0_ += 16) { \
            DTR__IVDEP for (i_j_ = 0; i_j_ < 16; i_j_++) { i = i_0_ + i_j_; BODY; } \
        } \
        for (i = i_0_; i < i_n_; i++) { BODY; } \
    } while (0)

/** Hot loops (the activations, forward and backward; the exp sums of softmax, attention and
 *  cross-entropy; cross-entropy's gradient; the depthwise convolution's, the convolutions'
 *  column producers and the 2x2 max pool; the sum of squares of the gradient norms) are
 *  compiled twice: as they are (SSE2 on x86-64)
 *  and for AVX2 (8 floats a vector: about 1.7-2x on them), the second picked at run time
 *  where the CPU has it (dtr__simd_level, src/core/gemm.c; DTRAIN_SIMD=generic keeps the
 *  first). The loop's body is a DTR__SIMD_BODY function (always inlined, so it is compiled in
 *  its caller's instruction set) called by a plain function and by a DTR__TARGET_AVX2 one. No
 *  FMA: nothing is contracted into a multiply-add, so both give the same bits (test_grad
 *  checks every op case both ways). The loops whose elements each take several exponentials
 *  (the activations, the exp sums, cross-entropy's gradient, the LSTM's and GRU's cells) are
 *  compiled a third time for AVX-512
 *  (DTR__TARGET_AVX512: 16 floats a vector, about 1.8x over AVX2 on them; DTRAIN_SIMD=avx2
 *  stops at AVX2). AVX-512 brings FMA: GCC is told not to contract there, and Clang reads the
 *  library's code with contraction off (the amalgamation's pragmas: by default it contracts
 *  inside an expression), so every variant gives the same bits. x86-64 with GCC or Clang; elsewhere, or with DTR_NO_SIMD, the
 *  AVX2 and AVX-512 functions are plain ones and never picked. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DTR_NO_SIMD)
#define DTR__X86_SIMD 1
#define DTR__TARGET_AVX2 __attribute__((target("avx2")))
#if defined(__clang__)
#define DTR__TARGET_AVX512 __attribute__((target("avx512f")))
#else
#define DTR__TARGET_AVX512 __attribute__((target("avx512f"), optimize("fp-contract=off")))
#endif
#define DTR__SIMD_BODY static inline __attribute__((always_inline))
#else
#define DTR__X86_SIMD 0
#define DTR__TARGET_AVX2
#define DTR__TARGET_AVX512
#define DTR__SIMD_BODY static inline
#endif

/** Marks the declaration of an implementation-private function (dtr__, not used by
 *  dtrain_cuda.cu, dtrain_comm.c or the tests): `static` inside the implementation unit, so
 *  the library exports only what the other units need (`make private-check` keeps it so);
 *  a plain declaration in the units that see the internal API, where nothing calls it. A
 *  definition without `static` after it keeps the internal linkage (C99 6.2.2). */
#if defined(DTRAIN_IMPLEMENTATION)
#define DTR__PRIVATE static
#else
#define DTR__PRIVATE
#endif

/* ---- atomics ----
 * Acquire/release loads and stores, a sequentially consistent decrement and compare-and-swap,
 * and relaxed accesses, on integers shared between threads. */
#if defined(__GNUC__) || defined(__clang__)
#define DTR__ATOMIC_LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define DTR__ATOMIC_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define DTR__ATOMIC_LOAD_SC(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define DTR__ATOMIC_STORE_SC(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
#define DTR__ATOMIC_LOAD_RELAXED(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define DTR__ATOMIC_STORE_RELAXED(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define DTR__ATOMIC_DEC(p) __atomic_sub_fetch((p), 1, __ATOMIC_SEQ_CST)
#define DTR__ATOMIC_INC(p) __atomic_add_fetch((p), 1, __ATOMIC_SEQ_CST)
/* 1 when *p was *expect and is now v; else 0 and *expect holds *p */
#define DTR__ATOMIC_CAS(p, expect, v) \
    __atomic_compare_exchange_n((p), (expect), (v), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)
#define DTR__HAVE_ATOMICS 1
#else
#define DTR__HAVE_ATOMICS 0   /* callers fall back to their mutexes (the thread pool), or need shims here */
#endif

/* thread-local storage where the compiler has it; elsewhere one shared copy (last writer wins) */
#if defined(__GNUC__) || defined(__clang__)
#define DTR__THREAD_LOCAL __thread
#elif defined(_MSC_VER)
#define DTR__THREAD_LOCAL __declspec(thread)
#else
#define DTR__THREAD_LOCAL
#endif
