/*
 * Pure parsers behind `epx doctor`: text in, values out, no file or device access, so
 * the unit tests feed them samples recorded on real machines (tests/data/doctor/).
 */
#ifndef EPX_TOOLS_DOCTOR_PARSE_H
#define EPX_TOOLS_DOCTOR_PARSE_H

#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------- NVIDIA driver */

/*
 * /proc/driver/nvidia/params holds "Name: value" lines. Copy the value of `key` (outer
 * quotes removed, surrounding blanks trimmed) into `value`; 1 when the key is listed,
 * 0 when not.
 */
int epx__doctor_params_get(const char *params_text, const char *key, char *value,
                           size_t value_size);

/* What IBGDA needs from the driver: 1 = set, 0 = off or absent. */
typedef struct {
    int stream_mem_ops;        /* EnableStreamMemOPs: 1 */
    int peer_mapping_override; /* PeerMappingOverride=1 in RegistryDwords (or its own line) */
    char registry_dwords[256]; /* RegistryDwords as it is now, "" if empty */
} epx__doctor_ibgda_options_t;

void epx__doctor_parse_ibgda_options(const char *params_text, epx__doctor_ibgda_options_t *options);

/*
 * The modprobe line that turns the missing options on, keeping any other registry
 * entries already set, e.g.
 *   options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"
 * "" when nothing is missing.
 */
void epx__doctor_ibgda_fix_line(const epx__doctor_ibgda_options_t *options, char *out,
                                size_t out_size);

/*
 * /proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64
 * 580.159.04  Release Build ...". Copies the version ("580.159.04") and sets *open_module
 * (1 = the open kernel module, which supports dma-buf for GPUDirect RDMA). 1 on
 * success, 0 when the text has no NVRM line.
 */
int epx__doctor_parse_driver_version(const char *version_text, char *version, size_t version_size,
                                     int *open_module);

/* ---------------------------------------------------------------- InfiniBand sysfs */

/*
 * ports/N/state and ports/N/phys_state: "4: ACTIVE", "5: LinkUp". Sets the number and
 * copies the word; 1 on success, 0 when the text is not "<number>: <word>".
 */
int epx__doctor_parse_port_state(const char *text, int *code, char *word, size_t word_size);

/*
 * ports/N/rate: "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)", "100 Gb/sec (4X EDR)".
 * Sets *gbps and copies what is in the parentheses ("4X NDR", "" when absent). 1 on
 * success, 0 when there is no "<number> Gb/sec".
 */
int epx__doctor_parse_port_rate(const char *text, double *gbps, char *width, size_t width_size);

typedef enum {
    EPX__DOCTOR_LINK_LAYER_UNKNOWN = 0,
    EPX__DOCTOR_LINK_LAYER_INFINIBAND = 1,
    EPX__DOCTOR_LINK_LAYER_ETHERNET = 2, /* RoCE */
} epx__doctor_link_layer_t;

/* ports/N/link_layer: "InfiniBand" or "Ethernet". */
epx__doctor_link_layer_t epx__doctor_parse_link_layer(const char *text);
const char *epx__doctor_link_layer_name(epx__doctor_link_layer_t layer);

/* ---------------------------------------------------------------- PCI nearness */

/*
 * How far apart two PCI devices are, from their sysfs paths
 * ("/sys/devices/pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:00.0"): the names
 * nvidia-smi topo uses.
 */
typedef enum {
    EPX__DOCTOR_PCI_UNKNOWN = 0,
    EPX__DOCTOR_PCI_SYS = 1, /* different root complexes (another host bridge or socket) */
    EPX__DOCTOR_PCI_PHB = 2, /* the same root complex, through the host bridge */
    EPX__DOCTOR_PCI_PXB = 3, /* behind the same PCIe switch (one or more bridges) */
    EPX__DOCTOR_PCI_PIX = 4, /* behind the same single bridge */
} epx__doctor_pci_level_t;

/* Path components the two paths share below "/sys/devices" (0 when unrelated). */
int epx__doctor_pci_common_depth(const char *path_a, const char *path_b);
epx__doctor_pci_level_t epx__doctor_pci_level(const char *path_a, const char *path_b);
const char *epx__doctor_pci_level_name(epx__doctor_pci_level_t level);

/* ---------------------------------------------------------------- GPU pairs */

typedef enum {
    EPX__DOCTOR_PAIR_SELF = 0,
    EPX__DOCTOR_PAIR_NVLINK = 1, /* P2P over NVLink */
    EPX__DOCTOR_PAIR_PCIE = 2,   /* P2P over PCIe only */
    EPX__DOCTOR_PAIR_NONE = 3,   /* no P2P: kernels cannot reach the peer's memory */
    EPX__DOCTOR_PAIR_P2P = 4,    /* P2P over a link NVML was not there to name */
} epx__doctor_pair_t;

/*
 * From NVML's nvmlDeviceGetP2PStatus answers (NVML_P2P_STATUS_OK = 0) for the NVLINK
 * and READ capabilities of one pair.
 */
epx__doctor_pair_t epx__doctor_pair_from_nvml(int nvlink_status, int read_status);

/*
 * The pair matrix as text, one row per GPU, like `nvidia-smi topo -m`:
 *          GPU0  GPU1
 *    GPU0     X    NV
 *    GPU1    NV     X
 * (NV = NVLink, PCI = PCIe P2P, P2P = P2P over an unnamed link, "-" = no P2P).
 * `pairs` is n*n row-major.
 */
void epx__doctor_format_pair_matrix(int n, const epx__doctor_pair_t *pairs, char *out,
                                    size_t out_size);

/* ---------------------------------------------------------------- sizes, versions */

/*
 * NVSHMEM_SYMMETRIC_SIZE sizes, read as NVSHMEM reads them: a number (".5" allowed)
 * with an optional binary multiplier k/m/g/t, after which anything is ignored
 * ("1073741824", "1G", "512M", "2GB", "1.5g", "20kk" = 20 KiB). 1 on success, 0 on
 * anything else.
 */
int epx__doctor_parse_size(const char *text, uint64_t *bytes);

/* "1.5 GiB", "512.0 MiB", "37 B": a size for people. */
void epx__doctor_format_bytes(uint64_t bytes, char *out, size_t out_size);

/*
 * The version in a shared library's file name: "libnvshmem_host.so.3.4.5" gives
 * "3.4.5", "libnvshmem_host.so.3" gives "3". 1 on success, 0 when the name has no
 * ".so.<digits>".
 */
int epx__doctor_version_from_filename(const char *filename, char *version, size_t version_size);

/* ---------------------------------------------------------------- bench output */

/* One row of `epx bench --json` (a missing field keeps its "unknown" value). */
typedef struct {
    char op[32];      /* "dispatch", "combine", ... */
    char dtype[16];   /* "bf16", "fp8" */
    char backend[16]; /* "host", "cuda" */
    char check[16];   /* "PASS", "FAIL", "" = not checked */
    int ranks;        /* -1 = unknown */
    double median_us; /* NaN = unknown */
    double gbps_per_rank;
    double floor_us;
    double floor_over_time; /* floor_us / the slowest rank's median: 1.0 = at the floor */
} epx__doctor_bench_row_t;

/*
 * Parse a line that holds one JSON object of bench output, possibly after a prefix
 * such as "[rank 0] ". 1 when the line has an object with an "op" field, else 0.
 * Only flat objects of strings, numbers and null are understood (what bench prints).
 */
int epx__doctor_parse_bench_line(const char *line, epx__doctor_bench_row_t *row);

#endif /* EPX_TOOLS_DOCTOR_PARSE_H */
