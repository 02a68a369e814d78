/*
 * epx tool support: what the `epx` command (tools/) and programs like it need beyond
 * include/epx.h. Applications do not need it. Same conventions as epx.h (statuses,
 * epx_last_error, struct sizes); part of the library's exported epx_* API.
 *
 *   - the tunables table (the EPX_* environment variables: `epx params`, `epx doctor`)
 *   - the communication memory a buffer would take on a group of a given shape,
 *     without forming the group (`epx doctor` plans for ranks it does not start)
 *   - how internode normal mode lays out such a buffer (`epx bench`, `epx doctor`)
 *   - where the NVSHMEM plugin of low-latency CUDA buffers is (`epx doctor`)
 *   - the fan-out copy of normal-mode dispatch, alone (`epx bench --mode fanout`)
 *   - the fan-in sum of normal-mode combine, alone (the same bench's fan-in rows)
 */
#ifndef EPX_TOOL_H
#define EPX_TOOL_H

#include <stdio.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- tunables */

/*
 * Read and check every EPX_* variable (once per process; later calls give the same
 * answer). A bad value is EPX_ERR_INVALID_ARG naming the variable; that variable keeps
 * its default. An unknown EPX_* name is a warning in the log.
 */
epx_status_t epx_params_load(void);

/* One row of the table: the values in force (the defaults until epx_params_load). */
typedef struct {
    size_t size;          /* sizeof(epx_param_info_t): set by EPX_PARAM_INFO_INIT */
    const char *name;     /* "EPX_TIMEOUT_MS" */
    int is_int;           /* 1: an integer (int_*), 0: text (string_*) */
    int64_t int_default;
    int64_t int_value;
    const char *string_default; /* NULL for integers */
    const char *string_value;   /* NULL for integers; words are lower case */
    const char *doc;            /* one line */
} epx_param_info_t;

#define EPX_PARAM_INFO_INIT {sizeof(epx_param_info_t), NULL, 0, 0, 0, NULL, NULL, NULL}

/* Rows of the table: epx_param_info takes 0 .. epx_param_count() - 1. */
int epx_param_count(void);
/* Row `index` of the table (EPX_ERR_INVALID_ARG past the last row). */
epx_status_t epx_param_info(int index, epx_param_info_t *info);
/* The row named `name` ("EPX_NUM_SMS"); EPX_ERR_INVALID_ARG when there is none. */
epx_status_t epx_param_find(const char *name, epx_param_info_t *info);
/* The table as `epx params` shows it: name, type, default, value in force, doc. */
epx_status_t epx_params_print(FILE *out);

/* ---------------------------------------------------------------- planning */

/*
 * epx_buffer_size for a group that is not formed: `world_size` ranks (>= 1),
 * `ranks_per_node` per node (0 = all on one), on `backend` (AUTO = the backend a group
 * would pick here). The same checks and answer as epx_buffer_size on such a group. The
 * CUDA backend may initialise CUDA to answer.
 */
epx_status_t epx_buffer_size_plan(epx_backend_t backend, int world_size, int ranks_per_node,
                                  const epx_buffer_config_t *config, size_t *bytes_per_rank);

/* ---------------------------------------------------------------- internode normal mode */

/*
 * How the CUDA backend runs normal mode across nodes (docs/INTERNODE.md) for a buffer of
 * `config` on `world_size` ranks, `ranks_per_node` per node (two nodes or more), with the
 * EPX_* settings in force (EPX_XN_RING_TOKENS, EPX_NUM_SMS): its record and partial-sum
 * slots, whether credits flow, the memory per rank and how the kernels split their
 * warps. Planning only: no group is formed, no GPU is needed. Outputs are written only
 * on success; EPX_ERR_UNSUPPORTED when this build has no CUDA backend.
 */
typedef struct {
    size_t size;               /* sizeof(epx_internode_plan_t): set by EPX_INTERNODE_PLAN_INIT */
    int num_nodes;
    int credits;               /* 1: rings with credits; 0: slots for the worst case */
    int64_t slots_per_channel; /* record slots per (rank, node) channel, the same for partial
                                  sums: the ring, or max_tokens_per_rank */
    int64_t chunk_tokens;      /* records per put and per credit (0 without credits) */
    int64_t record_bytes;      /* one record slot: bf16 row, fp8 scales, top-k, rows */
    int64_t partial_bytes;     /* one partial-sum slot: bf16 row and top-k weights */
    size_t record_slot_bytes;  /* every record slot of a rank, in and out */
    size_t partial_slot_bytes; /* every partial-sum slot of a rank, in and out */
    size_t bytes_per_rank;     /* epx_buffer_size of the config on such a group */
    int64_t puts_in_flight;    /* most record puts one rank may have in flight to one peer */
    int num_sms;               /* the SM budget the warp counts below are for */
    int sender_warps;          /* send tokens (dispatch) / partial sums (combine) */
    int receiver_warps;        /* forward records (dispatch) / add up own tokens (combine) */
    int credit_warps;          /* return credits (0 without credits) */
} epx_internode_plan_t;

#define EPX_INTERNODE_PLAN_INIT                                                            \
    {sizeof(epx_internode_plan_t), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

epx_status_t epx_internode_plan(int world_size, int ranks_per_node,
                                const epx_buffer_config_t *config, epx_internode_plan_t *plan);

/*
 * Find and load the NVSHMEM plugin (libepx_nvshmem.so) as a low-latency CUDA buffer would
 * (EPX_NVSHMEM_PLUGIN, beside libepx, the build directory when libepx runs from it, the
 * loader's path): its path (written to `path`, `path_size` bytes) and the NVSHMEM version
 * linked into it. Starts nothing: NVSHMEM is
 * not initialised. EPX_ERR_UNSUPPORTED, with where it looked, when the plugin is absent,
 * does not load, or this build has no CUDA backend.
 */
epx_status_t epx_nvshmem_plugin_probe(char *path, size_t path_size, int version[3]);

/* ---------------------------------------------------------------- copy ceiling */

/* How epx_fanout_copy moves the rows (the CPU backend copies with memcpy either way). */
typedef enum {
    /* 16-byte vector loads and stores from registers, one row per warp at a time: the
     * access pattern of the vector dispatch kernel (EPX_NORMAL_KERNELS=1). */
    EPX_FANOUT_VECTOR = 1,
    /* TMA bulk copies through a ring of rows in shared memory per warp: that of the
     * bulk-copy dispatch kernel (EPX_NORMAL_KERNELS=2; needs sm_90). */
    EPX_FANOUT_BULK = 2,
    /* Loads and stores split between warps: one warp per block bulk-loads rows (TMA) into
     * a ring in shared memory, the block's other 16 warps store each row from there to
     * every destination with 16-byte vectors: that of the staged dispatch kernel
     * (EPX_NORMAL_KERNELS=3; needs sm_90). */
    EPX_FANOUT_STAGED = 3,
} epx_fanout_kernel_t;

typedef struct {
    size_t size;                /* sizeof(epx_fanout_args_t): set by EPX_FANOUT_ARGS_INIT */
    epx_fanout_kernel_t kernel; /* EPX_FANOUT_VECTOR (default), _BULK or _STAGED */
    const void *src;            /* the rows, 16-byte aligned; device memory on CUDA */
    int64_t src_pitch;          /* bytes between source rows, a multiple of 16; 0 = row_bytes */
    int64_t rows;               /* 0 to config.max_tokens_per_rank */
    int64_t row_bytes;          /* a multiple of 16, at most config.hidden * 2 */
    /* Destinations per row on average, 1 to world_size (in thousandths): row i goes to
     * k_i = floor((i + 1) * fanout) - floor(i * fanout) ranks. 1 = a plain copy. */
    double fanout;
    int num_sms; /* SMs to use, 0 = the buffer's num_sms (at most 1024) */
    /* EPX_FANOUT_BULK: row slots of each warp's ring; EPX_FANOUT_STAGED: of the block's
     * ring. 2 to 8 (the shared memory of a block must hold them: EPX_ERR_CUDA when it
     * cannot); 0 = as many as the bulk dispatch kernel's budget holds. */
    int stages;
} epx_fanout_args_t;

#define EPX_FANOUT_ARGS_INIT                                                               \
    {sizeof(epx_fanout_args_t), EPX_FANOUT_VECTOR, NULL, 0, 0, 0, 1.0, 0, 0}

/*
 * The fan-out copy that normal-mode dispatch does, without its routing and signals, to
 * measure the ceiling of that access pattern on the machine: each of `rows` source rows
 * is read once and written to k_i ranks of the buffer's group, (rank + i + j) mod
 * world_size for j < k_i, at row rank * max_tokens_per_rank + i of each one's
 * combine-input region (epx_get_combine_input; the same memory peers map for normal
 * mode). Queued on `stream` (a cudaStream_t on CUDA, NULL = the legacy default stream;
 * ignored on the CPU backend, which copies before returning); no signal to or wait for
 * the peers: the caller brackets the call with epx_group_barrier and a stream
 * synchronisation, and times it. Every rank of the group may write into this rank's
 * region meanwhile, so no operation may run on the buffer concurrently; what the
 * caller had written into the combine-input region is overwritten. Not for buffers
 * whose group spans nodes (EPX_ERR_UNSUPPORTED).
 */
epx_status_t epx_fanout_copy(epx_buffer_t buffer, const epx_fanout_args_t *args, void *stream);

/* ---------------------------------------------------------------- fan-in ceiling */

/* How epx_fanin_reduce reads and adds the rows (the CPU backend loops either way). */
typedef enum {
    /* Every warp of a block takes one output row at a time (the next by ticket as it
     * frees up) and loads 16-byte vectors of several source rows at once per lane
     * before adding them: the access pattern of the vector combine kernel, with its
     * loads in flight (6 rows x 3 vectors a lane on 8 blocks or fewer, else 8 x 2). */
    EPX_FANIN_VECTOR = 1,
} epx_fanin_kernel_t;

typedef struct {
    size_t size;               /* sizeof(epx_fanin_args_t): set by EPX_FANIN_ARGS_INIT */
    epx_fanin_kernel_t kernel; /* EPX_FANIN_VECTOR (the default and only one) */
    void *dst;                 /* the output rows, 16-byte aligned; device memory on CUDA */
    int64_t dst_pitch;         /* bytes between output rows, a multiple of 16; 0 = row_bytes */
    int64_t rows;              /* 0 to config.max_tokens_per_rank */
    int64_t row_bytes;         /* bf16 values: a multiple of 16, at most config.hidden * 2 */
    /* Sources per row on average, 1 to world_size (in thousandths): row i adds up
     * k_i = floor((i + 1) * fanin) - floor(i * fanin) rows, as epx_fanout_copy's row i
     * goes to k_i ranks. 1 = a copy through fp32 (which turns -0.0 into +0.0). */
    double fanin;
    int num_sms; /* SMs to use, 0 = the buffer's num_sms (at most 1024) */
} epx_fanin_args_t;

#define EPX_FANIN_ARGS_INIT {sizeof(epx_fanin_args_t), EPX_FANIN_VECTOR, NULL, 0, 0, 0, 1.0, 0}

/*
 * The fan-in sum that normal-mode combine does, without its routing and signals, to
 * measure the ceiling of that access pattern on the machine: output row i (i < rows) is
 * the sum of k_i bf16 rows, one from each of the ranks (rank + i + j) mod world_size for
 * j < k_i, each read at row rank * max_tokens_per_rank + i of that rank's combine-input
 * region (epx_get_combine_input; read through the mapping peers use in normal mode):
 * exactly the places epx_fanout_copy with fanout = fanin writes this rank's row i to,
 * so a fan-out followed by a fan-in returns each row added up k_i times. The rows are
 * added element by element in fp32 starting from 0.0f, in the order j = 0, 1, ...,
 * rounded once to bf16 (to nearest, ties to even; NaN stays NaN) and stored at dst + i *
 * dst_pitch; the other bytes of dst are not written. Queued on `stream` (a cudaStream_t
 * on CUDA, NULL = the legacy default stream; ignored on the CPU backend, which adds
 * before returning); no signal to or wait for the peers: the caller brackets the call
 * with epx_group_barrier and a stream synchronisation (the peers' rows must be in place
 * before it starts, and stay until every rank's call is done), and times it. dst must
 * not overlap the buffer. No operation may run on the buffer concurrently (nor an
 * epx_fanout_copy: the two share a ticket counter on CUDA). Not for buffers whose group
 * spans nodes (EPX_ERR_UNSUPPORTED).
 */
epx_status_t epx_fanin_reduce(epx_buffer_t buffer, const epx_fanin_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TOOL_H */
