/*
 * Low-latency mode of the CUDA backend: loading the NVSHMEM plugin, setting NVSHMEM up
 * (once per process, bootstrapped by a unique id shared through the group), the memory
 * plan, and creating / destroying a buffer's low-latency part.
 *
 * NVSHMEM is process-wide: the first low-latency buffer initialises it with this
 * rank's place in its group, and later buffers must come from a group with the same
 * rank and size (the same processes). Destroying that group finalises it, once every
 * rank's low-latency buffers are gone and no rank saw a failed peer (the group votes
 * first, with its timeout, so a dead rank cannot hang nvshmem_finalize); otherwise it
 * stays until the process exits and the OS reclaims it. NVSHMEM cannot be set up twice
 * in a process, so low-latency CUDA buffers end with that group.
 */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "ops/cuda/ll.h"
#include "transport/cuda_status.h"

#define EPX_LL_UID_BYTES 256
#define EPX_LL_ALIGN 256

static pthread_mutex_t nv_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    const epx_ll_plugin_t *plugin;
    char path[PATH_MAX];
    int initialized, finalized, rank, world;
    epx_group_t owner; /* the group that set NVSHMEM up */
    int live_buffers;  /* low-latency buffers not destroyed */
    int saw_failure;   /* a buffer was destroyed with a failed or masked peer */
} nv;

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
 * The device state after the two result slots (offsets from its start): seq [2][2] and
 * released [2] uint64, arrive [2][4] uint32, mask [R + 1] int32 (the last word claims the
 * failure record), the peer table [R] pointers.
 */
typedef struct {
    size_t released, arrive, mask, peers, bytes;
} state_layout_t;

static state_layout_t state_layout(int world)
{
    state_layout_t l;
    l.released = 4 * sizeof(uint64_t);
    l.arrive = l.released + 2 * sizeof(uint64_t);
    l.mask = l.arrive + 8 * sizeof(uint32_t);
    l.peers = l.mask + (((size_t)world + 1) * sizeof(int32_t) + 7) / 8 * 8;
    l.bytes = l.peers + (size_t)world * sizeof(char *);
    return l;
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
    if (config->hidden % 8 != 0)
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
    s->scale_cols = config->hidden % 128 == 0 ? config->hidden / 128 : 0;
    s->timeout_ns = group->timeout_ms * 1000000;
    s->x_row_bytes = (size_t)config->hidden * (config->low_latency_dtype == EPX_DTYPE_FP8_E4M3 ? 1 : 2);
    /* Puts (and their staging memory) only where some peer may lack a direct pointer. */
    s->may_put = group->ranks_per_node < R || epx__param_int(EPX_PARAM_LL_FORCE_PUTS) != 0;

    size_t L = (size_t)s->num_local, rows = (size_t)s->rows, S = (size_t)s->scale_cols;
    size_t cells = L * (size_t)R * (size_t)m, k = (size_t)s->topk, H = (size_t)s->hidden;
    size_t puts = s->may_put ? 1 : 0;
    /* Symmetric: flags, then two slots with the same inner offsets. */
    size_t sym = 0;
    s->flags = take(&sym, 4 * 2 * (size_t)R * sizeof(uint64_t));
    size_t in_slot = 0;
    s->sent_count = take(&in_slot, L * (size_t)R * sizeof(int32_t));
    s->recv_x = take(&in_slot, cells * s->x_row_bytes);
    s->recv_scales = take(&in_slot, cells * S * sizeof(float));
    s->recv_src_info = take(&in_slot, cells * sizeof(int32_t));
    s->recv_topk = take(&in_slot, cells * sizeof(int32_t));
    s->recv_range = take(&in_slot, L * (size_t)R * sizeof(int64_t));
    s->combine_in = take(&in_slot, L * rows * H * 2);
    s->combine_stage = take(&in_slot, puts * (size_t)m * k * H * 2);
    s->send_x = take(&in_slot, puts * (size_t)m * s->x_row_bytes);
    s->send_scales = take(&in_slot, puts * (size_t)m * S * sizeof(float));
    s->slot[0] = take(&sym, in_slot);
    s->slot[1] = take(&sym, in_slot);
    /* Local: two slots of bookkeeping, then the state. */
    size_t local_slot = 0;
    s->recv_count = take(&local_slot, L * sizeof(int32_t));
    s->recv_src_rank = take(&local_slot, L * rows * sizeof(int32_t));
    s->send_pos = take(&local_slot, (size_t)m * k * sizeof(int32_t));
    s->local_slot_bytes = local_slot;
    *sym_bytes = sym;
    *local_bytes = align_up(2 * local_slot + state_layout(R).bytes);
    return EPX_SUCCESS;
}

/* Candidates: EPX_NVSHMEM_PLUGIN, beside the code of libepx, the build directory. */
static epx_status_t load_plugin(void)
{
    if (nv.plugin != NULL)
        return EPX_SUCCESS;
    char candidates[3][PATH_MAX];
    int n = 0;
    const char *forced = epx__param_string(EPX_PARAM_NVSHMEM_PLUGIN);
    if (forced != NULL && forced[0] != '\0') {
        snprintf(candidates[n++], PATH_MAX, "%s", forced);
    } else {
        Dl_info info;
        if (dladdr((void *)load_plugin, &info) != 0 && info.dli_fname != NULL) {
            const char *slash = strrchr(info.dli_fname, '/');
            int dir = slash == NULL ? 0 : (int)(slash - info.dli_fname);
            snprintf(candidates[n++], PATH_MAX, "%.*s%s%s", dir, info.dli_fname,
                     dir > 0 ? "/" : "", EPX_LL_PLUGIN_FILE);
        }
#ifdef EPX_PLUGIN_BUILD_DIR
        snprintf(candidates[n++], PATH_MAX, "%s/%s", EPX_PLUGIN_BUILD_DIR, EPX_LL_PLUGIN_FILE);
#endif
        snprintf(candidates[n++], PATH_MAX, "%s", EPX_LL_PLUGIN_FILE);
    }
    /* The reason worth reporting: a file that is there but does not load (a missing
     * dependency, a wrong ABI) outranks the candidates that do not exist. */
    char reason[512] = "", looked[1024] = "";
    int present = 0;
    for (int i = 0; i < n; i++) {
        size_t used = strlen(looked);
        snprintf(looked + used, sizeof(looked) - used, "%s%.300s", i > 0 ? ", " : "",
                 candidates[i]);
        void *library = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
        if (library == NULL) {
            const char *why = dlerror();
            int exists = strchr(candidates[i], '/') != NULL && access(candidates[i], F_OK) == 0;
            if (!present || exists)
                snprintf(reason, sizeof(reason), "%s", why != NULL ? why : "dlopen failed");
            present = present || exists;
            continue;
        }
        epx_ll_plugin_entry_t entry;
        *(void **)(&entry) = dlsym(library, EPX_LL_PLUGIN_SYMBOL);
        const epx_ll_plugin_t *plugin = entry != NULL ? entry() : NULL;
        if (plugin == NULL || plugin->abi != EPX_LL_PLUGIN_ABI) {
            snprintf(reason, sizeof(reason), "%.300s is not an epx NVSHMEM plugin of ABI %d",
                     candidates[i], EPX_LL_PLUGIN_ABI);
            present = 1;
            dlclose(library);
            continue;
        }
        nv.plugin = plugin;
        memcpy(nv.path, candidates[i], sizeof(nv.path));
        return EPX_SUCCESS;
    }
    if (present)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer: low-latency mode on the CUDA backend: %s is there but does "
                         "not load (looked in: %s): %s",
                         EPX_LL_PLUGIN_FILE, looked, reason);
    return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                     "buffer: low-latency mode on the CUDA backend needs %s (built when NVSHMEM "
                     "is found: pip install nvidia-nvshmem-cu13 or set NVSHMEM_HOME, then "
                     "rebuild; or point EPX_NVSHMEM_PLUGIN at it); looked in: %s (%s)",
                     EPX_LL_PLUGIN_FILE, looked, reason);
}

epx_status_t epx__cuda_ll_plugin_load(const char **path, int version[3])
{
    pthread_mutex_lock(&nv_lock);
    epx_status_t status = load_plugin();
    if (status == EPX_SUCCESS) {
        *path = nv.path;
        nv.plugin->nvshmem_version(&version[0], &version[1], &version[2]);
    }
    pthread_mutex_unlock(&nv_lock);
    return status;
}

/* Defaults for NVSHMEM that the user did not set (README lists them). */
static void nvshmem_defaults(size_t sym_bytes)
{
    if (getenv("NVSHMEM_SYMMETRIC_SIZE") == NULL) {
        /* The heap also holds NVSHMEM's own state; later buffers reuse freed space. */
        size_t slack = sym_bytes / 4 > ((size_t)512 << 20) ? sym_bytes / 4 : ((size_t)512 << 20);
        char value[32];
        snprintf(value, sizeof(value), "%zu", sym_bytes + slack);
        setenv("NVSHMEM_SYMMETRIC_SIZE", value, 0);
    }
    /* epx uses no NVSHMEM collectives; NVLink SHARP would only cost memory. */
    setenv("NVSHMEM_DISABLE_NVLS", "1", 0);
}

typedef struct {
    int32_t status;
    int32_t need_init;
    uint8_t uid[EPX_LL_UID_BYTES];
} ll_vote_t;

/* Allgather this rank's status; the first failing rank's becomes everyone's. */
static epx_status_t vote(epx_group_t group, epx_status_t status, ll_vote_t *mine, ll_vote_t *all,
                         const char *what)
{
    mine->status = (int32_t)status;
    epx_status_t gathered = epx__bootstrap_allgather(group->bootstrap, mine, all, sizeof(*mine));
    if (status != EPX_SUCCESS)
        return status;
    if (gathered != EPX_SUCCESS)
        return gathered;
    for (int r = 0; r < group->world_size; r++)
        if (all[r].status != EPX_SUCCESS)
            return EPX_ERROR(EPX_ERR_REMOTE, "buffer_create: rank %d failed %s (%s)", r, what,
                             epx_status_string((epx_status_t)all[r].status));
    return EPX_SUCCESS;
}

/* Load the plugin and initialise NVSHMEM for this group (collective). */
static epx_status_t nvshmem_setup(epx_group_t group, size_t sym_bytes, epx_status_t status)
{
    int rank = group->rank, world = group->world_size;
    ll_vote_t mine, *all = calloc((size_t)world, sizeof(ll_vote_t));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    memset(&mine, 0, sizeof(mine));
    pthread_mutex_lock(&nv_lock);
    if (status == EPX_SUCCESS)
        status = load_plugin();
    if (status == EPX_SUCCESS && nv.finalized)
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED,
                           "buffer_create: NVSHMEM was finalised when the group that set it up "
                           "was destroyed, and it cannot be set up twice in a process: keep "
                           "that group while low-latency CUDA buffers are needed");
    if (status == EPX_SUCCESS && nv.initialized && (nv.rank != rank || nv.world != world))
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED,
                           "buffer_create: NVSHMEM was set up in this process as rank %d of %d; "
                           "low-latency buffers of one process must come from groups with the "
                           "same rank and size (here rank %d of %d)",
                           nv.rank, nv.world, rank, world);
    if (status == EPX_SUCCESS && nv.plugin->uid_size() > EPX_LL_UID_BYTES)
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED, "buffer_create: NVSHMEM's unique id is too large");
    mine.need_init = !nv.initialized;
    if (status == EPX_SUCCESS && mine.need_init) {
        nvshmem_defaults(sym_bytes);
        if (rank == 0 && nv.plugin->get_uid(mine.uid) != 0)
            status = EPX_ERROR(EPX_ERR_NVSHMEM, "buffer_create: nvshmemx_get_uniqueid failed");
    }
    status = vote(group, status, &mine, all, "to load NVSHMEM");
    if (status == EPX_SUCCESS && all[0].need_init != mine.need_init)
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED,
                           "buffer_create: NVSHMEM is set up on some ranks of the group and not "
                           "on others");
    if (status == EPX_SUCCESS && mine.need_init) {
        char message[256] = "";
        int64_t start = epx__now_ns();
        if (nv.plugin->init(all[0].uid, rank, world, message, sizeof(message)) != 0) {
            status = EPX_ERROR(EPX_ERR_NVSHMEM, "buffer_create: %s", message);
        } else {
            nv.initialized = 1;
            nv.owner = group;
            nv.rank = rank;
            nv.world = world;
            int major, minor, patch;
            nv.plugin->nvshmem_version(&major, &minor, &patch);
            EPX_INFO(EPX_SUBSYS_TRANSPORT, "NVSHMEM %d.%d.%d up as PE %d of %d in %.0f ms (%s)",
                     major, minor, patch, rank, world, (double)(epx__now_ns() - start) / 1e6,
                     nv.path);
        }
    }
    pthread_mutex_unlock(&nv_lock);
    free(all);
    return status;
}

epx_status_t epx__cuda_nvshmem_setup(epx_group_t group, size_t sym_bytes, epx_status_t status,
                                     const epx_ll_plugin_t **plugin)
{
    status = nvshmem_setup(group, sym_bytes, status);
    *plugin = status == EPX_SUCCESS ? nv.plugin : NULL;
    if (status == EPX_SUCCESS) {
        pthread_mutex_lock(&nv_lock);
        nv.live_buffers++;
        pthread_mutex_unlock(&nv_lock);
    }
    return status;
}

void epx__cuda_nvshmem_release(int healthy)
{
    pthread_mutex_lock(&nv_lock);
    nv.live_buffers--;
    nv.saw_failure = nv.saw_failure || !healthy;
    pthread_mutex_unlock(&nv_lock);
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
    s->arrive = (uint32_t *)(state + layout.arrive);
    s->mask = (int32_t *)(state + layout.mask);
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
        peers[r] = ll->plugin->peer_ptr(ll->sym, r);
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
    EPX_CUDA_CHECK(cudaDeviceSynchronize(), "buffer_create: initialising low-latency memory");
    EPX_INFO(EPX_SUBSYS_TRANSPORT,
             "low-latency: %.1f MB symmetric + %.1f MB local per rank, %d of %d ranks by direct "
             "stores, %s",
             (double)ll->sym_bytes / 1e6, (double)ll->local_bytes / 1e6, direct, R,
             s->use_puts ? "NVSHMEM puts to the rest" : "no puts");
    return EPX_SUCCESS;
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
    status = nvshmem_setup(group, ll != NULL ? ll->sym_bytes : 0, status);
    if (status != EPX_SUCCESS) {
        free(ll);
        return status;
    }
    ll->plugin = nv.plugin;
    /* Collective on every PE of the process's NVSHMEM world (this group). */
    ll->sym = ll->plugin->malloc_sym(ll->sym_bytes);
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
    pthread_mutex_lock(&nv_lock);
    nv.live_buffers++;
    pthread_mutex_unlock(&nv_lock);
    ll->counted = 1;
    *out = ll;
    return EPX_SUCCESS;
}

void epx__cuda_ll_destroy(epx__cuda_ll_t *ll, int healthy)
{
    if (ll == NULL)
        return;
    if (ll->counted) {
        pthread_mutex_lock(&nv_lock);
        nv.live_buffers--;
        nv.saw_failure = nv.saw_failure || !healthy;
        pthread_mutex_unlock(&nv_lock);
    }
    if (ll->sym != NULL && healthy)
        ll->plugin->free_sym(ll->sym);
    if (ll->local != NULL)
        (void)cudaFree(ll->local);
    if (ll->fail != NULL)
        (void)cudaFreeHost(ll->fail);
    (void)cudaGetLastError();
    free(ll);
}

void epx__cuda_ll_group_destroy(epx_group_t group)
{
    pthread_mutex_lock(&nv_lock);
    if (!nv.initialized || nv.finalized || nv.owner != group) {
        pthread_mutex_unlock(&nv_lock);
        return;
    }
    /* Everyone must be ready, or nobody calls the collective finalize. */
    int32_t mine = nv.live_buffers == 0 && !nv.saw_failure;
    int world = group->world_size, ready = mine;
    int32_t *all = calloc((size_t)world, sizeof(int32_t));
    if (all == NULL ||
        epx__bootstrap_allgather(group->bootstrap, &mine, all, sizeof(mine)) != EPX_SUCCESS)
        ready = 0;
    for (int r = 0; ready && r < world; r++)
        ready = all[r] != 0;
    free(all);
    if (ready) {
        nv.plugin->finalize();
        nv.finalized = 1;
        EPX_INFO(EPX_SUBSYS_TRANSPORT, "NVSHMEM finalised (its group was destroyed)");
    } else {
        EPX_WARN(EPX_SUBSYS_TRANSPORT,
                 "NVSHMEM stays set up until the process exits: %s",
                 mine ? "another rank still has low-latency buffers or saw a failed peer"
                      : (nv.live_buffers > 0 ? "low-latency buffers of this process are not destroyed"
                                             : "a peer failed while a buffer was in use"));
    }
    nv.owner = NULL;
    pthread_mutex_unlock(&nv_lock);
}
