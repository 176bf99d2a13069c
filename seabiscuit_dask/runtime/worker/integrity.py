"""Checksums for weight tiles and block-output checkpoints; checkpoints stored safely.

Tiles carry a CRC-32 of their bytes: computed from the model when SeaBiscuit
writes the weight store (the reference), or on first load from a user's
checkpoint. Checkpoints are safetensors files (never pickles) whose metadata holds
the CRC-32 of every tensor; a file that is missing, truncated or whose bytes do
not match is reported as absent, so the block runs again instead.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (about 4 GB/s here)."""
    x = t.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    x = x.contiguous().reshape(-1)
    return zlib.crc32(x.view(torch.uint8).numpy().data) if x.numel() else 0


def request_folder(root: str | os.PathLike[str], model: str, request: int) -> Path:
    """Where the blocks of ``request`` of ``model`` checkpoint their outputs under ``root``: the
    caller makes and deletes it, workers write into it (both must name the same folder)."""
    return Path(root) / model / f"r{int(request)}"


def save_checkpoint(path: Path, tensors: Mapping[str, torch.Tensor], make_folder: bool = True) -> None:
    """Write ``tensors`` with their checksums, atomically (a reader sees all or nothing);
    ``make_folder=False``: only into a folder that exists (``FileNotFoundError`` if it does not)."""
    from safetensors.torch import save_file

    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: exports may be views of one another; safetensors needs each its own storage.
    cpu = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    meta = {f"crc32:{k}": str(crc32(v)) for k, v in cpu.items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(cpu, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(tensors, "") when ``path`` holds an intact checkpoint, else (None, why)."""
    from safetensors import safe_open

    if not path.exists():
        return None, "missing"
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata() or {}
            out = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - any unreadable file is "not a checkpoint"
        return None, f"unreadable ({e})"
    for k, v in out.items():
        want = meta.get(f"crc32:{k}")
        if want is None or int(want) != crc32(v):
            return None, f"checksum mismatch on {k!r}"
    return out, ""
