"""Loading parameters and parameter tiles, from memory or from safetensors slices.

A tile is read with ``safe_open(...).get_slice(key)[a:b, c:d]``: only its own
bytes come off the disk, never the whole weight. Every read is recorded in
``WeightStore.reads`` so callers (and tests) can see what was loaded.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .errors import BadCheckpoint
from .ir import DTYPE_BYTES, ParamSpec, quant_region
from .lower.registry import torch_dtype

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def read_raw(spec: ParamSpec) -> torch.Tensor:
    """A ``raw`` param (or tile): only its bytes of the C-ordered array at ``offset`` of ``file``."""
    import numpy as np

    src = spec.source
    assert src.file is not None and src.stored is not None
    try:
        dtype = np.dtype(spec.dtype)
    except TypeError as e:
        raise BadCheckpoint(f"{src.file}: {src.key!r} is {spec.dtype}, which has no raw layout here") from e
    offset = int(src.offset or 0)
    nbytes = int(np.prod(src.stored, dtype=np.int64)) * dtype.itemsize
    try:
        size = os.path.getsize(src.file)
    except OSError as e:
        raise BadCheckpoint(f"{src.file}: cannot be read for {src.key!r}: {e}") from e
    if offset < 0 or offset + nbytes > size:
        raise BadCheckpoint(f"{src.file}: {src.key!r} needs {nbytes} bytes at offset {offset}, the file has "
                            f"{size}: it is truncated or not this model's")
    stored = np.memmap(src.file, dtype=dtype, mode="r", offset=offset, shape=tuple(src.stored))
    view = stored.T if src.transposed else stored
    part = view[tuple(slice(a, b) for a, b in src.slices)] if src.slices is not None else view
    return torch.from_numpy(np.array(part, copy=True, order="C"))


INT4_WAITING = 8
"""int4 tiles' scales and zeros a store keeps, computed with the integers, until their own param is read."""


@dataclass(frozen=True)
class StoredTensor:
    """What a safetensors header says about one tensor."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    offset: int = -1            # NOTE: where its bytes start in the file


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """Parse and check a safetensors header without reading any tensor data.

    Raises ``BadCheckpoint`` for a file that is missing, truncated, or whose header
    is not valid safetensors, naming the file and the sizes involved.
    """
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadCheckpoint(f"{path}: {size} bytes is too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise BadCheckpoint(f"{path}: header says {n} bytes of metadata but the file "
                                    f"has only {size - 8} after the length field (truncated?)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise BadCheckpoint(f"{path}: cannot be read: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadCheckpoint(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise BadCheckpoint(f"{path}: safetensors header is not a JSON object")
    data_bytes = size - 8 - n
    out: dict[str, StoredTensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            start, stop = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadCheckpoint(f"{path}: header entry for {key!r} is malformed: {info!r}") from e
        need = DTYPE_BYTES[dtype]
        for s in shape:
            need *= s
        if stop - start != need:
            raise BadCheckpoint(f"{path}: tensor {key!r} {shape} {dtype} needs {need} bytes "
                                f"but its offsets cover {stop - start}")
        if stop > data_bytes:
            raise BadCheckpoint(f"{path}: tensor {key!r} ends at byte {stop} of the data section "
                                f"but the file holds only {data_bytes} data bytes (truncated)")
        out[key] = StoredTensor(path, key, shape, dtype, 8 + n + start)
    return out


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or a folder (sharded or not)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.exists():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise BadCheckpoint(f"{index}: not a safetensors index ({e})") from e
            return [p / s for s in shards]
        files = sorted(p.glob("*.safetensors"))
        if files:
            return files
    raise BadCheckpoint(f"{path}: no safetensors checkpoint there (a .safetensors file, or a "
                        "folder holding model.safetensors or model.safetensors.index.json)")


@dataclass
class WeightStore:
    """Loads ``ParamSpec`` values: from tensors in memory, inline data or safetensors.

    ``tensors`` maps state-dict keys to tensors (a model's parameters and buffers,
    or a state dict). Params whose source is ``safetensors`` are read from their
    file unless ``tensors`` holds the key.
    """

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    reads: list[tuple[str, tuple[tuple[int, int], ...] | None]] = field(default_factory=list)
    _handles: dict[str, Any] = field(default_factory=dict)
    _headers: dict[str, dict[str, StoredTensor]] = field(default_factory=dict)
    _scales: dict[Any, torch.Tensor] = field(default_factory=dict)     # rows quantized: their scales

    @classmethod
    def from_weights(cls, weights: torch.nn.Module | Mapping[str, torch.Tensor] | None,
                     device: torch.device | str = "cpu") -> WeightStore:
        """``weights``: an ``nn.Module``, a state dict, or None (use the params' sources)."""
        dev = torch.device(device)
        if weights is None:
            return cls(device=dev)
        if isinstance(weights, torch.nn.Module):
            named: dict[str, torch.Tensor] = dict(weights.named_parameters(remove_duplicate=False))
            named.update(weights.named_buffers(remove_duplicate=False))
            for k in getattr(weights, "lazy_buffers", ()):     # NOTE: unread stand-ins (trace/onnx.py)
                named.pop(k, None)
            return cls(named, dev)
        if isinstance(weights, Mapping):
            return cls(dict(weights), dev)
        raise BadCheckpoint(f"weights must be an nn.Module, a state dict or None, "
                            f"got {type(weights).__name__}")

    def _read_rows(self, file: str, key: str,
                   slices: tuple[tuple[int, int], ...] | None) -> torch.Tensor | None:
        """A tile of whole rows (all of a tensor, or a range of its first dimension) read from ``file``
        into memory of its own; None for any other tile (read through the file's mapping).

        A tile that stays a view of the mapped file runs its block about 9% slower than the same
        bytes copied (SmolLM2's decode step on one worker: 48.7 against 44.3 ms), and a copy out of
        the mapping would hold each byte twice while the mapping lives: read, it is held once."""
        st = self._header(file).get(key)
        if st is None:
            return None
        shape, rows = list(st.shape), (0, st.shape[0] if st.shape else 1)
        if slices is not None:
            cut = [(int(a), int(b)) for a, b in slices]
            if len(cut) != len(shape) or any(c != (0, d) for c, d in zip(cut[1:], shape[1:])) \
                    or not 0 <= cut[0][0] <= cut[0][1] <= shape[0]:
                return None
            rows, shape[0] = cut[0], cut[0][1] - cut[0][0]
        row_bytes = DTYPE_BYTES[st.dtype]
        for d in st.shape[1:]:
            row_bytes *= d
        out = torch.empty(shape, dtype=torch_dtype(st.dtype))
        want = row_bytes * (rows[1] - rows[0])
        if want:
            try:
                with open(file, "rb") as f:
                    f.seek(st.offset + rows[0] * row_bytes)
                    got = f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))   # type: ignore[arg-type]
            except OSError as e:
                raise BadCheckpoint(f"{file}: reading {key!r} rows {rows[0]}:{rows[1]} failed: {e}") from e
            if got != want:
                raise BadCheckpoint(f"{file}: {key!r} rows {rows[0]}:{rows[1]} need {want} bytes, "
                                    f"{got} were read (truncated?)")
        return out

    def _header(self, file: str) -> dict[str, StoredTensor]:
        """``file``'s safetensors header, parsed and checked once."""
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(file)
        return self._headers[file]

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._header(file)
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except Exception as e:
                raise BadCheckpoint(f"{file}: cannot be opened as safetensors: {e}") from e
        return self._handles[file]

    def load(self, spec: ParamSpec) -> torch.Tensor:
        src = spec.source
        if src.quant is not None:
            return self._quantized(spec)
        index = tuple(slice(a, b) for a, b in src.slices) if src.slices is not None else ()
        dtype = torch_dtype(spec.dtype)
        if src.key in self.tensors:
            t = self.tensors[src.key]
            if t.is_meta:
                raise BadCheckpoint(f"param {src.key!r} is on the meta device: pass real weights "
                                    "or bind a checkpoint (sb.bind_checkpoint)")
            value = t[index] if index else t
        elif src.kind == "inline" and src.data is not None:
            # NOTE: an inline tile's data is its own values (ParamSource.sliced), its slices say where
            value = torch.tensor(src.data, dtype=dtype).reshape(spec.shape)
        elif src.kind == "raw" and src.file and src.stored is not None:
            value = read_raw(spec)
        elif src.kind == "gguf" and src.file:
            from . import gguf

            value = gguf.load(spec)
        elif src.kind == "safetensors" and src.file:
            rows = self._read_rows(src.file, src.key, src.slices)
            if rows is not None:
                value = rows
            else:
                sl = self._open(src.file).get_slice(src.key)
                try:
                    value = sl[index] if index else sl[:]
                except Exception as e:
                    raise BadCheckpoint(f"{src.file}: reading {src.key!r}{list(src.slices or [])} "
                                        f"failed: {e}") from e
        else:
            raise BadCheckpoint(f"no weights for param {spec.name!r} (key {src.key!r}): pass the "
                                "model or a state dict, or bind a checkpoint")
        self.reads.append((src.key, src.slices))
        if tuple(value.shape) != spec.shape:
            raise BadCheckpoint(f"param {spec.name!r} (key {src.key!r}) has shape "
                                f"{tuple(value.shape)}, the graph expects {spec.shape}")
        return value.to(device=self.device, dtype=dtype)

    def _quantized(self, spec: ParamSpec) -> torch.Tensor:
        """A param derived from a float weight (``ParamSource.quant``): the float rows its tile
        covers are read whole (all ``k`` columns: a row's scale is over all of it), quantized
        (``quantize.quantize_rows``) and dropped. The scales of rows quantized are kept by the
        rows' source (a few bytes a row), so the scale params that follow read no float row again;
        loads may run on several threads at once: each computes its own rows."""
        from .quantize import quantize_rows

        src = spec.source
        assert src.whole is not None
        n, k = src.whole
        if src.quant is not None and src.quant.startswith("int4"):
            return self._int4(spec)
        rows = src.slices[0] if src.slices is not None else (0, n)
        key = (replace(src, quant=None, slices=None), rows)
        scale = self._scales.get(key)
        q = None
        if scale is None or src.quant == "int8":
            sliced = None if rows == (0, n) else (rows, (0, k))
            plain = replace(src, quant=None, whole=None, slices=sliced)
            floats = self.load(ParamSpec(spec.name, (rows[1] - rows[0], k), "float32", plain))
            q, scale = quantize_rows(floats)
            self._scales[key] = scale
        if src.quant == "int8":
            assert q is not None
            cols = src.slices[1] if src.slices is not None and len(src.slices) > 1 else (0, k)
            value = q if cols == (0, k) else q[:, cols[0]:cols[1]].contiguous()
        else:
            value = scale if len(spec.shape) == 1 else scale[:, None]      # NOTE: [n, 1]: a table's
        if tuple(value.shape) != spec.shape:
            raise BadCheckpoint(f"param {spec.name!r} ({src.quant} of {src.key!r}) has shape "
                                f"{tuple(value.shape)}, the graph expects {spec.shape}")
        return value.to(device=self.device, dtype=torch_dtype(spec.dtype))

    def _int4(self, spec: ParamSpec) -> torch.Tensor:
        """An int4 tile (``quantize.py``'s int4 schemes) or its scales and zeros: the float block its
        rows and groups cover is read, quantized group by group (``quantize.quantize_groups``) and
        packed for the int4 kernel (``qlinear.pack_int4``: its layout is a tile's own, so each tile is
        packed from its own rows). The scales and zeros computed with the integers wait for the
        param that follows (by the same tile's source), so the float rows are read once."""
        from .qlinear import pack_int4
        from .quantize import quantize_groups

        src = spec.source
        assert src.whole is not None and src.quant is not None
        n, k = src.whole
        group = int(src.quant.split("-")[1][1:])
        sz_kind = src.quant.endswith("-sz")
        rows, cols = quant_region(src)      # NOTE: [n / 64, k, 32] (qlinear.pack_int4): whole blocks
        key = (replace(src, quant=None, slices=None), rows, cols)
        value = self._scales.pop(key, None) if sz_kind else None
        if value is None and src.kind == "gguf" and group == 32 and src.file:
            from . import gguf

            f = gguf.open_gguf(src.file)
            if f.info(src.key).type in gguf.EXACT_INT4:     # NOTE: the file's own integers, as they are
                q, sz = f.int4_rows(src.key, rows, cols, src.heads)
                value = sz if sz_kind else pack_int4(q)
        if value is None:
            sliced = None if (rows, cols) == ((0, n), (0, k)) else (rows, cols)
            plain = replace(src, quant=None, whole=None, slices=sliced)
            floats = self.load(ParamSpec(spec.name, (rows[1] - rows[0], cols[1] - cols[0]), "float32", plain))
            q, sz = quantize_groups(floats, group)
            if sz_kind:
                value = sz
            else:
                value = pack_int4(q)
                self._scales[key] = sz
                # NOTE: a block reads a weight's scales right after it; one left unread (its block
                # loaded elsewhere) is dropped after a few others, so the store holds no stray copies
                waiting = [k for k in list(self._scales) if len(k) == 3]
                for old in waiting[:-INT4_WAITING]:
                    self._scales.pop(old, None)
        if tuple(value.shape) != spec.shape:
            raise BadCheckpoint(f"param {spec.name!r} ({src.quant} of {src.key!r}) has shape "
                                f"{tuple(value.shape)}, the graph expects {spec.shape}")
        return value.to(device=self.device)
