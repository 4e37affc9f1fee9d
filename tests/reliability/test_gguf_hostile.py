"""Hostile-input tests for the GGUF pre-validator (`metatp.ir.gguf_validate`).

Contract: on any file `validate_gguf` either returns a layout or raises `GGUFFieldError`
(missing file: `ModelNotFoundError`), fast and without allocating by a count read from
the file; when it returns a layout, `gguf.GGUFReader` opens the file without raising and
agrees with it. The mutators and the oracle live in `scripts.fuzz_gguf`, which runs
the same properties for much longer.
"""

from __future__ import annotations

import os
import pickle
import struct
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metatp.models import cache_dir
from support.require import requires
from metatp.ir.errors import ModelFormatError, ModelNotFoundError
from metatp.ir.gguf_validate import (
    MAX_ARRAY_ELEMENTS_TOTAL,
    GGUFFieldError,
    GGUFLayout,
    validate_gguf,
)
from scripts.fuzz_gguf import (
    INTERESTING_INTS,
    build_sample_gguf,
    check_bytes,
    delete_range,
    duplicate_range,
    flip_bits,
    overwrite_bytes,
    reader_agrees,
    splice_int,
)

REAL_MODEL = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


def _sample() -> tuple[bytes, int]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sample.gguf")
        build_sample_gguf(path)
        return Path(path).read_bytes(), validate_gguf(path).data_offset


SAMPLE, HEADER_END = _sample()  # ~1.2 KB file, header (KVs + tensor infos) ~800 bytes

FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf_hostile")


@pytest.fixture()
def sample_path(tmp_path: Path) -> Path:
    path = tmp_path / "sample.gguf"
    build_sample_gguf(path)
    return path


# -- hand-built files -----------------------------------------------------------------------

def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def tinfo(name: str | bytes, ne: list[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(u64(n) for n in ne) + u32(ggml_type) + u64(offset)


def build(kvs: Sequence[bytes] = (), tis: Sequence[bytes] = (), data: bytes = b"", *,
          version: int = 3, n_kv: int | None = None, n_tensors: int | None = None,
          alignment: int = 32) -> bytes:
    """Header + KVs + tensor infos, padded to `alignment`, then `data`."""
    head = (b"GGUF" + u32(version) + u64(len(tis) if n_tensors is None else n_tensors)
            + u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tis))
    return head + b"\0" * (-len(head) % alignment) + data


def write(tmp_path: Path, data: bytes, name: str = "f.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def rejected(tmp_path: Path, data: bytes, field: str, detail: str = "") -> GGUFFieldError:
    """Assert `data` is rejected naming `field` (substring), fast and with little memory."""
    path = write(tmp_path, data)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(GGUFFieldError) as info:
            validate_gguf(path)
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    err = info.value
    assert field in err.field, (err.field, str(err))
    assert detail in str(err), str(err)
    assert f"at byte {err.offset}" in str(err) or "not a GGUF file" in str(err)
    assert elapsed < 0.5, elapsed
    assert peak < 1 << 20, peak
    return err


def valid_and_reader_agrees(tmp_path: Path, data: bytes) -> GGUFLayout:
    path = write(tmp_path, data)
    layout = validate_gguf(path)
    reader_agrees(str(path), layout)
    return layout


# -- the valid sample and the real model ------------------------------------------------------

def test_sample_validates_and_matches_reader(sample_path: Path) -> None:
    layout = validate_gguf(sample_path)
    reader_agrees(str(sample_path), layout)  # names, shapes, types, offsets, sizes, keys
    assert layout.version == 3 and layout.alignment == 32
    assert layout.n_kv == len(layout.kv_types) == 15
    assert layout.kv_types["general.alignment"] == VT.UINT32
    assert layout.kv_types["test.tokens"] == VT.ARRAY
    assert layout.kv_types["test.f64"] == VT.FLOAT64
    assert [(t.name, t.ne, t.ggml_type, t.offset, t.n_bytes) for t in layout.tensors] == [
        ("blk.0.attn_q.weight", (64, 2), QT.Q8_0, 0, 136),
        ("token_embd.weight", (16, 2), QT.F16, 160, 64),
        ("output_norm.weight", (32,), QT.F32, 224, 128),
    ]
    assert layout.data_offset % 32 == 0
    assert layout.file_size == layout.data_offset + 224 + 128 == sample_path.stat().st_size


@requires("model", why=None if REAL_MODEL.exists() else "reference model not downloaded")
def test_real_model_validates_fast() -> None:
    validate_gguf(REAL_MODEL)  # warm the page cache
    start = time.perf_counter()
    layout = validate_gguf(REAL_MODEL)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"{elapsed:.3f} s"
    assert (layout.version, layout.n_kv, len(layout.tensors)) == (3, 33, 272)
    assert layout.tensors[0].name == "token_embd.weight"
    end = max(t.offset + t.n_bytes for t in layout.tensors)
    assert layout.data_offset + end <= layout.file_size


@requires("model", why=None if REAL_MODEL.exists() else "reference model not downloaded")
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1_785_663))
def test_real_model_truncated_header_rejected(workdir: Path, cut: int) -> None:
    # Cuts land mostly in the 49k-token vocabulary and the merges (string arrays).
    with open(REAL_MODEL, "rb") as f:
        head = f.read(cut)
    assert check_bytes(head, workdir) != "valid"


# -- properties -----------------------------------------------------------------------------

def test_every_truncation_rejected(workdir: Path) -> None:
    # The sample's last tensor ends exactly at EOF, so no strict prefix is a valid file.
    assert check_bytes(SAMPLE, workdir) == "valid"
    for n in range(len(SAMPLE)):
        assert check_bytes(SAMPLE[:n], workdir) != "valid", n


header_pos = st.integers(0, HEADER_END - 1)


@FUZZ
@given(flips=st.lists(st.tuples(header_pos, st.integers(0, 7)), min_size=1, max_size=8))
def test_bit_flips(workdir: Path, flips: list[tuple[int, int]]) -> None:
    check_bytes(flip_bits(SAMPLE, flips), workdir)


@FUZZ
@given(edits=st.lists(st.tuples(header_pos, st.integers(0, 255)), min_size=1, max_size=8))
def test_byte_overwrites(workdir: Path, edits: list[tuple[int, int]]) -> None:
    check_bytes(overwrite_bytes(SAMPLE, edits), workdir)


@FUZZ
@given(offset=header_pos, width=st.sampled_from([4, 8]),
       value=st.sampled_from(INTERESTING_INTS) | st.integers(0, (1 << 64) - 1))
def test_integer_splices(workdir: Path, offset: int, width: int, value: int) -> None:
    # Hits counts, lengths, type codes and offsets with boundary values.
    check_bytes(splice_int(SAMPLE, offset, value, width), workdir)


@FUZZ
@given(start=header_pos, length=st.integers(1, 64), dup=st.booleans())
def test_deleted_or_duplicated_ranges(workdir: Path, start: int, length: int, dup: bool) -> None:
    mutate = duplicate_range if dup else delete_range
    check_bytes(mutate(SAMPLE, start, length), workdir)


# -- plain cases: not a GGUF at all --------------------------------------------------------------

def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        validate_gguf(tmp_path / "nope.gguf")
    assert isinstance(info.value, FileNotFoundError)


def test_empty_file(tmp_path: Path) -> None:
    err = rejected(tmp_path, b"", "magic")
    assert "not a GGUF file" in str(err)


def test_text_file(tmp_path: Path) -> None:
    err = rejected(tmp_path, b"hello, this is not a model\n", "magic")
    assert "not a GGUF file" in str(err)


def test_directory_and_fifo_rejected_without_blocking(tmp_path: Path) -> None:
    with pytest.raises(GGUFFieldError, match="not a regular file"):
        validate_gguf(tmp_path)
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFFieldError, match="not a regular file"):
        validate_gguf(fifo)


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 23])
def test_tiny_prefixes(tmp_path: Path, n: int) -> None:
    rejected(tmp_path, build()[:n], "")


@pytest.mark.parametrize(("version", "detail"), [
    (1, "version 1 is not supported"),
    (0, "unsupported version 0"),
    (4, "unsupported version 4"),
    (0x03000000, "big-endian"),
])
def test_bad_versions(tmp_path: Path, version: int, detail: str) -> None:
    err = rejected(tmp_path, build(version=version), "version", detail)
    assert err.offset == 4


def test_version_2_accepted(tmp_path: Path) -> None:
    assert valid_and_reader_agrees(tmp_path, build(version=2)).version == 2


def test_error_message_and_pickle(tmp_path: Path) -> None:
    bad = tinfo("blk.0.attn_q.weight", [4] * 9, QT.F32, 0)
    err = rejected(tmp_path, build(tis=[bad]), "tensor info #0 'blk.0.attn_q.weight'", "n_dims=9")
    assert err.offset == 24 + 8 + len("blk.0.attn_q.weight")
    assert str(err) == (f"corrupt GGUF '{tmp_path / 'f.gguf'}': tensor info #0 "
                        f"'blk.0.attn_q.weight': n_dims=9 not in 1..4 at byte {err.offset}")
    assert isinstance(err, ModelFormatError)
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.field, again.offset, str(again)) == (
        GGUFFieldError, err.field, err.offset, str(err))


# -- absurd counts and lengths: rejected before any allocation or loop ------------------------

@pytest.mark.parametrize("n", [1 << 63, (1 << 64) - 1, 1 << 40, 2])
def test_absurd_tensor_count(tmp_path: Path, n: int) -> None:
    rejected(tmp_path, build(n_tensors=n), "tensor_count")


@pytest.mark.parametrize("n", [1 << 63, (1 << 64) - 1, 1 << 32, 1])
def test_absurd_kv_count(tmp_path: Path, n: int) -> None:
    rejected(tmp_path, build(n_kv=n), "kv_count")


def test_absurd_key_length(tmp_path: Path) -> None:
    rejected(tmp_path, build([u64(1 << 40) + b"k" + u32(VT.UINT8) + b"\0"]), "key length")


def test_absurd_string_value_length(tmp_path: Path) -> None:
    rejected(tmp_path, build([kv("a.s", VT.STRING, u64(1 << 40) + b"x")]), "'a.s' length")


@pytest.mark.parametrize(("etype", "count"), [
    (VT.UINT64, 1 << 62),  # count * 8 overflows 64 bits in C
    (VT.UINT8, (1 << 64) - 1),
    (VT.STRING, 1 << 60),
    (VT.ARRAY, 1 << 60),
])
def test_absurd_array_length(tmp_path: Path, etype: int, count: int) -> None:
    payload = u32(etype) + u64(count) + b"\0" * 64
    rejected(tmp_path, build([kv("a.arr", VT.ARRAY, payload)]), "array length")


def test_string_array_with_absurd_item_length(tmp_path: Path) -> None:
    payload = u32(VT.STRING) + u64(3) + gstr("ok") + u64(1 << 40) + gstr("x")
    rejected(tmp_path, build([kv("a.arr", VT.ARRAY, payload)]), "'a.arr'[1] length")


def test_deeply_nested_arrays_rejected_without_recursion(tmp_path: Path) -> None:
    # 10k levels fit in 120 KB; GGUFReader would hit RecursionError.
    payload = (u32(VT.ARRAY) + u64(1)) * 10_000 + u32(VT.UINT8) + u64(0)
    rejected(tmp_path, build([kv("a.nest", VT.ARRAY, payload)]), "array element type", "nested")


def test_array_element_total_is_capped(tmp_path: Path) -> None:
    # A few MB of uint8s would make GGUFReader build millions of numpy objects (GBs).
    n = MAX_ARRAY_ELEMENTS_TOTAL + 1
    payload = u32(VT.UINT8) + u64(n) + bytes(n)
    rejected(tmp_path, build([kv("a.big", VT.ARRAY, payload)]), "array length", "resource limit")


@pytest.mark.parametrize("ne", [[1 << 32] * 3, [1 << 63, 2], [(1 << 64) - 1]])
def test_element_count_overflow(tmp_path: Path, ne: list[int]) -> None:
    rejected(tmp_path, build(tis=[tinfo("t", ne, QT.F32, 0)]), "tensor info #0 't'", "overflow")


# -- key/value rules -------------------------------------------------------------------------

def test_valid_kinds_incl_empty_and_nested_arrays(tmp_path: Path) -> None:
    kvs = [
        kv("a.empty", VT.ARRAY, u32(VT.INT32) + u64(0)),
        kv("a.empty_str", VT.ARRAY, u32(VT.STRING) + u64(0)),
        kv("a.nested", VT.ARRAY, u32(VT.ARRAY) + u64(2) + (u32(VT.ARRAY) + u64(1) + u32(VT.UINT16)
                                                            + u64(2) + b"\1\0\2\0") * 2),
        kv("a.s", VT.STRING, gstr("")),
        kv("a.b", VT.BOOL, b"\1"),
    ]
    layout = valid_and_reader_agrees(tmp_path, build(kvs))
    assert list(layout.kv_types) == ["a.empty", "a.empty_str", "a.nested", "a.s", "a.b"]


def test_invalid_utf8_in_value_is_accepted(tmp_path: Path) -> None:
    # Values are not decoded here; the loader decodes them with errors="replace".
    kvs = [kv("a.s", VT.STRING, gstr(b"\xff\xfe")),
           kv("a.toks", VT.ARRAY, u32(VT.STRING) + u64(2) + gstr(b"ok") + gstr(b"\xc3("))]
    valid_and_reader_agrees(tmp_path, build(kvs))


def test_invalid_utf8_in_key(tmp_path: Path) -> None:
    rejected(tmp_path, build([kv(b"bad\xff", VT.UINT8, b"\0")]), "kv #0 key", "UTF-8")


def test_empty_key(tmp_path: Path) -> None:
    rejected(tmp_path, build([kv(b"", VT.UINT8, b"\0")]), "kv #0 key length", "empty")


def test_duplicate_key(tmp_path: Path) -> None:
    one = kv("a.x", VT.UINT8, b"\0")
    err = rejected(tmp_path, build([one, one]), "kv #1 'a.x'", "duplicate key")
    assert err.offset == 24 + len(one)


def test_key_reserved_by_reader(tmp_path: Path) -> None:
    rejected(tmp_path, build([kv("GGUF.version", VT.UINT32, u32(3))]), "kv #0", "reserved")


@pytest.mark.parametrize("vtype", [13, 0xFFFFFFFF])
def test_unknown_value_type(tmp_path: Path, vtype: int) -> None:
    rejected(tmp_path, build([kv("a.x", vtype, b"\0" * 16)]), "value type", "unknown")


def test_unknown_array_element_type(tmp_path: Path) -> None:
    rejected(tmp_path, build([kv("a.x", VT.ARRAY, u32(77) + u64(0))]), "array element type")


@pytest.mark.parametrize(("vtype", "payload", "detail"), [
    (VT.UINT32, u32(0), "not a power of two"),
    (VT.UINT32, u32(48), "not a power of two"),
    (VT.UINT64, u64(32), "must be UINT32"),
    (VT.STRING, gstr("32"), "must be UINT32"),
])
def test_bad_alignment(tmp_path: Path, vtype: int, payload: bytes, detail: str) -> None:
    rejected(tmp_path, build([kv("general.alignment", vtype, payload)]), "general.alignment",
             detail)


def test_custom_alignment_is_used(tmp_path: Path) -> None:
    data = build([kv("general.alignment", VT.UINT32, u32(64))],
                 [tinfo("a", [16], QT.F32, 0), tinfo("b", [16], QT.F32, 64)],
                 bytes(128), alignment=64)
    layout = valid_and_reader_agrees(tmp_path, data)
    assert layout.alignment == 64 and layout.data_offset % 64 == 0


# -- tensor info rules -----------------------------------------------------------------------

def one_tensor(ne: list[int], ggml_type: int = QT.F32, offset: int = 0, data: int = 4096,
               name: str | bytes = "t") -> bytes:
    return build(tis=[tinfo(name, ne, ggml_type, offset)], data=bytes(data))


@pytest.mark.parametrize(("ne", "ggml_type", "offset", "detail"), [
    ([], QT.F32, 0, "n_dims=0"),
    ([1] * 5, QT.F32, 0, "n_dims=5"),
    ([4, 0], QT.F32, 0, "ne[1]=0"),
    ([4], 4, 0, "unknown ggml type 4"),  # Q4_2, removed from ggml
    ([4], 1000, 0, "unknown ggml type 1000"),
    ([33, 2], QT.Q8_0, 0, "not a multiple of the Q8_0 block size 32"),
    ([4], QT.F32, 16, "not a multiple of the alignment 32"),
    ([4], QT.F32, 4096, "runs past the end"),
    ([1024, 2], QT.F32, 0, "runs past the end"),
])
def test_bad_tensor_info(tmp_path: Path, ne: list[int], ggml_type: int, offset: int,
                         detail: str) -> None:
    rejected(tmp_path, one_tensor(ne, ggml_type, offset), "tensor info #0", detail)


def test_bad_tensor_names(tmp_path: Path) -> None:
    rejected(tmp_path, one_tensor([4], name=b"\x80x"), "tensor info #0 name", "UTF-8")
    rejected(tmp_path, one_tensor([4], name=b""), "tensor info #0 name length", "empty")


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    data = build(tis=[tinfo("w", [4], QT.F32, 0), tinfo("w", [4], QT.F32, 32)], data=bytes(64))
    rejected(tmp_path, data, "tensor info #1 'w'", "duplicate tensor name")


def test_overlapping_tensors(tmp_path: Path) -> None:
    data = build(tis=[tinfo("a", [16], QT.F32, 0), tinfo("b", [16], QT.F32, 32)], data=bytes(96))
    rejected(tmp_path, data, "tensor info #1 'b'", "overlaps tensor 'a'")


def test_tensors_out_of_order_and_tail_padding_optional(tmp_path: Path) -> None:
    # Data order need not follow info order, and the last tensor need not be padded:
    # 'a' (20 bytes at 32) ends 12 bytes before EOF; cutting that slack keeps it valid.
    data = build(tis=[tinfo("a", [5], QT.F32, 32), tinfo("b", [3], QT.F32, 0)], data=bytes(64))
    layout = valid_and_reader_agrees(tmp_path, data)
    assert layout.file_size == layout.data_offset + 64
    assert validate_gguf(write(tmp_path, data[:-12], "cut.gguf")).file_size == len(data) - 12
    rejected(tmp_path, data[:-13], "tensor info #0 'a'", "runs past the end")
