/*
 * `epx doctor` NVSHMEM checks: where libnvshmem_host.so.3 is and which version, whether
 * epx's own NVSHMEM plugin (libepx_nvshmem.so: the low-latency kernels) loads and was
 * built against the same NVSHMEM, which of NVSHMEM's bootstrap and transport plugins
 * load (their libraries must resolve: IBGDA needs rdma-core's libmlx5), and whether two
 * processes really initialise NVSHMEM from a unique id, as epx's low-latency and
 * internode modes do.
 *
 * The library is looked for where epx's build and users put it: $NVSHMEM_HOME/lib, the
 * nvidia-nvshmem wheel under the site-packages of the python3 on PATH, the device
 * image's /opt/torch venv, then the dynamic loader's own path.
 *
 * The bootstrap test uses the host library alone (nvshmemx_hostlib_init_attr, as
 * nvshmem4py does), so the doctor needs no device code. It fills the init attributes
 * by hand, which is safe because NVSHMEM 3.x versions them: each struct starts with
 * (1 << 16) + its size, and the library checks that before reading further.
 */
#include <dlfcn.h>
#include <errno.h>
#include <dirent.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/tool.h"
#include "doctor_checks.h"
#include "doctor_child.h"
#include "doctor_cuda.h"
#include "doctor_parse.h"
#include "epx.h"

#define HOST_LIBRARY "libnvshmem_host.so.3"
#define DEVICE_IMAGE_VENV "/opt/torch/.venv/lib/python3.12/site-packages"
#define NVSHMEMX_INIT_WITH_UNIQUEID 8
#define ABI_VERSION(size) ((1 << 16) + (int)(size))

/* NVSHMEM 3.x init ABI, version 1 (bootstrap_device_host/nvshmem_uniqueid.h and
 * device_host/nvshmem_types.h). */
typedef struct {
    int version;
    char internal[124];
} uniqueid_v1_t;

typedef struct {
    int version;
    uniqueid_v1_t *id;
    int myrank;
    int nranks;
} uniqueid_args_v1_t;

typedef struct {
    int version;
    uniqueid_args_v1_t uid_args;
    char content[96];
} init_args_v1_t;

typedef struct {
    int version;
    void *mpi_comm;
    init_args_v1_t args;
} init_attr_v1_t;

_Static_assert(sizeof(uniqueid_v1_t) == 128, "NVSHMEM uniqueid_v1 is 128 bytes");
_Static_assert(sizeof(uniqueid_args_v1_t) == 24, "NVSHMEM uniqueid_args_v1 is 24 bytes");
_Static_assert(sizeof(init_args_v1_t) == 128, "NVSHMEM init_args_v1 is 128 bytes");
_Static_assert(sizeof(init_attr_v1_t) == 144, "NVSHMEM init_attr_v1 is 144 bytes");

typedef struct {
    char path[4096]; /* the library found, "" when none */
    int major, minor, patch;
    char load_error[512];
} library_facts_t;

/* ---------------------------------------------------------------- finding it */

static int file_exists(const char *path)
{
    struct stat info;
    return stat(path, &info) == 0 && S_ISREG(info.st_mode);
}

/* Candidates in search order, newline-separated into `out`. */
static void list_candidates(char *out, size_t out_size)
{
    size_t used = 0;
    out[0] = '\0';
#define ADD(...)                                                                   \
    do {                                                                           \
        if (used < out_size)                                                       \
            used += (size_t)snprintf(out + used, out_size - used, __VA_ARGS__);    \
    } while (0)
    const char *home = getenv("NVSHMEM_HOME");
    if (home != NULL && home[0] != '\0')
        ADD("%s/lib/%s\n", home, HOST_LIBRARY);
    char python[4096];
    if (epx__doctor_find_in_path("python3", python, sizeof(python))) {
        char *const argv[] = {python, "-c",
                              "import site\n"
                              "for p in site.getsitepackages() + [site.getusersitepackages()]: "
                              "print(p)",
                              NULL};
        char output[4096];
        if (epx__doctor_run_program(argv, NULL, output, sizeof(output), NULL, 0, 15.0, NULL) == 0) {
            for (char *line = strtok(output, "\n"); line != NULL; line = strtok(NULL, "\n"))
                ADD("%s/nvidia/nvshmem/lib/%s\n", line, HOST_LIBRARY);
        }
    }
    ADD("%s/nvidia/nvshmem/lib/%s\n", DEVICE_IMAGE_VENV, HOST_LIBRARY);
#undef ADD
}

/* In a child: find and load the library, read its version. */
static void probe_library(epx__doctor_report_t *report, void *arg, void *facts_out)
{
    (void)report;
    (void)arg;
    library_facts_t *facts = facts_out;
    char candidates[8192];
    list_candidates(candidates, sizeof(candidates));
    for (char *line = strtok(candidates, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (file_exists(line)) {
            snprintf(facts->path, sizeof(facts->path), "%s", line);
            break;
        }
    }
    void *library = dlopen(facts->path[0] ? facts->path : HOST_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        const char *error = dlerror();
        if (facts->path[0])
            snprintf(facts->load_error, sizeof(facts->load_error), "%s", error ? error : "?");
        return;
    }
    if (!facts->path[0]) { /* found by the loader's own search */
        Dl_info info;
        void *symbol = dlsym(library, "nvshmem_my_pe");
        if (symbol != NULL && dladdr(symbol, &info) != 0 && info.dli_fname != NULL)
            snprintf(facts->path, sizeof(facts->path), "%s", info.dli_fname);
        else
            snprintf(facts->path, sizeof(facts->path), "%s", HOST_LIBRARY);
    }
    void (*version)(int *, int *, int *) = NULL;
    *(void **)(&version) = dlsym(library, "nvshmemx_vendor_get_version_info");
    if (version != NULL)
        version(&facts->major, &facts->minor, &facts->patch);
}

/* ---------------------------------------------------------------- epx's plugin */

/*
 * libepx_nvshmem.so holds the low-latency kernels and every NVSHMEM call; libepx loads
 * it when the first low-latency CUDA buffer is made. Its device code is NVSHMEM's,
 * linked in at build time, and at run time it brings in libnvshmem_host.so.3 through
 * its RPATH or the loader's path: the two must be one NVSHMEM version.
 */
#define LL_PLUGIN_FILE "libepx_nvshmem.so"
#define LL_PLUGIN_FIX                                                                      \
    "for low-latency mode on GPUs: pip install nvidia-nvshmem-cu13==3.4.5 and rebuild epx " \
    "(CMake then builds " LL_PLUGIN_FILE "), or set EPX_NVSHMEM_PLUGIN to its path"

#ifdef EPX_WITH_CUDA
typedef struct {
    int32_t loaded;
    int32_t version[3];      /* the NVSHMEM compiled into the plugin */
    int32_t host_version[3]; /* the libnvshmem_host.so.3 it brought in; 0 = unknown */
    char path[4096];
    char host_path[4096];
    char message[1024]; /* epx_last_error() when it does not load */
} ll_plugin_facts_t;

/* In a child: load the plugin exactly as a buffer would, and the host library with it. */
static void probe_ll_plugin(epx__doctor_report_t *report, void *arg, void *facts_out)
{
    (void)report;
    (void)arg;
    ll_plugin_facts_t *facts = facts_out;
    char path[PATH_MAX];
    int version[3] = {0, 0, 0};
    if (epx_nvshmem_plugin_probe(path, sizeof(path), version) != EPX_SUCCESS) {
        snprintf(facts->message, sizeof(facts->message), "%s", epx_last_error());
        return;
    }
    facts->loaded = 1;
    char resolved[PATH_MAX];
    snprintf(facts->path, sizeof(facts->path), "%s",
             realpath(path, resolved) != NULL ? resolved : path);
    for (int i = 0; i < 3; i++)
        facts->version[i] = version[i];
    /* Already loaded as the plugin's dependency: RTLD_NOLOAD finds that copy, not
     * whichever one a fresh search would. */
    void *host = dlopen(HOST_LIBRARY, RTLD_LAZY | RTLD_NOLOAD);
    if (host == NULL)
        return;
    void (*get_version)(int *, int *, int *) = NULL;
    *(void **)(&get_version) = dlsym(host, "nvshmemx_vendor_get_version_info");
    if (get_version != NULL) {
        int host_version[3] = {0, 0, 0};
        get_version(&host_version[0], &host_version[1], &host_version[2]);
        for (int i = 0; i < 3; i++)
            facts->host_version[i] = host_version[i];
        Dl_info info;
        if (dladdr(*(void **)(&get_version), &info) != 0 && info.dli_fname != NULL)
            snprintf(facts->host_path, sizeof(facts->host_path), "%s",
                     realpath(info.dli_fname, resolved) != NULL ? resolved : info.dli_fname);
    }
    dlclose(host);
}

/* 1 when the loader's message says the plugin file itself is not there (as opposed to
 * a plugin that is there but does not load: a missing dependency, another ABI). */
static int ll_plugin_missing(const char *message, const char *forced)
{
    const char *not_there = ": cannot open shared object file";
    char pattern[4096 + 64];
    snprintf(pattern, sizeof(pattern), "%s%s", forced[0] != '\0' ? forced : LL_PLUGIN_FILE,
             not_there);
    return strstr(message, pattern) != NULL;
}

static int same_version(const int32_t a[3], const int b[3])
{
    return a[0] == b[0] && a[1] == b[1] && a[2] == b[2];
}
#endif /* EPX_WITH_CUDA */

static void check_ll_plugin(epx__doctor_report_t *report, const epx__doctor_context_t *context)
{
#ifndef EPX_WITH_CUDA
    (void)context;
    epx__doctor_add(report, "nvshmem.plugin", EPX__DOCTOR_SKIP, NULL,
                    "this epx has no CUDA backend, so it never loads " LL_PLUGIN_FILE
                    " (low-latency mode runs on the CPU backend only)");
#else
    ll_plugin_facts_t facts;
    memset(&facts, 0, sizeof(facts));
    if (epx__doctor_run_child(report, "nvshmem.plugin", context->timeout_s, probe_ll_plugin, NULL,
                              &facts, sizeof(facts)) != EPX__DOCTOR_CHILD_DONE)
        return;
    const char *forced = epx__tool_param_string("EPX_NVSHMEM_PLUGIN");
    if (forced == NULL)
        forced = "";
    if (!facts.loaded && !ll_plugin_missing(facts.message, forced)) {
        epx__doctor_add(report, "nvshmem.plugin",
                        context->gpu.gpu_count > 0 ? EPX__DOCTOR_FAIL : EPX__DOCTOR_WARN,
                        "install what the loader says is missing (the NVSHMEM library the "
                        "plugin was built with), or rebuild epx so its plugin matches",
                        "%s is there but does not load, so low-latency mode on GPUs is "
                        "unavailable\nepx says: %s",
                        LL_PLUGIN_FILE, facts.message);
        return;
    }
    if (!facts.loaded) {
        char where[4096 + 64];
        if (forced[0] != '\0')
            snprintf(where, sizeof(where), "EPX_NVSHMEM_PLUGIN=%s", forced);
        else
            snprintf(where, sizeof(where), "looked beside libepx, in the build directory (from "
                                           "a build tree) and on the loader's path");
        epx__doctor_add(report, "nvshmem.plugin", EPX__DOCTOR_NOT_PRESENT, LL_PLUGIN_FIX,
                        "%s not found (%s), so low-latency mode on GPUs is unavailable\n"
                        "epx says: %s",
                        LL_PLUGIN_FILE, where, facts.message);
        return;
    }
    char version[32], host[4096 + 64] = "";
    snprintf(version, sizeof(version), "%d.%d.%d", facts.version[0], facts.version[1],
             facts.version[2]);
    if (facts.host_version[0] > 0)
        snprintf(host, sizeof(host), "\nit loads libnvshmem_host.so.3 %d.%d.%d from %s",
                 facts.host_version[0], facts.host_version[1], facts.host_version[2],
                 facts.host_path[0] ? facts.host_path : "?");
    int host_differs = facts.host_version[0] > 0 &&
                       !same_version(facts.host_version, facts.version);
    int library_differs = context->nvshmem_version[0] > 0 &&
                          !same_version(facts.version, context->nvshmem_version);
    char fix[EPX__DOCTOR_FIX_MAX];
    snprintf(fix, sizeof(fix),
             "use one NVSHMEM version throughout: pip install nvidia-nvshmem-cu13==%s (the "
             "plugin's) and set NVSHMEM_HOME or LD_LIBRARY_PATH to it, or rebuild epx against "
             "the NVSHMEM you run with",
             version);
    if (host_differs)
        epx__doctor_add(report, "nvshmem.plugin", EPX__DOCTOR_WARN, fix,
                        "%s found at %s, NVSHMEM %s%s\nits device code is NVSHMEM %s but the "
                        "host library it loads is %d.%d.%d: they must be one version",
                        LL_PLUGIN_FILE, facts.path, version, host, version,
                        facts.host_version[0], facts.host_version[1], facts.host_version[2]);
    else if (library_differs)
        epx__doctor_add(report, "nvshmem.plugin", EPX__DOCTOR_WARN, fix,
                        "%s found at %s, NVSHMEM %s%s\nbut nvshmem.library found NVSHMEM "
                        "%d.%d.%d at %s: host and device NVSHMEM must be one version at run "
                        "time",
                        LL_PLUGIN_FILE, facts.path, version, host, context->nvshmem_version[0],
                        context->nvshmem_version[1], context->nvshmem_version[2],
                        context->nvshmem_path);
    else
        epx__doctor_add(report, "nvshmem.plugin", EPX__DOCTOR_PASS, NULL,
                        "%s found at %s, NVSHMEM %s%s", LL_PLUGIN_FILE, facts.path, version, host);
#endif
}

/* ---------------------------------------------------------------- plugins */

typedef struct {
    char directory[4096]; /* where the host library is: the plugins sit beside it */
    int rdma_ports_up;
} plugin_arg_t;

/* Which plugins beside the library load, and whether rdma-core's libraries do. */
static void probe_plugins(epx__doctor_report_t *report, void *arg, void *facts)
{
    (void)facts;
    const plugin_arg_t *plugins = arg;
    const char *directory = plugins->directory;
    char loaded[512] = "", failed[1024] = "";
    size_t loaded_used = 0, failed_used = 0;
    int ibgda = 0, ibrc = 0, uid = 0;
    DIR *listing = opendir(directory);
    struct dirent *entry;
    while (listing != NULL && (entry = readdir(listing)) != NULL) {
        const char *name = entry->d_name;
        if (strncmp(name, "nvshmem_transport_", 18) != 0 && strncmp(name, "nvshmem_bootstrap_", 18) != 0)
            continue;
        char path[4096 + 256 + 2], shortname[64];
        snprintf(path, sizeof(path), "%s/%s", directory, name);
        snprintf(shortname, sizeof(shortname), "%.*s", (int)strcspn(name + 18, "."), name + 18);
        int is_transport = name[8] == 't';
        void *plugin = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (plugin != NULL) {
            if (loaded_used < sizeof(loaded))
                loaded_used += (size_t)snprintf(loaded + loaded_used, sizeof(loaded) - loaded_used,
                                                " %s%s", is_transport ? "" : "bootstrap-",
                                                shortname);
            ibgda |= is_transport && strcmp(shortname, "ibgda") == 0;
            ibrc |= is_transport && strcmp(shortname, "ibrc") == 0;
            uid |= !is_transport && strcmp(shortname, "uid") == 0;
        } else if (failed_used < sizeof(failed)) {
            const char *error = dlerror();
            failed_used += (size_t)snprintf(failed + failed_used, sizeof(failed) - failed_used,
                                            "\n  %s: %s", shortname, error ? error : "?");
        }
    }
    if (listing != NULL)
        closedir(listing);
    /* The IB transports open rdma-core at init, not at load: try it here. */
    void *verbs = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    void *mlx5 = dlopen("libmlx5.so.1", RTLD_NOW | RTLD_LOCAL);
    int need_rdma = plugins->rdma_ports_up > 0;
    char detail[EPX__DOCTOR_DETAIL_MAX];
    snprintf(detail, sizeof(detail),
             "plugins that load:%s\nrdma-core: libibverbs.so.1 %s, libmlx5.so.1 %s (IBGDA needs "
             "both)%s%s",
             loaded[0] ? loaded : " none", verbs ? "loads" : "missing", mlx5 ? "loads" : "missing",
             failed[0] ? "\nplugins that do not load (epx needs only bootstrap-uid and, across "
                         "nodes, ibgda or ibrc):"
                       : "",
             failed);
    if (!uid)
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_FAIL,
                        "reinstall the NVSHMEM wheel (nvidia-nvshmem-cu13): its "
                        "nvshmem_bootstrap_uid.so.3 must sit beside libnvshmem_host.so.3",
                        "%s\nepx starts NVSHMEM from a unique id, which needs the bootstrap-uid "
                        "plugin",
                        detail);
    else if (!need_rdma)
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_PASS, NULL,
                        "%s\nno RDMA port is up, so only NVSHMEM's built-in P2P transport is used",
                        detail);
    else if (!(ibgda && verbs && mlx5) && !(ibrc && verbs))
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_FAIL,
                        "install rdma-core (libibverbs1 and ibverbs-providers on Debian/Ubuntu) "
                        "so NVSHMEM can reach the NICs",
                        "%s\nRDMA ports are up but no IB transport can run", detail);
    else if (!(ibgda && verbs && mlx5))
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_WARN,
                        "install rdma-core's mlx5 provider (ibverbs-providers) for IBGDA; until "
                        "then internode traffic goes through the slower IBRC proxy",
                        "%s", detail);
    else
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_PASS, NULL, "%s", detail);
}

/* ---------------------------------------------------------------- bootstrap */

typedef struct {
    int32_t ok;
    int32_t my_pe;
    int32_t n_pes;
    int32_t peer_mapped; /* nvshmem_ptr gave the peer's address (P2P) */
    double init_ms;
    char message[384];
} pe_result_t;

typedef struct {
    const char *library;
    int rank;
    int ordinal;
    int uid_out; /* rank 0 writes the id here */
    int uid_in;  /* rank 1 reads it here */
    int to_parent;
    int64_t deadline_ns;
} pe_worker_t;

static void run_pe(const pe_worker_t *worker)
{
    pe_result_t result;
    memset(&result, 0, sizeof(result));
    epx__doctor_cuda_t cuda;
    char why[256];
    int status;
    void *library = NULL;
    int (*get_uniqueid)(uniqueid_v1_t *) = NULL;
    int (*set_uid_args)(int, int, const uniqueid_v1_t *, init_attr_v1_t *) = NULL;
    int (*init_attr)(unsigned int, init_attr_v1_t *) = NULL;
    int (*my_pe)(void) = NULL, (*n_pes)(void) = NULL;
    void *(*symmetric_malloc)(size_t) = NULL;
    void *(*symmetric_ptr)(const void *, int) = NULL;
    void (*symmetric_free)(void *) = NULL, (*finalize)(void) = NULL;
    if (epx__doctor_cuda_load(&cuda, why, sizeof(why)) != 0 || cuda.cuInit(0) != 0 ||
        epx__doctor_cuda_use_device(&cuda, worker->ordinal) != 0) {
        snprintf(result.message, sizeof(result.message), "cannot use GPU%d", worker->ordinal);
        goto done;
    }
    library = dlopen(worker->library, RTLD_NOW | RTLD_GLOBAL);
    if (library == NULL) {
        snprintf(result.message, sizeof(result.message), "load: %s", dlerror());
        goto done;
    }
    *(void **)(&get_uniqueid) = dlsym(library, "nvshmemx_get_uniqueid");
    *(void **)(&set_uid_args) = dlsym(library, "nvshmemx_set_attr_uniqueid_args");
    *(void **)(&init_attr) = dlsym(library, "nvshmemx_hostlib_init_attr");
    *(void **)(&my_pe) = dlsym(library, "nvshmem_my_pe");
    *(void **)(&n_pes) = dlsym(library, "nvshmem_n_pes");
    *(void **)(&symmetric_malloc) = dlsym(library, "nvshmem_malloc");
    *(void **)(&symmetric_ptr) = dlsym(library, "nvshmem_ptr");
    *(void **)(&symmetric_free) = dlsym(library, "nvshmem_free");
    *(void **)(&finalize) = dlsym(library, "nvshmemx_hostlib_finalize");
    if (!get_uniqueid || !set_uid_args || !init_attr || !my_pe || !n_pes || !symmetric_malloc ||
        !symmetric_ptr || !symmetric_free || !finalize) {
        snprintf(result.message, sizeof(result.message),
                 "the library lacks the host-only init API (nvshmemx_hostlib_init_attr)");
        goto done;
    }
    uniqueid_v1_t id;
    memset(&id, 0, sizeof(id));
    id.version = ABI_VERSION(sizeof(id));
    if (worker->rank == 0) {
        if ((status = get_uniqueid(&id)) != 0) {
            snprintf(result.message, sizeof(result.message), "nvshmemx_get_uniqueid: %d", status);
            goto done;
        }
        epx__doctor_write_all(worker->uid_out, &id, sizeof(id));
    } else if (epx__doctor_read_all(worker->uid_in, &id, sizeof(id), worker->deadline_ns) != 0) {
        snprintf(result.message, sizeof(result.message), "no unique id from rank 0");
        goto done;
    }
    init_attr_v1_t attr;
    memset(&attr, 0, sizeof(attr));
    attr.version = ABI_VERSION(sizeof(attr));
    attr.args.version = ABI_VERSION(sizeof(attr.args));
    attr.args.uid_args.version = ABI_VERSION(sizeof(attr.args.uid_args));
    set_uid_args(worker->rank, 2, &id, &attr);
    int64_t start = epx__tool_now_ns();
    if ((status = init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr)) != 0) {
        char tail[200];
        epx__doctor_child_output_tail(tail, sizeof(tail));
        snprintf(result.message, sizeof(result.message), "nvshmemx_hostlib_init_attr: %d%s%s",
                 status, tail[0] ? "; NVSHMEM printed: " : "", tail);
        goto done;
    }
    result.init_ms = (double)(epx__tool_now_ns() - start) / 1e6;
    result.my_pe = my_pe();
    result.n_pes = n_pes();
    void *memory = symmetric_malloc(4096); /* collective: both PEs must get here */
    if (memory != NULL) {
        result.peer_mapped = symmetric_ptr(memory, 1 - result.my_pe) != NULL;
        symmetric_free(memory);
    }
    finalize();
    result.ok = memory != NULL;
    if (memory == NULL)
        snprintf(result.message, sizeof(result.message), "nvshmem_malloc of 4 KiB failed");
done:
    epx__doctor_write_all(worker->to_parent, &result, sizeof(result));
    _exit(0);
}

typedef struct {
    const char *library;
    const epx__doctor_context_t *context;
} bootstrap_arg_t;

static void coordinate_bootstrap(epx__doctor_report_t *report, void *arg, void *facts)
{
    (void)facts;
    const bootstrap_arg_t *bootstrap = arg;
    const epx__doctor_context_t *context = bootstrap->context;
    /* The test's own settings: a small heap, no multicast (it can take a shared
     * machine's GPUs out of service), and no NIC transport when no port is up. */
    setenv("NVSHMEM_SYMMETRIC_SIZE", "64M", 1);
    setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
    if (context->rdma_ports_up == 0 && getenv("NVSHMEM_REMOTE_TRANSPORT") == NULL)
        setenv("NVSHMEM_REMOTE_TRANSPORT", "none", 1);
    int uid_pipe[2], results[2][2];
    if (pipe(uid_pipe) != 0 || pipe(results[0]) != 0 || pipe(results[1]) != 0) {
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_FAIL, NULL, "pipe: %s",
                        strerror(errno));
        return;
    }
    int gpus = context->gpu.gpu_count;
    int64_t deadline = epx__tool_now_ns() + (int64_t)((context->timeout_s - 3.0) * 1e9);
    pid_t pids[2];
    for (int rank = 0; rank < 2; rank++) {
        pe_worker_t worker = {bootstrap->library, rank, gpus >= 2 ? rank : 0, uid_pipe[1],
                              uid_pipe[0], results[rank][1], deadline};
        pids[rank] = fork();
        if (pids[rank] == 0)
            run_pe(&worker);
    }
    pe_result_t got[2];
    memset(got, 0, sizeof(got));
    for (int rank = 0; rank < 2; rank++) {
        if (pids[rank] < 0 ||
            epx__doctor_read_all(results[rank][0], &got[rank], sizeof(got[rank]), deadline) != 0)
            snprintf(got[rank].message, sizeof(got[rank].message),
                     "did not finish within the timeout (NVSHMEM init hangs: check "
                     "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME and that the ranks reach each other)");
    }
    for (int rank = 0; rank < 2; rank++) {
        if (pids[rank] > 0)
            epx__tool_wait_child(pids[rank], epx__tool_now_ns() + 2000000000LL);
    }
    for (int rank = 0; rank < 2; rank++) {
        if (!got[rank].ok) {
            epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_FAIL,
                            "run again with NVSHMEM_DEBUG=INFO to see where NVSHMEM stops; "
                            "epx's low-latency and internode modes need this to work",
                            "two PEs from a unique id (%s): PE %d failed: %s",
                            gpus >= 2 ? "GPU0 and GPU1" : "both on GPU0", rank, got[rank].message);
            return;
        }
    }
    epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_PASS, NULL,
                    "two PEs initialised from a unique id (%s) in %.0f ms; PEs %d and %d of %d; "
                    "peer memory %s (NVSHMEM_SYMMETRIC_SIZE=64M for the test)",
                    gpus >= 2 ? "GPU0 and GPU1" : "both on GPU0",
                    got[0].init_ms > got[1].init_ms ? got[0].init_ms : got[1].init_ms,
                    got[0].my_pe, got[1].my_pe, got[0].n_pes,
                    got[0].peer_mapped && got[1].peer_mapped ? "mapped directly (P2P)"
                                                             : "not mapped (traffic goes through a "
                                                               "proxy)");
}

/* ---------------------------------------------------------------- the check */

#define LIBRARY_USABLE 0
#define LIBRARY_UNSUPPORTED 1 /* loads, but not NVSHMEM 3.x: no bootstrap test */
#define LIBRARY_ABSENT 2      /* not found */
#define LIBRARY_BROKEN 3      /* found but does not load */
#define LIBRARY_UNCHECKED 4   /* its probe crashed or hung (already a fail line) */

/* nvshmem.library; records the library in `context` for the checks after it. */
static int check_library(epx__doctor_report_t *report, epx__doctor_context_t *context,
                         library_facts_t *facts, char *version, size_t version_size)
{
    memset(facts, 0, sizeof(*facts));
    if (epx__doctor_run_child(report, "nvshmem.library", context->timeout_s, probe_library, NULL,
                              facts, sizeof(*facts)) != EPX__DOCTOR_CHILD_DONE)
        return LIBRARY_UNCHECKED;
    const char *fix_missing =
        "for epx's low-latency and internode modes: pip install nvidia-nvshmem-cu13 (or set "
        "NVSHMEM_HOME to an NVSHMEM 3.x install)";
    if (facts->path[0] == '\0') {
        epx__doctor_add(report, "nvshmem.library", EPX__DOCTOR_NOT_PRESENT,
                        context->gpu.gpu_count > 0 ? fix_missing : NULL,
                        "%s not found ($NVSHMEM_HOME/lib, python3's site-packages/nvidia/nvshmem/"
                        "lib, %s, the loader path)", HOST_LIBRARY, DEVICE_IMAGE_VENV);
        return LIBRARY_ABSENT;
    }
    if (facts->major > 0)
        snprintf(version, version_size, "%d.%d.%d", facts->major, facts->minor, facts->patch);
    else if (!epx__doctor_version_from_filename(facts->path, version, version_size))
        snprintf(version, version_size, "unknown");
    if (facts->load_error[0] != '\0') {
        epx__doctor_add(report, "nvshmem.library", context->gpu.gpu_count > 0 ? EPX__DOCTOR_FAIL
                                                                               : EPX__DOCTOR_WARN,
                        "install what the loader says is missing (usually the NVIDIA driver's "
                        "libcuda.so.1), or point NVSHMEM_HOME at a working NVSHMEM",
                        "found %s (version %s) but it does not load: %s", facts->path, version,
                        facts->load_error);
        return LIBRARY_BROKEN;
    }
    snprintf(context->nvshmem_path, sizeof(context->nvshmem_path), "%s", facts->path);
    if (facts->major > 0) {
        context->nvshmem_version[0] = facts->major;
        context->nvshmem_version[1] = facts->minor;
        context->nvshmem_version[2] = facts->patch;
    }
    int supported = facts->major == 3;
    epx__doctor_add(report, "nvshmem.library", supported ? EPX__DOCTOR_PASS : EPX__DOCTOR_WARN,
                    supported ? NULL
                              : "use NVSHMEM 3.x (epx is built and tested against 3.4), from the "
                                "nvidia-nvshmem-cu13 wheel",
                    "NVSHMEM %s at %s", version, facts->path);
    return supported ? LIBRARY_USABLE : LIBRARY_UNSUPPORTED;
}

void epx__doctor_check_nvshmem(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    library_facts_t facts;
    char version[32] = "";
    int library = check_library(report, context, &facts, version, sizeof(version));
    /* The plugin brings in its own host library, so it is checked whatever was found. */
    check_ll_plugin(report, context);

    if (library == LIBRARY_ABSENT) {
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no NVSHMEM library");
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no NVSHMEM library");
        return;
    }
    if (library == LIBRARY_BROKEN || library == LIBRARY_UNCHECKED) {
        const char *why = library == LIBRARY_BROKEN ? "the library does not load" : "no library";
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_SKIP, NULL, "%s", why);
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_SKIP, NULL, "%s", why);
        return;
    }

    plugin_arg_t plugins;
    char path_copy[sizeof(facts.path)];
    snprintf(path_copy, sizeof(path_copy), "%s", facts.path);
    snprintf(plugins.directory, sizeof(plugins.directory), "%s", dirname(path_copy));
    plugins.rdma_ports_up = context->rdma_ports_up;
    epx__doctor_run_child(report, "nvshmem.transports", context->timeout_s, probe_plugins,
                          &plugins, NULL, 0);

    if (context->gpu.gpu_count <= 0) {
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no GPU, so NVSHMEM cannot initialise");
        return;
    }
    if (library == LIBRARY_UNSUPPORTED) {
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_SKIP, NULL,
                        "the init ABI of NVSHMEM %s is not known to this doctor", version);
        return;
    }
    bootstrap_arg_t bootstrap = {facts.path, context};
    epx__doctor_run_child(report, "nvshmem.bootstrap", context->timeout_s, coordinate_bootstrap,
                          &bootstrap, NULL, 0);
}
