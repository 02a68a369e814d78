/*
 * Glue between the files of src/core only (the logger and the tunables table need a
 * little of each other). Nothing outside src/core should include this; the rest of the
 * library uses core.h.
 */
#ifndef EPX_CORE_PRIVATE_H
#define EPX_CORE_PRIVATE_H

#include <stddef.h>

#include "core/core.h"

/*
 * Lower-case names indexed by epx_log_level_t (EPX_LOG_NONE .. EPX_LOG_TRACE) and by
 * subsystem bit position (core, bootstrap, ...). The params table validates
 * EPX_LOG_LEVEL / EPX_LOG_SUBSYS with the same words the logger parses.
 */
#define EPX__LOG_LEVEL_COUNT 6
#define EPX__LOG_SUBSYS_COUNT 5
extern const char *const epx__log_level_words[EPX__LOG_LEVEL_COUNT];
extern const char *const epx__log_subsys_words[EPX__LOG_SUBSYS_COUNT];

/* 0 and *level set when `text` names a level (case-insensitive); -1 otherwise. */
int epx__log_parse_level(const char *text, epx_log_level_t *level);
/*
 * 0 and *mask set when `text` is a comma list of subsystem words or "all"
 * (case-insensitive). -1 otherwise, with the first bad item copied into `bad_item`.
 */
int epx__log_parse_subsys(const char *text, unsigned *mask, char *bad_item, size_t bad_size);

/*
 * The subsystem a source file belongs to, from its path (src/bootstrap/... is
 * bootstrap), so that errors recorded with EPX_ERROR are filtered like the file's
 * own log lines.
 */
epx_log_subsys_t epx__log_subsys_of_file(const char *file);

/* Forget the logger's configuration and close its file (epx__params_reset calls it). */
void epx__log_reset(void);

#endif /* EPX_CORE_PRIVATE_H */
