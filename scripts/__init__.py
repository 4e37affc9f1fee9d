"""The workshop: development scripts (GPU checks, fuzzers, soaks, micro-benchmarks), run from a
source tree and never installed (llama.cpp's scripts/ beside its tools/). The product's
subcommands live in `metatp.tools`.

    python -m scripts.fuzz_gguf --values          # from the tree's root
    python3 scripts/gpu_check --emulate           # a folder: its __main__ does the same mapping

Importing this package makes `metatp` importable from this tree when it is not installed
(`_source_tree.register`: the package-dir mapping of pyproject.toml as a meta-path finder), so a
GPU machine with nothing installed runs them; with metatp installed it does nothing. They
import `metatp.testing`, which the wheel does not ship either.
"""

from scripts._source_tree import register

register()
