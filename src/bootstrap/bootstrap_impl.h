/*
 * Inside the bootstrap: the common object, the small vtable each kind (TCP, caller
 * callbacks) fills in, and the parsed form of a unique id. Only src/bootstrap/ includes
 * this; the rest of the library sees bootstrap.h.
 */
#ifndef EPX_BOOTSTRAP_IMPL_H
#define EPX_BOOTSTRAP_IMPL_H

#include <netinet/in.h>
#include <stdint.h>

#include "bootstrap/bootstrap.h"

typedef struct {
    const char *name;
    /* `stage` ("allgather", "barrier") only labels error messages. */
    epx_status_t (*allgather)(epx__bootstrap_t *bootstrap, const void *send, void *recv,
                              size_t bytes, const char *stage);
    epx_status_t (*barrier)(epx__bootstrap_t *bootstrap);
    void (*destroy)(epx__bootstrap_t *bootstrap);
} epx__bootstrap_kind_t;

struct epx__bootstrap {
    const epx__bootstrap_kind_t *kind;
    int rank;
    int world_size;
    void *impl; /* the kind's own state */
    /*
     * A collective that failed leaves the ranks out of step (some may have finished it,
     * some not), so every later call returns the first failure instead of mixing one
     * exchange's bytes into the next.
     */
    epx_status_t failed;
    char failed_message[512];
};

/* Allocate the common object (impl set by the caller); NULL on out of memory. */
epx__bootstrap_t *epx__bootstrap_new(const epx__bootstrap_kind_t *kind, int rank,
                                     int world_size, void *impl);

/* The fields of an id's text "epx1:<ipv4>:<port>:<nonce hex>". */
typedef struct {
    struct in_addr address;
    uint16_t port; /* host byte order */
    uint64_t nonce;
} epx__unique_id_fields_t;

/* Parse and validate; errors are EPX_ERR_INVALID_ARG naming the bad part. */
epx_status_t epx__unique_id_parse(const char *text, epx__unique_id_fields_t *fields);

#endif /* EPX_BOOTSTRAP_IMPL_H */
