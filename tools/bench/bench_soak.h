/*
 * `epx bench --soak DURATION`: the stability check (bench_soak*.c). Round after round
 * with a fresh random shape inside the buffer's limits, a sample of them checked
 * bit-exactly against the oracle, while each time window's latency percentiles, the
 * memory in use and the failures are reported, then a summary.
 *
 * Files: bench_soak.c (options, schedule, windows, memory, fault injection, report),
 * bench_soak_normal.c and bench_soak_ll.c (one round of each mode), bench_soak_rejoin.c
 * (starting the replacement of a killed rank, and its group).
 */
#ifndef EPX_TOOLS_BENCH_SOAK_H
#define EPX_TOOLS_BENCH_SOAK_H

#include <stdint.h>

#include "bench_memory.h"
#include "epx.h"
#include "moe_case.h"

typedef enum {
    EPX__SOAK_INJECT_NONE = 0,
    EPX__SOAK_INJECT_KILL = 1, /* the rank SIGKILLs itself */
    EPX__SOAK_INJECT_STOP = 2, /* the rank stops answering (alive, silent) to the end */
} epx__soak_inject_t;

/* Room for a unique id as text (epx_unique_id_to_string). */
#define EPX__SOAK_ID_BYTES (2 * EPX_UNIQUE_ID_BYTES + 64)

typedef struct {
    double duration_s;   /* 0 = no soak */
    double window_s;     /* 0 = 60 s, or a tenth of a shorter soak */
    int check_every;     /* check one round in N (1 = every round) */
    int run_normal;      /* rounds of normal mode */
    int run_ll;          /* rounds of low-latency mode */
    int64_t ll_tokens;   /* the buffer's max_low_latency_tokens (M) */
    epx__soak_inject_t inject;
    int inject_rank;
    double inject_at_s;  /* seconds after the soak started */
    /* --rejoin-after: with --inject kill, a replacement rejoins this long after the kill
     * (0 = none; CPU backend). */
    double rejoin_after_s;
    /* --soak-rejoin ID (set by the soak itself): this process is that replacement, and
     * ID the unique id of the rejoin's group. */
    char rejoin_id[EPX__SOAK_ID_BYTES];
} epx__soak_options_t;

#define EPX__SOAK_OPTIONS_INIT {0, 0, 4, 1, 1, 128, EPX__SOAK_INJECT_NONE, -1, 0, 0, ""}

/*
 * Match a soak flag at argv[*index] (advancing *index past its value): 1 when matched,
 * 0 when the flag is not a soak flag, -1 after printing why its value is bad.
 */
int epx__soak_match(int argc, char **argv, int *index, epx__soak_options_t *soak);

/* The soak's lines of `epx bench --help`. */
extern const char epx__soak_usage[];

/* The ops timed, one latency series each. */
typedef enum {
    EPX__SOAK_DISPATCH = 0,        /* epx_dispatch, fresh */
    EPX__SOAK_CACHED_DISPATCH = 1, /* epx_dispatch with the handle */
    EPX__SOAK_COMBINE = 2,         /* epx_combine */
    EPX__SOAK_LL_DISPATCH = 3,     /* epx_ll_dispatch (+ its receive when split) */
    EPX__SOAK_LL_COMBINE = 4,      /* epx_ll_combine (+ its receive when split) */
    EPX__SOAK_OP_COUNT = 5,
} epx__soak_op_t;

const char *epx__soak_op_name(epx__soak_op_t op);

/* What one rank's round did. */
typedef struct {
    double us[EPX__SOAK_OP_COUNT]; /* latency of each op that ran */
    int ran[EPX__SOAK_OP_COUNT];
    int checked;      /* compared with the oracle */
    int mismatches;   /* comparisons that failed (the first difference is printed) */
    int peer_losses;  /* low-latency calls that lost a peer (masked, step completed) */
    double detect_us; /* the first such call's duration: how long detection took */
    int failed;       /* an unexpected failure: the soak stops (message printed) */
} epx__soak_round_t;

/* Everything a round needs, made once by the soak (bench_soak.c). */
typedef struct {
    epx_group_t group;
    epx_buffer_t buffer;
    epx__bench_device_t *device;
    int rank;
    int world;
    int ranks_per_node; /* the group's: combine sums node by node across nodes */
    int cuda;
    int64_t max_tokens;    /* normal mode: the buffer's max_tokens_per_rank */
    int64_t ll_tokens;     /* low-latency mode: M, 0 = off */
    int64_t hidden;
    int experts;
    int topk;
    epx_dtype_t ll_dtype;  /* the buffer's low_latency_dtype */
    int ll_combine_x;      /* combine_x also holds a low-latency [L, M * R, hidden] x */
    /* The ranks meet at a host barrier before each timed op, so an op's latency is the op
     * (plus the ranks' launch skew), not a peer's host work (drawing inputs, checking)
     * before it. Off once a fault was injected: the rendezvous may be gone. */
    int synced;
    /* Backend memory sized for the largest round, reused by every round. */
    void *x, *x_scales, *topk_idx, *topk_weights, *combine_x, *out_x;
} epx__soak_t;

/*
 * The rejoin's process plumbing (bench_soak_rejoin.c). epx__soak_fork_victim: in the
 * victim's launched process, fork the victim; the parent never returns (it waits, starts
 * the replacement if the victim reported a group id, and exits with its status); the
 * child returns the pipe to report on (-1 without --rejoin-after).
 * epx__soak_report_rejoin: the victim, just before it dies, reports the group id.
 * epx__soak_rejoin_group: the rejoin's group from that id, trying again on a timeout
 * until `wait_s` seconds have passed (0 = once).
 */
int epx__soak_fork_victim(const epx__soak_options_t *so);
void epx__soak_report_rejoin(int fd, const char *id);
epx_status_t epx__soak_rejoin_group(const char *id, int rank, int world, double wait_s,
                                    epx_group_t *group);

/* One normal-mode round (bench_soak_normal.c); `seed` fixes its shape on every rank. */
void epx__soak_normal_round(epx__soak_t *soak, uint64_t seed, int check, epx__soak_round_t *out);
/* One low-latency round (bench_soak_ll.c). */
void epx__soak_ll_round(epx__soak_t *soak, uint64_t seed, int check, epx__soak_round_t *out);

/* Deterministic random numbers of a round: the same on every rank. */
uint64_t epx__soak_random(uint64_t *state);
/* Uniform in 0..bound-1. */
int64_t epx__soak_below(uint64_t *state, int64_t bound);

/*
 * The draws that end a round's shape in both modes, in this order: the case's seed, its
 * routing (a repeated expert only with top-k >= 2), a drop fraction from drops[0..count-1]
 * and, one round in eight, a rank that passes no tokens.
 */
void epx__soak_draw_routing(uint64_t *state, int world, const double *drops, int count,
                            moe_case_t *c);

/*
 * A round's inputs into the soak's backend memory: `x_bytes` of x, `scale_bytes` of
 * x_scales (none when 0), then topk_idx and topk_weights of `in` (c's tokens and top-k).
 */
epx_status_t epx__soak_copy_inputs(epx__soak_t *soak, const moe_case_t *c, const moe_inputs_t *in,
                                   size_t x_bytes, size_t scale_bytes);

/* Mark two device/host timestamps around an op; the op's duration in us. */
void epx__soak_mark(epx__soak_t *soak, int index);
/* Before a timed op: the barrier when synced, then the first timestamp. */
void epx__soak_start_op(epx__soak_t *soak);
double epx__soak_elapsed_us(epx__soak_t *soak);


#endif /* EPX_TOOLS_BENCH_SOAK_H */
