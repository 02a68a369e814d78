/*
 * Low-latency steps checked against the oracle (ll_step.h).
 */
#include "ll_step.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

void ll_step_init(ll_step_t *s, const ll_shape_t *shape, int rank, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    s->shape = shape;
    s->rank = rank;
    s->c = (moe_case_t){shape->world_size, shape->max_tokens, shape->hidden,
                        shape->experts_per_rank * shape->world_size, shape->topk,
                        EPX_DTYPE_BF16, 1, seed, MOE_ROUTING_RANDOM, 0.2, -1, 0, 0, 0};
    CHECK_EQ_INT(moe_ll_inputs_make(&s->c, rank, &s->in), 0);
    size_t bytes = (size_t)(shape->max_tokens * shape->hidden) * 2;
    s->out = malloc(bytes);
    CHECK(s->out != NULL);
    memset(s->out, 0xff, bytes);
    s->got = (epx_ll_dispatch_result_t)EPX_LL_DISPATCH_RESULT_INIT;
    s->combined = (epx_ll_combine_result_t)EPX_LL_COMBINE_RESULT_INIT;
    s->check_dispatch_masked = 1;
}

void ll_step_free(ll_step_t *s)
{
    moe_inputs_free(&s->in);
    free(s->out);
    s->out = NULL;
}

/* A split call's receive; the send's status stands unless the receive adds a worse one. */
static epx_status_t receive_if_split(epx_buffer_t buffer, epx_ll_handle_t handle, uint32_t flags,
                                     epx_status_t sent)
{
    if (!(flags & EPX_LL_SEND_ONLY) ||
        (sent != EPX_SUCCESS && sent != EPX_ERR_REMOTE && sent != EPX_ERR_TIMEOUT))
        return sent;
    epx_status_t received = epx_ll_receive(buffer, handle, NULL);
    return received != EPX_SUCCESS ? received : sent;
}

epx_status_t ll_step_dispatch(epx_buffer_t buffer, ll_step_t *s, uint32_t flags)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(s->in.x, EPX_DTYPE_BF16, s->in.num_tokens, s->shape->hidden);
    args.topk_idx =
        epx_tensor_2d(s->in.topk_idx, EPX_DTYPE_INT64, s->in.num_tokens, s->shape->topk);
    args.flags = flags;
    epx_status_t status = epx_ll_dispatch(buffer, &args, &s->got, NULL);
    return receive_if_split(buffer, s->got.handle, flags, status);
}

void ll_step_check_dispatch(const ll_step_t *s, const uint8_t *mask, const char *what)
{
    int64_t hidden = s->shape->hidden;
    moe_ll_expected_t e;
    moe_ll_cast_t bf16 = {0, 0, 0};
    CHECK_EQ_INT(moe_ll_oracle_dispatch(&s->c, s->rank, s->shape->max_tokens, mask, bf16, &e), 0);
    const int32_t *count = s->got.recv_count.data;
    const int32_t *src = s->got.recv_src_info.data;
    const uint16_t *x = s->got.recv_x.data;
    CHECK(count != NULL && src != NULL && x != NULL);
    for (int local = 0; local < e.num_local; local++) {
        if (count[local] != e.count[local])
            TEST_FAIL("rank %d %s: expert %d received %d rows, oracle %d", s->rank, what, local,
                      count[local], e.count[local]);
        for (int64_t i = 0; i < e.count[local]; i++) {
            int64_t row = local * e.rows + i;
            if (src[row] != e.src_token[row] ||
                memcmp(x + row * hidden, (const uint16_t *)e.x + row * hidden,
                       (size_t)hidden * 2) != 0)
                TEST_FAIL("rank %d %s: expert %d row %lld differs from the oracle", s->rank, what,
                          local, (long long)i);
        }
    }
    if (s->check_dispatch_masked && s->got.num_masked_entries != e.masked_entries)
        TEST_FAIL("rank %d %s: dispatch num_masked_entries %lld, oracle %lld", s->rank, what,
                  (long long)s->got.num_masked_entries, (long long)e.masked_entries);
    moe_ll_expected_free(&e);
}

epx_status_t ll_step_combine(epx_buffer_t buffer, ll_step_t *s, uint32_t flags)
{
    const ll_shape_t *shape = s->shape;
    int R = shape->world_size, L = shape->experts_per_rank;
    int64_t rows = shape->max_tokens * R, hidden = shape->hidden;
    uint16_t *x = calloc((size_t)(L * rows * hidden), 2);
    CHECK(x != NULL);
    const int32_t *count = s->got.recv_count.data;
    const int32_t *src = s->got.recv_src_info.data;
    const int64_t *range = s->got.recv_layout_range.data;
    for (int local = 0; local < L; local++)
        for (int r = 0; r < R; r++) {
            int64_t begin = (int64_t)((uint64_t)range[local * R + r] >> 32);
            int64_t n = range[local * R + r] & 0xffffffff;
            for (int64_t i = begin; i < begin + n && i < count[local]; i++)
                moe_ll_expert_row(&s->c, (int64_t)s->rank * L + local, r, src[local * rows + i],
                                  x + ((size_t)local * (size_t)rows + (size_t)i) * (size_t)hidden);
        }
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = s->got.handle;
    args.x.data = x;
    args.x.dtype = EPX_DTYPE_BF16;
    args.x.ndim = 3;
    args.x.shape[0] = L;
    args.x.shape[1] = rows;
    args.x.shape[2] = hidden;
    args.topk_idx = epx_tensor_2d(s->in.topk_idx, EPX_DTYPE_INT64, s->in.num_tokens, shape->topk);
    args.topk_weights =
        epx_tensor_2d(s->in.topk_weights, EPX_DTYPE_FP32, s->in.num_tokens, shape->topk);
    args.out = epx_tensor_2d(s->out, EPX_DTYPE_BF16, s->in.num_tokens, hidden);
    args.flags = flags;
    s->combined = (epx_ll_combine_result_t)EPX_LL_COMBINE_RESULT_INIT;
    epx_status_t status = epx_ll_combine(buffer, &args, &s->combined, NULL);
    status = receive_if_split(buffer, s->got.handle, flags, status);
    free(x);
    return status;
}

void ll_step_check_combine(const ll_step_t *s, const uint8_t *mask, const char *what)
{
    uint16_t *want;
    int64_t masked;
    int64_t hidden = s->shape->hidden;
    CHECK_EQ_INT(moe_ll_oracle_combine(&s->c, s->rank, mask, &want, &masked), 0);
    if (s->combined.num_masked_entries != masked)
        TEST_FAIL("rank %d %s: combine num_masked_entries %lld, oracle %lld", s->rank, what,
                  (long long)s->combined.num_masked_entries, (long long)masked);
    for (int64_t i = 0; i < s->in.num_tokens * hidden; i++)
        if (s->out[i] != want[i])
            TEST_FAIL("rank %d %s: combine out[%lld][%lld] = 0x%04x, oracle 0x%04x", s->rank,
                      what, (long long)(i / hidden), (long long)(i % hidden), s->out[i], want[i]);
    free(want);
}

void ll_step_run_checked(epx_buffer_t buffer, const ll_shape_t *shape, int rank, uint64_t seed,
                         const uint8_t *mask, uint32_t flags, const char *what)
{
    ll_step_t s;
    ll_step_init(&s, shape, rank, seed);
    epx_status_t status = ll_step_dispatch(buffer, &s, flags);
    if (status != EPX_SUCCESS)
        TEST_FAIL("rank %d %s: dispatch returned %s: %s", rank, what, epx_status_name(status),
                  epx_last_error());
    ll_step_check_dispatch(&s, mask, what);
    status = ll_step_combine(buffer, &s, flags);
    if (status != EPX_SUCCESS)
        TEST_FAIL("rank %d %s: combine returned %s: %s", rank, what, epx_status_name(status),
                  epx_last_error());
    ll_step_check_combine(&s, mask, what);
    ll_step_free(&s);
}
