/*
 * The registry of live library objects (groups, buffers, handles).
 *
 * The public API hands out plain pointers, so a caller can pass one after destroying
 * it. Reading a destroyed object to find out would itself be a use-after-free, so the
 * library never looks inside a pointer it has not first found here: every entry point
 * checks its object arguments against this set of live pointers (a hash set under a
 * mutex) and refuses the others with EPX_ERR_INVALID_ARG. Destroyed objects are not
 * returned to the allocator at once but kept in a bounded quarantine, so the address of
 * a recently destroyed object is not handed out again for a new one (which would make a
 * stale pointer look live).
 */
#ifndef EPX_OBJECTS_H
#define EPX_OBJECTS_H

#include "epx.h"

typedef enum {
    EPX__OBJECT_GROUP = 1,
    EPX__OBJECT_BUFFER = 2,
    EPX__OBJECT_HANDLE = 3,
} epx__object_kind_t;

/* Record a new object as live. EPX_ERR_OUT_OF_MEMORY if the set cannot grow. */
epx_status_t epx__object_add(epx__object_kind_t kind, const void *object);

/*
 * Forget a live object (on destroy). Returns 1 if it was live with this kind, else 0
 * (then nothing changes: a second destroy is detected, not performed).
 */
int epx__object_remove(epx__object_kind_t kind, const void *object);

/*
 * Check an argument of entry point `op`: EPX_SUCCESS when `object` is live with this
 * kind; otherwise EPX_ERR_INVALID_ARG with "op: <name> is NULL" or "op: <name> is not a
 * live epx <kind> (destroyed already, or never made by epx)".
 */
epx_status_t epx__object_check(epx__object_kind_t kind, const void *object, const char *op,
                               const char *name);

/* 1 when `object` is live with this kind, else 0; records no error. */
int epx__object_live(epx__object_kind_t kind, const void *object);

/*
 * Free the memory of an object already removed: it waits in the quarantine first and
 * is freed (with free()) when newer ones push it out.
 */
void epx__object_retire(void *object);

#endif /* EPX_OBJECTS_H */
