/*
 * `epx doctor`'s parsers on samples recorded from real machines (tests/data/doctor/):
 * the driver's /proc/driver/nvidia/{params,version} with and without the IBGDA options,
 * sysfs InfiniBand port entries and PCI trees, NVML P2P answers mapped to the pair
 * matrix, sizes, versions and `epx bench --json` lines.
 *
 * Built with tools/doctor/doctor_parse.c and tools/doctor/doctor_sysfs.c (tests/doctor.cmake).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "doctor_parse.h"
#include "doctor_sysfs.h"
#include "test_util.h"

#ifndef EPX_DOCTOR_DATA_DIR
#error "EPX_DOCTOR_DATA_DIR must name tests/data/doctor (set by tests/doctor.cmake)"
#endif

static char *read_sample(const char *name)
{
    static char buffer[4][65536];
    static int next;
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", EPX_DOCTOR_DATA_DIR, name);
    char *out = buffer[next++ % 4];
    if (epx__doctor_read_file(path, out, sizeof(buffer[0])) < 0)
        TEST_FAIL("cannot read sample %s", path);
    return out;
}

static void test_params(void)
{
    const char *h200 = read_sample("nvidia_params_h200.txt");
    char value[256];
    CHECK(epx__doctor_params_get(h200, "EnableStreamMemOPs", value, sizeof(value)));
    CHECK_STR(value, "0");
    CHECK(epx__doctor_params_get(h200, "RegistryDwords", value, sizeof(value)));
    CHECK_STR(value, ""); /* the quotes are removed */
    CHECK(epx__doctor_params_get(h200, "NvLinkDisable", value, sizeof(value)));
    CHECK_STR(value, "1");
    /* A key is matched whole: "EnableMSI" must not answer for "Enable". */
    CHECK(!epx__doctor_params_get(h200, "Enable", value, sizeof(value)));
    CHECK(!epx__doctor_params_get(h200, "PeerMappingOverride", value, sizeof(value)));
    CHECK(!epx__doctor_params_get("", "EnableStreamMemOPs", value, sizeof(value)));

    /* The H200 machine: neither option, and the exact line to add. */
    epx__doctor_ibgda_options_t options;
    char line[400];
    epx__doctor_parse_ibgda_options(h200, &options);
    CHECK_EQ_INT(options.stream_mem_ops, 0);
    CHECK_EQ_INT(options.peer_mapping_override, 0);
    epx__doctor_ibgda_fix_line(&options, line, sizeof(line));
    CHECK_STR(line, "options nvidia NVreg_EnableStreamMemOPs=1 "
                    "NVreg_RegistryDwords=\"PeerMappingOverride=1;\"");

    /* Both set (with another registry entry beside PeerMappingOverride): nothing to add. */
    epx__doctor_parse_ibgda_options(read_sample("nvidia_params_ibgda.txt"), &options);
    CHECK_EQ_INT(options.stream_mem_ops, 1);
    CHECK_EQ_INT(options.peer_mapping_override, 1);
    epx__doctor_ibgda_fix_line(&options, line, sizeof(line));
    CHECK_STR(line, "");

    /* Stream memops on, PeerMappingOverride=0 among other entries: the other entries
     * are kept and the stale 0 is replaced. */
    epx__doctor_parse_ibgda_options(read_sample("nvidia_params_partial.txt"), &options);
    CHECK_EQ_INT(options.stream_mem_ops, 1);
    CHECK_EQ_INT(options.peer_mapping_override, 0);
    CHECK_STR(options.registry_dwords, "RMForceStaticBar1=0;PeerMappingOverride=0");
    epx__doctor_ibgda_fix_line(&options, line, sizeof(line));
    CHECK_STR(line, "options nvidia NVreg_RegistryDwords=\"PeerMappingOverride=1;"
                    "RMForceStaticBar1=0;\"");

    /* Hex values and the option listed on a line of its own. */
    epx__doctor_parse_ibgda_options("EnableStreamMemOPs: 0x1\nPeerMappingOverride: 1\n", &options);
    CHECK_EQ_INT(options.stream_mem_ops, 1);
    CHECK_EQ_INT(options.peer_mapping_override, 1);
    epx__doctor_parse_ibgda_options("EnableStreamMemOPs: 10\nRegistryDwords: \"peermappingoverride = 1\"\n",
                                    &options);
    CHECK_EQ_INT(options.stream_mem_ops, 0);
    CHECK_EQ_INT(options.peer_mapping_override, 1);
}

static void test_driver_version(void)
{
    char version[64];
    int open_module = -1;
    CHECK(epx__doctor_parse_driver_version(read_sample("nvidia_version_open.txt"), version,
                                           sizeof(version), &open_module));
    CHECK_STR(version, "580.159.04");
    CHECK_EQ_INT(open_module, 1);
    CHECK(epx__doctor_parse_driver_version(read_sample("nvidia_version_proprietary.txt"), version,
                                           sizeof(version), &open_module));
    CHECK_STR(version, "535.129.03");
    CHECK_EQ_INT(open_module, 0);
    CHECK(!epx__doctor_parse_driver_version("GCC version: 12.2.0\n", version, sizeof(version),
                                            &open_module));
}

static void test_port_entries(void)
{
    int code = -1;
    char word[32];
    double gbps = 0;
    CHECK(epx__doctor_parse_port_state("4: ACTIVE\n", &code, word, sizeof(word)));
    CHECK_EQ_INT(code, 4);
    CHECK_STR(word, "ACTIVE");
    CHECK(epx__doctor_parse_port_state("5: LinkUp", &code, word, sizeof(word)));
    CHECK_EQ_INT(code, 5);
    CHECK_STR(word, "LinkUp");
    CHECK(!epx__doctor_parse_port_state("ACTIVE\n", &code, word, sizeof(word)));
    CHECK(!epx__doctor_parse_port_state("4:\n", &code, word, sizeof(word)));
    CHECK(!epx__doctor_parse_port_state("", &code, word, sizeof(word)));

    CHECK(epx__doctor_parse_port_rate("400 Gb/sec (4X NDR)\n", &gbps, word, sizeof(word)));
    CHECK(gbps == 400.0);
    CHECK_STR(word, "4X NDR");
    CHECK(epx__doctor_parse_port_rate("2.5 Gb/sec (1X SDR)", &gbps, word, sizeof(word)));
    CHECK(gbps == 2.5);
    CHECK_STR(word, "1X SDR");
    CHECK(epx__doctor_parse_port_rate("25 Gb/sec", &gbps, word, sizeof(word)));
    CHECK(gbps == 25.0);
    CHECK_STR(word, "");
    CHECK(!epx__doctor_parse_port_rate("fast\n", &gbps, word, sizeof(word)));
    CHECK(!epx__doctor_parse_port_rate("400 Mb/sec\n", &gbps, word, sizeof(word)));

    CHECK_EQ_INT(epx__doctor_parse_link_layer("InfiniBand\n"), EPX__DOCTOR_LINK_LAYER_INFINIBAND);
    CHECK_EQ_INT(epx__doctor_parse_link_layer("Ethernet\n"), EPX__DOCTOR_LINK_LAYER_ETHERNET);
    CHECK_EQ_INT(epx__doctor_parse_link_layer("OmniPath\n"), EPX__DOCTOR_LINK_LAYER_UNKNOWN);
}

/* The recorded tree: mlx5_0 (NDR, up) and GPU 0000:04:00.0 behind one switch, mlx5_1
 * (RoCE, down) on another root port, mlx5_2 (HDR, port 1 up, port 2 INIT) beside GPU
 * 0000:83:00.0 on the second root complex. */
static void test_sysfs_tree(void)
{
    char root[1024];
    snprintf(root, sizeof(root), "%s/sysfs", EPX_DOCTOR_DATA_DIR);
    epx__doctor_rdma_device_t devices[8];
    int count = epx__doctor_scan_rdma(root, devices, 8);
    CHECK_EQ_INT(count, 3);
    CHECK_STR(devices[0].name, "mlx5_0");
    CHECK_STR(devices[1].name, "mlx5_1");
    CHECK_STR(devices[2].name, "mlx5_2");
    CHECK_EQ_INT(devices[0].port_count, 1);
    CHECK_EQ_INT(devices[0].ports[0].number, 1);
    CHECK_EQ_INT(devices[0].ports[0].state, 4);
    CHECK_STR(devices[0].ports[0].state_name, "ACTIVE");
    CHECK_EQ_INT(devices[0].ports[0].phys_state, 5);
    CHECK(devices[0].ports[0].rate_gbps == 400.0);
    CHECK_STR(devices[0].ports[0].width, "4X NDR");
    CHECK_EQ_INT(devices[0].ports[0].link_layer, EPX__DOCTOR_LINK_LAYER_INFINIBAND);
    CHECK_EQ_INT(devices[1].ports[0].state, 1);
    CHECK_STR(devices[1].ports[0].state_name, "DOWN");
    CHECK_EQ_INT(devices[1].ports[0].link_layer, EPX__DOCTOR_LINK_LAYER_ETHERNET);
    CHECK_EQ_INT(devices[2].port_count, 2);
    CHECK_EQ_INT(devices[2].ports[0].number, 1); /* sorted by port number */
    CHECK_EQ_INT(devices[2].ports[1].number, 2);
    CHECK_STR(devices[2].ports[1].state_name, "INIT");
    CHECK(devices[2].ports[1].rate_gbps == 200.0);

    /* A root without the class is "no devices", not an error. */
    CHECK_EQ_INT(epx__doctor_scan_rdma(EPX_DOCTOR_DATA_DIR "/no-such-root", devices, 8), 0);

    char gpu0[1024], gpu1[1024];
    CHECK(epx__doctor_pci_device_path(root, "0000:04:00.0", gpu0, sizeof(gpu0)));
    CHECK(epx__doctor_pci_device_path(root, "0000:83:00.0", gpu1, sizeof(gpu1)));
    char absent[1024];
    CHECK(!epx__doctor_pci_device_path(root, "0000:99:00.0", absent, sizeof(absent)));
    CHECK_EQ_INT(epx__doctor_pci_level(gpu0, devices[0].pci_path), EPX__DOCTOR_PCI_PIX);
    CHECK_EQ_INT(epx__doctor_pci_level(gpu0, devices[1].pci_path), EPX__DOCTOR_PCI_PHB);
    CHECK_EQ_INT(epx__doctor_pci_level(gpu0, devices[2].pci_path), EPX__DOCTOR_PCI_SYS);
    CHECK_EQ_INT(epx__doctor_pci_level(gpu1, devices[2].pci_path), EPX__DOCTOR_PCI_PIX);
    CHECK_EQ_INT(epx__doctor_pci_level(gpu1, devices[0].pci_path), EPX__DOCTOR_PCI_SYS);
}

static void test_pci_paths(void)
{
    /* Two switch levels between GPU and NIC: PXB. */
    const char *gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/"
                      "0000:03:00.0/0000:04:00.0";
    const char *nic = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/"
                      "0000:05:00.0";
    CHECK_EQ_INT(epx__doctor_pci_common_depth(gpu, nic), 3);
    CHECK_EQ_INT(epx__doctor_pci_level(gpu, nic), EPX__DOCTOR_PCI_PXB);
    /* A virtual machine: every device straight on the root bus (the H200 machine). */
    CHECK_EQ_INT(epx__doctor_pci_level("/sys/devices/pci0000:00/0000:00:06.0",
                                       "/sys/devices/pci0000:00/0000:00:07.0"),
                 EPX__DOCTOR_PCI_PHB);
    /* Functions of one card share their bridge: PIX. */
    CHECK_EQ_INT(epx__doctor_pci_level("/sys/devices/pci0000:00/0000:00:02.0/0000:3b:00.0",
                                       "/sys/devices/pci0000:00/0000:00:02.0/0000:3b:00.1"),
                 EPX__DOCTOR_PCI_PIX);
    /* Not PCI paths, or nothing known. */
    CHECK_EQ_INT(epx__doctor_pci_level("/sys/devices/virtual/net/lo", gpu), EPX__DOCTOR_PCI_UNKNOWN);
    CHECK_EQ_INT(epx__doctor_pci_level(gpu, ""), EPX__DOCTOR_PCI_UNKNOWN);
    /* Components compare whole: "0000:00:01.0" is not a prefix match of "0000:00:01.1". */
    CHECK_EQ_INT(epx__doctor_pci_common_depth("/sys/devices/pci0000:00/0000:00:01.0/x",
                                              "/sys/devices/pci0000:00/0000:00:01.1/x"),
                 1);
}

/* Read "gpus N" and "i j nvlink read" lines, map them, compare with the .expected text. */
static void check_pair_sample(const char *name)
{
    char sample[256], expected_name[256];
    snprintf(sample, sizeof(sample), "%s.txt", name);
    snprintf(expected_name, sizeof(expected_name), "%s.expected", name);
    char *text = read_sample(sample);
    int n = 0;
    epx__doctor_pair_t pairs[64];
    for (int i = 0; i < 64; i++)
        pairs[i] = EPX__DOCTOR_PAIR_SELF;
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        int i, j, nvlink, read;
        if (line[0] == '#')
            continue;
        if (sscanf(line, "gpus %d", &n) == 1)
            continue;
        CHECK(sscanf(line, "%d %d %d %d", &i, &j, &nvlink, &read) == 4);
        CHECK(n > 0 && n <= 8 && i >= 0 && i < n && j >= 0 && j < n && i != j);
        pairs[i * n + j] = epx__doctor_pair_from_nvml(nvlink, read);
    }
    char matrix[2048];
    epx__doctor_format_pair_matrix(n, pairs, matrix, sizeof(matrix));
    char *expected = read_sample(expected_name);
    size_t length = strlen(expected);
    while (length > 0 && expected[length - 1] == '\n')
        expected[--length] = '\0';
    CHECK_STR(matrix, expected);
}

static void test_pairs(void)
{
    CHECK_EQ_INT(epx__doctor_pair_from_nvml(0, 0), EPX__DOCTOR_PAIR_NVLINK);
    CHECK_EQ_INT(epx__doctor_pair_from_nvml(5, 0), EPX__DOCTOR_PAIR_PCIE);
    CHECK_EQ_INT(epx__doctor_pair_from_nvml(5, 1), EPX__DOCTOR_PAIR_NONE);
    check_pair_sample("nvml_p2p_dgx_h100");
    check_pair_sample("nvml_p2p_pcie_4gpu");
    /* A matrix too large for the buffer is cut, still NUL-terminated. */
    epx__doctor_pair_t pairs[4] = {EPX__DOCTOR_PAIR_SELF, EPX__DOCTOR_PAIR_P2P,
                                   EPX__DOCTOR_PAIR_P2P, EPX__DOCTOR_PAIR_SELF};
    char small[20];
    epx__doctor_format_pair_matrix(2, pairs, small, sizeof(small));
    CHECK_EQ_INT(strlen(small), sizeof(small) - 1);
    char full[200];
    epx__doctor_format_pair_matrix(2, pairs, full, sizeof(full));
    CHECK_STR(full, "        GPU0  GPU1\n  GPU0     X   P2P\n  GPU1   P2P     X");
}

static void test_sizes_and_versions(void)
{
    uint64_t bytes = 0;
    CHECK(epx__doctor_parse_size("1073741824", &bytes));
    CHECK(bytes == 1073741824ull);
    CHECK(epx__doctor_parse_size("1G", &bytes));
    CHECK(bytes == 1073741824ull);
    CHECK(epx__doctor_parse_size("512M", &bytes));
    CHECK(bytes == 536870912ull);
    CHECK(epx__doctor_parse_size("64k", &bytes));
    CHECK(bytes == 65536ull);
    CHECK(epx__doctor_parse_size("2GB", &bytes));
    CHECK(bytes == 2147483648ull);
    CHECK(epx__doctor_parse_size("1.5GiB", &bytes));
    CHECK(bytes == 1610612736ull);
    /* NVSHMEM's own examples: one multiplier, the rest ignored; a leading dot. */
    CHECK(epx__doctor_parse_size("20kk", &bytes));
    CHECK(bytes == 20480ull);
    CHECK(epx__doctor_parse_size(".5m", &bytes));
    CHECK(bytes == 524288ull);
    CHECK(epx__doctor_parse_size("3.1M", &bytes));
    CHECK(bytes == 3250586ull); /* rounded up, as NVSHMEM does */
    CHECK(!epx__doctor_parse_size("", &bytes));
    CHECK(!epx__doctor_parse_size("12x", &bytes));
    CHECK(!epx__doctor_parse_size("G", &bytes));
    CHECK(!epx__doctor_parse_size("-1G", &bytes));
    CHECK(!epx__doctor_parse_size("12 apples", &bytes));
    CHECK(!epx__doctor_parse_size("99999999999T", &bytes));

    char text[32];
    epx__doctor_format_bytes(37, text, sizeof(text));
    CHECK_STR(text, "37 B");
    epx__doctor_format_bytes(1536ull << 20, text, sizeof(text));
    CHECK_STR(text, "1.5 GiB");
    epx__doctor_format_bytes(512ull << 20, text, sizeof(text));
    CHECK_STR(text, "512.0 MiB");

    char version[32];
    CHECK(epx__doctor_version_from_filename("/x/libnvshmem_host.so.3.4.5", version, sizeof(version)));
    CHECK_STR(version, "3.4.5");
    CHECK(epx__doctor_version_from_filename("libnvshmem_host.so.3", version, sizeof(version)));
    CHECK_STR(version, "3");
    CHECK(!epx__doctor_version_from_filename("libnvshmem_host.so", version, sizeof(version)));
}

static void test_bench_lines(void)
{
    char *text = read_sample("bench_lines.txt");
    epx__doctor_bench_row_t rows[8];
    int parsed = 0, lines = 0;
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        lines++;
        if (epx__doctor_parse_bench_line(line, &rows[parsed]))
            parsed++;
    }
    CHECK_EQ_INT(lines, 5);
    CHECK_EQ_INT(parsed, 3); /* the header and the malformed line are refused */
    CHECK_STR(rows[0].op, "layout");
    CHECK(isnan(rows[0].gbps_per_rank)); /* null stays unknown */
    CHECK_STR(rows[1].op, "dispatch");
    CHECK_STR(rows[1].dtype, "bf16");
    CHECK_STR(rows[1].backend, "cuda");
    CHECK_STR(rows[1].check, "PASS");
    CHECK_EQ_INT(rows[1].ranks, 8);
    CHECK(fabs(rows[1].median_us - 812.25) < 1e-9);
    CHECK(fabs(rows[1].gbps_per_rank - 18.0734) < 1e-9);
    CHECK(fabs(rows[1].floor_over_time - 0.0680406) < 1e-12);
    CHECK_STR(rows[2].op, "combine");
    CHECK(rows[2].median_us == 1000.0);
    CHECK_STR(rows[2].check, ""); /* null: not checked */
    CHECK(!epx__doctor_parse_bench_line("no json here", &rows[0]));
    CHECK(!epx__doctor_parse_bench_line("{\"dtype\":\"bf16\"}", &rows[0])); /* no op */
    CHECK(!epx__doctor_parse_bench_line("{\"op\":\"dispatch\"", &rows[0])); /* unterminated */
}

static void test_bus_ids(void)
{
    char id[32] = "00000000:1B:00.0";
    epx__doctor_normalize_bus_id(id);
    CHECK_STR(id, "0000:1b:00.0");
    char short_id[32] = "0000:AB:00.0";
    epx__doctor_normalize_bus_id(short_id);
    CHECK_STR(short_id, "0000:ab:00.0");
}

int main(void)
{
    test_params();
    test_driver_version();
    test_port_entries();
    test_sysfs_tree();
    test_pci_paths();
    test_pairs();
    test_sizes_and_versions();
    test_bench_lines();
    test_bus_ids();
    printf("test_doctor_parse: all passed\n");
    return 0;
}
