"""Errors: every failure of the C library becomes an EpxError carrying its status."""

import enum
import threading

from . import _capi

Status = enum.IntEnum("Status", [(name, value) for name, value in _capi.STATUS])
Status.__doc__ = "epx_status_t (EPX_STATUS_MAP in epx.h), without the EPX_ prefix."


class EpxError(RuntimeError):
    """A call into epx failed.

    Attributes:
        status: a ``Status`` (``Status.ERR_INVALID_ARG``, ...), or the raw int for a
            value this package does not know.
        status_name: ``"EPX_ERR_INVALID_ARG"``, ...
        message: what was wrong: the C library's epx_last_error() text (which rank, which
            stage, which argument), or the Python layer's own check.
        result: for a low-latency call that lost a peer (ERR_TIMEOUT / ERR_REMOTE): what
            the call returns on success, since the step completed without that peer
            (include/epx.h, "Failed peers"); None otherwise.
    """

    result = None

    def __init__(self, status, message):
        try:
            status = Status(int(status))
            self.status_name = "EPX_" + status.name
        except ValueError:
            self.status_name = "EPX_STATUS_%d" % int(status)
        self.status = status
        self.message = message
        super().__init__("%s: %s" % (self.status_name, message))


# The exception a bootstrap callback (Python called from C: group.py's _Callbacks) raised
# on this thread, for the EpxError of the C call that failed because of it.
_callback_failure = threading.local()


def note_callback_failure(error):
    """A bootstrap callback raised `error`; the C library only sees a nonzero return."""
    _callback_failure.error = error


def _take_callback_failure():
    error = getattr(_callback_failure, "error", None)
    _callback_failure.error = None
    return error


def check(status, what=""):
    """Raise EpxError for a nonzero status of a C call, with epx_last_error().

    When the call failed because a bootstrap callback raised (EPX_ERR_BOOTSTRAP), the
    message names that exception and the EpxError is chained to it; a KeyboardInterrupt
    or SystemExit raised in the callback is raised again as it was.
    """
    # Taken whatever the status: a call may run a callback that fails and still succeed
    # (the group's last vote ignores its answer), and that record must not reach a later
    # error. Ctrl-C or an exit in a callback goes on as itself either way.
    failure = _take_callback_failure()
    if failure is not None and not isinstance(failure, Exception):
        raise failure
    if status == 0:
        return
    message = _capi.api().last_error()
    if not message:
        message = (what + ": " if what else "") + _capi.api().epx_status_string(
            status).decode()
    if failure is None or int(status) != int(Status.ERR_BOOTSTRAP):
        raise EpxError(status, message)
    raise EpxError(status, "%s (the callback raised %s: %s)" % (
        message, type(failure).__name__, failure)) from failure


def peer_lost(status):
    """Is `status` a low-latency wait that lost a peer (the step completed without it)?"""
    return status in (int(Status.ERR_TIMEOUT), int(Status.ERR_REMOTE))


def peer_lost_error(status, what, result):
    """The EpxError of a low-latency call that lost a peer, carrying its `result`."""
    try:
        check(status, what)
    except EpxError as error:
        error.result = result
        return error
    return None


def invalid_argument(message):
    return EpxError(Status.ERR_INVALID_ARG, message)
