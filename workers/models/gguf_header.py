"""A GGUF file's header: its metadata and its tensors' shapes, read without the rest.

``gguf.GGUFReader`` builds a numpy view for every element of every array it meets, which
for a 262 144-token vocabulary (three such arrays) takes over ten seconds; a registry
entry needs a dozen scalars and the parameter count. This reads the same layout (GGUF
v2/v3: header, key-value pairs, tensor infos) with the ``gguf`` package's own type codes,
keeping scalars and strings and stepping over arrays (their length is kept).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass
class GgufHeader:
    fields: dict[str, Any] = field(default_factory=dict)  # scalars and strings; an array: its length
    parameters: int = 0


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def skip_value(self, kind: GGUFValueType) -> None:
        if kind == GGUFValueType.STRING:
            self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        elif kind == GGUFValueType.ARRAY:
            inner, count = GGUFValueType(self.take("<I")), self.take("<Q")
            if inner in _SCALAR:
                self.pos += count * struct.calcsize(_SCALAR[inner])
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            self.pos += struct.calcsize(_SCALAR[kind])


def read_header(path: Path) -> GgufHeader:
    """ValueError for a file that is not GGUF v2/v3 or is cut short."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        try:
            if buf[:4] != b"GGUF":
                raise ValueError("not a GGUF file")
            cur.pos = 4
            version = cur.take("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (this reads 2 and 3)")
            n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
            header = GgufHeader()
            for _ in range(n_kv):
                key = cur.string()
                kind = GGUFValueType(cur.take("<I"))
                if kind == GGUFValueType.STRING:
                    header.fields[key] = cur.string()
                elif kind == GGUFValueType.ARRAY:
                    start = cur.pos
                    cur.skip_value(kind)
                    header.fields[key] = struct.unpack_from("<Q", buf, start + 4)[0]  # its length
                else:
                    header.fields[key] = cur.take(_SCALAR[kind])
            for _ in range(n_tensors):
                cur.string()  # name
                dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
                cur.pos += 4 + 8  # type, offset
                count = 1
                for d in dims:
                    count *= d
                header.parameters += count
        except (struct.error, IndexError) as exc:
            raise ValueError(f"the GGUF header is cut short ({exc})") from None
    return header
