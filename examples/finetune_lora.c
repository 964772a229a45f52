/* examples/finetune_lora.c: fine-tuning with LoRA adapters: a Fashion-MNIST MLP trained on the
 * images, then adapted to their photographic negatives by rank-r adapters alone.
 *
 * What it shows (the code is in examples/finetune_lora.h, which tests/test_train.c checks):
 *   - a base model trained and saved (dtr_model_save);
 *   - the same layers declared with an adapter each (dtr_linear_layer_add_lora, before the
 *     build), the base file loaded with the adapters optional (dtr_model_load_ex);
 *   - everything frozen but "*lora_" (dtr_model_set_trainable with a '*' pattern): AdamW
 *     trains and keeps moments for the adapters only;
 *   - the adapters merged into the weights (dtr_linear_layer_merge_lora) and the merged file
 *     loaded into a plain MLP that scores what the adapted model scores.
 *
 * Build and run from the repository:
 *     make examples && build/examples/finetune_lora [DATA_DIR] [--rank R] [--steps N] [--threads T]
 * Build by hand, with dtrain.h, common.h and finetune_lora.h beside this file:
 *     cc -O2 -I. -DDTRAIN_IMPLEMENTATION -DDTR_USE_ZLIB finetune_lora.c -o finetune_lora -lm -lpthread -lz
 * DATA_DIR defaults to $DTR_FMNIST_DIR, else /usr/share/datasets/fashion-mnist. The two files
 * (base and merged weights) go to $TMPDIR or /tmp and are removed at the end. */
#include "common.h"
#include "finetune_lora.h"

int main(int argc, char **argv) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_mnist d;
    ft_report rep;
    const char *dir = NULL, *tmp = getenv("TMPDIR");
    char base[512], merged[512];
    long rank = 8, steps = 600, threads = 2;
    double t0;
    int i;
    dtr_result r;
    for (i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--rank")) rank = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--steps")) steps = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = strtol(argv[++i], NULL, 10);
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else rank = 0;
    }
    if (rank < 1 || steps < 1 || threads < 1) {
        fprintf(stderr, "usage: %s [DATA_DIR] [--rank R] [--steps N] [--threads T]\n", argv[0]);
        return 2;
    }
    cfg.threads = (int)threads;
    if ((r = dtr_context_create(&cfg, &ctx)) != DTR_OK) return fm_fail(NULL, "context", r);
    if ((r = fm_data_load(fm_data_dir(dir), &d)) != DTR_OK) {
        dtr_context_destroy(ctx);
        return 1;   /* fm_data_load printed why, with a hint */
    }
    snprintf(base, sizeof base, "%s/finetune_lora_%ld_base.safetensors", tmp && *tmp ? tmp : "/tmp", (long)getpid());
    snprintf(merged, sizeof merged, "%s/finetune_lora_%ld_merged.safetensors", tmp && *tmp ? tmp : "/tmp", (long)getpid());
    t0 = fm_now();
    r = ft_run(ctx, &d, (int)rank, steps, steps, base, merged, &rep);
    remove(base);
    remove(merged);
    if (r == DTR_OK) {
        printf("base, %ld steps: test accuracy %.3f on the images, %.3f on their negatives\n", steps, rep.base_acc,
               rep.base_neg_acc);
        printf("LoRA rank %ld, %ld steps on the negatives: %.3f (%lld of %lld parameters trained, AdamW state %zu bytes)\n",
               rank, steps, rep.tuned_neg_acc, (long long)rep.trainable, (long long)rep.params, rep.state_bytes);
        printf("merged into a plain MLP: %.3f on the negatives (%.1f s in all)\n", rep.merged_neg_acc, fm_now() - t0);
    }
    dtr_mnist_destroy(&d);
    if (r != DTR_OK) return fm_fail(ctx, "fine-tuning", r);
    dtr_context_destroy(ctx);
    return 0;
}
