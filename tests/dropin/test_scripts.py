"""The acceptance check of issue 47 item 5: a script written in llama-cpp-python's idiom and
one in vLLM's run unchanged against metatp (only the import line swapped) on the default model,
as real scripts in their own processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["llama_cpp_style.py", "vllm_style.py"])
def test_script_runs_unchanged(script, default_model, tmp_path):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPTS / script), str(default_model)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith("ALL OK")
