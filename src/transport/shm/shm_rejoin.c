/*
 * A new process takes a lost rank's place among running segments (shm.h, epx__shm_rejoin).
 *
 * It follows epx__shm_create with the exchange limited to the pairs that involve a
 * joiner: two allgathers over the new rendezvous around the descriptor exchange, the
 * first with each rank's socket name and pid (or why it could not take part), the second
 * with whether it mapped what it needed, so that every rank succeeds or fails together.
 * A survivor hands the joiners the descriptor it kept of its own segment and maps theirs
 * into a staging object; nothing in its running shm changes until epx__shm_adopt, so a
 * failed rejoin leaves it exactly as it was. A joiner's segment is unnamed like every
 * other, so a joiner killed at any moment leaves nothing behind either.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "transport/shm/shm_private.h"

/* Round 1's record of this rank: its socket, or why it cannot take part. */
static void epx__rejoin_prepare(struct epx__shm *staged, const epx__shm_t *shm, int joining,
                                size_t bytes_per_rank, void (*init)(void *, void *),
                                void *context, epx__shm_record_t *mine, int *listen_fd)
{
    memset(mine, 0, sizeof(*mine));
    mine->data_bytes = bytes_per_rank;
    mine->pid = (int64_t)getpid();
    epx_status_t status = EPX_SUCCESS;
    if (!joining && (shm == NULL || shm->data_bytes != bytes_per_rank || shm->own_fd < 0))
        status = EPX_ERROR(EPX_ERR_INTERNAL,
                           "shm rejoin: rank %d survives but has no matching segment to hand "
                           "over",
                           staged->rank);
    else if (joining && shm != NULL)
        status = EPX_ERROR(EPX_ERR_INTERNAL, "shm rejoin: rank %d joins but already has segments",
                           staged->rank);
    if (status == EPX_SUCCESS && joining) {
        status = epx__shm_create_own(staged);
        if (status == EPX_SUCCESS && init != NULL)
            init(epx__shm_peer(staged, staged->rank), context);
    }
    if (status == EPX_SUCCESS)
        status = epx__shm_listen(staged, mine->name, sizeof(mine->name), listen_fd);
    if (status != EPX_SUCCESS)
        epx__shm_record_fail(mine, status, epx_last_error());
}

/* Round 1's outcome on this rank: EPX_SUCCESS with names[] set, or the first failure. */
static epx_status_t epx__rejoin_check_round1(const struct epx__shm *staged,
                                             epx__shm_record_t *records, const char **names,
                                             size_t bytes_per_rank)
{
    int failed = epx__shm_first_failure(records, staged->world_size, staged->rank);
    if (failed >= 0)
        return epx__shm_setup_error(staged, records, failed);
    for (int r = 0; r < staged->world_size; r++) {
        if (records[r].data_bytes != bytes_per_rank)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "shm rejoin: rank %d has %llu bytes per rank, rank %d %zu (the "
                             "newcomer must pass the survivors' buffer config)",
                             r, (unsigned long long)records[r].data_bytes, staged->rank,
                             bytes_per_rank);
        records[r].name[sizeof(records[r].name) - 1] = '\0';
        names[r] = records[r].name;
    }
    return EPX_SUCCESS;
}

epx_status_t epx__shm_rejoin(const epx__transport_ranks_t *ranks, const unsigned char *joiners,
                             size_t bytes_per_rank, epx__shm_t *shm,
                             void (*init)(void *data, void *context), void *context,
                             epx__shm_t **staged_out)
{
    int world = ranks->world_size, me = ranks->rank;
    int joining = joiners[me] != 0;
    epx__shm_record_t *records = calloc((size_t)world, sizeof(*records));
    const char **names = calloc((size_t)world, sizeof(*names));
    int *fds = calloc((size_t)world, sizeof(*fds));
    unsigned char *peers = calloc((size_t)world, 1);
    struct epx__shm *staged = epx__shm_alloc(ranks, bytes_per_rank);
    if (records == NULL || names == NULL || fds == NULL || peers == NULL || staged == NULL) {
        free(records);
        free(names);
        free(fds);
        free(peers);
        epx__shm_destroy(staged);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "shm rejoin: no host memory for %d ranks", world);
    }
    for (int r = 0; r < world; r++) {
        fds[r] = -1;
        /* Every pair with a joiner in it exchanges, both ways; survivors already share. */
        peers[r] = r != me && (joining || joiners[r]);
    }

    epx__shm_record_t mine;
    int listen_fd = -1;
    epx__rejoin_prepare(staged, shm, joining, bytes_per_rank, init, context, &mine, &listen_fd);
    /* Round 1: socket names, taken part in even after a local failure (peers learn it). */
    epx_status_t status = epx__bootstrap_allgather(ranks->bootstrap, &mine, records, sizeof(mine));
    if (status == EPX_SUCCESS)
        status = epx__rejoin_check_round1(staged, records, names, bytes_per_rank);
    if (status != EPX_SUCCESS)
        goto fail;
    epx__shm_probe_pids(staged, records);

    int own_fd = joining ? staged->own_fd : shm->own_fd;
    status = epx__shm_map_peers(staged, ranks->bootstrap, listen_fd, own_fd, names, peers, fds,
                                records);
    listen_fd = -1; /* closed by epx__shm_map_peers */
    if (status != EPX_SUCCESS)
        goto fail;
    EPX_DEBUG(EPX_SUBSYS_TRANSPORT, "shm rejoin: rank %d (%s) exchanged segments", me,
              joining ? "joining" : "survivor");
    free(records);
    free(names);
    free(fds);
    free(peers);
    *staged_out = staged;
    return EPX_SUCCESS;

fail:
    if (listen_fd >= 0)
        close(listen_fd);
    free(records);
    free(names);
    free(fds);
    free(peers);
    epx__shm_destroy(staged); /* unmaps what was mapped, closes a joiner's own segment */
    return status;
}

void epx__shm_adopt(epx__shm_t *shm, epx__shm_t *staged)
{
    for (int r = 0; r < shm->world_size; r++) {
        if (r == shm->rank || staged->headers[r] == NULL)
            continue;
        /* The old segment's memory goes with its last mapping: this one, or a peer's. */
        if (shm->headers[r] != NULL)
            munmap(shm->headers[r], shm->segment_bytes);
        shm->headers[r] = staged->headers[r];
        shm->pids[r] = staged->pids[r];
        shm->pid_visible[r] = staged->pid_visible[r];
        staged->headers[r] = NULL;
    }
    epx__shm_destroy(staged);
}

int epx__shm_peer_running(const epx__shm_t *shm, int rank, int64_t *pid)
{
    if (rank < 0 || rank >= shm->world_size || rank == shm->rank)
        return 0;
    *pid = shm->pids[rank];
    return shm->pid_visible[rank] && !epx__shm_pid_exited(shm->pids[rank]);
}
