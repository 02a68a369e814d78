/*
 * Assertions for C tests. A failed check prints file:line and the expression (and the
 * library's last error for status checks), then ends the test process with status 1.
 */
#ifndef EPX_TEST_UTIL_H
#define EPX_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx.h"

#define TEST_FAIL(...)                                              \
    do {                                                            \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);        \
        fprintf(stderr, __VA_ARGS__);                               \
        fprintf(stderr, "\n");                                      \
        exit(1);                                                    \
    } while (0)

#define CHECK(cond)                                 \
    do {                                            \
        if (!(cond))                                \
            TEST_FAIL("check failed: %s", #cond);   \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                              \
    do {                                                                                \
        long long check_a_ = (long long)(a), check_b_ = (long long)(b);                 \
        if (check_a_ != check_b_)                                                       \
            TEST_FAIL("%s == %s: %lld != %lld", #a, #b, check_a_, check_b_);            \
    } while (0)

/* Two C strings must be equal; prints the expression and both strings otherwise. */
#define CHECK_STR(got, expected)                                                      \
    do {                                                                              \
        const char *check_got_ = (got), *check_expected_ = (expected);                \
        if (strcmp(check_got_, check_expected_) != 0)                                 \
            TEST_FAIL("%s: got \"%s\", expected \"%s\"", #got, check_got_,            \
                      check_expected_);                                               \
    } while (0)

/* The call must return `expected`; prints both names and the last error otherwise. */
#define CHECK_STATUS(call, expected)                                                    \
    do {                                                                                \
        epx_status_t check_got_ = (call);                                               \
        if (check_got_ != (expected))                                                   \
            TEST_FAIL("%s returned %s, expected %s (last error: %s)", #call,            \
                      epx_status_name(check_got_), epx_status_name(expected),           \
                      epx_last_error());                                                \
    } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, EPX_SUCCESS)

/* The last error message must mention `needle` (a rejected input names what was wrong). */
#define CHECK_ERROR_MENTIONS(needle)                                                    \
    do {                                                                                \
        if (strstr(epx_last_error(), (needle)) == NULL)                                 \
            TEST_FAIL("last error \"%s\" does not mention \"%s\"", epx_last_error(),    \
                      (needle));                                                        \
    } while (0)

#endif /* EPX_TEST_UTIL_H */
