"""``tools/gpu_check.sh --dry-run``: the device script's every section on the CPU at tiny shapes (the SmolLM2 wheel
split and joined here), and the carry of the wheel in parts (``minispec.lab.carry``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minispec.lab import carry

ROOT = Path(__file__).resolve().parent.parent
GPU_WORDS = ("nvidia", "cuda", "gpu", "h100", "h200", "a100")
CALL1 = ("keep", "graphs", "latency", "attention", "split", "speedup", "gpu_check_call1")
CALL2 = ("carry", "smollm2", "drafting", "gpu_tests", "gpu_check_call2")


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """One dry run of the whole script, shared by the checks below."""
    if torch.cuda.is_available():
        pytest.skip("the dry run's CPU-only claims are checked on a machine without CUDA")
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    docs = {c: {f.stem: json.loads(f.read_text()) for f in (out / c).glob("*.json")} for c in ("call1", "call2")}
    return p, out, docs


def test_the_dry_run_writes_every_section_and_names_the_cpu(dry):
    p, out, docs = dry
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert set(docs["call1"]) == set(CALL1) and set(docs["call2"]) == set(CALL2)
    for call in ("call1", "call2"):
        files = [f for f in (out / call).iterdir() if f.is_file()]
        assert len(files) <= 8  # a device call brings back at most 8 files
        assert (out / call / f"gpu_check_{call}.log").exists()
        for name, d in docs[call].items():
            assert d["benchmark"] == name and d["dry_run"] is True and d["device"].startswith("cpu")
            assert not any(w in d["device"].lower() for w in GPU_WORDS)
            assert "error" not in d and not d.get("errors"), (name, d.get("error") or d.get("errors"))
        index = docs[call][f"gpu_check_{call}"]["sections"]
        assert all(s["status"] == "ok" for s in index.values()), index


def test_the_wheel_went_through_in_two_parts_and_came_back_whole(dry):
    _, _, docs = dry
    keep, joined = docs["call1"]["keep"], docs["call2"]["carry"]["joined"]
    assert [p["intact"] for p in keep["parts"]] == [True, True] and joined["parts"] == 2
    cached = next((Path(os.environ.get("MINISPEC_CACHE") or Path.home() / ".cache" / "minispec") / "wheels")
                  .glob(carry.WHEEL_GLOB), None)
    if cached is not None:  # the real SmolLM2 wheel was split and joined
        assert joined["sha256"] == carry.sha256(cached) and joined["size"] == cached.stat().st_size


def test_the_dry_bench_runs_every_configuration_and_keeps_greedy_identity(dry):
    _, _, docs = dry
    b = docs["call2"]["smollm2"]
    n = sum(b["settings"]["prompt_sets"].values())
    assert set(b["settings"]["prompt_sets"]) == {"own", "spec_bench"} and not b["errors"] and not b["skipped"]
    for dtype in ("bfloat16", "float32"):
        for mode in ("eager", "graphed"):
            for m in ("vanilla", "eagle", "eagle2", "copy"):
                r = b["rows"][dtype][mode][m]
                assert r["prompts"] == n and r["tokens_per_s"] > 0 and r["tau"] >= 1
                if dtype == "float32":  # the CPU's float32 forward is row-invariant: every answer is vanilla's
                    assert r["identical_to_eager_vanilla"] == f"{n}/{n}", (mode, m)
        assert "graphed_vanilla_over_eager_vanilla" in b["ratios"][dtype]
        for key, v in b["ratios"][dtype].items():
            if key != "graphed_vanilla_over_eager_vanilla":
                assert v["bound"] is None or v["bound"] <= v["tau"] + 1e-9


def test_the_dry_speedup_section_decodes_eager_and_graphed_without_a_prediction_above_tau(dry):
    _, _, docs = dry
    s = docs["call1"]["speedup"]
    assert set(s["runs"]) == {"eager", "graphed"} and set(s["forward_s_by_rows"]) == {"1", "2", "4"}
    for run in s["runs"].values():
        assert run["identical_all"]
        for r in run["methods"].values():
            assert (r["predicted_speedup"] is None) == (r["prediction_refused"] is not None)
            assert r["predicted_speedup"] is None or r["predicted_speedup"] <= r["tau_step"] + 1e-9


def test_the_dry_split_section_measures_the_table_and_times_the_graphed_step_dense_and_split(dry):
    """Issue 58 item 3 on a GPU: the backend table, then the graphed step with its bucket forced to dense and to the
    Triton split at every context and tree; the dry run goes through the same code (the kernel in the interpreter)."""
    _, _, docs = dry
    s = docs["call1"]["split"]
    sp = s["settings"]
    assert {(r["context"], r["method"]) for r in s["rows"]} == {(c, m) for c in sp["context"] for m in sp["methods"]}
    for r in s["rows"]:
        assert r["dense_s"] > 0 and r["split_s"] > 0 and r["graphs_used"] is False and r["table_choice"] == "dense"
    measured = {tuple(p[:3]) for p in s["table"]["table"]["best"]}
    assert measured == {(b, c, t) for b in sp["table_batch"] for c in sp["table_context"] for t in sp["table_tree"]}
    assert all(max(r["max_abs_err_vs_dense"].values()) < 1e-5 for r in s["table"]["results"])
    assert s["table_kept"] is None  # a CPU's table is never kept for the runner
    assert s["acceptance"] == {"split_at_least_dense_from_8k": None, "split_3x_at_32k": None}  # no such context here


def test_the_dry_drafting_section_times_eager_and_graphed_drafts_of_the_same_trees(dry):
    _, _, docs = dry
    d = docs["call2"]["drafting"]
    assert d["method"] == "eagle2" and d["steps"] > 0 and d["eager_ms"] > 0 and d["graphed_ms"] > 0
    assert d["same_trees"] and d["same_tokens"] and d["captures"] >= 1 and d["cuda_graphs"] is False  # CPU: same bits


# --------------------------------------------------------------------------- the carry, piece by piece
def test_split_and_join_round_trip_and_refuse_a_missing_or_damaged_part(tmp_path):
    src = tmp_path / "w.whl"
    src.write_bytes(os.urandom(100_003))
    m = carry.split(src, tmp_path / "carry", 3)
    assert [p["size"] for p in m["parts"]] == [33_335, 33_335, 33_333] and m["sha256"] == carry.sha256(src)
    assert all(json.loads((tmp_path / "carry" / f"call{n}" / "manifest.json").read_text()) == m for n in (1, 2, 3))
    r = carry.join(tmp_path / "carry", tmp_path / "cache" / "wheels")
    assert Path(r["wheel"]).read_bytes() == src.read_bytes() and r["parts"] == 3
    part2 = tmp_path / "carry" / "call2" / "w.whl.part2"
    data = part2.read_bytes()
    part2.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(carry.CarryError, match="part2 is damaged"):
        carry.join(tmp_path / "carry", tmp_path / "other")
    part2.unlink()
    with pytest.raises(carry.CarryError, match=r"parts missing: \['call2/w.whl.part2'\].*warm"):
        carry.join(tmp_path / "carry", tmp_path / "other")
    assert not (tmp_path / "other").exists()  # nothing written where a check failed
    with pytest.raises(ValueError, match="positive"):
        carry.split(src, tmp_path / "x", 0)


def test_slim_moves_tracked_files_out_of_what_a_call_sends_and_restore_brings_them_back(tmp_path):
    repo = tmp_path / "repo"
    (repo / "big").mkdir(parents=True)
    (repo / "big" / "a.bin").write_bytes(b"x" * 5000)
    (repo / "keep.py").write_text("print(1)\n")
    (repo / ".gitignore").write_text("/.gpucheck/\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    full = carry.tree_bytes(repo)
    assert full == 5000 + 9 + 12 and carry.tree_bytes(repo, ("big",)) == 21
    assert carry.slim(repo, paths=("big", "missing")) == ["big"]
    assert carry.tree_bytes(repo) == 21 and (repo / ".gpucheck" / "stash" / "big" / "a.bin").exists()
    with pytest.raises(FileExistsError, match="restore before"):
        (repo / "big").mkdir()
        carry.slim(repo, paths=("big",))
    (repo / "big").rmdir()
    assert carry.restore(repo, paths=("big",)) == ["big"] and carry.tree_bytes(repo) == full
    assert subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True).stdout == ""


def test_the_spec_bench_subset_takes_each_task_group(tmp_path):
    rows = [dict(question_id=i, category=c, turns=[f"q{i}"]) for i, c in enumerate(
        ["writing", "coding", "translation", "translation", "summarization", "qa", "math_reasoning", "rag", "rag"])]
    src = tmp_path / "sb.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert carry.spec_bench_subset(src, tmp_path / "sub.jsonl") == 6
    got = [json.loads(line)["category"] for line in (tmp_path / "sub.jsonl").read_text().splitlines()]
    assert got == ["writing", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert carry.spec_bench_subset(src, tmp_path / "sub2.jsonl", per_group=2) == 9


def test_the_script_refuses_an_unknown_action():
    p = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "nope"], capture_output=True, text=True)
    assert p.returncode == 2 and "--dry-run" in p.stderr


def test_the_entry_point_refuses_an_unknown_section_and_a_missing_gpu(tmp_path, capsys):
    from minispec.lab.gpu_check import main

    assert main(["nope", "--out", str(tmp_path), "--dry-run"]) == 2
    if not torch.cuda.is_available():
        assert main(["graphs", "--out", str(tmp_path)]) == 2
        assert "--dry-run" in capsys.readouterr().err


def test_a_configuration_that_fails_is_reported_and_the_bench_goes_on(tmp_path, monkeypatch):
    """A method that cannot run graphed (here: made to raise when graphed) is an error of that configuration alone,
    recorded with its message; every other configuration runs every prompt, and eager vanilla is the reference."""
    import importlib
    import time

    from minispec import load
    from minispec.drafters.eagle import EagleDrafter
    from minispec.lab import gpu_bench
    from minispec.lab.gpu_check import _tiny_head
    from minispec.methods import Methods

    gen = importlib.import_module("minispec.generate")
    real = gen.generate

    def generate(*a, cuda_graphs=False, drafter=None, **kw):
        if cuda_graphs and isinstance(drafter, EagleDrafter):
            raise RuntimeError("cannot capture this drafter (simulated)")
        return real(*a, cuda_graphs=cuda_graphs, drafter=drafter, **kw)

    monkeypatch.setattr(gen, "generate", generate)
    target = load("tiny-llama")[0]
    head = _tiny_head(target, tmp_path / "head")
    r = gpu_bench.run(lambda dtype: load("tiny-llama", getattr(torch, dtype)),
                      lambda model: Methods(model, "tiny-llama", drafter_path=head),
                      {"own": ["abc", "hello"]}, max_new_tokens=3, deadline=time.perf_counter() + 600,
                      dtypes=("float32",), methods=("vanilla", "eagle2"), warmup_tokens=2)
    assert [(e["mode"], e["method"]) for e in r["errors"]] == [("graphed", "eagle2")]
    assert "cannot capture" in r["errors"][0]["error"]
    rows = r["rows"]["float32"]
    assert rows["graphed"]["eagle2"]["prompts"] == 0 and rows["graphed"]["eagle2"]["tokens_per_s"] is None
    for mode, m in (("eager", "vanilla"), ("eager", "eagle2"), ("graphed", "vanilla")):
        assert rows[mode][m]["prompts"] == 2 and rows[mode][m]["identical_to_eager_vanilla"] == "2/2"
    assert "graphed/eagle2" not in r["ratios"]["float32"] and "eager/eagle2" in r["ratios"]["float32"]
