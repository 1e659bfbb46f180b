"""Checks of chapter 3's exercises (solutions/ch03_eagle.py): EAGLE feature drafting.

    3.1 eagle_input       the EAGLE-1 head's input rows cat[embed(x_{j+1}), f_j] (the shifted pairs)
    3.2 build_vocab_map   EAGLE-3's draft vocabulary: d2t offsets and the t2d mask
    3.3 to_target_logits  draft-vocabulary logits scattered into the target vocabulary, -inf elsewhere
    3.4 eagle_loss        SmoothL1(features) + w_cls x soft cross-entropy against the target's top-K
    3.5 draft_chain       a greedy chain drafted at the feature level (the head's own feature fed back)
    3.6 ttt_loss          EAGLE-3's training-time test: each level's tokens, inputs, positions, attention mask
                          and targets, the decay-weighted loss

References are minispec's own code: 3.1 the input that ``EagleDrafter`` feeds its head's ``fc``
(captured with a forward pre-hook while it drafts), 3.2 ``minispec.drafters.eagle3.build_vocab_map``,
3.3 ``Eagle3Head.to_target_logits``, 3.4 ``minispec.train.eagle.eagle_loss`` (the loss that
trained the shipped head, value and gradient), 3.5 the tokens ``EagleDrafter`` drafts as a greedy
chain (float64 heads, so no near-tie decides), 3.6 ``minispec.train.eagle.unroll`` (the training-time
test's levels) on a float64 head over minispec's tiny Llama target; all on seeded random tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from minispec.drafters.base import Features
from minispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from minispec.drafters.eagle3 import Eagle3Config, Eagle3Head
from minispec.drafters.eagle3 import build_vocab_map as lib_build_vocab_map
from minispec.sampling import GREEDY
from minispec.train import eagle as train_eagle

from .checks import as_int, exercise, get

TITLE = "EAGLE feature drafting: the head's input, its loss, EAGLE-3's draft vocabulary"
MODULE = "ch03_eagle"
EXERCISES: list = []


# --------------------------------------------------------------------------- the library behind the signatures
def _stub_target(embedding: torch.Tensor):
    """The parts of a target an EagleDrafter touches: tok_emb, lm_head, cfg, device, dtype."""
    V, H = embedding.shape
    return SimpleNamespace(tok_emb=nn.Embedding.from_pretrained(embedding), lm_head=nn.Linear(H, V, bias=False),
                           cfg=SimpleNamespace(d_model=H, vocab_size=V, name="stub", arch="stub"),
                           device=embedding.device, dtype=embedding.dtype)


@torch.no_grad()
def library_eagle_input(embedding: torch.Tensor, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    """What ``EagleDrafter`` feeds its head's ``fc`` for this context, captured with a pre-hook.

    The drafter gets ``features`` through ``prefill`` (as ``minispec.generate`` hands them over)
    and drafts one token; the hook records the [n-1, 2H] rows of its first head call.
    """
    V, H = embedding.shape
    target = _stub_target(embedding)
    head = EagleHead(EagleConfig(hidden_size=H, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                                 intermediate_size=4, vocab_size=V)).to(embedding.dtype)
    seen = []
    hook = head.fc.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].clone()))
    try:
        d = EagleDrafter(target, head, tree="chain:1")
        d.prefill(list(tokens), Features(features))
        d.propose(GREEDY, budget=1)
    finally:
        hook.remove()
    return seen[0]  # [n-1, 2H]


def library_loss(pred_feat, target_feat, pred_logits, top_idx, top_logp, w_cls=0.1):
    """``minispec.train.eagle.eagle_loss`` on N positions, through stubs of the head and the target.

    The training loss takes a batch (tokens, features, top-k, mask) and computes the head's
    prediction itself; here one sequence of N + 1 positions carries the given tensors, the stub
    head returns ``pred_feat`` and the stub LM head returns ``pred_logits`` (CE on every position:
    ce_frac 1, no feature noise).
    """
    N, H = pred_feat.shape
    K = top_idx.shape[1]

    def lm_head(x):  # x [M, H]: rows of pred_feat in the loss's random order -> the same rows of pred_logits
        match = (x.detach()[:, None, :] == pred_feat.detach()[None]).all(-1)  # [M, N]
        return pred_logits[match.float().argmax(-1)]  # [M, V] (rows of pred_feat are assumed distinct)

    hidden = torch.cat([torch.zeros(1, H, dtype=target_feat.dtype), target_feat])[None]  # [1, N+1, H]
    tops = lambda t: torch.cat([torch.zeros(1, K, dtype=t.dtype), t])[None]  # noqa: E731  row r+1 <- position r
    batch = (torch.zeros(1, N + 1, dtype=torch.long), hidden, tops(top_idx), tops(top_logp),
             torch.ones(1, N, dtype=torch.bool))
    target = SimpleNamespace(tok_emb=lambda t: torch.zeros(*t.shape, H), lm_head=lm_head)
    head = lambda emb, feat, pos: pred_feat[None]  # noqa: E731  [1, N, H]
    loss, _, _, _ = train_eagle.eagle_loss(head, target, batch, w_cls, 1.0, 0.0, torch.Generator().manual_seed(0))
    return loss


def library_to_target_logits(draft_logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``Eagle3Head.to_target_logits`` of a small head holding ``d2t``."""
    head = Eagle3Head(Eagle3Config(hidden_size=8, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1,
                                   vocab_size=vocab_size, draft_vocab_size=d2t.numel()))
    head.d2t.copy_(d2t)
    return head.to_target_logits(draft_logits)


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``)."""
    return SimpleNamespace(__name__="minispec.drafters.eagle / eagle3, minispec.train.eagle (chapter 3 adapter)",
                           eagle_input=library_eagle_input, eagle_loss=library_loss,
                           build_vocab_map=lib_build_vocab_map, to_target_logits=library_to_target_logits,
                           draft_chain=library_draft_chain, ttt_loss=library_ttt_loss, minispec_library=True)


# --------------------------------------------------------------------------- helpers
def _tensor(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise AssertionError(f"{what} must return a torch.Tensor, got {type(x).__name__}")
    return x


def _close(got: torch.Tensor, want: torch.Tensor, what: str, where: str, atol=1e-5, rtol=1e-5) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)} {where}")
    g, w = got.detach().double(), want.detach().double()
    if not torch.allclose(g, w, atol=atol, rtol=rtol, equal_nan=False):
        bad = ((g - w).abs() > atol + rtol * w.abs()) | (g.isinf() != w.isinf())
        i = tuple(bad.nonzero()[0].tolist()) if bad.any() else ()
        raise AssertionError(f"{what}{list(i)} = {g[i].item():.6g}, expected {w[i].item():.6g} {where}")


# --------------------------------------------------------------------------- 3.1
@exercise(EXERCISES, "3.1", "eagle_input")
def check_eagle_input(impl):
    fn = get(impl, "eagle_input")
    g = torch.Generator().manual_seed(31)
    for k, (V, H, n) in enumerate([(11, 4, 2), (17, 6, 5), (40, 8, 12), (9, 2, 3)]):
        emb = torch.randn(V, H, generator=g)  # [V, H]
        tokens = torch.randint(0, V, (n,), generator=g).tolist()
        feats = torch.randn(n - 1, H, generator=g)  # [n-1, H] f_0..f_{n-2}
        want = library_eagle_input(emb, tokens, feats)  # [n-1, 2H]
        got = _tensor(fn(emb.clone(), list(tokens), feats.clone()), "eagle_input")
        where = f"for n={n} tokens {tokens}, H={H} (row j = cat[embedding[x_(j+1)], f_j], as EagleDrafter feeds fc)"
        if tuple(got.shape) == tuple(want.shape) and not torch.allclose(got.double(), want.double(), atol=1e-6):
            swapped = torch.cat([want[:, H:], want[:, :H]], -1)
            unshifted = torch.cat([emb[torch.tensor(tokens[:-1])], feats], -1)
            if torch.allclose(got.double(), swapped.double(), atol=1e-6):
                raise AssertionError(f"the feature comes first in your rows: EAGLE concatenates the embedding FIRST, "
                                     f"then the feature, {where}")
            if torch.allclose(got.double(), unshifted.double(), atol=1e-6):
                raise AssertionError(f"row j pairs f_j with x_j, the token that PRODUCED it; EAGLE pairs it with the "
                                     f"next token x_(j+1) (the shift), {where}")
        _close(got, want, "row", where, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- 3.2
@exercise(EXERCISES, "3.2", "build_vocab_map")
def check_build_vocab_map(impl):
    fn = get(impl, "build_vocab_map")
    g = torch.Generator().manual_seed(33)
    cases = [("counts [5, 1, 5, 0, 2]", torch.tensor([5, 1, 5, 0, 2]), 3),
             ("counts [0, 0, 0, 0]", torch.zeros(4, dtype=torch.long), 2)]
    for k in range(12):
        V = (8, 30, 200)[k % 3]
        counts = torch.randint(0, (3, 10, 1000)[k % 3], (V,), generator=g)  # small ranges: many ties
        cases.append((f"random counts #{k} (V={V})", counts, int(torch.randint(1, V + 1, (1,), generator=g))))
    cases.append(("all kept (Vd = V)", torch.randint(0, 5, (12,), generator=g), 12))
    for desc, counts, Vd in cases:
        want_d2t, want_t2d = lib_build_vocab_map(counts, Vd)
        out = fn(counts.clone(), Vd)
        try:
            d2t, t2d = out
        except (TypeError, ValueError):
            raise AssertionError(f"build_vocab_map must return (d2t, t2d), got {out!r}") from None
        d2t, t2d = _tensor(d2t, "build_vocab_map's d2t"), _tensor(t2d, "build_vocab_map's t2d")
        where = f"for {desc}, draft_vocab_size={Vd}"
        if t2d.dtype != torch.bool:
            raise AssertionError(f"t2d must be a bool tensor [V], got dtype {t2d.dtype} {where}")
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise AssertionError(f"d2t must hold integer offsets (torch.long), got dtype {d2t.dtype} {where}")
        if tuple(t2d.shape) == tuple(want_t2d.shape) and not torch.equal(t2d, want_t2d):
            i = int((t2d != want_t2d).nonzero()[0])
            raise AssertionError(f"t2d[{i}] = {bool(t2d[i])}, expected {bool(want_t2d[i])} (token {i} occurs "
                                 f"{int(counts[i])} times; keep the {Vd} most frequent, ties to the lower id) {where}")
        if tuple(d2t.shape) == tuple(want_d2t.shape) and not torch.equal(d2t.long(), want_d2t):
            kept = (torch.arange(Vd) + want_d2t).tolist()
            if torch.equal(d2t.long(), torch.tensor(kept)):
                raise AssertionError(f"d2t holds the target ids themselves; it holds OFFSETS: "
                                     f"target_id = draft_id + d2t[draft_id] {where}")
        _close(t2d.long(), want_t2d.long(), "t2d", where, atol=0, rtol=0)
        _close(d2t.long(), want_d2t, "d2t", f"{where} (draft ids follow increasing target ids)", atol=0, rtol=0)
    for bad in (0, 9):
        try:
            fn(torch.ones(8, dtype=torch.long), bad)
        except ValueError:
            continue
        except Exception as e:
            raise AssertionError(f"build_vocab_map(counts of V=8, {bad}) raised {type(e).__name__}: {e}; "
                                 f"expected ValueError") from None
        raise AssertionError(f"build_vocab_map(counts of V=8, {bad}) returned instead of raising ValueError")


# --------------------------------------------------------------------------- 3.3
@exercise(EXERCISES, "3.3", "to_target_logits")
def check_to_target_logits(impl):
    fn = get(impl, "to_target_logits")
    g = torch.Generator().manual_seed(34)
    for k, (V, Vd, lead) in enumerate([(10, 4, ()), (30, 7, (3,)), (50, 50, (2,)), (64, 16, (2, 3)), (5, 1, ())]):
        counts = torch.randint(0, 20, (V,), generator=g)
        d2t, _ = lib_build_vocab_map(counts, Vd)
        logits = torch.randn(*lead, Vd, generator=g, dtype=(torch.float32, torch.float64)[k % 2])
        want = library_to_target_logits(logits, d2t, V)
        got = _tensor(fn(logits.clone(), d2t.clone(), V), "to_target_logits")
        where = f"for V={V}, Vd={Vd}, draft logits of shape {tuple(logits.shape)}, d2t={d2t.tolist()}"
        if got.dtype != logits.dtype:
            raise AssertionError(f"the result has dtype {got.dtype}, expected the draft logits' {logits.dtype} {where}")
        if tuple(got.shape) == tuple(want.shape):
            outside = want.isinf()
            _close(got.where(~outside, want), want, "logits", f"(draft id i goes to target id i + d2t[i]) {where}",
                   atol=0, rtol=0)
            if outside.any() and not (got[outside] == float("-inf")).all():
                v = got[outside][got[outside] != float("-inf")][0].item()
                raise AssertionError(f"a target id outside the draft vocabulary has logit {v:.4g}, expected -inf "
                                     f"(probability exactly 0 under the draft) {where}")
        _close(got, want, "logits", where, atol=0, rtol=0)


# --------------------------------------------------------------------------- 3.4
def _loss_case(g, N, H, V, K):
    pred = torch.randn(N, H, generator=g, requires_grad=True)
    tgt = torch.randn(N, H, generator=g) * 1.5  # some |differences| > 1: both SmoothL1 branches
    W = torch.randn(V, H, generator=g) / H ** 0.5  # [V, H] a stand-in LM head
    full = torch.log_softmax(2 * torch.randn(N, V, generator=g), -1)
    top_logp, top_idx = full.topk(K, dim=-1)  # [N, K]: sums below 1 unless K = V
    return pred, tgt, W, top_idx, top_logp


@exercise(EXERCISES, "3.4", "eagle_loss")
def check_eagle_loss(impl):
    fn = get(impl, "eagle_loss")
    g = torch.Generator().manual_seed(32)
    for N, H, V, K, w in [(6, 4, 10, 3, 0.1), (9, 8, 20, 5, 0.1), (4, 6, 12, 12, 0.5), (5, 4, 16, 1, 0.0),
                          (7, 5, 30, 4, 2.0)]:
        pred, tgt, W, top_idx, top_logp = _loss_case(g, N, H, V, K)
        where = f"for N={N}, H={H}, V={V}, K={K}, w_cls={w}"
        ref = library_loss(pred, tgt, pred @ W.T, top_idx, top_logp, w)
        (want_grad,) = torch.autograd.grad(ref, pred)
        got = _tensor(fn(pred, tgt.clone(), pred @ W.T, top_idx.clone(), top_logp.clone(), w), "eagle_loss")
        if got.numel() != 1:
            raise AssertionError(f"eagle_loss must return a scalar (mean over positions), got shape {tuple(got.shape)} {where}")
        got = got.reshape(())
        if not abs(got.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item())):
            l1 = torch.nn.functional.smooth_l1_loss(pred, tgt).item()
            ce = (ref.item() - l1) / w if w else float("nan")
            raise AssertionError(f"loss = {got.item():.6g}, expected {ref.item():.6g} (minispec.train.eagle.eagle_loss: "
                                 f"SmoothL1 {l1:.6g} + {w} x soft CE {ce:.6g}) {where}")
        if not got.requires_grad:
            raise AssertionError(f"the loss does not depend differentiably on pred_feat / pred_logits (detached? "
                                 f"built with .item() or numpy?): it could not train the head {where}")
        (grad,) = torch.autograd.grad(got, pred)
        _close(grad, want_grad, "d loss / d pred_feat", f"(gradient through the features and the logits) {where}")


@torch.no_grad()
def library_draft_chain(head, embedding: torch.Tensor, lm_head, tokens: list[int], features: torch.Tensor,
                        k: int) -> list[int]:
    """The tokens ``EagleDrafter`` drafts as a greedy chain of k for this context (its KV-cached path)."""
    target = _stub_target(embedding)
    target.lm_head = lm_head
    d = EagleDrafter(target, head, tree=f"chain:{k}")
    d.prefill(list(tokens), Features(features))
    return list(d.propose(GREEDY, budget=k).tokens)


@exercise(EXERCISES, "3.5", "draft_chain")
def check_draft_chain(impl):
    fn = get(impl, "draft_chain")
    for seed in range(6):
        g = torch.Generator().manual_seed(350 + seed)
        V, H = 40 + 7 * seed, 8
        embedding = torch.randn(V, H, generator=g, dtype=torch.float64)  # float64: no near-tie decides a token
        head = EagleHead(EagleConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                     intermediate_size=16, vocab_size=V)).to(torch.float64)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        lm_head = nn.Linear(H, V, bias=False).to(torch.float64)
        with torch.no_grad():
            lm_head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
        n, k = 2 + 3 * seed, 1 + seed % 5
        tokens = torch.randint(0, V, (n,), generator=g).tolist()
        features = torch.randn(n - 1, H, generator=g, dtype=torch.float64)
        want = library_draft_chain(head, embedding, lm_head, tokens, features, k)
        out = fn(head, embedding.clone(), lm_head, list(tokens), features.clone(), k)
        try:
            got = [as_int(x, "a draft token") for x in out]
        except TypeError:
            raise AssertionError(f"draft_chain must return a list of k token ids, got {out!r}") from None
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(f"draft_chain(k={k}) on a context of {n} tokens returned {got}; EagleDrafter drafts "
                                 f"{want} (first difference at draft {first + 1})")


# --------------------------------------------------------------------------- 3.6: the training-time test
class HeadLevels:
    """Exercise 3.6's ``level``: runs an EAGLE-1/2 head one level of a training-time-test unroll at a time, each
    level's rows attending, as the caller's mask allows, to the keys of every level run so far and their own.

    ``level(tokens [B, Tp], inputs [B, Tp, H], positions [B, Tp], mask [Tp, (j + 1) Tp])`` -> [B, Tp, H]: the
    head's ``fc`` on cat[embedding(tokens), inputs], then its layers with attention over all keys under ``mask``
    (key i * Tp + s: level i's key at anchor s). ``calls`` records every call (detached copies), for the check's
    diagnosis; ``train.eagle.unroll`` computes the same levels with the right masks built in."""

    def __init__(self, head: EagleHead, embed):
        self.head, self.embed, self.calls = head, embed, []
        self.keys = [([], []) for _ in head.layers]  # per layer: each level's keys / values [B, Hq, Tp, hd]

    def __call__(self, tokens, inputs, positions, mask):
        from minispec.model import rope_cos_sin

        j = len(self.calls)
        tokens, inputs, positions, mask = (_tensor(x, f"level's {name}") for x, name in
                                           ((tokens, "tokens"), (inputs, "inputs"), (positions, "positions"),
                                            (mask, "mask")))
        self.calls.append(dict(tokens=tokens.detach().clone(), inputs=inputs.detach().clone(),
                               positions=positions.detach().clone(), mask=mask.detach().clone()))
        B, Tp = tokens.shape
        if mask.dtype != torch.bool or tuple(mask.shape) != (Tp, (j + 1) * Tp):
            raise AssertionError(f"level {j}'s mask must be a bool tensor [Tp, (j + 1) * Tp] = [{Tp}, {(j + 1) * Tp}] "
                                 f"(a column per key of levels 0..{j}), got {mask.dtype} {tuple(mask.shape)}")
        c = self.head.cfg
        rep, scale = c.num_attention_heads // c.num_key_value_heads, c.head_dim ** -0.5
        x = self.head.fc(torch.cat([self.embed(tokens).to(inputs.dtype), inputs], dim=-1))  # [B, Tp, H]
        rope = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        for layer, (ks, vs) in zip(self.head.layers, self.keys):
            h = x if layer.input_layernorm is None else layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h, rope)  # q [B, Hq, Tp, hd], k / v [B, Hkv, Tp, hd]
            ks.append(k.repeat_interleave(rep, 1)), vs.append(v.repeat_interleave(rep, 1))
            s = (q @ torch.cat(ks, 2).transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))  # [B, Hq, Tp, K]
            a = torch.softmax(s.float(), -1).to(q.dtype)  # in float32, as train.eagle.level_attention does
            x = x + layer.self_attn.out(a @ torch.cat(vs, 2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


def _ttt_case(seed: int, layers: int):
    """(head, embedding module, tokens [B, T], features [B, T, H], valid [B, T-1]): a random float64 EAGLE-1/2
    head on minispec's tiny Llama target, its features of random token sequences (response positions: the
    second half)."""
    from minispec.loading import load

    target, _ = load("tiny-llama")
    g = torch.Generator().manual_seed(360 + seed)
    B, T = 2, 7 + 2 * seed
    tokens = torch.randint(1, target.cfg.vocab_size, (B, T), generator=g)
    with torch.no_grad():
        feats = target(tokens).hidden.double()  # [B, T, H] the tiny target's features
    cfg = EagleConfig.for_target(target.cfg)
    head = EagleHead(EagleConfig(**{**vars(cfg), "num_hidden_layers": layers})).to(torch.float64)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2)
    embed = nn.Embedding.from_pretrained(target.tok_emb.weight.detach().double())
    valid = torch.zeros(B, T - 1, dtype=torch.bool)
    valid[:, (T - 1) // 2:] = True
    valid[1, -1] = False  # a position that is not trained
    return head, embed, tokens, feats, valid


def reference_ttt(head, embed, tokens, feats, valid, steps: int, decay: float):
    """(the loss, each level's predictions) from ``minispec.train.eagle.unroll`` and 3.6's loss."""
    import torch.nn.functional as F

    outs = train_eagle.unroll(head, embed, tokens, feats[:, :-1], steps)
    Tp = tokens.shape[1] - 1
    total, weights = 0.0, 0.0
    for j, out in enumerate(outs):
        trained = F.pad(valid[:, j:], (0, j))
        target = F.pad(feats[:, 1 + j:], (0, 0, 0, j))[:, :Tp]
        if trained.any():
            total, weights = total + decay ** j * F.smooth_l1_loss(out[trained], target[trained]), weights + decay ** j
    return total / weights, outs


def library_ttt_loss(level, tokens, features, valid, steps, decay=0.8):
    """``minispec.train.eagle.unroll`` on the head behind ``level`` (a ``HeadLevels``), with 3.6's loss."""
    return reference_ttt(level.head, level.embed, tokens, features, valid, steps, decay)[0]


def _diagnose(calls, tokens, feats, outs, steps) -> str:
    """Where the learner's calls of ``level`` part from the right ones: the first wrong tokens, inputs, positions
    or mask entry."""
    import torch.nn.functional as F

    if len(calls) != steps:
        return f"; `level` was called {len(calls)} times, once per level expected ({steps})"
    B, T = tokens.shape
    Tp = T - 1
    for j, c in enumerate(calls):
        want_tok = F.pad(tokens[:, 1 + j:], (0, j))[:, :Tp]
        if tuple(c["tokens"].shape) != (B, Tp) or not torch.equal(c["tokens"].long(), want_tok):
            return f"; level {j} read other tokens than x_(t+1+{j}) at anchor t (0 past the end)"
        want_in = feats[:, :-1] if j == 0 else outs[j - 1]
        if tuple(c["inputs"].shape) != tuple(want_in.shape) or not torch.allclose(c["inputs"].double(), want_in.double(),
                                                                                  atol=1e-9):
            return (f"; level {j}'s input features are not " + ("the target's f_t" if j == 0 else
                                                                 f"the head's own level {j - 1} output at the same anchor"))
        if not torch.equal(c["positions"].long(), torch.arange(Tp)[None].expand(B, Tp) + j):
            return f"; level {j}'s positions are not t + {j} at anchor t"
        want_mask = torch.cat([torch.ones(Tp, Tp, dtype=torch.bool).tril()] + [torch.eye(Tp, dtype=torch.bool)] * j, 1)
        bad = (c["mask"] != want_mask).nonzero()
        if len(bad):
            t, key = (int(x) for x in bad[0])
            i, s = divmod(key, Tp)
            return (f"; level {j}'s mask[{t}, {key}] is {bool(c['mask'][t, key])}: anchor {t} "
                    f"{'must' if want_mask[t, key] else 'must not'} see level {i}'s key at anchor {s}")
    return ""


@exercise(EXERCISES, "3.6", "ttt_loss")
def check_ttt_loss(impl):
    fn = get(impl, "ttt_loss")
    for seed, (layers, steps, decay) in enumerate([(1, 1, 0.8), (1, 3, 0.8), (2, 4, 0.5), (1, 6, 0.9)]):
        head, embed, tokens, feats, valid = _ttt_case(seed, layers)
        want, outs = reference_ttt(head, embed, tokens, feats, valid, steps, decay)
        level = HeadLevels(head, embed)
        where = (f"for B={tokens.shape[0]}, T={tokens.shape[1]}, steps={steps}, decay={decay}, a {layers}-layer head"
                 + (" (the last levels have no trained position: skip them)" if steps > tokens.shape[1] // 2 else ""))
        got = _tensor(fn(level, tokens.clone(), feats.clone(), valid.clone(), steps, decay), "ttt_loss")
        want = want.detach()
        if got.dim() != 0:
            raise AssertionError(f"ttt_loss must return a scalar tensor, got shape {tuple(got.shape)} {where}")
        if not getattr(impl, "minispec_library", False) and len(level.calls) != steps:
            raise AssertionError(f"`level` was called {len(level.calls)} times {where}: run every level through it, "
                                 f"once per level ({steps})")
        if not torch.isclose(got.detach().double(), want.detach(), rtol=1e-6, atol=1e-12):  # softmax in float32
            raise AssertionError(f"loss = {got.item():.10g} {where}, expected {want.item():.10g} (minispec.train.eagle."
                                 f"unroll's levels){_diagnose(level.calls, tokens, feats, outs, steps)}")
        if not got.requires_grad:
            raise AssertionError(f"the loss does not depend differentiably on the head {where} (.item(), .detach() or "
                                 "a float): nothing to train")
