/*
 * The fan-out copy of normal-mode dispatch alone (epx_fanout_copy, include/epx_tool.h),
 * for `epx bench --mode fanout`: how fast this access pattern can go on the machine,
 * with the same SM budget and the three ways of moving bytes of the dispatch kernels
 * (vector, bulk, staged), and none of their routing, bookkeeping or signals.
 *
 * What moves: row i of src to k_i ranks, (rank + i + j) mod R for j < k_i, at row
 * first_row + i of each one's combine-input region (the memory peers map by CUDA IPC).
 *
 * Roles: the vector kernel is dispatch.cu's copy loop: every warp of a block of
 * EPX_CUDA_THREADS takes one row at a time (the next by ticket as it frees up, as the
 * dispatch takes tokens: rows go to 5 or 6 ranks), loads a batch of 16-byte vectors per
 * lane (8 in flight) and stores it to each destination. The bulk kernel is dispatch_bulk.cu's
 * ring: EPX_BULK_PIPES warps per block, lane 0 of each keeps a ring of rows in shared
 * memory moving (bulk load of a row, then one bulk store per destination, the next
 * stages-1 loads in flight meanwhile). The staged kernel splits the two: one loader warp
 * per block takes rows by ticket, works out each row's destinations once and bulk-loads
 * the row into a block-wide ring in shared memory; EPX_FANOUT_WARPS store warps copy
 * each slot to every destination with 16-byte vectors and release it. So no warp's
 * stores wait for its own loads, and a row's bookkeeping is done once per block.
 *
 * Signals: none. The caller orders the copy against everything else (barriers, stream
 * synchronisation). The waits, inside a block only (for a local bulk load; the staged
 * kernel's store warps for a slot, its loader for a free one), give up after the group's
 * timeout and record the failure.
 */
#include "epx_tool.h"

#include "ring_store.cuh"

#define EPX_FANOUT_WARPS (EPX_CUDA_THREADS / 32)

__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_fanout_vector_kernel(epx__cuda_shape_t s, epx__cuda_fanout_args_t a)
{
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    const int R = s.world_size;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        peers[r] = epx_peer(s, r);
    __syncthreads();
    const int lane = epx_lane();
    const int64_t units = a.row_bytes / 16;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * EPX_FANOUT_WARPS;
    uint32_t *tickets = &s.local->grid_counter[EPX_CUDA_COUNTER_FANOUT_ROWS];
    uint32_t ticket = 0;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * EPX_FANOUT_WARPS + epx_warp(); i < a.rows;
         i = epx_ticket_token(ticket, num_warps)) {
        ticket = epx_ticket_take(tickets, lane);
        const char *src = static_cast<const char *>(a.src) + i * a.src_pitch;
        const int count = epx_fanout_count(i, a.fanout_milli);
        const int64_t offset = a.dst_offset + (a.first_row + i) * a.dst_pitch;
        for (int64_t i0 = 0; i0 < units; i0 += 32 * 8) {
            int4 v[8];
            epx_ld16_batch<8>(v, src, i0, units, lane, 16);
            for (int j = 0; j < count; j++)
                epx_st16_batch<8>(peers[(s.rank + i + j) % R] + offset, v, i0, units, lane);
        }
    }
}

/* Slots of the staged kernel's ring at most, and its slots' shared bookkeeping. */
#define EPX_FANOUT_STAGED_SLOTS 8
/* Rows a loader takes per ticket: 4 for rows up to EPX_FANOUT_STAGED_SMALL_ROW bytes, else
 * 1. Measured (one H200, 8 ranks, 8 SMs a rank, docs/PERFORMANCE.md): fp8 rows of 7168
 * bytes 20% faster by fours than one by one, bf16 rows of 14336 bytes 8% slower. */
#define EPX_FANOUT_STAGED_SMALL_ROW 8192

typedef struct {
    uint64_t full[EPX_FANOUT_STAGED_SLOTS];  /* the loader's arrival + the row's bytes */
    uint64_t empty[EPX_FANOUT_STAGED_SLOTS]; /* one arrival per store warp */
    int32_t row[EPX_FANOUT_STAGED_SLOTS];    /* -1: no more rows */
    int32_t count[EPX_FANOUT_STAGED_SLOTS];
    char *dst[EPX_FANOUT_STAGED_SLOTS][EPX_CUDA_MAX_RANKS];
} epx_fanout_staged_t;

/* The loader: lane 0 of the block's last warp. Returns when the rows run out (after
 * marking the next slot so) or a wait gave up (recorded). */
__device__ __forceinline__ void epx_fanout_stage_rows(const epx__cuda_shape_t &s,
                                                      const epx__cuda_fanout_args_t &a,
                                                      epx_fanout_staged_t &st, char *const *peers,
                                                      char *ring, int stages, int64_t slot_bytes)
{
    const int32_t chunk = a.row_bytes <= EPX_FANOUT_STAGED_SMALL_ROW ? 4 : 1;
    const int R = s.world_size;
    const uint32_t bytes = static_cast<uint32_t>(a.row_bytes);
    uint32_t *tickets = &s.local->grid_counter[EPX_CUDA_COUNTER_FANOUT_ROWS];
    /* Rows [row, end) are this block's; `next` is the ticket of its next chunk, taken a
     * chunk ahead so that the atomic's latency hides behind the rows. */
    int32_t row = static_cast<int32_t>(atomicAdd(tickets, 1u)) * chunk;
    int32_t end = row + chunk;
    uint32_t next = atomicAdd(tickets, 1u);
    int slot = 0;
    uint32_t lap = 0;
    for (;;) {
        if (lap > 0 && !epx_mbar_wait(&st.empty[slot], (lap - 1) & 1, s.timeout_ns,
                                      &s.local->failed)) {
            if (!epx_failed(s))
                epx_record_failure(s, EPX_CUDA_FAIL_TIMEOUT, EPX_CUDA_STAGE_DISPATCH, s.rank,
                                   s.rank, 0, row, 0);
            return;
        }
        if (row == end) {
            row = static_cast<int32_t>(next) * chunk;
            end = row + chunk;
            next = atomicAdd(tickets, 1u);
        }
        if (row >= a.rows) {
            st.row[slot] = -1;
            epx_mbar_arrive_expect(&st.full[slot], 0);
            return;
        }
        const int count = epx_fanout_count(row, a.fanout_milli);
        const int64_t offset = a.dst_offset + (a.first_row + row) * a.dst_pitch;
        int peer = (s.rank + row) % R;
        for (int j = 0; j < count; j++) {
            st.dst[slot][j] = peers[peer] + offset;
            peer = peer + 1 == R ? 0 : peer + 1;
        }
        st.row[slot] = row;
        st.count[slot] = count;
        epx_bulk_fence_shared();
        epx_mbar_arrive_expect(&st.full[slot], bytes);
        epx_bulk_load(ring + slot * slot_bytes, static_cast<const char *>(a.src) + row * a.src_pitch,
                      bytes, &st.full[slot]);
        row++;
        epx_ring_advance(&slot, &lap, stages);
    }
}

/* A store warp: every row of the ring, its share of each (16-byte units, the first
 * thread turning by a quarter of the block a row so no warp always gets the tail). */
__device__ __forceinline__ void epx_fanout_store_rows(const epx__cuda_shape_t &s,
                                                      const epx__cuda_fanout_args_t &a,
                                                      epx_fanout_staged_t &st, const char *ring,
                                                      int stages, int64_t slot_bytes)
{
    const int units = static_cast<int>(a.row_bytes / 16), lane = epx_lane();
    int slot = 0;
    uint32_t lap = 0;
    for (int k = 0;; k++) {
        if (!epx_ring_wait_full(s, &st.full[slot], lap, k, 0))
            return;
        if (st.row[slot] < 0)
            return;
        const int first =
            epx_ring_first_unit<EPX_CUDA_THREADS>(static_cast<int>(threadIdx.x), k);
        epx_ring_store_row<EPX_CUDA_THREADS>(ring + slot * slot_bytes, units, st.dst[slot],
                                             st.count[slot], first);
        __syncwarp();
        if (lane == 0)
            epx_mbar_arrive(&st.empty[slot]);
        epx_ring_advance(&slot, &lap, stages);
    }
}

__global__ void __launch_bounds__(EPX_CUDA_THREADS + 32)
    epx_fanout_staged_kernel(epx__cuda_shape_t s, epx__cuda_fanout_args_t a, int stages,
                             int64_t slot_bytes)
{
    extern __shared__ __align__(128) char ring[];
    __shared__ epx_fanout_staged_t st;
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    for (int r = threadIdx.x; r < s.world_size; r += blockDim.x)
        peers[r] = epx_peer(s, r);
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; i++) {
            epx_mbar_init(&st.full[i], 1);
            epx_mbar_init(&st.empty[i], EPX_FANOUT_WARPS);
        }
        epx_mbar_init_fence();
    }
    __syncthreads();
    if (epx_warp() < EPX_FANOUT_WARPS)
        epx_fanout_store_rows(s, a, st, ring, stages, slot_bytes);
    else if (epx_lane() == 0)
        epx_fanout_stage_rows(s, a, st, peers, ring, stages, slot_bytes);
}

__global__ void __launch_bounds__(EPX_BULK_PIPES * 32)
    epx_fanout_bulk_kernel(epx__cuda_shape_t s, epx__cuda_fanout_args_t a, int stages,
                           int64_t slot_bytes)
{
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t bars[EPX_BULK_PIPES][EPX_BULK_MAX_STAGES];
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    const int R = s.world_size, S = stages;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        peers[r] = epx_peer(s, r);
    const int lane = epx_lane(), warp = epx_warp();
    uint64_t *bar = bars[warp];
    char *slots = ring + static_cast<int64_t>(warp) * S * slot_bytes;
    epx_bulk_ring_init(bar, S);
    /* One thread per ring drives every copy. */
    if (lane != 0)
        return;

    const int64_t first = static_cast<int64_t>(blockIdx.x) * EPX_BULK_PIPES + warp;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * EPX_BULK_PIPES;
    const int64_t count = first < a.rows ? (a.rows - 1 - first) / stride + 1 : 0;
    const uint32_t bytes = static_cast<uint32_t>(a.row_bytes);
    for (int64_t j = 0; j < count && j < S; j++) {
        const int64_t i = first + j * stride;
        const int n = epx_fanout_count(i, a.fanout_milli);
        epx_mbar_arrive_expect(&bar[j], n > 0 ? bytes : 0);
        if (n > 0)
            epx_bulk_load(slots + j * slot_bytes, static_cast<const char *>(a.src) + i * a.src_pitch,
                          bytes, &bar[j]);
    }
    for (int64_t j = 0; j < count; j++) {
        const int slot = static_cast<int>(j % S);
        const int64_t i = first + j * stride;
        if (!epx_mbar_wait(&bar[slot], static_cast<uint32_t>((j / S) & 1), s.timeout_ns,
                           &s.local->failed)) {
            if (!epx_failed(s))
                epx_record_failure(s, EPX_CUDA_FAIL_TIMEOUT, EPX_CUDA_STAGE_DISPATCH, s.rank,
                                   s.rank, 0, i, 0);
            break;
        }
        const int n = epx_fanout_count(i, a.fanout_milli);
        const int64_t offset = a.dst_offset + (a.first_row + i) * a.dst_pitch;
        for (int k = 0; k < n; k++)
            epx_bulk_store(peers[(s.rank + i + k) % R] + offset, slots + slot * slot_bytes, bytes);
        epx_bulk_commit();
        const int64_t refill = j - 1 + S;
        if (j >= 1 && refill < count) {
            epx_bulk_wait_read<1>();
            const int previous = static_cast<int>((j - 1) % S);
            const int64_t row = first + refill * stride;
            const int m = epx_fanout_count(row, a.fanout_milli);
            epx_mbar_arrive_expect(&bar[previous], m > 0 ? bytes : 0);
            if (m > 0)
                epx_bulk_load(slots + previous * slot_bytes,
                              static_cast<const char *>(a.src) + row * a.src_pitch, bytes,
                              &bar[previous]);
        }
    }
    epx_bulk_wait_all();
}

/*
 * Stages of a ring kernel's ring, each `stage_bytes` of the block's shared memory:
 * `requested`, or (0) as many as EPX_BULK_RING_BYTES holds, at most `most`. Two at least,
 * and the block's shared memory must hold them: cudaErrorInvalidValue otherwise.
 */
static cudaError_t epx_fanout_stages(const void *kernel, int requested, int64_t stage_bytes,
                                     int64_t most, int64_t *stages)
{
    int64_t budget = 0, room = 0;
    cudaError_t err = epx_bulk_ring_budget(kernel, 0, &budget);
    if (err == cudaSuccess)
        err = epx_bulk_ring_budget(kernel, INT64_MAX, &room);
    if (err != cudaSuccess)
        return err;
    int64_t n = requested;
    if (n == 0)
        n = budget / stage_bytes < most ? budget / stage_bytes : most;
    if (n < 2 || n > most || n * stage_bytes > room)
        return cudaErrorInvalidValue;
    *stages = n;
    return cudaSuccess;
}

/* The staged kernel: one block per SM up to a row each; `stages` slots of the ring (0 =
 * as many as EPX_BULK_RING_BYTES holds, at most EPX_FANOUT_STAGED_SLOTS). */
static cudaError_t epx_fanout_launch_staged(const epx__cuda_shape_t *shape,
                                            const epx__cuda_fanout_args_t *args,
                                            cudaStream_t stream)
{
    const void *kernel = reinterpret_cast<const void *>(epx_fanout_staged_kernel);
    const int64_t slot_bytes = epx_bulk_round_up(args->row_bytes, 128);
    int64_t stages = 0;
    cudaError_t err = epx_fanout_stages(kernel, args->stages, slot_bytes, EPX_FANOUT_STAGED_SLOTS,
                                        &stages);
    if (err == cudaSuccess)
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(stages * slot_bytes));
    if (err == cudaSuccess)
        err = cudaMemsetAsync(&shape->local->grid_counter[EPX_CUDA_COUNTER_FANOUT_ROWS], 0,
                              sizeof(uint32_t), stream);
    if (err != cudaSuccess)
        return err;
    const int blocks = static_cast<int>(args->rows < args->num_sms ? args->rows : args->num_sms);
    epx_fanout_staged_kernel<<<blocks, EPX_CUDA_THREADS + 32,
                               static_cast<size_t>(stages * slot_bytes), stream>>>(
        *shape, *args, static_cast<int>(stages), slot_bytes);
    return cudaGetLastError();
}

extern "C" cudaError_t epx__cuda_launch_fanout(const epx__cuda_shape_t *shape,
                                               const epx__cuda_fanout_args_t *args,
                                               cudaStream_t stream)
{
    if (args->rows <= 0)
        return cudaSuccess;
    if (args->kernel == EPX_FANOUT_VECTOR) {
        int64_t wanted = (args->rows + EPX_FANOUT_WARPS - 1) / EPX_FANOUT_WARPS;
        int blocks = static_cast<int>(wanted < args->num_sms ? wanted : args->num_sms);
        cudaError_t err = cudaMemsetAsync(&shape->local->grid_counter[EPX_CUDA_COUNTER_FANOUT_ROWS],
                                          0, sizeof(uint32_t), stream);
        if (err != cudaSuccess)
            return err;
        epx_fanout_vector_kernel<<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*shape, *args);
        return cudaGetLastError();
    }
    if (args->kernel == EPX_FANOUT_STAGED)
        return epx_fanout_launch_staged(shape, args, stream);
    const void *kernel = reinterpret_cast<const void *>(epx_fanout_bulk_kernel);
    const int64_t slot_bytes = epx_bulk_round_up(args->row_bytes, 128);
    /* A slot is refilled only after the next one's stores were issued: two at least. */
    int64_t stages = 0;
    cudaError_t err = epx_fanout_stages(kernel, args->stages, EPX_BULK_PIPES * slot_bytes,
                                        EPX_BULK_MAX_STAGES, &stages);
    if (err != cudaSuccess)
        return err;
    const int64_t ring_bytes = EPX_BULK_PIPES * stages * slot_bytes;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(ring_bytes));
    if (err != cudaSuccess)
        return err;
    epx_fanout_bulk_kernel<<<epx_bulk_blocks(args->rows, args->num_sms), EPX_BULK_PIPES * 32,
                             static_cast<size_t>(ring_bytes), stream>>>(
        *shape, *args, static_cast<int>(stages), slot_bytes);
    return cudaGetLastError();
}
