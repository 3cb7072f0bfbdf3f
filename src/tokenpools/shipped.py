"""The files that ship inside the package: the scenarios (the paper's experiments and ours)
and the example config, found by name so `tokenpools demo`, `simulate` and `experiments` work
from an installed package as well as from a checkout."""

from __future__ import annotations

from pathlib import Path

from tokenpools.model.config import ConfigError

PACKAGE = Path(__file__).parent
SCENARIOS = PACKAGE / "scenarios"
EXAMPLE_CONFIG = PACKAGE / "examples" / "tokenpools.yaml"


def builtin_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def scenario_path(name_or_path: str | Path) -> Path:
    """A scenario file: a path that exists, or the name of a shipped one (`paper-exp1`)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = SCENARIOS / f"{path.name.removesuffix('.yaml')}.yaml"
    if shipped.exists():
        return shipped
    raise ConfigError(
        f"no scenario file {str(name_or_path)!r}, and no shipped scenario of that name "
        f"(shipped: {', '.join(builtin_scenarios())})"
    )
