"""``python -m minispec profile``: where a decode step's time goes, per method, next to the hardware floor.

For each method the decode loop's own clock (``GenerationStats.phase_s``) splits the decode time
into draft, target forward, verify (sampling + acceptance), KV commit, feature hand-off and the
rest of the loop; dividing by the number of steps gives milliseconds per step. In the same run:

  bandwidth   the machine's memory copy bandwidth (read + write bytes of a large tensor copy);
  floor       the target's weight bytes read per forward / that bandwidth: what a single-token
              forward cannot beat when decoding is memory-bound;
  peak        the machine's fp32 matrix-multiply rate (a large GEMM through the same weight-panel
              oneDNN path the model uses), and with it the compute floor of a forward over N + 1
              rows: (N + 1) x 2 x (linear weights) FLOP / peak. Extra rows pay at least this, so
              it bounds how cheap verification can get on this machine;
  verify      a target forward over N + 1 tokens against N (``lab.tune.verify_cost_curve``),
              as a ratio to N = 0: how much verifying N drafts costs beyond decoding one token;
  breakdown   where a one-row forward's time goes beyond the floor (``forward_breakdown``): the
              linear products, attention, norms, the MLP's activation and the rest, the number of
              ATen ops it runs, what one small op costs hot and right after a weight stream, and the
              eager floor: the same forward with the widths shrunk so that its weight products cost
              next to nothing (``eager_floor``), which no faster weight kernel can take away.

The speedup model of chapter 1 reads off the same numbers: per step a method pays
draft + target(N) + verify + commit + hand-off + other and commits tau tokens; vanilla pays the
same with N = 0 and tau = 1.

Shapes: N draft nodes per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import Counter

import torch

from ..generate import PHASES
from .text_table import Col, text_table


def copy_bandwidth(mib: int = 256, reps: int = 5, device=None) -> float:
    """Memory bandwidth in GB/s of copying a ``mib`` MiB fp32 tensor (bytes read + written), best of
    ``reps``, on ``device`` (default the CPU, where both tensors are in 2 MiB pages as the weight panels are:
    the faster copy, so the floor it gives is the lower; on a GPU its memory)."""
    device = torch.device(device or "cpu")
    n = mib * 2**20 // 4
    if device.type == "cpu":
        from ..exact.hugepages import huge_page_empty

        src, dst = huge_page_empty((n,)).fill_(1.0), huge_page_empty((n,))
    else:
        src = torch.ones(n, device=device)
        dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src), device) for _ in range(reps))
    return 2 * src.numel() * 4 / best / 1e9


def matmul_peak(n: int = 1024, reps: int = 5, device=None, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of an n x n x n product, best of ``reps``. On the CPU in fp32 through
    ``minispec.exact.linear.ExactLinear`` (the path a CPU model's layers take); elsewhere (a GPU,
    another dtype) a plain ``torch.mm`` of ``dtype`` on ``device``."""
    device = torch.device(device or "cpu")
    if device.type == "cpu" and dtype == torch.float32:
        from ..exact.linear import ExactLinear

        lin, a = ExactLinear(n, n, bias=False), torch.randn(n, n)
        fn = lambda: lin(a)  # noqa: E731
    else:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        fn = lambda: torch.mm(a, b)  # noqa: E731
    with torch.inference_mode():
        fn()  # builds the weight panels once / loads the kernel
        best = min(_timed(fn, device) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def _timed(fn, device: torch.device = torch.device("cpu")) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def weight_bytes(model) -> int:
    """Bytes of the weights one forward reads: every linear layer's weight (the LM head included; the
    embedding table is read one row per token and not counted)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))


SECTIONS = ("linear", "attention", "norm", "mlp_act", "rest")


@torch.inference_mode()
def forward_breakdown(target, context: int = 256, reps: int = 20) -> dict:
    """Where a one-row decode forward's time goes, after ``context`` cached tokens.

    Forward hooks time each module's own share (its time less its children's): "linear" the weight
    products with their row padding (``torch.nn.Linear`` and the exact backend's; the LM head included), "attention" the
    attention module less its projections (rope, KV write, the row-invariant attention), "norm" the
    norms, "mlp_act" the MLP less its projections (SiLU and product), "rest" the forward less all of
    these (embedding, residual adds, the plan, Python). The hooks cost time of their own, so the forward
    without them is reported beside (``forward_ms``). Also: the ATen ops one forward runs, counted by name
    (``ops_by_name``, most frequent first: views and reshapes cost a dispatch each too), and the time
    of one small op (``x + x`` on a row) hot and right after the LM head has streamed its weights,
    which is what most of those ops pay in a forward; and ``eager_floor_ms``, the same forward with the
    widths shrunk (``eager_floor``).
    """
    from ..model import MLP, Attention, RMSNorm

    kinds = {torch.nn.Linear: "linear", Attention: "attention", RMSNorm: "norm", torch.nn.LayerNorm: "norm", MLP: "mlp_act"}
    forward = _decode_forward(target, context)
    plain = _median_ms(forward, reps)
    totals, stack, handles = dict.fromkeys(SECTIONS, 0.0), [], []

    def pre(module, args):
        stack.append([time.perf_counter(), 0.0])

    def post(kind):
        def hook(module, args, out):
            t0, children = stack.pop()
            elapsed = time.perf_counter() - t0
            totals[kind] += elapsed - children
            if stack:
                stack[-1][1] += elapsed
        return hook

    for m in target.modules():
        kind = next((k for cls, k in kinds.items() if isinstance(m, cls)), None)
        if kind:
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post(kind))]
    try:
        forward(), forward()
        for k in totals:
            totals[k] = 0.0
        t0 = time.perf_counter()
        for _ in range(reps):
            forward()
        hooked = (time.perf_counter() - t0) / reps * 1e3
    finally:
        for h in handles:
            h.remove()
    ms = {k: v / reps * 1e3 for k, v in totals.items()}
    ms["rest"] = hooked - sum(ms.values())
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward()
    top = Counter(e.name for e in prof.events() if e.cpu_parent is None)  # the ops the forward itself calls
    row = torch.randn(1, target.cfg.d_model, device=target.device)
    small_hot = _median_ms(lambda: row + row, 200) * 1e3

    def after_stream():
        target.lm_head(row)
        t0 = time.perf_counter()
        row + row
        return time.perf_counter() - t0

    for _ in range(3):
        after_stream()
    small_cold = sorted(after_stream() for _ in range(50))[25] * 1e6
    return dict(context=context, forward_ms=plain, hooked_forward_ms=hooked, section_ms=ms, aten_ops=sum(top.values()),
                ops_by_name=dict(top.most_common()), small_op_us=dict(hot=small_hot, after_weight_stream=small_cold),
                eager_floor_ms=eager_floor(target, context, reps))


def _decode_forward(target, context: int):
    """A one-row decode forward of ``target`` after ``context`` cached tokens, as a function (its keys discarded)."""
    from ..kv import KVCache

    kv = KVCache.for_model(target, context + 2)
    target(torch.randint(0, target.cfg.vocab_size, (1, context), device=target.device), kv=kv)
    kv.commit()
    x = torch.tensor([[1]], device=target.device)

    def forward():
        target(x, kv=kv)
        kv.discard()
    return forward


def _median_ms(fn, n: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3  # median ms


@torch.inference_mode()
def eager_floor(target, context: int = 256, reps: int = 20) -> float:
    """Median ms of a one-row decode forward of ``target``'s architecture with its widths shrunk: the model width,
    the MLP width and the vocabulary made tiny (random weights), its layers, heads, head dim, attention over
    ``context`` cached keys, norms, rope and every op kept, on the same kernels. Its weight products cost next
    to nothing, so this is what a forward costs beyond them in eager PyTorch (ops, their dispatch, Python and
    the attention itself): the part of the distance to the weight floor that no faster weight kernel removes."""
    from ..exact import prepack

    return _median_ms(_decode_forward(prepack(shrunk_model(target)), context), reps)


def shrunk_model(target):
    """``target``'s architecture (layers, heads, KV heads, head dim, context, attention backend, dtype, device) with
    model width, MLP width and vocabulary of 32, 32 and 64 (whole weight panels, ``linear.PANEL``), random
    weights: what ``eager_floor`` times. Each of its linear layers runs under the row recipe of the target's layer
    of the same name (its padding rows, its split of the input features; ``minispec.exact.recipes``): a plan is
    probed per shape and CPU, so a layer left to probe its own small shape could take another and run other
    ops."""
    from .. import exact
    from ..exact.linear import PANEL, ExactLinear
    from ..model import Transformer

    cfg = dataclasses.replace(target.cfg, d_model=PANEL, d_ff=PANEL, vocab_size=2 * PANEL,
                              name=f"{target.cfg.name} (shrunk)")
    with torch.inference_mode(False):  # weights that keep a version counter (the prepacked copies read it)
        small = Transformer(cfg).to(target.device, target.dtype).eval().requires_grad_(False)
        if isinstance(target.lm_head, ExactLinear):
            exact.apply(small)
    small.attention = target.attention
    layers = dict(target.named_modules())
    for name, m in small.named_modules():
        if isinstance(m, ExactLinear) and isinstance(layers.get(name), ExactLinear):
            m._recipe = layers[name]._recipe  # (kernel, split, min_rows, multiple): the target layer's own
    return small


def step_breakdown(target, tok, prompts: list[str], drafters: dict, max_new_tokens: int, params=None,
                   seed: int = 0) -> dict:
    """Mean ms per decode step of each phase (``generate.PHASES``) with tau and nodes, per method.

    Methods are interleaved per prompt (so drift of a shared machine hits all alike), after one
    short warm-up generation each.

    Args:
        drafters: method name -> drafter (None for vanilla).
        params: a ``SamplingParams`` (None: greedy); sampled runs are seeded with ``seed``, the
            same seed for every method, so each method sees the same prompts and seeds.
    """
    from .. import generate
    from ..sampling import GREEDY

    params = params or GREEDY
    kw = dict(params=params, seed=None if params.greedy else seed)

    acc = {m: dict(phase=dict.fromkeys(PHASES, 0.0), steps=0, nodes=0, new=0, forwards=0) for m in drafters}
    for m, d in drafters.items():
        generate(target, tok, prompts[0], drafter=d, max_new_tokens=8, **kw)  # warm-up
    for p in prompts:
        for m, d in drafters.items():
            s, a = generate(target, tok, p, drafter=d, max_new_tokens=max_new_tokens, **kw).stats, acc[m]
            for k, v in s.phase_s.items():
                a["phase"][k] += v
            a["steps"] += len(s.nodes)
            a["nodes"] += sum(s.nodes)
            a["new"], a["forwards"] = a["new"] + s.new_tokens, a["forwards"] + s.target_forwards
    out = {}
    for m, a in acc.items():
        ms = {k: v / a["steps"] * 1e3 for k, v in a["phase"].items()}
        out[m] = dict(step_ms=sum(ms.values()), phase_ms=ms, steps=a["steps"], mean_nodes=a["nodes"] / a["steps"],
                      tau=a["new"] / a["forwards"])
    return out


def run_profile(model_name: str, methods: list[str], prompts: list[str], max_new_tokens: int, sizes, context: int,
                reps: int, draft_vocab=None, params=None, breakdown: bool = True) -> dict:
    """Everything ``python -m minispec profile`` reports, as one dict (``breakdown``: with ``forward_breakdown``)."""
    from .. import load
    from ..auto import resolve
    from ..methods import Methods
    from ..sampling import GREEDY
    from .tune import verify_cost_curve

    target, tok = load(model_name)
    bw = copy_bandwidth()
    wb = weight_bytes(target)
    peak = matmul_peak()
    flops_row = 2 * wb // next(target.parameters()).element_size()  # one multiply-add per weight per row
    with torch.inference_mode():
        curve = verify_cost_curve(target, sizes=sizes, context=context, reps=reps)[1]
    t0 = curve[min(curve)]
    parts = forward_breakdown(target, context) if breakdown else None
    made = Methods(target, model_name, draft_vocab=draft_vocab)
    drafters = {m: made.drafter(resolve(m, made, say=lambda line: print(line, flush=True), params=params or GREEDY))
                for m in methods}  # auto: this machine's saved choice (or the default), announced
    rows = step_breakdown(target, tok, prompts, drafters, max_new_tokens, params)
    base = rows.get("vanilla")
    for r in rows.values():
        r["ms_per_token"] = r["step_ms"] / r["tau"]
        if base:
            r["speedup_vs_vanilla"] = base["ms_per_token"] / r["ms_per_token"]
    return dict(model=model_name, copy_bandwidth_gb_s=bw, weight_bytes=wb, weight_floor_ms=wb / (bw * 1e9) * 1e3,
                verify_ms={n: t * 1e3 for n, t in curve.items()}, verify_ratio={n: t / t0 for n, t in curve.items()},
                peak_gflop_s=peak, flop_per_row=flops_row,
                compute_floor_ms={n: (n + 1) * flops_row / (peak * 1e9) * 1e3 for n in curve},
                extra_rows_gflop_s={n: n * flops_row / ((t - t0) * 1e9) for n, t in curve.items() if n and t > t0},
                context=context, methods=rows, prompts=len(prompts), max_new_tokens=max_new_tokens,
                sampling=dataclasses.asdict(params or GREEDY), breakdown=parts)


def format_breakdown(b: dict, floor_ms: float) -> list[str]:
    """``forward_breakdown``'s lines for the profile's header."""
    ms = b["section_ms"]
    return [f"one-row forward (context {b['context']}): {b['forward_ms']:.1f} ms = {floor_ms / b['forward_ms']:.2f} of the "
            f"floor; with timing hooks {b['hooked_forward_ms']:.1f} ms: " + ", ".join(f"{k} {ms[k]:.1f}" for k in SECTIONS),
            f"  {b['aten_ops']} ATen ops per forward; one small op {b['small_op_us']['hot']:.1f} us hot, "
            f"{b['small_op_us']['after_weight_stream']:.1f} us right after a weight stream",
            f"  eager floor: the same forward with its widths shrunk (weight products next to free) "
            f"{b['eager_floor_ms']:.1f} ms",
            "  most called: " + ", ".join(f"{name.removeprefix('aten::')} {n}"
                                          for name, n in list(b["ops_by_name"].items())[:8])]


def format_profile(r: dict) -> str:
    lines = [f"memory copy bandwidth {r['copy_bandwidth_gb_s']:.1f} GB/s; target weights {r['weight_bytes'] / 2**20:.0f} MiB "
             f"-> floor {r['weight_floor_ms']:.1f} ms per forward",
             f"fp32 matmul peak {r['peak_gflop_s']:.0f} GFLOP/s; {r['flop_per_row'] / 1e6:.0f} MFLOP per row -> compute "
             "floor " + ", ".join(f"N={n} {ms:.1f} ms" for n, ms in r["compute_floor_ms"].items()),
             "extra rows run at " + ", ".join(f"N={n} {g:.0f} GFLOP/s" for n, g in r["extra_rows_gflop_s"].items()),
             "decode steps: " + ("greedy" if not r.get("sampling", {}).get("temperature") else
                                 "sampled (temperature {temperature}, top_k {top_k}, top_p {top_p}), seeded".format(**r["sampling"])),
             "target forward over N + 1 tokens (context %d): " % r["context"] + ", ".join(
                 f"N={n} {ms:.1f} ms ({r['verify_ratio'][n]:.2f}x)" for n, ms in r["verify_ms"].items()),
             *(format_breakdown(r["breakdown"], r["weight_floor_ms"]) if r.get("breakdown") else []),
             ""]
    cols = [Col("method", width=16, left=True), Col("nodes", ".1f", 5), Col("tau", ".2f", 5), Col("step ms", ".1f", 8),
            *(Col(p, ".2f", 8) for p in PHASES), Col("ms/token", ".1f", 8), Col("vs vanilla", width=10)]
    rows = [[m, x["mean_nodes"], x["tau"], x["step_ms"], *(x["phase_ms"][p] for p in PHASES), x["ms_per_token"],
             f"{x['speedup_vs_vanilla']:.2f}x" if "speedup_vs_vanilla" in x else None] for m, x in r["methods"].items()]
    return "\n".join(lines + text_table(cols, rows))


def main(argv=None) -> int:
    from .benchinfo import save_json
    from ..config import fast
    from .env import default_threads
    from ..args import at_least, thread_count
    from ..methods import parse_method
    from ..prompts import own_prompts

    ap = argparse.ArgumentParser(prog="python -m minispec profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="vanilla,pld,eagle,eagle2@5/6/16,eagle2")
    ap.add_argument("--prompts", type=at_least(1), default=4, help="minispec's own prompts (never Spec-Bench)")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64)
    ap.add_argument("--sizes", default="0,1,2,4,8,16,32,64", help="N of the verify-cost curve")
    ap.add_argument("--context", type=at_least(1), default=256)
    ap.add_argument("--reps", type=at_least(1), default=7)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--no-prepack", action="store_true", help="F.linear instead of the weight panels (the before figure)")
    ap.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: one per idle core)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampled, seeded")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                    help="where a one-row forward's time goes (sections, ATen ops, a small op hot and cold)")
    ap.add_argument("--json", default=None, help="write the result (device, versions, settings) here")
    args = ap.parse_args(argv)
    from ..sampling import SamplingParams

    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p)
        methods = [parse_method(m.strip()).name for m in args.methods.split(",") if m.strip()]
        sizes = sorted({at_least(0)(n) for n in args.sizes.split(",")})
    except (ValueError, argparse.ArgumentTypeError) as e:
        ap.error(f"--sizes: {e}" if isinstance(e, argparse.ArgumentTypeError) else str(e))
    if not methods:
        ap.error("--methods names no method")
    torch.set_num_threads(args.threads if args.threads is not None else default_threads())
    if args.no_prepack:
        from ..exact.linear import ExactLinear

        ExactLinear.prepack = False
    n_prompts, tokens = (1, 8) if fast() else (args.prompts, args.max_new_tokens)
    prompts = [p["prompt"] for p in own_prompts()][:n_prompts]
    r = run_profile(args.model, methods, prompts, tokens, sizes, args.context, args.reps, args.draft_vocab, params,
                    args.breakdown)
    print(format_profile(r))
    if args.json:
        print(f"saved {save_json(args.json, dict(benchmark='profile', threads=torch.get_num_threads(), prepacked=not args.no_prepack, **r))}")
    return 0
