/*
 * One low-latency round of the soak (bench_soak.h): a dispatch and a combine of one
 * step, each whole or split into its EPX_LL_SEND_ONLY send and epx_ll_receive, with a
 * shape drawn for the round: tokens 0..M, routing uniform, home-rank first, all to one
 * expert (a crowded expert: more than M rows) or with a repeated expert, a fraction of
 * -1 entries, and the cast (bf16, fp8, fp8 with power-of-two scales, UE8M0 scales) the
 * buffer allows. The combine reads the expert outputs from the zero-copy buffer or a
 * separate tensor. A checked round compares everything with the oracle
 * (tests/common/moe_ll.h) bit for bit, with the ranks masked so far left out.
 *
 * A call that loses a peer (EPX_ERR_TIMEOUT / EPX_ERR_REMOTE) has masked it and
 * completed the step without it (include/epx.h): the round counts the loss, keeps its
 * duration as the detection time and goes on; its results are not checked, since which
 * of the lost rank's rows arrived depends on when it died.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_soak.h"
#include "common/tool.h"
#include "moe_ll.h"

typedef struct {
    epx__soak_t *soak;
    moe_case_t c;
    moe_ll_cast_t cast;
    moe_inputs_t in;
    int num_local;
    int64_t rows; /* M * R */
    uint8_t *mask; /* [R] masked before this round */
    char label[64];
} ll_round_t;

static void draw_shape(ll_round_t *r, uint64_t seed)
{
    epx__soak_t *soak = r->soak;
    uint64_t state = seed;
    moe_case_t *c = &r->c;
    memset(c, 0, sizeof(*c));
    c->world_size = soak->world;
    c->num_tokens = epx__soak_below(&state, 4) == 0 ? soak->ll_tokens
                                                     : epx__soak_below(&state, soak->ll_tokens + 1);
    c->hidden = soak->hidden;
    c->num_experts = soak->experts;
    c->num_topk = soak->topk;
    c->dtype = EPX_DTYPE_BF16;
    c->expert_alignment = 1;
    static const double drops[] = {0.0, 0.0, 0.2, 0.5};
    epx__soak_draw_routing(&state, soak->world, drops, 4, c);
    /* Casts the buffer takes: fp8 only when its rows are sized for fp8. */
    int fp8_ok = soak->hidden % 128 == 0;
    int kinds = soak->ll_dtype == EPX_DTYPE_FP8_E4M3 ? 3 : fp8_ok ? 4 : 1;
    int kind = (int)epx__soak_below(&state, kinds) + (soak->ll_dtype == EPX_DTYPE_FP8_E4M3);
    r->cast = (moe_ll_cast_t){kind >= 1, kind >= 2, kind >= 3 && soak->hidden % 512 == 0};
    r->num_local = soak->experts / soak->world;
    r->rows = soak->ll_tokens * soak->world;
    snprintf(r->label, sizeof(r->label), "soak rank %d ll %s", soak->rank,
             !r->cast.use_fp8 ? "bf16" : r->cast.use_ue8m0 ? "fp8 ue8m0"
                                        : r->cast.round_scale ? "fp8 pow2" : "fp8");
}

/* Device or host memory at `offset` bytes of `base`, `bytes` long, into new host memory. */
static void *copy_out(ll_round_t *r, const void *base, size_t offset, size_t bytes)
{
    void *host = malloc(bytes > 0 ? bytes : 1);
    if (host != NULL && bytes > 0 &&
        epx__bench_copy_rows_out(r->soak->device, host, (const char *)base + offset, 1, bytes,
                                 bytes) != EPX_SUCCESS) {
        free(host);
        return NULL;
    }
    return host;
}

/* The dispatch results against the oracle; fills count/src/range for the combine. */
static int check_dispatch(ll_round_t *r, const epx_ll_dispatch_result_t *got,
                          const moe_ll_expected_t *e, int32_t *count, int32_t *src,
                          int64_t *range)
{
    int L = r->num_local, R = r->soak->world;
    int64_t hidden = r->c.hidden, rows = r->rows;
    int32_t *c = copy_out(r, got->recv_count.data, 0, (size_t)L * 4);
    int32_t *s = copy_out(r, got->recv_src_info.data, 0, (size_t)(L * rows) * 4);
    int64_t *g = copy_out(r, got->recv_layout_range.data, 0, (size_t)(L * R) * 8);
    int ok = c != NULL && s != NULL && g != NULL;
    if (ok) {
        memcpy(count, c, (size_t)L * 4);
        memcpy(src, s, (size_t)(L * rows) * 4);
        memcpy(range, g, (size_t)(L * R) * 8);
        ok = epx__bench_compare(r->label, "ll recv_count", EPX_DTYPE_INT32, c, e->count, 1, L) &&
             epx__bench_compare(r->label, "ll recv_layout_range", EPX_DTYPE_INT64, g, e->range, L,
                                R);
    }
    size_t element = r->cast.use_fp8 ? 1 : 2;
    int64_t groups = hidden / (r->cast.use_ue8m0 ? 512 : 128);
    for (int l = 0; l < L && ok; l++) {
        int64_t n = e->count[l];
        size_t first = (size_t)(l * rows);
        ok = epx__bench_compare(r->label, "ll recv_src_info", EPX_DTYPE_INT32, s + first,
                                e->src_token + first, 1, n);
        void *x = copy_out(r, got->recv_x.data, first * (size_t)hidden * element,
                           (size_t)(n * hidden) * element);
        ok = ok && x != NULL &&
             epx__bench_compare(r->label, "ll recv_x",
                                r->cast.use_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, x,
                                (const char *)e->x + first * (size_t)hidden * element, n, hidden);
        free(x);
        if (!ok || !r->cast.use_fp8)
            continue;
        if (r->cast.use_ue8m0) {
            /* The oracle's fp32 power-of-two scales as the exponent bytes epx packs. */
            uint8_t *want = malloc((size_t)(n * groups * 4) + 1);
            uint8_t *have = copy_out(r, got->recv_x_scales.data, first * (size_t)groups * 4,
                                     (size_t)(n * groups) * 4);
            ok = want != NULL && have != NULL;
            for (int64_t i = 0; ok && i < n * groups * 4; i++) {
                uint32_t bits;
                memcpy(&bits, e->scales + first * (size_t)(hidden / 128) + i, 4);
                want[i] = (uint8_t)((bits >> 23) & 0xff);
            }
            ok = ok && epx__bench_compare(r->label, "ll recv_x_scales (ue8m0)", EPX_DTYPE_BOOL,
                                          have, want, n, groups * 4);
            free(want);
            free(have);
        } else {
            float *have = copy_out(r, got->recv_x_scales.data, first * (size_t)groups * 4,
                                   (size_t)(n * groups) * 4);
            ok = have != NULL && epx__bench_compare(r->label, "ll recv_x_scales", EPX_DTYPE_FP32,
                                                    have, e->scales + first * (size_t)groups, n,
                                                    groups);
            free(have);
        }
    }
    free(c);
    free(s);
    free(g);
    return ok;
}

/* The expert outputs of the received rows into `x` ([L][M * R][hidden] bf16). */
static epx_status_t write_expert_outputs(ll_round_t *r, void *x, const int32_t *count,
                                         const int32_t *src, const int64_t *range)
{
    int L = r->num_local, R = r->soak->world;
    int64_t hidden = r->c.hidden, rows = r->rows;
    uint16_t *row = malloc((size_t)(rows > 0 ? rows : 1) * (size_t)hidden * 2);
    if (row == NULL)
        return epx__tool_error(EPX_ERR_OUT_OF_MEMORY, "soak: out of memory for expert outputs");
    epx_status_t status = EPX_SUCCESS;
    for (int l = 0; l < L && status == EPX_SUCCESS; l++) {
        for (int s = 0; s < R; s++) {
            int64_t begin = (int64_t)((uint64_t)range[l * R + s] >> 32);
            int64_t n = range[l * R + s] & 0xffffffff;
            for (int64_t i = begin; i < begin + n && i < count[l]; i++)
                moe_ll_expert_row(&r->c, (int64_t)r->soak->rank * L + l, s, src[l * rows + i],
                                  row + i * hidden);
        }
        status = epx__bench_copy_in(r->soak->device, (char *)x + (size_t)(l * rows * hidden) * 2,
                                    row, (size_t)(count[l] * hidden) * 2);
    }
    free(row);
    return status;
}

/* One lost peer in this round; the first one's call duration is the detection time. */
static void count_loss(epx__soak_round_t *out, double us)
{
    if (out->peer_losses++ == 0)
        out->detect_us = us;
}

/* A low-latency call's status: a lost peer is counted, anything else fails the round. */
static int sort_status(epx__soak_round_t *out, int rank, epx_status_t status, double us,
                       const char *what)
{
    if (status == EPX_SUCCESS)
        return 1;
    if (status == EPX_ERR_TIMEOUT || status == EPX_ERR_REMOTE) {
        count_loss(out, us);
        fprintf(stderr, "epx bench: soak: rank %d: %s lost a peer after %.0f us (masked, the "
                        "step goes on): %s\n",
                rank, what, us, epx__tool_error_text());
        return 1;
    }
    fprintf(stderr, "epx bench: soak: rank %d: %s failed: %s: %s\n", rank, what,
            epx_status_name(status), epx__tool_error_text());
    out->failed = 1;
    return 0;
}

/*
 * A loss the call's status does not show: on the GPU a wait that times out masks the
 * rank on the device and reports it through epx_get_async_error, while the call itself
 * (asynchronous) returned success. After the op's stream was synchronised (its timing
 * read), a rank masked now and not before is a loss of this op: counted as one, and the
 * step is not checked. `mask32` holds the mask before the op and is brought up to date.
 */
static void note_new_mask(ll_round_t *r, epx__soak_round_t *out, int32_t *mask32, double us,
                          const char *what)
{
    epx__soak_t *soak = r->soak;
    int R = soak->world;
    int32_t *now = calloc((size_t)R, sizeof(int32_t));
    if (now == NULL || epx_ll_get_masked(soak->buffer, now, R) != EPX_SUCCESS) {
        free(now);
        return;
    }
    for (int i = 0; i < R; i++) {
        if (now[i] && !mask32[i]) {
            count_loss(out, us);
            fprintf(stderr, "epx bench: soak: rank %d: %s lost rank %d after %.0f us (masked on "
                            "the device, the step goes on)\n",
                    soak->rank, what, i, us);
        }
        mask32[i] = now[i];
    }
    free(now);
}

/* Send (and receive, when split) one op, timed from the send to the end of the receive. */
static epx_status_t receive_if_split(epx__soak_t *soak, epx_ll_handle_t handle, int split,
                                     epx_status_t sent)
{
    if (!split || (sent != EPX_SUCCESS && sent != EPX_ERR_TIMEOUT && sent != EPX_ERR_REMOTE))
        return sent;
    epx_status_t received = epx_ll_receive(soak->buffer, handle, soak->device->stream);
    return received != EPX_SUCCESS ? received : sent;
}

void epx__soak_ll_round(epx__soak_t *soak, uint64_t seed, int check, epx__soak_round_t *out)
{
    ll_round_t r;
    memset(&r, 0, sizeof(r));
    r.soak = soak;
    draw_shape(&r, seed);
    uint64_t state = seed ^ 0x27d4eb2full;
    int split_dispatch = epx__soak_below(&state, 2) == 0;
    int split_combine = epx__soak_below(&state, 2) == 0;
    int from_view = !soak->ll_combine_x || epx__soak_below(&state, 2) == 0;
    int L = r.num_local, R = soak->world, k = r.c.num_topk;
    int64_t hidden = r.c.hidden;
    r.mask = calloc((size_t)R, 1);
    int32_t *mask32 = calloc((size_t)R, sizeof(int32_t));
    int32_t *count = calloc((size_t)L, 4);
    int32_t *src = calloc((size_t)(L * r.rows) + 1, 4);
    int64_t *range = calloc((size_t)(L * R), 8);
    if (r.mask == NULL || mask32 == NULL || count == NULL || src == NULL || range == NULL ||
        moe_ll_inputs_make(&r.c, soak->rank, &r.in) != 0) {
        fprintf(stderr, "epx bench: soak: rank %d: out of memory\n", soak->rank);
        out->failed = 1;
        goto done;
    }
    epx_status_t status = epx_ll_get_masked(soak->buffer, mask32, R);
    for (int i = 0; i < R; i++)
        r.mask[i] = (uint8_t)(mask32[i] != 0);
    int64_t n = r.in.num_tokens;
    if (status == EPX_SUCCESS)
        status = epx__soak_copy_inputs(soak, &r.c, &r.in, (size_t)(n * hidden) * 2, 0);
    if (!sort_status(out, soak->rank, status, 0, "copying the inputs"))
        goto done;

    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(soak->x, EPX_DTYPE_BF16, n, hidden);
    args.topk_idx = epx_tensor_2d(soak->topk_idx, EPX_DTYPE_INT64, n, k);
    args.use_fp8 = r.cast.use_fp8;
    args.round_scale = r.cast.round_scale;
    args.use_ue8m0 = r.cast.use_ue8m0;
    args.flags = split_dispatch ? EPX_LL_SEND_ONLY : 0;
    epx_ll_dispatch_result_t got = EPX_LL_DISPATCH_RESULT_INIT;
    epx__soak_start_op(soak);
    status = epx_ll_dispatch(soak->buffer, &args, &got, soak->device->stream);
    status = receive_if_split(soak, got.handle, split_dispatch, status);
    epx__soak_mark(soak, 1);
    double us = epx__soak_elapsed_us(soak);
    int losses = out->peer_losses;
    if (!sort_status(out, soak->rank, status, us, "epx_ll_dispatch"))
        goto done;
    if (status == EPX_SUCCESS)
        note_new_mask(&r, out, mask32, us, "epx_ll_dispatch");
    out->us[EPX__SOAK_LL_DISPATCH] = us;
    out->ran[EPX__SOAK_LL_DISPATCH] = 1;

    /* A step that lost a peer is not checked: which of its rows arrived is chance. */
    moe_ll_expected_t e;
    memset(&e, 0, sizeof(e));
    int checking = check && out->peer_losses == losses &&
                   moe_ll_oracle_dispatch(&r.c, soak->rank, soak->ll_tokens, r.mask, r.cast,
                                          &e) == 0;
    if (checking) {
        out->checked++;
        if (!check_dispatch(&r, &got, &e, count, src, range)) {
            out->mismatches++;
            checking = 0;
        }
        moe_ll_expected_free(&e);
    }

    epx_ll_combine_args_t cargs = EPX_LL_COMBINE_ARGS_INIT;
    cargs.handle = got.handle;
    status = EPX_SUCCESS; /* a lost peer was counted above; the step goes on */
    if (from_view) {
        status = epx_ll_get_combine_buffer(soak->buffer, got.handle, &cargs.x);
    } else {
        cargs.x.data = soak->combine_x;
        cargs.x.dtype = EPX_DTYPE_BF16;
        cargs.x.ndim = 3;
        cargs.x.shape[0] = L;
        cargs.x.shape[1] = r.rows;
        cargs.x.shape[2] = hidden;
    }
    if (status == EPX_SUCCESS && checking)
        status = write_expert_outputs(&r, cargs.x.data, count, src, range);
    if (!sort_status(out, soak->rank, status, 0, "preparing the combine input"))
        goto done;
    cargs.topk_idx = args.topk_idx;
    cargs.topk_weights = epx_tensor_2d(soak->topk_weights, EPX_DTYPE_FP32, n, k);
    cargs.out = epx_tensor_2d(soak->out_x, EPX_DTYPE_BF16, n, hidden);
    cargs.flags = split_combine ? EPX_LL_SEND_ONLY : 0;
    epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
    losses = out->peer_losses;
    epx__soak_start_op(soak);
    status = epx_ll_combine(soak->buffer, &cargs, &result, soak->device->stream);
    status = receive_if_split(soak, got.handle, split_combine, status);
    epx__soak_mark(soak, 1);
    us = epx__soak_elapsed_us(soak);
    if (!sort_status(out, soak->rank, status, us, "epx_ll_combine"))
        goto done;
    if (status == EPX_SUCCESS)
        note_new_mask(&r, out, mask32, us, "epx_ll_combine");
    out->us[EPX__SOAK_LL_COMBINE] = us;
    out->ran[EPX__SOAK_LL_COMBINE] = 1;

    uint16_t *want = NULL;
    int64_t masked = 0;
    if (checking && out->peer_losses == losses &&
        moe_ll_oracle_combine(&r.c, soak->rank, r.mask, &want, &masked) == 0) {
        out->checked++;
        uint16_t *have = copy_out(&r, soak->out_x, 0, (size_t)(n * hidden) * 2);
        int ok = have != NULL &&
                 epx__bench_compare_bf16(r.label, "ll combine out", have, want, n, hidden, 0);
        if (ok && result.num_masked_entries != -1 && result.num_masked_entries != masked) {
            fprintf(stderr, "epx bench: %s: ll combine num_masked_entries %lld, oracle %lld\n",
                    r.label, (long long)result.num_masked_entries, (long long)masked);
            ok = 0;
        }
        out->mismatches += !ok;
        free(have);
    }
    free(want);
done:
    moe_inputs_free(&r.in);
    free(r.mask);
    free(mask32);
    free(count);
    free(src);
    free(range);
}
