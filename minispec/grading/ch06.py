"""Checks of chapter 6's exercises (solutions/ch06_split_attention.py): split tree attention.

    6.1 merge_partials         log-sum-exp merge of two partial attention results
    6.2 merge_kernel           the merge of 6.1 as a Triton kernel (one program per block of rows)
    6.3 masked_attention_lse   masked attention returning the row log-sum-exps (the tree suffix)
    6.4 tiled_attention        online softmax over key tiles (the mask-free prefix)
    6.5 prefix_split_kernel    the online softmax of one split of a ragged prefix as a Triton kernel
    6.6 split_tree_attention   prefix + suffix + merge, with grouped-query heads

Checks 6.1, 6.3, 6.4 and 6.6 run the learner's function on random float64 inputs and compare
with softmax attention computed directly over all keys (and with minispec.attention's own
functions), to 1e-9: the split is exact, so only float64 rounding separates correct answers. Check 6.4
also passes keys and values that log how many keys each operation reads (``KeyReads``): an answer that
reads K or V whole (a one-shot softmax and its logsumexp) fails, however right its numbers.
Checks 6.2 and 6.5 launch the learner's kernel on float32 inputs (CPU tensors under
TRITON_INTERPRET=1 when there is no GPU): 6.2 against ``minispec.attention.reference.merge`` in
float64, 6.5 split by split against float64 softmax attention over the split's keys, to 1e-5
(6.5: plus 4 float32 ulps of the split's largest score, which float32 rounds: 5e-4 around +1000).
"""

from __future__ import annotations

import math
import os
import re
import sys
from types import SimpleNamespace

import torch

from minispec.attention import reference as ref

from .checks import exercise, get

TITLE = "Split tree attention: mask-free prefix, masked suffix, log-sum-exp merge"
MODULE = "ch06_split_attention"
EXERCISES: list = []
TOL = 1e-9


def library():
    """minispec's own functions behind the exercises' signatures (``--impl minispec``)."""
    return SimpleNamespace(
        __name__="minispec.attention.reference (chapter 6 adapter)",
        merge_partials=lambda out_a, lse_a, out_b, lse_b: ref.merge(out_a, lse_a, out_b, lse_b, return_lse=True),
        masked_attention_lse=ref.attention_with_lse,
        tiled_attention=_library_tiled,
        split_tree_attention=lambda q, k, v, prefix_len, tree_mask, block=16: ref.split_attention(q, k, v, prefix_len,
                                                                                                 tree_mask),
        merge_kernel=_LibraryMergeKernel(),
        prefix_split_kernel=_LibraryPrefixKernel(),
    )


def _library_tiled(q, k, v, block):
    """minispec's attention_with_lse over each tile of ``block`` keys, merged tile by tile with its ``merge``."""
    out, lse = ref.attention_with_lse(q, k[..., :0, :], v[..., :0, :])  # no key yet: out 0, lse -inf
    for j in range(0, k.shape[-2], block):
        tile = ref.attention_with_lse(q, k[..., j:j + block, :], v[..., j:j + block, :])
        out, lse = ref.merge(out, lse, *tile, return_lse=True)
    return out, lse


def kernel_device() -> str:
    """Where the graded kernels run: "cuda" on a GPU, "cpu" under Triton's interpreter.

    ``import minispec`` switches the interpreter on where there is no CUDA (``TRITON_INTERPRET=1``), before
    triton is imported. Raises AssertionError naming the problem when the kernels cannot run: no GPU and the
    interpreter off, or triton imported before the interpreter was switched on (then triton's own functions,
    ``tl.sum`` and ``tl.max``, are compiled while the learner's kernel is interpreted, and a correct kernel
    would fail with "Cannot call @triton.jit'd outside of the scope of a kernel").
    """
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret and torch.cuda.is_available():
        return "cuda"
    if not interpret:
        raise AssertionError(f"no CUDA GPU here and TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}: Triton "
                             "kernels run on a CPU only in Triton's interpreter; unset TRITON_INTERPRET (importing "
                             "minispec sets it) or set it to 1 before triton is imported")
    tl = sys.modules.get("triton.language")
    if tl is not None and type(getattr(tl.standard, "sum", None)).__name__ == "JITFunction":
        raise AssertionError("triton was imported before TRITON_INTERPRET=1 was set, so its own functions "
                             "(tl.sum, tl.max) are compiled, not interpreted, and no kernel can call them: restart "
                             "Python (the notebook's kernel) and import minispec before anything imports triton")
    return "cpu"


def _triton_split():
    """minispec.attention.triton_split (the interpreter was chosen when minispec was imported)."""
    kernel_device()
    from minispec.attention import triton_split
    return triton_split


class _LibraryMergeKernel:
    """minispec's own ``_merge_kernel`` (n partials, online) behind ``merge_kernel[grid](...)``'s signature."""

    def __getitem__(self, grid):
        def launch(OP, LP, OS, LS, Out, R, D, BLOCK_R, BLOCK_D):
            ts = _triton_split()
            O, L = torch.stack([OP, OS]), torch.stack([LP, LS])  # [2 parts, R, D], [2 parts, R]
            ts._merge_kernel[(1, ts.triton.cdiv(R, BLOCK_R))](
                O, L, Out, R, 2, 0, O.stride(0), O.stride(1), 0, L.stride(0), 0, Out.stride(0),
                HEAD_DIM=D, BLOCK_T=BLOCK_R, BLOCK_D=BLOCK_D)
        return launch

    def __call__(self, *args, **kwargs):
        raise TypeError("launch a kernel with kernel[grid](...)")


class _LibraryPrefixKernel:
    """minispec's own ``_prefix_kernel`` (grouped-query rows, strided cache) behind ``prefix_split_kernel[grid](...)``.

    One KV head (Hkv = G = 1) whose T = R tokens are the rows; Q [B, R, D], K / V [B, N, D] and the
    partials O [B, S, R, D] / L [B, S, R] passed with their strides (head strides 0). The library
    scores in log2 units: the scale carries log2(e)."""

    def __getitem__(self, grid):
        B, S = grid

        def launch(Q, K, V, Lens, O, L, R, N, D, chunk, scale, BLOCK_R, BLOCK_N, BLOCK_D):
            ts = _triton_split()
            ts._prefix_kernel[(B, 1, S)](
                Q, K, V, O, L, Lens, chunk, scale * ts.LOG2E, 1, 1, R,
                R * D, 0, D, N * D, 0, D, N * D, 0, D,
                S * R * D, 0, R * D, D, S * R, 0, R,
                HEAD_DIM=D, BLOCK_M=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
        return launch

    def __call__(self, *args, **kwargs):
        raise TypeError("launch a kernel with kernel[grid](...)")


def _attention64(q, k, v, mask=None):
    """Ground truth: (out, lse) of softmax attention, computed directly in float64."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [..., T, N]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [..., T]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ v.double(), lse


def _pair(out, what: str):
    try:
        a, b = out
    except (TypeError, ValueError):
        raise AssertionError(f"{what} must return (out, lse), got {type(out).__name__}") from None
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise AssertionError(f"{what} must return two tensors (out, lse)")
    return a, b


def _close(got: torch.Tensor, want: torch.Tensor, what: str, where: str) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)} {where}")
    if torch.isnan(got).any():
        raise AssertionError(f"{what} contains nan {where}")
    same_inf = torch.isinf(want) & (got == want)  # -inf where a row sees no key
    err = torch.where(same_inf, 0.0, (got.double() - want).abs()).max().item() if got.numel() else 0.0
    if not err <= TOL:
        raise AssertionError(f"{what} differs from the reference by {err:.3g} (max abs) {where}")


def _rand(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] ancestor mask of a tree given by parents (node 0 the root, parents[0] = -1)."""
    T = len(parents)
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def _random_parents(T: int, g) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]


@exercise(EXERCISES, "6.1", "merge_partials")
def check_merge_partials(impl):
    fn = get(impl, "merge_partials")
    g = torch.Generator().manual_seed(61)
    q, k, v = _rand(3, 4, 8, g=g), _rand(3, 11, 8, g=g), _rand(3, 11, 8, g=g)  # [3 heads, T=4 | N=11, hd=8]
    want_out, want_lse = _attention64(q, k, v)
    for cut in (1, 4, 10):
        a, b = _attention64(q, k[:, :cut], v[:, :cut]), _attention64(q, k[:, cut:], v[:, cut:])
        where = f"(keys 0..{cut - 1} merged with keys {cut}..10)"
        out, lse = _pair(fn(a[0], a[1], b[0], b[1]), "merge_partials")
        _close(out, want_out, "out", where)
        _close(lse, want_lse, "lse", where)
        out, lse = _pair(fn(a[0], a[1] + 1000, b[0], b[1] + 1000), "merge_partials")
        _close(out, want_out, "out", f"when both lse are shifted by +1000 (exp would overflow) {where}")
        _close(lse, want_lse + 1000, "lse", f"when both lse are shifted by +1000 {where}")
    b = _attention64(q, k, v)
    empty = (torch.zeros_like(b[0]), torch.full_like(b[1], float("-inf")))
    _close(_pair(fn(*empty, *b), "merge_partials")[0], b[0], "out", "with an empty first part (lse = -inf, out = 0)")
    _close(_pair(fn(*b, *empty), "merge_partials")[0], b[0], "out", "with an empty second part (lse = -inf, out = 0)")
    out, lse = _pair(fn(*empty, *empty), "merge_partials")
    _close(out, empty[0], "out", "when both parts are empty (expected zeros, not nan)")
    _close(lse, empty[1], "lse", "when both parts are empty (expected -inf)")


def _launch(kernel, out_p, lse_p, out_s, lse_s, block_r: int) -> torch.Tensor:
    """The launcher of solutions/ch06's ``merge_triton``, for any kernel with merge_kernel's signature."""
    R, D = out_p.shape
    out = torch.full_like(out_p, float("nan"))  # rows the kernel forgets to store stay nan
    block_d = 1 << max(D - 1, 0).bit_length()  # next power of two >= D
    _kernel_call(kernel, (-(-R // block_r),), out_p, lse_p, out_s, lse_s, out, R, D, BLOCK_R=block_r, BLOCK_D=block_d)
    return out


@exercise(EXERCISES, "6.2", "merge_kernel")
def check_merge_kernel(impl):
    kernel = get(impl, "merge_kernel")
    dev = kernel_device()
    g = torch.Generator().manual_seed(65)
    cases = [(1, 16, 16, ""), (37, 16, 16, ""), (50, 64, 32, ""), (12, 64, 4, ""), (9, 24, 8, ""),
             (21, 64, 8, "empty"), (16, 16, 16, "shift")]  # (R, D, BLOCK_R, what)
    for R, D, block_r, what in cases:
        out_p, out_s = torch.randn(R, D, generator=g), torch.randn(R, D, generator=g)
        lse_p, lse_s = torch.randn(R, generator=g) * 3, torch.randn(R, generator=g) * 3
        where = f"for R={R} rows, D={D}, BLOCK_R={block_r}"
        if what == "empty":  # rows 0, 3, 6, ...: prefix empty; 1, 4, ...: suffix empty; 2, 11, 20: both
            lse_p[0::3], lse_s[1::3], lse_p[2::9], lse_s[2::9] = (float("-inf"),) * 4
            out_p[0::3], out_s[1::3], out_p[2::9], out_s[2::9] = 0.0, 0.0, 0.0, 0.0
            where += " with empty parts (rows 0, 3, ...: lse_p = -inf; 1, 4, ...: lse_s = -inf; 2, 11, 20: both)"
        elif what == "shift":
            lse_p, lse_s = lse_p + 1000, lse_s + 1000
            where += " with lse around +1000 (exp(lse) overflows: subtract the max first)"
        want = ref.merge(out_p.double(), lse_p.double(), out_s.double(), lse_s.double())
        got = _launch(kernel, *(x.to(dev) for x in (out_p, lse_p, out_s, lse_s)), block_r).cpu()
        if torch.isnan(got).any():
            rows = torch.isnan(got).any(-1).nonzero().flatten().tolist()
            raise AssertionError(f"out has nan in rows {rows[:8]}{' ...' if len(rows) > 8 else ''} {where} "
                                 f"(a row not stored, or exp(-inf - -inf) / 0 / 0 for an empty part)")
        err = (got.double() - want).abs().max().item()
        if not err <= 1e-5:
            row = int((got.double() - want).abs().amax(-1).argmax())
            raise AssertionError(f"out differs from minispec.attention.reference.merge by {err:.3g} (max abs, "
                                 f"worst row {row}) {where}")



@exercise(EXERCISES, "6.3", "masked_attention_lse")
def check_masked_attention_lse(impl):
    fn = get(impl, "masked_attention_lse")
    g = torch.Generator().manual_seed(62)
    q, k, v = _rand(2, 3, 6, 8, g=g), _rand(2, 3, 7, 8, g=g), _rand(2, 3, 7, 8, g=g)
    masks = {"a random mask": torch.rand(6, 7, generator=g) < 0.5,
             "a causal mask": torch.ones(6, 7, dtype=torch.bool).tril(1),
             "a per-head random mask": torch.rand(2, 3, 6, 7, generator=g) < 0.4}
    masks["a random mask"][2] = False  # a row that sees nothing
    masks["a random mask"][3] = True
    for name, mask in masks.items():
        out, lse = _pair(fn(q, k, v, mask), "masked_attention_lse")
        want = _attention64(q, k, v, mask)
        where = f"with {name} (q {tuple(q.shape)}, k {tuple(k.shape)}; rows without a visible key: out 0, lse -inf)"
        _close(out, want[0], "out", where)
        _close(lse, want[1], "lse", where)
        lib = ref.attention_with_lse(q, k, v, mask)
        _close(out, lib[0], "out (vs minispec.attention.attention_with_lse)", where)
    T = 9
    m = tree_mask(_random_parents(T, g))
    q, k, v = _rand(4, T, 16, g=g), _rand(4, T, 16, g=g), _rand(4, T, 16, g=g)
    out, lse = _pair(fn(q, k, v, m), "masked_attention_lse")
    want = _attention64(q, k, v, m)
    _close(out, want[0], "out", "with a tree's ancestor mask")
    _close(lse, want[1], "lse", "with a tree's ancestor mask")


# Operations that only pick, reshape or convert keys (a tile is sliced out of K through them), and those that
# read no data at all; any other operation that takes keys is a read of every key it holds.
_LAYOUT = {"__getitem__", "narrow", "split", "split_with_sizes", "tensor_split", "chunk", "unbind", "select",
           "transpose", "swapaxes", "swapdims", "permute", "movedim", "t", "T", "mT", "view", "view_as", "reshape",
           "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "contiguous", "clone",
           "detach", "to", "double", "float", "type", "type_as"}
_NO_DATA = {"shape", "dtype", "device", "size", "dim", "ndim", "numel", "stride", "is_contiguous", "__len__",
            "element_size", "storage_offset", "is_floating_point", "requires_grad", "layout", "is_cuda", "new_zeros",
            "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "empty_like", "full_like", "names"}


class KeyReads(torch.Tensor):
    """Keys or values that log how many keys each operation reads at once (exercise 6.4's check).

    Slicing, views and conversions give ``KeyReads`` again; any other operation on one logs
    (operation, keys it holds) in ``KeyReads.log`` and returns a plain tensor, so the scores and
    partial results computed from a tile are not watched. ``per_key`` is the number of elements one
    key holds (the product of the other dimensions)."""

    log: list | None = None
    per_key = 1

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property: .shape, .mT, ...
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _NO_DATA:
            return out
        if name in _LAYOUT:
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.as_subclass(cls), out)
        if cls.log is not None:
            watched = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, KeyReads)]
            cls.log += [(name, a.numel() // cls.per_key) for a in watched]
        return out


@exercise(EXERCISES, "6.4", "tiled_attention")
def check_tiled_attention(impl):
    fn = get(impl, "tiled_attention")
    g = torch.Generator().manual_seed(63)
    for N in (0, 1, 7, 16, 37):
        q, k, v = _rand(2, 5, 8, g=g), _rand(2, N, 8, g=g) * 3, _rand(2, N, 8, g=g)  # * 3: sharp softmax
        want = _attention64(q, k, v)
        for block in (1, 4, 16, 64):
            KeyReads.log, KeyReads.per_key = [], (k.numel() // N if N else 1)
            try:  # K and V log the keys each operation reads: a tile holds at most `block`
                out, lse = _pair(fn(q, k.as_subclass(KeyReads), v.as_subclass(KeyReads), block), "tiled_attention")
            finally:
                reads, KeyReads.log = KeyReads.log, None
            out, lse = (x.as_subclass(torch.Tensor) for x in (out, lse))
            where = f"for N={N} keys in tiles of {block}" + (" (no keys: out 0, lse -inf)" if N == 0 else "")
            _close(out, want[0], "out", where)
            _close(lse, want[1], "lse", where)
            whole = [(op, n) for op, n in reads if n > block]
            if whole:
                op, n = max(whole, key=lambda r: r[1])
                raise AssertionError(f"the right answer, but `{op}` read {n} keys of K or V at once {where}: read "
                                     f"them a tile of at most {block} keys at a time (slice k[..., j:j + block, :]), "
                                     "so that no step holds more than a tile of scores")


def _kernel_call(kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, with a stub's NotImplementedError unwrapped from the interpreter's error."""
    try:
        kernel[grid](*args, **meta)
    except NotImplementedError:
        raise
    except Exception as e:  # the interpreter / compiler wraps the kernel's own exceptions
        m = re.search(r"NotImplementedError\(['\"](.*?)['\"]\)", f"{e!r} {e.__cause__!r}")
        if m:
            raise NotImplementedError(m[1]) from None
        raise


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())  # the next power of two >= n, at least lo


# (P_b per batch row, N keys per row in K / V, R query rows, D, splits, chunk, BLOCK_N, what)
PREFIX_CASES = [
    ((0, 37, 64, 5), 64, 6, 24, 3, 32, 16, "ragged"),  # P_b = 0; 37 ends inside a tile; split 2 starts past N
    ((70, 41, 19), 70, 5, 16, 4, 20, 16, "chunk"),  # chunk 20 is not a multiple of BLOCK_N = 16
    ((50, 33), 50, 16, 16, 1, 50, 16, "sharp"),  # one split of 4 tiles, keys x 4: the max grows tile after tile
    ((40, 17), 48, 4, 16, 2, 24, 16, "shift"),  # scores around +1000, exact in float32
]


def _prefix_inputs(lens, N, R, D, what, g):
    """q [B, R, D], k, v [B, N, D] float32; keys past P_b are random too (a leak changes the answer)."""
    B = len(lens)
    if what != "shift":
        q, k, v = (torch.randn(B, n, D, generator=g) for n in (R, N, N))
        return q, k * (4 if what == "sharp" else 1), v
    # multiples of 1/32 with |q . k| < 4100: every score is exact in float32, only exp / log / division round
    q = torch.randint(-32, 33, (B, R, D), generator=g) / 32
    k = torch.randint(-32, 33, (B, N, D), generator=g) / 32
    q[..., 0], k[..., 0] = 32.0, 125.0 + k[..., 0]  # s = q . k / 4 = 1000 +- 12
    return q.float(), k.float(), torch.randn(B, N, D, generator=g)


@exercise(EXERCISES, "6.5", "prefix_split_kernel")
def check_prefix_split_kernel(impl):
    kernel = get(impl, "prefix_split_kernel")
    dev = kernel_device()
    g = torch.Generator().manual_seed(655)
    for lens, N, R, D, ns, chunk, block_n, what in PREFIX_CASES:
        B = len(lens)
        q, k, v = _prefix_inputs(lens, N, R, D, what, g)
        where = (f"(P_b = {list(lens)}, {N} keys per row in K / V, the others random; R={R} rows, D={D}, "
                 f"{ns} split(s) of chunk={chunk} keys, BLOCK_N={block_n})")
        if what == "sharp":
            where += " with sharp softmaxes (keys x 4): the running max grows from tile to tile"
        elif what == "shift":
            where += " with scores around +1000 (exp(s) overflows float32 unless a max is subtracted first)"
        guard = _pow2(R) * _pow2(D)  # room for a last program that stores rows >= R
        o_buf = torch.full((B * ns * R * D + guard,), float("nan"), device=dev)  # rows never stored stay nan
        l_buf = torch.full((B * ns * R + guard,), float("nan"), device=dev)
        O, L = o_buf[:B * ns * R * D].view(B, ns, R, D), l_buf[:B * ns * R].view(B, ns, R)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
        _kernel_call(kernel, (B, ns), q.to(dev), k.to(dev), v.to(dev), lens_t, O, L, R, N, D, chunk,
                     1.0 / math.sqrt(D), BLOCK_R=_pow2(R), BLOCK_N=block_n, BLOCK_D=_pow2(D))
        if not (torch.isnan(o_buf[O.numel():]).all() and torch.isnan(l_buf[L.numel():]).all()):
            raise AssertionError(f"the kernel wrote past the end of O or L (rows >= R or columns >= D stored?) {where}")
        O, L = O.cpu().double(), L.cpu().double()
        for b, P in enumerate(lens):
            for s in range(ns):
                lo, hi = s * chunk, min((s + 1) * chunk, P)
                want_o, want_l = _attention64(q[b], k[b, lo:max(lo, hi)], v[b, lo:max(lo, hi)])
                tiles = -(-(hi - lo) // block_n)
                tail = f", the last one running past key {hi - 1}" if (hi - lo) % block_n else ""
                part = (f"in batch {b} (P_b={P}), split {s}: " +
                        (f"keys {lo}..{hi - 1} ({tiles} tile(s) of {block_n}{tail})" if hi > lo else
                         f"no key (it starts at {lo} >= P_b: expected out 0, lse -inf)"))
                for name, got in (("out", O[b, s]), ("lse", L[b, s])):
                    if torch.isnan(got).any():
                        raise AssertionError(f"{name} is nan {part} {where} (a row not stored, or 0 / 0, "
                                             "or exp(-inf - -inf))")
                # float32 rounds a score s by up to an ulp of |s|: allow 4 ulps of the split's largest |s| (5e-4 at 1e3)
                scores = q[b].double() @ k[b, lo:max(lo, hi)].double().T / math.sqrt(D)  # [R, keys of the split]
                s_max = float(scores.abs().amax()) if hi > lo else 0.0
                tol = 1e-5 + 2.0 ** -21 * s_max
                empty_ok = torch.isinf(want_l) & (L[b, s] == want_l)
                err_l = torch.where(empty_ok, 0.0, (L[b, s] - want_l).abs())
                if not (err_l <= tol).all():
                    row = int(err_l.argmax())
                    raise AssertionError(f"lse differs from float64 softmax attention: row {row} has "
                                         f"{float(L[b, s, row]):.7g}, expected {float(want_l[row]):.7g}, "
                                         f"{part} {where}")
                err = (O[b, s] - want_o).abs()
                if not err.max() <= tol:
                    raise AssertionError(f"out differs from float64 softmax attention by {float(err.max()):.3g} "
                                         f"(max abs, row {int(err.amax(-1).argmax())}) {part} {where}")


@exercise(EXERCISES, "6.6", "split_tree_attention")
def check_split_tree_attention(impl):
    fn = get(impl, "split_tree_attention")
    g = torch.Generator().manual_seed(64)
    for B, H, Hkv, T, P, hd in [(1, 2, 2, 1, 0, 8), (2, 4, 1, 5, 13, 8), (1, 8, 2, 9, 40, 16), (2, 4, 4, 7, 1, 8)]:
        q, k, v = _rand(B, H, T, hd, g=g), _rand(B, Hkv, P + T, hd, g=g), _rand(B, Hkv, P + T, hd, g=g)
        m = tree_mask(_random_parents(T, g))
        full = torch.cat([torch.ones(T, P, dtype=torch.bool), m], -1)  # [T, S]
        G = H // Hkv
        want = _attention64(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), full)[0]
        where = f"for B={B}, H={H} query / {Hkv} KV heads, T={T} tree tokens after a prefix of {P}"
        got = fn(q, k, v, P, m)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"split_tree_attention must return a tensor, got {type(got).__name__}")
        _close(got, want, "out", where)
        _close(got, ref.split_attention(q, k, v, P, m), "out (vs minispec.attention.split_attention)", where)
