"""Scaling to Llama (chapter 9): random-weight Llama-shaped models, step latency, the cost model at scale.

A decode step's cost depends on the shapes, not on the weights' values, so a Llama-3.1-8B-shaped
model with random bf16 weights, built directly on the GPU, times what a real checkpoint would
(and needs no download). What random weights cannot give is acceptance: the oracle drafter
(``lab.oracle``) supplies it, drafting the target's own greedy stream with each token
corrupted at a set rate, so tau is known in advance and the output must still equal vanilla.

Predicted here (the roofline, Williams et al. 2009): ``step_bytes`` (every linear weight once +
the KV cache of the batch), ``flops_per_row`` (a multiply-add per linear weight + attention over
the context), ``roofline_step_s`` (the slower of the two at a bandwidth and a peak), the
``ridge_rows`` at which they meet, ``roofline_speedup`` of an oracle tree at a given tau and the
``crossover_batch`` at which it falls below 1. Weights are counted on a meta-device model.

Measured here:
  step_latency       one target forward of T = N + 1 new tokens for B sequences after P cached
                     tokens: eager (``Transformer.forward`` + ``KVCache``, dense or split
                     attention) or a CUDA graph replay (``cuda_graphs.GraphedForward``);
  latency_grid       per-token latency = step / tau of vanilla (N = 0), a chain and an
                     EAGLE-2-shaped tree, over batch x prompt, with the speedup over vanilla the
                     cost model predicts from those step costs (draft cost of the oracle: zero)
                     and the weight-bandwidth floor ((weight + KV bytes per step) / bandwidth);
  rows_latency       one forward of 1, 2, 4, ... rows (batch 1): whether one row costs the least;
  oracle_speedup     batch 1, the real decode loop: vanilla vs oracle chain / tree; output equal
                     to vanilla?, measured tau and speedup next to the cost model's prediction
                     from the same run's measured draft and verify time per step; the oracle
                     re-anchors when a verify forward breaks a near-tie differently from the
                     vanilla run, and a tau that leaves the promise raises ``OracleTauError``.

The KV cache of a latency measurement holds zeros that stand for a prefilled prompt (attention
costs the same whatever the keys), which skips a prefill of up to 32 x 8k tokens per point.

References: Grattafiori et al., "The Llama 3 Herd of Models" (2024) for the shapes; Williams,
Waterman, Patterson, "Roofline" (CACM 2009); Chen et al., "MagicDec" (2024) for long contexts;
Leviathan et al. (2023) for the speedup model; Li et al., "EAGLE-2" (2024) for the tree (depth 6,
60 nodes).

Shapes: B batch, P prompt (cached) tokens, N draft nodes, T = N + 1 new tokens, V vocab.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch

from .attention_grid import timed
from ..attention.table import BackendTable
from ..cuda_graphs import GraphedForward
from .oracle import OracleDrafter, expected_tau, tree_shape
from ..kv import KVCache, StaticKVCache
from ..model import ModelConfig, Transformer
from ..tree import Tree


def llama_config(name: str) -> ModelConfig:
    """Shapes by name: "llama-3.1-8b", "llama-3.2-1b" (its usual draft), "tiny" and "tiny-draft" (smoke).

    Llama 3.1's RoPE frequency scaling is left out (minispec does not implement it; it changes
    no shape and no cost)."""
    shapes = {
        "llama-3.1-8b": dict(vocab_size=128256, n_layer=32, n_head=32, d_model=4096, d_ff=14336, n_kv_head=8,
                             tie_embeddings=False),
        "llama-3.2-1b": dict(vocab_size=128256, n_layer=16, n_head=32, d_model=2048, d_ff=8192, n_kv_head=8,
                             tie_embeddings=True),
        "tiny": dict(vocab_size=256, n_layer=2, n_head=4, d_model=64, d_ff=128, n_kv_head=2, tie_embeddings=False),
        "tiny-draft": dict(vocab_size=256, n_layer=1, n_head=2, d_model=32, d_ff=64, n_kv_head=1, tie_embeddings=True),
    }
    if name not in shapes:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(shapes)}")
    big = name.startswith("llama")
    return ModelConfig("llama", max_seq_len=131072 if big else 4096, rope_theta=500000.0 if big else 10000.0,
                       norm_eps=1e-5, name=f"{name}-shaped", **shapes[name])


def random_model(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0, std: float = 0.02) -> Transformer:
    """A Transformer with N(0, std) weights and unit norms, allocated once on ``device`` in ``dtype``
    (built on the meta device first: no fp32 copy of 8B parameters on the way); on the CPU in float32 with the
    exact backend, as ``load()`` gives it (``minispec.exact``)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module a new Parameter: tie them again (one matrix, not two)
        model.lm_head.weight = model.tok_emb.weight
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std, generator=g)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    if model.device.type == "cpu" and dtype == torch.float32:
        from ..exact import apply

        apply(model)
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes of the weights a forward reads (every linear layer, LM head included; not the embedding)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))


def kv_bytes(cfg: ModelConfig, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values a forward reads for ``batch`` sequences of ``tokens`` cached tokens."""
    return 2 * cfg.n_layer * batch * cfg.n_kv_head * tokens * cfg.head_dim * torch.finfo(dtype).bits // 8


# --------------------------------------------------------------------------- the roofline of a decode step
H100_SPEC = dict(name="H100 SXM5 (NVIDIA spec sheet)", bandwidth=3.35e12, peak=989e12, dtype="bfloat16")
"""Spec-sheet figures, not measurements: NVIDIA's H100 SXM5 datasheet gives 3.35 TB/s of HBM3 and
989 TFLOP/s of dense BF16 tensor-core math (1979 with 2:4 sparsity). Achieved rates are lower."""


def _shape_key(cfg: ModelConfig) -> tuple:
    return (cfg.arch, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.d_ff, cfg.n_kv_head, cfg.head_dim,
            cfg.tie_embeddings)


@functools.lru_cache(maxsize=64)
def _linear_params(key: tuple) -> int:
    arch, vocab, n_layer, n_head, d_model, d_ff, n_kv_head, head_dim, tie = key
    cfg = ModelConfig(arch, vocab, n_layer, n_head, d_model, d_ff, max_seq_len=1, n_kv_head=n_kv_head,
                      head_dim=head_dim, tie_embeddings=tie)
    with torch.device("meta"):  # shapes only: an 8B model costs no memory
        model = Transformer(cfg)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def linear_params(cfg: ModelConfig) -> int:
    """Weights of the linear layers one forward multiplies by (attention projections, MLP, LM head;
    not the embedding table, which is read one row per token), counted on a meta-device model."""
    return _linear_params(_shape_key(cfg))


def step_bytes(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes one forward reads from memory: every linear weight once (shared by all rows) and the
    keys and values of ``batch`` sequences of ``context`` cached tokens (chapter 9, exercise 9.1)."""
    return linear_params(cfg) * torch.finfo(dtype).bits // 8 + kv_bytes(cfg, batch, context, dtype)


def flops_per_row(cfg: ModelConfig, context: int) -> int:
    """FLOPs of one new token's row: a multiply-add per linear weight, and attention over
    ``context`` keys (q.k and p.v: 2 x 2 x head_dim per key, head and layer)."""
    return 2 * linear_params(cfg) + 4 * cfg.n_layer * cfg.n_head * cfg.head_dim * context


def roofline_step_s(cfg: ModelConfig, batch: int, new_tokens: int, context: int, dtype: torch.dtype,
                    bandwidth: float, peak: float) -> float:
    """The roofline's lower bound on one forward of ``new_tokens`` rows for each of ``batch``
    sequences after ``context`` cached tokens: the longer of reading ``step_bytes`` at
    ``bandwidth`` (bytes/s) and computing every row's ``flops_per_row`` at ``peak`` (FLOP/s)."""
    return max(step_bytes(cfg, batch, context, dtype) / bandwidth,
               batch * new_tokens * flops_per_row(cfg, context) / peak)


def ridge_rows(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype, bandwidth: float, peak: float) -> float:
    """Rows per forward at which computing them takes as long as reading the step's bytes: below
    it extra rows (draft tokens, sequences) are free on the roofline, above it each costs its FLOPs.
    With no KV this is ``peak x bytes per weight / (2 x bandwidth)``."""
    return step_bytes(cfg, batch, context, dtype) / bandwidth * peak / flops_per_row(cfg, context)


def roofline_speedup(cfg: ModelConfig, batch: int, nodes: int, tau: float, context: int, dtype: torch.dtype,
                     bandwidth: float, peak: float) -> float:
    """Speculation's speedup over vanilla on the roofline, drafting free: tau tokens per forward of
    ``nodes + 1`` rows per sequence against one token per forward of one row."""
    vanilla = roofline_step_s(cfg, batch, 1, context, dtype, bandwidth, peak)
    return tau * vanilla / roofline_step_s(cfg, batch, nodes + 1, context, dtype, bandwidth, peak)


def crossover_batch(cfg: ModelConfig, nodes: int, tau: float, context: int, dtype: torch.dtype, bandwidth: float,
                    peak: float, max_batch: int = 4096) -> int | None:
    """The smallest batch in 1..max_batch at which ``roofline_speedup`` is below 1 (speculation stops
    paying), or None if it pays up to ``max_batch`` (long contexts: the KV reads, one per sequence,
    outweigh every row's FLOPs)."""
    return next((b for b in range(1, max_batch + 1)
                 if roofline_speedup(cfg, b, nodes, tau, context, dtype, bandwidth, peak) < 1), None)


METHODS = {"vanilla": (0, 0), "chain": (5, 5), "eagle2": (6, 60)}  # name -> (depth, draft nodes)


def method_tree(depth: int, nodes: int) -> Tree:
    """The verify shape of a method: no nodes (vanilla), a chain, or the oracle's EAGLE-2-shaped tree."""
    return Tree([], []) if nodes == 0 else Tree([0] * nodes, tree_shape(depth, nodes)[0])


def step_latency(model, batch: int, prompt: int, tree: Tree, mode: str, reps: int, attention: str = "dense",
                 warmup: int = 2) -> dict:
    """Median seconds of one target forward over root + ``tree`` for ``batch`` rows after ``prompt`` tokens.

    Args:
        mode: "eager" (``Transformer.forward`` with a ``KVCache``, backend ``attention``), "graph"
            (``GraphedForward`` over a ``StaticKVCache``: a CUDA graph replay on a GPU, its eager
            fallback elsewhere, which the result says) or "static" (the same without graphs: what
            attending over the static cache costs by itself).
        attention: eager: a backend name (``minispec.attention.BACKENDS``); graph / static: the bucket's
            backend, "dense", "flash" or "split" (forced), or "table" (the runner's own choice:
            ``attention.table.table_for``).
    Returns:
        dict(step_s, graphs_used, attention).
    """
    dev, T = model.device, len(tree) + 1
    g = torch.Generator().manual_seed(batch * 7919 + prompt)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, T), generator=g).to(dev)  # [B, T]
    pos = tree.positions(prompt).to(dev).expand(batch, T) if len(tree) else None  # [B, T]
    mask = tree.mask().to(dev) if len(tree) and not tree.is_chain else None  # [T, T]
    own = model.attention  # the backend set back afterwards ("exact" for a CPU float32 model from load())
    with torch.inference_mode():
        if mode == "eager":
            model.set_attention(attention)
            kv = KVCache.for_model(model, capacity=prompt + T, batch_size=batch)
            kv.length = prompt  # zeros stand for a prefilled prompt

            def step():
                model(tokens, positions=pos, mask=mask, kv=kv)
                kv.discard()
            used, attn = False, attention
        elif mode in ("graph", "static"):
            model.set_attention(own)
            kv = StaticKVCache.for_model(model, capacity=prompt + T, batch_size=batch)
            kv.set_lengths([prompt] * batch)
            forced = None if attention == "table" else BackendTable(f"forced: {attention}", {(1, 1, 1): attention})
            gf = GraphedForward(model, kv, batch_buckets=(batch,), token_buckets=(T,), enabled=mode == "graph",
                                table=forced)

            def step():
                gf(tokens, pos, mask)
                kv.discard()
            name = gf.backend_for(batch, T)
            used, attn = gf.use_graphs, name + (" (full capacity)" if name != "split" else " (device lengths)")
        else:
            raise ValueError(f"mode must be 'eager', 'graph' or 'static', got {mode!r}")
        for _ in range(warmup):
            step()
        times = [timed(step, dev) for _ in range(reps)]
    model.set_attention(own)
    return dict(step_s=statistics.median(times), graphs_used=used, attention=attn)


def rows_latency(model, prompt: int, rows=(1, 2, 4, 6, 8), reps: int = 10, mode: str = "eager") -> dict[int, float]:
    """Median seconds of one forward of T new rows (a chain: T - 1 drafts after the root) after ``prompt``
    cached tokens, batch 1, for each T in ``rows``: is one row cheaper than several on this device, as the
    cost model assumes (``cost_check.predicted_speedup``)? A GPU's matrix kernels are chosen by row count."""
    return {T: step_latency(model, 1, prompt, method_tree(T - 1, T - 1), mode, reps)["step_s"] for T in rows}


def latency_grid(model, batches, prompts, modes, reps: int, p_corrupt: float, bandwidth: float,
                 deadline: float | None = None, methods=METHODS, warmup: int = 2) -> dict:
    """Per-token latency of each method over batch x prompt (see module doc).

    Args:
        modes: {label: (mode, attention)}, e.g. {"eager_dense": ("eager", "dense"), "graph": ("graph", "dense")}.
        p_corrupt: the oracle's corruption rate, which fixes tau = expected_tau(p, depth).
        bandwidth: copy bandwidth (GB/s) for the floor.
        deadline: ``time.perf_counter()`` after which no new (batch, prompt) point starts.
    Returns:
        dict(rows, skipped, weight_bytes, errors).
    """
    from .attention_grid import coarse_first
    from .cost_check import predicted_speedup

    wb, rows, skipped, errors = weight_bytes(model), [], [], []
    for B, P in coarse_first(batches, prompts):
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(dict(batch=B, prompt=P))
            continue
        base = {}
        for method, (depth, nodes) in methods.items():
            tree, tau = method_tree(depth, nodes), expected_tau(p_corrupt, depth)
            for label, (mode, attention) in modes.items():
                try:
                    r = step_latency(model, B, P, tree, mode, reps, attention, warmup)
                except Exception as e:  # noqa: BLE001  (out of memory at the largest shapes, a missing kernel)
                    errors.append(dict(batch=B, prompt=P, method=method, mode=label, error=f"{type(e).__name__}: "
                                       f"{str(e)[:200]}"))
                    _free(model.device)
                    continue
                base.setdefault(label, r["step_s"] if method == "vanilla" else None)
                floor = (wb + kv_bytes(model.cfg, B, P, model.dtype)) / (bandwidth * 1e9)
                pred, refused = predicted_speedup(tau, r["step_s"] / base[label]) if base.get(label) else (None, None)
                rows.append(dict(batch=B, prompt=P, method=method, depth=depth, nodes=nodes, mode=label, **r,
                                 tau_expected=tau, per_token_s=r["step_s"] / tau,
                                 tokens_per_s=B * tau / r["step_s"], predicted_speedup=pred,
                                 prediction_refused=refused, floor_step_s=floor, floor_per_token_s=floor / tau))
        _free(model.device)
    return dict(rows=rows, skipped=skipped, errors=errors, weight_bytes=wb)


def _free(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class OracleTauError(RuntimeError):
    """A run's measured tau left the oracle's promise: its speedup says nothing about that tau."""


def tau_check(tokens_per_step: list[int], depth: int, p_corrupt: float, max_new_tokens: int,
              z: float = 4.0) -> dict:
    """Measured tokens per step against the oracle's promise sum_{i=0..depth} (1 - p)^i.

    Only the steps whose budget allowed the full depth count (the last few steps draft fewer
    tokens); a step in which the oracle drafted nothing (off its stream) counts as the 1 token it
    committed, so a collapse shows. Tolerance: ``z`` standard errors of the mean of n steps, from
    the exact law of one step's tokens (1 + the number of leading uncorrupted drafts, at most depth).

    Args:
        tokens_per_step: ``GenerationStats.tokens_per_step`` (index 0: the prefill's token).
    Returns:
        dict(tau_full, full_steps, tau_expected, tolerance, ok); ok is None when no step had the
        full depth.
    """
    a, done, full = 1.0 - p_corrupt, tokens_per_step[0], []
    for n in tokens_per_step[1:]:
        if max_new_tokens - done - 1 >= depth:  # the step's draft budget (Decoder.propose)
            full.append(n)
        done += n
    law = [(j + 1, a ** j * (1 - a)) for j in range(depth)] + [(depth + 1, a ** depth)]  # (tokens, probability)
    mean = sum(t * q for t, q in law)
    sd = math.sqrt(max(sum(t * t * q for t, q in law) - mean ** 2, 0.0))
    if not full:
        return dict(tau_full=None, full_steps=0, tau_expected=mean, tolerance=None, ok=None)
    tol = z * sd / math.sqrt(len(full)) + 1e-9
    tau = sum(full) / len(full)
    return dict(tau_full=tau, full_steps=len(full), tau_expected=mean, tolerance=tol, ok=abs(tau - mean) <= tol)


def oracle_speedup(model, prompt_len: int, max_new_tokens: int, p_corrupt: float, seed: int = 0,
                   methods=METHODS, reanchor: bool = True, check_tau: bool = True, tau_z: float = 4.0,
                   cuda_graphs: bool = False) -> dict:
    """Batch 1 through ``generate``: vanilla, then the oracle as a chain and as a tree.

    Per method: output identical to vanilla, tau (measured and expected), decode tokens/s, the
    measured speedup, and the cost model's prediction from the same run's per-step draft and
    target time against vanilla's target time (no loop overhead: the gap to the measured speedup is
    what sampling, verification, KV commit and Python cost; ``phase_s_per_step`` has each part). A
    prediction above the method's tau is refused (``cost_check.predicted_speedup``: None, and
    ``prediction_refused`` says why). On a GPU the phases are timed by CUDA events (``minispec.clock``).

    The oracle re-anchors when the context leaves its stream (``reanchor``; see
    ``lab.oracle``); re-anchoring is the measuring device's cost, so its time is taken out of
    the draft phase and the decode time and reported as ``reanchor_s`` with the count
    ``reanchors``. Then tau is checked against the promise (``tau_check``, ``tau_z`` standard
    errors): with ``check_tau`` a departure raises ``OracleTauError``, naming the method, its
    re-anchors and off-stream proposals, instead of reporting the speedup of another tau.

    Args:
        methods: {name: (depth, draft nodes)}, "vanilla": (0, 0) included.
        cuda_graphs: decode through ``generate(..., cuda_graphs=True)`` (the reference stream too).
    Returns:
        dict(prompt_tokens, max_new_tokens, p_corrupt, methods={name: {...}}, identical_all, tau_ok_all).
    """
    from .cost_check import predicted_speedup
    from ..generate import generate
    from ..tokenizer import ByteTokenizer

    tok = ByteTokenizer()  # decodes any id (mod 256): text is not looked at
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    depth_max = max(d for d, _ in methods.values())
    generate(model, tok, prompt, max_new_tokens=4, chat=False, stop_at_eos=False, cuda_graphs=cuda_graphs)  # warm-up
    ref = generate(model, tok, prompt, max_new_tokens=max_new_tokens + depth_max, chat=False, stop_at_eos=False,
                   cuda_graphs=cuda_graphs)
    stream = ref.prompt_tokens + ref.tokens
    out = {method: _oracle_run(model, tok, prompt, ref, stream, depth, nodes, p_corrupt, max_new_tokens, seed, reanchor,
                               tau_z, cuda_graphs) for method, (depth, nodes) in methods.items()}
    base = out["vanilla"]
    for r in out.values():
        r["measured_speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["predicted_speedup"], r["prediction_refused"] = predicted_speedup(
            r["tau_step"], (r["target_s"] + r["draft_s"]) / base["target_s"])
    bad = {m: r for m, r in out.items() if r["tau_ok"] is False}
    if check_tau and bad:
        raise OracleTauError("; ".join(
            f"{m}: measured tau {r['tau_full']:.2f} over {r['full_steps']} full-depth steps, promised "
            f"{r['tau_expected']:.2f} +- {r['tau_tolerance']:.2f} ({r['reanchors']} re-anchors, {r['off_stream']} "
            f"proposals off the stream, diverged at {r['diverged_at'][:5]})" for m, r in bad.items())
            + ": the speedup measured would belong to another tau")
    return dict(prompt_tokens=prompt_len, max_new_tokens=max_new_tokens, p_corrupt=p_corrupt, methods=out,
                identical_all=all(r["identical"] for r in out.values()),
                tau_ok_all=all(r["tau_ok"] is not False for r in out.values()))


def _oracle_run(model, tok, prompt, ref, stream, depth, nodes, p_corrupt, max_new_tokens, seed, reanchor, tau_z,
                cuda_graphs=False) -> dict:
    """One method of ``oracle_speedup`` (nodes 0: vanilla): warm-up, one timed generation, its row."""
    from ..generate import generate

    drafter = None if nodes == 0 else OracleDrafter(stream, k=depth, p_corrupt=p_corrupt, seed=seed,
                                                    tree_nodes=nodes, vocab_size=model.cfg.vocab_size,
                                                    target=model if reanchor else None)
    if drafter is not None:  # warm-up: kernels for this tree size
        generate(model, tok, prompt, drafter=drafter, max_new_tokens=2 * depth + 2, chat=False, stop_at_eos=False,
                 cuda_graphs=cuda_graphs)
    r = generate(model, tok, prompt, drafter=drafter, max_new_tokens=max_new_tokens, chat=False, stop_at_eos=False,
                 cuda_graphs=cuda_graphs)
    s = r.stats
    steps = len(s.nodes)
    re_s = getattr(drafter, "reanchor_s", 0.0)
    phase = dict(s.phase_s, draft=s.phase_s["draft"] - re_s)
    decode_s = s.decode_s - re_s
    first = next((i for i, (a, b) in enumerate(zip(r.tokens, ref.tokens)) if a != b), None)
    check = tau_check(s.tokens_per_step, depth, p_corrupt if nodes else 1.0, max_new_tokens, tau_z)
    return dict(depth=depth, nodes=nodes, identical=r.tokens == ref.tokens[:max_new_tokens],
                first_difference=first, off_stream=getattr(drafter, "off_stream", 0),
                reanchors=getattr(drafter, "reanchors", 0), reanchor_s=re_s,
                diverged_at=list(getattr(drafter, "diverged_at", [])),
                tau_expected=expected_tau(p_corrupt, depth) if nodes else 1.0,
                tau_step=(s.new_tokens - 1) / steps, tau_full=check["tau_full"],
                full_steps=check["full_steps"], tau_tolerance=check["tolerance"], tau_ok=check["ok"],
                steps=steps, decode_tokens_per_s=(s.new_tokens - 1) / decode_s,
                draft_s=phase["draft"] / steps, target_s=phase["target"] / steps,
                step_s=decode_s / steps, phase_s_per_step={k: v / steps for k, v in phase.items()})
