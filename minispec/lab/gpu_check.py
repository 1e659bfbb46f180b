"""``python -m minispec.lab.gpu_check SECTION... --out DIR [--dry-run]``: the sections of ``tools/gpu_check.sh``.

GPU time comes by chance, for minutes, on machines that reach no network and take 64 MiB a call
(docs/gpu.md, "Running tools/gpu_check.sh"). Each section is one function here that writes one JSON file
into DIR as soon as it is done (``device`` names the GPU, or the CPU in a dry run), so a call that runs out
of time still brings back what it finished; ``gpu_check_<call>.json`` indexes a call's sections. The two
device calls of the script (the SmolLM2 wheel travels in two parts, ``minispec.lab.carry``):

    call1   keep       the first part arrived intact (sha256), and stays on the warm machine
            graphs     chapter 8: draft (Llama-3.2-1B-shaped) and verify (Llama-3.1-8B-shaped) steps, eager,
                       over the static cache, replayed; batch 1 and 32 (``gpu_suite.cuda_graphs``)
            latency    chapter 9: per-token latency of vanilla / chain / EAGLE-2-shaped tree, batch 1, prompt
                       128-32k, eager dense, eager split, graphed (``gpu_suite.llama_latency``)
            attention  chapter 6: the attention grid at batch 1, context 8k-32k (``gpu_suite.attention_grid``)
            split      chapters 6 and 8: the backend table measured at batch 1 (``lab.backend_table``, kept where
                       the graph runner reads it on this machine), then the graphed target step with its buckets
                       forced to dense and to the Triton split, batch 1, context 8k-32k, each tree shape
            speedup    chapter 9: the decode loop with the oracle, float32, eager and graphed: phases by CUDA
                       events, the cost model's prediction (refused above tau), and one forward of 1-16 rows
    call2   carry      the parts joined (sha256), the gguf reader, SmolLM2 converted and loaded
            smollm2    the end-to-end bench: vanilla / eagle / eagle2 / copy x eager / graphed x bf16 / fp32 on
                       minispec's prompts and the carried Spec-Bench subset (``minispec.lab.gpu_bench``)
            drafting   eager against graphed EAGLE-2 drafting on SmolLM2, side by side
                       (``lab.draft_timing.smollm2_draft_times``)
            gpu_tests  ``pytest -m gpu`` over the test files with GPU tests (``gpu_suite.gpu_tests``)

A budget (``--budget-s``) is shared by the sections of one invocation in proportion to ``WEIGHTS``; a
section stops adding points at its deadline and lists what it skipped. ``--dry-run`` runs every section's
code on the CPU at tiny shapes (tiny Llama models, a random EAGLE head, a stand-in wheel where the real
one is not cached): its files say ``dry_run: true`` and name the CPU. No dry-run figure is a GPU figure.

What each section runs, so that a change there shows in its file: graphs, latency and speedup (graphed) run
``cuda_graphs.GraphedForward``; latency and attention the split attention kernels; split the attention backend
table and ``GraphedForward`` with each bucket's backend forced (dense, split); smollm2 and drafting
``generate(..., cuda_graphs=True)`` / ``Decoder(graphs=True)`` with each drafter, graphed as far as the drafter allows,
on the backend table split measured (the graph runner reads it where ``backend_table --save`` keeps it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from .gpu_suite import ROOT, Suite, device_name

SECTIONS = ("keep", "graphs", "latency", "attention", "split", "speedup", "carry", "smollm2", "drafting", "gpu_tests")
CALLS = {"call1": ("keep", "graphs", "latency", "attention", "split", "speedup"),
         "call2": ("carry", "smollm2", "drafting", "gpu_tests")}
WEIGHTS = dict(keep=0.01, graphs=0.15, latency=0.2, attention=0.2, split=0.25, speedup=0.2, carry=0.2, smollm2=0.4,
               drafting=0.1, gpu_tests=0.3)


def settings(dry: bool) -> dict:
    """Every size and count (written into each file)."""
    if dry:
        return dict(dtype="float32", copy_mib=16, p_corrupt=0.15, target="tiny", draft="tiny-draft",
                    graphs=dict(batch=[1, 2], prompt=16, reps=1),
                    latency=dict(batch=[1], prompt=[16, 32], reps=1, warmup=1),
                    attention=dict(batch=[1], ctx=[32], tree=[4], heads=[4, 2, 16], reps=1),
                    split=dict(table_batch=[1], table_context=[24], table_tree=[1, 5], table_reps=1,
                               context=[16], methods=["vanilla", "chain"], reps=1, warmup=1),
                    speedup=dict(prompt=16, new_tokens=24, dtype="float32", graphs=[False, True], rows=[1, 2, 4],
                                 rows_reps=1),
                    smollm2=dict(model="tiny-llama", max_new_tokens=4, own_prompts=1, warmup_tokens=2),
                    drafting=dict(model="tiny-llama", method="eagle2", new_tokens=6, rounds=1),
                    gpu_tests=dict(files=["test_clock.py"]))
    return dict(dtype="bfloat16", copy_mib=1024, p_corrupt=0.15, target="llama-3.1-8b", draft="llama-3.2-1b",
                graphs=dict(batch=[1, 32], prompt=1024, reps=20),
                latency=dict(batch=[1], prompt=[128, 8192, 32768], reps=10, warmup=2),
                attention=dict(batch=[1], ctx=[8192, 16384, 32768], tree=[8, 16, 32, 64], heads=[32, 8, 128], reps=30),
                split=dict(table_batch=[1], table_context=[1024, 8192, 16384, 32768], table_tree=[1, 8, 64],
                           table_reps=5,
                           context=[32768, 8192, 16384], methods=["vanilla", "chain", "eagle2"], reps=5, warmup=2),
                speedup=dict(prompt=128, new_tokens=128, dtype="float32", graphs=[False, True],
                             rows=[1, 2, 4, 6, 8, 16], rows_reps=10),
                smollm2=dict(model="smollm2-135m", max_new_tokens=64, own_prompts=3, warmup_tokens=8),
                drafting=dict(model="smollm2-135m", method="eagle2", new_tokens=48, rounds=3),
                gpu_tests=dict(files=None))


class _Suite(Suite):
    """gpu-suite's sections, each under the deadline ``gpu_check`` gives it."""
    until = 0.0

    def deadline(self, section: str) -> float:
        return self.until


class Check:
    """Runs sections under one budget and writes their files (see the module doc)."""

    def __init__(self, out: Path, dry: bool, budget_s: float, carry_dir: Path, call: str | None = None):
        self.out, self.dry, self.budget_s, self.carry_dir, self.call = out, dry, budget_s, carry_dir, call
        self.s = settings(dry)
        self.suite = _Suite(out, smoke=dry, budget_s=budget_s)
        self.suite.s = dict(self.suite.s, **{k: self.s[k] for k in ("dtype", "copy_mib", "p_corrupt", "target", "draft",
                                                                     "attention", "latency", "graphs")})
        self.device = self.suite.device
        self.t0 = time.perf_counter()
        self.index: dict[str, dict] = {}

    def write(self, name: str, payload: dict) -> Path:
        from .benchinfo import device_info, versions

        try:
            import triton
            vers = dict(versions(), triton=triton.__version__)
        except ImportError:
            vers = versions()
        doc = dict(benchmark=name, dry_run=self.dry, smoke=self.dry, call=self.call, device=device_name(self.device),
                   device_info=device_info(), versions=vers,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **payload)
        path = self.out / f"{name}.json"
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        return path

    def run(self, sections) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(sections):
            t = time.perf_counter()
            left = self.budget_s - (t - self.t0)
            share = WEIGHTS[name] / sum(WEIGHTS[s] for s in sections[i:])
            self.suite.until = until = t + max(left, 0.0) * share
            if left <= 0:
                self.index[name] = dict(status="skipped", why="time budget spent", seconds=0.0)
                continue
            try:
                payload = getattr(self, name)(until)
                status = "error" if payload.get("errors") else "ok"
                self.index[name] = dict(status=status, file=self.write(name, payload).name)
            except Exception as e:  # noqa: BLE001  (one broken section must not cost the others' figures)
                err = "".join(traceback.format_exception(e))[-3000:]
                self.index[name] = dict(status="error", file=self.write(name, dict(error=err)).name)
            self.index[name]["seconds"] = time.perf_counter() - t
            print(f"[gpu-check] {name}: {self.index[name]['status']} ({self.index[name]['seconds']:.1f} s)", flush=True)
        self.suite.models.clear()
        self.write(f"gpu_check_{self.call or 'sections'}", dict(budget_s=self.budget_s, settings=self.s,
                                                               elapsed_s=time.perf_counter() - self.t0,
                                                               sections=self.index))
        return 1 if any(v["status"] == "error" for v in self.index.values()) else 0

    # ------------------------------------------------------------------ call 1
    def keep(self, until: float) -> dict:
        """The parts this machine holds: present and intact (the join of the last call checks them again)."""
        from .carry import sha256

        manifest = next(iter(sorted(self.carry_dir.glob("call*/manifest.json"))), None)
        if manifest is None:
            return dict(settings=dict(carry_dir=str(self.carry_dir)), parts=[],
                        errors=[f"no carried part under {self.carry_dir}/call*/"])
        found, later = [], []
        for p in json.loads(manifest.read_text())["parts"]:
            f = self.carry_dir / p["file"]
            if f.exists():
                found.append(dict(file=p["file"], intact=f.stat().st_size == p["size"] and sha256(f) == p["sha256"]))
            else:
                later.append(p["file"])
        errors = [f"{p['file']} is damaged" for p in found if not p["intact"]] + (
            [] if found else [f"no carried part under {self.carry_dir}/call*/"])
        return dict(settings=dict(carry_dir=str(self.carry_dir)), parts=found, to_come=later, errors=errors)

    def graphs(self, until: float) -> dict:
        return self.suite.cuda_graphs()

    def latency(self, until: float) -> dict:
        return self.suite.llama_latency()

    def attention(self, until: float) -> dict:
        return self.suite.attention_grid()

    def split(self, until: float) -> dict:
        """The backend table at batch 1 (kept for the graph runner), then the graphed step: dense against split.

        The table is measured with the target's heads over ``table_context`` (a short context too, so that a small
        cache, SmolLM2's in call 2, looks up a point measured near its own size, not 8k's) and, on a GPU, kept
        where ``GraphedForward`` reads it on this machine (``backend_table.keep``). The step: the target's forward
        of each method's tree rows after ``context`` cached tokens, batch 1, through ``GraphedForward`` with its
        bucket forced to dense and to split (``scale.step_latency``, graph mode: a replay on a GPU), contexts in
        the order given (32k first: the acceptance's 3x), each point's two backends back to back."""
        from .backend_table import keep, measure_table
        from .scale import METHODS, method_tree, step_latency
        from ..attention.table import choose_backend, table_for

        sp = self.s["split"]
        model = self.suite._model("target")
        c = model.cfg
        heads = (c.n_head, c.n_kv_head, c.head_dim)
        now = time.perf_counter()
        table = measure_table(self.device, self.suite.dtype, sp["table_batch"], sp["table_context"], sp["table_tree"],
                              heads, sp["table_reps"], graphed=True, deadline=now + 0.4 * (until - now))  # 40% of it
        kept = str(keep(table)) if self.device.type == "cuda" else None  # a dry run's CPU table is never read
        rows, skipped, errors = [], [], []
        for P in sp["context"]:
            for method in sp["methods"]:
                tree = method_tree(*METHODS[method])
                if time.perf_counter() > until:
                    skipped.append(dict(context=P, method=method))
                    continue
                try:
                    r = {name: step_latency(model, 1, P, tree, "graph", sp["reps"], name, sp["warmup"])
                         for name in ("dense", "split")}  # the bucket's backend forced
                except Exception as e:  # noqa: BLE001  (out of memory at one shape: the others go on)
                    errors.append(dict(context=P, method=method, error=f"{type(e).__name__}: {e}"[:400]))
                    continue
                T = len(tree) + 1
                dense_s, split_s = r["dense"]["step_s"], r["split"]["step_s"]
                rows.append(dict(batch=1, context=P, method=method, tokens=T, dense_s=dense_s, split_s=split_s,
                                 dense_over_split=dense_s / split_s,
                                 graphs_used=r["split"]["graphs_used"],
                                 table_choice=choose_backend(1, P + T, T, table_for(self.device))))
        long = [r["dense_over_split"] for r in rows if r["context"] >= 8192]
        at_32k = [r["dense_over_split"] for r in rows if r["context"] == 32768]
        acceptance = dict(split_at_least_dense_from_8k=min(long) >= 1 if long else None,
                          split_3x_at_32k=min(at_32k) >= 3 if at_32k else None)
        return dict(settings=dict(sp, heads=list(heads), target=self.s["target"], dtype=str(self.suite.dtype)),
                    table=table, table_kept=kept, rows=rows, acceptance=acceptance, skipped=skipped, errors=errors,
                    notes=["dense_s / split_s: median seconds of one graphed target step (GraphedForward, one bucket, "
                           "its backend forced); dense attends the cache's whole capacity under a mask, split reads "
                           "the lengths on the device",
                           "table_choice: what the graph runner picks at that shape from the table kept here",
                           "acceptance: split >= dense at every context >= 8k, and >= 3x at 32k (issue 58); None: "
                           "not measured"])

    def speedup(self, until: float) -> dict:
        """The oracle's decode loop on the float32 target (TF32 off), eager and graphed; one forward by rows."""
        from .scale import llama_config, oracle_speedup, random_model, rows_latency

        sp = self.s["speedup"]
        self.suite.models.pop("target", None)  # give the bf16 target's memory back first
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        model = random_model(llama_config(self.s["target"]), self.device, getattr(torch, sp["dtype"]), seed=0)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        runs, errors, skipped = {}, [], []
        try:
            for graphs in sp["graphs"]:
                label = "graphed" if graphs else "eager"
                if time.perf_counter() > until:
                    skipped.append(label)
                    continue
                try:
                    runs[label] = oracle_speedup(model, sp["prompt"], sp["new_tokens"], self.s["p_corrupt"],
                                                 cuda_graphs=graphs)
                except Exception as e:  # noqa: BLE001  (OracleTauError, or graphs that fail: the other run goes on)
                    errors.append(dict(run=label, error=f"{type(e).__name__}: {e}"[:600]))
            rows = rows_latency(model, sp["prompt"], sp["rows"], sp["rows_reps"]) if time.perf_counter() < until else {}
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            del model
        refused = {f"{label}/{m}": r["prediction_refused"] for label, run in runs.items()
                   for m, r in run["methods"].items() if r.get("prediction_refused")}
        return dict(settings=dict(sp, target=self.s["target"], p_corrupt=self.s["p_corrupt"]), runs=runs,
                    forward_s_by_rows={str(k): v for k, v in rows.items()}, predictions_refused=refused,
                    skipped=skipped, errors=errors,
                    notes=["phases by CUDA events on a GPU (minispec.clock); predicted_speedup None where the cost "
                           "model refused a figure above tau (prediction_refused says why)",
                           "forward_s_by_rows: one eager forward of T rows after the prompt, median: the cost model "
                           "assumes one row costs no more than several"])

    # ------------------------------------------------------------------ call 2
    def carry(self, until: float) -> dict:
        """Join the parts into the minispec cache; convert SmolLM2 and decode a few tokens (dry run: join only)."""
        from .carry import join
        from ..config import cache_dir

        t = time.perf_counter()
        if self.dry:  # the dry run never touches this machine's cache: joined into a folder removed after
            with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
                joined = join(self.carry_dir, Path(tmp) / "wheels")
            return dict(settings=dict(carry_dir=str(self.carry_dir)), joined=joined, join_s=time.perf_counter() - t,
                        errors=[], converted="dry run: not converted (CI converts SmolLM2 with the same "
                                             "ensure_smollm2 before its tests)")
        joined = join(self.carry_dir, cache_dir() / "wheels")
        out = dict(settings=dict(carry_dir=str(self.carry_dir), cache=str(cache_dir())), joined=joined,
                   join_s=time.perf_counter() - t, errors=[])
        import gguf  # noqa: F401  (the carried wheel, installed by tools/gpu_check.sh when the image lacks it)
        from ..generate import generate
        from ..loading import ensure_smollm2, load

        t = time.perf_counter()
        path = ensure_smollm2()
        out["convert_s"] = time.perf_counter() - t
        model, tok = load("smollm2-135m", torch.bfloat16, self.device)
        r = generate(model, tok, "Name three colours.", max_new_tokens=16)
        out.update(converted=str(path), smoke_text=r.text, config=dict(model.cfg.__dict__))
        return out

    def smollm2(self, until: float) -> dict:
        from . import gpu_bench
        from ..methods import Methods
        from ..loading import load
        from ..prompts import own_prompts, spec_bench

        sm = self.s["smollm2"]
        subset = next(self.carry_dir.glob("call*/spec_bench_subset.jsonl"), None)
        sets = {"own": [p["prompt"] for p in own_prompts()[:sm["own_prompts"]]]}
        if subset is not None:
            sets["spec_bench"] = [q["prompt"] for q in spec_bench(subset)]
        tmp = tempfile.TemporaryDirectory(prefix="gpucheck-") if self.dry else None
        head_dir = None
        if self.dry:  # a random EAGLE-1/2 head for the tiny target, written in the official layout
            head_dir = _tiny_head(load(sm["model"])[0], Path(tmp.name) / "head")

        def load_model(dtype):
            return load(sm["model"], getattr(torch, dtype), self.device)

        def make_methods(model):
            return Methods(model, sm["model"], drafter_path=head_dir)

        try:
            r = gpu_bench.run(load_model, make_methods, sets, sm["max_new_tokens"], until,
                              warmup_tokens=sm["warmup_tokens"])
        finally:
            if tmp is not None:
                tmp.cleanup()
        notes = ["tokens_per_s: new tokens / wall time of generate (prefill and graph captures included); "
                 "decode_tokens_per_s: the decode steps alone",
                 "identical_to_eager_vanilla: greedy answers equal to eager vanilla's in the same dtype; GPU kernels "
                 "are not row-invariant, so a difference is a near-tie broken another way, reported, not hidden"]
        if subset is None:
            notes.append("no Spec-Bench subset was carried: own prompts only")
        if self.dry:
            notes.append(f"dry run: {sm['model']} with a random EAGLE head; no figure here is a GPU's or SmolLM2's")
        return dict(settings=dict(sm, methods=list(gpu_bench.METHODS), modes=list(gpu_bench.MODES),
                                  dtypes=list(gpu_bench.DTYPES), prompt_sets={k: len(v) for k, v in sets.items()},
                                  spec_bench_subset=str(subset) if subset else None), notes=notes, **r)

    def drafting(self, until: float) -> dict:
        """Eager against graphed EAGLE drafting on the target, the two alternated in one process
        (``draft_timing.smollm2_draft_times``; the dry run: the tiny model with a random head)."""
        from .draft_timing import smollm2_draft_times

        d = self.s["drafting"]
        tmp = tempfile.TemporaryDirectory(prefix="gpucheck-") if self.dry else None
        try:
            head = None
            if self.dry:
                from ..loading import load

                head = _tiny_head(load(d["model"])[0], Path(tmp.name) / "head")
            dtype = torch.float32 if self.dry else torch.bfloat16
            r = smollm2_draft_times(d["method"], str(self.device), dtype, d["new_tokens"], d["rounds"],
                                    model_name=d["model"], drafter_path=head)
        finally:
            if tmp is not None:
                tmp.cleanup()
        notes = ["eager_ms / graphed_ms: median draft time a step (device synchronised around it); same_trees / "
                 "same_tokens: reported, not asserted (GPU kernels differ between the modes)"]
        if self.dry:
            notes.append("dry run: the tiny model with a random EAGLE head on the CPU: no figure here is a GPU's")
        return dict(settings=d, notes=notes, errors=[], timed_on=r.pop("device"), **r)

    def gpu_tests(self, until: float) -> dict:
        # a fresh interpreter importing torch needs its seconds even when the dry run's share is short
        self.suite.tests_s = max(until - time.perf_counter(), 240.0 if self.dry else 1.0)
        self.suite.test_files = self.s["gpu_tests"]["files"]
        return self.suite.gpu_tests()


def _tiny_head(target, out: Path) -> Path:
    """A random EAGLE-1/2 head for ``target`` saved in the official layout (``lab.export``), seeded."""
    from .export import export_head
    from ..drafters.eagle import EagleConfig, EagleHead

    head = EagleHead(EagleConfig.for_target(target.cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_((1.0 if p.dim() == 1 and "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    return export_head(head, out, target.cfg.max_seq_len, torch.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minispec.lab.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("sections", nargs="+", help=f"sections ({', '.join(SECTIONS)}) or a call ({', '.join(CALLS)})")
    ap.add_argument("--out", required=True, type=Path, help="folder for the JSON files")
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny shapes (CI)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="seconds for all the sections given (default 150)")
    ap.add_argument("--carry-dir", type=Path, default=ROOT / ".gpucheck", help="the carried folders (default .gpucheck)")
    a = ap.parse_args(argv)
    call = a.sections[0] if len(a.sections) == 1 and a.sections[0] in CALLS else None
    sections = list(CALLS[call]) if call else a.sections
    if unknown := [s for s in sections if s not in SECTIONS]:
        print(f"error: unknown sections {unknown}; choose from {', '.join(SECTIONS)} or {', '.join(CALLS)}",
              file=sys.stderr)
        return 2
    if not a.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU here; --dry-run runs the same code on the CPU at tiny shapes", file=sys.stderr)
        return 2
    if a.dry_run and "triton" not in sys.modules:  # the Triton kernels in the interpreter: the same code on the CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rc = Check(a.out, a.dry_run, a.budget_s, a.carry_dir, call).run(sections)
    print(f"[gpu-check] wrote {a.out}/*.json" + ("" if rc == 0 else " (with errors: see the index file)"), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
