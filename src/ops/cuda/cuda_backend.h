/*
 * Host side of the CUDA backend (normal mode over CUDA IPC): the buffer's state, the
 * handles' device state, and the helpers the operation files share.
 *
 * A buffer whose group spans several nodes runs normal mode in internode form
 * (internode.c, nvshmem/xn_*.cu): the same memory layout and host logic, its shared
 * allocation in NVSHMEM symmetric memory instead of CUDA IPC, ranks of its own node
 * reached by stores and the other nodes by NVSHMEM puts.
 *
 * Files: backend.c (the vtable, buffers, layout, abort), dispatch.c, combine.c,
 * errors.c (device error record -> status, host waits), pool.c (device memory of
 * handles), fanout.c and fanin.c (tool support: epx_fanout_copy, epx_fanin_reduce).
 * Kernels via launch.h: layout.cu, dispatch.cu and combine.cu (vector form),
 * dispatch_bulk.cu and combine_bulk.cu (bulk-copy form, EPX_NORMAL_KERNELS=2),
 * dispatch_staged.cu (staged form, =3, the default; the ring dispatches' shared parts in
 * dispatch_parts.cuh), copy.cu, copy_fanout.cu, reduce_fanin.cu.
 */
#ifndef EPX_OPS_CUDA_BACKEND_H
#define EPX_OPS_CUDA_BACKEND_H

#include <cuda_runtime_api.h>

#include "ops/backend.h"
#include "ops/cuda/launch.h"
#include "transport/cuda_status.h"
#include "transport/cuda_ipc/ipc.h"
#include "transport/shm/shm.h"

/* ---------------------------------------------------------------- handle memory */

/*
 * Fixed-size device slots for handles, reused across dispatches: cudaFree would stall
 * the device at every handle destroy, and cudaMalloc is not allowed while a stream is
 * being captured into a CUDA graph. Reference counted, so a handle may outlive its
 * buffer's destroy without touching freed memory.
 */
typedef struct epx__cuda_pool epx__cuda_pool_t;

epx_status_t epx__cuda_pool_create(int device, size_t slot_bytes, int preallocate,
                                   epx__cuda_pool_t **pool);
/* A free slot (allocating one when none is free); NULL with the error recorded. */
void *epx__cuda_pool_get(epx__cuda_pool_t *pool);
void epx__cuda_pool_put(epx__cuda_pool_t *pool, void *slot);
void epx__cuda_pool_retain(epx__cuda_pool_t *pool);
/* Drop a reference; the last one frees every slot. */
void epx__cuda_pool_release(epx__cuda_pool_t *pool);

/* A handle's device arrays (struct epx_handle.backend_state). */
typedef struct {
    epx__cuda_pool_t *pool;
    void *slot;
    int32_t *send_row;        /* [num_tokens][R]: row of each token at each rank, or -1 */
    int32_t *recv_count;      /* rows received */
    int32_t *recv_per_expert; /* [L], rounded up to the handle's alignment */
    int32_t *rank_prefix;     /* [R][R] rank_prefix_matrix */
    epx__cuda_xn_routing_t xn; /* internode mode; NULL arrays on one node */
} epx__cuda_handle_state_t;

/* ---------------------------------------------------------------- buffers */

typedef struct epx__cuda_xn epx__cuda_xn_t;

/*
 * Combine inputs mapped on demand (config.auto_register, auto_register.c). Slot i is
 * row EPX_CUDA_MAX_REGISTERED + i of the device range table; every rank may hold one
 * allocation of its own there (or none). `occupied` and `last_use` are the same on
 * every rank: they change only from what every rank learns in each combine's exchange.
 */
typedef struct {
    epx__cuda_ipc_allocation_t mine; /* this rank's allocation here (bytes 0: none) */
    epx__cuda_ipc_range_t *range;    /* every rank's, as mapped here */
    int occupied;                    /* some rank has an allocation here */
    uint64_t last_use;               /* the last combine (calls) that read from here */
} epx__cuda_auto_slot_t;

typedef struct {
    int on;                   /* config.auto_register resolved; 0 after a failed mapping */
    epx__shm_t *shm;          /* the per-combine exchange (host shared memory) */
    uint64_t calls;           /* combines so far */
    uintptr_t refused_base;   /* the last allocation found without an IPC handle */
    unsigned long long refused_id;
    epx__cuda_auto_slot_t slots[EPX_CUDA_AUTO_SLOTS];
} epx__cuda_auto_t;

typedef struct {
    /* Normal mode: over CUDA IPC on one node (ipc), over NVSHMEM across nodes (xn). */
    epx__cuda_ipc_t *ipc;
    epx__cuda_xn_t *xn;
    char *shared;                 /* this rank's shared allocation (either kind) */
    char **peer_bases;            /* [R] host copy of the peers' bases (NULL: other node) */
    epx__cuda_shape_t shape;      /* what kernels see (device addresses) */
    epx__cuda_local_t *local;     /* device */
    epx__cuda_mapped_t *mapped;   /* host address of the mapped block */
    int32_t *mapped_rank_counts;  /* host addresses of its arrays */
    int32_t *mapped_recv_per_expert;
    uint64_t next_ticket;
    cudaStream_t abort_stream;    /* non-blocking: reaches peers while kernels spin */
    uint64_t *abort_word;         /* pinned host staging for the abort word */
    epx__cuda_pool_t *pool;
    size_t handle_slot_bytes;
    int num_sms;
    int kernels; /* EPX_CUDA_KERNELS_*: EPX_NORMAL_KERNELS when the buffer was made */
    /* The device error record, once turned into a status (reported once, then kept). */
    int error_seen;
    epx_status_t error_status;
    int error_culprit;
    char error_message[400];
    struct epx__cuda_ll *ll; /* low-latency mode (ll.h), NULL when off */
    /* epx_buffer_register's ranges as mapped here, by slot (registered.c) */
    epx__cuda_ipc_range_t *registered[EPX_CUDA_MAX_REGISTERED];
    epx__cuda_ipc_cache_t ipc_cache;
    epx__cuda_auto_t autoreg; /* combine inputs mapped on demand (auto_register.c) */
} epx__cuda_buffer_t;

/* Collective: every rank's status, the bootstrap's vote (its answer; EPX_ERR_REMOTE "<op>:
 * rank r <what>" naming the first rank that failed). */
epx_status_t epx__cuda_vote(epx_group_t group, epx_status_t status, const char *op,
                            const char *what);

/*
 * One rank's GPU and SM budget, as the last vote of buffer_create gathers them: ranks
 * sharing one GPU (CUDA MPS) whose budgets add up to more SMs than it has can leave a
 * rank's kernels without an SM while its peers' kernels wait for it (then operations
 * fail on their timeout), so the lowest of them warns.
 */
typedef struct {
    int32_t status;   /* the vote's (epx__bootstrap_vote) */
    int32_t num_sms;  /* the buffer's SM budget on this rank */
    uint8_t uuid[16]; /* the GPU's (cudaDeviceProp.uuid); all zero when unknown */
} epx__cuda_gpu_vote_t;

/* Among `votes` ([world_size]), the ranks on rank `rank`'s GPU: how many (itself
 * included), the lowest of them, and their SM budgets added up. A rank whose GPU is
 * unknown (an all-zero UUID) counts alone. */
void epx__cuda_gpu_share(const epx__cuda_gpu_vote_t *votes, int world_size, int rank,
                         int *ranks, int *first, int64_t *sms);

/* epx_buffer_register's backend part (registered.c): the table's register_range and
 * unregister_range, and the release of every range (buffer teardown, local). */
epx_status_t epx__cuda_register_range(epx_buffer_t buffer, int slot);
epx_status_t epx__cuda_unregister_range(epx_buffer_t buffer, int slot);
void epx__cuda_release_ranges(epx__cuda_buffer_t *cuda);

/* trace.c: the normal-mode combine's phase trace (EPX_NORMAL_TRACE), made at create and
 * written (write = 1: every rank ready to destroy) and freed at release. */
epx_status_t epx__cuda_trace_create(epx__cuda_buffer_t *cuda);
void epx__cuda_trace_release(epx__cuda_buffer_t *cuda, int write);
/* A device trace of `words` words to <prefix>.<rank>, after a header of 8 int64: the
 * magic's 8 bytes, then `fields`. Best effort: a failure is logged (naming `variable`),
 * never an error. Also the low-latency trace's (ll_setup.c, EPX_LL_TRACE). */
void epx__cuda_trace_write(const char *variable, const char *prefix, int rank,
                           const char magic[8], const int64_t fields[7], const uint64_t *trace,
                           size_t words);
/* Write this rank's device table row `row` (EPX_CUDA_RANGE_ROWS) from `peers` ([R], or
 * NULL: all NULL). Synchronous; no kernel may be reading the row. */
epx_status_t epx__cuda_write_range_row(epx__cuda_buffer_t *cuda, int row, char *const *peers);

/*
 * Inputs mapped on demand (auto_register.c). Create: collective at the end of
 * buffer_create when auto_register is on (every rank alike): the host shared memory of
 * the exchange; where it cannot be made (ranks on several hosts), the feature is turned
 * off on every rank with a warning; a peer gone meanwhile fails it (the buffer with it).
 */
epx_status_t epx__cuda_auto_create(epx_buffer_t buffer);

/* One rank's record of one combine, in its host shared memory (two, by the call's
 * parity: a rank writes call n + 1's while a slower peer may still read call n's, never
 * n - 1's, which every peer read before it entered call n's barrier). */
typedef struct {
    int32_t want;      /* this rank's x is in an allocation no slot holds */
    int32_t used;      /* the slot this rank's x is read from this call, or -1 */
    uint32_t stale;    /* slots holding an allocation of this rank that is gone (freed) */
    int32_t capturing; /* this rank is capturing a CUDA graph */
} epx__cuda_auto_record_t;

/* What every rank's records of one combine decide (the same on every rank). */
typedef struct {
    uint32_t stale; /* slots to evict first */
    uint32_t used;  /* slots read in this call (the stale ones left out) */
    int wanted;     /* some rank needs a mapping (or a new one for a slot evicted now) */
    int capturing;  /* some rank is capturing a graph: nothing is mapped */
    int map;        /* a mapping step runs: !capturing and (wanted or stale) */
    int victim;     /* the slot the new allocations go to; -1: none free (copied in) */
} epx__cuda_auto_plan_t;

/* The plan from `all` ([world]) and the slots' shared state (auto_register.c). */
void epx__cuda_auto_plan(const epx__cuda_auto_t *au, const epx__cuda_auto_record_t *all,
                         int world, epx__cuda_auto_plan_t *plan);
/*
 * Collective, in every rank's combine when auto_register is on (whatever its x; a rank
 * that failed before publishes its failure through the buffer's abort, which ends the
 * peers' wait): where the peers read this rank's x. `placed` nonzero: x is in the buffer
 * or a registered range already. Otherwise x's allocation is looked up among the slots
 * and, when new, mapped by every peer (every rank's new allocation in one slot, the least
 * recently read evicted); on a hit *region (1 + table row), *offset and *stride say
 * where. A mapping that fails turns the feature off on every rank (one warning) and x is
 * copied in; errors returned are a peer's failure or timeout.
 */
epx_status_t epx__cuda_auto_locate(epx_buffer_t buffer, const epx_tensor_t *x, int64_t rows,
                                   cudaStream_t stream, int placed, int32_t *region,
                                   int64_t *offset, int64_t *stride);
/* Collective, in epx_buffer_register when auto_register is on: evict the slots holding
 * allocations their rank has freed (CUDA would refuse to open a new range over them). */
epx_status_t epx__cuda_auto_purge(epx_buffer_t buffer, epx_status_t local);
/* Local: close every mapping and the shared memory (buffer teardown). */
void epx__cuda_auto_release(epx__cuda_buffer_t *cuda);

/* Visible CUDA devices, 0 without a driver or device (the table's device_count). */
int epx__cuda_device_count(void);

/* Nodes the group spans: world_size / ranks_per_node (group.c checks it divides). */
int epx__cuda_num_nodes(epx_group_t group);

/* Byte layout of every rank's shared allocation for this config (fills `shape`). */
epx_status_t epx__cuda_plan(epx_group_t group, const epx_buffer_config_t *config,
                            epx__cuda_shape_t *shape, size_t *handle_slot_bytes);

/* ---------------------------------------------------------------- errors and waits */

/*
 * The device error record as a status: EPX_SUCCESS when the device recorded nothing;
 * otherwise the first failure (timeout naming the rank and stage, a peer's failure,
 * bad input found on the device), also stored as the buffer's async error.
 */
epx_status_t epx__cuda_poll(epx_buffer_t buffer);
/* The same without touching the thread's last error: 1 when a failure is recorded. */
int epx__cuda_note_failure(epx_buffer_t buffer);
/* Wait (host, with the group's timeout) until the count exchange stamped `ticket`. */
epx_status_t epx__cuda_wait_ticket(epx_buffer_t buffer, uint64_t ticket, const char *op);
/* The rank a device failure blames (for forwarding in abort), or -1. */
int epx__cuda_failure_culprit(epx_buffer_t buffer);

/* Largest power of two (at most 16) dividing both the address and the row pitch. */
int epx__cuda_alignment(const void *data, int64_t pitch_bytes);
/* Blocks for a data kernel: one warp per token, at most the buffer's SM budget. */
int epx__cuda_blocks_for(const epx__cuda_buffer_t *cuda, int64_t tokens);

/* ---------------------------------------------------------------- kernels */

/* The normal-mode kernels of this buffer: single-node (CUDA IPC) or internode. */
cudaError_t epx__cuda_run_notify(const epx__cuda_buffer_t *cuda,
                                 const epx__cuda_notify_args_t *args, cudaStream_t stream);
cudaError_t epx__cuda_run_dispatch(const epx__cuda_buffer_t *cuda,
                                   const epx__cuda_dispatch_args_t *args, cudaStream_t stream);
cudaError_t epx__cuda_run_combine(const epx__cuda_buffer_t *cuda,
                                  const epx__cuda_combine_args_t *args, cudaStream_t stream);

/* ---------------------------------------------------------------- internode */

/* Adds the internode regions to a plan (shape->num_nodes > 1) and the handle's routing
 * to the handle slot size. */
epx_status_t epx__cuda_xn_plan(epx_group_t group, const epx_buffer_config_t *config,
                               epx__cuda_shape_t *shape, size_t *handle_slot_bytes);
/* Collective: symmetric memory for the shared allocation, the peers of this node.
 * Fills cuda->shared, cuda->xn and cuda->peer_bases. */
epx_status_t epx__cuda_xn_create(epx_buffer_t buffer, epx__cuda_buffer_t *cuda,
                                 epx_status_t status);
/* `healthy`: every rank agreed no peer failed (freeing symmetric memory is collective). */
void epx__cuda_xn_destroy(epx__cuda_buffer_t *cuda, int healthy);
/* Put *cuda->abort_word (EPX_CUDA_ABORT_PACK) into the abort word of every rank on
 * another node but `skip` (-1: none), on `stream`: their waits end naming this failure
 * instead of timing out. No-op on one node. */
void epx__cuda_xn_tell(const epx__cuda_buffer_t *cuda, int skip, cudaStream_t stream);
/* The backend's internode_plan hook (epx_internode_plan but bytes_per_rank). */
epx_status_t epx__cuda_xn_describe(epx_group_t group, const epx_buffer_config_t *config,
                                   epx_internode_plan_t *plan);
/* The routing arrays of a handle slot (after the single-node ones). */
void epx__cuda_xn_routing(const epx__cuda_shape_t *shape, void *slot, int64_t offset,
                          epx__cuda_xn_routing_t *routing);

epx_status_t epx__cuda_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                epx_dispatch_result_t *result, void *stream);
epx_status_t epx__cuda_combine(epx_buffer_t buffer, const epx_combine_args_t *args,
                               void *stream);
/* Tool support: epx_fanout_copy (fanout.c). */
epx_status_t epx__cuda_fanout_copy(epx_buffer_t buffer, const epx_fanout_args_t *args,
                                   void *stream);
/* Tool support: epx_fanin_reduce (fanin.c). */
epx_status_t epx__cuda_fanin_reduce(epx_buffer_t buffer, const epx_fanin_args_t *args,
                                    void *stream);

#endif /* EPX_OPS_CUDA_BACKEND_H */
