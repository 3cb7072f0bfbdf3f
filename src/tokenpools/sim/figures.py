"""PNG figures in the style of the paper's figures 2–6."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from tokenpools.sim.records import RunResult

MAX_SERIES = 10  # above this many tenants, plot by service class instead


def _groups(result: RunResult) -> dict[str, list[str]]:
    """Series to draw: one per tenant, or one per service class for large scenarios."""
    names = [t.name for t in result.scenario.tenants]
    if len(names) <= MAX_SERIES:
        return {n: [n] for n in names}
    groups: dict[str, list[str]] = {}
    for t in result.scenario.tenants:
        cls = result.config.entitlements[t.entitlement or t.name].service_class.value
        groups.setdefault(cls, []).append(t.name)
    return groups


def _phases(ax: Axes, result: RunResult) -> None:
    for phase in result.scenario.phases[1:]:
        ax.axvline(phase.start_s, color="grey", linestyle=":", linewidth=0.8)


def queue_depth(results: list[RunResult], path: Path) -> None:
    """Engine waiting queue over time, one line per policy (the paper's figure 2)."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for r in results:
        ax.plot([s.t for s in r.samples], [s.waiting for s in r.samples], label=r.policy)
    _phases(ax, results[0])
    ax.set_xlabel("time (s)")
    ax.set_ylabel("engine waiting queue")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title(f"{results[0].scenario.name}: engine queue depth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency(results: list[RunResult], path: Path) -> None:
    """TTFT of each completed request over time, per tenant; one panel per policy."""
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.4 * len(results)), sharex=True)
    axes = list(axes) if len(results) > 1 else [axes]
    for ax, r in zip(axes, results, strict=True):
        for label, members in _groups(r).items():
            wanted = set(members)
            points = [
                (a.req.sent_at, a.first_token_at - a.req.sent_at)
                for a in r.attempts
                if a.req.tenant in wanted and a.first_token_at is not None
            ]
            points = points[:: max(1, len(points) // 5000)]  # enough dots to see, no more
            if points:
                xs, ys = zip(*points, strict=True)
                ax.scatter(xs, ys, s=3, label=label)
        _phases(ax, r)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(r.policy, fontsize=9)
        ax.legend(fontsize=7, markerscale=3, loc="upper left")
    axes[-1].set_xlabel("time sent (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def utilization(result: RunResult, path: Path) -> None:
    """Running sequences stacked by tenant, against the pool's slots (figure 4 style)."""
    groups = _groups(result)
    ts = [s.t for s in result.samples]
    stacks = [
        [sum(s.running_by_tenant.get(n, 0) for n in members) for s in result.samples]
        for members in groups.values()
    ]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.stackplot(ts, stacks, labels=list(groups), alpha=0.85)
    ax.plot(ts, [s.slots for s in result.samples], color="black", linewidth=1, label="slots")
    _phases(ax, result)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("running sequences")
    ax.set_title(f"{result.scenario.name} under {result.policy}: slots by tenant")
    ax.legend(fontsize=7, ncol=4, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def priority_dynamics(result: RunResult, path: Path) -> None:
    """The four-panel figure: slots held, debt, priority, low-priority denials per second."""
    ts = [s.t for s in result.samples]
    dt = result.scenario.sample_interval_s
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    for label, members in _groups(result).items():
        n = len(members)  # groups show the sum of slots and denials, the mean debt and priority
        samples = result.samples
        axes[0].plot(
            ts, [sum(s.running_by_tenant.get(m, 0) for m in members) for s in samples], label=label
        )
        axes[1].plot(
            ts, [sum(s.scores.get(m, (0.0, 0.0))[0] for m in members) / n for s in samples]
        )
        axes[2].plot(
            ts, [sum(s.scores.get(m, (0.0, 0.0))[1] for m in members) / n for s in samples]
        )
        axes[3].plot(
            ts,
            [sum(s.low_priority_by_tenant.get(m, 0) for m in members) / dt for s in samples],
        )
    for ax, label in zip(
        axes, ("slots held", "debt", "priority", "low-priority denials/s"), strict=True
    ):
        ax.set_ylabel(label)
        _phases(ax, result)
    axes[0].plot(ts, [s.slots for s in result.samples], color="black", linewidth=0.8)
    axes[0].legend(fontsize=7, ncol=4)
    axes[-1].set_xlabel("time (s)")
    axes[0].set_title(f"{result.scenario.name} under {result.policy}: priority dynamics")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_figures(results: list[RunResult], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    name = results[0].scenario.name
    written = [folder / f"{name}-queue.png", folder / f"{name}-latency.png"]
    queue_depth(results, written[0])
    latency(results, written[1])
    for r in results:
        if r.policy in ("tokenpools", "none"):
            path = folder / f"{name}-utilization-{r.policy}.png"
            utilization(r, path)
            written.append(path)
        if r.policy == "tokenpools":
            path = folder / f"{name}-priority.png"
            priority_dynamics(r, path)
            written.append(path)
    return written
