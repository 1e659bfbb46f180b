"""minispec.joint_law: the packed next-token laws equal plain forwards, and the joint TV check
passes the right verifier (chapters 1-2's real-model checks; on SmolLM2 the notebooks also assert
that a wrong verifier is flagged)."""

import pytest
import torch

from minispec import exactness as ex
from minispec import load
from minispec.drafters import DraftModel
from minispec.joint_law import assert_loop_check, claim_uniform_q, first_tokens_law, joint_tv_check, loop_tv_check, next_token_laws, table_lm
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
    with pytest.raises(AssertionError, match="above the bound"):
        assert_loop_check({"lying, unlabelled": res["lying"]}, bound)
