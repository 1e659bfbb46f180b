"""``python -m minispec gpu-suite --smoke``: every JSON written, honest about the device (CPU, smoke)."""

import json
import time

import pytest
import torch

from minispec.cli import main
from minispec.drafters.oracle import expected_tau

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
    from minispec.attention_grid import coarse_first, run_grid

    assert coarse_first([1, 2, 3], [10, 20])[:4] == [(1, 10), (1, 20), (3, 10), (3, 20)]  # corners first
    r = run_grid("cpu", torch.float32, [1, 2], [16], [4], heads=(2, 1, 8), reps=1, deadline=time.perf_counter() - 1,
                 bandwidth=1.0)
    assert r["results"] == [] and r["skipped"] == [dict(batch=1, ctx=16, tree=4), dict(batch=2, ctx=16, tree=4)]


def test_unknown_section_and_missing_gpu_are_errors(tmp_path, capsys):
    assert main(["gpu-suite", "--smoke", "--out", str(tmp_path), "--only", "nope"]) == 2
    if not torch.cuda.is_available():
        assert main(["gpu-suite", "--out", str(tmp_path)]) == 2
        assert "--smoke" in capsys.readouterr().err
