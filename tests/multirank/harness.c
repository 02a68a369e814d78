/*
 * Shared pieces of the multi-rank test programs (see harness.h).
 */
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mem.h"
#include "test_util.h"

const char *mr_flag(int argc, char **argv, const char *name, const char *fallback)
{
    size_t length = strlen(name);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], name) == 0 && i + 1 < argc)
            return argv[i + 1];
        if (strncmp(argv[i], name, length) == 0 && argv[i][length] == '=')
            return argv[i] + length + 1;
    }
    return fallback;
}

epx_backend_t mr_backend_flag(int argc, char **argv)
{
    const char *name = mr_flag(argc, argv, "--backend", "auto");
    if (strcmp(name, "auto") == 0)
        return EPX_BACKEND_AUTO;
    if (strcmp(name, "host") == 0)
        return EPX_BACKEND_HOST;
    if (strcmp(name, "cuda") == 0)
        return EPX_BACKEND_CUDA;
    TEST_FAIL("--backend %s: expected host, cuda or auto", name);
}

epx_group_t mr_group_create(int argc, char **argv, epx_group_info_t *info)
{
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create_from_env(mr_backend_flag(argc, argv), &group));
    CHECK_OK(epx_group_get_info(group, info));
    mr_mem_init(group);
    return group;
}

void mr_tensor_to_host(const epx_tensor_t *tensor, int64_t rows, void *dst)
{
    size_t element = epx_dtype_size(tensor->dtype);
    size_t row_bytes = (size_t)tensor->shape[1] * element;
    int64_t stride = tensor->strides[0] != 0 ? tensor->strides[0] : tensor->shape[1];
    if (rows <= 0)
        return;
    if (tensor->data == NULL)
        TEST_FAIL("result tensor has no data");
    if (stride == tensor->shape[1]) {
        mr_mem_to_host(dst, tensor->data, (size_t)rows * row_bytes);
        return;
    }
    for (int64_t i = 0; i < rows; i++)
        mr_mem_to_host((char *)dst + (size_t)i * row_bytes,
                       (const char *)tensor->data + (size_t)(i * stride) * element, row_bytes);
}

/* bf16 bits on a line where neighbouring values are neighbouring integers. */
static int64_t bf16_ordinal(uint16_t bits)
{
    return (bits & 0x8000u) ? -(int64_t)(bits & 0x7fffu) : (int64_t)bits;
}

int64_t mr_bf16_ulps(uint16_t a, uint16_t b)
{
    int64_t d = bf16_ordinal(a) - bf16_ordinal(b);
    return d < 0 ? -d : d;
}

/* After "rank", "ranks" or "rank(s)" and a space: the listed numbers, "1, 3" or "1 3". */
static int list_names_rank(const char *list, int rank)
{
    while (*list >= '0' && *list <= '9') {
        char *end;
        long value = strtol(list, &end, 10);
        if (value == rank)
            return 1;
        list = end;
        while (*list == ',' || *list == ' ')
            list++;
    }
    return 0;
}

int mr_message_names_rank(const char *message, int rank)
{
    static const char *const prefixes[] = {"rank ", "ranks ", "rank(s) "};
    for (size_t p = 0; p < sizeof prefixes / sizeof prefixes[0]; p++)
        for (const char *at = strstr(message, prefixes[p]); at != NULL;
             at = strstr(at + 1, prefixes[p]))
            if (list_names_rank(at + strlen(prefixes[p]), rank))
                return 1;
    return 0;
}

double mr_now_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec * 1e3 + (double)now.tv_nsec / 1e6;
}

void mr_set_rank_env(int rank, int world, const char *unique_id)
{
    char rank_text[16], world_text[16];
    snprintf(rank_text, sizeof rank_text, "%d", rank);
    snprintf(world_text, sizeof world_text, "%d", world);
    setenv("EPX_RANK", rank_text, 1);
    setenv("EPX_LOCAL_RANK", rank_text, 1);
    setenv("EPX_WORLD_SIZE", world_text, 1);
    setenv("EPX_UNIQUE_ID", unique_id, 1);
}
