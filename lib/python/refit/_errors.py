"""refit's exceptions: every failure of the native core arrives as one of these."""

from __future__ import annotations

import enum
from typing import Any, Optional


class _Named(enum.IntEnum):
    """An IntEnum that prints as its name: ``Errc.timeout``, not ``4`` (f-strings and str()
    included); it still compares and converts as its number."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class Errc(_Named):
    """What kind of failure a :class:`RefitError` is: the C++ ``refit::errc`` codes (stable
    values: they travel in ERROR replies)."""

    invalid_argument = 1  #: the caller passed something unusable (bad option, bad tensor)
    protocol = 2  #: a message was malformed or out of order
    version_mismatch = 3  #: the peers speak different protocol versions
    timeout = 4  #: a deadline passed while waiting for the peer (RefitTimeout)
    peer = 5  #: the peer is gone (its process ended), or refused the request
    unauthorized = 6  #: session token or CURVE key mismatch
    transport = 7  #: buffers could not be created, shared or mapped
    cuda = 8  #: a CUDA call failed
    nccl = 9  #: an NCCL call failed
    apply = 10  #: the receiver's sink (table or callback) failed: shape/dtype mismatch, callback raised
    incomplete = 11  #: END arrived but the manifest was not complete: nothing committed
    io = 12  #: a file or system call failed
    internal = 13  #: a bug in refit
    needs_whole = 14  #: the receiver holds no base for a subset or delta version: send a whole one


class Event(_Named):
    """What :meth:`Receiver.serve_one` did."""

    idle = 0  #: nothing arrived within the wait
    hello = 1  #: a session started (buffers mapped)
    begin = 2  #: a refit started
    batch = 3  #: a batch was applied (or enqueued)
    committed = 4  #: END: the version is live
    aborted = 5  #: a refit failed; committed_version is unchanged, dirty if partly applied
    bye = 6  #: the session ended
    refused = 7  #: a message was refused without touching the session (stranger, bad HELLO)
    ended = 8  #: one streamer of a group ended its part; the version ends with the last one's
    #: a staged receiver (``Receiver(stage="host")``): the version is whole in the stage, its
    #: streamer heard OK, the weights wait for :meth:`Receiver.apply`
    prepared = 9


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
        try:
            self.code = Errc(code) if code is not None else None
        except ValueError:  # a code this version does not know: keep the number
            self.code = code

    def __reduce__(self):  # keeps .code across pickling (multiprocessing, Ray)
        return (type(self), (str(self), self.code))


class RefitTimeout(RefitError, TimeoutError):
    """A deadline passed while waiting for the peer (``code`` is ``Errc.timeout``): the peer is
    dead or stuck. The next refit starts a new session."""
