/*
 * The `epx` command: one executable, one subcommand per job, each with its own --help.
 * `params` and `version` are small enough to live here; launch, bench and doctor have
 * files of their own.
 */
#include <stdio.h>
#include <string.h>

#include "common/commands.h"
#include "common/tool.h"
#include "doctor/doctor.h"
#include "epx.h"

static const char usage_text[] =
    "usage: epx <command> [options]\n"
    "\n"
    "commands:\n"
    "  launch   start N ranks of a program on this machine (like torchrun)\n"
    "  bench    time and check layout, dispatch, cached dispatch and combine (--mode ll:\n"
    "           low-latency dispatch/combine, the send/receive split, CUDA graphs)\n"
    "  doctor   check this machine (GPUs, links, MPS, NVSHMEM) for running epx\n"
    "  params   print the EPX_* tunables with their values in force\n"
    "  version  print the version and whether the CUDA backend was built\n"
    "\n"
    "`epx <command> --help` describes each command's options.\n";

static int is_help(const char *arg)
{
    return strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0;
}

int epx__command_params(int argc, char **argv)
{
    if (argc > 1) {
        if (is_help(argv[1])) {
            printf("usage: epx params\n\n"
                   "Print every EPX_* environment variable the library reads: name, type,\n"
                   "default, the value in force and what it does. A value that does not\n"
                   "parse is reported (naming the variable) and the exit status is 1.\n");
            return 0;
        }
        fprintf(stderr, "epx params: unexpected argument '%s'\n", argv[1]);
        return 2;
    }
    epx_status_t status = epx_params_load();
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "epx params: %s: %s\n", epx_status_name(status), epx_last_error());
        return 1;
    }
    epx_params_print(stdout);
    return 0;
}

int epx__command_version(int argc, char **argv)
{
    if (argc > 1) {
        if (is_help(argv[1])) {
            printf("usage: epx version\n\nPrint the epx version and the backends built in.\n");
            return 0;
        }
        fprintf(stderr, "epx version: unexpected argument '%s'\n", argv[1]);
        return 2;
    }
    int code = epx_version();
#ifdef EPX_WITH_CUDA
    const char *cuda = "built";
#else
    const char *cuda = "not built";
#endif
    printf("epx %d.%d.%d\n", code / 10000, code / 100 % 100, code % 100);
    printf("backends: host, cuda (%s)\n", cuda);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fputs(usage_text, stderr);
        return 2;
    }
    const char *command = argv[1];
    if (is_help(command) || strcmp(command, "help") == 0) {
        fputs(usage_text, stdout);
        return 0;
    }
    if (strcmp(command, "--version") == 0)
        command = "version";

    static const struct {
        const char *name;
        int (*run)(int argc, char **argv);
    } commands[] = {
        {"launch", epx__command_launch},
        {"bench", epx__command_bench},
        {"doctor", epx__command_doctor},
        {"params", epx__command_params},
        {"version", epx__command_version},
    };
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
        if (strcmp(command, commands[i].name) == 0)
            return commands[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "epx: unknown command '%s'\n\n", command);
    fputs(usage_text, stderr);
    return 2;
}
