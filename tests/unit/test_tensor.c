/*
 * Tensor helpers: dtype facts, constructors, row strides, and every path by which
 * epx__check_tensor accepts or rejects an argument.
 */
#include <stdint.h>
#include <string.h>

#include "api.h"
#include "test_util.h"

static char storage[64];

static void test_dtypes_and_backends(void)
{
    CHECK_EQ_INT(epx_dtype_size(EPX_DTYPE_BF16), 2);
    CHECK_EQ_INT(epx_dtype_size(EPX_DTYPE_FP8_E4M3), 1);
    CHECK_EQ_INT(epx_dtype_size(EPX_DTYPE_FP32), 4);
    CHECK_EQ_INT(epx_dtype_size(EPX_DTYPE_INT64), 8);
    CHECK_EQ_INT(epx_dtype_size(EPX_DTYPE_INT32), 4);
    CHECK_EQ_INT(epx_dtype_size(EPX_DTYPE_BOOL), 1);
    CHECK_EQ_INT(epx_dtype_size(EPX_DTYPE_INVALID), 0);
    CHECK_EQ_INT(epx_dtype_size((epx_dtype_t)42), 0);

    CHECK(strcmp(epx_dtype_name(EPX_DTYPE_BF16), "bf16") == 0);
    CHECK(strcmp(epx_dtype_name(EPX_DTYPE_FP8_E4M3), "fp8_e4m3") == 0);
    CHECK(strcmp(epx_dtype_name(EPX_DTYPE_FP32), "fp32") == 0);
    CHECK(strcmp(epx_dtype_name(EPX_DTYPE_INT64), "int64") == 0);
    CHECK(strcmp(epx_dtype_name(EPX_DTYPE_INT32), "int32") == 0);
    CHECK(strcmp(epx_dtype_name(EPX_DTYPE_BOOL), "bool") == 0);
    CHECK(strcmp(epx_dtype_name(EPX_DTYPE_INVALID), "invalid") == 0);
    CHECK(strcmp(epx_dtype_name((epx_dtype_t)42), "unknown") == 0);

    CHECK(strcmp(epx_backend_name(EPX_BACKEND_AUTO), "auto") == 0);
    CHECK(strcmp(epx_backend_name(EPX_BACKEND_HOST), "host") == 0);
    CHECK(strcmp(epx_backend_name(EPX_BACKEND_CUDA), "cuda") == 0);
    CHECK(strcmp(epx_backend_name((epx_backend_t)7), "unknown") == 0);
}

static void test_constructors_and_strides(void)
{
    epx_tensor_t none = EPX_TENSOR_NONE;
    CHECK(!epx__tensor_given(&none));
    CHECK(!epx__tensor_given(NULL));

    epx_tensor_t vector = epx_tensor_1d(storage, EPX_DTYPE_INT32, 7);
    CHECK(vector.data == storage);
    CHECK_EQ_INT(vector.dtype, EPX_DTYPE_INT32);
    CHECK_EQ_INT(vector.ndim, 1);
    CHECK_EQ_INT(vector.shape[0], 7);
    CHECK_EQ_INT(vector.shape[1], 0);
    CHECK_EQ_INT(vector.strides[0], 0);
    CHECK(epx__tensor_given(&vector));
    CHECK_EQ_INT(epx__tensor_row_stride(&vector), 1);

    epx_tensor_t matrix = epx_tensor_2d(storage, EPX_DTYPE_BF16, 4, 6);
    CHECK_EQ_INT(matrix.ndim, 2);
    CHECK_EQ_INT(matrix.shape[0], 4);
    CHECK_EQ_INT(matrix.shape[1], 6);
    CHECK_EQ_INT(matrix.strides[0] | matrix.strides[1] | matrix.strides[2], 0);
    CHECK_EQ_INT(epx__tensor_row_stride(&matrix), 6);
    matrix.strides[0] = 10;
    matrix.strides[1] = 1;
    CHECK_EQ_INT(epx__tensor_row_stride(&matrix), 10);

    epx_tensor_t cube = EPX_TENSOR_NONE;
    cube.data = storage;
    cube.dtype = EPX_DTYPE_BF16;
    cube.ndim = 3;
    cube.shape[0] = 2;
    cube.shape[1] = 3;
    cube.shape[2] = 5;
    CHECK_EQ_INT(epx__tensor_row_stride(&cube), 15);
}

static void test_accepted(void)
{
    epx_tensor_t x = epx_tensor_2d(storage, EPX_DTYPE_BF16, 4, 8);
    CHECK_OK(epx__check_tensor("dispatch", "x", &x, EPX_DTYPE_BF16, 2, 4, 8));
    CHECK_OK(epx__check_tensor("dispatch", "x", &x, EPX_DTYPE_BF16, 2, -1, 8));
    CHECK_OK(epx__check_tensor("dispatch", "x", &x, EPX_DTYPE_BF16, 2, -1, -1));
    CHECK_OK(epx__check_tensor("dispatch", "x", &x, EPX_DTYPE_INVALID, 2, 4, -1));

    /* Strided rows, explicit unit inner stride. */
    x.strides[0] = 12;
    x.strides[1] = 1;
    CHECK_OK(epx__check_tensor("dispatch", "x", &x, EPX_DTYPE_BF16, 2, 4, 8));
    x.strides[0] = 8; /* exactly packed */
    CHECK_OK(epx__check_tensor("dispatch", "x", &x, EPX_DTYPE_BF16, 2, 4, 8));

    /* Size-1 dimensions may carry any stride (frameworks report arbitrary ones). */
    epx_tensor_t column = epx_tensor_2d(storage, EPX_DTYPE_FP32, 5, 1);
    column.strides[0] = 1;
    column.strides[1] = 5;
    CHECK_OK(epx__check_tensor("layout", "column", &column, EPX_DTYPE_FP32, 2, 5, 1));
    epx_tensor_t one_row = epx_tensor_2d(storage, EPX_DTYPE_FP32, 1, 8);
    one_row.strides[0] = 3;
    one_row.strides[1] = 1;
    CHECK_OK(epx__check_tensor("layout", "one_row", &one_row, EPX_DTYPE_FP32, 2, 1, 8));

    /* Empty tensors are valid (a rank may have no tokens). */
    epx_tensor_t empty = epx_tensor_2d(storage, EPX_DTYPE_INT64, 0, 8);
    CHECK_OK(epx__check_tensor("dispatch", "topk_idx", &empty, EPX_DTYPE_INT64, 2, 0, 8));

    epx_tensor_t counts = epx_tensor_1d(storage, EPX_DTYPE_INT32, 16);
    CHECK_OK(epx__check_tensor("layout", "num_tokens_per_expert", &counts, EPX_DTYPE_INT32, 1,
                               16, -1));
    counts.strides[0] = 1;
    CHECK_OK(epx__check_tensor("layout", "num_tokens_per_expert", &counts, EPX_DTYPE_INT32, 1,
                               16, 99)); /* dim1 is ignored for 1-d */

    epx_tensor_t cube = EPX_TENSOR_NONE;
    cube.data = storage;
    cube.dtype = EPX_DTYPE_BF16;
    cube.ndim = 3;
    cube.shape[0] = 2;
    cube.shape[1] = 3;
    cube.shape[2] = 5;
    CHECK_OK(epx__check_tensor("ll_dispatch", "recv_x", &cube, EPX_DTYPE_BF16, 3, 2, 3));
    cube.strides[0] = 15;
    cube.strides[1] = 5;
    cube.strides[2] = 1;
    CHECK_OK(epx__check_tensor("ll_dispatch", "recv_x", &cube, EPX_DTYPE_BF16, 3, -1, -1));
}

/* The check must fail with `status`, and the message must be exactly `message`, or
 * (when `exact` is 0) mention it, plus the op and the argument name. */
static void expect_rejected(const epx_tensor_t *tensor, epx_dtype_t dtype, int ndim,
                            int64_t dim0, int64_t dim1, epx_status_t status,
                            const char *message, int exact)
{
    epx__clear_error();
    CHECK_STATUS(epx__check_tensor("dispatch", "x", tensor, dtype, ndim, dim0, dim1), status);
    if (exact && strcmp(epx_last_error(), message) != 0)
        TEST_FAIL("message \"%s\", expected \"%s\"", epx_last_error(), message);
    CHECK_ERROR_MENTIONS(message);
    CHECK(strncmp(epx_last_error(), "dispatch: x ", 12) == 0);
}

static void test_rejected(void)
{
    const epx_status_t bad = EPX_ERR_INVALID_ARG;
    epx_tensor_t none = EPX_TENSOR_NONE;
    expect_rejected(&none, EPX_DTYPE_BF16, 2, -1, -1, bad, "dispatch: x is required", 1);
    expect_rejected(NULL, EPX_DTYPE_BF16, 2, -1, -1, bad, "dispatch: x is required", 1);

    epx_tensor_t x = epx_tensor_2d(storage, EPX_DTYPE_FP32, 4, 7);
    expect_rejected(&x, EPX_DTYPE_BF16, 2, -1, -1, bad,
                    "dispatch: x has dtype fp32, expected bf16", 1);
    x.dtype = (epx_dtype_t)42;
    expect_rejected(&x, EPX_DTYPE_INVALID, 2, -1, -1, bad, "has no valid dtype (value 42)", 0);
    x.dtype = EPX_DTYPE_INVALID;
    expect_rejected(&x, EPX_DTYPE_INVALID, 2, -1, -1, bad, "has no valid dtype", 0);

    x = epx_tensor_2d(storage, EPX_DTYPE_BF16, 4, 7);
    expect_rejected(&x, EPX_DTYPE_BF16, 1, -1, -1, bad,
                    "dispatch: x has 2 dimensions, expected 1", 1);
    epx_tensor_t vector = epx_tensor_1d(storage, EPX_DTYPE_BF16, 4);
    expect_rejected(&vector, EPX_DTYPE_BF16, 2, -1, -1, bad,
                    "dispatch: x has 1 dimension, expected 2", 1);
    vector.ndim = 9;
    expect_rejected(&vector, EPX_DTYPE_BF16, 2, -1, -1, bad, "has 9 dimensions", 0);

    expect_rejected(&x, EPX_DTYPE_BF16, 2, -1, 8, bad,
                    "dispatch: x has shape [4, 7], expected [*, 8]", 1);
    expect_rejected(&x, EPX_DTYPE_BF16, 2, 5, -1, bad,
                    "dispatch: x has shape [4, 7], expected [5, *]", 1);
    vector = epx_tensor_1d(storage, EPX_DTYPE_BF16, 4);
    expect_rejected(&vector, EPX_DTYPE_BF16, 1, 3, -1, bad,
                    "dispatch: x has shape [4], expected [3]", 1);

    x.shape[0] = -1;
    expect_rejected(&x, EPX_DTYPE_BF16, 2, -1, -1, bad,
                    "dispatch: x has a negative dimension (shape [-1, 7])", 1);
    x.shape[0] = 4;

    x.strides[0] = 14;
    x.strides[1] = 2;
    expect_rejected(&x, EPX_DTYPE_BF16, 2, -1, -1, bad,
                    "dispatch: x must be contiguous in its last dimension (strides [14, 2])", 1);
    vector.strides[0] = 3;
    expect_rejected(&vector, EPX_DTYPE_BF16, 1, -1, -1, bad, "contiguous in its last dimension",
                    0);
    x.strides[0] = 6;
    x.strides[1] = 1;
    expect_rejected(&x, EPX_DTYPE_BF16, 2, -1, -1, bad, "has row stride 6, less than its row "
                    "length 7", 0);
    x.strides[0] = -7;
    expect_rejected(&x, EPX_DTYPE_BF16, 2, -1, -1, bad, "has a negative stride", 0);

    epx_tensor_t cube = EPX_TENSOR_NONE;
    cube.data = storage;
    cube.dtype = EPX_DTYPE_BF16;
    cube.ndim = 3;
    cube.shape[0] = 2;
    cube.shape[1] = 3;
    cube.shape[2] = 5;
    cube.strides[0] = 20;
    cube.strides[1] = 5;
    cube.strides[2] = 1;
    expect_rejected(&cube, EPX_DTYPE_BF16, 3, -1, -1, bad, "must be contiguous", 0);

    /* Sizes whose byte extent cannot be addressed are refused, not wrapped. */
    epx_tensor_t huge = epx_tensor_2d(storage, EPX_DTYPE_BF16, INT64_MAX / 4, 1024);
    expect_rejected(&huge, EPX_DTYPE_BF16, 2, -1, -1, bad, "too large to address", 0);
    huge = epx_tensor_2d(storage, EPX_DTYPE_FP32, 3, INT64_MAX / 2);
    expect_rejected(&huge, EPX_DTYPE_FP32, 2, -1, -1, bad, "too large to address", 0);
    huge = epx_tensor_2d(storage, EPX_DTYPE_BF16, 1 << 20, 8);
    huge.strides[0] = INT64_MAX / 8;
    huge.strides[1] = 1;
    expect_rejected(&huge, EPX_DTYPE_BF16, 2, -1, -1, bad, "too large to address", 0);
    cube.strides[0] = cube.strides[1] = cube.strides[2] = 0;
    cube.shape[1] = INT64_MAX / 2;
    expect_rejected(&cube, EPX_DTYPE_BF16, 3, -1, -1, bad, "too large to address", 0);

    /* Asking for an impossible rank is the caller's bug, not the user's. */
    x = epx_tensor_2d(storage, EPX_DTYPE_BF16, 4, 7);
    expect_rejected(&x, EPX_DTYPE_BF16, 0, -1, -1, EPX_ERR_INTERNAL, "checked for 0 dimensions",
                    0);
    expect_rejected(&x, EPX_DTYPE_BF16, 4, -1, -1, EPX_ERR_INTERNAL, "checked for 4 dimensions",
                    0);
    epx__clear_error();
}

int main(void)
{
    test_dtypes_and_backends();
    test_constructors_and_strides();
    test_accepted();
    test_rejected();
    printf("test_tensor: ok\n");
    return 0;
}
