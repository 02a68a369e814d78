/*
 * The levelled logger.
 *
 * Each line reads `epx[host:pid:rank] LEVEL subsys file:line message`, so that the lines
 * of many ranks merged into one terminal or one file can be told apart and grepped.
 * The level and the subsystem mask come from EPX_LOG_LEVEL / EPX_LOG_SUBSYS through the
 * tunables table, read lazily on the first log call (a bad value there falls back to
 * the default, warn/all: the table reports the bad value itself as an error).
 *
 * Lines go to stderr, or to EPX_LOG_FILE where %p becomes the pid and %r the rank. The
 * file is opened on first use; when the pid (after fork) or the rank (after a group is
 * created) no longer matches the name it was opened under, it is reopened, so each
 * process and rank ends up in its own file. Every line is formatted first and written
 * with one call under a mutex, so lines of concurrent threads never interleave.
 */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/core.h"
#include "core/core_private.h"

const char *const epx__log_level_words[EPX__LOG_LEVEL_COUNT] = {
    "none", "error", "warn", "info", "debug", "trace",
};
static const char *const epx__log_level_labels[EPX__LOG_LEVEL_COUNT] = {
    "NONE", "ERROR", "WARN", "INFO", "DEBUG", "TRACE",
};
const char *const epx__log_subsys_words[EPX__LOG_SUBSYS_COUNT] = {
    "core", "bootstrap", "transport", "ops", "tools",
};

#define EPX__LOG_PATH_BYTES 1024
#define EPX__LOG_LINE_BYTES 2048

/* The configuration is read once; the flag is set last, with release order. */
static pthread_mutex_t epx__log_mutex = PTHREAD_MUTEX_INITIALIZER;
static atomic_int epx__log_configured;
static atomic_int epx__log_level = EPX_LOG_WARN;
static atomic_uint epx__log_mask = EPX_SUBSYS_ALL;
static atomic_int epx__log_rank = -1;
static char epx__log_host[64];

/* Guarded by epx__log_mutex. */
static char epx__log_pattern[EPX__LOG_PATH_BYTES]; /* EPX_LOG_FILE; "" = stderr */
static FILE *epx__log_file;      /* the open file; NULL = not opened (yet) */
static int epx__log_file_failed; /* the open failed: stderr until pid/rank change */
static pid_t epx__log_file_pid;  /* the pid and rank the file was opened (or tried) for */
static int epx__log_file_rank;

int epx__log_parse_level(const char *text, epx_log_level_t *level)
{
    for (int i = 0; i < EPX__LOG_LEVEL_COUNT; i++) {
        if (strcasecmp(text, epx__log_level_words[i]) == 0) {
            *level = (epx_log_level_t)i;
            return 0;
        }
    }
    return -1;
}

/* Bit of one subsystem word (or all of them for "all"); 0 when the word is unknown. */
static unsigned epx__log_subsys_bit(const char *word, size_t length)
{
    if (length == 3 && strncasecmp(word, "all", 3) == 0)
        return EPX_SUBSYS_ALL;
    for (int i = 0; i < EPX__LOG_SUBSYS_COUNT; i++) {
        if (strlen(epx__log_subsys_words[i]) == length &&
            strncasecmp(word, epx__log_subsys_words[i], length) == 0)
            return 1u << i;
    }
    return 0;
}

int epx__log_parse_subsys(const char *text, unsigned *mask, char *bad_item, size_t bad_size)
{
    unsigned result = 0;
    const char *item = text;
    for (;;) {
        const char *end = strchr(item, ',');
        size_t length = end ? (size_t)(end - item) : strlen(item);
        /* Tolerate spaces around items ("core, ops"), nothing else. */
        const char *word = item;
        size_t word_length = length;
        while (word_length > 0 && isspace((unsigned char)word[0])) {
            word++;
            word_length--;
        }
        while (word_length > 0 && isspace((unsigned char)word[word_length - 1]))
            word_length--;
        unsigned bit = epx__log_subsys_bit(word, word_length);
        if (bit == 0) {
            if (bad_item != NULL && bad_size > 0)
                snprintf(bad_item, bad_size, "%.*s", (int)word_length, word);
            return -1;
        }
        result |= bit;
        if (end == NULL)
            break;
        item = end + 1;
    }
    *mask = result;
    return 0;
}

epx_log_subsys_t epx__log_subsys_of_file(const char *file)
{
    if (file == NULL)
        return EPX_SUBSYS_CORE;
    const char *source = NULL;
    for (const char *at = strstr(file, "src/"); at != NULL; at = strstr(at + 1, "src/")) {
        if (at == file || at[-1] == '/')
            source = at + 4;
    }
    if (source != NULL) {
        if (strncmp(source, "bootstrap/", 10) == 0)
            return EPX_SUBSYS_BOOTSTRAP;
        if (strncmp(source, "transport/", 10) == 0)
            return EPX_SUBSYS_TRANSPORT;
        if (strncmp(source, "ops/", 4) == 0)
            return EPX_SUBSYS_OPS;
        return EPX_SUBSYS_CORE;
    }
    if (strncmp(file, "tools/", 6) == 0 || strstr(file, "/tools/") != NULL)
        return EPX_SUBSYS_TOOLS;
    return EPX_SUBSYS_CORE;
}

/* The path a reader needs: below src/ when the file is in it ("ops/host/combine.c"). */
static const char *epx__log_short_path(const char *file)
{
    if (file == NULL)
        return "?";
    const char *source = strstr(file, "/src/");
    if (source != NULL) {
        const char *next;
        while ((next = strstr(source + 1, "/src/")) != NULL)
            source = next;
        return source + 5;
    }
    if (strncmp(file, "src/", 4) == 0)
        return file + 4;
    const char *slash = strrchr(file, '/');
    return slash ? slash + 1 : file;
}

static const char *epx__log_subsys_word(epx_log_subsys_t subsys)
{
    for (int i = 0; i < EPX__LOG_SUBSYS_COUNT; i++) {
        if ((unsigned)subsys & (1u << i))
            return epx__log_subsys_words[i];
    }
    return "core";
}

static void epx__log_configure(void)
{
    pthread_mutex_lock(&epx__log_mutex);
    if (!atomic_load_explicit(&epx__log_configured, memory_order_relaxed)) {
        /* epx__param_string loads the table without logging, so this cannot recurse. */
        epx_log_level_t level = EPX_LOG_WARN;
        unsigned mask = EPX_SUBSYS_ALL;
        if (epx__log_parse_level(epx__param_string(EPX_PARAM_LOG_LEVEL), &level) != 0)
            level = EPX_LOG_WARN;
        if (epx__log_parse_subsys(epx__param_string(EPX_PARAM_LOG_SUBSYS), &mask, NULL, 0) != 0)
            mask = EPX_SUBSYS_ALL;
        snprintf(epx__log_pattern, sizeof(epx__log_pattern), "%s",
                 epx__param_string(EPX_PARAM_LOG_FILE));

        if (gethostname(epx__log_host, sizeof(epx__log_host)) != 0)
            snprintf(epx__log_host, sizeof(epx__log_host), "unknown");
        epx__log_host[sizeof(epx__log_host) - 1] = '\0';
        /* The short name is what people call the node; the domain only adds width. */
        char *dot = strchr(epx__log_host, '.');
        if (dot != NULL && dot != epx__log_host)
            *dot = '\0';

        atomic_store_explicit(&epx__log_level, (int)level, memory_order_relaxed);
        atomic_store_explicit(&epx__log_mask, mask, memory_order_relaxed);
        atomic_store_explicit(&epx__log_configured, 1, memory_order_release);
    }
    pthread_mutex_unlock(&epx__log_mutex);
}

int epx__log_enabled(epx_log_level_t level, epx_log_subsys_t subsys)
{
    if (!atomic_load_explicit(&epx__log_configured, memory_order_acquire))
        epx__log_configure();
    return level > EPX_LOG_NONE &&
           (int)level <= atomic_load_explicit(&epx__log_level, memory_order_relaxed) &&
           ((unsigned)subsys & atomic_load_explicit(&epx__log_mask, memory_order_relaxed)) != 0;
}

void epx__log_set_rank(int rank)
{
    atomic_store_explicit(&epx__log_rank, rank < 0 ? -1 : rank, memory_order_relaxed);
}

/* The rank as printed: "-" until a group has set it. */
static void epx__log_format_rank(char *text, size_t size, int rank)
{
    if (rank >= 0)
        snprintf(text, size, "%d", rank);
    else
        snprintf(text, size, "-");
}

/* EPX_LOG_FILE with %p and %r replaced; %% is a percent sign. */
static void epx__log_expand_path(char *path, size_t size, pid_t pid, int rank)
{
    size_t used = 0;
    path[0] = '\0';
    for (const char *in = epx__log_pattern; *in != '\0' && used + 1 < size; in++) {
        char piece[32];
        const char *text = piece;
        if (in[0] == '%' && in[1] == 'p') {
            snprintf(piece, sizeof(piece), "%ld", (long)pid);
            in++;
        } else if (in[0] == '%' && in[1] == 'r') {
            epx__log_format_rank(piece, sizeof(piece), rank);
            in++;
        } else if (in[0] == '%' && in[1] == '%') {
            snprintf(piece, sizeof(piece), "%%");
            in++;
        } else {
            piece[0] = in[0];
            piece[1] = '\0';
        }
        int written = snprintf(path + used, size - used, "%s", text);
        if (written < 0)
            break;
        used += (size_t)written;
        if (used >= size)
            used = size - 1;
    }
}

/* The stream for a line from this pid and rank; called with epx__log_mutex held. */
static FILE *epx__log_stream_locked(pid_t pid, int rank)
{
    if (epx__log_pattern[0] == '\0')
        return stderr;
    int reopen = (epx__log_file != NULL || epx__log_file_failed) &&
                 ((strstr(epx__log_pattern, "%p") != NULL && pid != epx__log_file_pid) ||
                  (strstr(epx__log_pattern, "%r") != NULL && rank != epx__log_file_rank));
    if (reopen) {
        if (epx__log_file != NULL)
            fclose(epx__log_file);
        epx__log_file = NULL;
        epx__log_file_failed = 0;
    }
    if (epx__log_file != NULL)
        return epx__log_file;
    if (epx__log_file_failed)
        return stderr;

    char path[EPX__LOG_PATH_BYTES];
    epx__log_expand_path(path, sizeof(path), pid, rank);
    epx__log_file_pid = pid;
    epx__log_file_rank = rank;
    epx__log_file = fopen(path, "ae"); /* e: not inherited by exec */
    if (epx__log_file == NULL) {
        int open_errno = errno;
        /* The logger cannot log through itself here; say it on stderr, once. */
        epx__log_file_failed = 1;
        char rank_text[16];
        epx__log_format_rank(rank_text, sizeof(rank_text), rank);
        fprintf(stderr,
                "epx[%s:%ld:%s] WARN core core/log.c:%d cannot open EPX_LOG_FILE %s (%s); "
                "logging to stderr\n",
                epx__log_host, (long)pid, rank_text, __LINE__, path, strerror(open_errno));
        return stderr;
    }
    /* Line buffered: a crash loses at most the line being written. */
    setvbuf(epx__log_file, NULL, _IOLBF, 0);
    return epx__log_file;
}

void epx__log(epx_log_level_t level, epx_log_subsys_t subsys, const char *file, int line,
              const char *fmt, ...)
{
    if (!epx__log_enabled(level, subsys))
        return;

    char message[EPX__LOG_LINE_BYTES];
    va_list args;
    va_start(args, fmt);
    int length = vsnprintf(message, sizeof(message), fmt, args);
    va_end(args);
    if (length < 0) {
        snprintf(message, sizeof(message), "(unformattable log message \"%s\")", fmt);
        length = (int)strlen(message);
    }
    if ((size_t)length >= sizeof(message))
        length = (int)sizeof(message) - 1;
    /* The logger ends the line; a caller's own newline would leave a blank one. */
    while (length > 0 && message[length - 1] == '\n')
        message[--length] = '\0';

    pid_t pid = getpid();
    int rank = atomic_load_explicit(&epx__log_rank, memory_order_relaxed);
    char rank_text[16];
    epx__log_format_rank(rank_text, sizeof(rank_text), rank);
    int level_index = level < EPX__LOG_LEVEL_COUNT ? (int)level : EPX__LOG_LEVEL_COUNT - 1;

    char text[EPX__LOG_LINE_BYTES + 256];
    snprintf(text, sizeof(text), "epx[%s:%ld:%s] %s %s %s:%d %s\n", epx__log_host, (long)pid,
             rank_text, epx__log_level_labels[level_index], epx__log_subsys_word(subsys),
             epx__log_short_path(file), line, message);

    pthread_mutex_lock(&epx__log_mutex);
    FILE *stream = epx__log_stream_locked(pid, rank);
    fputs(text, stream);
    pthread_mutex_unlock(&epx__log_mutex);
}

void epx__log_reset(void)
{
    pthread_mutex_lock(&epx__log_mutex);
    if (epx__log_file != NULL)
        fclose(epx__log_file);
    epx__log_file = NULL;
    epx__log_file_failed = 0;
    epx__log_pattern[0] = '\0';
    atomic_store_explicit(&epx__log_configured, 0, memory_order_release);
    pthread_mutex_unlock(&epx__log_mutex);
}
