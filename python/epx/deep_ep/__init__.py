"""epx.deep_ep: DeepEP's Python API on epx: V1's deep_ep.Buffer, Config, EventOverlap, and
V2's ElasticBuffer and EPHandle (dispatch and combine).

    import epx.deep_ep as deep_ep      # the one line that changes

    buffer = deep_ep.Buffer(group, num_nvl_bytes=int(1e9))
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \\
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
        topk_weights=topk_weights)
    combined_x, _, event = buffer.combine(expert_out, handle)

docs/PYTHON.md ("DeepEP drop-in") lists the differences from DeepEP.
"""

from ..events import EventOverlap
from .buffer import Buffer, DispatchHandle, InternodeDispatchHandle
from .config import Config
from .elastic import ElasticBuffer, EPHandle

__all__ = ["Buffer", "Config", "DispatchHandle", "ElasticBuffer", "EPHandle", "EventOverlap",
           "InternodeDispatchHandle", "topk_idx_t"]


def __getattr__(name):
    # DeepEP's topk_idx_t is torch's int64; torch is imported only when it is asked for.
    if name == "topk_idx_t":
        import torch
        return torch.int64
    raise AttributeError("module 'epx.deep_ep' has no attribute %r" % name)
