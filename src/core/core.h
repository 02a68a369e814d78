/*
 * Core services shared by every part of the library: error reporting, logging,
 * tunables. Internal: never installed.
 */
#ifndef EPX_CORE_H
#define EPX_CORE_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "epx.h"

/* ---------------------------------------------------------------- errors */

/*
 * Record a failure: formats "message" into the thread-local last-error text (returned
 * by epx_last_error), logs it once at WARN level with file:line, and returns `status`
 * so that callers can write `return EPX_ERROR(EPX_ERR_INVALID_ARG, "x: %d", v);`.
 */
epx_status_t epx__error(epx_status_t status, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define EPX_ERROR(status, ...) epx__error((status), __FILE__, __LINE__, __VA_ARGS__)

/* Forget the last error of this thread (entry points call it first). */
void epx__clear_error(void);

/* Return early with the callee's status; the callee already recorded the message. */
#define EPX_CHECK(call)                          \
    do {                                         \
        epx_status_t epx_check_status_ = (call); \
        if (epx_check_status_ != EPX_SUCCESS)    \
            return epx_check_status_;            \
    } while (0)

/* Store the callee's status in `status` and jump to an unwinding label on failure. */
#define EPX_CHECK_GOTO(call, status, label) \
    do {                                    \
        (status) = (call);                  \
        if ((status) != EPX_SUCCESS)        \
            goto label;                     \
    } while (0)

/* ---------------------------------------------------------------- logging */

typedef enum {
    EPX_LOG_NONE = 0,
    EPX_LOG_ERROR = 1,
    EPX_LOG_WARN = 2,
    EPX_LOG_INFO = 3,
    EPX_LOG_DEBUG = 4,
    EPX_LOG_TRACE = 5,
} epx_log_level_t;

/* Subsystems, a bit each, selected by EPX_LOG_SUBSYS. */
typedef enum {
    EPX_SUBSYS_CORE = 1 << 0,
    EPX_SUBSYS_BOOTSTRAP = 1 << 1,
    EPX_SUBSYS_TRANSPORT = 1 << 2,
    EPX_SUBSYS_OPS = 1 << 3,
    EPX_SUBSYS_TOOLS = 1 << 4,
    EPX_SUBSYS_ALL = 0x1f,
} epx_log_subsys_t;

/* Nonzero when a message of this level and subsystem would be written. */
int epx__log_enabled(epx_log_level_t level, epx_log_subsys_t subsys);
void epx__log(epx_log_level_t level, epx_log_subsys_t subsys, const char *file, int line,
              const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* The rank printed in log lines (set when a group is created; -1 before). */
void epx__log_set_rank(int rank);

#define EPX_LOG(level, subsys, ...)                                     \
    do {                                                                \
        if (epx__log_enabled((level), (subsys)))                        \
            epx__log((level), (subsys), __FILE__, __LINE__, __VA_ARGS__); \
    } while (0)
#define EPX_WARN(subsys, ...) EPX_LOG(EPX_LOG_WARN, subsys, __VA_ARGS__)
#define EPX_INFO(subsys, ...) EPX_LOG(EPX_LOG_INFO, subsys, __VA_ARGS__)
#define EPX_DEBUG(subsys, ...) EPX_LOG(EPX_LOG_DEBUG, subsys, __VA_ARGS__)
#define EPX_TRACE(subsys, ...) EPX_LOG(EPX_LOG_TRACE, subsys, __VA_ARGS__)

/* ---------------------------------------------------------------- tunables */

/*
 * The one table of EPX_* environment variables. X(NAME, type, default, min, max, doc):
 * type INT uses default/min/max as integers; STRING uses the default string.
 * Never call getenv for an EPX_* variable anywhere else.
 */
#define EPX_PARAM_MAP(X)                                                                   \
    X(LOG_LEVEL, STRING, "warn", 0, 0,                                                      \
      "Log level: none, error, warn, info, debug, trace")                                   \
    X(LOG_SUBSYS, STRING, "all", 0, 0,                                                      \
      "Comma list of subsystems to log: core, bootstrap, transport, ops, tools, all")       \
    X(LOG_FILE, STRING, "", 0, 0,                                                           \
      "Log to this file instead of stderr; %p is replaced by the pid, %r by the rank")      \
    X(TIMEOUT_MS, INT, 30000, 1, 86400000,                                                  \
      "Longest wait for a peer rank, in milliseconds, before an operation fails")           \
    X(NUM_SMS, INT, 16, 1, 1024, "SMs per rank used by GPU kernels when a buffer asks for 0") \
    X(BACKEND, STRING, "auto", 0, 0, "Backend for epx_group_create_from_env: auto, host, cuda") \
    X(BOOTSTRAP_ADDR, STRING, "127.0.0.1", 0, 0,                                            \
      "IPv4 address rank 0 listens on for the TCP rendezvous (epx_get_unique_id)")          \
    X(RANK, INT, -1, -1, 1048576, "This process's rank (set by epx launch)")                \
    X(WORLD_SIZE, INT, 0, 0, 1048576, "Number of ranks (set by epx launch); 0 = not launched") \
    X(LOCAL_RANK, INT, -1, -1, 1048576, "Rank within the node (set by epx launch)")         \
    X(RANKS_PER_NODE, INT, 0, 0, 1048576,                                                   \
      "Ranks per NVLink domain; 0 = all ranks in one (split into virtual nodes for tests)") \
    X(UNIQUE_ID, STRING, "", 0, 0, "Rendezvous id text from rank 0 (set by epx launch)") \
    X(LIBRARY, STRING, "", 0, 0,                                                            \
      "Path of libepx.so for the Python package (read by Python, listed here for epx params)") \
    X(NVSHMEM_PLUGIN, STRING, "", 0, 0,                                                     \
      "Path of libepx_nvshmem.so (low-latency CUDA); default: beside libepx, the build, "  \
      "the loader's path")                                                                  \
    X(BARRIER_ALIGN_US, INT, 200, 0, 10000,                                                 \
      "Longest epx_group_barrier (TCP bootstrap, read on rank 0) holds a rank so that the " \
      "ranks on rank 0's host leave it together; 0 = each leaves when rank 0's answer "     \
      "reaches it")                                                                         \
    X(NORMAL_KERNELS, INT, 3, 1, 3,                                                         \
      "Normal-mode data kernels on one node: 1 = vector copies, 2 = TMA bulk-copy rings, " \
      "3 = staged dispatch (loader warps fill shared-memory rings, store warps empty them) " \
      "with the vector combine")                                                            \
    X(AUTO_REGISTER, INT, 0, 0, 1,                                                          \
      "Buffers whose config.auto_register is 0: 1 = combine maps an x outside the buffer " \
      "for the peers and reads it in place (docs/DESIGN.md), 0 = copies it in")            \
    X(LL_FORCE_PUTS, INT, 0, 0, 1,                                                          \
      "1 = low-latency kernels use NVSHMEM puts even where a direct peer pointer exists")  \
    X(LL_KERNELS, INT, 2, 1, 2,                                                             \
      "Low-latency CUDA kernels: 1 = receive packs the rows, 2 = rows placed once by the " \
      "sender (docs/LOW_LATENCY.md)")                                                        \
    X(LL_COMBINE_RECV, INT, 2, 1, 2,                                                        \
      "Low-latency kernels 2, combine receive: 1 = cp.async stages through shared memory, " \
      "2 = loads into registers, 16 a lane in flight (faster, docs/PERFORMANCE.md)")       \
    X(LL_RELEASE, INT, 2, 1, 2,                                                             \
      "Low-latency kernels 2, how a slot is given back: 1 = \"done\" flags at the end of "   \
      "each combine, 2 = inferred from the next dispatch and the outputs-ready flags (one " \
      "system-scope release round a step fewer, faster; every rank must set the same)")   \
    X(LL_TRACE, STRING, "", 0, 0,                                                           \
      "Developers: low-latency kernels 2 record phase times; written to <value>.<rank> when " \
      "the buffer is destroyed (scripts/ll-trace reads them)")                              \
    X(NORMAL_TRACE, STRING, "", 0, 0,                                                       \
      "Developers: the normal-mode combine (one node) records when each phase ends; "      \
      "written to <value>.<rank> when the buffer is destroyed (scripts/normal-trace reads them)") \
    X(XN_TEST_DELAY_NS, INT, 0, 0, 1000000,                                                 \
      "Tests: internode puts go in reverse token order, half of them held up to this many ns") \
    X(XN_RING_TOKENS, INT, 0, 0, 1048576,                                                   \
      "Internode normal mode: tokens in flight per (rank, node) channel, 0 or a power of two; " \
      "0 = slots for the worst case, no credits")

typedef enum {
#define EPX_PARAM_ENUM_(name, type, def, min, max, doc) EPX_PARAM_##name,
    EPX_PARAM_MAP(EPX_PARAM_ENUM_)
#undef EPX_PARAM_ENUM_
    EPX_PARAM_COUNT_
} epx_param_id_t;

/*
 * Read and validate every EPX_* variable once (thread-safe, idempotent). A bad value is
 * EPX_ERR_INVALID_ARG naming the variable; an unknown EPX_* variable gets a warning.
 * Entry points that read tunables call this first.
 */
epx_status_t epx__params_load(void);
/* Values in force (epx__params_load must have succeeded; else the defaults). */
int64_t epx__param_int(epx_param_id_t id);
const char *epx__param_string(epx_param_id_t id);
/*
 * The variable's value in the environment now, checked like the cached one, bypassing
 * the cache: for the launcher's variables, which a program may set with setenv after
 * its first epx call. *is_set = 0 (and the default) when unset or empty. INT tunables
 * fill *int_value, STRING ones `text` (may be NULL for INT). EPX_ERR_INVALID_ARG naming
 * the variable for a bad value.
 */
epx_status_t epx__param_read_now(epx_param_id_t id, int *is_set, int64_t *int_value, char *text,
                                 size_t text_size);
/* Print the table (name, type, default, value in force, doc) for `epx params`. */
void epx__params_print(FILE *out);
/* Tests only: forget the loaded values so the next load reads the environment again. */
void epx__params_reset(void);

/* ---------------------------------------------------------------- time */

/* Monotonic clock in nanoseconds. */
int64_t epx__now_ns(void);

#endif /* EPX_CORE_H */
