"""Fit an engine profile to a real server, then check the simulator against it.

1. Fit. Step time = t0 + a·prefill_tokens + b·decoding_sequences (engine/profile.py). Alone, a
   request's TTFT is one prefill step, t0 + a·P: measured at three prompt lengths. With k
   clients in closed loop, the median gap between two streamed tokens is a decode step,
   t0 + b·k (the other clients' prefills stall some gaps: the median leaves them out):
   measured at k = 1 … slots. One least squares fit of (t0, a, b) over both.
2. Check. Open-loop Poisson load at ~50 % and ~90 % of what the fitted engine serves, sent to
   the real server (tokenpools' load generator) and run in the simulator with the fitted
   profile, the same seed and arrivals. MAPE of TTFT and TPOT p50/p90 between the two.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from tokenpools.engine.profile import EngineProfile
from tokenpools.loadgen import LoadRun, Target
from tokenpools.real_engines.protection import MODEL, stream
from tokenpools.sim.metrics import percentile
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.simulator import RunResult, simulate

OUTPUT = 32
PROMPT = 100
FIT_PROMPTS = (50, 200, 400)


@dataclass(frozen=True)
class Fit:
    t0_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    extra_prompt_tokens: float  # what the engine counts beyond the prompt sent (its template)
    points: list[dict[str, float]]

    def profile(self, base: EngineProfile) -> EngineProfile:
        return base.model_copy(
            update={
                "t0_s": self.t0_s,
                "prefill_s_per_token": self.prefill_s_per_token,
                "decode_s_per_seq": self.decode_s_per_seq,
            }
        )


@dataclass
class Measured:
    ttft_s: list[float]
    gaps_s: list[float]
    prompt_tokens: list[int]  # as the engine counted them: its chat template adds some


async def closed_loop(url: str, clients: int, requests: int, prompt: int, output: int) -> Measured:
    """`clients` streams in closed loop, `requests` each."""
    m = Measured([], [], [])
    run = secrets.token_hex(4)  # no prompt repeats an earlier run's: the cache would hit
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(c: int) -> None:
            for i in range(requests):
                t = await stream(session, url, "none", prompt, output, f"{run}-{c}-{i}")
                if t.ttft_s is not None:
                    m.ttft_s.append(t.ttft_s)
                m.gaps_s.extend(t.gaps_s)
                if t.prompt_tokens is not None:
                    m.prompt_tokens.append(t.prompt_tokens)

        await asyncio.gather(*(client(c) for c in range(clients)))
    return m


async def fit(url: str, slots: int, requests: int = 6) -> Fit:
    rows: list[list[float]] = []
    values: list[float] = []
    points: list[dict[str, float]] = []
    extra = []
    for prompt in FIT_PROMPTS:
        m = await closed_loop(url, 1, requests, prompt, 4)
        real_prompt = statistics.median(m.prompt_tokens)
        extra.append(real_prompt - prompt)
        rows.append([1.0, real_prompt, 0.0])
        values.append(statistics.median(m.ttft_s))
        points.append({"prompt_tokens": real_prompt, "clients": 1, "ttft_p50_s": values[-1]})
    for clients in range(1, slots + 1):
        m = await closed_loop(url, clients, requests, PROMPT, OUTPUT)
        rows.append([1.0, 0.0, float(clients)])
        values.append(statistics.median(m.gaps_s))
        points.append({"clients": clients, "token_gap_p50_s": values[-1]})
    solution, *_ = np.linalg.lstsq(np.array(rows), np.array(values), rcond=None)
    t0, a, b = (max(0.0, float(x)) for x in solution)
    return Fit(t0, a, b, statistics.median(extra), points)


def capacity_rps(profile: EngineProfile, prompt: int = PROMPT, output: int = OUTPUT) -> float:
    """Requests per second the engine sustains with every slot busy: a prefill step holds
    the whole batch, a decode step is shared by all the slots."""
    slots = profile.max_num_seqs
    prefill = profile.step_time(prompt, 0, 0)
    decode = output * profile.step_time(0, slots, 0) / slots
    return 1.0 / (prefill + decode)


def load_scenario(
    profile_path: Path, rate: float, seconds: float, seed: int, prompt: int = PROMPT
) -> Scenario:
    """One tenant, Poisson arrivals at `rate` requests per second, fixed lengths."""
    return Scenario.model_validate(
        {
            "name": f"calibration-{rate:.3g}-rps",
            "duration_s": seconds,
            "seed": seed,
            "engine": {"profile": str(profile_path)},
            "tokenpools": {
                "pools": [
                    {
                        "name": "p",
                        "model": "SmolLM2-135M",
                        "perReplica": {"tokensPerSecond": 1e6, "kvTokens": 1e6, "concurrency": 1e3},
                    }
                ],
                "entitlements": [
                    {"name": "t", "tenantId": "t", "pool": "p", "serviceClass": "spot"}
                ],
            },
            "tenants": [
                {
                    "name": "t",
                    "workload": {
                        "arrivals": {"kind": "poisson", "rate": rate},
                        "prompt": {"kind": "fixed", "value": prompt},
                        "output": {"kind": "fixed", "value": OUTPUT},
                    },
                }
            ],
            "phases": [{"name": "all", "start_s": 0, "end_s": seconds}],
        }
    )


def quantiles(result: RunResult) -> dict[str, float]:
    ttft, tpot = [], []
    for a in result.attempts:
        if a.outcome != "completed" or a.first_token_at is None or a.finished_at is None:
            continue
        ttft.append(a.first_token_at - a.req.sent_at)
        if a.output_tokens > 1:
            tpot.append((a.finished_at - a.first_token_at) / (a.output_tokens - 1))
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90):
            value = percentile(values, q)
            out[f"{name}_p{q}_s"] = float("nan") if value is None else value
    out["completed"] = float(len(ttft))
    return out


async def check(
    url: str,
    fitted: Fit,
    base: EngineProfile,
    loads: dict[str, float],
    seconds: float,
    seed: int = 7,
) -> dict[str, Any]:
    """Real against simulated, per load (a fraction of the fitted engine's capacity). The
    simulator's prompts are as long as the engine counts them; the arrivals are the same."""
    profile = fitted.profile(base)
    engine_prompt = round(PROMPT + fitted.extra_prompt_tokens)
    out: dict[str, Any] = {}
    errors = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.yaml"
        path.write_text(yaml.safe_dump(profile.model_dump()))
        for label, fraction in loads.items():
            rate = fraction * capacity_rps(profile, engine_prompt)
            scenario = load_scenario(path, rate, seconds, seed)
            run = LoadRun(
                scenario,
                {"t": Target(url, "none")},
                MODEL,
                profile,
                label="real",
                extra_body={"ignore_eos": True},
            )
            real = quantiles(await run.run())
            sim = quantiles(
                simulate(load_scenario(path, rate, seconds, seed, engine_prompt), "none")
            )
            row_errors = {
                k: abs(sim[k] - real[k]) / real[k] for k in real if k != "completed" and real[k]
            }
            errors += list(row_errors.values())
            out[label] = {"rate_rps": rate, "real": real, "simulated": sim, "ape": row_errors}
    out["mape"] = sum(errors) / len(errors) if errors else float("nan")
    return out
