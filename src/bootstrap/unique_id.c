/*
 * The rendezvous id: printable text "epx1:<ipv4>:<port>:<nonce>" stored inside
 * epx_unique_id_t, so that it can travel through an environment variable unchanged.
 * The address and port say where rank 0 will listen; the 64-bit random nonce lets
 * rank 0 refuse connections from another run that happens to reach the same port.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bootstrap/bootstrap_impl.h"
#include "core/core.h"

#define ID_PREFIX "epx1:"
#define NONCE_HEX_DIGITS 16

static uint64_t random_nonce(void)
{
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof(nonce), GRND_NONBLOCK) == (ssize_t)sizeof(nonce) && nonce != 0)
        return nonce;
    /* No entropy source (very old kernel, or early boot): the nonce only has to differ
     * between runs, so mix the clock and the process id (splitmix64 finaliser). */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t z = ((uint64_t)now.tv_sec << 32) ^ (uint64_t)now.tv_nsec ^
                 ((uint64_t)getpid() << 16) ^ (uint64_t)(uintptr_t)&now;
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z != 0 ? z : 1;
}

/* Ask the kernel for a port that is free now on `address` (bind to port 0). */
static epx_status_t pick_free_port(struct in_addr address, const char *text, uint16_t *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return EPX_ERROR(EPX_ERR_SYSTEM, "unique id: socket() failed: %s", strerror(errno));
    struct sockaddr_in local = {.sin_family = AF_INET, .sin_port = 0, .sin_addr = address};
    socklen_t length = sizeof(local);
    if (bind(fd, (struct sockaddr *)&local, sizeof(local)) != 0) {
        int saved = errno;
        close(fd);
        return EPX_ERROR(EPX_ERR_SYSTEM,
                         "unique id: cannot bind EPX_BOOTSTRAP_ADDR %s: %s (rank 0 listens "
                         "there, so it must be an address of this host)",
                         text, strerror(saved));
    }
    if (getsockname(fd, (struct sockaddr *)&local, &length) != 0) {
        int saved = errno;
        close(fd);
        return EPX_ERROR(EPX_ERR_SYSTEM, "unique id: getsockname() failed: %s", strerror(saved));
    }
    close(fd);
    *port = ntohs(local.sin_port);
    return EPX_SUCCESS;
}

epx_status_t epx_get_unique_id(epx_unique_id_t *id)
{
    epx__clear_error();
    if (id == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_get_unique_id: id is NULL");
    EPX_CHECK(epx__params_load());

    const char *text = epx__param_string(EPX_PARAM_BOOTSTRAP_ADDR);
    struct in_addr address;
    if (text == NULL || inet_pton(AF_INET, text, &address) != 1)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "unique id: EPX_BOOTSTRAP_ADDR \"%s\" is not an IPv4 address "
                         "(dotted quad, e.g. 10.0.0.1)",
                         text != NULL ? text : "");
    if (address.s_addr == htonl(INADDR_ANY))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "unique id: EPX_BOOTSTRAP_ADDR 0.0.0.0 is not an address other ranks "
                         "can connect to; give this host's address");

    uint16_t port = 0;
    EPX_CHECK(pick_free_port(address, text, &port));

    epx_unique_id_t made;
    memset(&made, 0, sizeof(made));
    char dotted[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &address, dotted, sizeof(dotted));
    snprintf(made.internal, sizeof(made.internal), ID_PREFIX "%s:%u:%016" PRIx64, dotted,
             (unsigned)port, random_nonce());
    EPX_DEBUG(EPX_SUBSYS_BOOTSTRAP, "unique id: %s", made.internal);
    *id = made;
    return EPX_SUCCESS;
}

/* Parse a decimal port 1..65535 from exactly [begin, end). */
static int parse_port(const char *begin, const char *end, uint16_t *port)
{
    if (end == begin || end - begin > 5)
        return 0;
    unsigned value = 0;
    for (const char *p = begin; p < end; p++) {
        if (*p < '0' || *p > '9')
            return 0;
        value = value * 10 + (unsigned)(*p - '0');
    }
    if (value == 0 || value > 65535)
        return 0;
    *port = (uint16_t)value;
    return 1;
}

static int parse_nonce(const char *text, uint64_t *nonce)
{
    if (strlen(text) != NONCE_HEX_DIGITS)
        return 0;
    uint64_t value = 0;
    for (const char *p = text; *p != '\0'; p++) {
        int digit;
        if (*p >= '0' && *p <= '9')
            digit = *p - '0';
        else if (*p >= 'a' && *p <= 'f')
            digit = *p - 'a' + 10;
        else if (*p >= 'A' && *p <= 'F')
            digit = *p - 'A' + 10;
        else
            return 0;
        value = (value << 4) | (uint64_t)digit;
    }
    *nonce = value;
    return 1;
}

epx_status_t epx__unique_id_parse(const char *text, epx__unique_id_fields_t *fields)
{
    size_t length = strnlen(text, EPX_UNIQUE_ID_BYTES);
    if (length == EPX_UNIQUE_ID_BYTES)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "unique id: text is longer than %d characters",
                         EPX_UNIQUE_ID_BYTES - 1);
    if (strncmp(text, ID_PREFIX, strlen(ID_PREFIX)) != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "unique id: \"%s\" does not start with \"" ID_PREFIX
                         "\" (expected epx1:<ipv4>:<port>:<16 hex digits>)",
                         text);

    const char *address_text = text + strlen(ID_PREFIX);
    const char *port_text = strchr(address_text, ':');
    const char *nonce_text = port_text != NULL ? strchr(port_text + 1, ':') : NULL;
    if (port_text == NULL || nonce_text == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "unique id: \"%s\" lacks a field (expected "
                         "epx1:<ipv4>:<port>:<16 hex digits>)",
                         text);

    char address_copy[INET_ADDRSTRLEN];
    size_t address_length = (size_t)(port_text - address_text);
    epx__unique_id_fields_t parsed;
    if (address_length == 0 || address_length >= sizeof(address_copy))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "unique id: address in \"%s\" is not IPv4", text);
    memcpy(address_copy, address_text, address_length);
    address_copy[address_length] = '\0';
    if (inet_pton(AF_INET, address_copy, &parsed.address) != 1)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "unique id: address \"%s\" is not IPv4",
                         address_copy);
    if (!parse_port(port_text + 1, nonce_text, &parsed.port))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "unique id: port in \"%s\" is not a number from 1 to 65535", text);
    if (!parse_nonce(nonce_text + 1, &parsed.nonce))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "unique id: nonce \"%s\" is not %d hex digits", nonce_text + 1,
                         NONCE_HEX_DIGITS);
    *fields = parsed;
    return EPX_SUCCESS;
}

epx_status_t epx_unique_id_to_string(const epx_unique_id_t *id, char *text, size_t text_size)
{
    epx__clear_error();
    if (id == NULL || text == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_unique_id_to_string: %s is NULL",
                         id == NULL ? "id" : "text");
    epx__unique_id_fields_t fields;
    EPX_CHECK(epx__unique_id_parse(id->internal, &fields));
    size_t length = strlen(id->internal);
    if (text_size < length + 1)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "epx_unique_id_to_string: text_size %zu is too small (need %zu)",
                         text_size, length + 1);
    memcpy(text, id->internal, length + 1);
    return EPX_SUCCESS;
}

epx_status_t epx_unique_id_from_string(const char *text, epx_unique_id_t *id)
{
    epx__clear_error();
    if (text == NULL || id == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "epx_unique_id_from_string: %s is NULL",
                         text == NULL ? "text" : "id");
    epx__unique_id_fields_t fields;
    EPX_CHECK(epx__unique_id_parse(text, &fields));
    epx_unique_id_t parsed;
    memset(&parsed, 0, sizeof(parsed));
    memcpy(parsed.internal, text, strlen(text) + 1);
    *id = parsed;
    return EPX_SUCCESS;
}
