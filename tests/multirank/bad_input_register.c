/*
 * epx_buffer_register / epx_buffer_deregister refusals (test_bad_input): each names what
 * is wrong; with two or more ranks the other ranks get EPX_ERR_REMOTE naming the rank
 * that refused, not a hang; a refusal leaves the buffer usable.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bad_input.h"
#include "mem.h"
#include "test_util.h"

#define INVALID EPX_ERR_INVALID_ARG
#define RANGE_BYTES 4096

/* The buffer still works: a dispatch goes through and its handle is destroyed. */
static void expect_usable(bi_fixture_t *f)
{
    CHECK_OK(epx_dispatch(f->buffer, &f->args, &f->result, NULL));
    CHECK_OK(epx_handle_destroy(f->result.handle));
    f->result = (epx_dispatch_result_t)EPX_DISPATCH_RESULT_INIT;
}

void bi_run_register_cases(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    char *a = mr_mem_alloc(RANGE_BYTES, 0);
    bi_expect("register on a NULL buffer", epx_buffer_register(NULL, a, RANGE_BYTES), INVALID,
              "buffer");
    bi_expect("register a NULL ptr", epx_buffer_register(f.buffer, NULL, RANGE_BYTES), INVALID,
              "ptr");
    bi_expect("register 0 bytes", epx_buffer_register(f.buffer, a, 0), INVALID, "bytes");
    bi_expect("register a range past the address space",
              epx_buffer_register(f.buffer, (void *)(UINTPTR_MAX - 64), RANGE_BYTES), INVALID,
              "wraps");

    /* The buffer's own combine-input region is read in place already. */
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    epx_tensor_t view = EPX_TENSOR_NONE;
    CHECK_OK(epx_get_combine_input(f.buffer, f.result.handle, &view));
    bi_expect("register the combine-input view", epx_buffer_register(f.buffer, view.data, 256),
              INVALID, "combine-input");
    CHECK_OK(epx_handle_destroy(f.result.handle));
    f.result = (epx_dispatch_result_t)EPX_DISPATCH_RESULT_INIT;

    if (mr_mem_is_device()) {
        /* Host memory has no CUDA IPC handle: the CUDA backend says what it needs. */
        char *host = malloc(RANGE_BYTES);
        CHECK(host != NULL);
        bi_expect("register host memory (CUDA backend)",
                  epx_buffer_register(f.buffer, host, RANGE_BYTES), INVALID, "device");
        free(host);
    }

    /* Overlaps, then a full table. */
    CHECK_OK(epx_buffer_register(f.buffer, a, RANGE_BYTES));
    bi_expect("register a range overlapping another",
              epx_buffer_register(f.buffer, a + 1024, RANGE_BYTES), INVALID, "overlaps");
    char *more[EPX_MAX_REGISTERED];
    for (int i = 1; i < EPX_MAX_REGISTERED; i++) {
        more[i] = mr_mem_alloc(RANGE_BYTES, 0);
        CHECK_OK(epx_buffer_register(f.buffer, more[i], RANGE_BYTES));
    }
    char *extra = mr_mem_alloc(RANGE_BYTES, 0);
    bi_expect("register one range too many", epx_buffer_register(f.buffer, extra, RANGE_BYTES),
              EPX_ERR_CAPACITY, "EPX_MAX_REGISTERED");

    bi_expect("deregister on a NULL buffer", epx_buffer_deregister(NULL, a), INVALID, "buffer");
    bi_expect("deregister NULL", epx_buffer_deregister(f.buffer, NULL), INVALID, "start");
    bi_expect("deregister inside a range", epx_buffer_deregister(f.buffer, a + 16), INVALID,
              "start");
    bi_expect("deregister unregistered memory", epx_buffer_deregister(f.buffer, extra), INVALID,
              "start");
    expect_usable(&f);

    /* A freed slot is taken again; every range goes before the memory does. */
    CHECK_OK(epx_buffer_deregister(f.buffer, more[3]));
    CHECK_OK(epx_buffer_register(f.buffer, extra, RANGE_BYTES));
    CHECK_OK(epx_buffer_deregister(f.buffer, extra));
    CHECK_OK(epx_buffer_deregister(f.buffer, a));
    for (int i = 1; i < EPX_MAX_REGISTERED; i++)
        if (i != 3)
            CHECK_OK(epx_buffer_deregister(f.buffer, more[i]));
    bi_expect("deregister a range twice", epx_buffer_deregister(f.buffer, a), INVALID, "start");
    for (int i = 1; i < EPX_MAX_REGISTERED; i++)
        mr_mem_free(more[i]);
    mr_mem_free(extra);

    /* A range still registered when the buffer goes is released with it. */
    CHECK_OK(epx_buffer_register(f.buffer, a, RANGE_BYTES));
    epx_buffer_t gone = f.buffer;
    bi_teardown(&f);
    bi_expect("register on a destroyed buffer", epx_buffer_register(gone, a, RANGE_BYTES),
              INVALID, "buffer");
    mr_mem_free(a);
}

/* Rank 1 refuses; every other rank learns it from the vote. */
static void expect_one_refusal(const char *what, epx_status_t got, epx_status_t want,
                               const char *culprit)
{
    char text[160];
    if (bi_info.rank == 1) {
        snprintf(text, sizeof text, "%s (this rank)", what);
        bi_expect(text, got, want, culprit);
    } else {
        snprintf(text, sizeof text, "%s (on rank 1)", what);
        bi_expect(text, got, EPX_ERR_REMOTE, "rank 1");
    }
}

void bi_run_register_remote_cases(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    char *a = mr_mem_alloc(RANGE_BYTES, 0);
    expect_one_refusal("register, rank 1 passes NULL",
                       epx_buffer_register(f.buffer, bi_info.rank == 1 ? NULL : a, RANGE_BYTES),
                       INVALID, "ptr");
    if (mr_mem_is_device()) {
        char *host = malloc(RANGE_BYTES);
        CHECK(host != NULL);
        expect_one_refusal("register, rank 1 passes host memory",
                           epx_buffer_register(f.buffer, bi_info.rank == 1 ? host : a, RANGE_BYTES),
                           INVALID, "device");
        free(host);
    }
    /* Refusals leave nothing registered anywhere: the same range registers now. */
    CHECK_OK(epx_buffer_register(f.buffer, a, RANGE_BYTES));
    expect_one_refusal("deregister, rank 1 passes another pointer",
                       epx_buffer_deregister(f.buffer, bi_info.rank == 1 ? a + 16 : a), INVALID,
                       "start");
    expect_usable(&f);

    /* Two ranges, then rank 0 deregisters the first while the others deregister the
     * second: every rank is refused (the calls are out of order), nothing changes. */
    char *b = mr_mem_alloc(RANGE_BYTES, 0);
    CHECK_OK(epx_buffer_register(f.buffer, b, RANGE_BYTES));
    bi_expect("deregister, ranks in a different order",
              epx_buffer_deregister(f.buffer, bi_info.rank == 0 ? a : b), INVALID,
              "same order");
    CHECK_ERROR_MENTIONS(bi_info.rank == 0 ? "rank 1's call is for registered range"
                                           : "rank 0's call is for registered range");
    CHECK_OK(epx_buffer_deregister(f.buffer, b));
    mr_mem_free(b);

    CHECK_OK(epx_buffer_deregister(f.buffer, a));
    bi_teardown(&f);
    mr_mem_free(a);
}
