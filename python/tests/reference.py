"""A NumPy model of docs/DESIGN.md section 2, and the seeded inputs the tests feed it.

Every rank can regenerate every other rank's inputs from (seed, rank), so each rank
computes what it must receive locally, independently of the library.
"""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


class Case:
    def __init__(self, world, num_tokens=24, hidden=256, num_experts=8, num_topk=3, seed=1,
                 dtype="bf16", drop=0.15, empty_rank=-1, alignment=1, ranks_per_node=0):
        self.world = world
        # Combine sums per node first when the group spans nodes (docs/INTERNODE.md).
        self.ranks_per_node = ranks_per_node if 0 < ranks_per_node < world else world
        self.num_tokens = num_tokens
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_topk = num_topk
        self.seed = seed
        self.dtype = dtype
        self.drop = drop
        self.empty_rank = empty_rank
        self.alignment = alignment
        self.experts_per_rank = num_experts // world

    def tokens_of(self, rank):
        return 0 if rank == self.empty_rank else self.num_tokens

    def inputs(self, rank):
        """x (bf16, or fp8 with scales), topk_idx int64, topk_weights fp32 of one rank."""
        rng = np.random.default_rng([self.seed, rank])
        n, k, h = self.tokens_of(rank), self.num_topk, self.hidden
        if self.dtype == "fp8":
            bits = rng.integers(0, 254, (n, h), dtype=np.uint8)
            bits[bits >= 0x7F] += 1  # skip 0x7f: with 0xff, the two NaN encodings
            x = bits.view(FP8)
            scales = rng.uniform(0.25, 4.0, (n, h // 128)).astype(np.float32)
        else:
            x = rng.uniform(-4, 4, (n, h)).astype(np.float32).astype(BF16)
            scales = None
        idx = np.empty((n, k), dtype=np.int64)
        for t in range(n):
            idx[t] = rng.choice(self.num_experts, k, replace=False)
        idx[rng.uniform(size=(n, k)) < self.drop] = -1
        weights = rng.uniform(0.01, 1.0, (n, k)).astype(np.float32)
        return x, scales, idx, weights

    def home_rank(self, expert):
        return expert // self.experts_per_rank

    # ------------------------------------------------------------ section 2

    def layout(self, rank):
        _, _, idx, _ = self.inputs(rank)
        in_rank = np.zeros((idx.shape[0], self.world), dtype=bool)
        per_expert = np.zeros(self.num_experts, dtype=np.int32)
        for t in range(idx.shape[0]):
            for e in idx[t]:
                if e >= 0:
                    in_rank[t, self.home_rank(e)] = True
                    per_expert[e] += 1
        return in_rank.sum(axis=0).astype(np.int32), per_expert, in_rank

    def dispatch(self, rank):
        """What `rank` receives: dict of recv_x, recv_scales, recv_idx, recv_weights,
        counts (aligned), src (list of (source rank, token))."""
        first = rank * self.experts_per_rank
        xs, scales, idxs, weights, src = [], [], [], [], []
        counts = np.zeros(self.experts_per_rank, dtype=np.int64)
        for s in range(self.world):
            x, sc, idx, w = self.inputs(s)
            for t in range(idx.shape[0]):
                here = (idx[t] >= 0) & (idx[t] // self.experts_per_rank == rank)
                if not here.any():
                    continue
                xs.append(x[t])
                if sc is not None:
                    scales.append(sc[t])
                idxs.append(np.where(here, idx[t] - first, -1))
                weights.append(np.where(here, w[t], np.float32(0)))
                src.append((s, t))
                for local in idx[t][here] - first:
                    counts[local] += 1
        a = max(self.alignment, 1)
        counts = (counts + a - 1) // a * a
        n, h, k = len(xs), self.hidden, self.num_topk
        x_dtype = FP8 if self.dtype == "fp8" else BF16
        return {
            "recv_x": np.array(xs, dtype=x_dtype).reshape(n, h),
            "recv_scales": (np.array(scales, dtype=np.float32).reshape(n, h // 128)
                            if self.dtype == "fp8" else None),
            "recv_idx": np.array(idxs, dtype=np.int64).reshape(n, k),
            "recv_weights": np.array(weights, dtype=np.float32).reshape(n, k),
            "counts": [int(c) for c in counts],
            "src": src,
        }

    def combine_input(self, rank, src, x_of):
        """Rows rank `rank` sends back for its received tokens `src`: a function of (rank,
        source rank, token) that the home rank can recompute. x_of(s) = rank s's x (bf16)."""
        rows = np.empty((len(src), self.hidden), dtype=np.float32)
        for i, (s, t) in enumerate(src):
            rows[i] = x_of(s)[t].astype(np.float32) * np.float32(0.5 * (rank + 1)) + rank
        return rows.astype(BF16)

    def combine(self, rank, x_of, weights_too=True, bias=None):
        """combined_x (bf16) and combined weights (fp32) for `rank`'s own tokens, summed in
        fp32 from DeepEP's biases (a list of bf16 [tokens, hidden] arrays, or None), then
        in rank order as the host backend does; across nodes in rank order inside each
        node, each node's sum rounded to bf16 (weights: not rounded), then in node order
        (docs/INTERNODE.md, "Combine: summation order")."""
        x, _, idx, w = self.inputs(rank)
        n = idx.shape[0]
        acc = np.zeros((n, self.hidden), dtype=np.float32)
        for b in bias or ():
            acc += b.astype(np.float32)
        acc_w = np.zeros((n, self.num_topk), dtype=np.float32)
        per_node = self.ranks_per_node
        one_node = per_node == self.world
        for node in range(self.world // per_node):
            # One node: the rows go straight into the sum (nothing crosses a network).
            part = acc if one_node else np.zeros((n, self.hidden), dtype=np.float32)
            part_w = acc_w if one_node else np.zeros((n, self.num_topk), dtype=np.float32)
            for r in range(node * per_node, (node + 1) * per_node):
                here = (idx >= 0) & (idx // self.experts_per_rank == r)
                sent = here.any(axis=1)
                rows = self.combine_input(r, [(rank, t) for t in range(n) if sent[t]], x_of)
                part[sent] += rows.astype(np.float32)
                part_w[sent] += np.where(here, w, np.float32(0))[sent] * np.float32(r + 1)
            if not one_node:
                acc += part.astype(BF16).astype(np.float32)
                acc_w += part_w
        return acc.astype(BF16), acc_w
