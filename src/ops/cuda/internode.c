/*
 * Internode normal mode, host side: the regions it adds to the normal-mode plan, its
 * shared allocation in NVSHMEM symmetric memory, and which kernels a buffer runs.
 *
 * A group that spans N nodes of P ranks runs dispatch and combine with the same host
 * logic as on one node (dispatch.c, combine.c: tickets, handles, cached and worst-case
 * modes, caller outputs) and the same receive layout, so the results are identical;
 * only the kernels differ (nvshmem/xn_dispatch.cu, nvshmem/xn_combine.cu, in the
 * NVSHMEM plugin). The shared allocation of every rank is one nvshmem_malloc: ranks of
 * this node write it through nvshmem_ptr mappings, ranks of other nodes only through
 * NVSHMEM puts and signals, so every inter-node byte goes through NVSHMEM's transport
 * (IBGDA, IBRC, UCX, libfabric) and nothing of a network stack lives here.
 *
 * Memory added per rank (T = max_tokens_per_rank): the count messages ([2][R] rows in,
 * [R] staged out), record slots [N][S] in and out (a record is a token's row, scales,
 * top-k and its rows at the destination node's ranks), partial-sum slots [N][S] in and
 * out (a bf16 row and K fp32 weights). By default S = T, the worst case (every token of
 * a rank may go to every node), and no credits are needed. EPX_XN_RING_TOKENS = C below T
 * makes every slot array a ring, S = C, with the counters of the credits that flow back
 * as the rings drain (nvshmem/xn_ring.cuh).
 */
#include <stdlib.h>
#include <string.h>

#include "bootstrap/bootstrap.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/ll.h"
#include "transport/nvshmem/nvshmem.h"

#define EPX_XN_ALIGN 256
/* Records per put and per credit in a ring: a quarter of the ring, at most this many. */
#define EPX_XN_MAX_CHUNK 16

struct epx__cuda_xn {
    const epx_ll_plugin_t *plugin;
    void *sym;   /* nvshmem_malloc: the shared allocation */
    char **peers; /* [R] bases of this node's ranks (nvshmem_ptr), NULL for other nodes */
};

static int64_t align_up(int64_t value, int64_t alignment)
{
    return (value + alignment - 1) / alignment * alignment;
}

static int64_t take(int64_t *offset, int64_t bytes)
{
    int64_t at = align_up(*offset, EPX_XN_ALIGN);
    *offset = at + bytes;
    return at;
}

epx_status_t epx__cuda_xn_plan(epx_group_t group, const epx_buffer_config_t *config,
                               epx__cuda_shape_t *s, size_t *handle_slot_bytes)
{
    /* R <= EPX_CUDA_MAX_RANKS (64) with N >= 2 nodes: P <= 32, a warp's lanes (kernels). */
    int R = group->world_size, P = s->ranks_per_node, N = s->num_nodes;
    int64_t T = config->max_tokens_per_rank, K = config->num_topk, H = config->hidden;
    int64_t L = config->num_experts / R;
    if (K > 256)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer: internode normal mode takes num_topk up to 256 (config has %lld)",
                         (long long)K);
    int scales = H % 128 == 0 ? (int)(H / 128) : 0;
    s->max_tokens = T;
    s->xn_count_cols = align_up(R + N + L + 1, 4);
    s->xn_record_pitch = epx__cuda_xn_record(H * 2, scales, (int)K, P).bytes;
    s->xn_partial_pitch = align_up(H * 2 + K * 4, 16);
    s->xn_test_delay_ns = epx__param_int(EPX_PARAM_XN_TEST_DELAY_NS);
    /* A ring of T or more never wraps: the worst-case slots are no larger, and need no
     * credits. (The params table let only 0 and powers of two through.) */
    int64_t ring = epx__param_int(EPX_PARAM_XN_RING_TOKENS);
    s->xn_ring = ring > 0 && ring < T ? ring : 0;
    s->xn_chunk = 0;
    if (s->xn_ring > 0) {
        s->xn_chunk = s->xn_ring / 4 > 0 ? s->xn_ring / 4 : 1;
        if (s->xn_chunk > EPX_XN_MAX_CHUNK)
            s->xn_chunk = EPX_XN_MAX_CHUNK;
    }
    int64_t slots = s->xn_ring > 0 ? s->xn_ring : T;

    int64_t off = s->shared_bytes;
    s->off_xn_counts = take(&off, 2 * (int64_t)R * s->xn_count_cols * 4);
    s->off_xn_counts_out = take(&off, (int64_t)R * s->xn_count_cols * 4);
    s->off_xn_inbox = take(&off, (int64_t)N * slots * s->xn_record_pitch);
    s->off_xn_outbox = take(&off, (int64_t)N * slots * s->xn_record_pitch);
    s->off_xn_partial_in = take(&off, (int64_t)N * slots * s->xn_partial_pitch);
    s->off_xn_partial_out = take(&off, (int64_t)N * slots * s->xn_partial_pitch);
    s->off_xn_ring = 0;
    if (s->xn_ring > 0)
        s->off_xn_ring =
            take(&off, epx__cuda_xn_ring_layout(N, s->xn_ring / s->xn_chunk).bytes);
    s->shared_bytes = align_up(off, 1 << 21);

    /* The handle's routing: node_pos [T][N], node_out [N], node_in [N], fwd_rows [N][T][P]. */
    int64_t routing = align_up(T * N * 4, EPX_XN_ALIGN) + 2 * align_up(N * 4, EPX_XN_ALIGN) +
                      align_up((int64_t)N * T * P * 4, EPX_XN_ALIGN);
    *handle_slot_bytes = (size_t)align_up((int64_t)*handle_slot_bytes, EPX_XN_ALIGN) +
                         (size_t)routing;
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_xn_describe(epx_group_t group, const epx_buffer_config_t *config,
                                   epx_internode_plan_t *plan)
{
    epx__cuda_shape_t s;
    size_t slot = 0;
    EPX_CHECK(epx__cuda_plan(group, config, &s, &slot));
    if (s.num_nodes < 2)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "internode_plan: %d ranks of %d per node are one node; internode "
                         "normal mode needs two nodes or more",
                         group->world_size, s.ranks_per_node);
    int64_t N = s.num_nodes, slots = s.xn_ring > 0 ? s.xn_ring : s.max_tokens;
    int sms = config->num_sms > 0 ? config->num_sms : (int)epx__param_int(EPX_PARAM_NUM_SMS);
    int warps = sms * (EPX_CUDA_THREADS / 32);
    plan->num_nodes = (int)N;
    plan->credits = s.xn_ring > 0;
    plan->slots_per_channel = slots;
    plan->chunk_tokens = s.xn_chunk;
    plan->record_bytes = s.xn_record_pitch;
    plan->partial_bytes = s.xn_partial_pitch;
    plan->record_slot_bytes = (size_t)(2 * N * slots * s.xn_record_pitch);
    plan->partial_slot_bytes = (size_t)(2 * N * slots * s.xn_partial_pitch);
    plan->num_sms = sms;
    if (s.xn_ring > 0) {
        /* nvshmem/xn_ring.cuh: 8 warps of each block receive, the rest send, but one
         * returns credits. A put carries one record or more, within the credits. */
        plan->receiver_warps = sms * 8;
        plan->sender_warps = warps - plan->receiver_warps - 1;
        plan->credit_warps = 1;
        plan->puts_in_flight = s.xn_ring < plan->sender_warps ? s.xn_ring : plan->sender_warps;
    } else {
        /* nvshmem/xn_dispatch.cu: every warp sends its run (one put per node), then
         * forwards. */
        plan->receiver_warps = warps;
        plan->sender_warps = warps;
        plan->credit_warps = 0;
        plan->puts_in_flight = s.max_tokens < warps ? s.max_tokens : warps;
    }
    return EPX_SUCCESS;
}

void epx__cuda_xn_routing(const epx__cuda_shape_t *s, void *slot, int64_t offset,
                          epx__cuda_xn_routing_t *routing)
{
    memset(routing, 0, sizeof(*routing));
    if (s->num_nodes <= 1)
        return;
    int64_t T = s->max_tokens, N = s->num_nodes;
    char *at = (char *)slot + align_up(offset, EPX_XN_ALIGN);
    routing->node_pos = (int32_t *)at;
    at += align_up(T * N * 4, EPX_XN_ALIGN);
    routing->node_out = (int32_t *)at;
    at += align_up(N * 4, EPX_XN_ALIGN);
    routing->node_in = (int32_t *)at;
    at += align_up(N * 4, EPX_XN_ALIGN);
    routing->fwd_rows = (int32_t *)at;
}

/* What each rank says about its rings before the symmetric allocation. */
typedef struct {
    int32_t status;
    int32_t reserved;
    int64_t ring;
} ring_vote_t;

/*
 * Every rank must lay out its rings alike (a sender addresses the receiver's slots by
 * offset), so a differing EPX_XN_RING_TOKENS is refused on every rank, naming both.
 */
static epx_status_t agree_on_ring(epx_group_t group, int64_t ring, epx_status_t status)
{
    int R = group->world_size;
    ring_vote_t mine = {0, 0, ring};
    ring_vote_t *all = calloc((size_t)R, sizeof(*all));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    status = epx__bootstrap_vote(group->bootstrap, R, status, &mine, all, sizeof(mine),
                                 "buffer_create", "failed");
    for (int r = 0; r < R && status == EPX_SUCCESS; r++)
        if (all[r].ring != ring)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "buffer_create: EPX_XN_RING_TOKENS gives rank %d a ring of %lld "
                               "tokens and rank %d one of %lld (0 = slots for the worst case): "
                               "every rank must set the same value",
                               r, (long long)all[r].ring, group->rank, (long long)ring);
    free(all);
    return status;
}

epx_status_t epx__cuda_xn_create(epx_buffer_t buffer, epx__cuda_buffer_t *cuda,
                                 epx_status_t status)
{
    epx_group_t group = buffer->group;
    const epx__cuda_shape_t *s = &cuda->shape;
    int R = group->world_size, me = group->rank, P = s->ranks_per_node;
    size_t bytes = (size_t)s->shared_bytes;
    status = agree_on_ring(group, s->xn_ring, status);
    /* NVSHMEM's heap is sized once, by its first user: count a low-latency part too. */
    epx_ll_shape_t ll_shape;
    size_t ll_sym = 0, ll_local = 0;
    if (epx__cuda_ll_plan(group, &buffer->config, &ll_shape, &ll_sym, &ll_local) != EPX_SUCCESS)
        ll_sym = 0;
    epx__cuda_xn_t *xn = calloc(1, sizeof(*xn));
    if (xn != NULL)
        xn->peers = calloc((size_t)R, sizeof(char *));
    if ((xn == NULL || xn->peers == NULL) && status == EPX_SUCCESS)
        status = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    const epx_ll_plugin_t *plugin = NULL;
    status = epx__cuda_nvshmem_setup(group, bytes + ll_sym, status, &plugin);
    if (status != EPX_SUCCESS) {
        if (xn != NULL)
            free(xn->peers);
        free(xn);
        return status;
    }
    xn->plugin = plugin;
    cuda->xn = xn;
    /* Collective on every PE, in the same order on all (the low-latency part follows). */
    xn->sym = epx__nvshmem_malloc(bytes);
    if (xn->sym == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY,
                         "buffer_create: nvshmem_malloc of %zu bytes (internode normal mode) "
                         "failed: the symmetric heap is too small (NVSHMEM_SYMMETRIC_SIZE=%s)",
                         bytes,
                         getenv("NVSHMEM_SYMMETRIC_SIZE") ? getenv("NVSHMEM_SYMMETRIC_SIZE")
                                                          : "?");
    EPX_CUDA_CHECK(cudaMemset(xn->sym, 0, bytes), "buffer_create: zeroing the shared memory");
    int first = me / P * P;
    for (int r = first; r < first + P; r++) {
        xn->peers[r] = r == me ? (char *)xn->sym : epx__nvshmem_peer(xn->sym, r);
        if (xn->peers[r] == NULL)
            return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                             "buffer_create: NVSHMEM gives no direct pointer to rank %d, which "
                             "the group puts on this rank's node (ranks_per_node %d): the "
                             "ranks of a node must reach each other over NVLink or PCIe P2P",
                             r, P);
    }
    cuda->shared = xn->sym;
    cuda->peer_bases = xn->peers;
    return EPX_SUCCESS;
}

void epx__cuda_xn_destroy(epx__cuda_buffer_t *cuda, int healthy)
{
    epx__cuda_xn_t *xn = cuda->xn;
    if (xn == NULL)
        return;
    if (xn->sym != NULL && healthy)
        epx__nvshmem_free(xn->sym);
    epx__cuda_nvshmem_release(healthy);
    free(xn->peers);
    free(xn);
    cuda->xn = NULL;
    cuda->shared = NULL;
    cuda->peer_bases = NULL;
}

void epx__cuda_xn_tell(const epx__cuda_buffer_t *cuda, int skip, cudaStream_t stream)
{
    const epx__cuda_xn_t *xn = cuda->xn;
    if (xn == NULL || xn->sym == NULL || cuda->abort_word == NULL ||
        xn->plugin->xn_tell == NULL)
        return;
    /* The control area is at the same offset of every rank's symmetric allocation: the
     * word goes to this rank's abort_out first, and from there to each peer's abort_word. */
    epx__cuda_ctrl_t *ctrl = (epx__cuda_ctrl_t *)xn->sym;
    if (cudaMemcpyAsync(&ctrl->abort_out, cuda->abort_word, sizeof(uint64_t),
                        cudaMemcpyHostToDevice, stream) != cudaSuccess)
        return;
    for (int r = 0; r < cuda->shape.world_size; r++)
        if (r != cuda->shape.rank && r != skip && xn->peers[r] == NULL)
            (void)xn->plugin->xn_tell(&ctrl->abort_word, &ctrl->abort_out, r, stream);
}

cudaError_t epx__cuda_run_notify(const epx__cuda_buffer_t *cuda,
                                 const epx__cuda_notify_args_t *args, cudaStream_t stream)
{
    if (cuda->xn != NULL)
        return (cudaError_t)cuda->xn->plugin->xn_notify(&cuda->shape, args, stream);
    return epx__cuda_launch_notify(&cuda->shape, args, stream);
}

cudaError_t epx__cuda_run_dispatch(const epx__cuda_buffer_t *cuda,
                                   const epx__cuda_dispatch_args_t *args, cudaStream_t stream)
{
    if (cuda->xn != NULL)
        return (cudaError_t)cuda->xn->plugin->xn_dispatch(&cuda->shape, args, stream);
    return epx__cuda_launch_dispatch(&cuda->shape, args, stream);
}

cudaError_t epx__cuda_run_combine(const epx__cuda_buffer_t *cuda,
                                  const epx__cuda_combine_args_t *args, cudaStream_t stream)
{
    if (cuda->xn != NULL)
        return (cudaError_t)cuda->xn->plugin->xn_combine(&cuda->shape, args, stream);
    return epx__cuda_launch_combine(&cuda->shape, args, stream);
}
