/*
 * Stale objects: a handle, buffer or group used or destroyed after it was destroyed is
 * refused with EPX_ERR_INVALID_ARG and a message, never a crash or a read of freed
 * memory (the AddressSanitizer build checks the latter). Each case runs in a child
 * process, so a case that crashes is reported as a failure and the others still run.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epx.h"
#include "test_util.h"

#define TOKENS 4
#define HIDDEN 64
#define EXPERTS 4
#define TOPK 2

typedef struct {
    epx_group_t group;
    epx_buffer_t buffer;
    epx_handle_t handle;
    uint16_t x[TOKENS * HIDDEN];
    int64_t idx[TOKENS * TOPK];
    uint16_t out[TOKENS * HIDDEN];
} fixture_t;

/* A group of one, a buffer (with low-latency mode) and the handle of one dispatch. */
static void setup(fixture_t *f)
{
    memset(f, 0, sizeof(*f));
    epx_group_config_t gc = EPX_GROUP_CONFIG_INIT;
    gc.backend = EPX_BACKEND_HOST;
    CHECK_OK(epx_group_create(&gc, &f->group));
    epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
    bc.max_tokens_per_rank = TOKENS;
    bc.hidden = HIDDEN;
    bc.num_experts = EXPERTS;
    bc.num_topk = TOPK;
    bc.max_low_latency_tokens = TOKENS;
    CHECK_OK(epx_buffer_create(f->group, &bc, &f->buffer));
    for (int t = 0; t < TOKENS; t++) {
        f->idx[t * TOPK] = t % EXPERTS;
        f->idx[t * TOPK + 1] = -1;
    }
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    args.x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    args.topk_idx = epx_tensor_2d(f->idx, EPX_DTYPE_INT64, TOKENS, TOPK);
    CHECK_OK(epx_dispatch(f->buffer, &args, &result, NULL));
    f->handle = result.handle;
}

static epx_combine_args_t combine_args(fixture_t *f, epx_handle_t handle)
{
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = epx_tensor_2d(f->x, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    args.out_x = epx_tensor_2d(f->out, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    return args;
}

static void case_handle_destroyed_twice(void)
{
    fixture_t f;
    setup(&f);
    CHECK_OK(epx_handle_destroy(f.handle));
    CHECK_STATUS(epx_handle_destroy(f.handle), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("handle");
    CHECK_ERROR_MENTIONS("destroyed");
}

static void case_handle_used_after_destroy(void)
{
    fixture_t f;
    setup(&f);
    CHECK_OK(epx_handle_destroy(f.handle));
    epx_combine_args_t args = combine_args(&f, f.handle);
    CHECK_STATUS(epx_combine(f.buffer, &args, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("handle");
    epx_handle_info_t info = EPX_HANDLE_INFO_INIT;
    CHECK_STATUS(epx_handle_get_info(f.handle, &info), EPX_ERR_INVALID_ARG);
    epx_tensor_t matrix;
    CHECK_STATUS(epx_handle_get_rank_prefix_matrix(f.handle, &matrix), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("handle_get_rank_prefix_matrix");
    CHECK_ERROR_MENTIONS("destroyed");
    epx_tensor_t view;
    CHECK_STATUS(epx_get_combine_input(f.buffer, f.handle, &view), EPX_ERR_INVALID_ARG);
    /* Cached dispatch with the destroyed handle. */
    epx_dispatch_args_t dargs = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    dargs.x = epx_tensor_2d(f.x, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    dargs.handle = f.handle;
    CHECK_STATUS(epx_dispatch(f.buffer, &dargs, &result, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("handle");
    /* A refused stale handle has no effect: the buffer still works. */
    dargs.handle = NULL;
    dargs.topk_idx = epx_tensor_2d(f.idx, EPX_DTYPE_INT64, TOKENS, TOPK);
    CHECK_OK(epx_dispatch(f.buffer, &dargs, &result, NULL));
    epx_combine_args_t good = combine_args(&f, result.handle);
    CHECK_OK(epx_combine(f.buffer, &good, NULL));
    CHECK_OK(epx_handle_destroy(result.handle));
    CHECK_OK(epx_buffer_destroy(f.buffer));
    CHECK_OK(epx_group_destroy(f.group));
}

static void case_buffer_destroyed_twice(void)
{
    fixture_t f;
    setup(&f);
    CHECK_OK(epx_handle_destroy(f.handle));
    CHECK_OK(epx_buffer_destroy(f.buffer));
    CHECK_STATUS(epx_buffer_destroy(f.buffer), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("buffer");
    CHECK_ERROR_MENTIONS("destroyed");
}

static void case_buffer_used_after_destroy(void)
{
    fixture_t f;
    setup(&f);
    CHECK_OK(epx_buffer_destroy(f.buffer));
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    args.x = epx_tensor_2d(f.x, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    args.topk_idx = epx_tensor_2d(f.idx, EPX_DTYPE_INT64, TOKENS, TOPK);
    CHECK_STATUS(epx_dispatch(f.buffer, &args, &result, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("buffer");
    epx_combine_args_t cargs = combine_args(&f, f.handle);
    CHECK_STATUS(epx_combine(f.buffer, &cargs, NULL), EPX_ERR_INVALID_ARG);
    epx_status_t error;
    CHECK_STATUS(epx_get_async_error(f.buffer, &error, NULL, 0), EPX_ERR_INVALID_ARG);
    epx_ll_dispatch_args_t ll = EPX_LL_DISPATCH_ARGS_INIT;
    epx_ll_dispatch_result_t ll_result = EPX_LL_DISPATCH_RESULT_INIT;
    ll.x = args.x;
    ll.topk_idx = args.topk_idx;
    CHECK_STATUS(epx_ll_dispatch(f.buffer, &ll, &ll_result, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("buffer");
    int32_t mask[1];
    CHECK_STATUS(epx_ll_get_masked(f.buffer, mask, 1), EPX_ERR_INVALID_ARG);
    /* The handle outlives its buffer: destroying it is still fine. */
    CHECK_OK(epx_handle_destroy(f.handle));
    CHECK_OK(epx_group_destroy(f.group));
}

static void case_group_destroyed_twice(void)
{
    fixture_t f;
    setup(&f);
    CHECK_OK(epx_handle_destroy(f.handle));
    CHECK_OK(epx_buffer_destroy(f.buffer));
    CHECK_OK(epx_group_destroy(f.group));
    CHECK_STATUS(epx_group_destroy(f.group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("group");
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_STATUS(epx_group_get_info(f.group, &info), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_group_barrier(f.group), EPX_ERR_INVALID_ARG);
    epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
    bc.max_tokens_per_rank = TOKENS;
    bc.hidden = HIDDEN;
    bc.num_experts = EXPERTS;
    bc.num_topk = TOPK;
    epx_buffer_t buffer = NULL;
    CHECK_STATUS(epx_buffer_create(f.group, &bc, &buffer), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("group");
    CHECK(buffer == NULL);
}

/* A pointer that never was an object is refused the same way. */
static void case_never_an_object(void)
{
    static char not_an_object[256];
    CHECK_STATUS(epx_handle_destroy((epx_handle_t)not_an_object), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_buffer_destroy((epx_buffer_t)not_an_object), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_group_destroy((epx_group_t)not_an_object), EPX_ERR_INVALID_ARG);
}

/* Objects are recycled by the allocator: many create/destroy rounds, then stale use. */
static void case_many_rounds(void)
{
    fixture_t f;
    setup(&f);
    epx_handle_t first = f.handle;
    CHECK_OK(epx_handle_destroy(first));
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    args.x = epx_tensor_2d(f.x, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    args.topk_idx = epx_tensor_2d(f.idx, EPX_DTYPE_INT64, TOKENS, TOPK);
    for (int i = 0; i < 100; i++) {
        CHECK_OK(epx_dispatch(f.buffer, &args, &result, NULL));
        CHECK(result.handle != first); /* a destroyed handle's address is not reused soon */
        CHECK_OK(epx_handle_destroy(result.handle));
        CHECK_STATUS(epx_handle_destroy(result.handle), EPX_ERR_INVALID_ARG);
    }
    CHECK_STATUS(epx_handle_destroy(first), EPX_ERR_INVALID_ARG);
    CHECK_OK(epx_buffer_destroy(f.buffer));
    CHECK_OK(epx_group_destroy(f.group));
}

typedef struct {
    const char *name;
    void (*run)(void);
} test_case_t;

int main(void)
{
    static const test_case_t cases[] = {
        {"handle_destroyed_twice", case_handle_destroyed_twice},
        {"handle_used_after_destroy", case_handle_used_after_destroy},
        {"buffer_destroyed_twice", case_buffer_destroyed_twice},
        {"buffer_used_after_destroy", case_buffer_used_after_destroy},
        {"group_destroyed_twice", case_group_destroyed_twice},
        {"never_an_object", case_never_an_object},
        {"many_rounds", case_many_rounds},
    };
    int failures = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            alarm(30);
            cases[i].run();
            exit(0);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
            printf("ok   %s\n", cases[i].name);
        } else {
            failures++;
            if (WIFSIGNALED(status))
                printf("FAIL %s: killed by signal %d (%s)\n", cases[i].name, WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
            else
                printf("FAIL %s: exit status %d\n", cases[i].name, WEXITSTATUS(status));
        }
    }
    return failures == 0 ? 0 : 1;
}
