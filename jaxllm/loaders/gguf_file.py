"""A lean reader of the GGUF container: metadata, tensor table, memory-mapped tensor data.

`gguf.GGUFReader` decodes every metadata string eagerly; for a 49k-token vocabulary with 49k
merges that is ~6 s per open, paid on every start. This reader skips string arrays unless
asked for them (only the tokenizer conversion needs the vocabulary, and its result is cached;
`string_index` finds one token, like Gemma's <end_of_turn>, without decoding the rest), so
opening the demo model takes milliseconds. Dequantization stays with the `gguf` package.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count, the metadata key/values, the tensor table (name, dims, type, offset), then the tensor
data, aligned to `general.alignment` (32 by default).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np

# GGUF metadata value types with a fixed size -> numpy dtype (scalars and array elements).
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (torch order): ggml's dims reversed
    ggml_type: int
    offset: int  # absolute offset of the data in the file


class GGUFFile:
    def __init__(self, path: Path, *, string_arrays: bool = False):
        """Parses the header; string arrays (vocabulary, merges) are skipped unless asked."""
        self.path = path
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._data)
        try:
            self._parse(string_arrays)
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise ValueError(f"{path} is not a readable GGUF file: {e}") from e

    def _parse(self, string_arrays: bool) -> None:
        buf = self._buf
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("bad magic (expected 'GGUF')")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        self.pos = 24
        self.metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = self._string()
            (vtype,) = struct.unpack_from("<I", buf, self.pos)
            self.pos += 4
            self.metadata[key] = self._value(vtype, string_arrays)
        self.tensors: list[TensorInfo] = []
        table = []
        for _ in range(num_tensors):
            name = self._string()
            (ndim,) = struct.unpack_from("<I", buf, self.pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, self.pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, self.pos + 4 + 8 * ndim)
            self.pos += 4 + 8 * ndim + 12
            table.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise ValueError(f"general.alignment must be a positive multiple of 8, got {alignment}")
        start = -(-self.pos // alignment) * alignment
        self.tensors = [TensorInfo(n, s, t, start + o) for n, s, t, o in table]

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self.pos)
        s = bytes(self._buf[self.pos + 8 : self.pos + 8 + n]).decode("utf-8")
        self.pos += 8 + n
        return s

    def _value(self, vtype: int, string_arrays: bool):
        if vtype in _NUMPY:
            dtype = np.dtype(_NUMPY[vtype])
            v = np.frombuffer(self._buf, dtype=dtype, count=1, offset=self.pos)[0].item()
            self.pos += dtype.itemsize
            return v
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._buf, self.pos)
            self.pos += 12
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += dtype.itemsize * count
                return arr.tolist()
            if etype == _STRING:
                if string_arrays:
                    return [self._string() for _ in range(count)]
                start = self.pos
                for _ in range(count):  # skip: read only the lengths
                    (n,) = struct.unpack_from("<Q", self._buf, self.pos)
                    self.pos += 8 + n
                return _Skipped(count, start)
            return [self._value(etype, string_arrays) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def field(self, key: str, default=None):
        return self.metadata.get(key, default)

    def string_index(self, key: str, text: str) -> int | None:
        """Where `text` is in the string array `key` (None if absent), without decoding the
        array when it was skipped: a walk over the lengths that stops at the first match."""
        value = self.metadata.get(key)
        if isinstance(value, list):
            return value.index(text) if text in value else None
        if not isinstance(value, _Skipped):
            return None
        needle, pos = text.encode("utf-8"), value.offset
        for i in range(value.count):
            (n,) = struct.unpack_from("<Q", self._buf, pos)
            if n == len(needle) and self._buf[pos + 8 : pos + 8 + n] == needle:
                return i
            pos += 8 + n
        return None

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes, memory-mapped, shaped [rows, bytes per row]."""
        import gguf

        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        row = t.shape[-1] if t.shape else 1
        if row % block_size:
            raise ValueError(f"tensor {t.name!r}: row of {row} is not a multiple of {block_size}")
        row_bytes = row // block_size * type_size
        rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        end = t.offset + rows * row_bytes
        if end > len(self._data):
            raise ValueError(f"{self.path}: tensor {t.name!r} runs past the end of the file")
        return self._data[t.offset : end].reshape(rows, row_bytes)


class _Skipped:
    """Stands for a string array that was not decoded; len() still works."""

    def __init__(self, count: int, offset: int):
        self.count = count
        self.offset = offset  # of the first element (u64 length, then the UTF-8 bytes)

    def __len__(self) -> int:
        return self.count
