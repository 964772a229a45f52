/* ============================================================================
 * Public API: data pipeline (samplers, datasets, loaders)
 * ==========================================================================*/
#ifdef __cplusplus
extern "C" {
#endif

/* ---- distributed sampler ---- */

/** Splits the indices [0, n) of a dataset among `world` ranks, as torch's
 *  DistributedSampler does: every epoch the same seeded permutation on every rank (or the
 *  identity without shuffling), padded by wrapping around (or cut with drop_last) to a
 *  multiple of `world`, then rank r takes positions r, r + world, ... Every rank gets the
 *  same number of indices, so uneven data cannot make one rank wait for another forever. */
typedef struct dtr_sampler {
    int64_t n;          /**< dataset size */
    int rank, world;
    uint64_t seed;
    int shuffle;        /**< 1: a new permutation every epoch */
    int drop_last;      /**< 1: drop the tail instead of padding */
} dtr_sampler;

/** Fills `s`. Returns DTR_INVALID_ARGUMENT for n < 0, world < 1 or rank outside [0, world),
 *  or when drop_last leaves no index for a rank while n > 0 would need one. */
DTR_API dtr_result dtr_sampler_init(dtr_sampler *s, int64_t n, int rank, int world, uint64_t seed, int shuffle,
                                    int drop_last);
/** Indices per rank per epoch (the same on every rank). */
DTR_API int64_t dtr_sampler_count(const dtr_sampler *s);
/** Writes this rank's dtr_sampler_count() indices of `epoch` into `out`. Deterministic:
 *  the same (seed, epoch) gives the same indices on every machine. `scratch` must hold n
 *  int64 values (the permutation) or be NULL to use `alloc` (NULL: libc) for it. */
DTR_API dtr_result dtr_sampler_epoch(const dtr_sampler *s, int64_t epoch, int64_t *out, int64_t *scratch,
                                     const dtr_allocation_callbacks *alloc);

#ifdef __cplusplus
}
#endif
