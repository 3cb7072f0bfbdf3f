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


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_example_config_is_what_the_readme_says_it_is() -> None:
    """The README's table of the example config: its pools, each pool's entitlements and
    their classes, and the keys it says they have (sk-<entitlement>)."""
    from tokenpools.model.config import load_config
    from tokenpools.model.keys import hash_key
    from tokenpools.shipped import EXAMPLE_CONFIG

    section = _section((ROOT / "README.md").read_text(), "Configuration")
    table = section.split("The example config", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    said = {}
    for row in rows[1:]:  # the header aside
        pool, entitlements = (cell.strip() for cell in row.strip("|").split("|"))
        for item in entitlements.split(", "):
            name, cls = re.fullmatch(r"(\S+) \((\w+)\)", item).groups()  # type: ignore[union-attr]
            said[name] = (pool, cls)
    config = load_config(EXAMPLE_CONFIG)
    assert said == {e.name: (e.pool, e.service_class.value) for e in config.entitlements.values()}
    assert "two pools" in section and len(config.pools) == 2
    for entitlement in config.entitlements.values():
        assert hash_key(f"sk-{entitlement.name}") in entitlement.api_key_hashes
    assert hash_key("sk-admin") in config.gateway.admin_key_hashes


def test_the_readme_short_config_is_valid() -> None:
    import yaml

    from tokenpools.model.config import parse_config
    from tokenpools.model.keys import hash_key

    section = _section((ROOT / "README.md").read_text(), "Configuration")
    [block] = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    data = yaml.safe_load(block.replace("sha256:…", hash_key("sk-laptop")))
    config = parse_config(data)
    assert [e.service_class.value for e in config.entitlements.values()] == ["guaranteed", "spot"]
    assert "team-a-month" in config.budgets
