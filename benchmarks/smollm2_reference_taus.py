"""Tau of every SmolLM2 method on the test suite's greedy references (tests/conftest.py: one prompt per
category x N_REF new tokens; each tree method on the half of them its test decodes, ``half_of``), each
output checked against vanilla; then the full-vocabulary shipped EAGLE
head on the first three references, and the shipped draft's teacher-forced agreement beside the undistilled
control. The source of the figures in the comments of tests/test_smollm2_speculative.py, tests/test_eagle.py
and tests/test_draft_checkpoint.py.

    python benchmarks/smollm2_reference_taus.py --threads 2
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from conftest import N_REF, half_of, one_per_category  # noqa: E402

from minispec import generate, load  # noqa: E402
from minispec.drafters import DraftModel, PromptLookup  # noqa: E402
from minispec.drafters.draft_checkpoint import load_draft_model  # noqa: E402
from minispec.drafters.eagle import EagleDrafter  # noqa: E402
from minispec.args import thread_count# noqa: E402
from minispec.methods import Methods  # noqa: E402
from minispec.tokenizer import encode_prompt  # noqa: E402
from minispec.train.distill_draft import build_draft  # noqa: E402

from test_smollm2_speculative import TREE_METHODS  # noqa: E402

METHODS = list(TREE_METHODS)  # in the test's order: the i-th decodes half_of(refs, i)


def tau(model, tok, refs, make) -> float:
    new = forwards = 0
    for prompt, ref in refs.items():
        r = generate(model, tok, prompt, drafter=make(), max_new_tokens=N_REF)
        assert r.tokens == ref, prompt  # speculative greedy must equal vanilla greedy
        new, forwards = new + r.stats.new_tokens, forwards + r.stats.target_forwards
    return new / forwards


def agreement(draft, tok, refs) -> tuple[float, int]:
    hits = total = 0
    for prompt, tokens in refs.items():
        ids = encode_prompt(tok, prompt)
        with torch.no_grad():
            logits = draft(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:]
        hits += (logits.argmax(-1) == torch.tensor(tokens)).sum().item()
        total += len(tokens)
    return hits / total, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=thread_count, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m")
    refs = {p: generate(model, tok, p, max_new_tokens=N_REF).tokens for p in one_per_category()}
    print(f"{len(refs)} prompts x {N_REF} new tokens, {args.threads} threads; every output equals vanilla")
    methods, draft = Methods(model), load_draft_model(model)
    makers = {m: (lambda m=m: methods.drafter(m)) for m in METHODS}
    makers["prompt lookup"] = lambda: PromptLookup(k=8)
    makers["draft chain k=4"] = lambda: DraftModel(draft, k=4)
    for name, make in makers.items():
        if name in METHODS:
            print(f"{name}: tau {tau(model, tok, half_of(refs, METHODS.index(name)), make):.2f} (3 prompts)", flush=True)
        else:
            print(f"{name}: tau {tau(model, tok, refs, make):.2f}", flush=True)
    first3 = dict(list(refs.items())[:3])
    for tree in ("chain:5", "5,8,32"):
        t = tau(model, tok, first3, lambda tree=tree: EagleDrafter.from_pretrained(model, tree=tree))
        print(f"full-vocabulary shipped EAGLE head {tree}, 3 prompts: tau {t:.2f}", flush=True)
    print("shipped draft agreement %.3f on %d positions" % agreement(draft, tok, refs))
    print("undistilled control agreement %.3f on %d positions" % agreement(build_draft(model, [0, 1]), tok, refs))


if __name__ == "__main__":
    main()
