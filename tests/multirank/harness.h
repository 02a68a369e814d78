/*
 * Shared pieces of the multi-rank test programs: command-line flags, the group, a forked
 * rank's environment, copying result tensors back to the host, and bf16 comparison.
 */
#ifndef EPX_MULTIRANK_HARNESS_H
#define EPX_MULTIRANK_HARNESS_H

#include <stdint.h>

#include "epx.h"

/* Value of `--name VALUE` (or `--name=VALUE`), or `fallback` when absent. */
const char *mr_flag(int argc, char **argv, const char *name, const char *fallback);
/* The backend named by `--backend host|cuda|auto` (default auto); exits on a bad name. */
epx_backend_t mr_backend_flag(int argc, char **argv);

/* epx_group_create_from_env with the flag's backend, then mr_mem_init. */
epx_group_t mr_group_create(int argc, char **argv, epx_group_info_t *info);

/*
 * Copy the first `rows` rows of a 2-d result tensor (host or device memory, rows
 * possibly strided) into contiguous host memory at `dst`.
 */
void mr_tensor_to_host(const epx_tensor_t *tensor, int64_t rows, void *dst);

/*
 * Distance in bf16 steps between two bf16 values (0 = identical, 1 = one ulp apart);
 * +0 and -0 are the same value.
 */
int64_t mr_bf16_ulps(uint16_t a, uint16_t b);

/*
 * Does `message` name rank `rank`: "rank 3", "ranks 1, 3" or "rank(s) 3"? A number
 * must stand alone ("rank 13" does not name rank 3).
 */
int mr_message_names_rank(const char *message, int rank);

/* Monotonic clock in milliseconds. */
double mr_now_ms(void);

/*
 * In a forked child about to exec a rank: the environment `epx launch` gives rank `rank`
 * of `world` on one machine (EPX_RANK, EPX_LOCAL_RANK, EPX_WORLD_SIZE), and the group's
 * EPX_UNIQUE_ID.
 */
void mr_set_rank_env(int rank, int world, const char *unique_id);

#endif /* EPX_MULTIRANK_HARNESS_H */
