"""The README's Python example runs as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_readme_python_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if "DecisionCore" in b
    ]
    assert blocks, "README has no example of the decision core"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        namespace: dict[str, object] = {}
        exec(compile(blocks[0], "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    assert "decision" in namespace
