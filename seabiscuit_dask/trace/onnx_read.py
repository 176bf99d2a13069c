"""Reading an ONNX file: its model, and where each initializer's bytes lie.

A weight is read where it is stored, never copied: an initializer kept outside the model
file (external data) lies at an offset of a file in the model's folder; one kept inside it
lies at an offset of the ``.onnx`` file itself (its ``raw_data``, or packed ``float_data`` /
``double_data``), which ``embedded_places`` finds by walking the protobuf fields without
decoding the tensors. Either way a tile of it is read as raw bytes (``ParamSource`` kind
``raw``, ``weights.read_raw``), on the worker that holds the tile.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadCheckpoint

if TYPE_CHECKING:
    from onnx import ModelProto, TensorProto

Place = tuple[Path, int, np.dtype, tuple[int, ...]]
"""Where an initializer's bytes are: the file, the byte offset, the dtype and the shape (C order)."""

# NOTE: ONNX TensorProto data types whose bytes numpy reads as they are stored (little-endian)
RAW_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
              10: "float16", 11: "float64"}
# NOTE: field numbers of ModelProto.graph, GraphProto.initializer and TensorProto's fields
_GRAPH, _INITIALIZER = 7, 5
_DIMS, _DATA_TYPE, _FLOAT_DATA, _NAME, _RAW_DATA, _DOUBLE_DATA, _LOCATION = 1, 2, 4, 8, 9, 10, 14


def read_model(source: Any) -> tuple[ModelProto, Path | None]:
    """The ``ModelProto`` of ``source`` (a ``ModelProto``, an ``.onnx`` file or a folder holding
    ``model.onnx``) and the file it was read from (None for a ``ModelProto``). External data is
    not read here (``initializer_array``)."""
    import onnx

    if type(source).__name__ == "ModelProto":
        return source, None
    p = Path(source)
    if p.is_dir():
        p = p / "model.onnx"
    if not p.is_file():
        raise BadCheckpoint(f"no ONNX model at {p}")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as e:
        raise BadCheckpoint(f"{p} ({p.stat().st_size} bytes) is not a readable ONNX model: "
                            f"{type(e).__name__}: {str(e)[:200]}; it may be truncated") from e
    if not model.graph.node:
        raise BadCheckpoint(f"{p} ({p.stat().st_size} bytes) holds no graph nodes; it may be truncated")
    return model, p


def external_place(t: TensorProto, folder: Path | None) -> Place:
    """Where an initializer stored outside the model file is, checked: the file lies inside the
    model's folder and holds the tensor's bytes."""
    from onnx import helper

    info = {e.key: e.value for e in t.external_data}
    where = f"initializer {t.name!r}"
    if folder is None:
        raise BadCheckpoint(f"{where} lives in external file {info.get('location')!r}, but the model was "
                            "given as a ModelProto: load it from its file, or with its data")
    loc = info.get("location", "")
    path = (folder / loc).resolve()
    if not loc or os.path.isabs(loc) or folder.resolve() not in path.parents:
        raise BadCheckpoint(f"{where}: external data location {loc!r} is outside the model's folder "
                            f"{folder}; only files inside it are read")
    if not path.is_file():
        raise BadCheckpoint(f"{where}: external data file {path} is missing")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    shape = tuple(int(d) for d in t.dims)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    offset = int(info.get("offset", 0))
    length = int(info.get("length", nbytes))
    size = path.stat().st_size
    if length != nbytes or offset + length > size:
        raise BadCheckpoint(f"{where}: needs {nbytes} bytes at offset {offset} of {path} "
                            f"({size} bytes, length given {length}): the file is truncated or wrong")
    return path, offset, dtype, shape


def initializer_array(t: TensorProto, folder: Path | None) -> np.ndarray:
    """An initializer's values (``read_external`` for external data)."""
    from onnx import numpy_helper

    if t.data_location == 1:      # NOTE: TensorProto.EXTERNAL
        return read_external(t, folder)
    return np.asarray(numpy_helper.to_array(t))


def read_external(t: TensorProto, folder: Path | None) -> np.ndarray:
    """An initializer stored outside the model file: only its own bytes, from inside the model's folder."""
    path, offset, dtype, shape = external_place(t, folder)
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def embedded_places(path: Path) -> dict[str, Place]:
    """Where the initializers stored inside the ``.onnx`` file at ``path`` are, by name: those
    whose bytes lie there as numpy reads them (``raw_data`` of a type in ``RAW_DTYPES``, or packed
    ``float_data`` of a float32 / ``double_data`` of a float64 tensor). Others (varint-coded
    integers, strings, external data) are left out."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        out: dict[str, Place] = {}
        for num, start, stop in _fields(buf, 0, len(buf), path):
            if num != _GRAPH:
                continue
            for inner, a, b in _fields(buf, start, stop, path):
                if inner == _INITIALIZER:
                    found = _tensor_place(buf, a, b, path)
                    if found is not None:
                        out[found[0]] = found[1]
        return out


def _tensor_place(buf: mmap.mmap, start: int, stop: int, path: Path) -> tuple[str, Place] | None:
    name, dtype_code, data, location = "", 0, None, 0
    dims: list[int] = []
    for num, a, b in _fields(buf, start, stop, path):
        if num == _NAME:
            name = bytes(buf[a:b]).decode("utf-8", "replace")
        elif num == _DATA_TYPE:
            dtype_code = _varint(buf, a)[0]
        elif num == _DIMS:
            dims.extend(_varints(buf, a, b))
        elif num == _LOCATION:
            location = _varint(buf, a)[0]
        elif num == _RAW_DATA or (num, dtype_code) in ((_FLOAT_DATA, 1), (_DOUBLE_DATA, 11)):
            data = (a, b)
    if location == 1 or data is None or dtype_code not in RAW_DTYPES:
        return None
    dtype = np.dtype(RAW_DTYPES[dtype_code])
    shape = tuple(int(d) for d in dims)
    if data[1] - data[0] != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        return None      # NOTE: e.g. a float_data that repeats field entries instead of packing them
    return name, (path, data[0], dtype, shape)


def _varint(buf: mmap.mmap, i: int) -> tuple[int, int]:
    """The varint at ``buf[i]`` and the index after it."""
    out = shift = 0
    while True:
        byte = buf[i]
        i += 1
        out |= (byte & 0x7F) << shift
        if byte < 0x80:
            return out, i
        shift += 7


def _varints(buf: mmap.mmap, start: int, stop: int) -> Iterator[int]:
    """The values of a varint field: one (``stop`` at its end) or a packed run."""
    i = start
    while i < stop:
        v, i = _varint(buf, i)
        yield v


def _fields(buf: mmap.mmap, start: int, stop: int, path: Path) -> Iterator[tuple[int, int, int]]:
    """``(field number, value start, value stop)`` of each field of the message at
    ``buf[start:stop]``; a length-delimited value's span is its payload."""
    i = start
    while i < stop:
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            j = _varint(buf, i)[1]
        elif wire == 1:
            j = i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            j = i + n
        elif wire == 5:
            j = i + 4
        else:
            raise BadCheckpoint(f"{path}: wire type {wire} at byte {i} is not ONNX's protobuf; "
                                "the file is damaged")
        if j > stop:
            raise BadCheckpoint(f"{path}: field {num} at byte {i} runs to {j}, past its message's end "
                                f"{stop}: the file is truncated or damaged")
        yield num, i, j
        i = j
