/*
 * The judgement of `epx doctor`'s env.internode line (doctor_internode.h): pure, so the
 * unit test can feed it any values. The check that gathers the inputs is in
 * doctor_env.c.
 */
#include "doctor_internode.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "doctor_parse.h"

typedef struct {
    char *text;
    size_t size;
    size_t used;
} text_t;

static void append(text_t *t, const char *format, ...) __attribute__((format(printf, 2, 3)));

static void append(text_t *t, const char *format, ...)
{
    if (t->used >= t->size)
        return;
    va_list args;
    va_start(args, format);
    int written = vsnprintf(t->text + t->used, t->size - t->used, format, args);
    va_end(args);
    if (written > 0)
        t->used += (size_t)written;
}

static int is_set(const char *value)
{
    return value != NULL && value[0] != '\0';
}

/* NVSHMEM's booleans: 1, true, yes, on (any case) are true. */
static int is_true(const char *value)
{
    return is_set(value) && (strcmp(value, "1") == 0 || strcasecmp(value, "true") == 0 ||
                             strcasecmp(value, "yes") == 0 || strcasecmp(value, "on") == 0);
}

/* A whole positive number; 0 when `text` is not one. */
static long long positive(const char *text)
{
    char *end = NULL;
    long long value = strtoll(text, &end, 10);
    return end != text && *end == '\0' && value > 0 ? value : 0;
}

/* One "NAME=value (what it means)" line of the detail. */
static void setting(text_t *t, const char *name, const char *value, const char *unset)
{
    append(t, "\n%s=%s", name, is_set(value) ? value : "unset");
    if (!is_set(value))
        append(t, " (%s)", unset);
}

/* A problem: a line of the detail; the first one's fix becomes the line's fix. */
static void problem(text_t *detail, int *problems, char *fix, size_t fix_size,
                    const char *fix_text, const char *format, ...)
    __attribute__((format(printf, 6, 7)));

static void problem(text_t *detail, int *problems, char *fix, size_t fix_size,
                    const char *fix_text, const char *format, ...)
{
    append(detail, "\nproblem: ");
    if (detail->used < detail->size) {
        va_list args;
        va_start(args, format);
        int written =
            vsnprintf(detail->text + detail->used, detail->size - detail->used, format, args);
        va_end(args);
        if (written > 0)
            detail->used += (size_t)written;
    }
    if (*problems == 0)
        snprintf(fix, fix_size, "%s", fix_text);
    (*problems)++;
}

epx__doctor_status_t epx__doctor_internode_assess(const epx__doctor_internode_in_t *in,
                                                  char *detail_text, size_t detail_size,
                                                  char *fix, size_t fix_size)
{
    text_t detail = {detail_text, detail_size, 0};
    detail_text[0] = '\0';
    fix[0] = '\0';
    int nodes = in->ranks_per_node > 0 ? in->world_size / in->ranks_per_node : 1;
    append(&detail, "internode normal mode, %d ranks as %d nodes x %d, %lld tokens/rank: ",
           in->world_size, nodes, in->ranks_per_node, (long long)in->tokens);
    if (!in->plan_ok) {
        append(&detail, "not planned: %s", is_set(in->plan_error) ? in->plan_error : "?");
    } else if (in->plan.credits) {
        append(&detail, "rings of %lld tokens per (rank, node) channel, chunks of %lld, credits "
                        "(EPX_XN_RING_TOKENS=%lld)",
               (long long)in->plan.slots_per_channel, (long long)in->plan.chunk_tokens,
               (long long)in->ring_tokens);
    } else {
        append(&detail, "slots for the worst case, %lld tokens per (rank, node) channel, no "
                        "credits (EPX_XN_RING_TOKENS=%lld)",
               (long long)in->plan.slots_per_channel, (long long)in->ring_tokens);
    }
    if (in->plan_ok) {
        char bytes[32];
        epx__doctor_format_bytes((uint64_t)in->plan.bytes_per_rank, bytes, sizeof(bytes));
        append(&detail, "; %s per rank; at most %lld puts in flight to one peer (%d SMs)", bytes,
               (long long)in->plan.puts_in_flight, in->plan.num_sms);
    }
    setting(&detail, "NVSHMEM_IB_ENABLE_IBGDA", in->ib_enable_ibgda,
            "off: the NIC is driven by NVSHMEM's CPU proxy, IBRC or UCX");
    setting(&detail, "NVSHMEM_IBGDA_NUM_RC_PER_PE", in->ibgda_num_rc_per_pe,
            "NVSHMEM's default queue pairs per peer");
    char depth_default[64];
    snprintf(depth_default, sizeof(depth_default), "NVSHMEM's default, %d work requests",
             EPX__DOCTOR_NVSHMEM_QP_DEPTH);
    setting(&detail, "NVSHMEM_QP_DEPTH", in->qp_depth, depth_default);
    if (is_set(in->ibgda_qp_depth))
        setting(&detail, "NVSHMEM_IBGDA_QP_DEPTH", in->ibgda_qp_depth, "");
    setting(&detail, "NVSHMEM_DISABLE_P2P", in->disable_p2p, "P2P on");
    setting(&detail, "NVSHMEM_DISABLE_NVLS", in->disable_nvls,
            "NVLS on where the GPUs have it; epx launch sets 1");
    append(&detail, "\nEPX_TIMEOUT_MS=%lld", (long long)in->timeout_ms);

    int problems = 0;
    char why[320];
    if (is_true(in->disable_p2p) && in->ranks_per_node > 1)
        problem(&detail, &problems, fix, fix_size,
                "unset NVSHMEM_DISABLE_P2P: epx stores to the ranks of its node through "
                "NVSHMEM's peer mappings",
                "NVSHMEM_DISABLE_P2P=%s with %d ranks per node: the ranks of a node cannot "
                "reach each other directly, so a buffer whose group spans nodes is refused",
                in->disable_p2p, in->ranks_per_node);
    long long depth = EPX__DOCTOR_NVSHMEM_QP_DEPTH;
    if (is_set(in->qp_depth)) {
        depth = positive(in->qp_depth);
        if (depth == 0)
            problem(&detail, &problems, fix, fix_size,
                    "give NVSHMEM_QP_DEPTH a whole number of work requests, e.g. 1024",
                    "NVSHMEM_QP_DEPTH=%s is not a positive whole number", in->qp_depth);
    }
    if (is_set(in->ibgda_num_rc_per_pe) && positive(in->ibgda_num_rc_per_pe) == 0 &&
        strcmp(in->ibgda_num_rc_per_pe, "0") != 0)
        problem(&detail, &problems, fix, fix_size,
                "give NVSHMEM_IBGDA_NUM_RC_PER_PE a whole number of queue pairs, e.g. 2",
                "NVSHMEM_IBGDA_NUM_RC_PER_PE=%s is not a whole number", in->ibgda_num_rc_per_pe);
    if (is_set(in->ibgda_qp_depth) && !is_set(in->qp_depth))
        problem(&detail, &problems, fix, fix_size,
                "set NVSHMEM_QP_DEPTH instead (the same value)",
                "NVSHMEM_IBGDA_QP_DEPTH=%s is not read by NVSHMEM 3, whose queue pairs take "
                "NVSHMEM_QP_DEPTH (%d by default)",
                in->ibgda_qp_depth, EPX__DOCTOR_NVSHMEM_QP_DEPTH);
    if (in->plan_ok && depth > 0 && depth < 2 * in->plan.puts_in_flight) {
        snprintf(why, sizeof(why),
                 "raise NVSHMEM_QP_DEPTH to %lld or more, or make EPX_XN_RING_TOKENS smaller "
                 "(each put in flight holds 2 work requests)",
                 2 * (long long)in->plan.puts_in_flight);
        problem(&detail, &problems, fix, fix_size, why,
                "a queue pair of %lld work requests is shallower than the %lld that %lld puts "
                "in flight to one peer may hold (data and signal each; the queue pairs of a "
                "peer are picked per block, so one may carry them all): puts would wait for "
                "free slots",
                depth, 2 * (long long)in->plan.puts_in_flight,
                (long long)in->plan.puts_in_flight);
    }
    if (in->gpus > 0 && in->world_size > in->gpus && !is_true(in->disable_nvls))
        problem(&detail, &problems, fix, fix_size,
                "export NVSHMEM_DISABLE_NVLS=1 (epx launch sets it for its ranks)",
                "%d ranks share %d GPU%s with NVLink multicast (NVLS) on: NVLS objects fail "
                "when ranks share a GPU",
                in->world_size, in->gpus, in->gpus == 1 ? "" : "s");
    if (in->timeout_ms < EPX__DOCTOR_MIN_TIMEOUT_MS)
        problem(&detail, &problems, fix, fix_size,
                "set EPX_TIMEOUT_MS to a few seconds or more (30000 by default)",
                "EPX_TIMEOUT_MS=%lld is under a second: a slow peer or a network retry across "
                "nodes becomes an error",
                (long long)in->timeout_ms);
    if (problems > 0)
        return EPX__DOCTOR_WARN;
    return in->plan_ok ? EPX__DOCTOR_PASS : EPX__DOCTOR_SKIP;
}
