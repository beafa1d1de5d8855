"""The GGUF container: one walk over the header that checks every count and offset against the
file and decodes the metadata, then the tensors as views of the memory-mapped file.

gguf-py's reader decodes a vocabulary one value at a time through numpy (2.6 s for 32k
tokens, most of a load); this walk reads scalar arrays in one `np.frombuffer` and strings by
slicing (a 150k-token vocabulary in a fraction of a second). String values stay bytes until
`text()` decodes them, so that one undecodable field fails only where it is needed.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]  # numpy 1.x only

from ..errors import CheckpointError, UnsupportedModelError

# GGUF metadata value types: numpy dtypes of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8",
            11: "i8", 12: "f8"}  # fmt: skip
_STRING, _ARRAY, _UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32
# GGML types held as numbers (others are blocks of bytes, as gguf-py reads them)
_NUMBERS = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4",
            "I64": "i8"}  # fmt: skip


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: `dims` in GGUF order (ne: the row width first), `data` a view
    of the mapped file (numbers in numpy order [..., rows, width]; other types their bytes
    [..., rows, bytes per row], as gguf-py shapes them)."""

    name: str
    dims: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # in the file
    n_bytes: int
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dims


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    fields: dict[str, Any]  # key -> int / float / bool / bytes, or a list of them
    tensors: list[Tensor]
    mapped: np.memmap  # the whole file, read-only

    def release(self, t: Tensor) -> None:
        """Drop the mapped pages of a tensor that has been copied out: they would otherwise
        stay in the process's resident memory for the whole load."""
        mm = getattr(self.mapped, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)


def release_views(views) -> None:
    """Drop the resident pages of a mapped file under these arrays (views of an np.memmap
    whose contents have been copied out; a page is read again from the page cache if
    touched); arrays that are not views of a mapped file are left alone."""
    for view in views:
        root = view  # the array whose base is the mapping (through views and as_strided's)
        while root is not None and not isinstance(getattr(root, "base", None), mmap.mmap):
            root = getattr(root, "base", None)
        if root is None or view.size == 0:
            continue
        start = root.ctypes.data - getattr(root, "offset", 0) % mmap.ALLOCATIONGRANULARITY
        lo, hi = byte_bounds(view)
        first = -(-(lo - start) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside
        last = (hi - start) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and hasattr(root.base, "madvise"):
            root.base.madvise(mmap.MADV_DONTNEED, first, last - first)


def text(value: Any) -> Any:
    """A field's value with its strings decoded as UTF-8 (UnicodeDecodeError if one is not)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    return value


def read(file: Path) -> GGUFFile:
    """The file's metadata and tensors. Raises a one-line CheckpointError naming the first bad
    field (an array of 2**60 numbers, a tensor past the end of the file, a misaligned one...),
    UnsupportedModelError for a tensor type id unknown to gguf-py."""
    import gguf

    size = file.stat().st_size
    where = f"GGUF file {str(file)!r}"

    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}; the file is corrupt or truncated")

    if size < 24:
        raise corrupt(f"{size} bytes is shorter than a GGUF header")
    mapped = np.memmap(file, np.uint8, mode="r")
    data = memoryview(mapped)  # type: ignore[arg-type]  # numpy stubs: __buffer__ on 3.12+ only
    if bytes(data[:4]) != b"GGUF":
        raise CheckpointError(f"{where} does not start with 'GGUF'; is it a GGUF file?")
    # a version whose low half is zero: a big-endian file, which gguf-py reads too
    order: Literal["<", ">"] = "<" if int.from_bytes(data[4:8], "little") & 0xFFFF else ">"
    (version,) = struct.unpack_from(order + "I", data, 4)
    if version not in (2, 3):
        raise corrupt(f"GGUF version {version} (jaxinfer reads versions 2 and 3)")
    pos = 24

    def take(fmt: str, what: str) -> tuple:
        nonlocal pos
        n = struct.calcsize(order + fmt)
        if pos + n > size:
            raise corrupt(f"the file ends inside {what}")
        pos += n
        return struct.unpack_from(order + fmt, data, pos - n)

    def skip(n: int, what: str) -> None:
        nonlocal pos
        if n > size - pos:
            raise corrupt(f"{what} declares {_human(n)} but {_human(size - pos)} remain")
        pos += n

    def string(what: str) -> bytes:
        (n,) = take("Q", what)
        skip(n, what)
        return bytes(data[pos - n : pos])

    def shown(raw: bytes) -> str:  # quoted, escaped and cut: it may be garbage
        return repr(raw[:80].decode("utf-8", "replace"))

    def scalars(vtype: int, count: int, what: str) -> np.ndarray:
        dtype = np.dtype(_SCALARS[vtype]).newbyteorder(order)
        skip(count * dtype.itemsize, f"{what} ({count} values)" if count > 1 else what)
        return np.frombuffer(data, dtype, count, pos - count * dtype.itemsize)

    def value(vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return scalars(vtype, 1, what)[0].item()
        if vtype == _STRING:
            return string(what)
        if vtype != _ARRAY:
            raise corrupt(f"{what} has unknown value type {vtype}")
        itype, count = take("IQ", what)
        if itype in _SCALARS:
            return scalars(itype, count, what).tolist()
        if itype != _STRING:  # llama.cpp refuses arrays of arrays too
            raise corrupt(f"{what} is an array of value type {itype}")
        if count * 8 > size - pos:  # their lengths alone would not fit
            raise corrupt(f"{what} declares {count} strings")
        return [string(what) for _ in range(count)]

    n_tensors, n_kv = struct.unpack_from(order + "QQ", data, 8)
    # each metadata entry takes at least 13 bytes, each tensor's entry 28
    if 13 * n_kv + 28 * n_tensors > size:
        raise corrupt(
            f"the header declares {n_kv} metadata entries and {n_tensors} tensors, more than "
            f"its {_human(size)} can hold"
        )
    fields: dict[str, Any] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        raw = string(f"the key of metadata entry {i}")
        (vtype,) = take("I", f"metadata {shown(raw)}")
        fields[raw.decode("utf-8", "replace")] = got = value(vtype, f"metadata {shown(raw)}")
        if raw == b"general.alignment":
            if vtype != _UINT32 or got & (got - 1) or not got:
                raise corrupt("general.alignment is not a power of two (uint32)")
            alignment = got
    table = []
    for i in range(n_tensors):
        raw = string(f"the name of tensor {i}")
        (n_dims,) = take("I", f"tensor {shown(raw)}")
        if not 1 <= n_dims <= 4:
            raise corrupt(f"tensor {shown(raw)} has {n_dims} dims; GGUF tensors have 1 to 4")
        dims = take(f"{n_dims}Q", f"tensor {shown(raw)}")
        table.append((raw, dims, *take("IQ", f"tensor {shown(raw)}")))
    start = -(-pos // alignment) * alignment  # the tensor data follows the table, aligned
    known = {t.value for t in gguf.GGMLQuantizationType}
    tensors, names = [], set()
    for raw, dims, type_id, offset in table:
        name = shown(raw)
        if type_id not in known:
            raise UnsupportedModelError(
                f"{where}: tensor {name} has unknown GGUF type id {type_id}; the file is "
                "corrupt or newer than jaxinfer's gguf library"
            )
        qtype = gguf.GGMLQuantizationType(type_id)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if min(dims) == 0 or dims[0] % block:
            raise corrupt(
                f"tensor {name} has dims {list(dims)}: empty, or rows that are not whole "
                f"{qtype.name} blocks of {block}"
            )
        if offset % alignment:
            raise corrupt(f"tensor {name} starts at data offset {offset}, not {alignment}-aligned")
        n_bytes = math.prod(dims) // block * block_bytes
        if start + offset + n_bytes > size:
            raise corrupt(
                f"tensor {name} declares {math.prod(dims)} elements ({_human(n_bytes)} of "
                f"{qtype.name}) at data offset {offset}, past the end of the file "
                f"({_human(size)})"
            )
        if raw in names:
            raise corrupt(f"tensor {name} appears twice")
        names.add(raw)
        shape = tuple(reversed(dims))
        if qtype.name in _NUMBERS:
            dtype = np.dtype(_NUMBERS[qtype.name]).newbyteorder(order)
        else:
            dtype, shape = np.dtype(np.uint8), (*shape[:-1], dims[0] // block * block_bytes)
        view = mapped[start + offset : start + offset + n_bytes].view(dtype).reshape(shape)
        tensors.append(Tensor(raw.decode("utf-8", "replace"), tuple(dims), qtype, start + offset,
                              n_bytes, view))  # fmt: skip
    return GGUFFile(file, fields, tensors, mapped)


def _human(n: int) -> str:
    """A size in bytes for messages: 840 bytes, 1.131 MiB, 4 TiB."""
    k = min(max(n.bit_length() - 1, 0) // 10, 6)  # 1024**k <= n
    return f"{n} bytes" if not k else f"{n / 1024**k:.4g} {'KMGTPE'[k - 1]}iB"
