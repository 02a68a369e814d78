/*
 * `epx doctor` settings checks: the EPX_* tunables in force (the library's one table,
 * read through include/epx_tool.h), the NVSHMEM_* variables that decide whether and how fast
 * NVSHMEM runs, those that govern internode traffic against the buffer's internode plan
 * (env.internode), and whether the buffer the user plans (the standard case unless told)
 * fits in GPU memory, or in /dev/shm on the CPU backend.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "common/tool.h"
#include "doctor_checks.h"
#include "doctor_child.h"
#include "doctor_internode.h"
#include "doctor_parse.h"

#define NVSHMEM_DEFAULT_HEAP ((uint64_t)1 << 30)

/* ---------------------------------------------------------------- EPX_* */

static int known_param(const char *name, size_t length)
{
    epx_param_info_t info = EPX_PARAM_INFO_INIT;
    for (int i = 0; i < epx_param_count() && epx_param_info(i, &info) == EPX_SUCCESS; i++) {
        if (strlen(info.name) == length && strncmp(info.name, name, length) == 0)
            return 1;
    }
    return 0;
}

static void check_epx_params(epx__doctor_report_t *report)
{
    epx_status_t status = epx_params_load();
    if (status != EPX_SUCCESS) {
        epx__doctor_add(report, "env.epx", EPX__DOCTOR_FAIL,
                        "correct or unset that variable; `epx params` lists every EPX_* setting "
                        "with its allowed values",
                        "%s", epx_last_error());
        return;
    }
    char detail[EPX__DOCTOR_DETAIL_MAX];
    size_t used = (size_t)snprintf(detail, sizeof(detail),
                                   "in force: EPX_TIMEOUT_MS=%lld, EPX_NUM_SMS=%lld, EPX_BACKEND=%s",
                                   (long long)epx__tool_param_int("EPX_TIMEOUT_MS"),
                                   (long long)epx__tool_param_int("EPX_NUM_SMS"),
                                   epx__tool_param_string("EPX_BACKEND"));
    int changed = 0;
    epx_param_info_t row = EPX_PARAM_INFO_INIT;
    for (int i = 0; i < epx_param_count() && epx_param_info(i, &row) == EPX_SUCCESS; i++) {
        char value[128];
        if (row.is_int) {
            if (row.int_value == row.int_default)
                continue;
            snprintf(value, sizeof(value), "%lld", (long long)row.int_value);
        } else {
            if (strcmp(row.string_value, row.string_default) == 0)
                continue;
            snprintf(value, sizeof(value), "%s", row.string_value);
        }
        if (used < sizeof(detail))
            used += (size_t)snprintf(detail + used, sizeof(detail) - used, "%s %s=%s",
                                     changed++ == 0 ? "\nchanged from the defaults:" : ",",
                                     row.name, value);
    }
    /* Names only, never values: params.c is the one reader of EPX_* values. It warns
     * about unknown names in the log too; here they become part of the checklist. */
    char unknown[512] = "";
    size_t unknown_used = 0;
    for (char **entry = environ; entry != NULL && *entry != NULL; entry++) {
        const char *equals = strchr(*entry, '=');
        size_t length = equals != NULL ? (size_t)(equals - *entry) : strlen(*entry);
        if (strncmp(*entry, "EPX_", 4) != 0 || known_param(*entry, length))
            continue;
        if (unknown_used < sizeof(unknown))
            unknown_used += (size_t)snprintf(unknown + unknown_used, sizeof(unknown) - unknown_used,
                                             " %.*s", (int)length, *entry);
    }
    if (unknown[0] != '\0')
        epx__doctor_add(report, "env.epx", EPX__DOCTOR_WARN,
                        "fix the spelling or unset them; `epx params` lists the known names",
                        "%s\nnot epx settings (ignored):%s", detail, unknown);
    else
        epx__doctor_add(report, "env.epx", EPX__DOCTOR_PASS, NULL, "%s", detail);
}

/* ---------------------------------------------------------------- NVSHMEM_* */

static int is_true(const char *value)
{
    return value != NULL && (strcmp(value, "1") == 0 || strcasecmp(value, "true") == 0 ||
                             strcasecmp(value, "yes") == 0 || strcasecmp(value, "on") == 0);
}

static void check_nvshmem_env(epx__doctor_report_t *report, const epx__doctor_context_t *context)
{
    char detail[EPX__DOCTOR_DETAIL_MAX];
    size_t used = (size_t)snprintf(detail, sizeof(detail), "set:");
    int set = 0;
    for (char **entry = environ; entry != NULL && *entry != NULL; entry++) {
        if (strncmp(*entry, "NVSHMEM_", 8) != 0 || used >= sizeof(detail))
            continue;
        used += (size_t)snprintf(detail + used, sizeof(detail) - used, " %s", *entry);
        set++;
    }
    if (set == 0 && used < sizeof(detail))
        used += (size_t)snprintf(detail + used, sizeof(detail) - used, " none (NVSHMEM defaults)");

    const char *heap_text = getenv("NVSHMEM_SYMMETRIC_SIZE");
    uint64_t heap = NVSHMEM_DEFAULT_HEAP;
    if (heap_text != NULL && heap_text[0] != '\0' && !epx__doctor_parse_size(heap_text, &heap)) {
        epx__doctor_add(report, "env.nvshmem", EPX__DOCTOR_FAIL,
                        "give a size such as 1073741824, 2G or 512M",
                        "%s\nNVSHMEM_SYMMETRIC_SIZE=%s is not a size", detail, heap_text);
        return;
    }
    char heap_size[32];
    epx__doctor_format_bytes(heap, heap_size, sizeof(heap_size));
    if (used < sizeof(detail))
        used += (size_t)snprintf(detail + used, sizeof(detail) - used,
                                 "\nsymmetric heap per PE: %s%s", heap_size,
                                 heap_text != NULL ? "" : " (default)");

    int gpus = context->gpu.gpu_count;
    const char *nvls = getenv("NVSHMEM_DISABLE_NVLS");
    if (gpus >= 2 && !is_true(nvls)) {
        epx__doctor_add(report, "env.nvshmem", EPX__DOCTOR_WARN,
                        "export NVSHMEM_DISABLE_NVLS=1 (and NCCL_NVLS_ENABLE=0); `epx launch` "
                        "sets both for its ranks",
                        "%s\nNVSHMEM_DISABLE_NVLS is not 1 on a machine with %d GPUs: NVLink "
                        "multicast (NVLS), which epx does not use, can put a shared machine's "
                        "GPUs out of service",
                        detail, gpus);
        return;
    }
    const char *remote = getenv("NVSHMEM_REMOTE_TRANSPORT");
    if (context->rdma_ports_up > 0 && remote != NULL && strcasecmp(remote, "none") == 0) {
        epx__doctor_add(report, "env.nvshmem", EPX__DOCTOR_WARN,
                        "unset NVSHMEM_REMOTE_TRANSPORT (or set ibgda/ibrc) to use the RDMA NICs",
                        "%s\nNVSHMEM_REMOTE_TRANSPORT=none although RDMA ports are up: epx cannot "
                        "go across nodes",
                        detail);
        return;
    }
    /* Every PE on a GPU allocates its own heap there. */
    int ranks = epx__doctor_ranks(context);
    if (gpus > 0 && context->gpu.gpus[0].free_bytes > 0) {
        uint64_t per_gpu = (uint64_t)((ranks + gpus - 1) / gpus);
        if (heap * per_gpu > context->gpu.gpus[0].free_bytes) {
            char free_text[32];
            epx__doctor_format_bytes(context->gpu.gpus[0].free_bytes, free_text, sizeof(free_text));
            epx__doctor_add(report, "env.nvshmem", EPX__DOCTOR_FAIL,
                            "lower NVSHMEM_SYMMETRIC_SIZE, or run fewer ranks per GPU",
                            "%s\n%llu PEs per GPU x %s heap does not fit in GPU0's %s free",
                            detail, (unsigned long long)per_gpu, heap_size, free_text);
            return;
        }
    }
    epx__doctor_add(report, "env.nvshmem", EPX__DOCTOR_PASS, NULL, "%s", detail);
}

/* ---------------------------------------------------------------- internode traffic */

/*
 * env.internode: the NVSHMEM and EPX_* settings of internode normal mode against the
 * plan of the buffer the user asks about (doctor_internode.c judges). Planning needs no
 * GPU and starts nothing, so it runs here, not in a child.
 */
static void check_internode(epx__doctor_report_t *report, const epx__doctor_context_t *context)
{
    epx__doctor_internode_in_t in;
    memset(&in, 0, sizeof(in));
    in.ib_enable_ibgda = getenv("NVSHMEM_IB_ENABLE_IBGDA");
    in.ibgda_num_rc_per_pe = getenv("NVSHMEM_IBGDA_NUM_RC_PER_PE");
    in.qp_depth = getenv("NVSHMEM_QP_DEPTH");
    in.ibgda_qp_depth = getenv("NVSHMEM_IBGDA_QP_DEPTH");
    in.disable_p2p = getenv("NVSHMEM_DISABLE_P2P");
    in.disable_nvls = getenv("NVSHMEM_DISABLE_NVLS");
    in.timeout_ms = epx__tool_param_int("EPX_TIMEOUT_MS");
    in.ring_tokens = epx__tool_param_int("EPX_XN_RING_TOKENS");
    in.world_size = context->ranks > 0 ? context->ranks : 8; /* the standard case: 2 x 4 */
    int64_t from_env = epx__tool_param_int("EPX_RANKS_PER_NODE");
    if (context->ranks_per_node > 0)
        in.ranks_per_node = context->ranks_per_node;
    else if (from_env > 0 && from_env < in.world_size && in.world_size % from_env == 0)
        in.ranks_per_node = (int)from_env;
    else
        in.ranks_per_node = in.world_size / 2 > 0 ? in.world_size / 2 : 1;
    in.gpus = context->gpu.gpu_count;
    in.tokens = context->tokens;

    in.plan = (epx_internode_plan_t)EPX_INTERNODE_PLAN_INIT;
    char error[400] = "";
#ifdef EPX_WITH_CUDA
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = context->tokens;
    config.hidden = context->hidden;
    config.num_experts = context->experts;
    config.num_topk = context->topk;
    in.plan_ok = epx_internode_plan(in.world_size, in.ranks_per_node, &config, &in.plan) ==
                 EPX_SUCCESS;
    if (!in.plan_ok)
        snprintf(error, sizeof(error), "%s", epx_last_error());
#else
    /* The planner would refuse (and log a warning in the middle of the checklist). */
    in.plan_ok = 0;
    snprintf(error, sizeof(error), "this epx was built without the CUDA backend, whose "
                                   "internode normal mode the plan describes");
#endif
    in.plan_error = error;

    char detail[EPX__DOCTOR_DETAIL_MAX], fix[EPX__DOCTOR_FIX_MAX];
    epx__doctor_status_t status =
        epx__doctor_internode_assess(&in, detail, sizeof(detail), fix, sizeof(fix));
    epx__doctor_add(report, "env.internode", status, fix[0] != '\0' ? fix : NULL, "%s", detail);
}

/* ---------------------------------------------------------------- buffer fit */

typedef struct {
    int world;
    epx_backend_t backend;
    const epx__doctor_context_t *context;
    int64_t tokens;    /* max_tokens_per_rank */
    int64_t ll_tokens; /* max_low_latency_tokens; 0 = normal mode only */
} size_arg_t;

typedef struct {
    int ok;
    uint64_t bytes;
    char error[400];
} size_facts_t;

/*
 * In a child, because a backend may initialise CUDA to answer. epx_buffer_size_plan
 * answers for a group that is not formed, so any rank count, without starting a rank.
 */
static void compute_size(epx__doctor_report_t *report, void *arg, void *facts_out)
{
    (void)report;
    const size_arg_t *size = arg;
    size_facts_t *facts = facts_out;
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = size->tokens;
    config.hidden = size->context->hidden;
    config.num_experts = size->context->experts;
    config.num_topk = size->context->topk;
    /* Low-latency rows sized for fp8, as `epx bench --mode ll` does for its standard case. */
    config.max_low_latency_tokens = size->ll_tokens;
    config.low_latency_dtype = EPX_DTYPE_FP8_E4M3;
    size_t bytes = 0;
    epx_status_t status = epx_buffer_size_plan(size->backend, size->world, 0, &config, &bytes);
    facts->ok = status == EPX_SUCCESS;
    facts->bytes = bytes;
    if (!facts->ok)
        snprintf(facts->error, sizeof(facts->error), "%s: %s", epx_status_name(status),
                 epx_last_error());
}

/*
 * Whether one buffer fits: `name` is env.buffer_fit (normal mode: --tokens per rank) or
 * env.ll_buffer_fit (low-latency mode: a buffer of --ll-tokens for both modes, rows sized
 * for fp8, the shape `epx bench --mode ll` measures).
 */
static void check_buffer_fit(epx__doctor_report_t *report, const epx__doctor_context_t *context,
                             const char *name, int64_t tokens, int64_t ll_tokens)
{
    const epx__doctor_gpu_facts_t *gpu = &context->gpu;
    int world = context->ranks > 0 ? context->ranks : 8; /* the standard case has 8 ranks */
    size_arg_t arg = {world, EPX_BACKEND_HOST, context, tokens, ll_tokens};
#ifdef EPX_WITH_CUDA
    if (gpu->gpu_count > 0)
        arg.backend = EPX_BACKEND_CUDA;
#endif
    size_facts_t facts;
    if (epx__doctor_run_child(report, name, context->timeout_s, compute_size, &arg, &facts,
                              sizeof(facts)) != EPX__DOCTOR_CHILD_DONE)
        return;
    char shape[240];
    if (ll_tokens > 0)
        snprintf(shape, sizeof(shape),
                 "low-latency mode, %lld tokens/rank (fp8 rows), hidden %lld, top-%d of %d "
                 "experts, %d ranks",
                 (long long)ll_tokens, (long long)context->hidden, context->topk,
                 context->experts, world);
    else
        snprintf(shape, sizeof(shape),
                 "%lld tokens/rank, hidden %lld, top-%d of %d experts, %d ranks",
                 (long long)tokens, (long long)context->hidden, context->topk, context->experts,
                 world);
    const char *smaller = ll_tokens > 0 ? "--ll-tokens" : "--tokens";
    char fix[200];
    if (!facts.ok) {
        epx__doctor_add(report, name, EPX__DOCTOR_FAIL,
                        "choose a shape epx accepts (the message says which value is wrong)",
                        "the buffer for %s is refused: %s", shape, facts.error);
        return;
    }
    char need_text[32], have_text[32];
    if (arg.backend == EPX_BACKEND_CUDA) {
        int per_gpu = (world + gpu->gpu_count - 1) / gpu->gpu_count;
        uint64_t need = facts.bytes * (uint64_t)per_gpu, have = (uint64_t)-1;
        for (int g = 0; g < gpu->gpu_count; g++) {
            if (gpu->gpus[g].free_bytes > 0 && gpu->gpus[g].free_bytes < have)
                have = gpu->gpus[g].free_bytes;
        }
        epx__doctor_format_bytes(need, need_text, sizeof(need_text));
        if (have == (uint64_t)-1) {
            epx__doctor_add(report, name, EPX__DOCTOR_SKIP, NULL,
                            "%s needs %s per GPU; free GPU memory unknown", shape, need_text);
            return;
        }
        epx__doctor_format_bytes(have, have_text, sizeof(have_text));
        snprintf(fix, sizeof(fix), "use a smaller %s, run fewer ranks per GPU, or free GPU memory",
                 smaller);
        epx__doctor_add(report, name, need <= have ? EPX__DOCTOR_PASS : EPX__DOCTOR_FAIL,
                        need <= have ? NULL : fix,
                        "%s: the buffer takes %s per GPU (%d rank%s x %llu bytes), %s free on the "
                        "fullest GPU%s",
                        shape, need_text, per_gpu, per_gpu == 1 ? "" : "s",
                        (unsigned long long)facts.bytes, have_text,
                        need <= have ? "" : ": it does not fit");
        return;
    }
    /* The CPU backend keeps every rank's buffer in POSIX shared memory. */
    uint64_t need = facts.bytes * (uint64_t)world;
    struct statvfs shm;
    epx__doctor_format_bytes(need, need_text, sizeof(need_text));
    if (statvfs("/dev/shm", &shm) != 0) {
        epx__doctor_add(report, name, EPX__DOCTOR_SKIP, NULL,
                        "%s needs %s of shared memory (CPU backend); /dev/shm not found", shape,
                        need_text);
        return;
    }
    uint64_t have = (uint64_t)shm.f_bavail * (uint64_t)shm.f_frsize;
    char per_rank[32];
    epx__doctor_format_bytes(facts.bytes, per_rank, sizeof(per_rank));
    epx__doctor_format_bytes(have, have_text, sizeof(have_text));
    snprintf(fix, sizeof(fix),
             "the CPU backend needs more /dev/shm: enlarge it (docker --shm-size) or use a "
             "smaller %s or --ranks",
             smaller);
    epx__doctor_add(report, name, need <= have ? EPX__DOCTOR_PASS : EPX__DOCTOR_WARN,
                    need <= have ? NULL : fix,
                    "%s on the CPU backend: %s of shared memory (%s per rank), %s free in "
                    "/dev/shm",
                    shape, need_text, per_rank, have_text);
}

void epx__doctor_check_env(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    check_epx_params(report);
    check_nvshmem_env(report, context);
    check_internode(report, context);
    check_buffer_fit(report, context, "env.buffer_fit", context->tokens, 0);
    if (context->ll_tokens > 0)
        check_buffer_fit(report, context, "env.ll_buffer_fit", context->ll_tokens,
                         context->ll_tokens);
    else
        epx__doctor_add(report, "env.ll_buffer_fit", EPX__DOCTOR_SKIP, NULL,
                        "low-latency mode not checked (--ll-tokens 0)");
}
