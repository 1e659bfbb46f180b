"""The model under ``torch.compile``: the static forward (chapter 8's body) traces as one graph, and the trace
computes what the eager forward computes.

On the CPU a compiled forward is the counterpart of a captured CUDA graph: one program per bucket, its
shapes fixed, replayed each step. What it costs and saves on a CPU is ``benchmarks/compiled_forward.py``'s
business; here the backend is dynamo's "eager" one (the traced graph run op by op: no C++ compiler, seconds
on two cores), which shows what only tracing can get wrong: a graph break, a recompile per step, another op.
"""

import pytest
import torch

from minispec.cuda_graphs import static_forward, static_plan, static_prefill
from minispec.kv import StaticKVCache
from minispec.exact.attention import ready
from minispec.exact.linear import ExactLinear
from minispec.loading import load


def _steps(model, forward, n: int = 3, capacity: int = 48, T: int = 1):
    """Prefill 8 tokens, then ``n`` forwards of T tokens each through ``forward``; the logits of each."""
    g = torch.Generator().manual_seed(0)
    kv = StaticKVCache.for_model(model, capacity)
    static_prefill(model, kv, torch.randint(0, 256, (1, 8), generator=g))
    kv.commit()
    out = []
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    for _ in range(n):
        tokens = torch.randint(0, 256, (1, T), generator=g)
        kv.begin(1, T)
        out.append(forward(model, kv, tokens, kv.lengths[:1, None] + torch.arange(T), causal).logits.clone())
        kv.commit()
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kernel", ["panels", "onednn"])  # the two prepacked CPU kernels (one per machine, "auto")
def test_the_static_forward_traces_as_one_graph_without_recompiles(name, T, kernel, monkeypatch):
    monkeypatch.setattr(ExactLinear, "cpu_kernel", kernel)
    torch._dynamo.reset()
    model, _ = load(name)
    with torch.inference_mode():
        eager = _steps(model, static_forward, T=T)
        kv = StaticKVCache.for_model(model, 48)
        kv.begin(1, T)
        explained = torch._dynamo.explain(static_forward)(model, kv, torch.zeros(1, T, dtype=torch.long),
                                                           torch.arange(T)[None], torch.ones(1, T, T, dtype=torch.bool))
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        assert explained.graph_count == 1
        torch._dynamo.reset()
        compiled = torch.compile(static_forward, backend="eager", dynamic=False)
        first = _steps(model, compiled, n=1, T=T)  # traced here
        with torch.compiler.set_stance("fail_on_recompile"):  # every later step: the same graph, other lengths
            traced = _steps(model, compiled, T=T)
    assert torch.equal(first[0], eager[0])
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))


def test_a_linear_traces_without_a_break_after_an_eager_call():
    layer = ExactLinear(8, 4).requires_grad_(False)
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    cold = torch._dynamo.explain(layer)(x)  # no plan yet: it is chosen eagerly, outside the graph
    eager = layer(x)
    torch._dynamo.reset()
    warm = torch._dynamo.explain(layer)(x)
    assert cold.graph_break_count > 0 and warm.graph_break_count == 0
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, backend="eager")(x), eager)


def test_past_one_key_block_the_plan_reads_its_keys_before_the_traced_call():
    """Past 128 keys the CPU's exact attention reads its key blocks on the host: inside a trace that breaks the
    graph, so a plan built before the traced call works them out first (``minispec.exact.attention.ready``)."""
    model, _ = load("tiny-llama")
    call = lambda tokens, plan, kv: model(tokens, kv=kv, plan=plan)  # noqa: E731
    token, one = torch.tensor([[5]]), torch.ones(1, 1, 1, dtype=torch.bool)
    with torch.inference_mode():
        kv = StaticKVCache.for_model(model, 200)  # 200 slots, all attended: two key blocks
        static_prefill(model, kv, torch.arange(8)[None])
        kv.commit()

        def run(fn, keys_first: bool):  # one forward of ``token`` on a fresh static plan, its entry discarded
            kv.begin(1, 1)
            plan = static_plan(kv, kv.lengths[:1, None], one)
            out = fn(token, ready(plan) if keys_first else plan, kv)
            kv.discard()
            return out

        eager = run(call, False).logits
        torch._dynamo.reset()
        inside = run(torch._dynamo.explain(call), False)
        torch._dynamo.reset()
        before = run(torch._dynamo.explain(call), True)
        torch._dynamo.reset()
        traced = run(torch.compile(call, backend="eager"), True).logits
    assert inside.graph_break_count > 0
    assert before.graph_break_count == 0 and before.graph_count == 1
    assert torch.equal(traced, eager)
