/*
 * Groups: who the ranks are, which backend and device they use, and the bootstrap
 * they talk through outside the data path.
 *
 * Creation is collective. Every rank checks its own config first (so a bad field is
 * reported where it was made), then brings the bootstrap up, then all ranks compare
 * what they resolved: a group whose ranks disagree on the world size, the backend or
 * the node size would fail much later in a confusing way, so it fails here, on every
 * rank, naming the first rank that disagrees.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "api.h"
#include "core/objects.h"

/* What every rank must agree on, exchanged right after the bootstrap is up. */
typedef struct {
    int32_t rank; /* the position the bootstrap gave this rank must be config.rank */
    int32_t world_size;
    int32_t backend;
    int32_t ranks_per_node;
    char host[64]; /* gethostname: a node's ranks must share one (group_nodes.c) */
} group_agreement_t;

static int backend_known(epx_backend_t backend)
{
    return backend == EPX_BACKEND_AUTO || backend == EPX_BACKEND_HOST ||
           backend == EPX_BACKEND_CUDA;
}

/* Devices of the CUDA backend this process can use (0 when the build has none). */
static int cuda_device_count(void)
{
    const epx__backend_ops_t *cuda = epx__backend_find(EPX_BACKEND_CUDA);
    return cuda != NULL && cuda->device_count != NULL ? cuda->device_count() : 0;
}

static epx_status_t check_config(const epx_group_config_t *config)
{
    if (config->size != sizeof(epx_group_config_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: config size is %zu, expected %zu (initialise it with "
                         "EPX_GROUP_CONFIG_INIT)",
                         config->size, sizeof(epx_group_config_t));
    if (config->world_size < 1)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "group: world_size %d is less than 1",
                         config->world_size);
    if (config->rank < 0 || config->rank >= config->world_size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "group: rank %d is outside 0..%d (world_size %d)",
                         config->rank, config->world_size - 1, config->world_size);
    if (config->unique_id != NULL && config->callbacks != NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: both unique_id and callbacks are set; give exactly one");
    if (config->world_size > 1 && config->unique_id == NULL && config->callbacks == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: world_size %d needs a unique_id or callbacks to rendezvous "
                         "(neither is set)",
                         config->world_size);
    if (config->callbacks != NULL && config->callbacks->allgather == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: callbacks.allgather is NULL (it is required; barrier may be "
                         "NULL)");
    if (config->ranks_per_node < 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: ranks_per_node %d is negative (0 = all ranks on one node)",
                         config->ranks_per_node);
    if (config->ranks_per_node > 0 && config->world_size % config->ranks_per_node != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: ranks_per_node %d does not divide world_size %d (0 = all "
                         "ranks on one node)",
                         config->ranks_per_node, config->world_size);
    if (!backend_known(config->backend))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: backend %d is not an epx_backend_t value (auto, host, cuda)",
                         (int)config->backend);
    if (config->device < -1)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: device %d is not a device index (-1 = choose by local rank)",
                         config->device);
    if (config->timeout_ms < 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: timeout_ms %" PRId64 " is negative (0 = EPX_TIMEOUT_MS)",
                         config->timeout_ms);
    return EPX_SUCCESS;
}

static epx_status_t resolve_backend(epx_backend_t requested, epx_backend_t *resolved)
{
    int built = epx__backend_find(EPX_BACKEND_CUDA) != NULL;
    if (requested == EPX_BACKEND_AUTO) {
        *resolved = cuda_device_count() > 0 ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
        return EPX_SUCCESS;
    }
    if (requested == EPX_BACKEND_CUDA && !built)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "group: backend cuda was requested but this epx was built without "
                         "CUDA (rebuild with nvcc available and EPX_WITH_CUDA=ON)");
    if (requested == EPX_BACKEND_CUDA && cuda_device_count() <= 0)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "group: backend cuda was requested but no CUDA device is visible");
    *resolved = requested;
    return EPX_SUCCESS;
}

/* The node size the caller gave: config.ranks_per_node, else EPX_RANKS_PER_NODE (read
 * now, as a launcher's variables), else 0: found from the hosts at the agreement. */
static epx_status_t given_ranks_per_node(const epx_group_config_t *config, int *given)
{
    *given = config->ranks_per_node;
    if (*given > 0)
        return EPX_SUCCESS;
    int64_t from_env = 0;
    int is_set = 0;
    EPX_CHECK(epx__param_read_now(EPX_PARAM_RANKS_PER_NODE, &is_set, &from_env, NULL, 0));
    if (from_env > 0 && from_env < config->world_size && config->world_size % from_env != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: EPX_RANKS_PER_NODE=%lld does not divide world_size %d",
                         (long long)from_env, config->world_size);
    *given = from_env > 0 && from_env < config->world_size ? (int)from_env : 0;
    return EPX_SUCCESS;
}

/* Local rank and device for the node size in group->ranks_per_node. A launcher knows the
 * real placement on the node; without one, ranks are placed node by node in rank order.
 * Read now: the launcher's variables may have been set after the settings were cached. */
static epx_status_t place_rank(const epx_group_config_t *config, struct epx_group *group)
{
    int64_t local_rank = -1;
    int is_set = 0;
    EPX_CHECK(epx__param_read_now(EPX_PARAM_LOCAL_RANK, &is_set, &local_rank, NULL, 0));
    group->local_rank = local_rank >= 0 ? (int)local_rank : config->rank % group->ranks_per_node;

    group->device = -1;
    if (group->backend == EPX_BACKEND_CUDA) {
        int count = cuda_device_count();
        if (config->device >= count)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "group: device %d does not exist (%d CUDA device%s visible)",
                             config->device, count, count == 1 ? "" : "s");
        group->device = config->device >= 0 ? config->device : group->local_rank % count;
    }
    return EPX_SUCCESS;
}

/* Fill everything a group knows before it talks to the other ranks (the node size until
 * the agreement: the one given, else the world). */
static epx_status_t resolve_group(const epx_group_config_t *config, int given,
                                  struct epx_group *group)
{
    group->rank = config->rank;
    group->world_size = config->world_size;
    group->ranks_per_node = given > 0 ? given : config->world_size;
    group->timeout_ms = config->timeout_ms > 0 ? config->timeout_ms
                                               : epx__param_int(EPX_PARAM_TIMEOUT_MS);
    EPX_CHECK(resolve_backend(config->backend, &group->backend));
    return place_rank(config, group);
}

static epx_status_t check_agreement(const epx_group_config_t *config, int given,
                                    struct epx_group *group)
{
    group_agreement_t mine = {.rank = group->rank,
                              .world_size = group->world_size,
                              .backend = (int32_t)group->backend,
                              .ranks_per_node = given};
    if (gethostname(mine.host, sizeof(mine.host) - 1) != 0)
        strcpy(mine.host, "?");
    group_agreement_t *all = calloc((size_t)group->world_size, sizeof(*all));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "group: out of memory");
    epx_status_t status = epx__bootstrap_allgather(group->bootstrap, &mine, all, sizeof(mine));
    if (status != EPX_SUCCESS) {
        free(all);
        return status;
    }
    /* Every rank compares against rank 0 in rank order, so every rank reports the same
     * culprit. */
    for (int r = 0; r < group->world_size && status == EPX_SUCCESS; r++) {
        const group_agreement_t *theirs = &all[r];
        if (theirs->rank != r)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "group: the process in position %d of the rendezvous says it "
                               "is rank %d (config.rank must match the callbacks' order)",
                               r, (int)theirs->rank);
        else if (theirs->world_size != all[0].world_size)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "group: rank %d has world_size %d, rank 0 has %d", r,
                               (int)theirs->world_size, (int)all[0].world_size);
        else if (theirs->backend != all[0].backend)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG, "group: rank %d has backend %s, rank 0 has %s",
                               r, epx_backend_name((epx_backend_t)theirs->backend),
                               epx_backend_name((epx_backend_t)all[0].backend));
        else if (theirs->ranks_per_node != all[0].ranks_per_node)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "group: rank %d has ranks_per_node %d, rank 0 has %d (0: not "
                               "given)",
                               r, (int)theirs->ranks_per_node, (int)all[0].ranks_per_node);
    }
    /* Every rank sees the same hosts, so every rank finds the same nodes. */
    int per_node = group->ranks_per_node;
    if (status == EPX_SUCCESS)
        status = epx__group_nodes(all[0].host, sizeof(all[0]), group->world_size, given,
                                  &per_node);
    free(all);
    if (status != EPX_SUCCESS || per_node == group->ranks_per_node)
        return status;
    group->ranks_per_node = per_node; /* found from the hosts */
    return place_rank(config, group);
}

epx_status_t epx_group_create(const epx_group_config_t *config, epx_group_t *group)
{
    epx__clear_error();
    if (config == NULL || group == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_group_create: %s is NULL",
                         config == NULL ? "config" : "group");
    EPX_CHECK(check_config(config));
    EPX_CHECK(epx__params_load());

    int given = 0;
    EPX_CHECK(given_ranks_per_node(config, &given));
    struct epx_group *created = calloc(1, sizeof(*created));
    if (created == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "group: out of memory");
    epx_status_t status;
    EPX_CHECK_GOTO(resolve_group(config, given, created), status, err_free);
    if (config->callbacks != NULL)
        EPX_CHECK_GOTO(epx__bootstrap_create_callbacks(config->callbacks, config->rank,
                                                       config->world_size, &created->bootstrap),
                       status, err_free);
    else
        EPX_CHECK_GOTO(epx__bootstrap_create_tcp(config->unique_id, config->rank,
                                                 config->world_size, created->timeout_ms,
                                                 &created->bootstrap),
                       status, err_free);
    EPX_CHECK_GOTO(check_agreement(config, given, created), status, err_bootstrap);
    EPX_CHECK_GOTO(epx__object_add(EPX__OBJECT_GROUP, created), status, err_bootstrap);

    epx__log_set_rank(created->rank);
    EPX_INFO(EPX_SUBSYS_CORE,
             "group: rank %d of %d, local rank %d, %d ranks per node, backend %s, device %d",
             created->rank, created->world_size, created->local_rank, created->ranks_per_node,
             epx_backend_name(created->backend), created->device);
    *group = created;
    return EPX_SUCCESS;

err_bootstrap:
    epx__bootstrap_destroy(created->bootstrap);
err_free:
    free(created);
    return status;
}

/* EPX_BACKEND text to the enum (read now, like the launcher's variables). */
static epx_status_t backend_from_env(epx_backend_t *backend)
{
    char text[32];
    int is_set = 0;
    EPX_CHECK(epx__param_read_now(EPX_PARAM_BACKEND, &is_set, NULL, text, sizeof(text)));
    const epx_backend_t all[] = {EPX_BACKEND_AUTO, EPX_BACKEND_HOST, EPX_BACKEND_CUDA};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (strcasecmp(text, epx_backend_name(all[i])) == 0) {
            *backend = all[i];
            return EPX_SUCCESS;
        }
    }
    return EPX_ERROR(EPX_ERR_INVALID_ARG, "group: EPX_BACKEND=%s is not auto, host or cuda", text);
}

/*
 * The launcher's variables are read at this call, not from the settings cached by the
 * first epx call: a program may set them (setenv) after it used epx. Any of them set
 * means a launcher meant a group; only when none is set is the process a group of one.
 */
epx_status_t epx_group_create_from_env(epx_backend_t backend, epx_group_t *group)
{
    epx__clear_error();
    if (group == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_group_create_from_env: group is NULL");
    if (!backend_known(backend))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: backend %d is not an epx_backend_t value (auto, host, cuda)",
                         (int)backend);
    EPX_CHECK(epx__params_load());
    if (backend == EPX_BACKEND_AUTO)
        EPX_CHECK(backend_from_env(&backend));

    int64_t world_size = 0, rank = -1, ranks_per_node = 0;
    int world_set = 0, rank_set = 0, id_set = 0, per_node_set = 0;
    char id_text[EPX_UNIQUE_ID_BYTES * 2 + 64];
    EPX_CHECK(epx__param_read_now(EPX_PARAM_WORLD_SIZE, &world_set, &world_size, NULL, 0));
    EPX_CHECK(epx__param_read_now(EPX_PARAM_RANK, &rank_set, &rank, NULL, 0));
    EPX_CHECK(epx__param_read_now(EPX_PARAM_UNIQUE_ID, &id_set, NULL, id_text, sizeof(id_text)));
    EPX_CHECK(epx__param_read_now(EPX_PARAM_RANKS_PER_NODE, &per_node_set, &ranks_per_node,
                                  NULL, 0));

    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.backend = backend;
    if (world_size == 0) {
        if (rank_set || id_set)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "group: %s is set but EPX_WORLD_SIZE is not (a launcher sets "
                             "EPX_RANK, EPX_WORLD_SIZE and EPX_UNIQUE_ID together; unset them "
                             "all for a group of one)",
                             rank_set ? "EPX_RANK" : "EPX_UNIQUE_ID");
        return epx_group_create(&config, group); /* not started by a launcher */
    }

    if (rank < 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: EPX_RANK is not set but EPX_WORLD_SIZE=%" PRId64
                         " (a launcher sets both)",
                         world_size);
    if (rank >= world_size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "group: EPX_RANK=%" PRId64 " is not a rank of EPX_WORLD_SIZE=%" PRId64
                         " (a launcher sets both)",
                         rank, world_size);
    config.rank = (int)rank;
    config.world_size = (int)world_size;
    config.ranks_per_node = (int)ranks_per_node;
    epx_unique_id_t id;
    if (world_size > 1) {
        if (!id_set)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "group: EPX_UNIQUE_ID is not set but EPX_WORLD_SIZE=%" PRId64
                             " (a launcher sets both)",
                             world_size);
        epx_status_t status = epx_unique_id_from_string(id_text, &id);
        if (status != EPX_SUCCESS) {
            char why[512]; /* copied: EPX_ERROR rewrites the last-error text it reads */
            snprintf(why, sizeof(why), "%s", epx_last_error());
            return EPX_ERROR(status, "group: EPX_UNIQUE_ID: %s", why);
        }
        config.unique_id = &id;
    }
    return epx_group_create(&config, group);
}

epx_status_t epx_group_destroy(epx_group_t group)
{
    epx__clear_error();
    if (group == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_group_destroy: group is NULL");
    /* Removal is the check: of two threads destroying the same group, one wins. */
    if (!epx__object_remove(EPX__OBJECT_GROUP, group))
        return epx__object_check(EPX__OBJECT_GROUP, group, "epx_group_destroy", "group");
    const epx__backend_ops_t *ops = epx__backend_find(group->backend);
    if (ops != NULL && ops->group_destroy != NULL)
        ops->group_destroy(group);
    epx__bootstrap_destroy(group->bootstrap);
    epx__object_retire(group);
    return EPX_SUCCESS;
}

epx_status_t epx_group_get_info(epx_group_t group, epx_group_info_t *info)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_GROUP, group, "epx_group_get_info", "group"));
    if (info == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_group_get_info: info is NULL");
    if (info->size != sizeof(epx_group_info_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "epx_group_get_info: info.size is %zu, expected %zu (use "
                         "EPX_GROUP_INFO_INIT)",
                         info->size, sizeof(epx_group_info_t));
    epx_group_info_t filled = {.size = sizeof(filled),
                               .rank = group->rank,
                               .world_size = group->world_size,
                               .local_rank = group->local_rank,
                               .ranks_per_node = group->ranks_per_node,
                               .backend = group->backend,
                               .device = group->device};
    *info = filled;
    return EPX_SUCCESS;
}

epx_status_t epx_group_barrier(epx_group_t group)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_GROUP, group, "epx_group_barrier", "group"));
    return epx__bootstrap_barrier(group->bootstrap);
}

epx_status_t epx_group_allgather(epx_group_t group, const void *send, void *recv, size_t bytes)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_GROUP, group, "epx_group_allgather", "group"));
    if (send == NULL || recv == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_group_allgather: %s is NULL",
                         send == NULL ? "send" : "recv");
    if (bytes == 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_group_allgather: bytes is 0");
    if (bytes > (size_t)INT64_MAX / (size_t)group->world_size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "epx_group_allgather: bytes %zu times world size %d overflows", bytes,
                         group->world_size);
    return epx__bootstrap_allgather(group->bootstrap, send, recv, bytes);
}
