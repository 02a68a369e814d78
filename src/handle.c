/*
 * Handle entry points. Backends make handles (epx__handle_alloc, src/ops/backend.c);
 * the caller reads and destroys them here.
 */
#include "api.h"

epx_status_t epx_handle_get_info(epx_handle_t handle, epx_handle_info_t *info)
{
    epx__clear_error();
    if (handle == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_get_info: handle is NULL");
    if (info == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_get_info: info is NULL");
    if (info->size != sizeof(epx_handle_info_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "handle_get_info: info.size is %zu, expected %zu (use "
                         "EPX_HANDLE_INFO_INIT)",
                         info->size, sizeof(epx_handle_info_t));
    info->num_tokens = handle->num_tokens;
    info->num_recv_tokens = handle->num_recv_tokens;
    info->num_local_experts = handle->num_local_experts;
    info->expert_alignment = handle->expert_alignment;
    return EPX_SUCCESS;
}

epx_status_t epx_handle_destroy(epx_handle_t handle)
{
    epx__clear_error();
    if (handle == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_destroy: handle is NULL");
    epx__handle_free(handle);
    return EPX_SUCCESS;
}
