"""``python -m minispec gpu-suite --out DIR [--smoke]``: every GPU measurement in one run of ~9 minutes.

GPU time comes in short runs on machines that reach no network, so one command does it all and
writes one JSON file per measurement into DIR, each with ``device`` (the GPU's name as torch
reports it, or the CPU's), the versions, the settings and ``smoke``:

    gpu_tests.json       ``pytest -m gpu`` over the test files that have GPU tests: the summary
    copy_bandwidth.json  a large device copy, GB/s (read + write): the yardstick of every bandwidth
    attention_grid.json  chapter 6: dense-mask SDPA, FlexAttention, PyTorch split, Triton split,
                         causal; Llama-3-8B heads, context 512-32k, tree 8-64, batch 1-32, bf16,
                         cold L2; achieved KV bandwidth against the copy bandwidth
    cuda_graphs.json     chapter 8: per-step latency of the draft (Llama-3.2-1B-shaped, one token)
                         and verify (Llama-3.1-8B-shaped, vanilla / chain / EAGLE-2 tree) forwards:
                         eager, eager over the static cache, CUDA graph replay
    llama_latency.json   chapter 9: per-token latency of vanilla, chain and EAGLE-2-shaped tree with
                         an oracle drafter (tau known), with and without graphs and split attention,
                         batch 1-32, prompt 128-8k; predicted speedup; weight-bandwidth floor
    llama_speedup.json   chapter 9: batch 1 through the decode loop: output == vanilla, measured
                         tau and speedup next to the cost model's prediction (the target in float32,
                         TF32 off: in bf16 random weights' near-ties break vanilla's stream)
    suite.json           the index: sections, seconds, errors, what the time budget skipped

A time budget (``--budget-s``, default 510 s, the whole run) gives each measurement section a
deadline, a share of the time the GPU tests left; a section stops adding points at its deadline
and lists what it skipped. The GPU tests have their own fixed budget (``--tests-s``, default
150 s): a fresh process that imports torch, starts CUDA and JIT-compiles the Triton kernels
(~8 variants) needs minutes, not what a fraction of the budget would leave it. They first check
their prerequisites (pytest, the ``dev`` extra; a C compiler, which Triton needs to build its
launcher; CUDA) and, where one is missing, record which in gpu_tests.json instead of running.
``--smoke`` runs the same code paths on the CPU with tiny shapes in well under a minute (CI
runs it); its files say ``smoke: true`` and name the CPU: no smoke figure is a GPU figure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout: minispec/lab/gpu_suite.py -> ./
SECTIONS = ("gpu_tests", "copy_bandwidth", "attention_grid", "cuda_graphs", "llama_latency", "llama_speedup")
TESTS_S = 150.0  # the GPU tests' own budget (seconds), outside the measurement sections' deadlines
DEADLINES = dict(copy_bandwidth=0.02, attention_grid=0.47, cuda_graphs=0.58, llama_latency=0.86,
                 llama_speedup=0.98)  # fraction of the time left after the GPU tests by which each must stop
COMPILERS = ("cc", "gcc", "clang")


def missing_prerequisites(cuda: bool = True) -> list[str]:
    """What ``pytest -m gpu`` needs and this machine lacks (empty: all there).

    Args:
        cuda: also need a CUDA GPU and a C compiler (Triton builds its launcher with one); the
            smoke run's tests skip their GPU parts and run Triton in its interpreter, so only
            pytest is needed there.
    Returns:
        one line per missing prerequisite, saying how to get it.
    """
    missing = []
    if importlib.util.find_spec("pytest") is None:
        missing.append("pytest: install the dev extra (pip install -e '.[dev]')")
    if cuda and not any(shutil.which(c) for c in COMPILERS):
        missing.append(f"a C compiler ({', '.join(COMPILERS)} on PATH): Triton compiles its launcher with it")
    if cuda and not torch.cuda.is_available():
        missing.append("CUDA: torch.cuda.is_available() is False")
    return missing


def settings(smoke: bool) -> dict:
    """Every size and count of the run (written into each JSON)."""
    if smoke:
        return dict(dtype="float32", copy_mib=64, p_corrupt=0.15, target="tiny", draft="tiny-draft",
                    attention=dict(batch=[1, 2], ctx=[32], tree=[4, 8], heads=[4, 2, 16], reps=2),
                    graphs=dict(batch=[1, 2], prompt=32, reps=2),
                    latency=dict(batch=[1, 2], prompt=[16], reps=1, warmup=1),
                    speedup=dict(prompt=16, new_tokens=24, dtype="float32"))
    return dict(dtype="bfloat16", copy_mib=1024, p_corrupt=0.15, target="llama-3.1-8b", draft="llama-3.2-1b",
                attention=dict(batch=[1, 4, 16, 32], ctx=[512, 2048, 8192, 32768], tree=[8, 16, 32, 64],
                               heads=[32, 8, 128], reps=30),
                graphs=dict(batch=[1, 8, 32], prompt=1024, reps=20),
                latency=dict(batch=[1, 8, 32], prompt=[128, 1024, 8192], reps=10, warmup=2),
                speedup=dict(prompt=128, new_tokens=128, dtype="float32"))


def device_name(device: torch.device) -> str:
    """The GPU's name as torch reports it, or "cpu: <model name>"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from .benchinfo import device_info

    info = device_info()
    return f"cpu: {info.get('cpu_model') or info['cpu']}"


def run_captured(cmd: list[str], timeout: float, **kw) -> tuple[str, int | str]:
    """Run ``cmd``; return (its stdout then its stderr, its return code or "timeout"). Killed at ``timeout``
    seconds, it still returns both streams as far as they got: a timeout is when the stderr (a traceback, a
    hang's stacks under ``PYTHONFAULTHANDLER``) is most needed."""
    def text(x) -> str:
        return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        return p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:  # its streams are bytes, whatever text=True says
        return text(e.stdout) + text(e.stderr) + f"\n[killed after {timeout:.0f} s]\n", "timeout"


def failure_lines(out: str, limit: int = 80) -> list[str]:
    """The lines of a pytest output that say what failed and why (its ``FAILED`` / ``ERROR`` summary lines and the
    ``E`` lines of the tracebacks), at most ``limit``: the output's tail alone can be all warnings summary."""
    return [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR ", "E "))][:limit]


class Suite:
    """Runs the sections in order under one time budget and writes their JSON files."""

    def __init__(self, out: Path, smoke: bool, budget_s: float, tests_s: float = TESTS_S):
        self.out, self.smoke, self.budget_s, self.tests_s = out, smoke, budget_s, tests_s
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = getattr(torch, settings(smoke)["dtype"])
        self.s = settings(smoke)
        self.t0 = self.t_measure = time.perf_counter()  # t_measure: when the measurement sections start
        self.index: dict[str, dict] = {}
        self.bandwidth: float | None = None
        self.models: dict[str, torch.nn.Module] = {}
        self.test_files: list[str] | None = None  # gpu_tests: only these file names (default: every GPU test file)

    def deadline(self, section: str) -> float:
        """GPU tests: their own ``tests_s``; the others: a share of the budget the tests left."""
        if section == "gpu_tests":
            return time.perf_counter() + self.tests_s
        left = max(0.0, self.budget_s - (self.t_measure - self.t0))
        return self.t_measure + DEADLINES[section] * left

    def write(self, name: str, payload: dict) -> Path:
        from .benchinfo import device_info, versions

        try:
            import triton
            vers = dict(versions(), triton=triton.__version__)
        except ImportError:
            vers = versions()
        doc = dict(benchmark=name, smoke=self.smoke, device=device_name(self.device), device_info=device_info(),
                   versions=vers, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   **payload)
        path = self.out / f"{name}.json"
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        return path

    def run(self, sections) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in sections:
            t = time.perf_counter()
            if t > self.deadline(name):
                self.index[name] = dict(status="skipped", why="time budget spent")
                continue
            try:
                payload = getattr(self, name)()
                status = "error" if payload.get("errors") else "skipped" if payload.get("missing") else "ok"
                self.index[name] = dict(status=status, file=self.write(name, payload).name)
                if status == "skipped":
                    self.index[name]["why"] = "missing: " + "; ".join(payload["missing"])
            except Exception as e:  # noqa: BLE001  (one broken section must not cost the others' figures)
                err = "".join(traceback.format_exception(e))[-3000:]
                self.index[name] = dict(status="error", file=self.write(name, dict(error=err)).name)
            self.index[name]["seconds"] = time.perf_counter() - t
            if name == "gpu_tests":
                self.t_measure = time.perf_counter()  # the measurements share what the tests left
            print(f"[gpu-suite] {name}: {self.index[name]['status']} ({self.index[name]['seconds']:.1f} s)", flush=True)
        self.models.clear()
        self.write("suite", dict(budget_s=self.budget_s, tests_s=self.tests_s, elapsed_s=time.perf_counter() - self.t0,
                                 settings=self.s, sections=self.index))
        return 1 if any(v["status"] == "error" for v in self.index.values()) else 0

    # ------------------------------------------------------------------ sections
    def gpu_tests(self) -> dict:
        """``pytest -m gpu`` over the test files that mark GPU tests, in ``tests_s`` seconds; on a CPU
        they all skip. With a prerequisite missing (``missing_prerequisites``) nothing runs and the
        JSON says what is missing."""
        tests = ROOT / "tests"
        if not tests.is_dir():
            return dict(errors=["tests/ not found: run from a checkout of the repository"])
        files = sorted(str(f) for f in tests.glob("test_*.py")
                       if "pytest.mark.gpu" in f.read_text() and f.name not in ("test_gpu_suite.py", "test_gpu_check.py")
                       and (self.test_files is None or f.name in self.test_files))
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-p", "no:xdist", *files]
        timeout = self.tests_s
        settings = dict(marker="gpu", command="python " + " ".join(cmd[1:]), timeout_s=timeout,
                        files=[Path(f).name for f in files])
        if missing := missing_prerequisites(cuda=not self.smoke):
            return dict(settings=settings, missing=missing, errors=[])
        env = dict(os.environ, OMP_NUM_THREADS="1") if self.smoke else dict(os.environ)
        t = time.perf_counter()
        out, rc = run_captured(cmd, timeout, cwd=ROOT, env=env)
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)",
                                                     out.strip().splitlines()[-1] if out.strip() else "")}
        ok = rc in (0, 5) and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
        return dict(settings=settings, missing=[], returncode=rc, counts=counts, seconds=time.perf_counter() - t,
                    output_tail=out[-4000:], failures=failure_lines(out),
                    errors=[] if ok else [f"pytest returned {rc}: {counts}"])

    def copy_bandwidth(self) -> dict:
        from .attention_grid import copy_bandwidth

        self.bandwidth = copy_bandwidth(self.device, self.s["copy_mib"] * 2**20)
        return dict(settings=dict(bytes=self.s["copy_mib"] * 2**20, dtype="float32", timing="median of 10 after 2 "
                                  "warm-ups; bytes read + bytes written"), copy_bandwidth_GBps=self.bandwidth)

    def _bw(self) -> float:
        if self.bandwidth is None:
            self.copy_bandwidth()
        return self.bandwidth

    def attention_grid(self) -> dict:
        from .attention_grid import run_grid

        a = self.s["attention"]
        grid = run_grid(self.device, self.dtype, a["batch"], a["ctx"], a["tree"], tuple(a["heads"]), a["reps"],
                        deadline=self.deadline("attention_grid"), bandwidth=self._bw())
        return dict(settings=dict(a, dtype=str(self.dtype), timing="median per call; interleaved repetitions" + (
            "; L2 flushed before each timing, its back-to-back calls on distinct input copies; CUDA events"
            if self.device.type == "cuda" else "; perf_counter"),
            triton_interpret=os.environ.get("TRITON_INTERPRET") == "1"), **grid)

    def _model(self, role: str):
        """The target or draft model (random weights, built once)."""
        from .scale import llama_config, random_model

        if role not in self.models:
            cfg = llama_config(self.s[role])
            self.models[role] = random_model(cfg, self.device, self.dtype, seed=0 if role == "target" else 1)
        return self.models[role]

    def cuda_graphs(self) -> dict:
        from ..cuda_graphs import greedy_decode
        from .scale import METHODS, method_tree, step_latency

        g = self.s["graphs"]
        rows, skipped, errors, replay_equals_eager = [], [], [], None
        for role, methods in (("draft", {"vanilla": METHODS["vanilla"]}), ("target", METHODS)):
            model = self._model(role)
            for B in g["batch"]:
                for method, (depth, nodes) in methods.items():
                    if time.perf_counter() > self.deadline("cuda_graphs"):
                        skipped.append(dict(role=role, batch=B, method=method))
                        continue
                    tree = method_tree(depth, nodes)
                    try:
                        r = {m: step_latency(model, B, g["prompt"], tree, m, g["reps"])
                             for m in ("eager", "static", "graph")}
                    except Exception as e:  # noqa: BLE001
                        errors.append(dict(role=role, batch=B, method=method, error=f"{type(e).__name__}: {e}"[:300]))
                        continue
                    rows.append(dict(role=role, model=model.cfg.name, batch=B, prompt=g["prompt"], method=method,
                                     tokens=nodes + 1, eager_s=r["eager"]["step_s"], static_s=r["static"]["step_s"],
                                     graph_s=r["graph"]["step_s"], graphs_used=r["graph"]["graphs_used"],
                                     eager_over_graph=r["eager"]["step_s"] / r["graph"]["step_s"]))
            if role == "draft":  # replay == eager (padded: the same kernels), on the draft model's greedy tokens
                prompts = torch.randint(0, model.cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
                toks = {on: greedy_decode(model, prompts.to(self.device), 16, enabled=on, pad=True).tolist()
                        for on in (True, False)}
                replay_equals_eager = toks[True] == toks[False]
                self.models.pop("draft")
        notes = ["eager = Transformer.forward + KVCache (what generate runs); graph = GraphedForward over a "
                 "StaticKVCache (attention over the whole capacity, prompt + tokens); static = the same without "
                 "graphs (eager_s vs static_s: the static cache's own cost; static_s vs graph_s: what graphs save)",
                 "a draft chain of k tokens costs k draft steps"]
        if self.device.type != "cuda":
            notes.append("no CUDA: 'graph' ran GraphedForward's eager fallback (graphs_used false)")
        return dict(settings=dict(g, dtype=str(self.dtype), target=self.s["target"], draft=self.s["draft"],
                                  methods={m: dict(depth=d, nodes=n) for m, (d, n) in METHODS.items()}),
                    rows=rows, skipped=skipped, errors=errors, replay_equals_eager_tokens=replay_equals_eager,
                    notes=notes)

    def llama_latency(self) -> dict:
        from ..attention import triton_available
        from .scale import METHODS, latency_grid

        model = self._model("target")
        split = "split_triton" if triton_available(self.device) else "split_torch"
        modes = {"eager_dense": ("eager", "dense"), f"eager_{split}": ("eager", split), "graph": ("graph", "dense")}
        lat = self.s["latency"]
        r = latency_grid(model, lat["batch"], lat["prompt"], modes, lat["reps"], self.s["p_corrupt"], self._bw(),
                         deadline=self.deadline("llama_latency"), warmup=lat["warmup"])
        return dict(settings=dict(lat, dtype=str(self.dtype), target=self.s["target"], p_corrupt=self.s["p_corrupt"],
                                  modes={k: list(v) for k, v in modes.items()}, copy_bandwidth_GBps=self._bw(),
                                  methods={m: dict(depth=d, nodes=n) for m, (d, n) in METHODS.items()}),
                    notes=["per_token_s = step_s / tau_expected (per sequence); tau from the oracle drafter: "
                           "sum_{i<=depth} (1 - p_corrupt)^i", "predicted_speedup = vanilla step_s * tau / step_s "
                           "(same mode, batch, prompt; the oracle's draft costs nothing); None where that is above "
                           "tau (prediction_refused: a step measured cheaper than vanilla's)",
                           "floor = (weight bytes + KV bytes) / copy bandwidth per step"], **r)

    def llama_speedup(self) -> dict:
        """Batch 1 through the decode loop, on the target rebuilt in ``speedup.dtype`` (float32, TF32 off).

        Random weights put near-ties of the top two logits everywhere. In bf16 a verify forward over
        more rows breaks them differently from vanilla's one-row forward (GPU kernels are not
        row-count invariant), so the oracle keeps losing the target's stream: the first H100 run
        measured tau 2.93 against 4.15 promised and stopped with ``OracleTauError``. In float32 the
        rounding differences are ~2^16 times smaller than bf16's, and greedy output stays vanilla's.
        """
        from .scale import llama_config, oracle_speedup, random_model

        sp = self.s["speedup"]
        self.models.pop("target", None)  # the last section: give the bf16 target's memory back first
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        model = random_model(llama_config(self.s["target"]), self.device, getattr(torch, sp["dtype"]), seed=0)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            r = oracle_speedup(model, sp["prompt"], sp["new_tokens"], self.s["p_corrupt"])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        notes = ["eager decode loop (generate); it does not use CUDA graphs yet",
                 f"the target in {sp['dtype']} with TF32 off, not bf16: see first_difference if an output differs"]
        if not r["identical_all"]:
            notes.append("an output differs from vanilla: a near-tie of the top-2 logits broke differently in a "
                         "forward over more rows (GPU kernels are not batch-invariant)")
        return dict(settings=dict(sp, target=self.s["target"], p_corrupt=self.s["p_corrupt"]), notes=notes, **r)


def main(argv=None) -> int:
    from ..args import thread_count

    ap = argparse.ArgumentParser(prog="python -m minispec gpu-suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for the JSON files")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the same code paths, for CI")
    ap.add_argument("--budget-s", type=float, default=510.0, help="time budget in seconds (default 510: 8.5 minutes)")
    ap.add_argument("--tests-s", type=float, default=TESTS_S,
                    help=f"the GPU tests' own time limit in seconds (default {TESTS_S:.0f})")
    ap.add_argument("--only", default=None, help=f"comma list of sections (default all: {','.join(SECTIONS)})")
    ap.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads for --smoke (default: one per idle core)")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",")] if args.only else list(SECTIONS)
    if unknown := [s for s in sections if s not in SECTIONS]:
        print(f"error: unknown sections {unknown}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA GPU here; --smoke runs the same code paths on the CPU with tiny shapes", file=sys.stderr)
        return 2
    if args.smoke:
        from .env import default_threads

        torch.set_num_threads(args.threads if args.threads is not None else default_threads())
        if "triton" not in sys.modules:  # run the Triton kernels in the interpreter: the same code path on CPU
            os.environ.setdefault("TRITON_INTERPRET", "1")
    rc = Suite(args.out, args.smoke, args.budget_s, args.tests_s).run(sections)
    print(f"[gpu-suite] wrote {args.out}/*.json" + ("" if rc == 0 else " (with errors: see suite.json)"))
    return rc
