"""Checks of chapter 9's exercises (solutions/ch09_scaling.py): the roofline of a decode step at scale.

    9.1 step_bytes          bytes a forward reads: every linear weight once (LM head included, tied
                            or not) + the KV cache of batch x context tokens (grouped-query heads)
    9.2 roofline_step_s     the slower of reading those bytes and computing every row's FLOPs
                            (linear layers + attention over the context)
    9.3 corruption_for_tau  the oracle's corruption rate for a wanted tau (inverse of expected_tau)
    9.4 crossover_batch     the smallest batch at which speculation's roofline speedup falls below 1

Every check is exact on the CPU: the shapes of Llama-3.1-8B, Llama-3.2-1B, SmolLM2-135M, minispec's
tiny presets, a few hand-made ones (multi-head, head_dim not d_model / n_head) and a hundred random
Llama-family configurations, in fp32, bf16, fp16 and fp8. The references are written here from
the shapes; ``--impl minispec`` answers with ``minispec.lab.scale`` (which counts the weights of a
model built on the meta device) and ``minispec.lab.oracle``, so the two are checked against
each other. A failure names the case and, for the usual slips, what was missed. An answer that calls
minispec's function of the same name (``forbidden``: the library's answer) fails, whatever it returns.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import torch

from minispec.model import ModelConfig

from .checks import exercise, refusing

TITLE = "Scaling to Llama: step bytes, the roofline, the oracle's tau, the crossover batch"
MODULE = "ch09_scaling"
EXERCISES: list = []
N_RANDOM = 100
REL = 1e-9
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
CPU = (15e9, 200e9)  # bytes/s, FLOP/s: the order of this project's CPUs (fp32)
H100 = (3.35e12, 989e12)  # the H100 SXM5 spec sheet (bf16 dense)


# --------------------------------------------------------------------------- references, from the shapes
def _size(dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _layer_weights(cfg) -> int:
    H, Hkv, hd, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model
    return D * (H + 2 * Hkv) * hd + H * hd * D + 3 * D * cfg.d_ff  # wqkv, wo, gate_up, down


def reference_weights(cfg) -> int:
    return cfg.n_layer * _layer_weights(cfg) + cfg.vocab_size * cfg.d_model  # + the LM head


def reference_kv_elements(cfg, batch, context, heads=None, tensors=2) -> int:
    return tensors * cfg.n_layer * (heads or cfg.n_kv_head) * cfg.head_dim * batch * context


def reference_step_bytes(cfg, batch, context, dtype) -> int:
    return (reference_weights(cfg) + reference_kv_elements(cfg, batch, context)) * _size(dtype)


def reference_flops_per_row(cfg, context, heads=None) -> int:
    return 2 * reference_weights(cfg) + 4 * cfg.n_layer * (heads or cfg.n_head) * cfg.head_dim * context


def reference_roofline(cfg, batch, new_tokens, context, dtype, bandwidth, peak) -> float:
    return max(reference_step_bytes(cfg, batch, context, dtype) / bandwidth,
               batch * new_tokens * reference_flops_per_row(cfg, context) / peak)


def promise(p: float, k: int) -> float:
    return sum((1.0 - p) ** i for i in range(k + 1))


def reference_speedup(cfg, batch, nodes, tau, context, dtype, bandwidth, peak) -> float:
    return tau * reference_roofline(cfg, batch, 1, context, dtype, bandwidth, peak) / reference_roofline(
        cfg, batch, nodes + 1, context, dtype, bandwidth, peak)


def reference_crossover(cfg, nodes, tau, context, dtype, bandwidth, peak, max_batch):
    return next((b for b in range(1, max_batch + 1)
                 if reference_speedup(cfg, b, nodes, tau, context, dtype, bandwidth, peak) < 1), None)


# --------------------------------------------------------------------------- the library behind the signatures
def library():
    """minispec.lab.scale and minispec.lab.oracle behind the exercises' signatures (``--impl minispec``)."""
    from minispec.lab import scale
    from minispec.lab.oracle import corruption_for_tau

    return SimpleNamespace(__name__="minispec.lab.scale (chapter 9)", minispec_library=True,
                           step_bytes=scale.step_bytes, roofline_step_s=scale.roofline_step_s,
                           corruption_for_tau=corruption_for_tau, crossover_batch=scale.crossover_batch)


def forbidden(ex_id: str) -> dict:
    """The library functions whose answer is exercise ``ex_id``'s: its check refuses a call into them."""
    from minispec.lab import oracle
    from minispec.lab import scale

    names = {"9.1": [(scale, "step_bytes")], "9.2": [(scale, "roofline_step_s")],
             "9.3": [(oracle, "corruption_for_tau")],
             "9.4": [(scale, "crossover_batch"), (scale, "roofline_speedup")]}[ex_id]
    return {f"{m.__name__}.{n}": getattr(m, n) for m, n in names}


# --------------------------------------------------------------------------- cases
def _llama(name, vocab, n_layer, n_head, d_model, d_ff, n_kv_head, head_dim=None, tie=False) -> ModelConfig:
    return ModelConfig("llama", vocab, n_layer, n_head, d_model, d_ff, max_seq_len=4096, n_kv_head=n_kv_head,
                       head_dim=head_dim, tie_embeddings=tie, name=name)


def configs(rng: random.Random, n_random: int = N_RANDOM):
    """Named shapes first, then random Llama-family ones."""
    from minispec.lab.scale import llama_config

    out = [llama_config(n) for n in ("llama-3.1-8b", "llama-3.2-1b", "tiny", "tiny-draft")]
    out += [_llama("smollm2-135m", 49152, 30, 9, 576, 1536, 3, tie=True),
            _llama("multi-head (no GQA)", 1000, 3, 4, 64, 176, 4),
            _llama("head_dim 32, not d_model / n_head", 512, 2, 4, 64, 128, 2, head_dim=32, tie=True),
            _llama("one KV head", 300, 1, 8, 96, 200, 1)]
    for i in range(n_random):
        kv = rng.choice([1, 2, 4])
        hd = rng.choice([8, 16, 32, 64])
        out.append(_llama(f"random #{i}", rng.randint(50, 5000), rng.randint(1, 6), kv * rng.choice([1, 2, 4]),
                          8 * rng.randint(2, 40), 8 * rng.randint(2, 80), kv, head_dim=hd, tie=rng.random() < 0.5))
    return out


def _describe(cfg) -> str:
    return (f"{cfg.name or 'config'} (n_layer={cfg.n_layer}, n_head={cfg.n_head}, n_kv_head={cfg.n_kv_head}, "
            f"head_dim={cfg.head_dim}, d_model={cfg.d_model}, d_ff={cfg.d_ff}, vocab_size={cfg.vocab_size}, "
            f"tie_embeddings={cfg.tie_embeddings})")


def _number(x, what: str, case: str) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise AssertionError(f"{what} must be a number, got {x!r} {case}")
    return x


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-300)


# --------------------------------------------------------------------------- 9.1
def _bytes_cases(rng: random.Random):
    for cfg in configs(rng):
        dtype = rng.choice(DTYPES)
        for batch, context in ((1, 0), (1, 1), (rng.randint(1, 64), rng.randint(0, 9000))):
            yield cfg, batch, context, dtype
    from minispec.lab.scale import llama_config
    yield llama_config("llama-3.1-8b"), 32, 131072, torch.bfloat16  # the KV cache outweighs the weights


def _bytes_hint(got, cfg, batch, context, dtype) -> str:
    s, w = _size(dtype), reference_weights(cfg)
    kv = reference_kv_elements(cfg, batch, context)
    slips = [
        (w * s, "the KV cache is missing: every cached token's keys and values are read"),
        ((w + reference_kv_elements(cfg, batch, context, tensors=1)) * s, "a key AND a value per token, layer and KV "
                                                                          "head"),
        ((w + reference_kv_elements(cfg, batch, context, heads=cfg.n_head)) * s,
         "grouped-query attention: the cache holds n_kv_head heads, not n_head"),
        ((w - cfg.vocab_size * cfg.d_model + kv) * s, "the LM head is read by every forward (tied or not)"),
        ((w + cfg.vocab_size * cfg.d_model + kv) * s, "the embedding table is read one row per token, not whole: "
                                                      "count only the LM head"),
        (w + kv, "bytes, not elements: multiply by the dtype's size"),
        ((w + kv) * torch.finfo(dtype).bits, "bytes, not bits"),
    ]
    return next(("; " + why for v, why in slips if got == v and v != (w + kv) * s), "")


@exercise(EXERCISES, "9.1", "step_bytes")
def check_step_bytes(impl):
    fn = refusing(impl, "step_bytes", forbidden("9.1"))
    for cfg, batch, context, dtype in _bytes_cases(random.Random(91)):
        case = f"for {_describe(cfg)}, batch={batch}, context={context}, dtype={dtype}"
        want = reference_step_bytes(cfg, batch, context, dtype)
        got = _number(fn(cfg, batch, context, dtype), "step_bytes", case)
        if got != want:
            raise AssertionError(f"returned {got} {case}, expected {want} ({reference_weights(cfg) * _size(dtype)} "
                                 f"weight bytes){_bytes_hint(got, cfg, batch, context, dtype)}")


# --------------------------------------------------------------------------- 9.2
def _roof_cases(rng: random.Random):
    from minispec.lab.scale import llama_config

    big = llama_config("llama-3.1-8b")
    yield big, 1, 1, 1024, torch.bfloat16, *H100  # memory-bound
    yield big, 32, 61, 1024, torch.bfloat16, *H100  # compute-bound
    yield big, 64, 6, 32768, torch.bfloat16, *H100  # the KV cache dominates
    yield big, 1, 300, 0, torch.bfloat16, *H100  # near the ridge
    for cfg in configs(rng, n_random=40):
        for _ in range(3):
            bw, peak = rng.choice([CPU, H100, (1e11, 1e11), (1e12, 1e15)])
            yield (cfg, rng.randint(1, 64), rng.choice([1, 2, 6, rng.randint(1, 80)]), rng.randint(0, 20000),
                   rng.choice(DTYPES), bw, peak)


def _roof_hint(got, cfg, batch, new, context, dtype, bw, peak) -> str:
    mem = reference_step_bytes(cfg, batch, context, dtype) / bw
    comp = batch * new * reference_flops_per_row(cfg, context) / peak
    slips = [
        (mem + comp, "the bound is the slower of the two times, not their sum"),
        (max(mem, batch * new * 2 * reference_weights(cfg) / peak), "attention over the context costs FLOPs too"),
        (max(mem, batch * new * reference_flops_per_row(cfg, context, heads=cfg.n_kv_head) / peak),
         "every query head attends (n_head), not only the KV heads"),
        (max(mem, comp / 2), "a multiply-add is 2 FLOPs"),
        (max(mem, new * reference_flops_per_row(cfg, context) / peak), "every sequence of the batch computes its rows"),
        (mem, "the compute time is missing"),
        (comp, "the memory time is missing"),
    ]
    want = max(mem, comp)
    return next(("; " + why for v, why in slips if _close(got, v) and not _close(v, want)), "")


@exercise(EXERCISES, "9.2", "roofline_step_s")
def check_roofline_step_s(impl):
    fn = refusing(impl, "roofline_step_s", forbidden("9.2"))
    for cfg, batch, new, context, dtype, bw, peak in _roof_cases(random.Random(92)):
        case = (f"for {_describe(cfg)}, batch={batch}, new_tokens={new}, context={context}, dtype={dtype}, "
                f"bandwidth={bw:.3g}, peak={peak:.3g}")
        want = reference_roofline(cfg, batch, new, context, dtype, bw, peak)
        got = _number(fn(cfg, batch, new, context, dtype, bw, peak), "roofline_step_s", case)
        if not _close(got, want):
            mem = reference_step_bytes(cfg, batch, context, dtype) / bw
            comp = batch * new * reference_flops_per_row(cfg, context) / peak
            hint = _roof_hint(got, cfg, batch, new, context, dtype, bw, peak)
            raise AssertionError(f"returned {got:.6g} s {case}, expected {want:.6g} s (memory {mem:.4g} s, "
                                 f"compute {comp:.4g} s){hint}")


# --------------------------------------------------------------------------- 9.3
def _tau_cases(rng: random.Random):
    for k in (1, 2, 5, 8):
        yield 1.0, k  # p = 1: nothing accepted
        yield float(k + 1), k  # p = 0: everything
        yield 1 + k / 2, k
    yield 3.0, 5
    for _ in range(60):
        k = rng.randint(1, 12)
        yield rng.uniform(1.0, k + 1.0), k


@exercise(EXERCISES, "9.3", "corruption_for_tau")
def check_corruption_for_tau(impl):
    fn = refusing(impl, "corruption_for_tau", forbidden("9.3"))
    for tau, k in _tau_cases(random.Random(93)):
        case = f"for tau={tau!r}, k={k}"
        p = _number(fn(tau, k), "corruption_for_tau", case)
        if not 0.0 <= p <= 1.0 or math.isnan(p):
            raise AssertionError(f"returned p={p!r} {case}: a probability is in [0, 1]")
        got = promise(p, k)
        if abs(got - tau) > 1e-9:
            hint = ""
            if abs(promise(1 - p, k) - tau) <= 1e-6:
                hint = "; that is the acceptance rate 1 - p, not the corruption rate p"
            elif k > 1 and abs(promise(p, k - 1) - tau) <= 1e-6:
                hint = "; the promise has k + 1 terms: the target's own (bonus) token is the i = 0 term"
            raise AssertionError(f"returned p={p!r} {case}, whose promise is {got!r} tokens per forward, not "
                                 f"{tau!r}{hint}")
    for tau, k in ((0.5, 3), (4.5, 3), (2.0, 0), (1.0 - 1e-9, 4)):
        try:
            fn(tau, k)
        except ValueError:
            continue
        raise AssertionError(f"returned for tau={tau}, k={k} instead of raising ValueError (need k >= 1 and "
                             f"1 <= tau <= k + 1)")


# --------------------------------------------------------------------------- 9.4
def _cross_cases(rng: random.Random):
    from minispec.lab.scale import llama_config

    big, small = llama_config("llama-3.1-8b"), _llama("smollm2-135m", 49152, 30, 9, 576, 1536, 3, tie=True)
    yield big, 5, 3.0, 0, torch.bfloat16, *H100, 4096  # short context: a crossover in the hundreds
    yield big, 60, 4.0, 0, torch.bfloat16, *H100, 4096  # a big tree stops paying sooner
    yield big, 5, 3.0, 32768, torch.bfloat16, *H100, 4096  # long context: the KV reads keep it paying
    yield big, 5, 3.0, 0, torch.bfloat16, *H100, 10  # pays up to max_batch
    yield small, 5, 3.0, 256, torch.float32, *CPU, 256
    yield small, 5, 3.0, 8192, torch.float32, *CPU, 256  # SmolLM2 at a long context on a CPU
    yield small, 60, 1.5, 0, torch.float32, *CPU, 64  # a big tree at a low tau: below 1 from the first batch
    for cfg in configs(rng, n_random=30):
        nodes = rng.choice([1, 3, 5, 25, 60])
        yield (cfg, nodes, rng.uniform(1.0, nodes + 1.0), rng.choice([0, 128, 2048, rng.randint(0, 40000)]),
               rng.choice(DTYPES), *rng.choice([CPU, H100, (1e11, 1e12)]), rng.choice([64, 512, 4096]))


def _ambiguous(cfg, nodes, tau, context, dtype, bw, peak, want, max_batch) -> bool:
    """True when a speedup within rounding of 1 decides the answer (formulas equal up to rounding may differ)."""
    near = [b for b in (want, (want or max_batch + 1) - 1) if b and 1 <= b <= max_batch]
    return any(abs(reference_speedup(cfg, b, nodes, tau, context, dtype, bw, peak) - 1) < 1e-9 for b in near)


@exercise(EXERCISES, "9.4", "crossover_batch")
def check_crossover_batch(impl):
    fn = refusing(impl, "crossover_batch", forbidden("9.4"))
    for cfg, nodes, tau, context, dtype, bw, peak, max_batch in _cross_cases(random.Random(94)):
        want = reference_crossover(cfg, nodes, tau, context, dtype, bw, peak, max_batch)
        if _ambiguous(cfg, nodes, tau, context, dtype, bw, peak, want, max_batch):
            continue
        case = (f"for {_describe(cfg)}, nodes={nodes}, tau={tau:.4g}, context={context}, dtype={dtype}, "
                f"bandwidth={bw:.3g}, peak={peak:.3g}, max_batch={max_batch}")
        got = fn(cfg, nodes, tau, context, dtype, bw, peak, max_batch)
        if got is not None:
            got = _number(got, "crossover_batch", case)
        if got != want:
            at = [b for b in (got, want) if isinstance(b, (int, float)) and 1 <= b <= max_batch]
            speeds = ", ".join(f"B={int(b)}: {reference_speedup(cfg, int(b), nodes, tau, context, dtype, bw, peak):.4f}"
                               for b in sorted(set(at)))
            raise AssertionError(f"returned {got!r} {case}, expected {want!r}"
                                 + (f" (the roofline speedup at {speeds})" if speeds else ""))
