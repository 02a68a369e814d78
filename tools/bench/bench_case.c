/*
 * One `epx bench` case (one dispatch dtype): make the inputs from the seed, run
 * layout, dispatch, cached dispatch and combine both ways once and check them against
 * the oracle, then time the ops together, iteration after iteration.
 *
 * Combine is timed twice. "combine" takes its x from the buffer's combine-input view
 * (epx_get_combine_input), where a caller computes its expert outputs: the fast path,
 * peers read the rows in place. The rows are written there once, before timing: no
 * operation writes the region (the host backend's copy path stages the same rows
 * there, the same values), so they stay valid across iterations. "combine_copy" takes
 * x from a separate tensor, which the backend first copies into the buffer;
 * "combine_registered" from another separate tensor, registered with
 * epx_buffer_register once at setup, which the peers read in place (the CPU backend
 * copies it like any other); "combine_weights" is "combine" with the received top-k
 * weights combined as well (out_topk_weights, what DeepEP's training path asks for).
 *
 * Every rank runs the same sequence of collective calls whatever its check found, so a
 * wrong result on one rank is reported, never turned into a hang on the others.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "moe_case.h"

typedef struct {
    epx_group_t group;
    const epx__bench_options_t *options;
    epx__bench_device_t *device;
    int rank;
    int world_size;
    moe_case_t moe;
    epx_buffer_t buffer;
    moe_inputs_t inputs;
    int64_t scale_cols;
    int64_t num_recv; /* rows this rank receives (the same every iteration) */
    char label[64];   /* "rank 1 bf16", for messages */
    /* Backend memory. */
    void *x;
    void *x_scales;
    void *topk_idx;
    void *topk_weights;
    void *per_rank;
    void *per_expert;
    void *in_rank;
    void *combine_x; /* combine_copy's x (combine's is the buffer's combine-input view) */
    void *registered_x; /* combine_registered's x (registered with the buffer) */
    void *recv_weights; /* combine_weights' top-k weights in: the dispatch's, [rows, k] */
    void *out_x;
    void *out_weights; /* combine_weights' out_topk_weights, [tokens, k] */
} bench_case_t;

/* What every rank tells the others after the checked run. */
typedef struct {
    int64_t num_recv;
    int32_t check[EPX__BENCH_OP_COUNT];
} rank_summary_t;

static size_t element_size(const bench_case_t *bc)
{
    return epx_dtype_size(bc->moe.dtype);
}

static int is_fp8(const bench_case_t *bc)
{
    return bc->moe.dtype == EPX_DTYPE_FP8_E4M3;
}

/* ---------------------------------------------------------------- ops */

static void run_layout(bench_case_t *bc)
{
    epx_layout_args_t args = EPX_LAYOUT_ARGS_INIT;
    args.topk_idx = epx_tensor_2d(bc->topk_idx, EPX_DTYPE_INT64, bc->moe.num_tokens, bc->moe.num_topk);
    args.num_tokens_per_rank = epx_tensor_1d(bc->per_rank, EPX_DTYPE_INT32, bc->world_size);
    args.num_tokens_per_expert = epx_tensor_1d(bc->per_expert, EPX_DTYPE_INT32, bc->moe.num_experts);
    args.is_token_in_rank =
        epx_tensor_2d(bc->in_rank, EPX_DTYPE_BOOL, bc->moe.num_tokens, bc->world_size);
    epx__bench_must(bc->rank, epx_get_dispatch_layout(bc->buffer, &args, bc->device->stream),
                    "epx_get_dispatch_layout");
}

/* Fresh dispatch when `cached` is NULL, else cached mode with that handle; `flags`
 * EPX_DISPATCH_* (EPX_DISPATCH_WORST_CASE: no host wait). */
static void run_dispatch_flags(bench_case_t *bc, epx_handle_t cached, uint32_t flags,
                               epx_dispatch_result_t *result)
{
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(bc->x, bc->moe.dtype, bc->moe.num_tokens, bc->moe.hidden);
    if (is_fp8(bc))
        args.x_scales = epx_tensor_2d(bc->x_scales, EPX_DTYPE_FP32, bc->moe.num_tokens, bc->scale_cols);
    if (cached == NULL) {
        args.topk_idx =
            epx_tensor_2d(bc->topk_idx, EPX_DTYPE_INT64, bc->moe.num_tokens, bc->moe.num_topk);
        args.topk_weights =
            epx_tensor_2d(bc->topk_weights, EPX_DTYPE_FP32, bc->moe.num_tokens, bc->moe.num_topk);
        args.expert_alignment = bc->moe.expert_alignment;
    } else {
        args.handle = cached;
    }
    args.flags = flags;
    epx_dispatch_result_t fresh = EPX_DISPATCH_RESULT_INIT;
    *result = fresh;
    epx__bench_must(bc->rank, epx_dispatch(bc->buffer, &args, result, bc->device->stream),
                    cached == NULL ? "epx_dispatch" : "epx_dispatch (cached)");
}

static void run_dispatch(bench_case_t *bc, epx_handle_t cached, epx_dispatch_result_t *result)
{
    run_dispatch_flags(bc, cached, 0, result);
}

/* The combine-input view for `handle` (the same memory for every handle of the buffer). */
static epx_tensor_t combine_view(bench_case_t *bc, epx_handle_t handle)
{
    epx_tensor_t view = EPX_TENSOR_NONE;
    epx__bench_must(bc->rank, epx_get_combine_input(bc->buffer, handle, &view),
                    "epx_get_combine_input");
    return view;
}

/* Where a combine op's x comes from, as its messages say it. */
static const char *combine_x_text(epx__bench_op_t op)
{
    switch (op) {
    case EPX__BENCH_OP_COMBINE:
        return "input view";
    case EPX__BENCH_OP_COMBINE_COPY:
        return "separate x";
    case EPX__BENCH_OP_COMBINE_REGISTERED:
        return "registered x";
    default:
        return "input view, top-k weights";
    }
}

/* x from the combine-input view (`op` EPX__BENCH_OP_COMBINE) or a separate tensor. */
static void run_combine(bench_case_t *bc, epx_handle_t handle, epx__bench_op_t op)
{
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = handle;
    const int64_t k = bc->moe.num_topk;
    if (op == EPX__BENCH_OP_COMBINE || op == EPX__BENCH_OP_COMBINE_WEIGHTS)
        args.x = combine_view(bc, handle);
    else
        args.x = epx_tensor_2d(op == EPX__BENCH_OP_COMBINE_REGISTERED ? bc->registered_x
                                                                      : bc->combine_x,
                               EPX_DTYPE_BF16, bc->num_recv, bc->moe.hidden);
    args.out_x = epx_tensor_2d(bc->out_x, EPX_DTYPE_BF16, bc->moe.num_tokens, bc->moe.hidden);
    if (op == EPX__BENCH_OP_COMBINE_WEIGHTS) {
        args.topk_weights = epx_tensor_2d(bc->recv_weights, EPX_DTYPE_FP32, bc->num_recv, k);
        args.out_topk_weights =
            epx_tensor_2d(bc->out_weights, EPX_DTYPE_FP32, bc->moe.num_tokens, k);
    }
    const epx_status_t status = epx_combine(bc->buffer, &args, bc->device->stream);
    if (status != EPX_SUCCESS) {
        char what[64];
        snprintf(what, sizeof(what), "epx_combine (%s)", combine_x_text(op));
        epx__bench_must(bc->rank, status, what);
    }
}

/* ---------------------------------------------------------------- setup */

static void *alloc_copy(bench_case_t *bc, const void *host, size_t bytes)
{
    void *data = NULL;
    epx__bench_must(bc->rank, epx__bench_alloc(bc->device, bytes, &data), "bench allocation");
    if (host != NULL)
        epx__bench_must(bc->rank, epx__bench_copy_in(bc->device, data, host, bytes), "bench copy");
    return data;
}

static void setup(bench_case_t *bc)
{
    const moe_case_t *c = &bc->moe;
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = c->num_tokens;
    config.hidden = c->hidden;
    config.num_experts = c->num_experts;
    config.num_topk = c->num_topk;
    config.dispatch_dtype = c->dtype;
    config.num_sms = bc->options->sms;
    config.auto_register = bc->options->auto_register ? 1 : -1;
    epx__bench_must(bc->rank, epx_buffer_create(bc->group, &config, &bc->buffer),
                    "epx_buffer_create");

    if (moe_inputs_make(c, bc->rank, &bc->inputs) != 0) {
        fprintf(stderr, "epx bench: rank %d: out of memory making the inputs\n", bc->rank);
        exit(1);
    }
    size_t tokens = (size_t)c->num_tokens;
    size_t topk = (size_t)c->num_topk;
    bc->x = alloc_copy(bc, bc->inputs.x, tokens * (size_t)c->hidden * element_size(bc));
    if (is_fp8(bc))
        bc->x_scales = alloc_copy(bc, bc->inputs.x_scales, tokens * (size_t)bc->scale_cols * 4);
    bc->topk_idx = alloc_copy(bc, bc->inputs.topk_idx, tokens * topk * 8);
    bc->topk_weights = alloc_copy(bc, bc->inputs.topk_weights, tokens * topk * 4);
    bc->per_rank = alloc_copy(bc, NULL, (size_t)bc->world_size * 4);
    bc->per_expert = alloc_copy(bc, NULL, (size_t)c->num_experts * 4);
    bc->in_rank = alloc_copy(bc, NULL, tokens * (size_t)bc->world_size);
    bc->out_x = alloc_copy(bc, NULL, tokens * (size_t)c->hidden * 2);
    bc->out_weights = alloc_copy(bc, NULL, (tokens > 0 ? tokens : 1) * topk * 4);
}

/*
 * Combine input: the row each received token carries back, in a separate tensor and in
 * the combine-input view of `handle`. With the oracle's source arrays (the checked
 * run) it is what moe_oracle_combine expects; without them any values time the same.
 */
static void make_combine_input(bench_case_t *bc, const moe_expected_t *expected,
                               epx_handle_t handle)
{
    size_t row_bytes = (size_t)bc->moe.hidden * 2;
    uint16_t *rows = malloc((size_t)(bc->num_recv > 0 ? bc->num_recv : 1) * row_bytes);
    if (rows == NULL) {
        fprintf(stderr, "epx bench: rank %d: out of memory for the combine input\n", bc->rank);
        exit(1);
    }
    int use_oracle = expected != NULL && expected->num_recv == bc->num_recv;
    for (int64_t i = 0; i < bc->num_recv; i++) {
        int src_rank = use_oracle ? expected->recv_src_rank[i] : 0;
        int64_t src_token = use_oracle ? expected->recv_src_token[i] : i;
        moe_combine_row(&bc->moe, bc->rank, src_rank, src_token, rows + i * bc->moe.hidden);
    }
    /* Mapped on demand, its allocation is what the peers map: sized as PyTorch's caching
     * allocator would (2 MiB steps), which peers read faster (moe_registered_size). */
    size_t x_bytes = (size_t)bc->num_recv * row_bytes;
    if (bc->options->auto_register)
        x_bytes = moe_registered_size(x_bytes + row_bytes);
    bc->combine_x = alloc_copy(bc, NULL, x_bytes);
    if (bc->num_recv > 0)
        epx__bench_must(bc->rank,
                        epx__bench_copy_in(bc->device, bc->combine_x, rows,
                                           (size_t)bc->num_recv * row_bytes),
                        "bench copy");
    /* One spare row: a rank that receives nothing still registers a range (never empty);
     * --register-mb: a larger allocation. Rounded up to 2 MiB (moe_registered_size)
     * unless --register-exact, which shows what other sizes cost. */
    size_t registered_bytes = (size_t)(bc->num_recv + 1) * row_bytes;
    if (registered_bytes < ((size_t)bc->options->register_mb << 20))
        registered_bytes = (size_t)bc->options->register_mb << 20;
    if (!bc->options->register_exact)
        registered_bytes = moe_registered_size(registered_bytes);
    bc->registered_x = alloc_copy(bc, NULL, registered_bytes);
    epx__bench_must(bc->rank,
                    epx__bench_copy_in(bc->device, bc->registered_x, rows,
                                       (size_t)bc->num_recv * row_bytes),
                    "bench copy into the registered x");
    epx__bench_must(bc->rank,
                    epx_buffer_register(bc->buffer, bc->registered_x, registered_bytes),
                    "epx_buffer_register");
    epx_tensor_t view = combine_view(bc, handle);
    if (view.shape[0] < bc->num_recv) {
        fprintf(stderr, "epx bench: %s: the combine-input view has %lld rows, %lld received\n",
                bc->label, (long long)view.shape[0], (long long)bc->num_recv);
        exit(1);
    }
    epx__bench_must(bc->rank,
                    epx__bench_copy_in(bc->device, view.data, rows,
                                       (size_t)bc->num_recv * row_bytes),
                    "bench copy into the combine-input view");
    free(rows);
}

static void teardown(bench_case_t *bc)
{
    if (bc->registered_x != NULL)
        epx__bench_must(bc->rank, epx_buffer_deregister(bc->buffer, bc->registered_x),
                        "epx_buffer_deregister");
    void *memory[] = {bc->x,        bc->x_scales, bc->topk_idx,  bc->topk_weights,
                      bc->per_rank, bc->per_expert, bc->in_rank, bc->combine_x,
                      bc->registered_x, bc->recv_weights, bc->out_x, bc->out_weights};
    for (size_t i = 0; i < sizeof(memory) / sizeof(memory[0]); i++)
        epx__bench_free(bc->device, memory[i]);
    moe_inputs_free(&bc->inputs);
    epx__bench_must(bc->rank, epx_buffer_destroy(bc->buffer), "epx_buffer_destroy");
}

/* ---------------------------------------------------------------- checks */

/* Copy `rows` rows of a result tensor (maybe strided, maybe device memory) to the host. */
static void *copy_out(bench_case_t *bc, const epx_tensor_t *tensor, int64_t rows, int64_t cols)
{
    size_t element = epx_dtype_size(tensor->dtype);
    size_t row_bytes = (size_t)cols * element;
    void *host = malloc(rows > 0 ? (size_t)rows * row_bytes : 1);
    if (host == NULL) {
        fprintf(stderr, "epx bench: rank %d: out of memory copying results\n", bc->rank);
        exit(1);
    }
    int64_t stride = tensor->ndim == 2 && tensor->strides[0] != 0 ? tensor->strides[0] : cols;
    epx__bench_must(bc->rank,
                    epx__bench_copy_rows_out(bc->device, host, tensor->data, rows, row_bytes,
                                             (size_t)stride * element),
                    "bench copy of results");
    /* The copy waited for the operations before it: one that failed on the device (a
     * peer that did not answer) is said as such, not as the wrong values it left. */
    epx_status_t failed = EPX_SUCCESS;
    char message[512] = "";
    epx__bench_must(bc->rank, epx_get_async_error(bc->buffer, &failed, message, sizeof(message)),
                    "epx_get_async_error");
    if (failed != EPX_SUCCESS) {
        fprintf(stderr, "epx bench: rank %d: %s: an operation failed on the device: %s: %s\n",
                bc->rank, bc->label, epx_status_name(failed), message);
        exit(1);
    }
    return host;
}

static int check_tensor(bench_case_t *bc, const char *what, const epx_tensor_t *tensor,
                        epx_dtype_t dtype, const void *expected, int64_t rows, int64_t cols)
{
    if (rows == 0)
        return 1;
    if (tensor->data == NULL || tensor->dtype != dtype) {
        fprintf(stderr, "epx bench: %s: %s missing from the result or of dtype %s\n", bc->label,
                what, epx_dtype_name(tensor->dtype));
        return 0;
    }
    void *got = copy_out(bc, tensor, rows, cols);
    int ok = epx__bench_compare(bc->label, what, dtype, got, expected, rows, cols);
    free(got);
    return ok;
}

static int check_layout(bench_case_t *bc, const moe_expected_t *expected)
{
    const moe_case_t *c = &bc->moe;
    epx_tensor_t per_rank = epx_tensor_1d(bc->per_rank, EPX_DTYPE_INT32, bc->world_size);
    epx_tensor_t per_expert = epx_tensor_1d(bc->per_expert, EPX_DTYPE_INT32, c->num_experts);
    epx_tensor_t in_rank = epx_tensor_2d(bc->in_rank, EPX_DTYPE_BOOL, c->num_tokens, bc->world_size);
    int ok = check_tensor(bc, "layout num_tokens_per_rank", &per_rank, EPX_DTYPE_INT32,
                          expected->num_tokens_per_rank, 1, bc->world_size);
    ok &= check_tensor(bc, "layout num_tokens_per_expert", &per_expert, EPX_DTYPE_INT32,
                       expected->num_tokens_per_expert, 1, c->num_experts);
    ok &= check_tensor(bc, "layout is_token_in_rank", &in_rank, EPX_DTYPE_BOOL,
                       expected->is_token_in_rank, c->num_tokens, bc->world_size);
    return ok;
}

/* recv_x (and scales) of a fresh or cached dispatch; topk outputs of a fresh one. */
static int check_dispatch(bench_case_t *bc, const moe_expected_t *expected,
                          const epx_dispatch_result_t *result, int cached)
{
    const moe_case_t *c = &bc->moe;
    const char *op = cached ? "cached dispatch" : "dispatch";
    char what[96];
    if (result->num_recv_tokens != expected->num_recv) {
        fprintf(stderr, "epx bench: %s: %s received %lld tokens, expected %lld\n", bc->label, op,
                (long long)result->num_recv_tokens, (long long)expected->num_recv);
        return 0;
    }
    int64_t rows = expected->num_recv;
    snprintf(what, sizeof(what), "%s recv_x", op);
    int ok = check_tensor(bc, what, &result->recv_x, c->dtype, expected->recv_x, rows, c->hidden);
    if (is_fp8(bc)) {
        snprintf(what, sizeof(what), "%s recv_x_scales", op);
        ok &= check_tensor(bc, what, &result->recv_x_scales, EPX_DTYPE_FP32,
                           expected->recv_x_scales, rows, bc->scale_cols);
    }
    if (!cached) {
        ok &= check_tensor(bc, "dispatch recv_topk_idx", &result->recv_topk_idx, EPX_DTYPE_INT64,
                           expected->recv_topk_idx, rows, c->num_topk);
        ok &= check_tensor(bc, "dispatch recv_topk_weights", &result->recv_topk_weights,
                           EPX_DTYPE_FP32, expected->recv_topk_weights, rows, c->num_topk);
    }
    if (result->num_local_experts != expected->num_local_experts ||
        result->num_recv_tokens_per_expert == NULL) {
        fprintf(stderr, "epx bench: %s: %s gave %d per-expert counts, expected %d\n", bc->label,
                op, result->num_recv_tokens_per_expert != NULL ? result->num_local_experts : 0,
                expected->num_local_experts);
        return 0;
    }
    snprintf(what, sizeof(what), "%s num_recv_tokens_per_expert", op);
    ok &= epx__bench_compare(bc->label, what, EPX_DTYPE_INT32, result->num_recv_tokens_per_expert,
                             expected->num_recv_per_expert, 1, expected->num_local_experts);
    return ok;
}

static int check_combine(bench_case_t *bc, const char *what)
{
    uint16_t *expected = NULL;
    if (moe_oracle_combine(&bc->moe, bc->rank, &expected) != 0) {
        fprintf(stderr, "epx bench: rank %d: out of memory in the combine oracle\n", bc->rank);
        exit(1);
    }
    epx_tensor_t out = epx_tensor_2d(bc->out_x, EPX_DTYPE_BF16, bc->moe.num_tokens, bc->moe.hidden);
    uint16_t *got = copy_out(bc, &out, bc->moe.num_tokens, bc->moe.hidden);
    int ok = epx__bench_compare_bf16(bc->label, what, got, expected, bc->moe.num_tokens,
                                     bc->moe.hidden, 0);
    free(got);
    free(expected);
    return ok;
}

/*
 * combine_weights' out_topk_weights: each token's weight where its id names an expert, 0
 * where it is -1 (the received rows carry the weight on the expert's rank and 0 on the
 * others, so the sums are exact).
 */
static int check_combined_weights(bench_case_t *bc)
{
    const int64_t tokens = bc->moe.num_tokens, k = bc->moe.num_topk;
    epx_tensor_t out = epx_tensor_2d(bc->out_weights, EPX_DTYPE_FP32, tokens, k);
    float *got = copy_out(bc, &out, tokens, k);
    const moe_inputs_t *in = &bc->inputs;
    for (int64_t i = 0; i < tokens * k; i++) {
        const float want = in->topk_idx[i] >= 0 ? in->topk_weights[i] : 0.0f;
        if (memcmp(&got[i], &want, sizeof(want)) != 0) {
            fprintf(stderr, "epx bench: %s: combine_weights out_topk_weights[%lld][%lld] is "
                    "%.9g, expected %.9g\n", bc->label, (long long)(i / k), (long long)(i % k),
                    got[i], want);
            free(got);
            return 0;
        }
    }
    free(got);
    return 1;
}

/* The checked run: every op once, in the timed loop's order. */
static void run_checked(bench_case_t *bc, rank_summary_t *summary)
{
    int check = bc->options->check;
    moe_expected_t expected;
    memset(&expected, 0, sizeof(expected));
    if (check && moe_oracle_dispatch(&bc->moe, bc->rank, &expected) != 0) {
        fprintf(stderr, "epx bench: rank %d: out of memory in the dispatch oracle\n", bc->rank);
        exit(1);
    }
    for (int op = 0; op < EPX__BENCH_OP_COUNT; op++)
        summary->check[op] = check ? EPX__BENCH_CHECK_PASS : EPX__BENCH_CHECK_NONE;

    run_layout(bc);
    if (check && !check_layout(bc, &expected))
        summary->check[EPX__BENCH_OP_LAYOUT] = EPX__BENCH_CHECK_FAIL;

    epx_dispatch_result_t result;
    run_dispatch(bc, NULL, &result);
    bc->num_recv = result.num_recv_tokens;
    summary->num_recv = bc->num_recv;
    if (check && !check_dispatch(bc, &expected, &result, 0))
        summary->check[EPX__BENCH_OP_DISPATCH] = EPX__BENCH_CHECK_FAIL;

    epx_dispatch_result_t cached;
    run_dispatch(bc, result.handle, &cached);
    if (check && !check_dispatch(bc, &expected, &cached, 1))
        summary->check[EPX__BENCH_OP_CACHED_DISPATCH] = EPX__BENCH_CHECK_FAIL;

    make_combine_input(bc, check ? &expected : NULL, result.handle);
    /* combine_weights' input: this dispatch's received top-k weights, in a tensor of
     * their own (the dispatch's view is rewritten by every dispatch). */
    const int64_t k = bc->moe.num_topk;
    float *recv_weights = copy_out(bc, &result.recv_topk_weights, bc->num_recv, k);
    bc->recv_weights =
        alloc_copy(bc, recv_weights, (size_t)(bc->num_recv > 0 ? bc->num_recv : 1) * (size_t)k * 4);
    free(recv_weights);
    /* out_x is cleared before each, so neither check can pass on the other's result. */
    size_t out_bytes = (size_t)bc->moe.num_tokens * (size_t)bc->moe.hidden * 2;
    const epx__bench_op_t combines[] = {EPX__BENCH_OP_COMBINE, EPX__BENCH_OP_COMBINE_COPY,
                                        EPX__BENCH_OP_COMBINE_REGISTERED,
                                        EPX__BENCH_OP_COMBINE_WEIGHTS};
    for (size_t i = 0; i < sizeof(combines) / sizeof(combines[0]); i++) {
        epx__bench_must(bc->rank, epx__bench_fill(bc->device, bc->out_x, 0xff, out_bytes),
                        "bench clearing out_x");
        epx__bench_must(bc->rank,
                        epx__bench_fill(bc->device, bc->out_weights, 0xff,
                                        (size_t)bc->moe.num_tokens * (size_t)k * 4),
                        "bench clearing out_topk_weights");
        run_combine(bc, result.handle, combines[i]);
        char what[96];
        snprintf(what, sizeof(what), "%s (%s) out_x", epx__bench_op_name(combines[i]),
                 combine_x_text(combines[i]));
        if (check && !check_combine(bc, what))
            summary->check[combines[i]] = EPX__BENCH_CHECK_FAIL;
        if (check && combines[i] == EPX__BENCH_OP_COMBINE_WEIGHTS && !check_combined_weights(bc))
            summary->check[combines[i]] = EPX__BENCH_CHECK_FAIL;
    }

    epx__bench_must(bc->rank, epx_handle_destroy(result.handle), "epx_handle_destroy");
    if (check)
        moe_expected_free(&expected);
}

void epx__bench_allgather(epx_group_t group, const void *mine, void *all, size_t bytes,
                          const char *what)
{
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    epx__bench_must(info.rank, epx_group_allgather(group, mine, all, bytes), what);
}

/* Once per case, off the timed path. */
static void allgather(bench_case_t *bc, const void *mine, void *all, size_t bytes,
                      const char *what)
{
    epx__bench_allgather(bc->group, mine, all, bytes, what);
}

/*
 * slowest[op][it] = the longest any rank took for that op in that iteration. Rank 0
 * alone can finish well before the others (it measured below the all-ranks floor on
 * one GPU), so the floor is compared with the slowest rank.
 */
static void gather_slowest(bench_case_t *bc, double *times[EPX__BENCH_OP_COUNT], int iters,
                           double *slowest[EPX__BENCH_OP_COUNT])
{
    size_t per_rank = (size_t)iters * EPX__BENCH_OP_COUNT;
    double *mine = malloc(per_rank * sizeof(double));
    double *all = malloc(per_rank * (size_t)bc->world_size * sizeof(double));
    if (mine == NULL || all == NULL) {
        fprintf(stderr, "epx bench: rank %d: out of memory gathering times\n", bc->rank);
        exit(1);
    }
    for (int op = 0; op < EPX__BENCH_OP_COUNT; op++)
        memcpy(mine + (size_t)op * (size_t)iters, times[op], (size_t)iters * sizeof(double));
    allgather(bc, mine, all, per_rank * sizeof(double), "gathering times");
    for (int op = 0; op < EPX__BENCH_OP_COUNT; op++) {
        for (int it = 0; it < iters; it++) {
            double longest = 0;
            for (int r = 0; r < bc->world_size; r++) {
                double t = all[(size_t)r * per_rank + (size_t)op * (size_t)iters + (size_t)it];
                longest = t > longest ? t : longest;
            }
            slowest[op][it] = longest;
        }
    }
    free(mine);
    free(all);
}

/* ---------------------------------------------------------------- timing */

static void run_timed(bench_case_t *bc, int warmup, int iters, double *times[EPX__BENCH_OP_COUNT])
{
    for (int it = 0; it < warmup + iters; it++) {
        /* Start together, so rank 0's times measure the collective, not the skew. */
        epx__bench_must(bc->rank, epx_group_barrier(bc->group), "epx_group_barrier");
        epx_dispatch_result_t result, cached;
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 0), "timestamp");
        run_layout(bc);
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 1), "timestamp");
        run_dispatch(bc, NULL, &result);
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 2), "timestamp");
        run_dispatch(bc, result.handle, &cached);
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 3), "timestamp");
        run_combine(bc, result.handle, EPX__BENCH_OP_COMBINE);
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 4), "timestamp");
        run_combine(bc, result.handle, EPX__BENCH_OP_COMBINE_COPY);
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 5), "timestamp");
        run_combine(bc, result.handle, EPX__BENCH_OP_COMBINE_REGISTERED);
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 6), "timestamp");
        run_combine(bc, result.handle, EPX__BENCH_OP_COMBINE_WEIGHTS);
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 7), "timestamp");

        double durations[EPX__BENCH_OP_COUNT];
        epx__bench_must(bc->rank, epx__bench_elapsed_us(bc->device, EPX__BENCH_OP_COUNT + 1, durations),
                        "reading timestamps");
        if (result.num_recv_tokens != bc->num_recv) {
            fprintf(stderr, "epx bench: %s: iteration %d received %lld tokens, the first run %lld "
                    "(same inputs)\n", bc->label, it, (long long)result.num_recv_tokens,
                    (long long)bc->num_recv);
            exit(1);
        }
        epx__bench_must(bc->rank, epx_handle_destroy(result.handle), "epx_handle_destroy");
        if (it >= warmup) {
            for (int op = 0; op < EPX__BENCH_OP_COUNT; op++)
                times[op][it - warmup] = durations[op];
        }
    }
}

/*
 * The fresh dispatch without a host wait (EPX_DISPATCH_WORST_CASE, each handle destroyed
 * at once: its memory is reused in stream order), the cached dispatch, the combine (x in
 * the buffer) and the registered combine, each `calls` times in a row between one pair
 * of events after a barrier, with no host wait and no event between the calls:
 * per_call[op] = this rank's time / calls (0 for the ops not run so). Between operations
 * that make every rank end together (each waits for its peers at its end), a rank's next
 * kernels start as soon as its stream allows; with events between them, as in the
 * table, each also waits for the event.
 */
static void run_back_to_back(bench_case_t *bc, int calls, double per_call[EPX__BENCH_OP_COUNT])
{
    for (int op = 0; op < EPX__BENCH_OP_COUNT; op++)
        per_call[op] = 0;
    epx_dispatch_result_t result, cached;
    run_dispatch(bc, NULL, &result);
    const epx__bench_op_t ops[] = {EPX__BENCH_OP_DISPATCH, EPX__BENCH_OP_CACHED_DISPATCH,
                                   EPX__BENCH_OP_COMBINE, EPX__BENCH_OP_COMBINE_REGISTERED};
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
        epx__bench_must(bc->rank, epx_group_barrier(bc->group), "epx_group_barrier");
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 0), "timestamp");
        for (int c = 0; c < calls; c++) {
            if (ops[i] == EPX__BENCH_OP_DISPATCH) {
                epx_dispatch_result_t worst;
                run_dispatch_flags(bc, NULL, EPX_DISPATCH_WORST_CASE, &worst);
                epx__bench_must(bc->rank, epx_handle_destroy(worst.handle), "epx_handle_destroy");
            } else if (ops[i] == EPX__BENCH_OP_CACHED_DISPATCH) {
                run_dispatch(bc, result.handle, &cached);
            } else {
                run_combine(bc, result.handle, ops[i]);
            }
        }
        epx__bench_must(bc->rank, epx__bench_mark(bc->device, 1), "timestamp");
        double elapsed = 0;
        epx__bench_must(bc->rank, epx__bench_elapsed_us(bc->device, 2, &elapsed),
                        "reading timestamps");
        per_call[ops[i]] = elapsed / calls;
    }
    epx__bench_must(bc->rank, epx_handle_destroy(result.handle), "epx_handle_destroy");
}

static int64_t row_bytes(const bench_case_t *bc, epx__bench_op_t op)
{
    int64_t hidden = bc->moe.hidden;
    switch (op) {
    case EPX__BENCH_OP_DISPATCH:
    case EPX__BENCH_OP_CACHED_DISPATCH:
        return hidden * (int64_t)element_size(bc) + (is_fp8(bc) ? bc->scale_cols * 4 : 0);
    case EPX__BENCH_OP_COMBINE:
    case EPX__BENCH_OP_COMBINE_COPY:
    case EPX__BENCH_OP_COMBINE_REGISTERED:
    case EPX__BENCH_OP_COMBINE_WEIGHTS:
        return hidden * 2;
    default:
        return 0; /* layout moves no payload */
    }
}

/*
 * The floor's bytes of `op`, all ranks together (epx__bench_dispatch_floor_bytes): a
 * fresh dispatch reads each source token (x, scales, top-k ids and weights) and writes
 * each received row with the same parts; a cached one has no routing to read or write;
 * combine reads each received row and writes each output row (combine_weights: each
 * with its top-k weights).
 */
static int64_t floor_bytes(const bench_case_t *bc, epx__bench_op_t op, int64_t received)
{
    int64_t tokens = bc->moe.num_tokens * bc->world_size;
    int64_t routing = (int64_t)bc->moe.num_topk * (8 + 4);
    switch (op) {
    case EPX__BENCH_OP_DISPATCH:
        return epx__bench_dispatch_floor_bytes(tokens, row_bytes(bc, op) + routing, received,
                                               row_bytes(bc, op) + routing);
    case EPX__BENCH_OP_CACHED_DISPATCH:
        return epx__bench_dispatch_floor_bytes(tokens, row_bytes(bc, op), received,
                                               row_bytes(bc, op));
    case EPX__BENCH_OP_COMBINE:
    case EPX__BENCH_OP_COMBINE_COPY:
    case EPX__BENCH_OP_COMBINE_REGISTERED:
        return epx__bench_combine_floor_bytes(tokens, 0, received, row_bytes(bc, op));
    case EPX__BENCH_OP_COMBINE_WEIGHTS:
        /* Each received row with its k weights read, each token's row and k weights
         * written. */
        return epx__bench_combine_floor_bytes(tokens, 0, received,
                                              row_bytes(bc, op) + bc->moe.num_topk * 4);
    default:
        return 0; /* layout moves no payload */
    }
}

int epx__bench_run_case(epx_group_t group, const epx__bench_options_t *options,
                        epx__bench_device_t *device, epx_dtype_t dtype, int warmup, int iters,
                        int back_to_back, epx__bench_row_t rows[EPX__BENCH_OP_COUNT])
{
    bench_case_t bc;
    memset(&bc, 0, sizeof(bc));
    bc.group = group;
    bc.options = options;
    bc.device = device;
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    bc.rank = info.rank;
    bc.world_size = info.world_size;
    moe_case_t moe = {info.world_size, options->tokens, options->hidden, options->experts,
                      options->topk, dtype, options->alignment, options->seed,
                      MOE_ROUTING_RANDOM, 0.0, -1, info.ranks_per_node, 0, 0};
    bc.moe = moe;
    bc.scale_cols = options->hidden / 128;
    snprintf(bc.label, sizeof(bc.label), "rank %d %s", bc.rank,
             epx__bench_dtype_text(dtype));

    setup(&bc);
    rank_summary_t mine;
    run_checked(&bc, &mine);
    rank_summary_t *all = calloc((size_t)bc.world_size, sizeof(rank_summary_t));
    double *times[EPX__BENCH_OP_COUNT], *slowest[EPX__BENCH_OP_COUNT];
    int out_of_memory = all == NULL;
    for (int op = 0; op < EPX__BENCH_OP_COUNT; op++) {
        times[op] = calloc((size_t)(iters > 0 ? iters : 1), sizeof(double));
        slowest[op] = calloc((size_t)(iters > 0 ? iters : 1), sizeof(double));
        out_of_memory |= times[op] == NULL || slowest[op] == NULL;
    }
    if (out_of_memory) {
        fprintf(stderr, "epx bench: rank %d: out of memory\n", bc.rank);
        exit(1);
    }
    allgather(&bc, &mine, all, sizeof(mine), "gathering check results");
    run_timed(&bc, warmup, iters, times);
    gather_slowest(&bc, times, iters, slowest);
    /* Back to back: one time a call per op, the slowest rank's as for an iteration. */
    double back[EPX__BENCH_OP_COUNT], slowest_back[EPX__BENCH_OP_COUNT];
    memset(slowest_back, 0, sizeof(slowest_back));
    if (back_to_back > 0) {
        run_back_to_back(&bc, back_to_back, back);
        double *back_of[EPX__BENCH_OP_COUNT], *slowest_of[EPX__BENCH_OP_COUNT];
        for (int op = 0; op < EPX__BENCH_OP_COUNT; op++) {
            back_of[op] = &back[op];
            slowest_of[op] = &slowest_back[op];
        }
        gather_slowest(&bc, back_of, 1, slowest_of);
    }

    int failed = 0;
    for (int op = 0; op < EPX__BENCH_OP_COUNT; op++) {
        epx__bench_row_t *row = &rows[op];
        row->dtype = dtype;
        row->op = (epx__bench_op_t)op;
        row->median_us = epx__bench_median(times[op], iters);
        row->p99_us = epx__bench_p99(times[op], iters);
        row->slowest_us = epx__bench_median(slowest[op], iters);
        row->bytes_per_rank = bc.num_recv * row_bytes(&bc, (epx__bench_op_t)op);
        row->total_bytes = 0;
        row->check = options->check ? EPX__BENCH_CHECK_PASS : EPX__BENCH_CHECK_NONE;
        int64_t received = 0;
        for (int r = 0; r < bc.world_size; r++) {
            received += all[r].num_recv;
            if (all[r].check[op] == EPX__BENCH_CHECK_FAIL)
                row->check = EPX__BENCH_CHECK_FAIL;
        }
        row->total_bytes = received * row_bytes(&bc, (epx__bench_op_t)op);
        row->floor_bytes = floor_bytes(&bc, (epx__bench_op_t)op, received);
        row->back_to_back_us = slowest_back[op];
        failed |= row->check == EPX__BENCH_CHECK_FAIL;
        free(times[op]);
        free(slowest[op]);
    }
    free(all);
    teardown(&bc);
    return failed;
}
