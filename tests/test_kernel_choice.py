"""Which prepacked kernel the exact backend runs ("auto"): measured once per machine by the lab
(``minispec.lab.calibrate``), saved, and read by every later process, so every process on the machine (and every
worker that timed it at the same moment) computes the same bits; without a saved choice, the documented default.
The runtime (``minispec.exact.kernels``) never times anything."""

import json

import pytest
import torch

from minispec.exact import kernels as kc
from minispec.exact.linear import ExactLinear
from minispec.lab import calibrate

CPU_KERNELS, onednn_available = kc.CPU_KERNELS, kc.onednn_available
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN linear: "
                                  "'auto' is the panels without timing (test_without_onednn_auto_is_the_panels)")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache and nothing read in this process yet; the lab's timer stubbed (it says "onednn" and counts
    its calls)."""
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kc, "_READ", {})
    calls = []

    def timed(**kw):
        calls.append(kw)
        return {"kernel": "onednn", "machine": kc.machine_tag(), "times_ms": {"panels": {"1": 2.0}, "onednn": {"1": 1.0}},
                "rows": [1]}

    monkeypatch.setattr(calibrate, "time_kernels", timed)
    return calls


def test_without_a_saved_choice_the_runtime_runs_the_default_and_times_nothing(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(ExactLinear, "cpu_kernel", "auto")
    layer = ExactLinear(8, 4)
    with torch.inference_mode():
        assert layer.kernel(torch.zeros(1, 8)) == kc.DEFAULT_KERNEL == kc.chosen_kernel() == "panels"
        assert layer._recipe(torch.zeros(1, 8))[2] == layer.row_recipe(torch.zeros(1, 8)).min_rows  # no pad beyond the recipe's
    assert kc.chosen_pad("panels") == kc.DEFAULT_PAD == 1 and not fresh  # nothing timed
    assert not list(tmp_path.iterdir())  # nothing written, not even a folder
    assert kc.describe().startswith("panels (the default: no calibration saved for this machine")


@needs_onednn
def test_the_lab_times_once_per_machine_and_later_processes_read_the_file(fresh, monkeypatch):
    assert calibrate.calibrate_kernels()["kernel"] == "onednn" and len(fresh) == 1
    path = kc.choice_path()
    assert path.exists() and json.loads(path.read_text())["kernel"] == "onednn"
    assert path.name.endswith(f"-{torch.get_num_threads()}t.json") and torch.__version__.replace("+", "_") in path.name
    assert calibrate.calibrate_kernels()["kernel"] == "onednn" and len(fresh) == 1  # saved: not timed again
    monkeypatch.setattr(kc, "_READ", {})  # a new process
    monkeypatch.setattr(calibrate, "time_kernels", lambda **kw: pytest.fail("timed again although the choice is saved"))
    monkeypatch.setattr(ExactLinear, "cpu_kernel", "auto")
    layer = ExactLinear(8, 4)
    with torch.inference_mode():
        assert layer.kernel(torch.zeros(1, 8)) == "onednn"  # the layer asks the profile, which reads the file


@needs_onednn
def test_force_times_again(fresh):
    calibrate.calibrate_kernels()
    calibrate.calibrate_kernels(force=True)
    assert len(fresh) == 2 and kc.read_choice(kc.choice_path())["kernel"] == "onednn"


@needs_onednn
def test_a_process_that_times_it_second_takes_the_first_ones_choice(fresh, monkeypatch):
    """Two processes time at once: the one whose file lands first decides for both."""
    def timed_while_another_wrote(**kw):
        kc.choice_path().parent.mkdir(parents=True, exist_ok=True)
        kc.choice_path().write_text(json.dumps({"kernel": "panels", "machine": "the other process"}))
        return {"kernel": "onednn"}

    monkeypatch.setattr(calibrate, "time_kernels", timed_while_another_wrote)
    assert calibrate.calibrate_kernels()["kernel"] == "panels"
    assert kc.chosen_kernel() == "panels"
    assert json.loads(kc.choice_path().read_text())["machine"] == "the other process"
    assert not list(kc.choice_path().parent.glob(".*.tmp"))  # no temporary file left behind


def test_an_unreadable_record_is_no_choice_and_an_unwritable_cache_keeps_this_process_choice(tmp_path):
    bad = tmp_path / "bad.json"
    for text in ("not json", json.dumps({"kernel": "mkl"}), json.dumps(["onednn"])):
        bad.write_text(text)
        assert kc.read_choice(bad) is None
    assert kc.read_choice(tmp_path / "missing.json") is None
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    record = {"kernel": "panels"}
    assert kc.write_once(blocked / "sub" / "choice.json", record) is record  # its parent cannot be made


def test_without_onednn_auto_is_the_panels(fresh, monkeypatch):
    monkeypatch.setattr(kc, "onednn_available", lambda: False)
    monkeypatch.setattr(calibrate, "onednn_available", lambda: False)
    assert calibrate.calibrate_kernels()["kernel"] == "panels" and not fresh  # nothing to choose between: nothing timed
    assert not kc.choice_path().exists()
    kc.choice_path().parent.mkdir(parents=True)
    kc.choice_path().write_text(json.dumps({"kernel": "onednn"}))  # a record this build cannot follow
    monkeypatch.setattr(kc, "_READ", {})
    assert kc.chosen_kernel() == "panels"


def test_the_timing_runs_each_kernel_under_its_own_row_recipe():
    """The real timing (the lab's), on small shapes: every kernel timed at every row count, its recipe named, and
    the faster sum chosen."""
    kernels = CPU_KERNELS if onednn_available() else ("panels",)
    with torch.inference_mode():  # where a calibration may run, as often as not
        r = calibrate.time_kernels(shapes=((64, 96), (96, 64)), layers=2, rows=(1, 3), rounds=1, kernels=kernels)
    assert set(r["times_ms"]) == set(kernels) and all(set(t) == {"1", "3"} for t in r["times_ms"].values())
    assert all(v > 0 for t in r["times_ms"].values() for v in t.values())
    assert r["kernel"] == min(kernels, key=lambda k: sum(r["times_ms"][k].values()))
    assert all(set(p) == {"64->96", "96->64"} for p in r["recipes"].values())
    assert r["machine"] == kc.machine_tag()


@needs_onednn
def test_describe_names_the_saved_choice_and_the_times(fresh):
    calibrate.calibrate_kernels()
    line = kc.describe()
    assert line.startswith("onednn (timed at 1 rows on this machine: panels 2.0 ms, onednn 1.0 ms;")


def test_a_choice_holds_for_the_huge_page_mode_it_was_timed_in(monkeypatch):
    """The panels stream faster from 2 MiB pages, so a choice timed where Linux gives none (THP "never", or no
    THP) is not read where it gives them, nor the other way round."""
    tags = {}
    for mode in ("madvise", "always", "never", None):
        monkeypatch.setattr(kc, "thp_mode", lambda mode=mode: mode)
        tags[mode] = kc.machine_tag()
    assert tags["madvise"] == tags["always"] != tags["never"] == tags[None]
    assert "-thp-" in tags["madvise"] and "-nothp-" in tags["never"]


def test_thp_mode_reads_the_bracketed_mode(tmp_path, monkeypatch):
    import builtins

    from minispec import config

    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(
        f if str(path) == "/sys/kernel/mm/transparent_hugepage/enabled" else path, *a, **k))
    assert config.thp_mode() == "madvise"
    f.write_text("[always] madvise never\n")
    assert config.thp_mode() == "always"
    f.unlink()
    assert config.thp_mode() is None


def test_the_timing_pads_one_row_calls_to_the_fastest_candidate():
    """``pad_rows`` is the fastest of the one-row paddings timed (candidates that pad no layer further than a
    smaller one are not timed twice), and the row counts are timed under it."""
    kernels = CPU_KERNELS if onednn_available() else ("panels",)
    with torch.inference_mode():
        r = calibrate.time_kernels(shapes=((64, 96), (96, 64)), layers=2, rows=(1, 3), rounds=1, kernels=kernels)
    assert set(r["pad_rows"]) == set(r["pad_ms"]) == set(kernels)
    for k in kernels:
        assert set(r["pad_ms"][k]) <= {str(c) for c in calibrate.PAD_CANDIDATES} and "1" in r["pad_ms"][k]
        assert r["pad_rows"][k] == int(min(r["pad_ms"][k], key=r["pad_ms"][k].get))


@pytest.mark.parametrize("pad", [1, 6])
def test_auto_pads_a_layers_short_calls_to_the_records_rows_and_keeps_their_bits(fresh, monkeypatch, pad):
    """Under "auto" a call of fewer rows than the saved record's ``pad_rows`` for the chosen kernel runs padded to it
    (never below its row recipe's own padding), and every row keeps the bits it has in a call of any other row count; a
    kernel named explicitly runs under its recipe alone. A record without ``pad_rows`` (timed before it existed) pads
    nothing."""
    chosen = "onednn" if onednn_available() else "panels"
    record = {"kernel": chosen, "machine": kc.machine_tag(), "times_ms": {chosen: {"1": 1.0}}, "rows": [1]}
    if pad > 1:
        record["pad_rows"] = {chosen: pad}
    kc.write_once(kc.choice_path(), record)
    monkeypatch.setattr(ExactLinear, "cpu_kernel", "auto")
    torch.manual_seed(0)
    layer = ExactLinear(64, 96)
    x = torch.randn(9, 64)
    with torch.inference_mode():
        own = layer.row_recipe(x[:1]).min_rows
        assert layer._recipe(x[:1])[0] == chosen and layer._recipe(x[:1])[2] == max(own, pad)
        full = layer(x)
        for m in range(1, 9):
            assert torch.equal(layer(x[:m]), full[:m]), m
        monkeypatch.setattr(ExactLinear, "cpu_kernel", chosen)
        assert layer._recipe(x[:1])[2] == own
    assert kc.chosen_pad("the other kernel") == 1
