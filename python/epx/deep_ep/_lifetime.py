"""The lifetime rules deep_ep.Buffer and deep_ep.ElasticBuffer share (DeepEP's): destroy()
only with explicitly_destroy, otherwise freed when collected; used after destroy() is an
error. A class using it sets _NAME, _epx_group, _owns_group and explicitly_destroy, and
defines _release_buffers() (free its epx buffers, collectively) and _epx_buffers() (the
live ones)."""

import sys

from .. import _exit
from ..errors import EpxError, Status


class Lifetime:
    _NAME = "deep_ep.Buffer"

    def destroy(self):
        """Free the epx buffers (collective). As DeepEP's, only with explicitly_destroy."""
        if not self.explicitly_destroy:
            raise EpxError(Status.ERR_INVALID_STATE,
                           "%s.destroy: the buffer was made with explicitly_destroy=False "
                           "(it is freed when collected)" % self._NAME)
        self._release()

    def _release(self):
        try:
            self._release_buffers()
        finally:
            self._drop_group()

    def _drop_group(self):
        if self._owns_group and self._epx_group is not None:
            self._epx_group.destroy()
        self._epx_group = None

    def _abandon(self, reason):
        """Collected without destroy() although made with explicitly_destroy (as DeepEP's:
        no collective step then), or on the way out of a process dying on an uncaught
        exception (epx/_exit.py). This rank may be leaving on an exception, and a vote with
        peers that never come would hang the process (and its launcher) for good. So the
        epx buffers are aborted, which ends the peers' current or next call on them with
        ERR_REMOTE naming this rank, and freed on this rank only."""
        buffers = [b for b in self._epx_buffers() if b is not None]
        for buffer in buffers:
            buffer._abandon(reason)
        if buffers:
            try:  # after the aborts: stderr may be a pipe nobody reads any more
                sys.stderr.write("epx: %s: its buffers were aborted and freed on this rank "
                                 "only\n" % reason)
            except Exception:  # noqa: BLE001
                pass
        self._drop_group()

    def __del__(self):
        try:
            if self._epx_group is None:
                return
            if _exit.leaving() is not None:
                self._abandon("%s: this rank is exiting on an uncaught exception (%s)"
                              % (self._NAME, _exit.leaving()))
            elif self.explicitly_destroy:
                self._abandon("%s collected without destroy()" % self._NAME)
            else:
                self._release()
        except Exception:
            pass

    def _group(self):
        if self._epx_group is None:
            raise EpxError(Status.ERR_INVALID_STATE, "%s: used after destroy()" % self._NAME)
        return self._epx_group
