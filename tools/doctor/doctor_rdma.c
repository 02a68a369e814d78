/*
 * `epx doctor` RDMA checks, all from sysfs and /proc (no verbs calls, so nothing here
 * can hang): the InfiniBand/RoCE ports and their state and rate (what `ibstat`
 * shows), the NIC nearest each GPU on the PCIe tree, GPUDirect RDMA (nvidia-peermem or
 * dma-buf), GDRCopy, and the two driver options NVSHMEM's IBGDA transport needs.
 *
 * IBGDA lets the GPU ring the NIC's doorbell itself; it needs the driver to allow
 * stream memory operations (EnableStreamMemOPs=1) and to map peer memory for the NIC
 * (PeerMappingOverride=1, a registry entry). Without them NVSHMEM falls back to IBRC,
 * where a CPU thread drives the NIC: correct, but slower for small messages.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "doctor_checks.h"
#include "doctor_parse.h"
#include "doctor_sysfs.h"

#define PORT_ACTIVE 4
#define SYSFS_ROOT "/sys"

static int exists(const char *path)
{
    struct stat info;
    return stat(path, &info) == 0;
}

static void check_ports(epx__doctor_report_t *report, epx__doctor_context_t *context,
                        const epx__doctor_rdma_device_t *devices, int count)
{
    char detail[EPX__DOCTOR_DETAIL_MAX];
    size_t used = 0;
    int active = 0, ports = 0;
    detail[0] = '\0';
    for (int d = 0; d < count; d++) {
        for (int p = 0; p < devices[d].port_count; p++) {
            const epx__doctor_rdma_port_t *port = &devices[d].ports[p];
            ports++;
            active += port->state == PORT_ACTIVE;
            if (used < sizeof(detail))
                used += (size_t)snprintf(detail + used, sizeof(detail) - used,
                                         "%s%s port %d: %s, %s, %.0f Gb/sec%s%s%s, %s",
                                         used > 0 ? "\n" : "", devices[d].name, port->number,
                                         port->state_name[0] ? port->state_name : "state ?",
                                         port->phys_state_name[0] ? port->phys_state_name
                                                                  : "phys_state ?",
                                         port->rate_gbps, port->width[0] ? " (" : "", port->width,
                                         port->width[0] ? ")" : "",
                                         epx__doctor_link_layer_name(port->link_layer));
        }
    }
    context->rdma_ports_up = active;
    if (active > 0)
        epx__doctor_add(report, "rdma.devices", EPX__DOCTOR_PASS, NULL,
                        "%d of %d RDMA ports active:\n%s", active, ports, detail);
    else
        epx__doctor_add(report, "rdma.devices", EPX__DOCTOR_WARN,
                        "bring a port up: check the cable and, for InfiniBand, that a subnet "
                        "manager runs (opensm or the switch's); `ibstat` shows the same state",
                        "%d RDMA device%s but no port is ACTIVE, so epx cannot go across nodes:\n%s",
                        count, count == 1 ? "" : "s", detail);
}

static void check_affinity(epx__doctor_report_t *report, const epx__doctor_context_t *context,
                           const epx__doctor_rdma_device_t *devices, int count)
{
    const epx__doctor_gpu_facts_t *gpu = &context->gpu;
    if (gpu->gpu_count <= 0) {
        epx__doctor_add(report, "rdma.nic_affinity", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no GPU to place next to a NIC");
        return;
    }
    char detail[EPX__DOCTOR_DETAIL_MAX];
    size_t used = 0;
    int far = 0;
    detail[0] = '\0';
    for (int g = 0; g < gpu->gpu_count; g++) {
        char gpu_path[512];
        int best = -1;
        epx__doctor_pci_level_t best_level = EPX__DOCTOR_PCI_UNKNOWN;
        if (epx__doctor_pci_device_path(SYSFS_ROOT, gpu->gpus[g].bus_id, gpu_path,
                                        sizeof(gpu_path))) {
            for (int d = 0; d < count; d++) {
                epx__doctor_pci_level_t level =
                    epx__doctor_pci_level(gpu_path, devices[d].pci_path);
                if (level > best_level) {
                    best_level = level;
                    best = d;
                }
            }
        }
        far += best_level < EPX__DOCTOR_PCI_PXB;
        if (used < sizeof(detail))
            used += (size_t)snprintf(detail + used, sizeof(detail) - used, "%sGPU%d -> %s: %s",
                                     g > 0 ? "\n" : "", g, best >= 0 ? devices[best].name : "?",
                                     epx__doctor_pci_level_name(best_level));
    }
    if (far > 0)
        epx__doctor_add(report, "rdma.nic_affinity", EPX__DOCTOR_WARN,
                        "GPUDirect RDMA through the host bridge or across sockets is slow: put a "
                        "NIC behind each GPU's PCIe switch (NVSHMEM gives each PE its nearest NIC "
                        "by default; make sure NVSHMEM_HCA_LIST does not leave it out)",
                        "%d GPU%s without a NIC on its PCIe switch:\n%s", far,
                        far == 1 ? "" : "s", detail);
    else
        epx__doctor_add(report, "rdma.nic_affinity", EPX__DOCTOR_PASS, NULL,
                        "every GPU has a NIC behind its PCIe switch:\n%s", detail);
}

static void check_gpudirect(epx__doctor_report_t *report, const epx__doctor_context_t *context)
{
    const epx__doctor_gpu_facts_t *gpu = &context->gpu;
    int peermem = exists(SYSFS_ROOT "/module/nvidia_peermem");
    int supported = gpu->gpu_count > 0, dma_buf = gpu->gpu_count > 0 && gpu->open_module;
    for (int g = 0; g < gpu->gpu_count; g++) {
        supported &= gpu->gpus[g].gpudirect_rdma != 0;
        dma_buf &= gpu->gpus[g].dma_buf != 0;
    }
    if (gpu->gpu_count <= 0) {
        epx__doctor_add(report, "rdma.gpudirect", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no GPU, so no GPUDirect RDMA (nvidia_peermem %s)",
                        peermem ? "loaded" : "not loaded");
        return;
    }
    if (!supported) {
        epx__doctor_add(report, "rdma.gpudirect", EPX__DOCTOR_FAIL,
                        "use data-center GPUs and a driver that supports GPUDirect RDMA, or keep "
                        "epx within one node",
                        "the driver says GPUDirect RDMA is not supported on these GPUs, so the NIC "
                        "cannot read GPU memory");
        return;
    }
    if (peermem || dma_buf) {
        epx__doctor_add(report, "rdma.gpudirect", EPX__DOCTOR_PASS, NULL,
                        "GPUDirect RDMA available: %s%s%s", peermem ? "nvidia_peermem loaded" : "",
                        peermem && dma_buf ? "; " : "",
                        dma_buf ? "dma-buf (open kernel module) supported" : "");
        return;
    }
    epx__doctor_add(report, "rdma.gpudirect", context->rdma_ports_up > 0 ? EPX__DOCTOR_FAIL
                                                                         : EPX__DOCTOR_WARN,
                    "sudo modprobe nvidia-peermem (and list it in /etc/modules-load.d/ so it "
                    "loads at boot), or use the open kernel module, which supports dma-buf",
                    "neither nvidia_peermem nor dma-buf is available: NICs cannot register GPU "
                    "memory, so NVSHMEM cannot go across nodes");
}

static void check_gdrcopy(epx__doctor_report_t *report, const epx__doctor_context_t *context)
{
    int device = exists("/dev/gdrdrv");
    void *library = dlopen("libgdrapi.so.2", RTLD_NOW | RTLD_LOCAL);
    if (library != NULL)
        dlclose(library);
    if (device && library != NULL) {
        epx__doctor_add(report, "rdma.gdrcopy", EPX__DOCTOR_PASS, NULL,
                        "GDRCopy present (/dev/gdrdrv, libgdrapi.so.2)");
        return;
    }
    epx__doctor_add(report, "rdma.gdrcopy", EPX__DOCTOR_NOT_PRESENT,
                    context->rdma_ports_up > 0
                        ? "optional: install GDRCopy (gdrdrv module and libgdrapi) to speed up "
                          "the IBRC fallback; IBGDA does not need it"
                        : NULL,
                    "GDRCopy not installed (%s, %s); only NVSHMEM's IBRC proxy uses it",
                    device ? "/dev/gdrdrv present" : "no /dev/gdrdrv",
                    library != NULL ? "libgdrapi.so.2 loads" : "no libgdrapi.so.2");
}

static void check_driver_options(epx__doctor_report_t *report, const epx__doctor_context_t *context)
{
    char params[16384];
    if (epx__doctor_read_file("/proc/driver/nvidia/params", params, sizeof(params)) <= 0) {
        epx__doctor_add(report, "rdma.ibgda_driver_options", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no /proc/driver/nvidia/params (no NVIDIA kernel module loaded)");
        return;
    }
    epx__doctor_ibgda_options_t options;
    epx__doctor_parse_ibgda_options(params, &options);
    char state[160];
    snprintf(state, sizeof(state), "EnableStreamMemOPs=%d, PeerMappingOverride %s",
             options.stream_mem_ops, options.peer_mapping_override ? "=1" : "not set");
    if (options.stream_mem_ops && options.peer_mapping_override) {
        epx__doctor_add(report, "rdma.ibgda_driver_options", EPX__DOCTOR_PASS, NULL,
                        "%s: the driver allows IBGDA", state);
        return;
    }
    char line[400], fix[EPX__DOCTOR_FIX_MAX];
    epx__doctor_ibgda_fix_line(&options, line, sizeof(line));
    snprintf(fix, sizeof(fix),
             "add `%s` to /etc/modprobe.d/nvidia.conf, then `update-initramfs -u` (or dracut -f) "
             "and reboot",
             line);
    if (context->rdma_ports_up > 0)
        epx__doctor_add(report, "rdma.ibgda_driver_options", EPX__DOCTOR_WARN, fix,
                        "%s: NVSHMEM's IBGDA transport cannot run, so internode traffic goes "
                        "through IBRC (a CPU proxy thread: correct, slower for small messages); "
                        "everything within a node works without them",
                        state);
    else
        epx__doctor_add(report, "rdma.ibgda_driver_options", EPX__DOCTOR_SKIP, fix,
                        "%s: IBGDA would need them, but no RDMA port is up, so nothing here uses "
                        "IBGDA; everything within a node works without them",
                        state);
}

void epx__doctor_check_rdma(epx__doctor_report_t *report, epx__doctor_context_t *context)
{
    static epx__doctor_rdma_device_t devices[EPX__DOCTOR_MAX_RDMA_DEVICES];
    int count = epx__doctor_scan_rdma(SYSFS_ROOT, devices, EPX__DOCTOR_MAX_RDMA_DEVICES);
    context->rdma_ports_up = 0;
    if (count == 0) {
        epx__doctor_add(report, "rdma.devices", EPX__DOCTOR_NOT_PRESENT,
                        NULL,
                        "no InfiniBand or RoCE device in %s/class/infiniband: epx runs within "
                        "this node only (NVLink/PCIe); across nodes it needs RDMA NICs",
                        SYSFS_ROOT);
        epx__doctor_add(report, "rdma.nic_affinity", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no RDMA device");
    } else {
        check_ports(report, context, devices, count);
        check_affinity(report, context, devices, count);
    }
    if (count == 0) {
        int peermem = exists(SYSFS_ROOT "/module/nvidia_peermem");
        epx__doctor_add(report, "rdma.gpudirect", EPX__DOCTOR_NOT_PRESENT, NULL,
                        "no RDMA device, so GPUDirect RDMA is not used (nvidia_peermem %s)",
                        peermem ? "loaded" : "not loaded");
    } else {
        check_gpudirect(report, context);
    }
    check_gdrcopy(report, context);
    check_driver_options(report, context);
}
