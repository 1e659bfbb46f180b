"""``python -m minispec gpu-suite --smoke``: every JSON written, honest about the device (CPU, smoke)."""

import json
import time

import pytest
import torch

from minispec.cli import main
from minispec.lab.oracle import expected_tau

FILES = ("gpu_tests", "copy_bandwidth", "attention_grid", "cuda_graphs", "llama_latency", "llama_speedup", "suite")
GPU_WORDS = ("nvidia", "cuda", "gpu", "h100", "h200", "a100")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of the whole suite (tiny shapes, CPU), shared by the checks below."""
    if torch.cuda.is_available():
        pytest.skip("the smoke run's CPU-only claims are checked on a machine without CUDA")
    out = tmp_path_factory.mktemp("suite")
    n = torch.get_num_threads()
    try:
        rc = main(["gpu-suite", "--smoke", "--out", str(out), "--threads", "1"])
    finally:
        torch.set_num_threads(n)
    return rc, {name: json.loads((out / f"{name}.json").read_text()) for name in FILES if (out / f"{name}.json").exists()}


def test_smoke_writes_every_file_with_the_required_fields(smoke):
    rc, docs = smoke
    assert rc == 0
    assert set(docs) == set(FILES)
    for name, d in docs.items():
        assert d["benchmark"] == name
        assert d["smoke"] is True
        assert d["device"].startswith("cpu")  # names the CPU ...
        assert not any(w in d["device"].lower() for w in GPU_WORDS)  # ... and never claims a GPU
        assert d["device_info"]["cuda"] is False and "gpu" not in d["device_info"]
        assert {"torch", "python", "minispec"} <= set(d["versions"])
        assert "settings" in d
        assert "error" not in d and not d.get("errors"), d.get("error") or d.get("errors")
    assert all(s["status"] == "ok" for s in docs["suite"]["sections"].values())


def test_smoke_measurements_are_complete_and_consistent(smoke):
    _, docs = smoke
    assert docs["copy_bandwidth"]["copy_bandwidth_GBps"] > 0
    grid = docs["attention_grid"]
    assert len(grid["results"]) == 4 and not grid["skipped"]  # batch [1, 2] x ctx [32] x tree [4, 8]
    for row in grid["results"]:
        assert {"dense", "split_torch", "causal"} <= set(row["median_s"])
        assert all(err < 1e-4 for err in row["max_abs_err_vs_dense"].values())
    graphs = docs["cuda_graphs"]
    assert {r["role"] for r in graphs["rows"]} == {"draft", "target"}
    assert not any(r["graphs_used"] for r in graphs["rows"])  # no CUDA: the eager fallback ran, and says so
    assert graphs["replay_equals_eager_tokens"] is True
    lat = docs["llama_latency"]
    p = lat["settings"]["p_corrupt"]
    assert {(r["method"], r["mode"]) for r in lat["rows"]} == {
        (m, mode) for m in ("vanilla", "chain", "eagle2") for mode in lat["settings"]["modes"]}
    for r in lat["rows"]:
        assert r["tau_expected"] == pytest.approx(expected_tau(p, r["depth"]))
        assert r["per_token_s"] == pytest.approx(r["step_s"] / r["tau_expected"])
        assert r["floor_step_s"] > 0 and r["graphs_used"] is False
    speed = docs["llama_speedup"]
    assert speed["identical_all"] is True  # oracle output == vanilla
    assert speed["methods"]["vanilla"]["measured_speedup"] == 1.0
    tests = docs["gpu_tests"]
    assert tests["counts"].get("skipped", 0) > 0 and not tests["counts"].get("failed")  # skipped without CUDA
    assert "test_cuda_graphs.py" in tests["settings"]["files"]


def test_budget_skips_sections_and_records_them(tmp_path):
    rc = main(["gpu-suite", "--smoke", "--out", str(tmp_path), "--budget-s", "0", "--only",
               "copy_bandwidth,attention_grid", "--threads", "1"])
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert rc == 0
    assert {k: v["status"] for k, v in suite["sections"].items()} == {"copy_bandwidth": "skipped",
                                                                      "attention_grid": "skipped"}
    assert not (tmp_path / "attention_grid.json").exists()


def test_grid_deadline_lists_what_it_skipped():
    from minispec.lab.attention_grid import coarse_first, run_grid

    assert coarse_first([1, 2, 3], [10, 20])[:4] == [(1, 10), (1, 20), (3, 10), (3, 20)]  # corners first
    r = run_grid("cpu", torch.float32, [1, 2], [16], [4], heads=(2, 1, 8), reps=1, deadline=time.perf_counter() - 1,
                 bandwidth=1.0)
    assert r["results"] == [] and r["skipped"] == [dict(batch=1, ctx=16, tree=4), dict(batch=2, ctx=16, tree=4)]


def test_unknown_section_and_missing_gpu_are_errors(tmp_path, capsys):
    assert main(["gpu-suite", "--smoke", "--out", str(tmp_path), "--only", "nope"]) == 2
    if not torch.cuda.is_available():
        assert main(["gpu-suite", "--out", str(tmp_path)]) == 2
        assert "--smoke" in capsys.readouterr().err


# --------------------------------------------------------------------------- the GPU tests' prerequisites and budget
def test_missing_prerequisites_names_each_one(monkeypatch):
    import importlib.util

    from minispec.lab import gpu_suite

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(gpu_suite.shutil, "which", lambda name: None)  # no cc, gcc or clang on PATH
    monkeypatch.setattr(gpu_suite.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytest" else real_find_spec(name, *a))
    monkeypatch.setattr(gpu_suite.torch.cuda, "is_available", lambda: False)
    missing = gpu_suite.missing_prerequisites(cuda=True)
    assert len(missing) == 3
    assert missing[0].startswith("pytest") and "dev" in missing[0]
    assert "C compiler" in missing[1] and "CUDA" in missing[2]
    assert gpu_suite.missing_prerequisites(cuda=False) == missing[:1]  # smoke: only pytest is needed
    monkeypatch.setattr(gpu_suite.shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    monkeypatch.setattr(gpu_suite.importlib.util, "find_spec", real_find_spec)
    monkeypatch.setattr(gpu_suite.torch.cuda, "is_available", lambda: True)
    assert gpu_suite.missing_prerequisites(cuda=True) == []


def test_gpu_tests_section_records_what_is_missing_instead_of_running(tmp_path, monkeypatch):
    from minispec.lab import gpu_suite

    monkeypatch.setattr(gpu_suite, "missing_prerequisites", lambda cuda=True: ["pytest: install the dev extra"])
    real_run = gpu_suite.subprocess.run

    def run(cmd, *a, **k):
        assert "pytest" not in cmd, "pytest must not be started"
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(gpu_suite.subprocess, "run", run)
    rc = gpu_suite.Suite(tmp_path, smoke=True, budget_s=60, tests_s=5).run(["gpu_tests"])
    doc = json.loads((tmp_path / "gpu_tests.json").read_text())
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert rc == 0 and doc["missing"] == ["pytest: install the dev extra"] and doc["settings"]["timeout_s"] == 5
    assert suite["sections"]["gpu_tests"]["status"] == "skipped" and "pytest" in suite["sections"]["gpu_tests"]["why"]


def test_gpu_tests_json_records_the_failed_tests_and_an_error(tmp_path, monkeypatch):
    """A pytest run with failures: gpu_tests.json names them under ``failures`` and the section is an error."""
    import subprocess

    from minispec.lab import gpu_suite

    monkeypatch.setattr(gpu_suite, "missing_prerequisites", lambda cuda=True: [])
    out = "\n".join(["F.", "E       RuntimeError: no storage", "FAILED tests/test_t.py::test_gpu - RuntimeError",
                     "1 failed, 1 passed in 3.0s"])
    monkeypatch.setattr(gpu_suite.subprocess, "run",
                        lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, 1, stdout=out, stderr=""))
    rc = gpu_suite.Suite(tmp_path, smoke=True, budget_s=60, tests_s=5).run(["gpu_tests"])
    doc = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert rc == 1 and doc["counts"] == {"failed": 1, "passed": 1} and doc["returncode"] == 1
    assert doc["failures"] == ["E       RuntimeError: no storage", "FAILED tests/test_t.py::test_gpu - RuntimeError"]
    assert doc["errors"] == ["pytest returned 1: {'failed': 1, 'passed': 1}"]


def test_measurements_share_the_time_the_gpu_tests_left(tmp_path):
    from minispec.lab.gpu_suite import DEADLINES, Suite

    s = Suite(tmp_path, smoke=True, budget_s=500, tests_s=150)
    assert s.deadline("gpu_tests") == pytest.approx(time.perf_counter() + 150, abs=5)  # its own seconds
    s.t0, s.t_measure = 1000.0, 1120.0  # the tests took 120 s of the 500
    assert s.deadline("attention_grid") == pytest.approx(1120 + DEADLINES["attention_grid"] * 380)
    assert s.deadline("llama_speedup") < s.t0 + s.budget_s


def test_smoke_gpu_tests_ran_with_their_own_budget(smoke):
    _, docs = smoke
    tests = docs["gpu_tests"]
    assert tests["missing"] == [] and tests["settings"]["timeout_s"] == docs["suite"]["tests_s"] > 0


# --------------------------------------------------------------------------- the attention grid: timing, failures
def test_timed_flushes_then_calls_the_function_the_requested_times():
    from minispec.lab.attention_grid import flush_buffer, timed

    flush = torch.zeros(64)
    calls = []

    def fn():
        calls.append(bool((flush == 1).all()))  # the flush was written before the first call

    t = timed(fn, torch.device("cpu"), calls=5, flush=flush)
    assert calls == [True] * 5 and t >= 0
    assert flush_buffer(torch.device("cpu")).numel() * 4 == 1 << 20  # a token buffer on the CPU


def test_grid_keeps_every_row_when_a_method_or_a_shape_fails(monkeypatch):
    """A method raising at one shape (the dense reference, here) drops that method from the row; a
    shape raising (out of memory, say) becomes a row with its error; all other rows are kept."""
    from minispec.lab import attention_grid as ag

    real_dense, real_shape = ag.dense_attention, ag.run_shape

    def dense(q, k, v, mask):
        if q.shape[0] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_dense(q, k, v, mask)

    def run_shape(B, H, Hkv, hd, P, T, *a, **kw):
        if B == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_shape(B, H, Hkv, hd, P, T, *a, **kw)

    monkeypatch.setattr(ag, "dense_attention", dense)
    monkeypatch.setattr(ag, "run_shape", run_shape)
    seen = []
    r = ag.run_grid("cpu", torch.float32, [1, 2, 3, 4], [16], [4], heads=(2, 1, 8), reps=1, bandwidth=1.0,
                    on_row=seen.append)
    rows = {row["batch"]: row for row in r["results"]}
    assert sorted(rows) == [1, 2, 3, 4] and [row["batch"] for row in seen] == [1, 2, 4]
    assert "OutOfMemoryError" in rows[3]["error"] and "median_s" not in rows[3]
    assert "dense" not in rows[2]["median_s"] and "OutOfMemoryError" in rows[2]["failed"]["dense"]
    assert {"split_torch", "causal"} <= set(rows[2]["median_s"])
    for b in (1, 4):
        assert "error" not in rows[b] and not rows[b]["failed"] and "dense" in rows[b]["median_s"]
        assert rows[b]["sdpa_backend"] == dict(dense="cpu", causal="cpu") and rows[b]["calls_per_timing"] == 1
    assert any("1 shapes failed" in n for n in r["notes"])


def test_the_gpu_tests_section_keeps_what_failed_and_why_past_a_warnings_summary():
    """An H200 run (2026-11-28) recorded 4 failed GPU tests whose 4000-character output tail was all warnings
    summary: the section keeps the FAILED / ERROR lines and the traceback's E lines on their own."""
    from minispec.lab.gpu_suite import failure_lines

    out = "\n".join(["..F.", "    def test_x():", ">       assert 1 == 2", "E       assert 1 == 2",
                     "=== warnings summary ===", *["  UserWarning: noise"] * 500,
                     "FAILED tests/test_a.py::test_x - assert 1 == 2", "ERROR tests/test_b.py::test_y", "1 failed"])
    assert failure_lines(out) == ["E       assert 1 == 2", "FAILED tests/test_a.py::test_x - assert 1 == 2",
                                  "ERROR tests/test_b.py::test_y"]
    assert failure_lines(out, limit=1) == ["E       assert 1 == 2"]
    assert failure_lines("5 passed") == []


def test_a_timed_out_command_keeps_its_stderr():
    """The GPU tests' run killed at its time limit: what it printed on stderr (a traceback, the stacks of a hang)
    is kept beside its stdout, and the return code says "timeout"."""
    import sys

    from minispec.lab.gpu_suite import run_captured

    code = ("import sys, time; print('on stdout', flush=True); sys.stderr.write('Traceback: on stderr\\n'); "
            "sys.stderr.flush(); time.sleep(60)")
    out, rc = run_captured([sys.executable, "-c", code], timeout=3)
    assert rc == "timeout" and "on stdout" in out and "Traceback: on stderr" in out and "killed after 3 s" in out
    out, rc = run_captured([sys.executable, "-c", "import sys; sys.stderr.write('warn\\n'); print('done')"], timeout=60)
    assert rc == 0 and out == "done\nwarn\n"


def test_a_result_file_on_a_gpu_host_times_no_cpu_kernel(monkeypatch, tmp_path):
    """``device_info`` (written into every result file) names the CPU linear kernel "auto" uses from this machine's
    saved choice, or the documented default without one, on a GPU host as on a CPU host: it never times a kernel
    (timing is ``python -m minispec calibrate``'s work, ``minispec.lab.calibrate``)."""
    from minispec.exact import kernels
    from minispec.exact.linear import ExactLinear
    from minispec.lab import benchinfo, calibrate

    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ExactLinear, "prepack", True)
    monkeypatch.setattr(ExactLinear, "cpu_kernel", "auto")
    monkeypatch.setattr(calibrate, "time_kernels", lambda **kw: pytest.fail("a result file timed the CPU kernels"))
    monkeypatch.setattr(kernels, "_READ", {})  # this process's reads so far were of another cache folder
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Test GPU")
    info = benchinfo.device_info()
    assert info["gpu"] == "NVIDIA Test GPU" and info["linear_kernel"] == f"auto: {kernels.DEFAULT_KERNEL}"
    if not kernels.onednn_available():  # this torch build has one kernel: the record cannot name another
        return
    kernels.write_once(kernels.choice_path(), {"kernel": "onednn", "machine": kernels.machine_tag()})
    kernels._READ.clear()  # read again, as a new process would
    assert benchinfo.device_info()["linear_kernel"] == "auto: onednn"  # the record, read
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert benchinfo.device_info()["linear_kernel"] == "auto: onednn"  # a CPU host reads it the same way
