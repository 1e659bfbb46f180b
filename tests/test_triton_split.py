"""The one-launch Triton split kernel (chapter 6): results, tiles, workspace, capturability.

The kernel runs on CPU tensors in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported); the interpreter is slow, so the shapes are tiny. Ground truth is
float64 softmax attention over each row's own keys (its committed prefix, then its new tokens
under the tree mask) and minispec's PyTorch split (``reference.split_attention``). bf16 is left
to the GPU tests (tests/test_attention.py::test_gpu_bf16): the interpreter's bf16 ``tl.dot`` is
wrong (it multiplies the raw 16-bit patterns), fp16 stands in for a 2-byte dtype here.
"""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from minispec.attention import split_attention, triton_available
from minispec.attention import tiles
from minispec.grading.ch06 import tree_mask  # [T, T] ancestor mask from parents

pytestmark = [pytest.mark.ch06, pytest.mark.skipif(
    not triton_available("cpu"), reason="Triton interpreter is off (TRITON_INTERPRET=1 must precede importing triton)")]




def random_tree(T: int, g: torch.Generator) -> torch.Tensor:
    return tree_mask([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)])


def case(B, H, Hkv, T, C, lens, hd=16, tree="per_row", seed=0, dtype=torch.float32):
    """q [B, H, T, hd], a cache k, v [B, Hkv, C, hd] of random values (garbage past each row's keys shows if it
    leaks in), lengths [B] int32, and the tree mask: None (causal), [T, T] shared or [B, T, T] per row."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)
    k, v = torch.randn(B, Hkv, C, hd, generator=g), torch.randn(B, Hkv, C, hd, generator=g)
    mask = {"causal": None, "shared": random_tree(T, g),
            "per_row": torch.stack([random_tree(T, g) for _ in range(B)]) if tree == "per_row" else None}[tree]
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor(lens, dtype=torch.int32), mask


def want64(q, k, v, lens, mask) -> torch.Tensor:
    """float64 attention, row b over its P_b committed keys and its T new ones (cache slots P_b .. P_b + T - 1)."""
    B, H, T, hd = q.shape
    G = H // k.shape[1]
    out = torch.empty(B, H, T, hd, dtype=torch.float64)
    for b, P in enumerate(lens.tolist()):
        kb = k[b, :, :P + T].double().repeat_interleave(G, 0)  # [H, P + T, hd]
        vb = v[b, :, :P + T].double().repeat_interleave(G, 0)
        tm = torch.ones(T, T, dtype=torch.bool).tril() if mask is None else (mask if mask.dim() == 2 else mask[b])
        full = torch.cat([torch.ones(T, P, dtype=torch.bool), tm], -1)  # [T, P + T]
        s = (q[b].double() @ kb.transpose(-1, -2)) / math.sqrt(hd)  # [H, T, P + T]
        out[b] = torch.softmax(s.masked_fill(~full, float("-inf")), -1) @ vb
    return out


def torch_split(q, k, v, lens, mask) -> torch.Tensor:
    """minispec's PyTorch split, one row at a time over its own keys."""
    T = q.shape[2]
    rows = [split_attention(q[b:b + 1], k[b:b + 1, :, :P + T], v[b:b + 1, :, :P + T], P,
                            None if mask is None else (mask if mask.dim() == 2 else mask[b]))
            for b, P in enumerate(lens.tolist())]
    return torch.cat(rows)


class Launches:
    """Counts the launches of the kernels of ``triton_split`` (and runs them, unless ``run=False``)."""

    def __init__(self, monkeypatch, run=True):
        from minispec.attention import triton_split as ts

        self.calls, self.run = [], run
        for name in ("_split_kernel", "_prefix_kernel", "_merge_kernel"):
            monkeypatch.setattr(ts, name, self._spy(name, getattr(ts, name)))

    def _spy(self, name, kernel):
        spy = self

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    spy.calls.append((name, grid, kwargs))
                    if spy.run:
                        kernel[grid](*args, **kwargs)
                return launch
        return Spy()


# --------------------------------------------------------------------------- one launch equals the references
# (B, H, Hkv, T, C, lengths per row, tree): GQA groups 1 / 3 / 4, a decode step (T 1), chains and trees, an empty
# prefix, ragged rows in a cache with spare capacity, T past one tree tile (33 > the interpreter's 32 keys)
CASES = [
    (1, 4, 1, 1, 40, [39], "causal"),
    (3, 6, 2, 5, 70, [0, 17, 65], "per_row"),
    (2, 4, 4, 4, 50, [9, 46], "shared"),
    (2, 8, 2, 33, 80, [3, 47], "per_row"),
    (4, 4, 1, 3, 50, [47, 0, 1, 31], "causal"),
]


@pytest.mark.parametrize("B, H, Hkv, T, C, lens, tree", CASES, ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-T{c[3]}-{c[6]}"
                                                                     for c in CASES])
def test_one_launch_equals_float64_and_the_torch_split(monkeypatch, B, H, Hkv, T, C, lens, tree):
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    q, k, v, lengths, mask = case(B, H, Hkv, T, C, lens, tree=tree, seed=B * 7 + T)
    launches = Launches(monkeypatch)
    ws = SplitWorkspace()
    got = split_attention_triton(q, k, v, lengths, mask, workspace=ws)
    assert [c[0] for c in launches.calls] == ["_split_kernel"]  # prefix, tree and merge: one launch
    assert launches.calls[0][1][2] == 2  # two splits under the interpreter: the merge ran
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got.double() - want64(q, k, v, lengths, mask)).abs().max() < 1e-5
    assert (got - torch_split(q, k, v, lengths, mask)).abs().max() < 1e-5
    assert all(int(cnt.abs().sum()) == 0 for _, _, cnt in ws._parts.values())  # every ticket counter reset


@settings(max_examples=4, deadline=None)  # the interpreter takes about a second a call
@given(st.integers(1, 3), st.integers(1, 2), st.integers(1, 4), st.integers(1, 9), st.integers(0, 40), st.data())
def test_random_shapes_and_configurations(B, Hkv, G, T, spare, data):
    """Random batch, GQA group, tree size, cache capacity, ragged lengths, tree kind, dtype and tile
    configuration (the interpreter's, or a 64 / 48 KiB GPU's): the one launch equals float64 and the torch split."""
    from minispec.attention.triton_split import split_attention_triton

    C = T + spare + data.draw(st.integers(0, 40))
    lens = data.draw(st.lists(st.integers(0, C - T), min_size=B, max_size=B))
    tree = data.draw(st.sampled_from(["causal", "shared", "per_row"]))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16]))
    smem = data.draw(st.sampled_from([None, 64 * 1024, 48 * 1024]))
    q, k, v, lengths, mask = case(B, G * Hkv, Hkv, T, C, lens, hd=data.draw(st.sampled_from([16, 32])), tree=tree,
                                  seed=data.draw(st.integers(0, 2**16)), dtype=dtype)
    got = split_attention_triton(q, k, v, lengths, mask, smem=smem, num_splits=data.draw(st.integers(1, 4)))
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert (got.double() - want64(q, k, v, lengths, mask)).abs().max() < tol
    assert (got.double() - torch_split(q, k, v, lengths, mask).double()).abs().max() < tol


@pytest.mark.parametrize("splits", [1, 3, 5])
def test_split_counts_int64_lengths_and_an_int_length(splits):
    """One split (no workspace, no merge), more splits than key tiles (empty splits), int64 lengths, and one
    Python int for every row: the same attention."""
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    q, k, v, lengths, mask = case(2, 4, 2, 6, 60, [21, 54], seed=splits)
    want = want64(q, k, v, lengths, mask)
    ws = SplitWorkspace()
    got = split_attention_triton(q, k, v, lengths.long(), mask, num_splits=splits, block_n=16, workspace=ws)
    assert (got.double() - want).abs().max() < 1e-5
    assert {key[1:3] for key in ws._parts} == ({(1, 1)} if splits == 1 else {(4, splits)})  # 1: a token buffer
    same = torch.tensor([30, 30], dtype=torch.int32)
    got_int = split_attention_triton(q, k, v, 30, mask, num_splits=splits, workspace=ws)  # slots 30.. for both rows
    assert (got_int.double() - want64(q, k, v, same, mask)).abs().max() < 1e-5


def test_fp16_matches_float64():
    from minispec.attention.triton_split import split_attention_triton

    q, k, v, lengths, mask = case(2, 4, 2, 4, 40, [5, 36], seed=3)
    want = want64(q, k, v, lengths, mask)
    got = split_attention_triton(q.half(), k.half(), v.half(), lengths, mask)
    assert got.dtype == torch.float16 and (got.double() - want).abs().max() < 5e-3  # fp16: 11-bit mantissa


# --------------------------------------------------------------------------- the tile configurations
def test_launch_config_fits_each_shared_memory_limit():
    bf16 = torch.bfloat16
    chosen = {kib: tiles.launch_config(bf16, 128, 64, gpu=True, smem=kib * 1024) for kib in (227, 163, 99, 64, 48)}
    assert [(c["BLOCK_M"], c["BLOCK_N"], c["num_stages"]) for c in chosen.values()] == [
        (64, 64, 3), (64, 64, 3), (64, 64, 2), (64, 32, 2), (32, 32, 2)]
    for kib, c in chosen.items():
        assert tiles.config_bytes(c, bf16) <= kib * 1024
    assert tiles.config_bytes(chosen[227], bf16) > 99 * 1024  # the big tiles do not fit an L4 / A10 / RTX 4090
    assert tiles.smem_bytes(64, 64, 128, 3, 2) == 120 * 1024
    tiny = tiles.launch_config(bf16, 128, 64, gpu=True, smem=1024)  # nothing fits: the smallest, the compiler decides
    assert (tiny["BLOCK_M"], tiny["BLOCK_N"], tiny["num_stages"]) == tiles.CONFIGS[-1]
    assert tiles.launch_config(torch.float32, 128, 4, gpu=True, smem=99 * 1024)["BLOCK_M"] == 16  # rows: 16 at least
    assert tiles.launch_config(bf16, 128, 64, gpu=False)["BLOCK_N"] == tiles.INTERPRETER["BLOCK_N"]


@pytest.mark.parametrize("dtype, kib, tiles_, row_blocks", [(torch.float16, 64, (64, 32, 2), 1),
                                                             (torch.float16, 48, (32, 32, 2), 2),
                                                             (torch.float32, 48, (16, 16, 1), 3)])
def test_small_tile_configurations_forced_equal_the_references(monkeypatch, dtype, kib, tiles_, row_blocks):
    """The configurations a 64 / 48 KiB GPU gets (head dim 128), run in the interpreter: the same attention as
    float64 and the PyTorch split."""
    from minispec.attention.triton_split import split_attention_triton

    q, k, v, lengths, mask = case(2, 8, 2, 9, 100, [90, 13], hd=128, seed=5, dtype=dtype)
    launches = Launches(monkeypatch)
    got = split_attention_triton(q, k, v, lengths, mask, smem=kib * 1024)
    cfg = launches.calls[0][2]
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]) == tiles_
    assert tiles.config_bytes(cfg, dtype) <= kib * 1024 and launches.calls[0][1][1] == row_blocks  # 36 query rows
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert (got.double() - want64(q, k, v, lengths, mask)).abs().max() < tol
    assert (got.double() - torch_split(q, k, v, lengths, mask).double()).abs().max() < tol


def test_out_of_resources_steps_down_and_remembers(monkeypatch):
    """A compiler that refuses more than 60 KiB of shared memory: the call steps down to a configuration that
    fits, gives the same result, and the next call starts there (one launch)."""
    import triton

    from minispec.attention import triton_split as ts

    monkeypatch.setattr(ts, "_SMEM_CAP", {})
    real = ts._split_kernel
    tried = []

    class Picky:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                need = tiles.smem_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_D"], kw["num_stages"], 2)
                tried.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"]))
                if need > 60 * 1024:
                    raise triton.runtime.errors.OutOfResources(need, 60 * 1024, "shared memory")
                real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ts, "_split_kernel", Picky())
    q, k, v, lengths, mask = case(1, 4, 1, 16, 60, [40], hd=128, seed=6)
    got = ts.split_attention_triton(q.half(), k.half(), v.half(), lengths, mask, smem=227 * 1024)
    assert tried == [(64, 64, 3), (64, 64, 2), (64, 32, 2)]
    assert (got.double() - want64(q.half(), k.half(), v.half(), lengths, mask)).abs().max() < 5e-3
    tried.clear()
    ts.split_attention_triton(q.half(), k.half(), v.half(), lengths, mask, smem=227 * 1024)
    assert tried == [(64, 32, 2)]
    monkeypatch.setattr(ts, "_SMEM_CAP", {})  # nothing fits: the error reaches the caller
    monkeypatch.setattr(tiles, "CONFIGS", ((64, 64, 3),))
    with pytest.raises(triton.runtime.errors.OutOfResources):
        ts.split_attention_triton(q.half(), k.half(), v.half(), lengths, mask, smem=227 * 1024)


def test_device_limits_are_read_once_per_device(monkeypatch):
    """The SM count and shared memory come from one read of the device's properties, cached."""
    from types import SimpleNamespace

    from minispec.attention.triton_split import tile_config

    reads = []

    def props(index):
        reads.append(index)
        return SimpleNamespace(multi_processor_count=58, shared_memory_per_block_optin=99 * 1024)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    tiles.device_limits.cache_clear()
    try:
        gpu = torch.device("cuda", 3)
        for _ in range(5):
            cfg = tile_config(torch.bfloat16, 128, 4, gpu)
            splits = tiles.num_splits_for(8192, 8, cfg["BLOCK_N"], gpu)
        assert reads == [3]
        assert (cfg["BLOCK_N"], cfg["num_stages"]) == (64, 2) and splits == 15  # 2 x 58 SMs / 8 programs
    finally:
        tiles.device_limits.cache_clear()


COMPILE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minispec.attention import triton_split as ts
from minispec.attention.tiles import launch_config

INTS = ["P_int", "Hkv", "G", "T", "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_n", "sv_b", "sv_h", "sv_n", "sm_b", "sm_t",
        "so_b", "so_h", "so_t"]
out = []
for arch, dt, kib, rows, T, lens, causal, splits in json.loads(sys.argv[1]):
    dtype = getattr(torch, dt)
    cfg = launch_config(dtype, 128, rows, True, smem=kib * 1024)
    ptr = "*" + {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dt]
    sig = dict(Q=ptr, K=ptr, V=ptr, M="constexpr" if causal else "*u8", Out=ptr, Lens="*i64" if lens else "constexpr",
               WO="*fp32", WL="*fp32", Cnt="*i32", splits="constexpr" if splits == 1 else "i32", qk_scale="fp32",
               **{n: "i32" for n in INTS}, **{c: "constexpr" for c in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_D",
                                                                        "BLOCK_T", "LENS", "CAUSAL")})
    const = dict(HEAD_DIM=128, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
                 BLOCK_T=min(ts.pow2(T), cfg["BLOCK_N"]), LENS=lens, CAUSAL=causal)
    const.update({k: v for k, v in (("M", None), ("Lens", None), ("splits", 1))
                  if (k == "M" and causal) or (k == "Lens" and not lens) or (k == "splits" and splits == 1)})
    k = triton.compile(ASTSource(fn=ts._split_kernel, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    out.append([cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"], k.metadata.shared])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernel_compiles_for_gpus_within_their_shared_memory():
    """Triton's own compiler (no GPU needed) builds the kernel for GPUs from a T4 to an H100 with the tiles
    ``launch_config`` picks for their shared memory, and each fits: what a launch would check before running.
    Covers every compiled branch: lengths from a tensor or an int, a tree or causal, one split or several."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    # (sm, dtype, shared KiB per block, G * T rows, T, lengths tensor, causal, splits)
    targets = [(90, "bfloat16", 227, 4, 1, True, True, 8), (86, "bfloat16", 99, 256, 64, True, False, 4),
               (75, "float16", 64, 64, 16, True, False, 4), (80, "float32", 48, 64, 16, False, False, 1)]
    # compile, do not interpret: "0" explicitly, since importing minispec without CUDA sets it to "1" if unset
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(targets)], capture_output=True, text=True,
                          env=dict(env, TRITON_DEFAULT_FP_FUSION="1"), cwd=Path(__file__).resolve().parent.parent,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for (arch, _, kib, *_), (bm, bn, stages, shared) in zip(targets, got):
        assert 0 < shared <= kib * 1024, (arch, bm, bn, stages, shared)
    assert [tuple(g[:3]) for g in got] == [(16, 64, 3), (64, 64, 2), (64, 32, 2), (16, 16, 1)]


# --------------------------------------------------------------------------- no allocation, nothing read on the host
class Ops(TorchDispatchMode):
    """The ATen ops dispatched inside the block that are not views (an allocation, a copy, a host read)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_allocation_and_no_host_read_per_call(monkeypatch):
    """With a warm workspace, an output buffer and device lengths, the host side of a call dispatches no ATen op
    but views: nothing allocated, nothing copied, no tensor value read (what a CUDA graph needs). The first call
    of a shape allocates the workspace's three buffers, once."""
    from minispec.attention.triton_split import SplitWorkspace, default_workspace, split_attention_triton

    q, k, v, lengths, mask = case(2, 4, 2, 3, 40, [7, 30], seed=8)
    ws = SplitWorkspace()
    out = ws.output(q)
    launches = Launches(monkeypatch, run=False)
    with Ops() as first:
        split_attention_triton(q, k, v, lengths, mask, out=out, workspace=ws, validate=False)
    assert sorted(first.ops) == ["aten.empty.memory_format", "aten.empty.memory_format", "aten.zeros.default"]
    for tree, lens in ((mask, lengths), (None, lengths), (mask, lengths.long())):  # int64: StaticKVCache's lengths
        with Ops() as later:
            got = split_attention_triton(q, k, v, lens, tree, out=out, workspace=ws, validate=False)
        assert later.ops == [] and got is out
    assert len(launches.calls) == 4
    for _ in range(2):  # no workspace given: the device's default one, allocated on first use only
        with Ops() as default:
            split_attention_triton(q, k, v, lengths, mask, out=out, validate=False)
    assert default.ops == [] and default_workspace("cpu") is default_workspace(torch.device("cpu"))
    with Ops() as checked:  # validate (the default on a CPU) reads the lengths: fine here, never inside a graph
        split_attention_triton(q, k, v, lengths, mask, out=out, workspace=ws)
    assert "aten._local_scalar_dense.default" in checked.ops


def test_workspace_is_reused_and_new_lengths_need_no_new_buffers():
    """Calls of one shape reuse the same workspace tensors; new lengths written into the same lengths tensor (a
    graph replay's case) give the new rows' attention through the same buffers."""
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    q, k, v, lengths, mask = case(2, 4, 2, 3, 40, [7, 30], seed=9)
    ws = SplitWorkspace()
    out = ws.output(q)
    split_attention_triton(q, k, v, lengths, mask, out=out, workspace=ws)
    ptrs = [t.data_ptr() for bufs in ws._parts.values() for t in bufs]
    nbytes = ws.nbytes
    for new in ([0, 37], [19, 2]):
        lengths.copy_(torch.tensor(new))
        got = split_attention_triton(q, k, v, lengths, mask, out=out, workspace=ws)
        assert got is out and (got.double() - want64(q, k, v, lengths, mask)).abs().max() < 1e-5
    assert [t.data_ptr() for bufs in ws._parts.values() for t in bufs] == ptrs and ws.nbytes == nbytes
    assert ws.output(q) is out


def test_bad_input_raises_before_any_launch(monkeypatch):
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    q, k, v, lengths, mask = case(2, 4, 2, 3, 40, [7, 30], seed=10)
    ws = SplitWorkspace()
    launches = Launches(monkeypatch, run=False)
    with pytest.raises(ValueError, match="must fit"):
        split_attention_triton(q, k, v, torch.tensor([7, 38], dtype=torch.int32), mask, workspace=ws)
    with pytest.raises(ValueError, match="must fit"):
        split_attention_triton(q, k, v, 38, mask, workspace=ws)
    with pytest.raises(ValueError, match="int32 / int64"):
        split_attention_triton(q, k, v, lengths.float(), mask, workspace=ws)
    with pytest.raises(ValueError, match="out must be"):
        split_attention_triton(q, k, v, lengths, mask, out=torch.empty(2, 4, 3, 16).half(), workspace=ws)
    with pytest.raises(ValueError, match="does not fit"):
        split_attention_triton(q, k, v, lengths, mask[:, :2], workspace=ws)
    with pytest.raises(TypeError, match="boolean"):
        split_attention_triton(q, k, v, lengths, mask.int(), workspace=ws)
    assert launches.calls == [] and ws._parts == {}


# --------------------------------------------------------------------------- GPU: what only a GPU shows
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [None, 16])
def test_gpu_last_arriver_merge_holds_under_concurrency(splits):
    """Many splits racing for the ticket, call after call on one workspace: every result right, every counter
    back at 0 (the partials' writes ordered before the ticket, the merge reading them from L2)."""
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    q, k, v, lengths, mask = case(4, 32, 8, 8, 4096, [4000, 17, 2048, 3333], hd=128, seed=20)
    want = want64(q, k, v, lengths, mask)
    q, k, v, mask = (x.cuda() for x in (q.bfloat16(), k.bfloat16(), v.bfloat16(), mask))
    ws = SplitWorkspace()
    out = ws.output(q)
    for _ in range(20):
        got = split_attention_triton(q, k, v, lengths.long().cuda(), mask, num_splits=splits, out=out, workspace=ws)
        assert (got.double().cpu() - want).abs().max() < 2e-2
    assert all(int(cnt.abs().sum()) == 0 for _, _, cnt in ws._parts.values())



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_launch_captured_replays_new_int64_lengths():
    """Captured once (thread-local mode), the launch reads StaticKVCache-style int64 lengths on every replay."""
    from minispec.attention.triton_split import SplitWorkspace, split_attention_triton

    B, H, Hkv, T, C = 2, 8, 2, 1, 300
    q, k, v, lengths, _ = case(B, H, Hkv, T, C, [100, 250], hd=64, seed=21)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    lens = lengths.long().cuda()
    ws = SplitWorkspace()
    out = ws.output(q)
    run = lambda: split_attention_triton(q, k, v, lens, None, out=out, workspace=ws)  # noqa: E731
    run()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    for new in ([100, 250], [0, C - T], [7, 8]):
        lens.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        want = want64(q.cpu(), k.cpu(), v.cpu(), torch.tensor(new), None)
        assert (out.double().cpu() - want).abs().max() < 1e-4, new


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tiles_chosen_from_the_device_compile_first_time(dtype, monkeypatch):
    """The configuration the shared-memory estimate picks for this GPU compiles: no OutOfResources step-down."""
    from minispec.attention import triton_split as ts

    monkeypatch.setattr(ts, "_SMEM_CAP", {})
    q, k, v, lengths, mask = case(2, 32, 8, 16, 1000, [900, 33], hd=128, seed=22)
    q, k, v, mask = (x.cuda() for x in (q.to(dtype), k.to(dtype), v.to(dtype), mask))
    got = ts.split_attention_triton(q, k, v, lengths.cuda(), mask)
    assert ts._SMEM_CAP == {}, "the estimate chose tiles this GPU could not hold"
    want = want64(q.cpu().float(), k.cpu().float(), v.cpu().float(), lengths, mask.cpu())
    assert (got.double().cpu() - want).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_backend_table_measures_one_point():
    from minispec.lab.backend_table import measure_table

    doc = measure_table("cuda", torch.bfloat16, [1], [2048], [4], heads=(8, 2, 64), reps=2)
    row, = doc["results"]
    assert row["failed"] == {} and set(row["median_s"]) == {"dense", "flash", "split"}
    assert max(row["max_abs_err_vs_dense"].values()) < 2e-2
    assert doc["table"]["device"] == torch.cuda.get_device_name() and doc["table"]["best"][0][3] == row["best"]
