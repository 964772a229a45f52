/* examples/finetune_lora.h: fine-tuning a trained network for a new input domain with LoRA
 * adapters (examples/finetune_lora.c runs it; tests/test_train.c checks it).
 *
 * The base: examples/common.h's MLP (784-256-128-10) trained on Fashion-MNIST and saved.
 * The new domain: the same garments as photographic negatives (every standardised pixel
 * negated), where the base's accuracy collapses. The fine-tuned model declares the same
 * layers with a rank-r adapter on each (dtr_linear_layer_add_lora), loads the base file with
 * the adapters optional (dtr_model_load_ex), freezes everything but "*lora_" and trains the
 * adapters alone with AdamW: 5% of the parameters, and AdamW's state for those only. Then
 * the adapters are merged into the weights (dtr_linear_layer_merge_lora) and the merged file
 * loads into a plain MLP, which scores what the adapted model scores. */
#ifndef DTRAIN_EXAMPLES_FINETUNE_LORA_H
#define DTRAIN_EXAMPLES_FINETUNE_LORA_H
#include "common.h"

typedef struct ft_report {
    double base_acc, base_neg_acc;    /* the base on the test images, and on their negatives */
    double tuned_neg_acc, merged_neg_acc;
    int64_t trainable, params;        /* floats trained while fine-tuning, of all the model's */
    size_t state_bytes;               /* AdamW's moments while fine-tuning */
} ft_report;

/* the negatives of n standardised images (a fresh copy; NULL when out of memory) */
FM_FN float *ft_negatives(const float *x, int64_t n) {
    float *y = (float *)malloc((size_t)(n * FM_PIXELS) * sizeof(float));
    int64_t i;
    for (i = 0; y && i < n * FM_PIXELS; i++) y[i] = -x[i];
    return y;
}

/* max_steps SGD steps of net over the shuffled (X, Y) of n samples, batches of 128 */
FM_FN dtr_result ft_train(dtr_context *ctx, const fm_net *net, dtr_optimizer *opt, const float *X, const int32_t *Y,
                          int64_t n, int64_t steps, uint64_t seed) {
    int32_t *order = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    fm_batch b;
    fm_epoch_stats st;
    dtr_rng rng;
    dtr_result r = fm_batch_alloc(&b, 128);
    int64_t done = 0;
    if (!order) r = DTR_OUT_OF_MEMORY;
    dtr_rng_seed(&rng, seed, 1);
    while (r == DTR_OK && done < steps) {
        fm_shuffle(&rng, order, n);
        r = fm_train_epoch(ctx, net, opt, X, Y, order, n, &b, steps - done, &st);
        done += st.steps;
    }
    fm_batch_free(&b);
    free(order);
    return r;
}

/* the MLP of common.h declared with a rank-r adapter (alpha 2r) on each of its layers */
FM_FN dtr_result ft_lora_net(fm_net *net, dtr_context *ctx, int rank) {
    dtr_linear_layer *l[3];
    dtr_result r;
    int k;
    memset(net, 0, sizeof *net);
    net->arch = FM_MLP;
    l[0] = &net->fc1, l[1] = &net->fc2, l[2] = &net->fc3;
    if ((r = dtr_model_create(ctx, 1, &net->model)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&net->fc1, net->model, "fc1", FM_PIXELS, 256, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&net->fc2, net->model, "fc2", 256, 128, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK) return r;
    if ((r = dtr_linear_layer_init(&net->fc3, net->model, "fc3", 128, FM_CLASSES, 1, DTR_INIT_TORCH_DEFAULT)) != DTR_OK) return r;
    for (k = 0; k < 3; k++)
        if ((r = dtr_linear_layer_add_lora(l[k], net->model, rank, 2.0f * (float)rank)) != DTR_OK) return r;
    return dtr_model_build(net->model);
}

/* the base (loaded from path, the adapters optional) with only its adapters trainable; the
   floats of those and of every parameter */
FM_FN dtr_result ft_adapt(fm_net *net, const char *path, int64_t *trainable, int64_t *params) {
    const char *adapters[1] = {"*lora_"};
    dtr_load_config lc = dtr_load_config_init();
    dtr_result r;
    int i;
    lc.optional = adapters, lc.n_optional = 1;
    if ((r = dtr_model_load_ex(net->model, path, &lc)) != DTR_OK) return r;
    if ((r = dtr_model_set_trainable(net->model, NULL, 0, 0)) != DTR_OK) return r;
    if ((r = dtr_model_set_trainable(net->model, adapters, 1, 1)) != DTR_OK) return r;
    for (*trainable = 0, *params = 0, i = 0; i < dtr_model_param_count(net->model); i++) {
        int64_t n = dtr_tensor_numel(dtr_model_param_at(net->model, i));
        *params += n;
        if (dtr_model_param_trainable(net->model, i)) *trainable += n;
    }
    return DTR_OK;
}

/* fine-tunes the adapters of `tuned` on the negatives for `steps`, merges them, saves the
   merged weights at merged_path and scores them in a plain MLP */
FM_FN dtr_result ft_tune_merge(dtr_context *ctx, fm_net *tuned, const float *negx, const dtr_mnist *d, const float *neg_test,
                               int64_t steps, const char *merged_path, ft_report *rep) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 2e-3f);
    dtr_optimizer *opt = NULL;
    fm_net plain;
    fm_batch b;
    dtr_result r;
    oc.weight_decay = 0.0f;
    if ((r = dtr_optimizer_create(tuned->model, &oc, &opt)) != DTR_OK) return r;
    rep->state_bytes = dtr_optimizer_state_bytes(opt);
    r = ft_train(ctx, tuned, opt, negx, d->train_y, d->train_n, steps, 11);
    dtr_optimizer_destroy(opt);
    if (r == DTR_OK) r = fm_batch_alloc(&b, 500);
    if (r == DTR_OK) r = fm_evaluate(ctx, tuned, neg_test, d->test_y, d->test_n, &b, &rep->tuned_neg_acc);
    if (r == DTR_OK) r = dtr_linear_layer_merge_lora(&tuned->fc1);
    if (r == DTR_OK) r = dtr_linear_layer_merge_lora(&tuned->fc2);
    if (r == DTR_OK) r = dtr_linear_layer_merge_lora(&tuned->fc3);
    if (r == DTR_OK) r = dtr_model_save(tuned->model, merged_path, DTR_F32);
    if (r == DTR_OK && (r = fm_net_init(&plain, ctx, FM_MLP, DTR_INIT_ZEROS, 1)) == DTR_OK) {
        r = dtr_model_load(plain.model, merged_path);   /* skips the (merged) adapters' entries */
        if (r == DTR_OK) r = fm_evaluate(ctx, &plain, neg_test, d->test_y, d->test_n, &b, &rep->merged_neg_acc);
        fm_net_free(&plain);
    }
    fm_batch_free(&b);
    return r;
}

/* The whole run: the base trained for base_steps and saved at base_path, then its adapters
   (rank) tuned for tune_steps on the negatives; files under base_path and merged_path. */
FM_FN dtr_result ft_run(dtr_context *ctx, const dtr_mnist *d, int rank, int64_t base_steps, int64_t tune_steps,
                        const char *base_path, const char *merged_path, ft_report *rep) {
    float *negx = ft_negatives(d->train_x, d->train_n), *neg_test = ft_negatives(d->test_x, d->test_n);
    fm_net base, tuned;
    fm_batch b;
    memset(&tuned, 0, sizeof tuned);
    dtr_optimizer *opt = NULL;
    dtr_result r = negx && neg_test ? fm_net_init(&base, ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, 1) : DTR_OUT_OF_MEMORY;
    memset(rep, 0, sizeof *rep);
    if (r == DTR_OK && (r = fm_sgd(&base, 0.05f, 0.9f, 0, &opt)) == DTR_OK) {
        r = ft_train(ctx, &base, opt, d->train_x, d->train_y, d->train_n, base_steps, 7);
        dtr_optimizer_destroy(opt);
        if (r == DTR_OK && (r = fm_batch_alloc(&b, 500)) == DTR_OK) {
            r = fm_evaluate(ctx, &base, d->test_x, d->test_y, d->test_n, &b, &rep->base_acc);
            if (r == DTR_OK) r = fm_evaluate(ctx, &base, neg_test, d->test_y, d->test_n, &b, &rep->base_neg_acc);
            fm_batch_free(&b);
        }
        if (r == DTR_OK) r = dtr_model_save(base.model, base_path, DTR_F32);
        fm_net_free(&base);
    }
    if (r == DTR_OK && (r = ft_lora_net(&tuned, ctx, rank)) == DTR_OK) {
        r = ft_adapt(&tuned, base_path, &rep->trainable, &rep->params);
        if (r == DTR_OK) r = ft_tune_merge(ctx, &tuned, negx, d, neg_test, tune_steps, merged_path, rep);
    }
    fm_net_free(&tuned);
    free(negx);
    free(neg_test);
    return r;
}

#endif
