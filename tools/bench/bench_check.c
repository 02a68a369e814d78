/*
 * `epx bench --check` comparisons. Dispatch moves bytes without arithmetic, so its
 * results must match the oracle bit for bit; combine sums in fp32 and rounds once to
 * bf16, where the summation order may differ by backend, hence one ulp of slack.
 * Only the first difference is printed: it locates the bug, the rest is noise.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "moe_case.h"

/* One element as text: hex bits and, where it helps, the value. */
static void format_value(epx_dtype_t dtype, const void *data, int64_t index, char *text,
                         size_t size)
{
    switch (dtype) {
    case EPX_DTYPE_BF16: {
        uint16_t bits = ((const uint16_t *)data)[index];
        snprintf(text, size, "0x%04x (%g)", bits, (double)moe_bf16_to_float(bits));
        break;
    }
    case EPX_DTYPE_FP32: {
        float value;
        memcpy(&value, (const char *)data + index * 4, 4);
        uint32_t bits;
        memcpy(&bits, &value, 4);
        snprintf(text, size, "0x%08" PRIx32 " (%g)", bits, (double)value);
        break;
    }
    case EPX_DTYPE_INT64:
        snprintf(text, size, "%" PRId64, ((const int64_t *)data)[index]);
        break;
    case EPX_DTYPE_INT32:
        snprintf(text, size, "%" PRId32, ((const int32_t *)data)[index]);
        break;
    default: /* fp8 and bool: one byte */
        snprintf(text, size, "0x%02x", ((const uint8_t *)data)[index]);
        break;
    }
}

static void report(const char *label, const char *what, epx_dtype_t dtype, const void *got,
                   const void *expected, int64_t index, int64_t cols)
{
    char got_text[64], expected_text[64];
    format_value(dtype, got, index, got_text, sizeof(got_text));
    format_value(dtype, expected, index, expected_text, sizeof(expected_text));
    fprintf(stderr, "epx bench: %s: %s differs at row %lld column %lld: got %s, expected %s\n",
            label, what, (long long)(index / cols), (long long)(index % cols), got_text,
            expected_text);
}

int epx__bench_compare(const char *label, const char *what, epx_dtype_t dtype, const void *got,
                       const void *expected, int64_t rows, int64_t cols)
{
    size_t element = epx_dtype_size(dtype);
    int64_t count = rows * cols;
    if (count <= 0 || memcmp(got, expected, (size_t)count * element) == 0)
        return 1;
    for (int64_t i = 0; i < count; i++) {
        if (memcmp((const char *)got + i * element, (const char *)expected + i * element,
                   element) != 0) {
            report(label, what, dtype, got, expected, i, cols);
            return 0;
        }
    }
    return 1;
}

/* bf16 bits as an integer that orders like the value (+0 and -0 both map to 0). */
static int32_t ordered(uint16_t bits)
{
    return (bits & 0x8000u) ? -(int32_t)(bits & 0x7fffu) : (int32_t)bits;
}

static int is_nan(uint16_t bits)
{
    return (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0;
}

int epx__bench_compare_bf16(const char *label, const char *what, const uint16_t *got,
                            const uint16_t *expected, int64_t rows, int64_t cols, int max_ulp)
{
    int64_t count = rows * cols;
    for (int64_t i = 0; i < count; i++) {
        int32_t distance = ordered(got[i]) - ordered(expected[i]);
        if (distance < 0)
            distance = -distance;
        if (is_nan(got[i]) || is_nan(expected[i]) || distance > max_ulp) {
            report(label, what, EPX_DTYPE_BF16, got, expected, i, cols);
            return 0;
        }
    }
    return 1;
}
