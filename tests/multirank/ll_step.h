/*
 * One low-latency step of a multi-rank test (dispatch, then combine of the received rows
 * with the oracle's expert outputs), each checked bit for bit against the oracle
 * (tests/common/moe_ll.h) with a given set of masked ranks. For the fault and rejoin
 * tests, which run many such steps while ranks come and go. bf16, CPU backend memory.
 */
#ifndef EPX_MULTIRANK_LL_STEP_H
#define EPX_MULTIRANK_LL_STEP_H

#include <stdint.h>

#include "epx.h"
#include "moe_ll.h"

typedef struct {
    int world_size;
    int experts_per_rank;
    int topk;
    int64_t hidden;
    int64_t max_tokens; /* the buffer's max_low_latency_tokens */
} ll_shape_t;

typedef struct {
    const ll_shape_t *shape;
    int rank;
    moe_case_t c;
    moe_inputs_t in;
    uint16_t *out;               /* combine output, NaN bits until written */
    epx_ll_dispatch_result_t got;
    epx_ll_combine_result_t combined;
    /* Compare the dispatch's num_masked_entries with the oracle (1 after init). A
     * dispatch that loses a rank in its wait sent that rank its rows before it knew, so
     * its count does not include them. */
    int check_dispatch_masked;
} ll_step_t;

/* Inputs of step `seed` on `rank` (the same seed on every rank makes one step). */
void ll_step_init(ll_step_t *s, const ll_shape_t *shape, int rank, uint64_t seed);
void ll_step_free(ll_step_t *s);

/* The calls; `flags` EPX_LL_SEND_ONLY splits them (the receive follows at once). */
epx_status_t ll_step_dispatch(epx_buffer_t buffer, ll_step_t *s, uint32_t flags);
epx_status_t ll_step_combine(epx_buffer_t buffer, ll_step_t *s, uint32_t flags);

/* Against the oracle with `mask` ([R], 1 = masked; NULL = none); exits on a difference. */
void ll_step_check_dispatch(const ll_step_t *s, const uint8_t *mask, const char *what);
void ll_step_check_combine(const ll_step_t *s, const uint8_t *mask, const char *what);

/*
 * Dispatch, check, combine, check: one whole step with every call expected to succeed
 * and `mask` as the ranks masked on this rank.
 */
void ll_step_run_checked(epx_buffer_t buffer, const ll_shape_t *shape, int rank, uint64_t seed,
                         const uint8_t *mask, uint32_t flags, const char *what);

#endif /* EPX_MULTIRANK_LL_STEP_H */
