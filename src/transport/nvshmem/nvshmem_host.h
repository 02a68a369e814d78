/*
 * The NVSHMEM host functions of the plugin library libepx_nvshmem.so (built from
 * src/transport/nvshmem/host.cu and the backend's kernels in src/ops/cuda/nvshmem/).
 * The transport (nvshmem.c) loads the library with dlopen() and reaches NVSHMEM only
 * through this table, so libepx.so loads on machines without NVSHMEM. Plain C: both
 * libepx (C) and the plugin (CUDA C++) read it.
 */
#ifndef EPX_TRANSPORT_NVSHMEM_HOST_H
#define EPX_TRANSPORT_NVSHMEM_HOST_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_NVSHMEM_HOST_ABI 1
#define EPX_NVSHMEM_HOST_SYMBOL "epx_nvshmem_host_v1"
#define EPX_NVSHMEM_PLUGIN_FILE "libepx_nvshmem.so"

typedef struct {
    int abi; /* EPX_NVSHMEM_HOST_ABI */
    /* NVSHMEM's version (the one linked into the plugin). */
    void (*version)(int *major, int *minor, int *patch);
    /* The unique id: its size, and a fresh one (rank 0 makes it, the group shares it). */
    size_t (*uid_size)(void);
    int (*get_uid)(void *uid);
    /* Initialise NVSHMEM as PE `rank` of `world` from the shared unique id (collective).
     * Returns 0 or NVSHMEM's status; `message` gets a reason. The CUDA device is set. */
    int (*init)(const void *uid, int rank, int world, char *message, size_t message_size);
    /* Collective over all PEs, in the same order everywhere. */
    void *(*malloc_sym)(size_t bytes);
    void (*free_sym)(void *p);
    void (*barrier_all)(void);
    /* Peer `pe`'s address of symmetric `p` when this process can store to it, else NULL. */
    void *(*peer_ptr)(void *p, int pe);
    /* Collective on every PE; NVSHMEM cannot be set up again in this process. */
    void (*finalize)(void);
} epx_nvshmem_host_t;

typedef const epx_nvshmem_host_t *(*epx_nvshmem_host_entry_t)(void);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TRANSPORT_NVSHMEM_HOST_H */
