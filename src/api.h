/*
 * What the API layer's files (the .c files directly in src/) share and nothing below
 * them sees: the buffer bookkeeping of the entry points (src/epx.c).
 */
#ifndef EPX_API_H
#define EPX_API_H

#include "ops/backend.h"

/*
 * A buffer operation's bookkeeping, shared by the normal and low-latency entry points:
 * refuse to run on a buffer that already failed (a device-side failure counts), and
 * record this rank's failure inside a collective and tell the peers (returns `status`).
 */
epx_status_t epx__buffer_check_usable(epx_buffer_t buffer, const char *op);
epx_status_t epx__buffer_fail(epx_buffer_t buffer, epx_status_t status);

/*
 * A new buffer object for `group` with its generic fields set from a validated `config`
 * (num_sms resolved, a fresh serial) and impl NULL; NULL on out of memory. For
 * epx_buffer_create and epx_buffer_create_rejoin (src/epx_ll_rejoin.c).
 */
struct epx_buffer *epx__buffer_new(epx_group_t group, const epx_buffer_config_t *config,
                                   const epx__backend_ops_t *ops);

/*
 * epx_buffer_size without the check that `group` is a live group: for
 * epx_buffer_size_plan (src/plan.c), which asks on a group it made up on the stack.
 */
epx_status_t epx__buffer_size(epx_group_t group, const epx_buffer_config_t *config,
                              size_t *bytes_per_rank);

/*
 * The node size of a group of `world_size` ranks whose host names are `hosts` (rank r's
 * at hosts + r * stride, NUL-terminated): `given` (> 0: config.ranks_per_node or
 * EPX_RANKS_PER_NODE) when no node it makes spans two hosts, else an error; with
 * `given` 0, the ranks per host when the ranks come host by host, the same number on
 * each, else the world size with a warning (src/group_nodes.c).
 */
epx_status_t epx__group_nodes(const char *hosts, size_t stride, int world_size, int given,
                              int *ranks_per_node);

#endif /* EPX_API_H */
