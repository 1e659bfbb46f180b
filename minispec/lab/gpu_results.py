"""The GPU measurements committed to the repository, as chapters 8 and 9 read them.

A GPU is lent to some sessions, for minutes; what it measured lies in JSON files under
``benchmarks/results`` (``python -m minispec gpu-suite --out benchmarks/results/<name>`` writes one
folder per run: ``cuda_graphs.json``, ``llama_latency.json``, ``llama_speedup.json``,
``copy_bandwidth.json``, ...). The notebooks state nothing about a GPU that these files do not hold:
``runs(benchmark)`` finds every file of a benchmark recursively, whichever exist when it is called (a
later GPU run adds a folder), keeps those whose device names a GPU (not a CPU, not a ``--smoke`` run,
not a section that raised), and ``rows(benchmark)`` flattens their measurements into one list of dicts,
each tagged with the GPU and the file it came from. The arithmetic set against the chapters' models
stays in the notebooks, where a reader sees it.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _gpu(doc: dict) -> str | None:
    """The GPU a result file names (its ``device`` string or ``device_info.gpu``), else None."""
    info = doc.get("device_info") if isinstance(doc.get("device_info"), dict) else {}
    dev = doc.get("device")
    if isinstance(dev, dict):
        return dev.get("gpu")
    if isinstance(dev, str) and dev and not dev.lower().startswith("cpu"):
        return dev
    return info.get("gpu")


def runs(benchmark: str, root: Path | str = RESULTS) -> list[dict]:
    """Every committed GPU result of ``benchmark``, found recursively under ``root``, oldest first.

    Returns:
        [dict(path, gpu, date, doc, copy_bandwidth)]: ``path`` relative to the repository, ``doc`` the file's
        JSON, ``copy_bandwidth`` the bytes/s the same run measured (its ``settings``, or the folder's
        ``copy_bandwidth.json``), None when it measured none. Files that are smoke runs, name no GPU or
        hold an ``error`` (a section that raised) are left out.
    """
    root = Path(root)
    out = []
    for f in sorted(root.rglob("*.json")) if root.exists() else []:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("benchmark") != benchmark or doc.get("smoke") or doc.get("error"):
            continue
        gpu = _gpu(doc)
        if not gpu:
            continue
        bw = (doc.get("settings") or {}).get("copy_bandwidth_GBps") or doc.get("copy_bandwidth_GBps")
        sibling = f.parent / "copy_bandwidth.json"
        if bw is None and sibling.exists():
            bw = json.loads(sibling.read_text()).get("copy_bandwidth_GBps")
        out.append(dict(path=str(f.relative_to(root.parents[1])), gpu=gpu, date=str(doc.get("date", ""))[:10], doc=doc,
                        copy_bandwidth=None if bw is None else bw * 1e9))
    return sorted(out, key=lambda r: (r["date"], r["path"]))


def rows(benchmark: str, root: Path | str = RESULTS) -> list[dict]:
    """The measurement rows (``doc["rows"]``) of every GPU run of ``benchmark``, each with ``gpu``, ``path`` and the
    run's ``copy_bandwidth`` (bytes/s) added."""
    return [dict(row, gpu=r["gpu"], path=r["path"], copy_bandwidth=r["copy_bandwidth"])
            for r in runs(benchmark, root) for row in r["doc"].get("rows", [])]


def model_config(name: str):
    """The ModelConfig of a result row's model ("llama-3.1-8b-shaped" or "llama-3.1-8b")."""
    from .scale import llama_config

    return llama_config(name.removesuffix("-shaped"))
