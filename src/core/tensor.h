/*
 * The argument checks every entry point runs on a tensor before a backend sees it
 * (src/core/tensor.c), and the facts about a checked tensor that backends read.
 */
#ifndef EPX_CORE_TENSOR_H
#define EPX_CORE_TENSOR_H

#include <stdint.h>

#include "epx.h"

/* Elements between consecutive rows of a tensor (its strides resolved: contiguous if 0). */
int64_t epx__tensor_row_stride(const epx_tensor_t *tensor);
/* Elements between columns of a 2-d tensor (1 when contiguous). Only x_scales may have
 * more than 1 (column major, epx__validate_dispatch); every other tensor has 1. */
int64_t epx__tensor_col_stride(const epx_tensor_t *tensor);
/* Nonzero when an optional tensor argument is given (data != NULL). */
int epx__tensor_given(const epx_tensor_t *tensor);

/*
 * Check a tensor argument: given, dtype, ndim, shape (a dimension of -1 = any), inner
 * dimension contiguous. Errors name the argument: "dispatch: x has dtype fp32, expected
 * bf16 or fp8_e4m3".
 */
epx_status_t epx__check_tensor(const char *op, const char *name, const epx_tensor_t *tensor,
                               epx_dtype_t dtype, int ndim, int64_t dim0, int64_t dim1);

#endif /* EPX_CORE_TENSOR_H */
