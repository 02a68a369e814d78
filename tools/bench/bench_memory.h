/*
 * Where `epx bench` keeps its tensors and how it times them, per backend: host memory
 * and the wall clock for the host backend; device memory, a stream and CUDA events for
 * the CUDA backend. Everything CUDA-specific in the bench lives behind this header.
 */
#ifndef EPX_TOOLS_BENCH_MEMORY_H
#define EPX_TOOLS_BENCH_MEMORY_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

/* Timestamps one timed iteration takes (one before the first op, one after each). */
#define EPX__BENCH_MAX_MARKS 40

typedef struct {
    epx_backend_t backend;
    void *stream; /* cudaStream_t handed to the operations; NULL for the host backend */
    void *events[EPX__BENCH_MAX_MARKS];      /* cudaEvent_t, CUDA backend */
    int64_t host_marks[EPX__BENCH_MAX_MARKS]; /* epx__now_ns, host backend */
} epx__bench_device_t;

/* Create the stream and events on `device_index` (CUDA); nothing to do for host. */
epx_status_t epx__bench_device_init(epx__bench_device_t *device, epx_backend_t backend,
                                    int device_index);
void epx__bench_device_fini(epx__bench_device_t *device);

/*
 * CUDA graphs (CUDA backend only; EPX_ERR_UNSUPPORTED on the host backend): capture
 * what the bench stream runs between begin and end, then replay it on that stream.
 */
epx_status_t epx__bench_graph_begin(epx__bench_device_t *device);
epx_status_t epx__bench_graph_end(epx__bench_device_t *device, void **graph);
epx_status_t epx__bench_graph_launch(epx__bench_device_t *device, void *graph);
void epx__bench_graph_destroy(void *graph);

/* Zeroed memory the backend's operations can read and write (at least one byte). */
epx_status_t epx__bench_alloc(const epx__bench_device_t *device, size_t bytes, void **data);
void epx__bench_free(const epx__bench_device_t *device, void *data);

/* Host -> backend memory. */
epx_status_t epx__bench_copy_in(const epx__bench_device_t *device, void *dst, const void *src,
                                size_t bytes);
/* Set `bytes` of backend memory to `byte`, in the bench stream's order (then waits). */
epx_status_t epx__bench_fill(const epx__bench_device_t *device, void *data, int byte,
                             size_t bytes);
/*
 * Backend memory -> host, `rows` rows of `row_bytes` read `src_pitch` bytes apart and
 * written contiguously. Waits for the work queued on the bench stream first.
 */
epx_status_t epx__bench_copy_rows_out(const epx__bench_device_t *device, void *dst,
                                      const void *src, int64_t rows, size_t row_bytes,
                                      size_t src_pitch);

/* Record timestamp `index` in stream order. */
epx_status_t epx__bench_mark(epx__bench_device_t *device, int index);
/* Wait for the stream, then durations_us[i] = mark[i + 1] - mark[i] for i < marks - 1. */
epx_status_t epx__bench_elapsed_us(epx__bench_device_t *device, int marks,
                                   double *durations_us);

/*
 * Host copy bandwidth in GB/s (1e9 bytes/s) counting read + write: best of a few
 * memcpy of `bytes`. 0 if the memory could not be allocated.
 */
double epx__bench_host_copy_bandwidth(size_t bytes);

/* Copy `bytes` of backend memory, queued on the bench stream (CUDA: cudaMemcpyAsync,
 * device to device, by the copy engines; host: memcpy). */
epx_status_t epx__bench_copy(const epx__bench_device_t *device, void *dst, const void *src,
                             size_t bytes);

/*
 * The backend's copy bandwidth in GB/s counting read + write: best of a few timed
 * copies of `bytes` (CUDA: cudaMemcpyAsync device to device, as tests/gpu/cuda_normal
 * measures it; host: epx__bench_host_copy_bandwidth). 0 if it could not be measured.
 */
double epx__bench_copy_bandwidth(epx__bench_device_t *device, size_t bytes);

/*
 * The copy bandwidth the floors are counted against, measured as above by the calling
 * rank (alone on the device: the caller keeps the others waiting): CUDA copies 2 GiB
 * (smaller copies measure less: 4062 against 4250 GB/s at 256 MiB on an H200), 256 MiB
 * when 2 GiB cannot be allocated; the host 256 MiB. `bytes` (optional) receives the size
 * measured. 0 if nothing could be measured.
 */
#define EPX__BENCH_FLOOR_COPY_BYTES ((size_t)2 << 30)       /* CUDA */
#define EPX__BENCH_FLOOR_FALLBACK_BYTES ((size_t)256 << 20) /* the host; CUDA's fallback */
double epx__bench_floor_bandwidth(epx__bench_device_t *device, size_t *bytes);

#endif /* EPX_TOOLS_BENCH_MEMORY_H */
