"""Train an EAGLE-1/2 head for SmolLM2-135M-Instruct on the frozen target's features.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"):
the head (``minispec.drafters.eagle.EagleHead``) reads (embed(x_{t+1}), f_t) and regresses the
target's next feature f_{t+1}; its logits are the target's LM head on the prediction. Recipe:

  data   ``minispec.train.data.training_sequences``: the self-distilled ShareGPT cache (target
         greedy answers; its 32 held-out examples are the held-out set here) plus extra ShareGPT
         V3 conversations with their own replies. ``target_features`` runs the frozen target once
         per sequence (fp16 features + top-k log-probs, cached).
  loss   SmoothL1(g_{t+1}, f_{t+1}) + ``--ce-weight`` (0.1) x soft cross-entropy of
         lm_head(g_{t+1}) against the target's top-k distribution at t+1, on response positions.
         The CE needs the 576 x 49152 LM head, so it runs on a random ``--ce-frac`` of the positions
         of each batch. Input features get uniform noise U(-a, a) * std(f), a = ``--noise`` (EAGLE's
         data noise: the head must cope with its own imperfect features when drafting).
  optim  ``minispec.train.loop``: AdamW, linear warm-up + cosine decay, gradient clipping, seeded
         batches, periodic held-out metrics, resumable (``--resume``), several processes under
         torchrun (DDP). ``--minutes`` makes the schedule follow wall time (the cosine runs over the
         fraction of the time budget spent; training stops when it is spent and ``--steps`` is
         ignored), which suits a shared CPU whose speed changes during the run.
  levels ``--ttt-steps`` N > 1: every position also drafts levels 1..N-1 of a chain on the head's own
         predicted features, as decoding does (training-time test, ``unroll``; EAGLE-3's, which HASS,
         Zhang et al. 2024, applies to EAGLE heads), each level's loss weighted ``--ttt-decay``^j.
  head   ``--layers`` decoder layers (official EAGLE-1/2: one; layers 1.. are pre-norm Llama
         layers). ``--init-from`` a head with fewer layers starts the others as the identity.
  save   fp16 ``name.safetensors`` with the official EAGLE-1 keys + ``name.json`` (the Llama-style
         head config under "config", its layer count, settings, data sizes, metrics, timings, the command).

Held-out metrics: "acceptance" = P(head argmax == target greedy token) with true features
(teacher forcing); "tau_chain5" = greedy chain tau with depth 5 along the target's own greedy
text, the head drafting autoregressively on its own features through ``EagleDrafter`` exactly as
in decoding (prefill counted as one forward, like ``GenerationStats.tau``).

    python -m minispec train eagle --extra-sharegpt 0 --minutes 25
    torchrun --nproc_per_node 2 -m minispec train eagle --extra-sharegpt 0 --minutes 25

Shapes: B sequences, T positions, D width, K top-k, N positions with a CE term, V vocab.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..args import at_least, thread_count
from ..drafters.base import Features
from ..drafters.eagle import EagleConfig, EagleDrafter, EagleHead, load_eagle
from ..drafters.defaults import shipped_head
from ..model import rope_cos_sin
from .. import exact  # the trained head follows its target's backend (trainer)
from ..sampling import GREEDY
from . import TARGET, bf16_help, ddp, loop, native_bf16
from .data import FeatureData, add_selfdistill_args, feature_data, selfdistill_data
from .measure import record_measurement

FORMAT = "minispec-eagle-v1"
DEFAULT_OUT = Path(str(shipped_head("eagle")))  # minispec/checkpoints/smollm2-135m-eagle.safetensors


def make_batch(seqs, feats, idx: list[int], device: str | torch.device = "cpu"):
    """Right-padded batch of sequences ``idx``, built on the CPU and moved to ``device``.

    Returns:
        tokens [B, T] long, hidden [B, T, D] float32, top_idx [B, T, K] long, top_logp [B, T, K]
        float32, loss_mask [B, T-1] bool: head position j (input f_j, output g_{j+1}) carries a loss
        when f_{j+1} exists and feeds a response token (j + 2 >= prompt_len).
    """
    T = max(len(seqs[i].tokens) for i in idx)
    D = feats[idx[0]]["hidden"].shape[1]
    K = max((feats[i]["top_idx"].shape[1] for i in idx if "top_idx" in feats[i]), default=1)  # self-distilled: none
    tokens = torch.zeros(len(idx), T, dtype=torch.long)
    hidden = torch.zeros(len(idx), T, D, dtype=feats[idx[0]]["hidden"].dtype)  # as stored (fp16); float32 on the device
    top_idx = torch.zeros(len(idx), T, K, dtype=torch.long)
    top_logp = torch.zeros(len(idx), T, K)
    mask = torch.zeros(len(idx), T - 1, dtype=torch.bool)
    for b, i in enumerate(idx):
        n, P = len(seqs[i].tokens), seqs[i].prompt_len
        tokens[b, :n] = seqs[i].tokens
        hidden[b, :n] = feats[i]["hidden"]
        if "top_idx" in feats[i]:
            top_idx[b, :n] = feats[i]["top_idx"].long()
            top_logp[b, :n] = feats[i]["top_logp"].float()
        mask[b, max(0, P - 2):n - 1] = True
    hidden = hidden.to(device, non_blocking=True).float()
    return tokens.to(device), hidden, top_idx.to(device), top_logp.to(device), mask.to(device)


def eagle_loss(head: EagleHead, target, batch, ce_weight: float, ce_frac: float, noise: float,
               generator: torch.Generator | None = None, draft_head: torch.Tensor | None = None,
               share=ddp.local):
    """EAGLE-1 loss on one batch; returns (loss, smooth_l1, ce, top-1 acc on the CE positions).

    ``draft_head`` [K, D]: the target's LM-head rows of the draft vocabulary (FR-Spec). Given, the CE
    is taken where the head is used, over those K tokens only: the head's distribution over them
    against the target's own (its logits from the true next feature, renormalised over the same K
    tokens), which needs no stored top-k and costs K / V of the full-vocabulary CE. None: the
    full-vocabulary CE against the stored top-k distribution.

    ``share`` (``ddp.share`` when the batch is this rank's share of a global one): the SmoothL1 is a
    mean over the loss positions, the CE and the accuracy over the CE positions; each is weighted
    by this rank's share of those positions. Noise and the CE positions are drawn from each rank's
    own ``generator`` (same distribution, other samples than one process draws; the noise scale is
    the std of the rank's share)."""
    tokens, hidden, top_idx, top_logp, mask = batch
    T = tokens.shape[1]
    with torch.no_grad():
        emb = target.tok_emb(tokens[:, 1:]).float()  # [B, T-1, D] embeddings of x_{j+1}
    feat = noised(hidden[:, :-1], noise, generator)  # [B, T-1, D] f_j
    pred = head(emb, feat, torch.arange(T - 1, device=feat.device))  # [B, T-1, D] predicted f_{j+1}
    tgt = hidden[:, 1:]
    l1, pick = feature_loss(pred, tgt, mask, ce_frac, generator, share)
    if draft_head is not None:
        ce, acc = draft_vocab_ce(pred, tgt, pick, draft_head)
    else:
        z = target.lm_head(pred[pick[:, 0], pick[:, 1]]).float()  # [N, V]
        ti, tl = top_idx[pick[:, 0], pick[:, 1] + 1], top_logp[pick[:, 0], pick[:, 1] + 1]  # [N, K] at f_{j+1}
        p = torch.softmax(tl, -1)  # the target's top-k distribution, renormalised
        ce = -(p * (z.gather(1, ti) - torch.logsumexp(z, -1, keepdim=True))).sum(-1).mean()
        acc = (z.argmax(-1) == ti[:, 0]).float().mean()
    (ce, _), (acc, _) = share(ce, len(pick)), share(acc, len(pick))
    return l1 + ce_weight * ce, l1, ce, acc


def unroll(head: EagleHead, embed, tokens: torch.Tensor, feat: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head drafting ``steps`` levels of a chain at every position at once, each level on its own
    features (training-time test, as EAGLE-3 trains; HASS applies it to EAGLE-1/2 heads).

    Anchor t (the last position whose true feature f_t the drafter holds) drafts, at level j:

        level 0   input (x_{t+1}, f_t), RoPE position t: predicts f_{t+1} (the teacher-forced head)
        level j   input (x_{t+1+j}, the head's own level j-1 output at t), position t + j: predicts
                  f_{t+1+j}; it attends to the level-0 keys of positions <= t (the committed pairs,
                  true features) and to its own keys of levels 1..j at t (its chain ancestors, itself)

    which is what ``EagleDrafter`` computes for a chain along the true tokens x_{t+2}, x_{t+3}, ...

    Args:
        head: the EAGLE-1/2 head (any number of layers; each keeps its own keys).
        embed: the target's token embedding (frozen).
        tokens: [B, T] token ids; feat: [B, Tp, H] the features f_t of anchors t = 0..Tp-1 (Tp = T - 1).
    Returns:
        ``steps`` tensors [B, Tp, H]: level j's predicted f_{t+1+j} at anchor t (past the sequence end
        its inputs are token 0: mask those positions' losses).
    """
    B, T = tokens.shape
    Tp = T - 1
    c = head.cfg
    rep, scale = c.num_attention_heads // c.num_key_value_heads, c.head_dim ** -0.5
    causal = torch.ones(Tp, Tp, dtype=torch.bool, device=feat.device).tril()  # [Tp, Tp]
    pos = torch.arange(Tp, device=feat.device)[None].expand(B, Tp)  # [B, Tp]
    keys = [([], []) for _ in head.layers]  # per layer: the keys / values of levels 0, 1, .. [B, Hq, Tp, hd]
    outs, g = [], feat
    for j in range(steps):
        tok = F.pad(tokens[:, 1 + j:], (0, j))[:, :Tp]  # [B, Tp] x_{t+1+j}
        x = head.fc(torch.cat([embed(tok).to(g.dtype), g], dim=-1))  # [B, Tp, H]
        rope = rope_cos_sin(pos + j, c.head_dim, c.rope_theta)
        for layer, (ks, vs) in zip(head.layers, keys):
            h = x if layer.input_layernorm is None else layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h, rope)  # q [B, Hq, Tp, hd], k / v [B, Hkv, Tp, hd]
            ks.append(k.repeat_interleave(rep, 1)), vs.append(v.repeat_interleave(rep, 1))
            x = x + layer.self_attn.out(level_attention(q, ks, vs, causal, scale))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        outs.append(x)
        g = x
    return outs


def level_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], causal: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of the queries q [B, Hq, Tp, hd] of level j = len(ks) - 1 of a training-time-test unroll (``unroll``
    here, ``train.eagle3.unroll``): to the level-0 keys ks[0] [B, Hq, Tp, hd] of positions <= t (``causal`` [Tp, Tp],
    the committed pairs) and to each later level's key at the same position t only (the chain's ancestors, itself).
    Returns [B, Hq, Tp, hd]."""
    Tp = q.shape[2]
    s0 = (q @ ks[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, Hq, Tp, Tp]
    sd = [(q * kd).sum(-1, keepdim=True) * scale for kd in ks[1:]]  # each [B, Hq, Tp, 1]: levels 1..j at t
    a = torch.softmax(torch.cat([s0, *sd], dim=-1).float(), dim=-1).to(q.dtype)  # [B, Hq, Tp, Tp + j]
    attn = a[..., :Tp] @ vs[0]  # [B, Hq, Tp, hd]
    for i, vd in enumerate(vs[1:]):
        attn = attn + a[..., Tp + i:Tp + i + 1] * vd
    return attn


def ttt_loss(head: EagleHead, target, batch, ce_weight: float, ce_frac: float, noise: float, steps: int,
             decay: float, draft_head: torch.Tensor, generator: torch.Generator | None = None, share=ddp.local):
    """``eagle_loss`` over ``steps`` levels of the chain (``unroll``): level j's SmoothL1 against
    f_{t+1+j} plus ``ce_weight`` x its draft-vocabulary CE, weighted decay^j and normalised by the
    weights. Only level 0's input features get the noise (the later levels' inputs are the head's own
    errors). Returns (loss, level 0's smooth_l1, ce and acc, [acc_j])."""
    tokens, hidden, _, _, mask = batch
    Tp = tokens.shape[1] - 1
    outs = unroll(head, target.tok_emb, tokens, noised(hidden[:, :-1], noise, generator), steps)  # f_t noised
    total, weights, first, accs = 0.0, 0.0, None, []
    for j, out in enumerate(outs):
        valid = F.pad(mask[:, j:], (0, j))  # [B, Tp]: f_{t+1+j} exists and feeds a response token
        tgt = F.pad(hidden[:, 1 + j:], (0, 0, 0, j))[:, :Tp]  # [B, Tp, D] f_{t+1+j}
        if not valid.any():
            continue
        l1, pick = feature_loss(out, tgt, valid, ce_frac, generator, share)
        ce, acc = draft_vocab_ce(out, tgt, pick, draft_head)
        (ce, _), (acc, _) = share(ce, len(pick)), share(acc, len(pick))
        total, weights = total + decay ** j * (l1 + ce_weight * ce), weights + decay ** j
        first = first or (l1, ce, acc)
        accs.append(float(acc))
    return (total / weights, *first, accs)


def noised(feat: torch.Tensor, noise: float, generator: torch.Generator | None) -> torch.Tensor:
    """feat + U(-noise, noise) * std(feat) (EAGLE's data noise; ``feat`` itself when ``noise`` is 0)."""
    if noise <= 0:
        return feat
    u = torch.rand(feat.shape, generator=generator, device=feat.device) * 2 - 1  # U(-1, 1)
    return feat + noise * feat.std() * u


def feature_loss(pred: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor, ce_frac: float,
                 generator: torch.Generator | None, share) -> tuple[torch.Tensor, torch.Tensor]:
    """SmoothL1 of the predicted features pred [B, Tp, D] against tgt over the ``mask`` [B, Tp] positions (weighted
    by this rank's share of them), and the CE positions [N, 2]: a random ``ce_frac`` of those, at least one."""
    pos = mask.nonzero()  # [M, 2]
    l1, _ = share(F.smooth_l1_loss(pred[mask], tgt[mask]), len(pos))
    pick = pos[torch.randperm(len(pos), generator=generator, device=pos.device)[:max(1, int(ce_frac * len(pos)))]]
    return l1, pick


def draft_vocab_ce(pred: torch.Tensor, tgt: torch.Tensor, pick: torch.Tensor,
                   draft_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """At the ``pick`` positions [N, 2]: the soft CE of the head's distribution over the draft vocabulary
    (``draft_head`` [K, D]) against the target's (from its true feature), and their argmax agreement."""
    z = pred[pick[:, 0], pick[:, 1]] @ draft_head.T  # [N, K] the head's logits over the draft vocabulary
    with torch.no_grad():
        zt = tgt[pick[:, 0], pick[:, 1]] @ draft_head.T  # [N, K] the target's, from the true feature
    ce = -(torch.softmax(zt, -1) * torch.log_softmax(z, -1)).sum(-1).mean()
    return ce, (z.argmax(-1) == zt.argmax(-1)).float().mean()


def loss_fn(target, ce_weight: float, ce_frac: float, noise: float, draft_head: torch.Tensor | None = None,
            ttt_steps: int = 1, ttt_decay: float = 0.8):
    """``eagle_loss`` (``ttt_steps`` 1) or ``ttt_loss`` (more) as ``minispec.train.loop`` calls a loss:
    (head, batch, generator, share) -> (loss, {"smooth_l1", "ce", "acc"}) (level 0's, and "acc_by_level")."""
    if ttt_steps > 1 and draft_head is None:
        raise ValueError("--ttt-steps > 1 trains with the draft-vocabulary CE: give --draft-vocab K > 0")

    def loss(head, batch, generator, share):
        if ttt_steps == 1:
            total, l1, ce, acc = eagle_loss(head, target, batch, ce_weight, ce_frac, noise, generator, draft_head, share)
            return total, dict(smooth_l1=l1, ce=ce, acc=acc)
        total, l1, ce, acc, accs = ttt_loss(head, target, batch, ce_weight, ce_frac, noise, ttt_steps, ttt_decay,
                                            draft_head, generator, share)
        return total, dict(smooth_l1=l1, ce=ce, acc=acc, acc_by_level=accs)
    return loss


def train_step(head, target, seqs, feats, idx: list[int], opt, ce_weight: float, ce_frac: float, noise: float,
               generator: torch.Generator | None = None, clip: float = 1.0, draft_head: torch.Tensor | None = None):
    """One optimizer step on the batch ``idx`` in one process (``make_batch`` + ``eagle_loss`` +
    ``loop.train_step``: backward, clipping, AdamW step); returns (loss, smooth_l1, ce, acc, grad_norm).
    Under torchrun ``loop.fit`` takes the steps (it wraps the head in DDP once)."""
    loop.one_process("train.eagle.train_step")
    objective = loop.Objective(head, loss_fn(target, ce_weight, ce_frac, noise, draft_head))
    n = loop.train_step(objective, opt, make_batch(seqs, feats, idx, target.device), generator, clip,
                        device=target.device)
    return n["loss"], n["smooth_l1"], n["ce"], n["acc"], n["grad_norm"]


def greedy_tokens(target, feat: dict) -> torch.Tensor:
    """[T] the target's greedy token after each position: the stored top-1, else the argmax of its LM
    head on the stored features (self-distilled data keeps features only)."""
    if "top_idx" in feat:
        return feat["top_idx"][:, 0].long()
    return target.lm_head(feat["hidden"].to(target.device).float()).argmax(-1).cpu()


@torch.no_grad()
def teacher_forced(head: EagleHead, target, seqs, feats, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence ``i`` teacher-forced: the head's outputs g [M, H] at its M response positions (fed the true
    features), the target's true features of the same next tokens [M, H], and those positions' mask [1, T-1]."""
    tokens, hidden, _, _, mask = make_batch(seqs, feats, [i], target.device)
    emb = target.tok_emb(tokens[:, 1:]).float()
    g = head(emb, hidden[:, :-1], torch.arange(tokens.shape[1] - 1, device=emb.device))[mask]  # [M, H]
    return g, hidden[:, 1:][mask], mask


@torch.no_grad()
def evaluate(head: EagleHead, target, seqs, feats, depth: int = 5, tau_seqs: int | None = None) -> dict:
    """Held-out acceptance (teacher-forced) and the greedy chain tau of depth ``depth``.

    The chain walk: the first response token comes from the prefill (one forward); at each later
    root x_t the drafter (fed the true features f_0..f_{t-1}) drafts ``depth`` tokens on its own
    features; they are accepted up to the first mismatch with the target's greedy tokens (and while
    the text still follows the target's greedy trajectory), plus one target token.
    """
    was = head.training
    head.eval()
    hits = total = 0
    for i in range(len(seqs)):
        g, _, mask = teacher_forced(head, target, seqs, feats, i)
        z = target.lm_head(g)  # [M, V]
        hits += int((z.argmax(-1).cpu() == greedy_tokens(target, feats[i])[1:][mask[0].cpu()]).sum())
        total += int(mask.sum())
    committed = forwards = 0
    drafter = EagleDrafter(target, head, tree=depth)
    for i in range(len(seqs) if tau_seqs is None else min(tau_seqs, len(seqs))):
        toks, P = seqs[i].tokens.tolist(), seqs[i].prompt_len
        greedy = greedy_tokens(target, feats[i]).tolist()  # greedy[t]: the target's token after toks[:t+1]
        h = feats[i]["hidden"].to(target.device).float()
        drafter.prefill(toks[:P + 1], Features(h[:P]))  # the prefill emits toks[P], the first root
        t = P  # toks[t] is the root (committed); the drafter holds the features of toks[:t]
        committed, forwards = committed + 1, forwards + 1
        while t + 1 < len(toks):
            tree = drafter.propose(GREEDY, budget=len(toks) - t - 1)
            a = 0
            while a < len(tree.tokens) and tree.tokens[a] == greedy[t + a] == toks[t + a + 1]:
                a += 1
            step = min(a + 1, len(toks) - 1 - t)
            drafter.commit(toks[t + 1:t + 1 + step], Features(h[t:t + step]))
            committed, forwards, t = committed + step, forwards + 1, t + step
    head.train(was)
    out = {"acceptance": hits / total, "positions": total}
    if forwards:
        out[f"tau_chain{depth}"] = committed / forwards
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minispec train eagle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="head .safetensors path (the .json goes beside it)")
    ap.add_argument("--extra-sharegpt", type=int, default=600, help="extra ShareGPT conversations (own replies)")
    ap.add_argument("--distill-prompts", type=int, default=576, help="self-distilled training examples (target answers)")
    ap.add_argument("--heldout", type=int, default=32, help="held-out examples of the distill cache")
    ap.add_argument("--max-len", type=int, default=320, help="tokens per sequence (prompt + response)")
    ap.add_argument("--topk", type=int, default=32, help="target log-probs kept per position (soft CE)")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (ignored with --minutes)")
    ap.add_argument("--minutes", type=float, default=0, help="train for this much wall time (time-based schedule)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--ce-frac", type=float, default=0.125, help="fraction of loss positions with a CE term")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="CE over the K most frequent tokens, where the head drafts (FR-Spec; targets from the true "
                         "next feature); 0: over the full vocabulary against the stored top-k")
    add_selfdistill_args(ap, "features recorded while the target decoded")
    ap.add_argument("--noise", type=float, default=0.1, help="uniform feature noise U(-a, a) * std(f)")
    ap.add_argument("--ttt-steps", type=at_least(1), default=1,
                    help="chain levels each position drafts in training, each on the head's own features before it "
                         "(training-time test, ``unroll``); 1: teacher forcing alone (EAGLE-1)")
    ap.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of level j: decay**j (--ttt-steps > 1)")
    ap.add_argument("--layers", type=int, default=1,
                    help="decoder layers of the head (official EAGLE-1/2: 1); layers 1.. are pre-norm Llama layers")
    ap.add_argument("--init-layer", type=int, default=None,
                    help="copy this target layer's attention/MLP/post-norm into the head's layer 0 (default: random "
                         "init, which trained much faster in a 20-step check than a copy of the last layer)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="warm start: the head weights of this EAGLE-1/2 checkpoint (e.g. the shipped head), "
                         "then train on the data chosen here with a fresh optimizer and schedule. A checkpoint with "
                         "fewer layers than --layers fills layers 0.. and fc; each further layer starts as the "
                         "identity (random weights, its o_proj and down_proj zero), so the deeper head starts as "
                         "exactly the checkpoint's function and its metrics, and any gain is the extra capacity's")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-tau-seqs", type=int, default=4, help="held-out sequences for the periodic chain-tau walk")
    ap.add_argument("--final-tau-seqs", type=int, default=32, help="held-out sequences for the final chain-tau walk")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=thread_count, default=1)
    ap.add_argument("--device", default="cpu", help="where the target computes the features and the head trains "
                                                    "(cuda: a GPU; one process)")
    ap.add_argument("--tf32", action="store_true",
                    help="on a GPU, matrix products in TF32 on its tensor cores (features and training; TF32's 10-bit "
                         "mantissa rounds far less than the training noise --noise adds to the features)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=native_bf16(), help=bf16_help())
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                    help="after training, measure greedy tau with minispec.generate and store it in the record")
    ap.add_argument("--measure-only", action="store_true", help="only (re)measure the checkpoint at --out")
    ap.add_argument("--measure-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.init_layer is not None and args.init_from is not None:
        ap.error("--init-layer and --init-from both set the head's starting weights: choose one")
    if args.layers < 1:
        ap.error(f"--layers must be at least 1, got {args.layers}")
    return args


def run_measure(args, target, tok, held, record: dict) -> dict:
    """Greedy generate-based tau of the head at ``args.out`` as a chain and as two dynamic trees."""
    head = load_eagle(args.out, target).head
    trees = {"chain:5": "chain:5", "dynamic:5,8,32": "5,8,32", "dynamic:6,10,60": "6,10,60"}
    record.get("eval", {}).pop("generate", None)  # an earlier, unreproducible measurement
    return record_measurement(args, target, tok, held, record, "eagle", DEFAULT_OUT,
                              {k: (lambda t=t: EagleDrafter(target, head, tree=t)) for k, t in trees.items()})


def init_from_target(head: EagleHead, target, layer: int) -> None:
    """Start the head's decoder layer 0 from a target layer (the same fused modules)."""
    blk, lay = target.blocks[layer], head.layers[0]
    with torch.no_grad():
        for dst, src in [(lay.self_attn.wqkv, blk.attn.wqkv), (lay.self_attn.wo, blk.attn.wo),
                         (lay.mlp.gate_up, blk.mlp.gate_up), (lay.mlp.down, blk.mlp.down),
                         (lay.post_attention_layernorm, blk.mlp_norm)]:
            dst.weight.copy_(src.weight)


def warm_start(head: EagleHead, path: Path, target) -> None:
    """Start ``head`` from the weights of the EAGLE-1/2 checkpoint at ``path`` (fp16 on disk, fp32 here).
    A checkpoint with fewer layers fills fc and layers 0..n-1; the layers after start as the identity
    (``identity_layer``). ValueError when that head's shape differs from ``head``'s other than by
    having fewer layers."""
    src = load_eagle(path, target).head
    n, want = src.cfg.num_hidden_layers, head.cfg.num_hidden_layers
    if {**src.cfg.to_dict(), "num_hidden_layers": 0} != {**head.cfg.to_dict(), "num_hidden_layers": 0} or n > want:
        raise ValueError(f"{path}: its head config {src.cfg.to_dict()} differs from the head trained here "
                         f"{head.cfg.to_dict()}" + (" (more layers)" if n > want else ""))
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in src.state_dict().items()}, strict=False)
    assert not unexpected and all(k.startswith(tuple(f"layers.{i}." for i in range(n, want))) for k in missing)
    for layer in head.layers[n:]:
        identity_layer(layer)


def identity_layer(layer) -> None:
    """Make a decoder layer with its residual connections the identity: its two output projections
    (attention's o_proj, the MLP's down_proj) zero, the rest as it is. Gradients reach them at once
    and every other weight of the layer from the next step on."""
    with torch.no_grad():
        layer.self_attn.wo.weight.zero_()
        layer.mlp.down.weight.zero_()


def warm_start_record(path: Path, layers: int | None = None) -> dict:
    """What a warm-started head started from: the checkpoint's name, and its own training command and
    data when its minispec .json is beside it; given the head's ``layers``, how many came from the
    checkpoint and how the others started."""
    from ..drafters.layouts import files

    rec = dict(path=path.name)
    meta = path.with_suffix(".json")
    if meta.is_file():
        prev = json.loads(meta.read_text())
        rec.update(command=prev.get("command"), data=prev.get("data"), training_steps=prev.get("training", {}).get("steps"))
    meta = files(path)[1]
    n = meta.get("config", meta).get("num_hidden_layers", 1)  # minispec's record, or an official config.json
    if layers is not None and layers > n:
        rec.update(layers_from_checkpoint=n, new_layers="identity (o_proj and down_proj zero, other weights random)")
    return rec


def save_head(head: EagleHead, path: Path, record: dict) -> None:
    """fp16 safetensors with the official EAGLE-1 keys + the JSON record beside it."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in head.state_dict().items()}
    save_file(sd, str(path), metadata={"format": FORMAT, "target": TARGET})
    loop.write_record(path, record)


def new_head(args, target) -> EagleHead:
    """The head of ``--layers`` layers to train: random (seeded), or layer 0 from a target layer
    (``--init-layer``), or from a checkpoint (``--init-from``; further layers start as the identity)."""
    head = EagleHead(EagleConfig.for_target(target.cfg, num_hidden_layers=args.layers)).to(target.device)
    if args.init_layer is not None:
        init_from_target(head, target, args.init_layer % target.cfg.n_layer)
    if args.init_from is not None:
        warm_start(head, args.init_from, target)
    return head


def load_data(args, target, tok) -> tuple[FeatureData, torch.Tensor | None]:
    """The training data (``--selfdistill-parts`` appended to train) and the draft vocabulary's LM-head
    rows [K, D] (None with ``--draft-vocab 0``)."""
    data = feature_data(args, target, tok, seed=args.seed)
    if args.selfdistill_parts:
        # the full-vocabulary CE (--draft-vocab 0) reads the target's stored top-k; the draft-vocabulary CE needs none
        sd, fsd = selfdistill_data(args.selfdistill_parts, args.max_len, target, topk=0 if args.draft_vocab else args.topk,
                                   folder=args.selfdistill_dir, first=args.selfdistill_first)
        data.train, data.ftrain = data.train + sd, data.ftrain + fsd
    return data, draft_head_rows(target, args.draft_vocab) if args.draft_vocab else None


def draft_head_rows(target, k: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """LM_K [K, D]: the target's LM-head rows of the ``k`` most frequent tokens (FR-Spec's draft vocabulary,
    from ``counts``; default: the shipped ones), detached, on the target's device. The draft-vocabulary CE
    (``eagle_loss(..., draft_head=LM_K)``) takes its logits as ``g @ LM_K.T``."""
    from ..drafters.vocab import load_counts, top_tokens

    rows = top_tokens(load_counts() if counts is None else counts, k).to(target.lm_head.weight.device)  # [K]
    return target.lm_head.weight[rows].detach()  # [K, D]


def loop_settings(args) -> loop.Settings:
    """The loop's settings: with ``--minutes`` the time budget alone ends the run (``--steps`` ignored)."""
    return loop.Settings.from_args("eagle", args, steps=0 if args.minutes else args.steps)


def trainer(args, target, head: EagleHead, data: FeatureData, draft_head: torch.Tensor | None) -> loop.Trainer:
    """``head`` and ``eagle_loss`` on ``data`` for ``loop.fit``; the history keeps the SmoothL1, CE,
    accuracy and grad norm of the step and the held-out acceptance / chain tau.

    ``head`` computes as its target does from here on, on every rank (``exact.follow``, in place: the exact
    backend on a CPU float32 target). The held-out evaluation drafts through an ``EagleDrafter``, which makes
    that same swap; were the head left plain until then, the steps after the first evaluation would compute
    their attention otherwise than the steps before it, a run resumed from its checkpoint (which reruns no
    evaluation before its first step) would take that step otherwise than the uninterrupted run, and under
    torchrun rank 0 (which alone evaluates) otherwise than the other ranks."""
    exact.follow(target, head)

    def heldout() -> dict:
        return evaluate(head, target, data.held, data.fheld, tau_seqs=args.eval_tau_seqs)

    def log(n: dict) -> dict:
        ev = heldout()
        by_level = {"train_acc_by_level": n["acc_by_level"]} if "acc_by_level" in n else {}
        return dict(smooth_l1=n["smooth_l1"], ce=n["ce"], train_acc=n["acc"], **by_level, grad_norm=n["grad_norm"],
                    heldout_acceptance=ev["acceptance"], heldout_tau_chain5=ev.get("tau_chain5"))

    return loop.Trainer(model=head, lengths=[len(s.tokens) for s in data.train],
                        batch=lambda idx: make_batch(data.train, data.ftrain, idx, target.device),
                        loss=loss_fn(target, args.ce_weight, args.ce_frac, args.noise, draft_head, args.ttt_steps,
                                     args.ttt_decay),
                        log=log, before=heldout)


def make_record(args, argv, head: EagleHead, data: FeatureData, run: loop.Run) -> dict:
    """The JSON record of a run (before the final evaluation and the measurement)."""
    n_tok = lambda ss: sum(len(s.tokens) for s in ss)  # noqa: E731
    train, held = data.train, data.held
    ce = (f"over the {args.draft_vocab} most frequent tokens (target distribution from the true next feature)"
          if args.draft_vocab else f"(top-{args.topk})")
    loss = f"SmoothL1(feature) + {args.ce_weight} * soft CE {ce} on {args.ce_frac} of positions"
    if args.ttt_steps > 1:
        loss = (f"sum_j {args.ttt_decay}^j [{loss}] over chain levels j < {args.ttt_steps}, level j on the head's own "
                "features (training-time test), normalised by the weights")
    return dict(
        format=FORMAT, target=TARGET, config=head.cfg.to_dict(), dtype="float16",
        shared=["embed_tokens (target tok_emb)", "lm_head (target)"],
        command=loop.command("python -m minispec train eagle", argv), settings=loop.settings(args),
        layers=head.cfg.num_hidden_layers,
        init_from=None if args.init_from is None else warm_start_record(args.init_from, head.cfg.num_hidden_layers),
        data=dict(train_sequences=len(train), train_tokens=n_tok(train),
                  train_distill_sequences=sum(s.source == "distill" for s in train),
                  train_sharegpt_sequences=sum(s.source == "sharegpt" for s in train),
                  train_selfdistill_sequences=sum(s.source == "selfdistill" for s in train),
                  heldout_sequences=len(held), heldout_tokens=n_tok(held),
                  sources="self-distilled ShareGPT V3 (target greedy answers) + ShareGPT V3 own replies; "
                          "held-out = the distill cache's first 32 examples (distill_draft's held-out set)",
                  features_s=round(data.features_s, 1)),
        training=loop.training_record(run, loop_settings(args), len(train), loss),
        eval=dict(heldout_before_training=run.init_eval), **loop.stamp())


def main(argv=None) -> dict:
    """Train (resumably; under torchrun on every rank), save the fp16 head + JSON record, evaluate the
    saved head, measure; returns the record (rank 0; {} elsewhere)."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    target, tok = loop.start(args)
    if args.measure_only:
        loop.one_process("--measure-only")
        held = feature_data(args, target, tok, seed=args.seed, features=False).held
        return run_measure(args, target, tok, held, loop.read_record(args.out))
    data, draft_head = loop.main_first(lambda: load_data(args, target, tok))
    head = new_head(args, target)
    run = loop.fit(loop_settings(args), trainer(args, target, head, data, draft_head))
    if not ddp.is_main():
        ddp.cleanup()
        return {}
    heldout = lambda: evaluate(load_eagle(args.out, target).head.float(), target, data.held, data.fheld,  # noqa: E731
                               tau_seqs=args.final_tau_seqs)  # the fp16 checkpoint as users load it
    measure = (lambda rec: run_measure(args, target, tok, data.held, rec)) if args.measure else None
    record = loop.finish(args.out, make_record(args, argv, head, data, run), lambda out, rec: save_head(head, out, rec),
                         run, t_start, heldout, measure)
    print(json.dumps(dict(out=str(args.out), **record["eval"]["heldout"], train_s=record["training"]["train_s"])))
    ddp.cleanup()
    return record


if __name__ == "__main__":
    main()
