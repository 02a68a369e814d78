/*
 * Socket helpers for the TCP bootstrap. Every call that can wait takes an absolute
 * deadline (epx__now_ns clock) and waits with poll(), so no call blocks past it.
 * They return an outcome, not a status: the protocol layer knows which rank and stage
 * a failure belongs to and writes the message.
 */
#ifndef EPX_BOOTSTRAP_TCP_IO_H
#define EPX_BOOTSTRAP_TCP_IO_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    EPX__IO_OK = 0,
    EPX__IO_TIMEOUT, /* the deadline passed */
    EPX__IO_CLOSED,  /* the peer closed or reset the connection */
    EPX__IO_ERROR,   /* another socket error; errno is kept in *error_code */
} epx__io_result_t;

/* Absolute deadline `timeout_ms` from now. */
int64_t epx__deadline_after_ms(int64_t timeout_ms);
/* Milliseconds left until `deadline_ns` for poll(), clamped to [0, INT32_MAX]. */
int epx__ms_until(int64_t deadline_ns);

/*
 * Wait until `fd` is ready for `events` (POLLIN/POLLOUT). EPX__IO_OK also when the
 * socket reports an error or hang-up: the next recv/send says which.
 */
epx__io_result_t epx__wait_fd(int fd, short events, int64_t deadline_ns, int *error_code);
/* Send or receive exactly `length` bytes. MSG_NOSIGNAL: a dead peer is EPX__IO_CLOSED,
 * never a SIGPIPE. */
epx__io_result_t epx__send_all(int fd, const void *data, size_t length, int64_t deadline_ns,
                               int *error_code);
epx__io_result_t epx__recv_all(int fd, void *data, size_t length, int64_t deadline_ns,
                               int *error_code);
/* Send a header and a body as one message (sendmsg of the two): a small frame leaves as
 * one segment and wakes its reader once. On loopback each send also runs the reader's
 * side of the delivery, so one send a frame instead of two halves a broadcast's time. */
epx__io_result_t epx__send_two(int fd, const void *head, size_t head_length, const void *body,
                               size_t body_length, int64_t deadline_ns, int *error_code);
/* One recv() of at most `length` bytes on a socket poll() said is readable: bytes read
 * in *received (0 with EPX__IO_CLOSED when the peer closed). */
epx__io_result_t epx__recv_some(int fd, void *data, size_t length, size_t *received,
                                int *error_code);

/* The two IPv4 ends of a connected socket; 0 when either is unknown or not IPv4. */
int epx__socket_ends(int fd, struct sockaddr_in *local, struct sockaddr_in *peer);

/*
 * Connect to address:port, retrying while nobody listens yet, until the deadline.
 * On EPX__IO_TIMEOUT, *error_code holds the last connect error (0 if none).
 */
epx__io_result_t epx__connect_retry(struct in_addr address, uint16_t port,
                                    int64_t deadline_ns, int *fd, int *error_code);
/* Bind (SO_REUSEADDR) and listen. Returns 0, or -1 with errno kept in *error_code. */
int epx__listen_on(struct in_addr address, uint16_t port, int backlog, int *fd,
                   int *error_code);
/* Accept one connection by the deadline; the new socket has TCP_NODELAY. */
epx__io_result_t epx__accept_until(int listen_fd, int64_t deadline_ns, int *fd,
                                   int *error_code);

#endif /* EPX_BOOTSTRAP_TCP_IO_H */
