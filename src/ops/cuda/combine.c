/*
 * Host side of combine on the CUDA backend: decide where peers read this rank's input
 * from, then one kernel (combine.cu) in which every home rank pulls its tokens' rows.
 *
 * The pull reads each expert-output row straight from the rank that holds it, so that
 * row has to be in memory the peers have mapped:
 *   - x inside this rank's buffer: the combine-input region (epx_get_combine_input,
 *     for any dispatch dtype), or the dispatch recv_x view overwritten in place with
 *     the expert outputs (a bf16 dispatch's view has exactly combine's shape). Peers
 *     read it where it is: no copy at all. This rank publishes x's byte offset in its
 *     allocation and its row stride (combine.cu); every rank's allocation has the same
 *     layout and each peer adds the offset to its own mapping of this rank's, so any
 *     16-byte aligned x inside the data regions works.
 *   - x inside a range registered with epx_buffer_register: the same, the offset
 *     counted from the range's start, which every peer mapped (registered.c).
 *   - with config.auto_register on, x inside an allocation mapped on demand: the same
 *     (auto_register.c, which maps x's allocation the first time it is seen).
 *   - x anywhere else: one local copy into the receive region first (its dispatch
 *     views are no longer valid: this is a new operation), then the pull. The vector
 *     kernels copy with the SM copy kernel (copy.cu); the bulk-copy kernels
 *     (EPX_NORMAL_KERNELS=2) hand the copy to the copy engines (cudaMemcpy2DAsync, no
 *     SM time) when the host knows how many rows were received, else the SM kernel.
 * Top-k weights, when given, are copied into the combine-weights region (small).
 * No host wait: failures surface through the device error record.
 */
#include <string.h>

#include "ops/cuda/cuda_backend.h"

/* Queue a local copy of `rows` rows into the shared region at `offset`. */
static epx_status_t stage_rows(epx__cuda_buffer_t *cuda, const epx_tensor_t *tensor,
                               int64_t offset, int64_t row_bytes, int64_t rows,
                               const int32_t *rows_device, cudaStream_t stream, const char *what)
{
    epx__cuda_copy_args_t c;
    memset(&c, 0, sizeof(c));
    c.src = tensor->data;
    c.src_pitch = epx__tensor_row_stride(tensor) * (int64_t)epx_dtype_size(tensor->dtype);
    c.dst = cuda->shared + offset;
    c.dst_pitch = row_bytes;
    c.row_bytes = row_bytes;
    c.rows = rows;
    c.rows_device = rows_device;
    EPX_CUDA_CHECK(epx__cuda_launch_copy(&c, cuda->num_sms, stream),
                   "combine: copying %s into the buffer", what);
    return EPX_SUCCESS;
}

/*
 * Where x's rows are, as an offset in this rank's shared allocation: 1 when x already
 * lies inside it (usable in place), 0 when it lies outside, an error when it straddles
 * the edge or cannot be read with 16-byte vectors in place.
 */
static epx_status_t locate_x(const epx__cuda_buffer_t *cuda, const epx_tensor_t *x,
                             int64_t rows, int *inside, int64_t *offset, int64_t *stride)
{
    uintptr_t base = (uintptr_t)cuda->shared;
    uintptr_t end = base + (uintptr_t)cuda->shape.shared_bytes;
    uintptr_t first = (uintptr_t)x->data;
    int64_t pitch = epx__tensor_row_stride(x) * 2;
    int64_t row_bytes = cuda->shape.hidden * 2;
    uintptr_t last = first + (uintptr_t)(rows > 0 ? (rows - 1) * pitch + row_bytes : 0);
    *inside = 0;
    if (last <= base || first >= end)
        return EPX_SUCCESS;
    if (first < base + (uintptr_t)cuda->shape.off_x || last > end)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "combine: x overlaps the buffer's memory but does not lie inside its "
                         "data region; pass a view of the buffer (epx_get_combine_input, or "
                         "recv_x) or memory outside it");
    if ((first - base) % 16 != 0 || pitch % 16 != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "combine: x lies in the buffer at byte offset %llu with row pitch %lld; "
                         "in place it must be 16-byte aligned",
                         (unsigned long long)(first - base), (long long)pitch);
    *inside = 1;
    *offset = (int64_t)(first - base);
    *stride = pitch;
    return EPX_SUCCESS;
}

/*
 * The same for the ranges registered with epx_buffer_register: *region = 1 + the range
 * holding all of x's rows (read in place), else 0 (x is copied in). x crossing a range's
 * edge, or unaligned inside one, is copied in as well: registration is an offer, not a
 * promise about every x.
 */
static void locate_registered(epx_buffer_t buffer, const epx_tensor_t *x, int64_t rows,
                              int32_t *region, int64_t *offset, int64_t *stride)
{
    const epx__cuda_buffer_t *cuda = buffer->impl;
    uintptr_t first = (uintptr_t)x->data;
    int64_t pitch = epx__tensor_row_stride(x) * 2;
    uintptr_t last = first + (uintptr_t)(rows > 0 ? (rows - 1) * pitch + cuda->shape.hidden * 2 : 0);
    *region = 0;
    for (int i = 0; i < EPX_MAX_REGISTERED; i++) {
        uintptr_t base = (uintptr_t)buffer->registered[i].ptr;
        if (buffer->registered[i].bytes == 0 || cuda->registered[i] == NULL || first < base ||
            last > base + buffer->registered[i].bytes)
            continue;
        if ((first - base) % 16 != 0 || pitch % 16 != 0 || first % 16 != 0)
            return;
        *region = i + 1;
        *offset = (int64_t)(first - base);
        *stride = pitch;
        return;
    }
}

epx_status_t epx__cuda_combine(epx_buffer_t buffer, const epx_combine_args_t *args, void *stream)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    const epx__cuda_shape_t *s = &cuda->shape;
    cudaStream_t st = (cudaStream_t)stream;
    EPX_CHECK(epx__cuda_poll(buffer));
    const struct epx_handle *handle = args->handle;
    const epx__cuda_handle_state_t *state = handle->backend_state;
    if (state == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "combine: the handle has no CUDA routing");
    /* The same answer on every rank (the group's shape), before anything is queued; by
     * dtype, as a rank without tokens may pass the tensor with no memory. */
    if (cuda->xn != NULL && (epx__tensor_given(&args->order_topk_idx) ||
                             args->order_topk_idx.dtype != EPX_DTYPE_INVALID))
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "combine: order_topk_idx (DeepEP V2's summation order) across nodes is "
                         "not supported by the CUDA backend yet (one node, or the CPU backend)");

    int64_t rows = args->x.shape[0];
    if (rows > s->max_recv)
        rows = s->max_recv; /* rows past any rank's receive count are never read */
    int inside = 0;
    int64_t x_offset = s->off_x, x_stride = s->hidden * 2;
    int32_t x_region = 0;
    EPX_CHECK(locate_x(cuda, &args->x, rows, &inside, &x_offset, &x_stride));
    if (!inside) {
        locate_registered(buffer, &args->x, rows, &x_region, &x_offset, &x_stride);
        inside = x_region != 0;
    }
    /* Mapped on demand (auto_register.c): an exchange with every peer (a rank that failed
     * before it has published its failure there, through the buffer's abort). */
    if (cuda->autoreg.on)
        EPX_CHECK(epx__cuda_auto_locate(buffer, &args->x, rows, st, inside, &x_region, &x_offset,
                                        &x_stride));
    inside = inside || x_region != 0;
    if (!inside && cuda->kernels == EPX_CUDA_KERNELS_BULK && handle->num_recv_tokens >= 0) {
        int64_t received = rows < handle->num_recv_tokens ? rows : handle->num_recv_tokens;
        size_t row_bytes = (size_t)s->hidden * 2;
        if (received > 0)
            EPX_CUDA_CHECK(cudaMemcpy2DAsync(cuda->shared + s->off_x, row_bytes, args->x.data,
                                             (size_t)epx__tensor_row_stride(&args->x) * 2,
                                             row_bytes, (size_t)received,
                                             cudaMemcpyDefault, st),
                           "combine: copying x into the buffer (copy engines)");
    } else if (!inside) {
        EPX_CHECK(stage_rows(cuda, &args->x, s->off_x, s->hidden * 2, rows, state->recv_count, st,
                             "x"));
    }
    int has_weights = epx__tensor_given(&args->topk_weights);
    if (has_weights)
        EPX_CHECK(stage_rows(cuda, &args->topk_weights, s->off_combine_weights,
                             (int64_t)s->num_topk * 4, rows, state->recv_count, st,
                             "topk_weights"));

    epx__cuda_combine_args_t c;
    memset(&c, 0, sizeof(c));
    c.send_row = state->send_row;
    c.num_tokens = handle->num_tokens;
    c.out_x = args->out_x.data;
    c.out_stride = epx__tensor_row_stride(&args->out_x) * 2;
    c.out_align = epx__cuda_alignment(c.out_x, c.out_stride);
    c.has_weights = has_weights;
    if (has_weights) {
        c.out_weights = args->out_topk_weights.data;
        c.out_weights_stride = epx__tensor_row_stride(&args->out_topk_weights);
    }
    for (int j = 0; j < 2; j++) {
        if (!epx__tensor_given(&args->bias[j]))
            continue;
        c.bias[j] = args->bias[j].data;
        c.bias_stride[j] = epx__tensor_row_stride(&args->bias[j]) * 2;
        c.bias_align[j] = epx__cuda_alignment(c.bias[j], c.bias_stride[j]);
    }
    c.x_offset = x_offset;
    c.x_region = x_region;
    c.x_stride = x_stride;
    c.x_rows = rows;
    /* Internode: the reduce kernel also sums the records this rank forwarded. */
    c.num_blocks = cuda->xn != NULL ? cuda->num_sms : epx__cuda_blocks_for(cuda, handle->num_tokens);
    c.xn = state->xn;
    c.kernels = cuda->kernels;
    c.num_sms = cuda->num_sms;
    if (epx__tensor_given(&args->order_topk_idx)) {
        c.order_topk = args->order_topk_idx.data;
        c.order_stride = epx__tensor_row_stride(&args->order_topk_idx);
    }
    EPX_CUDA_CHECK(epx__cuda_run_combine(cuda, &c, st), "combine: launching the combine kernel");
    return EPX_SUCCESS;
}
