"""`tokenpools quickstart`: one request answered through the gateway in front of the
emulator, and a clear error (no traceback) when its port is taken. The installed path (a
fresh `pip install .`) is tests/test_packaging.py's."""

from __future__ import annotations

import socket
import subprocess
import sys

from tokenpools.quickstart import config_data


def _quickstart(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tokenpools.cli", "quickstart", "--once", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_one_request_is_answered_and_the_way_to_send_more_is_printed() -> None:
    done = _quickstart("--port", "0", "--backend-port", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tokenpools gateway on http://127.0.0.1:")
    gateway = lines[0].split()[3].rstrip(",")
    assert "first request: HTTP 200, admitted as guaranteed-a (guaranteed)" in done.stdout
    assert "'completion_tokens': 32" in done.stdout
    assert f"curl -s {gateway}/v1/chat/completions" in done.stdout


def test_a_taken_port_is_an_error_that_says_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = _quickstart("--port", "0", "--backend-port", port)
    assert done.returncode == 1
    assert "--backend-port" in done.stderr and "Traceback" not in done.stderr


def test_the_first_pool_is_pointed_at_the_emulator_and_nothing_else_changes() -> None:
    import yaml

    from tokenpools.shipped import EXAMPLE_CONFIG

    example = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    data = config_data("http://127.0.0.1:1234")
    assert data["pools"][0]["backends"] == [{"url": "http://127.0.0.1:1234"}]
    data["pools"][0]["backends"] = example["pools"][0]["backends"]
    assert data == example
