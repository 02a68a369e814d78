/*
 * Routing of tokens to ranks and experts (host backend): the layout operation, and the
 * per-token step that dispatch shares with it.
 *
 * A token goes to a rank once however many of its experts live there, and counts once
 * per distinct expert, so a row with a repeated expert id is one row for that expert.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ops/host/host.h"

epx_status_t epx__host_route_token(const char *op, const int64_t *idx, int num_topk, int64_t token,
                                   int num_experts, int num_local, uint8_t *rank_hit,
                                   int32_t *expert_counts)
{
    for (int j = 0; j < num_topk; j++) {
        int64_t expert = idx[j];
        if (expert == -1)
            continue;
        if (expert < -1 || expert >= num_experts)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: topk_idx[%" PRId64 "][%d] = %" PRId64
                             " is outside [-1, %d) (num_experts %d)",
                             op, token, j, expert, num_experts, num_experts);
        rank_hit[expert / num_local] = 1;
        if (expert_counts == NULL)
            continue;
        int repeated = 0;
        for (int i = 0; i < j && !repeated; i++)
            repeated = idx[i] == expert;
        if (!repeated)
            expert_counts[expert]++;
    }
    return EPX_SUCCESS;
}

epx_status_t epx__host_layout_op(epx_buffer_t buffer, const epx_layout_args_t *args, void *stream)
{
    (void)stream;
    int world = buffer->group->world_size;
    int num_experts = buffer->config.num_experts;
    int k = buffer->config.num_topk;
    int64_t tokens = args->topk_idx.shape[0];
    int64_t idx_stride = epx__tensor_row_stride(&args->topk_idx);
    const int64_t *idx = args->topk_idx.data;

    /* Counted in scratch first: outputs are written only on success. */
    int32_t *rank_counts = calloc((size_t)world, sizeof(int32_t));
    int32_t *expert_counts = calloc((size_t)num_experts, sizeof(int32_t));
    uint8_t *hit = calloc((size_t)world, 1);
    if (rank_counts == NULL || expert_counts == NULL || hit == NULL) {
        free(rank_counts);
        free(expert_counts);
        free(hit);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "layout: no host memory for %d counts",
                         world + num_experts);
    }
    epx_status_t status = EPX_SUCCESS;
    for (int64_t t = 0; t < tokens && status == EPX_SUCCESS; t++) {
        memset(hit, 0, (size_t)world);
        status = epx__host_route_token("layout", idx + t * idx_stride, k, t, num_experts,
                                       buffer->num_local_experts, hit, expert_counts);
        for (int r = 0; r < world; r++)
            rank_counts[r] += hit[r];
    }
    if (status == EPX_SUCCESS) {
        int32_t *per_rank = args->num_tokens_per_rank.data;
        int32_t *per_expert = args->num_tokens_per_expert.data;
        memcpy(per_rank, rank_counts, (size_t)world * sizeof(int32_t));
        memcpy(per_expert, expert_counts, (size_t)num_experts * sizeof(int32_t));
        if (epx__tensor_given(&args->is_token_in_rank)) {
            /* Second pass for the per-token bits, now that the ids are known to be valid. */
            int64_t stride = epx__tensor_row_stride(&args->is_token_in_rank);
            for (int64_t t = 0; t < tokens; t++) {
                uint8_t *row = (uint8_t *)args->is_token_in_rank.data + t * stride;
                memset(row, 0, (size_t)world);
                epx__host_route_token("layout", idx + t * idx_stride, k, t, num_experts,
                                      buffer->num_local_experts, row, NULL);
            }
        }
    }
    free(rank_counts);
    free(expert_counts);
    free(hit);
    return status;
}
