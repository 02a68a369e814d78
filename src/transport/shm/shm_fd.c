/*
 * Handing segment file descriptors to the peers, so that no segment ever has a name.
 *
 * A segment named in /dev/shm outlives a rank killed before it unlinks the name; one
 * that never had a name is freed by the kernel with its last descriptor or mapping,
 * whatever kills the ranks. So each rank makes its segment unnamed (O_TMPFILE in
 * /dev/shm, or memfd_create where that is refused) and passes the descriptor to every
 * peer over a Unix socket (SCM_RIGHTS), as NCCL passes its cuMem handles. The sockets
 * live in the abstract namespace, which leaves no file behind either.
 *
 * Every rank listens, then (after the names went round the bootstrap) connects to every
 * peer and runs one poll loop: it sends its descriptor on each connection it accepts
 * and reads a peer's descriptor from each connection it made. Connecting never blocks
 * (the backlog holds the whole world), and the loop serves both directions at once, so
 * no order of arrival can deadlock. The loop gives up on a peer whose process is gone
 * and, after the group's timeout, on one that does not answer.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "transport/shm/shm_private.h"

#define EPX__SHM_POLL_MS 10

/* The socket address of an abstract name (sun_path starts with a NUL byte). */
static socklen_t epx__shm_address(const char *name, struct sockaddr_un *address)
{
    memset(address, 0, sizeof(*address));
    address->sun_family = AF_UNIX;
    size_t length = strnlen(name, sizeof(address->sun_path) - 2);
    memcpy(address->sun_path + 1, name, length);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + length);
}

int epx__shm_anonymous_file(void)
{
    /* A file in /dev/shm without a name: counted against /dev/shm like a named one. */
    int fd = open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0)
        return fd;
    /* Older kernels, or no /dev/shm: an anonymous shmem file. */
    return memfd_create("epx-shm", MFD_CLOEXEC);
}

epx_status_t epx__shm_listen(struct epx__shm *shm, char *name, size_t name_size, int *listen_fd)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return EPX_ERROR(EPX_ERR_SYSTEM, "shm: rank %d could not make a Unix socket: %s",
                         shm->rank, strerror(errno));
    for (int attempt = 0; attempt < 16; attempt++) {
        snprintf(name, name_size, "epx-%ld-%016" PRIx64 "-%d", (long)getpid(),
                 epx__shm_random(), shm->rank);
        struct sockaddr_un address;
        socklen_t length = epx__shm_address(name, &address);
        if (bind(fd, (struct sockaddr *)&address, length) == 0) {
            /* The whole world may connect before this rank accepts anyone. */
            if (listen(fd, shm->world_size) != 0)
                break;
            *listen_fd = fd;
            return EPX_SUCCESS;
        }
        if (errno != EADDRINUSE)
            break;
    }
    int err = errno;
    close(fd);
    name[0] = '\0';
    return EPX_ERROR(EPX_ERR_SYSTEM, "shm: rank %d could not listen on a Unix socket: %s",
                     shm->rank, strerror(err));
}

/* Send `fd` on a connection just accepted, if it comes from a process of this user. */
static void epx__shm_send_fd(int connection, int fd, int rank)
{
    struct ucred peer;
    socklen_t length = sizeof(peer);
    if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0 ||
        peer.uid != getuid())
        return; /* not one of ours: it gets nothing */
    int32_t payload = rank;
    struct iovec data = {&payload, sizeof(payload)};
    union {
        char buffer[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof(control));
    struct msghdr message;
    memset(&message, 0, sizeof(message));
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    message.msg_control = control.buffer;
    message.msg_controllen = sizeof(control.buffer);
    struct cmsghdr *header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(header), &fd, sizeof(int));
    /* A few bytes on a fresh connection: the socket buffer takes them at once. */
    while (sendmsg(connection, &message, MSG_NOSIGNAL) < 0 && errno == EINTR)
        ;
}

/* Read the descriptor a peer sends on `connection`: >= 0, or -1 with *closed set. */
static int epx__shm_receive_fd(int connection, int peer, int *closed)
{
    int32_t payload = -1;
    struct iovec data = {&payload, sizeof(payload)};
    union {
        char buffer[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr message;
    memset(&message, 0, sizeof(message));
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    message.msg_control = control.buffer;
    message.msg_controllen = sizeof(control.buffer);
    ssize_t got = recvmsg(connection, &message, MSG_CMSG_CLOEXEC);
    *closed = 0;
    if (got < 0)
        return -1; /* EAGAIN: not yet; other errors show up as a hang-up */
    struct cmsghdr *header = CMSG_FIRSTHDR(&message);
    int fd = -1;
    if (header != NULL && header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS)
        memcpy(&fd, CMSG_DATA(header), sizeof(int));
    if (got != (ssize_t)sizeof(payload) || payload != peer || fd < 0) {
        if (fd >= 0)
            close(fd);
        *closed = 1;
        return -1;
    }
    return fd;
}

/* The rank whose process connected on `connection`, or -1 if its pid is not known. */
static int epx__shm_connected_rank(const struct epx__shm *shm, int connection)
{
    struct ucred peer;
    socklen_t length = sizeof(peer);
    if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0)
        return -1;
    for (int r = 0; r < shm->world_size; r++)
        if (shm->pid_visible[r] && shm->pids[r] == (int64_t)peer.pid)
            return r;
    return -1;
}

static epx_status_t epx__shm_exited(const struct epx__shm *shm, int r)
{
    return EPX_ERROR(EPX_ERR_REMOTE, "shm setup: rank %d (pid %" PRId64 ") exited", r,
                     shm->pids[r]);
}

/* Connect to every peer's socket; a failure is recorded, the others still connect. */
static epx_status_t epx__shm_connect_all(struct epx__shm *shm, const char *const *names,
                                         const unsigned char *peers, int *connections)
{
    epx_status_t status = EPX_SUCCESS;
    for (int r = 0; r < shm->world_size; r++) {
        connections[r] = -1;
        if (r == shm->rank || !peers[r])
            continue;
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        struct sockaddr_un address;
        socklen_t length = epx__shm_address(names[r], &address);
        int err = fd < 0 ? errno : 0;
        if (fd >= 0 && connect(fd, (struct sockaddr *)&address, length) != 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
        connections[r] = fd;
        if (fd >= 0 || status != EPX_SUCCESS)
            continue;
        if (err == ECONNREFUSED && epx__shm_pid_exited(shm->pids[r]))
            status = epx__shm_exited(shm, r);
        else
            status = EPX_ERROR(EPX_ERR_SYSTEM,
                               "shm setup: rank %d could not connect to rank %d's socket @%s: %s "
                               "(are the ranks in one network namespace?)",
                               shm->rank, r, names[r], strerror(err));
    }
    return status;
}

epx_status_t epx__shm_exchange_fds(struct epx__shm *shm, int listen_fd, int own_fd,
                                   const char *const *names, const unsigned char *peers_given,
                                   int *fds)
{
    int world = shm->world_size, me = shm->rank;
    int *connections = malloc((size_t)world * sizeof(int));
    unsigned char *served = calloc((size_t)world, 1);
    unsigned char *peers = malloc((size_t)world);
    struct pollfd *polls = malloc((size_t)(world + 1) * sizeof(struct pollfd));
    int *poll_rank = malloc((size_t)(world + 1) * sizeof(int));
    if (connections == NULL || served == NULL || peers == NULL || polls == NULL ||
        poll_rank == NULL) {
        free(connections);
        free(served);
        free(peers);
        free(polls);
        free(poll_rank);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "shm: out of memory for the descriptor exchange");
    }
    for (int r = 0; r < world; r++) {
        fds[r] = -1;
        peers[r] = r != me && (peers_given == NULL || peers_given[r]);
        served[r] = !peers[r]; /* a rank that is not a peer neither sends nor asks */
    }
    epx_status_t status = epx__shm_connect_all(shm, names, peers, connections);
    int64_t start = epx__now_ns();
    /* On a failure this rank stops at once: closing its sockets tells the peers (their
     * connections hang up or are refused), and the second allgather says why. */
    while (status == EPX_SUCCESS) {
        int count = 0, unserved = 0;
        for (int r = 0; r < world; r++)
            unserved += !served[r];
        if (unserved > 0) {
            polls[count] = (struct pollfd){listen_fd, POLLIN, 0};
            poll_rank[count++] = -1;
        }
        for (int r = 0; r < world; r++)
            if (peers[r] && fds[r] < 0) {
                polls[count] = (struct pollfd){connections[r], POLLIN, 0};
                poll_rank[count++] = r;
            }
        if (count == 0)
            break; /* every descriptor in, every peer served */
        int ready = poll(polls, (nfds_t)count, EPX__SHM_POLL_MS);
        if (ready < 0 && errno != EINTR) {
            status = EPX_ERROR(EPX_ERR_SYSTEM, "shm setup: poll: %s", strerror(errno));
            break;
        }
        for (int i = 0; i < count && ready > 0 && status == EPX_SUCCESS; i++) {
            if (polls[i].revents == 0)
                continue;
            int r = poll_rank[i];
            if (r < 0) {
                int connection = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
                if (connection < 0)
                    continue;
                int peer = epx__shm_connected_rank(shm, connection);
                if (peer < 0) /* a peer whose pid this rank cannot see */
                    for (int q = 0; q < world && peer < 0; q++)
                        if (!served[q] && !shm->pid_visible[q])
                            peer = q;
                epx__shm_send_fd(connection, own_fd, me);
                close(connection);
                if (peer >= 0)
                    served[peer] = 1;
                continue;
            }
            int closed = 0;
            int fd = epx__shm_receive_fd(connections[r], r, &closed);
            if (fd >= 0)
                fds[r] = fd;
            else if (closed || (polls[i].revents & (POLLHUP | POLLERR)))
                status = epx__shm_pid_exited(shm->pids[r])
                             ? epx__shm_exited(shm, r)
                             : EPX_ERROR(EPX_ERR_REMOTE,
                                         "shm setup: rank %d closed its socket without sending "
                                         "its segment (it failed)",
                                         r);
        }
        /* A peer that is gone will neither send nor need anything any more. */
        int64_t waited = epx__now_ns() - start;
        for (int r = 0; r < world && status == EPX_SUCCESS; r++) {
            if (!peers[r] || (fds[r] >= 0 && served[r]))
                continue;
            if (shm->pid_visible[r] && epx__shm_pid_exited(shm->pids[r]))
                status = epx__shm_exited(shm, r);
            else if (waited >= shm->timeout_ms * 1000000ll)
                status = EPX_ERROR(EPX_ERR_TIMEOUT,
                                   "shm setup: rank %d did not exchange segments within %" PRId64
                                   " ms",
                                   r, shm->timeout_ms);
        }
    }
    for (int r = 0; r < world; r++) {
        if (connections[r] >= 0)
            close(connections[r]);
        if (status != EPX_SUCCESS && fds[r] >= 0) {
            close(fds[r]);
            fds[r] = -1;
        }
    }
    free(connections);
    free(served);
    free(peers);
    free(polls);
    free(poll_rank);
    return status;
}
