"""The vanilla decode loop on tiny models: greedy equals a cache-free argmax loop, sampling has p's law."""

import pytest
import torch

from minispec import generate, load
from minispec.sampling import probs


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@torch.no_grad()
def _reference_greedy(model, ids, n):
    """Recompute the whole sequence every step (no KV cache): the plainest possible decoder."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_greedy_equals_cache_free_reference(name):
    model, tok = load(name)
    for prompt in ["Hello, world", "def f(x):", "12 + 30 ="]:
        r = generate(model, tok, prompt, max_new_tokens=40)
        assert r.tokens == _reference_greedy(model, tok.encode(prompt), 40)
        assert r.stats.new_tokens == 40 and r.stats.target_forwards == 40 and r.stats.tau == 1.0
        assert r.stats.tokens_per_s > 0 and r.text == tok.decode(r.tokens)


def test_sampling_is_seeded_and_reproducible(tiny):
    model, tok = tiny
    a = generate(model, tok, "abc", temperature=1.0, top_p=0.9, max_new_tokens=20, seed=7).tokens
    b = generate(model, tok, "abc", temperature=1.0, top_p=0.9, max_new_tokens=20, seed=7).tokens
    c = generate(model, tok, "abc", temperature=1.0, top_p=0.9, max_new_tokens=20, seed=8).tokens
    assert a == b and a != c


def test_sampling_params_built_once_decode_as_the_three_numbers(tiny):
    from minispec import SamplingParams
    from minispec.batch import generate_batch

    model, tok = tiny
    sp = SamplingParams(1.0, 5, 0.9)
    a = generate(model, tok, "abc", temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=20, seed=3).tokens
    assert generate(model, tok, "abc", params=sp, max_new_tokens=20, seed=3).tokens == a
    rs, _ = generate_batch(model, tok, ["abc", "xy"], params=sp, max_new_tokens=20, seed=[3, 4])
    ref, _ = generate_batch(model, tok, ["abc", "xy"], temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=20, seed=[3, 4])
    assert [r.tokens for r in rs] == [r.tokens for r in ref]
    with pytest.raises(TypeError, match="not both"):
        generate(model, tok, "abc", params=sp, temperature=0.5)
    with pytest.raises(TypeError, match="not both"):
        generate_batch(model, tok, ["abc"], params=sp, top_p=0.5)


def test_first_sampled_token_has_the_target_distribution(tiny):
    """The empirical law of the first new token over many seeds matches p (top-k keeps the support small)."""
    model, tok = tiny
    ids = tok.encode("xyz")
    with torch.no_grad():
        p = probs(model(torch.tensor([ids])).logits[0, -1], temperature=1.0, top_k=8)
    n = 3000
    counts = torch.zeros_like(p)
    for s in range(n):
        counts[generate(model, tok, ids, temperature=1.0, top_k=8, max_new_tokens=1, seed=s).tokens[0]] += 1
    tv = 0.5 * (counts / n - p).abs().sum().item()
    # 8 categories, 3000 samples: E[TV] ~ 0.02; a wrong distribution (e.g. no top-k, or greedy) is far above
    assert tv < 0.05, tv


def test_stops_at_eos():
    model, tok = load("tiny-gpt2")
    r = generate(model, tok, "hi", max_new_tokens=30)
    eos = r.tokens[5]
    model.cfg.eos_token_id = eos
    try:
        r2 = generate(model, tok, "hi", max_new_tokens=30)
        assert r2.tokens == r.tokens[: r.tokens.index(eos) + 1]
        assert len(generate(model, tok, "hi", max_new_tokens=30, stop_at_eos=False).tokens) == 30
    finally:
        model.cfg.eos_token_id = None


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(prompt=""), "empty"), (dict(prompt=" \n "), "empty"),
    (dict(prompt=[]), "empty"),
    (dict(prompt="x" * 500), "exceeds the model's context of 512"),
    (dict(prompt=[1, 2, 999]), r"token ids must be in \[0, 256\)"),
])
def test_bad_input_raises_clear_errors(tiny, kwargs, match):
    model, tok = tiny
    kwargs = {"prompt": "hello", **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, tok, kwargs.pop("prompt"), max_new_tokens=kwargs.pop("max_new_tokens", 16), **kwargs)


def test_decode_time_is_split_into_phases(tiny):
    """GenerationStats.phase_s accounts for the whole decode time, and each step's node count is kept."""
    from minispec.drafters import PromptLookup
    from minispec.generate import PHASES

    model, tok = tiny
    for drafter in (None, PromptLookup(k=4)):
        s = generate(model, tok, "abcabcabcabc", drafter=drafter, max_new_tokens=24, chat=False).stats
        assert set(s.phase_s) == set(PHASES) and all(v >= 0 for v in s.phase_s.values())
        assert abs(sum(s.phase_s.values()) - s.decode_s) < 1e-9
        assert s.phase_s["target"] > 0 and len(s.nodes) == s.target_forwards - 1
        assert (sum(s.nodes) > 0) == (drafter is not None)
        assert (s.phase_s["draft"] > 0) == (drafter is not None)


def test_profile_command_on_a_tiny_model(tmp_path):
    import json
    import subprocess
    import sys

    import os

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "minispec", "profile", "--model", "tiny-llama", "--methods", "vanilla,pld",
                        "--prompts", "2", "--max-new-tokens", "16", "--sizes", "0,2", "--reps", "1", "--threads", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, MINISPEC_CACHE=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["copy_bandwidth_gb_s"] > 0 and res["weight_bytes"] > 0 and set(res["verify_ms"]) == {"0", "2"}
    # (no auto: without a saved choice it is DEFAULT_AUTO, an EAGLE head, which no tiny model ships; tests/test_auto.py
    # covers how auto resolves)
    assert set(res["methods"]) == {"vanilla", "pld"} and res["methods"]["vanilla"]["tau"] == 1.0
    assert res["device"]["cpu"] and "vanilla" in r.stdout and "floor" in r.stdout
    assert res["device"]["linear_kernel"] in ("auto: panels", "auto: onednn", "panels", "onednn")  # the kernel that ran
    assert res["peak_gflop_s"] > 0 and res["flop_per_row"] == res["weight_bytes"] // 2  # fp32: 4 bytes, 2 FLOP
    floor = res["compute_floor_ms"]
    assert floor["2"] == pytest.approx(3 * floor["0"])  # (N + 1) rows
    assert res["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0} and "decode steps: greedy" in r.stdout
    b = res["breakdown"]
    assert b["aten_ops"] > 0 and "ATen ops per forward" in r.stdout and "of the floor" in r.stdout
    assert b["small_op_us"]["hot"] > 0 and b["small_op_us"]["after_weight_stream"] > 0
    assert b["eager_floor_ms"] > 0 and "eager floor" in r.stdout


@pytest.mark.parametrize("kernel", ["panels", "onednn"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_the_eager_floor_times_the_same_architecture_with_its_widths_shrunk(name, kernel, monkeypatch):
    """``profile.eager_floor``'s model keeps what makes the ops (layers, heads, KV heads, head dim, context,
    attention backend, architecture) and shrinks what makes the weight bytes; its forward runs the same ATen ops
    by name as the model's own, under either kernel and whatever row recipes this CPU's probes choose per shape:
    here the probes are made to choose a split of the input features at the target's width and padding
    rows at any other, as two CPUs might."""
    from collections import Counter

    from torch.profiler import profile as torch_profile

    import minispec
    from minispec.exact import recipes as invariance
    from minispec.exact.linear import ExactLinear as Linear
    from minispec.lab import profile

    wide = 64  # both tiny models' width
    monkeypatch.setattr(Linear, "cpu_kernel", kernel)
    monkeypatch.setattr(invariance, "_RECIPES", {})
    monkeypatch.setattr(invariance, "choose_recipe", lambda kernel, fn, split_fn, n_in, dtype, device: (
        invariance.RowRecipe(kernel, 2, 1, (1,)) if n_in == wide else invariance.RowRecipe(kernel, 1, 4, (1, 2, 3))))
    target, _ = minispec.load(name)
    assert target.cfg.d_model == wide
    small = profile.shrunk_model(target)
    keep = ("arch", "n_layer", "n_head", "n_kv_head", "head_dim", "max_seq_len", "norm_eps", "rope_theta")
    assert all(getattr(small.cfg, k) == getattr(target.cfg, k) for k in keep)
    assert (small.cfg.d_model, small.cfg.d_ff, small.cfg.vocab_size) == (32, 32, 64)
    streamed = [sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear)) for model in (small, target)]
    assert streamed[0] < streamed[1] / 4  # the weights a forward streams

    def ops(model):
        with torch.inference_mode():
            forward = profile._decode_forward(model, 24)
            forward()  # the weights packed, the plans chosen
            with torch_profile() as prof:
                forward()
        return Counter(e.name for e in prof.events() if e.cpu_parent is None)

    assert ops(small) == ops(target)
    assert any(k[1] == wide and p.split == 2 for k, p in invariance.recipes().items())  # the target's recipe: a split
    assert profile.eager_floor(target, context=24, reps=3) > 0


def test_forward_breakdown_splits_a_forward_into_its_modules_own_time(monkeypatch):
    """Each section is a module kind's own time (its children's removed), the rest is what no hook saw (so
    the sections add up to the hooked forward), and the hooks are gone afterwards."""
    import time

    import minispec
    from minispec.lab import profile
    from minispec.model import RMSNorm

    target, _ = minispec.load("tiny-llama")
    real = RMSNorm.forward

    def slow(self, x):  # every norm takes 2 ms more: the norm section grows by that, no other section
        time.sleep(0.002)
        return real(self, x)

    b0 = profile.forward_breakdown(target, context=16, reps=3)
    monkeypatch.setattr(RMSNorm, "forward", slow)
    b = profile.forward_breakdown(target, context=16, reps=3)
    norms = sum(isinstance(m, RMSNorm) for m in target.modules())
    assert set(b["section_ms"]) == set(profile.SECTIONS)
    # every sleep lands in the norm section: a lower bound that no noise on the machine can break (a difference
    # against b0 could, when b0's own norm time came out high), and one that fails when a norm's time is left in
    # its parent or counted elsewhere
    assert b["section_ms"]["norm"] >= 2 * norms
    assert b["section_ms"]["attention"] < b0["section_ms"]["attention"] + norms  # not the attention's: < half the sleeps
    assert sum(b["section_ms"].values()) == pytest.approx(b["hooked_forward_ms"])
    assert b["section_ms"]["rest"] > 0  # no time counted twice (a child's time left in its parent's)
    assert b["forward_ms"] >= 2 * norms  # the forward without hooks is timed too
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in target.modules())
    # the ops counted by name: one rsqrt per norm of a one-row forward (the norm is written out), all of them
    # adding up to aten_ops
    assert b0["ops_by_name"]["aten::rsqrt"] == norms and sum(b0["ops_by_name"].values()) == b0["aten_ops"]
    counts = list(b0["ops_by_name"].values())
    assert counts == sorted(counts, reverse=True)
    assert "most called: " in profile.format_breakdown(b0, 1.0)[-1]


def test_step_breakdown_decodes_with_the_sampling_it_is_given(monkeypatch):
    """profile's phases come from generate runs with the given SamplingParams and one seed for every
    method (greedy: no seed), warm-up included."""
    import minispec
    from minispec.lab.profile import step_breakdown
    from minispec.sampling import SamplingParams

    target, tok = minispec.load("tiny-llama")
    seen, real = [], minispec.generate
    monkeypatch.setattr(minispec, "generate", lambda *a, **kw: seen.append((kw["params"], kw["seed"])) or real(*a, **kw))
    params = SamplingParams(0.7, 5, 0.9)
    step_breakdown(target, tok, ["hi", "abc"], {"vanilla": None}, 6, params, seed=3)
    assert seen == [(params, 3)] * 3  # the warm-up and the two prompts
    seen.clear()
    step_breakdown(target, tok, ["hi"], {"vanilla": None}, 6)
    assert seen == [(SamplingParams(), None)] * 2


def test_profile_command_sampled_and_its_bad_sampling_arguments(tmp_path):
    """``profile --temperature``: the phases of sampled (seeded) steps; bad sampling parameters are
    refused before any model loads, with the parameter named."""
    import json
    import subprocess
    import sys

    out = tmp_path / "p.json"
    base = [sys.executable, "-m", "minispec", "profile", "--model", "tiny-llama", "--methods", "vanilla,pld",
            "--prompts", "1", "--max-new-tokens", "12", "--sizes", "0", "--reps", "1", "--threads", "1"]
    r = subprocess.run(base + ["--temperature", "0.7", "--top-k", "20", "--json", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 1.0}
    assert "sampled (temperature 0.7, top_k 20, top_p 1.0), seeded" in r.stdout
    assert res["methods"]["vanilla"]["phase_ms"]["verify"] > 0
    for bad, name in (["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top_p"):
        r = subprocess.run(base + bad, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and name in r.stderr, r.stderr


@torch.no_grad()
def _plain_loop(model, ids, n, params, gen):
    """Vanilla decoding written out, without a drafter or a verifier: prefill, then one token per forward,
    each drawn from p with the sequence's generator (the draws the empty tree's verification makes)."""
    from minispec.kv import KVCache
    from minispec.sampling import next_token
    from minispec.verify import TorchChooser

    kv = KVCache.for_model(model, len(ids) + n)
    logits = model(torch.tensor([ids]), kv=kv).logits[0, -1]
    kv.commit()
    out = [int(next_token(logits, params, gen))]
    while len(out) < n:
        logits = model(torch.tensor([[out[-1]]]), kv=kv).logits[0, -1]
        kv.commit()
        p = logits if params.greedy else probs(logits, params).double()  # [V]
        out.append(int(p.argmax()) if params.greedy else TorchChooser(gen).categorical(p))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_vanilla_is_the_drafter_that_proposes_the_empty_tree(tiny, temperature):
    """``drafter=None`` decodes with ``Vanilla()``: the same tokens as an explicit ``Vanilla()`` and as the
    plain loop (one token per forward, sampled with the same generator), tau 1, no draft phase."""
    from minispec.drafters import Vanilla
    from minispec.sampling import SamplingParams

    model, tok = tiny
    for prompt in ["Hello, world", "12 + 30 ="]:
        a = generate(model, tok, prompt, max_new_tokens=24, temperature=temperature, seed=5, chat=False,
                     stop_at_eos=False)
        b = generate(model, tok, prompt, drafter=Vanilla(), max_new_tokens=24, temperature=temperature, seed=5,
                     chat=False, stop_at_eos=False)
        ref = _plain_loop(model, tok.encode(prompt), 24, SamplingParams(temperature),
                          torch.Generator().manual_seed(5))
        assert a.tokens == b.tokens == ref
        assert a.stats.tau == 1.0 and a.stats.draft_forwards == 0 and a.stats.phase_s["draft"] == 0
        assert a.stats.nodes == [0] * 23 and a.stats.acceptance_by_position == []


def test_per_depth_acceptance_is_pooled_by_one_function():
    """add_by_depth / acceptance_by_depth: runs of different depths pooled depth by depth (bench, cost_check
    and the training measurement use them), as GenerationStats.record counts one tree."""
    from minispec.generate import GenerationStats, acceptance_by_depth, add_by_depth
    from minispec.tree import Tree

    tested, accepted = [], []
    for t, a in (([3, 2], [2]), ([1, 1, 1], [1, 1]), ([], [])):
        add_by_depth(tested, t)
        add_by_depth(accepted, a)
    assert tested == [4, 3, 1] and accepted == [3, 1]
    assert acceptance_by_depth(tested, accepted) == [0.75, 1 / 3, 0.0]
    s = GenerationStats()
    s.record(Tree([1, 2, 3, 4], [-1, 0, 1, -1]), [0])  # depth 3 tree, one accepted: depths 1, 2 tested
    s.record(Tree([1, 2], [-1, 0]), [0, 1])  # a chain of 2 all accepted
    assert s.tested_at_depth == [2, 2] and s.accepted_at_depth == [2, 1]
    assert s.acceptance_by_position == [1.0, 0.5]
