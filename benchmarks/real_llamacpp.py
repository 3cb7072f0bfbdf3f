"""tokenpools in front of a real llama.cpp server (SmolLM2-135M, 4 slots, this machine's CPUs).

1. Protection: a guaranteed tenant (1 slot's baseline) sends a request every second while spot
   floods with 6 clients — through a `tokenpools serve` process, and straight to the engine.
   Its TTFT against its unloaded value; several runs.
2. Calibration: fit the `cpu-smollm2-135m` engine profile to the server (step times, then
   refined at ~30 % and ~70 % load), then compare the simulator with the server at ~50 % and
   ~90 % load (tokenpools.real_engines.calibrate); each load measured `--repeats` times.

    python benchmarks/real_llamacpp.py --json out/real_llamacpp.json [--repeats 3]
    python benchmarks/real_llamacpp.py --json /tmp/real_llamacpp.json --smoke  # the tests' run

`--smoke`: one run of each part, seconds long, and a first fit from one request per point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from smoke import parse_args
from tokenpools.engine.profile import load_profile
from tokenpools.processes import free_port, spawn, stop, wait_ready
from tokenpools.real_engines.calibrate import calibrate, fit
from tokenpools.real_engines.llamacpp import LlamaCppServer
from tokenpools.real_engines.protection import KEYS, Load, gateway_config, protection

SLOTS = 4
# The JSON (paths as in benchmarks/smoke.py): the headline medians, each protection figure's
# spread over the runs, and the calibration as tokenpools.real_engines.calibrate reports it.
FIELDS = (
    "unloaded_ttft_p50_s",
    "with_tokenpools.guaranteed_ttft_p50_s", "with_tokenpools.guaranteed_ttft_p99_s",
    "with_tokenpools.spot_rejected_fraction",
    "without.guaranteed_ttft_p50_s", "without.guaranteed_ttft_p99_s",
    "calibration_mape.overall",
    "spread.unloaded.guaranteed_ttft_p50_s.median",
    "spread.with_tokenpools.guaranteed_ttft_p99_s.median",
    "spread.with_tokenpools.spot_rejected_fraction.median",
    "spread.without.guaranteed_ttft_p99_s.median",
    "spread.*.guaranteed_ttft_p50_s.min", "spread.*.guaranteed_ttft_p50_s.max",
    "calibration.first_fit.t0_s", "calibration.first_fit.prefill_s_per_token",
    "calibration.first_fit.decode_s_per_seq", "calibration.first_fit.extra_prompt_tokens",
    "calibration.first_fit.points",
    "calibration.first_capacity_rps", "calibration.capacity_rps",
    "calibration.profile.t0_s", "calibration.profile.prefill_s_per_token",
    "calibration.profile.decode_s_per_seq", "calibration.fit_mape", "calibration.mape",
    "calibration.30%.rate_rps", "calibration.30%.real", "calibration.30%.simulated",
    "calibration.30%.ape", "calibration.30%.ape_first_fit",
    "calibration.50%.rate_rps", "calibration.50%.real.ttft_p50_s",
    "calibration.50%.simulated.ttft_p50_s", "calibration.50%.ape",
    "calibration.70%.rate_rps", "calibration.90%.rate_rps", "calibration.90%.real.ttft_p90_s",
    "calibration.90%.simulated.ttft_p90_s", "calibration.90%.ape",
)  # fmt: skip
# Every load generator sends its first request at once, so even 2 s runs answer some.
SMOKE = {
    "repeats": 1,
    "seconds": 1.5,
    "unloaded_seconds": 1.0,
    "calibration_seconds": 2.0,
    "fit_requests": 1,
}


def spread(runs: list[dict[str, float]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def protection_runs(
    llama: str, repeats: int, seconds: float, unloaded_s: float
) -> dict[str, Any]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(gateway_config(llama, SLOTS), f)
    gateway = spawn(["serve", "--config", f.name, "--port", str(port)])
    gw = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(f"{gw}/readyz", gateway)
        load = Load(seconds=seconds)
        unloaded, with_tp, without = [], [], []
        for run in range(repeats):
            unloaded.append(
                (await protection(llama, KEYS, Load(seconds=unloaded_s, spot_workers=0))).summary()
            )
            with_tp.append((await protection(gw, KEYS, load)).summary())
            without.append((await protection(llama, KEYS, load)).summary())
            print(
                f"run {run}: unloaded p50 {unloaded[-1]['guaranteed_ttft_p50_s']:.3f} s; "
                f"with tokenpools p50 {with_tp[-1]['guaranteed_ttft_p50_s']:.3f} "
                f"p99 {with_tp[-1]['guaranteed_ttft_p99_s']:.3f} s, spot refused "
                f"{with_tp[-1]['spot_rejected_fraction']:.0%}; without p50 "
                f"{without[-1]['guaranteed_ttft_p50_s']:.3f} "
                f"p99 {without[-1]['guaranteed_ttft_p99_s']:.3f} s",
                file=sys.stderr,
            )
        return {"unloaded": unloaded, "with_tokenpools": with_tp, "without": without}
    finally:
        stop(gateway)
        Path(f.name).unlink()


async def calibration(
    llama: str, seconds: float, repeats: int, fit_requests: int
) -> dict[str, Any]:
    fitted = await fit(llama, SLOTS, fit_requests)
    print(
        f"first fit: t0 {fitted.t0_s * 1000:.1f} ms, prefill "
        f"{fitted.prefill_s_per_token * 1000:.3f} ms/token, decode "
        f"{fitted.decode_s_per_seq * 1000:.2f} ms/sequence; the chat template adds "
        f"{fitted.extra_prompt_tokens:g} prompt tokens",
        file=sys.stderr,
    )
    result = await calibrate(llama, fitted, load_profile("cpu-smollm2-135m"), seconds, repeats)
    p = result["profile"]
    print(
        f"refined at 30%/70% load: t0 {p['t0_s'] * 1000:.1f} ms, prefill "
        f"{p['prefill_s_per_token'] * 1000:.3f} ms/token, decode "
        f"{p['decode_s_per_seq'] * 1000:.2f} ms/sequence (MAPE {result['fit_mape']:.1%})",
        file=sys.stderr,
    )
    for label in ("30%", "50%", "70%", "90%"):
        row = result[label]
        print(
            f"load {label} ({row['rate_rps']:.2f} req/s): "
            + ", ".join(
                f"{k} real {row['real'][k]:.3f} sim {row['simulated'][k]:.3f}" for k in row["ape"]
            ),
            file=sys.stderr,
        )
    mape = "nothing finished to compare" if result["mape"] is None else f"{result['mape']:.1%}"
    print(f"MAPE at 50% and 90% load: {mape}", file=sys.stderr)
    return {
        "first_fit": {
            "t0_s": fitted.t0_s,
            "prefill_s_per_token": fitted.prefill_s_per_token,
            "decode_s_per_seq": fitted.decode_s_per_seq,
            "extra_prompt_tokens": fitted.extra_prompt_tokens,
            "points": fitted.points,
        },
        **result,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    server = LlamaCppServer(slots=SLOTS)
    llama = server.start()
    try:
        runs = await protection_runs(llama, args.repeats, args.seconds, args.unloaded_seconds)
        cal = await calibration(llama, args.calibration_seconds, args.repeats, args.fit_requests)
    finally:
        server.stop()
    mape = {
        f"{k}_{label}": cal[label]["ape"][k] for label in ("50%", "90%") for k in cal[label]["ape"]
    }
    return {
        "unloaded_ttft_p50_s": spread(runs["unloaded"], "guaranteed_ttft_p50_s")["median"],
        "with_tokenpools": {
            k: spread(runs["with_tokenpools"], k)["median"]
            for k in ("guaranteed_ttft_p50_s", "guaranteed_ttft_p99_s", "spot_rejected_fraction")
        },
        "without": {
            k: spread(runs["without"], k)["median"]
            for k in ("guaranteed_ttft_p50_s", "guaranteed_ttft_p99_s")
        },
        "calibration_mape": {"overall": cal["mape"], **mape},
        "spread": {
            group: {k: spread(rows, k) for k in rows[0] if k != "guaranteed_requests"}
            for group, rows in runs.items()
        },
        "calibration": cal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="per protection run")
    parser.add_argument("--unloaded-seconds", type=float, default=8.0, help="per unloaded run")
    parser.add_argument("--calibration-seconds", type=float, default=40.0, help="per load run")
    parser.add_argument("--fit-requests", type=int, default=6, help="per point of the first fit")
    args = parse_args(parser, SMOKE)
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
