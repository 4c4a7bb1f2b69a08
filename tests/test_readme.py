"""The README's examples run as written, each in a fresh process, as on a machine without accelerators."""

from __future__ import annotations

import doctest
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```(?:python|py)\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _first_line(code: str) -> str:
    return next(line for line in code.splitlines() if line and not line.startswith(("import", "from")))[:40]


def test_every_python_block_is_found():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs_in_a_fresh_process(code, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # the block's own setup
    env["JAX_PLATFORMS"] = "cpu"  # as on a machine without accelerators
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{_first_line(code)!r} failed:\n{done.stderr[-3000:]}"


def test_readme_doctests_pass():
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
