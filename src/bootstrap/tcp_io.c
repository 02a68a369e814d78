/*
 * Deadline-bounded socket operations. Sockets are non-blocking throughout: poll() does
 * the waiting, so a send or recv can never block past the deadline, and EINTR (a
 * signal handler in the application) only restarts the wait with the time left.
 */
#include "bootstrap/tcp_io.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"

int64_t epx__deadline_after_ms(int64_t timeout_ms)
{
    return epx__now_ns() + timeout_ms * 1000000;
}

int epx__ms_until(int64_t deadline_ns)
{
    int64_t left_ns = deadline_ns - epx__now_ns();
    if (left_ns <= 0)
        return 0;
    int64_t left_ms = (left_ns + 999999) / 1000000; /* round up: never wake too early */
    return left_ms > INT32_MAX ? INT32_MAX : (int)left_ms;
}

epx__io_result_t epx__wait_fd(int fd, short events, int64_t deadline_ns, int *error_code)
{
    for (;;) {
        struct pollfd entry = {.fd = fd, .events = events, .revents = 0};
        int ready = poll(&entry, 1, epx__ms_until(deadline_ns));
        if (ready > 0)
            return EPX__IO_OK;
        if (ready == 0) {
            if (epx__now_ns() >= deadline_ns)
                return EPX__IO_TIMEOUT;
            continue; /* poll's millisecond rounding woke us just before the deadline */
        }
        if (errno != EINTR) {
            *error_code = errno;
            return EPX__IO_ERROR;
        }
    }
}

static int is_closed_error(int code)
{
    return code == EPIPE || code == ECONNRESET || code == ENOTCONN || code == ECONNABORTED;
}

epx__io_result_t epx__send_two(int fd, const void *head, size_t head_length, const void *body,
                               size_t body_length, int64_t deadline_ns, int *error_code)
{
    struct iovec parts[2] = {{(void *)head, head_length}, {(void *)body, body_length}};
    int first = 0;
    for (;;) {
        while (first < 2 && parts[first].iov_len == 0)
            first++;
        if (first == 2)
            return EPX__IO_OK;
        struct msghdr message;
        memset(&message, 0, sizeof(message));
        message.msg_iov = parts + first;
        message.msg_iovlen = (size_t)(2 - first);
        ssize_t sent = sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent > 0) {
            size_t left = (size_t)sent;
            for (; first < 2 && left >= parts[first].iov_len; first++)
                left -= parts[first].iov_len;
            if (first < 2) {
                parts[first].iov_base = (char *)parts[first].iov_base + left;
                parts[first].iov_len -= left;
            }
            continue;
        }
        if (sent < 0 && errno == EINTR)
            continue;
        if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            epx__io_result_t waited = epx__wait_fd(fd, POLLOUT, deadline_ns, error_code);
            if (waited != EPX__IO_OK)
                return waited;
            continue;
        }
        *error_code = sent < 0 ? errno : EPIPE;
        return is_closed_error(*error_code) ? EPX__IO_CLOSED : EPX__IO_ERROR;
    }
}

epx__io_result_t epx__send_all(int fd, const void *data, size_t length, int64_t deadline_ns,
                               int *error_code)
{
    return epx__send_two(fd, data, length, NULL, 0, deadline_ns, error_code);
}

epx__io_result_t epx__recv_some(int fd, void *data, size_t length, size_t *received,
                                int *error_code)
{
    *received = 0;
    for (;;) {
        ssize_t got = recv(fd, data, length, MSG_DONTWAIT);
        if (got > 0) {
            *received = (size_t)got;
            return EPX__IO_OK;
        }
        if (got == 0)
            return EPX__IO_CLOSED;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return EPX__IO_OK; /* spurious wake-up: nothing read, wait again */
        *error_code = errno;
        return is_closed_error(errno) ? EPX__IO_CLOSED : EPX__IO_ERROR;
    }
}

epx__io_result_t epx__recv_all(int fd, void *data, size_t length, int64_t deadline_ns,
                               int *error_code)
{
    char *next = data;
    while (length > 0) {
        epx__io_result_t waited = epx__wait_fd(fd, POLLIN, deadline_ns, error_code);
        if (waited != EPX__IO_OK)
            return waited;
        size_t got = 0;
        epx__io_result_t result = epx__recv_some(fd, next, length, &got, error_code);
        if (result != EPX__IO_OK)
            return result;
        next += got;
        length -= got;
    }
    return EPX__IO_OK;
}

static void set_nodelay(int fd)
{
    /* Bootstrap messages are small and answered at once; Nagle would add 40 ms waits.
     * Failure only costs latency, so it is not an error. */
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static void sleep_ms(int ms)
{
    struct timespec pause = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
    }
}

int epx__socket_ends(int fd, struct sockaddr_in *local, struct sockaddr_in *peer)
{
    socklen_t local_length = sizeof(*local), peer_length = sizeof(*peer);
    if (getsockname(fd, (struct sockaddr *)local, &local_length) != 0 ||
        getpeername(fd, (struct sockaddr *)peer, &peer_length) != 0)
        return 0;
    return local->sin_family == AF_INET && peer->sin_family == AF_INET;
}

/*
 * On loopback, connecting to a port in the ephemeral range that nobody listens on can
 * connect the socket to itself (TCP simultaneous open) when the kernel happens to pick
 * that same port as the local one. Such a socket looks connected but leads nowhere.
 */
static int is_self_connected(int fd)
{
    struct sockaddr_in local, peer;
    if (!epx__socket_ends(fd, &local, &peer))
        return 0;
    return local.sin_port == peer.sin_port && local.sin_addr.s_addr == peer.sin_addr.s_addr;
}

/* One connection attempt; 0 when connected, else the errno of the failure. */
static int connect_once(struct in_addr address, uint16_t port, int64_t deadline_ns, int *fd)
{
    int sock = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (sock < 0)
        return errno;
    struct sockaddr_in remote = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr = address};
    int code = 0;
    if (connect(sock, (struct sockaddr *)&remote, sizeof(remote)) != 0) {
        code = errno;
        if (code == EINPROGRESS || code == EINTR) {
            int wait_error = 0;
            epx__io_result_t waited = epx__wait_fd(sock, POLLOUT, deadline_ns, &wait_error);
            if (waited == EPX__IO_TIMEOUT) {
                code = ETIMEDOUT;
            } else if (waited == EPX__IO_ERROR) {
                code = wait_error;
            } else {
                socklen_t length = sizeof(code);
                if (getsockopt(sock, SOL_SOCKET, SO_ERROR, &code, &length) != 0)
                    code = errno;
            }
        }
    }
    if (code == 0 && is_self_connected(sock))
        code = ECONNREFUSED;
    if (code != 0) {
        close(sock);
        return code;
    }
    set_nodelay(sock);
    *fd = sock;
    return 0;
}

epx__io_result_t epx__connect_retry(struct in_addr address, uint16_t port,
                                    int64_t deadline_ns, int *fd, int *error_code)
{
    /* Rank 0 may not be listening yet: retry, backing off from 10 ms to 100 ms so that
     * a late root costs little time and an absent one little CPU. */
    int pause_ms = 10;
    *error_code = 0;
    for (;;) {
        int code = connect_once(address, port, deadline_ns, fd);
        if (code == 0)
            return EPX__IO_OK;
        if (code == EMFILE || code == ENFILE || code == ENOBUFS || code == ENOMEM ||
            code == EAFNOSUPPORT) {
            *error_code = code; /* this process cannot make sockets: retrying won't help */
            return EPX__IO_ERROR;
        }
        if (code != ETIMEDOUT || *error_code == 0)
            *error_code = code;
        int left_ms = epx__ms_until(deadline_ns);
        if (left_ms <= 0)
            return EPX__IO_TIMEOUT;
        sleep_ms(pause_ms < left_ms ? pause_ms : left_ms);
        pause_ms = pause_ms * 2 > 100 ? 100 : pause_ms * 2;
    }
}

int epx__listen_on(struct in_addr address, uint16_t port, int backlog, int *fd,
                   int *error_code)
{
    int sock = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (sock < 0) {
        *error_code = errno;
        return -1;
    }
    /* The port was free when the id was made; a previous run's connections in
     * TIME_WAIT must not stop us from binding it again. */
    int one = 1;
    (void)setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in local = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr = address};
    if (bind(sock, (struct sockaddr *)&local, sizeof(local)) != 0 ||
        listen(sock, backlog) != 0) {
        *error_code = errno;
        close(sock);
        return -1;
    }
    *fd = sock;
    return 0;
}

epx__io_result_t epx__accept_until(int listen_fd, int64_t deadline_ns, int *fd,
                                   int *error_code)
{
    for (;;) {
        epx__io_result_t waited = epx__wait_fd(listen_fd, POLLIN, deadline_ns, error_code);
        if (waited != EPX__IO_OK)
            return waited;
        int sock = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (sock >= 0) {
            set_nodelay(sock);
            *fd = sock;
            return EPX__IO_OK;
        }
        /* A connection that was reset before we accepted it is not our failure. */
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK ||
            errno == ECONNABORTED || errno == EPROTO)
            continue;
        *error_code = errno;
        return EPX__IO_ERROR;
    }
}
