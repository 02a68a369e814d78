/*
 * Rejected inputs of the low-latency entry points (one rank). Each is refused before
 * anything is sent, so unlike normal mode the buffer stays usable: the last case runs
 * a valid step on the same buffer. Expert ids out of range are the exception on the GPU,
 * where only the kernels read topk_idx: they treat the entry as -1 and report it
 * asynchronously (dispatch and combine, short and long routing, outputs checked).
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bad_input.h"
#include "mem.h"
#include "test_util.h"

#define LL_HIDDEN 256
#define LL_TOKENS 4

static epx_buffer_t ll_buffer_of(int64_t hidden, int64_t max_ll, epx_dtype_t ll_dtype)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = BI_MAX_TOKENS;
    config.hidden = hidden;
    config.num_experts = BI_EXPERTS_PER_RANK * bi_info.world_size;
    config.num_topk = BI_TOPK;
    config.max_low_latency_tokens = max_ll;
    config.low_latency_dtype = ll_dtype;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(bi_group, &config, &buffer));
    return buffer;
}

static epx_buffer_t ll_buffer(int64_t hidden, int64_t max_ll)
{
    return ll_buffer_of(hidden, max_ll, EPX_DTYPE_BF16);
}

static uint16_t x_data[BI_MAX_TOKENS * 2 * 512];
static int64_t idx_data[BI_MAX_TOKENS * 2 * BI_TOPK];
static float weight_data[BI_MAX_TOKENS * 2 * BI_TOPK];

/* bi_run_ll_cases' inputs and output in the memory the backend uses (device memory on
 * the GPU): the routing is written to idx_data, then uploaded (ll_upload_idx). */
static struct {
    uint16_t *x, *out;
    int64_t *idx;
    float *weights;
} ll_mem;

static void ll_upload_idx(int64_t tokens)
{
    mr_mem_to_device(ll_mem.idx, idx_data, (size_t)(tokens * BI_TOPK) * sizeof(int64_t));
}

static epx_ll_dispatch_args_t ll_args(int64_t hidden, int64_t tokens)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    for (int64_t i = 0; i < tokens * BI_TOPK; i++)
        idx_data[i] = i % BI_EXPERTS_PER_RANK;
    ll_upload_idx(tokens);
    args.x = epx_tensor_2d(ll_mem.x, EPX_DTYPE_BF16, tokens, hidden);
    args.topk_idx = epx_tensor_2d(ll_mem.idx, EPX_DTYPE_INT64, tokens, BI_TOPK);
    return args;
}

static epx_ll_combine_args_t ll_combine_args(epx_ll_handle_t handle, epx_tensor_t x)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = x;
    args.topk_idx = epx_tensor_2d(ll_mem.idx, EPX_DTYPE_INT64, LL_TOKENS, BI_TOPK);
    args.topk_weights = epx_tensor_2d(ll_mem.weights, EPX_DTYPE_FP32, LL_TOKENS, BI_TOPK);
    args.out = epx_tensor_2d(ll_mem.out, EPX_DTYPE_BF16, LL_TOKENS, LL_HIDDEN);
    return args;
}

/* Combine arguments for a step dispatched with `dispatched`: its handle, the step's
 * combine buffer as x, the same routing, `weights` (out is left to the caller). */
static epx_ll_combine_args_t ll_combine_for(epx_buffer_t buffer, epx_ll_handle_t handle,
                                            const epx_ll_dispatch_args_t *dispatched,
                                            float *weights)
{
    epx_ll_combine_args_t back = EPX_LL_COMBINE_ARGS_INIT;
    back.handle = handle;
    CHECK_OK(epx_ll_get_combine_buffer(buffer, handle, &back.x));
    back.topk_idx = dispatched->topk_idx;
    back.topk_weights =
        epx_tensor_2d(weights, EPX_DTYPE_FP32, dispatched->topk_idx.shape[0], BI_TOPK);
    return back;
}

/* out[t][*] == want[t] for every token (bf16 bits). */
static void ll_check_out(const char *what, const uint16_t *want, int64_t tokens)
{
    uint16_t *out = malloc((size_t)(tokens * LL_HIDDEN) * 2);
    CHECK(out != NULL);
    mr_mem_to_host(out, ll_mem.out, (size_t)(tokens * LL_HIDDEN) * 2);
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < LL_HIDDEN; h++)
            if (out[t * LL_HIDDEN + h] != want[t])
                TEST_FAIL("%s: out[%lld][%lld] is 0x%04x, expected 0x%04x", what, (long long)t,
                          (long long)h, out[t * LL_HIDDEN + h], want[t]);
    free(out);
}

/*
 * A bad expert id in a combine's topk_idx. The host refuses it where it reads topk_idx
 * (CPU backend); the GPU kernels treat the entry as -1 and report it asynchronously. A
 * buffer of its own: the failure record keeps the first bad id of a buffer only.
 * Values: expert outputs all 1.0, weights 0.25, so a token's output is 0.25 per entry
 * that counts (0.5 with both, 0.25 without the bad one).
 */
static void ll_combine_bad_id_case(void)
{
    const int64_t tokens = LL_TOKENS;
    epx_buffer_t buffer = ll_buffer(LL_HIDDEN, BI_MAX_TOKENS);
    epx_ll_dispatch_args_t args = ll_args(LL_HIDDEN, tokens);
    epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
    epx_tensor_t x;
    CHECK_OK(epx_ll_get_combine_buffer(buffer, result.handle, &x));
    size_t x_elems = (size_t)(x.shape[0] * x.shape[1] * x.shape[2]);
    uint16_t *ones = malloc(x_elems * 2);
    CHECK(ones != NULL);
    for (size_t i = 0; i < x_elems; i++)
        ones[i] = 0x3f80; /* 1.0 */
    mr_mem_to_device(x.data, ones, x_elems * 2);
    free(ones);
    for (int64_t i = 0; i < tokens * BI_TOPK; i++)
        weight_data[i] = 0.25f;
    mr_mem_to_device(ll_mem.weights, weight_data, (size_t)(tokens * BI_TOPK) * sizeof(float));
    idx_data[2 * BI_TOPK + 1] = BI_EXPERTS_PER_RANK * bi_info.world_size;
    ll_upload_idx(tokens);

    epx_ll_combine_args_t back = ll_combine_args(result.handle, x);
    uint16_t want[LL_TOKENS] = {0x3f00, 0x3f00, 0x3f00, 0x3f00}; /* 0.5 */
    if (mr_mem_is_device()) {
        CHECK_OK(epx_ll_combine(buffer, &back, NULL, NULL));
        bi_expect_async(buffer, "ll: combine expert id out of range (async)",
                        "ll_combine: topk_idx[2][1] is");
        want[2] = 0x3e80; /* 0.25: the bad entry counted as -1 */
    } else {
        bi_expect("ll: combine expert id out of range", epx_ll_combine(buffer, &back, NULL, NULL),
                  EPX_ERR_INVALID_ARG, "topk_idx");
        idx_data[2 * BI_TOPK + 1] = (2 * BI_TOPK + 1) % BI_EXPERTS_PER_RANK;
        ll_upload_idx(tokens);
        CHECK_OK(epx_ll_combine(buffer, &back, NULL, NULL));
    }
    ll_check_out("ll: combine after a bad id", want, tokens);
    CHECK_OK(epx_buffer_destroy(buffer));
}

/*
 * A bad expert id in a dispatch of more than 2048 top-k entries (the GPU's kernels 2 read
 * such routing without their cache), late in the token range. Host: refused; GPU: the
 * step completes and the async error names the entry.
 */
static void ll_long_dispatch_bad_id_case(void)
{
    const int64_t tokens = 1040, entries = tokens * BI_TOPK;
    epx_buffer_t buffer = ll_buffer(LL_HIDDEN, tokens);
    uint16_t *x_host = calloc((size_t)(tokens * LL_HIDDEN), 2);
    int64_t *idx_host = malloc((size_t)entries * sizeof(int64_t));
    float *weights_host = malloc((size_t)entries * sizeof(float));
    CHECK(x_host != NULL && idx_host != NULL && weights_host != NULL);
    for (int64_t i = 0; i < entries; i++) {
        idx_host[i] = i % BI_EXPERTS_PER_RANK;
        weights_host[i] = 0.25f;
    }
    idx_host[1030 * BI_TOPK + 1] = -5;
    void *x = mr_mem_from_host(x_host, (size_t)(tokens * LL_HIDDEN) * 2);
    int64_t *idx = mr_mem_from_host(idx_host, (size_t)entries * sizeof(int64_t));
    float *weights = mr_mem_from_host(weights_host, (size_t)entries * sizeof(float));
    void *out = mr_mem_alloc((size_t)(tokens * LL_HIDDEN) * 2, 0);

    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, tokens, LL_HIDDEN);
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, tokens, BI_TOPK);
    epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
    if (mr_mem_is_device()) {
        CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
        bi_expect_async(buffer, "ll: id out of range, 2080 entries (async)",
                        "ll_dispatch: topk_idx[1030][1] is -5");
        /* The step still combines (the same entry is left out there too). */
        epx_ll_combine_args_t back = ll_combine_for(buffer, result.handle, &args, weights);
        back.out = epx_tensor_2d(out, EPX_DTYPE_BF16, tokens, LL_HIDDEN);
        CHECK_OK(epx_ll_combine(buffer, &back, NULL, NULL));
        mr_mem_sync();
    } else {
        bi_expect("ll: id out of range, 2080 entries",
                  epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_INVALID_ARG,
                  "topk_idx[1030][1]");
    }
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(x);
    mr_mem_free(idx);
    mr_mem_free(weights);
    mr_mem_free(out);
    free(x_host);
    free(idx_host);
    free(weights_host);
}

/* One call of the operation under test, for ll_wait_stats_refusals. */
typedef struct {
    epx_buffer_t buffer;
    epx_ll_dispatch_args_t *dispatch; /* or NULL: the combine */
    epx_ll_dispatch_result_t *result;
    epx_ll_combine_args_t *combine;
} ll_call_t;

static ll_call_t ll_dispatch_call(epx_buffer_t buffer, epx_ll_dispatch_args_t *args,
                                  epx_ll_dispatch_result_t *result)
{
    return (ll_call_t){buffer, args, result, NULL};
}

static ll_call_t ll_combine_call(epx_buffer_t buffer, epx_ll_combine_args_t *args)
{
    return (ll_call_t){buffer, NULL, NULL, args};
}

static epx_status_t ll_call(const ll_call_t *call)
{
    if (call->dispatch != NULL)
        return epx_ll_dispatch(call->buffer, call->dispatch, call->result, NULL);
    return epx_ll_combine(call->buffer, call->combine, NULL, NULL);
}

/*
 * Every refusal of wait_recv_cost_stats ([R] int64, 1-d, contiguous), through `stats`,
 * the field of the args that `call` passes; the field is left not given. (A strided
 * tensor is refused too, but needs two ranks to be one: tests/multirank/test_ll.c.)
 */
static void ll_wait_stats_refusals(const char *op, epx_tensor_t *stats, ll_call_t call)
{
    char what[96];
    const int64_t world = bi_info.world_size;
    *stats = epx_tensor_1d(ll_mem.idx, EPX_DTYPE_INT32, world);
    snprintf(what, sizeof(what), "ll: %s wait_recv_cost_stats dtype", op);
    bi_expect(what, ll_call(&call), EPX_ERR_INVALID_ARG, "wait_recv_cost_stats");
    CHECK_ERROR_MENTIONS("expected int64");
    *stats = epx_tensor_1d(ll_mem.idx, EPX_DTYPE_INT64, world + 1);
    snprintf(what, sizeof(what), "ll: %s wait_recv_cost_stats length", op);
    bi_expect(what, ll_call(&call), EPX_ERR_INVALID_ARG, "wait_recv_cost_stats");
    *stats = epx_tensor_2d(ll_mem.idx, EPX_DTYPE_INT64, 1, world);
    snprintf(what, sizeof(what), "ll: %s wait_recv_cost_stats 2-d", op);
    bi_expect(what, ll_call(&call), EPX_ERR_INVALID_ARG, "wait_recv_cost_stats");
    CHECK_ERROR_MENTIONS("expected 1");
    *stats = epx_tensor_1d(ll_mem.idx, EPX_DTYPE_INT64, world);
    stats->strides[0] = -1;
    snprintf(what, sizeof(what), "ll: %s wait_recv_cost_stats negative stride", op);
    bi_expect(what, ll_call(&call), EPX_ERR_INVALID_ARG, "wait_recv_cost_stats");
    *stats = (epx_tensor_t)EPX_TENSOR_NONE;
}

void bi_run_ll_cases(void)
{
    ll_mem.x = mr_mem_alloc(sizeof(x_data), 0);
    ll_mem.out = mr_mem_alloc(sizeof(x_data), 0);
    ll_mem.idx = mr_mem_alloc(sizeof(idx_data), 0);
    ll_mem.weights = mr_mem_alloc(sizeof(weight_data), 0);
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = BI_MAX_TOKENS;
    config.hidden = LL_HIDDEN;
    config.num_experts = BI_EXPERTS_PER_RANK;
    config.num_topk = BI_TOPK;
    config.max_low_latency_tokens = -1;
    epx_buffer_t none = NULL;
    bi_expect("ll: negative max_low_latency_tokens", epx_buffer_create(bi_group, &config, &none),
              EPX_ERR_INVALID_ARG, "max_low_latency_tokens");
    config.max_low_latency_tokens = BI_MAX_TOKENS;
    config.low_latency_dtype = EPX_DTYPE_FP32;
    size_t bytes = 0;
    bi_expect("ll: buffer_size with low_latency_dtype fp32",
              epx_buffer_size(bi_group, &config, &bytes), EPX_ERR_INVALID_ARG,
              "config.low_latency_dtype");
    CHECK_ERROR_MENTIONS("fp32");
    bi_expect("ll: low_latency_dtype fp32", epx_buffer_create(bi_group, &config, &none),
              EPX_ERR_INVALID_ARG, "config.low_latency_dtype");
    CHECK(none == NULL);
    config.low_latency_dtype = EPX_DTYPE_FP8_E4M3;
    config.hidden = 64;
    bi_expect("ll: low_latency_dtype fp8 with hidden 64",
              epx_buffer_create(bi_group, &config, &none), EPX_ERR_INVALID_ARG,
              "config.hidden");
    CHECK(none == NULL);
    /* A config from before the field was appended (size up to it) ignores whatever lies
     * there and sizes for bf16, as 0 does. */
    config.hidden = LL_HIDDEN;
    config.low_latency_dtype = EPX_DTYPE_BF16;
    size_t bf16_bytes = 0;
    CHECK_OK(epx_buffer_size(bi_group, &config, &bf16_bytes));
    config.low_latency_dtype = EPX_DTYPE_INVALID;
    CHECK_OK(epx_buffer_size(bi_group, &config, &bytes));
    CHECK_EQ_INT(bytes, bf16_bytes);
    config.low_latency_dtype = EPX_DTYPE_FP32;
    config.size = offsetof(epx_buffer_config_t, low_latency_dtype);
    CHECK_OK(epx_buffer_size(bi_group, &config, &bytes));
    CHECK_EQ_INT(bytes, bf16_bytes);

    epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
    epx_ll_dispatch_args_t args;
    epx_buffer_t off = ll_buffer(LL_HIDDEN, 0);
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    bi_expect("ll: dispatch on a buffer without it", epx_ll_dispatch(off, &args, &result, NULL),
              EPX_ERR_INVALID_STATE, "max_low_latency_tokens");
    CHECK_OK(epx_buffer_destroy(off));

    epx_buffer_t buffer = ll_buffer(LL_HIDDEN, BI_MAX_TOKENS);
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.size = 8;
    bi_expect("ll: dispatch args.size", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "size");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    bi_expect("ll: dispatch NULL args", epx_ll_dispatch(buffer, NULL, &result, NULL),
              EPX_ERR_INVALID_ARG, "args");
    CHECK_ERROR_MENTIONS("args is NULL");
    bi_expect("ll: dispatch NULL result", epx_ll_dispatch(buffer, &args, NULL, NULL),
              EPX_ERR_INVALID_ARG, "result");
    CHECK_ERROR_MENTIONS("result is NULL");
    result.size += 8;
    bi_expect("ll: dispatch result.size", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "EPX_LL_DISPATCH_RESULT_INIT");
    result.size -= 8;
    args.x.dtype = EPX_DTYPE_FP32;
    bi_expect("ll: x not bf16", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "x");
    args = ll_args(LL_HIDDEN, BI_MAX_TOKENS + 1);
    bi_expect("ll: more tokens than max_low_latency_tokens",
              epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_CAPACITY, "x");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.cumulative_local_expert_recv_stats =
        epx_tensor_1d(ll_mem.idx, EPX_DTYPE_INT32, BI_EXPERTS_PER_RANK + 1);
    bi_expect("ll: cumulative_local_expert_recv_stats length",
              epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_INVALID_ARG,
              "cumulative_local_expert_recv_stats");
    args.cumulative_local_expert_recv_stats.shape[0] = BI_EXPERTS_PER_RANK;
    args.cumulative_local_expert_recv_stats.dtype = EPX_DTYPE_INT64;
    bi_expect("ll: cumulative_local_expert_recv_stats dtype",
              epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_INVALID_ARG,
              "cumulative_local_expert_recv_stats");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    ll_wait_stats_refusals("ll_dispatch", &args.wait_recv_cost_stats,
                           ll_dispatch_call(buffer, &args, &result));
    /* Args of the sizes from before wait_recv_cost_stats and before
     * cumulative_local_expert_recv_stats: what lies past them is not read (a valid step). */
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.wait_recv_cost_stats = epx_tensor_1d(ll_mem.idx, EPX_DTYPE_INT32, 99);
    args.size = offsetof(epx_ll_dispatch_args_t, wait_recv_cost_stats);
    CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
    args.cumulative_local_expert_recv_stats = args.wait_recv_cost_stats;
    args.size = offsetof(epx_ll_dispatch_args_t, cumulative_local_expert_recv_stats);
    CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.topk_idx.shape[1] = BI_TOPK + 1;
    bi_expect("ll: topk_idx width", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "topk_idx");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    idx_data[3] = BI_EXPERTS_PER_RANK * bi_info.world_size;
    ll_upload_idx(LL_TOKENS);
    if (mr_mem_is_device()) {
        /* The GPU kernels find it (the host never reads topk_idx): the entry is treated
         * as -1, the step completes, the async error names the entry, and the buffer stays
         * usable (the valid steps below run on it). */
        CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
        bi_expect_async(buffer, "ll: expert id out of range (async)",
                        "ll_dispatch: topk_idx[1][1] is");
    } else {
        bi_expect("ll: expert id out of range", epx_ll_dispatch(buffer, &args, &result, NULL),
                  EPX_ERR_INVALID_ARG, "topk_idx");
    }
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.use_fp8 = 1;
    args.use_ue8m0 = 1;
    bi_expect("ll: ue8m0 without round_scale", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "round_scale");
    args.round_scale = 1;
    bi_expect("ll: ue8m0 with hidden 256", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "use_ue8m0");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.round_scale = 1;
    bi_expect("ll: round_scale without fp8", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "use_fp8");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.flags = 0x80;
    bi_expect("ll: unknown flags", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "flags");

    epx_buffer_t narrow = ll_buffer(64, BI_MAX_TOKENS);
    args = ll_args(64, LL_TOKENS);
    args.use_fp8 = 1;
    bi_expect("ll: fp8 with hidden 64", epx_ll_dispatch(narrow, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "use_fp8");
    CHECK_OK(epx_buffer_destroy(narrow));

    /* A buffer sized for fp8 rows refuses a bf16 dispatch before sending anything: the
     * slots do not turn over, so a correct fp8 step on it works right after. */
    epx_buffer_t fp8_only = ll_buffer_of(LL_HIDDEN, BI_MAX_TOKENS, EPX_DTYPE_FP8_E4M3);
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    bi_expect("ll: bf16 dispatch on an fp8-sized buffer",
              epx_ll_dispatch(fp8_only, &args, &result, NULL), EPX_ERR_INVALID_ARG, "use_fp8");
    CHECK_ERROR_MENTIONS("low_latency_dtype");
    args.use_fp8 = 1;
    epx_ll_dispatch_result_t fp8_result = EPX_LL_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_ll_dispatch(fp8_only, &args, &fp8_result, NULL));
    CHECK_EQ_INT(fp8_result.recv_x.dtype, EPX_DTYPE_FP8_E4M3);
    CHECK_EQ_INT(fp8_result.recv_x.shape[2], LL_HIDDEN);
    /* ll_args routes token t to experts 2t and 2t + 1 (mod 8), all rank 0's: rank 0
     * gets one row per top-k entry of every rank, the others none. */
    int32_t counts[BI_EXPERTS_PER_RANK];
    CHECK_EQ_INT(fp8_result.recv_count.shape[0], BI_EXPERTS_PER_RANK);
    mr_mem_to_host(counts, fp8_result.recv_count.data, sizeof(counts));
    int64_t received = 0;
    for (int local = 0; local < BI_EXPERTS_PER_RANK; local++)
        received += counts[local];
    CHECK_EQ_INT(received, bi_info.rank == 0 ? LL_TOKENS * BI_TOPK * bi_info.world_size : 0);
    epx_tensor_t fp8_x;
    CHECK_OK(epx_ll_get_combine_buffer(fp8_only, fp8_result.handle, &fp8_x));
    epx_ll_combine_args_t fp8_back = ll_combine_args(fp8_result.handle, fp8_x);
    CHECK_OK(epx_ll_combine(fp8_only, &fp8_back, NULL, NULL));
    CHECK_OK(epx_buffer_destroy(fp8_only));

    /* A valid step, then bad combines on it. */
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
    epx_tensor_t x;
    CHECK_OK(epx_ll_get_combine_buffer(buffer, result.handle, &x));
    epx_ll_combine_args_t back = ll_combine_args(result.handle, x);
    back.x.shape[1] -= 1;
    bi_expect("ll: combine x shape", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "x");
    back = ll_combine_args(result.handle, x);
    back.out = epx_tensor_2d(ll_mem.out, EPX_DTYPE_BF16, LL_TOKENS + 1, LL_HIDDEN);
    bi_expect("ll: combine out rows", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "out");
    back = ll_combine_args(result.handle, x);
    back.topk_weights.dtype = EPX_DTYPE_BF16;
    bi_expect("ll: combine topk_weights dtype", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "topk_weights");
    bi_expect("ll: combine NULL args", epx_ll_combine(buffer, NULL, NULL, NULL),
              EPX_ERR_INVALID_ARG, "args");
    CHECK_ERROR_MENTIONS("args is NULL");
    back = ll_combine_args(result.handle, x);
    back.size -= 8;
    bi_expect("ll: combine args.size", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "EPX_LL_COMBINE_ARGS_INIT");
    back = ll_combine_args(result.handle, x);
    epx_ll_combine_result_t bad_result = EPX_LL_COMBINE_RESULT_INIT;
    bad_result.size = 4;
    bi_expect("ll: combine result.size", epx_ll_combine(buffer, &back, &bad_result, NULL),
              EPX_ERR_INVALID_ARG, "EPX_LL_COMBINE_RESULT_INIT");
    back.flags = 0x80;
    bi_expect("ll: combine unknown flags", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "flags");
    CHECK_ERROR_MENTIONS("unknown bits");
    back = ll_combine_args(result.handle, (epx_tensor_t)EPX_TENSOR_NONE);
    bi_expect("ll: combine x not given", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "x");
    CHECK_ERROR_MENTIONS("x is required");
    back = ll_combine_args(result.handle, x);
    back.x.dtype = EPX_DTYPE_FP32;
    bi_expect("ll: combine x dtype fp32", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "x");
    CHECK_ERROR_MENTIONS("x has dtype fp32");
    back = ll_combine_args(result.handle, x);
    back.x.strides[2] = 2; /* every other element: not row major */
    back.x.strides[1] = 2 * x.shape[2];
    back.x.strides[0] = 2 * x.shape[1] * x.shape[2];
    bi_expect("ll: combine x strided", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "x");
    CHECK_ERROR_MENTIONS("must be contiguous");
    back = ll_combine_args(result.handle, x);
    back.topk_idx.shape[0] = LL_TOKENS - 1;
    bi_expect("ll: combine topk_idx rows", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "topk_idx");
    back = ll_combine_args(result.handle, x);
    ll_wait_stats_refusals("ll_combine", &back.wait_recv_cost_stats,
                           ll_combine_call(buffer, &back));
    bi_expect("ll: get_combine_buffer NULL x",
              epx_ll_get_combine_buffer(buffer, result.handle, NULL), EPX_ERR_INVALID_ARG, "x");
    CHECK_ERROR_MENTIONS("x is NULL");
    back = ll_combine_args(result.handle, x);
    back.handle.internal[0] ^= 1;
    bi_expect("ll: combine handle of another buffer", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "handle");
    bi_expect("ll: mask an out-of-range rank", epx_ll_mask_rank(buffer, bi_info.world_size),
              EPX_ERR_INVALID_ARG, "rank");
    bi_expect("ll: mask itself", epx_ll_mask_rank(buffer, bi_info.rank), EPX_ERR_INVALID_ARG,
              "rank");
    int32_t mask[1];
    bi_expect("ll: get_masked NULL mask", epx_ll_get_masked(buffer, NULL, bi_info.world_size),
              EPX_ERR_INVALID_ARG, "mask");
    CHECK_ERROR_MENTIONS("mask is NULL");
    /* One entry short of the world size (0 with one rank: this runs with one). */
    bi_expect("ll: get_masked count",
              epx_ll_get_masked(buffer, mask, bi_info.world_size - 1), EPX_ERR_INVALID_ARG,
              "count");
    CHECK_ERROR_MENTIONS("less than the world size");

    /* None of that had an effect: the step still combines. */
    size_t x_bytes = (size_t)(x.shape[0] * x.shape[1] * x.shape[2]) * 2;
    void *zeros = calloc(1, x_bytes);
    CHECK(zeros != NULL);
    mr_mem_to_device(x.data, zeros, x_bytes);
    free(zeros);
    back = ll_combine_args(result.handle, x);
    CHECK_OK(epx_ll_combine(buffer, &back, NULL, NULL));
    /* Combine args of the size from before wait_recv_cost_stats: the field is not read. */
    back.wait_recv_cost_stats = epx_tensor_1d(ll_mem.idx, EPX_DTYPE_INT32, 99);
    back.size = offsetof(epx_ll_combine_args_t, wait_recv_cost_stats);
    CHECK_OK(epx_ll_combine(buffer, &back, NULL, NULL));
    CHECK_OK(epx_buffer_destroy(buffer));
    ll_combine_bad_id_case();
    ll_long_dispatch_bad_id_case();
    mr_mem_free(ll_mem.x);
    mr_mem_free(ll_mem.out);
    mr_mem_free(ll_mem.idx);
    mr_mem_free(ll_mem.weights);
}

void bi_run_ll_alignment_cases(void)
{
    const int64_t hidden = LL_HIDDEN, tokens = LL_TOKENS;
    const size_t x_bytes = (size_t)(tokens * hidden) * 2 + 16;
    epx_buffer_t buffer = ll_buffer(hidden, BI_MAX_TOKENS);
    /* Inputs in the memory the backend uses (device memory on the GPU). */
    for (size_t i = 0; i < x_bytes / 2; i++)
        x_data[i] = (uint16_t)(0x3c00 + (i * 37 + (size_t)bi_info.rank) % 512);
    for (int64_t i = 0; i < tokens * BI_TOPK; i++)
        idx_data[i] = (i * 3 + bi_info.rank) % (BI_EXPERTS_PER_RANK * bi_info.world_size);
    for (int64_t i = 0; i < tokens * BI_TOPK; i++)
        weight_data[i] = 0.25f;
    char *x = mr_mem_from_host(x_data, x_bytes);
    int64_t *idx = mr_mem_from_host(idx_data, (size_t)(tokens * BI_TOPK) * sizeof(int64_t));
    float *weights = mr_mem_from_host(weight_data, (size_t)(tokens * BI_TOPK) * sizeof(float));
    char *out = mr_mem_alloc((size_t)(tokens * hidden) * 2 + 16, 0);

    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, tokens, BI_TOPK);
    epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
    int gpu = bi_info.backend == EPX_BACKEND_CUDA;
    if (gpu) {
        args.x = epx_tensor_2d(x + 2, EPX_DTYPE_BF16, tokens, hidden);
        bi_expect("ll: dispatch x 2 bytes off a 16-byte boundary",
                  epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_INVALID_ARG, "x");
        CHECK_ERROR_MENTIONS("16-byte");
        args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, tokens - 1, hidden);
        args.x.strides[0] = hidden + 4; /* row pitch 2 * (hidden + 4) bytes */
        args.x.strides[1] = 1;
        args.topk_idx.shape[0] = tokens - 1;
        bi_expect("ll: dispatch x rows 8 bytes apart from 16-byte boundaries",
                  epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_INVALID_ARG, "x");
        args.topk_idx.shape[0] = tokens;
    }
    /* Not refused, nothing turned over: a valid step now. */
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, tokens, hidden);
    CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
    epx_ll_combine_args_t back = ll_combine_for(buffer, result.handle, &args, weights);
    if (gpu) {
        back.out = epx_tensor_2d(out + 2, EPX_DTYPE_BF16, tokens, hidden);
        bi_expect("ll: combine out 2 bytes off a 16-byte boundary",
                  epx_ll_combine(buffer, &back, NULL, NULL), EPX_ERR_INVALID_ARG, "out");
        CHECK_ERROR_MENTIONS("16-byte");
    }
    back.out = epx_tensor_2d(out, EPX_DTYPE_BF16, tokens, hidden);
    CHECK_OK(epx_ll_combine(buffer, &back, NULL, NULL));
    CHECK_OK(epx_ll_clean_buffer(buffer, NULL));
    epx_status_t async = EPX_SUCCESS;
    CHECK_OK(epx_get_async_error(buffer, &async, NULL, 0));
    CHECK_EQ_INT(async, EPX_SUCCESS);
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(x);
    mr_mem_free(idx);
    mr_mem_free(weights);
    mr_mem_free(out);
}
