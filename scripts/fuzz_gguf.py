"""Fuzz GGUF files: their bytes (the validator) and their metadata values (the loader and the API).

Bytes: on any file the validator either raises `GGUFFieldError` or returns a layout, quickly
and without a large allocation; and when it returns a layout, `gguf.GGUFReader` opens the same
file without raising and agrees with the layout (tensor names, shapes, types, offsets, sizes,
keys and value types).

Values (`--values`): a well-formed file whose hyper-parameters, tensors or chat template are
hostile (zero, negative, NaN, huge, of the wrong type; a missing or reshaped tensor; a template
that loops, recurses or builds huge strings). Loading it, rendering its chat template and
generating two tokens must each succeed or raise a `MetatpError`, within a time bound; never a
hang or another exception.

`tests/test_gguf_hostile.py` and `tests/test_reliability_hostile.py` drive the same mutators and
oracles with hypothesis for a bounded number of examples; this script runs them for as long as
you like:

    python -m scripts.fuzz_gguf --examples 10000 [--seed 1] [--base model.gguf]
    python -m scripts.fuzz_gguf --values --examples 500 [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import gguf

from metatp.ir.gguf_validate import GGUFFieldError, GGUFLayout, validate_gguf
from metatp.testing.gguf_edit import GGUFParts, finish_gguf, read_parts, write_parts

# A validation that takes longer than this on a small file counts as a hang.
MAX_VALIDATE_SECONDS = 2.0

# Integers that tend to break parsers when spliced over a count, length, type or offset.
INTERESTING_INTS = (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 63, 64, 127, 128, 255, 256,
                    0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, 1 << 40,
                    1 << 62, 1 << 63, (1 << 64) - 1)


# -- the sample file ----------------------------------------------------------------------

def build_sample_gguf(path: str | os.PathLike[str]) -> None:
    """Write a tiny valid GGUF that exercises every value kind and three tensor types.

    The last tensor's size is a multiple of the alignment, so the file ends exactly where
    its data ends: every strict truncation must then be rejected.
    """
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_custom_alignment(32)
    w.add_name("hostile-sample")
    w.add_uint8("test.u8", 200)
    w.add_int16("test.i16", -1234)
    w.add_uint32("test.u32", 4096)
    w.add_int32("test.i32", -7)
    w.add_float32("test.f32", 1e-5)
    w.add_bool("test.bool", True)
    w.add_uint64("test.u64", 1 << 40)
    w.add_float64("test.f64", 3.25)
    w.add_array("test.tokens", ["<s>", "</s>", "héllo", "▁world", "", "\u4e2d\u6587"])
    w.add_array("test.ids", [1, 2, 3, 40000])
    w.add_array("test.scores", [0.5, -1.0, 2.25])
    w.add_key_value("test.nested", [[1, 2], [3, 4, 5]], gguf.GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    # Q8_0, ne=(64, 2): two rows of two 34-byte blocks = 136 bytes, padded to 160.
    w.add_tensor("blk.0.attn_q.weight", rng.integers(0, 256, (2, 68), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", rng.standard_normal((2, 16)).astype(np.float16))
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    finish_gguf(w)


# -- mutators: pure functions of the input bytes and explicit parameters -------------------

def flip_bits(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    """Flip bit `bit` of byte `offset` for each (offset, bit)."""
    out = bytearray(data)
    for offset, bit in flips:
        out[offset % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


def overwrite_bytes(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    """Set byte `offset` to `value` for each (offset, value)."""
    out = bytearray(data)
    for offset, value in edits:
        out[offset % len(out)] = value & 0xFF
    return bytes(out)


def splice_int(data: bytes, offset: int, value: int, width: int) -> bytes:
    """Overwrite `width` (4 or 8) bytes at `offset` with little-endian `value`."""
    offset = min(offset, len(data) - width)
    raw = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    return data[:offset] + raw + data[offset + width:]


def truncate(data: bytes, length: int) -> bytes:
    return data[:length]


def delete_range(data: bytes, start: int, length: int) -> bytes:
    """Cut bytes out, shifting everything after (misaligns the rest of the header)."""
    return data[:start] + data[start + length:]


def duplicate_range(data: bytes, start: int, length: int) -> bytes:
    """Repeat a slice in place (duplicate keys, tensors, or shifted fields)."""
    return data[:start + length] + data[start:start + length] + data[start + length:]


# -- the oracle ---------------------------------------------------------------------------

_counter = itertools.count()


def field_category(field: str) -> str:
    """'kv #3 \\'test.ids\\' array length' -> "kv #N '…' array length" for summaries."""
    field = re.sub(r"'[^']*'", "'…'", field)
    field = re.sub(r"#\d+", "#N", field)
    return re.sub(r"\[\d+\]", "[i]", field)


def reader_agrees(path: str, layout: GGUFLayout) -> None:
    """Open `path` with gguf.GGUFReader (must not raise) and compare it with `layout`."""
    reader = gguf.GGUFReader(path)
    assert reader.data_offset == layout.data_offset, (reader.data_offset, layout.data_offset)
    assert int(reader.alignment) == layout.alignment
    kv = {k: int(f.types[0]) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert kv == layout.kv_types, (kv, layout.kv_types)
    assert len(reader.tensors) == len(layout.tensors)
    for rt, t in zip(reader.tensors, layout.tensors):
        assert rt.name == t.name
        assert tuple(int(x) for x in rt.shape) == t.ne, (rt.shape, t.ne)
        assert int(rt.tensor_type) == t.ggml_type
        assert int(rt.data_offset) == layout.data_offset + t.offset
        assert int(rt.n_bytes) == t.n_bytes
        assert rt.data.nbytes == t.n_bytes


def check_bytes(data: bytes, workdir: str | os.PathLike[str], use_reader: bool = True,
                zero_tail: int = 0) -> str:
    """Write `data` (then `zero_tail` sparse zero bytes) to a fresh file and apply the
    contract; return 'valid' or the category of the rejected field. Raises AssertionError
    (or whatever escaped) on a violation."""
    path = os.path.join(os.fspath(workdir), f"mutant-{os.getpid()}-{next(_counter)}.gguf")
    with open(path, "wb") as f:
        f.write(data)
        if zero_tail:
            f.truncate(len(data) + zero_tail)
    try:
        start = time.perf_counter()
        try:
            layout = validate_gguf(path)
        except GGUFFieldError as e:
            size = len(data) + zero_tail
            assert str(e) and e.field and isinstance(e.offset, int) and 0 <= e.offset <= size
            outcome = field_category(e.field)
        else:
            outcome = "valid"
        elapsed = time.perf_counter() - start
        assert elapsed < MAX_VALIDATE_SECONDS, f"validation took {elapsed:.2f} s"
        if outcome == "valid" and use_reader:
            reader_agrees(path, layout)
        return outcome
    finally:
        os.unlink(path)


# -- random driver ------------------------------------------------------------------------

# A mutation maps (header bytes, length of the zero tail after them) to the same pair.
Mutation = tuple[str, Callable[[bytes, int], tuple[bytes, int]]]


def random_mutation(rng: random.Random, data: bytes, tail: int, header_end: int) -> Mutation:
    """Pick a mutator and its parameters; 95% of positions fall in the header."""
    def pos() -> int:
        return rng.randrange(header_end if rng.random() < 0.95 else len(data))

    kind = rng.choice(["flip", "overwrite", "splice", "truncate", "delete", "duplicate"])
    if kind == "flip":
        flips = [(pos(), rng.randrange(8)) for _ in range(rng.randint(1, 8))]
        return f"flip_bits({flips})", lambda d, t: (flip_bits(d, flips), t)
    if kind == "overwrite":
        edits = [(pos(), rng.randrange(256)) for _ in range(rng.randint(1, 8))]
        return f"overwrite_bytes({edits})", lambda d, t: (overwrite_bytes(d, edits), t)
    if kind == "splice":
        offset, width = pos(), rng.choice([4, 8])
        value = rng.choice(INTERESTING_INTS) if rng.random() < 0.8 else rng.getrandbits(64)
        return (f"splice_int({offset}, {value}, {width})",
                lambda d, t: (splice_int(d, offset, value, width), t))
    if kind == "truncate":
        length = rng.randrange(len(data) + tail)
        return (f"truncate({length})", lambda d, t: (truncate(d, length), 0) if length < len(d)
                else (d, length - len(d)))
    start, length = pos(), rng.randint(1, 64)
    if kind == "delete":
        return (f"delete_range({start}, {length})",
                lambda d, t: (delete_range(d, start, length), t))
    return (f"duplicate_range({start}, {length})",
            lambda d, t: (duplicate_range(d, start, length), t))


def run(examples: int, seed: int, base: bytes, use_reader: bool, save_dir: Path | None,
        zero_tail: int = 0) -> int:
    """Run `examples` random mutations of `base` (followed by `zero_tail` zero bytes of
    tensor data); print a summary; return the number of contract violations."""
    with tempfile.TemporaryDirectory(prefix="fuzz_gguf-") as workdir:
        base_path = os.path.join(workdir, "base.gguf")
        with open(base_path, "wb") as f:
            f.write(base)
            f.truncate(len(base) + zero_tail)
        header_end = validate_gguf(base_path).data_offset
        rng = random.Random(seed)
        outcomes: collections.Counter[str] = collections.Counter()
        by_kind: collections.Counter[str] = collections.Counter()
        failures: list[str] = []
        t0 = time.perf_counter()
        for i in range(examples):
            desc, mutate = random_mutation(rng, base, zero_tail, header_end)
            mutant, tail = mutate(base, zero_tail)
            by_kind[desc.split("(")[0]] += 1
            try:
                outcomes[check_bytes(mutant, workdir, use_reader, tail)] += 1
            except Exception as e:  # noqa: BLE001 -- any escape is a finding
                outcomes["FAILED"] += 1
                failures.append(f"#{i} {desc}: {type(e).__name__}: {e}")
                if save_dir is not None:
                    save_dir.mkdir(parents=True, exist_ok=True)
                    with open(save_dir / f"failure-{seed}-{i}.gguf", "wb") as f:
                        f.write(mutant)
                        f.truncate(len(mutant) + tail)
        elapsed = time.perf_counter() - t0

    valid = outcomes.pop("valid", 0)
    n_failed = outcomes.pop("FAILED", 0)
    print(f"{examples} mutants of a {len(base) + zero_tail}-byte GGUF (header {header_end} bytes), "
          f"seed {seed}, {elapsed:.1f} s ({1e3 * elapsed / max(examples, 1):.2f} ms each)")
    print("mutators: " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())))
    print(f"valid (reader {'agreed' if use_reader else 'not run'}): {valid}")
    print(f"rejected with GGUFFieldError: {sum(outcomes.values())}")
    for category, n in outcomes.most_common():
        print(f"  {n:7d}  {category}")
    print(f"contract violations: {n_failed}")
    for line in failures[:20]:
        print("  " + line)
    return n_failed


# -- metadata values: rewrite a well-formed file with hostile values (the editor: metatp.testing.gguf_edit)

VT = gguf.GGUFValueType

# Values that break hyper-parameter readers: zero, negative, NaN, huge, and of the wrong type.
HOSTILE_VALUES: tuple[tuple[Any, gguf.GGUFValueType], ...] = (
    (0, VT.UINT32), (1, VT.UINT32), (3, VT.UINT32), (7, VT.UINT32), (1 << 31, VT.UINT32),
    ((1 << 32) - 1, VT.UINT32), (-1, VT.INT32), (-(1 << 31), VT.INT32), ((1 << 63) - 1, VT.INT64),
    (1 << 40, VT.UINT64), (0.0, VT.FLOAT32), (-0.0, VT.FLOAT32), (-1.0, VT.FLOAT32), (1e-30, VT.FLOAT32),
    (1e30, VT.FLOAT32), (float("nan"), VT.FLOAT32), (float("inf"), VT.FLOAT32), (float("-inf"), VT.FLOAT64),
    (2.5, VT.FLOAT32), (True, VT.BOOL), ("32", VT.STRING), ("", VT.STRING), ("linear", VT.STRING),
    ("yarn", VT.STRING),
)

# Keys a loader trusts; {arch} is filled in.
HPARAM_KEYS = (
    "{arch}.block_count", "{arch}.context_length", "{arch}.embedding_length", "{arch}.feed_forward_length",
    "{arch}.attention.head_count", "{arch}.attention.head_count_kv", "{arch}.attention.key_length",
    "{arch}.attention.value_length", "{arch}.rope.dimension_count", "{arch}.rope.freq_base",
    "{arch}.rope.scaling.type", "{arch}.rope.scaling.factor", "{arch}.attention.layer_norm_rms_epsilon",
    "{arch}.attention.layer_norm_epsilon", "{arch}.vocab_size", "{arch}.expert_count",
    "{arch}.expert_used_count", "{arch}.attention.sliding_window", "{arch}.final_logit_softcapping",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "general.architecture",
)

# Templates that loop, compute, recurse, grow or reach outside without bound (and two that are fine).
HOSTILE_TEMPLATES = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{{ 2 ** 100000000 }}",
    "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ 'a' * 10000000000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{% include 'chat.jinja' %}", "{% import 'macros' as m %}", "{% extends 'base' %}",
    "{{ 'a'.center(10000000000) }}", "{{ 'a'|center(10000000000) }}", "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}", "{{ range(100000)|map('string')|map('center', 1000000)|list|length }}",
    "{{ (range(100000)|list)|join('x' * 1000000) }}", "{{ messages|tojson(indent=100000000) }}",
    "{{ 1 / 0 }}", "{% for %}", "{{ ''.__class__.__mro__ }}", "{% if true %}" * 400 + "{% endif %}" * 400,
    "{{ raise_exception('no') }}", "{{ messages[5]['content'] }}", "{{ cycler }}",
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "",
)

# How one example changes the file.
ValueMutation = tuple[str, Callable[[GGUFParts], None]]


def set_key(key: str, value: Any, vtype: gguf.GGUFValueType) -> ValueMutation:
    def apply(p: GGUFParts) -> None:
        k = key.format(arch=p.arch)
        if k == "general.architecture":
            p.arch = str(value)
            return
        p.kvs[k] = (value, vtype, None)
    return f"set {key} = {value!r} ({vtype.name})", apply


def delete_key(key: str) -> ValueMutation:
    return f"delete {key}", lambda p: p.kvs.pop(key.format(arch=p.arch), None)


def set_template(template: str) -> ValueMutation:
    def apply(p: GGUFParts) -> None:
        p.kvs["tokenizer.chat_template"] = (template, VT.STRING, None)
    return f"template {template[:60]!r}", apply


def drop_tensor(index: int) -> ValueMutation:
    def apply(p: GGUFParts) -> None:
        del p.tensors[index % len(p.tensors)]
    return f"drop tensor #{index}", apply


def reshape_tensor(index: int, how: str) -> ValueMutation:
    """Change a tensor's rank or shape without changing its bytes (a weight of the wrong rank)."""
    def apply(p: GGUFParts) -> None:
        i = index % len(p.tensors)
        name, data, qtype, ne = p.tensors[i]
        if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return
        n = int(np.prod(ne))
        if how == "flat":
            new = (n,)
        elif how == "3d":
            new = (ne[0], 1, n // ne[0])         # a matrix with a unit middle dim: rank 3
        elif how == "transpose":
            new = tuple(reversed(ne))
        else:       # "split": half as wide, twice as many rows
            new = (ne[0] // 2, 2 * n // ne[0]) if ne[0] % 2 == 0 else ne
        if int(np.prod(new)) != n:
            return
        p.tensors[i] = (name, data, qtype, tuple(int(x) for x in new))
    return f"reshape tensor #{index} ({how})", apply


def scale_tensor(index: int, value: float) -> ValueMutation:
    """Fill a float tensor with one value (NaN or inf weights: NaN logits)."""
    def apply(p: GGUFParts) -> None:
        i = index % len(p.tensors)
        name, data, qtype, ne = p.tensors[i]
        if qtype == gguf.GGMLQuantizationType.F32:
            p.tensors[i] = (name, np.full_like(data, value), qtype, ne)
    return f"fill tensor #{index} with {value}", apply


def random_value_mutation(rng: random.Random) -> ValueMutation:
    kind = rng.choice(["set", "set", "set", "delete", "template", "template", "tensor"])
    if kind == "set":
        value, vtype = rng.choice(HOSTILE_VALUES)
        return set_key(rng.choice(HPARAM_KEYS), value, vtype)
    if kind == "delete":
        return delete_key(rng.choice(HPARAM_KEYS))
    if kind == "template":
        return set_template(rng.choice(HOSTILE_TEMPLATES))
    which = rng.choice(["drop", "reshape", "fill"])
    index = rng.randrange(64)
    if which == "drop":
        return drop_tensor(index)
    if which == "reshape":
        return reshape_tensor(index, rng.choice(["flat", "3d", "transpose", "split"]))
    return scale_tensor(index, rng.choice([float("nan"), float("inf"), 1e30]))


# A load + chat render + two generated tokens of a tiny model that takes longer than this hangs.
MAX_VALUE_SECONDS = 10.0


class _Hang(Exception):
    pass


def check_values(path: str | os.PathLike[str], time_limit: float = MAX_VALUE_SECONDS) -> str:
    """The value contract on one file: load, render the chat template, generate two tokens.

    Returns 'ok' or the name of the MetatpError raised; raises AssertionError for any other
    exception or for taking longer than `time_limit` (an alarm interrupts a hang when this
    runs on the main thread)."""
    import signal
    import threading
    import warnings

    from metatp import LLM, MetatpError, SamplingParams

    def on_alarm(signum, frame):
        raise _Hang()

    main = threading.current_thread() is threading.main_thread()
    if main:
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, time_limit)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(os.fspath(path), n_ctx=64, backend="numpy")
            if llm.tokenizer.chat_template is not None:
                try:
                    llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
                except MetatpError:
                    pass     # a template error does not stop the plain-text path below
            llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        outcome = "ok"
    except _Hang:
        raise AssertionError(f"hang: no result after {time_limit:g} s") from None
    except MetatpError as e:
        assert str(e), f"{type(e).__name__} without a message"
        outcome = type(e).__name__
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    elapsed = time.perf_counter() - start
    assert elapsed < time_limit, f"took {elapsed:.1f} s"
    return outcome


def run_values(examples: int, seed: int, base: Path | None) -> int:
    """Random value mutations of a tiny synthetic model (or `base`); return the violations."""
    with tempfile.TemporaryDirectory(prefix="fuzz_values-") as workdir:
        if base is None:
            from metatp.testing.synth import SynthSpec, write_synthetic_gguf

            base = Path(workdir, "base.gguf")
            write_synthetic_gguf(base, SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False))
        parts0 = read_parts(base)
        rng = random.Random(seed)
        outcomes: collections.Counter[str] = collections.Counter()
        failures: list[str] = []
        t0 = time.perf_counter()
        for i in range(examples):
            muts = [random_value_mutation(rng) for _ in range(rng.randint(1, 3))]
            parts = copy.deepcopy(parts0)
            path = Path(workdir, f"value-{i}.gguf")
            try:
                for _, apply in muts:
                    apply(parts)
                write_parts(path, parts)
            except Exception:  # noqa: BLE001 -- the writer refused the mutant (e.g. a value out of its type's range)
                outcomes["unwritable"] += 1
                continue
            try:
                outcomes[check_values(path)] += 1
            except Exception as e:  # noqa: BLE001 -- any escape is a finding
                outcomes["FAILED"] += 1
                failures.append(f"#{i} {'; '.join(d for d, _ in muts)}: {type(e).__name__}: {e}")
            finally:
                path.unlink(missing_ok=True)
        elapsed = time.perf_counter() - t0
    n_failed = outcomes.pop("FAILED", 0)
    print(f"{examples} value mutants, seed {seed}, {elapsed:.1f} s")
    for outcome, n in outcomes.most_common():
        print(f"  {n:7d}  {outcome}")
    print(f"contract violations: {n_failed}")
    for line in failures[:20]:
        print("  " + line)
    return n_failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=10000, help="mutants to try (10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base", type=Path,
                   help="GGUF to mutate (default: a tiny generated sample); only its header"
                        " and the tensor data are read, mutations target the header")
    p.add_argument("--no-reader", action="store_true",
                   help="skip the GGUFReader cross-check (it is slow on big vocabularies)")
    p.add_argument("--save-dir", type=Path, help="write mutants that break the contract here")
    p.add_argument("--values", action="store_true",
                   help="mutate metadata values, tensors and the chat template of a well-formed model instead of bytes")
    args = p.parse_args(argv)
    if args.values:
        return 1 if run_values(args.examples, args.seed, args.base) else 0

    if args.base is None:
        with tempfile.TemporaryDirectory() as d:
            build_sample_gguf(os.path.join(d, "sample.gguf"))
            base, zero_tail = Path(d, "sample.gguf").read_bytes(), 0
    else:
        # Mutate only the header; the tensor data is replaced by sparse zeros of the same
        # length, which neither the validator nor GGUFReader looks at.
        header_end = validate_gguf(args.base).data_offset
        with open(args.base, "rb") as f:
            base = f.read(header_end)
        zero_tail = os.path.getsize(args.base) - header_end
    failed = run(args.examples, args.seed, base, not args.no_reader, args.save_dir, zero_tail)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
