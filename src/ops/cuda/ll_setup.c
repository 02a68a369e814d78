/*
 * Low-latency mode of the CUDA backend: the memory plan, and creating / destroying a
 * buffer's low-latency part. NVSHMEM itself (the plugin library, its process-wide set-up
 * and finalisation, symmetric memory, peer pointers) is the transport's
 * (src/transport/nvshmem/nvshmem.h); this file finds the kernels in the same plugin.
 * NVSHMEM cannot be set up twice in a process, so low-latency CUDA buffers end with the
 * group that set it up.
 */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/ll.h"
#include "transport/cuda_status.h"
#include "transport/nvshmem/nvshmem.h"

#define EPX_LL_ALIGN 256

static size_t align_up(size_t value)
{
    return (value + EPX_LL_ALIGN - 1) / EPX_LL_ALIGN * EPX_LL_ALIGN;
}

/* Reserve `bytes` at *offset (aligned); returns where they start. */
static size_t take(size_t *offset, size_t bytes)
{
    size_t at = *offset;
    *offset = align_up(at + bytes);
    return at;
}

/*
 * The device state after the two result slots (offsets from its start): seq [2][2],
 * released [2] and combined [2] uint64, arrive [2][4] uint32, mask [R + 2] int32 (the
 * last two words claim the failure record's timeout and bad-id parts), the peer table [R]
 * pointers, then (kernels 2; always laid out) arrived and combine_arrived [2][R] uint64.
 */
typedef struct {
    size_t released, combined, arrive, mask, peers, arrived, combine_arrived, bytes;
} state_layout_t;

static state_layout_t state_layout(int world)
{
    state_layout_t l;
    l.released = 4 * sizeof(uint64_t);
    l.combined = l.released + 2 * sizeof(uint64_t);
    l.arrive = l.combined + 2 * sizeof(uint64_t);
    l.mask = l.arrive + 8 * sizeof(uint32_t);
    l.peers = l.mask + (((size_t)world + 2) * sizeof(int32_t) + 7) / 8 * 8;
    l.arrived = l.peers + (size_t)world * sizeof(char *);
    l.combine_arrived = l.arrived + 2 * (size_t)world * sizeof(uint64_t);
    l.bytes = l.combine_arrived + 2 * (size_t)world * sizeof(uint64_t);
    return l;
}

/* Kernels 2 for this config when EPX_LL_KERNELS asks for them and they serve its shape. */
static int choose_kernels(const epx_buffer_config_t *config, int world)
{
    if (epx__param_int(EPX_PARAM_LL_KERNELS) != 2)
        return 1;
    if (config->num_topk > EPX_LL2_MAX_TOPK ||
        epx_ll2_dispatch_smem(config->num_experts, config->num_topk, world, EPX_LL_RUN_SEND) >
            47 * 1024) /* 48 KB without opt-in, less the kernel's static shared memory */
        return 1;
    return 2;
}

epx_status_t epx__cuda_ll_plan(epx_group_t group, const epx_buffer_config_t *config,
                               epx_ll_shape_t *s, size_t *sym_bytes, size_t *local_bytes)
{
    memset(s, 0, sizeof(*s));
    *sym_bytes = *local_bytes = 0;
    int64_t m = config->max_low_latency_tokens;
    if (m <= 0)
        return EPX_SUCCESS;
    int R = group->world_size;
    if (config->hidden % (EPX__VECTOR_BYTES / 2) != 0) /* bf16 rows in whole vectors */
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer: low-latency mode on the CUDA backend moves 16-byte vectors, so "
                         "hidden must be a multiple of 8 (config has %lld)",
                         (long long)config->hidden);
    /* The kernels' shared memory, the send's with its routing cache full. */
    size_t send_smem = epx_ll_send_smem(config->num_experts, config->num_topk, R, 0) +
                       EPX_LL_CACHED_ENTRIES * 8;
    size_t recv_smem = epx_ll_recv_smem(config->num_experts / R, R);
    size_t smem = send_smem > recv_smem ? send_smem : recv_smem;
    if (smem > 48 * 1024)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer: low-latency mode on the CUDA backend takes at most about 2000 "
                         "experts (config has %d experts, %d ranks)",
                         config->num_experts, R);
    s->rank = group->rank;
    s->world = R;
    s->num_experts = config->num_experts;
    s->num_local = config->num_experts / R;
    s->topk = config->num_topk;
    s->blocks = config->num_sms;
    s->hidden = config->hidden;
    s->max_tokens = m;
    s->rows = m * R;
    s->scale_cols = config->hidden % EPX__FP8_BLOCK == 0 ? config->hidden / EPX__FP8_BLOCK : 0;
    s->timeout_ns = group->timeout_ms * 1000000;
    s->x_row_bytes = (size_t)config->hidden * (config->low_latency_dtype == EPX_DTYPE_FP8_E4M3 ? 1 : 2);
    /* Puts (and their staging memory) only where some peer may lack a direct pointer. */
    s->may_put = group->ranks_per_node < R || epx__param_int(EPX_PARAM_LL_FORCE_PUTS) != 0;

    s->kernels = choose_kernels(config, R);
    s->release = s->kernels == 2 ? (int)epx__param_int(EPX_PARAM_LL_RELEASE) : 1;

    size_t L = (size_t)s->num_local, rows = (size_t)s->rows, S = (size_t)s->scale_cols;
    size_t cells = L * (size_t)R * (size_t)m, k = (size_t)s->topk, H = (size_t)s->hidden;
    size_t E = (size_t)s->num_experts;
    size_t puts = s->may_put ? 1 : 0;
    /* What only one generation of kernels uses (the other's regions are empty). */
    size_t one = s->kernels == 1 ? 1 : 0, two = 1 - one;
    /* Symmetric: flags, then two slots with the same inner offsets. */
    size_t sym = 0;
    s->flags = take(&sym, 4 * 2 * (size_t)R * sizeof(uint64_t));
    size_t in_slot = 0;
    s->sent_count = take(&in_slot, one * L * (size_t)R * sizeof(int32_t));
    s->recv_x = take(&in_slot, cells * s->x_row_bytes);
    s->recv_scales = take(&in_slot, cells * S * sizeof(float));
    s->recv_src_info = take(&in_slot, cells * sizeof(int32_t));
    s->recv_topk = take(&in_slot, cells * sizeof(int32_t));
    s->recv_range = take(&in_slot, L * (size_t)R * sizeof(int64_t));
    s->combine_in = take(&in_slot, L * rows * H * 2);
    s->combine_stage = take(&in_slot, puts * (size_t)m * k * H * 2);
    s->send_x = take(&in_slot, one * puts * (size_t)m * s->x_row_bytes);
    s->send_scales = take(&in_slot, one * puts * (size_t)m * S * sizeof(float));
    s->counts = take(&in_slot, two * (size_t)R * (E + 1) * sizeof(uint64_t));
    s->arrival = take(&in_slot, two * (size_t)R * sizeof(uint64_t));
    s->combine_arrival = take(&in_slot, two * (size_t)R * sizeof(uint64_t));
    s->count_stage = take(&in_slot, two * puts * (size_t)R * (E + 1) * sizeof(uint64_t));
    s->put_x = take(&in_slot, two * puts * (size_t)m * k * s->x_row_bytes);
    s->put_scales = take(&in_slot, two * puts * (size_t)m * k * S * sizeof(float));
    s->put_src = take(&in_slot, two * puts * (size_t)m * k * sizeof(int32_t));
    s->put_topk = take(&in_slot, two * puts * (size_t)m * k * sizeof(int32_t));
    s->slot[0] = take(&sym, in_slot);
    s->slot[1] = take(&sym, in_slot);
    /* Local: two slots of bookkeeping, then the state. */
    size_t local_slot = 0;
    s->recv_count = take(&local_slot, L * sizeof(int32_t));
    s->recv_src_rank = take(&local_slot, L * rows * sizeof(int32_t));
    s->send_pos = take(&local_slot, (size_t)m * k * sizeof(int32_t));
    s->sent_rows = take(&local_slot, two * (size_t)R * sizeof(int32_t));
    s->local_slot_bytes = local_slot;
    *sym_bytes = sym;
    *local_bytes = align_up(2 * local_slot + state_layout(R).bytes);
    return EPX_SUCCESS;
}

/* The kernels' table in the plugin the transport loaded. */
static epx_status_t find_kernels(const epx_ll_plugin_t **plugin)
{
    epx_ll_plugin_entry_t entry;
    *(void **)(&entry) = epx__nvshmem_symbol(EPX_LL_PLUGIN_SYMBOL);
    const epx_ll_plugin_t *table = entry != NULL ? entry() : NULL;
    if (table == NULL || table->abi != EPX_LL_PLUGIN_ABI)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer_create: the NVSHMEM plugin has no low-latency kernels of ABI %d "
                         "(rebuild it with this epx)",
                         EPX_LL_PLUGIN_ABI);
    *plugin = table;
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_nvshmem_setup(epx_group_t group, size_t sym_bytes, epx_status_t status,
                                     const epx_ll_plugin_t **plugin)
{
    *plugin = NULL;
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    status = epx__nvshmem_setup(&ranks, group, sym_bytes, status);
    if (status == EPX_SUCCESS)
        status = find_kernels(plugin);
    /* The caller's next step (nvshmem_malloc) is collective: a rank whose plugin lacks
     * the kernels must not leave its peers waiting there, so all learn it first. */
    status = epx__cuda_vote(group, status, "buffer_create", "could not set up NVSHMEM");
    if (status == EPX_SUCCESS)
        epx__nvshmem_user_begin();
    return status;
}

void epx__cuda_nvshmem_release(int healthy)
{
    epx__nvshmem_user_end(healthy);
}

/* Kernels 2: the combine receive's loads (EPX_LL_COMBINE_RECV), its copy stages and its
 * shared memory (the plugin's prepare). */
static epx_status_t prepare_kernels2(epx__cuda_ll_t *ll)
{
    epx_ll_shape_t *s = &ll->shape;
    s->combine_recv = (int)epx__param_int(EPX_PARAM_LL_COMBINE_RECV);
    int err = ll->plugin->prepare(s);
    if (err != cudaSuccess)
        return EPX_CUDA_ERROR((cudaError_t)err,
                              "buffer_create: low-latency kernels 2: shared memory for the "
                              "combine (%d experts, top-%d, %d ranks)",
                              s->num_experts, s->topk, s->world);
    return EPX_SUCCESS;
}

/* The phase trace when EPX_LL_TRACE names a file prefix (kernels 2 only). */
static epx_status_t create_trace(epx__cuda_ll_t *ll)
{
    epx_ll_shape_t *s = &ll->shape;
    if (s->kernels != 2 || epx__param_string(EPX_PARAM_LL_TRACE)[0] == '\0')
        return EPX_SUCCESS;
    size_t bytes = epx_ll_trace_words(s->blocks) * sizeof(uint64_t);
    EPX_CUDA_CHECK(cudaMalloc((void **)&ll->trace, bytes),
                   "buffer_create: cudaMalloc of %zu bytes (EPX_LL_TRACE)", bytes);
    EPX_CUDA_CHECK(cudaMemset(ll->trace, 0, bytes), "buffer_create: zeroing the trace");
    s->trace = ll->trace;
    return EPX_SUCCESS;
}

/*
 * Write the trace to <EPX_LL_TRACE>.<rank>: a header of 8 int64 (magic "EPXLLTR3" as
 * bytes, rank, world, blocks, calls, events, kernels, 0), then the trace's words
 * (ll_plugin.h). Best effort: a failure is logged, never an error.
 */
static void write_trace(const epx__cuda_ll_t *ll)
{
    const epx_ll_shape_t *s = &ll->shape;
    const int64_t fields[7] = {s->rank, s->world, s->blocks, EPX_LL_TRACE_CALLS,
                               EPX_LL_TRACE_EVENTS, s->kernels, 0};
    epx__cuda_trace_write("EPX_LL_TRACE", epx__param_string(EPX_PARAM_LL_TRACE), s->rank,
                          "EPXLLTR3", fields, ll->trace, epx_ll_trace_words(s->blocks));
}

/* Device memory, the peer table and the failure record; zeroes everything. */
static epx_status_t create_memory(epx_buffer_t buffer, epx__cuda_ll_t *ll)
{
    epx_ll_shape_t *s = &ll->shape;
    int R = s->world;
    EPX_CUDA_CHECK(cudaMalloc((void **)&ll->local, ll->local_bytes),
                   "buffer_create: cudaMalloc of %zu bytes (low-latency results)", ll->local_bytes);
    EPX_CUDA_CHECK(cudaMemset(ll->local, 0, ll->local_bytes), "buffer_create: zeroing memory");
    EPX_CUDA_CHECK(cudaMemset(ll->sym, 0, ll->sym_bytes), "buffer_create: zeroing the heap");
    EPX_CUDA_CHECK(cudaHostAlloc((void **)&ll->fail, sizeof(epx_ll_fail_t), cudaHostAllocMapped),
                   "buffer_create: cudaHostAlloc of the failure record");
    memset(ll->fail, 0, sizeof(*ll->fail));
    void *fail_device = NULL;
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(&fail_device, ll->fail, 0),
                   "buffer_create: device address of the failure record");

    /* Slot results come first (plan order), the state after them. */
    size_t per_slot = s->local_slot_bytes;
    s->local[0] = ll->local;
    s->local[1] = ll->local + per_slot;
    char *state = ll->local + 2 * per_slot;
    state_layout_t layout = state_layout(R);
    s->seq = (uint64_t *)state;
    s->released = (uint64_t *)(state + layout.released);
    s->combined = (uint64_t *)(state + layout.combined);
    s->arrive = (uint32_t *)(state + layout.arrive);
    s->mask = (int32_t *)(state + layout.mask);
    s->arrived = (uint64_t *)(state + layout.arrived);
    s->combine_arrived = (uint64_t *)(state + layout.combine_arrived);
    char **peer_table = (char **)(state + layout.peers);
    s->peer = (char *const *)peer_table;
    s->sym = ll->sym;
    s->fail = fail_device;

    int force_puts = (int)epx__param_int(EPX_PARAM_LL_FORCE_PUTS);
    char **peers = calloc((size_t)R, sizeof(char *));
    if (peers == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    int direct = 0, unreachable = -1;
    int per_node = buffer->group->ranks_per_node > 0 ? buffer->group->ranks_per_node : R;
    for (int r = 0; r < R; r++) {
        peers[r] = epx__nvshmem_peer(ll->sym, r);
        /* Ranks of other nodes only through NVSHMEM puts, even where NVSHMEM could map
         * them (virtual nodes on one machine): the path a real network takes. */
        if ((force_puts && r != s->rank) || r / per_node != s->rank / per_node)
            peers[r] = NULL;
        if (peers[r] == NULL) {
            s->use_puts = 1;
            unreachable = r;
        } else {
            direct++;
        }
    }
    if (s->use_puts && !s->may_put) {
        free(peers);
        /* The group says one node, but NVSHMEM cannot map this peer (no P2P path). */
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer_create: low-latency mode: NVSHMEM gives no direct pointer to "
                         "rank %d although the group puts all ranks on one node; set "
                         "EPX_LL_FORCE_PUTS=1 (NVSHMEM puts to every peer) or EPX_RANKS_PER_NODE",
                         unreachable);
    }
    cudaError_t err = cudaMemcpy(peer_table, peers, (size_t)R * sizeof(char *), cudaMemcpyHostToDevice);
    free(peers);
    EPX_CUDA_CHECK(err, "buffer_create: copying the peer table");
    EPX_CHECK(create_trace(ll));
    EPX_CUDA_CHECK(cudaDeviceSynchronize(), "buffer_create: initialising low-latency memory");
    if (s->kernels == 2)
        EPX_CHECK(prepare_kernels2(ll));
    else if (epx__param_int(EPX_PARAM_LL_KERNELS) == 2)
        EPX_INFO(EPX_SUBSYS_OPS,
                 "low-latency: EPX_LL_KERNELS=2 asked for, but kernels 2 serve num_topk <= %d "
                 "and up to about 2000 experts (config: %d, %d): kernels 1",
                 EPX_LL2_MAX_TOPK, s->topk, s->num_experts);
    EPX_INFO(EPX_SUBSYS_TRANSPORT,
             "low-latency: %.1f MB symmetric + %.1f MB local per rank, %d of %d ranks by direct "
             "stores, %s, kernels %d",
             (double)ll->sym_bytes / 1e6, (double)ll->local_bytes / 1e6, direct, R,
             s->use_puts ? "NVSHMEM puts to the rest" : "no puts", s->kernels);
    return EPX_SUCCESS;
}

int epx__cuda_ll_settings_differ(const epx__cuda_ll_vote_t *votes, int world_size)
{
    for (int r = 1; r < world_size; r++)
        if (votes[r].kernels != votes[0].kernels || votes[r].release != votes[0].release)
            return r;
    return -1;
}

/*
 * The vote before the symmetric heap: every rank's status and the settings its kernels
 * run with. Ranks that ran different kernels, or gave slots back differently, would wait
 * for each other's flags until their timeouts; every rank refuses the buffer instead,
 * naming the settings.
 */
static epx_status_t vote_settings(epx_group_t group, const epx__cuda_ll_t *ll,
                                  epx_status_t status)
{
    epx__cuda_ll_vote_t mine = {0, 0, 0};
    if (ll != NULL) {
        mine.kernels = ll->shape.kernels;
        mine.release = ll->shape.release;
    }
    epx__cuda_ll_vote_t *all = calloc((size_t)group->world_size, sizeof(*all));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    status = epx__bootstrap_vote(group->bootstrap, group->world_size, status, &mine, all,
                                 sizeof(mine), "buffer_create", "could not set up NVSHMEM");
    int r = status == EPX_SUCCESS ? epx__cuda_ll_settings_differ(all, group->world_size) : -1;
    if (r >= 0)
        status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                           "buffer_create: the ranks' low-latency settings differ: rank 0 runs "
                           "kernels %d (EPX_LL_KERNELS) giving slots back by form %d "
                           "(EPX_LL_RELEASE), rank %d kernels %d and form %d; every rank must "
                           "set the same values",
                           all[0].kernels, all[0].release, r, all[r].kernels, all[r].release);
    free(all);
    return status;
}

epx_status_t epx__cuda_ll_create(epx_buffer_t buffer, epx_status_t status, epx__cuda_ll_t **out)
{
    *out = NULL;
    epx_group_t group = buffer->group;
    if (buffer->config.max_low_latency_tokens <= 0)
        return status;
    epx__cuda_ll_t *ll = calloc(1, sizeof(*ll));
    if (ll == NULL && status == EPX_SUCCESS)
        status = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    if (status == EPX_SUCCESS)
        status = epx__cuda_ll_plan(group, &buffer->config, &ll->shape, &ll->sym_bytes,
                                   &ll->local_bytes);
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    status = epx__nvshmem_setup(&ranks, group, ll != NULL ? ll->sym_bytes : 0, status);
    if (status == EPX_SUCCESS)
        status = find_kernels(&ll->plugin);
    /* nvshmem_malloc below is collective: a rank whose plugin lacks the kernels, or whose
     * settings differ from its peers', must not leave them waiting there (or later, in
     * the kernels), so all learn it first. */
    status = vote_settings(group, ll, status);
    if (status != EPX_SUCCESS) {
        free(ll);
        return status;
    }
    /* Collective on every PE of the process's NVSHMEM world (this group). */
    ll->sym = epx__nvshmem_malloc(ll->sym_bytes);
    if (ll->sym == NULL)
        status = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY,
                           "buffer_create: nvshmem_malloc of %zu bytes failed: the symmetric heap "
                           "is too small (NVSHMEM_SYMMETRIC_SIZE=%s)",
                           ll->sym_bytes,
                           getenv("NVSHMEM_SYMMETRIC_SIZE") ? getenv("NVSHMEM_SYMMETRIC_SIZE") : "?");
    if (status == EPX_SUCCESS)
        status = create_memory(buffer, ll);
    /* The caller's final vote tells every rank whether all are ready. */
    if (status != EPX_SUCCESS) {
        epx__cuda_ll_destroy(ll, 0);
        return status;
    }
    epx__nvshmem_user_begin();
    ll->counted = 1;
    *out = ll;
    return EPX_SUCCESS;
}

void epx__cuda_ll_destroy(epx__cuda_ll_t *ll, int healthy)
{
    if (ll == NULL)
        return;
    if (ll->counted)
        epx__nvshmem_user_end(healthy);
    if (ll->sym != NULL && healthy)
        epx__nvshmem_free(ll->sym);
    if (ll->trace != NULL) {
        if (healthy && cudaDeviceSynchronize() == cudaSuccess)
            write_trace(ll);
        (void)cudaFree(ll->trace);
    }
    if (ll->local != NULL)
        (void)cudaFree(ll->local);
    if (ll->fail != NULL)
        (void)cudaFreeHost(ll->fail);
    (void)cudaGetLastError();
    free(ll);
}

void epx__cuda_ll_group_destroy(epx_group_t group)
{
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    epx__nvshmem_owner_destroyed(group, &ranks);
}
