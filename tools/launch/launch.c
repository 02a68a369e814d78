/*
 * `epx launch`: the command line, the unique id and the optional CUDA MPS daemon.
 * Starting and supervising the ranks is in launch_ranks.c.
 *
 * MPS matters because several ranks usually share one GPU here (docs/DESIGN.md section 4):
 * without it the GPU time-slices between processes and a cross-process flag round trip
 * takes milliseconds instead of microseconds.
 */
#include <errno.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/args.h"
#include "common/commands.h"
#include "common/tool.h"
#include "epx.h"
#include "launch.h"

#define MPS_CONTROL "nvidia-cuda-mps-control"

static const char launch_usage[] =
    "usage: epx launch -n N [options] -- PROGRAM [ARGS...]\n"
    "\n"
    "Start N ranks of PROGRAM on this machine, each with EPX_RANK, EPX_WORLD_SIZE,\n"
    "EPX_LOCAL_RANK and EPX_UNIQUE_ID set (what epx_group_create_from_env reads), and\n"
    "NVSHMEM_DISABLE_NVLS=1 / NCCL_NVLS_ENABLE=0 unless already set. Each output line\n"
    "is forwarded with a \"[rank R] \" prefix. If a rank fails, the others get SIGTERM\n"
    "(SIGKILL 3 s later) and the launcher exits with the failing rank's status\n"
    "(128 + signal number for a signal).\n"
    "\n"
    "options:\n"
    "  -n, --nproc N          number of ranks (required)\n"
    "  --timeout SECONDS      stop every rank and exit 124 after this long\n"
    "                         (default: no limit; 0 = no limit)\n"
    "  --ranks-per-node M     set EPX_RANKS_PER_NODE=M (virtual nodes for tests)\n"
    "  --backend B            set EPX_BACKEND=B (auto, host or cuda)\n"
    "  --mps                  run a CUDA MPS daemon for the ranks (needs " MPS_CONTROL ")\n"
    "  -h, --help             this text\n";

static int usage_error(const char *format, const char *detail)
{
    fprintf(stderr, "epx launch: ");
    fprintf(stderr, format, detail);
    fprintf(stderr, "\n\n%s", launch_usage);
    return 2;
}

/* ---------------------------------------------------------------- MPS */

/* Nonzero when `name` is an executable file in one of the PATH directories. */
static int found_in_path(const char *name)
{
    const char *path = getenv("PATH");
    if (path == NULL || *path == '\0')
        path = "/usr/local/bin:/usr/bin:/bin";
    char candidate[4096];
    while (*path != '\0') {
        const char *end = strchr(path, ':');
        size_t length = end != NULL ? (size_t)(end - path) : strlen(path);
        if (length == 0) /* an empty entry means the current directory */
            snprintf(candidate, sizeof(candidate), "./%s", name);
        else
            snprintf(candidate, sizeof(candidate), "%.*s/%s", (int)length, path, name);
        if (access(candidate, X_OK) == 0)
            return 1;
        path += length;
        if (*path == ':')
            path++;
    }
    return 0;
}

/* How long one call of the MPS control program may take when --timeout is not given. */
#define MPS_CONTROL_LIMIT_S 60.0

/* Run the MPS control program with `input` (may be NULL) on its stdin; its status, or -1
 * (said why) when it could not run or did not finish within `limit_s` (then killed). */
static int run_mps_control(const char *argument, const char *input, double limit_s)
{
    int input_pipe[2] = {-1, -1};
    if (input != NULL && pipe(input_pipe) != 0) {
        fprintf(stderr, "epx launch: pipe: %s\n", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "epx launch: fork: %s\n", strerror(errno));
        if (input != NULL) {
            close(input_pipe[0]);
            close(input_pipe[1]);
        }
        return -1;
    }
    if (pid == 0) {
        if (input != NULL) {
            dup2(input_pipe[0], 0);
            close(input_pipe[0]);
            close(input_pipe[1]);
        }
        /* A NULL argument ends the list early: the program then runs without one. */
        char *const argv[] = {MPS_CONTROL, (char *)argument, NULL};
        execvp(MPS_CONTROL, argv);
        dprintf(2, "epx launch: cannot run %s: %s\n", MPS_CONTROL, strerror(errno));
        _exit(127);
    }
    if (input != NULL) {
        close(input_pipe[0]);
        ssize_t written = write(input_pipe[1], input, strlen(input));
        (void)written; /* a control program that died early shows in its status */
        close(input_pipe[1]);
    }
    int64_t deadline = epx__tool_now_ns() + (int64_t)(limit_s * 1e9);
    int wait_status = epx__tool_wait_child(pid, deadline);
    if (wait_status < 0) {
        if (epx__tool_now_ns() >= deadline)
            fprintf(stderr, "epx launch: --mps: '%s %s' did not finish within %.0f s; stopped it\n",
                    MPS_CONTROL, argument != NULL ? argument : "(quit)", limit_s);
        return -1;
    }
    if (WIFEXITED(wait_status))
        return WEXITSTATUS(wait_status);
    return 128 + WTERMSIG(wait_status);
}

static int make_dir(const char *path)
{
    if (mkdir(path, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "epx launch: --mps: cannot create %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/*
 * Start the daemon with private pipe and log directories, so that it cannot collide
 * with another user's daemon; the directories go into the environment the ranks
 * inherit, which is how their CUDA runtime finds this daemon.
 */
static int start_mps(char *root, size_t root_size, double limit_s)
{
    if (!found_in_path(MPS_CONTROL)) {
        fprintf(stderr,
                "epx launch: --mps needs %s, which is not in PATH (it comes with the NVIDIA "
                "driver; run without --mps, or add its directory to PATH)\n",
                MPS_CONTROL);
        return -1;
    }
    char pipe_dir[512], log_dir[512];
    snprintf(root, root_size, "/tmp/epx-mps-%ld", (long)getpid());
    snprintf(pipe_dir, sizeof(pipe_dir), "%s/pipe", root);
    snprintf(log_dir, sizeof(log_dir), "%s/log", root);
    if (make_dir(root) != 0 || make_dir(pipe_dir) != 0 || make_dir(log_dir) != 0)
        return -1;
    setenv("CUDA_MPS_PIPE_DIRECTORY", pipe_dir, 1);
    setenv("CUDA_MPS_LOG_DIRECTORY", log_dir, 1);
    int status = run_mps_control("-d", NULL, limit_s);
    if (status != 0) {
        fprintf(stderr, "epx launch: --mps: '%s -d' failed (status %d); see %s\n", MPS_CONTROL,
                status, log_dir);
        return -1;
    }
    return 0;
}

static int remove_entry(const char *path, const struct stat *info, int type, struct FTW *ftw)
{
    (void)info;
    (void)type;
    (void)ftw;
    remove(path);
    return 0;
}

/* Ask the daemon to quit (same environment as at start), then tidy its directories. */
static void stop_mps(const char *root, int keep_logs, double limit_s)
{
    int status = run_mps_control(NULL, "quit\n", limit_s);
    if (status != 0) {
        fprintf(stderr, "epx launch: --mps: 'echo quit | %s' failed (status %d); the daemon "
                "may still run with CUDA_MPS_PIPE_DIRECTORY=%s/pipe\n", MPS_CONTROL, status,
                root);
        return;
    }
    if (keep_logs) {
        fprintf(stderr, "epx launch: MPS logs kept in %s/log\n", root);
        return;
    }
    nftw(root, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
}

/* ---------------------------------------------------------------- run */

int epx__launch_run(const epx__launch_options_t *options)
{
    epx_status_t status = epx_params_load();
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "epx launch: %s: %s\n", epx_status_name(status), epx_last_error());
        return 1;
    }
    epx_unique_id_t id;
    char id_text[2 * EPX_UNIQUE_ID_BYTES + 64];
    status = epx_get_unique_id(&id);
    if (status == EPX_SUCCESS)
        status = epx_unique_id_to_string(&id, id_text, sizeof(id_text));
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "epx launch: cannot make a unique id: %s: %s\n",
                epx_status_name(status), epx_last_error());
        return 1;
    }
    char mps_root[256] = "";
    /* The MPS control program's calls are bounded too: by --timeout when given. */
    double mps_limit_s = options->timeout_s > 0 ? options->timeout_s : MPS_CONTROL_LIMIT_S;
    if (options->use_mps && start_mps(mps_root, sizeof(mps_root), mps_limit_s) != 0)
        return 1;

    int exit_status = epx__launch_ranks(options, id_text);

    if (options->use_mps)
        stop_mps(mps_root, exit_status != 0, mps_limit_s);
    return exit_status;
}

int epx__command_launch(int argc, char **argv)
{
    epx__launch_options_t options = EPX__LAUNCH_OPTIONS_INIT;
    int program = -1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = NULL;
        int64_t number = 0;
        int matched;
        if (strcmp(arg, "--") == 0) {
            program = i + 1;
            break;
        }
        if (arg[0] != '-') { /* the program may also follow the flags without "--" */
            program = i;
            break;
        }
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            fputs(launch_usage, stdout);
            return 0;
        }
        if (strcmp(arg, "--mps") == 0) {
            options.use_mps = 1;
        } else if ((matched = epx__match_value(argc, argv, &i, "-n", &value)) != 0 ||
                   (matched = epx__match_value(argc, argv, &i, "--nproc", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 20, &number) != 0)
                return usage_error("-n needs a number of ranks >= 1, got '%s'",
                                   value != NULL ? value : "");
            options.num_ranks = (int)number;
        } else if ((matched = epx__match_value(argc, argv, &i, "--timeout", &value)) != 0) {
            if (matched < 0 || epx__parse_double(value, 0, 1e9, &options.timeout_s) != 0)
                return usage_error("--timeout needs seconds >= 0, got '%s'",
                                   value != NULL ? value : "");
        } else if ((matched = epx__match_value(argc, argv, &i, "--ranks-per-node", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 20, &number) != 0)
                return usage_error("--ranks-per-node needs a number >= 1, got '%s'",
                                   value != NULL ? value : "");
            options.ranks_per_node = (int)number;
        } else if ((matched = epx__match_value(argc, argv, &i, "--backend", &value)) != 0) {
            if (matched < 0 || (strcmp(value, "auto") != 0 && strcmp(value, "host") != 0 &&
                                strcmp(value, "cuda") != 0))
                return usage_error("--backend must be auto, host or cuda, got '%s'",
                                   value != NULL ? value : "");
            options.backend = value;
        } else {
            return usage_error("unknown option '%s'", arg);
        }
    }
    if (options.num_ranks == 0)
        return usage_error("%s", "-n N is required");
    if (program < 0 || program >= argc)
        return usage_error("%s", "no program given (put it after --)");
    if (options.ranks_per_node > 0 && options.num_ranks % options.ranks_per_node != 0) {
        char detail[96];
        snprintf(detail, sizeof(detail), "%d does not divide -n %d", options.ranks_per_node,
                 options.num_ranks);
        return usage_error("--ranks-per-node %s", detail);
    }
    options.argv = argv + program;
    return epx__launch_run(&options);
}
