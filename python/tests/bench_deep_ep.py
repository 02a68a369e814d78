"""Time dispatch and combine through epx.deep_ep against epx.Buffer on the same case.

    epx launch --mps -n 8 -- python3 python/tests/bench_deep_ep.py [--tokens 4096]
        [--hidden 7168] [--experts 256] [--topk 8] [--sms 24] [--iters 20] [--profile]

(the GPU machine: torch tensors on the CUDA backend; on the CPU backend it runs with
torch CPU tensors, slowly). Each line is the mean time per call over --iters calls, on
rank 0, after a warm-up, with CUDA events on the current stream:
  epx.Buffer views       dispatch returning views into the buffer (no copy)
  epx.Buffer copy=True   dispatch returning tensors the caller owns (one local copy)
  deep_ep                deep_ep.Buffer.dispatch with DeepEP's arguments (top-k, layout)
  deep_ep no top-k       routed by is_token_in_rank / num_tokens_per_expert
  V2 ElasticBuffer       deep_ep.ElasticBuffer.dispatch (DeepEP 2.x), plain and expanded
                         (expert_alignment 128)
and the same for cached dispatch and combine (x a separate tensor, as DeepEP's callers
pass it). deep_ep against "copy=True" shows what the DeepEP surface costs on top of epx;
"views" against "copy=True" is the copy DeepEP's own receivers make out of their ring.
--profile adds a cProfile of the fresh V2 dispatch on rank 0 (where its host time goes:
the exchanges and the host's waits for the device show in the calls that wait).
"""

import argparse
import time

import torch

import epx
import epx.deep_ep as deep_ep


def timed(fn, iters, cuda):
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e6 / iters


def profile_v2(group, args, fresh):
    """The fresh V2 dispatch under cProfile on rank 0 (every rank runs the calls): the
    top functions by cumulative time, as text (None elsewhere)."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile() if group.rank == 0 else None
    if profiler is not None:
        profiler.enable()
    for _ in range(args.iters):
        fresh()
    if profiler is None:
        return None
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    return "fresh V2 dispatch x %d, rank 0, cProfile:\n%s" % (args.iters, text.getvalue())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--sms", type=int, default=24)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true",
                        help="also profile --iters fresh V2 dispatches on rank 0 (cProfile, "
                             "by cumulative time: host work and host waits, each in the call "
                             "that waits)")
    args = parser.parse_args()

    group = epx.Group.from_env()
    cuda = group.backend == "cuda"
    device = torch.device("cuda", group.device) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(group.rank)
    x = torch.randn((args.tokens, args.hidden), dtype=torch.bfloat16, device=device)
    scores = torch.randn((args.tokens, args.experts), device=device).abs() + 1
    topk_idx = torch.topk(scores, args.topk, dim=-1, sorted=False)[1].to(torch.int64)
    topk_weights = torch.rand((args.tokens, args.topk), dtype=torch.float32, device=device)

    plain = epx.Buffer(group, max_tokens_per_rank=args.tokens, hidden=args.hidden,
                       num_experts=args.experts, num_topk=args.topk, num_sms=args.sms)
    need = epx.Buffer.buffer_size(group, args.tokens, args.hidden, args.experts, args.topk)
    ours = deep_ep.Buffer(group, need, explicitly_destroy=True)
    config = deep_ep.Config(args.sms)
    per_rank, _, per_expert, in_rank, _ = ours.get_dispatch_layout(topk_idx, args.experts)
    layout = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
              "num_tokens_per_expert": per_expert}

    results = []

    def row(name, fn):
        results.append((name, timed(fn, args.iters, cuda)))

    row("dispatch  epx.Buffer views", lambda: plain.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights))
    row("dispatch  epx.Buffer copy=True", lambda: plain.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, copy=True))
    row("dispatch  deep_ep", lambda: ours.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, config=config, **layout))
    row("dispatch  deep_ep no top-k", lambda: ours.dispatch(x, config=config, **layout))

    _, _, _, _, plain_handle, _ = plain.dispatch(x, topk_idx=topk_idx,
                                                 topk_weights=topk_weights, copy=True)
    recv_x, _, _, _, handle, _ = ours.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                               config=config, **layout)
    row("cached    epx.Buffer views", lambda: plain.dispatch(x, handle=plain_handle))
    row("cached    epx.Buffer copy=True", lambda: plain.dispatch(x, handle=plain_handle,
                                                                 copy=True))
    row("cached    deep_ep", lambda: ours.dispatch(x, handle=handle, config=config))

    expert_out = recv_x.clone()
    row("combine   epx.Buffer", lambda: plain.combine(expert_out, plain_handle))
    row("combine   deep_ep", lambda: ours.combine(expert_out, handle, config=config))

    deep_ep.Buffer.set_num_sms(args.sms)  # the SMs of the ElasticBuffer's epx buffers
    elastic = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=args.tokens,
                                    hidden=args.hidden, num_topk=args.topk,
                                    explicitly_destroy=True)
    v2 = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_experts=args.experts)
    row("dispatch  V2 ElasticBuffer", lambda: elastic.dispatch(x, **v2))
    row("dispatch  V2 expanded", lambda: elastic.dispatch(x, expert_alignment=128,
                                                          do_expand=True, **v2))
    v2_x, _, _, v2_handle, _ = elastic.dispatch(x, **v2)
    v2_ex_x, _, _, v2_ex_handle, _ = elastic.dispatch(x, expert_alignment=128, do_expand=True,
                                                      **v2)
    row("cached    V2 ElasticBuffer", lambda: elastic.dispatch(x, handle=v2_handle))
    row("combine   V2 ElasticBuffer", lambda: elastic.combine(v2_x, v2_handle))
    row("combine   V2 expanded", lambda: elastic.combine(v2_ex_x, v2_ex_handle))
    profile = profile_v2(group, args, lambda: elastic.dispatch(x, **v2)) if args.profile \
        else None

    if group.rank == 0:
        print("bench_deep_ep: %d ranks, %s backend, %d tokens x %d, %d experts, top-%d, %d SMs"
              % (group.world_size, group.backend, args.tokens, args.hidden, args.experts,
                 args.topk, args.sms))
        for name, micros in results:
            print("  %-34s %9.1f us" % (name, micros))
        if profile is not None:
            print(profile)
    plain.destroy()
    ours.destroy()
    elastic.destroy()
    group.destroy()


if __name__ == "__main__":
    main()
