"""Every ```python block of the README runs as shown (in order, in one namespace)."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 8, "the README should show an example per op and per strategy"
    torch.manual_seed(0)
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
