/*
 * Low-latency mode against the oracle (tests/common/moe_ll.h), on every rank:
 *
 *   epx launch -n N -- test_ll [--backend host|cuda|auto]
 *
 * Cases: bf16; fp8 with fp32 scales, power-of-two scales, and packed ue8m0; -1 entries
 * and a duplicated expert; an empty rank; fp8 on buffers sized for fp8 rows
 * (config.low_latency_dtype = FP8_E4M3); EPX_LL_SEND_ONLY with receive; two steps in
 * flight with step 0's combine after step 1's dispatch, through the zero-copy combine
 * buffer, and a step combined again (the same outputs, then others); every misuse error
 * (which must leave the buffer usable); the receives' wait times (wait_recv_cost_stats:
 * a rank that starts late stands out on the others); a masked rank (with two or more
 * ranks; it adds no wait time). Values are compared exactly (same algorithm, same
 * rounding).
 *
 * Inputs and outputs live in the backend's memory (mem.h): host memory on the host
 * backend, device memory on the CUDA backend, where the results are views into device
 * memory valid in stream order (the test uses the default stream and copies them back
 * before comparing). Two things the CUDA backend does differently, by contract: it
 * cannot count masked entries without a host sync (num_masked_entries is -1; the mask
 * is checked through epx_ll_get_masked instead), and a failure inside its kernels is
 * reported through epx_get_async_error (checked after every step on both backends).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "mem.h"
#include "moe_ll.h"
#include "test_util.h"

static epx_group_t group;
static epx_group_info_t info = EPX_GROUP_INFO_INIT;

#define MAX_TOKENS 8
#define EXPERTS_PER_RANK 5
#define TOPK 4

/* A dispatch result copied back to contiguous host memory (check_dispatch). */
typedef struct {
    void *x;         /* [L][rows][hidden] bf16 bits or e4m3 bytes */
    void *scales;    /* [L][rows][scale columns] fp32, or ue8m0 bytes; NULL for bf16 */
    int32_t *count;  /* [L] */
    int32_t *src;    /* [L][rows] */
    int64_t *range;  /* [L][R] */
} recv_host_t;

typedef struct {
    moe_case_t c;
    moe_ll_cast_t cast;
    moe_inputs_t in;                  /* host copies, for the oracle */
    void *x, *topk_idx, *topk_weights; /* the same inputs in the backend's memory */
    void *out;                        /* combine output, backend memory */
    uint16_t *out_host;               /* ... copied back by check_combine */
    epx_ll_dispatch_result_t got;
    recv_host_t recv;                 /* got, copied back by check_dispatch */
} step_t;

/* `ll_dtype`: the buffer's low_latency_dtype (FP8_E4M3: rows sized for fp8 dispatch). */
static epx_buffer_t make_buffer_of(int64_t hidden, epx_dtype_t ll_dtype)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = MAX_TOKENS;
    config.hidden = hidden;
    config.num_experts = EXPERTS_PER_RANK * info.world_size;
    config.num_topk = TOPK;
    config.max_low_latency_tokens = MAX_TOKENS;
    config.low_latency_dtype = ll_dtype;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));
    return buffer;
}

static epx_buffer_t make_buffer(int64_t hidden)
{
    return make_buffer_of(hidden, EPX_DTYPE_BF16);
}

static size_t out_bytes(const step_t *s)
{
    return (size_t)(s->in.num_tokens * s->c.hidden) * 2;
}

/* Bytes of the [L, M * R, hidden] bf16 combine input. */
static size_t combine_input_bytes(int64_t hidden)
{
    return (size_t)EXPERTS_PER_RANK * MAX_TOKENS * (size_t)info.world_size * (size_t)hidden * 2;
}

/* Routing of the steps (run_crowded switches it to send everything to expert 0). */
static moe_routing_t routing = MOE_ROUTING_RANDOM;

static void step_init(step_t *s, uint64_t seed, int64_t hidden, int64_t tokens, int empty_rank,
                      moe_ll_cast_t cast)
{
    memset(s, 0, sizeof(*s));
    s->c.world_size = info.world_size;
    s->c.num_tokens = tokens;
    s->c.hidden = hidden;
    s->c.num_experts = EXPERTS_PER_RANK * info.world_size;
    s->c.num_topk = TOPK;
    s->c.dtype = EPX_DTYPE_BF16;
    s->c.expert_alignment = 1;
    s->c.seed = seed;
    s->c.routing = routing;
    s->c.drop_fraction = 0.2;
    s->c.empty_rank = empty_rank;
    s->cast = cast;
    CHECK_EQ_INT(moe_ll_inputs_make(&s->c, info.rank, &s->in), 0);
    int64_t n = s->in.num_tokens;
    s->x = mr_mem_from_host(s->in.x, (size_t)(n * hidden) * 2);
    s->topk_idx = mr_mem_from_host(s->in.topk_idx, (size_t)(n * TOPK) * sizeof(int64_t));
    s->topk_weights = mr_mem_from_host(s->in.topk_weights, (size_t)(n * TOPK) * sizeof(float));
    /* NaN bits: a combine that does not write its output cannot pass by accident. */
    s->out = mr_mem_alloc(out_bytes(s), 0xff);
    s->out_host = calloc(out_bytes(s) / 2 + 1, 2);
    CHECK(s->out_host != NULL);
}

static void recv_host_free(recv_host_t *r)
{
    free(r->x);
    free(r->scales);
    free(r->count);
    free(r->src);
    free(r->range);
    memset(r, 0, sizeof(*r));
}

static void step_free(step_t *s)
{
    mr_mem_free(s->x);
    mr_mem_free(s->topk_idx);
    mr_mem_free(s->topk_weights);
    mr_mem_free(s->out);
    free(s->out_host);
    recv_host_free(&s->recv);
    moe_inputs_free(&s->in);
}

/* Overwrite the combine output with NaN bits before a combine that must rewrite it. */
static void step_poison_out(step_t *s)
{
    memset(s->out_host, 0xff, out_bytes(s));
    mr_mem_to_device(s->out, s->out_host, out_bytes(s));
}

/* Backend memory of [L] int32 that dispatches add their recv_count to, or NULL. */
static void *recv_stats;
/* Backend memory of [R] int64 that the receives of dispatches and of combines add their
 * wait times to (wait_recv_cost_stats), or NULL. */
static void *dispatch_wait_stats, *combine_wait_stats;

static epx_status_t step_dispatch(epx_buffer_t buffer, step_t *s, uint32_t flags)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    if (recv_stats != NULL)
        args.cumulative_local_expert_recv_stats =
            epx_tensor_1d(recv_stats, EPX_DTYPE_INT32, EXPERTS_PER_RANK);
    if (dispatch_wait_stats != NULL)
        args.wait_recv_cost_stats =
            epx_tensor_1d(dispatch_wait_stats, EPX_DTYPE_INT64, info.world_size);
    args.x = epx_tensor_2d(s->x, EPX_DTYPE_BF16, s->in.num_tokens, s->c.hidden);
    args.topk_idx = epx_tensor_2d(s->topk_idx, EPX_DTYPE_INT64, s->in.num_tokens, TOPK);
    args.use_fp8 = s->cast.use_fp8;
    args.round_scale = s->cast.round_scale;
    args.use_ue8m0 = s->cast.use_ue8m0;
    args.flags = flags;
    s->got = (epx_ll_dispatch_result_t)EPX_LL_DISPATCH_RESULT_INIT;
    /* Uploads of pageable memory may still be landing: let them finish first. */
    mr_mem_sync();
    return epx_ll_dispatch(buffer, &args, &s->got, NULL);
}

/*
 * A contiguous host copy of result tensor `t` (host or device memory; strides in
 * elements, all 0 = contiguous; the innermost dimension is contiguous). Waits for the
 * backend's queued work first (mr_mem_to_host).
 */
static void *tensor_to_host(const char *name, const epx_tensor_t *t)
{
    if (t->ndim < 1 || t->ndim > 3)
        TEST_FAIL("rank %d: %s has %d dimensions", info.rank, name, t->ndim);
    size_t element = epx_dtype_size(t->dtype);
    int64_t shape[3] = {1, 1, 1}, stride[3];
    for (int d = 0; d < t->ndim; d++)
        shape[3 - t->ndim + d] = t->shape[d];
    int contiguous = 1;
    for (int d = 0; d < t->ndim; d++)
        contiguous &= t->strides[d] == 0;
    stride[2] = 1;
    stride[1] = shape[2];
    stride[0] = shape[1] * shape[2];
    if (!contiguous) {
        for (int d = 0; d < t->ndim; d++)
            stride[3 - t->ndim + d] = t->strides[d];
        if (stride[2] != 1)
            TEST_FAIL("rank %d: %s has inner stride %lld", info.rank, name, (long long)stride[2]);
    }
    size_t row_bytes = (size_t)shape[2] * element;
    char *host = malloc((size_t)(shape[0] * shape[1]) * row_bytes + 1);
    CHECK(host != NULL);
    if (shape[0] * shape[1] * shape[2] == 0)
        return host;
    if (t->data == NULL)
        TEST_FAIL("rank %d: result %s has no data", info.rank, name);
    if (contiguous || (stride[1] == shape[2] && stride[0] == shape[1] * shape[2])) {
        mr_mem_to_host(host, t->data, (size_t)(shape[0] * shape[1]) * row_bytes);
        return host;
    }
    for (int64_t i = 0; i < shape[0]; i++)
        for (int64_t j = 0; j < shape[1]; j++) {
            size_t offset = (size_t)(i * stride[0] + j * stride[1]) * element;
            mr_mem_to_host(host + (size_t)(i * shape[1] + j) * row_bytes,
                           (const char *)t->data + offset, row_bytes);
        }
    return host;
}

/* No asynchronous failure so far (the CUDA backend's kernels report timeouts there). */
static void check_no_async_error(epx_buffer_t buffer, const char *after)
{
    epx_status_t error = EPX_SUCCESS;
    char message[256];
    CHECK_OK(epx_get_async_error(buffer, &error, message, sizeof(message)));
    if (error != EPX_SUCCESS)
        TEST_FAIL("rank %d: after %s: asynchronous error %s: %s", info.rank, after,
                  epx_status_name(error), message);
}

/*
 * A count of masked entries. The host backend counts exactly; the CUDA backend does not
 * sync with the host and reports -1 (the mask itself is checked with epx_ll_get_masked).
 */
static void check_masked_count(const char *what, int64_t reported, int64_t expected)
{
    if (reported == -1 && mr_mem_is_device())
        return;
    if (reported != expected)
        TEST_FAIL("rank %d: %s num_masked_entries %lld, expected %lld", info.rank, what,
                  (long long)reported, (long long)expected);
}

/* epx_ll_get_masked must report exactly the ranks of `mask` (NULL = none). */
static void check_mask_query(epx_buffer_t buffer, const uint8_t *mask)
{
    int32_t got_mask[64];
    CHECK(info.world_size <= 64);
    CHECK_OK(epx_ll_get_masked(buffer, got_mask, 64));
    for (int r = 0; r < info.world_size; r++)
        if (got_mask[r] != (mask != NULL && mask[r]))
            TEST_FAIL("rank %d: epx_ll_get_masked says rank %d is %smasked", info.rank, r,
                      got_mask[r] ? "" : "not ");
}

/* First byte where a and b differ, or -1. */
static int64_t first_difference(const void *a, const void *b, size_t bytes)
{
    const unsigned char *p = a, *q = b;
    for (size_t i = 0; i < bytes; i++)
        if (p[i] != q[i])
            return (int64_t)i;
    return -1;
}

static void check_dispatch(step_t *s, const uint8_t *mask)
{
    moe_ll_expected_t e;
    CHECK_EQ_INT(moe_ll_oracle_dispatch(&s->c, info.rank, MAX_TOKENS, mask, s->cast, &e), 0);
    const epx_ll_dispatch_result_t *g = &s->got;
    int64_t hidden = s->c.hidden, rows = e.rows, world = info.world_size;
    int64_t groups = hidden / 128;
    CHECK_EQ_INT(g->recv_x.ndim, 3);
    CHECK_EQ_INT(g->recv_x.shape[0], e.num_local);
    CHECK_EQ_INT(g->recv_x.shape[1], rows);
    CHECK_EQ_INT(g->recv_x.shape[2], hidden);
    CHECK_EQ_INT(g->recv_x.dtype, s->cast.use_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16);
    CHECK_EQ_INT(g->recv_count.dtype, EPX_DTYPE_INT32);
    CHECK_EQ_INT(g->recv_count.shape[0], e.num_local);
    CHECK_EQ_INT(g->recv_src_info.dtype, EPX_DTYPE_INT32);
    CHECK_EQ_INT(g->recv_src_info.shape[1], rows);
    CHECK_EQ_INT(g->recv_layout_range.dtype, EPX_DTYPE_INT64);
    CHECK_EQ_INT(g->recv_layout_range.shape[1], world);
    if (s->cast.use_fp8) {
        CHECK_EQ_INT(g->recv_x_scales.ndim, 3);
        CHECK_EQ_INT(g->recv_x_scales.dtype, s->cast.use_ue8m0 ? EPX_DTYPE_INT32 : EPX_DTYPE_FP32);
        CHECK_EQ_INT(g->recv_x_scales.shape[1], rows);
        CHECK_EQ_INT(g->recv_x_scales.shape[2], s->cast.use_ue8m0 ? hidden / 512 : groups);
    }
    check_masked_count("dispatch", g->num_masked_entries, e.masked_entries);

    recv_host_free(&s->recv);
    s->recv.count = tensor_to_host("recv_count", &g->recv_count);
    s->recv.src = tensor_to_host("recv_src_info", &g->recv_src_info);
    s->recv.range = tensor_to_host("recv_layout_range", &g->recv_layout_range);
    s->recv.x = tensor_to_host("recv_x", &g->recv_x);
    if (s->cast.use_fp8)
        s->recv.scales = tensor_to_host("recv_x_scales", &g->recv_x_scales);
    const int32_t *count = s->recv.count;
    const int32_t *src = s->recv.src;
    const int64_t *range = s->recv.range;
    size_t element = s->cast.use_fp8 ? 1 : 2;
    for (int local = 0; local < e.num_local; local++) {
        if (count[local] != e.count[local])
            TEST_FAIL("rank %d expert %d: recv_count %d, oracle %d", info.rank, local,
                      count[local], e.count[local]);
        for (int r = 0; r < world; r++)
            if (range[local * world + r] != e.range[local * world + r])
                TEST_FAIL("rank %d expert %d source %d: layout range 0x%llx, oracle 0x%llx",
                          info.rank, local, r, (unsigned long long)range[local * world + r],
                          (unsigned long long)e.range[local * world + r]);
        for (int64_t i = 0; i < e.count[local]; i++) {
            int64_t row = local * rows + i;
            if (src[row] != e.src_token[row])
                TEST_FAIL("rank %d expert %d row %lld: src_info %d, oracle %d (from rank %d)",
                          info.rank, local, (long long)i, src[row], e.src_token[row],
                          e.src_rank[row]);
            const char *have_x = (const char *)s->recv.x + (size_t)row * hidden * element;
            const char *want_x = (const char *)e.x + (size_t)row * hidden * element;
            int64_t at = first_difference(have_x, want_x, (size_t)hidden * element);
            if (at >= 0)
                TEST_FAIL("rank %d expert %d row %lld (rank %d token %d): x differs from the "
                          "oracle at byte %lld: 0x%02x, oracle 0x%02x",
                          info.rank, local, (long long)i, e.src_rank[row], e.src_token[row],
                          (long long)at, (unsigned char)have_x[at], (unsigned char)want_x[at]);
            if (!s->cast.use_fp8)
                continue;
            for (int64_t gi = 0; gi < groups; gi++) {
                float want = e.scales[row * groups + gi];
                uint32_t bits;
                memcpy(&bits, &want, 4);
                if (s->cast.use_ue8m0) {
                    /* [rows][hidden / 512] int32 = [rows][groups] exponent bytes. */
                    const uint8_t *bytes = s->recv.scales;
                    if (bytes[(size_t)row * groups + (size_t)gi] != ((bits >> 23) & 0xff))
                        TEST_FAIL("rank %d expert %d row %lld group %lld: ue8m0 byte %u, "
                                  "oracle %u", info.rank, local, (long long)i, (long long)gi,
                                  bytes[(size_t)row * groups + (size_t)gi], (bits >> 23) & 0xff);
                } else {
                    float have = ((const float *)s->recv.scales)[row * groups + gi];
                    if (memcmp(&have, &want, 4) != 0)
                        TEST_FAIL("rank %d expert %d row %lld group %lld: scale %a, oracle %a",
                                  info.rank, local, (long long)i, (long long)gi, (double)have,
                                  (double)want);
                }
            }
        }
    }
    moe_ll_expected_free(&e);
}

/* Expert outputs of this rank's received rows (as check_dispatch copied them back), in
 * host memory [L][rows][hidden]; rows past the counts are zeros. */
static uint16_t *expert_outputs(const step_t *s)
{
    int world = info.world_size, num_local = EXPERTS_PER_RANK;
    int64_t rows = (int64_t)MAX_TOKENS * world, hidden = s->c.hidden;
    const int32_t *count = s->recv.count;
    const int32_t *src = s->recv.src;
    const int64_t *range = s->recv.range;
    if (count == NULL)
        TEST_FAIL("rank %d: expert outputs before check_dispatch", info.rank);
    uint16_t *x = calloc(combine_input_bytes(hidden) / 2, 2);
    CHECK(x != NULL);
    for (int local = 0; local < num_local; local++) {
        for (int r = 0; r < world; r++) {
            int64_t begin = (int64_t)((uint64_t)range[local * world + r] >> 32);
            int64_t n = range[local * world + r] & 0xffffffff;
            CHECK(begin + n <= rows);
            for (int64_t i = begin; i < begin + n; i++)
                moe_ll_expert_row(&s->c, (int64_t)info.rank * num_local + local, r,
                                  src[local * rows + i], x + ((size_t)local * rows + i) * hidden);
        }
        CHECK(count[local] <= rows);
    }
    return x;
}

/* The expert outputs written into `dst` (backend memory: a tensor or the zero-copy view). */
static void fill_expert_outputs(const step_t *s, void *dst)
{
    uint16_t *x = expert_outputs(s);
    mr_mem_to_device(dst, x, combine_input_bytes(s->c.hidden));
    free(x);
}

/* The expert outputs in new backend memory (mr_mem_free it). */
static void *alloc_expert_outputs(const step_t *s)
{
    uint16_t *x = expert_outputs(s);
    void *memory = mr_mem_from_host(x, combine_input_bytes(s->c.hidden));
    free(x);
    return memory;
}

static epx_status_t step_combine(epx_buffer_t buffer, step_t *s, void *x, uint32_t flags,
                                 epx_ll_combine_result_t *result)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = s->got.handle;
    args.x = (epx_tensor_t)EPX_TENSOR_NONE;
    args.x.data = x;
    args.x.dtype = EPX_DTYPE_BF16;
    args.x.ndim = 3;
    args.x.shape[0] = EXPERTS_PER_RANK;
    args.x.shape[1] = (int64_t)MAX_TOKENS * info.world_size;
    args.x.shape[2] = s->c.hidden;
    args.topk_idx = epx_tensor_2d(s->topk_idx, EPX_DTYPE_INT64, s->in.num_tokens, TOPK);
    args.topk_weights =
        epx_tensor_2d(s->topk_weights, EPX_DTYPE_FP32, s->in.num_tokens, TOPK);
    args.out = epx_tensor_2d(s->out, EPX_DTYPE_BF16, s->in.num_tokens, s->c.hidden);
    args.flags = flags;
    if (combine_wait_stats != NULL)
        args.wait_recv_cost_stats =
            epx_tensor_1d(combine_wait_stats, EPX_DTYPE_INT64, info.world_size);
    mr_mem_sync();
    return epx_ll_combine(buffer, &args, result, NULL);
}

/* `result`: that of a blocking combine whose count is checked, or NULL. */
static void check_combine(step_t *s, const uint8_t *mask,
                          const epx_ll_combine_result_t *result)
{
    uint16_t *want;
    int64_t masked;
    CHECK_EQ_INT(moe_ll_oracle_combine(&s->c, info.rank, mask, &want, &masked), 0);
    if (result != NULL)
        check_masked_count("combine", result->num_masked_entries, masked);
    mr_mem_to_host(s->out_host, s->out, out_bytes(s));
    int64_t n = s->in.num_tokens * s->c.hidden;
    for (int64_t i = 0; i < n; i++)
        if (s->out_host[i] != want[i])
            TEST_FAIL("rank %d combine token %lld column %lld: 0x%04x, oracle 0x%04x", info.rank,
                      (long long)(i / s->c.hidden), (long long)(i % s->c.hidden), s->out_host[i],
                      want[i]);
    free(want);
}

/*
 * Three steps, dispatch, check, combine, check, on a buffer of low_latency_dtype
 * `ll_dtype`; with `split` every other step goes through EPX_LL_SEND_ONLY + receive.
 */
static void run_steps(const char *name, int64_t hidden, moe_ll_cast_t cast, int empty_rank,
                      epx_dtype_t ll_dtype, int split)
{
    epx_buffer_t buffer = make_buffer_of(hidden, ll_dtype);
    /* cumulative_local_expert_recv_stats: every step's recv_count adds up (from 5 each). */
    int32_t stats_want[EXPERTS_PER_RANK], stats_got[EXPERTS_PER_RANK];
    for (int local = 0; local < EXPERTS_PER_RANK; local++)
        stats_want[local] = 5;
    recv_stats = mr_mem_from_host(stats_want, sizeof(stats_want));
    for (int iteration = 0; iteration < 3; iteration++) {
        step_t s;
        step_init(&s, 100 + (uint64_t)iteration, hidden, MAX_TOKENS - iteration, empty_rank, cast);
        int send_only = split && iteration % 2 == 1;
        if (ll_dtype == EPX_DTYPE_FP8_E4M3 && iteration == 1) {
            /* Refused before anything is sent: the step below still pairs up across ranks. */
            moe_ll_cast_t wanted = s.cast;
            s.cast = (moe_ll_cast_t){0, 0, 0};
            CHECK_STATUS(step_dispatch(buffer, &s, 0), EPX_ERR_INVALID_ARG);
            CHECK_ERROR_MENTIONS("low_latency_dtype");
            s.cast = wanted;
        }
        CHECK_OK(step_dispatch(buffer, &s, send_only ? EPX_LL_SEND_ONLY : 0));
        if (send_only)
            CHECK_OK(epx_ll_receive(buffer, s.got.handle, NULL));
        check_dispatch(&s, NULL);
        for (int local = 0; local < EXPERTS_PER_RANK; local++)
            stats_want[local] += s.recv.count[local];
        void *x = alloc_expert_outputs(&s);
        epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
        CHECK_OK(step_combine(buffer, &s, x, 0, &result));
        check_combine(&s, NULL, &result);
        check_no_async_error(buffer, name);
        mr_mem_free(x);
        step_free(&s);
    }
    mr_mem_to_host(stats_got, recv_stats, sizeof(stats_got));
    for (int local = 0; local < EXPERTS_PER_RANK; local++)
        if (stats_got[local] != stats_want[local])
            TEST_FAIL("%s: rank %d: cumulative_local_expert_recv_stats[%d] is %d, expected %d",
                      name, info.rank, local, stats_got[local], stats_want[local]);
    mr_mem_free(recv_stats);
    recv_stats = NULL;
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: %s ok\n", name);
}

/* One blocking step at a time on a buffer sized for bf16 rows (the default). */
static void run_blocking(const char *name, int64_t hidden, moe_ll_cast_t cast, int empty_rank)
{
    run_steps(name, hidden, cast, empty_rank, EPX_DTYPE_BF16, 0);
}

/*
 * Every token to expert 0: with several ranks it receives more rows than M, so the
 * receive must pack rows over cells not read yet (M - 1 and M - 2 tokens per rank shift
 * each source's rows by a few places only), in bf16 and fp8 with UE8M0 scales.
 */
static void run_crowded(void)
{
    moe_ll_cast_t bf16 = {0, 0, 0}, ue8m0 = {1, 1, 1};
    routing = MOE_ROUTING_ONE_EXPERT;
    run_steps("crowded expert, bf16", 256, bf16, -1, EPX_DTYPE_BF16, 0);
    run_steps("crowded expert, fp8 ue8m0", 512, ue8m0, -1, EPX_DTYPE_BF16, 1);
    routing = MOE_ROUTING_RANDOM;
}

/*
 * A CUDA buffer across nodes (EPX_RANKS_PER_NODE below the world size) has both modes:
 * its normal-mode part lives in NVSHMEM symmetric memory beside the low-latency part
 * (test_normal checks that mode on the same splits); low-latency steps on it work, with
 * stores inside a node and NVSHMEM puts across.
 */
static void run_across_nodes(void)
{
    epx_buffer_t buffer = make_buffer(256);
    moe_ll_cast_t fp8 = {1, 0, 0};
    step_t s;
    step_init(&s, 7, 256, MAX_TOKENS, -1, fp8);
    CHECK_OK(step_dispatch(buffer, &s, 0));
    check_dispatch(&s, NULL);
    void *x = alloc_expert_outputs(&s);
    epx_ll_combine_result_t combined = EPX_LL_COMBINE_RESULT_INIT;
    CHECK_OK(step_combine(buffer, &s, x, 0, &combined));
    check_combine(&s, NULL, &combined);
    check_no_async_error(buffer, "across nodes");
    mr_mem_free(x);
    step_free(&s);
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: across %d nodes: low-latency ok on a buffer with both modes\n",
               info.world_size / info.ranks_per_node);
}

/* Two steps in flight; step 0's combine after step 1's dispatch; zero-copy combine. */
static void run_overlap(void)
{
    int64_t hidden = 256;
    moe_ll_cast_t fp8 = {1, 0, 0}, bf16 = {0, 0, 0};
    epx_buffer_t buffer = make_buffer(hidden);
    for (int round = 0; round < 3; round++) {
        step_t s0, s1;
        step_init(&s0, 200 + (uint64_t)round * 2, hidden, MAX_TOKENS, -1, fp8);
        step_init(&s1, 201 + (uint64_t)round * 2, hidden, MAX_TOKENS - 1, -1, bf16);
        CHECK_OK(step_dispatch(buffer, &s0, EPX_LL_SEND_ONLY));
        CHECK_OK(step_dispatch(buffer, &s1, EPX_LL_SEND_ONLY));
        CHECK_OK(epx_ll_receive(buffer, s1.got.handle, NULL)); /* any order */
        CHECK_OK(epx_ll_receive(buffer, s0.got.handle, NULL));
        check_dispatch(&s0, NULL);
        check_dispatch(&s1, NULL);

        epx_tensor_t zero_copy;
        CHECK_OK(epx_ll_get_combine_buffer(buffer, s0.got.handle, &zero_copy));
        CHECK_EQ_INT(zero_copy.ndim, 3);
        CHECK_EQ_INT(zero_copy.dtype, EPX_DTYPE_BF16);
        CHECK_EQ_INT(zero_copy.shape[0], EXPERTS_PER_RANK);
        CHECK_EQ_INT(zero_copy.shape[1], (int64_t)MAX_TOKENS * info.world_size);
        CHECK_EQ_INT(zero_copy.shape[2], hidden);
        fill_expert_outputs(&s0, zero_copy.data);
        CHECK_OK(step_combine(buffer, &s0, zero_copy.data, EPX_LL_SEND_ONLY, NULL));
        void *x1 = alloc_expert_outputs(&s1);
        epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
        CHECK_OK(step_combine(buffer, &s1, x1, 0, &result));
        CHECK_OK(epx_ll_receive(buffer, s0.got.handle, NULL));
        check_combine(&s0, NULL, NULL);
        check_combine(&s1, NULL, &result);
        /* Combining a step again is allowed and gives the same answer. */
        step_poison_out(&s1);
        CHECK_OK(step_combine(buffer, &s1, x1, 0, NULL));
        check_combine(&s1, NULL, NULL);
        /* Again with other expert outputs (copied in while the peers may still read the
         * last ones: on the GPU the second combine of a step waits until every peer's
         * previous combine has ended): the sums of the new outputs. */
        step_poison_out(&s1);
        s1.c.combine_salt = 1 + (uint64_t)round;
        void *x2 = alloc_expert_outputs(&s1);
        CHECK_OK(step_combine(buffer, &s1, x2, 0, NULL));
        check_combine(&s1, NULL, NULL);
        s1.c.combine_salt = 0;
        mr_mem_free(x2);
        check_no_async_error(buffer, "overlap");
        mr_mem_free(x1);
        step_free(&s0);
        step_free(&s1);
    }
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: overlap + send-only + zero-copy ok\n");
}

static void expect_state_error(const char *what, epx_status_t got, const char *needle)
{
    if (got != EPX_ERR_INVALID_STATE)
        TEST_FAIL("%s returned %s, expected EPX_ERR_INVALID_STATE (%s)", what,
                  epx_status_name(got), epx_last_error());
    CHECK_ERROR_MENTIONS(needle);
    if (info.rank == 0)
        printf("test_ll: refused %-36s \"%s\"\n", what, epx_last_error());
}

/* Every misuse is refused with no effect; the buffer keeps working afterwards. */
static void run_misuse(void)
{
    int64_t hidden = 128;
    moe_ll_cast_t bf16 = {0, 0, 0};
    epx_buffer_t buffer = make_buffer(hidden);
    step_t s0, s1, s2;
    step_init(&s0, 300, hidden, MAX_TOKENS, -1, bf16);
    step_init(&s1, 301, hidden, MAX_TOKENS, -1, bf16);
    step_init(&s2, 302, hidden, MAX_TOKENS, -1, bf16);
    void *x = mr_mem_alloc(combine_input_bytes(hidden), 0);

    CHECK_OK(step_dispatch(buffer, &s0, EPX_LL_SEND_ONLY));
    expect_state_error("combine before receive", step_combine(buffer, &s0, x, 0, NULL),
                       "epx_ll_receive");
    CHECK_OK(step_dispatch(buffer, &s1, EPX_LL_SEND_ONLY));
    expect_state_error("third operation in flight", step_dispatch(buffer, &s2, 0), "in flight");
    expect_state_error("clean while in flight", epx_ll_clean_buffer(buffer, NULL), "receive");
    CHECK_OK(epx_ll_receive(buffer, s0.got.handle, NULL));
    expect_state_error("receive with nothing pending", epx_ll_receive(buffer, s0.got.handle, NULL),
                       "nothing is pending");
    CHECK_OK(epx_ll_receive(buffer, s1.got.handle, NULL));
    check_dispatch(&s0, NULL);
    check_dispatch(&s1, NULL);
    /* Step 2 takes step 0's slot: step 0's handle is stale from now on. */
    CHECK_OK(step_dispatch(buffer, &s2, 0));
    check_dispatch(&s2, NULL);
    expect_state_error("combine with a reused slot", step_combine(buffer, &s0, x, 0, NULL),
                       "stale");
    expect_state_error("receive with a reused slot", epx_ll_receive(buffer, s0.got.handle, NULL),
                       "stale");
    epx_tensor_t view;
    expect_state_error("combine buffer of a reused slot",
                       epx_ll_get_combine_buffer(buffer, s0.got.handle, &view), "stale");
    /* Still usable: steps 1 and 2 combine correctly. */
    fill_expert_outputs(&s1, x);
    CHECK_OK(step_combine(buffer, &s1, x, EPX_LL_SEND_ONLY, NULL));
    expect_state_error("combine while its combine is pending",
                       step_combine(buffer, &s1, x, 0, NULL), "epx_ll_receive");
    CHECK_OK(epx_ll_receive(buffer, s1.got.handle, NULL));
    check_combine(&s1, NULL, NULL);
    fill_expert_outputs(&s2, x);
    CHECK_OK(step_combine(buffer, &s2, x, 0, NULL));
    check_combine(&s2, NULL, NULL);
    CHECK_OK(epx_ll_clean_buffer(buffer, NULL));
    expect_state_error("handle after clean", step_combine(buffer, &s2, x, 0, NULL), "stale");
    epx_ll_handle_t none = EPX_LL_HANDLE_NONE;
    CHECK_STATUS(epx_ll_receive(buffer, none, NULL), EPX_ERR_INVALID_ARG);
    /* And a fresh step after all that. */
    step_t s3;
    step_init(&s3, 303, hidden, MAX_TOKENS, -1, bf16);
    CHECK_OK(step_dispatch(buffer, &s3, 0));
    check_dispatch(&s3, NULL);
    fill_expert_outputs(&s3, x);
    CHECK_OK(step_combine(buffer, &s3, x, 0, NULL));
    check_combine(&s3, NULL, NULL);
    check_no_async_error(buffer, "misuse");
    mr_mem_free(x);
    step_free(&s0);
    step_free(&s1);
    step_free(&s2);
    step_free(&s3);
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: misuse ok\n");
}

/* What the wait-time tests start every entry at: 10 s + rank, so that a backend that
 * wrote its times instead of adding them would be caught. */
#define WAIT_STATS_BASE 10000000000ll
/* How late the late rank starts a timed operation, and the margins checked: the ranks
 * leave a barrier together first, so the others wait about this long for it. */
#define WAIT_STATS_LATE_US 500000
#define WAIT_STATS_MIN_NS 300000000ll /* what the late rank's entry must grow by */
#define WAIT_STATS_GAP_NS 200000000ll /* and by how much more than every other entry */
/* Set when this buffer's backend refuses wait_recv_cost_stats (a GPU on kernels 1). */
static int wait_stats_refused;

/* [R] int64 in backend memory, entry r = WAIT_STATS_BASE + r (mr_mem_free it). */
static void *wait_stats_alloc(void)
{
    int64_t base[64];
    CHECK(info.world_size <= 64);
    for (int r = 0; r < info.world_size; r++)
        base[r] = WAIT_STATS_BASE + r;
    return mr_mem_from_host(base, (size_t)info.world_size * sizeof(int64_t));
}

/*
 * One operation's wait_recv_cost_stats, before and after it: every entry added a time
 * >= 0 (never fell), and when rank `late` (or -1) started 0.5 s late, every other rank
 * added more than 0.3 s for it, and for every other rank at least 0.2 s less (each rank
 * timed on its own: not the end of a wait for all of them).
 */
static void check_wait_stats(const char *what, const int64_t *before, const int64_t *after,
                             int late)
{
    for (int r = 0; r < info.world_size; r++)
        if (after[r] < before[r])
            TEST_FAIL("rank %d: %s: wait_recv_cost_stats[%d] went from %lld to %lld (the "
                      "receive must add a time >= 0)",
                      info.rank, what, r, (long long)before[r], (long long)after[r]);
    if (late < 0 || late == info.rank)
        return;
    int64_t waited = after[late] - before[late];
    if (waited <= WAIT_STATS_MIN_NS)
        TEST_FAIL("rank %d: %s: rank %d started 0.5 s late, but wait_recv_cost_stats[%d] "
                  "grew by %lld ns only",
                  info.rank, what, late, late, (long long)waited);
    for (int r = 0; r < info.world_size; r++)
        if (r != late && after[r] - before[r] > waited - WAIT_STATS_GAP_NS)
            TEST_FAIL("rank %d: %s: wait_recv_cost_stats[%d] grew by %lld ns, not 0.2 s less "
                      "than the late rank %d's %lld ns",
                      info.rank, what, r, (long long)(after[r] - before[r]), late,
                      (long long)waited);
}

/*
 * wait_recv_cost_stats of dispatch and combine: each receive adds, per rank, the time it
 * waited for that rank, so a rank that starts late shows as the largest entry on every
 * other rank. Step 0 is on time; after a barrier (the ranks start together), the last
 * rank sleeps 0.5 s before its dispatch (step 1), before its combine (step 2), and before
 * both of step 3, which runs with EPX_LL_SEND_ONLY + receive (the slot keeps the tensors for the receive). The last
 * rank, because on the GPU a dispatch's send waits for the lower ranks' counts: a lower
 * late rank would be waited for in the send, which a split step does not time. The
 * results stay the oracle's. Also: a strided tensor is refused (one entry needs no
 * stride, so two ranks and up), and so are the stats on a GPU whose buffer runs kernels
 * 1 (EPX_LL_KERNELS=1), which then is all that is checked.
 */
static void run_wait_stats(void)
{
    int world = info.world_size, late = world >= 2 ? world - 1 : -1;
    int64_t hidden = 256;
    moe_ll_cast_t bf16 = {0, 0, 0};
    size_t bytes = (size_t)world * sizeof(int64_t);
    epx_buffer_t buffer = make_buffer(hidden);
    int64_t before[64], after[64];
    dispatch_wait_stats = wait_stats_alloc();
    combine_wait_stats = wait_stats_alloc();
    for (int step = 0; step < 4; step++) {
        int late_dispatch = step == 1 || step == 3, late_combine = step >= 2;
        uint32_t flags = step == 3 ? EPX_LL_SEND_ONLY : 0;
        step_t s;
        step_init(&s, 500 + (uint64_t)step, hidden, MAX_TOKENS, -1, bf16);
        if (step == 0 && world >= 2) {
            epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
            args.x = epx_tensor_2d(s.x, EPX_DTYPE_BF16, s.in.num_tokens, hidden);
            args.topk_idx = epx_tensor_2d(s.topk_idx, EPX_DTYPE_INT64, s.in.num_tokens, TOPK);
            args.wait_recv_cost_stats =
                epx_tensor_1d(dispatch_wait_stats, EPX_DTYPE_INT64, world);
            args.wait_recv_cost_stats.strides[0] = 2;
            epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
            CHECK_STATUS(epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_INVALID_ARG);
            CHECK_ERROR_MENTIONS("wait_recv_cost_stats must be contiguous");
        }
        CHECK_OK(epx_group_barrier(group)); /* on a loaded machine the ranks drift apart */
        mr_mem_to_host(before, dispatch_wait_stats, bytes);
        if (late_dispatch && info.rank == late)
            usleep(WAIT_STATS_LATE_US);
        epx_status_t status = step_dispatch(buffer, &s, flags);
        if (status == EPX_ERR_UNSUPPORTED && step == 0 && info.backend == EPX_BACKEND_CUDA) {
            CHECK_ERROR_MENTIONS("kernels 2");
            wait_stats_refused = 1;
            if (info.rank == 0)
                printf("test_ll: wait_recv_cost_stats refused on kernels 1: \"%s\"\n",
                       epx_last_error());
            step_free(&s);
            break;
        }
        CHECK_OK(status);
        if (flags)
            CHECK_OK(epx_ll_receive(buffer, s.got.handle, NULL));
        check_dispatch(&s, NULL);
        mr_mem_to_host(after, dispatch_wait_stats, bytes);
        check_wait_stats("dispatch", before, after, late_dispatch ? late : -1);

        void *x = alloc_expert_outputs(&s);
        CHECK_OK(epx_group_barrier(group));
        mr_mem_to_host(before, combine_wait_stats, bytes);
        if (late_combine && info.rank == late)
            usleep(WAIT_STATS_LATE_US);
        epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
        CHECK_OK(step_combine(buffer, &s, x, flags, &result));
        if (flags)
            CHECK_OK(epx_ll_receive(buffer, s.got.handle, NULL));
        check_combine(&s, NULL, &result);
        mr_mem_to_host(after, combine_wait_stats, bytes);
        check_wait_stats("combine", before, after, late_combine ? late : -1);
        check_no_async_error(buffer, "wait stats");
        mr_mem_free(x);
        step_free(&s);
    }
    mr_mem_free(dispatch_wait_stats);
    mr_mem_free(combine_wait_stats);
    dispatch_wait_stats = combine_wait_stats = NULL;
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0 && !wait_stats_refused)
        printf("test_ll: wait_recv_cost_stats ok (rank %d late)\n", late);
}

/* After steps with rank `lost` masked: its entry is as it started, the others no less. */
static void check_masked_wait_stats(const char *what, void *stats, int lost)
{
    int64_t got[64];
    mr_mem_to_host(got, stats, (size_t)info.world_size * sizeof(int64_t));
    for (int r = 0; r < info.world_size; r++)
        if (r == lost ? got[r] != WAIT_STATS_BASE + r : got[r] < WAIT_STATS_BASE + r)
            TEST_FAIL("rank %d: %s: wait_recv_cost_stats[%d] is %lld after steps with rank %d "
                      "masked, from %lld",
                      info.rank, what, r, (long long)got[r], lost,
                      (long long)(WAIT_STATS_BASE + r));
}

/* The last rank is lost: every other rank masks it and carries on. */
static void run_masked(void)
{
    int world = info.world_size, lost = world - 1;
    int64_t hidden = 256;
    moe_ll_cast_t fp8 = {1, 1, 0};
    epx_buffer_t buffer = make_buffer(hidden);
    uint8_t *mask = calloc((size_t)world, 1);
    mask[lost] = 1;
    /* The masked rank adds nothing to the wait times (the others something >= 0). */
    if (!wait_stats_refused) {
        dispatch_wait_stats = wait_stats_alloc();
        combine_wait_stats = wait_stats_alloc();
    }
    if (info.rank != lost) {
        check_mask_query(buffer, NULL);
        CHECK_OK(epx_ll_mask_rank(buffer, lost));
        CHECK_STATUS(epx_ll_mask_rank(buffer, info.rank), EPX_ERR_INVALID_ARG);
        check_mask_query(buffer, mask);
        for (int iteration = 0; iteration < 2; iteration++) {
            step_t s;
            step_init(&s, 400 + (uint64_t)iteration, hidden, MAX_TOKENS, -1, fp8);
            CHECK_OK(step_dispatch(buffer, &s, iteration ? EPX_LL_SEND_ONLY : 0));
            if (iteration)
                CHECK_OK(epx_ll_receive(buffer, s.got.handle, NULL));
            check_dispatch(&s, mask);
            void *x = alloc_expert_outputs(&s);
            epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
            /* The second step splits its combine too: the receive writes the final count
             * into the result given to the send. */
            CHECK_OK(step_combine(buffer, &s, x, iteration ? EPX_LL_SEND_ONLY : 0, &result));
            if (iteration)
                CHECK_OK(epx_ll_receive(buffer, s.got.handle, NULL));
            /* Where the backend counts (not the CUDA one: -1), something was masked. */
            if (result.num_masked_entries != -1 || !mr_mem_is_device())
                CHECK(result.num_masked_entries > 0 || s.in.num_tokens == 0 || world > 4);
            check_combine(&s, mask, &result);
            /* The lost rank stays the only one masked: no wait gave up on anyone else. */
            check_mask_query(buffer, mask);
            check_no_async_error(buffer, "masked step");
            mr_mem_free(x);
            step_free(&s);
        }
    }
    if (!wait_stats_refused && info.rank != lost) {
        check_masked_wait_stats("dispatch", dispatch_wait_stats, lost);
        check_masked_wait_stats("combine", combine_wait_stats, lost);
    }
    mr_mem_free(dispatch_wait_stats);
    mr_mem_free(combine_wait_stats);
    dispatch_wait_stats = combine_wait_stats = NULL;
    CHECK_OK(epx_group_barrier(group));
    free(mask);
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: masked rank %d ok\n", lost);
}

int main(int argc, char **argv)
{
    alarm(100);
    group = mr_group_create(argc, argv, &info);
    moe_ll_cast_t bf16 = {0, 0, 0}, fp8 = {1, 0, 0}, fp8_pow2 = {1, 1, 0}, ue8m0 = {1, 1, 1};
    run_blocking("bf16", 256, bf16, -1);
    run_blocking("fp8 fp32 scales", 256, fp8, -1);
    /* Scale rows of whole 16-byte vectors (hidden / 128 a multiple of 4) and rows of
     * three 512-channel chunks (a bulk dispatch send copies such scales whole). */
    run_blocking("fp8 fp32 scales, hidden 1536", 1536, fp8, -1);
    run_blocking("fp8 power-of-two scales", 384, fp8_pow2, -1);
    run_blocking("fp8 ue8m0", 512, ue8m0, -1);
    run_blocking("empty rank", 128, bf16, info.world_size - 1);
    /* Buffers sized for fp8 rows (config.low_latency_dtype): the same results. */
    run_steps("fp8 on an fp8-sized buffer", 256, fp8, -1, EPX_DTYPE_FP8_E4M3, 1);
    run_steps("fp8 ue8m0 on an fp8-sized buffer, empty rank", 512, ue8m0, info.world_size - 1,
              EPX_DTYPE_FP8_E4M3, 1);
    run_crowded();
    if (info.backend == EPX_BACKEND_CUDA && info.ranks_per_node < info.world_size)
        run_across_nodes();
    run_overlap();
    run_misuse();
    run_wait_stats();
    if (info.world_size >= 2)
        run_masked();
    CHECK_OK(epx_group_barrier(group));
    CHECK_OK(epx_group_destroy(group));
    printf("test_ll: ok (rank %d of %d, %s backend)\n", info.rank, info.world_size,
           epx_backend_name(info.backend));
    return 0;
}
