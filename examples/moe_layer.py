#!/usr/bin/env python3
"""A small MoE layer on epx: forward and backward across ranks, checked against one rank.

The layer: router logits = x @ Wr, softmax, top-k experts per token with their
probabilities as weights; expert e is a plain matmul x @ W[e]; the output is the weighted
sum of the token's experts. With expert parallelism each rank holds num_experts / ranks
experts, and epx moves the tokens:

    forward:  dispatch(x, topk_idx, topk_weights) -> local experts -> combine(partial sums)
    backward: combine's backward is a dispatch of dy (cached: the forward's handle), and
              dispatch's backward is a combine of d(recv_x) and d(recv_topk_weights).

Every rank then compares its output and gradients with the same layer computed on one
rank with all experts and all ranks' tokens (fp32), within bf16 tolerance.

    epx launch -n 4 -- python3 examples/moe_layer.py                  # NumPy, CPU backend
    epx launch -n 2 -- python3 examples/moe_layer.py --framework torch  # torch (GPU if any)
"""

import argparse
import os
import sys

import numpy as np

try:
    import epx  # installed (pip install ./python), or on PYTHONPATH
except ImportError:  # a checkout used as is: the package next to this file
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import epx  # noqa: E402

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    ml_dtypes = None
    BF16 = None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=["auto", "numpy", "torch", "all"], default="auto",
                        help="auto: NumPy on the CPU backend, and torch too if importable")
    parser.add_argument("--backend", default=os.environ.get("EPX_BACKEND", "auto"))
    parser.add_argument("--tokens", type=int, default=48, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--tolerance", type=float, default=2e-2,
                        help="largest relative error accepted (bf16 transport)")
    return parser.parse_args()


class Problem:
    """The model and every rank's inputs, identical on every rank (from the seed)."""

    def __init__(self, args, world):
        self.world = world
        self.tokens = args.tokens
        self.hidden = args.hidden
        self.num_experts = args.experts_per_rank * world
        self.topk = min(args.topk, self.num_experts)
        self.experts_per_rank = args.experts_per_rank
        rng = np.random.default_rng(args.seed)
        h, e = self.hidden, self.num_experts
        self.router = (rng.standard_normal((h, e)) / np.sqrt(h)).astype(np.float32)
        self.experts = (rng.standard_normal((e, h, h)) / np.sqrt(h)).astype(np.float32)
        self.seed = args.seed

    def inputs(self, rank):
        """x (values exactly representable in bf16, as fp32) and the upstream gradient g."""
        rng = np.random.default_rng([self.seed, rank])
        x = rng.standard_normal((self.tokens, self.hidden)).astype(np.float32)
        x = round_bf16(x)
        g = rng.standard_normal((self.tokens, self.hidden)).astype(np.float32)
        return x, g


def round_bf16(a):
    """fp32 -> nearest bf16 (round to nearest even) -> fp32, without ml_dtypes."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def to_bf16_bits(a):
    return (round_bf16(a).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def softmax(logits):
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def route(problem, x):
    """Router forward on one rank's tokens: probs, top-k ids (int64), top-k weights."""
    probs = softmax(x @ problem.router)
    idx = np.argsort(-probs, axis=1, kind="stable")[:, :problem.topk].astype(np.int64)
    return probs, idx, np.take_along_axis(probs, idx, axis=1).astype(np.float32)


def relative_error(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    scale = max(np.linalg.norm(want), 1e-12)
    return float(np.linalg.norm(got - want) / scale)


# ---------------------------------------------------------------- reference (one rank)

def reference_numpy(problem):
    """Output and gradients of the whole layer on one rank, fp32, all experts."""
    out = {"y": [], "dx": [], "drouter": [], "dexperts": np.zeros_like(problem.experts)}
    for rank in range(problem.world):
        x, g = problem.inputs(rank)
        probs, idx, w = route(problem, x)
        y = np.zeros_like(x)
        dx = np.zeros_like(x)
        dw = np.zeros_like(w)
        for j in range(problem.topk):
            for t in range(problem.tokens):
                weight_matrix = problem.experts[idx[t, j]]
                z = x[t] @ weight_matrix
                y[t] += w[t, j] * z
                dx[t] += w[t, j] * (g[t] @ weight_matrix.T)
                dw[t, j] = g[t] @ z
                out["dexperts"][idx[t, j]] += w[t, j] * np.outer(x[t], g[t])
        dprobs = np.zeros_like(probs)
        np.put_along_axis(dprobs, idx, dw, axis=1)
        dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
        out["y"].append(y)
        out["dx"].append(dx + dlogits @ problem.router.T)
        out["drouter"].append(x.T @ dlogits)
    return out


# ---------------------------------------------------------------- NumPy on epx

def as_tokens(values):
    """fp32 -> the bf16 tensor epx takes: ml_dtypes.bfloat16, else raw uint16 bits."""
    if BF16 is not None:
        return values.astype(BF16)
    return epx.raw_bits(to_bf16_bits(values))


def tokens_to_float(tensor):
    if tensor.dtype == np.uint16:
        return from_bf16_bits(tensor)
    return tensor.astype(np.float32)


def moe_numpy(problem, buffer, rank):
    """Forward and backward of this rank's part, by hand, with epx moving the tokens."""
    x, g = problem.inputs(rank)
    first = rank * problem.experts_per_rank
    experts = problem.experts[first:first + problem.experts_per_rank]

    # Forward: route, dispatch, local experts, combine.
    probs, idx, w = route(problem, x)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        as_tokens(x), topk_idx=idx, topk_weights=w, copy=True)
    rx = tokens_to_float(recv_x)
    partial = np.zeros_like(rx)
    for j in range(problem.topk):
        for local in range(problem.experts_per_rank):
            rows = recv_idx[:, j] == local
            partial[rows] += recv_w[rows, j, None] * (rx[rows] @ experts[local])
    y, _, _ = buffer.combine(as_tokens(partial), handle)
    y = tokens_to_float(y)

    # Backward: combine's backward is a (cached) dispatch of dy.
    recv_dy, _, _, _, _, _ = buffer.dispatch(as_tokens(g), handle=handle, copy=True)
    rdy = tokens_to_float(recv_dy)
    d_rx = np.zeros_like(rx)
    d_rw = np.zeros_like(recv_w)
    d_experts = np.zeros_like(experts)
    for j in range(problem.topk):
        for local in range(problem.experts_per_rank):
            rows = recv_idx[:, j] == local
            weight_matrix = experts[local]
            d_rx[rows] += recv_w[rows, j, None] * (rdy[rows] @ weight_matrix.T)
            d_rw[rows, j] = np.sum(rdy[rows] * (rx[rows] @ weight_matrix), axis=1)
            d_experts[local] += (recv_w[rows, j, None] * rx[rows]).T @ rdy[rows]
    # Dispatch's backward is a combine of d(recv_x) and d(recv_topk_weights).
    dx_tokens, dw, _ = buffer.combine(as_tokens(d_rx), handle, topk_weights=d_rw)
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, idx, dw, axis=1)
    dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
    dx = tokens_to_float(dx_tokens) + dlogits @ problem.router.T
    handle.destroy()
    return {"y": y, "dx": dx, "drouter": x.T @ dlogits, "dexperts": d_experts,
            "counts": counts}


# ---------------------------------------------------------------- torch on epx

def torch_functions(torch):
    class Dispatch(torch.autograd.Function):
        """recv_x, recv_w = dispatch(x, w); backward: combine(d recv_x, d recv_w)."""

        @staticmethod
        def forward(ctx, x, topk_weights, buffer, topk_idx, state):
            recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
                x.detach(), topk_idx=topk_idx, topk_weights=topk_weights.detach(), copy=True)
            ctx.buffer, ctx.handle = buffer, handle
            ctx.weights_like = recv_w
            state["handle"], state["recv_idx"] = handle, recv_idx
            return recv_x, recv_w

        @staticmethod
        def backward(ctx, d_recv_x, d_recv_w):
            if d_recv_w is None:  # the weights were not used: their gradient is zero
                d_recv_w = torch.zeros_like(ctx.weights_like)
            dx, dw, _ = ctx.buffer.combine(d_recv_x.to(torch.bfloat16).contiguous(), ctx.handle,
                                           topk_weights=d_recv_w.float().contiguous())
            return dx, dw, None, None, None

    class Combine(torch.autograd.Function):
        """y = combine(partial); backward: dispatch(dy) with the forward's handle."""

        @staticmethod
        def forward(ctx, partial, buffer, handle):
            y, _, _ = buffer.combine(partial.detach(), handle)
            ctx.buffer, ctx.handle = buffer, handle
            return y

        @staticmethod
        def backward(ctx, dy):
            recv_dy = ctx.buffer.dispatch(dy.to(torch.bfloat16).contiguous(), handle=ctx.handle,
                                          copy=True)[0]
            return recv_dy, None, None

    return Dispatch, Combine


def moe_torch(problem, buffer, rank, device):
    import torch

    Dispatch, Combine = torch_functions(torch)
    x_np, g_np = problem.inputs(rank)
    first = rank * problem.experts_per_rank
    x = torch.tensor(x_np, device=device).to(torch.bfloat16).requires_grad_()
    g = torch.tensor(g_np, device=device)
    router = torch.tensor(problem.router, device=device, requires_grad=True)
    experts = torch.tensor(problem.experts[first:first + problem.experts_per_rank],
                           device=device, requires_grad=True)

    probs = torch.softmax(x.float() @ router, dim=1)
    _, idx_np, _ = route(problem, x_np)  # the same top-k choice as the reference
    idx = torch.tensor(idx_np, device=device)
    w = torch.gather(probs, 1, idx)
    state = {}
    recv_x, recv_w = Dispatch.apply(x, w, buffer, idx, state)
    recv_idx = state["recv_idx"]
    rx = recv_x.float()
    partial = torch.zeros_like(rx)
    for j in range(problem.topk):
        for local in range(problem.experts_per_rank):
            rows = (recv_idx[:, j] == local).nonzero().squeeze(1)
            partial = partial.index_add(0, rows,
                                        recv_w[rows, j, None] * (rx[rows] @ experts[local]))
    y = Combine.apply(partial.to(torch.bfloat16), buffer, state["handle"])
    (y.float() * g).sum().backward()
    state["handle"].destroy()
    return {"y": y.float().detach().cpu().numpy(),
            "dx": x.grad.float().cpu().numpy(),
            "drouter": router.grad.cpu().numpy(),
            "dexperts": experts.grad.cpu().numpy()}


# ---------------------------------------------------------------- main

def check(name, got, want, rank, problem, tolerance):
    first = rank * problem.experts_per_rank
    errors = {
        "y": relative_error(got["y"], want["y"][rank]),
        "dx": relative_error(got["dx"], want["dx"][rank]),
        "d_router": relative_error(got["drouter"], want["drouter"][rank]),
        "d_experts": relative_error(got["dexperts"],
                                    want["dexperts"][first:first + problem.experts_per_rank]),
    }
    bad = {k: v for k, v in errors.items() if not v <= tolerance}
    text = ", ".join("%s %.2e" % item for item in errors.items())
    print("rank %d: %-5s relative errors vs one rank: %s -> %s"
          % (rank, name, text, "FAILED" if bad else "ok"), flush=True)
    return not bad


def main():
    args = parse_args()
    group = epx.Group.from_env(args.backend)
    rank, world = group.rank, group.world_size
    problem = Problem(args, world)
    frameworks = []
    try:
        import torch
    except ImportError:
        torch = None
    have_torch = torch is not None
    if args.framework in ("auto", "all"):
        if group.backend == "host":
            frameworks.append("numpy")
        if have_torch:
            frameworks.append("torch")
    elif args.framework == "torch" and not have_torch:
        raise SystemExit("--framework torch: torch is not installed")
    else:
        frameworks.append(args.framework)
    if group.backend != "host" and "numpy" in frameworks:
        raise SystemExit("NumPy arrays live on the host: run the CPU backend (EPX_BACKEND=host)")

    want = reference_numpy(problem)
    buffer = epx.Buffer(group, max_tokens_per_rank=problem.tokens, hidden=problem.hidden,
                        num_experts=problem.num_experts, num_topk=problem.topk)
    ok = True
    for name in frameworks:
        if name == "numpy":
            got = moe_numpy(problem, buffer, rank)
        else:
            device = "cpu"
            if group.backend == "cuda":
                device = "cuda:%d" % group.device
                torch.cuda.set_device(group.device)
            got = moe_torch(problem, buffer, rank, device)
        ok &= check(name, got, want, rank, problem, args.tolerance)
    buffer.destroy()
    group.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
