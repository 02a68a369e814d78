/*
 * The cases of test_bad_input, split by entry point; shared fixture and expectation.
 */
#ifndef EPX_MULTIRANK_BAD_INPUT_H
#define EPX_MULTIRANK_BAD_INPUT_H

#include "epx.h"
#include "moe_case.h"

#define BI_HIDDEN 256
#define BI_MAX_TOKENS 16
#define BI_EXPERTS_PER_RANK 8
#define BI_TOPK 2
#define BI_TOKENS 4

extern epx_group_t bi_group;
extern epx_group_info_t bi_info;

/*
 * The call returned `want` and the last error names `culprit` as a word (an argument,
 * field or rank). Prints the rejection; ends the test otherwise.
 */
void bi_expect(const char *what, epx_status_t got, epx_status_t want, const char *culprit);

/*
 * An input error the GPU finds on the device (the host never reads the tensor): after the
 * stream has run, the buffer's async error is EPX_ERR_INVALID_ARG and its text contains
 * `names`. Prints it; ends the test otherwise.
 */
void bi_expect_async(epx_buffer_t buffer, const char *what, const char *names);

/* A fresh buffer and valid dispatch arguments for `tokens` tokens of this rank. */
typedef struct {
    moe_case_t c;
    moe_inputs_t host;
    void *x, *scales, *idx, *weights; /* operation memory (mem.h) */
    epx_buffer_config_t config;
    epx_buffer_t buffer;
    epx_dispatch_args_t args;
    epx_dispatch_result_t result;
    void *outputs[4]; /* caller outputs a case attached (freed by bi_teardown) */
} bi_fixture_t;

void bi_setup(bi_fixture_t *f, epx_dtype_t dtype, int64_t tokens);
/* Set topk_idx[token][j] (host and operation memory). */
void bi_set_expert(bi_fixture_t *f, int64_t token, int j, int64_t expert);
void bi_teardown(bi_fixture_t *f);

void bi_run_config_cases(void);
void bi_run_dispatch_cases(void);
void bi_run_combine_cases(void);
void bi_run_layout_cases(void);
void bi_run_remote_cases(void);
void bi_run_abort_cases(void); /* bad_input_remote.c */
/* Mistakes in a call's form: no effect where made; cached mode ignores routing. */
void bi_run_form_cases(void); /* bad_input_form.c */
void bi_run_ll_cases(void); /* bad_input_ll.c */
/* Rows not on the backend's boundary (16 bytes on the GPU), refused before anything is
 * sent; then a valid step on the same buffer, in device memory (every rank calls it). */
void bi_run_ll_alignment_cases(void); /* bad_input_ll.c */
/* epx_buffer_register / deregister refusals, one rank and across ranks
 * (bad_input_register.c). */
void bi_run_register_cases(void);
void bi_run_register_remote_cases(void);
/* epx_fanout_copy (tool support): refusals, then the copy checked (bad_input_fanout.c). */
void bi_run_fanout_cases(void);
/* epx_fanin_reduce (tool support): refusals, then a valid call (bad_input_fanin.c). */
void bi_run_fanin_cases(void);

#endif /* EPX_MULTIRANK_BAD_INPUT_H */
