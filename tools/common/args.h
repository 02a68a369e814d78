/*
 * Small helpers shared by the `epx` subcommands: strict number parsing (a flag value
 * with trailing junk is an error, never silently truncated) and "--flag VALUE" /
 * "--flag=VALUE" matching.
 */
#ifndef EPX_TOOLS_ARGS_H
#define EPX_TOOLS_ARGS_H

#include <stdint.h>

/* 0 on success; -1 when `text` is not an integer within [min, max]. */
int epx__parse_int64(const char *text, int64_t min, int64_t max, int64_t *value);
/* 0 on success; -1 when `text` is not a finite number within [min, max]. */
int epx__parse_double(const char *text, double min, double max, double *value);

/*
 * If argv[*index] is `name` followed by a value ("--tokens 64") or `name=value`
 * ("--tokens=64"), store the value, advance *index past what was consumed minus one
 * (so the caller's loop increment lands on the next flag) and return 1. Return 0 when
 * argv[*index] is a different flag, -1 when it is `name` without a value.
 */
int epx__match_value(int argc, char **argv, int *index, const char *name, const char **value);

#endif /* EPX_TOOLS_ARGS_H */
