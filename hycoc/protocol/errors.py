"""The wire protocol's errors: one `WireError` subclass per stable ``code``, and their ERROR replies.

The codes are the list at the end of `hycoc.protocol.wire`'s module docstring; they go into ERROR frames and the
verifier's metrics, so a code never changes. `ERROR_CLASSES` maps a received code back to its class
(`error_from_reply`); `error_reply` turns any exception into what the peer may read.
"""

from __future__ import annotations

import re

from hycoc.protocol.messages import ErrorReply

#: What an ERROR frame's code may be (ascii, at most 255 bytes).
ERROR_CODE = re.compile(r"[a-z][a-z0-9_]*")


class WireError(Exception):
    """A frame or message that breaks the protocol. ``code`` is stable (it goes into error frames and metrics);
    ``message`` says what was wrong and what is allowed."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class _Kind(WireError):
    code = "wire_error"

    def __init__(self, message: str):
        super().__init__(type(self).code, message)


class BadMagic(_Kind):
    code = "bad_magic"


class UnsupportedVersion(_Kind):
    code = "unsupported_version"


class UnknownMessageType(_Kind):
    code = "unknown_message_type"


class BadFlags(_Kind):
    code = "bad_flags"


class FrameTooLarge(_Kind):
    code = "frame_too_large"


class Truncated(_Kind):
    code = "truncated"


class LengthMismatch(_Kind):
    code = "length_mismatch"


class CrcMismatch(_Kind):
    code = "crc_mismatch"


class BadEnum(_Kind):
    code = "bad_enum"


class BadText(_Kind):
    code = "bad_text"


class BadShape(_Kind):
    code = "bad_shape"


class NotFinite(_Kind):
    code = "not_finite"


class OutOfRange(_Kind):
    code = "out_of_range"


class BadTemperature(OutOfRange):
    code = "bad_temperature"


class BadTopK(OutOfRange):
    code = "bad_top_k"


class BadTopP(OutOfRange):
    code = "bad_top_p"


class BadEpsilon(OutOfRange):
    code = "bad_epsilon"


class TokenOutOfVocab(_Kind):
    code = "token_out_of_vocab"


class WrongRowCount(_Kind):
    code = "wrong_row_count"


class BadParent(_Kind):
    code = "bad_parent"


class BadPath(_Kind):
    code = "bad_path"


class BadScores(_Kind):
    code = "bad_scores"


class BonusMismatch(_Kind):
    code = "bonus_mismatch"


class HandoffSizeMismatch(_Kind):
    code = "handoff_size_mismatch"


class BadHandoffRange(_Kind):
    code = "bad_handoff_range"


class ContextOverflow(_Kind):
    code = "context_overflow"


class ConfigMismatch(_Kind):
    code = "config_mismatch"


def _kinds(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _kinds(sub)


#: code -> exception class, for turning a received ErrorReply back into an exception.
ERROR_CLASSES: dict[str, type[_Kind]] = {cls.code: cls for cls in _kinds(_Kind)}


def error_reply(exc: BaseException) -> ErrorReply:
    """The ErrorReply for an exception.

    A WireError, or any exception whose class declares a string ``code`` meant for the peer (the verifier's
    ``VerifierError`` family), keeps its code and its message (``exc.message``, else ``str(exc)``; cut to 65,535
    utf-8 bytes). Anything else becomes ``internal_error`` naming only the exception's type, so no internals
    leak to the peer.
    """
    code = exc.code if isinstance(exc, WireError) else getattr(type(exc), "code", None)
    if isinstance(code, str) and ERROR_CODE.fullmatch(code) and len(code) <= 255:
        message = getattr(exc, "message", None)
        message = message if isinstance(message, str) else str(exc)
        return ErrorReply(code, message.encode("utf-8")[:65535].decode("utf-8", "ignore"))
    return ErrorReply("internal_error", f"the receiver failed on this message ({type(exc).__name__})")


def error_from_reply(reply: ErrorReply) -> WireError:
    """The exception a received ErrorReply stands for (its class when the code is known, else WireError)."""
    cls = ERROR_CLASSES.get(reply.code)
    return cls(reply.message) if cls is not None else WireError(reply.code, reply.message)
