"""The load generator against a real server: attempts measured client-side, 429s retried."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from tests.gateway_setup import FAST
from tests.servers import ServerThread
from tokenpools.cli import app
from tokenpools.emulator.app import make_app as make_emulator


def test_load_command_replays_a_scenario_and_writes_a_summary(tmp_path: Path) -> None:
    emulator = ServerThread(make_emulator(FAST))
    scenario = {
        "name": "tiny-load",
        "duration_s": 3,
        "engine": {"profile": "paper-dgx-spark-qwen3-8b"},
        "tokenpools": {
            "pools": [
                {"name": "p", "model": "Qwen3-8B",
                 "perReplica": {"tokensPerSecond": 480, "kvTokens": 65536, "concurrency": 16}}
            ],
            "entitlements": [{"name": "a", "tenantId": "a", "pool": "p", "serviceClass": "spot"}],
        },
        "phases": [{"name": "all", "start_s": 0, "end_s": 3}],
        "tenants": [
            {"name": "a", "workload": {
                "arrivals": {"kind": "closed", "clients": 2},
                "prompt": {"kind": "fixed", "value": 32},
                "output": {"kind": "fixed", "value": 5}}}
        ],
    }  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(scenario))
    out = tmp_path / "load.json"
    try:
        result = CliRunner().invoke(
            app,
            ["load", str(path), "--target", emulator.url, "--metrics-url",
             f"{emulator.url}/metrics", "--json", str(out)],
        )  # fmt: skip
    finally:
        emulator.stop()
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    m = summary["policies"]["load"]["tenants"]["a"]["totals"]
    assert m["completed"] >= 10 and m["rejected"] == 0
    assert 0 < m["ttft_p50_s"] < 1.0 and m["tpot_p50_s"] is not None
    assert m["output_tok_s"] > 0
