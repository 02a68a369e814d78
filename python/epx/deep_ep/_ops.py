"""The few tensor operations epx.deep_ep does itself, for NumPy arrays and torch tensors.

All are small next to a dispatch: the layout of a group that has no normal-mode buffer
yet, the tokens per node of a group spanning nodes, and the top-k padding of a
worst-case dispatch. docs/PYTHON.md ("DeepEP drop-in")
lists them as known costs. Other frameworks raise NotImplementedError naming the
operation.
"""

import importlib

from .. import _frameworks


def framework_name(tensor, what):
    """The framework of `tensor`, "numpy" or "torch"; NotImplementedError naming `what`
    for any other (the operations epx.deep_ep does itself are written for those two)."""
    name = _frameworks.of(tensor).name
    if name not in ("numpy", "torch"):
        raise NotImplementedError("epx.deep_ep: %s is implemented for NumPy arrays and torch "
                                  "tensors, not %s" % (what, name))
    return name


def layout(topk_idx, num_experts, num_ranks):
    """get_dispatch_layout computed with the framework (no epx buffer exists yet):
    (num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool
    [T, R]). A token counts once per distinct rank; per expert, once per entry. Ids
    outside [0, num_experts) count nowhere."""
    local = num_experts // num_ranks
    if framework_name(topk_idx, "get_dispatch_layout before the first dispatch") == "torch":
        torch = importlib.import_module("torch")
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        rank = torch.where(valid, topk_idx // local, torch.full_like(topk_idx, num_ranks))
        in_rank = torch.zeros((topk_idx.shape[0], num_ranks + 1), dtype=torch.bool,
                              device=topk_idx.device)
        in_rank.scatter_(1, rank, True)
        in_rank = in_rank[:, :num_ranks].contiguous()
        expert = torch.where(valid, topk_idx, torch.full_like(topk_idx, num_experts))
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
        per_expert.scatter_add_(0, expert.reshape(-1),
                                torch.ones(expert.numel(), dtype=torch.int32,
                                           device=topk_idx.device))
        return in_rank.sum(dim=0, dtype=torch.int32), per_expert[:num_experts].contiguous(), \
            in_rank
    np = importlib.import_module("numpy")
    idx = np.asarray(topk_idx)
    valid = (idx >= 0) & (idx < num_experts)
    in_rank = np.zeros((idx.shape[0], num_ranks), dtype=bool)
    rows, cols = np.nonzero(valid)
    in_rank[rows, idx[rows, cols] // local] = True
    per_expert = np.bincount(idx[valid], minlength=num_experts).astype(np.int32)
    return in_rank.sum(axis=0).astype(np.int32), per_expert, in_rank


def tokens_per_node(is_token_in_rank, ranks_per_node):
    """DeepEP's num_tokens_per_rdma_rank: int32 [N], the tokens sent to each node of
    ranks_per_node ranks (a token counts once per node), from is_token_in_rank [T, R]."""
    tokens, ranks = int(is_token_in_rank.shape[0]), int(is_token_in_rank.shape[1])
    nodes = ranks // ranks_per_node
    if framework_name(is_token_in_rank, "num_tokens_per_rdma_rank") == "torch":
        torch = importlib.import_module("torch")
        in_node = is_token_in_rank.reshape(tokens, nodes, ranks_per_node).any(dim=2)
        return in_node.sum(dim=0, dtype=torch.int32)
    np = importlib.import_module("numpy")
    in_node = np.asarray(is_token_in_rank).reshape(tokens, nodes, ranks_per_node).any(axis=2)
    return in_node.sum(axis=0).astype(np.int32)


def take_rows(view, rows, framework):
    """A new tensor of `rows` rows owning the first rows of `view` (the rest uninitialised
    when the view is shorter)."""
    if view is None:
        return None
    have = min(int(view.shape[0]), rows)
    if framework.name == "torch":
        out = view.new_empty((rows,) + tuple(view.shape[1:]))
    else:
        np = importlib.import_module("numpy")
        out = np.empty((rows,) + tuple(view.shape[1:]), dtype=view.dtype)
    out[:have] = view[:have]
    return out


def pad_rows(tensor, count, count_device, value):
    """Rows from `count` on become `value`. When only the device knows the count
    (`count` < 0), `count_device` is an int32 [1] torch tensor holding it."""
    if tensor is None:
        return
    if count >= 0:
        tensor[count:] = value
        return
    torch = importlib.import_module("torch")
    rows = torch.arange(tensor.shape[0], device=tensor.device)
    tensor.masked_fill_((rows >= count_device.to(rows.dtype)).unsqueeze(1), value)
