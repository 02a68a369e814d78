/*
 * libepx_nvshmem.so: NVSHMEM set-up and the low-latency kernels behind one table
 * (src/ops/cuda/ll_plugin.h says why this is a plugin). Nothing here keeps state
 * besides NVSHMEM's own; libepx decides when to initialise and what to allocate.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <nvshmem.h>
#include <nvshmemx.h>

#include "ops/cuda/ll_plugin.h"

extern "C" int epx_ll_launch_dispatch_send(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_ll_launch_dispatch_recv(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_ll_launch_combine_send(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_ll_launch_combine_recv(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_xn_launch_notify(const epx__cuda_shape_t *, const epx__cuda_notify_args_t *,
                                    void *);
extern "C" int epx_xn_launch_dispatch(const epx__cuda_shape_t *,
                                      const epx__cuda_dispatch_args_t *, void *);
extern "C" int epx_xn_launch_combine(const epx__cuda_shape_t *, const epx__cuda_combine_args_t *,
                                     void *);

static void plugin_version(int *major, int *minor, int *patch)
{
    *major = NVSHMEM_VENDOR_MAJOR_VERSION;
    *minor = NVSHMEM_VENDOR_MINOR_VERSION;
    *patch = NVSHMEM_VENDOR_PATCH_VERSION;
}

static size_t plugin_uid_size(void)
{
    return sizeof(nvshmemx_uniqueid_t);
}

static int plugin_get_uid(void *uid)
{
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    int status = nvshmemx_get_uniqueid(&id);
    memcpy(uid, &id, sizeof(id));
    return status;
}

/* nvshmemx_init_attr exits the process on failure; this returns the status instead. */
static int plugin_init(const void *uid, int rank, int world, char *message, size_t message_size)
{
    nvshmemx_uniqueid_t id;
    memcpy(&id, uid, sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    int status = nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr);
    if (status != 0) {
        snprintf(message, message_size, "nvshmemx_set_attr_uniqueid_args: status %d", status);
        return status;
    }
    nvshmemx_init_init_attr_ver_only(attr);
    nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                  NVSHMEM_VENDOR_PATCH_VERSION};
    int provided = 0;
    status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                  NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
    if (status != 0) {
        snprintf(message, message_size,
                 "NVSHMEM initialisation failed (status %d, errno %s); run with "
                 "NVSHMEM_DEBUG=INFO to see why",
                 status, strerror(errno));
        return status;
    }
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world) {
        snprintf(message, message_size, "NVSHMEM made this rank PE %d of %d, expected %d of %d",
                 nvshmem_my_pe(), nvshmem_n_pes(), rank, world);
        return -1;
    }
    return 0;
}

static void *plugin_malloc(size_t bytes)
{
    return nvshmem_malloc(bytes);
}

static void plugin_free(void *p)
{
    nvshmem_free(p);
}

static void plugin_barrier(void)
{
    nvshmem_barrier_all();
}

static void *plugin_peer_ptr(void *p, int pe)
{
    return nvshmem_ptr(p, pe);
}

static void plugin_finalize(void)
{
    nvshmem_finalize();
}

static const epx_ll_plugin_t plugin = {
    EPX_LL_PLUGIN_ABI,           plugin_version,
    plugin_uid_size,             plugin_get_uid,
    plugin_init,                 plugin_malloc,
    plugin_free,                 plugin_barrier,
    plugin_peer_ptr,             epx_ll_launch_dispatch_send,
    epx_ll_launch_dispatch_recv, epx_ll_launch_combine_send,
    epx_ll_launch_combine_recv,  plugin_finalize,
    epx_xn_launch_notify,        epx_xn_launch_dispatch,
    epx_xn_launch_combine,
};

extern "C" __attribute__((visibility("default"))) const epx_ll_plugin_t *epx_ll_plugin_v1(void)
{
    return &plugin;
}
