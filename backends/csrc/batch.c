/* batch.c: several prepared kernel calls in one ctypes call (part of the unity build cpu_kernels.c). */

/* ------------------------------------------------------------------ batches
 * Several prepared kernel calls in one: under -sm tensor every simulated device makes its own
 * rope, KV write, attention and gated-activation call per layer, and each ctypes call costs more
 * than a small kernel. A batch runs them in the given order (so the bits are those of separate
 * calls); it stops at the first that fails and says which. */
typedef int (*kernel_fn)(const void *);

typedef struct {
    int64_t n;
    const kernel_fn *fns;
    const void *const *args;
    int64_t failed;          /* out: index of the call that returned nonzero */
} BatchArgs;

int metatp_batch(BatchArgs *b) {
    for (int64_t i = 0; i < b->n; i++) {
        const int rc = b->fns[i](b->args[i]);
        if (rc) {
            b->failed = i;
            return rc;
        }
    }
    return 0;
}
