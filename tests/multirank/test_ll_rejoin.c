/*
 * Rejoin in low-latency mode (include/epx.h, docs/STABILITY.md): a rank is lost, the
 * survivors mask it and keep serving, a new process with its rank number joins the
 * running buffer (epx_buffer_create_rejoin; the survivors call epx_ll_rejoin) over a new
 * group, and the steps after it are checked bit for bit against the oracle
 * (tests/common/moe_ll.h) with the rank unmasked.
 *
 *   test_ll_rejoin [--variant rejoin3|rejoin0|dies|refused|stopped|all]
 *
 * Its own launcher (as test_ll_fault): 4 ranks on the CPU backend, one of them (LOST) lost;
 * when the process that holds rank LOST ends, the launcher starts the next newcomer, if
 * the variant has one. Every newcomer attempt a uses a group made from ids[a], unique ids
 * the launcher makes up front (the "serving system" of the test).
 *   rejoin3, rejoin0: rank 3 (or 0, the old group's rendezvous hub) is killed, detected,
 *     masked; a newcomer rejoins and serves; it is killed in turn, and a second newcomer
 *     rejoins (a segment replaced twice); the buffer is destroyed cleanly at the end.
 *   dies: the first newcomer dies after forming the group, three more die at a random
 *     moment inside the rejoin; after each, the survivors serve with the rank masked and
 *     hold exactly the shared memory (mappings, descriptors) they held before; then a
 *     newcomer rejoins for good.
 *   refused: each refusal (a rank not yet masked, an operation in flight, configs that
 *     differ, a newcomer's own bad config, ranks that swapped numbers, a survivor that
 *     masks a live rank) returns the right error on every rank and changes nothing.
 *   stopped: rank 3 falls silent (alive): a replacement is refused while the old process
 *     runs; once it is gone, the rejoin succeeds.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "ll_step.h"
#include "test_util.h"

#define NUM_RANKS 4
#define TIMEOUT_MS 1500       /* the first group's: a stopped rank is found after this */
#define REJOIN_TIMEOUT_MS 20000 /* the rejoin groups': a newcomer may wait for survivors */
#define MAX_IDS 8

static const ll_shape_t shape = {NUM_RANKS, 3, 4, 128, 8};

typedef struct {
    const char *variant;
    int lost;
    int rank;
    char *ids[MAX_IDS];
} context_t;

static epx_buffer_config_t buffer_config(void)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = shape.max_tokens;
    config.hidden = shape.hidden;
    config.num_experts = shape.experts_per_rank * NUM_RANKS;
    config.num_topk = shape.topk;
    config.max_low_latency_tokens = shape.max_tokens;
    return config;
}

/* The group of rejoin attempt `attempt`, with this process as `rank`. */
static epx_group_t rejoin_group(const context_t *ctx, int attempt, int rank)
{
    epx_unique_id_t id;
    CHECK(attempt < MAX_IDS && ctx->ids[attempt] != NULL);
    CHECK_OK(epx_unique_id_from_string(ctx->ids[attempt], &id));
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = NUM_RANKS;
    config.backend = EPX_BACKEND_HOST;
    config.unique_id = &id;
    config.timeout_ms = REJOIN_TIMEOUT_MS;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    return group;
}

/* mask[r] = 1 for the ranks masked here, checked against `want` (1 = LOST only). */
static void check_mask(epx_buffer_t buffer, const context_t *ctx, int lost_masked,
                       const char *what)
{
    int32_t mask[NUM_RANKS];
    CHECK_OK(epx_ll_get_masked(buffer, mask, NUM_RANKS));
    for (int r = 0; r < NUM_RANKS; r++)
        if (mask[r] != (lost_masked && r == ctx->lost))
            TEST_FAIL("rank %d %s: epx_ll_get_masked says rank %d is %smasked", ctx->rank, what, r,
                      mask[r] ? "" : "not ");
}

static const uint8_t *lost_mask(const context_t *ctx)
{
    static uint8_t mask[NUM_RANKS];
    memset(mask, 0, sizeof mask);
    mask[ctx->lost] = 1;
    return mask;
}

/* A step that loses rank LOST: the dispatch's wait names it, the results lack it. */
static void step_losing(epx_buffer_t buffer, const context_t *ctx, uint64_t seed, const char *what)
{
    ll_step_t s;
    ll_step_init(&s, &shape, ctx->rank, seed);
    s.check_dispatch_masked = 0;
    epx_status_t status = ll_step_dispatch(buffer, &s, 0);
    if ((status != EPX_ERR_REMOTE && status != EPX_ERR_TIMEOUT) ||
        !mr_message_names_rank(epx_last_error(), ctx->lost))
        TEST_FAIL("rank %d %s: dispatch returned %s (%s), expected the loss of rank %d",
                  ctx->rank, what, epx_status_name(status), epx_last_error(), ctx->lost);
    ll_step_check_dispatch(&s, lost_mask(ctx), what);
    CHECK_OK(ll_step_combine(buffer, &s, 0));
    ll_step_check_combine(&s, lost_mask(ctx), what);
    ll_step_free(&s);
    check_mask(buffer, ctx, 1, what);
}

/* A step whose outcome depends on when a newcomer died: run, not checked. */
static void step_unchecked(epx_buffer_t buffer, const context_t *ctx, uint64_t seed)
{
    ll_step_t s;
    ll_step_init(&s, &shape, ctx->rank, seed);
    epx_status_t status = ll_step_dispatch(buffer, &s, 0);
    CHECK(status == EPX_SUCCESS || status == EPX_ERR_REMOTE || status == EPX_ERR_TIMEOUT);
    status = ll_step_combine(buffer, &s, 0);
    CHECK(status == EPX_SUCCESS || status == EPX_ERR_REMOTE || status == EPX_ERR_TIMEOUT);
    ll_step_free(&s);
}

static void steps_masked(epx_buffer_t buffer, const context_t *ctx, uint64_t seed, int count)
{
    for (int i = 0; i < count; i++)
        ll_step_run_checked(buffer, &shape, ctx->rank, seed + (uint64_t)i, lost_mask(ctx),
                            i % 2 ? EPX_LL_SEND_ONLY : 0, "masked step");
}

/* Steps with every rank in; the odd ones split into send and receive. */
static void steps_all(epx_buffer_t buffer, const context_t *ctx, uint64_t seed, int count)
{
    for (int i = 0; i < count; i++)
        ll_step_run_checked(buffer, &shape, ctx->rank, seed + (uint64_t)i, NULL,
                            i % 2 ? EPX_LL_SEND_ONLY : 0, "step after the rejoin");
}

/* After a rejoin, on any rank: nobody masked, no loss reported, normal mode refused. */
static void check_rejoined(epx_buffer_t buffer, const context_t *ctx)
{
    check_mask(buffer, ctx, 0, "after the rejoin");
    epx_status_t error = EPX_ERR_INTERNAL;
    CHECK_OK(epx_get_async_error(buffer, &error, NULL, 0));
    CHECK_STATUS(error, EPX_SUCCESS);
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    CHECK_STATUS(epx_dispatch(buffer, &args, &result, NULL), EPX_ERR_INVALID_STATE);
    CHECK_ERROR_MENTIONS("low-latency mode only");
    /* Registered ranges are for normal mode's combine: refused on every rank alike (the
     * call is collective; every rank of the buffer's group checks here). */
    static char range[256];
    CHECK_STATUS(epx_buffer_register(buffer, range, sizeof range), EPX_ERR_INVALID_STATE);
    CHECK_ERROR_MENTIONS("ranges are for normal mode's combine");
}

/* Shared-memory mappings and descriptors of this process (a rejoin must not add any). */
static void count_shared_memory(int *mappings, int *descriptors)
{
    *mappings = 0;
    *descriptors = 0;
    FILE *maps = fopen("/proc/self/maps", "r");
    CHECK(maps != NULL);
    char line[512];
    while (fgets(line, sizeof line, maps) != NULL)
        *mappings += strstr(line, "/dev/shm/") != NULL || strstr(line, "memfd:") != NULL;
    fclose(maps);
    DIR *dir = opendir("/proc/self/fd");
    CHECK(dir != NULL);
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        char path[300], target[512];
        snprintf(path, sizeof path, "/proc/self/fd/%s", entry->d_name);
        ssize_t length = readlink(path, target, sizeof target - 1);
        if (length <= 0)
            continue;
        target[length] = '\0';
        *descriptors += strstr(target, "/dev/shm/") != NULL || strstr(target, "memfd:") != NULL;
    }
    closedir(dir);
}

static void check_shared_memory(const context_t *ctx, int mappings, int descriptors,
                                const char *what)
{
    int now_mappings, now_descriptors;
    count_shared_memory(&now_mappings, &now_descriptors);
    if (now_mappings != mappings || now_descriptors != descriptors)
        TEST_FAIL("rank %d %s: %d shared-memory mappings and %d descriptors, %d and %d before",
                  ctx->rank, what, now_mappings, now_descriptors, mappings, descriptors);
}

/* An attempt that every rank must refuse with `status`, the message naming `culprit`. */
static void expect_refused(epx_status_t got, epx_status_t status, const char *needle,
                           const context_t *ctx, const char *what)
{
    if (got != status || (needle != NULL && strstr(epx_last_error(), needle) == NULL))
        TEST_FAIL("rank %d %s: returned %s (%s), expected %s mentioning \"%s\"", ctx->rank, what,
                  epx_status_name(got), epx_last_error(), epx_status_name(status),
                  needle != NULL ? needle : "");
    printf("[rank %d] %s: %s: %s\n", ctx->rank, what, epx_status_name(got), epx_last_error());
    fflush(stdout);
}

/* ---------------------------------------------------------------- survivors */

static void destroy_groups(epx_group_t *groups, int count)
{
    for (int i = count - 1; i >= 0; i--)
        if (groups[i] != NULL)
            CHECK_OK(epx_group_destroy(groups[i]));
}

static void survivor_rejoin(const context_t *ctx, epx_group_t first, epx_buffer_t buffer)
{
    epx_group_t groups[2] = {NULL, NULL};
    step_losing(buffer, ctx, 101, "step 1 (rank lost)");
    steps_masked(buffer, ctx, 102, 2);
    int mappings, descriptors;
    count_shared_memory(&mappings, &descriptors);

    /* Arguments refused at once, without talking to anyone. */
    CHECK_STATUS(epx_ll_rejoin(buffer, NULL), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_ll_rejoin(buffer, first), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("own group");
    /* The handle of the last masked step: stale after the rejoin. */
    ll_step_t old;
    ll_step_init(&old, &shape, ctx->rank, 104);
    CHECK_OK(ll_step_dispatch(buffer, &old, 0));

    groups[0] = rejoin_group(ctx, 0, ctx->rank);
    double start = mr_now_ms();
    CHECK_OK(epx_ll_rejoin(buffer, groups[0]));
    printf("[rank %d] rank %d rejoined in %.1f ms\n", ctx->rank, ctx->lost, mr_now_ms() - start);
    check_rejoined(buffer, ctx);
    check_shared_memory(ctx, mappings, descriptors, "after the rejoin");
    epx_tensor_t view;
    CHECK_STATUS(epx_ll_get_combine_buffer(buffer, old.got.handle, &view), EPX_ERR_INVALID_STATE);
    ll_step_free(&old);
    steps_all(buffer, ctx, 105, 3);

    /* The newcomer is lost in turn; a second one takes its place. */
    step_losing(buffer, ctx, 108, "step 8 (newcomer lost)");
    steps_masked(buffer, ctx, 109, 1);
    groups[1] = rejoin_group(ctx, 1, ctx->rank);
    CHECK_OK(epx_ll_rejoin(buffer, groups[1]));
    check_rejoined(buffer, ctx);
    check_shared_memory(ctx, mappings, descriptors, "after the second rejoin");
    steps_all(buffer, ctx, 110, 2);
    /* Every rank is alive and in the buffer's group: the destroy's vote succeeds. */
    CHECK_OK(epx_buffer_destroy(buffer));
    destroy_groups(groups, 2);
}

static void survivor_dies(const context_t *ctx, epx_buffer_t buffer)
{
    epx_group_t groups[5] = {NULL};
    step_losing(buffer, ctx, 101, "step 1 (rank lost)");
    steps_masked(buffer, ctx, 102, 1);
    int mappings, descriptors;
    count_shared_memory(&mappings, &descriptors);
    int owner = -1; /* the attempt whose group the buffer now belongs to */
    for (int attempt = 0; attempt < 5; attempt++) {
        groups[attempt] = rejoin_group(ctx, attempt, ctx->rank);
        epx_status_t status = epx_ll_rejoin(buffer, groups[attempt]);
        printf("[rank %d] attempt %d: %s %s\n", ctx->rank, attempt, epx_status_name(status),
               epx_last_error());
        fflush(stdout);
        if (attempt == 0 || attempt == 4) /* died before it began; a good one */
            CHECK_STATUS(status, attempt == 0 ? EPX_ERR_REMOTE : EPX_SUCCESS);
        if (status == EPX_SUCCESS)
            owner = attempt;
        if (attempt == 4)
            break;
        /* The newcomer is dead by now or soon: serve on, the rank masked again. */
        check_shared_memory(ctx, mappings, descriptors, "after a failed rejoin");
        step_unchecked(buffer, ctx, 200 + (uint64_t)attempt);
        check_mask(buffer, ctx, 1, "after a newcomer died");
        steps_masked(buffer, ctx, 210 + 10 * (uint64_t)attempt, 2);
        check_shared_memory(ctx, mappings, descriptors, "serving after a failed rejoin");
        if (owner != attempt) {
            CHECK_OK(epx_group_destroy(groups[attempt]));
            groups[attempt] = NULL;
        }
    }
    check_rejoined(buffer, ctx);
    steps_all(buffer, ctx, 300, 3);
    CHECK_OK(epx_buffer_destroy(buffer));
    destroy_groups(groups, 5);
}

static void survivor_refused(const context_t *ctx, epx_buffer_t buffer)
{
    epx_group_t groups[7] = {NULL};
    const char *what;
    /* 0: the loss was not seen yet, so nobody masked the rank. */
    what = "attempt 0 (rank not masked)";
    groups[0] = rejoin_group(ctx, 0, ctx->rank);
    expect_refused(epx_ll_rejoin(buffer, groups[0]), EPX_ERR_INVALID_STATE, "has not masked it",
                   ctx, what);
    step_losing(buffer, ctx, 101, "step 1 (rank lost)");
    steps_masked(buffer, ctx, 102, 1);

    /* 1: a dispatch sent and not received. */
    what = "attempt 1 (operation in flight)";
    groups[1] = rejoin_group(ctx, 1, ctx->rank);
    ll_step_t s;
    ll_step_init(&s, &shape, ctx->rank, 103);
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(s.in.x, EPX_DTYPE_BF16, s.in.num_tokens, shape.hidden);
    args.topk_idx = epx_tensor_2d(s.in.topk_idx, EPX_DTYPE_INT64, s.in.num_tokens, shape.topk);
    args.flags = EPX_LL_SEND_ONLY;
    CHECK_OK(epx_ll_dispatch(buffer, &args, &s.got, NULL));
    expect_refused(epx_ll_rejoin(buffer, groups[1]), EPX_ERR_INVALID_STATE, "in flight", ctx, what);
    CHECK_OK(epx_ll_receive(buffer, s.got.handle, NULL)); /* the step goes on */
    ll_step_check_dispatch(&s, lost_mask(ctx), what);
    CHECK_OK(ll_step_combine(buffer, &s, 0));
    ll_step_check_combine(&s, lost_mask(ctx), what);
    ll_step_free(&s);

    /* 2: the newcomer's config differs; 3: the newcomer's own config is refused. */
    groups[2] = rejoin_group(ctx, 2, ctx->rank);
    expect_refused(epx_ll_rejoin(buffer, groups[2]), EPX_ERR_INVALID_ARG, "config differs", ctx,
                   "attempt 2 (configs differ)");
    groups[3] = rejoin_group(ctx, 3, ctx->rank);
    expect_refused(epx_ll_rejoin(buffer, groups[3]), EPX_ERR_REMOTE, "rank 3 refused", ctx,
                   "attempt 3 (newcomer's bad config)");

    /* 4: ranks 1 and 2 swapped their numbers in the new group. */
    int swapped = ctx->rank == 1 ? 2 : ctx->rank == 2 ? 1 : ctx->rank;
    groups[4] = rejoin_group(ctx, 4, swapped);
    expect_refused(epx_ll_rejoin(buffer, groups[4]),
                   swapped != ctx->rank ? EPX_ERR_INVALID_ARG : EPX_ERR_REMOTE,
                   swapped != ctx->rank ? "in the buffer" : "rank 1 refused", ctx,
                   "attempt 4 (rank numbers swapped)");
    steps_masked(buffer, ctx, 104, 2); /* nothing changed */
    check_mask(buffer, ctx, 1, "after the refusals");

    /* 5: a good attempt; then the newcomer is lost again. */
    groups[5] = rejoin_group(ctx, 5, ctx->rank);
    CHECK_OK(epx_ll_rejoin(buffer, groups[5]));
    check_rejoined(buffer, ctx);
    steps_all(buffer, ctx, 106, 2);
    step_losing(buffer, ctx, 108, "step 8 (newcomer lost)");

    /* 6: rank 0 masks rank 2, which is alive and takes part as a survivor. */
    if (ctx->rank == 0)
        CHECK_OK(epx_ll_mask_rank(buffer, 2));
    groups[6] = rejoin_group(ctx, 6, ctx->rank);
    expect_refused(epx_ll_rejoin(buffer, groups[6]), EPX_ERR_INVALID_STATE, "masks rank 2", ctx,
                   "attempt 6 (a live rank masked)");
    /* The buffer's group (5) has lost the newcomer: its destroy's vote may fail. */
    epx_status_t destroyed = epx_buffer_destroy(buffer);
    CHECK(destroyed == EPX_SUCCESS || destroyed == EPX_ERR_BOOTSTRAP ||
          destroyed == EPX_ERR_REMOTE || destroyed == EPX_ERR_TIMEOUT);
    destroy_groups(groups, 7);
}

static void survivor_stopped(const context_t *ctx, epx_buffer_t buffer)
{
    epx_group_t groups[2] = {NULL, NULL};
    step_losing(buffer, ctx, 101, "step 1 (rank silent)");
    steps_masked(buffer, ctx, 102, 1);
    groups[0] = rejoin_group(ctx, 0, ctx->rank);
    expect_refused(epx_ll_rejoin(buffer, groups[0]), EPX_ERR_INVALID_STATE, "still running", ctx,
                   "attempt 0 (old process alive)");
    CHECK_OK(epx_group_destroy(groups[0]));
    groups[0] = NULL;
    steps_masked(buffer, ctx, 103, 1);
    groups[1] = rejoin_group(ctx, 1, ctx->rank); /* the launcher ended the old process */
    CHECK_OK(epx_ll_rejoin(buffer, groups[1]));
    check_rejoined(buffer, ctx);
    steps_all(buffer, ctx, 104, 2);
    CHECK_OK(epx_buffer_destroy(buffer));
    destroy_groups(groups, 2);
}

/* A rank of the first group: serve, lose LOST, then the variant's survivor script. */
static int run_initial(int argc, char **argv, context_t *ctx)
{
    alarm(90);
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx_group_t group = mr_group_create(argc, argv, &info);
    ctx->rank = info.rank;
    CHECK_EQ_INT(info.world_size, NUM_RANKS);
    epx_buffer_config_t config = buffer_config();
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));
    ll_step_run_checked(buffer, &shape, ctx->rank, 100, NULL, 0, "step 0");
    if (ctx->rank == ctx->lost) {
        if (strcmp(ctx->variant, "stopped") == 0) {
            pause(); /* alive and silent until the launcher ends it */
            _exit(0);
        }
        raise(SIGKILL);
    }
    if (strncmp(ctx->variant, "rejoin", 6) == 0)
        survivor_rejoin(ctx, group, buffer);
    else if (strcmp(ctx->variant, "dies") == 0)
        survivor_dies(ctx, buffer);
    else if (strcmp(ctx->variant, "refused") == 0)
        survivor_refused(ctx, buffer);
    else
        survivor_stopped(ctx, buffer);
    /* The first group lost a rank (maybe its hub): its destroy is local. */
    CHECK_OK(epx_group_destroy(group));
    printf("[rank %d] %s: done\n", ctx->rank, ctx->variant);
    return 0;
}

/* ---------------------------------------------------------------- newcomers */

/* epx_buffer_create_rejoin on attempt `attempt`'s group, with the survivors' config. */
static epx_status_t join(const context_t *ctx, int attempt, epx_group_t *group,
                         epx_buffer_t *buffer)
{
    *group = rejoin_group(ctx, attempt, ctx->lost);
    epx_buffer_config_t config = buffer_config();
    return epx_buffer_create_rejoin(*group, &config, buffer);
}

/* Newcomer `index` of variant rejoin*: serve, then die (0) or finish (1). */
static void newcomer_rejoin(const context_t *ctx, int index)
{
    epx_group_t group;
    epx_buffer_t buffer;
    CHECK_OK(join(ctx, index, &group, &buffer));
    check_rejoined(buffer, ctx);
    if (index == 0) {
        steps_all(buffer, ctx, 105, 3);
        raise(SIGKILL);
    }
    steps_all(buffer, ctx, 110, 2);
    CHECK_OK(epx_buffer_destroy(buffer));
    CHECK_OK(epx_group_destroy(group));
}

static void newcomer_dies(const context_t *ctx, int index)
{
    epx_group_t group = rejoin_group(ctx, index, ctx->lost);
    if (index == 0)
        raise(SIGKILL); /* in the group, gone before the rejoin */
    if (index < 4) {
        /* Killed (SIGALRM, no handler) somewhere in the next few milliseconds. */
        srand((unsigned)getpid());
        struct itimerval when = {{0, 0}, {0, 200 + rand() % 4000}};
        CHECK(setitimer(ITIMER_REAL, &when, NULL) == 0);
        epx_buffer_t buffer;
        epx_buffer_config_t config = buffer_config();
        (void)epx_buffer_create_rejoin(group, &config, &buffer);
        for (;;)
            pause();
    }
    epx_buffer_t buffer;
    epx_buffer_config_t config = buffer_config();
    CHECK_OK(epx_buffer_create_rejoin(group, &config, &buffer));
    check_rejoined(buffer, ctx);
    steps_all(buffer, ctx, 300, 3);
    CHECK_OK(epx_buffer_destroy(buffer));
    CHECK_OK(epx_group_destroy(group));
}

static void newcomer_refused(const context_t *ctx, int index)
{
    epx_group_t groups[7] = {NULL};
    epx_buffer_t buffer = NULL;
    epx_buffer_config_t config = buffer_config();
    if (index == 1) {
        /* 6: the survivors refuse because one of them masks a live rank. */
        groups[6] = rejoin_group(ctx, 6, ctx->lost);
        expect_refused(epx_buffer_create_rejoin(groups[6], &config, &buffer),
                       EPX_ERR_INVALID_STATE, "masks rank 2", ctx, "attempt 6");
        CHECK(buffer == NULL);
        CHECK_OK(epx_group_destroy(groups[6]));
        return;
    }
    groups[0] = rejoin_group(ctx, 0, ctx->lost);
    expect_refused(epx_buffer_create_rejoin(groups[0], &config, &buffer), EPX_ERR_INVALID_STATE,
                   "has not masked it", ctx, "attempt 0");
    groups[1] = rejoin_group(ctx, 1, ctx->lost);
    expect_refused(epx_buffer_create_rejoin(groups[1], &config, &buffer), EPX_ERR_REMOTE,
                   "rank 0 refused", ctx, "attempt 1");
    epx_buffer_config_t wider = config;
    wider.hidden *= 2;
    groups[2] = rejoin_group(ctx, 2, ctx->lost);
    expect_refused(epx_buffer_create_rejoin(groups[2], &wider, &buffer), EPX_ERR_INVALID_ARG,
                   "config differs", ctx, "attempt 2");
    epx_buffer_config_t normal_only = config;
    normal_only.max_low_latency_tokens = 0;
    groups[3] = rejoin_group(ctx, 3, ctx->lost);
    expect_refused(epx_buffer_create_rejoin(groups[3], &normal_only, &buffer), EPX_ERR_INVALID_ARG,
                   "max_low_latency_tokens", ctx, "attempt 3");
    groups[4] = rejoin_group(ctx, 4, ctx->lost);
    expect_refused(epx_buffer_create_rejoin(groups[4], &config, &buffer), EPX_ERR_REMOTE,
                   "rank 1 refused", ctx, "attempt 4");
    CHECK(buffer == NULL); /* written on success only */
    groups[5] = rejoin_group(ctx, 5, ctx->lost);
    CHECK_OK(epx_buffer_create_rejoin(groups[5], &config, &buffer));
    check_rejoined(buffer, ctx);
    steps_all(buffer, ctx, 106, 2);
    raise(SIGKILL);
}

static void newcomer_stopped(const context_t *ctx, int index)
{
    epx_group_t group;
    epx_buffer_t buffer = NULL;
    epx_status_t status = join(ctx, index, &group, &buffer);
    if (index == 0) {
        expect_refused(status, EPX_ERR_REMOTE, "still running", ctx, "attempt 0");
        CHECK_OK(epx_group_destroy(group));
        return; /* the launcher then ends the old process and starts the next newcomer */
    }
    CHECK_OK(status);
    check_rejoined(buffer, ctx);
    steps_all(buffer, ctx, 104, 2);
    CHECK_OK(epx_buffer_destroy(buffer));
    CHECK_OK(epx_group_destroy(group));
}

static int run_newcomer(context_t *ctx, int index)
{
    alarm(90);
    ctx->rank = ctx->lost;
    if (strncmp(ctx->variant, "rejoin", 6) == 0)
        newcomer_rejoin(ctx, index);
    else if (strcmp(ctx->variant, "dies") == 0)
        newcomer_dies(ctx, index);
    else if (strcmp(ctx->variant, "refused") == 0)
        newcomer_refused(ctx, index);
    else
        newcomer_stopped(ctx, index);
    printf("[rank %d] newcomer %d of %s: done\n", ctx->rank, index, ctx->variant);
    return 0;
}

/* ---------------------------------------------------------------- launcher */

typedef struct {
    const char *name;
    int lost;
    int newcomers;
    int first_at_start; /* the first newcomer starts at once, beside the (silent) old rank */
} variant_t;

static pid_t spawn(const variant_t *v, const char *ids, const char *g1, int rank, int newcomer)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        TEST_FAIL("fork: %s", strerror(errno));
    if (pid > 0)
        return pid;
    char timeout_text[16], lost_text[16], index_text[16];
    snprintf(timeout_text, sizeof timeout_text, "%d", TIMEOUT_MS);
    snprintf(lost_text, sizeof lost_text, "%d", v->lost);
    snprintf(index_text, sizeof index_text, "%d", newcomer);
    mr_set_rank_env(rank, NUM_RANKS, g1);
    setenv("EPX_TIMEOUT_MS", timeout_text, 1);
    setenv("EPX_LOG_LEVEL", "error", 1);
    char *child_argv[] = {"test_ll_rejoin", "--child", (char *)v->name, "--lost", lost_text,
                          "--ids", (char *)ids, "--newcomer", index_text, "--backend", "host",
                          NULL};
    execv("/proc/self/exe", child_argv);
    _exit(127);
}

static int ended_well(int status, int may_die)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status) == 0;
    return may_die && WIFSIGNALED(status) &&
           (WTERMSIG(status) == SIGKILL || WTERMSIG(status) == SIGALRM);
}

static int run_variant(const variant_t *v)
{
    char ids[MAX_IDS * 160] = "", g1[2 * EPX_UNIQUE_ID_BYTES + 64];
    epx_unique_id_t id;
    CHECK_OK(epx_get_unique_id(&id));
    CHECK_OK(epx_unique_id_to_string(&id, g1, sizeof g1));
    for (int a = 0; a < MAX_IDS; a++) {
        char text[2 * EPX_UNIQUE_ID_BYTES + 64];
        CHECK_OK(epx_get_unique_id(&id));
        CHECK_OK(epx_unique_id_to_string(&id, text, sizeof text));
        strcat(ids, a ? "," : "");
        strcat(ids, text);
    }
    pid_t survivors[NUM_RANKS];
    pid_t occupant = -1, silent = -1;
    for (int r = 0; r < NUM_RANKS; r++) {
        survivors[r] = spawn(v, ids, g1, r, -1);
        if (r == v->lost)
            occupant = survivors[r];
    }
    int next = 0, failures = 0, running = NUM_RANKS;
    if (v->first_at_start) {
        silent = occupant;
        occupant = spawn(v, ids, g1, v->lost, next++);
        running++;
    }
    while (running > 0) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0)
            break;
        running--;
        int is_lost = pid == occupant || pid == silent;
        if (!ended_well(status, is_lost)) {
            failures++;
            fprintf(stderr, "FAIL %s: pid %d (%s) ended with %s %d\n", v->name, (int)pid,
                    is_lost ? "rank lost or newcomer" : "survivor",
                    WIFSIGNALED(status) ? "signal" : "status",
                    WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
        }
        if (pid == occupant && silent > 0) {
            kill(silent, SIGKILL); /* the refused newcomer is done: end the silent rank */
            continue;
        }
        if ((pid == occupant || pid == silent) && next < v->newcomers) {
            silent = -1;
            occupant = spawn(v, ids, g1, v->lost, next++);
            running++;
        }
    }
    printf("%s %s\n", failures ? "FAIL" : "ok  ", v->name);
    fflush(stdout);
    return failures;
}

static const variant_t variants[] = {
    {"rejoin3", 3, 2, 0}, {"rejoin0", 0, 2, 0}, {"dies", 3, 5, 0},
    {"refused", 3, 2, 0}, {"stopped", 3, 2, 1},
};

int main(int argc, char **argv)
{
    const char *child = mr_flag(argc, argv, "--child", NULL);
    if (child != NULL) {
        context_t ctx;
        memset(&ctx, 0, sizeof ctx);
        ctx.variant = child;
        ctx.lost = atoi(mr_flag(argc, argv, "--lost", "3"));
        char *ids = strdup(mr_flag(argc, argv, "--ids", ""));
        CHECK(ids != NULL);
        int count = 0;
        for (char *save = NULL, *id = strtok_r(ids, ",", &save); id != NULL && count < MAX_IDS;
             id = strtok_r(NULL, ",", &save))
            ctx.ids[count++] = id;
        int newcomer = atoi(mr_flag(argc, argv, "--newcomer", "-1"));
        int status = newcomer < 0 ? run_initial(argc, argv, &ctx) : run_newcomer(&ctx, newcomer);
        free(ids);
        return status;
    }
    const char *which = mr_flag(argc, argv, "--variant", "all");
    int failures = 0, ran = 0;
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++)
        if (strcmp(which, "all") == 0 || strcmp(which, variants[i].name) == 0) {
            failures += run_variant(&variants[i]);
            ran++;
        }
    if (ran == 0)
        TEST_FAIL("unknown --variant %s", which);
    return failures == 0 ? 0 : 1;
}
