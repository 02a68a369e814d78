/*
 * Normal mode on the CUDA backend: checked against the oracle, then timed: dispatch,
 * cached dispatch, and combine both ways, with its input in the buffer's combine-input
 * view (epx_get_combine_input: expert outputs written there, read in place by the
 * peers; bf16 and fp8 dispatch alike) and from a tensor outside the buffer (one local
 * copy first). The CUDA-graph check combines the dispatch recv_x view in place. Run by
 * scripts/gpu-check:
 *
 *   epx launch -n 8 --mps -- cuda_normal [--tokens 4096] [--hidden 7168]
 *        [--experts 256] [--topk 8] [--sms 16] [--warmup 5] [--iters 20] [--check 1]
 *
 * Rank 0 prints one line per (dtype, op): median and p10/p90 over the timed runs (CUDA
 * events on rank 0's stream, all ranks started together), the payload of all ranks,
 * and the time over the floor 2 * payload / copy bandwidth (measured here first).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "epx.h"
#include "moe_case.h"

#define CUDA_OK(call)                                                                    \
    do {                                                                                 \
        cudaError_t err_ = (call);                                                       \
        if (err_ != cudaSuccess) {                                                       \
            fprintf(stderr, "cuda_normal: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,   \
                    cudaGetErrorString(err_));                                           \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

#define EPX_OK(call)                                                                     \
    do {                                                                                 \
        epx_status_t st_ = (call);                                                       \
        if (st_ != EPX_SUCCESS) {                                                        \
            fprintf(stderr, "cuda_normal: rank %d: %s: %s: %s\n", g_rank, #call,         \
                    epx_status_name(st_), epx_last_error());                             \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

enum { OP_DISPATCH, OP_COMBINE_VIEW, OP_COMBINE_COPY, OP_CACHED, OP_COMBINE_REGISTERED, OP_COUNT };
static const char *op_names[OP_COUNT] = {"dispatch", "combine (input view)",
                                         "combine (x copied in)", "cached dispatch",
                                         "combine (x registered)"};

static int g_rank = -1;
static int g_failures = 0;

static long long flag_value(int argc, char **argv, const char *name, long long fallback)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return atoll(argv[i + 1]);
    return fallback;
}

static void *to_device(const void *host, size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes > 0 ? bytes : 16));
    if (bytes > 0)
        CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
}

/* Rows of a (possibly strided) device tensor, compared bytewise with the expected. */
/* Elements between rows of a result view (its strides, or contiguous when they are 0). */
static int64_t row_stride(const epx_tensor_t *t)
{
    if (t->strides[0] != 0)
        return t->strides[0];
    return t->ndim == 3 ? t->shape[1] * t->shape[2] : t->ndim == 2 ? t->shape[1] : 1;
}

static void check_rows(const char *what, const epx_tensor_t *t, const void *want, int64_t rows,
                       int64_t row_bytes)
{
    if (rows == 0)
        return;
    char *got = malloc((size_t)(rows * row_bytes));
    size_t pitch = (size_t)(row_stride(t) * (int64_t)epx_dtype_size(t->dtype));
    CUDA_OK(cudaMemcpy2D(got, (size_t)row_bytes, t->data, pitch, (size_t)row_bytes, (size_t)rows,
                         cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < rows; r++)
        if (memcmp(got + r * row_bytes, (const char *)want + r * row_bytes, (size_t)row_bytes)) {
            fprintf(stderr, "cuda_normal: rank %d: %s differs at row %lld\n", g_rank, what,
                    (long long)r);
            g_failures++;
            break;
        }
    free(got);
}

static void check_combine(const char *what, const moe_case_t *c, const void *out_device,
                          int64_t tokens)
{
    uint16_t *want = NULL;
    if (moe_oracle_combine(c, g_rank, &want) != 0)
        exit(1);
    size_t bytes = (size_t)(tokens * c->hidden) * 2;
    uint16_t *got = malloc(bytes + 2);
    CUDA_OK(cudaMemcpy(got, out_device, bytes, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < tokens * c->hidden; i++)
        if (got[i] != want[i]) {
            fprintf(stderr, "cuda_normal: rank %d: %s differs at token %lld column %lld: "
                    "got 0x%04x expected 0x%04x\n", g_rank, what, (long long)(i / c->hidden),
                    (long long)(i % c->hidden), got[i], want[i]);
            g_failures++;
            break;
        }
    free(got);
    free(want);
}

static int compare_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Device-to-device copy bandwidth, counting bytes read plus written (rank 0 only). */
static double copy_bandwidth_gbps(void)
{
    size_t bytes = (size_t)1 << 31;
    void *a = NULL, *b = NULL;
    CUDA_OK(cudaMalloc(&a, bytes));
    CUDA_OK(cudaMalloc(&b, bytes));
    CUDA_OK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    double best = 1e30;
    for (int i = 0; i < 6; i++) {
        CUDA_OK(cudaEventRecord(e0, 0));
        CUDA_OK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        if (i > 0 && ms < best)
            best = ms;
    }
    cudaFree(a);
    cudaFree(b);
    return 2.0 * (double)bytes / (best * 1e-3) / 1e9;
}

/*
 * Worst-case dispatch + in-place combine captured in a CUDA graph and replayed: no host
 * sync inside, the device epoch advances per replay, and the round trip comes back as
 * x * (ranks that received the token) (exact in fp32 for bf16 inputs).
 */
static void check_graph(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                        const moe_case_t *c, const moe_expected_t *e, const moe_inputs_t *in,
                        cudaStream_t stream)
{
    int64_t T = c->num_tokens, H = c->hidden;
    void *out = NULL;
    CUDA_OK(cudaMalloc(&out, (size_t)(T * H) * 2 + 16));
    epx_dispatch_args_t wargs = *args;
    wargs.flags = EPX_DISPATCH_WORST_CASE;
    epx_dispatch_result_t wres = EPX_DISPATCH_RESULT_INIT;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    EPX_OK(epx_dispatch(buffer, &wargs, &wres, stream));
    epx_combine_args_t back = EPX_COMBINE_ARGS_INIT;
    back.handle = wres.handle;
    back.x = wres.recv_x;
    back.out_x = epx_tensor_2d(out, EPX_DTYPE_BF16, T, H);
    EPX_OK(epx_combine(buffer, &back, stream));
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    uint16_t *got = malloc((size_t)(T * H) * 2 + 2);
    for (int replay = 0; replay < 3; replay++) {
        CUDA_OK(cudaMemset(out, 0xff, (size_t)(T * H) * 2));
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        int32_t rows = -1;
        CUDA_OK(cudaMemcpy(&rows, wres.num_recv_tokens_device, 4, cudaMemcpyDeviceToHost));
        if (rows != e->num_recv) {
            fprintf(stderr, "cuda_normal: rank %d: graph replay %d: %d rows on the device, "
                    "expected %lld\n", g_rank, replay, rows, (long long)e->num_recv);
            g_failures++;
        }
        CUDA_OK(cudaMemcpy(got, out, (size_t)(T * H) * 2, cudaMemcpyDeviceToHost));
        for (int64_t t = 0; t < T; t++) {
            int receivers = 0;
            for (int r = 0; r < c->world_size; r++)
                receivers += e->is_token_in_rank[t * c->world_size + r];
            for (int64_t i = 0; i < H; i++) {
                float x = moe_bf16_to_float(((const uint16_t *)in->x)[t * H + i]);
                uint16_t want = moe_float_to_bf16(x * (float)receivers);
                if (got[t * H + i] != want) {
                    fprintf(stderr, "cuda_normal: rank %d: graph replay %d: token %lld column "
                            "%lld: got 0x%04x expected 0x%04x\n", g_rank, replay, (long long)t,
                            (long long)i, got[t * H + i], want);
                    g_failures++;
                    t = T;
                    break;
                }
            }
        }
    }
    epx_status_t async = EPX_SUCCESS;
    char message[256];
    EPX_OK(epx_get_async_error(buffer, &async, message, sizeof(message)));
    if (async != EPX_SUCCESS) {
        fprintf(stderr, "cuda_normal: rank %d: after graph replays: %s: %s\n", g_rank,
                epx_status_name(async), message);
        g_failures++;
    }
    if (g_rank == 0)
        printf("RESULT bf16  graph (worst-case dispatch + in-place combine): 3 replays %s\n",
               g_failures == 0 ? "checked" : "FAILED");
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    EPX_OK(epx_handle_destroy(wres.handle));
    free(got);
    cudaFree(out);
}

static void run_dtype(epx_group_t group, const epx_group_info_t *info, epx_dtype_t dtype,
                      int argc, char **argv, double copy_gbps)
{
    int fp8 = dtype == EPX_DTYPE_FP8_E4M3;
    moe_case_t c = {info->world_size, flag_value(argc, argv, "--tokens", 4096),
                    flag_value(argc, argv, "--hidden", 7168),
                    (int)flag_value(argc, argv, "--experts", 256),
                    (int)flag_value(argc, argv, "--topk", 8), dtype, 1,
                    (uint64_t)flag_value(argc, argv, "--seed", 7), MOE_ROUTING_RANDOM, 0.0, -1,
                    info->ranks_per_node, 0, 0};
    int check = (int)flag_value(argc, argv, "--check", 1);
    int warmup = (int)flag_value(argc, argv, "--warmup", 5);
    int iters = (int)flag_value(argc, argv, "--iters", 20);
    int64_t T = c.num_tokens, H = c.hidden, K = c.num_topk;
    size_t elem = fp8 ? 1 : 2;

    moe_inputs_t in;
    if (moe_inputs_make(&c, g_rank, &in) != 0)
        exit(1);
    void *x = to_device(in.x, (size_t)(T * H) * elem);
    void *scales = fp8 ? to_device(in.x_scales, (size_t)(T * (H / 128)) * 4) : NULL;
    void *idx = to_device(in.topk_idx, (size_t)(T * K) * 8);
    void *weights = to_device(in.topk_weights, (size_t)(T * K) * 4);
    void *out = NULL;
    CUDA_OK(cudaMalloc(&out, (size_t)(T * H) * 2 + 16));

    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = T;
    config.hidden = H;
    config.num_experts = c.num_experts;
    config.num_topk = c.num_topk;
    config.dispatch_dtype = dtype;
    config.num_sms = (int)flag_value(argc, argv, "--sms", 16);
    epx_buffer_t buffer;
    EPX_OK(epx_buffer_create(group, &config, &buffer));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(x, dtype, T, H);
    if (fp8)
        args.x_scales = epx_tensor_2d(scales, EPX_DTYPE_FP32, T, H / 128);
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, T, K);
    args.topk_weights = epx_tensor_2d(weights, EPX_DTYPE_FP32, T, K);

    /* ---- checked run: dispatch, combine from the input view / copied in, cached dispatch */
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    EPX_OK(epx_dispatch(buffer, &args, &res, stream));
    int64_t n = res.num_recv_tokens;
    moe_expected_t e;
    memset(&e, 0, sizeof(e));
    uint16_t *combine_rows = calloc((size_t)(n * H) + 1, 2);
    void *combine_x = NULL, *registered_x = NULL;
    CUDA_OK(cudaMalloc(&combine_x, (size_t)(n * H) * 2 + 16));
    /* A second separate x, registered: the peers read it in place (epx_buffer_register),
     * in an allocation of a multiple of 2 MiB (moe_registered_size). */
    const size_t registered_bytes = moe_registered_size((size_t)(n * H) * 2 + 16);
    CUDA_OK(cudaMalloc(&registered_x, registered_bytes));
    EPX_OK(epx_buffer_register(buffer, registered_x, registered_bytes));
    CUDA_OK(cudaStreamSynchronize(stream));
    if (check) {
        if (moe_oracle_dispatch(&c, g_rank, &e) != 0)
            exit(1);
        if (e.num_recv != n) {
            fprintf(stderr, "cuda_normal: rank %d: received %lld rows, expected %lld\n", g_rank,
                    (long long)n, (long long)e.num_recv);
            exit(1);
        }
        check_rows("recv_x", &res.recv_x, e.recv_x, n, H * (int64_t)elem);
        if (fp8)
            check_rows("recv_x_scales", &res.recv_x_scales, e.recv_x_scales, n, (H / 128) * 4);
        check_rows("recv_topk_idx", &res.recv_topk_idx, e.recv_topk_idx, n, K * 8);
        check_rows("recv_topk_weights", &res.recv_topk_weights, e.recv_topk_weights, n, K * 4);
        if (memcmp(res.num_recv_tokens_per_expert, e.num_recv_per_expert,
                   (size_t)e.num_local_experts * 4)) {
            fprintf(stderr, "cuda_normal: rank %d: per-expert counts differ\n", g_rank);
            g_failures++;
        }
        for (int64_t i = 0; i < n; i++)
            moe_combine_row(&c, g_rank, e.recv_src_rank[i], e.recv_src_token[i],
                            combine_rows + i * H);
        CUDA_OK(cudaMemcpy(combine_x, combine_rows, (size_t)(n * H) * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(registered_x, combine_rows, (size_t)(n * H) * 2,
                           cudaMemcpyHostToDevice));
    }
    epx_combine_args_t back = EPX_COMBINE_ARGS_INIT;
    back.handle = res.handle;
    back.out_x = epx_tensor_2d(out, EPX_DTYPE_BF16, T, H);
    /* Expert outputs written into the combine-input view: the zero-copy path. They are
     * written once: no operation writes the region, so the timed runs reuse them. */
    epx_tensor_t view = EPX_TENSOR_NONE;
    EPX_OK(epx_get_combine_input(buffer, res.handle, &view));
    if (view.shape[0] != n || view.shape[1] != H || view.dtype != EPX_DTYPE_BF16) {
        fprintf(stderr, "cuda_normal: rank %d: combine input view is [%lld, %lld] %s, expected "
                "[%lld, %lld] bf16\n", g_rank, (long long)view.shape[0],
                (long long)view.shape[1], epx_dtype_name(view.dtype), (long long)n,
                (long long)H);
        exit(1);
    }
    CUDA_OK(cudaMemcpy(view.data, combine_rows, (size_t)(n * H) * 2, cudaMemcpyHostToDevice));
    /* A copy from pageable memory may still be landing when cudaMemcpy returns, and the
     * operations run on a non-blocking stream: wait for it. */
    CUDA_OK(cudaDeviceSynchronize());
    /* The same rows three ways: in the view, in a separate tensor, in a registered one. */
    const struct {
        int op;
        epx_tensor_t x;
    } combines[] = {{OP_COMBINE_VIEW, view},
                    {OP_COMBINE_COPY, epx_tensor_2d(combine_x, EPX_DTYPE_BF16, n, H)},
                    {OP_COMBINE_REGISTERED, epx_tensor_2d(registered_x, EPX_DTYPE_BF16, n, H)}};
    for (size_t i = 0; i < sizeof(combines) / sizeof(combines[0]); i++) {
        back.x = combines[i].x;
        CUDA_OK(cudaMemset(out, 0xff, (size_t)(T * H) * 2));
        EPX_OK(epx_combine(buffer, &back, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        if (check)
            check_combine(op_names[combines[i].op], &c, out, T);
    }
    epx_dispatch_args_t cached_args = EPX_DISPATCH_ARGS_INIT;
    cached_args.x = args.x;
    cached_args.x_scales = args.x_scales;
    cached_args.handle = res.handle;
    epx_dispatch_result_t cached = EPX_DISPATCH_RESULT_INIT;
    EPX_OK(epx_dispatch(buffer, &cached_args, &cached, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    if (check)
        check_rows("cached recv_x", &cached.recv_x, e.recv_x, n, H * (int64_t)elem);
    EPX_OK(epx_handle_destroy(res.handle));
    if (check && !fp8 && flag_value(argc, argv, "--graph", 1))
        check_graph(buffer, &args, &c, &e, &in, stream);

    /* ---- timed runs */
    cudaEvent_t ev[OP_COUNT + 1];
    for (int i = 0; i <= OP_COUNT; i++)
        CUDA_OK(cudaEventCreate(&ev[i]));
    double *times[OP_COUNT];
    for (int op = 0; op < OP_COUNT; op++)
        times[op] = calloc((size_t)iters + 1, sizeof(double));
    for (int it = 0; it < warmup + iters; it++) {
        EPX_OK(epx_group_barrier(group));
        CUDA_OK(cudaEventRecord(ev[0], stream));
        EPX_OK(epx_dispatch(buffer, &args, &res, stream));
        CUDA_OK(cudaEventRecord(ev[1], stream));
        back.handle = res.handle;
        EPX_OK(epx_get_combine_input(buffer, res.handle, &back.x));
        EPX_OK(epx_combine(buffer, &back, stream));
        CUDA_OK(cudaEventRecord(ev[2], stream));
        back.x = epx_tensor_2d(combine_x, EPX_DTYPE_BF16, n, H);
        EPX_OK(epx_combine(buffer, &back, stream));
        CUDA_OK(cudaEventRecord(ev[3], stream));
        cached_args.handle = res.handle;
        EPX_OK(epx_dispatch(buffer, &cached_args, &cached, stream));
        CUDA_OK(cudaEventRecord(ev[4], stream));
        back.x = epx_tensor_2d(registered_x, EPX_DTYPE_BF16, n, H);
        EPX_OK(epx_combine(buffer, &back, stream));
        CUDA_OK(cudaEventRecord(ev[5], stream));
        CUDA_OK(cudaEventSynchronize(ev[5]));
        EPX_OK(epx_handle_destroy(res.handle));
        for (int op = 0; it >= warmup && op < OP_COUNT; op++) {
            float ms = 0;
            CUDA_OK(cudaEventElapsedTime(&ms, ev[op], ev[op + 1]));
            times[op][it - warmup] = ms * 1000.0;
        }
    }
    epx_status_t async = EPX_SUCCESS;
    char message[256];
    EPX_OK(epx_get_async_error(buffer, &async, message, sizeof(message)));
    if (async != EPX_SUCCESS) {
        fprintf(stderr, "cuda_normal: rank %d: async error %s: %s\n", g_rank,
                epx_status_name(async), message);
        g_failures++;
    }

    /* Payload of every rank (the floor counts all bytes received by all ranks). */
    int64_t *all = calloc((size_t)info->world_size, sizeof(int64_t));
    EPX_OK(epx_group_allgather(group, &n, all, sizeof(n)));
    int64_t rows_total = 0;
    for (int r = 0; r < info->world_size; r++)
        rows_total += all[r];
    if (g_rank == 0) {
        for (int op = 0; op < OP_COUNT; op++) {
            qsort(times[op], (size_t)iters, sizeof(double), compare_double);
            int64_t row = (op == OP_DISPATCH || op == OP_CACHED)
                              ? H * (int64_t)elem + (fp8 ? (H / 128) * 4 : 0)
                              : H * 2;
            double payload = (double)rows_total * (double)row;
            double floor_us = 2.0 * payload / (copy_gbps * 1e9) * 1e6;
            double med = times[op][iters / 2];
            printf("RESULT %-5s %-22s median %8.1f us  p10 %8.1f  p90 %8.1f  payload %7.1f MB  "
                   "floor %7.1f us  x%.2f of floor  (%d SMs/rank)\n",
                   fp8 ? "fp8" : "bf16", op_names[op], med, times[op][iters / 10],
                   times[op][(iters * 9) / 10], payload / 1e6, floor_us, med / floor_us,
                   config.num_sms);
        }
        fflush(stdout);
    }
    free(all);
    for (int op = 0; op < OP_COUNT; op++)
        free(times[op]);
    EPX_OK(epx_buffer_deregister(buffer, registered_x));
    EPX_OK(epx_buffer_destroy(buffer));
    cudaStreamDestroy(stream);
    cudaFree(x);
    cudaFree(scales);
    cudaFree(idx);
    cudaFree(weights);
    cudaFree(out);
    cudaFree(combine_x);
    cudaFree(registered_x);
    free(combine_rows);
    if (check)
        moe_expected_free(&e);
    moe_inputs_free(&in);
}

int main(int argc, char **argv)
{
    epx_group_t group;
    epx_status_t status = epx_group_create_from_env(EPX_BACKEND_CUDA, &group);
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "cuda_normal: group: %s: %s\n", epx_status_name(status), epx_last_error());
        return 1;
    }
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    EPX_OK(epx_group_get_info(group, &info));
    g_rank = info.rank;
    CUDA_OK(cudaSetDevice(info.device));
    double copy_gbps = 4250.0;
    if (info.rank == 0) {
        copy_gbps = copy_bandwidth_gbps();
        printf("RESULT copy bandwidth (read + write) %.0f GB/s on device %d\n", copy_gbps,
               info.device);
    }
    long long with_fp8 = flag_value(argc, argv, "--fp8", 1);
    run_dtype(group, &info, EPX_DTYPE_BF16, argc, argv, copy_gbps);
    if (with_fp8)
        run_dtype(group, &info, EPX_DTYPE_FP8_E4M3, argc, argv, copy_gbps);
    EPX_OK(epx_group_destroy(group));
    if (g_failures > 0) {
        fprintf(stderr, "cuda_normal: rank %d: %d check(s) failed\n", g_rank, g_failures);
        return 1;
    }
    if (g_rank == 0)
        printf("cuda_normal: all checks passed\n");
    return 0;
}
