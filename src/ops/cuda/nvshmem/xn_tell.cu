/*
 * Telling the ranks of other nodes that this rank failed. Every rank's abort word sits at
 * the start of its shared allocation (epx__cuda_ctrl_t), and in internode mode that
 * allocation is symmetric, so one put of the word reaches a peer that no store can; the
 * peer's waits read it as they read a same-node peer's store (signal.cuh,
 * epx_check_abort). Called by the host when a call fails on this rank (backend.c,
 * errors.c). The source is symmetric too (the control area's abort_out), so any
 * transport takes it; to a peer with a direct path the put is a copy-engine copy.
 */
#include <cstdint>

#include <nvshmem.h>
#include <nvshmemx.h>

extern "C" int epx_xn_tell(uint64_t *abort_word, const uint64_t *source, int pe, void *stream)
{
    nvshmemx_putmem_on_stream(abort_word, source, sizeof(uint64_t), pe,
                              static_cast<cudaStream_t>(stream));
    return static_cast<int>(cudaGetLastError());
}
