"""Errors the verifier engine raises. Each has a stable ``code`` (the wire's ``ErrorReply.code``).

Every check runs before the session's state (cache, tokens, generator) is touched, so a session that raised is
unchanged and can take the next (correct) round.
"""

from __future__ import annotations


class VerifierError(ValueError):
    """Base class. ``code``: machine-readable kind; the message says what was wrong and how to fix it."""

    code = "verifier_error"


class BadRequest(VerifierError):
    """An open request with an invalid field (empty prompt, unknown acceptance mode, missing head, ...)."""

    code = "bad_request"


class TreeError(VerifierError):
    """A malformed draft tree: bad parent row, token outside the vocabulary, wrong row count."""

    code = "bad_tree"


class RootMismatch(VerifierError):
    """The tree's root is not the session's current root x_{t+1} (the last committed token)."""

    code = "bad_root"


class OverAllowance(VerifierError):
    """A ROUND with more rows than the allowance of the session's last REPLY (protocol 6; the first round after
    OPEN or APPEND may hold OPENED's tree_rows). The session is unchanged: draft at most the allowance and resend."""

    code = "over_allowance"


class SequenceError(VerifierError):
    """A round whose sequence number is neither the next one nor a retry of the last one."""

    code = "bad_seq"


class ContextOverflow(VerifierError):
    """The prompt or a tree would place a row at a position >= the verifier's max_context."""

    code = "context_overflow"


class ConversationMismatch(VerifierError):
    """An APPEND whose kept prefix is not what the session holds (``keep`` past the held ids, or their crc32
    differs): the device and the verifier disagree about the conversation. The session is unchanged."""

    code = "conversation_mismatch"


class SessionFinished(VerifierError):
    """A round sent after the request finished (EOS committed or max_new_tokens reached)."""

    code = "finished"


class NotPrefilled(VerifierError):
    """A round sent before ``Session.prefill``."""

    code = "not_prefilled"


class InjectedFault(VerifierError):
    """A fault injected on purpose (`hycoc.verifier.faults`, soak runs only); the request changed nothing."""

    code = "injected_fault"
