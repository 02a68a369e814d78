/*
 * Small helpers for the tests of src/core (params, logging): a clean EPX_* environment,
 * a scratch directory, and reading back what the logger wrote.
 */
#ifndef EPX_CORE_TEST_ENV_H
#define EPX_CORE_TEST_ENV_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "test_util.h"

/* Remove every EPX_* variable, so a developer's own settings cannot change a result. */
static inline void unset_epx_environment(void)
{
    for (;;) {
        char name[256] = "";
        for (char **entry = environ; *entry != NULL; entry++) {
            if (strncmp(*entry, "EPX_", 4) == 0) {
                size_t length = strcspn(*entry, "=");
                snprintf(name, sizeof(name), "%.*s", (int)length, *entry);
                break;
            }
        }
        if (name[0] == '\0')
            break;
        CHECK(unsetenv(name) == 0);
    }
    epx__params_reset();
}

/* A fresh directory under /tmp; the path is static storage. */
static inline const char *make_scratch_dir(void)
{
    static char path[64];
    snprintf(path, sizeof(path), "/tmp/epx-core-test-XXXXXX");
    CHECK(mkdtemp(path) != NULL);
    return path;
}

/* The whole file as a NUL-terminated string (caller frees); "" if it does not exist. */
static inline char *read_text_file(const char *path)
{
    FILE *file = fopen(path, "r");
    if (file == NULL) {
        char *empty = calloc(1, 1);
        CHECK(empty != NULL);
        return empty;
    }
    size_t capacity = 4096, used = 0;
    char *text = malloc(capacity);
    CHECK(text != NULL);
    size_t got;
    while ((got = fread(text + used, 1, capacity - used - 1, file)) > 0) {
        used += got;
        if (capacity - used - 1 == 0) {
            capacity *= 2;
            text = realloc(text, capacity);
            CHECK(text != NULL);
        }
    }
    text[used] = '\0';
    fclose(file);
    return text;
}

static inline int count_occurrences(const char *text, const char *needle)
{
    int count = 0;
    for (const char *at = strstr(text, needle); at != NULL; at = strstr(at + 1, needle))
        count++;
    return count;
}

#endif /* EPX_CORE_TEST_ENV_H */
