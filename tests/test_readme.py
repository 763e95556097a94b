"""The README's examples run as written."""

import pathlib
import re

from hypothesis import settings

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(marker: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if marker in b]


def test_the_fxpipe_testing_example_passes_as_written():
    """Under hypothesis' own default settings, as a user's test suite would run it, on 25 of its
    200 examples (each compiles a pipeline: 200 take 90 s here)."""
    (example,) = python_blocks("from fxpipe.testing import")
    assert "max_examples=200," in example
    example = example.replace("max_examples=200,", "max_examples=25,")
    namespace: dict = {}
    ours = settings._current_profile
    settings.load_profile("default")
    try:
        exec(compile(example, "<README.md example>", "exec"), namespace)
        namespace["test_my_pass"]()
    finally:
        settings.load_profile(ours)
