"""Chapter 3 exercises: EAGLE feature drafting (the head's input, EAGLE-3's draft vocabulary, the loss, a chain,
the training-time test).

References:
    Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (2024):
        the head reads (embedding of the NEXT token, target feature) pairs and regresses the
        next feature, trained with SmoothL1 + 0.1 x cross-entropy.
    Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
        Training-Time Test" (2025): fused low/mid/high features, no feature loss, and a reduced
        draft vocabulary mapped back to the target's with ``d2t`` / ``t2d``.

Notation: x_0..x_{n-1} the tokens, f_t [H] the target's last hidden state (after its final
norm) at position t, i.e. the feature that produced the target's distribution of x_{t+1};
V the target vocabulary, Vd the draft vocabulary (EAGLE-3).

The library versions are ``minispec/drafters/eagle.py`` (``EagleHead``, ``EagleDrafter``),
``minispec/train/eagle.py`` (``eagle_loss``; ``unroll`` and ``ttt_loss``, the training-time test of
exercise 3.6) and ``minispec/drafters/eagle3.py`` (``build_vocab_map``, ``Eagle3Head.to_target_logits``).

Check your work: ``python -m minispec grade 3``, or ``minispec.grading.check("3.1")``, or
``pytest tests/test_exercises.py -m ch03 --impl exercises``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def eagle_input(embedding: torch.Tensor, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    """The EAGLE-1 head's input rows for a context: the shifted (token, feature) pairs.

    Each row is one head position j: a token's embedding and the feature f_j, concatenated
    embedding FIRST (the head then applies ``fc`` [H, 2H] to each row). Questions to answer
    first: which token of the context removes the head's uncertainty about the branch the text
    took after f_j (notebook section 1)? Why are there n - 1 rows for n tokens, and which
    token gets no feature? Which token, then, shares row j with f_j?

    Args:
        embedding: [V, H] the target's token embedding matrix.
        tokens: the context x_0..x_{n-1}, n >= 2 token ids.
        features: [n-1, H] target features f_0..f_{n-2}.
    Returns:
        [n-1, 2H] float tensor, one row per head position j: H embedding values, then H feature values.
    """
    # EXERCISE 3.1: which token travels with f_j, and which half of the row comes first?
    # BEGIN SOLUTION
    emb = embedding[torch.as_tensor(tokens[1:], dtype=torch.long)]  # [n-1, H] embeddings of x_1..x_{n-1}
    return torch.cat([emb, features], dim=-1)  # [n-1, 2H]
    # END SOLUTION


def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's draft vocabulary: the ``draft_vocab_size`` most frequent target tokens.

    The kept target ids are sorted increasingly; draft id i is the i-th of them. On equal counts
    the LOWER target id is kept first. Two tensors encode the map, as in the official checkpoints:

        d2t [Vd] long: target_id = draft_id + d2t[draft_id]   (an offset, not the id itself)
        t2d [V] bool:  t2d[target_id] is True iff the target id is in the draft vocabulary

    Args:
        token_counts: [V] how often each target token occurs in the training data.
        draft_vocab_size: Vd, 1 <= Vd <= V.
    Returns:
        (d2t, t2d).
    Raises:
        ValueError: if draft_vocab_size is not in 1..V.
    """
    # EXERCISE 3.2: which ids are kept (and on ties?), in what order do they get draft ids, and what offset leads back?
    # BEGIN SOLUTION
    V = token_counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    order = sorted(range(V), key=lambda t: (-float(token_counts[t]), t))  # most frequent first, ties: lower id
    kept = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)  # [Vd] increasing target ids
    d2t = kept - torch.arange(draft_vocab_size)  # [Vd] offsets
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
    # END SOLUTION


def to_target_logits(draft_logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scatter EAGLE-3's draft-vocabulary logits into the target's vocabulary.

    Every target id outside the draft vocabulary must get logit -inf, so it has probability
    exactly 0 under the draft (the verifier then knows q is 0 there, and the target can still
    emit such tokens through the residual / bonus token). Where does draft id i land (exercise
    3.2's ``d2t``)?

    Args:
        draft_logits: [..., Vd] logits over the draft vocabulary (any leading dimensions).
        d2t: [Vd] long offsets (``build_vocab_map``).
        vocab_size: V, the target's vocabulary size.
    Returns:
        [..., V] logits, same dtype as draft_logits, -inf outside the draft vocabulary.
    """
    # EXERCISE 3.3: where does draft id i land in the target vocabulary, and what do the other ids get?
    # BEGIN SOLUTION
    Vd = draft_logits.shape[-1]
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))  # [..., V]
    out[..., torch.arange(Vd) + d2t] = draft_logits
    return out
    # END SOLUTION


def eagle_loss(pred_feat: torch.Tensor, target_feat: torch.Tensor, pred_logits: torch.Tensor,
               top_idx: torch.Tensor, top_logp: torch.Tensor, w_cls: float = 0.1) -> torch.Tensor:
    """EAGLE-1's training loss on N positions: feature regression + w_cls x soft cross-entropy.

    The loss is the feature term plus w_cls times the token term:

    - feature term: ``torch.nn.functional.smooth_l1_loss(pred_feat, target_feat)`` with its
      defaults (beta 1, mean over all N x H elements);
    - token term: the cross-entropy of the head's distribution (softmax of pred_logits, over
      the whole vocabulary) against the target's distribution, averaged over the N positions.
      The training data stores the target's distribution as its top-K only, as
      log-probabilities that need not sum to 1: the target distribution is the one they
      define on the K kept tokens, renormalised there.

    Questions: how do you turn top_logp into a distribution over its K tokens? Where do you
    read the head's log-probabilities of those same K tokens? The loss trains the head, so it
    must stay differentiable: which operations would cut the gradient?

    Args:
        pred_feat: [N, H] the head's predicted features g_{t+1}.
        target_feat: [N, H] the target's true features f_{t+1}.
        pred_logits: [N, V] the target's LM head applied to pred_feat.
        top_idx: [N, K] long, the target's K most likely next tokens at each position.
        top_logp: [N, K] their log-probabilities under the target (they need not sum to 1).
        w_cls: weight of the classification term (EAGLE: 0.1).
    Returns:
        Scalar tensor, the loss.
    """
    # EXERCISE 3.4: the feature term, then the token term against the renormalised top-K; keep gradients flowing
    # BEGIN SOLUTION
    l1 = F.smooth_l1_loss(pred_feat, target_feat)
    p = torch.softmax(top_logp.float(), dim=-1)  # [N, K] renormalised over the kept tokens
    logq = torch.log_softmax(pred_logits.float(), dim=-1)  # [N, V]
    ce = -(p * logq.gather(1, top_idx)).sum(-1).mean()
    return l1 + w_cls * ce
    # END SOLUTION


@torch.no_grad()
def draft_chain(head, embedding: torch.Tensor, lm_head, tokens: list[int], features: torch.Tensor,
                k: int) -> list[int]:
    """Draft k tokens greedily with an EAGLE-1/2 head: autoregression at the feature level.

    The head maps pairs (embedding of x_{j+1}, feature f_j) to a predicted next feature g_{j+1}
    (exercise 3.1's rows, through its ``fc`` and one decoder layer). From the context's pairs it
    predicts the feature at the last token, and the LM head turns a feature into the logits of
    the next token. Beyond the context there are no target features: what can the head pair the
    next draft token with?

    Args:
        head: an ``EagleHead``: ``head(emb [1, T, H], feat [1, T, H], positions [T])`` returns the
            predicted features [1, T, H] of T pairs at positions 0..T-1 (causal attention among them).
        embedding: [V, H] the target's token embedding matrix.
        lm_head: a callable from features [..., H] to logits [..., V].
        tokens: the context x_0..x_{n-1}, n >= 2 token ids (x_{n-1} just committed).
        features: [n-1, H] target features f_0..f_{n-2}.
        k: how many tokens to draft (k >= 1).
    Returns:
        the k draft token ids, each the argmax of its logits.
    """
    # EXERCISE 3.5: the pairs of the context first; then what feature goes with each new draft token?
    # BEGIN SOLUTION
    toks, feats, drafts = list(tokens[1:]), features, []  # pairs j: (x_{j+1}, f_j)
    for _ in range(k):
        emb = embedding[torch.as_tensor(toks, dtype=torch.long)]  # [T, H]
        g = head(emb[None], feats[None], torch.arange(len(toks)))[0, -1]  # [H]: the feature after the last pair
        x = int(lm_head(g).argmax())
        drafts.append(x)
        toks.append(x)  # the next pair: the draft token with the head's own feature for its position
        feats = torch.cat([feats, g[None]])
    return drafts
    # END SOLUTION


def ttt_loss(level, tokens: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, steps: int,
             decay: float = 0.8) -> torch.Tensor:
    """EAGLE-3's training-time test for an EAGLE-1/2 head: the loss of ``steps`` levels of a chain, drafted at
    every anchor position at once, each level fed the head's own previous output, as when it drafts.

    Level 0 is exercise 3.4's teacher-forced head: anchor t reads its pair of x_{t+1} and f_t and predicts
    f_{t+1}. At level j the drafter holds no target feature for the position it predicts. Questions to answer
    before coding: which token does anchor t read at level j, beside which feature, at which RoPE position?
    Which keys may its row attend to: the committed pairs (level 0) of which anchors, and which of the later
    levels' keys (section 7: a chain's draft sees its own ancestors, not another anchor's guesses)? Which
    feature is level j's target, and at which anchors does it not exist (or is not trained)? The loss is the
    feature term of 3.4 (SmoothL1) only; the library adds each level's cross-entropy.

    Args:
        level: runs the head's next level: ``level(tokens [B, Tp], inputs [B, Tp, H], positions [B, Tp],
            mask [Tp, (j + 1) * Tp])`` returns the level's predicted features [B, Tp, H] at the anchors
            t = 0..Tp-1 (Tp = T - 1). Call it once per level, in order: level j's rows attend to the keys of
            every level run so far and to their own, key i * Tp + s being level i's key at anchor s, where
            ``mask[t, i * Tp + s]`` is True. Token id 0 stands for a token past the end of the sequence.
        tokens: [B, T] token ids x_0..x_{T-1}.
        features: [B, T, H] the target's features f_0..f_{T-1}.
        valid: [B, T - 1] bool: anchor t's level-0 target f_{t+1} is trained (a response position).
        steps: the number of levels, >= 1.
        decay: level j's loss is weighted decay ** j.
    Returns:
        A scalar tensor (differentiable): sum_j decay^j L_j / sum_j decay^j over the levels that have trained
        positions, L_j = F.smooth_l1_loss of level j's predictions against their targets at those positions.
    """
    # EXERCISE 3.6: each level's tokens, input features, positions and attention mask; its targets and where they exist
    # BEGIN SOLUTION
    B, T = tokens.shape
    Tp = T - 1
    causal = torch.ones(Tp, Tp, dtype=torch.bool).tril()  # [Tp, Tp] level 0: the committed pairs up to t
    own = torch.eye(Tp, dtype=torch.bool)  # [Tp, Tp] levels 1..j: anchor t's own chain only
    anchors = torch.arange(Tp)[None].expand(B, Tp)  # [B, Tp]
    g, total, weights = features[:, :-1], 0.0, 0.0  # level 0 reads the target's f_t
    for j in range(steps):
        tok = F.pad(tokens[:, 1 + j:], (0, j))[:, :Tp]  # [B, Tp] x_{t+1+j}, 0 past the end
        g = level(tok, g, anchors + j, torch.cat([causal] + [own] * j, dim=1))  # [B, Tp, H] predicted f_{t+1+j}
        target = F.pad(features[:, 1 + j:], (0, 0, 0, j))[:, :Tp]  # [B, Tp, H] f_{t+1+j}
        trained = F.pad(valid[:, j:], (0, j))  # [B, Tp] f_{t+1+j} exists and is trained
        if trained.any():
            total, weights = total + decay ** j * F.smooth_l1_loss(g[trained], target[trained]), weights + decay ** j
    return total / weights
    # END SOLUTION
