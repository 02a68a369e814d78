/*
 * The host backend through the public API, with forked ranks: a dispatch and combine
 * small enough to work out by hand (so the check does not lean on the oracle in
 * tests/common), and the ways a collective call can go wrong across ranks: ranks in
 * different operations, inconsistent inputs, a receive tensor too small, a rank that
 * exits before the call. Each failure must reach every rank as a status with a message
 * naming the rank, and leave nothing in /dev/shm.
 */
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epx.h"
#include "test_util.h"

#define MAX_WORLD 4
#define DEADLINE_S 60
#define HIDDEN 128
#define TOPK 2
#define EXPERTS 4 /* 2 ranks x 2 local experts */
#define MAX_TOKENS 4

typedef int (*rank_body_t)(int rank, epx_buffer_t buffer);

/* ---------------------------------------------------------------- inputs */

/* Small integers are exact in bf16, so sums of them are exact too. */
static uint16_t bf16_of_int(int value)
{
    float f = (float)value;
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    return (uint16_t)(bits >> 16);
}

static int int_of_bf16(uint16_t bits)
{
    uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, sizeof(f));
    return (int)f;
}

static int x_value(int rank, int token, int column)
{
    return rank * 10 + token + 1 + column % 4;
}

/*
 * The hand-checked routing (experts 0,1 on rank 0; 2,3 on rank 1):
 *   rank 0: t0 -> {0, 3}  t1 -> {1, -}  t2 -> {-, -}  t3 -> {2, 2}
 *   rank 1: t0 -> {3, 0}  t1 -> {2, 3}
 */
static const int64_t routing[2][MAX_TOKENS][TOPK] = {
    {{0, 3}, {1, -1}, {-1, -1}, {2, 2}},
    {{3, 0}, {2, 3}, {-1, -1}, {-1, -1}},
};
static const int num_tokens_of[2] = {4, 2};

typedef struct {
    uint16_t x[MAX_TOKENS][HIDDEN];
    int64_t idx[MAX_TOKENS][TOPK];
    float weights[MAX_TOKENS][TOPK];
} inputs_t;

static void make_inputs(int rank, inputs_t *in)
{
    memset(in, 0, sizeof(*in));
    for (int t = 0; t < MAX_TOKENS; t++) {
        for (int i = 0; i < HIDDEN; i++)
            in->x[t][i] = bf16_of_int(x_value(rank, t, i));
        for (int j = 0; j < TOPK; j++) {
            in->idx[t][j] = routing[rank][t][j];
            in->weights[t][j] = 0.5f * (float)(rank * 100 + t * 10 + j + 1);
        }
    }
}

static epx_dispatch_args_t dispatch_args(int rank, inputs_t *in)
{
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(in->x, EPX_DTYPE_BF16, num_tokens_of[rank], HIDDEN);
    args.topk_idx = epx_tensor_2d(in->idx, EPX_DTYPE_INT64, num_tokens_of[rank], TOPK);
    args.topk_weights = epx_tensor_2d(in->weights, EPX_DTYPE_FP32, num_tokens_of[rank], TOPK);
    return args;
}

/* ---------------------------------------------------------------- hand-checked case */

typedef struct {
    int src_rank, src_token;
    int64_t idx[TOPK]; /* local ids */
} expected_row_t;

static const expected_row_t expected_rows[2][4] = {
    {{0, 0, {0, -1}}, {0, 1, {1, -1}}, {1, 0, {-1, 0}}},
    {{0, 0, {-1, 1}}, {0, 3, {0, 0}}, {1, 0, {1, -1}}, {1, 1, {0, 1}}},
};
static const int expected_recv[2] = {3, 4};
static const int32_t expected_per_expert[2][2] = {{2, 1}, {2, 3}};
/* Ranks that receive each token (combine multiplies by this). */
static const int receivers[2][MAX_TOKENS] = {{2, 1, 0, 1}, {2, 1, 0, 0}};

static int body_exact(int rank, epx_buffer_t buffer)
{
    inputs_t in;
    make_inputs(rank, &in);

    epx_layout_args_t layout = EPX_LAYOUT_ARGS_INIT;
    int32_t per_rank[2], per_expert[EXPERTS];
    uint8_t in_rank[MAX_TOKENS][2];
    layout.topk_idx = epx_tensor_2d(in.idx, EPX_DTYPE_INT64, num_tokens_of[rank], TOPK);
    layout.num_tokens_per_rank = epx_tensor_1d(per_rank, EPX_DTYPE_INT32, 2);
    layout.num_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, EXPERTS);
    layout.is_token_in_rank = epx_tensor_2d(in_rank, EPX_DTYPE_BOOL, num_tokens_of[rank], 2);
    CHECK_OK(epx_get_dispatch_layout(buffer, &layout, NULL));
    if (rank == 0) {
        CHECK_EQ_INT(per_rank[0], 2);
        CHECK_EQ_INT(per_rank[1], 2);
        CHECK_EQ_INT(per_expert[0], 1);
        CHECK_EQ_INT(per_expert[1], 1);
        CHECK_EQ_INT(per_expert[2], 1); /* t3 names expert 2 twice: one row */
        CHECK_EQ_INT(per_expert[3], 1);
        CHECK(in_rank[0][0] == 1 && in_rank[0][1] == 1 && in_rank[1][0] == 1 &&
              in_rank[1][1] == 0 && in_rank[2][0] == 0 && in_rank[2][1] == 0 &&
              in_rank[3][0] == 0 && in_rank[3][1] == 1);
    } else {
        CHECK_EQ_INT(per_rank[0], 1);
        CHECK_EQ_INT(per_rank[1], 2);
    }

    for (int round = 0; round < 3; round++) {
        epx_dispatch_args_t args = dispatch_args(rank, &in);
        args.expert_alignment = round == 2 ? 4 : 0;
        epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
        CHECK_OK(epx_dispatch(buffer, &args, &result, NULL));
        int n = expected_recv[rank];
        CHECK_EQ_INT(result.num_recv_tokens, n);
        CHECK_EQ_INT(result.num_local_experts, 2);
        CHECK(result.recv_x_scales.data == NULL);
        for (int e = 0; e < 2; e++) {
            int32_t want = expected_per_expert[rank][e];
            if (round == 2)
                want = (want + 3) / 4 * 4;
            CHECK_EQ_INT(result.num_recv_tokens_per_expert[e], want);
        }
        const uint16_t *rx = result.recv_x.data;
        const int64_t *ridx = result.recv_topk_idx.data;
        const float *rw = result.recv_topk_weights.data;
        for (int row = 0; row < n; row++) {
            const expected_row_t *want = &expected_rows[rank][row];
            for (int i = 0; i < HIDDEN; i++)
                CHECK_EQ_INT(int_of_bf16(rx[row * HIDDEN + i]),
                             x_value(want->src_rank, want->src_token, i));
            for (int j = 0; j < TOPK; j++) {
                CHECK_EQ_INT(ridx[row * TOPK + j], want->idx[j]);
                float w = want->idx[j] < 0
                              ? 0.0f
                              : 0.5f * (float)(want->src_rank * 100 + want->src_token * 10 + j + 1);
                CHECK(rw[row * TOPK + j] == w);
            }
        }

        /* Send the received rows straight back: each token comes home multiplied by the
         * number of ranks that received it; weights likewise. */
        uint16_t out[MAX_TOKENS][HIDDEN];
        float out_weights[MAX_TOKENS][TOPK];
        memset(out, 0xff, sizeof(out));
        epx_combine_args_t back = EPX_COMBINE_ARGS_INIT;
        back.handle = result.handle;
        back.x = result.recv_x;
        back.topk_weights = result.recv_topk_weights;
        back.out_x = epx_tensor_2d(out, EPX_DTYPE_BF16, num_tokens_of[rank], HIDDEN);
        back.out_topk_weights =
            epx_tensor_2d(out_weights, EPX_DTYPE_FP32, num_tokens_of[rank], TOPK);
        CHECK_OK(epx_combine(buffer, &back, NULL));
        for (int t = 0; t < num_tokens_of[rank]; t++) {
            for (int i = 0; i < HIDDEN; i++)
                CHECK_EQ_INT(int_of_bf16(out[t][i]), receivers[rank][t] * x_value(rank, t, i));
            for (int j = 0; j < TOPK; j++) {
                /* Only the rank holding the expert keeps the weight; the others send 0. */
                float w = routing[rank][t][j] >= 0 ? in.weights[t][j] : 0.0f;
                CHECK(out_weights[t][j] == w);
            }
        }

        /* Cached dispatch into caller-owned outputs with a row stride. */
        uint16_t strided[8][HIDDEN + 8];
        epx_dispatch_args_t again = EPX_DISPATCH_ARGS_INIT;
        again.x = args.x;
        again.handle = result.handle;
        again.recv_x = epx_tensor_2d(strided, EPX_DTYPE_BF16, 8, HIDDEN);
        again.recv_x.strides[0] = HIDDEN + 8;
        again.recv_x.strides[1] = 1;
        epx_dispatch_result_t cached = EPX_DISPATCH_RESULT_INIT;
        CHECK_OK(epx_dispatch(buffer, &again, &cached, NULL));
        CHECK(cached.handle == result.handle);
        CHECK(cached.recv_topk_idx.data == NULL);
        CHECK_EQ_INT(cached.num_recv_tokens, n);
        for (int row = 0; row < n; row++)
            for (int i = 0; i < HIDDEN; i++)
                CHECK_EQ_INT(int_of_bf16(strided[row][i]),
                             x_value(expected_rows[rank][row].src_rank,
                                     expected_rows[rank][row].src_token, i));
        CHECK_OK(epx_handle_destroy(result.handle));
    }
    return 0;
}

/*
 * Combine through the zero-copy input view: the staging rows of this rank, written by
 * the caller, read in place by the peers (the x rows are not copied; the weights are).
 * Each token comes home as 2 x value x receivers.
 */
static int body_combine_input(int rank, epx_buffer_t buffer)
{
    inputs_t in;
    make_inputs(rank, &in);
    for (int round = 0; round < 2; round++) {
        epx_dispatch_args_t args = dispatch_args(rank, &in);
        epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
        CHECK_OK(epx_dispatch(buffer, &args, &result, NULL));
        int n = expected_recv[rank];
        epx_tensor_t view = EPX_TENSOR_NONE;
        CHECK_OK(epx_get_combine_input(buffer, result.handle, &view));
        CHECK(view.data != NULL && view.dtype == EPX_DTYPE_BF16 && view.ndim == 2);
        CHECK_EQ_INT(view.shape[0], n);
        CHECK_EQ_INT(view.shape[1], HIDDEN);
        /* Not a dispatch output: the view is memory of its own. */
        CHECK(view.data != result.recv_x.data);
        uint16_t *rows = view.data;
        const uint16_t *rx = result.recv_x.data;
        for (int64_t i = 0; i < (int64_t)n * HIDDEN; i++)
            rows[i] = bf16_of_int(2 * int_of_bf16(rx[i]));

        uint16_t out[MAX_TOKENS][HIDDEN];
        float out_weights[MAX_TOKENS][TOPK];
        memset(out, 0xff, sizeof(out));
        epx_combine_args_t back = EPX_COMBINE_ARGS_INIT;
        back.handle = result.handle;
        back.x = view;
        back.topk_weights = result.recv_topk_weights;
        back.out_x = epx_tensor_2d(out, EPX_DTYPE_BF16, num_tokens_of[rank], HIDDEN);
        back.out_topk_weights =
            epx_tensor_2d(out_weights, EPX_DTYPE_FP32, num_tokens_of[rank], TOPK);
        CHECK_OK(epx_combine(buffer, &back, NULL));
        for (int t = 0; t < num_tokens_of[rank]; t++) {
            for (int i = 0; i < HIDDEN; i++)
                CHECK_EQ_INT(int_of_bf16(out[t][i]),
                             2 * receivers[rank][t] * x_value(rank, t, i));
            for (int j = 0; j < TOPK; j++)
                CHECK(out_weights[t][j] == (routing[rank][t][j] >= 0 ? in.weights[t][j] : 0.0f));
        }
        /* The rows are still as written: combine read them where they were. */
        for (int64_t i = 0; i < (int64_t)n * HIDDEN; i++)
            CHECK_EQ_INT(int_of_bf16(rows[i]), 2 * int_of_bf16(rx[i]));
        CHECK_OK(epx_handle_destroy(result.handle));
    }
    return 0;
}

/* ---------------------------------------------------------------- failures */

/* Both ranks dispatch once; then rank 0 dispatches again while rank 1 combines. */
static int body_different_ops(int rank, epx_buffer_t buffer)
{
    inputs_t in;
    make_inputs(rank, &in);
    epx_dispatch_args_t args = dispatch_args(rank, &in);
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_dispatch(buffer, &args, &result, NULL));
    epx_status_t status;
    if (rank == 0) {
        epx_dispatch_result_t second = EPX_DISPATCH_RESULT_INIT;
        status = epx_dispatch(buffer, &args, &second, NULL);
    } else {
        uint16_t out[MAX_TOKENS][HIDDEN];
        epx_combine_args_t back = EPX_COMBINE_ARGS_INIT;
        back.handle = result.handle;
        back.x = result.recv_x;
        back.out_x = epx_tensor_2d(out, EPX_DTYPE_BF16, num_tokens_of[rank], HIDDEN);
        status = epx_combine(buffer, &back, NULL);
    }
    /* Each rank sees the mismatch itself, or hears of it from the other first. */
    if (status != EPX_ERR_INVALID_STATE && status != EPX_ERR_REMOTE)
        TEST_FAIL("rank %d: got %s (%s)", rank, epx_status_name(status), epx_last_error());
    CHECK_ERROR_MENTIONS("rank 1 is in combine");
    /* The buffer is now unusable; the error sticks. */
    epx_dispatch_result_t third = EPX_DISPATCH_RESULT_INIT;
    CHECK_STATUS(epx_dispatch(buffer, &args, &third, NULL), status);
    CHECK_ERROR_MENTIONS("failed earlier");
    epx_handle_destroy(result.handle);
    return 0;
}

/* Rank 1 passes fp8 while rank 0 passes bf16. */
static int body_mixed_dtypes(int rank, epx_buffer_t buffer)
{
    inputs_t in;
    make_inputs(rank, &in);
    float scales[MAX_TOKENS][HIDDEN / 128] = {{1.0f}};
    epx_dispatch_args_t args = dispatch_args(rank, &in);
    if (rank == 1) {
        args.x.dtype = EPX_DTYPE_FP8_E4M3;
        args.x_scales = epx_tensor_2d(scales, EPX_DTYPE_FP32, num_tokens_of[rank], HIDDEN / 128);
    }
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    epx_status_t status = epx_dispatch(buffer, &args, &result, NULL);
    if (status != EPX_ERR_INVALID_ARG && status != EPX_ERR_REMOTE)
        TEST_FAIL("rank %d: got %s (%s)", rank, epx_status_name(status), epx_last_error());
    CHECK_ERROR_MENTIONS("passed x as");
    CHECK_ERROR_MENTIONS("fp8_e4m3");
    return 0;
}

/* Rank 0's recv_x has room for 2 rows but 3 arrive: it fails, rank 1 hears of it. */
static int body_small_output(int rank, epx_buffer_t buffer)
{
    inputs_t in;
    make_inputs(rank, &in);
    uint16_t recv_x[4][HIDDEN];
    int64_t recv_idx[4][TOPK];
    float recv_weights[4][TOPK];
    int rows = rank == 0 ? 2 : 4;
    epx_dispatch_args_t args = dispatch_args(rank, &in);
    args.recv_x = epx_tensor_2d(recv_x, EPX_DTYPE_BF16, rows, HIDDEN);
    args.recv_topk_idx = epx_tensor_2d(recv_idx, EPX_DTYPE_INT64, rows, TOPK);
    args.recv_topk_weights = epx_tensor_2d(recv_weights, EPX_DTYPE_FP32, rows, TOPK);
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    epx_status_t status = epx_dispatch(buffer, &args, &result, NULL);
    if (rank == 0) {
        CHECK_EQ_INT(status, EPX_ERR_CAPACITY);
        CHECK_ERROR_MENTIONS("recv_x has 2 rows but rank 0 receives 3 tokens");
    } else {
        CHECK_EQ_INT(status, EPX_ERR_REMOTE);
        CHECK_ERROR_MENTIONS("dispatch (waiting for data): rank 0 failed: ");
        CHECK_ERROR_MENTIONS("recv_x has 2 rows");
    }
    CHECK(result.handle == NULL); /* outputs are written only on success */
    return 0;
}

/* Rank 1 exits without calling dispatch. */
static int body_rank_exits(int rank, epx_buffer_t buffer)
{
    if (rank == 1)
        _exit(0);
    inputs_t in;
    make_inputs(rank, &in);
    epx_dispatch_args_t args = dispatch_args(rank, &in);
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    CHECK_STATUS(epx_dispatch(buffer, &args, &result, NULL), EPX_ERR_REMOTE);
    CHECK_ERROR_MENTIONS("dispatch (waiting for counts): rank 1 (pid ");
    CHECK_ERROR_MENTIONS(") exited");
    epx_status_t async = EPX_SUCCESS;
    char message[256];
    CHECK_OK(epx_get_async_error(buffer, &async, message, sizeof(message)));
    CHECK_EQ_INT(async, EPX_ERR_REMOTE);
    CHECK(strstr(message, "rank 1") != NULL);
    return 0;
}

/* ---------------------------------------------------------------- harness */

/*
 * epx_buffer_size with low-latency memory sized for fp8 rows: the staged and the
 * received dispatch rows of both slots shrink from 2 bytes per element to 1, nothing
 * else changes. HIDDEN * 64 tokens keeps every region a multiple of the 64-byte
 * alignment and the saving a multiple of the 4 KiB page, so it shows exactly.
 */
static void check_low_latency_sizes(epx_group_t group, epx_buffer_config_t config)
{
    const int64_t ll_tokens = 64;
    config.max_low_latency_tokens = ll_tokens;
    size_t unset = 0, bf16 = 0, fp8 = 0;
    config.low_latency_dtype = EPX_DTYPE_INVALID; /* 0 means bf16 */
    CHECK_OK(epx_buffer_size(group, &config, &unset));
    config.low_latency_dtype = EPX_DTYPE_BF16;
    CHECK_OK(epx_buffer_size(group, &config, &bf16));
    config.low_latency_dtype = EPX_DTYPE_FP8_E4M3;
    CHECK_OK(epx_buffer_size(group, &config, &fp8));
    CHECK_EQ_INT(unset, bf16);
    CHECK(fp8 < bf16);
    /* [L][R][M] cells per region = EXPERTS * M; 2 regions x 2 slots x 1 byte saved. */
    CHECK_EQ_INT(bf16 - fp8, 2 * 2 * (int64_t)EXPERTS * ll_tokens * HIDDEN);
}

static int run_rank(int rank, int world, const epx_unique_id_t *id, rank_body_t body)
{
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = world;
    config.backend = EPX_BACKEND_HOST;
    config.unique_id = id;
    config.timeout_ms = 20000;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    epx_buffer_config_t buffer_config = EPX_BUFFER_CONFIG_INIT;
    buffer_config.max_tokens_per_rank = MAX_TOKENS;
    buffer_config.hidden = HIDDEN;
    buffer_config.num_experts = EXPERTS;
    buffer_config.num_topk = TOPK;
    size_t bytes = 0;
    CHECK_OK(epx_buffer_size(group, &buffer_config, &bytes));
    CHECK(bytes > (size_t)(MAX_TOKENS * world) * HIDDEN * 2 * 2); /* receive + staging */
    check_low_latency_sizes(group, buffer_config);
    epx_buffer_t buffer = NULL;
    CHECK_OK(epx_buffer_create(group, &buffer_config, &buffer));
    int code = body(rank, buffer);
    CHECK_OK(epx_buffer_destroy(buffer));
    CHECK_OK(epx_group_destroy(group));
    return code;
}

static int segments_of(pid_t pid)
{
    char prefix[64];
    snprintf(prefix, sizeof(prefix), "epx-%ld-", (long)pid);
    DIR *dir = opendir("/dev/shm");
    int found = 0;
    for (struct dirent *entry; dir != NULL && (entry = readdir(dir)) != NULL;)
        found += strncmp(entry->d_name, prefix, strlen(prefix)) == 0;
    if (dir != NULL)
        closedir(dir);
    return found;
}

static void run(const char *name, int world, rank_body_t body)
{
    epx_unique_id_t id;
    CHECK_OK(epx_get_unique_id(&id));
    pid_t pids[MAX_WORLD];
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0)
            _exit(run_rank(r, world, &id, body));
    }
    int64_t deadline = (int64_t)time(NULL) + DEADLINE_S;
    for (int r = 0; r < world; r++) {
        int wstatus = 0;
        while (waitpid(pids[r], &wstatus, WNOHANG) == 0) {
            if ((int64_t)time(NULL) > deadline) {
                for (int k = 0; k < world; k++)
                    kill(pids[k], SIGKILL);
                TEST_FAIL("%s: rank %d still running after %d s (hang)", name, r, DEADLINE_S);
            }
            struct timespec pause = {0, 5000000};
            nanosleep(&pause, NULL);
        }
        if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0)
            TEST_FAIL("%s: rank %d ended with wait status %d", name, r, wstatus);
    }
    for (int r = 0; r < world; r++)
        CHECK_EQ_INT(segments_of(pids[r]), 0);
    printf("ok   %s\n", name);
}

int main(void)
{
    run("hand-checked dispatch/combine", 2, body_exact);
    run("combine through the zero-copy input view", 2, body_combine_input);
    run("ranks in different operations", 2, body_different_ops);
    run("fp8 on one rank, bf16 on the other", 2, body_mixed_dtypes);
    run("receive tensor too small", 2, body_small_output);
    run("rank exits before dispatch", 2, body_rank_exits);
    printf("test_host_backend: all passed\n");
    return 0;
}
