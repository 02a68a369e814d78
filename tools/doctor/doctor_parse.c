/*
 * Parsers for what `epx doctor` reads from the system. Every function is pure and
 * tolerant: kernel and driver texts change between versions, so an unexpected line is
 * "not found", never a crash, and numbers are parsed with an end check (no sscanf).
 */
#include "doctor_parse.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---------------------------------------------------------------- helpers */

static const char *skip_blanks(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    return s;
}

/* Copy [begin, end) with blanks and one pair of outer double quotes removed. */
static void copy_trimmed(const char *begin, const char *end, char *out, size_t out_size)
{
    if (out_size == 0)
        return;
    while (begin < end && isspace((unsigned char)*begin))
        begin++;
    while (end > begin && isspace((unsigned char)end[-1]))
        end--;
    if (end - begin >= 2 && *begin == '"' && end[-1] == '"') {
        begin++;
        end--;
    }
    size_t length = (size_t)(end - begin);
    if (length >= out_size)
        length = out_size - 1;
    memcpy(out, begin, length);
    out[length] = '\0';
}

/* ---------------------------------------------------------------- NVIDIA driver */

int epx__doctor_params_get(const char *params_text, const char *key, char *value,
                           size_t value_size)
{
    size_t key_length = strlen(key);
    const char *line = params_text;
    while (line != NULL && *line != '\0') {
        const char *end = strchr(line, '\n');
        if (end == NULL)
            end = line + strlen(line);
        const char *name = skip_blanks(line);
        if ((size_t)(end - name) > key_length && strncmp(name, key, key_length) == 0) {
            const char *colon = skip_blanks(name + key_length);
            if (*colon == ':') {
                copy_trimmed(colon + 1, end, value, value_size);
                return 1;
            }
        }
        line = *end != '\0' ? end + 1 : NULL;
    }
    return 0;
}

/* Value of `name` in a "Name=value;Name=value" registry list, case-insensitive name. */
static int registry_value(const char *list, const char *name, char *value, size_t value_size)
{
    size_t name_length = strlen(name);
    const char *entry = list;
    while (*entry != '\0') {
        const char *end = strchr(entry, ';');
        if (end == NULL)
            end = entry + strlen(entry);
        const char *start = skip_blanks(entry);
        if (strncasecmp(start, name, name_length) == 0) {
            const char *equals = skip_blanks(start + name_length);
            if (*equals == '=') {
                copy_trimmed(equals + 1, end, value, value_size);
                return 1;
            }
        }
        entry = *end != '\0' ? end + 1 : end;
    }
    return 0;
}

/* Driver registry values are decimal or 0x-hex; "1" and "0x1" both mean on. */
static int is_one(const char *value)
{
    char *end = NULL;
    long number = strtol(value, &end, 0);
    return end != value && *skip_blanks(end) == '\0' && number == 1;
}

void epx__doctor_parse_ibgda_options(const char *params_text, epx__doctor_ibgda_options_t *options)
{
    char value[256];
    memset(options, 0, sizeof(*options));
    if (epx__doctor_params_get(params_text, "EnableStreamMemOPs", value, sizeof(value)))
        options->stream_mem_ops = is_one(value);
    if (epx__doctor_params_get(params_text, "RegistryDwords", options->registry_dwords,
                               sizeof(options->registry_dwords)) &&
        registry_value(options->registry_dwords, "PeerMappingOverride", value, sizeof(value)))
        options->peer_mapping_override = is_one(value);
    /* Some driver builds list it as a parameter of its own. */
    if (!options->peer_mapping_override &&
        epx__doctor_params_get(params_text, "PeerMappingOverride", value, sizeof(value)))
        options->peer_mapping_override = is_one(value);
}

void epx__doctor_ibgda_fix_line(const epx__doctor_ibgda_options_t *options, char *out,
                                size_t out_size)
{
    if (out_size == 0)
        return;
    out[0] = '\0';
    if (options->stream_mem_ops && options->peer_mapping_override)
        return;
    size_t used = (size_t)snprintf(out, out_size, "options nvidia%s",
                                   options->stream_mem_ops ? "" : " NVreg_EnableStreamMemOPs=1");
    if (used >= out_size)
        return;
    /* RegistryDwords is one option: keep the entries already there, without a stale
     * PeerMappingOverride=0 that would contradict the one we add. */
    char kept[256] = "";
    size_t kept_used = 0;
    const char *entry = options->registry_dwords;
    while (*entry != '\0') {
        const char *end = strchr(entry, ';');
        if (end == NULL)
            end = entry + strlen(entry);
        const char *start = skip_blanks(entry);
        if (end > start && strncasecmp(start, "PeerMappingOverride", 19) != 0 &&
            kept_used + (size_t)(end - start) + 2 < sizeof(kept)) {
            memcpy(kept + kept_used, start, (size_t)(end - start));
            kept_used += (size_t)(end - start);
            kept[kept_used++] = ';';
            kept[kept_used] = '\0';
        }
        entry = *end != '\0' ? end + 1 : end;
    }
    if (!options->peer_mapping_override || kept_used > 0)
        snprintf(out + used, out_size - used, " NVreg_RegistryDwords=\"%s%s\"",
                 options->peer_mapping_override ? "" : "PeerMappingOverride=1;", kept);
}

int epx__doctor_parse_driver_version(const char *version_text, char *version, size_t version_size,
                                     int *open_module)
{
    const char *line = strstr(version_text, "NVRM version:");
    if (line == NULL)
        return 0;
    const char *end = strchr(line, '\n');
    if (end == NULL)
        end = line + strlen(line);
    *open_module = 0;
    for (const char *p = line; p + 4 <= end; p++) {
        if (strncmp(p, "Open", 4) == 0)
            *open_module = 1;
    }
    /* The version is the first word made of digits and dots with at least one dot. */
    for (const char *p = line; p < end; p++) {
        if (!isdigit((unsigned char)*p) || (p > line && !isspace((unsigned char)p[-1])))
            continue;
        const char *q = p;
        int dots = 0;
        while (q < end && (isdigit((unsigned char)*q) || *q == '.'))
            dots += *q++ == '.';
        if (dots > 0 && (q == end || isspace((unsigned char)*q))) {
            copy_trimmed(p, q, version, version_size);
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- InfiniBand sysfs */

int epx__doctor_parse_port_state(const char *text, int *code, char *word, size_t word_size)
{
    char *end = NULL;
    const char *start = skip_blanks(text);
    long number = strtol(start, &end, 10);
    if (end == start || *end != ':' || number < 0 || number > 1000)
        return 0;
    const char *word_start = skip_blanks(end + 1);
    const char *word_end = word_start;
    while (*word_end != '\0' && *word_end != '\n')
        word_end++;
    copy_trimmed(word_start, word_end, word, word_size);
    if (word_size > 0 && word[0] == '\0')
        return 0;
    *code = (int)number;
    return 1;
}

int epx__doctor_parse_port_rate(const char *text, double *gbps, char *width, size_t width_size)
{
    char *end = NULL;
    const char *start = skip_blanks(text);
    double rate = strtod(start, &end);
    if (end == start || !isfinite(rate) || rate < 0)
        return 0;
    const char *unit = skip_blanks(end);
    if (strncmp(unit, "Gb/sec", 6) != 0)
        return 0;
    *gbps = rate;
    if (width_size > 0)
        width[0] = '\0';
    const char *open = strchr(unit, '(');
    const char *close = open != NULL ? strchr(open, ')') : NULL;
    if (open != NULL && close != NULL)
        copy_trimmed(open + 1, close, width, width_size);
    return 1;
}

epx__doctor_link_layer_t epx__doctor_parse_link_layer(const char *text)
{
    const char *start = skip_blanks(text);
    if (strncasecmp(start, "InfiniBand", 10) == 0)
        return EPX__DOCTOR_LINK_LAYER_INFINIBAND;
    if (strncasecmp(start, "Ethernet", 8) == 0)
        return EPX__DOCTOR_LINK_LAYER_ETHERNET;
    return EPX__DOCTOR_LINK_LAYER_UNKNOWN;
}

const char *epx__doctor_link_layer_name(epx__doctor_link_layer_t layer)
{
    switch (layer) {
    case EPX__DOCTOR_LINK_LAYER_INFINIBAND:
        return "InfiniBand";
    case EPX__DOCTOR_LINK_LAYER_ETHERNET:
        return "Ethernet (RoCE)";
    default:
        return "unknown link layer";
    }
}

/* ---------------------------------------------------------------- PCI nearness */

/* Split a sysfs device path below /sys/devices into components; their count. */
static int pci_components(const char *path, const char *parts[], size_t lengths[], int max)
{
    /* The last "/devices/pci" is where the PCI tree starts (a test tree may sit under
     * a directory that has "devices" in its path too). */
    const char *p = NULL;
    for (const char *hit = strstr(path, "/devices/pci"); hit != NULL; hit = strstr(hit + 1, "/devices/pci"))
        p = hit;
    p = p != NULL ? p + strlen("/devices/") : path;
    int count = 0;
    while (*p != '\0' && count < max) {
        while (*p == '/')
            p++;
        if (*p == '\0')
            break;
        const char *end = strchr(p, '/');
        if (end == NULL)
            end = p + strlen(p);
        parts[count] = p;
        lengths[count] = (size_t)(end - p);
        count++;
        p = end;
    }
    return count;
}

#define PCI_MAX_DEPTH 32

int epx__doctor_pci_common_depth(const char *path_a, const char *path_b)
{
    const char *parts_a[PCI_MAX_DEPTH], *parts_b[PCI_MAX_DEPTH];
    size_t lengths_a[PCI_MAX_DEPTH], lengths_b[PCI_MAX_DEPTH];
    int count_a = pci_components(path_a, parts_a, lengths_a, PCI_MAX_DEPTH);
    int count_b = pci_components(path_b, parts_b, lengths_b, PCI_MAX_DEPTH);
    int depth = 0;
    while (depth < count_a && depth < count_b && lengths_a[depth] == lengths_b[depth] &&
           memcmp(parts_a[depth], parts_b[depth], lengths_a[depth]) == 0)
        depth++;
    return depth;
}

epx__doctor_pci_level_t epx__doctor_pci_level(const char *path_a, const char *path_b)
{
    const char *parts[PCI_MAX_DEPTH];
    size_t lengths[PCI_MAX_DEPTH];
    /* Both must be PCI device paths under a root "pciDDDD:BB". */
    int count_a = pci_components(path_a, parts, lengths, PCI_MAX_DEPTH);
    if (count_a < 2 || strncmp(parts[0], "pci", 3) != 0)
        return EPX__DOCTOR_PCI_UNKNOWN;
    int count_b = pci_components(path_b, parts, lengths, PCI_MAX_DEPTH);
    if (count_b < 2 || strncmp(parts[0], "pci", 3) != 0)
        return EPX__DOCTOR_PCI_UNKNOWN;
    int common = epx__doctor_pci_common_depth(path_a, path_b);
    if (common == 0)
        return EPX__DOCTOR_PCI_SYS;
    if (common == 1)
        return EPX__DOCTOR_PCI_PHB;
    /* Below a shared bridge: one switch (a downstream port, then the device) is PIX. */
    int hops_a = count_a - common, hops_b = count_b - common;
    return hops_a <= 2 && hops_b <= 2 ? EPX__DOCTOR_PCI_PIX : EPX__DOCTOR_PCI_PXB;
}

const char *epx__doctor_pci_level_name(epx__doctor_pci_level_t level)
{
    switch (level) {
    case EPX__DOCTOR_PCI_SYS:
        return "SYS (different PCIe root complexes)";
    case EPX__DOCTOR_PCI_PHB:
        return "PHB (same root complex, through the host bridge)";
    case EPX__DOCTOR_PCI_PXB:
        return "PXB (behind the same PCIe switches)";
    case EPX__DOCTOR_PCI_PIX:
        return "PIX (behind the same PCIe switch)";
    default:
        return "unknown";
    }
}

/* ---------------------------------------------------------------- GPU pairs */

epx__doctor_pair_t epx__doctor_pair_from_nvml(int nvlink_status, int read_status)
{
    if (nvlink_status == 0)
        return EPX__DOCTOR_PAIR_NVLINK;
    if (read_status == 0)
        return EPX__DOCTOR_PAIR_PCIE;
    return EPX__DOCTOR_PAIR_NONE;
}

static const char *pair_word(epx__doctor_pair_t pair)
{
    switch (pair) {
    case EPX__DOCTOR_PAIR_SELF:
        return "X";
    case EPX__DOCTOR_PAIR_NVLINK:
        return "NV";
    case EPX__DOCTOR_PAIR_PCIE:
        return "PCI";
    case EPX__DOCTOR_PAIR_P2P:
        return "P2P";
    default:
        return "-";
    }
}

void epx__doctor_format_pair_matrix(int n, const epx__doctor_pair_t *pairs, char *out,
                                    size_t out_size)
{
    if (out_size == 0)
        return;
    size_t used = 0;
    out[0] = '\0';
#define APPEND(...)                                                                    \
    do {                                                                               \
        if (used < out_size)                                                           \
            used += (size_t)snprintf(out + used, out_size - used, __VA_ARGS__);        \
    } while (0)
    APPEND("%6s", "");
    for (int j = 0; j < n; j++) {
        char label[16];
        snprintf(label, sizeof(label), "GPU%d", j);
        APPEND("%6s", label);
    }
    for (int i = 0; i < n; i++) {
        char label[16];
        snprintf(label, sizeof(label), "GPU%d", i);
        APPEND("\n%6s", label);
        for (int j = 0; j < n; j++)
            APPEND("%6s", pair_word(pairs[i * n + j]));
    }
#undef APPEND
}

/* ---------------------------------------------------------------- sizes, versions */

int epx__doctor_parse_size(const char *text, uint64_t *bytes)
{
    if (text == NULL)
        return 0;
    const char *start = skip_blanks(text);
    if (!isdigit((unsigned char)*start) && !(*start == '.' && isdigit((unsigned char)start[1])))
        return 0;
    char *end = NULL;
    double number = strtod(start, &end);
    if (end == start || !isfinite(number) || number < 0 || *start == '-')
        return 0;
    /* NVSHMEM's rule: one multiplier, and whatever follows it is ignored ("2GB",
     * "20kk" = 20k). A bare number must end there. */
    double scale = 1;
    switch (*end) {
    case 'k': case 'K': scale = 1024.0; break;
    case 'm': case 'M': scale = 1024.0 * 1024; break;
    case 'g': case 'G': scale = 1024.0 * 1024 * 1024; break;
    case 't': case 'T': scale = 1024.0 * 1024 * 1024 * 1024; break;
    default:
        if (*skip_blanks(end) != '\0')
            return 0;
        break;
    }
    double value = number * scale;
    if (value >= 18446744073709551615.0)
        return 0;
    *bytes = (uint64_t)ceil(value); /* NVSHMEM rounds up too */
    return 1;
}

void epx__doctor_format_bytes(uint64_t bytes, char *out, size_t out_size)
{
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    if (bytes < 1024) {
        snprintf(out, out_size, "%llu B", (unsigned long long)bytes);
        return;
    }
    double value = (double)bytes / 1024.0;
    int unit = 0;
    while (value >= 1024.0 && unit < 3) {
        value /= 1024.0;
        unit++;
    }
    snprintf(out, out_size, "%.1f %s", value, units[unit]);
}

int epx__doctor_version_from_filename(const char *filename, char *version, size_t version_size)
{
    const char *so = strstr(filename, ".so.");
    if (so == NULL || !isdigit((unsigned char)so[4]))
        return 0;
    const char *start = so + 4, *end = start;
    while (isdigit((unsigned char)*end) || (*end == '.' && isdigit((unsigned char)end[1])))
        end++;
    copy_trimmed(start, end, version, version_size);
    return 1;
}

/* ---------------------------------------------------------------- bench output */

/* A JSON string at *p (after the opening quote) copied into out; advances *p. */
static int scan_json_string(const char **p, char *out, size_t out_size)
{
    size_t used = 0;
    const char *s = *p;
    while (*s != '\0' && *s != '"') {
        char c = *s++;
        if (c == '\\') {
            if (*s == '\0')
                return 0;
            c = *s++;
            if (c == 'n')
                c = '\n';
            else if (c == 't')
                c = '\t';
            else if (c == 'u') { /* not produced by bench: keep a placeholder */
                for (int i = 0; i < 4 && *s != '\0'; i++)
                    s++;
                c = '?';
            }
        }
        if (used + 1 < out_size)
            out[used++] = c;
    }
    if (*s != '"')
        return 0;
    if (out_size > 0)
        out[used] = '\0';
    *p = s + 1;
    return 1;
}

static void store_string(epx__doctor_bench_row_t *row, const char *key, const char *value)
{
    const char *end = value + strlen(value);
    if (strcmp(key, "op") == 0)
        copy_trimmed(value, end, row->op, sizeof(row->op));
    else if (strcmp(key, "dtype") == 0)
        copy_trimmed(value, end, row->dtype, sizeof(row->dtype));
    else if (strcmp(key, "backend") == 0)
        copy_trimmed(value, end, row->backend, sizeof(row->backend));
    else if (strcmp(key, "check") == 0)
        copy_trimmed(value, end, row->check, sizeof(row->check));
}

static void store_number(epx__doctor_bench_row_t *row, const char *key, double value)
{
    if (strcmp(key, "ranks") == 0)
        row->ranks = (int)value;
    else if (strcmp(key, "median_us") == 0)
        row->median_us = value;
    else if (strcmp(key, "gbps_per_rank") == 0)
        row->gbps_per_rank = value;
    else if (strcmp(key, "floor_us") == 0)
        row->floor_us = value;
    else if (strcmp(key, "floor_over_time") == 0)
        row->floor_over_time = value;
}

int epx__doctor_parse_bench_line(const char *line, epx__doctor_bench_row_t *row)
{
    memset(row, 0, sizeof(*row));
    row->ranks = -1;
    row->median_us = row->gbps_per_rank = row->floor_us = row->floor_over_time = NAN;
    const char *p = strchr(line, '{');
    if (p == NULL)
        return 0;
    p++;
    for (;;) {
        char key[64], text[128];
        p = skip_blanks(p);
        if (*p == '}')
            break;
        if (*p != '"')
            return 0;
        p++;
        if (!scan_json_string(&p, key, sizeof(key)))
            return 0;
        p = skip_blanks(p);
        if (*p != ':')
            return 0;
        p = skip_blanks(p + 1);
        if (*p == '"') {
            p++;
            if (!scan_json_string(&p, text, sizeof(text)))
                return 0;
            store_string(row, key, text);
        } else if (strncmp(p, "null", 4) == 0) {
            p += 4;
        } else if (strncmp(p, "true", 4) == 0 || strncmp(p, "false", 5) == 0) {
            p += *p == 't' ? 4 : 5;
        } else {
            char *end = NULL;
            double value = strtod(p, &end);
            if (end == p)
                return 0;
            store_number(row, key, value);
            p = end;
        }
        p = skip_blanks(p);
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p != '}')
            return 0;
        break;
    }
    return row->op[0] != '\0';
}
