"""`metatp bench`: throughput in llama-bench's shape (pp512, tg128, tg128 @ d2048).

Every combination of the comma-separated options gets a row with tokens/s as mean ± std over
`-r` repetitions. Tensor-parallel rows also show their speed relative to the single-device row of
the same test measured in the same invocation, as llama.cpp's PR tables do. With
`--compare llama-cpp` (and llama-cpp-python importable) the same tests run through llama.cpp in
the same invocation, their repetitions interleaved with metatp's, and every row shows its ratio
to llama.cpp's row of the same test.

Every row also carries the communication its split implies, as `metatp dump` bills it, per
token and per 512-token prompt (`bench_comm`: tensor, the all-reduce bytes of the busiest rank;
layer, the hidden state's copies at the device boundaries), so the trade-off between the modes
is beside the measured speed.

Under `mpiexec -n N metatp bench ... -sm tensor` (or `-sm layer`; one process per device) the
world size is the device count (`--devices` may be left out or must equal it). The split rows
run on every rank in lock step; the single-device baseline (and `--compare llama-cpp`) run on
rank 0 alone while the other ranks sleep in a barrier, so the rows are the same as in one
process. Rank 0 prints the table once, with two more columns: the mean wall time this rank
spent inside `MPI_Allreduce` (tensor rows) or its MPI sends / receives of the hidden state
(layer rows) per call (us) and per token (ms) during the timed runs (it includes waiting for
the slower rank and the zero-fill / staging copy of the buffer; not the logits' Allgatherv or
broadcast, nor the token broadcast). t/s and peak memory are rank 0's.

The package, one job a module: `config` (BenchConfig, the layouts), `timing` (one timed run),
`setups` (a row's engine and fields), `slots` (lock step under mpiexec), `run` (run_bench, the
ratios), `table` (md / json / csv), `command` (the flags).
"""

from __future__ import annotations

from metatp.tools.bench.command import add_parser
from metatp.tools.bench.config import BenchConfig
from metatp.tools.bench.run import run_bench
from metatp.tools.bench.slots import check_world
from metatp.tools.bench.table import COMM_COLUMNS, COPY_COLUMNS, MPI_COLUMNS, format_rows

__all__ = ["BenchConfig", "run_bench", "check_world", "add_parser", "format_rows", "MPI_COLUMNS", "COPY_COLUMNS",
           "COMM_COLUMNS"]
