/*
 * TCP bootstrap: a star through rank 0 (the root).
 *
 * Join: the root listens on the id's address and port; every other rank connects
 * (retrying while the root is not up yet) and sends a hello (protocol magic, nonce,
 * rank, world size). The root ignores connections with another run's nonce (refusing
 * them with a message), fails the whole join on a duplicate rank or a world size that
 * does not match, and when all ranks are in sends each one "ready".
 *
 * Allgather: each non-root rank sends its block to the root in a frame; the root
 * collects all blocks at once with poll(), then sends the whole array back to each.
 * A barrier is an allgather of one word a rank. Rank 0 answers the ranks one after the
 * other (a few microseconds a send), so the first would leave the barrier tens of
 * microseconds before the last; with EPX_BARRIER_ALIGN_US > 0 (default 200), rank 0
 * puts into each word a time (CLOCK_MONOTONIC) at which the ranks on its host leave
 * together: after its sends to them, by its estimate from the previous barrier (the
 * sends' duration, and how late the ranks said that barrier's answer reached them),
 * never more than the setting after the last rank arrived. Ranks elsewhere (another IP
 * address at each end of the connection) leave at once.
 *
 * Failures: the root is the only process that sees every rank, so when it fails (a
 * rank closed its connection, a rank did not arrive in time) it sends every other rank
 * a frame carrying the status and its message before giving up. Non-root ranks wait for
 * the root a little longer than the timeout (a grace period), so that this report,
 * which names the guilty rank, reaches them before they give up on the root itself.
 *
 * Frames are in native byte order: every rank runs the same library build.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bootstrap/bootstrap_impl.h"
#include "bootstrap/tcp_io.h"
#include "core/core.h"

#define HELLO_MAGIC 0x31585045u /* "EPX1": also the protocol version */
#define FRAME_MAGIC 0x46585045u /* "EPXF" */
/* A connected rank sends its hello at once; a silent connection is not one of ours. */
#define HELLO_WAIT_MS 1000
/* Longest failure message a frame carries. */
#define MAX_REPORT_BYTES 1024
/* How long the root tries to deliver a failure report to each rank. */
#define REPORT_WAIT_MS 200
/* Aligned barrier release: room for a rank's wake-up beyond the estimate, and the
 * longest a rank ever waits for a release time (a time further off is not its clock's). */
#define BARRIER_MARGIN_NS 2000
#define BARRIER_MAX_WAIT_NS 10000000
/* The last stretch of the wait is spun (a sleep's wake-up is later by tens of us). */
#define BARRIER_SPIN_NS 100000

typedef struct {
    uint32_t magic;
    int32_t rank;
    int32_t world_size;
    uint32_t reserved;
    uint64_t nonce;
} hello_t;

/* status 0: `bytes` of data follow. Otherwise `bytes` of message text follow. */
typedef struct {
    uint32_t magic;
    int32_t status;
    uint64_t bytes;
} frame_t;

/* Progress of one rank's block towards the root. */
typedef struct {
    frame_t frame;
    size_t received; /* bytes of frame + block so far */
} incoming_t;

typedef struct {
    int64_t timeout_ms;
    int64_t grace_ms;
    char root_address[INET_ADDRSTRLEN + 8]; /* "a.b.c.d:port" for messages */
    int root_fd;     /* non-root: the connection to the root */
    int *peer_fds;   /* root: [world_size], the connection to each rank (-1 = none) */
    uint64_t *barrier_words; /* [world_size]: a barrier's exchange */
    /* Root: the barrier's aligned release (EPX_BARRIER_ALIGN_US). */
    int64_t align_ns;        /* longest a barrier may hold a rank; 0 = off */
    unsigned char *same_host; /* [world_size]: rank r's connection is from this host */
    int64_t send_ns;         /* last barrier: its answer's sends, per rank */
    int64_t late_ns;         /* recent barriers: the latest rank's lateness past the time */
    /* Non-root: how late the last barrier's answer was past its time (0: in time). */
    int64_t my_late_ns;
    /* Root's per-rank state for one allgather, allocated once (world_size entries;
     * on the heap, since a large world would not fit on the stack). */
    incoming_t *incoming;
    unsigned char *pending;
    struct pollfd *polls;
    int *polled_rank;
} tcp_t;

/* "rank 3" or "ranks 2, 3, 5" for the ranks r in 1..world_size-1 with pending[r]. */
static void format_ranks(char *out, size_t size, const unsigned char *pending, int world_size)
{
    int count = 0;
    for (int r = 1; r < world_size; r++)
        count += pending[r] != 0;
    size_t used = (size_t)snprintf(out, size, "%s", count == 1 ? "rank" : "ranks");
    int listed = 0;
    for (int r = 1; r < world_size && used < size; r++) {
        if (!pending[r])
            continue;
        if (listed == 16) {
            snprintf(out + used, size - used, ", ...");
            break;
        }
        used += (size_t)snprintf(out + used, size - used, "%s %d", listed ? "," : "", r);
        listed++;
    }
}

static const char *io_error_text(int code)
{
    return code != 0 ? strerror(code) : "no error";
}

/* ---------------------------------------------------------------- root side */

/* Best effort: tell one connection why we fail, then stop writing to it. */
static void send_report(int fd, epx_status_t status, const char *detail, int64_t deadline_ns)
{
    size_t length = strnlen(detail, MAX_REPORT_BYTES);
    frame_t frame = {.magic = FRAME_MAGIC, .status = (int32_t)status, .bytes = length};
    int ignored = 0;
    (void)epx__send_two(fd, &frame, sizeof(frame), detail, length, deadline_ns, &ignored);
    shutdown(fd, SHUT_WR);
}

/*
 * The root failed: record the error here and report it to every connected rank, so
 * that they fail with the same cause instead of waiting for their own timeout.
 */
static epx_status_t root_fail(epx__bootstrap_t *bootstrap, epx_status_t status,
                              const char *detail)
{
    tcp_t *tcp = bootstrap->impl;
    int64_t deadline = epx__deadline_after_ms(REPORT_WAIT_MS);
    for (int r = 1; r < bootstrap->world_size; r++)
        if (tcp->peer_fds[r] >= 0)
            send_report(tcp->peer_fds[r], status, detail, deadline);
    return EPX_ERROR(status, "bootstrap: %s", detail);
}

/* Refuse one connection during the join (it gets the reason, then is closed). */
static void refuse(int fd, const char *detail)
{
    send_report(fd, EPX_ERR_BOOTSTRAP, detail, epx__deadline_after_ms(REPORT_WAIT_MS));
    close(fd);
}

/* Both ends of a connection have one IPv4 address: the peer runs on this host (its
 * CLOCK_MONOTONIC is ours). */
static int connection_is_local(int fd)
{
    struct sockaddr_in mine, theirs;
    return epx__socket_ends(fd, &mine, &theirs) && mine.sin_addr.s_addr == theirs.sin_addr.s_addr;
}

static epx_status_t root_join(epx__bootstrap_t *bootstrap, const epx__unique_id_fields_t *id)
{
    tcp_t *tcp = bootstrap->impl;
    int world_size = bootstrap->world_size;
    char detail[MAX_REPORT_BYTES];
    int listen_fd = -1, error_code = 0;
    if (epx__listen_on(id->address, id->port, world_size, &listen_fd, &error_code) != 0)
        return EPX_ERROR(EPX_ERR_SYSTEM,
                         "bootstrap: rank 0 (root) cannot listen on %s: %s (is the port taken, "
                         "or the address not this host's?)",
                         tcp->root_address, strerror(error_code));

    int64_t deadline = epx__deadline_after_ms(tcp->timeout_ms);
    int joined = 1;
    while (joined < world_size) {
        int fd = -1;
        epx__io_result_t result = epx__accept_until(listen_fd, deadline, &fd, &error_code);
        if (result != EPX__IO_OK) {
            close(listen_fd);
            if (result != EPX__IO_TIMEOUT) {
                snprintf(detail, sizeof(detail), "rank 0 (root) failed to accept on %s: %s",
                         tcp->root_address, io_error_text(error_code));
                return root_fail(bootstrap, EPX_ERR_SYSTEM, detail);
            }
            unsigned char *missing = tcp->pending;
            char ranks[256];
            for (int r = 0; r < world_size; r++)
                missing[r] = r > 0 && tcp->peer_fds[r] < 0;
            format_ranks(ranks, sizeof(ranks), missing, world_size);
            snprintf(detail, sizeof(detail),
                     "timed out after %" PRId64 " ms in join waiting for %s to connect "
                     "(%d of %d ranks arrived)",
                     tcp->timeout_ms, ranks, joined, world_size);
            return root_fail(bootstrap, EPX_ERR_TIMEOUT, detail);
        }

        hello_t hello;
        int64_t hello_deadline = epx__deadline_after_ms(HELLO_WAIT_MS);
        if (hello_deadline > deadline)
            hello_deadline = deadline;
        if (epx__recv_all(fd, &hello, sizeof(hello), hello_deadline, &error_code) != EPX__IO_OK ||
            hello.magic != HELLO_MAGIC) {
            EPX_WARN(EPX_SUBSYS_BOOTSTRAP,
                     "bootstrap: ignored a connection to %s that sent no epx hello",
                     tcp->root_address);
            close(fd);
            continue;
        }
        if (hello.nonce != id->nonce) {
            /* Another run reached our port: not a failure of this group. */
            snprintf(detail, sizeof(detail),
                     "refused a process joining as rank %d at %s: its id's nonce does not "
                     "match rank 0's (the id comes from another run)",
                     (int)hello.rank, tcp->root_address);
            EPX_WARN(EPX_SUBSYS_BOOTSTRAP, "bootstrap: %s", detail);
            refuse(fd, detail);
            continue;
        }
        if (hello.world_size != world_size) {
            snprintf(detail, sizeof(detail),
                     "rank %d joined with world size %d, rank 0 (root) has %d",
                     (int)hello.rank, (int)hello.world_size, world_size);
        } else if (hello.rank < 1 || hello.rank >= world_size) {
            snprintf(detail, sizeof(detail),
                     "a process joined as rank %d, but the ranks other than the root are "
                     "1..%d",
                     (int)hello.rank, world_size - 1);
        } else if (tcp->peer_fds[hello.rank] >= 0) {
            snprintf(detail, sizeof(detail), "two processes joined as rank %d",
                     (int)hello.rank);
        } else {
            tcp->peer_fds[hello.rank] = fd;
            tcp->same_host[hello.rank] = (unsigned char)connection_is_local(fd);
            joined++;
            continue;
        }
        refuse(fd, detail);
        close(listen_fd);
        return root_fail(bootstrap, EPX_ERR_BOOTSTRAP, detail);
    }
    close(listen_fd);

    frame_t ready = {.magic = FRAME_MAGIC, .status = 0, .bytes = 0};
    for (int r = 1; r < world_size; r++) {
        epx__io_result_t result =
            epx__send_all(tcp->peer_fds[r], &ready, sizeof(ready), deadline, &error_code);
        if (result != EPX__IO_OK) {
            snprintf(detail, sizeof(detail), "rank %d %s during join", r,
                     result == EPX__IO_TIMEOUT ? "stopped reading" : "closed its connection");
            return root_fail(bootstrap,
                             result == EPX__IO_TIMEOUT ? EPX_ERR_TIMEOUT : EPX_ERR_REMOTE, detail);
        }
    }
    return EPX_SUCCESS;
}

/* Read what rank r has sent; returns 1 when its block is complete, 0 if not yet, -1 on
 * failure with the status and detail filled. */
static int root_read_block(int fd, int r, incoming_t *in, char *block, size_t bytes,
                           const char *stage, epx_status_t *status, char *detail, size_t size)
{
    size_t want, got = 0;
    char *target;
    if (in->received < sizeof(frame_t)) {
        target = (char *)&in->frame + in->received;
        want = sizeof(frame_t) - in->received;
    } else {
        target = block + (in->received - sizeof(frame_t));
        want = bytes - (in->received - sizeof(frame_t));
    }
    int error_code = 0;
    epx__io_result_t result = want > 0 ? epx__recv_some(fd, target, want, &got, &error_code)
                                       : EPX__IO_OK;
    if (result != EPX__IO_OK) {
        *status = result == EPX__IO_CLOSED ? EPX_ERR_REMOTE : EPX_ERR_SYSTEM;
        if (result == EPX__IO_CLOSED)
            snprintf(detail, size, "rank %d closed its connection during %s", r, stage);
        else
            snprintf(detail, size, "receiving from rank %d during %s failed: %s", r, stage,
                     io_error_text(error_code));
        return -1;
    }
    size_t before = in->received;
    in->received += got;
    if (before < sizeof(frame_t) && in->received >= sizeof(frame_t)) {
        if (in->frame.magic != FRAME_MAGIC || in->frame.status != 0 ||
            in->frame.bytes != bytes) {
            *status = EPX_ERR_BOOTSTRAP;
            snprintf(detail, size,
                     "rank %d contributed %" PRIu64 " bytes to %s where rank 0 contributed %zu "
                     "(the ranks are not running the same collective)",
                     r, in->frame.bytes, stage, bytes);
            return -1;
        }
    }
    return in->received == sizeof(frame_t) + bytes;
}

/*
 * The barrier's answer (words[r] for rank r, words[0] the root's): in each member's
 * word, how late it was past the last barrier's time, replaced by the time at which
 * the ranks on this host leave this one (0: at once). The time lies after the sends up
 * to the last rank on this host (they go out in rank order, each as long as the last
 * barrier's took), and after the ranks' recent lateness (twice it, plus 2 us: wake-ups
 * vary), within align_ns of now. Without an estimate yet (the first barrier), or with
 * no other rank on this host, the ranks leave at once.
 */
static void barrier_release_times(tcp_t *tcp, int world_size, void *recv)
{
    uint64_t *words = recv;
    /* The latest rank's lateness, kept as a maximum that decays by a quarter a barrier
     * (wake-ups vary from one barrier to the next). */
    int64_t late = tcp->late_ns - tcp->late_ns / 4;
    int last_here = 0; /* the last rank on this host, in the order of the sends */
    for (int r = 1; r < world_size; r++) {
        if (tcp->same_host[r])
            last_here = r;
        /* A report beyond the setting is not a wake-up (a clock not ours): at most that. */
        int64_t reported = words[r] < (uint64_t)tcp->align_ns ? (int64_t)words[r] : tcp->align_ns;
        if (tcp->same_host[r] && reported > late)
            late = reported;
    }
    tcp->late_ns = late;
    int64_t at = 0;
    if (tcp->align_ns > 0 && tcp->send_ns > 0 && last_here > 0) {
        int64_t hold = tcp->send_ns * last_here + 2 * late + BARRIER_MARGIN_NS;
        at = epx__now_ns() + (hold < tcp->align_ns ? hold : tcp->align_ns);
    }
    words[0] = (uint64_t)at;
    for (int r = 1; r < world_size; r++)
        words[r] = tcp->same_host[r] ? (uint64_t)at : 0;
}

static epx_status_t root_allgather(epx__bootstrap_t *bootstrap, const void *send, void *recv,
                                   size_t bytes, const char *stage, int barrier)
{
    tcp_t *tcp = bootstrap->impl;
    int world_size = bootstrap->world_size;
    char detail[MAX_REPORT_BYTES];
    memcpy(recv, send, bytes);

    int64_t deadline = epx__deadline_after_ms(tcp->timeout_ms);
    incoming_t *in = tcp->incoming;
    unsigned char *pending = tcp->pending;
    struct pollfd *polls = tcp->polls;
    int *polled_rank = tcp->polled_rank;
    memset(in, 0, sizeof(*in) * (size_t)world_size);
    int left = world_size - 1;
    for (int r = 0; r < world_size; r++)
        pending[r] = r > 0;

    /* Collect every block at once, so that a missing rank is found (and named) with
     * all the others missing at the same time, not one timeout after another. */
    while (left > 0) {
        int count = 0;
        for (int r = 1; r < world_size; r++) {
            if (!pending[r])
                continue;
            polls[count] = (struct pollfd){.fd = tcp->peer_fds[r], .events = POLLIN};
            polled_rank[count++] = r;
        }
        int ready = poll(polls, (nfds_t)count, epx__ms_until(deadline));
        if (ready < 0 && errno != EINTR) {
            snprintf(detail, sizeof(detail), "poll failed during %s: %s", stage, strerror(errno));
            return root_fail(bootstrap, EPX_ERR_SYSTEM, detail);
        }
        if (ready <= 0) {
            if (ready == 0 && epx__now_ns() >= deadline) {
                char ranks[256];
                format_ranks(ranks, sizeof(ranks), pending, world_size);
                snprintf(detail, sizeof(detail),
                         "timed out after %" PRId64 " ms in %s waiting for %s", tcp->timeout_ms,
                         stage, ranks);
                return root_fail(bootstrap, EPX_ERR_TIMEOUT, detail);
            }
            continue;
        }
        for (int i = 0; i < count; i++) {
            if (polls[i].revents == 0)
                continue;
            int r = polled_rank[i];
            epx_status_t status = EPX_SUCCESS;
            int done = root_read_block(polls[i].fd, r, &in[r], (char *)recv + (size_t)r * bytes,
                                       bytes, stage, &status, detail, sizeof(detail));
            if (done < 0)
                return root_fail(bootstrap, status, detail);
            if (done) {
                pending[r] = 0;
                left--;
            }
        }
    }

    if (barrier)
        barrier_release_times(tcp, world_size, recv);
    const int64_t sends_started = epx__now_ns();
    size_t total = (size_t)world_size * bytes;
    frame_t frame = {.magic = FRAME_MAGIC, .status = 0, .bytes = total};
    for (int r = 1; r < world_size; r++) {
        int error_code = 0;
        epx__io_result_t result = epx__send_two(tcp->peer_fds[r], &frame, sizeof(frame), recv,
                                                total, deadline, &error_code);
        if (result == EPX__IO_OK)
            continue;
        if (result == EPX__IO_TIMEOUT) {
            snprintf(detail, sizeof(detail),
                     "timed out after %" PRId64 " ms in %s waiting for rank %d to read the "
                     "result",
                     tcp->timeout_ms, stage, r);
            return root_fail(bootstrap, EPX_ERR_TIMEOUT, detail);
        }
        if (result == EPX__IO_CLOSED)
            snprintf(detail, sizeof(detail), "rank %d closed its connection during %s", r, stage);
        else
            snprintf(detail, sizeof(detail), "sending to rank %d during %s failed: %s", r, stage,
                     io_error_text(error_code));
        return root_fail(bootstrap, result == EPX__IO_CLOSED ? EPX_ERR_REMOTE : EPX_ERR_SYSTEM,
                         detail);
    }
    if (barrier && world_size > 1)
        tcp->send_ns = (epx__now_ns() - sends_started) / (world_size - 1);
    return EPX_SUCCESS;
}

/* ---------------------------------------------------------------- non-root side */

/* Turn an I/O failure on the connection to the root into a status with a message. */
static epx_status_t root_io_error(const tcp_t *tcp, epx__io_result_t result, int error_code,
                                  int64_t waited_ms, const char *stage)
{
    if (result == EPX__IO_TIMEOUT)
        return EPX_ERROR(EPX_ERR_TIMEOUT,
                         "bootstrap: timed out after %" PRId64 " ms in %s waiting for rank 0 "
                         "(root) at %s",
                         waited_ms, stage, tcp->root_address);
    if (result == EPX__IO_CLOSED)
        return EPX_ERROR(EPX_ERR_REMOTE,
                         "bootstrap: rank 0 (root) closed its connection during %s", stage);
    return EPX_ERROR(EPX_ERR_SYSTEM, "bootstrap: talking to rank 0 (root) during %s failed: %s",
                     stage, io_error_text(error_code));
}

/*
 * Read one frame from the root: `expected` bytes of data into `data`, or the root's
 * failure report, which becomes this rank's error.
 */
static epx_status_t read_root_frame(tcp_t *tcp, void *data, size_t expected,
                                    int64_t deadline, int64_t waited_ms, const char *stage,
                                    int *was_report)
{
    frame_t frame;
    *was_report = 0;
    int error_code = 0;
    epx__io_result_t result = epx__recv_all(tcp->root_fd, &frame, sizeof(frame), deadline,
                                            &error_code);
    if (result != EPX__IO_OK)
        return root_io_error(tcp, result, error_code, waited_ms, stage);
    if (frame.magic != FRAME_MAGIC)
        return EPX_ERROR(EPX_ERR_BOOTSTRAP,
                         "bootstrap: rank 0 (root) at %s sent something that is not an epx "
                         "frame during %s",
                         tcp->root_address, stage);
    if (frame.status != 0) {
        char report[MAX_REPORT_BYTES + 1];
        size_t length = frame.bytes < MAX_REPORT_BYTES ? (size_t)frame.bytes : MAX_REPORT_BYTES;
        if (epx__recv_all(tcp->root_fd, report, length, deadline, &error_code) != EPX__IO_OK)
            length = (size_t)snprintf(report, sizeof(report), "(the report was cut off)");
        report[length] = '\0';
        epx_status_t status = (epx_status_t)frame.status;
        if (status <= EPX_SUCCESS || status > EPX_ERR_INTERNAL)
            status = EPX_ERR_REMOTE;
        *was_report = 1;
        return EPX_ERROR(status, "bootstrap: rank 0 (root) reports: %s", report);
    }
    if (frame.bytes != expected)
        return EPX_ERROR(EPX_ERR_BOOTSTRAP,
                         "bootstrap: rank 0 (root) sent %" PRIu64 " bytes in %s, expected %zu "
                         "(the ranks are not running the same collective)",
                         frame.bytes, stage, expected);
    result = epx__recv_all(tcp->root_fd, data, expected, deadline, &error_code);
    return result == EPX__IO_OK ? EPX_SUCCESS
                                : root_io_error(tcp, result, error_code, waited_ms, stage);
}

/*
 * Sending to the root failed. If the root reported a failure before it went away, that
 * report (which says why) is already in our socket: prefer it to "connection closed".
 */
static epx_status_t root_send_error(tcp_t *tcp, epx__io_result_t result, int error_code,
                                    const char *stage)
{
    if (result == EPX__IO_CLOSED) {
        char none[1];
        int was_report = 0;
        epx_status_t reported =
            read_root_frame(tcp, none, 0, epx__now_ns(), 0, stage, &was_report);
        if (was_report)
            return reported;
    }
    return root_io_error(tcp, result, error_code, tcp->timeout_ms, stage);
}

static epx_status_t member_join(epx__bootstrap_t *bootstrap, const epx__unique_id_fields_t *id)
{
    tcp_t *tcp = bootstrap->impl;
    int error_code = 0;
    epx__io_result_t result = epx__connect_retry(id->address, id->port,
                                                 epx__deadline_after_ms(tcp->timeout_ms),
                                                 &tcp->root_fd, &error_code);
    if (result == EPX__IO_TIMEOUT)
        return EPX_ERROR(EPX_ERR_TIMEOUT,
                         "bootstrap: timed out after %" PRId64 " ms in join waiting for rank 0 "
                         "(root) at %s (last connect error: %s)",
                         tcp->timeout_ms, tcp->root_address, io_error_text(error_code));
    if (result != EPX__IO_OK)
        return EPX_ERROR(EPX_ERR_SYSTEM, "bootstrap: cannot connect to rank 0 (root) at %s: %s",
                         tcp->root_address, io_error_text(error_code));

    hello_t hello = {.magic = HELLO_MAGIC,
                     .rank = bootstrap->rank,
                     .world_size = bootstrap->world_size,
                     .reserved = 0,
                     .nonce = id->nonce};
    /* The root's own deadline started no later than our connection was accepted, so
     * timeout + grace from now covers its whole join and its report of a missing rank. */
    int64_t waited_ms = tcp->timeout_ms + tcp->grace_ms;
    int64_t deadline = epx__deadline_after_ms(waited_ms);
    result = epx__send_all(tcp->root_fd, &hello, sizeof(hello), deadline, &error_code);
    if (result != EPX__IO_OK)
        return root_send_error(tcp, result, error_code, "join");
    char none[1];
    int was_report = 0;
    return read_root_frame(tcp, none, 0, deadline, waited_ms, "join", &was_report);
}

static epx_status_t member_allgather(epx__bootstrap_t *bootstrap, const void *send,
                                     void *recv, size_t bytes, const char *stage)
{
    tcp_t *tcp = bootstrap->impl;
    int64_t waited_ms = tcp->timeout_ms + tcp->grace_ms;
    int64_t deadline = epx__deadline_after_ms(waited_ms);
    frame_t frame = {.magic = FRAME_MAGIC, .status = 0, .bytes = bytes};
    int error_code = 0;
    epx__io_result_t result = epx__send_two(tcp->root_fd, &frame, sizeof(frame), send, bytes,
                                            deadline, &error_code);
    if (result != EPX__IO_OK)
        return root_send_error(tcp, result, error_code, stage);
    int was_report = 0;
    return read_root_frame(tcp, recv, (size_t)bootstrap->world_size * bytes, deadline,
                           waited_ms, stage, &was_report);
}

/* ---------------------------------------------------------------- the kind */

static epx_status_t tcp_allgather(epx__bootstrap_t *bootstrap, const void *send, void *recv,
                                  size_t bytes, const char *stage)
{
    if (bootstrap->world_size == 1) {
        memcpy(recv, send, bytes);
        return EPX_SUCCESS;
    }
    if (bootstrap->rank == 0)
        return root_allgather(bootstrap, send, recv, bytes, stage, 0);
    return member_allgather(bootstrap, send, recv, bytes, stage);
}

/* Until `at` (CLOCK_MONOTONIC ns; 0 or past: return at once), sleeping until the last
 * BARRIER_SPIN_NS and spinning through them; how late it was when called. */
static int64_t wait_until(int64_t at)
{
    int64_t now = epx__now_ns();
    if (at <= 0 || at - now > BARRIER_MAX_WAIT_NS)
        return 0;
    if (now >= at)
        return now - at;
    if (at - now > BARRIER_SPIN_NS) {
        int64_t wake = at - BARRIER_SPIN_NS;
        struct timespec until = {.tv_sec = wake / 1000000000, .tv_nsec = wake % 1000000000};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
        }
    }
    while (epx__now_ns() < at) {
    }
    return 0;
}

static epx_status_t tcp_barrier(epx__bootstrap_t *bootstrap)
{
    tcp_t *tcp = bootstrap->impl;
    uint64_t *words = tcp->barrier_words;
    if (bootstrap->world_size == 1)
        return EPX_SUCCESS;
    if (bootstrap->rank == 0) {
        uint64_t none = 0;
        EPX_CHECK(root_allgather(bootstrap, &none, words, sizeof(uint64_t), "barrier", 1));
        (void)wait_until((int64_t)words[0]);
        return EPX_SUCCESS;
    }
    uint64_t late = (uint64_t)tcp->my_late_ns;
    EPX_CHECK(member_allgather(bootstrap, &late, words, sizeof(uint64_t), "barrier"));
    tcp->my_late_ns = wait_until((int64_t)words[bootstrap->rank]);
    return EPX_SUCCESS;
}

static void tcp_free(tcp_t *tcp, int world_size)
{
    if (tcp == NULL)
        return;
    if (tcp->root_fd >= 0)
        close(tcp->root_fd);
    if (tcp->peer_fds != NULL)
        for (int r = 0; r < world_size; r++)
            if (tcp->peer_fds[r] >= 0)
                close(tcp->peer_fds[r]);
    free(tcp->peer_fds);
    free(tcp->barrier_words);
    free(tcp->same_host);
    free(tcp->incoming);
    free(tcp->pending);
    free(tcp->polls);
    free(tcp->polled_rank);
    free(tcp);
}

static void tcp_destroy(epx__bootstrap_t *bootstrap)
{
    tcp_free(bootstrap->impl, bootstrap->world_size);
}

static const epx__bootstrap_kind_t tcp_kind = {
    .name = "tcp",
    .allgather = tcp_allgather,
    .barrier = tcp_barrier,
    .destroy = tcp_destroy,
};

/* A world of one needs no sockets, and then `id` may be NULL. */
epx_status_t epx__bootstrap_create_tcp(const epx_unique_id_t *id, int rank, int world_size,
                                       int64_t timeout_ms, epx__bootstrap_t **bootstrap)
{
    if (bootstrap == NULL || (id == NULL && world_size > 1))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "bootstrap: %s is NULL",
                         bootstrap == NULL ? "bootstrap" : "unique id");
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "bootstrap: rank %d is not in a world of %d",
                         rank, world_size);
    if (timeout_ms <= 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "bootstrap: timeout_ms %" PRId64 " is not positive",
                         timeout_ms);
    epx__unique_id_fields_t fields;
    memset(&fields, 0, sizeof(fields));
    if (world_size > 1)
        EPX_CHECK(epx__unique_id_parse(id->internal, &fields));

    tcp_t *tcp = calloc(1, sizeof(*tcp));
    if (tcp == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "bootstrap: out of memory");
    tcp->timeout_ms = timeout_ms;
    tcp->grace_ms = timeout_ms < 2000 ? timeout_ms : 2000;
    tcp->root_fd = -1;
    tcp->peer_fds = malloc(sizeof(int) * (size_t)world_size);
    tcp->barrier_words = calloc((size_t)world_size, sizeof(uint64_t));
    int root_state_ok = 1;
    if (rank == 0) {
        tcp->align_ns = epx__param_int(EPX_PARAM_BARRIER_ALIGN_US) * 1000;
        tcp->same_host = calloc((size_t)world_size, 1);
        tcp->incoming = calloc((size_t)world_size, sizeof(incoming_t));
        tcp->pending = calloc((size_t)world_size, 1);
        tcp->polls = calloc((size_t)world_size, sizeof(struct pollfd));
        tcp->polled_rank = calloc((size_t)world_size, sizeof(int));
        root_state_ok = tcp->incoming != NULL && tcp->pending != NULL && tcp->polls != NULL &&
                        tcp->polled_rank != NULL && tcp->same_host != NULL;
    }
    if (tcp->peer_fds == NULL || tcp->barrier_words == NULL || !root_state_ok) {
        tcp_free(tcp, 0);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "bootstrap: out of memory");
    }
    for (int r = 0; r < world_size; r++)
        tcp->peer_fds[r] = -1;
    char dotted[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &fields.address, dotted, sizeof(dotted));
    snprintf(tcp->root_address, sizeof(tcp->root_address), "%s:%u", dotted,
             (unsigned)fields.port);

    epx__bootstrap_t *created = epx__bootstrap_new(&tcp_kind, rank, world_size, tcp);
    if (created == NULL) {
        tcp_free(tcp, world_size);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "bootstrap: out of memory");
    }
    if (world_size > 1) {
        epx_status_t status = rank == 0 ? root_join(created, &fields) : member_join(created, &fields);
        if (status != EPX_SUCCESS) {
            epx__bootstrap_destroy(created);
            return status;
        }
    }
    EPX_DEBUG(EPX_SUBSYS_BOOTSTRAP, "bootstrap: rank %d of %d joined through %s", rank,
              world_size, world_size > 1 ? tcp->root_address : "no sockets (world of one)");
    *bootstrap = created;
    return EPX_SUCCESS;
}
