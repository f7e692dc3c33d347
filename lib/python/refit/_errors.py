"""refit's exceptions: every failure of the native core arrives as one of these."""

from __future__ import annotations

from typing import Any, Optional


class RefitError(Exception):
    """A refit failed. ``code`` is the C++ error code (:class:`refit.Errc`); the message says what
    went wrong and what to check, e.g. ``tensor 'w': the streamer sends bf16[4, 4] but the
    parameter table holds f32[4, 4]``.

    Example::

        try:
            streamer.refit(step, model.state_dict())
        except refit.RefitError as e:
            if e.code == refit.Errc.apply:   # the receiver's sink refused a tensor
                ...
    """

    def __init__(self, message: str, code: Optional[Any] = None) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # keeps .code across pickling (multiprocessing, Ray)
        return (type(self), (str(self), self.code))


class RefitTimeout(RefitError, TimeoutError):
    """A deadline passed while waiting for the peer (``code`` is ``Errc.timeout``): the peer is
    dead or stuck. The next refit starts a new session."""
