/*
 * `epx doctor`'s env.internode check: the settings that govern internode normal mode's
 * traffic (NVSHMEM's IBGDA switch, queue pairs per peer and their depth, P2P and NVLS;
 * EPX_TIMEOUT_MS and EPX_XN_RING_TOKENS) with their values, set or default, against the
 * plan of the buffer (epx_internode_plan). The judgement is a pure function of its
 * inputs, so the unit test (tests/unit/test_doctor_internode.c) feeds it made-up ones.
 */
#ifndef EPX_TOOLS_DOCTOR_INTERNODE_H
#define EPX_TOOLS_DOCTOR_INTERNODE_H

#include <stddef.h>
#include <stdint.h>

#include "doctor_report.h"
#include "epx_tool.h"

/* NVSHMEM's default depth of a queue pair (NVSHMEM_QP_DEPTH, work requests). */
#define EPX__DOCTOR_NVSHMEM_QP_DEPTH 1024
/* Below this EPX_TIMEOUT_MS a slow peer or a network retry becomes an error. */
#define EPX__DOCTOR_MIN_TIMEOUT_MS 1000

typedef struct {
    /* NVSHMEM_* as the environment has them; NULL or "" = unset. */
    const char *ib_enable_ibgda;
    const char *ibgda_num_rc_per_pe;
    const char *qp_depth;       /* NVSHMEM_QP_DEPTH */
    const char *ibgda_qp_depth; /* NVSHMEM_IBGDA_QP_DEPTH, a name NVSHMEM 3 does not read */
    const char *disable_p2p;
    const char *disable_nvls;
    /* EPX_* in force. */
    int64_t timeout_ms;
    int64_t ring_tokens; /* EPX_XN_RING_TOKENS */
    /* The group planned for. */
    int world_size;
    int ranks_per_node;
    int gpus;            /* visible GPUs, 0 = none or unknown */
    int64_t tokens;      /* max_tokens_per_rank of the planned buffer */
    /* epx_internode_plan's answer: plan_ok = 0 with plan_error set when it refused. */
    int plan_ok;
    epx_internode_plan_t plan;
    const char *plan_error;
} epx__doctor_internode_in_t;

/*
 * The line's status, detail (every value, then what is wrong) and fix (for the first
 * problem; "" when none). Problems, each a warning: P2P disabled while a node has
 * several ranks (the buffer is refused), a queue pair shallower than the work requests
 * the plan may have in flight to one peer (2 per put: data and signal), a value that is
 * not a number, NVSHMEM_IBGDA_QP_DEPTH without NVSHMEM_QP_DEPTH, NVLS on while ranks
 * share a GPU, EPX_TIMEOUT_MS under a second. Skip when the plan was refused.
 */
epx__doctor_status_t epx__doctor_internode_assess(const epx__doctor_internode_in_t *in,
                                                  char *detail, size_t detail_size, char *fix,
                                                  size_t fix_size);

#endif /* EPX_TOOLS_DOCTOR_INTERNODE_H */
