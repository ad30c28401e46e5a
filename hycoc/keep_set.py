"""The keep-set file a verifier server takes (``--keep-set``): read and checked without torch, so ``hycoc
verify-server`` and ``hycoc serve-ray`` name a bad file in one line before they import torch or load a model.

The keep set is the drafters' restricted vocabulary (paper §3.3): the ``keep_set`` pass of ``hycoc build`` writes
it into every bundle as ``keep_set.npy``, a 1-D array of int token ids. The verifier needs it for ``server-head``
sessions only (docs/serving.md). Its ids are checked against the verifier's vocabulary by
`hycoc.verifier.loading.check_keep_set` (that needs the checkpoint's config).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The file name the keep-set pass writes into a bundle.
KEEP_SET_FILE = "keep_set.npy"
#: How to make one, named in every error about a missing file.
BUILD_HINT = (
    f"give a bundle's {KEEP_SET_FILE}: `hycoc build RECIPE` writes bundles/<recipe name>-<target>/{KEEP_SET_FILE}"
)


def load_keep_set(path: str | os.PathLike):
    """The keep set at ``path`` (``--keep-set``): a non-empty 1-D .npy array of int token ids (numpy's .npy format,
    read with ``allow_pickle=False``). Returns it as numpy int64, shape (|V|,).

    Raises ValueError with one line naming ``--keep-set PATH``, what is wrong and the fix: the file does not exist,
    is a folder, is not a .npy array, or holds no 1-D int ids."""
    import numpy as np

    p = Path(path)
    if p.is_dir():
        hint = f"give the one in it, --keep-set {p / KEEP_SET_FILE}" if (p / KEEP_SET_FILE).is_file() else BUILD_HINT
        raise ValueError(f"--keep-set {path}: is a folder, not a {KEEP_SET_FILE} file; {hint}")
    if not p.exists():
        raise ValueError(f"--keep-set {path}: no such file; {BUILD_HINT}")
    try:
        ids = np.load(p, allow_pickle=False)
    except (OSError, ValueError):
        raise ValueError(f"--keep-set {path}: not a .npy array file; {BUILD_HINT}") from None
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) == 0:
        shape, dtype = getattr(ids, "shape", None), getattr(ids, "dtype", type(ids).__name__)
        raise ValueError(
            f"--keep-set {path}: expected a non-empty 1-D array of int token ids, got shape {shape} dtype {dtype}"
        )
    return ids.astype(np.int64)


__all__ = ["BUILD_HINT", "KEEP_SET_FILE", "load_keep_set"]
