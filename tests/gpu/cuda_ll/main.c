/*
 * Low-latency mode on the CUDA backend, checked against the oracle (tests/common/moe_ll.h)
 * in the ways only a GPU can be used. Run by scripts/gpu-check:
 *
 *   epx launch -n 8 --mps -- cuda_ll [--sms 16] [--replays 100] [--split-replays 20]
 *        [--seed 1] [--only TEXT] [--watchdog 300]
 *
 * Sub-tests (each on a fresh buffer; one PASS/FAIL/SKIP line each, printed by rank 0
 * once every rank has reported):
 *   graph fp8     one step (fp8 dispatch, expert outputs copied into the zero-copy
 *                 combine buffer with cudaMemcpyAsync, combine) captured on a non-default
 *                 stream and replayed --replays times, each replay with fresh inputs
 *                 copied into the captured tensors first;
 *   graph split   the same with EPX_LL_SEND_ONLY + epx_ll_receive inside the capture;
 *   graph bf16    the first with bf16 dispatch;
 *   overlap       outside graphs: dispatch A and B send-only, receive A and B, combine
 *                 A (zero-copy) and B (separate tensor), blocking, then send-only;
 *   masked rank   (4+ ranks) every rank masks one rank that sits the step out; its rows
 *                 are absent and its experts come back as zeros;
 *   standard case 128 tokens, hidden 7168, 256 experts, top-8, fp8, checked once;
 *   rejoin        epx_ll_rejoin / epx_buffer_create_rejoin return EPX_ERR_UNSUPPORTED
 *                 (NVSHMEM) and leave the buffer as it was.
 * Checks are exact: recv_count, recv_src_info, recv_layout_range, the fp8 bytes and
 * scales (or bf16 rows) and the combined output bits; the first mismatch of each kind is
 * printed with its indices and values. A kernel that gives up on a peer reports through
 * epx_get_async_error (checked after every step) and masks the peer (epx_ll_get_masked,
 * also checked). A sub-test that makes no progress for --watchdog seconds ends the
 * process with a message naming it (the device-side waits end after EPX_TIMEOUT_MS).
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda_ll.h"

/* ---------------------------------------------------------------- main */

typedef struct {
    const char *name;
    void (*run)(void);
    int runnable; /* else SKIP, with `why` */
    const char *why;
} subtest_t;

int main(int argc, char **argv)
{
    epx_status_t status = epx_group_create_from_env(EPX_BACKEND_CUDA, &g_group);
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "cuda_ll: group: %s: %s\n", epx_status_name(status), epx_last_error());
        return 1;
    }
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    if (epx_group_get_info(g_group, &info) != EPX_SUCCESS)
        return 1;
    g_rank = info.rank;
    g_world = info.world_size;
    CUDA_OK(cudaSetDevice(info.device));
    CUDA_OK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    g_sms = (int)flag_value(argc, argv, "--sms", 16);
    g_replays = (int)flag_value(argc, argv, "--replays", 100);
    g_split_replays = (int)flag_value(argc, argv, "--split-replays", 20);
    g_seed = (uint64_t)flag_value(argc, argv, "--seed", 1);
    unsigned watchdog_s = (unsigned)flag_value(argc, argv, "--watchdog", 300);
    const char *only = flag_text(argc, argv, "--only", "");
    signal(SIGALRM, on_watchdog);

    char graph_name[64], split_name[64], standard_name[80];
    snprintf(graph_name, sizeof(graph_name), "graph fp8, %d replays", g_replays);
    snprintf(split_name, sizeof(split_name), "graph fp8 send-only + receive, %d replays",
             g_split_replays);
    snprintf(standard_name, sizeof(standard_name),
             "standard case (128 x 7168, 256 experts, top-8, fp8)");
    const subtest_t subtests[] = {
        {graph_name, test_graph_fp8, 1, ""},
        {split_name, test_graph_split, 1, ""},
        {"graph bf16, 3 replays", test_graph_bf16, 1, ""},
        {"overlap: two steps in flight, send/receive split", test_overlap, 1, ""},
        {"masked rank", test_masked, g_world >= 4, "needs 4 or more ranks"},
        {standard_name, test_standard, 256 % g_world == 0, "256 experts need R | 256"},
        {"rejoin: EPX_ERR_UNSUPPORTED on the GPU", test_rejoin_unsupported, 1, ""},
    };
    if (g_rank == 0)
        printf("cuda_ll: %d ranks on device %d, %d SMs per rank, EPX_TIMEOUT_MS=%s\n", g_world,
               info.device, g_sms, getenv("EPX_TIMEOUT_MS") ? getenv("EPX_TIMEOUT_MS") : "default");
    int failed_subtests = 0;
    int *failed_ranks = calloc((size_t)g_world, sizeof(int));
    for (size_t i = 0; i < sizeof(subtests) / sizeof(subtests[0]); i++) {
        const subtest_t *t = &subtests[i];
        if (only[0] != '\0' && strstr(t->name, only) == NULL)
            continue;
        if (!t->runnable) {
            if (g_rank == 0)
                printf("SKIP %s: %s\n", t->name, t->why);
            continue;
        }
        double start = now_s();
        g_subtest_base = g_failures;
        watchdog_arm(t->name, watchdog_s);
        t->run();
        alarm(0);
        int n_failed = 0;
        int total = sum_over_ranks(g_failures - g_subtest_base, failed_ranks, &n_failed);
        if (total > 0)
            failed_subtests++;
        if (g_rank == 0) {
            if (total == 0) {
                printf("PASS %s (%.1f s)\n", t->name, now_s() - start);
            } else {
                printf("FAIL %s: %d failed check(s) on rank(s)", t->name, total);
                for (int r = 0; r < n_failed; r++)
                    printf(" %d", failed_ranks[r]);
                printf(" (their messages are on stderr)\n");
            }
            fflush(stdout);
        }
    }
    free(failed_ranks);
    if (g_rank == 0) {
        printf("cuda_ll: %s\n", failed_subtests ? "FAILED" : "all sub-tests passed");
        fflush(stdout);
    }
    /* Nobody exits (and so gets the launcher to stop the others) before rank 0 printed. */
    sum_over_ranks(0, NULL, NULL);
    cudaStreamDestroy(g_stream);
    epx_group_destroy(g_group);
    return failed_subtests ? 1 : 0;
}
