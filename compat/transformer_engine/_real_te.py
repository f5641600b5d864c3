"""Is NVIDIA's Transformer Engine installed beside this stand-in?

Read by the build backend (compat/build_backend, before anything is installed) and by
transformer_engine/__init__.py at import; it imports nothing outside the standard library.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Optional

# NVIDIA's distributions that ship TE's Python code or its compiled libraries (normalized names)
REAL_DISTS = ("transformer_engine_cu12", "transformer_engine_cu13", "transformer_engine_torch", "transformer_engine_jax")
MARKER = "te_parallel"  # in this stand-in's own METADATA (its summary)
_DIST_DIR = re.compile(r"^([A-Za-z0-9_.\-]+?)-[^-]+\.(dist-info|egg-info)$")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_text(path: str) -> str:
    for leaf in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(path, leaf), encoding="utf-8", errors="replace") as f:
                return f.read(4096)
        except OSError:
            continue
    return ""


def _real_in(directory: str) -> Optional[str]:
    try:
        entries = os.listdir(directory)
    except OSError:
        return None
    for entry in entries:
        path = os.path.join(directory, entry)
        if entry.startswith("transformer_engine_torch") and entry.endswith((".so", ".pyd")):
            return path
        match = _DIST_DIR.match(entry)
        if match is None:
            continue
        name = _normalized(match.group(1))
        if name in REAL_DISTS:
            return path
        if name == "transformer_engine" and MARKER not in _metadata_text(path):
            return path
    common = os.path.join(directory, "transformer_engine", "common")
    if os.path.isdir(common) and any(f.startswith("libtransformer_engine") for f in os.listdir(common)):
        return common
    return None


def find_real_te(directories: Iterable[str]) -> Optional[str]:
    """The first file or metadata directory of NVIDIA's TE found in `directories`, or None."""
    for directory in directories:
        if directory and os.path.isdir(directory):
            found = _real_in(directory)
            if found is not None:
                return found
    return None
