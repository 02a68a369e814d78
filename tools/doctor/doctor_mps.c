/*
 * `epx doctor` gpu.mps: is a CUDA MPS daemon serving this user, and does it matter?
 * It matters when several ranks share a GPU (the one-GPU machine runs 8 ranks on one
 * H200): without MPS the GPU time-slices between processes, ranks that spin-wait on
 * each other stall for whole time slices, and every flag round trip costs milliseconds.
 *
 * The daemon is found through its control pipe in CUDA_MPS_PIPE_DIRECTORY (default
 * /tmp/nvidia-mps), then asked for its server list, which only a live daemon answers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "doctor_checks.h"
#include "doctor_child.h"

#define MPS_CONTROL "nvidia-cuda-mps-control"

/* 1 when a daemon answers on the pipe directory in force. */
static int mps_answers(const char *control_path, char *detail, size_t detail_size)
{
    char *const argv[] = {(char *)control_path, NULL};
    char output[512];
    int timed_out = 0;
    int status = epx__doctor_run_program(argv, "get_server_list\n", output, sizeof(output), NULL,
                                         0, 5.0, &timed_out);
    if (status == 0)
        return 1;
    snprintf(detail, detail_size, timed_out ? "the daemon did not answer within 5 s"
                                            : "the control pipe exists but no daemon answers");
    return 0;
}

void epx__doctor_check_mps(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    const char *pipe_dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    const char *dir = pipe_dir != NULL && pipe_dir[0] != '\0' ? pipe_dir : "/tmp/nvidia-mps";
    char control_path[4096], pipe_path[4200], problem[128] = "";
    int have_control = epx__doctor_find_in_path(MPS_CONTROL, control_path, sizeof(control_path));
    snprintf(pipe_path, sizeof(pipe_path), "%s/control", dir);
    struct stat info;
    int have_pipe = stat(pipe_path, &info) == 0 && (S_ISFIFO(info.st_mode) || S_ISSOCK(info.st_mode));
    context->mps_running = have_pipe && have_control &&
                           mps_answers(control_path, problem, sizeof(problem));

    int gpus = context->gpu.gpu_count;
    if (gpus <= 0) {
        epx__doctor_add(report, "gpu.mps", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no GPU, so no CUDA MPS to check (%s %s)", MPS_CONTROL,
                        have_control ? "is installed" : "is not installed");
        return;
    }
    int ranks = epx__doctor_ranks(context);
    int shared = ranks > gpus;
    const char *percentage = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    char extra[160] = "";
    if (percentage != NULL && percentage[0] != '\0')
        snprintf(extra, sizeof(extra), "; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s limits each rank's "
                 "SMs", percentage);
    if (context->mps_running) {
        epx__doctor_add(report, "gpu.mps", EPX__DOCTOR_PASS, NULL,
                        "an MPS daemon answers on %s; ranks that share a GPU run concurrently%s",
                        dir, extra);
        return;
    }
    if (!shared) {
        epx__doctor_add(report, "gpu.mps", EPX__DOCTOR_PASS, NULL,
                        "no MPS daemon%s%s; not needed with %d rank%s on %d GPU%s (one GPU each)",
                        problem[0] ? ": " : "", problem, ranks, ranks == 1 ? "" : "s", gpus,
                        gpus == 1 ? "" : "s");
        return;
    }
    char fix[384];
    if (have_control)
        snprintf(fix, sizeof(fix),
                 "start MPS for the ranks: `epx launch --mps -n %d ...`, or once for the machine "
                 "`%s -d` (stop it with `echo quit | %s`)",
                 ranks, MPS_CONTROL, MPS_CONTROL);
    else
        snprintf(fix, sizeof(fix),
                 "install the NVIDIA driver's utilities (they ship %s) and start MPS, or give "
                 "each rank a GPU of its own",
                 MPS_CONTROL);
    epx__doctor_add(report, "gpu.mps", EPX__DOCTOR_WARN, fix,
                    "no MPS daemon on %s%s%s%s: %d ranks on %d GPU%s will time-slice, and ranks "
                    "waiting on each other stall for milliseconds%s",
                    dir, problem[0] ? " (" : "", problem, problem[0] ? ")" : "", ranks, gpus,
                    gpus == 1 ? "" : "s", extra);
}
