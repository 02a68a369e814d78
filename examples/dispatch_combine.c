/*
 * One MoE exchange with the epx C API: dispatch each token to the ranks that hold its
 * top-k experts, run the experts, combine their outputs back on the token's rank. The
 * experts here are the identity, so combine must give each token's row times the number
 * of ranks it went to, which the program checks.
 *
 * It uses the CPU backend, so the tensors are host memory; with EPX_BACKEND_CUDA (or
 * AUTO on a GPU machine) they are device pointers and `stream` a cudaStream_t.
 *
 *   cc examples/dispatch_combine.c $(pkg-config --cflags --libs epx) \
 *       -Wl,-rpath,"$(pkg-config --variable=libdir epx)" -o dispatch_combine
 *   epx launch -n 4 -- ./dispatch_combine
 */
#include <epx.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { TOKENS = 128, HIDDEN = 1024, EXPERTS = 16, TOPK = 4 };

#define CHECK(call)                                                                      \
    do {                                                                                 \
        if ((call) != EPX_SUCCESS) {                                                     \
            fprintf(stderr, "%s failed: %s\n", #call, epx_last_error());                 \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

/* bf16 is the top half of an fp32; exact for the small integers used here. */
static uint16_t to_bf16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    return (uint16_t)(bits >> 16);
}

static float from_bf16(uint16_t value)
{
    uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, sizeof(result));
    return result;
}

static uint16_t x[TOKENS * HIDDEN], y[TOKENS * HIDDEN];
static int64_t topk_idx[TOKENS * TOPK];
static float topk_weights[TOKENS * TOPK];

int main(void)
{
    void *stream = NULL;
    epx_group_t group;
    CHECK(epx_group_create_from_env(EPX_BACKEND_HOST, &group)); /* ranks set up by epx launch */
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK(epx_group_get_info(group, &info));

    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = TOKENS;
    config.hidden = HIDDEN;
    config.num_experts = EXPERTS;
    config.num_topk = TOPK;
    epx_buffer_t buffer;
    CHECK(epx_buffer_create(group, &config, &buffer));

    /* Token t holds t % 32 + 1 in every column; its experts are TOPK distinct ones. */
    int64_t num_tokens = TOKENS;
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; h < HIDDEN; h++)
            x[t * HIDDEN + h] = to_bf16((float)(t % 32 + 1));
        for (int j = 0; j < TOPK; j++) {
            topk_idx[t * TOPK + j] = (t * 7 + info.rank * 3 + j * 5) % EXPERTS;
            topk_weights[t * TOPK + j] = 1.0f / TOPK;
        }
    }

    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, num_tokens, HIDDEN);
    args.topk_idx = epx_tensor_2d(topk_idx, EPX_DTYPE_INT64, num_tokens, TOPK);
    args.topk_weights = epx_tensor_2d(topk_weights, EPX_DTYPE_FP32, num_tokens, TOPK);
    epx_dispatch_result_t got = EPX_DISPATCH_RESULT_INIT;
    CHECK(epx_dispatch(buffer, &args, &got, stream));
    /* got.recv_x: [got.num_recv_tokens, HIDDEN], ordered by source rank then token;
     * got.recv_topk_idx holds local expert ids (-1 = not on this rank). */

    /* The experts (here: the identity) write their outputs into the combine input. */
    epx_tensor_t expert_out;
    CHECK(epx_get_combine_input(buffer, got.handle, &expert_out));
    memcpy(expert_out.data, got.recv_x.data, (size_t)got.num_recv_tokens * HIDDEN * 2);

    epx_combine_args_t back = EPX_COMBINE_ARGS_INIT;
    back.handle = got.handle;
    back.x = expert_out;
    back.out_x = epx_tensor_2d(y, EPX_DTYPE_BF16, num_tokens, HIDDEN);
    CHECK(epx_combine(buffer, &back, stream));
    CHECK(epx_handle_destroy(got.handle));

    /* y[t] = x[t] times the number of ranks holding one of t's experts. */
    int experts_per_rank = EXPERTS / info.world_size, wrong = 0;
    for (int64_t t = 0; t < num_tokens; t++) {
        int ranks = 0;
        for (int r = 0; r < info.world_size; r++) {
            int hit = 0;
            for (int j = 0; j < TOPK; j++)
                hit |= topk_idx[t * TOPK + j] / experts_per_rank == r;
            ranks += hit;
        }
        for (int64_t h = 0; h < HIDDEN; h++)
            wrong += from_bf16(y[t * HIDDEN + h]) != (float)(t % 32 + 1) * (float)ranks;
    }
    printf("rank %d of %d: %lld tokens sent, %lld received, combine %s\n", info.rank,
           info.world_size, (long long)num_tokens, (long long)got.num_recv_tokens,
           wrong == 0 ? "correct" : "WRONG");

    CHECK(epx_buffer_destroy(buffer));
    CHECK(epx_group_destroy(group));
    return wrong == 0 ? 0 : 1;
}
