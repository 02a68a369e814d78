"""deep_ep.Config and the buffer size hints, for epx.

DeepEP's Config tunes its channel ring buffers (chunk sizes per channel); epx has no
channels, so only num_sms acts (the SMs of the buffer made at the first dispatch). The
hints give the bytes of epx memory for a shape, so that a program sizing its buffer with
them gets one that holds what it dispatches.
"""

# Tokens per rank that get_nvl_buffer_size_hint sizes for (DeepEP's hint has no token
# count: its ring buffer holds any number). A larger batch needs a larger num_nvl_bytes.
NVL_HINT_TOKENS_PER_RANK = 4096
# Top-k the hint allows for (bytes per row grow by 16 per top-k entry).
NVL_HINT_TOPK = 16


def normal_bytes(tokens_per_rank, hidden_bytes, num_ranks, num_topk):
    """epx's normal-mode memory per rank for this shape, bf16 rows (the CUDA backend's
    plan, the larger of the two backends): received rows, fp8 scales, top-k ids, weights
    and combine weights, and the combine-input rows, plus 2 MiB of control and rounding."""
    rows = tokens_per_rank * num_ranks
    per_row = 2 * hidden_bytes + hidden_bytes // 64 + 16 * num_topk
    return rows * per_row + (2 << 20)


def low_latency_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts):
    """epx's low-latency memory per rank (rows sized for bf16, docs/LOW_LATENCY.md): two
    slots, each with num_experts * M cells of a bf16 row, fp32 scales and 8 bytes of
    source information, and as many bf16 combine-input rows."""
    cells = num_experts * num_max_dispatch_tokens_per_rank
    return 2 * cells * (4 * hidden + hidden // 32 + 8) + (2 << 20)


class Config:
    """deep_ep.Config(num_sms, num_max_nvl_chunked_send_tokens, ..._recv_tokens,
    num_max_rdma_chunked_send_tokens, ..._recv_tokens), with DeepEP's defaults.

    epx reads num_sms only (when the call creates the buffer); the chunk sizes are kept
    as attributes and not used."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256):
        if int(num_sms) < 0:
            raise ValueError("Config: num_sms is %d, expected >= 0" % num_sms)
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes of epx normal-mode memory for NVL_HINT_TOKENS_PER_RANK tokens per rank of
        `hidden_bytes` (bf16: 2 * hidden) at up to NVL_HINT_TOPK experts per token."""
        return normal_bytes(NVL_HINT_TOKENS_PER_RANK, int(hidden_bytes), int(num_ranks),
                            NVL_HINT_TOPK)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """For a group spanning nodes, the normal-mode epx buffer must fit in num_nvl_bytes
        + num_rdma_bytes (its slots for rows crossing the network come on top of the rows
        received, up to about 2 / ranks-per-node times the single-node buffer): twice
        get_nvl_buffer_size_hint, which with it holds the internode buffer of the same
        tokens at any number of ranks per node (4096 tokens, hidden 7168, 4 ranks as 4
        nodes of 1: 1.43 GB needed, 2.88 GB from the two hints)."""
        return 2 * self.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)

    def __repr__(self):
        return ("deep_ep.Config(num_sms=%d, nvl=(%d, %d), rdma=(%d, %d))"
                % (self.num_sms, self.num_max_nvl_chunked_send_tokens,
                   self.num_max_nvl_chunked_recv_tokens, self.num_max_rdma_chunked_send_tokens,
                   self.num_max_rdma_chunked_recv_tokens))
