/*
 * The tunables table: every EPX_* environment variable, from EPX_PARAM_MAP.
 *
 * The environment is read once, under a mutex, into a cache that the rest of the
 * library reads without locking. Each variable's value is checked as it is read: an
 * integer must be a whole base-10 number in [min, max] (EPX_XN_RING_TOKENS also 0 or a
 * power of two), a word-valued variable one of its words. A bad value makes epx__params_load fail with EPX_ERR_INVALID_ARG naming
 * the variable (and leaves that variable at its default, so that the logger and
 * `epx params` still work). Word values are stored lower-case, so readers can compare
 * them with strcmp. An empty variable counts as unset.
 *
 * Reading is split from reporting: the cache can be filled without logging (the logger
 * itself reads EPX_LOG_LEVEL through it), and the first epx__params_load afterwards
 * logs what the environment changed and warns about EPX_* names nobody knows.
 *
 * This is the only file that reads EPX_* variables from the environment.
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/core.h"
#include "core/core_private.h"
#include "epx_tool.h"

typedef enum {
    EPX__PARAM_INT,
    EPX__PARAM_STRING,
} epx__param_type_t;

typedef struct {
    const char *name; /* "EPX_TIMEOUT_MS" */
    epx__param_type_t type;
    int64_t int_default;
    const char *string_default;
    int64_t min, max;
    const char *doc;
} epx__param_def_t;

/* The map gives one default column; split it by type into the two fields above. */
#define EPX__PARAM_DEFAULTS_INT(def) (int64_t)(def), NULL
#define EPX__PARAM_DEFAULTS_STRING(def) 0, (def)

static const epx__param_def_t epx__param_defs[EPX_PARAM_COUNT_] = {
#define EPX__PARAM_DEF_(name, type, def, min, max, doc) \
    {"EPX_" #name, EPX__PARAM_##type, EPX__PARAM_DEFAULTS_##type(def), (min), (max), doc},
    EPX_PARAM_MAP(EPX__PARAM_DEF_)
#undef EPX__PARAM_DEF_
};

typedef enum {
    EPX__PARAM_FROM_DEFAULT,
    EPX__PARAM_FROM_ENV,
    EPX__PARAM_REJECTED, /* set to a bad value; the default is in force */
} epx__param_origin_t;

#define EPX__PARAM_TEXT_BYTES 1024
#define EPX__PARAM_MESSAGE_BYTES 768

typedef struct {
    epx__param_origin_t origin;
    int64_t int_value;                 /* in force (INT) */
    char env_text[EPX__PARAM_TEXT_BYTES]; /* the environment's text (lower-cased words) */
} epx__param_value_t;

static pthread_mutex_t epx__params_mutex = PTHREAD_MUTEX_INITIALIZER;
static atomic_int epx__params_loaded;
/* Written under the mutex before epx__params_loaded is set; read-only afterwards. */
static epx__param_value_t epx__params_values[EPX_PARAM_COUNT_];
static epx_status_t epx__params_status;
static char epx__params_message[EPX__PARAM_MESSAGE_BYTES];
static int epx__params_first_rejected = -1;
static int epx__params_reported; /* under the mutex */

/* "a, b, c" from a word table, for messages that list the allowed values. */
static void epx__join_words(char *out, size_t size, const char *const *words, int count,
                            const char *extra)
{
    size_t used = 0;
    out[0] = '\0';
    for (int i = 0; i < count + (extra != NULL); i++) {
        const char *word = i < count ? words[i] : extra;
        int written = snprintf(out + used, size - used, "%s%s", i ? ", " : "", word);
        if (written < 0 || (size_t)written >= size - used)
            return;
        used += (size_t)written;
    }
}

static void epx__lower_case(char *text)
{
    for (; *text != '\0'; text++)
        *text = (char)tolower((unsigned char)*text);
}

/*
 * Check one value (`text`, not empty) of tunable `id`. 0 on success with *int_value set
 * for INT tunables; -1 with a message naming the variable and what it accepts.
 */
static int epx__param_check(int id, const char *text, int64_t *int_value, char *why,
                            size_t why_size)
{
    const epx__param_def_t *def = &epx__param_defs[id];
    char allowed[256];
    if (def->type == EPX__PARAM_INT) {
        char *end = NULL;
        errno = 0;
        long long value = strtoll(text, &end, 10);
        if (end == text || *end != '\0') {
            snprintf(why, why_size, "%s=%s is not an integer; expected an integer in [%" PRId64
                     ", %" PRId64 "]", def->name, text, def->min, def->max);
            return -1;
        }
        if (errno == ERANGE || value < def->min || value > def->max) {
            snprintf(why, why_size, "%s=%s is out of range; expected an integer in [%" PRId64
                     ", %" PRId64 "]", def->name, text, def->min, def->max);
            return -1;
        }
        /* Ring slots are taken modulo the ring and split into equal chunks. */
        if (id == EPX_PARAM_XN_RING_TOKENS && (value & (value - 1)) != 0) {
            snprintf(why, why_size, "%s=%s is not a power of two; expected 0 (slots for the "
                     "worst case, no credits) or a power of two in [1, %" PRId64 "]",
                     def->name, text, def->max);
            return -1;
        }
        *int_value = value;
        return 0;
    }

    switch ((epx_param_id_t)id) {
    case EPX_PARAM_LOG_LEVEL: {
        epx_log_level_t level;
        if (epx__log_parse_level(text, &level) == 0)
            return 0;
        epx__join_words(allowed, sizeof(allowed), epx__log_level_words, EPX__LOG_LEVEL_COUNT,
                        NULL);
        snprintf(why, why_size, "%s=%s is not a log level; expected one of: %s", def->name,
                 text, allowed);
        return -1;
    }
    case EPX_PARAM_LOG_SUBSYS: {
        unsigned mask;
        char bad[64];
        if (epx__log_parse_subsys(text, &mask, bad, sizeof(bad)) == 0)
            return 0;
        epx__join_words(allowed, sizeof(allowed), epx__log_subsys_words,
                        EPX__LOG_SUBSYS_COUNT, "all");
        snprintf(why, why_size, "%s=%s has an unknown subsystem \"%s\"; expected a comma list "
                 "of: %s", def->name, text, bad, allowed);
        return -1;
    }
    case EPX_PARAM_BACKEND: {
        const char *backends[] = {epx_backend_name(EPX_BACKEND_AUTO),
                                  epx_backend_name(EPX_BACKEND_HOST),
                                  epx_backend_name(EPX_BACKEND_CUDA)};
        for (int i = 0; i < 3; i++) {
            if (strcasecmp(text, backends[i]) == 0)
                return 0;
        }
        epx__join_words(allowed, sizeof(allowed), backends, 3, NULL);
        snprintf(why, why_size, "%s=%s is not a backend; expected one of: %s", def->name, text,
                 allowed);
        return -1;
    }
    default:
        return 0; /* free text (paths, addresses, ids): their users check them */
    }
}

static int epx__param_is_word_valued(int id)
{
    return id == EPX_PARAM_LOG_LEVEL || id == EPX_PARAM_LOG_SUBSYS || id == EPX_PARAM_BACKEND;
}

/* Fill the cache from the environment; called with the mutex held. */
static void epx__params_read_locked(void)
{
    epx__params_status = EPX_SUCCESS;
    epx__params_message[0] = '\0';
    epx__params_first_rejected = -1;
    for (int id = 0; id < EPX_PARAM_COUNT_; id++) {
        const epx__param_def_t *def = &epx__param_defs[id];
        epx__param_value_t *value = &epx__params_values[id];
        value->origin = EPX__PARAM_FROM_DEFAULT;
        value->int_value = def->int_default;
        value->env_text[0] = '\0';

        const char *env = getenv(def->name);
        if (env == NULL || env[0] == '\0')
            continue;
        snprintf(value->env_text, sizeof(value->env_text), "%s", env);
        if (epx__param_is_word_valued(id))
            epx__lower_case(value->env_text);

        char why[EPX__PARAM_MESSAGE_BYTES];
        int64_t parsed = def->int_default;
        int bad;
        if (strlen(env) >= sizeof(value->env_text)) {
            snprintf(why, sizeof(why), "%s is longer than %zu characters", def->name,
                     sizeof(value->env_text) - 1);
            bad = 1;
        } else {
            bad = epx__param_check(id, value->env_text, &parsed, why, sizeof(why)) != 0;
        }
        if (bad) {
            value->origin = EPX__PARAM_REJECTED;
            if (epx__params_first_rejected < 0) {
                epx__params_first_rejected = id;
                epx__params_status = EPX_ERR_INVALID_ARG;
                snprintf(epx__params_message, sizeof(epx__params_message), "%s", why);
            }
            continue;
        }
        value->origin = EPX__PARAM_FROM_ENV;
        value->int_value = parsed;
    }
}

/* Fill the cache if it is empty, without logging (safe to call from the logger). */
static void epx__params_ensure_read(void)
{
    if (atomic_load_explicit(&epx__params_loaded, memory_order_acquire))
        return;
    pthread_mutex_lock(&epx__params_mutex);
    if (!atomic_load_explicit(&epx__params_loaded, memory_order_relaxed)) {
        epx__params_read_locked();
        atomic_store_explicit(&epx__params_loaded, 1, memory_order_release);
    }
    pthread_mutex_unlock(&epx__params_mutex);
}

/* The default as shown to people: the number, or the string ("" when empty). */
static void epx__param_default_text(int id, char *out, size_t size)
{
    const epx__param_def_t *def = &epx__param_defs[id];
    if (def->type == EPX__PARAM_INT)
        snprintf(out, size, "%" PRId64, def->int_default);
    else
        snprintf(out, size, "%s", def->string_default[0] ? def->string_default : "\"\"");
}

/* Edit distance, for "did you mean" hints; long names are not compared. */
static int epx__edit_distance(const char *a, const char *b)
{
    enum { LONGEST = 48 };
    size_t la = strlen(a), lb = strlen(b);
    if (la > LONGEST || lb > LONGEST)
        return LONGEST;
    int row[LONGEST + 1];
    for (size_t j = 0; j <= lb; j++)
        row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diagonal = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int above = row[j];
            int cost = toupper((unsigned char)a[i - 1]) != toupper((unsigned char)b[j - 1]);
            int best = diagonal + cost;
            if (above + 1 < best)
                best = above + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diagonal = above;
        }
    }
    return row[lb];
}

/* One warning per EPX_* variable that is not in the table, with a near miss if any. */
static void epx__params_warn_unknown(void)
{
    for (char **entry = environ; entry != NULL && *entry != NULL; entry++) {
        if (strncmp(*entry, "EPX_", 4) != 0)
            continue;
        const char *equals = strchr(*entry, '=');
        size_t length = equals ? (size_t)(equals - *entry) : strlen(*entry);
        char name[128];
        snprintf(name, sizeof(name), "%.*s", (int)length, *entry);

        int known = 0, nearest = -1, nearest_distance = 1 << 30;
        for (int id = 0; id < EPX_PARAM_COUNT_ && !known; id++) {
            known = strcmp(name, epx__param_defs[id].name) == 0;
            int distance = epx__edit_distance(name, epx__param_defs[id].name);
            if (distance < nearest_distance) {
                nearest_distance = distance;
                nearest = id;
            }
        }
        if (known)
            continue;
        /* Two edits catch a dropped, doubled or swapped letter and a wrong case. */
        if (nearest >= 0 && nearest_distance <= 2)
            EPX_WARN(EPX_SUBSYS_CORE, "unknown variable %s ignored; did you mean %s?", name,
                     epx__param_defs[nearest].name);
        else
            EPX_WARN(EPX_SUBSYS_CORE, "unknown variable %s ignored (`epx params` lists the "
                     "known ones)", name);
    }
}

/* Say, once per reading of the environment, what it changed and what it got wrong. */
static void epx__params_report(void)
{
    for (int id = 0; id < EPX_PARAM_COUNT_; id++) {
        const epx__param_value_t *value = &epx__params_values[id];
        char default_text[EPX__PARAM_TEXT_BYTES];
        epx__param_default_text(id, default_text, sizeof(default_text));
        if (value->origin == EPX__PARAM_FROM_ENV) {
            EPX_INFO(EPX_SUBSYS_CORE, "%s=%s (default %s)", epx__param_defs[id].name,
                     value->env_text, default_text);
        } else if (value->origin == EPX__PARAM_REJECTED && id != epx__params_first_rejected) {
            /* The first bad value is the error itself; the others would go unseen. */
            char why[EPX__PARAM_MESSAGE_BYTES];
            int64_t ignored;
            if (epx__param_check(id, value->env_text, &ignored, why, sizeof(why)) != 0)
                EPX_WARN(EPX_SUBSYS_CORE, "%s", why);
            else
                EPX_WARN(EPX_SUBSYS_CORE, "%s is too long", epx__param_defs[id].name);
        }
    }
    epx__params_warn_unknown();
}

epx_status_t epx__params_load(void)
{
    epx__params_ensure_read();
    pthread_mutex_lock(&epx__params_mutex);
    int report = !epx__params_reported;
    epx__params_reported = 1;
    epx_status_t status = epx__params_status;
    char message[EPX__PARAM_MESSAGE_BYTES];
    snprintf(message, sizeof(message), "%s", epx__params_message);
    pthread_mutex_unlock(&epx__params_mutex);

    /* Logging happens outside the mutex: the logger reads the table too. */
    if (report)
        epx__params_report();
    if (status != EPX_SUCCESS)
        return EPX_ERROR(status, "%s", message);
    return EPX_SUCCESS;
}

/*
 * The readers fill the cache themselves (quietly) when nobody has loaded it yet, so
 * a value is never silently the default just because of the order of calls.
 */
int64_t epx__param_int(epx_param_id_t id)
{
    if ((int)id < 0 || id >= EPX_PARAM_COUNT_)
        return 0;
    epx__params_ensure_read();
    return epx__params_values[id].int_value;
}

/* The string in force; "" for an INT tunable. */
const char *epx__param_string(epx_param_id_t id)
{
    if ((int)id < 0 || id >= EPX_PARAM_COUNT_ || epx__param_defs[id].type != EPX__PARAM_STRING)
        return "";
    epx__params_ensure_read();
    const epx__param_value_t *value = &epx__params_values[id];
    return value->origin == EPX__PARAM_FROM_ENV ? value->env_text
                                                 : epx__param_defs[id].string_default;
}

epx_status_t epx__param_read_now(epx_param_id_t id, int *is_set, int64_t *int_value, char *text,
                                 size_t text_size)
{
    if ((int)id < 0 || id >= EPX_PARAM_COUNT_)
        return EPX_ERROR(EPX_ERR_INTERNAL, "params: no tunable %d", (int)id);
    const epx__param_def_t *def = &epx__param_defs[id];
    if (int_value != NULL)
        *int_value = def->int_default;
    if (text != NULL && text_size > 0)
        snprintf(text, text_size, "%s", def->type == EPX__PARAM_STRING ? def->string_default : "");
    /* getenv here, like the cache's reader: this file is where the environment is read. */
    const char *env = getenv(def->name);
    *is_set = env != NULL && env[0] != '\0';
    if (!*is_set)
        return EPX_SUCCESS;
    char value[EPX__PARAM_TEXT_BYTES];
    if (strlen(env) >= sizeof(value))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s is longer than %zu characters", def->name,
                         sizeof(value) - 1);
    snprintf(value, sizeof(value), "%s", env);
    if (epx__param_is_word_valued(id))
        epx__lower_case(value);
    char why[EPX__PARAM_MESSAGE_BYTES];
    int64_t parsed = def->int_default;
    if (epx__param_check(id, value, &parsed, why, sizeof(why)) != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s", why);
    if (int_value != NULL)
        *int_value = parsed;
    if (text != NULL && text_size > 0) {
        if (strlen(value) >= text_size)
            return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s is longer than %zu characters", def->name,
                             text_size - 1);
        snprintf(text, text_size, "%s", value);
    }
    return EPX_SUCCESS;
}

/* At most this many characters of a value in the table, so one long id keeps it legible. */
#define EPX__PARAM_PRINT_VALUE_WIDTH 40

static void epx__param_value_text(int id, char *out, size_t size)
{
    const epx__param_value_t *value = &epx__params_values[id];
    char text[EPX__PARAM_TEXT_BYTES];
    if (epx__param_defs[id].type == EPX__PARAM_INT) {
        snprintf(text, sizeof(text), "%" PRId64, value->int_value);
    } else {
        const char *string = epx__param_string((epx_param_id_t)id);
        snprintf(text, sizeof(text), "%s", string[0] ? string : "\"\"");
    }
    if (strlen(text) > EPX__PARAM_PRINT_VALUE_WIDTH)
        memcpy(text + EPX__PARAM_PRINT_VALUE_WIDTH - 3, "...", 4);
    const char *mark = value->origin == EPX__PARAM_FROM_ENV   ? " *"
                       : value->origin == EPX__PARAM_REJECTED ? " !"
                                                              : "";
    snprintf(out, size, "%s%s", text, mark);
}

void epx__params_print(FILE *out)
{
    epx__params_ensure_read();
    int name_width = 4, default_width = 7, value_width = 5;
    int any_env = 0, any_rejected = 0;
    for (int id = 0; id < EPX_PARAM_COUNT_; id++) {
        char text[EPX__PARAM_TEXT_BYTES];
        int length = (int)strlen(epx__param_defs[id].name);
        name_width = length > name_width ? length : name_width;
        epx__param_default_text(id, text, sizeof(text));
        length = (int)strlen(text);
        default_width = length > default_width ? length : default_width;
        epx__param_value_text(id, text, sizeof(text));
        length = (int)strlen(text);
        value_width = length > value_width ? length : value_width;
        any_env |= epx__params_values[id].origin == EPX__PARAM_FROM_ENV;
        any_rejected |= epx__params_values[id].origin == EPX__PARAM_REJECTED;
    }

    fprintf(out, "%-*s  %-6s  %-*s  %-*s  %s\n", name_width, "NAME", "TYPE", default_width,
            "DEFAULT", value_width, "VALUE", "DESCRIPTION");
    for (int id = 0; id < EPX_PARAM_COUNT_; id++) {
        const epx__param_def_t *def = &epx__param_defs[id];
        char default_text[EPX__PARAM_TEXT_BYTES], value_text[EPX__PARAM_TEXT_BYTES];
        epx__param_default_text(id, default_text, sizeof(default_text));
        epx__param_value_text(id, value_text, sizeof(value_text));
        fprintf(out, "%-*s  %-6s  %-*s  %-*s  %s\n", name_width, def->name,
                def->type == EPX__PARAM_INT ? "int" : "string", default_width, default_text,
                value_width, value_text, def->doc);
    }
    if (any_env)
        fprintf(out, "* set from the environment\n");
    for (int id = 0; id < EPX_PARAM_COUNT_ && any_rejected; id++) {
        if (epx__params_values[id].origin != EPX__PARAM_REJECTED)
            continue;
        char why[EPX__PARAM_MESSAGE_BYTES];
        int64_t ignored;
        if (epx__param_check(id, epx__params_values[id].env_text, &ignored, why, sizeof(why)))
            fprintf(out, "! rejected, default in force: %s\n", why);
        else
            fprintf(out, "! rejected, default in force: %s is too long\n",
                    epx__param_defs[id].name);
    }
}

void epx__params_reset(void)
{
    pthread_mutex_lock(&epx__params_mutex);
    atomic_store_explicit(&epx__params_loaded, 0, memory_order_release);
    epx__params_reported = 0;
    epx__params_status = EPX_SUCCESS;
    epx__params_message[0] = '\0';
    epx__params_first_rejected = -1;
    pthread_mutex_unlock(&epx__params_mutex);
    /* The logger caches its level and file from the table; make it read them again. */
    epx__log_reset();
}

/* ---------------------------------------------------------------- public (include/epx_tool.h) */

epx_status_t epx_params_load(void)
{
    epx__clear_error();
    return epx__params_load();
}

int epx_param_count(void)
{
    return EPX_PARAM_COUNT_;
}

epx_status_t epx_param_info(int index, epx_param_info_t *info)
{
    epx__clear_error();
    if (info == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "param_info: info is NULL");
    if (info->size != sizeof(epx_param_info_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "param_info: info.size is %zu, expected %zu (use EPX_PARAM_INFO_INIT)",
                         info->size, sizeof(epx_param_info_t));
    if (index < 0 || index >= EPX_PARAM_COUNT_)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "param_info: index %d is outside 0..%d", index,
                         EPX_PARAM_COUNT_ - 1);
    epx__params_ensure_read();
    const epx__param_def_t *def = &epx__param_defs[index];
    epx_param_info_t filled = EPX_PARAM_INFO_INIT;
    filled.name = def->name;
    filled.doc = def->doc;
    filled.is_int = def->type == EPX__PARAM_INT;
    if (filled.is_int) {
        filled.int_default = def->int_default;
        filled.int_value = epx__params_values[index].int_value;
    } else {
        filled.string_default = def->string_default;
        filled.string_value = epx__param_string((epx_param_id_t)index);
    }
    *info = filled;
    return EPX_SUCCESS;
}

epx_status_t epx_param_find(const char *name, epx_param_info_t *info)
{
    epx__clear_error();
    if (name == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "param_find: name is NULL");
    for (int id = 0; id < EPX_PARAM_COUNT_; id++)
        if (strcmp(epx__param_defs[id].name, name) == 0)
            return epx_param_info(id, info);
    return EPX_ERROR(EPX_ERR_INVALID_ARG, "param_find: %s is not an epx tunable (epx params "
                     "lists them)", name);
}

epx_status_t epx_params_print(FILE *out)
{
    epx__clear_error();
    if (out == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "params_print: out is NULL");
    epx__params_print(out);
    return EPX_SUCCESS;
}
