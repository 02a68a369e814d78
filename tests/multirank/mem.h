/*
 * Memory for the multi-rank tests: where the inputs and outputs of an operation live.
 *
 * The host backend works on host memory; the CUDA backend needs device memory. The
 * programs allocate and copy only through these functions, so the same test runs on
 * either backend: after mr_mem_init, mr_mem_alloc gives device memory when the group's
 * backend is CUDA (and the build has CUDA), host memory otherwise. Failures end the
 * test with a message (these are test programs, not library code).
 */
#ifndef EPX_MULTIRANK_MEM_H
#define EPX_MULTIRANK_MEM_H

#include <stddef.h>

#include "epx.h"

/* Choose host or device memory for this group's backend (and select its device). */
void mr_mem_init(epx_group_t group);
/* Nonzero when mr_mem_alloc returns device memory. */
int mr_mem_is_device(void);

/* `bytes` of operation memory (never NULL, even for 0 bytes), filled with `fill_byte`. */
void *mr_mem_alloc(size_t bytes, int fill_byte);
void mr_mem_free(void *memory);
/* A copy of host data in operation memory. */
void *mr_mem_from_host(const void *host, size_t bytes);

void mr_mem_to_device(void *dst, const void *host_src, size_t bytes);
void mr_mem_to_host(void *host_dst, const void *src, size_t bytes);
/* Wait for the backend's queued work (cudaDeviceSynchronize; nothing on the host). */
void mr_mem_sync(void);

#endif /* EPX_MULTIRANK_MEM_H */
