"""What accel-dash writes into this machine's usage database each time it builds the page: per held card of this
host, the seconds held since the last build, whether it was idle-held, its energy, and its job's samples and steps.

Only this host's cards are written (one writer per machine: the others' are their own accel-dash's or agent's).
Builds further apart than `max_gap_s` are not counted (accel-dash was not watching): the next build starts a new
watch. An interval counts as idle-held when the card is flagged idle-held at its end (the tracker's threshold has
passed): the first `--idle-after` of an episode is held, not idle-held, so the idle figure is a floor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_accel.dash.usage_schema import UsageObservation
from lightning_accel.dash.usage_store import UsageStore
from lightning_accel.telemetry.idle_held import holding_processes, job_holder, processes_holder

__all__ = ["DEFAULT_MAX_GAP_S", "UsageFeed"]

DEFAULT_MAX_GAP_S = 60.0
"""Builds further apart than this are not one watch (the page builds every 2 s while it is open)."""


class UsageFeed:
    """Turns successive page builds into `UsageObservation`s for `store` (which never raises: it warns)."""

    def __init__(self, store: UsageStore, host: str, max_gap_s: float = DEFAULT_MAX_GAP_S, agent: bool = False) -> None:
        self.store, self.host, self.max_gap_s = store, host, max_gap_s
        self.agent = agent
        """Whether the host's agent feeds this (an accel-dash page leaves the record to a running agent)."""
        self._last: float | None = None
        self._energy: dict[tuple[str, str], float] = {}
        self._progress: dict[str, tuple[int, int]] = {}
        self._seen: set[str] = set()

    def observe(self, now: float, hosts: Iterable[Mapping[str, Any]], idle_held: Iterable[Mapping[str, Any]]) -> None:
        """Record the interval since the last call (a page's `hosts` and `idle_held`, `DashState.build`'s)."""
        interval = None if self._last is None else now - self._last
        self._last = now
        watched = interval is not None and 0 < interval <= self.max_gap_s
        idle = {(card["host"], card["uuid"], card["holder"]) for card in idle_held}
        observations: list[UsageObservation] = []
        self._seen = set()
        for host in hosts:
            if host["host"] != self.host:
                continue
            for job in host["jobs"]:
                self._seen.add(str(job.heartbeat["run_id"]))  # on the page (stale a while, too): its counters kept
                if job.status == "running":
                    observations.extend(self._job(job.heartbeat, interval if watched else None, idle))
            for card in host["cards"]:
                holding = holding_processes(card.get("processes"))
                if holding and watched and interval is not None:
                    holder = processes_holder(holding)
                    observations.append(
                        UsageObservation(
                            host=self.host,
                            user=", ".join(sorted({str(p["user"]) for p in holding})),
                            job=f"pid {holding[0]['pid']}",
                            gpu_index=int(card["index"]),
                            gpu_uuid=str(card["uuid"]),
                            interval_s=interval,
                            held_s=interval,
                            idle=(self.host, card["uuid"], holder) in idle,
                        )
                    )
        for run in [run for run in self._progress if run not in self._seen]:  # gone from the page: forget them
            del self._progress[run]
        for key in [key for key in self._energy if key[0] not in self._seen]:
            del self._energy[key]
        if observations:
            self.store.record(observations, now)

    def _job(
        self, beat: Mapping[str, Any], interval: float | None, idle: set[tuple[str, str, str]]
    ) -> list[UsageObservation]:
        run = str(beat["run_id"])
        samples, steps = int(beat["samples"]), int(beat["step"])
        before = self._progress.get(run)
        self._progress[run] = (samples, steps)
        gpus = beat["gpus"]
        energies = {}
        for gpu in gpus:
            key = (run, str(gpu["uuid"]))
            energy, previous = gpu.get("energy_j"), self._energy.get(key)
            if energy is not None:
                self._energy[key] = float(energy)
            energies[key] = 0.0 if energy is None or previous is None else max(0.0, float(energy) - previous)
        if interval is None or not gpus:
            return []
        new_samples, new_steps = (0, 0) if before is None else (max(0, samples - before[0]), max(0, steps - before[1]))
        # each node's heartbeat counts the samples of the whole job: this node takes its share, so that the hosts'
        # databases add up to the job's samples once (the steps are the job's on every node: readers take the most)
        nodes, node_rank = max(1, int(beat.get("num_nodes") or 1)), int(beat.get("node_rank") or 0)
        node_share, node_rest = divmod(new_samples, nodes)
        share, rest = divmod(node_share + (1 if node_rank < node_rest else 0), len(gpus))
        holder = job_holder(beat)
        return [
            UsageObservation(
                host=self.host,
                user=str(beat["user"]),
                job=run,
                gpu_index=int(gpu["index"]),
                gpu_uuid=str(gpu["uuid"]),
                interval_s=interval,
                held_s=interval,
                idle=(self.host, gpu["uuid"], holder) in idle,
                energy_j=energies[(run, str(gpu["uuid"]))],
                samples=share + (1 if i < rest else 0),
                steps=new_steps,
            )
            for i, gpu in enumerate(gpus)
        ]
