/*
 * The CUDA backend's buffers: memory plan, creation (device memory mapped by every peer
 * through CUDA IPC, a host-mapped control block, a pool for handles), destruction,
 * aborting peers, the layout operation, the combine-input region, and the vtable.
 *
 * On one node (ranks_per_node == world_size: one node's NVLink GPUs, or processes
 * sharing a GPU under MPS) normal mode runs over CUDA IPC. Across nodes the same layout
 * lives in NVSHMEM symmetric memory and the internode kernels run (internode.c).
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/ll.h"

#define EPX_CUDA_REGION_ALIGN 256

static int64_t align_up(int64_t value, int64_t alignment)
{
    return (value + alignment - 1) / alignment * alignment;
}

int epx__cuda_device_count(void)
{
    int count = 0;
    /* No driver, no device, a driver too old: all mean "no GPU" here, never a failure. */
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return count;
}

int epx__cuda_alignment(const void *data, int64_t pitch_bytes)
{
    uint64_t bits = (uint64_t)(uintptr_t)data | (uint64_t)pitch_bytes | 16u;
    return (int)(bits & (~bits + 1u));
}

int epx__cuda_blocks_for(const epx__cuda_buffer_t *cuda, int64_t tokens)
{
    const int64_t warps = EPX_CUDA_THREADS / 32;
    int64_t wanted = (tokens + warps - 1) / warps;
    if (wanted > cuda->num_sms)
        wanted = cuda->num_sms;
    return wanted < 1 ? 1 : (int)wanted;
}

int epx__cuda_num_nodes(epx_group_t group)
{
    if (group->ranks_per_node <= 0)
        return 1;
    return group->world_size / group->ranks_per_node;
}

epx_status_t epx__cuda_plan(epx_group_t group, const epx_buffer_config_t *config,
                            epx__cuda_shape_t *s, size_t *handle_slot_bytes)
{
    int R = group->world_size;
    if (R > EPX_CUDA_MAX_RANKS)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer: the CUDA backend's normal mode takes at most %d ranks, the "
                         "group has %d",
                         EPX_CUDA_MAX_RANKS, R);
    if (config->num_experts > EPX_CUDA_MAX_EXPERTS)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer: the CUDA backend takes at most %d experts, config has %d",
                         EPX_CUDA_MAX_EXPERTS, config->num_experts);
    memset(s, 0, sizeof(*s));
    s->rank = group->rank;
    s->world_size = R;
    s->num_experts = config->num_experts;
    s->num_local_experts = config->num_experts / R;
    s->num_topk = config->num_topk;
    s->hidden = config->hidden;
    s->max_recv = config->max_tokens_per_rank * R;
    s->timeout_ns = group->timeout_ms * 1000000;
    s->ranks_per_node = group->ranks_per_node > 0 ? group->ranks_per_node : R;
    s->num_nodes = R / s->ranks_per_node;
    s->max_tokens = config->max_tokens_per_rank;

    int64_t L = s->num_local_experts, K = s->num_topk, rows = s->max_recv;
    int64_t off = sizeof(epx__cuda_ctrl_t);
    s->off_slots = off;
    off += (int64_t)R * (int64_t)sizeof(epx__cuda_slot_t);
    s->off_rank_counts = off = align_up(off, EPX_CUDA_REGION_ALIGN);
    off += 2 * (int64_t)R * R * 4;
    s->off_expert_counts = off = align_up(off, EPX_CUDA_REGION_ALIGN);
    off += 2 * (int64_t)R * L * 4;
    /* Rows are sized for bf16 whatever the dispatch dtype: combine's input is bf16. */
    s->x_pitch_max = s->hidden * 2;
    s->off_x = off = align_up(off, EPX_CUDA_REGION_ALIGN);
    off += rows * s->x_pitch_max;
    s->off_scales = -1;
    if (s->hidden % EPX__FP8_BLOCK == 0) {
        s->off_scales = off = align_up(off, EPX_CUDA_REGION_ALIGN);
        off += rows * (s->hidden / EPX__FP8_BLOCK) * 4;
    }
    s->off_topk_idx = off = align_up(off, EPX_CUDA_REGION_ALIGN);
    off += rows * K * 8;
    s->off_topk_weights = off = align_up(off, EPX_CUDA_REGION_ALIGN);
    off += rows * K * 4;
    s->off_combine_weights = off = align_up(off, EPX_CUDA_REGION_ALIGN);
    off += rows * K * 4;
    /* Combine's zero-copy input (epx_get_combine_input): bf16 rows apart from the
     * receive region, so the experts can read recv_x (bf16 or fp8) while they write
     * their outputs here. No operation writes it, so what the caller wrote survives
     * later dispatches until it writes again. */
    s->off_combine_input = off = align_up(off, EPX_CUDA_REGION_ALIGN);
    off += rows * s->hidden * 2;
    s->shared_bytes = align_up(off, 1 << 21);

    /* A handle's device slot: send_row [T][R], recv_count, recv_per_expert [L],
     * rank_prefix [R][R] (dispatch.c state_create). */
    int64_t slot = align_up(config->max_tokens_per_rank * R * 4, EPX_CUDA_REGION_ALIGN);
    slot += EPX_CUDA_REGION_ALIGN + align_up(L * 4, EPX_CUDA_REGION_ALIGN);
    slot += align_up((int64_t)R * R * 4, EPX_CUDA_REGION_ALIGN);
    *handle_slot_bytes = (size_t)slot;
    if (s->num_nodes > 1)
        return epx__cuda_xn_plan(group, config, s, handle_slot_bytes);
    return EPX_SUCCESS;
}

static epx_status_t cuda_buffer_size(epx_group_t group, const epx_buffer_config_t *config,
                                     size_t *bytes)
{
    /* Every buffer has normal mode (over CUDA IPC on one node, internode across). */
    epx__cuda_shape_t shape;
    size_t slot = 0;
    EPX_CHECK(epx__cuda_plan(group, config, &shape, &slot));
    epx_ll_shape_t ll_shape;
    size_t ll_sym = 0, ll_local = 0;
    EPX_CHECK(epx__cuda_ll_plan(group, config, &ll_shape, &ll_sym, &ll_local));
    *bytes = (size_t)shape.shared_bytes + sizeof(epx__cuda_local_t) + ll_sym + ll_local;
    return EPX_SUCCESS;
}

static void release_buffer(epx__cuda_buffer_t *cuda)
{
    if (cuda == NULL)
        return;
    if (cuda->abort_stream != NULL)
        (void)cudaStreamDestroy(cuda->abort_stream);
    if (cuda->abort_word != NULL)
        (void)cudaFreeHost(cuda->abort_word);
    if (cuda->mapped != NULL)
        (void)cudaFreeHost(cuda->mapped);
    if (cuda->local != NULL)
        (void)cudaFree(cuda->local);
    epx__cuda_trace_release(cuda, 0);
    epx__cuda_release_ranges(cuda);
    epx__cuda_ipc_destroy(cuda->ipc);
    epx__cuda_xn_destroy(cuda, 0);
    if (cuda->pool != NULL)
        epx__cuda_pool_release(cuda->pool);
    /* Still set only when creation failed after it (leaks the symmetric part: freeing
     * it is collective and the peers may have given up). */
    epx__cuda_ll_destroy(cuda->ll, 0);
    (void)cudaGetLastError();
    free(cuda);
}

/* Local resources besides the shared region: device state, mapped block, abort path. */
static epx_status_t create_local(epx_buffer_t buffer, epx__cuda_buffer_t *cuda)
{
    epx__cuda_shape_t *s = &cuda->shape;
    int R = s->world_size;
    EPX_CUDA_CHECK(cudaMalloc((void **)&cuda->local, sizeof(epx__cuda_local_t)),
                   "buffer_create: cudaMalloc of the device state");
    epx__cuda_local_t *init = calloc(1, sizeof(*init));
    if (init == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    for (int r = 0; r < R; r++)
        init->peers[r] = cuda->peer_bases[r];
    init->scan_first_bad = ~0ull;
    cudaError_t copied = cudaMemcpy(cuda->local, init, sizeof(*init), cudaMemcpyHostToDevice);
    free(init);
    EPX_CUDA_CHECK(copied, "buffer_create: initialising the device state");

    size_t mapped_bytes = sizeof(epx__cuda_mapped_t) +
                          ((size_t)R * R + (size_t)s->num_local_experts) * sizeof(int32_t);
    EPX_CUDA_CHECK(cudaHostAlloc((void **)&cuda->mapped, mapped_bytes, cudaHostAllocMapped),
                   "buffer_create: cudaHostAlloc of %zu bytes (mapped control block)",
                   mapped_bytes);
    memset(cuda->mapped, 0, mapped_bytes);
    cuda->mapped_rank_counts = (int32_t *)(cuda->mapped + 1);
    cuda->mapped_recv_per_expert = cuda->mapped_rank_counts + (size_t)R * R;
    void *device_view = NULL;
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(&device_view, cuda->mapped, 0),
                   "buffer_create: device address of the mapped control block");
    s->local = cuda->local;
    s->mapped = device_view;
    s->mapped_rank_counts = (int32_t *)(s->mapped + 1);
    s->mapped_recv_per_expert = s->mapped_rank_counts + (size_t)R * R;

    EPX_CUDA_CHECK(cudaHostAlloc((void **)&cuda->abort_word, sizeof(uint64_t), cudaHostAllocDefault),
                   "buffer_create: cudaHostAlloc of the abort word");
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&cuda->abort_stream, cudaStreamNonBlocking),
                   "buffer_create: creating the abort stream");
    /* A few handles up front: growing the pool is not allowed during graph capture. */
    EPX_CHECK(epx__cuda_pool_create(buffer->group->device, cuda->handle_slot_bytes, 4,
                                    &cuda->pool));
    EPX_CHECK(epx__cuda_trace_create(cuda));
    EPX_CUDA_CHECK(cudaDeviceSynchronize(), "buffer_create: initialising device memory");
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_vote(epx_group_t group, epx_status_t status, const char *op,
                            const char *what)
{
    int32_t mine = 0;
    int32_t *all = calloc((size_t)group->world_size, sizeof(int32_t));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "%s: out of host memory", op);
    status = epx__bootstrap_vote(group->bootstrap, group->world_size, status, &mine, all,
                                 sizeof(mine), op, what);
    free(all);
    return status;
}

void epx__cuda_gpu_share(const epx__cuda_gpu_vote_t *votes, int world_size, int rank,
                         int *ranks, int *first, int64_t *sms)
{
    static const uint8_t unknown[16] = {0};
    const uint8_t *mine = votes[rank].uuid;
    int known = memcmp(mine, unknown, sizeof(unknown)) != 0;
    *ranks = 0;
    *first = rank;
    *sms = 0;
    for (int r = 0; r < world_size; r++) {
        if (r != rank && (!known || memcmp(votes[r].uuid, mine, sizeof(unknown)) != 0))
            continue;
        if (*ranks == 0)
            *first = r;
        *ranks += 1;
        *sms += votes[r].num_sms;
    }
}

/*
 * buffer_create's last vote (every rank's status), which also carries each rank's GPU
 * and SM budget: the lowest of the ranks sharing a GPU warns when their budgets add up
 * to more SMs than it has.
 */
static epx_status_t vote_created(epx_group_t group, const epx__cuda_buffer_t *cuda,
                                 epx_status_t status)
{
    int world = group->world_size;
    epx__cuda_gpu_vote_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.num_sms = cuda->num_sms;
    struct cudaDeviceProp prop;
    int gpu_sms = 0;
    if (status == EPX_SUCCESS && cudaGetDeviceProperties(&prop, group->device) == cudaSuccess) {
        memcpy(mine.uuid, prop.uuid.bytes, sizeof(mine.uuid));
        gpu_sms = prop.multiProcessorCount;
    }
    (void)cudaGetLastError();
    epx__cuda_gpu_vote_t *all = calloc((size_t)world, sizeof(*all));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    status = epx__bootstrap_vote(group->bootstrap, world, status, &mine, all, sizeof(mine),
                                 "buffer_create", "failed");
    int ranks = 0, first = 0;
    int64_t sms = 0;
    if (status == EPX_SUCCESS)
        epx__cuda_gpu_share(all, world, group->rank, &ranks, &first, &sms);
    free(all);
    if (ranks > 1 && gpu_sms > 0 && sms > gpu_sms && group->rank == first)
        EPX_WARN(EPX_SUBSYS_OPS,
                 "buffer_create: %d ranks share this GPU (device %d, %d SMs) and their "
                 "buffers' SM budgets add up to %lld SMs: a rank's kernels may find no free "
                 "SM while its peers' kernels wait for it (low-latency receives: every "
                 "block waits), and operations then fail on their timeout; keep the ranks' "
                 "num_sms (EPX_NUM_SMS, --sms) at %d or fewer each",
                 ranks, group->device, gpu_sms, (long long)sms, gpu_sms / ranks);
    return status;
}

static epx_status_t cuda_buffer_create(epx_buffer_t buffer)
{
    epx_group_t group = buffer->group;
    epx__cuda_buffer_t *cuda = calloc(1, sizeof(*cuda));
    if (cuda == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    cuda->num_sms = buffer->config.num_sms;
    cuda->autoreg.on = buffer->config.auto_register > 0;
    cuda->kernels = (int)epx__param_int(EPX_PARAM_NORMAL_KERNELS);
    /* Every rank runs the same checks on the same config and group (the group's ranks
     * agreed on ranks_per_node), so all fail alike here and all take the same path. */
    epx_status_t status =
        epx__cuda_plan(group, &buffer->config, &cuda->shape, &cuda->handle_slot_bytes);
    if (status != EPX_SUCCESS) {
        free(cuda);
        return status;
    }
    cudaError_t err = cudaSetDevice(group->device);
    if (err != cudaSuccess)
        status = EPX_CUDA_ERROR(err, "buffer_create: cudaSetDevice(%d)", group->device);
    if (cuda->shape.num_nodes > 1) {
        /* Collective (NVSHMEM set-up votes): a local failure above is carried into it. */
        status = epx__cuda_xn_create(buffer, cuda, status);
        if (status == EPX_SUCCESS)
            status = create_local(buffer, cuda);
    } else {
        /* Collective: a local failure above is carried into the IPC step's vote. */
        epx__transport_ranks_t ranks = epx__group_ranks(group);
        status = epx__cuda_ipc_create(&ranks, (size_t)cuda->shape.shared_bytes, status,
                                      &cuda->ipc);
        if (status == EPX_SUCCESS) {
            cuda->shared = cuda->ipc->local;
            cuda->peer_bases = cuda->ipc->peers;
            status = create_local(buffer, cuda);
        }
    }
    /* Low-latency mode (collective as well; a failure above joins its votes). */
    status = epx__cuda_ll_create(buffer, status, &cuda->ll);
    /* Everyone learns whether everyone is ready before any rank starts an operation. */
    status = vote_created(group, cuda, status);
    if (status != EPX_SUCCESS) {
        release_buffer(cuda);
        return status;
    }
    buffer->impl = cuda;
    if (cuda->autoreg.on) {
        status = epx__cuda_auto_create(buffer);
        if (status != EPX_SUCCESS) {
            buffer->impl = NULL;
            release_buffer(cuda);
            return status;
        }
    }
    if (cuda->ipc != NULL)
        EPX_INFO(EPX_SUBSYS_TRANSPORT,
                 "cuda buffer: device %d, %.1f MB shared per rank, %d peers mapped by CUDA IPC",
                 group->device, (double)cuda->shape.shared_bytes / 1e6, group->world_size - 1);
    else
        EPX_INFO(EPX_SUBSYS_TRANSPORT,
                 "cuda buffer: device %d, internode normal mode: %d nodes of %d ranks, %.1f MB "
                 "of NVSHMEM symmetric memory per rank (stores inside a node, puts across); "
                 "%s%lld tokens per channel%s",
                 group->device, epx__cuda_num_nodes(group), group->ranks_per_node,
                 (double)cuda->shape.shared_bytes / 1e6,
                 cuda->shape.xn_ring > 0 ? "rings of " : "worst-case slots, ",
                 (long long)(cuda->shape.xn_ring > 0 ? cuda->shape.xn_ring
                                                     : cuda->shape.max_tokens),
                 cuda->shape.xn_ring > 0 ? " with credits (EPX_XN_RING_TOKENS)" : "");
    return EPX_SUCCESS;
}

/* The combine-input region: peers read an x that lies there in place (combine.c). */
static epx_status_t cuda_combine_input(epx_buffer_t buffer, void **base, int64_t *rows)
{
    const epx__cuda_buffer_t *cuda = buffer->impl;
    *base = cuda->shared + cuda->shape.off_combine_input;
    *rows = cuda->shape.max_recv;
    return EPX_SUCCESS;
}

/*
 * Before the destroy's vote (src/epx.c): let this rank's queued operations finish (a
 * peer may still be reading this rank's memory: combine pulls), record any failure the
 * device saw, and say whether this rank can take part in freeing the NVSHMEM memory,
 * which is collective: only when no peer is masked (a masked rank may be gone; then the
 * memory stays until the process exits).
 */
static int cuda_destroy_ready(epx_buffer_t buffer)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    if (cuda == NULL)
        return 0;
    (void)cudaSetDevice(buffer->group->device);
    (void)cudaDeviceSynchronize();
    if (epx__cuda_note_failure(buffer))
        return 0;
    if (cuda->ll == NULL)
        return 1;
    int R = buffer->group->world_size;
    int32_t *mask = calloc((size_t)R, sizeof(int32_t));
    if (mask == NULL)
        return 0;
    epx__cuda_ll_poll(buffer);
    /* A bad expert id (EPX_ERR_INVALID_ARG) loses no peer; a lost peer is also masked. */
    int peer_error = atomic_load(&buffer->ll_peer_error);
    int ready = peer_error == EPX_SUCCESS || peer_error == EPX_ERR_INVALID_ARG;
    epx__cuda_ll_get_masked(buffer, mask);
    for (int r = 0; r < R; r++)
        ready = ready && !mask[r];
    free(mask);
    return ready;
}

/* Parts a buffer does not have (no normal mode across nodes, no low-latency mode) are
 * NULL and skipped. */
static void cuda_buffer_destroy(epx_buffer_t buffer, int all_ready)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    if (cuda == NULL)
        return;
    (void)cudaSetDevice(buffer->group->device);
    epx__cuda_trace_release(cuda, all_ready);
    epx__cuda_ll_destroy(cuda->ll, all_ready);
    cuda->ll = NULL;
    /* After the low-latency part: symmetric frees happen in the same order everywhere. */
    epx__cuda_xn_destroy(cuda, all_ready);
    release_buffer(cuda);
    buffer->impl = NULL;
}

static void cuda_abort(epx_buffer_t buffer, epx_status_t status, const char *message)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    /* Peers waiting in a combine's exchange of inputs mapped on demand stop too. */
    if (cuda != NULL && cuda->autoreg.shm != NULL)
        epx__shm_abort(cuda->autoreg.shm, status, message);
    /* The abort word lives in the peers' normal-mode memory, written directly where it
     * is mapped (this node), and put through NVSHMEM to the ranks of other nodes (their
     * allocation is symmetric then). */
    if (cuda == NULL || cuda->peer_bases == NULL)
        return;
    int me = buffer->group->rank;
    int recorded = epx__cuda_note_failure(buffer); /* a failure the device recorded */
    int culprit = recorded && cuda->error_culprit >= 0 ? cuda->error_culprit : me;
    int timed_out = status == EPX_ERR_TIMEOUT ||
                    (recorded && cuda->error_status == EPX_ERR_TIMEOUT);
    int code = timed_out ? 1 : 2;
    *cuda->abort_word = EPX_CUDA_ABORT_PACK(code, EPX_CUDA_STAGE_NONE, me, culprit);
    /* Through a non-blocking stream: the user's stream may hold kernels that spin. */
    for (int r = 0; r < buffer->group->world_size; r++)
        if (r != me && cuda->peer_bases[r] != NULL)
            (void)cudaMemcpyAsync(cuda->peer_bases[r], cuda->abort_word, sizeof(uint64_t),
                                  cudaMemcpyHostToDevice, cuda->abort_stream);
    /* A failure the device recorded was put to the other nodes by note_failure (or came
     * from a peer, who did); never to a rank that timed out: it may be gone. */
    if (!recorded)
        epx__cuda_xn_tell(cuda, timed_out ? culprit : -1, cuda->abort_stream);
    int64_t deadline = epx__now_ns() + 1000000000ll;
    while (cudaStreamQuery(cuda->abort_stream) == cudaErrorNotReady && epx__now_ns() < deadline)
        sched_yield();
    (void)cudaGetLastError();
}

static epx_status_t cuda_layout(epx_buffer_t buffer, const epx_layout_args_t *args, void *stream)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    cudaStream_t st = (cudaStream_t)stream;
    /* Local, but it reports bad expert ids through the normal-mode error record, and
     * only normal mode's dispatch uses its counts. */
    EPX_CHECK(epx__cuda_poll(buffer));
    epx__cuda_layout_args_t a;
    memset(&a, 0, sizeof(a));
    a.topk_idx = args->topk_idx.data;
    a.topk_stride = epx__tensor_row_stride(&args->topk_idx);
    a.num_tokens = args->topk_idx.shape[0];
    a.num_tokens_per_rank = args->num_tokens_per_rank.data;
    a.num_tokens_per_expert = args->num_tokens_per_expert.data;
    if (epx__tensor_given(&args->is_token_in_rank)) {
        a.is_token_in_rank = args->is_token_in_rank.data;
        a.in_rank_stride = epx__tensor_row_stride(&args->is_token_in_rank);
    }
    EPX_CUDA_CHECK(cudaMemsetAsync(a.num_tokens_per_rank, 0,
                                   (size_t)buffer->group->world_size * sizeof(int32_t), st),
                   "get_dispatch_layout: zeroing num_tokens_per_rank");
    EPX_CUDA_CHECK(cudaMemsetAsync(a.num_tokens_per_expert, 0,
                                   (size_t)buffer->config.num_experts * sizeof(int32_t), st),
                   "get_dispatch_layout: zeroing num_tokens_per_expert");
    EPX_CUDA_CHECK(epx__cuda_launch_layout(&cuda->shape, &a, cuda->num_sms, st),
                   "get_dispatch_layout: launching the layout kernel");
    return EPX_SUCCESS;
}

/* A device failure (seen after CUDA graph replays, say) becomes the async error. */
static void cuda_poll_async_error(epx_buffer_t buffer)
{
    if (buffer->impl != NULL) {
        (void)epx__cuda_note_failure(buffer);
        epx__cuda_ll_poll(buffer);
    }
}

/*
 * No rejoin on this backend: low-latency memory is NVSHMEM's symmetric heap, set up by
 * every PE of the job together, and NVSHMEM cannot add a PE to a running job (nor give a
 * new process the place of one that left). docs/STABILITY.md has the workaround.
 */
static epx_status_t cuda_ll_rejoin_check(epx_group_t group)
{
    (void)group;
    return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                     "rejoin: the cuda backend cannot take a rank back into a running "
                     "low-latency buffer: its memory is NVSHMEM's symmetric heap, and NVSHMEM "
                     "cannot add a PE to a running job; keep serving with the rank masked and "
                     "rebuild the buffers and the group at a quiet moment (docs/STABILITY.md)");
}

const epx__backend_ops_t epx__cuda_backend = {
    .name = "cuda",
    .device_count = epx__cuda_device_count,
    .group_destroy = epx__cuda_ll_group_destroy,
    .destroy_ready = cuda_destroy_ready,
    .buffer_size = cuda_buffer_size,
    .internode_plan = epx__cuda_xn_describe,
    .buffer_create = cuda_buffer_create,
    .buffer_destroy = cuda_buffer_destroy,
    .abort = cuda_abort,
    .layout = cuda_layout,
    .dispatch = epx__cuda_dispatch,
    .combine = epx__cuda_combine,
    .combine_input = cuda_combine_input,
    .register_range = epx__cuda_register_range,
    .unregister_range = epx__cuda_unregister_range,
    .poll_async_error = cuda_poll_async_error,
    .ll_dispatch = epx__cuda_ll_dispatch,
    .ll_dispatch_receive = epx__cuda_ll_dispatch_receive,
    .ll_combine = epx__cuda_ll_combine,
    .ll_combine_receive = epx__cuda_ll_combine_receive,
    .ll_combine_buffer = epx__cuda_ll_combine_buffer,
    .ll_mask_rank = epx__cuda_ll_mask_rank,
    .ll_get_masked = epx__cuda_ll_get_masked,
    .ll_row_align = EPX__VECTOR_BYTES,
    .ll_check_wait_stats = epx__cuda_ll_check_wait_stats,
    .fanout_copy = epx__cuda_fanout_copy,
    .fanin_reduce = epx__cuda_fanin_reduce,
    .ll_rejoin_check = cuda_ll_rejoin_check,
};
