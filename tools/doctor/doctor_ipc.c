/*
 * `epx doctor` gpu.ipc: does CUDA IPC really work between two processes, and how
 * long does a flag take to go there and back? This is the path epx's intranode mode
 * uses: each rank maps the others' buffers with cuIpcOpenMemHandle and signals through
 * flags in them.
 *
 * Two worker processes (on GPU0 and GPU1, or both on GPU0 when there is one) each
 * allocate a flag, exchange IPC handles through pipes, map the other's flag and run a
 * one-thread ping-pong kernel: A writes i into B's flag and waits for i in its own,
 * B answers. The kernel is PTX text, JIT-compiled by the driver, so the doctor needs no
 * nvcc and no CUDA runtime. It times itself with %globaltimer after a warm-up and
 * gives up after a deadline, so a broken mapping is a timeout, never a hang.
 *
 * When two processes share a GPU without MPS, the GPU time-slices between them and a
 * round trip takes milliseconds instead of microseconds (docs/DESIGN.md section 4 measured
 * 4.5 ms against 7.3 us): the line says so.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/tool.h"
#include "doctor_checks.h"
#include "doctor_child.h"
#include "doctor_cuda.h"

#define ITERATIONS 200u
#define WARMUP 20u
#define KERNEL_TIMEOUT_NS 8000000000ull
/* Round trips above this mean time slicing or a slow path, not NVLink or MPS. */
#define SLOW_ROUND_TRIP_US 50.0

/* One thread: role 0 sends i and waits for the answer, role 1 waits and answers.
 * result[0] = ns for the iterations after the warm-up, result[1] = 1 on timeout. */
static const char pingpong_ptx[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    ".visible .entry epx_doctor_pingpong(.param .u64 param_mine, .param .u64 param_peer,\n"
    "    .param .u32 param_iters, .param .u32 param_warm, .param .u32 param_role,\n"
    "    .param .u64 param_timeout, .param .u64 param_result)\n"
    "{\n"
    "    .reg .pred %p<6>;\n"
    "    .reg .b32 %r<10>;\n"
    "    .reg .b64 %rd<12>;\n"
    "    ld.param.u64 %rd1, [param_mine];\n"
    "    ld.param.u64 %rd2, [param_peer];\n"
    "    ld.param.u32 %r1, [param_iters];\n"
    "    ld.param.u32 %r2, [param_warm];\n"
    "    ld.param.u32 %r3, [param_role];\n"
    "    ld.param.u64 %rd3, [param_timeout];\n"
    "    ld.param.u64 %rd4, [param_result];\n"
    "    cvta.to.global.u64 %rd1, %rd1;\n"
    "    cvta.to.global.u64 %rd2, %rd2;\n"
    "    cvta.to.global.u64 %rd4, %rd4;\n"
    "    mov.u64 %rd5, %globaltimer;\n"
    "    mov.u64 %rd6, %rd5;\n"
    "    mov.u32 %r4, 1;\n"
    "    mov.u32 %r5, 0;\n"
    "    add.u32 %r6, %r2, 1;\n"
    "    setp.eq.u32 %p1, %r3, 0;\n"
    "LOOP:\n"
    "    setp.gt.u32 %p2, %r4, %r1;\n"
    "    @%p2 bra DONE;\n"
    "    setp.eq.u32 %p3, %r4, %r6;\n"
    "    @%p3 mov.u64 %rd6, %globaltimer;\n"
    "    @%p1 st.volatile.global.u32 [%rd2], %r4;\n"
    "WAIT:\n"
    "    ld.volatile.global.u32 %r7, [%rd1];\n"
    "    setp.ge.u32 %p4, %r7, %r4;\n"
    "    @%p4 bra GOT;\n"
    "    mov.u64 %rd7, %globaltimer;\n"
    "    sub.u64 %rd8, %rd7, %rd5;\n"
    "    setp.gt.u64 %p5, %rd8, %rd3;\n"
    "    @%p5 bra TIMEOUT;\n"
    "    bra WAIT;\n"
    "GOT:\n"
    "    @!%p1 st.volatile.global.u32 [%rd2], %r4;\n"
    "    add.u32 %r4, %r4, 1;\n"
    "    bra LOOP;\n"
    "TIMEOUT:\n"
    "    mov.u32 %r5, 1;\n"
    "DONE:\n"
    "    mov.u64 %rd7, %globaltimer;\n"
    "    sub.u64 %rd8, %rd7, %rd6;\n"
    "    st.global.u64 [%rd4], %rd8;\n"
    "    st.global.u32 [%rd4+8], %r5;\n"
    "    ret;\n"
    "}\n";

typedef struct {
    int32_t ok;
    int32_t timed_out;
    int64_t elapsed_ns;
    char message[384];
} worker_result_t;

typedef struct {
    int role;
    int ordinal;
    int to_peer;
    int from_peer;
    int to_parent;
    int64_t deadline_ns;
} worker_t;

/* A failed driver call: record which step and why. */
#define STEP(call, what)                                                                  \
    do {                                                                                  \
        int step_result_ = (call);                                                        \
        if (step_result_ != EPX__CU_SUCCESS) {                                            \
            snprintf(result.message, sizeof(result.message), "%s: %s", (what),            \
                     epx__doctor_cuda_error(&cuda, step_result_));                        \
            goto done;                                                                    \
        }                                                                                 \
    } while (0)

static void run_worker(const worker_t *worker)
{
    worker_result_t result;
    epx__doctor_cuda_t cuda;
    char why[256], byte = 1;
    epx__cu_deviceptr_t flag = 0, out = 0, peer = 0;
    epx__cu_ipc_handle_t handle, peer_handle;
    void *module = NULL, *function = NULL;
    memset(&result, 0, sizeof(result));
    if (epx__doctor_cuda_load(&cuda, why, sizeof(why)) != 0) {
        snprintf(result.message, sizeof(result.message), "load the driver: %s", why);
        goto done;
    }
    STEP(cuda.cuInit(0), "cuInit");
    STEP(epx__doctor_cuda_use_device(&cuda, worker->ordinal), "make the GPU's context current");
    STEP(cuda.cuMemAlloc(&flag, 4096), "allocate the flag");
    STEP(cuda.cuMemAlloc(&out, 64), "allocate the result");
    STEP(cuda.cuMemsetD32(flag, 0, 1024), "clear the flag");
    STEP(cuda.cuMemsetD32(out, 0, 16), "clear the result");
    STEP(cuda.cuCtxSynchronize(), "synchronise after clearing");
    STEP(cuda.cuIpcGetMemHandle(&handle, flag), "export the flag (cuIpcGetMemHandle)");
    if (epx__doctor_write_all(worker->to_peer, &handle, sizeof(handle)) != 0 ||
        epx__doctor_read_all(worker->from_peer, &peer_handle, sizeof(peer_handle),
                             worker->deadline_ns) != 0) {
        snprintf(result.message, sizeof(result.message),
                 "exchange IPC handles: the other process did not answer");
        goto done;
    }
    STEP(cuda.cuIpcOpenMemHandle(&peer, peer_handle, EPX__CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
         "map the other process's flag (cuIpcOpenMemHandle)");
    STEP(cuda.cuModuleLoadData(&module, pingpong_ptx), "load the ping-pong kernel (PTX JIT)");
    STEP(cuda.cuModuleGetFunction(&function, module, "epx_doctor_pingpong"),
         "find the ping-pong kernel");
    /* Start both kernels together: the first round trip should not time a late start. */
    if (epx__doctor_write_all(worker->to_peer, &byte, 1) != 0 ||
        epx__doctor_read_all(worker->from_peer, &byte, 1, worker->deadline_ns) != 0) {
        snprintf(result.message, sizeof(result.message),
                 "wait for the other process before the ping-pong: it did not answer");
        goto done;
    }
    unsigned int iterations = ITERATIONS, warmup = WARMUP, role = (unsigned int)worker->role;
    unsigned long long timeout_ns = KERNEL_TIMEOUT_NS;
    void *parameters[] = {&flag, &peer, &iterations, &warmup, &role, &timeout_ns, &out};
    STEP(cuda.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, NULL, parameters, NULL),
         "launch the ping-pong kernel");
    STEP(cuda.cuCtxSynchronize(), "run the ping-pong kernel");
    uint64_t host[2] = {0, 0};
    STEP(cuda.cuMemcpyDtoH(host, out, sizeof(host)), "read the kernel's timing");
    result.elapsed_ns = (int64_t)host[0];
    result.timed_out = (int32_t)(host[1] & 0xffffffffu);
    result.ok = 1;
    /* Tell the peer we are done before unmapping, so that its last store lands in
     * memory that still exists. */
    if (epx__doctor_write_all(worker->to_peer, &byte, 1) == 0)
        epx__doctor_read_all(worker->from_peer, &byte, 1, worker->deadline_ns);
    cuda.cuIpcCloseMemHandle(peer);
done:
    epx__doctor_write_all(worker->to_parent, &result, sizeof(result));
    _exit(0);
}

#undef STEP

static void close_pair(int fds[2])
{
    if (fds[0] >= 0)
        close(fds[0]);
    if (fds[1] >= 0)
        close(fds[1]);
    fds[0] = fds[1] = -1;
}

/* Runs in a doctor child (no CUDA here): start the two workers and judge their results. */
static void coordinate(epx__doctor_report_t *report, void *arg, void *facts)
{
    (void)facts;
    const epx__doctor_context_t *context = arg;
    int gpus = context->gpu.gpu_count;
    int ordinals[2] = {0, gpus >= 2 ? 1 : 0};
    int a_to_b[2] = {-1, -1}, b_to_a[2] = {-1, -1}, results[2][2] = {{-1, -1}, {-1, -1}};
    if (pipe(a_to_b) != 0 || pipe(b_to_a) != 0 || pipe(results[0]) != 0 || pipe(results[1]) != 0) {
        epx__doctor_add(report, "gpu.ipc", EPX__DOCTOR_FAIL, "free file descriptors and run again",
                        "cannot create pipes: %s", strerror(errno));
        return;
    }
    int64_t deadline = epx__tool_now_ns() + (int64_t)((context->timeout_s - 3.0) * 1e9);
    pid_t pids[2] = {-1, -1};
    for (int role = 0; role < 2; role++) {
        worker_t worker = {role, ordinals[role], role == 0 ? a_to_b[1] : b_to_a[1],
                           role == 0 ? b_to_a[0] : a_to_b[0], results[role][1], deadline};
        pids[role] = fork();
        if (pids[role] == 0)
            run_worker(&worker);
    }
    close(results[0][1]);
    close(results[1][1]);
    results[0][1] = results[1][1] = -1;
    worker_result_t got[2];
    memset(got, 0, sizeof(got));
    for (int role = 0; role < 2; role++) {
        if (pids[role] < 0 ||
            epx__doctor_read_all(results[role][0], &got[role], sizeof(got[role]), deadline) != 0)
            snprintf(got[role].message, sizeof(got[role].message),
                     pids[role] < 0 ? "could not start the process"
                                    : "the process crashed or hung before it reported");
    }
    for (int role = 0; role < 2; role++) {
        if (pids[role] > 0)
            epx__tool_wait_child(pids[role], epx__tool_now_ns() + 2000000000LL);
    }
    close_pair(a_to_b);
    close_pair(b_to_a);
    close_pair(results[0]);
    close_pair(results[1]);

    char where[64];
    snprintf(where, sizeof(where), gpus >= 2 ? "GPU0 <-> GPU1" : "two processes on GPU0");
    for (int role = 0; role < 2; role++) {
        if (!got[role].ok) {
            epx__doctor_add(report, "gpu.ipc", EPX__DOCTOR_FAIL,
                            "CUDA IPC must work for epx's intranode mode: run on bare metal or "
                            "give the container the host IPC namespace (docker --ipc=host) and "
                            "the same user for all ranks",
                            "CUDA IPC test (%s), process %d on GPU%d: %s", where, role + 1,
                            ordinals[role], got[role].message);
            return;
        }
    }
    if (got[0].timed_out || got[1].timed_out) {
        epx__doctor_add(report, "gpu.ipc", EPX__DOCTOR_FAIL,
                        "the flag written through the IPC mapping never arrived: check that peer "
                        "access works (gpu.peer_access) and that no IOMMU blocks P2P",
                        "CUDA IPC test (%s): the memory mapped, but the ping-pong timed out",
                        where);
        return;
    }
    double round_trip_us = (double)got[0].elapsed_ns / 1e3 / (double)(ITERATIONS - WARMUP);
    int shared = gpus < 2;
    if (round_trip_us <= SLOW_ROUND_TRIP_US) {
        epx__doctor_add(report, "gpu.ipc", EPX__DOCTOR_PASS, NULL,
                        "CUDA IPC works (%s): flag round trip %.1f us (mean of %u round trips "
                        "after %u warm-up)%s",
                        where, round_trip_us, ITERATIONS - WARMUP, WARMUP,
                        shared ? (context->mps_running ? ", under MPS" : "") : "");
        return;
    }
    epx__doctor_add(report, "gpu.ipc", EPX__DOCTOR_WARN,
                    shared ? "several ranks share this GPU: run them under CUDA MPS (`epx launch "
                             "--mps`, or `nvidia-cuda-mps-control -d`), which cuts the round "
                             "trip to microseconds"
                           : "the P2P path between these GPUs is slow: check `nvidia-smi topo -m` "
                             "and that the GPUs are not in a power-saving state",
                    "CUDA IPC works (%s) but a flag round trip takes %.1f us (%u round trips "
                    "after %u warm-up)%s",
                    where, round_trip_us, ITERATIONS - WARMUP, WARMUP,
                    shared && !context->mps_running ? ": the GPU time-slices between the two "
                                                      "processes (no MPS)"
                                                    : "");
}

void epx__doctor_check_ipc(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    if (!context->gpu.driver_loaded || context->gpu.gpu_count <= 0) {
        epx__doctor_add(report, "gpu.ipc", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no GPU, so no CUDA IPC to test");
        return;
    }
    epx__doctor_run_child(report, "gpu.ipc", context->timeout_s, coordinate, context, NULL, 0);
}
