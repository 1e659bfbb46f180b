"""minispec.lab.gpu_results: the committed GPU runs that chapters 8-9 read, found recursively; CPU, smoke and
failed runs left out."""

import json

from minispec.lab import gpu_results


def _write(path, **doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def test_runs_are_found_recursively_and_only_gpu_runs_count(tmp_path):
    root = tmp_path / "benchmarks" / "results"
    rows = [dict(batch=1, step_s=0.01)]
    _write(root / "gpu-a" / "llama_latency.json", benchmark="llama_latency", device="NVIDIA X", date="2026-01-02T00:00",
           settings=dict(copy_bandwidth_GBps=2000.0), rows=rows)
    _write(root / "deeper" / "gpu-b" / "llama_latency.json", benchmark="llama_latency", device={"gpu": "NVIDIA Y"},
           date="2026-01-01", rows=rows + rows)
    _write(root / "deeper" / "gpu-b" / "copy_bandwidth.json", benchmark="copy_bandwidth", device="NVIDIA Y",
           copy_bandwidth_GBps=3000.0)
    _write(root / "cpu" / "llama_latency.json", benchmark="llama_latency", device="cpu: some CPU", rows=rows)
    _write(root / "smoke" / "llama_latency.json", benchmark="llama_latency", device="NVIDIA Z", smoke=True, rows=rows)
    _write(root / "failed" / "llama_latency.json", benchmark="llama_latency", device="NVIDIA Z", error="Traceback")
    _write(root / "other.json", benchmark="cuda_graphs", device="NVIDIA X", rows=rows)
    (root / "broken.json").write_text("{not json")

    runs = gpu_results.runs("llama_latency", root)
    assert [r["gpu"] for r in runs] == ["NVIDIA Y", "NVIDIA X"]  # oldest first; CPU, smoke and failed runs left out
    assert runs[0]["path"] == "benchmarks/results/deeper/gpu-b/llama_latency.json"
    assert [r["copy_bandwidth"] for r in runs] == [3000e9, 2000e9]  # the folder's copy_bandwidth.json, or settings
    got = gpu_results.rows("llama_latency", root)
    assert len(got) == 3 and {r["gpu"] for r in got} == {"NVIDIA X", "NVIDIA Y"}
    assert all(r["batch"] == 1 and r["path"].endswith("llama_latency.json") for r in got)
    assert gpu_results.runs("llama_latency", tmp_path / "missing") == []


def test_the_committed_runs_are_read():
    """The repository's own GPU runs: chapters 8-9 read them (the H100 and H200 folders under benchmarks/results)."""
    graphs = gpu_results.runs("cuda_graphs")
    assert graphs and all(r["copy_bandwidth"] and r["gpu"].startswith("NVIDIA") for r in graphs)
    assert {r["model"] for r in gpu_results.rows("cuda_graphs")} >= {"llama-3.1-8b-shaped", "llama-3.2-1b-shaped"}
    assert gpu_results.model_config("llama-3.1-8b-shaped").n_layer == 32
