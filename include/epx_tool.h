/*
 * epx tool support: what the `epx` command (tools/) and programs like it need beyond
 * include/epx.h. Applications do not need it. Same conventions as epx.h (statuses,
 * epx_last_error, struct sizes); part of the library's exported epx_* API.
 *
 *   - the tunables table (the EPX_* environment variables: `epx params`, `epx doctor`)
 *   - the communication memory a buffer would take on a group of a given shape,
 *     without forming the group (`epx doctor` plans for ranks it does not start)
 *   - where the NVSHMEM plugin of low-latency CUDA buffers is (`epx doctor`)
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

/* Row `index` of the table: 0, 1, ... until EPX_ERR_INVALID_ARG (past the last row). */
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

/*
 * Find and load the NVSHMEM plugin (libepx_nvshmem.so) as a low-latency CUDA buffer would
 * (EPX_NVSHMEM_PLUGIN, beside libepx, the build directory when libepx runs from it, the
 * loader's path): its path (written to `path`, `path_size` bytes) and the NVSHMEM version
 * linked into it. Starts nothing: NVSHMEM is
 * not initialised. EPX_ERR_UNSUPPORTED, with where it looked, when the plugin is absent,
 * does not load, or this build has no CUDA backend.
 */
epx_status_t epx_nvshmem_plugin_probe(char *path, size_t path_size, int version[3]);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TOOL_H */
