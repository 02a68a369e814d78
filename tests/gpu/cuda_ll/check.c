/* tests/gpu/cuda_ll: the exact checks of dispatch and combine results, and buffers. */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda_ll.h"

/* ---------------------------------------------------------------- checks */

/* Element strides of a result view (all 0 = contiguous, row major). */
void view_strides(const epx_tensor_t *t, int64_t stride[EPX_MAX_DIMS])
{
    int contiguous = 1;
    for (int d = 0; d < t->ndim; d++)
        contiguous &= t->strides[d] == 0;
    int64_t running = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        stride[d] = contiguous ? running : t->strides[d];
        running *= t->shape[d];
    }
}

/*
 * Rows first..first+n-1 of block `block` of a 3-d view [blocks, rows, C] (or elements
 * first..first+n-1 of row `block` of a 2-d view [blocks, C]; or of a 1-d view) into
 * contiguous host memory. The stream has been synchronised.
 */
void copy_back(void *dst, const epx_tensor_t *t, int64_t block, int64_t first, int64_t n)
{
    if (n <= 0)
        return;
    int64_t stride[EPX_MAX_DIMS];
    view_strides(t, stride);
    size_t element = epx_dtype_size(t->dtype);
    const char *base = (const char *)t->data;
    if (t->ndim == 1) { /* `block` is 0 */
        CUDA_OK(cudaMemcpy(dst, base + (size_t)(first * stride[0]) * element,
                           (size_t)n * element, cudaMemcpyDeviceToHost));
    } else if (t->ndim == 2) {
        CUDA_OK(cudaMemcpy(dst, base + (size_t)(block * stride[0] + first) * element,
                           (size_t)n * element, cudaMemcpyDeviceToHost));
    } else {
        size_t row = (size_t)t->shape[2] * element;
        const char *src = base + (size_t)(block * stride[0] + first * stride[1]) * element;
        CUDA_OK(cudaMemcpy2D(dst, row, src, (size_t)stride[1] * element, row, (size_t)n,
                             cudaMemcpyDeviceToHost));
    }
}

int64_t first_difference(const void *a, const void *b, size_t bytes)
{
    const unsigned char *p = a, *q = b;
    for (size_t i = 0; i < bytes; i++)
        if (p[i] != q[i])
            return (int64_t)i;
    return -1;
}

/* The dispatch result `r` (received; the stream is synchronised here) against the oracle. */
void check_dispatch(const char *what, const step_t *s, const epx_ll_dispatch_result_t *r)
{
    CUDA_OK(cudaStreamSynchronize(g_stream));
    const moe_ll_expected_t *e = &s->e;
    int world = g_world, num_local = e->num_local, fp8 = s->cast.use_fp8;
    int64_t rows = e->rows, hidden = s->shape.hidden, groups = hidden / 128;
    epx_dtype_t scale_dtype = s->cast.use_ue8m0 ? EPX_DTYPE_INT32 : EPX_DTYPE_FP32;
    int64_t scale_cols = s->cast.use_ue8m0 ? hidden / 512 : groups;
    if (r->recv_x.data == NULL || r->recv_x.ndim != 3 || r->recv_x.shape[0] != num_local ||
        r->recv_x.shape[1] != rows || r->recv_x.shape[2] != hidden ||
        r->recv_x.dtype != (fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16) ||
        r->recv_count.data == NULL || r->recv_count.shape[0] != num_local ||
        r->recv_count.dtype != EPX_DTYPE_INT32 || r->recv_src_info.data == NULL ||
        r->recv_src_info.dtype != EPX_DTYPE_INT32 || r->recv_src_info.shape[1] != rows ||
        r->recv_layout_range.data == NULL || r->recv_layout_range.dtype != EPX_DTYPE_INT64 ||
        r->recv_layout_range.shape[1] != world ||
        (fp8 && (r->recv_x_scales.data == NULL || r->recv_x_scales.ndim != 3 ||
                 r->recv_x_scales.dtype != scale_dtype || r->recv_x_scales.shape[1] != rows ||
                 r->recv_x_scales.shape[2] != scale_cols))) {
        fail(what, "dispatch result shapes: recv_x %s [%lld, %lld, %lld], scales %s [.., %lld, "
             "%lld], count %s [%lld], src_info %s [.., %lld], range %s [.., %lld]; expected "
             "L %d, rows %lld, hidden %lld", epx_dtype_name(r->recv_x.dtype),
             (long long)r->recv_x.shape[0], (long long)r->recv_x.shape[1],
             (long long)r->recv_x.shape[2], epx_dtype_name(r->recv_x_scales.dtype),
             (long long)r->recv_x_scales.shape[1], (long long)r->recv_x_scales.shape[2],
             epx_dtype_name(r->recv_count.dtype), (long long)r->recv_count.shape[0],
             epx_dtype_name(r->recv_src_info.dtype), (long long)r->recv_src_info.shape[1],
             epx_dtype_name(r->recv_layout_range.dtype), (long long)r->recv_layout_range.shape[1],
             num_local, (long long)rows, (long long)hidden);
        return;
    }
    /* GPU: -1 (no host sync). A count, where given, must be the oracle's. */
    if (r->num_masked_entries != -1 && r->num_masked_entries != e->masked_entries)
        fail(what, "num_masked_entries %lld, oracle %lld", (long long)r->num_masked_entries,
             (long long)e->masked_entries);

    int32_t *count = calloc((size_t)num_local, sizeof(int32_t));
    int64_t *range = calloc((size_t)world, sizeof(int64_t));
    int32_t *src = calloc((size_t)rows + 1, sizeof(int32_t));
    size_t x_row = (size_t)hidden * (fp8 ? 1 : 2);
    size_t scale_row = (size_t)scale_cols * 4;
    char *x = malloc((size_t)rows * x_row + 1);
    unsigned char *scales = malloc((size_t)rows * scale_row + 1);
    if (!count || !range || !src || !x || !scales)
        exit(1);
    copy_back(count, &r->recv_count, 0, 0, num_local);
    int bad_count = 0, bad_range = 0, bad_src = 0, bad_x = 0, bad_scale = 0;
    for (int local = 0; local < num_local; local++) {
        if (count[local] != e->count[local] && bad_count++ == 0)
            fail(what, "expert %d: recv_count %d, oracle %d", local, count[local],
                 e->count[local]);
        copy_back(range, &r->recv_layout_range, local, 0, world);
        for (int s_rank = 0; s_rank < world; s_rank++) {
            int64_t want = e->range[local * world + s_rank];
            if (range[s_rank] != want && bad_range++ == 0)
                fail(what, "expert %d source rank %d: layout range begin %lld count %lld, oracle "
                     "begin %lld count %lld", local, s_rank,
                     (long long)((uint64_t)range[s_rank] >> 32),
                     (long long)(range[s_rank] & 0xffffffff), (long long)((uint64_t)want >> 32),
                     (long long)(want & 0xffffffff));
        }
        int64_t n = e->count[local]; /* the oracle's rows; extra rows are a count error */
        copy_back(src, &r->recv_src_info, local, 0, n);
        copy_back(x, &r->recv_x, local, 0, n);
        if (fp8)
            copy_back(scales, &r->recv_x_scales, local, 0, n);
        for (int64_t i = 0; i < n; i++) {
            int64_t row = local * rows + i;
            if (src[i] != e->src_token[row] && bad_src++ == 0)
                fail(what, "expert %d row %lld: recv_src_info %d, oracle token %d of rank %d",
                     local, (long long)i, src[i], e->src_token[row], e->src_rank[row]);
            const unsigned char *want_x = (const unsigned char *)e->x + (size_t)row * x_row;
            const unsigned char *have_x = (const unsigned char *)x + (size_t)i * x_row;
            int64_t at = first_difference(have_x, want_x, x_row);
            if (at >= 0 && bad_x++ == 0) {
                if (fp8)
                    fail(what, "expert %d row %lld (rank %d token %d): fp8 byte %lld is 0x%02x, "
                         "oracle 0x%02x", local, (long long)i, e->src_rank[row],
                         e->src_token[row], (long long)at, have_x[at], want_x[at]);
                else
                    fail(what, "expert %d row %lld (rank %d token %d): bf16 element %lld is "
                         "0x%04x, oracle 0x%04x", local, (long long)i, e->src_rank[row],
                         e->src_token[row], (long long)(at / 2),
                         ((const uint16_t *)have_x)[at / 2], ((const uint16_t *)want_x)[at / 2]);
            }
            for (int64_t g = 0; fp8 && g < groups; g++) {
                float want = e->scales[row * groups + g];
                uint32_t bits;
                memcpy(&bits, &want, 4);
                if (s->cast.use_ue8m0) {
                    /* Exponent byte of group g: byte g % 4 of int32 g / 4 = byte g of the row. */
                    unsigned have = scales[(size_t)i * scale_row + (size_t)g];
                    if (have != ((bits >> 23) & 0xff) && bad_scale++ == 0)
                        fail(what, "expert %d row %lld group %lld: ue8m0 byte %u, oracle %u",
                             local, (long long)i, (long long)g, have, (bits >> 23) & 0xff);
                } else {
                    float have;
                    memcpy(&have, scales + (size_t)i * scale_row + (size_t)g * 4, 4);
                    if (memcmp(&have, &want, 4) != 0 && bad_scale++ == 0)
                        fail(what, "expert %d row %lld group %lld: scale %a (%g), oracle %a (%g)",
                             local, (long long)i, (long long)g, (double)have, (double)have,
                             (double)want, (double)want);
                }
            }
        }
    }
    if (bad_count + bad_range + bad_src + bad_x + bad_scale > 1)
        fail(what, "dispatch mismatches in all: %d counts, %d ranges, %d src_info, %d rows of x, "
             "%d scales", bad_count, bad_range, bad_src, bad_x, bad_scale);
    free(count);
    free(range);
    free(src);
    free(x);
    free(scales);
}

/* The combined output `out` (device; the stream is synchronised here) against the oracle. */
void check_combine(const char *what, const step_t *s, const void *out)
{
    CUDA_OK(cudaStreamSynchronize(g_stream));
    int64_t n = s->shape.tokens * s->shape.hidden, hidden = s->shape.hidden, bad = 0, first = -1;
    uint16_t *got = malloc((size_t)n * 2 + 2);
    if (got == NULL)
        exit(1);
    CUDA_OK(cudaMemcpy(got, out, (size_t)n * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++)
        if (got[i] != s->want[i] && bad++ == 0)
            first = i;
    if (bad > 0) {
        const int64_t *idx = s->in.topk_idx + (first / hidden) * s->shape.topk;
        fail(what, "combine: %lld of %lld values differ; first at token %lld column %lld: 0x%04x, "
             "oracle 0x%04x (token's experts %lld %lld ...)", (long long)bad, (long long)n,
             (long long)(first / hidden), (long long)(first % hidden), got[first], s->want[first],
             (long long)idx[0], (long long)(s->shape.topk > 1 ? idx[1] : -1));
    }
    free(got);
}

/* No asynchronous error, and exactly the ranks of `mask` (NULL = none) masked. */
void check_buffer_state(const char *what, epx_buffer_t buffer, const uint8_t *mask)
{
    epx_status_t error = EPX_SUCCESS;
    char message[512];
    epx_status_t status = epx_get_async_error(buffer, &error, message, sizeof(message));
    if (status != EPX_SUCCESS)
        fail(what, "epx_get_async_error: %s", epx_status_name(status));
    else if (error != EPX_SUCCESS)
        fail(what, "asynchronous error %s: %s", epx_status_name(error), message);
    int32_t masked[1024];
    if (g_world > 1024 || epx_ll_get_masked(buffer, masked, g_world) != EPX_SUCCESS) {
        fail(what, "epx_ll_get_masked: %s", epx_last_error());
        return;
    }
    for (int r = 0; r < g_world; r++)
        if (masked[r] != (mask != NULL && mask[r])) {
            fail(what, "epx_ll_get_masked: rank %d is %smasked%s", r, masked[r] ? "" : "not ",
                 masked[r] ? " (a device wait gave up on it?)" : "");
            break;
        }
}

epx_buffer_t make_buffer(const shape_t *shape)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = shape->max_tokens;
    config.hidden = shape->hidden;
    config.num_experts = shape->experts_per_rank * g_world;
    config.num_topk = shape->topk;
    config.num_sms = g_sms;
    config.max_low_latency_tokens = shape->max_tokens;
    epx_buffer_t buffer = NULL;
    epx_status_t status = epx_buffer_create(g_group, &config, &buffer);
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "cuda_ll: rank %d: epx_buffer_create (M %lld, hidden %lld, %d experts, "
                "top-%d): %s: %s\n", g_rank, (long long)shape->max_tokens,
                (long long)shape->hidden, config.num_experts, shape->topk,
                epx_status_name(status), epx_last_error());
        exit(1);
    }
    return buffer;
}
