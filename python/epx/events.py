"""EventOverlap: DeepEP's event wrapper, over the caller framework's CUDA events."""


class EventOverlap:
    """An event after an epx operation, for overlapping communication with compute.

    epx runs every operation on the caller's current stream (there is no separate
    communication stream), so `async_finish=True` only records an event after the
    operation and keeps its tensors alive until you wait on it. On the host backend the
    operations are synchronous and `event` is None; waiting is then a no-op.

    Attributes:
        event: the framework's event (torch.cuda.Event, cupy.cuda.Event) or None.
        extra_tensors: tensors kept alive until the event is waited on.
    """

    def __init__(self, event=None, extra_tensors=None, _framework=None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._framework = _framework

    def current_stream_wait(self):
        """Make the current stream wait for the event (no-op without an event)."""
        if self.event is not None:
            if self._framework is not None:
                self._framework.wait_event(self.event)
            else:
                self.event.wait()
        self.extra_tensors = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.current_stream_wait()

    def __repr__(self):
        return "EventOverlap(%s)" % ("no event" if self.event is None else repr(self.event))
