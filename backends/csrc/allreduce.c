/* allreduce.c: the simulated all-reduce (part of the unity build cpu_kernels.c). */

/* ------------------------------------------------------------------ simulated all-reduce
 * Sum n equal-length buffers in place with the bits of llama.cpp's butterfly (the schedule is
 * backends/collectives/schedule.py butterfly_schedule): zero the inactive ones, fold the devices past
 * the largest power of two p2, then pairwise sums at distance p2/2, ..., 1 into the lower half,
 * then every buffer receives buffer 0's result. */
typedef struct {
    int64_t n, count;
    float *const *bufs;
    const uint8_t *active;   /* n flags */
} AllreduceArgs;

static void add_into(float *dst, const float *src, int64_t count) {
    for (int64_t i = 0; i < count; i++) dst[i] += src[i];
}

int metatp_allreduce(const AllreduceArgs *a) {
    const int64_t n = a->n, count = a->count;
    float *const *bufs = a->bufs;
    if (n < 1) return -1;
    for (int64_t j = 0; j < n; j++)
        if (!a->active[j]) memset(bufs[j], 0, sizeof(float) * (size_t)count);
    int64_t p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    for (int64_t j = p2; j < n; j++) add_into(bufs[j - p2], bufs[j], count);
    for (int64_t off = p2 / 2; off >= 1; off /= 2)
        for (int64_t j = 0; j < off; j++) add_into(bufs[j], bufs[j + off], count);
    for (int64_t j = 1; j < n; j++) memcpy(bufs[j], bufs[0], sizeof(float) * (size_t)count);
    return 0;
}
