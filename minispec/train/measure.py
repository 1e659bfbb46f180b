"""The measurement a trained head's record keeps: greedy decoding with ``minispec.generate``.

tau = new tokens / target forwards (prefill counted as one forward, as in ``GenerationStats.tau``)
of each drafter against vanilla decoding on the same prompts, the acceptance rate at each draft
depth, and whether every output equals vanilla (greedy speculative decoding must reproduce it).
``train eagle``, ``train eagle3`` and ``train medusa`` call ``record_measurement`` after training
(``--measure``, the default) or alone (``--measure-only``).

Shapes: none (counts and rates).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .loop import write_record


@torch.inference_mode()
def measure(target, tok, drafters: dict, prompts: list, max_new_tokens: int = 128) -> dict:
    """Greedy ``minispec.generate`` with each drafter on ``prompts``: tau (new tokens / target
    forwards, prefill included), acceptance by depth, and whether every output equals vanilla.

    Args:
        drafters: name -> zero-argument factory of a fresh drafter.
        prompts: texts (chat template applied) or token-id lists (used as they are).
    Returns:
        {name: {"tau", "acceptance_by_position", "equal_to_vanilla", "new_tokens", "target_forwards", "decode_s"}}
    """
    from ..generate import acceptance_by_depth, add_by_depth, generate

    vanilla = [generate(target, tok, p, max_new_tokens=max_new_tokens) for p in prompts]
    out = {"vanilla": dict(tau=1.0, new_tokens=sum(v.stats.new_tokens for v in vanilla),
                           decode_s=round(sum(v.stats.decode_s for v in vanilla), 2))}
    for name, make in drafters.items():
        new = fwd = 0
        equal, tested, accepted, dec = True, [], [], 0.0
        for p, v in zip(prompts, vanilla):
            r = generate(target, tok, p, drafter=make(), max_new_tokens=max_new_tokens)
            equal &= r.tokens == v.tokens
            new, fwd, dec = new + r.stats.new_tokens, fwd + r.stats.target_forwards, dec + r.stats.decode_s
            add_by_depth(tested, r.stats.tested_at_depth)
            add_by_depth(accepted, r.stats.accepted_at_depth)
        out[name] = dict(tau=round(new / fwd, 3), equal_to_vanilla=equal, new_tokens=new, target_forwards=fwd,
                         acceptance_by_position=[round(a, 3) for a in acceptance_by_depth(tested, accepted)],
                         decode_s=round(dec, 2))
    return out


def measure_prompts(tok, held, n_heldout: int = 8, n_own: int = 4) -> tuple[list, dict]:
    """The measurement prompts: the first ``n_heldout`` held-out ShareGPT prompts (token ids, chat
    template included) and the first ``n_own`` of ``minispec.prompts.own_prompts()``."""
    from ..prompts import own_prompts

    ids = [s.tokens[:s.prompt_len].tolist() for s in held[:n_heldout]]
    own = [p["prompt"] for p in own_prompts()[:n_own]]
    return ids + own, dict(heldout_sharegpt=len(ids), own_prompts=len(own))


def record_measurement(args, target, tok, held, record: dict, name: str, default_out: Path, drafters: dict) -> dict:
    """Measure ``drafters`` (name -> factory) with ``measure`` on the held-out and own prompts, store the
    result and the command that reruns it in ``record["measured"]``, and rewrite the JSON record.

    Args:
        args: the trainer's flags (``out``, ``measure_tokens``).
        name: the trainer (``train <name> --measure-only`` reruns the measurement).
        default_out: the trainer's default ``--out`` (the rerun command names ``--out`` otherwise).
    Returns:
        the record.
    """
    prompts, sizes = measure_prompts(tok, held)
    res = measure(target, tok, drafters, prompts, args.measure_tokens)
    record["measured"] = dict(greedy=True, max_new_tokens=args.measure_tokens, prompts=sizes, results=res,
                              command=f"python -m minispec train {name} --measure-only" +
                                      ("" if args.out == default_out else f" --out {args.out}"))
    write_record(args.out, record)
    return record
