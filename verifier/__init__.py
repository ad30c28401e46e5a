"""hycoc.verifier: the reference verifier (paper Algorithm 4) -- engine here, network server in ``server``."""

from .engine import Session, VerifierEngine
from .errors import (
    BadRequest,
    ContextOverflow,
    NotPrefilled,
    RootMismatch,
    SequenceError,
    SessionFinished,
    TreeError,
    VerifierError,
)
from .kv_cache import kv_bytes_per_session

__all__ = [
    "VerifierEngine",
    "Session",
    "VerifierError",
    "BadRequest",
    "TreeError",
    "RootMismatch",
    "SequenceError",
    "ContextOverflow",
    "SessionFinished",
    "NotPrefilled",
    "kv_bytes_per_session",
]
