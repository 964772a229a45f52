/* ============================================================================
 * Gradient compression of the data-parallel engine (src/engine/compress.c), private to
 * src/engine/data_parallel.c: one codec per engine (dtr_dp_compress), state per bucket,
 * the residual of error feedback, and the engine's counters.
 * ==========================================================================*/

typedef struct dtr__dpc dtr__dpc;

/** Makes the compressor of config `cfg` for model m over group c (defaults filled in).
 *  dev: the gradients handed to it are in the backend's memory and the group takes them
 *  there (bf16 / fp16 encoded and decoded by the backend's cast kernel, int8 and top-k by
 *  its codec slot; its buffers and residual in the backend's memory; not PowerSGD).
 *  @return DTR_OK, DTR_INVALID_ARGUMENT (compress, topk_ratio, powersgd_rank; the context's
 *          message says which) or DTR_OUT_OF_MEMORY. */
DTR__PRIVATE dtr_result dtr__dpc_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, int dev, dtr__dpc **out);
DTR__PRIVATE void dtr__dpc_destroy(dtr__dpc *z);
/** The buckets changed (the model's trainable set did): every bucket's state is made again at
 *  its next start, and the residual of error feedback starts from zero. */
DTR__PRIVATE void dtr__dpc_forget_buckets(dtr__dpc *z);
/** Bucket i ([begin, end) of the gradient buffer g) is final: encodes it (adding the
 *  residual) and starts its exchange in *req. */
DTR__PRIVATE dtr_result dtr__dpc_start(dtr__dpc *z, int i, float *g, int64_t begin, int64_t end, dtr_request **req);
/** After bucket i's request completed: decodes the average into g + begin (PowerSGD: its
 *  second all-reduce, blocking). Called in bucket order on every rank. */
DTR__PRIVATE dtr_result dtr__dpc_finish(dtr__dpc *z, int i, float *g, int64_t begin);
/** The engine's counters (updated by the engine too). */
DTR__PRIVATE dtr_dp_stats *dtr__dpc_stats(dtr__dpc *z);
/** The residual of error feedback (numel floats) or NULL when the codec has none; *dev 1
 *  when it is in the backend's memory. */
DTR__PRIVATE float *dtr__dpc_residual(dtr__dpc *z, size_t *bytes, int *dev);
/** int8 of n floats (n >= 1): payload [f32 scale = max |g| / 127][n int8, g / scale rounded to
 *  nearest, NaN as 0]; resid (may be NULL, may be g itself) = g - decoded. */
DTR__PRIVATE void dtr__int8_encode(const float *g, int64_t n, unsigned char *out, float *resid);
