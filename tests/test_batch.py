"""Batched decoding (chapter 7, ``minispec.batch``): B sequences of different lengths in one target
forward per step, each accepting its own path, finished ones leaving the batch.

The claim is strong: every sequence of a batch computes, bit for bit, what it computes alone, so
greedy answers equal unbatched ones and sampled answers equal unbatched ones drawn with the same
seed; ``test_batched_sampling_has_the_targets_law`` checks the batched samples' law directly.
"""

import ast
from pathlib import Path

import pytest
import torch

from lawcheck import Sampled, assert_same_law, exact_law
from minispec import generate, load
from minispec.batch import BatchDecoder, generate_batch, prefill_groups
from minispec.drafters import DraftModel, PromptLookup
from minispec.tokenizer import encode_prompt

PROMPTS = ["abcabcabc abc ab", "the cat", "x", "a quick brown fox jumps over the lazy dog, a quick brown",
           "0101010", "hello hello hello world"]


@pytest.fixture(scope="module")
def tiny():
    (model, tok), (draft, _) = load("tiny-llama"), load("tiny-gpt2-draft")
    return model, tok, draft


def _alone(model, tok, prompts, make, **kw):
    return [generate(model, tok, p, drafter=make(), **kw).tokens for p in prompts]


@pytest.mark.parametrize("name", ["vanilla", "lookup", "chain", "tree", "mixed"])
@pytest.mark.parametrize("block_size", [3, 16])
def test_batched_greedy_equals_each_sequence_alone(tiny, name, block_size):
    """Prompts of 1 to 20+ tokens, chains and branching trees (and a batch mixing drafters): every
    answer equals its unbatched greedy answer; EOS-free lengths differ, so sequences leave early."""
    model, tok, draft = tiny
    makers = {"vanilla": lambda: None, "lookup": lambda: PromptLookup(k=4),
              "chain": lambda: DraftModel(draft, k=3), "tree": lambda: DraftModel(draft, tree="3,2,6")}
    if name == "mixed":
        drafters = [makers[n]() for n in ("lookup", "chain", "tree", "lookup", "chain", "tree")]
        want = [generate(model, tok, p, drafter=d, max_new_tokens=30).tokens
                for p, d in zip(PROMPTS, [makers[n]() for n in ("lookup", "chain", "tree") * 2])]
        got, batch = generate_batch(model, tok, PROMPTS, drafter=drafters, max_new_tokens=30, kv_block_size=block_size)
    else:
        want = _alone(model, tok, PROMPTS, makers[name], max_new_tokens=30)
        got, batch = generate_batch(model, tok, PROMPTS, drafter=None if name == "vanilla" else makers[name],
                                    max_new_tokens=30, kv_block_size=block_size)
    assert [r.tokens for r in got] == want
    assert batch.kv.free_list and len(batch.kv.free_list) == batch.kv.n_blocks  # every block back in the pool
    assert max(batch.rows_per_step) == len(PROMPTS)
    if name != "vanilla":
        assert any(r.stats.tau > 1 for r in got)  # speculation did accept drafts


def test_prefill_groups_prompts_of_similar_lengths_and_pads_little():
    lengths = [192, 20, 24, 180, 60, 22, 64, 190, 1]
    groups = prefill_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))  # every prompt once
    for g in groups:
        assert len(g) * max(lengths[b] for b in g) <= 1.25 * sum(lengths[b] for b in g)  # padded rows / tokens
    assert sorted(map(sorted, groups)) == [[0, 3, 7], [1, 2, 5], [4, 6], [8]]  # 1 would pad 20-token rows to 20
    assert prefill_groups([7] * 5) == [[0, 1, 2, 3, 4]] and prefill_groups([]) == []
    assert len(prefill_groups(lengths, padding=100.0)) == 1


def test_the_prefill_runs_one_forward_per_group_of_similar_prompts(tiny, monkeypatch):
    """``BatchDecoder.prefill`` follows ``prefill_groups`` (each sequence's answer stays its own: the tests above)."""
    model, tok, _ = tiny
    ids = [encode_prompt(tok, p, chat=False) for p in PROMPTS]
    batch = BatchDecoder(model, ids, max_new_tokens=4)
    seen = []
    forward = batch._forward
    monkeypatch.setattr(batch, "_forward", lambda rows, **kw: seen.append(sorted(rows)) or forward(rows, **kw))
    batch.prefill()
    assert seen == [sorted(g) for g in prefill_groups([len(i) for i in ids])] and len(seen) > 1


def test_sequences_leave_the_batch_when_they_finish(tiny):
    """Different token budgets (through EOS ids) finish sequences at different steps: the forward's
    rows shrink and the finished sequence's blocks return to the pool at once."""
    model, tok, draft = tiny
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    first = generate(model, tok, ids[1], max_new_tokens=6, chat=False, stop_at_eos=False).tokens
    batch = BatchDecoder(model, ids, [DraftModel(draft, k=2) for _ in ids], max_new_tokens=12, eos={first[2]},
                         block_size=4)
    batch.prefill()
    steps = []
    while not batch.done:
        batch.step()
        steps.append(len(batch.active()))
        for b, dec in enumerate(batch.decs):
            if dec.done:
                assert batch.kv.tables[b] == [] and batch.kv.lengths[b] == 0
    assert batch.decs[1].new[-1] == first[2] and len(batch.decs[1].new) <= 3  # stopped at its "EOS"
    rows = batch.rows_per_step
    assert rows == sorted(rows, reverse=True) and rows[-1] < 4  # the batch only shrinks
    for dec, x in zip(batch.decs, ids):  # and each answer is still what the sequence alone gives
        alone = generate(model, tok, x, drafter=DraftModel(draft, k=2), max_new_tokens=12, chat=False, stop_at_eos=False)
        cut = alone.tokens
        if first[2] in cut:
            cut = cut[:cut.index(first[2]) + 1]
        assert dec.new == cut


@pytest.mark.parametrize("kv", ["paged", "rows"])
def test_waiting_prompts_take_the_rows_of_finished_sequences_and_each_answer_stays_its_own(tiny, kv):
    """Continuous batching: six prompts with budgets of 2 to 30 tokens on a cache of two rows (``max_rows=2``).
    While prompts wait, every step's forward is full (a finished sequence's row went to the next prompt at
    once); no forward has more than two rows; and each answer, greedy with a draft chain or sampled with
    its seed, equals the sequence alone."""
    model, tok, draft = tiny
    ids = [encode_prompt(tok, p, chat=False) for p in PROMPTS]
    budgets = [3, 17, 5, 9, 2, 30]
    batch = BatchDecoder(model, ids, [DraftModel(draft, k=2) for _ in ids], max_new_tokens=budgets, kv=kv, max_rows=2)
    assert batch.kv.batch_size == 2
    batch.prefill()
    full = []
    while not batch.done:
        batch.step()
        if batch.waiting:
            full.append(len(batch.active()) == 2)
    assert full and all(full) and max(batch.rows_per_step) == 2 and not batch.row_of
    assert any(dec.stats.tau > 1 for dec in batch.decs)  # the drafts were accepted
    for dec, x, n in zip(batch.decs, ids, budgets):
        alone = generate(model, tok, x, drafter=DraftModel(draft, k=2), max_new_tokens=n, chat=False, stop_at_eos=False)
        assert dec.new == alone.tokens
    seeds = list(range(20, 20 + len(PROMPTS)))
    want = [generate(model, tok, p, drafter=PromptLookup(k=3), max_new_tokens=12, temperature=0.8, seed=s).tokens
            for p, s in zip(PROMPTS, seeds)]
    got, batch = generate_batch(model, tok, PROMPTS, drafter=lambda: PromptLookup(k=3), max_new_tokens=12,
                                temperature=0.8, seed=seeds, kv=kv, max_rows=4)
    assert [r.tokens for r in got] == want and max(batch.rows_per_step) <= 4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_rows must be a positive number"):
            generate_batch(model, tok, PROMPTS, max_new_tokens=4, kv=kv, max_rows=bad)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_batched_sampling_equals_each_sequence_alone_with_its_seed(tiny, temperature, top_p):
    model, tok, draft = tiny
    seeds = list(range(10, 10 + len(PROMPTS)))
    for make in (lambda: None, lambda: DraftModel(draft, tree="3,2,6"), lambda: PromptLookup(k=3)):
        want = [generate(model, tok, p, drafter=make(), max_new_tokens=25, temperature=temperature, top_p=top_p,
                         seed=s).tokens for p, s in zip(PROMPTS, seeds)]
        got, _ = generate_batch(model, tok, PROMPTS, drafter=make, max_new_tokens=25, temperature=temperature,
                                top_p=top_p, seed=seeds)
        assert [r.tokens for r in got] == want


def test_batched_sampling_has_the_targets_law(tiny):
    """The batched loop's own samples: the first three tokens of 2,000 sequences sampled in batches of
    8 with a branching draft tree (top-k 3: 27 outcomes) against the target's exactly computed joint
    law; chi-square does not reject it and TV is small (``lawcheck``, as for the unbatched loop)."""
    model, tok, draft = tiny
    params = dict(temperature=0.7, top_k=3)
    ids = tok.encode("abcabc ab")
    exact = exact_law(model, ids, params)
    counts, n, B, tested = dict.fromkeys(exact, 0), 2000, 8, 0
    for start in range(0, n, B):
        got, _ = generate_batch(model, tok, [ids] * B, drafter=lambda: DraftModel(draft, tree="3,2,6"), chat=False,
                                max_new_tokens=3, seed=[start + j for j in range(B)], stop_at_eos=False, **params)
        for r in got:
            counts[tuple(r.tokens)] += 1  # KeyError: an impossible sequence
            tested += sum(r.stats.tested_at_depth)
    assert tested > n / 2  # the drafters really proposed
    assert_same_law(Sampled(counts, n, tested, 0), exact)


def test_bad_batches_raise_clear_errors(tiny):
    model, tok, draft = tiny
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(model, tok, ["ab", "  "], max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty list"):
        generate_batch(model, tok, "ab", max_new_tokens=4)
    with pytest.raises(ValueError, match="2 prompts need 2 drafters"):
        generate_batch(model, tok, ["ab", "cd"], drafter=[PromptLookup()], max_new_tokens=4)
    shared = PromptLookup()
    with pytest.raises(ValueError, match="drafter of its own"):
        generate_batch(model, tok, ["ab", "cd"], drafter=[shared, shared], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate_batch(model, tok, ["ab", "cd" * 5000], max_new_tokens=4)
    with pytest.raises(ValueError, match="one seed or 2 seeds"):
        generate_batch(model, tok, ["ab", "cd"], max_new_tokens=4, seed=[1, 2, 3], temperature=1.0)


def test_ragged_forward_rows_equal_single_forwards(tiny):
    """The model's forward on a ragged plan: each row's logits equal that sequence's forward alone, bit for bit."""
    from minispec.attention.plan import prepare_ragged
    from minispec.kv import KVCache, PagedKVCache

    model, tok, _ = tiny
    seqs = [tok.encode(p) for p in PROMPTS[:3]]
    kv = PagedKVCache.for_model(model, 64, batch_size=3, block_size=4)
    T = max(map(len, seqs))
    x = torch.zeros(3, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, :len(s)] = torch.tensor(s)
    with torch.inference_mode():
        plan = prepare_ragged(3, T, x.device, kv, {b: len(s) for b, s in enumerate(seqs)})
        out = model(x, kv=kv, plan=plan, last_logits_only=False)
        last = model.lm_head(plan.last(out.hidden))  # [3, 1, V]: each row's last real token
        for b, s in enumerate(seqs):
            alone = model(torch.tensor([s]), kv=KVCache.for_model(model, 64))
            assert torch.equal(out.logits[b, :len(s)], alone.logits[0])
            assert torch.equal(last[b, 0], alone.logits[0, -1])
        kv.commit()
        with pytest.raises(TypeError, match="paged KV cache"):
            prepare_ragged(3, T, x.device, KVCache.for_model(model, 64), {0: 1, 1: 1, 2: 1})
        with pytest.raises(ValueError, match="new tokens for each"):
            prepare_ragged(3, T, x.device, kv, {0: 1, 1: T + 1, 2: 1})
        assert kv.pending == 0


@pytest.mark.slow
def test_smollm2_batched_eagle2_equals_alone_on_own_prompts(smollm2):
    """8 of minispec's own prompts (chat, code, math, knowledge, writing; of different lengths) in a
    batch of 8 with the shipped EAGLE-2 head drafting dynamic trees: every greedy answer equals the
    prompt decoded alone. (Own prompts, not Spec-Bench: the test runs in any checkout.)"""
    from minispec.methods import Methods
    from minispec.prompts import own_prompts

    model, tok = smollm2
    lengths, prompts = set(), []
    for q in own_prompts():
        n = len(encode_prompt(tok, q["prompt"]))
        if n not in lengths and len(prompts) < 8:
            lengths.add(n)
            prompts.append(q["prompt"])
    d = Methods(model).drafter("eagle2@4/4/16")
    want = [generate(model, tok, p, drafter=d, max_new_tokens=20).tokens for p in prompts]
    got, batch = generate_batch(model, tok, prompts, drafter=d, max_new_tokens=20)
    assert len({len(r.prompt_tokens) for r in got}) == len(prompts)  # all different lengths
    assert [r.tokens for r in got] == want
    assert sum(r.stats.new_tokens for r in got) / sum(r.stats.target_forwards for r in got) > 1.3


# ----------------------------------------------------------------------------- BatchDecoder and Decoder
_DECODER_STATE = {"new", "stats", "drafter", "gen", "params", "kv", "runner", "max_new_tokens", "eos"}


def _reaches_into_decoders(source: str) -> list[str]:
    """Where ``source`` (batch.py) reads a ``_``-prefixed attribute of anything but ``self``, or, inside
    ``BatchDecoder``, assigns an attribute of another object or reads a Decoder's state (``dec.new``, ...)."""
    out = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            out.append(f"line {node.lineno}: private .{node.attr}")
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BatchDecoder"):
        for node in ast.walk(cls):
            if not isinstance(node, ast.Attribute) or (isinstance(node.value, ast.Name) and node.value.id == "self"):
                continue
            if isinstance(node.ctx, ast.Store):
                out.append(f"line {node.lineno}: assigns .{node.attr} of another object")
            elif node.attr in _DECODER_STATE:
                out.append(f"line {node.lineno}: reads a Decoder's .{node.attr}")
    return out


def test_batch_touches_no_private_attribute_of_a_decoder():
    """BatchDecoder only batches the target's forward: each sequence's work goes through the Decoder's
    public steps (start, propose, inputs, verify, advance, result), never its private attributes."""
    import minispec.batch

    assert _reaches_into_decoders(Path(minispec.batch.__file__).read_text()) == []
    old = ("class BatchDecoder:\n    def prefill(self):\n        for dec in self.decs:\n"
           "            dec.new = [1]\n            dec.drafter.prefill(dec.ids, dec._features(out, 0))\n"
           "            dec.stats.tokens_per_step.append(1)\n")
    assert len(_reaches_into_decoders(old)) == 4  # the rule sees what batch.py used to do
