/* Strict flag-value parsing for the `epx` subcommands. */
#include "common/args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int epx__parse_int64(const char *text, int64_t min, int64_t max, int64_t *value)
{
    if (text == NULL || *text == '\0')
        return -1;
    errno = 0;
    char *end = NULL;
    long long parsed = strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0')
        return -1;
    if (parsed < min || parsed > max)
        return -1;
    *value = parsed;
    return 0;
}

int epx__parse_double(const char *text, double min, double max, double *value)
{
    if (text == NULL || *text == '\0')
        return -1;
    errno = 0;
    char *end = NULL;
    double parsed = strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !isfinite(parsed))
        return -1;
    if (parsed < min || parsed > max)
        return -1;
    *value = parsed;
    return 0;
}

int epx__match_value(int argc, char **argv, int *index, const char *name, const char **value)
{
    const char *arg = argv[*index];
    size_t length = strlen(name);
    if (strncmp(arg, name, length) != 0)
        return 0;
    if (arg[length] == '=') {
        *value = arg + length + 1;
        return 1;
    }
    if (arg[length] != '\0')
        return 0;
    if (*index + 1 >= argc)
        return -1;
    *value = argv[*index + 1];
    *index += 1;
    return 1;
}
