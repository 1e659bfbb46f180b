"""``python -m minispec exactness``: every verifier, exactly and empirically, in one report.

Three parts, each a list of records:
    enumeration  exact law of one speculative step of every verifier on tiny vocabularies,
                 summed over all random outcomes (``minispec.lab.exactness``); pass: max abs
                 error <= 1e-12.
    empirical    first-token samples of every verifier on real model distributions: a
                 GPT-2-architecture target and draft (``gpt2`` / ``distilgpt2`` where a hub
                 or cache has them, else the seeded ``tiny-gpt2`` / ``tiny-gpt2-draft``), at
                 several temperatures with top-k / top-p truncation (support <= 20 tokens),
                 plus small synthetic pairs. Reduced draft vocabulary (FR-Spec, as the EAGLE
                 drafters use it, ``minispec.drafters.vocab``): q drafts over a subset that
                 misses every other token of p's top 20, so q = 0 where p > 0 and only the
                 residual can emit those tokens. Pass: TV below the stated bound and a chi-square
                 p-value above 0.001 / (number of settings) (Bonferroni).
                 Batched (chapter 7): the decode loop itself, ``minispec.batch.generate_batch``
                 with 32 rows per batch, each with its own draft-model chain or tree and seed;
                 the joint law of the first three tokens (top-k 3: 27 outcomes) on the seeded
                 tiny-gpt2 with a noisy copy of it as the draft; 10k samples in full mode (the loop drafts
                 row by row in Python), judged by the TV bound of that size and chi-square.
    controls     deliberately wrong verifiers (and, for the batched loop, drafters whose trees
                 lie about q); they must be flagged as failing and do not count toward the exit status.

Full mode (default): >= 100k samples per setting, TV bound 0.01. Fast mode (MINISPEC_FAST=1
or --fast): fewer samples, with the TV bound that sample size supports stated in the output.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import exactness as ex
from .text_table import Col, text_table
from ..config import fast
from ..sampling import SamplingParams, probs

MODEL_VERIFIERS = ("chain_k1", "chain_k2", "mss_replacement_n3", "mss_no_replacement_n3", "onehot_n3")
MODEL_SETTINGS = {  # name -> SamplingParams; top-k 20 keeps the support at most 20 tokens
    "t1.0_topk20": SamplingParams(1.0, 20, 1.0),
    "t0.7_topk20": SamplingParams(0.7, 20, 1.0),
    "t1.0_topk20_topp0.9": SamplingParams(1.0, 20, 0.9),
}
REDUCED_VOCAB = ("t1.0_topk20", "t0.7_topk20")  # settings also run with a reduced draft vocabulary
PROMPT = "The quick brown fox jumps over the lazy dog. Speculative decoding is"


def reduced_vocab(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """The draft's logits [V] over a reduced vocabulary: every other token of p's top 20 (ranks
    2, 4, ..., 20) is left out (-inf), as a frequency-ranked draft vocabulary leaves out rare
    tokens the target may still want."""
    out = lq.clone()
    out[lp.topk(20).indices[1::2]] = float("-inf")
    return out


def model_pair():
    """(target name, draft name, p logits [V], q logits [V]) at the end of PROMPT."""
    from ..loading import ModelNotFound, load

    try:
        (t, tok), (d, _) = load("gpt2"), load("distilgpt2")
        names = ("gpt2", "distilgpt2")
    except (ModelNotFound, OSError, ValueError):
        (t, tok), (d, _) = load("tiny-gpt2"), load("tiny-gpt2-draft")
        names = ("tiny-gpt2", "tiny-gpt2-draft")
    ids = tok.encode(PROMPT) if hasattr(tok, "encode") else tok(PROMPT)["input_ids"]
    with torch.no_grad():
        x = torch.tensor([ids])
        return (*names, t(x).logits[0, -1].double(), d(x).logits[0, -1].double())


def run_model_suite(n_samples: int, tv_limit: float | None, alpha: float, seed: int = 0):
    """Empirical first-token checks on real model distributions; returns (records, controls, models)."""
    tname, dname, lp, lq = model_pair()
    g = torch.Generator().manual_seed(seed)
    records, controls = [], []
    settings = [(s, params, lq) for s, params in MODEL_SETTINGS.items()] + \
               [(f"{s}_reduced_vocab", MODEL_SETTINGS[s], reduced_vocab(lp, lq)) for s in REDUCED_VOCAB]
    for sname, params, lq_s in settings:
        p, q = probs(lp, params), probs(lq_s, params)
        support = (p > 0).nonzero().flatten()  # compare on p's support (<= 20 tokens)
        for name, table, out in [(v, ex.VERIFIERS, records) for v in MODEL_VERIFIERS] + \
                                [(c, ex.CONTROLS, controls) for c in ex.CONTROLS]:
            program, _ = table[name]
            draw = ex.first_token_sampler(program)
            r = ex.empirical_check(draw, p, q, n_samples, g)
            counts = torch.tensor(r.pop("counts"))
            outside = int(counts.sum() - counts[support].sum())
            bound = tv_limit if tv_limit is not None else r["tv_bound"]
            r.update(verifier=name, setting=f"{tname}/{dname}/{sname}", support=len(support), tv_limit=bound,
                     passed=outside == 0 and r["tv"] < bound and r["p_value"] > alpha)
            out.append(r)
    return records, controls, (tname, dname)


BATCHED_DRAFTERS = {"batched_chain_k2": "chain:2", "batched_tree_2,2,4": "2,2,4"}  # name -> draft-model tree
BATCHED_COPYING = "batched_copying_k2"  # and the copying drafter (copies, else the draft model's chain:2)
BATCHED_PARAMS = SamplingParams(1.0, 3, 1.0)  # top-k 3: 27 outcomes of the first three tokens


def run_batched_suite(n_samples: int, alpha: float, seed: int = 0, batch: int = 32, control_samples: int | None = None):
    """The batched decode loop itself (chapter 7, ``minispec.batch``): the joint law of the first three
    tokens of sequences sampled ``batch`` at a time, each row with its own draft-model tree and seed,
    against the target's exact law (27 outcomes), by ``joint_law.loop_tv_check``. Token 1 comes from
    the prefill; tokens 2 and 3 from the first speculative step (a tree of depth 2 drafted after it,
    verified, plus the bonus). The controls are the same drafters made to claim a uniform q
    (``joint_law.claim_uniform_q``). The loop runs each row's drafter in Python, so this part takes
    fewer samples than the others and is judged by the TV bound of its own sample size; the controls
    take ``control_samples`` each (default ``n_samples``): a claimed uniform q is flagged by a margin
    of many orders of magnitude at a few hundred (chi-square p below 1e-20 at 320, alpha ~1e-5).
    Returns (records, controls)."""
    from ..drafters import CopyingDrafter, DraftModel
    from .joint_law import claim_uniform_q, first_tokens_law, loop_tv_check
    from ..loading import load

    (t, tok), (d, _) = load("tiny-gpt2"), load("tiny-gpt2")
    with torch.no_grad():  # the draft: a noisy copy of the target, so its drafts are often right (an
        g = torch.Generator().manual_seed(seed)  # unrelated tiny draft misses p's top 3: a bug would not show)
        d.lm_head.weight.add_(0.05 * torch.randn(d.lm_head.weight.shape, generator=g))
    drafters = {name: (lambda tree=tree: DraftModel(d, tree=tree)) for name, tree in BATCHED_DRAFTERS.items()}
    # the copying drafter: the prompt's own continuation after its last token's earlier occurrence (a
    # deterministic chain, one-hot q), else the draft model's chain (sampled, real q)
    drafters[BATCHED_COPYING] = lambda: CopyingDrafter(DraftModel(d, tree="chain:2"), k=2, min_ngram=1)
    wrong = {f"{name}_fake_uniform_q": (lambda make=make: claim_uniform_q(make(), t.cfg.vocab_size))
             for name, make in drafters.items()}
    law = first_tokens_law(t, tok.encode(PROMPT), BATCHED_PARAMS, 3)  # the exact law, computed once for both
    records, controls = [], []
    for makers, n, out in ((drafters, n_samples, records), (wrong, control_samples or n_samples, controls)):
        res, _, support, _ = loop_tv_check(t, tok, tok.encode(PROMPT), makers, BATCHED_PARAMS, n, length=3,
                                           batch=batch, seed=seed, law=law)
        bound = ex.tv_bound(n, len(support))  # K = the 27 outcomes, as in the committed full run
        for name, r in res.items():
            outside = int(r["counts"][-1])
            out.append(dict(
                verifier=name, setting=f"tiny-gpt2/noisy copy/t1.0_topk3/batch{batch}/3 tokens", samples=n,
                tv=r["tv"], tv_bound=bound, tv_limit=bound, p_value=r["p_value"], support=len(support),
                drafts_verified=r["drafts_tested"], drafts_accepted=r["drafts_accepted"],
                passed=bool(outside == 0 and r["tv"] < bound and r["p_value"] > alpha)))
    return records, controls


PARTS = ("enumeration", "empirical", "batched")


def run_all(full: bool, samples: int | None = None, seed: int = 0, parts=PARTS) -> dict:
    """Run the parts (all three by default); returns the report dict (``passed`` is the overall verdict)."""
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"parts must be among {PARTS}, got {parts}")
    n = samples or (100_000 if full else 4_000)
    n_model = len(MODEL_SETTINGS) + len(REDUCED_VOCAB)
    n_settings = n_model * len(MODEL_VERIFIERS) + len(ex.EMPIRICAL_VERIFIERS) + len(BATCHED_DRAFTERS) + 1  # + copying
    alpha = 0.001 / n_settings
    tv_limit = 0.01 if full else None  # fast mode: the sample-size bound of exactness.tv_bound
    enum, enum_controls, synth, synth_controls, model, model_controls, batched, batched_controls = [[]] * 8
    names = ("-", "-")
    if "enumeration" in parts:
        enum, enum_controls = ex.run_enumeration_suite(seed)
    if "empirical" in parts:
        synth, synth_controls = ex.run_empirical_suite(n_samples=n, seed=seed, control_samples=min(n, 5000))
        for r in synth:  # same verdict rule as the model suite
            r["tv_limit"] = tv_limit if tv_limit is not None else r["tv_bound"]
            r["passed"] = r["tv"] < r["tv_limit"] and r["p_value"] > alpha
        model, model_controls, names = run_model_suite(n, tv_limit, alpha, seed)
    if "batched" in parts:
        batched, batched_controls = run_batched_suite(10_000 if full else min(n, 800), alpha, seed,
                                                      control_samples=None if full else min(n, 320))
    controls = [dict(r, part="enumeration") for r in enum_controls] + \
               [dict(r, part="empirical") for r in synth_controls + model_controls] + \
               [dict(r, part="batched") for r in batched_controls]
    report = dict(
        mode="full" if full else "fast", parts=list(parts), samples_per_setting=n, models=dict(target=names[0], draft=names[1]),
        criteria=dict(enumeration_max_abs_error=ex.TOL, tv_limit=tv_limit if tv_limit is not None else
                      f"tv_bound(n={n}, V) = 0.5*sqrt(V/n) + sqrt(log(1e6)/(2n)), e.g. {ex.tv_bound(n, 20):.4f} for V=20",
                      chi_square_alpha=alpha, chi_square_correction=f"Bonferroni over {n_settings} empirical settings"),
        enumeration=enum, empirical=synth + model, batched=batched, controls=controls)
    report["passed"] = all(r["passed"] for r in enum + synth + model + batched)
    # a verifier is wrong if any one setting exposes it: each control must fail somewhere
    report["controls_flagged"] = {name: any(not r["passed"] for r in controls if r["verifier"] == name)
                                  for name in dict.fromkeys(r["verifier"] for r in controls)}
    return report


EMPIRICAL_COLUMNS = [Col("empirical setting", width=58, left=True), Col("verifier", width=22, left=True),
                     Col("TV", ".4f", 7), Col("limit", ".4f", 7), Col("p-value", ".3g", 8), Col(" verdict", left=True)]
CONTROL_COLUMNS = [Col("part", width=11, left=True), Col("verifier", width=28, left=True),
                   Col("setting", width=45, left=True), Col("statistic", width=22, left=True), Col("verdict", left=True)]


def format_report(rep: dict) -> str:
    enum = rep["enumeration"]
    lines = [f"exactness ({rep['mode']} mode, {rep['samples_per_setting']} samples per empirical setting; "
             f"models {rep['models']['target']} / {rep['models']['draft']}; parts {', '.join(rep['parts'])})"]
    if enum:
        worst = max(enum, key=lambda r: r["max_abs_error"])
        lines.append(f"enumeration: {sum(r['passed'] for r in enum)}/{len(enum)} pass; worst error "
                     f"{worst['max_abs_error']:.1e} ({worst['verifier']}, {worst['setting']}); "
                     f"limit {rep['criteria']['enumeration_max_abs_error']:.0e}")
    lines += text_table(EMPIRICAL_COLUMNS, [[r["setting"], r["verifier"], r["tv"], r["tv_limit"], r["p_value"],
                                             "PASS" if r["passed"] else "FAIL"]
                                            for r in rep["empirical"] + rep.get("batched", [])])
    lines.append("controls (deliberately wrong; must FAIL, not counted):")
    lines += text_table(CONTROL_COLUMNS, [[r["part"], r["verifier"], r["setting"], f"err {r['max_abs_error']:.2e}"
                                           if "max_abs_error" in r else f"TV {r['tv']:.3f} p {r['p_value']:.2g}",
                                           "FAIL" if not r["passed"] else "not detected here"]
                                          for r in rep["controls"]], indent="  ")
    lines.append(f"chi-square alpha {rep['criteria']['chi_square_alpha']:.2g} ({rep['criteria']['chi_square_correction']})")
    flagged = rep["controls_flagged"]
    lines.append(f"controls flagged as failing: {sum(flagged.values())}/{len(flagged)} "
                 f"({', '.join(n + ('' if f else ' NOT FLAGGED') for n, f in flagged.items())})")
    lines.append(f"overall: {'PASS' if rep['passed'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minispec exactness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print a machine-readable report")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help=">= 100k samples per setting, TV limit 0.01 (default unless MINISPEC_FAST=1)")
    mode.add_argument("--fast", action="store_true", help="fewer samples; the TV limit is the bound for that size")
    ap.add_argument("--samples", type=int, default=None, help="samples per empirical setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--out", default=None, help="also write the report, with the device and versions, to this JSON file")
    args = ap.parse_args(argv)
    full = args.full or not (args.fast or fast())
    rep = run_all(full, args.samples, args.seed, tuple(p.strip() for p in args.parts.split(",") if p.strip()))
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    status = 0 if rep["passed"] else 1
    if args.out:
        from .benchinfo import save_json

        command = "python -m minispec exactness " + " ".join(argv if argv is not None else sys.argv[1:])
        print(f"saved {save_json(args.out, dict(benchmark='exactness', command=command, exit_status=status, **rep))}")
    return status


if __name__ == "__main__":
    sys.exit(main())
