/*
 * The registry of live objects (see objects.h): an open-addressing hash set of pointers
 * with their kinds, and a ring of destroyed objects waiting to be freed.
 */
#include "core/objects.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/core.h"

/* Destroyed objects kept before free(): enough that a handle destroyed this step is not
 * reused by the next thousand dispatches. At most a few hundred kilobytes. */
#define EPX__QUARANTINE 1024

/* A slot that held an object: lookups continue past it, inserts may reuse it. */
#define EPX__TOMBSTONE ((uintptr_t)1)

typedef struct {
    uintptr_t key; /* 0 = empty, EPX__TOMBSTONE = removed, else the object's address */
    int kind;
} entry_t;

static pthread_mutex_t registry_mutex = PTHREAD_MUTEX_INITIALIZER;
static entry_t *table;
static size_t capacity; /* a power of two, or 0 before the first add */
static size_t used;     /* live entries and tombstones */
static size_t live;
static void *quarantine[EPX__QUARANTINE];
static size_t quarantine_next;

static size_t slot_of(uintptr_t key)
{
    /* Objects come from malloc (16-byte aligned): mix the high bits in. */
    uint64_t h = (uint64_t)key * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (capacity - 1);
}

/* The entry holding `key`, or NULL. Caller holds the mutex. */
static entry_t *find(uintptr_t key)
{
    if (capacity == 0)
        return NULL;
    for (size_t i = slot_of(key), probes = 0; probes < capacity; i = (i + 1) & (capacity - 1), probes++) {
        if (table[i].key == key)
            return &table[i];
        if (table[i].key == 0)
            return NULL;
    }
    return NULL;
}

/* Rehash into a table of `new_capacity` slots (drops tombstones). */
static int resize(size_t new_capacity)
{
    entry_t *fresh = calloc(new_capacity, sizeof(*fresh));
    if (fresh == NULL)
        return -1;
    entry_t *old = table;
    size_t old_capacity = capacity;
    table = fresh;
    capacity = new_capacity;
    used = live;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].key == 0 || old[i].key == EPX__TOMBSTONE)
            continue;
        size_t j = slot_of(old[i].key);
        while (table[j].key != 0)
            j = (j + 1) & (capacity - 1);
        table[j] = old[i];
    }
    free(old);
    return 0;
}

epx_status_t epx__object_add(epx__object_kind_t kind, const void *object)
{
    uintptr_t key = (uintptr_t)object;
    pthread_mutex_lock(&registry_mutex);
    /* Keep at most half the slots used, so probes stay short. */
    if ((used + 1) * 2 > capacity &&
        resize(capacity == 0 ? 64 : (live + 1) * 4 > capacity ? capacity * 2 : capacity) != 0) {
        pthread_mutex_unlock(&registry_mutex);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "out of memory for the registry of live objects");
    }
    size_t i = slot_of(key);
    while (table[i].key != 0 && table[i].key != EPX__TOMBSTONE && table[i].key != key)
        i = (i + 1) & (capacity - 1);
    if (table[i].key != key) {
        if (table[i].key == 0)
            used++;
        live++;
    }
    table[i].key = key;
    table[i].kind = (int)kind;
    pthread_mutex_unlock(&registry_mutex);
    return EPX_SUCCESS;
}

int epx__object_remove(epx__object_kind_t kind, const void *object)
{
    pthread_mutex_lock(&registry_mutex);
    entry_t *entry = object != NULL ? find((uintptr_t)object) : NULL;
    int was_live = entry != NULL && entry->kind == (int)kind;
    if (was_live) {
        entry->key = EPX__TOMBSTONE;
        entry->kind = 0;
        live--;
    }
    pthread_mutex_unlock(&registry_mutex);
    return was_live;
}

static const char *kind_name(epx__object_kind_t kind)
{
    switch (kind) {
    case EPX__OBJECT_GROUP:
        return "group";
    case EPX__OBJECT_BUFFER:
        return "buffer";
    case EPX__OBJECT_HANDLE:
        return "handle";
    }
    return "object";
}

int epx__object_live(epx__object_kind_t kind, const void *object)
{
    if (object == NULL)
        return 0;
    pthread_mutex_lock(&registry_mutex);
    const entry_t *entry = find((uintptr_t)object);
    int live = entry != NULL && entry->kind == (int)kind;
    pthread_mutex_unlock(&registry_mutex);
    return live;
}

epx_status_t epx__object_check(epx__object_kind_t kind, const void *object, const char *op,
                               const char *name)
{
    if (object == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s is NULL", op, name);
    if (!epx__object_live(kind, object))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: %s %p is not a live epx %s (destroyed already, or never made by "
                         "epx)",
                         op, name, object, kind_name(kind));
    return EPX_SUCCESS;
}

void epx__object_retire(void *object)
{
    if (object == NULL)
        return;
    pthread_mutex_lock(&registry_mutex);
    void *oldest = quarantine[quarantine_next];
    quarantine[quarantine_next] = object;
    quarantine_next = (quarantine_next + 1) % EPX__QUARANTINE;
    pthread_mutex_unlock(&registry_mutex);
    free(oldest);
}
