/*
 * What `epx doctor` reads from sysfs and /proc: small files, the InfiniBand/RoCE
 * devices with their ports (what `ibstat` shows) and PCI device paths. Each reader
 * takes the root it reads under ("/sys" normally), so the tests can point it at a
 * recorded tree in tests/data/doctor/.
 */
#ifndef EPX_TOOLS_DOCTOR_SYSFS_H
#define EPX_TOOLS_DOCTOR_SYSFS_H

#include <stddef.h>

#include "doctor_parse.h"

/*
 * Read a whole small file into `out` (NUL-terminated, cut to fit). Returns the bytes
 * read, or -1 when the file cannot be opened.
 */
long epx__doctor_read_file(const char *path, char *out, size_t out_size);

/* Lower-case a PCI bus id in place and shorten an 8-digit domain to 4 digits, as sysfs
 * names devices ("00000000:00:06.0" -> "0000:00:06.0"). */
void epx__doctor_normalize_bus_id(char *bus_id);

#define EPX__DOCTOR_MAX_RDMA_DEVICES 32
#define EPX__DOCTOR_MAX_RDMA_PORTS 4

typedef struct {
    int number;
    int state;        /* 4 = ACTIVE */
    char state_name[24];
    int phys_state;   /* 5 = LinkUp */
    char phys_state_name[24];
    double rate_gbps; /* 0 when unreadable */
    char width[24];   /* "4X NDR" */
    epx__doctor_link_layer_t link_layer;
} epx__doctor_rdma_port_t;

typedef struct {
    char name[64];          /* "mlx5_0" */
    char pci_path[512];     /* "/sys/devices/pci0000:00/...", "" when unknown */
    int port_count;
    epx__doctor_rdma_port_t ports[EPX__DOCTOR_MAX_RDMA_PORTS];
} epx__doctor_rdma_device_t;

/*
 * Scan <sysfs_root>/class/infiniband/<device>/ports/<n>/{state,phys_state,rate,
 * link_layer} and each device's PCI path (<device>/device, resolved). Devices are
 * sorted by name. Returns how many were found (0 when the class does not exist).
 */
int epx__doctor_scan_rdma(const char *sysfs_root, epx__doctor_rdma_device_t *devices, int max);

/* The resolved sysfs path of PCI device `bus_id` under sysfs_root; 1 on success. */
int epx__doctor_pci_device_path(const char *sysfs_root, const char *bus_id, char *out,
                                size_t out_size);

#endif /* EPX_TOOLS_DOCTOR_SYSFS_H */
