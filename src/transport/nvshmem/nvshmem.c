/*
 * The NVSHMEM transport (nvshmem.h): loading the plugin, NVSHMEM's set-up (once per
 * process, bootstrapped by a unique id shared through the ranks' bootstrap), symmetric
 * memory, peer pointers, and finalisation when the owner goes.
 */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "transport/nvshmem/nvshmem.h"
#include "transport/nvshmem/nvshmem_host.h"

#define EPX_NVSHMEM_UID_BYTES 256

static pthread_mutex_t nv_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    void *library;
    const epx_nvshmem_host_t *host;
    char path[PATH_MAX];
    int initialized, finalized, rank, world;
    const void *owner; /* what set NVSHMEM up (a group) */
    int live_users;    /* users not ended */
    int saw_failure;   /* a user ended with a failed or masked peer */
} nv;

#ifdef EPX_PLUGIN_BUILD_DIR
/* Nonzero when `directory` is the build directory or inside it: code running from the
 * build tree (libepx.so, the tests that link libepx statically) may use the build's
 * plugin, while an installed copy (whose build directory may hold a newer build, or be
 * gone) must not look there. */
static int inside_build_dir(const char *directory)
{
    char real_dir[PATH_MAX], real_build[PATH_MAX];
    if (realpath(directory, real_dir) == NULL || realpath(EPX_PLUGIN_BUILD_DIR, real_build) == NULL)
        return 0;
    size_t length = strlen(real_build);
    return strncmp(real_dir, real_build, length) == 0 &&
           (real_dir[length] == '\0' || real_dir[length] == '/');
}
#endif

/*
 * Candidates: EPX_NVSHMEM_PLUGIN; beside the code of libepx (libepx.so, or a program that
 * links it statically); the build directory, for code running from inside it; the
 * loader's search by name (LD_LIBRARY_PATH, the caller's run path).
 */
static epx_status_t load_plugin(void)
{
    if (nv.host != NULL)
        return EPX_SUCCESS;
    char candidates[3][PATH_MAX];
    int n = 0;
    const char *forced = epx__param_string(EPX_PARAM_NVSHMEM_PLUGIN);
    if (forced != NULL && forced[0] != '\0') {
        snprintf(candidates[n++], PATH_MAX, "%s", forced);
    } else {
        Dl_info info;
        char code[PATH_MAX] = "";
        if (dladdr((void *)load_plugin, &info) != 0 && info.dli_fname != NULL)
            snprintf(code, sizeof(code), "%s", info.dli_fname);
        /* For a program (static libepx) the loader reports argv[0], which has no slash
         * when the program was found through PATH: ask the kernel where it is. */
        if (strchr(code, '/') == NULL) {
            ssize_t length = readlink("/proc/self/exe", code, sizeof(code) - 1);
            code[length > 0 ? length : 0] = '\0';
        }
        char *slash = strrchr(code, '/');
        if (slash != NULL) {
            *slash = '\0'; /* code is now its directory */
            snprintf(candidates[n++], PATH_MAX, "%s/%s", slash == code ? "" : code,
                     EPX_NVSHMEM_PLUGIN_FILE);
        }
        const char *code_dir = slash != NULL ? code : "";
#ifdef EPX_PLUGIN_BUILD_DIR
        if (inside_build_dir(code_dir))
            snprintf(candidates[n++], PATH_MAX, "%s/%s", EPX_PLUGIN_BUILD_DIR,
                     EPX_NVSHMEM_PLUGIN_FILE);
#else
        (void)code_dir;
#endif
        snprintf(candidates[n++], PATH_MAX, "%s", EPX_NVSHMEM_PLUGIN_FILE);
    }
    /* The reason worth reporting: a file that is there but does not load (a missing
     * dependency, a wrong ABI) outranks the candidates that do not exist. */
    char reason[512] = "", looked[1024] = "";
    int present = 0;
    for (int i = 0; i < n; i++) {
        size_t used = strlen(looked);
        snprintf(looked + used, sizeof(looked) - used, "%s%.300s", i > 0 ? ", " : "",
                 candidates[i]);
        void *library = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
        if (library == NULL) {
            const char *why = dlerror();
            int exists = strchr(candidates[i], '/') != NULL && access(candidates[i], F_OK) == 0;
            if (!present || exists)
                snprintf(reason, sizeof(reason), "%s", why != NULL ? why : "dlopen failed");
            present = present || exists;
            continue;
        }
        epx_nvshmem_host_entry_t entry;
        *(void **)(&entry) = dlsym(library, EPX_NVSHMEM_HOST_SYMBOL);
        const epx_nvshmem_host_t *host = entry != NULL ? entry() : NULL;
        if (host == NULL || host->abi != EPX_NVSHMEM_HOST_ABI) {
            snprintf(reason, sizeof(reason), "%.300s is not an epx NVSHMEM plugin of ABI %d",
                     candidates[i], EPX_NVSHMEM_HOST_ABI);
            present = 1;
            dlclose(library);
            continue;
        }
        nv.library = library;
        nv.host = host;
        /* Found by name: report the file the loader chose. */
        Dl_info found;
        const char *path = candidates[i];
        if (dladdr(*(void **)(&entry), &found) != 0 && found.dli_fname != NULL)
            path = found.dli_fname;
        snprintf(nv.path, sizeof(nv.path), "%.*s", (int)sizeof(nv.path) - 1, path);
        return EPX_SUCCESS;
    }
    if (present)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "buffer: low-latency mode on the CUDA backend: %s is there but does "
                         "not load (looked in: %s): %s (a missing libnvshmem_host.so.3 is "
                         "NVSHMEM's runtime: pip install nvidia-nvshmem-cu13, the version the "
                         "plugin was built with, or put its lib/ on LD_LIBRARY_PATH)",
                         EPX_NVSHMEM_PLUGIN_FILE, looked, reason);
    return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                     "buffer: low-latency mode on the CUDA backend needs %s (built when NVSHMEM "
                     "is found: pip install nvidia-nvshmem-cu13 or set NVSHMEM_HOME, then "
                     "rebuild; or point EPX_NVSHMEM_PLUGIN at it); looked in: %s (%s)",
                     EPX_NVSHMEM_PLUGIN_FILE, looked, reason);
}

epx_status_t epx__nvshmem_probe(const char **path, int version[3])
{
    pthread_mutex_lock(&nv_lock);
    epx_status_t status = load_plugin();
    if (status == EPX_SUCCESS) {
        *path = nv.path;
        nv.host->version(&version[0], &version[1], &version[2]);
    }
    pthread_mutex_unlock(&nv_lock);
    return status;
}

void *epx__nvshmem_symbol(const char *name)
{
    pthread_mutex_lock(&nv_lock);
    void *symbol = nv.library != NULL ? dlsym(nv.library, name) : NULL;
    pthread_mutex_unlock(&nv_lock);
    return symbol;
}

/* Defaults for NVSHMEM that the user did not set (README lists them). */
static void nvshmem_defaults(size_t sym_bytes)
{
    if (getenv("NVSHMEM_SYMMETRIC_SIZE") == NULL) {
        /* The heap also holds NVSHMEM's own state; later buffers reuse freed space. */
        size_t slack = sym_bytes / 4 > ((size_t)512 << 20) ? sym_bytes / 4 : ((size_t)512 << 20);
        char value[32];
        snprintf(value, sizeof(value), "%zu", sym_bytes + slack);
        setenv("NVSHMEM_SYMMETRIC_SIZE", value, 0);
    } else {
        EPX_INFO(EPX_SUBSYS_TRANSPORT,
                 "NVSHMEM_SYMMETRIC_SIZE=%s is set, so epx does not size the heap (it needs %zu "
                 "bytes)",
                 getenv("NVSHMEM_SYMMETRIC_SIZE"), sym_bytes);
    }
    /* epx uses no NVSHMEM collectives; NVLink SHARP would only cost memory. */
    setenv("NVSHMEM_DISABLE_NVLS", "1", 0);
}

typedef struct {
    int32_t status;
    int32_t need_init;
    uint8_t uid[EPX_NVSHMEM_UID_BYTES];
} setup_vote_t;

epx_status_t epx__nvshmem_setup(const epx__transport_ranks_t *ranks, const void *owner,
                                size_t sym_bytes, epx_status_t status)
{
    int rank = ranks->rank, world = ranks->world_size;
    setup_vote_t mine, *all = calloc((size_t)world, sizeof(setup_vote_t));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    memset(&mine, 0, sizeof(mine));
    pthread_mutex_lock(&nv_lock);
    if (status == EPX_SUCCESS)
        status = load_plugin();
    if (status == EPX_SUCCESS && nv.finalized)
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED,
                           "buffer_create: NVSHMEM was finalised when the group that set it up "
                           "was destroyed, and it cannot be set up twice in a process: keep "
                           "that group while low-latency CUDA buffers are needed");
    if (status == EPX_SUCCESS && nv.initialized && (nv.rank != rank || nv.world != world))
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED,
                           "buffer_create: NVSHMEM was set up in this process as rank %d of %d; "
                           "low-latency buffers of one process must come from groups with the "
                           "same rank and size (here rank %d of %d)",
                           nv.rank, nv.world, rank, world);
    if (status == EPX_SUCCESS && nv.host->uid_size() > EPX_NVSHMEM_UID_BYTES)
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED, "buffer_create: NVSHMEM's unique id is too large");
    mine.need_init = !nv.initialized;
    if (status == EPX_SUCCESS && mine.need_init) {
        nvshmem_defaults(sym_bytes);
        if (rank == 0 && nv.host->get_uid(mine.uid) != 0)
            status = EPX_ERROR(EPX_ERR_NVSHMEM, "buffer_create: nvshmemx_get_uniqueid failed");
    }
    status = epx__bootstrap_vote(ranks->bootstrap, world, status, &mine, all, sizeof(mine),
                                 "buffer_create", "failed to load NVSHMEM");
    if (status == EPX_SUCCESS && all[0].need_init != mine.need_init)
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED,
                           "buffer_create: NVSHMEM is set up on some ranks of the group and not "
                           "on others");
    if (status == EPX_SUCCESS && mine.need_init) {
        char message[256] = "";
        int64_t start = epx__now_ns();
        if (nv.host->init(all[0].uid, rank, world, message, sizeof(message)) != 0) {
            status = EPX_ERROR(EPX_ERR_NVSHMEM, "buffer_create: %s", message);
        } else {
            nv.initialized = 1;
            nv.owner = owner;
            nv.rank = rank;
            nv.world = world;
            int major, minor, patch;
            nv.host->version(&major, &minor, &patch);
            EPX_INFO(EPX_SUBSYS_TRANSPORT, "NVSHMEM %d.%d.%d up as PE %d of %d in %.0f ms (%s)",
                     major, minor, patch, rank, world, (double)(epx__now_ns() - start) / 1e6,
                     nv.path);
        }
    }
    pthread_mutex_unlock(&nv_lock);
    free(all);
    return status;
}

void *epx__nvshmem_malloc(size_t bytes)
{
    return nv.host != NULL ? nv.host->malloc_sym(bytes) : NULL;
}

void epx__nvshmem_free(void *p)
{
    if (p != NULL && nv.host != NULL)
        nv.host->free_sym(p);
}

void *epx__nvshmem_peer(void *p, int pe)
{
    return nv.host != NULL ? nv.host->peer_ptr(p, pe) : NULL;
}

void epx__nvshmem_user_begin(void)
{
    pthread_mutex_lock(&nv_lock);
    nv.live_users++;
    pthread_mutex_unlock(&nv_lock);
}

void epx__nvshmem_user_end(int healthy)
{
    pthread_mutex_lock(&nv_lock);
    nv.live_users--;
    nv.saw_failure = nv.saw_failure || !healthy;
    pthread_mutex_unlock(&nv_lock);
}

void epx__nvshmem_owner_destroyed(const void *owner, const epx__transport_ranks_t *ranks)
{
    pthread_mutex_lock(&nv_lock);
    if (!nv.initialized || nv.finalized || nv.owner != owner) {
        pthread_mutex_unlock(&nv_lock);
        return;
    }
    /* Everyone must be ready, or nobody calls the collective finalize. */
    int32_t mine = nv.live_users == 0 && !nv.saw_failure;
    int world = ranks->world_size, ready = mine;
    int32_t *all = calloc((size_t)world, sizeof(int32_t));
    if (all == NULL ||
        epx__bootstrap_allgather(ranks->bootstrap, &mine, all, sizeof(mine)) != EPX_SUCCESS)
        ready = 0;
    for (int r = 0; ready && r < world; r++)
        ready = all[r] != 0;
    free(all);
    if (ready) {
        nv.host->finalize();
        nv.finalized = 1;
        EPX_INFO(EPX_SUBSYS_TRANSPORT, "NVSHMEM finalised (its group was destroyed)");
    } else {
        EPX_WARN(EPX_SUBSYS_TRANSPORT,
                 "NVSHMEM stays set up until the process exits: %s",
                 mine ? "another rank still has low-latency buffers or saw a failed peer"
                      : (nv.live_users > 0 ? "low-latency buffers of this process are not destroyed"
                                           : "a peer failed while a buffer was in use"));
    }
    nv.owner = NULL;
    pthread_mutex_unlock(&nv_lock);
}
