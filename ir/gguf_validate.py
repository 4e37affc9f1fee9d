"""Validate a GGUF file's structure before anything else trusts it.

GGUF files come from the internet. `gguf.GGUFReader` assumes a well-formed file: on a
corrupt or hostile one it fails with raw numpy/Python errors (IndexError, ValueError from
reshape, KeyError, UnicodeDecodeError, RecursionError...) or builds one numpy object per
array element, so a few megabytes of crafted metadata cost it gigabytes of memory.

`validate_gguf` walks the whole header -- magic, version, counts, every key/value, every
tensor info -- over a read-only mmap with an explicit bounds check before each read, and
checks the tensor data regions against the file size. It never allocates in proportion to
a count read from the file: every count is first compared with the bytes that remain, and
fixed-size arrays are skipped by arithmetic, not read. Any defect raises `GGUFFieldError`
naming the field and its byte offset. A file that passes is safe to hand to
`gguf.GGUFReader` (see `tests/test_gguf_hostile.py` for the property that checks this).

Only little-endian GGUF v2/v3 is accepted (what llama.cpp writes and reads).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from metatp.ir.errors import ModelFormatError, ModelNotFoundError

__all__ = ["GGUFFieldError", "GGUFLayout", "TensorInfo", "validate_gguf"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 62  # ggml stores element counts in int64; keep well clear of overflow
MAX_NAME_BYTES = 65535  # GGUF spec: keys are at most 65535 bytes; same cap for tensor names
MAX_ARRAY_DEPTH = 8  # nested arrays: GGUFReader recurses once per level
# GGUFReader builds one numpy array per metadata array element (~0.7 KB and ~13 us each).
# The largest real vocabularies hold ~260k tokens (x3 arrays, plus merges), so 4M elements
# in all is generous for real files and caps the reader at a few GB for hostile ones.
MAX_ARRAY_ELEMENTS_TOTAL = 1 << 22
# GGUFReader registers these names itself; a key that repeats one makes it raise KeyError.
READER_RESERVED_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})

HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor_count, kv_count
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, value type, 1-byte value
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, ne[0], type, offset

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Encoded size of each fixed-size GGUF value type; STRING and ARRAY are variable.
_SCALAR_SIZES: dict[int, int] = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
_STRING = int(GGUFValueType.STRING)
_ARRAY = int(GGUFValueType.ARRAY)
_VALUE_TYPE_NAMES = {int(t): t.name for t in GGUFValueType}
# Smallest encoding of one element of each type (what a count is checked against).
_MIN_ELEMENT_BYTES: dict[int, int] = {**_SCALAR_SIZES, _STRING: 8, _ARRAY: 4 + 8}


class GGUFFieldError(ModelFormatError):
    """A GGUF file is malformed; `.field` names the bad field, `.offset` its byte offset."""

    def __init__(
        self, path: str, field: str, offset: int, detail: str, message: str | None = None
    ) -> None:
        self.path = path
        self.field = field
        self.offset = offset
        self.detail = detail
        self._message = message
        super().__init__(message or f"corrupt GGUF '{path}': {field}: {detail} at byte {offset}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through self.args; rebuild from the real constructor arguments.
        return (type(self), (self.path, self.field, self.offset, self.detail, self._message))


@dataclass
class TensorInfo:
    """One tensor as the file describes it; `offset` is relative to the data section."""

    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous (row) dimension
    ggml_type: int
    offset: int
    n_bytes: int


@dataclass
class GGUFLayout:
    """The validated structure of a GGUF file (no values, only where things are)."""

    version: int
    alignment: int
    n_kv: int
    kv_types: dict[str, int]  # key -> GGUFValueType code
    tensors: list[TensorInfo]
    data_offset: int  # absolute offset of the tensor data section: align(end of tensor infos)
    file_size: int


def validate_gguf(path: str | os.PathLike[str]) -> GGUFLayout:
    """Check every structural field of the GGUF at `path`; return its layout or raise.

    Raises `ModelNotFoundError` if the file does not exist and `GGUFFieldError` (a
    `ModelFormatError`) for anything else that makes it unusable.
    """
    spath = os.fspath(path)
    try:
        st = os.stat(spath)
    except FileNotFoundError as e:
        raise ModelNotFoundError(f"model file not found: '{spath}'") from e
    except OSError as e:
        raise GGUFFieldError(spath, "file", 0, f"cannot stat: {e.strerror or e}") from e
    # Refuse directories, FIFOs and devices before opening: opening a FIFO would block.
    if not stat.S_ISREG(st.st_mode):
        raise GGUFFieldError(spath, "file", 0, "not a regular file",
                             message=f"'{spath}' is not a GGUF file (not a regular file)")
    try:
        f = open(spath, "rb")
    except FileNotFoundError as e:  # removed between stat and open
        raise ModelNotFoundError(f"model file not found: '{spath}'") from e
    except OSError as e:
        raise GGUFFieldError(spath, "file", 0, f"cannot open: {e.strerror or e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # mmap cannot map an empty file
            raise GGUFFieldError(spath, "magic", 0, "empty file",
                                 message=f"'{spath}' is not a GGUF file (empty file)")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise GGUFFieldError(spath, "file", 0, f"cannot map: {e}") from e
        # The file must not shrink while mapped (SIGBUS); nothing here can guard that.
        with mm:
            return _Walker(mm, size, spath).walk()


class _Walker:
    """Bounds-checked cursor over the mapped file; one instance per validation."""

    def __init__(self, buf: mmap.mmap, size: int, path: str) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0
        self.array_elements = 0  # running total, checked against MAX_ARRAY_ELEMENTS_TOTAL

    # -- primitives -------------------------------------------------------------------

    def error(self, field: str, detail: str, offset: int | None = None) -> GGUFFieldError:
        return GGUFFieldError(self.path, field, self.pos if offset is None else offset, detail)

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            raise self.error(field, f"truncated: needs {n} bytes, only {self.remaining()} left")

    def u32(self, field: str) -> int:
        self.need(4, field)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, field: str) -> int:
        self.need(8, field)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(v)

    def name(self, field: str) -> str:
        """Read a key or tensor name: non-empty, bounded, strict UTF-8."""
        start = self.pos
        n = self.u64(f"{field} length")
        if n == 0:
            raise self.error(f"{field} length", "empty name", start)
        if n > MAX_NAME_BYTES:
            raise self.error(f"{field} length", f"length {n} > {MAX_NAME_BYTES}", start)
        self.need(n, field)
        raw = self.buf[self.pos:self.pos + n]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(field, f"invalid UTF-8 ({e.reason} at name byte {e.start})") from None
        self.pos += n
        return text

    def skip_string(self, field: str) -> None:
        """Skip a string value; its bytes are not decoded (the loader uses errors='replace')."""
        start = self.pos
        n = self.u64(f"{field} length")
        if n > self.size - self.pos:
            raise self.error(f"{field} length",
                             f"string length {n} > {self.remaining()} bytes left", start)
        self.pos += n

    # -- key/values -------------------------------------------------------------------

    def skip_value(self, vtype: int, field: str, depth: int = 0) -> None:
        """Skip one value of type `vtype`, checking every length against the file."""
        size = _SCALAR_SIZES.get(vtype)
        if size is not None:
            self.need(size, field)
            self.pos += size
        elif vtype == _STRING:
            self.skip_string(field)
        elif vtype == _ARRAY:
            self.skip_array(field, depth)
        else:
            raise self.error(field, f"unknown value type {vtype}")

    def skip_array(self, field: str, depth: int) -> None:
        start = self.pos
        etype = self.u32(f"{field} array element type")
        if etype not in _MIN_ELEMENT_BYTES:
            raise self.error(f"{field} array element type", f"unknown value type {etype}", start)
        if etype == _ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
            raise self.error(f"{field} array element type",
                             f"arrays nested deeper than {MAX_ARRAY_DEPTH}", start)
        count_at = self.pos
        count = self.u64(f"{field} array length")
        min_bytes = count * _MIN_ELEMENT_BYTES[etype]
        if min_bytes > self.remaining():
            raise self.error(f"{field} array length",
                             f"{count} x {_VALUE_TYPE_NAMES[etype]} needs at least {min_bytes}"
                             f" bytes, only {self.remaining()} left", count_at)
        self.array_elements += count
        if self.array_elements > MAX_ARRAY_ELEMENTS_TOTAL:
            raise self.error(f"{field} array length",
                             f"metadata arrays hold more than {MAX_ARRAY_ELEMENTS_TOTAL}"
                             " elements in all (resource limit)", count_at)
        if etype in _SCALAR_SIZES:
            self.pos += min_bytes  # fixed size, already bounds-checked: skip without reading
        elif etype == _STRING:
            self.skip_string_array(count, field)
        else:
            for i in range(count):
                self.skip_array(f"{field}[{i}]", depth + 1)

    def skip_string_array(self, count: int, field: str) -> None:
        """Hot loop for vocabularies (~50k-250k strings): locals only, no per-item objects."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.error(f"{field}[{i}] length", "truncated: string length runs past EOF")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos - 8
                raise self.error(f"{field}[{i}] length",
                                 f"string length {n} > {size - pos} bytes left")
            pos += n
        self.pos = pos

    # -- whole file -------------------------------------------------------------------

    def walk(self) -> GGUFLayout:
        """Header, key/values, tensor infos, then the data regions, in file order."""
        magic = bytes(self.buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFFieldError(self.path, "magic", 0, f"magic {magic!r} != {GGUF_MAGIC!r}",
                                 message=f"'{self.path}' is not a GGUF file "
                                         f"(starts with {magic!r}, expected {GGUF_MAGIC!r})")
        self.pos = 4
        version = self.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if version == 1:
                detail = "GGUF version 1 is not supported (only versions 2 and 3)"
            elif int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                detail = "big-endian GGUF is not supported"
            else:
                detail = f"unsupported version {version} (only 2 and 3)"
            raise self.error("version", detail, 4)

        n_tensors = self.u64("tensor_count")
        n_kv = self.u64("kv_count")
        # Each entry has a minimum encoded size; reject counts the file cannot hold before
        # looping over them (a crafted 2**63 would otherwise spin forever).
        min_kv = n_kv * MIN_KV_BYTES
        if min_kv > self.remaining():
            raise self.error("kv_count", f"{n_kv} key/values need at least {min_kv} bytes,"
                             f" only {self.remaining()} left", 16)
        min_ti = n_tensors * MIN_TENSOR_INFO_BYTES
        if min_kv + min_ti > self.remaining():
            raise self.error("tensor_count", f"{n_tensors} tensor infos need at least {min_ti}"
                             f" bytes, only {self.remaining() - min_kv} left after the"
                             " key/values", 8)

        kv_types, alignment = self.walk_kvs(n_kv)
        infos, offset_fields = self.walk_tensor_infos(n_tensors, alignment)
        data_offset = -(-self.pos // alignment) * alignment
        self.check_regions(infos, offset_fields, data_offset)
        return GGUFLayout(version=version, alignment=alignment, n_kv=n_kv, kv_types=kv_types,
                          tensors=infos, data_offset=data_offset, file_size=self.size)

    def walk_kvs(self, n_kv: int) -> tuple[dict[str, int], int]:
        kv_types: dict[str, int] = {}
        alignment = DEFAULT_ALIGNMENT
        for i in range(n_kv):
            kv_at = self.pos
            key = self.name(f"kv #{i} key")
            where = f"kv #{i} '{key}'"
            if key in kv_types:
                raise self.error(where, "duplicate key", kv_at)
            if key in READER_RESERVED_KEYS:
                raise self.error(where, "key name is reserved by the GGUF reader", kv_at)
            type_at = self.pos
            vtype = self.u32(f"{where} value type")
            if vtype not in _MIN_ELEMENT_BYTES:
                raise self.error(f"{where} value type", f"unknown value type {vtype}", type_at)
            value_at = self.pos
            if key == "general.alignment":
                if vtype != GGUFValueType.UINT32:
                    raise self.error(where, f"type {_VALUE_TYPE_NAMES[vtype]}, must be UINT32",
                                     type_at)
                alignment = self.u32(where)
                if alignment == 0 or alignment & (alignment - 1):
                    raise self.error(where, f"alignment {alignment} is not a power of two",
                                     value_at)
            else:
                self.skip_value(vtype, where)
            kv_types[key] = vtype
        return kv_types, alignment

    def walk_tensor_infos(self, n_tensors: int, alignment: int
                          ) -> tuple[list[TensorInfo], list[int]]:
        infos: list[TensorInfo] = []
        offset_fields: list[int] = []  # byte offset of each tensor's `offset` field
        seen: set[str] = set()
        for i in range(n_tensors):
            info_at = self.pos
            name = self.name(f"tensor info #{i} name")
            where = f"tensor info #{i} '{name}'"
            if name in seen:
                raise self.error(where, "duplicate tensor name", info_at)
            seen.add(name)

            dims_at = self.pos
            n_dims = self.u32(where)
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.error(where, f"n_dims={n_dims} not in 1..{MAX_DIMS}", dims_at)
            ne: list[int] = []
            n_elems = 1
            for d in range(n_dims):
                d_at = self.pos
                v = self.u64(f"{where} ne[{d}]")
                if v == 0:
                    raise self.error(where, f"ne[{d}]=0 (empty tensor)", d_at)
                n_elems *= v
                if n_elems > MAX_ELEMENTS:
                    raise self.error(where, f"element count overflows (> 2**62) at ne[{d}]={v}",
                                     d_at)
                ne.append(v)

            type_at = self.pos
            ggml_type = self.u32(f"{where} type")
            try:
                qtype = GGMLQuantizationType(ggml_type)
                block_size, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise self.error(where, f"unknown ggml type {ggml_type}", type_at) from None
            if ne[0] % block_size:
                raise self.error(where, f"ne[0]={ne[0]} is not a multiple of the {qtype.name}"
                                 f" block size {block_size}", dims_at + 4)

            offset_fields.append(self.pos)
            offset = self.u64(f"{where} offset")
            if offset % alignment:
                raise self.error(where, f"data offset {offset} is not a multiple of the"
                                 f" alignment {alignment}", self.pos - 8)
            infos.append(TensorInfo(name=name, ne=tuple(ne), ggml_type=ggml_type,
                                    offset=offset, n_bytes=n_elems // block_size * type_size))
        return infos, offset_fields

    def check_regions(self, infos: list[TensorInfo], offset_fields: list[int],
                      data_offset: int) -> None:
        """Every tensor's bytes lie inside the file and no two tensors share a byte."""
        for i, (t, at) in enumerate(zip(infos, offset_fields)):
            end = data_offset + t.offset + t.n_bytes
            if end > self.size:
                raise self.error(f"tensor info #{i} '{t.name}'",
                                 f"data [{data_offset + t.offset}, {end}) runs past the end of"
                                 f" the file ({self.size} bytes)", at)
        order = sorted(range(len(infos)), key=lambda k: infos[k].offset)
        for prev, cur in zip(order, order[1:]):
            a, b = infos[prev], infos[cur]
            if b.offset < a.offset + a.n_bytes:
                raise self.error(f"tensor info #{cur} '{b.name}'",
                                 f"data at relative offset {b.offset} overlaps tensor"
                                 f" '{a.name}' [{a.offset}, {a.offset + a.n_bytes})",
                                 offset_fields[cur])
