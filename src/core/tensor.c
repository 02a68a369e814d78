/*
 * Tensor views: dtype facts, constructors, and the argument checks every entry point
 * runs before a backend sees a tensor.
 *
 * Backends rely on what epx__check_tensor guarantees: data given, the dtype and shape
 * asked for, no negative sizes, the innermost dimension contiguous, rows that do not
 * overlap, and a byte extent that fits in int64. The messages name the operation and
 * the argument, because "invalid argument" alone sends a user hunting through a dozen
 * tensors.
 */
#include <stdio.h>

#include "core/core.h"
#include "core/tensor.h"

size_t epx_dtype_size(epx_dtype_t dtype)
{
    switch (dtype) {
    case EPX_DTYPE_BF16:
        return 2;
    case EPX_DTYPE_FP8_E4M3:
    case EPX_DTYPE_BOOL:
        return 1;
    case EPX_DTYPE_FP32:
    case EPX_DTYPE_INT32:
        return 4;
    case EPX_DTYPE_INT64:
        return 8;
    case EPX_DTYPE_INVALID:
        break;
    }
    return 0;
}

const char *epx_dtype_name(epx_dtype_t dtype)
{
    switch (dtype) {
    case EPX_DTYPE_INVALID:
        return "invalid";
    case EPX_DTYPE_BF16:
        return "bf16";
    case EPX_DTYPE_FP8_E4M3:
        return "fp8_e4m3";
    case EPX_DTYPE_FP32:
        return "fp32";
    case EPX_DTYPE_INT64:
        return "int64";
    case EPX_DTYPE_INT32:
        return "int32";
    case EPX_DTYPE_BOOL:
        return "bool";
    }
    return "unknown";
}

const char *epx_backend_name(epx_backend_t backend)
{
    switch (backend) {
    case EPX_BACKEND_AUTO:
        return "auto";
    case EPX_BACKEND_HOST:
        return "host";
    case EPX_BACKEND_CUDA:
        return "cuda";
    }
    return "unknown";
}

epx_tensor_t epx_tensor_1d(void *data, epx_dtype_t dtype, int64_t n)
{
    epx_tensor_t tensor = EPX_TENSOR_NONE;
    tensor.data = data;
    tensor.dtype = dtype;
    tensor.ndim = 1;
    tensor.shape[0] = n;
    return tensor;
}

epx_tensor_t epx_tensor_2d(void *data, epx_dtype_t dtype, int64_t rows, int64_t cols)
{
    epx_tensor_t tensor = EPX_TENSOR_NONE;
    tensor.data = data;
    tensor.dtype = dtype;
    tensor.ndim = 2;
    tensor.shape[0] = rows;
    tensor.shape[1] = cols;
    return tensor;
}

int epx__tensor_given(const epx_tensor_t *tensor)
{
    return tensor != NULL && tensor->data != NULL;
}

int64_t epx__tensor_row_stride(const epx_tensor_t *tensor)
{
    if (tensor->strides[0] != 0)
        return tensor->strides[0];
    switch (tensor->ndim) {
    case 1:
        return 1;
    case 2:
        return tensor->shape[1];
    case 3:
        return tensor->shape[1] * tensor->shape[2];
    default:
        return 0;
    }
}

int64_t epx__tensor_col_stride(const epx_tensor_t *tensor)
{
    return tensor->ndim >= 2 && tensor->strides[1] != 0 ? tensor->strides[1] : 1;
}

/* "[4, 7168]" from a tensor's own shape. */
static void epx__format_shape(char *out, size_t size, const epx_tensor_t *tensor)
{
    int used = snprintf(out, size, "[");
    for (int i = 0; i < tensor->ndim && i < EPX_MAX_DIMS && used > 0 && (size_t)used < size;
         i++)
        used += snprintf(out + used, size - (size_t)used, "%s%lld", i ? ", " : "",
                         (long long)tensor->shape[i]);
    if (used > 0 && (size_t)used < size)
        snprintf(out + used, size - (size_t)used, "]");
}

/* "[*, 7168]": the shape asked for, * where any size is accepted. */
static void epx__format_expected(char *out, size_t size, int ndim, int64_t dim0, int64_t dim1)
{
    const int64_t dims[EPX_MAX_DIMS] = {dim0, dim1, -1};
    int used = snprintf(out, size, "[");
    for (int i = 0; i < ndim && used > 0 && (size_t)used < size; i++) {
        if (dims[i] < 0)
            used += snprintf(out + used, size - (size_t)used, "%s*", i ? ", " : "");
        else
            used += snprintf(out + used, size - (size_t)used, "%s%lld", i ? ", " : "",
                             (long long)dims[i]);
    }
    if (used > 0 && (size_t)used < size)
        snprintf(out + used, size - (size_t)used, "]");
}

static void epx__format_strides(char *out, size_t size, const epx_tensor_t *tensor)
{
    epx_tensor_t strides = *tensor;
    for (int i = 0; i < EPX_MAX_DIMS; i++)
        strides.shape[i] = tensor->strides[i];
    epx__format_shape(out, size, &strides);
}

/*
 * Strides of a tensor whose shape is already checked. A size-1 dimension may carry any
 * stride (frameworks report arbitrary ones there), since it is never stepped over.
 */
static epx_status_t epx__check_strides(const char *op, const char *name,
                                       const epx_tensor_t *tensor)
{
    const int64_t *shape = tensor->shape, *strides = tensor->strides;
    int ndim = tensor->ndim;
    char text[96];
    epx__format_strides(text, sizeof(text), tensor);

    int all_zero = 1;
    for (int i = 0; i < ndim; i++) {
        if (strides[i] < 0)
            return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s has a negative stride (strides %s)",
                             op, name, text);
        all_zero &= strides[i] == 0;
    }
    if (all_zero)
        return EPX_SUCCESS;
    /* Past the all-zero "contiguous" shorthand, a zero stride is a broadcast view, which
     * the operations would read as packed rows, past the end of the caller's memory. */
    for (int i = 0; i < ndim; i++)
        if (strides[i] == 0 && shape[i] > 1)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: %s has stride 0 in dimension %d (a broadcast view; strides "
                             "%s): pass a materialised tensor",
                             op, name, i, text);

    if (ndim == 3) {
        /* Nothing reads 3-d tensors row by row yet, so only the packed layout is taken. */
        int64_t plane;
        if (__builtin_mul_overflow(shape[1], shape[2], &plane) || strides[2] != 1 ||
            strides[1] != shape[2] || strides[0] != plane)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: %s must be contiguous (strides %s); 3-d tensors cannot be "
                             "strided", op, name, text);
        return EPX_SUCCESS;
    }

    int64_t inner_size = shape[ndim - 1];
    int64_t inner_stride = strides[ndim - 1];
    if (inner_size > 1 && inner_stride != 0 && inner_stride != 1)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: %s must be contiguous in its last dimension (strides %s)", op,
                         name, text);
    if (ndim == 2 && shape[0] > 1 && strides[0] != 0 && strides[0] < shape[1])
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: %s has row stride %lld, less than its row length %lld (rows "
                         "would overlap)", op, name, (long long)strides[0],
                         (long long)shape[1]);
    return EPX_SUCCESS;
}

/* The bytes spanned from the first element to one past the last must fit in int64. */
static epx_status_t epx__check_extent(const char *op, const char *name,
                                      const epx_tensor_t *tensor)
{
    int64_t elements = 1;
    int overflow = 0;
    for (int i = 1; i < tensor->ndim; i++)
        overflow |= __builtin_mul_overflow(elements, tensor->shape[i], &elements);
    if (overflow) {
        /* The row stride below would overflow too. */
    } else if (tensor->shape[0] > 0 && tensor->ndim > 1) {
        int64_t rows_before_last;
        overflow |= __builtin_mul_overflow(tensor->shape[0] - 1,
                                           epx__tensor_row_stride(tensor), &rows_before_last);
        overflow |= __builtin_add_overflow(elements, rows_before_last, &elements);
    } else {
        overflow |= __builtin_mul_overflow(elements, tensor->shape[0], &elements);
    }
    int64_t bytes;
    overflow |= __builtin_mul_overflow(elements, (int64_t)epx_dtype_size(tensor->dtype), &bytes);
    if (overflow || (uint64_t)bytes > (uint64_t)SIZE_MAX) {
        char shape[96];
        epx__format_shape(shape, sizeof(shape), tensor);
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s is too large to address (shape %s)", op,
                         name, shape);
    }
    return EPX_SUCCESS;
}

epx_status_t epx__check_tensor(const char *op, const char *name, const epx_tensor_t *tensor,
                               epx_dtype_t dtype, int ndim, int64_t dim0, int64_t dim1)
{
    if (ndim < 1 || ndim > EPX_MAX_DIMS)
        return EPX_ERROR(EPX_ERR_INTERNAL, "%s: %s checked for %d dimensions", op, name, ndim);
    if (!epx__tensor_given(tensor))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s is required", op, name);

    if (dtype != EPX_DTYPE_INVALID && tensor->dtype != dtype)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s has dtype %s, expected %s", op, name,
                         epx_dtype_name(tensor->dtype), epx_dtype_name(dtype));
    if (epx_dtype_size(tensor->dtype) == 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s has no valid dtype (value %d)", op, name,
                         (int)tensor->dtype);

    if (tensor->ndim != ndim)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s has %d dimension%s, expected %d", op,
                         name, (int)tensor->ndim, tensor->ndim == 1 ? "" : "s", ndim);

    char shape[96], expected[96];
    epx__format_shape(shape, sizeof(shape), tensor);
    for (int i = 0; i < ndim; i++) {
        if (tensor->shape[i] < 0)
            return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s has a negative dimension (shape %s)",
                             op, name, shape);
    }
    if ((dim0 >= 0 && tensor->shape[0] != dim0) ||
        (ndim >= 2 && dim1 >= 0 && tensor->shape[1] != dim1)) {
        epx__format_expected(expected, sizeof(expected), ndim, dim0, dim1);
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s has shape %s, expected %s", op, name,
                         shape, expected);
    }

    EPX_CHECK(epx__check_strides(op, name, tensor));
    EPX_CHECK(epx__check_extent(op, name, tensor));
    return EPX_SUCCESS;
}
