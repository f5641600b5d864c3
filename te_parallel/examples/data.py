"""Training text that exists on every machine: the source files of Python's standard library, as bytes.

Byte-level tokens (vocabulary 256). The corpus is the sorted stdlib *.py files concatenated up to
`max_bytes`; the last `val_fraction` of it is the held-out validation split (fixed, never trained on).
Training windows are drawn at random offsets from a torch.Generator that the checkpoint saves, so a
resumed run sees exactly the batches the uninterrupted one would. Under context parallelism every rank of a
CP group draws the same windows and keeps its load-balanced chunks of them (cp_rank, cp_size).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from te_parallel.parallel.context_parallel import shard_sequence

VOCAB = 256
VAL_FRACTION = 0.05
MIN_CORPUS_BYTES = 1 << 16


def load_corpus(max_bytes: int, sources: Optional[List[Tuple[int, str]]] = None) -> torch.Tensor:
    """The text as int64 byte values; `sources`, when given, receives (offset, file) of every file used."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if sources is not None:
            sources.append((total, path.relative_to(root).as_posix()))
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < MIN_CORPUS_BYTES:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}; need at least 64 KiB of text")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.int64)


class ByteData:
    def __init__(self, max_bytes: int, seq_len: int, val_fraction: float = VAL_FRACTION, *, cp_rank: int = 0,
                 cp_size: int = 1) -> None:
        """cp_rank, cp_size: this rank's place in its CP group; the batches then hold its seq_len/cp_size
        positions of each window (chunks cp_rank and 2·cp_size−1−cp_rank of 2·cp_size)."""
        self.cp_rank, self.cp_size = cp_rank, cp_size
        sources: List[Tuple[int, str]] = []
        tokens = load_corpus(max_bytes, sources)
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val, self.seq_len = tokens[:split], tokens[split:], seq_len
        # the files the validation text comes from (the tail of the sorted list, not a random sample)
        self.val_files = [name for i, (_, name) in enumerate(sources)
                          if (sources[i + 1][0] if i + 1 < len(sources) else len(tokens)) > split]

    def describe_val(self) -> str:
        """'encodings/cp860.py … encodings/cp866.py (7 files)': where the validation text comes from."""
        files = self.val_files
        if len(files) <= 2:
            return " and ".join(files)
        return f"{files[0]} … {files[-1]} ({len(files)} files)"

    def batch(self, gen: torch.Generator, batch: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Random windows: ids and next-byte targets, both [seq(/cp), batch] (the layers' "sbhd" layout)."""
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch,), generator=gen)
        return self._windows(self.train, starts, device)

    def val_batches(self, n: int, batch: int, device):
        """n fixed validation batches, evenly spaced over the held-out split."""
        span = len(self.val) - self.seq_len - 1
        starts = torch.linspace(0, span, n * batch).long().view(n, batch)
        return [self._windows(self.val, s, device) for s in starts]

    def _windows(self, src: torch.Tensor, starts: torch.Tensor, device):
        idx = starts.view(1, -1) + torch.arange(self.seq_len + 1).view(-1, 1)  # [s+1, b]
        w = src[idx]
        ids, targets = w[:-1], w[1:]  # [s, b]: a position's target is the next byte, so both shard alike
        if self.cp_size > 1:
            ids, targets = (shard_sequence(t, 0, self.cp_rank, self.cp_size) for t in (ids, targets))  # [s/cp, b]
        return ids.to(device), targets.to(device)
