/*
 * `epx doctor` GPU checks: driver and runtime versions, the GPUs and their compute
 * capability, and how each pair of GPUs reaches the other (NVLink, PCIe, or not at
 * all). Runs in a child process (doctor_child.h) because it creates CUDA contexts.
 * NVML, when the driver ships it, names the links; without it the driver's peer-access
 * answer is all we have.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(EPX_WITH_CUDA) && defined(__has_include)
#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h> /* CUDART_VERSION: the runtime epx was built against */
#endif
#endif

#include "doctor_checks.h"
#include "doctor_child.h"
#include "doctor_cuda.h"
#include "doctor_parse.h"
#include "doctor_sysfs.h"

#define CUDA_ERROR_STUB_LIBRARY 34
#define NVML_NVLINK_MAX_LINKS 18
#define NVML_P2P_CAPS_INDEX_READ 0
#define NVML_P2P_CAPS_INDEX_NVLINK 2

/* The NVML calls used here (nvml.h ABI: handles are pointers, results ints). */
typedef struct {
    unsigned long long total, free, used;
} nvml_memory_t;

typedef struct {
    int (*init)(void);
    int (*shutdown)(void);
    int (*handle_by_bus_id)(const char *bus_id, void **device);
    int (*p2p_status)(void *device1, void *device2, int capability, int *status);
    int (*nvlink_state)(void *device, unsigned int link, int *enabled);
    int (*memory_info)(void *device, nvml_memory_t *memory);
    void *devices[EPX__DOCTOR_MAX_GPUS];
    int loaded;
} nvml_t;

static void nvml_load(nvml_t *nvml, const epx__doctor_gpu_facts_t *facts)
{
    memset(nvml, 0, sizeof(*nvml));
    void *library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == NULL)
        return;
    *(void **)(&nvml->init) = dlsym(library, "nvmlInit_v2");
    *(void **)(&nvml->shutdown) = dlsym(library, "nvmlShutdown");
    *(void **)(&nvml->handle_by_bus_id) = dlsym(library, "nvmlDeviceGetHandleByPciBusId_v2");
    *(void **)(&nvml->p2p_status) = dlsym(library, "nvmlDeviceGetP2PStatus");
    *(void **)(&nvml->nvlink_state) = dlsym(library, "nvmlDeviceGetNvLinkState");
    *(void **)(&nvml->memory_info) = dlsym(library, "nvmlDeviceGetMemoryInfo");
    if (nvml->init == NULL || nvml->handle_by_bus_id == NULL || nvml->init() != 0)
        return;
    /* CUDA and NVML number GPUs differently (CUDA_VISIBLE_DEVICES, FASTEST_FIRST): the
     * PCI bus id is the name both agree on. */
    for (int i = 0; i < facts->gpu_count; i++) {
        if (nvml->handle_by_bus_id(facts->gpus[i].bus_id, &nvml->devices[i]) != 0)
            return;
    }
    nvml->loaded = 1;
}

/* Lines for the GPU checks that cannot run, all with the same status and reason. */
static void add_rest(epx__doctor_report_t *report, epx__doctor_status_t status, const char *reason)
{
    static const char *const names[] = {"gpu.runtime", "gpu.devices", "gpu.links",
                                        "gpu.peer_access"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        epx__doctor_add(report, names[i], status, NULL, "%s", reason);
}

static void check_runtime(epx__doctor_report_t *report, const epx__doctor_gpu_facts_t *facts)
{
#ifdef CUDART_VERSION
    int built = CUDART_VERSION;
    char library_name[64];
    snprintf(library_name, sizeof(library_name), "libcudart.so.%d", built / 1000);
    void *library = dlopen(library_name, RTLD_NOW | RTLD_LOCAL);
    int runtime = 0;
    int (*get_version)(int *) = NULL;
    if (library != NULL)
        *(void **)(&get_version) = dlsym(library, "cudaRuntimeGetVersion");
    if (get_version == NULL || get_version(&runtime) != 0) {
        epx__doctor_add(report, "gpu.runtime", EPX__DOCTOR_FAIL,
                        "install the CUDA runtime epx was built with (the CUDA toolkit or the "
                        "nvidia-cuda-runtime wheel) and add its lib directory to LD_LIBRARY_PATH",
                        "epx was built against CUDA runtime %d.%d, but %s does not load here",
                        built / 1000, built % 1000 / 10, library_name);
        return;
    }
    if (runtime > facts->driver_version) {
        char fix[256];
        snprintf(fix, sizeof(fix),
                 "update the NVIDIA driver to one that supports CUDA %d.%d, or rebuild epx with "
                 "an older CUDA toolkit",
                 runtime / 1000, runtime % 1000 / 10);
        epx__doctor_add(report, "gpu.runtime", EPX__DOCTOR_FAIL, fix,
                        "CUDA runtime %d.%d is newer than the driver supports (CUDA %d.%d)",
                        runtime / 1000, runtime % 1000 / 10, facts->driver_version / 1000,
                        facts->driver_version % 1000 / 10);
        return;
    }
    epx__doctor_add(report, "gpu.runtime", EPX__DOCTOR_PASS, NULL,
                    "CUDA runtime %d.%d (epx built against %d.%d); the driver supports up to %d.%d",
                    runtime / 1000, runtime % 1000 / 10, built / 1000, built % 1000 / 10,
                    facts->driver_version / 1000, facts->driver_version % 1000 / 10);
#else
    epx__doctor_add(report, "gpu.runtime", EPX__DOCTOR_FAIL,
                    "rebuild epx with the CUDA backend: cmake -DEPX_WITH_CUDA=ON (needs nvcc)",
                    "this epx was built without the CUDA backend, so it cannot use the %d GPU%s "
                    "here (only the CPU backend runs)",
                    facts->gpu_count, facts->gpu_count == 1 ? "" : "s");
#endif
}

/* Fill facts->gpus and add gpu.devices. */
static void check_devices(epx__doctor_report_t *report, const epx__doctor_cuda_t *cuda,
                          epx__doctor_gpu_facts_t *facts, nvml_t *nvml)
{
    char detail[EPX__DOCTOR_DETAIL_MAX];
    size_t used = 0;
    int too_old = 0, count = facts->gpu_count;
    used += (size_t)snprintf(detail, sizeof(detail), "%d GPU%s visible", count,
                             count == 1 ? "" : "s");
    if (count > EPX__DOCTOR_MAX_GPUS)
        count = facts->gpu_count = EPX__DOCTOR_MAX_GPUS;
    for (int i = 0; i < count; i++) {
        epx__doctor_gpu_t *gpu = &facts->gpus[i];
        int device = 0;
        size_t total = 0;
        cuda->cuDeviceGet(&device, i);
        cuda->cuDeviceGetName(gpu->name, (int)sizeof(gpu->name), device);
        cuda->cuDeviceTotalMem(&total, device);
        gpu->total_bytes = total;
        cuda->cuDeviceGetAttribute(&gpu->cc_major, EPX__CU_ATTR_COMPUTE_CAPABILITY_MAJOR, device);
        cuda->cuDeviceGetAttribute(&gpu->cc_minor, EPX__CU_ATTR_COMPUTE_CAPABILITY_MINOR, device);
        cuda->cuDeviceGetAttribute(&gpu->sms, EPX__CU_ATTR_MULTIPROCESSOR_COUNT, device);
        cuda->cuDeviceGetAttribute(&gpu->gpudirect_rdma, EPX__CU_ATTR_GPU_DIRECT_RDMA_SUPPORTED,
                                   device);
        cuda->cuDeviceGetAttribute(&gpu->dma_buf, EPX__CU_ATTR_DMA_BUF_SUPPORTED, device);
        cuda->cuDeviceGetPCIBusId(gpu->bus_id, (int)sizeof(gpu->bus_id), device);
        epx__doctor_normalize_bus_id(gpu->bus_id);
        too_old += gpu->cc_major < 9;
    }
    nvml_load(nvml, facts);
    for (int i = 0; i < count; i++) {
        epx__doctor_gpu_t *gpu = &facts->gpus[i];
        nvml_memory_t memory;
        if (nvml->loaded && nvml->memory_info != NULL &&
            nvml->memory_info(nvml->devices[i], &memory) == 0) {
            gpu->free_bytes = memory.free;
        } else if (epx__doctor_cuda_use_device(cuda, i) == 0) {
            /* Without NVML a context tells us: it costs a few hundred MB per GPU. */
            size_t free_bytes = 0, total_bytes = 0;
            if (cuda->cuMemGetInfo(&free_bytes, &total_bytes) == 0)
                gpu->free_bytes = free_bytes;
        }
        char total_text[32], free_text[32];
        epx__doctor_format_bytes(gpu->total_bytes, total_text, sizeof(total_text));
        epx__doctor_format_bytes(gpu->free_bytes, free_text, sizeof(free_text));
        if (used < sizeof(detail))
            used += (size_t)snprintf(detail + used, sizeof(detail) - used,
                                     "\nGPU%d %s, sm_%d%d, %d SMs, %s (%s free), PCI %s", i,
                                     gpu->name, gpu->cc_major, gpu->cc_minor, gpu->sms,
                                     total_text, gpu->free_bytes > 0 ? free_text : "?",
                                     gpu->bus_id);
    }
    if (too_old > 0)
        epx__doctor_add(report, "gpu.devices", EPX__DOCTOR_FAIL,
                        "run on Hopper (sm_90) or newer GPUs: epx's kernels are built for sm_90",
                        "%s\n%d GPU%s older than sm_90", detail, too_old, too_old == 1 ? " is" : "s are");
    else
        epx__doctor_add(report, "gpu.devices", EPX__DOCTOR_PASS, NULL, "%s", detail);
}

static void check_pairs(epx__doctor_report_t *report, const epx__doctor_cuda_t *cuda,
                        const epx__doctor_gpu_facts_t *facts, const nvml_t *nvml)
{
    int n = facts->gpu_count;
    if (n < 2) {
        epx__doctor_add(report, "gpu.links", EPX__DOCTOR_PASS, NULL,
                        "one GPU: ranks on this machine share it, so no GPU-to-GPU link is used");
        epx__doctor_add(report, "gpu.peer_access", EPX__DOCTOR_PASS, NULL,
                        "one GPU: ranks map each other's memory on the same GPU through CUDA IPC");
        return;
    }
    epx__doctor_pair_t pairs[EPX__DOCTOR_MAX_GPUS * EPX__DOCTOR_MAX_GPUS];
    int nvlink = 0, pcie = 0, none = 0, peer_denied = 0, total_pairs = n * (n - 1);
    char denied[256] = "";
    size_t denied_used = 0;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < n; j++) {
            epx__doctor_pair_t pair = EPX__DOCTOR_PAIR_SELF;
            if (i != j) {
                int can = 0;
                cuda->cuDeviceCanAccessPeer(&can, i, j);
                if (!can) {
                    peer_denied++;
                    if (denied_used < sizeof(denied))
                        denied_used += (size_t)snprintf(denied + denied_used,
                                                        sizeof(denied) - denied_used, " %d->%d",
                                                        i, j);
                }
                int nvlink_status = 1, read_status = 1;
                if (nvml->loaded && nvml->p2p_status != NULL) {
                    nvml->p2p_status(nvml->devices[i], nvml->devices[j],
                                     NVML_P2P_CAPS_INDEX_NVLINK, &nvlink_status);
                    nvml->p2p_status(nvml->devices[i], nvml->devices[j],
                                     NVML_P2P_CAPS_INDEX_READ, &read_status);
                    pair = epx__doctor_pair_from_nvml(nvlink_status, read_status);
                } else {
                    pair = can ? EPX__DOCTOR_PAIR_P2P : EPX__DOCTOR_PAIR_NONE;
                }
                nvlink += pair == EPX__DOCTOR_PAIR_NVLINK;
                pcie += pair == EPX__DOCTOR_PAIR_PCIE;
                none += pair == EPX__DOCTOR_PAIR_NONE;
            }
            pairs[i * n + j] = pair;
        }
    }
    char matrix[1024];
    epx__doctor_format_pair_matrix(n, pairs, matrix, sizeof(matrix));
    char links[256] = "";
    if (nvml->loaded && nvml->nvlink_state != NULL) {
        size_t links_used = (size_t)snprintf(links, sizeof(links), "\nNVLinks up per GPU:");
        for (int i = 0; i < n && links_used < sizeof(links); i++) {
            int up = 0;
            for (unsigned int link = 0; link < NVML_NVLINK_MAX_LINKS; link++) {
                int enabled = 0;
                if (nvml->nvlink_state(nvml->devices[i], link, &enabled) == 0)
                    up += enabled != 0;
            }
            links_used += (size_t)snprintf(links + links_used, sizeof(links) - links_used,
                                           " GPU%d %d", i, up);
        }
    }
    const char *source = nvml->loaded ? "NVML" : "the driver's peer-access answer (no NVML)";
    if (none > 0)
        epx__doctor_add(report, "gpu.links", EPX__DOCTOR_FAIL,
                        "put the ranks of one node on GPUs that have P2P (check IOMMU/ACS settings "
                        "and `nvidia-smi topo -p2p r`), or split them into nodes with "
                        "EPX_RANKS_PER_NODE",
                        "%d of %d GPU pairs have no P2P path (from %s):\n%s%s", none, total_pairs,
                        source, matrix, links);
    else if (pcie > 0)
        epx__doctor_add(report, "gpu.links", EPX__DOCTOR_WARN,
                        "expect PCIe speed for ranks on the PCI pairs; NVLink-connected GPUs "
                        "(`nvidia-smi topo -m` shows NV#) give full speed",
                        "%d of %d GPU pairs reach each other over PCIe only (from %s):\n%s%s",
                        pcie, total_pairs, source, matrix, links);
    else
        epx__doctor_add(report, "gpu.links", EPX__DOCTOR_PASS, NULL,
                        "%d GPU pairs, %s (from %s):\n%s%s", total_pairs,
                        nvlink == total_pairs ? "all over NVLink" : "all with P2P", source,
                        matrix, links);
    if (peer_denied > 0)
        epx__doctor_add(report, "gpu.peer_access", EPX__DOCTOR_FAIL,
                        "enable P2P between these GPUs (IOMMU off or passthrough, ACS disabled on "
                        "the PCIe switches), or keep the ranks of one node on GPUs that have it",
                        "the driver refuses peer access for %d of %d pairs:%s", peer_denied,
                        total_pairs, denied);
    else
        epx__doctor_add(report, "gpu.peer_access", EPX__DOCTOR_PASS, NULL,
                        "the driver allows peer access for all %d GPU pairs", total_pairs);
}

static void probe_gpus(epx__doctor_report_t *report, void *arg, void *facts_out)
{
    (void)arg;
    epx__doctor_gpu_facts_t *facts = facts_out;
    epx__doctor_cuda_t cuda;
    char why[512];
    char version_text[512] = "", version[64] = "";
    if (epx__doctor_read_file("/proc/driver/nvidia/version", version_text,
                              sizeof(version_text)) > 0)
        epx__doctor_parse_driver_version(version_text, version, sizeof(version),
                                         &facts->open_module);
    if (epx__doctor_cuda_load(&cuda, why, sizeof(why)) != 0) {
        epx__doctor_add(report, "gpu.driver", EPX__DOCTOR_NOT_PRESENT,
                        "install the NVIDIA driver if this machine has NVIDIA GPUs; without one "
                        "epx runs on its CPU backend",
                        "no NVIDIA driver: %s", why);
        add_rest(report, EPX__DOCTOR_NOT_PRESENT, "no NVIDIA driver, so no GPU to check");
        return;
    }
    int result = cuda.cuInit(0);
    if (result == EPX__CU_ERROR_NO_DEVICE || result == CUDA_ERROR_STUB_LIBRARY) {
        const char *visible = getenv("CUDA_VISIBLE_DEVICES");
        char fix[256] = "";
        if (visible != NULL)
            snprintf(fix, sizeof(fix), "CUDA_VISIBLE_DEVICES=\"%s\" hides GPUs: unset it or "
                     "list the GPUs to use", visible);
        epx__doctor_add(report, "gpu.driver", EPX__DOCTOR_NOT_PRESENT, fix[0] ? fix : NULL,
                        "the driver library loads but finds no GPU: %s",
                        epx__doctor_cuda_error(&cuda, result));
        add_rest(report, EPX__DOCTOR_NOT_PRESENT, "no GPU visible");
        return;
    }
    if (result != EPX__CU_SUCCESS) {
        epx__doctor_add(report, "gpu.driver", EPX__DOCTOR_FAIL,
                        "check `nvidia-smi` and `dmesg`: the kernel module and the user-space "
                        "driver must be the same version (reboot after a driver update)",
                        "cuInit failed: %s", epx__doctor_cuda_error(&cuda, result));
        add_rest(report, EPX__DOCTOR_SKIP, "the driver did not initialise");
        return;
    }
    facts->driver_loaded = 1;
    cuda.cuDriverGetVersion(&facts->driver_version);
    cuda.cuDeviceGetCount(&facts->gpu_count);
    epx__doctor_add(report, "gpu.driver", EPX__DOCTOR_PASS, NULL,
                    "NVIDIA driver %s%s, supports CUDA %d.%d", version[0] ? version : "(version ?)",
                    facts->open_module ? " (open kernel module)" : "",
                    facts->driver_version / 1000, facts->driver_version % 1000 / 10);
    if (facts->gpu_count <= 0) {
        add_rest(report, EPX__DOCTOR_NOT_PRESENT, "no GPU visible");
        return;
    }
    check_runtime(report, facts);
    nvml_t nvml;
    check_devices(report, &cuda, facts, &nvml);
    check_pairs(report, &cuda, facts, &nvml);
    if (nvml.loaded && nvml.shutdown != NULL)
        nvml.shutdown();
}

void epx__doctor_check_gpu(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    if (epx__doctor_run_child(report, "gpu.driver", context->timeout_s, probe_gpus, NULL,
                              &context->gpu, sizeof(context->gpu)) != EPX__DOCTOR_CHILD_DONE) {
        /* The failure is on the gpu.driver line; keep the checklist complete. */
        memset(&context->gpu, 0, sizeof(context->gpu));
        add_rest(report, EPX__DOCTOR_SKIP, "the GPU probe did not finish (see gpu.driver)");
    }
}
