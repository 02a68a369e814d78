/*
 * Shared-memory segments of a group: create, hand over, map.
 *
 * A segment never has a name (shm_fd.c says why and how descriptors travel), so a rank
 * killed at any moment leaves nothing behind: the kernel frees a segment with its last
 * descriptor or mapping. Setup is two allgathers over the bootstrap around the
 * descriptor exchange. The first carries each rank's socket name and pid (or the
 * reason it could not make its segment); the second carries whether each rank mapped
 * every peer. Because every rank learns every other rank's outcome, all of them fail
 * or succeed together and no rank is left waiting for one that gave up.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "transport/shm/shm_private.h"

static size_t epx__round_up(size_t value, size_t to)
{
    return (value + to - 1) / to * to;
}

uint64_t epx__shm_random(void)
{
    uint64_t value = 0;
    if (getrandom(&value, sizeof(value), GRND_NONBLOCK) != (ssize_t)sizeof(value)) {
        /* No entropy yet (early boot): the clock and pid are unique enough (a clash of
         * socket names fails the bind, and the name is drawn again). */
        value = (uint64_t)epx__now_ns() * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    }
    return value;
}

void epx__shm_record_fail(epx__shm_record_t *record, epx_status_t status, const char *message)
{
    if (record->status != EPX_SUCCESS)
        return;
    record->status = status;
    snprintf(record->message, sizeof(record->message), "%s", message);
}

/*
 * Make, size and map this rank's segment; its descriptor stays open in shm->own_fd, for
 * the exchange and for a rank that rejoins later. On failure nothing is left.
 */
epx_status_t epx__shm_create_own(struct epx__shm *shm)
{
    int fd = epx__shm_anonymous_file();
    if (fd < 0) {
        int err = errno;
        return EPX_ERROR(err == ENOSPC || err == ENOMEM ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_SYSTEM,
                         "shm: rank %d could not create a segment in /dev/shm: %s", shm->rank,
                         strerror(err));
    }
    /* fallocate reserves the pages now: a full /dev/shm is an error here, not a SIGBUS
     * on the first touch in the middle of a dispatch. */
    int err = ftruncate(fd, (off_t)shm->segment_bytes) == 0 ? 0 : errno;
    if (err == 0) {
        do
            err = posix_fallocate(fd, 0, (off_t)shm->segment_bytes);
        while (err == EINTR);
    }
    void *base = MAP_FAILED;
    if (err == 0) {
        base = mmap(NULL, shm->segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED)
            err = errno;
    }
    if (err != 0) {
        close(fd);
        if (err == ENOSPC || err == ENOMEM || err == EFBIG)
            return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY,
                             "shm: rank %d could not reserve %zu bytes of shared memory in "
                             "/dev/shm (%s); free space there or make the buffer smaller",
                             shm->rank, shm->segment_bytes, strerror(err));
        return EPX_ERROR(EPX_ERR_SYSTEM,
                         "shm: rank %d could not size or map %zu bytes in /dev/shm: %s", shm->rank,
                         shm->segment_bytes, strerror(err));
    }
    epx__shm_header_t *header = base;
    header->magic = EPX__SHM_MAGIC;
    header->pid = (int64_t)getpid();
    header->data_bytes = shm->data_bytes;
    header->rank = shm->rank;
    header->world_size = shm->world_size;
    atomic_store_explicit(&header->arrivals, 0, memory_order_relaxed);
    atomic_store_explicit(&header->abort_state, EPX__ABORT_NONE, memory_order_release);
    shm->headers[shm->rank] = header;
    shm->own_fd = fd;
    return EPX_SUCCESS;
}

epx_status_t epx__shm_map_peer(struct epx__shm *shm, int peer, int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != shm->segment_bytes)
        return EPX_ERROR(EPX_ERR_SYSTEM, "shm: rank %d's segment is not %zu bytes as announced",
                         peer, shm->segment_bytes);
    void *base = mmap(NULL, shm->segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    if (base == MAP_FAILED)
        return EPX_ERROR(err == ENOMEM ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_SYSTEM,
                         "shm: rank %d could not map rank %d's segment (%zu bytes): %s", shm->rank,
                         peer, shm->segment_bytes, strerror(err));
    const epx__shm_header_t *header = base;
    if (header->magic != EPX__SHM_MAGIC || header->rank != peer ||
        header->pid != shm->pids[peer]) {
        int64_t pid = header->pid;
        munmap(base, shm->segment_bytes);
        return EPX_ERROR(EPX_ERR_INTERNAL,
                         "shm: the segment rank %d sent has a bad header (pid %" PRId64
                         ", announced %" PRId64 ")",
                         peer, pid, shm->pids[peer]);
    }
    shm->headers[peer] = base;
    return EPX_SUCCESS;
}

int epx__shm_first_failure(const epx__shm_record_t *records, int world_size, int rank)
{
    if (records[rank].status != EPX_SUCCESS)
        return rank;
    for (int r = 0; r < world_size; r++)
        if (records[r].status != EPX_SUCCESS)
            return r;
    return -1;
}

epx_status_t epx__shm_setup_error(const struct epx__shm *shm, const epx__shm_record_t *records,
                                  int failed)
{
    if (failed == shm->rank) /* recorded (and logged) where it happened */
        return (epx_status_t)records[failed].status;
    return EPX_ERROR(EPX_ERR_REMOTE, "shm setup: rank %d failed: %s", failed,
                     records[failed].message);
}

void epx__shm_destroy(epx__shm_t *shm)
{
    if (shm == NULL)
        return;
    if (shm->headers != NULL) {
        for (int r = 0; r < shm->world_size; r++)
            if (shm->headers[r] != NULL)
                munmap(shm->headers[r], shm->segment_bytes);
    }
    if (shm->own_fd >= 0)
        close(shm->own_fd);
    free(shm->headers);
    free(shm->pids);
    free(shm->pid_visible);
    free(shm);
}

/*
 * Liveness checks rely on kill(pid, 0), and a peer in another pid namespace is invisible
 * to it. Probed between the two setup allgathers: no peer can leave setup before this
 * rank has joined the second one, so a peer that looks gone here was never visible.
 */
void epx__shm_probe_pids(struct epx__shm *shm, const epx__shm_record_t *records)
{
    for (int r = 0; r < shm->world_size; r++) {
        shm->pids[r] = records[r].pid;
        shm->pid_visible[r] = r == shm->rank || !epx__shm_pid_exited(shm->pids[r]);
        if (!shm->pid_visible[r])
            EPX_INFO(EPX_SUBSYS_TRANSPORT,
                     "shm: rank %d's pid %" PRId64 " is not visible from this process (other "
                     "pid namespace?); its exit will be noticed by the timeout only",
                     r, shm->pids[r]);
    }
}

struct epx__shm *epx__shm_alloc(const epx__transport_ranks_t *ranks, size_t bytes_per_rank)
{
    int world = ranks->world_size;
    struct epx__shm *shm = calloc(1, sizeof(*shm));
    if (shm == NULL)
        return NULL;
    shm->own_fd = -1;
    shm->headers = calloc((size_t)world, sizeof(*shm->headers));
    shm->pids = calloc((size_t)world, sizeof(*shm->pids));
    shm->pid_visible = calloc((size_t)world, 1);
    if (shm->headers == NULL || shm->pids == NULL || shm->pid_visible == NULL) {
        epx__shm_destroy(shm);
        return NULL;
    }
    shm->rank = ranks->rank;
    shm->world_size = world;
    shm->timeout_ms = ranks->timeout_ms;
    shm->data_bytes = bytes_per_rank;
    shm->segment_bytes = epx__shm_segment_bytes(bytes_per_rank);
    shm->learned_rank = -1;
    return shm;
}

epx_status_t epx__shm_map_peers(struct epx__shm *shm, epx__bootstrap_t *bootstrap, int listen_fd,
                                int own_fd, const char *const *names, const unsigned char *peers,
                                int *fds, epx__shm_record_t *records)
{
    epx__shm_record_t mapped;
    memset(&mapped, 0, sizeof(mapped));
    epx_status_t status = epx__shm_exchange_fds(shm, listen_fd, own_fd, names, peers, fds);
    if (status != EPX_SUCCESS)
        epx__shm_record_fail(&mapped, status, epx_last_error());
    close(listen_fd);
    for (int r = 0; r < shm->world_size && mapped.status == EPX_SUCCESS; r++) {
        if (peers != NULL ? !peers[r] : r == shm->rank)
            continue;
        status = epx__shm_map_peer(shm, r, fds[r]);
        if (status != EPX_SUCCESS)
            epx__shm_record_fail(&mapped, status, epx_last_error());
    }
    for (int r = 0; r < shm->world_size; r++)
        if (fds[r] >= 0)
            close(fds[r]);
    /* Round 2: whether every rank mapped what it needed; all succeed or fail together. */
    status = epx__bootstrap_allgather(bootstrap, &mapped, records, sizeof(mapped));
    if (status != EPX_SUCCESS)
        return status;
    int failed = epx__shm_first_failure(records, shm->world_size, shm->rank);
    return failed >= 0 ? epx__shm_setup_error(shm, records, failed) : EPX_SUCCESS;
}

epx_status_t epx__shm_create(const epx__transport_ranks_t *group, size_t bytes_per_rank,
                             epx__shm_t **out)
{
    int world = group->world_size;
    epx__shm_record_t *records = calloc((size_t)world, sizeof(*records));
    const char **names = calloc((size_t)world, sizeof(*names));
    int *fds = calloc((size_t)world, sizeof(*fds));
    struct epx__shm *shm = epx__shm_alloc(group, bytes_per_rank);
    if (records == NULL || names == NULL || fds == NULL || shm == NULL) {
        free(records);
        free(names);
        free(fds);
        epx__shm_destroy(shm);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "shm: no host memory for %d ranks' bookkeeping",
                         world);
    }
    for (int r = 0; r < world; r++)
        fds[r] = -1;

    epx__shm_record_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.data_bytes = bytes_per_rank;
    mine.pid = (int64_t)getpid();
    int listen_fd = -1;
    epx_status_t status = epx__shm_create_own(shm);
    if (status == EPX_SUCCESS)
        status = epx__shm_listen(shm, mine.name, sizeof(mine.name), &listen_fd);
    if (status != EPX_SUCCESS)
        epx__shm_record_fail(&mine, status, epx_last_error());

    /* Round 1: socket names. Every rank takes part even after a local failure, so that
     * the others learn about it instead of waiting. */
    EPX_CHECK_GOTO(epx__bootstrap_allgather(group->bootstrap, &mine, records, sizeof(mine)), status,
                   fail);
    int failed = epx__shm_first_failure(records, world, shm->rank);
    if (failed >= 0) {
        status = epx__shm_setup_error(shm, records, failed);
        goto fail;
    }
    for (int r = 0; r < world; r++) {
        if (records[r].data_bytes != bytes_per_rank) {
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "shm setup: rank %d asked for %" PRIu64 " bytes per rank, rank %d "
                               "for %zu (every rank must pass the same buffer config)",
                               r, records[r].data_bytes, shm->rank, bytes_per_rank);
            goto fail;
        }
        records[r].name[sizeof(records[r].name) - 1] = '\0';
        names[r] = records[r].name;
    }

    epx__shm_probe_pids(shm, records);

    /* The descriptors, then every rank maps every peer. */
    status = epx__shm_map_peers(shm, group->bootstrap, listen_fd, shm->own_fd, names, NULL, fds,
                                records);
    listen_fd = -1; /* closed by epx__shm_map_peers */
    if (status != EPX_SUCCESS)
        goto fail;

    EPX_DEBUG(EPX_SUBSYS_TRANSPORT, "shm: rank %d mapped %d segments of %zu bytes", shm->rank,
              world, shm->segment_bytes);
    free(records);
    free(names);
    free(fds);
    *out = shm;
    return EPX_SUCCESS;

fail:
    if (listen_fd >= 0)
        close(listen_fd);
    free(records);
    free(names);
    free(fds);
    epx__shm_destroy(shm);
    return status;
}

void *epx__shm_peer(epx__shm_t *shm, int rank)
{
    if (rank < 0 || rank >= shm->world_size)
        return NULL;
    return (char *)shm->headers[rank] + EPX__SHM_HEADER_BYTES;
}

size_t epx__shm_data_bytes(const epx__shm_t *shm)
{
    return shm->data_bytes;
}

size_t epx__shm_segment_bytes(size_t data_bytes)
{
    return EPX__SHM_HEADER_BYTES + epx__round_up(data_bytes > 0 ? data_bytes : 1, 4096);
}
