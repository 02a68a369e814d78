/*
 * Comparisons of normal-mode results against the oracle (tests/common/moe_case.h), for
 * test_normal. A mismatch ends the program with one line that names the case, the rank,
 * the step, the field and the first differing element.
 */
#ifndef EPX_MULTIRANK_NORMAL_CHECK_H
#define EPX_MULTIRANK_NORMAL_CHECK_H

#include <stdint.h>

#include "epx.h"
#include "moe_case.h"

/* What is being checked: for messages and for the expected values. */
typedef struct {
    const char *case_name;
    int rank;
    const moe_case_t *c;
    const moe_expected_t *e; /* oracle dispatch for this rank */
    const moe_inputs_t *in;  /* this rank's inputs, host copy */
} nt_ctx_t;

void nt_fail(const nt_ctx_t *ctx, const char *step, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));

/* Layout outputs (host copies) against the oracle's layout of this rank's inputs. */
void nt_check_layout(const nt_ctx_t *ctx, const int32_t *per_rank, const int32_t *per_expert,
                     const uint8_t *in_rank);

/*
 * A dispatch result copied to the host. The counts come from the host fields, or from
 * the device copies when the backend left them out (worst-case mode on a GPU).
 */
typedef struct {
    int64_t num_recv;
    void *x;
    float *scales;
    int64_t *idx;     /* NULL when the result has no recv_topk_idx */
    float *weights;   /* NULL when the result has no recv_topk_weights */
    int32_t *per_expert;
    int num_local_experts;
} nt_recv_t;

void nt_recv_download(const nt_ctx_t *ctx, const char *step, const epx_dispatch_result_t *res,
                      nt_recv_t *out);
void nt_recv_free(nt_recv_t *recv);

/*
 * Everything a dispatch returned against the oracle, exactly. `want_idx` and
 * `want_weights` say whether recv_topk_idx / recv_topk_weights must be present.
 */
void nt_check_recv(const nt_ctx_t *ctx, const char *step, const nt_recv_t *got, int want_idx,
                   int want_weights);

/*
 * Combine output rows against `want` (bf16 bits), exactly: the backends sum in the
 * oracle's order (+0 and -0 count as equal).
 */
void nt_check_bf16_rows(const nt_ctx_t *ctx, const char *step, const uint16_t *got,
                        const uint16_t *want, int64_t rows, int64_t hidden);

/* Combined top-k weights: the original weight where the entry is an expert, else 0. */
void nt_check_combined_weights(const nt_ctx_t *ctx, const char *step, const float *got);

#endif /* EPX_MULTIRANK_NORMAL_CHECK_H */
