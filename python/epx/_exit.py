"""Whether this process is leaving on an uncaught exception.

A buffer still alive when the interpreter shuts down is freed by its __del__. Freeing a
healthy buffer is collective (every rank votes), which is right for a program that ends
normally on every rank, but a rank that dies on an uncaught exception would wait in
that vote for peers who are elsewhere (in their next operation, waiting for it) until a
timeout, or for good under a bootstrap that has none (a torch process group). So the
package chains sys.excepthook, which the interpreter calls for an uncaught exception
before it shuts down: after it ran, buffers abort (the peers' calls end with
EPX_ERR_REMOTE naming this rank) and free locally instead of voting.
"""

import sys

_reason = None  # "ExceptionType: text" once an uncaught exception reached sys.excepthook


def leaving():
    """The uncaught exception this process is leaving on ("Type: text"), or None."""
    return _reason


def _install():
    previous = sys.excepthook

    def hook(exc_type, exc, traceback):
        global _reason
        try:
            # An interactive session reports errors through the hook and goes on.
            if not (hasattr(sys, "ps1") or sys.flags.interactive):
                _reason = "%s: %s" % (getattr(exc_type, "__name__", exc_type), exc)
        except Exception:  # noqa: BLE001 - an exception whose str() fails
            _reason = getattr(exc_type, "__name__", "an exception")
        finally:
            previous(exc_type, exc, traceback)

    hook.epx_previous = previous
    sys.excepthook = hook


_install()
