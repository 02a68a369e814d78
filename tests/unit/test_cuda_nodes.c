/*
 * CUDA buffers on groups that span nodes, without a GPU: which parts a buffer gets
 * (normal mode over CUDA IPC needs one node; across nodes only the low-latency part,
 * and a config without low-latency tokens is refused, naming the way out), what
 * epx_buffer_size reports for each, and a low-latency-only buffer's normal-mode entry
 * points: each returns EPX_ERR_UNSUPPORTED naming the operation and the nodes, and the
 * paths that must not fail (abort, async error polling, destroy) skip the missing
 * normal-mode part instead of touching it.
 */
#include <stdio.h>

#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/ll.h"

static struct epx_group make_group(int rank, int world, int per_node)
{
    struct epx_group g;
    memset(&g, 0, sizeof(g));
    g.rank = rank;
    g.world_size = world;
    g.ranks_per_node = per_node;
    g.backend = EPX_BACKEND_CUDA;
    g.device = 0;
    g.timeout_ms = 1000;
    return g;
}

static epx_buffer_config_t make_config(int64_t ll_tokens)
{
    epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
    c.max_tokens_per_rank = 64;
    c.hidden = 256;
    c.num_experts = 32;
    c.num_topk = 4;
    c.num_sms = 16;
    c.max_low_latency_tokens = ll_tokens;
    return c;
}

/* ---------------------------------------------------------------- the decision */

static void check_parts(void)
{
    struct epx_group one = make_group(0, 4, 4), two = make_group(3, 4, 2);
    struct epx_group eight = make_group(5, 16, 2);
    CHECK_EQ_INT(epx__cuda_num_nodes(&one), 1);
    CHECK_EQ_INT(epx__cuda_num_nodes(&two), 2);
    CHECK_EQ_INT(epx__cuda_num_nodes(&eight), 8);

    epx_buffer_config_t normal_only = make_config(0), both = make_config(16);
    int with_normal = -1;
    CHECK_OK(epx__cuda_choose_parts(&one, &normal_only, &with_normal));
    CHECK_EQ_INT(with_normal, 1);
    with_normal = -1;
    CHECK_OK(epx__cuda_choose_parts(&one, &both, &with_normal));
    CHECK_EQ_INT(with_normal, 1);
    with_normal = -1;
    CHECK_OK(epx__cuda_choose_parts(&two, &both, &with_normal));
    CHECK_EQ_INT(with_normal, 0);
    with_normal = -1;
    CHECK_OK(epx__cuda_choose_parts(&eight, &both, &with_normal));
    CHECK_EQ_INT(with_normal, 0);

    /* Across nodes without low-latency tokens nothing would be usable: refused, and
     * the message says why and what to do instead. */
    with_normal = -1;
    CHECK_STATUS(epx__cuda_choose_parts(&two, &normal_only, &with_normal), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("spans 2 nodes");
    CHECK_ERROR_MENTIONS("max_low_latency_tokens");
    CHECK_ERROR_MENTIONS("one node");
    CHECK_EQ_INT(with_normal, -1);
}

/* ---------------------------------------------------------------- epx_buffer_size */

static void check_sizes(void)
{
    struct epx_group one = make_group(1, 4, 4), two = make_group(1, 4, 2);
    epx_buffer_config_t both = make_config(16), normal_only = make_config(0);

    epx__cuda_shape_t shape;
    size_t slot = 0;
    CHECK_OK(epx__cuda_plan(&one, &both, &shape, &slot));
    /* The low-latency plan of each group (it may reserve more where peers need puts). */
    epx_ll_shape_t ll_shape;
    size_t one_sym = 0, one_local = 0, two_sym = 0, two_local = 0;
    CHECK_OK(epx__cuda_ll_plan(&one, &both, &ll_shape, &one_sym, &one_local));
    CHECK_OK(epx__cuda_ll_plan(&two, &both, &ll_shape, &two_sym, &two_local));
    CHECK(two_sym > 0 && two_local > 0);

    /* One node: both parts. Across nodes: the low-latency part only. */
    size_t one_node = 0, across = 0;
    CHECK_OK(epx__cuda_backend.buffer_size(&one, &both, &one_node));
    CHECK_EQ_INT(one_node, (size_t)shape.shared_bytes + sizeof(epx__cuda_local_t) + one_sym +
                               one_local);
    CHECK_OK(epx__cuda_backend.buffer_size(&two, &both, &across));
    CHECK_EQ_INT(across, two_sym + two_local);
    /* The normal-mode part of this config (MBs) dwarfs any low-latency difference. */
    CHECK(across < one_node);

    size_t untouched = 12345;
    CHECK_STATUS(epx__cuda_backend.buffer_size(&two, &normal_only, &untouched),
                 EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("low-latency");
    CHECK_EQ_INT(untouched, 12345);
}

/* ---------------------------------------------------------------- the entry points */

/* A one-process stand-in for the group's rendezvous: every rank "sends" what this one
 * sends, so the destroy's health vote sees every rank healthy. */
static int world_of_bootstrap = 4;

static int mirror_allgather(void *ctx, const void *send, void *recv, size_t bytes)
{
    (void)ctx;
    for (int r = 0; r < world_of_bootstrap; r++)
        memcpy((char *)recv + (size_t)r * bytes, send, bytes);
    return 0;
}

static int mirror_barrier(void *ctx)
{
    (void)ctx;
    return 0;
}

/* The normal-mode call must be refused, naming the operation, the nodes and the way out. */
static void check_refused(epx_status_t status, const char *op)
{
    CHECK_STATUS(status, EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS(op);
    CHECK_ERROR_MENTIONS("needs all ranks of the group on one node");
    CHECK_ERROR_MENTIONS("spans 2 nodes");
    CHECK_ERROR_MENTIONS("epx_ll_");
}

/*
 * A buffer as cuda_buffer_create leaves it across nodes, with the low-latency part
 * left out too (it needs a GPU and NVSHMEM): no normal-mode part at all.
 */
static void check_entry_points(void)
{
    struct epx_group group = make_group(2, world_of_bootstrap, 2);
    epx_bootstrap_callbacks_t callbacks = {mirror_allgather, mirror_barrier, NULL};
    CHECK_OK(epx__bootstrap_create_callbacks(&callbacks, group.rank, group.world_size,
                                             &group.bootstrap));
    struct epx_buffer *buffer = calloc(1, sizeof(*buffer));
    epx__cuda_buffer_t *cuda = calloc(1, sizeof(*cuda));
    CHECK(buffer != NULL && cuda != NULL);
    buffer->group = &group;
    buffer->config = make_config(16);
    buffer->num_local_experts = buffer->config.num_experts / group.world_size;
    buffer->ops = &epx__cuda_backend;
    buffer->impl = cuda;
    atomic_init(&buffer->async_error, EPX_SUCCESS);
    atomic_init(&buffer->ll_peer_error, EPX_SUCCESS);
    const epx__backend_ops_t *ops = &epx__cuda_backend;

    epx_layout_args_t layout;
    memset(&layout, 0, sizeof(layout));
    check_refused(ops->layout(buffer, &layout, NULL), "get_dispatch_layout");

    /* Fresh and cached dispatch share one entry; neither reads its arguments first. */
    struct epx_handle handle;
    memset(&handle, 0, sizeof(handle));
    handle.buffer = buffer;
    epx_dispatch_args_t dispatch;
    memset(&dispatch, 0, sizeof(dispatch));
    epx_dispatch_result_t result;
    memset(&result, 0, sizeof(result));
    check_refused(ops->dispatch(buffer, &dispatch, &result, NULL), "dispatch");
    dispatch.handle = &handle;
    check_refused(ops->dispatch(buffer, &dispatch, &result, NULL), "dispatch");
    CHECK(result.handle == NULL);

    epx_combine_args_t combine;
    memset(&combine, 0, sizeof(combine));
    combine.handle = &handle;
    check_refused(ops->combine(buffer, &combine, NULL), "combine");

    void *base = &handle;
    int64_t rows = -7;
    check_refused(ops->combine_input(buffer, &base, &rows), "get_combine_input");
    CHECK(base == &handle);
    CHECK_EQ_INT(rows, -7);

    /* No device error record to read: nothing is recorded, and the poll says so. */
    CHECK_OK(epx__cuda_poll(buffer));
    CHECK_EQ_INT(epx__cuda_note_failure(buffer), 0);
    CHECK_EQ_INT(epx__cuda_failure_culprit(buffer), -1);
    ops->poll_async_error(buffer);
    CHECK_EQ_INT(atomic_load(&buffer->async_error), EPX_SUCCESS);
    CHECK_EQ_INT(atomic_load(&buffer->ll_peer_error), EPX_SUCCESS);

    /* The abort path has no peer memory to write into: it returns, touching nothing. */
    ops->abort(buffer, EPX_ERR_TIMEOUT, "test");
    CHECK_EQ_INT(atomic_load(&buffer->async_error), EPX_SUCCESS);

    /* Destroy frees what there is (here nothing but the host state). */
    ops->buffer_destroy(buffer);
    CHECK(buffer->impl == NULL);
    free(buffer);
    epx__bootstrap_destroy(group.bootstrap);
}

int main(void)
{
    check_parts();
    check_sizes();
    check_entry_points();
    printf("test_cuda_nodes: ok\n");
    return 0;
}
#else
int main(void)
{
    printf("test_cuda_nodes: skipped (built without the CUDA backend)\n");
    return 0;
}
#endif
