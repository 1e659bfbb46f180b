"""minispec.exact.linear.ExactLinear: the weight-panel path equals F.linear, and a row's result does not
depend on how many rows are computed with it (what keeps greedy verification == vanilla)."""

import pytest
import torch
import torch.nn.functional as F

from minispec.exact.linear import PANEL, ExactLinear


@pytest.fixture
def panels(monkeypatch):
    monkeypatch.setattr(ExactLinear, "cpu_kernel", "panels")  # whatever this machine's "auto" chose


def _layer(n_in, n_out, bias, seed=0):
    torch.manual_seed(seed)
    return ExactLinear(n_in, n_out, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576,), (5, 576), (2, 7, 576)])
@pytest.mark.parametrize("n_out", [1536, 100])  # whole panels, and a last panel zero-padded
def test_panels_equal_f_linear(panels, shape, bias, n_out):
    layer = _layer(576, n_out, bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        assert layer._use_panels(x) and layer.kernel(x) == "panels"
        y = layer(x)
    assert y.shape == (*shape[:-1], n_out)
    wp = layer.panel_weight()
    assert wp.shape == (-(-n_out // PANEL), 576, PANEL)
    assert torch.equal(wp.transpose(1, 2).reshape(-1, 576)[:n_out], layer.weight)  # panel p = w[p*PANEL:...].T
    assert not wp.transpose(1, 2).reshape(-1, 576)[n_out:].any()  # the last panel's missing outputs: zeros
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_non_contiguous_input(panels):
    layer = _layer(576, 64, False)
    x = torch.randn(4, 1152)[:, ::2]  # every other column: a strided view
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_a_call_is_padded_with_copies_of_its_rows_and_returns_its_own():
    """``pad_rows`` appends copies of the call's rows (one op for the one-row decode step), cut to length, zeros
    only for an empty call; ``_product`` with ``rows`` returns the first rows, for each kernel, with the bits of
    the whole padded call."""
    from minispec.exact.recipes import pad_rows

    x = torch.arange(6.0).reshape(3, 2)
    assert pad_rows(x, 2) is x and torch.equal(pad_rows(x[:1], 2), x[[0, 0]])
    assert torch.equal(pad_rows(x[:2], 5), x[[0, 1, 0, 1, 0]]) and torch.equal(pad_rows(x[:0], 4), torch.zeros(4, 2))
    layer = _layer(64, 40, True)  # 40 outputs: two panels, the last one part zeros
    xs = torch.randn(4, 64)
    kernels = ["panels", "f_linear"] + (["onednn"] if onednn_available() else [])
    with torch.inference_mode():
        for kernel in kernels:
            for rows in (1, 2, 3):
                got = layer._product(kernel, xs, rows=rows)
                assert got.shape == (rows, 40) and torch.equal(got, layer._product(kernel, xs)[:rows]), (kernel, rows)


@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (576, 49152)])  # qkv, down, LM head of SmolLM2
def test_row_results_do_not_depend_on_the_row_count(panels, n_in, n_out):
    layer = _layer(n_in, n_out, False)
    x = torch.randn(1, 65, n_in)
    with torch.inference_mode():
        full = layer(x)  # [1, 65, out]
        for m in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64):
            assert torch.equal(layer(x[:, :m]), full[:, :m]), f"rows 0..{m - 1} computed alone differ"
            assert torch.equal(layer(x[0, m]), full[0, m]), f"row {m} computed alone differs"


def test_weight_change_rebuilds_the_panels(panels):
    layer = _layer(64, 32, True)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(layer(x), before)
    layer.load_state_dict({"weight": torch.zeros(32, 64), "bias": torch.ones(32)})  # replaced
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.ones(3, 32))


def test_training_uses_autograd():
    layer = _layer(16, 8, True)
    x = torch.randn(4, 16, requires_grad=True)
    assert not layer._use_panels(x)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_state_dict_is_nn_linear(monkeypatch):
    layer = _layer(16, 8, True)
    assert set(layer.state_dict()) == {"weight", "bias"}
    monkeypatch.setattr(ExactLinear, "prepack", False)
    monkeypatch.setattr(ExactLinear, "row_invariant", False)  # as it is: no row padding (which a CPU's recipe may add)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        assert not layer._use_panels(x)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_prepack_builds_the_panels_of_every_linear_of_a_loaded_model(monkeypatch):
    from minispec import load

    monkeypatch.setattr(ExactLinear, "cpu_kernel", "panels")  # whatever MINISPEC_LINEAR_KERNEL and "auto" say
    model, _ = load("tiny-llama")  # load() prepacks
    layers = [m for m in model.modules() if isinstance(m, ExactLinear)]
    assert len(layers) == 4 * model.cfg.n_layer + 1  # qkv, out, gate_up, down per layer + LM head
    assert all(m.__dict__.get("_panel_parts") for m in layers)
    fresh = ExactLinear(8, 4)
    assert not fresh.__dict__.get("_panel_parts")


# --------------------------------------------------------------------------- oneDNN's prepacked kernel
from minispec.exact.kernels import onednn_available  # noqa: E402

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN linear")


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setattr(ExactLinear, "cpu_kernel", "onednn")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576,), (5, 576), (2, 7, 576)])
@pytest.mark.parametrize("n_out", [1536, 100])
def test_onednn_equals_f_linear(onednn, shape, bias, n_out):
    layer = _layer(576, n_out, bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        assert layer.kernel(x) == "onednn"
        y = layer(x)
    assert y.shape == (*shape[:-1], n_out) and layer.__dict__.get("_onednn_parts")
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (576, 49152)])
def test_onednn_rows_do_not_depend_on_the_row_count(onednn, n_in, n_out):
    """Under the recipe its probe chose on this CPU (as it is where oneDNN is invariant, else padded or split)."""
    layer = _layer(n_in, n_out, False)
    x = torch.randn(1, 65, n_in)
    with torch.inference_mode():
        full = layer(x)
        assert layer.row_recipe(x).kernel == "onednn"
        for m in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64):
            assert torch.equal(layer(x[:, :m]), full[:, :m]), f"rows 0..{m - 1} computed alone differ"
            assert torch.equal(layer(x[0, m]), full[0, m]), f"row {m} computed alone differs"


@needs_onednn
def test_onednn_weight_change_rebuilds_the_packed_copy(onednn):
    layer = _layer(64, 32, True)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.load_state_dict({"weight": torch.zeros(32, 64), "bias": torch.ones(32)})
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.ones(3, 32))


@needs_onednn
def test_onednn_greedy_speculative_equals_vanilla(onednn):
    """The whole decode loop on oneDNN's kernel: speculative greedy runs (a self-draft that is always right,
    and a tiny draft that is mostly wrong) give vanilla's tokens, every linear layer computing on oneDNN."""
    from minispec import generate, load
    from minispec.drafters import DraftModel

    model, tok = load("tiny-llama")
    draft = load("tiny-gpt2-draft")[0]
    for prompt in ("Hello world, hello world, hello", "def f(x):\n    return x"):
        vanilla = generate(model, tok, prompt, max_new_tokens=40)
        assert generate(model, tok, prompt, drafter=DraftModel(model, k=3), max_new_tokens=40).tokens == vanilla.tokens
        assert generate(model, tok, prompt, drafter=DraftModel(draft, k=4), max_new_tokens=40).tokens == vanilla.tokens
    with torch.inference_mode():
        assert {layer.kernel(torch.zeros(1, layer.in_features)) for layer in model.modules()
                if isinstance(layer, ExactLinear)} == {"onednn"}


def test_linear_kernel_from_the_environment(monkeypatch):
    from minispec.exact import linear

    monkeypatch.setenv("MINISPEC_LINEAR_KERNEL", "onednn")
    assert linear._kernel_from_env() == "onednn"
    monkeypatch.delenv("MINISPEC_LINEAR_KERNEL")
    assert linear._kernel_from_env() == "auto"
    monkeypatch.setenv("MINISPEC_LINEAR_KERNEL", "mkl")
    with pytest.raises(ValueError, match="MINISPEC_LINEAR_KERNEL must be one of auto, panels, onednn, got 'mkl'"):
        linear._kernel_from_env()


@pytest.mark.parametrize("kernel", ["panels", pytest.param("onednn", marks=needs_onednn)])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_model_that_has_run_copies_and_pickles_without_its_prepacked_weights(kernel, name, monkeypatch):
    """``copy.deepcopy`` of a model after a forward (what the GPU trainer test does before ``.to("cuda")``)
    raised "Cannot access storage of OpaqueTensorImpl" where the layers held oneDNN's prepacked weights,
    which are opaque tensors; the copies leave the prepacked caches behind and rebuild them on first use."""
    import copy
    import pickle

    from minispec import load

    monkeypatch.setattr(ExactLinear, "cpu_kernel", kernel)
    cache = {"panels": "_panel_parts", "onednn": "_onednn_parts"}[kernel]
    model = load(name)[0]
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = model(x).logits
    assert any(m.__dict__.get(cache) for m in model.modules() if isinstance(m, ExactLinear))  # it prepacked
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not any(k in m.__dict__ for m in twin.modules() if isinstance(m, ExactLinear) for k in ExactLinear.PREPACKED)
        assert (twin.lm_head.weight is twin.tok_emb.weight) == (model.lm_head.weight is model.tok_emb.weight)
        with torch.inference_mode():
            assert torch.equal(twin(x).logits, before)  # rebuilt on first use: the same bits
    assert model.lm_head.__dict__.get(cache)  # the original keeps its own


# --------------------------------------------------------------------------- weights in huge pages
import mmap  # noqa: E402

from minispec.config import thp_mode  # noqa: E402
from minispec.exact import hugepages  # noqa: E402

linux_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() is None,
                                   reason="no transparent huge pages on this OS")


@pytest.fixture
def huge(monkeypatch):
    monkeypatch.setattr(hugepages, "HUGE_PAGES", True)  # the mmap path, also where THP is "never" (advice still taken)


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux_madvise
def test_huge_page_empty_is_aligned_advised_and_outlives_its_mapping(huge):
    """A tensor of at least one huge page starts on a 2 MiB boundary of a mapping advised MADV_HUGEPAGE
    ("hg" in its VmFlags, whatever the machine's THP mode), holds what is written to it after every other
    reference to the mapping is gone, and has the shape and dtype asked for."""
    import gc

    t = hugepages.huge_page_empty((3, hugepages.HUGE_PAGE // 4 // 3 + 7))  # just over one huge page of float32
    assert t.shape == (3, hugepages.HUGE_PAGE // 4 // 3 + 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert "hg" in _vm_flags(t.data_ptr())
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    gc.collect()
    assert torch.equal(t.flatten(), torch.arange(t.numel(), dtype=torch.float32))
    b = hugepages.huge_page_empty((hugepages.HUGE_PAGE,), torch.bfloat16)  # other dtypes: bytes, not elements, count
    assert b.dtype == torch.bfloat16 and b.data_ptr() % hugepages.HUGE_PAGE == 0


def test_huge_page_empty_is_a_plain_tensor_when_small_or_switched_off(monkeypatch):
    small = hugepages.huge_page_empty((4, 8))
    assert small.shape == (4, 8) and small.untyped_storage().nbytes() == 4 * 8 * 4  # no mapping around it
    monkeypatch.setattr(hugepages, "HUGE_PAGES", False)
    big = hugepages.huge_page_empty((hugepages.HUGE_PAGE,))
    assert big.untyped_storage().nbytes() == hugepages.HUGE_PAGE * 4


@linux_madvise
def test_panels_in_huge_pages_compute_the_same_bits(monkeypatch, panels, huge):
    """A layer whose panels fill huge pages (an LM-head-sized weight) computes, at every row count, the bits of
    the same layer on panels in ordinary pages; only where the panels live differs."""
    layer = _layer(576, 4096, False)  # 9.4 MB of panels
    x = torch.randn(9, 576)
    with torch.inference_mode():
        huge = [layer(x[:m]) for m in (1, 2, 9)]
        assert layer.panel_weight().data_ptr() % hugepages.HUGE_PAGE == 0
        monkeypatch.setattr(hugepages, "HUGE_PAGES", False)
        layer.__dict__.pop("_panel_parts")
        plain = [layer(x[:m]) for m in (1, 2, 9)]
        assert layer.panel_weight().untyped_storage().nbytes() == layer.panel_weight().numel() * 4
    assert all(torch.equal(a, b) for a, b in zip(huge, plain))


def test_huge_page_empty_falls_back_where_the_kernel_refuses_the_advice(monkeypatch, huge):
    """A Linux built without THP answers madvise(MADV_HUGEPAGE) with EINVAL: an ordinary tensor, no error."""
    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    t = hugepages.huge_page_empty((hugepages.HUGE_PAGE,))
    assert t.shape == (hugepages.HUGE_PAGE,) and t.untyped_storage().nbytes() == hugepages.HUGE_PAGE * 4
