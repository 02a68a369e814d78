/*
 * Device memory of handles: fixed-size slots, reused (see cuda_backend.h).
 *
 * A slot goes back to the free list when its handle is destroyed. Work already queued
 * on the stream that still reads it (a combine) runs before any later dispatch on that
 * stream can reuse it, the same stream-order rule every CUDA allocator caching memory
 * relies on.
 */
#include <pthread.h>
#include <stdlib.h>

#include "ops/cuda/cuda_backend.h"

struct epx__cuda_pool {
    pthread_mutex_t lock;
    int refs;
    int device;
    size_t slot_bytes;
    void **slots; /* every slot ever allocated */
    int num_slots;
    int capacity;
    void **free_slots;
    int num_free;
};

/* Allocate one more slot and put it on the free list (lock held). */
static epx_status_t grow(epx__cuda_pool_t *pool)
{
    if (pool->num_slots == pool->capacity) {
        int capacity = pool->capacity > 0 ? pool->capacity * 2 : 8;
        void **slots = realloc(pool->slots, (size_t)capacity * sizeof(void *));
        if (slots != NULL)
            pool->slots = slots;
        void **free_slots = realloc(pool->free_slots, (size_t)capacity * sizeof(void *));
        if (free_slots != NULL)
            pool->free_slots = free_slots;
        if (slots == NULL || free_slots == NULL)
            return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "dispatch: out of host memory for handles");
        pool->capacity = capacity;
    }
    void *slot = NULL;
    EPX_CUDA_CHECK(cudaMalloc(&slot, pool->slot_bytes),
                   "dispatch: cudaMalloc of %zu bytes for a handle's routing", pool->slot_bytes);
    pool->slots[pool->num_slots++] = slot;
    pool->free_slots[pool->num_free++] = slot;
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_pool_create(int device, size_t slot_bytes, int preallocate,
                                   epx__cuda_pool_t **out)
{
    epx__cuda_pool_t *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    pthread_mutex_init(&pool->lock, NULL);
    pool->refs = 1;
    pool->device = device;
    pool->slot_bytes = slot_bytes;
    for (int i = 0; i < preallocate; i++) {
        epx_status_t status = grow(pool);
        if (status != EPX_SUCCESS) {
            epx__cuda_pool_release(pool);
            return status;
        }
    }
    *out = pool;
    return EPX_SUCCESS;
}

void *epx__cuda_pool_get(epx__cuda_pool_t *pool)
{
    void *slot = NULL;
    pthread_mutex_lock(&pool->lock);
    if (pool->num_free > 0 || grow(pool) == EPX_SUCCESS)
        slot = pool->free_slots[--pool->num_free];
    pthread_mutex_unlock(&pool->lock);
    return slot;
}

void epx__cuda_pool_put(epx__cuda_pool_t *pool, void *slot)
{
    pthread_mutex_lock(&pool->lock);
    /* Capacity always covers every slot, so the free list cannot overflow. */
    pool->free_slots[pool->num_free++] = slot;
    pthread_mutex_unlock(&pool->lock);
}

void epx__cuda_pool_retain(epx__cuda_pool_t *pool)
{
    pthread_mutex_lock(&pool->lock);
    pool->refs++;
    pthread_mutex_unlock(&pool->lock);
}

void epx__cuda_pool_release(epx__cuda_pool_t *pool)
{
    if (pool == NULL)
        return;
    pthread_mutex_lock(&pool->lock);
    int refs = --pool->refs;
    pthread_mutex_unlock(&pool->lock);
    if (refs > 0)
        return;
    int current = -1;
    (void)cudaGetDevice(&current);
    (void)cudaSetDevice(pool->device);
    for (int i = 0; i < pool->num_slots; i++)
        (void)cudaFree(pool->slots[i]);
    if (current >= 0)
        (void)cudaSetDevice(current);
    (void)cudaGetLastError();
    pthread_mutex_destroy(&pool->lock);
    free(pool->slots);
    free(pool->free_slots);
    free(pool);
}
