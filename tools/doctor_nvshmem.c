/*
 * `epx doctor` NVSHMEM checks: where libnvshmem_host.so.3 is and which version, which
 * of its bootstrap and transport plugins load (their libraries must resolve: IBGDA
 * needs rdma-core's libmlx5), and whether two processes really initialise NVSHMEM from
 * a unique id, as epx's low-latency and internode modes do.
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
#include <libgen.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"
#include "doctor_checks.h"
#include "doctor_child.h"
#include "doctor_cuda.h"
#include "doctor_parse.h"

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
    int64_t start = epx__now_ns();
    if ((status = init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr)) != 0) {
        char tail[200];
        epx__doctor_child_output_tail(tail, sizeof(tail));
        snprintf(result.message, sizeof(result.message), "nvshmemx_hostlib_init_attr: %d%s%s",
                 status, tail[0] ? "; NVSHMEM printed: " : "", tail);
        goto done;
    }
    result.init_ms = (double)(epx__now_ns() - start) / 1e6;
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
    int64_t deadline = epx__now_ns() + (int64_t)((context->timeout_s - 3.0) * 1e9);
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
            epx__doctor_wait_child(pids[rank], epx__now_ns() + 2000000000LL);
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

void epx__doctor_check_nvshmem(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    library_facts_t facts;
    memset(&facts, 0, sizeof(facts));
    if (epx__doctor_run_child(report, "nvshmem.library", context->timeout_s, probe_library, NULL,
                              &facts, sizeof(facts)) != EPX__DOCTOR_CHILD_DONE) {
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_SKIP, NULL, "no library");
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_SKIP, NULL, "no library");
        return;
    }
    const char *fix_missing =
        "for epx's low-latency and internode modes: pip install nvidia-nvshmem-cu13 (or set "
        "NVSHMEM_HOME to an NVSHMEM 3.x install)";
    if (facts.path[0] == '\0') {
        epx__doctor_add(report, "nvshmem.library", EPX__DOCTOR_NOT_PRESENT,
                        context->gpu.gpu_count > 0 ? fix_missing : NULL,
                        "%s not found ($NVSHMEM_HOME/lib, python3's site-packages/nvidia/nvshmem/"
                        "lib, %s, the loader path)", HOST_LIBRARY, DEVICE_IMAGE_VENV);
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no NVSHMEM library");
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no NVSHMEM library");
        return;
    }
    char version[32] = "";
    if (facts.major > 0)
        snprintf(version, sizeof(version), "%d.%d.%d", facts.major, facts.minor, facts.patch);
    else if (!epx__doctor_version_from_filename(facts.path, version, sizeof(version)))
        snprintf(version, sizeof(version), "unknown");
    if (facts.load_error[0] != '\0') {
        epx__doctor_add(report, "nvshmem.library", context->gpu.gpu_count > 0 ? EPX__DOCTOR_FAIL
                                                                               : EPX__DOCTOR_WARN,
                        "install what the loader says is missing (usually the NVIDIA driver's "
                        "libcuda.so.1), or point NVSHMEM_HOME at a working NVSHMEM",
                        "found %s (version %s) but it does not load: %s", facts.path, version,
                        facts.load_error);
        epx__doctor_add(report, "nvshmem.transports", EPX__DOCTOR_SKIP, NULL,
                        "the library does not load");
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_SKIP, NULL,
                        "the library does not load");
        return;
    }
    int supported = facts.major == 3;
    epx__doctor_add(report, "nvshmem.library", supported ? EPX__DOCTOR_PASS : EPX__DOCTOR_WARN,
                    supported ? NULL
                              : "use NVSHMEM 3.x (epx is built and tested against 3.4), from the "
                                "nvidia-nvshmem-cu13 wheel",
                    "NVSHMEM %s at %s", version, facts.path);

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
    if (!supported) {
        epx__doctor_add(report, "nvshmem.bootstrap", EPX__DOCTOR_SKIP, NULL,
                        "the init ABI of NVSHMEM %s is not known to this doctor", version);
        return;
    }
    bootstrap_arg_t bootstrap = {facts.path, context};
    epx__doctor_run_child(report, "nvshmem.bootstrap", context->timeout_s, coordinate_bootstrap,
                          &bootstrap, NULL, 0);
}
