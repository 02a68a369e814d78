/*
 * A group's nodes from its ranks' hosts (src/group_nodes.c): found when nothing gives
 * the node size, checked when config.ranks_per_node or EPX_RANKS_PER_NODE does. Every
 * case is a made-up list of host names, so no second machine is needed.
 */
#include <stdio.h>
#include <string.h>

#include "api.h"
#include "test_util.h"

#define HOST_BYTES 16

/* hosts[r] = the r-th letter of `letters` as a host name ("a", "b", ...). */
static void make_hosts(char (*hosts)[HOST_BYTES], const char *letters)
{
    for (size_t r = 0; r < strlen(letters); r++)
        snprintf(hosts[r], HOST_BYTES, "host-%c", letters[r]);
}

static int nodes(const char *letters, int given, epx_status_t *status)
{
    char hosts[16][HOST_BYTES];
    make_hosts(hosts, letters);
    int per_node = -1;
    *status = epx__group_nodes(hosts[0], HOST_BYTES, (int)strlen(letters), given, &per_node);
    return per_node;
}

static void expect_nodes(const char *letters, int given, int want)
{
    epx_status_t status;
    int got = nodes(letters, given, &status);
    CHECK_OK(status);
    CHECK_EQ_INT(got, want);
}

static void expect_refused(const char *letters, int given, const char *needle)
{
    epx_status_t status;
    (void)nodes(letters, given, &status);
    CHECK_STATUS(status, EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS(needle);
}

int main(void)
{
    /* Nothing given (0): the ranks on each host; hosts with different numbers of ranks,
     * or not host by host: one node, as before host names were looked at (with a warning
     * naming the first rank out of place). Given: virtual nodes inside a host are fine. */
    static const struct {
        const char *hosts;
        int given, want;
    } found[] = {
        {"a", 0, 1},    {"aaaa", 0, 4}, {"aabb", 0, 2}, {"aaabbbccc", 0, 3}, {"abcd", 0, 1},
        {"aaab", 0, 4}, {"aabbb", 0, 5}, {"abab", 0, 4}, {"aabbaa", 0, 6},   {"aaaa", 2, 2},
        {"aaaa", 4, 4}, {"aabb", 2, 2}, {"aabb", 1, 1},
    };
    for (size_t i = 0; i < sizeof(found) / sizeof(found[0]); i++)
        expect_nodes(found[i].hosts, found[i].given, found[i].want);
    /* Given: a node across hosts is refused, naming the ranks and hosts. */
    expect_refused("aabb", 4, "puts rank 2 (host host-b) in one node with rank 0 (host host-a)");
    expect_refused("abab", 2, "puts rank 1 (host host-b) in one node with rank 0 (host host-a)");
    printf("test_group_nodes: ok\n");
    return 0;
}
