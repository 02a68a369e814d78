/*
 * Argument checks of the entry points, one function per operation. Each returns
 * EPX_ERR_INVALID_ARG (or EPX_ERR_CAPACITY) with a message naming the argument, so the
 * backends can rely on shapes, dtypes and sizes being right.
 */
#ifndef EPX_VALIDATE_H
#define EPX_VALIDATE_H

#include "api.h"

epx_status_t epx__validate_buffer_config(epx_group_t group, const epx_buffer_config_t *config);
/* A validated config (either accepted size) as the current struct, new fields 0. */
void epx__buffer_config_read(const epx_buffer_config_t *config, epx_buffer_config_t *full);
epx_status_t epx__validate_layout(epx_buffer_t buffer, const epx_layout_args_t *args);
epx_status_t epx__validate_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                    const epx_dispatch_result_t *result);
epx_status_t epx__validate_combine(epx_buffer_t buffer, const epx_combine_args_t *args);
/* Dispatch args of either accepted size (validated) as the current struct, new fields 0. */
void epx__dispatch_args_read(const epx_dispatch_args_t *args, epx_dispatch_args_t *full);
/* Combine args of either accepted size (validated) as the current struct, bias empty. */
void epx__combine_args_read(const epx_combine_args_t *args, epx_combine_args_t *full);
/* num_tokens_per_expert in host memory (host backend): every count >= 0. */
epx_status_t epx__validate_layout_counts(const char *op, const epx_tensor_t *counts);

/*
 * Expert ids in host memory: every entry in [-1, num_experts). The host backend calls it
 * (device memory is checked by the GPU kernels instead).
 */
epx_status_t epx__validate_topk_values(const char *op, const epx_tensor_t *topk_idx,
                                       int num_experts);

/* Low-latency mode (src/validate_ll.c). */
epx_status_t epx__validate_ll_dispatch(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                                       const epx_ll_dispatch_result_t *result);
epx_status_t epx__validate_ll_combine(epx_buffer_t buffer, const epx_ll_combine_args_t *args,
                                      int64_t num_tokens);
/* EPX_ERR_INVALID_STATE naming `op` when the buffer has no low-latency mode. */
epx_status_t epx__validate_ll_enabled(epx_buffer_t buffer, const char *op);

#endif /* EPX_VALIDATE_H */
