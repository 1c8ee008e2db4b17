"""A fast reader of a GGUF file's metadata and tensor table.

``gguf.GGUFReader`` turns every metadata value into numpy views of a memory map, one small array
per string, and does it for the whole vocabulary before returning: 2.9 s for SmolLM2's header
on the development CPU (49 152 tokens, 48 900 merges), about half of loading the model. This
reads the same values with ``struct`` from one ``mmap`` in 0.18 s. The format is small and fixed (magic, version,
counts, key/value pairs, tensor infos, aligned data); the ``gguf`` package still supplies its
constants and the dequantization of tensor data, and ``tests/test_models_loaders.py`` checks that
both readers agree field by field and byte by byte. Little-endian files only (what every current
converter writes).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from attrs import frozen

from dspark_core.errors import ModelError

# GGUF metadata value types (gguf.GGUFValueType): scalar struct formats and numpy dtypes
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# unquantized tensor types (gguf.GGMLQuantizationType) read as typed arrays, as GGUFReader does
_PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@frozen
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` in torch order (GGUF lists dimensions fastest first),
    ``tensor_type`` a ``gguf.GGMLQuantizationType`` value, and ``data`` a read-only view of the
    file laid out as ``gguf.quants.dequantize`` takes it (bytes per row for quantized types)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray


@frozen
class GGUFFile:
    """Metadata ``fields`` (scalars as Python numbers, strings as ``str``, arrays as lists) and tensors."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buffer) -> None:
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        return self.buffer[start : self.offset].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("IQ")
            if item in _SCALARS:  # one unpack for the whole array
                fmt = f"{count}{_SCALARS[item]}"
                return list(self.unpack(fmt))
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Metadata and tensor table of the GGUF file at ``path``; a :class:`ModelError` naming the file
    when it is missing, not GGUF, or damaged."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: GGUF file not found")
    try:
        with path.open("rb") as handle:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if buffer[:4] != b"GGUF":
            raise ModelError(f"{path}: not a GGUF file (bad magic)")
        cursor = _Cursor(buffer)
        cursor.offset = 4
        version, tensor_count, field_count = cursor.unpack("IQQ")
        if version & 0xFFFF == 0:  # a small version read the wrong way round
            raise ModelError(f"{path}: big-endian GGUF files are not supported")
        fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = cursor.string()
            (kind,) = cursor.unpack("I")
            fields[key] = cursor.value(kind)
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            (dims,) = cursor.unpack("I")
            shape = cursor.unpack(f"{dims}Q")
            tensor_type, offset = cursor.unpack("IQ")
            infos.append((name, tuple(reversed(shape)), tensor_type, offset))
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
        data_start = -(-cursor.offset // alignment) * alignment
        tensors = [GGUFTensor(name, shape, kind, _tensor_data(buffer, data_start + offset, shape, kind))
                   for name, shape, kind, offset in infos]
    except ModelError:
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ModelError(f"{path}: not a readable GGUF file ({exc})") from None
    seen: set[str] = set()
    for tensor in tensors:
        if tensor.name in seen:
            raise ModelError(f"{path}: tensor {tensor.name!r} appears twice")
        seen.add(tensor.name)
    return GGUFFile(fields, tensors)


def _tensor_data(buffer, start: int, shape: tuple[int, ...], kind: int) -> np.ndarray:
    """A view of one tensor's bytes, as typed values or as bytes per row of quantized blocks."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    elements = int(np.prod(shape, dtype=np.int64))
    if kind in _PLAIN_TYPES:
        return np.frombuffer(buffer, dtype=_PLAIN_TYPES[kind], count=elements, offset=start).reshape(shape)
    quant = GGMLQuantizationType(kind)
    block, size = GGML_QUANT_SIZES[quant]
    count = elements // block * size
    return np.frombuffer(buffer, dtype=np.uint8, count=count, offset=start).reshape(quant_shape_to_byte_shape(shape, quant))
