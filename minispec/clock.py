"""The decode loop's clock: where a step's time goes, phase by phase (``GenerationStats.phase_s``).

A decode step is a sequence of phases (draft, target forward, verification, KV commit, ...), and the
loop calls ``clock.lap(phase)`` at the end of each: the time since the last lap goes to that phase.

On the CPU the host's clock is the work's clock: a phase's Python returns when its arithmetic is
done, so ``perf_counter`` laps split the step (``HostClock``; nothing else is done, nothing costs
more). On a GPU a phase's Python returns as soon as its kernels are *launched*; they run later,
and a host clock hands their time to whichever later phase first waits for the GPU (a ``.item()``,
a copy to the host). That is how a 6-row chain's verify forward could look cheaper than vanilla's
one-row forward (docs/gpu.md). So on CUDA each lap also records a CUDA event on the current stream
(``EventClock``): the event completes when the GPU has done the work launched before it, and the
time between two events is the GPU timeline's share of that phase: its kernels' time, or the host's
while the GPU waits for launches. Events are read once complete, never forcing a wait: at a later
lap if the GPU has passed them, at ``flush`` (end of the generation) with one synchronisation.

``decode_s`` stays the host's wall time (what a user waits for); on a GPU ``flush`` adds the wait
for the last launched work. The phases then sum to it up to the latency of recording an event
(tests/test_generate.py's GPU test checks this on a GPU).

Reference: NVIDIA, "CUDA C++ Best Practices Guide", section "Using CUDA GPU Timers" (events, not
host timers, time asynchronous work).
"""

from __future__ import annotations

import time
from typing import Callable

import torch


class HostClock:
    """Phases timed by the host's clock (the CPU: work is done when its call returns).

    Args:
        owner: what the laps add to: an object with ``phase_s`` {phase: seconds} and ``decode_s``.
        now: the host's clock in seconds (``time.perf_counter``; a test passes a fake).
    """

    def __init__(self, owner, now: Callable[[], float] = time.perf_counter):
        self.owner, self.now = owner, now
        self.t = now()

    def start(self) -> None:
        """The next lap counts from now (the time before it belongs to no phase)."""
        self.t = self.now()

    def lap(self, phase: str) -> None:
        """The time since the last lap (or ``start``) goes to ``phase`` and to ``decode_s``."""
        t = self.now()
        self.owner.phase_s[phase] = self.owner.phase_s.get(phase, 0.0) + (t - self.t)
        self.owner.decode_s += t - self.t
        self.t = t

    def flush(self) -> None:
        """Nothing is pending on the host clock."""


class EventClock(HostClock):
    """Phases timed by events on the device's stream; ``decode_s`` by the host (see the module doc).

    Args:
        owner, now: as ``HostClock``.
        new_event: makes an event with ``record()``, ``query()`` (True once the device has passed it),
            ``synchronize()`` (wait until it has) and ``elapsed_time(later)`` in milliseconds; default
            ``torch.cuda.Event(enable_timing=True)``. A test passes a fake device's.
    """

    def __init__(self, owner, now: Callable[[], float] = time.perf_counter, new_event: Callable | None = None):
        super().__init__(owner, now)
        self.new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.last = None  # the settled event the next phase counts from
        self.pending: list[tuple[str | None, object]] = []  # (phase, or None for a start; its event), oldest first

    def _record(self, phase: str | None) -> None:
        ev = self.new_event()
        ev.record()
        self.pending.append((phase, ev))

    def start(self) -> None:
        super().start()
        self._record(None)
        self._settle(wait=False)

    def lap(self, phase: str) -> None:
        t = self.now()
        self.owner.decode_s += t - self.t
        self.t = t
        self._record(phase)
        self._settle(wait=False)

    def flush(self) -> None:
        """Wait for the last recorded event, give every pending phase its time, and add the wait for the
        device's last work to ``decode_s``."""
        if not self.pending:
            return
        self.pending[-1][1].synchronize()
        t = self.now()
        self.owner.decode_s += t - self.t
        self.t = t
        self._settle(wait=True)

    def _settle(self, wait: bool) -> None:
        """Pending events the device has passed (all of them with ``wait``), oldest first, into their phases."""
        while self.pending:
            phase, ev = self.pending[0]
            if not wait and not ev.query():
                return
            if phase is not None and self.last is not None:
                self.owner.phase_s[phase] = self.owner.phase_s.get(phase, 0.0) + self.last.elapsed_time(ev) / 1e3
            self.last = ev
            self.pending.pop(0)


def phase_clock(owner, device) -> HostClock:
    """The clock of a decode loop on ``device``: ``EventClock`` on CUDA, ``HostClock`` elsewhere."""
    return EventClock(owner) if torch.device(device).type == "cuda" else HostClock(owner)
