/*
 * sysfs readers for `epx doctor` (see doctor_sysfs.h). Missing files are normal here
 * (no NIC, an older kernel, a container that hides /sys): every reader reports what it
 * found and leaves the rest at "unknown".
 */
#include "doctor_sysfs.h"

#include <ctype.h>
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

long epx__doctor_read_file(const char *path, char *out, size_t out_size)
{
    if (out_size == 0)
        return -1;
    out[0] = '\0';
    FILE *file = fopen(path, "r");
    if (file == NULL)
        return -1;
    size_t got = fread(out, 1, out_size - 1, file);
    out[got] = '\0';
    fclose(file);
    return (long)got;
}

void epx__doctor_normalize_bus_id(char *bus_id)
{
    for (char *p = bus_id; *p != '\0'; p++)
        *p = (char)tolower((unsigned char)*p);
    /* "0000abcd:..." (NVML's 8-digit domain) -> "abcd:...". */
    char *colon = strchr(bus_id, ':');
    if (colon != NULL && colon - bus_id == 8 && strncmp(bus_id, "0000", 4) == 0)
        memmove(bus_id, bus_id + 4, strlen(bus_id + 4) + 1);
}

/* out = a/b; 0 on success, -1 when it does not fit (a sysfs path that long is bogus). */
static int join_path(char *out, size_t out_size, const char *a, const char *b)
{
    int length = snprintf(out, out_size, "%s/%s", a, b);
    return length < 0 || (size_t)length >= out_size ? -1 : 0;
}

static int compare_names(const void *a, const void *b)
{
    const epx__doctor_rdma_device_t *x = a, *y = b;
    return strcmp(x->name, y->name);
}

static int compare_ports(const void *a, const void *b)
{
    const epx__doctor_rdma_port_t *x = a, *y = b;
    return (x->number > y->number) - (x->number < y->number);
}

static void read_port(const char *port_dir, epx__doctor_rdma_port_t *port)
{
    char path[PATH_MAX], text[256];
    port->state = -1;
    port->phys_state = -1;
    if (join_path(path, sizeof(path), port_dir, "state") == 0 &&
        epx__doctor_read_file(path, text, sizeof(text)) > 0)
        epx__doctor_parse_port_state(text, &port->state, port->state_name,
                                     sizeof(port->state_name));
    if (join_path(path, sizeof(path), port_dir, "phys_state") == 0 &&
        epx__doctor_read_file(path, text, sizeof(text)) > 0)
        epx__doctor_parse_port_state(text, &port->phys_state, port->phys_state_name,
                                     sizeof(port->phys_state_name));
    if (join_path(path, sizeof(path), port_dir, "rate") == 0 &&
        epx__doctor_read_file(path, text, sizeof(text)) > 0)
        epx__doctor_parse_port_rate(text, &port->rate_gbps, port->width, sizeof(port->width));
    if (join_path(path, sizeof(path), port_dir, "link_layer") == 0 &&
        epx__doctor_read_file(path, text, sizeof(text)) > 0)
        port->link_layer = epx__doctor_parse_link_layer(text);
}

static void read_device(const char *device_dir, epx__doctor_rdma_device_t *device)
{
    char path[PATH_MAX], resolved[PATH_MAX];
    if (join_path(path, sizeof(path), device_dir, "device") == 0 &&
        realpath(path, resolved) != NULL && strlen(resolved) < sizeof(device->pci_path))
        memcpy(device->pci_path, resolved, strlen(resolved) + 1);
    if (join_path(path, sizeof(path), device_dir, "ports") != 0)
        return;
    DIR *ports = opendir(path);
    if (ports == NULL)
        return;
    struct dirent *entry;
    while ((entry = readdir(ports)) != NULL && device->port_count < EPX__DOCTOR_MAX_RDMA_PORTS) {
        char *end = NULL;
        long number = strtol(entry->d_name, &end, 10);
        if (end == entry->d_name || *end != '\0' || number < 0)
            continue;
        epx__doctor_rdma_port_t *port = &device->ports[device->port_count++];
        port->number = (int)number;
        char port_dir[PATH_MAX];
        if (join_path(port_dir, sizeof(port_dir), path, entry->d_name) == 0)
            read_port(port_dir, port);
    }
    closedir(ports);
    qsort(device->ports, (size_t)device->port_count, sizeof(device->ports[0]), compare_ports);
}

int epx__doctor_scan_rdma(const char *sysfs_root, epx__doctor_rdma_device_t *devices, int max)
{
    char class_dir[PATH_MAX];
    if (join_path(class_dir, sizeof(class_dir), sysfs_root, "class/infiniband") != 0)
        return 0;
    DIR *directory = opendir(class_dir);
    if (directory == NULL)
        return 0;
    int count = 0;
    struct dirent *entry;
    while ((entry = readdir(directory)) != NULL && count < max) {
        char device_dir[PATH_MAX];
        if (entry->d_name[0] == '.' || strlen(entry->d_name) >= sizeof(devices[0].name) ||
            join_path(device_dir, sizeof(device_dir), class_dir, entry->d_name) != 0)
            continue;
        epx__doctor_rdma_device_t *device = &devices[count++];
        memset(device, 0, sizeof(*device));
        memcpy(device->name, entry->d_name, strlen(entry->d_name) + 1);
        read_device(device_dir, device);
    }
    closedir(directory);
    qsort(devices, (size_t)count, sizeof(devices[0]), compare_names);
    return count;
}

int epx__doctor_pci_device_path(const char *sysfs_root, const char *bus_id, char *out,
                                size_t out_size)
{
    char path[PATH_MAX], resolved[PATH_MAX], devices[PATH_MAX];
    if (join_path(devices, sizeof(devices), sysfs_root, "bus/pci/devices") != 0 ||
        join_path(path, sizeof(path), devices, bus_id) != 0 || realpath(path, resolved) == NULL ||
        strlen(resolved) >= out_size)
        return 0;
    memcpy(out, resolved, strlen(resolved) + 1);
    return 1;
}
