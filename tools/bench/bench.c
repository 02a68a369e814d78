/*
 * `epx bench`: one harness for layout, dispatch, cached dispatch and combine (from the
 * combine-input view, and from a separate tensor), in the
 * manner of nccl-tests: the same flags for every op, inputs drawn from a seed, an
 * optional exact check against the oracle, and a table (or JSON lines) of the median
 * and p99 times with the metrics DeepEP reports. `--mode ll` runs the low-latency ops
 * instead (bench_ll.c), with the same flags and output style.
 *
 * With -n N outside a launch, the bench re-runs itself under `epx launch`, so that
 * `epx bench -n 8 --check` is all a user types.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/args.h"
#include "bench.h"
#include "bench_nodes.h"
#include "common/commands.h"
#include "common/tool.h"
#include "launch/launch.h"

/* The floor's bandwidth is measured at the start of every run
 * (epx__bench_floor_bandwidth; docs/PERFORMANCE.md, "How the numbers are counted"); the
 * H200's figure stands in on CUDA only when nothing could be measured, and the header
 * says so. */
#define CUDA_FLOOR_ASSUMED_GBPS 4250.0

static const char bench_usage[] =
    "usage: epx bench [options]\n"
    "\n"
    "Time (and with --check verify) layout, dispatch, cached dispatch and combine:\n"
    "combine with x in the buffer's combine-input view (zero-copy, op \"combine\"),\n"
    "with x in a separate tensor (copied into the buffer first, op \"combine_copy\") and\n"
    "with x in a tensor registered with epx_buffer_register (op \"combine_registered\"),\n"
    "and with x in the view and the top-k weights combined too (op \"combine_weights\").\n"
    "With --mode ll, the low-latency ops instead: epx_ll_dispatch and epx_ll_combine\n"
    "(x in the zero-copy buffer), each in one call and split into its EPX_LL_SEND_ONLY\n"
    "send and its epx_ll_receive (ops dispatch_send, dispatch_recv, ...).\n"
    "With --mode fanout, the copy that dispatch does, alone (epx_fanout_copy): each of\n"
    "--tokens rows read once and written to --fanout ranks on average, with the vector\n"
    "and the bulk-copy (TMA) kernels at the same SM budget, then as plain copies, then\n"
    "by the copy engines; then the sum combine does, alone (epx_fanin_reduce, rows\n"
    "\"fanin\"): each output row the fp32 sum of bf16 rows read from --fanout ranks on\n"
    "average, then from one; GB/s counts every rank's reads and writes.\n"
    "Run inside `epx launch`, or give -n N to have it launch itself.\n"
    "\n"
    "options (defaults: the standard case of docs/DESIGN.md for the mode):\n"
    "  --mode M          normal, ll or fanout (normal)\n"
    "  --tokens N        tokens per rank (normal 4096; ll 128, also max_low_latency_tokens)\n"
    "  --hidden N        elements per token (7168)\n"
    "  --experts N       experts over all ranks (256)\n"
    "  --topk N          experts per token (8)\n"
    "  --dtype D         dispatch dtype: bf16, fp8 or all (normal all; ll fp8)\n"
    "  --round-scale     ll, fp8: power-of-two scales\n"
    "  --ue8m0           ll, fp8: scales as packed UE8M0 exponents (implies --round-scale)\n"
    "  --wait-stats      ll: every dispatch and combine passes wait_recv_cost_stats (the\n"
    "                    time each receive waited for each rank), so the timings include\n"
    "                    recording them; the sums are printed after the table\n"
    "  --ll-dtype D      ll: the buffer's low-latency rows sized for bf16 or fp8\n"
    "                    (config.low_latency_dtype; fp8 rows take half the bytes and allow\n"
    "                    fp8 dispatch only): fp8 when only fp8 is dispatched, else bf16\n"
    "  --warmup N        untimed iterations (normal: host 1, cuda 5; ll: host 2, cuda 10)\n"
    "  --iters N         timed iterations (normal: host 3, cuda 30; ll: host 20, cuda 100)\n"
    "  --back-to-back N  normal: after the table, N fresh dispatches without a host wait\n"
    "                    (EPX_DISPATCH_WORST_CASE), N cached dispatches, N combines and N\n"
    "                    registered combines, each run back to back between one pair of\n"
    "                    events, timed a call (0: off; cuda: the iterations, host: 0)\n"
    "  --seed N          input seed (1)\n"
    "  --alignment N     per-expert count alignment, normal mode (1)\n"
    "  --register-mb N   normal: allocate combine_registered's tensor at least N MiB\n"
    "                    (x at its start; 0: just its rows), rounded up to 2 MiB as\n"
    "                    PyTorch's caching allocator does\n"
    "  --auto-register   normal: combine_copy's x mapped for the peers on demand\n"
    "                    (config.auto_register 1) instead of copied in; without it the\n"
    "                    bench's buffer copies (EPX_AUTO_REGISTER is not read)\n"
    "  --register-exact  normal: allocate it exactly its rows (and one more) instead, as a\n"
    "                    C caller's cudaMalloc might: peers read such an allocation slower\n"
    "                    (docs/PERFORMANCE.md)\n"
    "  --sms N           SMs per rank for GPU kernels (0 = EPX_NUM_SMS)\n"
    "  --fanout F        fanout: destinations per row on average (and the fan-in's\n"
    "                    sources), 1 to the ranks (5.25, or the ranks when fewer)\n"
    "  --backend B       auto, host or cuda (auto)\n"
    "  --check           compare every result with the oracle; exit 1 on a mismatch\n"
    "  --json            one JSON object per line instead of the table\n"
    "  --floor-bw GBPS   copy bandwidth for the floor (default: measured at the start, rank\n"
    "                    0 alone: cuda a 2 GiB device-to-device copy, host a memcpy)\n"
    "  -n N              launch N ranks (when not already inside epx launch)\n"
    "  --timeout S       limit for the launch that -n starts (600 s, at least the soak's\n"
    "                    duration + 600 s; 0 = none)\n"
    "  --mps             with -n: run the ranks under a CUDA MPS daemon (epx launch --mps)\n"
    "  --ranks-per-node K  virtual nodes of K ranks (with -n: the launch's\n"
    "                    --ranks-per-node; in a launch, EPX_RANKS_PER_NODE must say K);\n"
    "                    prints the expected traffic across nodes: normal mode, network\n"
    "                    bytes per rank and per token (payload and record overhead),\n"
    "                    network messages per token, bytes moved inside nodes\n"
    "                    (docs/INTERNODE.md); --mode ll, the put path's rows, messages and\n"
    "                    bytes per token (docs/LOW_LATENCY.md)\n"
    "  -h, --help        this text\n"
    "\n"
    "The table's floor is the least time the op can take, all ranks at once, moving the\n"
    "bytes it must read and write through memory at the copy bandwidth; floor/time is\n"
    "that floor over the slowest rank's median time (1.00 = at the floor). The header\n"
    "says what each op's floor counts.\n";

void epx__bench_must(int rank, epx_status_t status, const char *what)
{
    if (status == EPX_SUCCESS)
        return;
    if (rank >= 0)
        fprintf(stderr, "epx bench: rank %d: %s failed: %s: %s\n", rank, what,
                epx_status_name(status), epx__tool_error_text());
    else
        fprintf(stderr, "epx bench: %s failed: %s: %s\n", what, epx_status_name(status),
                epx__tool_error_text());
    exit(1);
}

epx_buffer_config_t epx__bench_buffer_config(const epx__bench_options_t *options)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = options->tokens;
    config.hidden = options->hidden;
    config.num_experts = options->experts;
    config.num_topk = options->topk;
    config.num_sms = options->sms;
    return config;
}

static int usage_error(const char *flag, const char *value)
{
    fprintf(stderr, "epx bench: bad value for %s: '%s'\n\n%s", flag, value != NULL ? value : "",
            bench_usage);
    return 2;
}

/*
 * What was left to the mode (tokens 0, dtypes -1) gets the mode's standard case; flags
 * that only one mode understands are refused in the other. Returns -1 or 2, as
 * parse_options.
 */
static int apply_mode_defaults(epx__bench_options_t *o)
{
    int ll = o->mode == EPX__BENCH_MODE_LL;
    int fanout = o->mode == EPX__BENCH_MODE_FANOUT;
    if (fanout && (o->check || o->soak.duration_s > 0 || o->ranks_per_node > 0)) {
        fprintf(stderr, "epx bench: --mode fanout times copies only: no --check, --soak or "
                        "--ranks-per-node\n");
        return 2;
    }
    if (o->fanout > 0 && !fanout) {
        fprintf(stderr, "epx bench: --fanout needs --mode fanout\n\n%s", bench_usage);
        return 2;
    }

    if (o->tokens == 0)
        o->tokens = ll ? 128 : 4096;
    if (o->run_bf16 < 0) {
        o->run_bf16 = !ll;
        o->run_fp8 = 1;
    }
    if (o->round_scale && !ll) {
        fprintf(stderr, "epx bench: --round-scale and --ue8m0 need --mode ll\n\n%s", bench_usage);
        return 2;
    }
    if (o->round_scale && !o->run_fp8) {
        fprintf(stderr, "epx bench: --round-scale and --ue8m0 apply to fp8 dispatch, which "
                        "--dtype bf16 leaves out\n");
        return 2;
    }
    if (o->ranks_per_node > 0 && o->num_ranks > 0 && o->num_ranks % o->ranks_per_node != 0) {
        fprintf(stderr, "epx bench: --ranks-per-node %d does not divide -n %d\n",
                o->ranks_per_node, o->num_ranks);
        return 2;
    }
    if (o->wait_stats && !ll) {
        fprintf(stderr, "epx bench: --wait-stats needs --mode ll\n\n%s", bench_usage);
        return 2;
    }
    if (o->ll_dtype != EPX_DTYPE_INVALID && !ll) {
        fprintf(stderr, "epx bench: --ll-dtype needs --mode ll\n\n%s", bench_usage);
        return 2;
    }
    if (o->ll_dtype == EPX_DTYPE_FP8_E4M3 && o->run_bf16) {
        fprintf(stderr, "epx bench: --ll-dtype fp8 sizes the buffer for fp8 dispatch only, "
                        "which --dtype bf16 or all cannot use (give --ll-dtype bf16)\n");
        return 2;
    }
    /* A run that dispatches fp8 only needs no more than fp8 rows (the standard case). */
    if (o->ll_dtype == EPX_DTYPE_INVALID)
        o->ll_dtype = ll && !o->run_bf16 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    return -1;
}

/*
 * Parse the flags. `launch_only[i]` marks the arguments that belong to the launch
 * that -n starts (dropped from the re-run's command line). Returns -1 to go on, else
 * the exit status (0 after --help, 2 for a bad flag).
 */
static int parse_options(int argc, char **argv, epx__bench_options_t *o, char *launch_only)
{
    int64_t seed = (int64_t)o->seed; /* the flag table holds int64_t destinations */
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = NULL;
        int64_t number = 0;
        int first = i;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            fputs(bench_usage, stdout);
            fputs(epx__soak_usage, stdout);
            return 0;
        }
        int soak_flag = epx__soak_match(argc, argv, &i, &o->soak);
        if (soak_flag != 0) {
            if (soak_flag < 0)
                return 2;
            continue;
        }
        if (strcmp(arg, "--check") == 0) {
            o->check = 1;
            continue;
        }
        if (strcmp(arg, "--json") == 0) {
            o->json = 1;
            continue;
        }
        if (strcmp(arg, "--wait-stats") == 0) {
            o->wait_stats = 1;
            continue;
        }
        if (strcmp(arg, "--auto-register") == 0) {
            o->auto_register = 1;
            continue;
        }
        if (strcmp(arg, "--register-exact") == 0) {
            o->register_exact = 1;
            continue;
        }
        if (strcmp(arg, "--round-scale") == 0) {
            o->round_scale = 1;
            continue;
        }
        if (strcmp(arg, "--ue8m0") == 0) {
            o->use_ue8m0 = 1;
            o->round_scale = 1; /* UE8M0 holds powers of two only */
            continue;
        }
        if (strcmp(arg, "--mps") == 0) {
            o->use_mps = 1;
            launch_only[i] = 1;
            continue;
        }
        /* Integer flags: name, bounds, and where the value goes. */
        struct {
            const char *name;
            int64_t min, max;
            int64_t *wide;  /* either an int64_t destination ... */
            int *narrow;    /* ... or an int one */
        } const int_flags[] = {
            {"--tokens", 1, INT32_MAX, &o->tokens, NULL},
            {"--hidden", 1, INT32_MAX, &o->hidden, NULL},
            {"--seed", 0, INT64_MAX, &seed, NULL},
            {"--experts", 1, 1 << 20, NULL, &o->experts},
            {"--topk", 1, 1 << 20, NULL, &o->topk},
            {"--warmup", 0, 1 << 24, NULL, &o->warmup},
            {"--iters", 1, 1 << 24, NULL, &o->iters},
            {"--back-to-back", 0, 1 << 24, NULL, &o->back_to_back},
            {"--alignment", 1, 1 << 20, NULL, &o->alignment},
            {"--sms", 0, 1024, NULL, &o->sms},
            {"-n", 1, 1 << 20, NULL, &o->num_ranks},
            {"--ranks-per-node", 1, 1 << 20, NULL, &o->ranks_per_node},
            {"--register-mb", 0, 1 << 20, NULL, &o->register_mb},
        };
        int handled = 0;
        for (size_t f = 0; f < sizeof(int_flags) / sizeof(int_flags[0]) && !handled; f++) {
            int matched = epx__match_value(argc, argv, &i, int_flags[f].name, &value);
            if (matched == 0)
                continue;
            if (matched < 0 ||
                epx__parse_int64(value, int_flags[f].min, int_flags[f].max, &number) != 0)
                return usage_error(int_flags[f].name, value);
            if (int_flags[f].wide != NULL)
                *int_flags[f].wide = number;
            else
                *int_flags[f].narrow = (int)number;
            if (int_flags[f].narrow == &o->num_ranks)
                launch_only[first] = launch_only[i] = 1;
            handled = 1;
        }
        if (handled)
            continue;
        int matched;
        if ((matched = epx__match_value(argc, argv, &i, "--mode", &value)) != 0) {
            if (matched < 0)
                return usage_error("--mode", NULL);
            if (strcmp(value, "normal") == 0)
                o->mode = EPX__BENCH_MODE_NORMAL;
            else if (strcmp(value, "ll") == 0)
                o->mode = EPX__BENCH_MODE_LL;
            else if (strcmp(value, "fanout") == 0)
                o->mode = EPX__BENCH_MODE_FANOUT;
            else
                return usage_error("--mode", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--dtype", &value)) != 0) {
            if (matched < 0)
                return usage_error("--dtype", NULL);
            o->run_bf16 = strcmp(value, "bf16") == 0 || strcmp(value, "all") == 0;
            o->run_fp8 = strcmp(value, "fp8") == 0 || strcmp(value, "all") == 0;
            if (!o->run_bf16 && !o->run_fp8)
                return usage_error("--dtype", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--ll-dtype", &value)) != 0) {
            if (matched < 0)
                return usage_error("--ll-dtype", NULL);
            if (strcmp(value, "bf16") == 0)
                o->ll_dtype = EPX_DTYPE_BF16;
            else if (strcmp(value, "fp8") == 0)
                o->ll_dtype = EPX_DTYPE_FP8_E4M3;
            else
                return usage_error("--ll-dtype", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--backend", &value)) != 0) {
            if (matched < 0)
                return usage_error("--backend", NULL);
            if (strcmp(value, "auto") == 0)
                o->backend = EPX_BACKEND_AUTO;
            else if (strcmp(value, "host") == 0)
                o->backend = EPX_BACKEND_HOST;
            else if (strcmp(value, "cuda") == 0)
                o->backend = EPX_BACKEND_CUDA;
            else
                return usage_error("--backend", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--floor-bw", &value)) != 0) {
            if (matched < 0 || epx__parse_double(value, 1e-6, 1e9, &o->floor_bw_gbps) != 0)
                return usage_error("--floor-bw", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--fanout", &value)) != 0) {
            if (matched < 0 || epx__parse_double(value, 1, 64, &o->fanout) != 0)
                return usage_error("--fanout", value);
        } else if ((matched = epx__match_value(argc, argv, &i, "--timeout", &value)) != 0) {
            if (matched < 0 || epx__parse_double(value, 0, 1e9, &o->timeout_s) != 0)
                return usage_error("--timeout", value);
            launch_only[first] = launch_only[i] = 1;
        } else {
            fprintf(stderr, "epx bench: unknown option '%s'\n\n%s", arg, bench_usage);
            return 2;
        }
    }
    o->seed = (uint64_t)seed; /* parsed as int64_t with the other integers */
    return apply_mode_defaults(o);
}

/*
 * The buffers the run will make, checked by the library before any rank does anything:
 * epx_buffer_size_plan of each config for `world` ranks (no group is formed), so that a
 * bad --topk or --experts is one message before the header, not an error from every
 * rank (with -n, from the one process that has not launched the ranks yet). Returns -1
 * when the shape is accepted, else the exit status 2.
 */
static int check_shape(const epx__bench_options_t *o, int world)
{
    epx_buffer_config_t config = epx__bench_buffer_config(o);
    if (o->mode == EPX__BENCH_MODE_LL) {
        config.max_low_latency_tokens = o->tokens;
        config.low_latency_dtype = o->ll_dtype;
    }
    const epx_dtype_t dtypes[] = {EPX_DTYPE_BF16, EPX_DTYPE_FP8_E4M3};
    for (int d = 0; d < 2; d++) {
        if ((d == 0 && !o->run_bf16) || (d == 1 && !o->run_fp8))
            continue;
        /* Low-latency mode keeps the default (bf16) normal-mode dtype. */
        if (o->mode == EPX__BENCH_MODE_NORMAL)
            config.dispatch_dtype = dtypes[d];
        size_t bytes = 0;
        epx_status_t status =
            epx_buffer_size_plan(EPX_BACKEND_HOST, world, 0, &config, &bytes);
        if (status != EPX_SUCCESS) {
            fprintf(stderr, "epx bench: these options give a buffer epx refuses for %d rank%s: "
                            "%s: %s\n",
                    world, world == 1 ? "" : "s", epx_status_name(status), epx_last_error());
            return 2;
        }
    }
    return -1;
}

/* `epx launch -n N -- <this executable> bench <the same flags without -n>`. */
static int relaunch(int argc, char **argv, const epx__bench_options_t *o, const char *launch_only)
{
    static char self[PATH_MAX];
    ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (length <= 0) {
        fprintf(stderr, "epx bench: cannot find this executable (/proc/self/exe)\n");
        return 1;
    }
    self[length] = '\0';
    char **child_argv = calloc((size_t)argc + 2, sizeof(char *));
    if (child_argv == NULL) {
        fprintf(stderr, "epx bench: out of memory\n");
        return 1;
    }
    int count = 0;
    child_argv[count++] = self;
    child_argv[count++] = "bench";
    for (int i = 1; i < argc; i++) {
        if (!launch_only[i])
            child_argv[count++] = argv[i];
    }
    child_argv[count] = NULL;

    epx__launch_options_t launch = EPX__LAUNCH_OPTIONS_INIT;
    launch.num_ranks = o->num_ranks;
    launch.timeout_s = o->timeout_s;
    /* A soak runs for its duration: the launch limit stretches to cover it. */
    if (launch.timeout_s > 0 && o->soak.duration_s + 600 > launch.timeout_s)
        launch.timeout_s = o->soak.duration_s + 600;
    launch.use_mps = o->use_mps;
    launch.ranks_per_node = o->ranks_per_node;
    /* Only rank 0 writes to stdout; unprefixed, the table and JSON lines stay as they
     * are (errors on stderr keep their rank prefix). */
    launch.prefix_stdout = 0;
    launch.argv = child_argv;
    int status = epx__launch_run(&launch);
    free(child_argv);
    return status;
}

/* Rank 0 measures the floor's bandwidth while the other ranks wait (every rank calls
 * this); the other ranks print no floor. */
static void choose_floor(epx_group_t group, const epx__bench_options_t *o,
                         const epx_group_info_t *info, epx__bench_device_t *device,
                         epx__bench_context_t *context)
{
    if (o->floor_bw_gbps > 0) {
        context->floor_bw_gbps = o->floor_bw_gbps;
        context->floor_source = "given with --floor-bw";
        return;
    }
    const int cuda = info->backend == EPX_BACKEND_CUDA;
    /* Alone on the device: the other ranks' work would share its bandwidth. */
    epx__bench_must(info->rank, epx_group_barrier(group), "epx_group_barrier");
    if (info->rank == 0) {
        size_t bytes = 0;
        context->floor_bw_gbps = epx__bench_floor_bandwidth(device, &bytes);
        context->floor_copy_bytes = bytes;
        if (bytes == EPX__BENCH_FLOOR_COPY_BYTES)
            context->floor_source =
                "measured: 2 GiB device-to-device copy on rank 0 alone, read + write counted";
        else if (bytes > 0 && cuda)
            context->floor_source = "measured: 256 MiB device-to-device copy on rank 0 alone "
                                    "(2 GiB could not be allocated), read + write counted";
        else if (bytes > 0)
            context->floor_source = "measured: 256 MiB memcpy on rank 0, read + write counted";
        else if (cuda) {
            context->floor_bw_gbps = CUDA_FLOOR_ASSUMED_GBPS;
            context->floor_source =
                "assumed (the copy could not be measured): an H200's HBM copy bandwidth";
        } else {
            context->floor_source = "could not allocate 256 MiB to measure memcpy";
        }
    } else {
        context->floor_source = "measured on rank 0";
    }
    epx__bench_must(info->rank, epx_group_barrier(group), "epx_group_barrier");
}

/*
 * Every normal-mode case asked for; rank 0 prints, with the expected traffic across
 * nodes after each dtype's rows when `nodes` says so. Returns 1 when a check failed.
 */
static int run_normal(epx_group_t group, const epx__bench_options_t *o,
                      epx__bench_device_t *device, const epx__bench_context_t *context, int rank,
                      int nodes)
{
    if (rank == 0 && !o->json)
        epx__bench_print_header(stdout, context);
    int failed = 0, explained = 0;
    const epx_dtype_t dtypes[] = {EPX_DTYPE_BF16, EPX_DTYPE_FP8_E4M3};
    for (int d = 0; d < 2; d++) {
        if ((d == 0 && !o->run_bf16) || (d == 1 && !o->run_fp8))
            continue;
        epx__bench_row_t rows[EPX__BENCH_OP_COUNT];
        failed |= epx__bench_run_case(group, o, device, dtypes[d], context->warmup,
                                      context->iters, context->back_to_back, rows);
        if (rank == 0) {
            for (int op = 0; op < EPX__BENCH_OP_COUNT; op++)
                epx__bench_print_row(stdout, context, &rows[op], o->json);
            if (!o->json)
                epx__bench_print_back_to_back(stdout, context, rows, EPX__BENCH_OP_COUNT);
        }
        if (nodes) {
            epx__bench_nodes_report(group, o->tokens, o->hidden, o->experts, o->topk, o->sms,
                                    o->seed, dtypes[d], o->json, !explained);
            explained = 1;
        }
    }
    return failed;
}

/* The soak's replacement of a killed rank: no group from the launch (bench_soak.c). */
static int run_replacement(const epx__bench_options_t *o)
{
    epx__bench_device_t device;
    epx__bench_must(-1, epx__bench_device_init(&device, EPX_BACKEND_HOST, -1),
                    "bench device setup");
    int failed = epx__bench_soak_newcomer(o, &device);
    epx__bench_device_fini(&device);
    return failed;
}

static int run(const epx__bench_options_t *o)
{
    if (o->soak.rejoin_id[0] != '\0')
        return run_replacement(o);
    epx_group_t group = NULL;
    epx__bench_must(-1, epx_group_create_from_env(o->backend, &group), "epx_group_create_from_env");
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    int cuda = info.backend == EPX_BACKEND_CUDA;
    int ll = o->mode == EPX__BENCH_MODE_LL;
    if (o->ranks_per_node > 0 && info.ranks_per_node != o->ranks_per_node) {
        if (info.rank == 0)
            fprintf(stderr, "epx bench: --ranks-per-node %d, but the group has %d ranks per "
                            "node: launch with `epx launch --ranks-per-node %d` (or "
                            "EPX_RANKS_PER_NODE=%d), or give -n to the bench\n",
                    o->ranks_per_node, info.ranks_per_node, o->ranks_per_node,
                    o->ranks_per_node);
        /* No rank leaves before rank 0 has said why: the first rank to exit makes the
         * launcher stop the others, rank 0 included. */
        fflush(stderr);
        epx_group_barrier(group);
        epx_group_destroy(group);
        return 2;
    }
    int nodes = o->ranks_per_node > 0 || info.ranks_per_node < info.world_size;
    /* Low-latency ops take microseconds (milliseconds on the host), so more runs. */
    int warmup = o->warmup >= 0 ? o->warmup : ll ? (cuda ? 10 : 2) : (cuda ? 5 : 1);
    int iters = o->iters >= 0 ? o->iters : ll ? (cuda ? 100 : 20) : (cuda ? 30 : 3);

    epx__bench_device_t device;
    epx__bench_must(info.rank, epx__bench_device_init(&device, info.backend, info.device),
                    "bench device setup");

    epx__bench_context_t context;
    memset(&context, 0, sizeof(context));
    context.backend = epx_backend_name(info.backend);
    context.ranks = info.world_size;
    context.tokens = o->tokens;
    context.hidden = o->hidden;
    context.experts = o->experts;
    context.topk = o->topk;
    context.alignment = o->alignment;
    context.auto_register = o->auto_register;
    context.seed = o->seed;
    /* SMs are the GPU kernels' budget: the CPU backend has none to state. */
    context.sms = !cuda ? 0 : o->sms > 0 ? o->sms : (int)epx__tool_param_int("EPX_NUM_SMS");
    context.warmup = warmup;
    context.iters = iters;
    context.back_to_back = ll ? 0 : o->back_to_back >= 0 ? o->back_to_back : cuda ? iters : 0;
    choose_floor(group, o, &info, &device, &context);

    int failed = o->soak.duration_s > 0 ? epx__bench_soak_run(group, o, &device)
                 : ll ? epx__bench_ll_run(group, o, &device, &context)
                 : o->mode == EPX__BENCH_MODE_FANOUT
                     ? epx__bench_fanout_run(group, o, &device, &context)
                     : run_normal(group, o, &device, &context, info.rank, nodes);
    epx__bench_device_fini(&device);
    epx__bench_must(info.rank, epx_group_destroy(group), "epx_group_destroy");
    if (failed == 1 && info.rank == 0)
        fprintf(stderr, "epx bench: check FAILED (see the differences above)\n");
    return failed == 2 ? 2 : failed ? 1 : 0; /* 2: options the run cannot honour */
}

int epx__command_bench(int argc, char **argv)
{
    /* tokens 0 and dtypes -1: the chosen mode's standard case (apply_mode_defaults). */
    epx__bench_options_t options = {
        .mode = EPX__BENCH_MODE_NORMAL, .tokens = 0, .hidden = 7168, .experts = 256,
        .topk = 8, .run_bf16 = -1, .run_fp8 = -1, .warmup = -1, .iters = -1,
        .back_to_back = -1, .seed = 1,
        .alignment = 1, .sms = 0, .backend = EPX_BACKEND_AUTO, .check = 0, .json = 0,
        .floor_bw_gbps = 0, .num_ranks = 0, .timeout_s = 600, .use_mps = 0,
        .round_scale = 0, .use_ue8m0 = 0, .ll_dtype = EPX_DTYPE_INVALID, .ranks_per_node = 0,
        .soak = EPX__SOAK_OPTIONS_INIT, .fanout = 0,
    };
    char *launch_only = calloc((size_t)argc + 1, 1);
    if (launch_only == NULL) {
        fprintf(stderr, "epx bench: out of memory\n");
        return 1;
    }
    int status = parse_options(argc, argv, &options, launch_only);
    if (status >= 0) {
        free(launch_only);
        return status;
    }
    epx_status_t loaded = epx_params_load();
    if (loaded != EPX_SUCCESS) {
        free(launch_only);
        fprintf(stderr, "epx bench: %s: %s\n", epx_status_name(loaded), epx_last_error());
        return 1;
    }
    int64_t launched_ranks = epx__tool_param_int("EPX_WORLD_SIZE");
    int world = options.num_ranks > 0 ? options.num_ranks
                                      : launched_ranks > 0 ? (int)launched_ranks : 1;
    /* Inside a launch only rank 0 checks (the others have the same arguments): it says
     * why and exits, and the launcher stops the others, still waiting for it in the
     * rendezvous. A rank that exited first would get rank 0 stopped before it spoke. */
    status = launched_ranks == 0 || epx__tool_param_int("EPX_RANK") <= 0
                 ? check_shape(&options, world)
                 : -1;
    if (status >= 0) {
        free(launch_only);
        return status;
    }
    if (options.num_ranks > 0 && launched_ranks == 0) {
        status = relaunch(argc, argv, &options, launch_only);
        free(launch_only);
        return status;
    }
    free(launch_only);
    if (options.num_ranks > 0 && launched_ranks != options.num_ranks) {
        fprintf(stderr, "epx bench: -n %d, but this launch has %lld ranks\n", options.num_ranks,
                (long long)launched_ranks);
        return 2;
    }
    return run(&options);
}
