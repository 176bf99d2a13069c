"""Activations on the wire: tensors of every dtype, SeaBiscuit's own serialization.

distributed's torch serializer goes through numpy, which has no bfloat16 (and
reads CUDA tensors not at all). ``Tensors`` is a name -> tensor mapping that
serializes each tensor as its raw bytes (one frame each, no copy for a
contiguous CPU tensor) plus its dtype and shape, and comes back on the CPU; the
block that reads it moves it to its own device. It is what block outputs are on
both data planes: returned by a task, or sent worker to worker.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import torch
from dask.sizeof import sizeof
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from ...errors import BadMessage, UnsupportedModel

# NOTE: the dtypes an activation may have; anything else named in a header is refused
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class Tensors(dict):  # type: ignore[type-arg]
    """Named tensors that travel between workers and to the client (see module doc);
    ``wire_bytes``: of a batch read off a stream, the bytes its own frames carried (a tensor
    sent once for several names counts once), else None."""

    wire_bytes: int | None = None


# NOTE: each dtype as numpy holds its bytes (bfloat16, which numpy lacks, as int16): a tensor
# becomes bytes and back with one numpy view each way, not a chain of torch calls (each costs
# tens of microseconds where a block run left the caches cold, as at every hop of a decode step)
NUMPY: dict[torch.dtype, type[np.generic]] = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.bfloat16: np.int16, torch.complex64: np.complex64, torch.complex128: np.complex128,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_}
NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}
Frame = bytes | bytearray | memoryview      # the bytes of one frame, or a view of them


def dtype_name(t: torch.Tensor) -> str:
    """How a header names the dtype of ``t``; one no activation may have is refused here."""
    name = NAMES.get(t.dtype)
    if name is None:
        raise UnsupportedModel(f"an activation of dtype {str(t.dtype).removeprefix('torch.')} cannot be "
                               f"sent; SeaBiscuit sends only {', '.join(DTYPES)} (cast it in the model)")
    return name


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (moved to the CPU and made contiguous if it is not already)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16)
    try:
        a = t.numpy()
    except RuntimeError:            # NOTE: a lazily conjugated or negated view: made real first
        a = t.resolve_conj().resolve_neg().numpy()
    if not a.size:
        return memoryview(b"")
    try:
        return memoryview(a).cast("B")  # type: ignore[arg-type]
    except TypeError:               # NOTE: not C-contiguous
        return memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B")  # type: ignore[arg-type]


ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in DTYPES.values()}


def from_bytes(buf: Frame, dtype: str, shape: list[int], offset: int = 0, nbytes: int = -1) -> torch.Tensor:
    """A CPU tensor of ``dtype`` and ``shape`` over ``buf`` (its ``nbytes`` from ``offset``; all of
    it by default), copied once if ``buf`` is read-only."""
    kind = DTYPES.get(dtype)
    if kind is None:
        raise BadMessage(f"an activation of dtype {dtype!r} arrived; SeaBiscuit sends only "
                         f"{', '.join(DTYPES)}")
    dims = [int(s) for s in shape]
    n = 1
    for s in dims:
        n *= s
    if nbytes < 0:
        buf = memoryview(buf).cast("B")
        nbytes = buf.nbytes - offset
    if nbytes != n * ITEMSIZE[kind]:
        raise BadMessage(f"an activation of dtype {dtype} and shape {list(shape)} arrived with "
                         f"{nbytes} bytes")
    if not n:
        return torch.empty(dims, dtype=kind)
    if type(buf) is not bytearray and memoryview(buf).readonly:
        buf, offset = bytearray(memoryview(buf)[offset:offset + nbytes]), 0
    t = torch.from_numpy(np.frombuffer(buf, dtype=NUMPY[kind], count=n, offset=offset).reshape(dims))
    return t.view(torch.bfloat16) if kind is torch.bfloat16 else t


@dask_serialize.register(Tensors)
def _serialize(ts: Tensors) -> tuple[dict[str, Any], list[memoryview]]:
    names = list(ts)
    header = {"names": names, "dtypes": [dtype_name(ts[n]) for n in names],
              "shapes": [list(ts[n].shape) for n in names]}
    return header, [as_bytes(ts[n]) for n in names]


@dask_deserialize.register(Tensors)
def _deserialize(header: dict[str, Any], frames: list[Any]) -> Tensors:
    names, dtypes, shapes = header["names"], header["dtypes"], header["shapes"]
    if not len(names) == len(dtypes) == len(shapes) == len(frames):
        raise BadMessage(f"an activation message names {len(names)} tensors and has {len(frames)} "
                         "frames")
    return Tensors({str(n): from_bytes(f, str(d), list(s))
                    for n, d, s, f in zip(names, dtypes, shapes, frames)})


@sizeof.register(Tensors)
def _sizeof(ts: Tensors) -> int:
    return sum(int(t.numel() * t.element_size()) + 64 for t in ts.values())


def nbytes(ts: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors in a mapping; of one read off a stream, the bytes that crossed."""
    crossed = getattr(ts, "wire_bytes", None)
    if crossed is not None:
        return int(crossed)
    return sum(int(t.numel() * t.element_size()) for t in ts.values() if isinstance(t, torch.Tensor))


def inline(ts: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    """Tensors as plain msgpack data, ``[name, dtype, shape, bytes]`` each: a few small ones (a
    decode step's tokens, down a follow) go in a message without distributed's serialization
    (a cold 0.1-0.2 ms at each end of every step)."""
    return [[str(n), NAMES.get(t.dtype) or dtype_name(t), list(t.shape), bytes(as_bytes(t))]
            for n, t in ts.items()]


def from_inline(items: Any) -> Tensors:
    """``inline``'s tensors back; a dtype, shape or length that does not fit is refused."""
    try:
        return Tensors({str(n): from_bytes(bytearray(b), str(d), list(s)) for n, d, s, b in items})
    except (TypeError, ValueError) as e:
        raise BadMessage(f"tensors sent inline are malformed ({type(e).__name__}: {e})") from None


# --- stream messages as frames (``streams``) ---------------------------------------------------
MAX_FRAMES = 1 << 16            # NOTE: per batch; a header naming more is refused before reading on
MAX_FRAME_BYTES = 1 << 33       # NOTE: 8 GiB: an activation bigger than this is not a real one
FIELDS = ("tensors", "inputs")  # NOTE: the only fields that carry tensors


def pack(msgs: Sequence[dict[str, Any]]) -> list[Any]:
    """A batch of data-plane messages as frames: a prefix (frame count and lengths), a msgpack
    header (the messages, each tensor mapping replaced by its index), then each tensor's bytes.
    A ``tensors`` field holds one mapping; an ``inputs`` field a list of (block, mapping).
    A tensor that is another one of the batch (the same memory, shape and strides: each layer's
    view of one rotary table) goes once; its header entry names the frame (``[name, dtype, shape,
    frame]``)."""
    specs: list[list[list[Any]]] = []
    frames: list[memoryview] = []
    sent: dict[tuple[Any, ...], int] = {}

    def entry(name: str, t: torch.Tensor) -> list[Any]:
        dtype = NAMES.get(t.dtype) or dtype_name(t)
        head = [str(name), dtype, list(t.shape)]
        key = (t.data_ptr(), dtype, t.shape, t.stride(), None if t.is_cpu else t.device)
        at = sent.get(key)
        if at is not None and t.numel():
            return [*head, at]
        sent[key] = len(frames)
        frames.append(as_bytes(t))
        return head

    def take(ts: Mapping[str, torch.Tensor]) -> int:
        specs.append([entry(n, t) for n, t in ts.items()])
        return len(specs) - 1

    out = []
    for m in msgs:
        m = dict(m)
        if "tensors" in m:
            m["tensors"] = take(m["tensors"])
        if "inputs" in m:
            m["inputs"] = [[b, take(ts)] for b, ts in m["inputs"]]
        out.append(m)
    head = msgpack.packb({"msgs": out, "tensors": specs}, use_bin_type=True)
    lengths = [len(head), *(f.nbytes for f in frames)]
    return [struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths), head, *frames]


ALIGN = 64                      # NOTE: tensors start at multiples of this in a packed message


def pack_message(msgs: Sequence[dict[str, Any]]) -> tuple[list[Any], int]:
    """``pack``'s frames laid end to end as one message of a stream (``streams``), each tensor's bytes
    starting at a multiple of ``ALIGN`` (zero bytes between): the pieces and their total length."""
    prefix, head, *data = pack(msgs)
    out, pos = [prefix, head], len(prefix) + len(head)
    for f in data:
        pad = -pos % ALIGN
        if pad:
            out.append(bytes(pad))
        out.append(f)
        pos += pad + f.nbytes
    return out, pos


def unpack_message(buf: Frame) -> list[dict[str, Any]]:
    """The messages of one ``pack_message`` buffer; each tensor is a view of ``buf`` (no copy)."""
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if mv.nbytes < 8:
        raise BadMessage(f"a data-plane message of {mv.nbytes} bytes (it needs 8 at least)")
    (n,) = struct.unpack_from("<Q", mv, 0)
    if not 1 <= n <= MAX_FRAMES or 8 + 8 * n > mv.nbytes:
        raise BadMessage(f"a data-plane message of {mv.nbytes} bytes names {n} frames")
    lengths = struct.unpack_from(f"<{n}Q", mv, 8)
    pos = 8 + 8 * n + lengths[0]
    head, frames = mv[8 + 8 * n:pos], []
    for length in lengths[1:]:
        pos += -pos % ALIGN
        frames.append((pos, length))
        pos += length
    if pos != mv.nbytes:
        raise BadMessage(f"a data-plane message of {mv.nbytes} bytes whose frames take {pos}")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    return _unpack(head, [n for _, n in frames],
                   lambda i, dtype, shape: from_bytes(mv, dtype, shape, *frames[i]))


def unpack(head: bytes, frames: Sequence[Frame]) -> list[dict[str, Any]]:
    """``pack``'s messages back, tensors and all; a header that does not match its frames is refused."""
    return _unpack(head, [memoryview(f).nbytes for f in frames],
                   lambda i, dtype, shape: from_bytes(frames[i], dtype, shape))


# (frame index, dtype, shape) -> the tensor over that frame's bytes
ReadFrame = Callable[[int, str, list[int]], torch.Tensor]


def _unpack(head: Frame, sizes: list[int], frame: ReadFrame) -> list[dict[str, Any]]:
    """``unpack``, of frames of ``sizes`` bytes, each read by ``frame(i, dtype, shape)``; a header
    that is not the layout ``pack`` writes (a field missing or of another kind) is refused."""
    try:
        return _build(msgpack.unpackb(head, raw=False, strict_map_key=True), sizes, frame)
    except BadMessage:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise BadMessage(f"a data-plane message's header is malformed ({type(e).__name__}: "
                         f"{e})") from None


def _build(h: Any, sizes: list[int], frame: ReadFrame) -> list[dict[str, Any]]:
    count = len(sizes)
    built: list[Tensors] = []
    read: list[torch.Tensor] = []
    for spec in h["tensors"]:
        ts = Tensors()
        own = 0             # NOTE: bytes of the frames this batch's tensors read first
        for name, dtype, shape, *again in spec:
            if again:           # NOTE: a frame read already: a tensor of its own, not the same memory
                at = again[0]
                ref = read[at] if len(again) == 1 and isinstance(at, int) and 0 <= at < len(read) else None
                if ref is None or NAMES.get(ref.dtype) != dtype or list(ref.shape) != shape:
                    raise BadMessage(f"a data-plane batch names frame {again} for tensor {name!r} of "
                                     f"{dtype} {shape}, after {len(read)} frames")
                ts[str(name)] = ref.clone()
                continue
            if len(read) >= count:
                raise BadMessage(f"a data-plane batch names more tensors than its {count} frames")
            ts[str(name)] = t = frame(len(read), str(dtype), shape)
            own += sizes[len(read)]
            read.append(t)
        ts.wire_bytes = own
        built.append(ts)
    if len(read) != count:
        raise BadMessage(f"a data-plane batch has {count} frames and names {len(read)} tensors")
    msgs = []
    for m in h["msgs"]:
        m = dict(m)
        if "tensors" in m:
            m["tensors"] = built[int(m["tensors"])]
        if "inputs" in m:
            m["inputs"] = [[b, built[int(i)]] for b, i in m["inputs"]]
        msgs.append(m)
    return msgs
