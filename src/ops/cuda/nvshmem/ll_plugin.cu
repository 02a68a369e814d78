/*
 * libepx_nvshmem.so, the backend's part: the low-latency kernels (kernels 1: ll_*.cu,
 * kernels 2: ll2_*.cu, chosen per buffer by EPX_LL_KERNELS) and the internode
 * normal-mode kernels behind one table (src/ops/cuda/ll_plugin.h says why this is a
 * plugin). NVSHMEM's set-up lives in the same library, on the transport's side
 * (src/transport/nvshmem/host.cu).
 */
#include "ops/cuda/ll_plugin.h"

extern "C" int epx_ll_launch_dispatch_send(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_ll_launch_dispatch_recv(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_ll_launch_combine_send(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_ll_launch_combine_recv(const epx_ll_shape_t *, const epx_ll_op_t *, void *);
extern "C" int epx_ll2_launch_dispatch(const epx_ll_shape_t *, const epx_ll_op_t *, int, void *);
extern "C" int epx_ll2_launch_combine(const epx_ll_shape_t *, const epx_ll_op_t *, int, void *);
extern "C" int epx_ll2_prepare(epx_ll_shape_t *);
extern "C" int epx_xn_launch_notify(const epx__cuda_shape_t *, const epx__cuda_notify_args_t *,
                                    void *);
extern "C" int epx_xn_launch_dispatch(const epx__cuda_shape_t *,
                                      const epx__cuda_dispatch_args_t *, void *);
extern "C" int epx_xn_launch_combine(const epx__cuda_shape_t *, const epx__cuda_combine_args_t *,
                                     void *);
extern "C" int epx_xn_tell(uint64_t *, const uint64_t *, int, void *);

static const epx_ll_plugin_t plugin = {
    EPX_LL_PLUGIN_ABI,          epx_ll_launch_dispatch_send, epx_ll_launch_dispatch_recv,
    epx_ll_launch_combine_send, epx_ll_launch_combine_recv,  epx_xn_launch_notify,
    epx_xn_launch_dispatch,     epx_xn_launch_combine,   epx_ll2_launch_dispatch,
    epx_ll2_launch_combine,     epx_ll2_prepare,             epx_xn_tell,
};

extern "C" __attribute__((visibility("default"))) const epx_ll_plugin_t *epx_ll_plugin_v1(void)
{
    return &plugin;
}
