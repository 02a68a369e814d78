/*
 * `epx launch`: start N ranks of a program on this machine, each with the EPX_*
 * environment epx_group_create_from_env reads, forward their output line by line with
 * a "[rank r] " prefix, and stop them all when one fails or the timeout passes.
 * `epx bench -n N` uses the same code to re-run itself.
 */
#ifndef EPX_TOOLS_LAUNCH_H
#define EPX_TOOLS_LAUNCH_H

#include <stdint.h>

/* Exit status when the overall timeout ended the run (the same as timeout(1)). */
#define EPX__LAUNCH_TIMEOUT_STATUS 124

typedef struct {
    int num_ranks;          /* >= 1 */
    int use_mps;            /* start a CUDA MPS daemon for the ranks, stop it afterwards */
    double timeout_s;       /* whole run; 0 = no limit */
    int ranks_per_node;     /* EPX_RANKS_PER_NODE for the ranks; 0 = leave it unset */
    const char *backend;    /* EPX_BACKEND for the ranks; NULL = leave it unset */
    int prefix_stdout;      /* "[rank r] " before stdout lines (stderr always has it) */
    char *const *argv;      /* program and arguments, NULL-terminated */
} epx__launch_options_t;

/* No overall time limit unless asked for (--timeout): a training job runs for days. */
#define EPX__LAUNCH_OPTIONS_INIT {0, 0, 0.0, 0, NULL, 1, NULL}

/*
 * Make a unique id, start the MPS daemon if asked, run the ranks and supervise them.
 * Returns the exit status for the launcher: 0 when every rank exited with 0, else the
 * first failing rank's status (128 + signal for a signal), 124 on timeout, 1 when the
 * launcher itself could not start the ranks.
 */
int epx__launch_run(const epx__launch_options_t *options);

/*
 * The supervision part of epx__launch_run (tools/launch/launch_ranks.c): fork and exec the
 * ranks with `unique_id` in their environment, forward output, handle failures,
 * signals and the timeout. Same return value.
 */
int epx__launch_ranks(const epx__launch_options_t *options, const char *unique_id);

#endif /* EPX_TOOLS_LAUNCH_H */
