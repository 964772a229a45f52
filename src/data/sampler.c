/* ============================================================================
 * Distributed sampler: per-epoch seeded permutations sharded by rank with equal counts.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_data.h"
#include "../core/internal.h"

dtr_result dtr_sampler_init(dtr_sampler *s, int64_t n, int rank, int world, uint64_t seed, int shuffle, int drop_last) {
    if (!s) return DTR_NULL_HANDLE;
    memset(s, 0, sizeof(*s));
    if (n < 0 || world < 1 || rank < 0 || rank >= world) return DTR_INVALID_ARGUMENT;
    if (drop_last && n > 0 && n < world) return DTR_INVALID_ARGUMENT;
    s->n = n;
    s->rank = rank;
    s->world = world;
    s->seed = seed;
    s->shuffle = shuffle ? 1 : 0;
    s->drop_last = drop_last ? 1 : 0;
    return DTR_OK;
}

int64_t dtr_sampler_count(const dtr_sampler *s) {
    if (!s || s->world < 1) return 0;
    return s->drop_last ? s->n / s->world : (s->n + s->world - 1) / s->world;
}

dtr_result dtr_sampler_epoch(const dtr_sampler *s, int64_t epoch, int64_t *out, int64_t *scratch,
                             const dtr_allocation_callbacks *alloc) {
    int64_t count, i, *perm = scratch;
    dtr_rng rng;
    if (!s || !out) return DTR_NULL_HANDLE;
    count = dtr_sampler_count(s);
    if (s->n == 0 || count == 0) return DTR_OK;
    if (!perm) {
        perm = (int64_t *)dtr__malloc(alloc, (size_t)s->n * sizeof(int64_t));
        if (!perm) return DTR_OUT_OF_MEMORY;
    }
    for (i = 0; i < s->n; i++) perm[i] = i;
    if (s->shuffle) { /* Fisher-Yates from a stream keyed by the epoch: the same on every rank */
        dtr_rng_seed(&rng, s->seed, (uint64_t)epoch * 2654435761u + 1u);
        for (i = s->n - 1; i > 0; i--) {
            /* bounded draw from 64 random bits (modulo bias below 2^-24 for n < 2^40) */
            uint64_t r = ((uint64_t)dtr_rng_u32(&rng) << 32) | dtr_rng_u32(&rng);
            int64_t j = (int64_t)(r % (uint64_t)(i + 1)), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    for (i = 0; i < count; i++) out[i] = perm[(i * s->world + s->rank) % s->n]; /* wrap-around padding */
    if (perm != scratch) dtr__free(alloc, perm);
    return DTR_OK;
}
