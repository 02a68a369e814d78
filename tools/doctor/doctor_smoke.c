/*
 * `epx doctor` smoke run: a short, checked `epx bench` of dispatch and combine across
 * the local GPUs (ranks sharing a GPU under MPS when there are fewer GPUs than ranks),
 * or on the CPU backend with 2 ranks when there is no GPU. It runs this executable as
 * a child, `epx bench -n N ... --check --json` (bench starts the ranks through `epx
 * launch`), and reads its JSON lines. Every other check looks at the system; this one
 * proves that epx itself moves tokens here, and how fast against the copy floor.
 *
 * The case is small so the run takes seconds, which also means the bandwidth is below
 * what the standard case reaches: the line flags only a result far below the floor;
 * `scripts/bench` measures the standard case.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/tool.h"
#include "doctor_checks.h"
#include "doctor_child.h"
#include "doctor_parse.h"

#define SMOKE_TIMEOUT_S 240.0
/* On the GPU a smoke run this far below the floor points at a real problem (time
 * slicing without MPS, an SM budget of one, a slow link), not at the small case. */
#define SMOKE_LOW_FRACTION 0.10

int epx__doctor_ranks(const epx__doctor_context_t *context)
{
    if (context->ranks > 0)
        return context->ranks;
    if (context->gpu.gpu_count >= 2)
        return context->gpu.gpu_count;
    return 2;
}

/* The last non-empty line of `text` (for error messages). */
static void last_line(const char *text, char *out, size_t out_size)
{
    size_t length = strlen(text);
    while (length > 0 && (text[length - 1] == '\n' || text[length - 1] == ' '))
        length--;
    size_t start = length;
    while (start > 0 && text[start - 1] != '\n')
        start--;
    snprintf(out, out_size, "%.*s", (int)(length - start), text + start);
}

static void report_row(epx__doctor_report_t *report, const char *name, const char *backend,
                       const epx__doctor_bench_row_t *row)
{
    if (row == NULL) {
        epx__doctor_add(report, name, EPX__DOCTOR_FAIL,
                        "run the bench by hand (the smoke.run line has the command) to see why",
                        "the bench printed no %s row", strchr(name, '.') + 1);
        return;
    }
    char floor[96] = "floor unknown";
    if (isfinite(row->floor_over_time))
        snprintf(floor, sizeof(floor), "floor/time %.2f (floor %.1f us, 1.00 = at the floor)",
                 row->floor_over_time, row->floor_us);
    char numbers[256];
    snprintf(numbers, sizeof(numbers), "%s %s on %s, %d ranks: median %.1f us, %.2f GB/s per rank, %s",
             row->dtype, row->op, backend, row->ranks, row->median_us, row->gbps_per_rank, floor);
    if (strcmp(row->check, "PASS") != 0) {
        epx__doctor_add(report, name, EPX__DOCTOR_FAIL,
                        "epx computed a wrong result here: report it with this output and "
                        "`epx doctor --json`",
                        "%s; check against the reference: %s", numbers,
                        row->check[0] ? row->check : "not run");
        return;
    }
    if (strcmp(backend, "cuda") == 0 && isfinite(row->floor_over_time) &&
        row->floor_over_time < SMOKE_LOW_FRACTION) {
        epx__doctor_add(report, name, EPX__DOCTOR_WARN,
                        "far below the floor even for a small case: look at the gpu.mps and "
                        "gpu.ipc lines, then measure the standard case with scripts/bench",
                        "%s; results correct", numbers);
        return;
    }
    epx__doctor_add(report, name, EPX__DOCTOR_PASS, NULL, "%s; results correct", numbers);
}

void epx__doctor_check_smoke(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    if (!context->run_smoke) {
        epx__doctor_add(report, "smoke.run", EPX__DOCTOR_SKIP, NULL, "skipped (--no-smoke)");
        return;
    }
    int gpus = context->gpu.gpu_count;
    int ranks = epx__doctor_ranks(context);
    const char *backend = "host";
#ifdef EPX_WITH_CUDA
    if (gpus > 0)
        backend = "cuda";
#endif
    int cuda = strcmp(backend, "cuda") == 0;
    /* Small but not trivial on a GPU; the CPU backend gets a case that takes seconds. */
    char ranks_text[16], experts[16], sms[16], timeout[16];
    int per_gpu = cuda ? (ranks + gpus - 1) / gpus : 1;
    int sms_per_rank = cuda && context->gpu.gpus[0].sms > 0 ? context->gpu.gpus[0].sms / per_gpu : 16;
    if (sms_per_rank > 16)
        sms_per_rank = 16;
    if (sms_per_rank < 1)
        sms_per_rank = 1;
    snprintf(ranks_text, sizeof(ranks_text), "%d", ranks);
    snprintf(experts, sizeof(experts), "%d", cuda ? (256 % ranks == 0 ? 256 : 32 * ranks) : 4 * ranks);
    snprintf(sms, sizeof(sms), "%d", sms_per_rank);
    snprintf(timeout, sizeof(timeout), "%.0f", SMOKE_TIMEOUT_S - 10);
    int want_mps = cuda && ranks > gpus && !context->mps_running;
    char mps_control[4096];
    if (want_mps && !epx__doctor_find_in_path("nvidia-cuda-mps-control", mps_control,
                                              sizeof(mps_control)))
        want_mps = 0;
    char *argv[40];
    int argc = 0;
    argv[argc++] = context->self_path;
    argv[argc++] = "bench";
    argv[argc++] = "-n";
    argv[argc++] = ranks_text;
    argv[argc++] = "--timeout";
    argv[argc++] = timeout;
    if (want_mps)
        argv[argc++] = "--mps";
    argv[argc++] = "--backend";
    argv[argc++] = (char *)backend;
    argv[argc++] = "--tokens";
    argv[argc++] = cuda ? "1024" : "128";
    argv[argc++] = "--hidden";
    argv[argc++] = cuda ? "7168" : "1024";
    argv[argc++] = "--experts";
    argv[argc++] = experts;
    argv[argc++] = "--topk";
    argv[argc++] = cuda ? "8" : "4";
    argv[argc++] = "--dtype";
    argv[argc++] = "bf16";
    argv[argc++] = "--warmup";
    argv[argc++] = "2";
    argv[argc++] = "--iters";
    argv[argc++] = cuda ? "10" : "3";
    if (cuda) {
        argv[argc++] = "--sms";
        argv[argc++] = sms;
    }
    argv[argc++] = "--check";
    argv[argc++] = "--json";
    argv[argc] = NULL;

    char command[1024];
    size_t used = 0;
    for (int i = 0; i < argc && used < sizeof(command); i++)
        used += (size_t)snprintf(command + used, sizeof(command) - used, "%s%s", i ? " " : "",
                                 i == 0 ? "epx" : argv[i]);
    static char output[65536], errors[16384];
    int timed_out = 0;
    int64_t start = epx__tool_now_ns();
    int status = epx__doctor_run_program(argv, NULL, output, sizeof(output), errors,
                                         sizeof(errors), SMOKE_TIMEOUT_S, &timed_out);
    double seconds = (double)(epx__tool_now_ns() - start) / 1e9;
    char tail[400];
    last_line(errors, tail, sizeof(tail));
    if (status == 2 && (strstr(errors, "unknown command") || strstr(errors, "unknown option"))) {
        epx__doctor_add(report, "smoke.run", EPX__DOCTOR_SKIP, NULL,
                        "`epx bench` is not available in this build (%s)", tail);
        return;
    }
    if (status != 0) {
        epx__doctor_add(report, "smoke.run", EPX__DOCTOR_FAIL,
                        "run the command by hand to see the whole output; the gpu.* and env.* "
                        "lines above often name the cause",
                        "`%s` %s after %.1f s%s%s", command,
                        timed_out ? "did not finish" : "failed", seconds,
                        tail[0] ? ": " : "", tail);
        return;
    }
    epx__doctor_bench_row_t rows[2];
    int found[2] = {0, 0};
    for (char *line = strtok(output, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        epx__doctor_bench_row_t row;
        if (!epx__doctor_parse_bench_line(line, &row) || strcmp(row.dtype, "bf16") != 0)
            continue;
        int which = strcmp(row.op, "dispatch") == 0 ? 0 : strcmp(row.op, "combine") == 0 ? 1 : -1;
        if (which >= 0) {
            rows[which] = row;
            found[which] = 1;
        }
    }
    epx__doctor_add(report, "smoke.run", EPX__DOCTOR_PASS, NULL, "`%s` ran in %.1f s%s", command,
                    seconds, want_mps ? " (with an MPS daemon for the run)" : "");
    report_row(report, "smoke.dispatch", backend, found[0] ? &rows[0] : NULL);
    report_row(report, "smoke.combine", backend, found[1] ? &rows[1] : NULL);
}
