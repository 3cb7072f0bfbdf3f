"""`pip install .` without extras, into a fresh virtual environment: no matplotlib or numpy, and
a working gateway (the example config shipped in the package, the emulator behind it). pip
resolves pyproject's ranges as a user's would, constrained to the locked versions
(locks/dev.txt) so that a new release elsewhere cannot change what this test installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from scripts import locks

from tokenpools.processes import free_port

ROOT = Path(__file__).parent.parent


def test_the_core_install_serves_without_the_sim_extra(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    constraints = tmp_path / "constraints.txt"  # pip takes no hashes in a constraints file
    pins = locks.locked((locks.LOCK_DIR / "dev.txt").read_text())
    constraints.write_text("".join(f"{pin}\n" for pin in pins))
    # no mypyc build: this checks dependencies; the variable reaches the build's own pip too
    env = {**os.environ, "TOKENPOOLS_PURE": "1", "PIP_CONSTRAINT": str(constraints)}
    subprocess.run([*pip, str(ROOT)], check=True, env=env, capture_output=True)
    python, tokenpools = str(venv / "bin" / "python"), str(venv / "bin" / "tokenpools")
    missing = subprocess.run(
        [python, "-c", "import importlib.util as u; print([m for m in ('matplotlib', 'numpy') "
         "if u.find_spec(m) is None])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert missing.stdout.strip() == "['matplotlib', 'numpy']"
    assert subprocess.run(
        [tokenpools, "--version"], capture_output=True, text=True
    ).stdout.startswith("tokenpools ")

    config = yaml.safe_load(
        subprocess.run([tokenpools, "example-config"], capture_output=True, check=True).stdout
    )
    emu_port, gw_port = free_port(), free_port()
    config["pools"][0]["backends"] = [{"url": f"http://127.0.0.1:{emu_port}"}]
    path = tmp_path / "tokenpools.yaml"
    path.write_text(yaml.safe_dump(config))
    emulator = subprocess.Popen(
        [tokenpools, "emulate", "--speed", "0", "--port", str(emu_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    serve = [tokenpools, "serve", "--config", str(path), "--port", str(gw_port)]
    gateway = subprocess.Popen(
        [*serve, "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        url = f"http://127.0.0.1:{gw_port}"
        for _ in range(200):
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # waiting for a child process to listen; nothing to inject
        key = "sk-guaranteed-a"  # the example config's documented key
        model = config["pools"][0]["name"]  # served under its own name
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        # the dashboard's files are package data: served from the installed package
        for page in ("dashboard", "dashboard/dashboard.js", "dashboard/vendor/uPlot.iife.min.js"):
            assert httpx.get(f"{url}/{page}").status_code == 200, page
    finally:
        emulator.terminate()
        gateway.terminate()
        emulator.wait(10)
        _, err = gateway.communicate(timeout=10)
    access = [json.loads(line) for line in err.decode().splitlines() if '"request_id"' in line]
    assert access and access[-1]["status"] == 200 and access[-1]["entitlement"] == "guaranteed-a"
    # the README's short path: the same install, then one command to an answered request
    quick = subprocess.run(
        [tokenpools, "quickstart", "--once", "--port", "0", "--backend-port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert quick.returncode == 0, quick.stderr
    assert "first request: HTTP 200, admitted as guaranteed-a (guaranteed)" in quick.stdout
