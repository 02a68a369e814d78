/*
 * Rejoin in low-latency mode (include/epx.h, docs/STABILITY.md): a new process takes the
 * place of a lost rank in the survivors' running low-latency buffer. Survivors call
 * epx_ll_rejoin, newcomers epx_buffer_create_rejoin, all on a new group that holds every
 * rank (a fresh rendezvous: the old group may have lost its hub, and cannot take a new
 * process in anyway).
 *
 * The ranks first agree, in one allgather over the new group, on who is which: each
 * sends whether it joins, its verdict on its own arguments (with the reason), its buffer
 * config, its mask and its next slot. Every rank then makes the same checks on the same
 * records, so all of them accept or refuse together: the newcomers must be exactly the
 * ranks every survivor masked, the configs and the survivors' next slots must agree.
 * Then the backend moves the memory (ll_rejoin). Nothing here changes a survivor's
 * buffer until the backend succeeded, so a refused or failed rejoin leaves it serving
 * with the rank masked.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "core/objects.h"
#include "validate.h"

/* What each rank contributes to the agreement; followed by its mask, [world] bytes. */
typedef struct {
    int32_t status;
    int32_t joining;
    int32_t next_slot;
    int32_t num_experts;
    int32_t num_topk;
    int32_t dispatch_dtype;
    int32_t low_latency_dtype;
    int32_t pad;
    int64_t max_tokens_per_rank;
    int64_t hidden;
    int64_t max_low_latency_tokens;
    char message[256];
} rejoin_record_t;

static int configs_differ(const rejoin_record_t *a, const rejoin_record_t *b)
{
    return a->num_experts != b->num_experts || a->num_topk != b->num_topk ||
           a->dispatch_dtype != b->dispatch_dtype || a->low_latency_dtype != b->low_latency_dtype ||
           a->max_tokens_per_rank != b->max_tokens_per_rank || a->hidden != b->hidden ||
           a->max_low_latency_tokens != b->max_low_latency_tokens;
}

/* The checks every rank makes on the gathered records, in the same order. */
static epx_status_t check_records(const char *records, size_t bytes, int world, int *next_slot)
{
    const rejoin_record_t *first = (const rejoin_record_t *)records;
    int survivor = -1, joiners = 0;
    for (int r = 0; r < world; r++) {
        const rejoin_record_t *record = (const rejoin_record_t *)(records + (size_t)r * bytes);
        if (configs_differ(record, first))
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "rejoin: rank %d's buffer config differs from rank 0's (a newcomer "
                             "passes the survivors' config)",
                             r);
        joiners += record->joining != 0;
        if (!record->joining && survivor < 0)
            survivor = r;
    }
    if (joiners == 0)
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "rejoin: no rank called epx_buffer_create_rejoin, so there is nobody to "
                         "take back");
    if (survivor < 0)
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "rejoin: every rank called epx_buffer_create_rejoin: there is no "
                         "running buffer to join (make one with epx_buffer_create)");
    for (int s = 0; s < world; s++) {
        const rejoin_record_t *record = (const rejoin_record_t *)(records + (size_t)s * bytes);
        if (record->joining)
            continue;
        const unsigned char *mask = (const unsigned char *)(record + 1);
        for (int r = 0; r < world; r++) {
            const rejoin_record_t *other =
                (const rejoin_record_t *)(records + (size_t)r * bytes);
            if (other->joining && !mask[r])
                return EPX_ERROR(EPX_ERR_INVALID_STATE,
                                 "rejoin: rank %d came back (epx_buffer_create_rejoin) but rank %d "
                                 "has not masked it: only a rank whose loss every survivor saw "
                                 "(a failed wait masks it, or epx_ll_mask_rank) can rejoin",
                                 r, s);
            if (!other->joining && mask[r])
                return EPX_ERROR(EPX_ERR_INVALID_STATE,
                                 "rejoin: rank %d masks rank %d, which takes part as a survivor "
                                 "(epx_ll_rejoin): only a lost rank replaced by a new process "
                                 "(epx_buffer_create_rejoin) can be taken back",
                                 s, r);
        }
        const rejoin_record_t *reference =
            (const rejoin_record_t *)(records + (size_t)survivor * bytes);
        if (record->next_slot != reference->next_slot)
            return EPX_ERROR(EPX_ERR_INVALID_STATE,
                             "rejoin: survivors %d and %d are not in step (their next dispatch "
                             "uses slots %d and %d): every rank must make the same calls",
                             survivor, s, reference->next_slot, record->next_slot);
    }
    *next_slot = ((const rejoin_record_t *)(records + (size_t)survivor * bytes))->next_slot;
    return EPX_SUCCESS;
}

/*
 * The agreement (see the file comment). `local`: this rank's verdict on its own
 * arguments (with the thread's last error as the reason); `mask` [world] for a survivor,
 * NULL for a newcomer. On success joiners[r] = 1 for each newcomer and *next_slot is the
 * survivors' next slot.
 */
static epx_status_t rejoin_agree(epx_group_t group, epx_status_t local, int joining,
                                 const epx_buffer_config_t *config, const int32_t *mask,
                                 int next_slot, unsigned char *joiners, int *agreed_slot)
{
    int world = group->world_size;
    size_t bytes = (sizeof(rejoin_record_t) + (size_t)world + 7) / 8 * 8;
    char *mine = calloc(1, bytes);
    char *all = calloc((size_t)world, bytes);
    if (mine == NULL || all == NULL) {
        free(mine);
        free(all);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "rejoin: out of memory for %d ranks", world);
    }
    rejoin_record_t *record = (rejoin_record_t *)mine;
    record->status = (int32_t)local;
    record->joining = joining;
    record->next_slot = next_slot;
    if (local != EPX_SUCCESS) {
        snprintf(record->message, sizeof(record->message), "%s", epx_last_error());
    } else {
        record->num_experts = config->num_experts;
        record->num_topk = config->num_topk;
        record->dispatch_dtype = (int32_t)config->dispatch_dtype;
        record->low_latency_dtype = (int32_t)config->low_latency_dtype;
        record->max_tokens_per_rank = config->max_tokens_per_rank;
        record->hidden = config->hidden;
        record->max_low_latency_tokens = config->max_low_latency_tokens;
        for (int r = 0; r < world && mask != NULL; r++)
            ((unsigned char *)(record + 1))[r] = (unsigned char)(mask[r] != 0);
    }
    epx_status_t status = epx__bootstrap_allgather(group->bootstrap, mine, all, bytes);
    if (local != EPX_SUCCESS) {
        status = EPX_ERROR(local, "%s", record->message);
    } else if (status == EPX_SUCCESS) {
        for (int r = 0; r < world && status == EPX_SUCCESS; r++) {
            rejoin_record_t *theirs = (rejoin_record_t *)(all + (size_t)r * bytes);
            theirs->message[sizeof(theirs->message) - 1] = '\0';
            if (theirs->status != EPX_SUCCESS)
                status = EPX_ERROR(EPX_ERR_REMOTE, "rejoin: rank %d refused: %s", r,
                                   theirs->message);
        }
        if (status == EPX_SUCCESS)
            status = check_records(all, bytes, world, agreed_slot);
        for (int r = 0; r < world && status == EPX_SUCCESS; r++)
            joiners[r] = (unsigned char)(((rejoin_record_t *)(all + (size_t)r * bytes))->joining != 0);
    }
    free(mine);
    free(all);
    return status;
}

/* EPX_SUCCESS when this build's backend for `group` can rejoin, else why not. */
static epx_status_t check_backend(epx_group_t group, const char *op)
{
    const epx__backend_ops_t *ops = epx__backend_find(group->backend);
    if (ops == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED, "%s: backend %s is not built", op,
                         epx_backend_name(group->backend));
    if (ops->ll_rejoin_check != NULL)
        EPX_CHECK(ops->ll_rejoin_check(group));
    if (ops->ll_rejoin == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED, "%s: the %s backend cannot take a rank back", op,
                         ops->name);
    return EPX_SUCCESS;
}

/* A survivor's own arguments, checked before the agreement. */
static epx_status_t check_survivor(epx_buffer_t buffer, epx_group_t group)
{
    const char *op = "ll_rejoin";
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    EPX_CHECK(epx__buffer_check_usable(buffer, op));
    EPX_CHECK(epx__validate_ll_enabled(buffer, op));
    EPX_CHECK(check_backend(group, op));
    if (group->world_size != buffer->group->world_size || group->rank != buffer->group->rank)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: this process is rank %d of %d in the group but rank %d of %d in "
                         "the buffer (the new group keeps every rank's number)",
                         op, group->rank, group->world_size, buffer->group->rank,
                         buffer->group->world_size);
    if (epx__backend_find(group->backend) != buffer->ops)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: the group uses the %s backend, the buffer %s",
                         op, epx_backend_name(group->backend), buffer->ops->name);
    for (int slot = 0; slot < 2; slot++) {
        epx__ll_slot_state_t state = buffer->ll.slots[slot].state;
        if (state == EPX__LL_DISPATCH_SENT || state == EPX__LL_COMBINE_SENT)
            return EPX_ERROR(EPX_ERR_INVALID_STATE,
                             "%s: a low-latency %s is in flight (sent, not received): receive "
                             "it first; a rank rejoins between steps",
                             op, state == EPX__LL_DISPATCH_SENT ? "dispatch" : "combine");
    }
    return EPX_SUCCESS;
}

static void log_joiners(const char *what, const unsigned char *joiners, int world)
{
    char list[128] = "";
    size_t used = 0;
    for (int r = 0; r < world && used + 12 < sizeof(list); r++)
        if (joiners[r])
            used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%d", used ? ", " : "", r);
    EPX_INFO(EPX_SUBSYS_CORE, "rejoin: %s rank%s %s", what, strchr(list, ',') ? "s" : "", list);
}

static int first_joiner(const unsigned char *joiners, int world)
{
    for (int r = 0; r < world; r++)
        if (joiners[r])
            return r;
    return -1;
}

epx_status_t epx_ll_rejoin(epx_buffer_t buffer, epx_group_t group)
{
    epx__clear_error();
    /* Without a live new group there is nobody to tell (the peers' agreement times out);
     * the buffer's own group does not hold the newcomer, and its peers are not in this
     * call. */
    EPX_CHECK(epx__object_check(EPX__OBJECT_GROUP, group, "ll_rejoin", "group"));
    if (epx__object_live(EPX__OBJECT_BUFFER, buffer) && group == buffer->group)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "ll_rejoin: group is the buffer's own group; a rejoin needs a new group "
                         "formed with the newcomer (a fresh rendezvous)");
    epx_status_t local = check_survivor(buffer, group);
    int world = group->world_size;
    int32_t *mask = calloc((size_t)world, sizeof(int32_t));
    unsigned char *joiners = calloc((size_t)world, 1);
    if (local == EPX_SUCCESS && (mask == NULL || joiners == NULL))
        local = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "ll_rejoin: out of memory");
    if (local == EPX_SUCCESS)
        buffer->ops->ll_get_masked(buffer, mask);
    int next_slot = local == EPX_SUCCESS ? buffer->ll.next_slot : 0;
    int agreed_slot = 0;
    epx_status_t status = EPX_ERR_OUT_OF_MEMORY;
    if (joiners != NULL)
        status = rejoin_agree(group, local, 0, local == EPX_SUCCESS ? &buffer->config : NULL,
                              mask, next_slot, joiners, &agreed_slot);
    if (status == EPX_SUCCESS) {
        epx__transport_ranks_t ranks = epx__group_ranks(group);
        status = buffer->ops->ll_rejoin(buffer, &ranks, joiners);
    }
    if (status == EPX_SUCCESS) {
        /* Every rank is in again: the buffer now lives in the new group, the old steps
         * are over, and the loss is no longer news. */
        buffer->group = group;
        for (int slot = 0; slot < 2; slot++) {
            buffer->ll.slots[slot].state = EPX__LL_FREE;
            buffer->ll.slots[slot].combine_result = NULL;
        }
        atomic_store(&buffer->ll_peer_error, EPX_SUCCESS);
        buffer->ll_peer_message[0] = '\0';
        buffer->low_latency_only = 1;
        buffer->rejoined = first_joiner(joiners, world);
        log_joiners("took back", joiners, world);
    }
    free(mask);
    free(joiners);
    return status;
}

epx_status_t epx_buffer_create_rejoin(epx_group_t group, const epx_buffer_config_t *config,
                                      epx_buffer_t *buffer_out)
{
    const char *op = "buffer_create_rejoin";
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_GROUP, group, op, "group"));
    epx_status_t local = epx__validate_buffer_config(group, config);
    epx_buffer_config_t full;
    memset(&full, 0, sizeof(full));
    if (local == EPX_SUCCESS) {
        epx__buffer_config_read(config, &full);
        if (buffer_out == NULL)
            local = EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: buffer is NULL", op);
        else if (full.max_low_latency_tokens <= 0)
            local = EPX_ERROR(EPX_ERR_INVALID_ARG,
                              "%s: config.max_low_latency_tokens is 0; a rank rejoins a "
                              "low-latency buffer (pass the survivors' config)",
                              op);
    }
    if (local == EPX_SUCCESS)
        local = check_backend(group, op);
    struct epx_buffer *buffer = NULL;
    if (local == EPX_SUCCESS) {
        buffer = epx__buffer_new(group, &full, epx__backend_find(group->backend));
        if (buffer == NULL)
            local = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "%s: out of memory", op);
    }
    unsigned char *joiners = calloc((size_t)group->world_size, 1);
    if (local == EPX_SUCCESS && joiners == NULL)
        local = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "%s: out of memory", op);
    int agreed_slot = 0;
    epx_status_t status = EPX_ERR_OUT_OF_MEMORY;
    if (joiners != NULL)
        status = rejoin_agree(group, local, 1, &full, NULL, 0, joiners, &agreed_slot);
    if (status == EPX_SUCCESS) {
        epx__transport_ranks_t ranks = epx__group_ranks(group);
        status = buffer->ops->ll_rejoin(buffer, &ranks, joiners);
    }
    if (status == EPX_SUCCESS) {
        buffer->ll.next_slot = agreed_slot;
        buffer->low_latency_only = 1;
        buffer->rejoined = first_joiner(joiners, group->world_size);
        status = epx__object_add(EPX__OBJECT_BUFFER, buffer);
        if (status != EPX_SUCCESS)
            buffer->ops->buffer_destroy(buffer, 0);
    }
    if (status != EPX_SUCCESS) {
        free(buffer);
        free(joiners);
        return status;
    }
    log_joiners("joined as", joiners, group->world_size);
    free(joiners);
    *buffer_out = buffer;
    return EPX_SUCCESS;
}
