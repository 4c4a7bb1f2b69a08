"""The README's examples run as written."""

from __future__ import annotations

import doctest
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs():
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    namespace: dict = {}
    # running the README's own example is the point of this test
    exec(compile(code.replace("range(100)", "range(3)"), str(README), "exec"), namespace)  # noqa: S102
    assert int(namespace["state"].step) == 3


def test_readme_doctests_pass():
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
