/*
 * `epx doctor`: the command line, the order of the checks and the exit status. The
 * checks themselves are in doctor_<group>.c; each adds lines to one report, printed as
 * soon as its group is done, so a slow check (the smoke run) never hides the others.
 *
 * Exit status: 0 when nothing failed (warnings, "not present" and skipped lines are
 * fine: a machine without RDMA still runs epx within a node), 1 when a check failed,
 * 2 for bad usage. Missing hardware is never a failure by itself.
 */
#include "doctor.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/args.h"
#include "doctor_checks.h"
#include "doctor_report.h"
#include "epx.h"

static const char doctor_usage[] =
    "usage: epx doctor [--json] [--ranks N] [options]\n"
    "\n"
    "Check whether epx will work on this machine, and at full speed: GPUs, driver and\n"
    "CUDA versions, NVLink/PCIe pairs, CUDA IPC between two processes, CUDA MPS,\n"
    "NVSHMEM (library, plugins, a two-process unique-id bootstrap), RDMA NICs and their\n"
    "placement, GPUDirect RDMA, the driver options IBGDA needs, the EPX_* and NVSHMEM_*\n"
    "settings in force (those of internode traffic against the buffer's plan), whether\n"
    "the buffer fits, and a short checked dispatch/combine run.\n"
    "Each line is pass, warn, fail, not-present or skip, with a one-sentence fix.\n"
    "Exit status 0 when nothing fails, 1 otherwise. docs/DEPLOYMENT.md explains each line.\n"
    "\n"
    "options:\n"
    "  --json           one JSON document: {\"checks\": [{\"check\", \"status\", \"detail\",\n"
    "                   \"fix\"}, ...], \"summary\": {counts per status, \"exit_status\"}}\n"
    "  --ranks N        ranks to plan for (smoke run, MPS and buffer checks); default: one\n"
    "                   per GPU, 2 on one GPU or on the CPU backend (8 for the buffer check)\n"
    "  --ranks-per-node N  ranks per node of the internode check (env.internode); default:\n"
    "                   EPX_RANKS_PER_NODE when it splits the ranks, else half of them\n"
    "  --tokens N       max tokens per rank of the buffer to check (4096)\n"
    "  --hidden N       hidden size of the buffer to check (7168)\n"
    "  --experts N      experts over all ranks (256)\n"
    "  --topk N         experts per token (8)\n"
    "  --ll-tokens N    low-latency tokens per rank of the buffer to check (128, the\n"
    "                   standard low-latency case; 0 = do not check low-latency mode)\n"
    "  --no-smoke       skip the measured dispatch/combine run\n"
    "  --timeout S      limit for each check that runs in a child process (60)\n"
    "  -h, --help       this text\n";

static int usage_error(const char *format, const char *detail)
{
    fprintf(stderr, "epx doctor: ");
    fprintf(stderr, format, detail != NULL ? detail : "");
    fprintf(stderr, "\n\n%s", doctor_usage);
    return 2;
}

/* Parse the flags into `context` and *json; -1 to go on, else the exit status. */
static int parse_options(int argc, char **argv, epx__doctor_context_t *context, int *json)
{
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = NULL;
        int64_t number = 0;
        int matched;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            fputs(doctor_usage, stdout);
            return 0;
        }
        if (strcmp(arg, "--json") == 0) {
            *json = 1;
        } else if (strcmp(arg, "--no-smoke") == 0) {
            context->run_smoke = 0;
        } else if ((matched = epx__match_value(argc, argv, &i, "--ranks", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 16, &number) != 0)
                return usage_error("--ranks needs a number of ranks >= 1, got '%s'", value);
            context->ranks = (int)number;
        } else if ((matched = epx__match_value(argc, argv, &i, "--ranks-per-node", &value)) !=
                   0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 16, &number) != 0)
                return usage_error("--ranks-per-node needs a number of ranks >= 1, got '%s'",
                                   value);
            context->ranks_per_node = (int)number;
        } else if ((matched = epx__match_value(argc, argv, &i, "--tokens", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 24, &context->tokens) != 0)
                return usage_error("--tokens needs a number >= 1, got '%s'", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--hidden", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 20, &context->hidden) != 0)
                return usage_error("--hidden needs a number >= 1, got '%s'", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--experts", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 20, &number) != 0)
                return usage_error("--experts needs a number >= 1, got '%s'", value);
            context->experts = (int)number;
        } else if ((matched = epx__match_value(argc, argv, &i, "--topk", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 1, 1 << 20, &number) != 0)
                return usage_error("--topk needs a number >= 1, got '%s'", value);
            context->topk = (int)number;
        } else if ((matched = epx__match_value(argc, argv, &i, "--ll-tokens", &value)) != 0) {
            if (matched < 0 || epx__parse_int64(value, 0, 65536, &context->ll_tokens) != 0)
                return usage_error("--ll-tokens needs a number in [0, 65536], got '%s'", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--timeout", &value)) != 0) {
            if (matched < 0 || epx__parse_double(value, 10, 3600, &context->timeout_s) != 0)
                return usage_error("--timeout needs seconds in [10, 3600], got '%s'", value);
        } else {
            return usage_error("unknown option '%s'", arg);
        }
    }
    return -1;
}

typedef void (*check_fn_t)(epx__doctor_report_t *report, epx__doctor_context_t *context);

static void add_build_line(epx__doctor_report_t *report)
{
    int code = epx_version();
#ifdef EPX_WITH_CUDA
    const char *cuda = "the CUDA backend built";
#else
    const char *cuda = "no CUDA backend (CPU only)";
#endif
    epx__doctor_add(report, "epx.build", EPX__DOCTOR_PASS, NULL, "epx %d.%d.%d with %s",
                    code / 10000, code / 100 % 100, code % 100, cuda);
}

int epx__command_doctor(int argc, char **argv)
{
    static epx__doctor_context_t context; /* large (GPU facts): not on the stack */
    memset(&context, 0, sizeof(context));
    context.run_smoke = 1;
    context.tokens = 4096;
    context.hidden = 7168;
    context.experts = 256;
    context.topk = 8;
    context.ll_tokens = 128;
    context.timeout_s = 60.0;
    int json = 0;
    int parsed = parse_options(argc, argv, &context, &json);
    if (parsed >= 0)
        return parsed;
    ssize_t length = readlink("/proc/self/exe", context.self_path, sizeof(context.self_path) - 1);
    if (length <= 0)
        snprintf(context.self_path, sizeof(context.self_path), "%s", "epx");
    else
        context.self_path[length] = '\0';

    /* Order matters: later checks use what earlier ones learnt (GPU list, MPS, NICs). */
    static const check_fn_t checks[] = {
        epx__doctor_check_gpu,  epx__doctor_check_mps,     epx__doctor_check_ipc,
        epx__doctor_check_rdma, epx__doctor_check_nvshmem, epx__doctor_check_env,
        epx__doctor_check_smoke,
    };
    epx__doctor_report_t report = EPX__DOCTOR_REPORT_INIT;
    if (json)
        epx__doctor_print_json_start(stdout);
    else
        printf("epx doctor: will epx work on this machine, and at full speed?\n\n");
    add_build_line(&report);
    int printed = 0;
    for (size_t i = 0; i <= sizeof(checks) / sizeof(checks[0]); i++) {
        if (i > 0)
            checks[i - 1](&report, &context);
        if (json)
            epx__doctor_print_json(stdout, &report, printed);
        else
            epx__doctor_print_text(stdout, &report, printed);
        printed = report.count;
    }
    if (json)
        epx__doctor_print_summary_json(stdout, &report);
    else
        epx__doctor_print_summary_text(stdout, &report);
    int status = epx__doctor_exit_status(&report);
    epx__doctor_report_free(&report);
    return status;
}
