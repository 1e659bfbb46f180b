"""minispec.joint_law: the packed next-token laws equal plain forwards, and the joint TV check
passes the right verifier (chapters 1-2's real-model checks; on SmolLM2 the notebooks also assert
that a wrong verifier is flagged)."""

import pytest
import torch

from minispec import exactness as ex
from minispec import load
from minispec.joint_law import joint_tv_check, next_token_laws, table_lm
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
