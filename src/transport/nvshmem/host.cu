/*
 * The NVSHMEM host functions of libepx_nvshmem.so (nvshmem_host.h): the transport's side
 * of the plugin. Nothing here keeps state besides NVSHMEM's own; libepx decides when to
 * initialise and what to allocate.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <nvshmem.h>
#include <nvshmemx.h>

#include "transport/nvshmem/nvshmem_host.h"

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

static const epx_nvshmem_host_t host = {
    EPX_NVSHMEM_HOST_ABI, plugin_version, plugin_uid_size, plugin_get_uid, plugin_init,
    plugin_malloc,        plugin_free,    plugin_barrier,  plugin_peer_ptr, plugin_finalize,
};

extern "C" __attribute__((visibility("default"))) const epx_nvshmem_host_t *epx_nvshmem_host_v1(void)
{
    return &host;
}
