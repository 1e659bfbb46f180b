"""The decode loop's clock (``minispec.clock``): on a device whose work completes after its launch returns,
each phase gets the device time of the work it launched, not the host's time to launch it."""

import pytest
import torch

from minispec.clock import EventClock, HostClock, phase_clock
from minispec.generate import GenerationStats


class FakeDevice:
    """A device with its own timeline (seconds). Work launched from the host queues behind earlier work and
    finishes later; the host waits only when it synchronises. An event's time is when the device reaches it,
    which the host can read only once its own clock has passed it (as ``cudaEventElapsedTime`` refuses an
    event that has not completed)."""

    def __init__(self):
        self.host = 0.0  # the host's clock
        self.free_at = 0.0  # when the device has done everything launched so far

    def now(self) -> float:
        return self.host

    def launch(self, device_s: float, host_s: float) -> None:
        """Launch work that runs ``device_s`` on the device; launching takes the host ``host_s``."""
        self.free_at = max(self.free_at, self.host) + device_s
        self.host += host_s

    def host_work(self, s: float) -> None:
        self.host += s

    def sync(self) -> None:  # e.g. ``.item()`` on a result: the host waits for the device
        self.host = max(self.host, self.free_at)

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, dev: FakeDevice):
        self.dev, self.at = dev, None

    def record(self) -> None:
        self.at = max(self.dev.host, self.dev.free_at)  # reached after the work launched before it

    def query(self) -> bool:
        return self.at is not None and self.dev.host >= self.at

    def synchronize(self) -> None:
        self.dev.host = max(self.dev.host, self.at)

    def elapsed_time(self, later: "FakeEvent") -> float:
        if not (self.query() and later.query()):
            raise RuntimeError("event not completed: its time is not known yet")
        return (later.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event


def _one_step(dev: FakeDevice, clock) -> None:
    """Draft: 2 ms on the device, launched in 0.5 ms. Target forward: 10 ms, launched in 1 ms. Verify: reads the
    logits (waits for the device), then 0.3 ms of host work. Commit: 0.1 ms on the host."""
    dev.launch(0.002, 0.0005)
    clock.lap("draft")
    dev.launch(0.010, 0.001)
    clock.lap("target")
    dev.sync()
    dev.host_work(0.0003)
    clock.lap("verify")
    dev.host_work(0.0001)
    clock.lap("commit")


def test_on_a_late_device_each_phase_gets_the_work_it_launched():
    dev = FakeDevice()
    stats = GenerationStats()
    clock = EventClock(stats, now=dev.now, new_event=dev.event)
    clock.start()
    _one_step(dev, clock)
    clock.flush()
    want = dict(draft=0.002, target=0.010, verify=0.0003, commit=0.0001)
    assert {k: pytest.approx(v) for k, v in want.items()} == {k: stats.phase_s[k] for k in want}
    assert stats.decode_s == pytest.approx(0.0124) == pytest.approx(sum(stats.phase_s.values()))


def test_the_host_clock_on_such_a_device_gives_the_forward_to_verify():
    """What the loop did before events (and still does on the CPU, where work is done when its call returns): the
    forward's 10 ms land in verify, the phase that first waits; a 6-row chain looked cheaper than vanilla so."""
    dev = FakeDevice()
    stats = GenerationStats()
    clock = HostClock(stats, now=dev.now)
    clock.start()
    _one_step(dev, clock)
    assert stats.phase_s["target"] == pytest.approx(0.001) and stats.phase_s["verify"] == pytest.approx(0.0108)


def test_events_are_read_only_once_the_device_has_passed_them():
    """A lap never waits for the device: phases whose events are pending stay unsettled until a later lap finds
    them done or ``flush`` waits (FakeEvent.elapsed_time raises on an event not yet reached)."""
    dev = FakeDevice()
    stats = GenerationStats()
    clock = EventClock(stats, now=dev.now, new_event=dev.event)
    clock.start()
    dev.launch(0.010, 0.001)
    clock.lap("target")
    assert stats.phase_s["target"] == 0.0 and len(clock.pending) == 1 and dev.host == pytest.approx(0.001)
    dev.sync()
    clock.lap("verify")
    assert stats.phase_s["target"] == pytest.approx(0.010) and not clock.pending  # both passed: settled, no wait
    dev.launch(0.005, 0.001)
    clock.lap("hand_off")
    clock.start()  # a new step's start (BatchDecoder): the time before it belongs to no phase
    dev.host_work(0.006)  # the device finishes hand_off's work 4 ms into it, then waits 2 ms
    clock.lap("draft")
    clock.flush()
    assert stats.phase_s["hand_off"] == pytest.approx(0.005) and stats.phase_s["draft"] == pytest.approx(0.002)
    assert stats.decode_s == pytest.approx(0.017) == pytest.approx(sum(stats.phase_s.values()))
    dev.launch(0.004, 0.001)
    clock.lap("commit")
    clock.flush()  # the host waits 3 ms for the device: decode time, and the commit's
    assert stats.phase_s["commit"] == pytest.approx(0.004) and stats.decode_s == pytest.approx(0.021)


def test_the_decoder_routes_every_lap_through_its_clock(monkeypatch):
    """``Decoder`` (and ``generate``) start, lap and flush the clock ``phase_clock`` gives: with an event clock
    whose device is the host itself, every phase is counted and the phases add up to the decode time. The clock
    and the events read one counter that ticks a microsecond a reading, not the wall clock: an event is recorded
    one tick after its lap, whatever else runs on the machine."""
    import importlib
    import itertools

    from minispec import generate, load
    from minispec.drafters import PromptLookup

    ticks = itertools.count()

    def now():
        return next(ticks) * 1e-6

    class HostEvent:  # work is done when the call returns (the CPU), but the clock learns it only at the flush
        def record(self):
            self.at = now()

        def query(self):
            return False

        def synchronize(self):
            pass

        def elapsed_time(self, later):
            return (later.at - self.at) * 1e3

    made = []

    def clock(owner, device):
        made.append(EventClock(owner, now=now, new_event=HostEvent))
        return made[-1]

    monkeypatch.setattr(importlib.import_module("minispec.generate"), "phase_clock", clock)
    model, tok = load("tiny-llama")
    s = generate(model, tok, "abcabcabcabc", drafter=PromptLookup(k=4), max_new_tokens=16, chat=False).stats
    assert len(made) == 1 and not made[0].pending
    assert all(s.phase_s[p] > 0 for p in ("draft", "target", "verify", "commit", "hand_off"))
    assert sum(s.phase_s.values()) == pytest.approx(s.decode_s, rel=1e-3, abs=1e-5)


def test_the_clock_follows_the_device():
    stats = GenerationStats()
    assert type(phase_clock(stats, "cpu")) is HostClock and type(phase_clock(stats, torch.device("meta"))) is HostClock


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_phases_sum_to_the_decode_time(graphs):
    """On a GPU the loop times phases with CUDA events: they add up to the host's decode time (waits included)."""
    from minispec import generate, load
    from minispec.drafters import DraftModel

    model, tok = load("tiny-llama", device="cuda")
    for drafter in (None, DraftModel(load("tiny-llama", device="cuda")[0], k=3)):
        r = generate(model, tok, "The phases of a step", drafter=drafter, max_new_tokens=48, chat=False,
                     stop_at_eos=False, cuda_graphs=graphs)
        s = r.stats
        assert s.phase_s["target"] > 0 and s.decode_s > 0
        assert sum(s.phase_s.values()) == pytest.approx(s.decode_s, rel=0.05, abs=2e-3)
