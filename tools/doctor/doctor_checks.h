/*
 * The checks of `epx doctor`, one file each, and what they learn about the machine
 * for the checks that come after them (the GPU list decides how the IPC test, the NIC
 * affinity and the buffer-fit check run).
 *
 * Check names are "group.check" and stable: scripts and the tests key on them.
 *   gpu.driver gpu.runtime gpu.devices gpu.links gpu.peer_access gpu.ipc gpu.mps
 *   nvshmem.library nvshmem.plugin nvshmem.transports nvshmem.bootstrap
 *   rdma.devices rdma.nic_affinity rdma.gpudirect rdma.gdrcopy rdma.ibgda_driver_options
 *   env.epx env.nvshmem env.internode env.buffer_fit
 *   smoke.run smoke.dispatch smoke.combine
 */
#ifndef EPX_TOOLS_DOCTOR_CHECKS_H
#define EPX_TOOLS_DOCTOR_CHECKS_H

#include <stdint.h>

#include "doctor_report.h"

#define EPX__DOCTOR_MAX_GPUS 16

typedef struct {
    char name[96];
    char bus_id[32]; /* "0000:00:06.0", lower case, as sysfs names it */
    int cc_major;
    int cc_minor;
    int sms;
    uint64_t total_bytes;
    uint64_t free_bytes; /* 0 = unknown */
    int gpudirect_rdma;  /* CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED */
    int dma_buf;         /* CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED */
} epx__doctor_gpu_t;

/* Filled by the GPU check (in a child) and copied back. */
typedef struct {
    int driver_loaded;  /* libcuda.so.1 loaded and cuInit succeeded */
    int driver_version; /* cuDriverGetVersion: 13000 = CUDA 13.0 */
    int gpu_count;      /* visible GPUs, 0 when none */
    int open_module;    /* the open kernel module (dma-buf capable) */
    epx__doctor_gpu_t gpus[EPX__DOCTOR_MAX_GPUS];
} epx__doctor_gpu_facts_t;

typedef struct {
    /* Options. */
    int ranks;        /* --ranks: ranks for the smoke run and the buffer check; 0 = choose */
    int ranks_per_node; /* --ranks-per-node for env.internode; 0 = EPX_RANKS_PER_NODE or half */
    int run_smoke;    /* 0 with --no-smoke */
    int64_t tokens;   /* the buffer the user asks about (default: the standard case) */
    int64_t hidden;
    int experts;
    int topk;
    int64_t ll_tokens; /* --ll-tokens: the low-latency buffer to check (128); 0 = none */
    double timeout_s; /* per check that runs in a child */
    char self_path[4096]; /* this executable, for the smoke run */

    /* Learnt by the checks. */
    epx__doctor_gpu_facts_t gpu;
    int mps_running;   /* a CUDA MPS control daemon answers */
    int rdma_ports_up; /* RDMA ports in state ACTIVE */
    /* The libnvshmem_host.so.3 that nvshmem.library found and loaded, and its version
     * ({0, 0, 0} when none, or when the library does not say). */
    char nvshmem_path[4096];
    int nvshmem_version[3];
} epx__doctor_context_t;

void epx__doctor_check_gpu(epx__doctor_report_t *report, epx__doctor_context_t *context);
void epx__doctor_check_ipc(epx__doctor_report_t *report, epx__doctor_context_t *context);
void epx__doctor_check_mps(epx__doctor_report_t *report, epx__doctor_context_t *context);
void epx__doctor_check_nvshmem(epx__doctor_report_t *report, epx__doctor_context_t *context);
void epx__doctor_check_rdma(epx__doctor_report_t *report, epx__doctor_context_t *context);
void epx__doctor_check_env(epx__doctor_report_t *report, epx__doctor_context_t *context);
void epx__doctor_check_smoke(epx__doctor_report_t *report, epx__doctor_context_t *context);

/* Ranks the smoke run and the buffer check assume: --ranks, else one per GPU (at
 * least 2, sharing GPUs when there are fewer), else 2 on the CPU backend. */
int epx__doctor_ranks(const epx__doctor_context_t *context);

#endif /* EPX_TOOLS_DOCTOR_CHECKS_H */
