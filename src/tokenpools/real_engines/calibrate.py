"""Fit an engine profile to a real server, then check the simulator against it.

1. Fit. Step time = t0 + a·prefill_tokens + b·decoding_sequences (engine/profile.py). Alone, a
   request's TTFT is one prefill step, t0 + a·P: measured at three prompt lengths. With k
   clients in closed loop, the median gap between two streamed tokens is a decode step,
   t0 + b·k (the other clients' prefills stall some gaps: the median leaves them out):
   measured at k = 1 … slots. A line through the gaps gives t0 and b; a is then fitted to
   the TTFTs through that same t0 (a free intercept there came out negative: small prompts
   prefill faster per token).
2. Refine. Open-loop Poisson load at ~30 % and ~70 % of what the fitted engine serves, sent to
   the real server (tokenpools' load generator); the simulator runs the same arrivals with
   candidate profiles around the first fit (a grid over t0, a and b), and the profile whose
   TTFT and TPOT p50/p90 are closest (least MAPE) is kept.
3. Check, out of sample: the same at ~50 % and ~90 % of the refined profile's capacity, MAPE
   of TTFT and TPOT p50/p90 between the real server and the simulator with that profile.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from tokenpools.engine.profile import EngineProfile, load_profile
from tokenpools.loadgen import LoadRun, Target
from tokenpools.real_engines.protection import MODEL, stream
from tokenpools.sim.metrics import percentile
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.simulator import RunResult, simulate

OUTPUT = 32
PROMPT = 50
FIT_PROMPTS = (PROMPT // 2, PROMPT, 2 * PROMPT)  # around the workload: prefill is not linear


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
    points: list[dict[str, float]] = []
    prompts, ttfts, extra = [], [], []
    for prompt in FIT_PROMPTS:
        m = await closed_loop(url, 1, requests, prompt, 4)
        prompts.append(statistics.median(m.prompt_tokens))
        ttfts.append(statistics.median(m.ttft_s))
        extra.append(prompts[-1] - prompt)
        points.append({"prompt_tokens": prompts[-1], "clients": 1, "ttft_p50_s": ttfts[-1]})
    clients, gaps = [], []
    for k in range(1, slots + 1):
        m = await closed_loop(url, k, requests, PROMPT, OUTPUT)
        clients.append(float(k))
        gaps.append(statistics.median(m.gaps_s))
        points.append({"clients": k, "token_gap_p50_s": gaps[-1]})
    b, t0 = (float(x) for x in np.polyfit(clients, gaps, 1))
    t0, b = max(0.0, t0), max(0.0, b)
    p, t = np.array(prompts), np.array(ttfts) - t0
    a = max(0.0, float(p @ t / (p @ p)))
    return Fit(t0, a, b, statistics.median(extra), points)


def capacity_rps(profile: EngineProfile, prompt: int = PROMPT, output: int = OUTPUT) -> float:
    """Requests per second the engine sustains with every slot busy: a prefill step holds
    the whole batch, a decode step is shared by all the slots."""
    slots = profile.max_num_seqs
    prefill = profile.step_time(prompt, 0, 0)
    decode = output * profile.step_time(0, slots, 0) / slots
    return 1.0 / (prefill + decode)


def load_scenario(rate: float, seconds: float, seed: int, prompt: int = PROMPT) -> Scenario:
    """One tenant, Poisson arrivals at `rate` requests per second, fixed lengths."""
    return Scenario.model_validate(
        {
            "name": f"calibration-{rate:.3g}-rps",
            "duration_s": seconds,
            "seed": seed,
            "engine": {"profile": "cpu-smollm2-135m"},
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


METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


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


def errors(real: dict[str, float], sim: dict[str, float]) -> dict[str, float]:
    """Absolute percentage error of each metric (a fraction)."""
    return {k: abs(sim[k] - real[k]) / real[k] for k in METRICS if real[k] > 0}


@dataclass
class Observed:
    rate_rps: float
    real: dict[str, float]


async def observe(url: str, rate: float, seconds: float, seed: int, repeats: int) -> Observed:
    """The real server under open-loop Poisson load at `rate`, `repeats` times with the same
    arrivals: each metric is the median over the runs, so one run disturbed by a neighbour
    on this shared machine does not decide the fit."""
    scenario = load_scenario(rate, seconds, seed)
    runs = []
    for _ in range(repeats):
        run = LoadRun(
            scenario,
            {"t": Target(url, "none")},
            MODEL,
            load_profile(scenario.engine.profile),  # unused: the rate is given in requests/s
            label="real",
            extra_body={"ignore_eos": True},
        )
        runs.append(quantiles(await run.run()))
    return Observed(rate, {k: statistics.median(r[k] for r in runs) for k in runs[0]})


def simulated(
    profile: EngineProfile, fit: Fit, rate: float, seconds: float, seed: int
) -> dict[str, float]:
    """The same arrivals in the simulator, with prompts as long as the engine counts them."""
    prompt = round(PROMPT + fit.extra_prompt_tokens)
    return quantiles(simulate(load_scenario(rate, seconds, seed, prompt), "none", profile=profile))


def refine(
    fit: Fit, base: EngineProfile, seen: list[Observed], seconds: float, seed: int
) -> tuple[EngineProfile, float]:
    """The profile on a grid around the first fit that the observations agree with best."""
    best: tuple[float, EngineProfile] | None = None
    for t0 in (0.0, 0.5 * fit.t0_s, fit.t0_s, 2 * fit.t0_s + 0.002, 4 * fit.t0_s + 0.005):
        for fa in (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5):
            for fb in (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5):
                profile = base.model_copy(
                    update={
                        "t0_s": t0,
                        "prefill_s_per_token": fa * fit.prefill_s_per_token,
                        "decode_s_per_seq": fb * fit.decode_s_per_seq,
                    }
                )
                apes = [
                    e
                    for obs in seen
                    for e in errors(
                        obs.real, simulated(profile, fit, obs.rate_rps, seconds, seed)
                    ).values()
                ]
                if not apes:  # nothing completed in the windows: nothing to agree with
                    continue
                mape = sum(apes) / len(apes)
                if best is None or mape < best[0]:
                    best = (mape, profile)
    if best is None:  # a window too short on a loaded machine: the first fit stands
        return fit.profile(base), float("nan")
    return best[1], best[0]


async def calibrate(
    url: str, fit: Fit, base: EngineProfile, seconds: float, repeats: int = 3, seed: int = 7
) -> dict[str, Any]:
    """Refine at 30 % and 70 % of the first fit's capacity; then check at 50 % and 90 % of the
    refined profile's capacity, the best estimate of what "90 % load" means for this engine
    (near saturation, a few percent of capacity decide whether a queue builds)."""
    prompt = round(PROMPT + fit.extra_prompt_tokens)
    first = fit.profile(base)
    first_capacity = capacity_rps(first, prompt)
    seen = {
        label: await observe(url, f * first_capacity, seconds, seed, repeats)
        for label, f in (("30%", 0.3), ("70%", 0.7))
    }
    profile, fit_mape = refine(fit, base, list(seen.values()), seconds, seed)
    capacity = capacity_rps(profile, prompt)
    for label, f in (("50%", 0.5), ("90%", 0.9)):
        seen[label] = await observe(url, f * capacity, seconds, seed, repeats)
    out: dict[str, Any] = {
        "first_capacity_rps": first_capacity,
        "capacity_rps": capacity,
        "profile": {
            "t0_s": profile.t0_s,
            "prefill_s_per_token": profile.prefill_s_per_token,
            "decode_s_per_seq": profile.decode_s_per_seq,
        },
        "fit_mape": fit_mape,
    }
    checked = []
    for label in ("30%", "50%", "70%", "90%"):
        obs = seen[label]
        sim = simulated(profile, fit, obs.rate_rps, seconds, seed)
        ape = errors(obs.real, sim)
        out[label] = {
            "rate_rps": obs.rate_rps,
            "real": obs.real,
            "simulated": sim,
            "ape": ape,
            "ape_first_fit": errors(obs.real, simulated(first, fit, obs.rate_rps, seconds, seed)),
        }
        if label in ("50%", "90%"):
            checked += list(ape.values())
    # None: no request finished at 50% or 90% load (a seconds-long smoke run on a busy
    # machine), so there is nothing to compare
    out["mape"] = sum(checked) / len(checked) if checked else None
    return out
