"""minispec.lab.joint_law: the packed next-token laws equal plain forwards, and the joint TV check
passes the right verifier (chapters 1-2's real-model checks; on SmolLM2 the notebooks also assert
that a wrong verifier is flagged)."""

import pytest
import torch

from minispec.lab import exactness as ex
from minispec import load
from minispec.drafters import DraftModel
from minispec.lab.joint_law import (ALPHA, assert_loop_check, claim_uniform_q, first_tokens_law, flagged, joint_tv_check,
                                    loop_tv_check, next_token_laws, peek_verifier_stream, share_verifier_stream,
                                    table_lm)
from minispec.sampling import SamplingParams, probs


@pytest.mark.ch01
def test_packed_laws_equal_plain_forwards_and_the_right_verifier_passes():
    (target, tok), (draft, _) = load("tiny-gpt2"), load("tiny-gpt2-draft")
    params = SamplingParams(temperature=1.0, top_k=3)
    ids = tok.encode("abc")
    laws = next_token_laws(target, ids, [(), (5,), (5, 7)], params)
    with torch.inference_mode():
        for ctx, law in laws.items():
            plain = probs(target(torch.tensor([ids + list(ctx)])).logits[0, -1].double(), params)
            assert (plain - law).abs().max() <= 1e-5, ctx
    lm = table_lm(target, draft, ids, params, depth=1)
    law = ex.target_distribution(lm, 2)  # exact law of the first two tokens
    steps = {"chain": lambda lm, ctx, k, ch: ex.chain_step(lm, ctx, k, ch)}
    tv, bound, support, target_law = joint_tv_check(lm, law, steps, n=4000, length=2, k=1)
    assert len(support) == len(law) and abs(target_law.sum() - 1) < 1e-9
    assert tv["chain"]["tv"] <= bound


@pytest.mark.ch03
def test_first_tokens_law_is_the_product_of_plain_forwards():
    target, tok = load("tiny-gpt2")
    params = SamplingParams(temperature=1.0, top_k=3)
    ids = tok.encode("abc")
    law = first_tokens_law(target, ids, params, 2)
    assert len(law) == 9 and abs(sum(law.values()) - 1) < 1e-9
    with torch.inference_mode():
        p1 = probs(target(torch.tensor([ids])).logits[0, -1].double(), params)
        for (a, b), pab in law.items():
            p2 = probs(target(torch.tensor([ids + [a]])).logits[0, -1].double(), params)
            assert abs(pab - float(p1[a] * p2[b])) <= 1e-6, (a, b)


@pytest.mark.ch03
def test_loop_tv_check_passes_the_real_loop_and_flags_a_drafter_claiming_uniform_q():
    """The real decode loop (generate_batch) with a deterministic draft tree passes; the same drafter
    claiming its drafts came from a uniform q is flagged (it then emits the draft's favourites)."""
    target, tok = load("tiny-gpt2")
    draft, _ = load("tiny-gpt2")
    with torch.no_grad():  # a noisy copy of the target: its top-2 drafts are usually the target's top-2
        draft.lm_head.weight.add_(0.05 * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    params = SamplingParams(temperature=1.0, top_k=2)
    makers = {"tree": lambda: DraftModel(draft, tree="2,2,3"),
              "lying": lambda: claim_uniform_q(DraftModel(draft, tree="2,2,3"))}
    res, bound, support, exact = loop_tv_check(target, tok, tok.encode("abc"), makers, params, n=256, length=3,
                                               batch=64, progress=False)
    assert len(support) == 8 and exact[-1] == 0
    assert res["tree"]["tv"] <= bound and res["tree"]["counts"][-1] == 0 and res["tree"]["drafts_accepted"] > 0
    assert res["lying"]["tv"] > bound, (res["lying"]["tv"], bound)
    assert_loop_check({"tree": res["tree"], "WRONG: lying": res["lying"]}, bound)
    with pytest.raises(AssertionError, match="must be flagged"):
        assert_loop_check({"WRONG: not wrong": res["tree"]}, bound)
    with pytest.raises(AssertionError, match="an exact sampler must pass"):
        assert_loop_check({"lying, unlabelled": res["lying"]}, bound)


def _noisy_copy(target, scale=0.05):
    draft, _ = load("tiny-gpt2")
    with torch.no_grad():
        draft.lm_head.weight.add_(scale * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return draft


@pytest.mark.ch04
def test_a_drafter_that_reads_the_verifiers_coin_flips_is_flagged_and_company_changes_nothing():
    """The subtle control of chapters 4-5: the same deterministic trees, reordered only when the
    verifier's next uniform is high, bias the law; the chi-square test flags it while its TV
    stays under the TV bound's reach. Rows decoded beside other prompts (``company``: ragged
    prefixes and trees in the same forwards) keep the exact law."""
    target, tok = load("tiny-gpt2")
    draft = _noisy_copy(target)
    params = SamplingParams(temperature=1.0, top_k=3)
    makers = {"tree": lambda: DraftModel(draft, tree="3,2,6"),
              "WRONG: peeks": lambda: peek_verifier_stream(DraftModel(draft, tree="3,2,6"), band=0.3)}
    res, bound, support, exact = loop_tv_check(target, tok, tok.encode("abc"), makers, params, n=768, batch=128,
                                               progress=False, company=[tok.encode("a longer prompt, x"), [5]])
    assert len(support) == 27
    assert_loop_check(res, bound)
    assert res["WRONG: peeks"]["p_value"] < ALPHA and res["WRONG: peeks"]["tv"] <= bound  # subtle


@pytest.mark.ch04
def test_controls_are_tested_sequentially_until_flagged_at_a_level_split_over_the_looks():
    """``control_max``: a wrong control too subtle to be flagged at n runs gets looks at 2n, 4n, ...
    (each at ALPHA / looks, so an exact sampler stays flagged with probability <= 2 ALPHA over all
    of them) and stops at the first look that flags; honest runs take n and ALPHA; a blatant
    control stops at the first look."""
    target, tok = load("tiny-gpt2")
    draft = _noisy_copy(target)
    params = SamplingParams(temperature=1.0, top_k=3)
    makers = {"tree": lambda: DraftModel(draft, tree="3,2,6"),
              "WRONG: peeks": lambda: peek_verifier_stream(DraftModel(draft, tree="3,2,6"), band=0.3),
              "WRONG: lying": lambda: claim_uniform_q(DraftModel(draft, tree="3,2,6"))}
    with pytest.raises(ValueError, match="control_max"):
        loop_tv_check(target, tok, tok.encode("abc"), makers, params, n=128, control_max=64, progress=False)
    fixed, bound, _, _ = loop_tv_check(target, tok, tok.encode("abc"), makers, params, n=96, batch=96, progress=False)
    assert not flagged(fixed["WRONG: peeks"], bound)  # 96 runs are too few to see the subtle control
    res, bound, support, exact = loop_tv_check(target, tok, tok.encode("abc"), makers, params, n=96, batch=96,
                                               progress=False, control_max=1536)
    assert len(res["tree"]["draws"]) == 96 and "alpha" not in res["tree"]  # honest: fixed n, ALPHA
    peeks, lying = res["WRONG: peeks"], res["WRONG: lying"]
    assert peeks["looks"] == lying["looks"] == 5 and peeks["alpha"] == lying["alpha"] == ALPHA / 5
    assert len(lying["draws"]) == 96  # flagged at the first look
    assert len(peeks["draws"]) in (192, 384, 768, 1536) and flagged(peeks, None)
    assert peeks["bound"] == ex.tv_bound(len(peeks["draws"]), len(exact), delta=ALPHA / 5)
    assert (peeks["draws"][:96] == fixed["WRONG: peeks"]["draws"]).all()  # the same seeds, extended
    assert_loop_check(res, bound)


@pytest.mark.ch03
def test_a_drafter_sharing_the_verifiers_stream_is_flagged():
    """The subtle control of chapter 3: sampled drafts (real q) drawn from a copy of the verifier's
    generator; each draft still follows q, yet the emitted law is off."""
    target, tok = load("tiny-gpt2")
    draft = _noisy_copy(target, 0.3)
    params = SamplingParams(temperature=1.0, top_k=2)
    makers = {"chain": lambda: DraftModel(draft, k=2),
              "WRONG: shares the stream": lambda: share_verifier_stream(DraftModel(draft, k=2))}
    res, bound, support, exact = loop_tv_check(target, tok, tok.encode("abc"), makers, params, n=1024, batch=128,
                                               progress=False)
    assert res["chain"]["drafts_accepted"] > 0
    assert_loop_check(res, bound)
    assert res["WRONG: shares the stream"]["tv"] <= bound  # subtle: only the chi-square test sees it


def test_chi_square_p_merges_small_bins_and_matches_scipy():
    import numpy as np
    import scipy.stats

    law = np.array([0.5, 0.3, 0.15, 0.04, 0.01, 0.0])
    counts = np.array([52, 29, 14, 4, 1, 0])
    # bins 4 (expected 1) and 3 (4) merge into one of expected 5; the rest stand alone
    want = scipy.stats.chisquare([52, 29, 14, 5], [50, 30, 15, 5]).pvalue
    assert ex.chi_square_p(counts, law) == pytest.approx(want, rel=1e-12)
    assert ex.chi_square_p(np.array([52, 29, 14, 4, 0, 1]), law) == 0.0  # a draw where the law has no mass
    assert ex.chi_square_p(np.array([3, 2]), np.array([0.6, 0.4])) == 1.0  # one merged bin: nothing to test


@pytest.mark.parametrize("tv,K", [(0.1, 28), (0.05, 65), (0.5, 2), (0.01, 1000)])
def test_samples_for_tv_is_the_first_n_whose_bound_reaches_tv(tv, K):
    n = ex.samples_for_tv(tv, K)
    assert ex.tv_bound(n, K) <= tv < ex.tv_bound(n - 1, K)
    with pytest.raises(ValueError, match="tv must be"):
        ex.samples_for_tv(0.0, K)


def test_prefix_p_value_is_the_bonferroni_min_over_prefix_laws():
    import numpy as np
    import scipy.stats

    from minispec.lab.joint_law import prefix_p_value

    support = [(0, 0), (0, 1), (1, 0), (1, 1)]
    exact = np.array([0.25, 0.25, 0.25, 0.25, 0.0])
    draws = np.repeat([0, 1, 2, 3], [36, 34, 16, 14])  # token 1 leans to 0; token 2 fair given token 1
    p1 = scipy.stats.chisquare([70, 30], [50, 50]).pvalue
    p2 = scipy.stats.chisquare([36, 34, 16, 14], [25] * 4).pvalue
    assert p1 < p2
    assert prefix_p_value(draws, support, exact) == pytest.approx(2 * p1, rel=1e-12)
    assert prefix_p_value(np.repeat([0, 1, 2, 3], 25), support, exact) == 1.0  # min(1, 2 * 1)
    assert prefix_p_value(np.append(draws, 4), support, exact) == 0.0  # a sequence the target never emits
