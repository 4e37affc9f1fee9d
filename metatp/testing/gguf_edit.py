"""The tests' GGUF editor: a file as plain parts (keys with their value types, raw tensors) that
can be changed and written again, and the one place a `gguf.GGUFWriter` is finished.

`metatp.testing.synth` writes synthetic models through `finish_gguf`; the hostile-value tests
and `python -m scripts.fuzz_gguf --values` read a well-formed file with `read_parts`,
mutate it and write it back with `write_parts`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GGUFParts", "read_parts", "write_parts", "finish_gguf"]


def finish_gguf(w: Any) -> None:
    """Write a `gguf.GGUFWriter`'s header, key-value data and tensors, in that order, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass
class GGUFParts:
    """A GGUF as plain parts that can be changed and written again (keys keep their value types)."""

    arch: str
    kvs: dict[str, tuple[Any, Any, Any]]   # key -> (value, gguf.GGUFValueType, element type or None)
    tensors: list[tuple[str, np.ndarray, Any, tuple[int, ...]]]   # name, data, gguf.GGMLQuantizationType, ne


def read_parts(path: str | os.PathLike[str]) -> GGUFParts:
    """The file's architecture, keys (but the GGUF.* header fields) and tensors."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(path))
    kvs: dict[str, tuple[Any, Any, Any]] = {}
    arch = ""
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key == "general.architecture":
            arch = str(f.contents())
            continue
        sub = f.types[1] if len(f.types) > 1 else None
        kvs[key] = (f.contents(), f.types[0], sub)
    tensors = [(t.name, np.array(t.data), gguf.GGMLQuantizationType(int(t.tensor_type)),
                tuple(int(x) for x in t.shape)) for t in reader.tensors]
    return GGUFParts(arch, kvs, tensors)


def write_parts(path: str | os.PathLike[str], parts: GGUFParts) -> None:
    """Write `parts` as a GGUF file (float tensors by shape, quantized ones as raw blocks)."""
    import gguf

    w = gguf.GGUFWriter(os.fspath(path), parts.arch)
    for key, (value, vtype, sub) in parts.kvs.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, data, qtype, ne in parts.tensors:
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, np.ascontiguousarray(data).reshape(tuple(reversed(ne))))
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    finish_gguf(w)
