/*
 * Expected traffic of internode normal mode, counted from the routing, and how the bench
 * prints it (see bench_nodes.h for the model). Pure functions: tests/tools checks them
 * on a routing small enough to count by hand.
 */
#include "bench_nodes.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_report.h"

/* Largest node size counted on the stack; beyond it, one heap array per call. */
#define NODES_ON_STACK 64

int epx__bench_nodes_shape_valid(const epx__bench_nodes_shape_t *s)
{
    return s->world_size >= 1 && s->ranks_per_node >= 1 &&
           s->world_size % s->ranks_per_node == 0 && s->num_experts >= s->world_size &&
           s->num_experts % s->world_size == 0 && s->num_topk >= 1 && s->hidden >= 1;
}

int epx__bench_nodes_count(const epx__bench_nodes_shape_t *shape, int home_rank,
                           const int64_t *topk_idx, int64_t tokens,
                           epx__bench_nodes_counts_t *counts)
{
    memset(counts, 0, sizeof(*counts));
    if (!epx__bench_nodes_shape_valid(shape) || home_rank < 0 || home_rank >= shape->world_size ||
        tokens < 0)
        return -1;
    int world = shape->world_size, per_node = shape->ranks_per_node;
    int experts_per_rank = shape->num_experts / world;
    int home_node = home_rank / per_node;
    uint8_t on_stack[NODES_ON_STACK];
    uint8_t *hit = world <= NODES_ON_STACK ? on_stack : malloc((size_t)world);
    if (hit == NULL)
        return -1;
    int status = 0;
    for (int64_t t = 0; t < tokens && status == 0; t++) {
        /* The ranks that receive t: one row each, however many of its experts they hold. */
        memset(hit, 0, (size_t)world);
        for (int j = 0; j < shape->num_topk; j++) {
            int64_t expert = topk_idx[t * shape->num_topk + j];
            if (expert < -1 || expert >= shape->num_experts)
                status = -1;
            else if (expert >= 0)
                hit[expert / experts_per_rank] = 1;
        }
        for (int node = 0; node < world / per_node; node++) {
            int rows = 0;
            for (int r = node * per_node; r < (node + 1) * per_node; r++)
                rows += hit[r];
            if (node == home_node) {
                counts->home_rows += rows;
            } else if (rows > 0) {
                counts->records++;
                counts->forwarded_rows += rows;
            }
        }
    }
    counts->tokens = tokens;
    if (hit != on_stack)
        free(hit);
    if (status != 0)
        memset(counts, 0, sizeof(*counts));
    return status;
}

epx__bench_nodes_sizes_t epx__bench_nodes_sizes(const epx__bench_nodes_shape_t *shape,
                                                epx__bench_nodes_op_t op)
{
    epx__bench_nodes_sizes_t sizes;
    int64_t k = shape->num_topk;
    if (op == EPX__BENCH_NODES_DISPATCH) {
        int fp8 = shape->dtype == EPX_DTYPE_FP8_E4M3;
        sizes.payload = shape->hidden * (fp8 ? 1 : 2) + (fp8 ? shape->hidden / 128 * 4 : 0);
        /* The routing travels with the row: ids and weights, and where the row goes on
         * each rank of the destination node. */
        sizes.overhead = k * 8 + k * 4 + (int64_t)shape->ranks_per_node * 4;
        sizes.local_row = sizes.payload;
    } else {
        sizes.payload = shape->hidden * 2;
        sizes.overhead = k * 4;
        sizes.local_row = shape->hidden * 2;
    }
    return sizes;
}

int64_t epx__bench_nodes_network_bytes(const epx__bench_nodes_row_t *row,
                                       const epx__bench_nodes_counts_t *counts)
{
    return counts->records * (row->sizes.payload + row->sizes.overhead);
}

int64_t epx__bench_nodes_local_bytes(const epx__bench_nodes_row_t *row,
                                     const epx__bench_nodes_counts_t *counts)
{
    return (counts->home_rows + counts->forwarded_rows) * row->sizes.local_row;
}

static double per_token(int64_t value, int64_t tokens)
{
    return tokens > 0 ? (double)value / (double)tokens : NAN;
}

static const char *op_name(epx__bench_nodes_op_t op)
{
    return op == EPX__BENCH_NODES_DISPATCH ? "dispatch" : "combine";
}

void epx__bench_nodes_print_plan(FILE *out, const epx_internode_plan_t *plan, int json)
{
    if (json) {
        fprintf(out,
                "{\"mode\":\"normal\",\"internode_plan\":true,\"nodes\":%d,\"credits\":%d,"
                "\"slots_per_channel\":%lld,\"chunk_tokens\":%lld,\"record_bytes\":%lld,"
                "\"partial_bytes\":%lld,\"record_slot_bytes\":%lld,\"partial_slot_bytes\":%lld,"
                "\"buffer_bytes_per_rank\":%lld,\"sms\":%d,\"sender_warps\":%d,"
                "\"receiver_warps\":%d,\"credit_warps\":%d,\"puts_in_flight\":%lld}\n",
                plan->num_nodes, plan->credits, (long long)plan->slots_per_channel,
                (long long)plan->chunk_tokens, (long long)plan->record_bytes,
                (long long)plan->partial_bytes, (long long)plan->record_slot_bytes,
                (long long)plan->partial_slot_bytes, (long long)plan->bytes_per_rank,
                plan->num_sms, plan->sender_warps, plan->receiver_warps, plan->credit_warps,
                (long long)plan->puts_in_flight);
        return;
    }
    char total[32], records[32], partials[32];
    epx__bench_format_bytes((int64_t)plan->bytes_per_rank, total, sizeof(total));
    epx__bench_format_bytes((int64_t)plan->record_slot_bytes, records, sizeof(records));
    epx__bench_format_bytes((int64_t)plan->partial_slot_bytes, partials, sizeof(partials));
    fprintf(out, "# internode memory per rank: %s (epx_buffer_size), of it record slots %s and "
                 "partial-sum slots %s: ",
            total, records, partials);
    if (plan->credits)
        fprintf(out, "rings of %lld tokens per (rank, node) channel (EPX_XN_RING_TOKENS), "
                     "chunks of %lld, credits back\n",
                (long long)plan->slots_per_channel, (long long)plan->chunk_tokens);
    else
        fprintf(out, "%lld tokens per (rank, node) channel, the worst case, no credits\n",
                (long long)plan->slots_per_channel);
    if (plan->credits)
        fprintf(out, "# internode warps per rank (%d SMs): %d senders, %d receivers (dispatch: "
                     "forward records; combine: add up own tokens), %d credit warp; at most "
                     "%lld puts in flight per peer\n",
                plan->num_sms, plan->sender_warps, plan->receiver_warps, plan->credit_warps,
                (long long)plan->puts_in_flight);
    else
        fprintf(out, "# internode warps per rank (%d SMs): all %d send, then forward (dispatch) "
                     "or add up own tokens (combine); at most %lld puts in flight per peer\n",
                plan->num_sms, plan->sender_warps, (long long)plan->puts_in_flight);
    fflush(out);
}

void epx__bench_nodes_print_header(FILE *out, const epx__bench_nodes_shape_t *shape,
                                   int explain)
{
    if (explain)
        fprintf(out,
                "# traffic across nodes, expected from the routing: a token crosses the "
                "network once per destination node other than\n"
                "#   its home node (one record to the rank at the sender's position there, "
                "counted as 1 network message); combine\n"
                "#   sends one bf16 partial row per record back. net = records x (payload + "
                "overhead); local = rows delivered inside\n"
                "#   nodes (home node + forwarded), payload only. Per rank: rank 0's tokens; "
                "per token: all ranks' / all their tokens\n");
    fprintf(out, "# traffic, %d nodes x %d ranks:\n", shape->world_size / shape->ranks_per_node,
            shape->ranks_per_node);
    fprintf(out, "# %-5s %-9s %13s %12s %11s %11s %10s %13s %12s\n", "dtype", "op",
            "net_B/rank", "net_B/token", "payload_B/t", "overhead_B/t", "msgs/token",
            "local_B/rank", "local_B/token");
    fflush(out);
}

static void print_table_row(FILE *out, const epx__bench_nodes_row_t *row)
{
    const epx__bench_nodes_counts_t *total = &row->total;
    fprintf(out, "  %-5s %-9s %13lld ", epx__bench_dtype_text(row->dtype),
            op_name(row->op), (long long)epx__bench_nodes_network_bytes(row, &row->rank0));
    epx__bench_print_number(out, 12, 1,
                            per_token(epx__bench_nodes_network_bytes(row, total), total->tokens),
                            "-");
    fputc(' ', out);
    epx__bench_print_number(out, 11, 1,
                            per_token(total->records * row->sizes.payload, total->tokens), "-");
    fputc(' ', out);
    epx__bench_print_number(out, 11, 1,
                            per_token(total->records * row->sizes.overhead, total->tokens), "-");
    fputc(' ', out);
    epx__bench_print_number(out, 10, 3, per_token(total->records, total->tokens), "-");
    fprintf(out, " %13lld ", (long long)epx__bench_nodes_local_bytes(row, &row->rank0));
    epx__bench_print_number(out, 12, 1,
                            per_token(epx__bench_nodes_local_bytes(row, total), total->tokens),
                            "-");
    fputc('\n', out);
}

void epx__bench_nodes_print_json_start(FILE *out, const char *mode,
                                       const epx__bench_nodes_shape_t *shape, epx_dtype_t dtype,
                                       const char *op)
{
    fprintf(out,
            "{\"mode\":\"%s\",\"traffic\":\"expected\",\"ranks\":%d,\"ranks_per_node\":%d,"
            "\"nodes\":%d,\"experts\":%d,\"topk\":%d,\"hidden\":%lld,\"dtype\":\"%s\","
            "\"traffic_op\":\"%s\"",
            mode, shape->world_size, shape->ranks_per_node,
            shape->world_size / shape->ranks_per_node, shape->num_experts, shape->num_topk,
            (long long)shape->hidden, epx__bench_dtype_text(dtype), op);
}

/* Keys are our own fixed words (nothing to escape). */
static void print_json_row(FILE *out, const epx__bench_nodes_shape_t *shape,
                           const epx__bench_nodes_row_t *row)
{
    const epx__bench_nodes_counts_t *total = &row->total, *rank0 = &row->rank0;
    int64_t net_total = epx__bench_nodes_network_bytes(row, total);
    int64_t local_total = epx__bench_nodes_local_bytes(row, total);
    epx__bench_nodes_print_json_start(out, "normal", shape, row->dtype, op_name(row->op));
    fprintf(out,
            ",\"tokens_total\":%lld,\"records_rank0\":%lld,"
            "\"records_total\":%lld,\"payload_bytes_per_record\":%lld,"
            "\"overhead_bytes_per_record\":%lld,\"local_row_bytes\":%lld,"
            "\"home_rows_total\":%lld,\"forwarded_rows_total\":%lld,"
            "\"network_bytes_per_rank\":%lld,\"network_bytes_total\":%lld,"
            "\"local_bytes_per_rank\":%lld,\"local_bytes_total\":%lld",
            (long long)total->tokens, (long long)rank0->records, (long long)total->records,
            (long long)row->sizes.payload, (long long)row->sizes.overhead,
            (long long)row->sizes.local_row, (long long)total->home_rows,
            (long long)total->forwarded_rows,
            (long long)epx__bench_nodes_network_bytes(row, rank0), (long long)net_total,
            (long long)epx__bench_nodes_local_bytes(row, rank0), (long long)local_total);
    epx__bench_print_json_number(out, "network_bytes_per_token",
                                 per_token(net_total, total->tokens));
    epx__bench_print_json_number(out, "network_payload_bytes_per_token",
                                 per_token(total->records * row->sizes.payload, total->tokens));
    epx__bench_print_json_number(out, "network_overhead_bytes_per_token",
                                 per_token(total->records * row->sizes.overhead, total->tokens));
    epx__bench_print_json_number(out, "network_messages_per_token",
                                 per_token(total->records, total->tokens));
    epx__bench_print_json_number(out, "local_bytes_per_token",
                                 per_token(local_total, total->tokens));
    fprintf(out, "}\n");
}

void epx__bench_nodes_print_row(FILE *out, const epx__bench_nodes_shape_t *shape,
                                const epx__bench_nodes_row_t *row, int json)
{
    if (json)
        print_json_row(out, shape, row);
    else
        print_table_row(out, row);
    fflush(out);
}
