"""``load_drafter``: checkpoints written in each official layout load into drafters that draft
exactly what the original heads draft; heads for another model are refused with both sizes named."""

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

from minispec import load
from minispec.drafters.base import Features
from minispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from minispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, build_vocab_map, eagle3_layers
from minispec.drafters.loader import load_drafter
from minispec.drafters.medusa import MedusaDrafter, MedusaHeads
from minispec.sampling import GREEDY

pytestmark = pytest.mark.ch03

CONTEXTS = ["The tree mask at work", "abcabcabc, abc"]


@pytest.fixture(scope="module")
def target():
    return load("tiny-llama")


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if p.dim() == 1 and "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return module.eval()


def _proposals(drafter, model, tok):
    """(tokens, parents) of the greedy tree drafted after each context, features handed over as generate does."""
    out = []
    for text in CONTEXTS:
        ctx = tok.encode(text)
        with torch.no_grad():
            o = model(torch.tensor([ctx[:-1]]), hidden_layers=drafter.target_layers)
        drafter.prefill(ctx, Features(o.hidden[0], {i: h[0] for i, h in o.layer_inputs.items()}))
        t = drafter.propose(GREEDY, budget=10)
        out.append((t.tokens, t.parents))
    assert any(len(t) > 1 for t, _ in out)
    return out


def _eagle1(model, bias=True, seed=0):
    return _randomize(EagleHead(EagleConfig.for_target(model.cfg, bias=bias)), seed)


def _eagle3(model, vocab=None, seed=0):
    c = Eagle3Config.for_target(model, 96)
    if vocab:
        c.vocab_size = vocab
    head = _randomize(Eagle3Head(c), seed)
    counts = torch.arange(c.vocab_size).flip(0) % 97  # some frequency order
    d2t, t2d = build_vocab_map(counts, 96)
    head.d2t.copy_(d2t), head.t2d.copy_(t2d)
    return head


def _write_dir(path, config, state, fmt):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().contiguous() for k, v in state.items()}
    if fmt == "safetensors":
        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return path


@pytest.mark.parametrize("bias", [True, False], ids=["fc_bias", "no_fc_bias"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("embed_copy", [False, True], ids=["", "embed_copy"])
def test_official_eagle1_dirs(tmp_path, target, capsys, bias, fmt, embed_copy):
    model, tok = target
    head = _eagle1(model, bias)
    cfg = head.cfg.to_dict()
    if bias:
        cfg.pop("bias")  # official configs without "bias" mean an fc bias
    state = dict(head.state_dict())
    if embed_copy:
        state["embed_tokens.weight"] = model.tok_emb.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an identical embedding copy raises no warning
        d = load_drafter(_write_dir(tmp_path / "eagle", cfg, state, fmt), model, tree="4,3,8")
    assert isinstance(d, EagleDrafter) and d.head.cfg.bias == bias
    line = capsys.readouterr().out
    assert "EAGLE-1/2" in line and "hidden 64" in line and f"fc bias {bias}" in line and "float32" in line
    assert _proposals(d, model, tok) == _proposals(EagleDrafter(model, head, tree="4,3,8"), model, tok)


def test_eagle1_embed_copy_of_another_model_warns(tmp_path, target):
    model, _ = target
    head = _eagle1(model)
    state = dict(head.state_dict(), **{"embed_tokens.weight": torch.randn_like(model.tok_emb.weight)})
    with pytest.warns(UserWarning, match="differs from the target's embedding"):
        load_drafter(_write_dir(tmp_path / "e", head.cfg.to_dict(), state, "safetensors"), model, verbose=False)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_official_eagle3_dir_without_rope_theta(tmp_path, target, capsys, fmt):
    model, tok = target
    head = _eagle3(model)
    cfg = head.config.to_dict()
    cfg.pop("rope_theta"), cfg.pop("head_dim")
    d = load_drafter(_write_dir(tmp_path / "e3", cfg, head.state_dict(), fmt), model, tree="eagle")
    assert isinstance(d, Eagle3Drafter) and d.head.config.rope_theta == 10000.0
    assert d.target_layers == eagle3_layers(model.cfg.n_layer)
    line = capsys.readouterr().out
    assert "EAGLE-3" in line and "draft vocab 96" in line and "absent" in line
    assert torch.equal(d.head.d2t, head.d2t) and torch.equal(d.head.t2d, head.t2d)
    assert _proposals(d, model, tok) == _proposals(Eagle3Drafter(model, head, tree="eagle"), model, tok)


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_official_medusa_dir(tmp_path, target, capsys, own_lm_head):
    model, tok = target
    heads = _randomize(MedusaHeads(model.cfg.d_model, 4, model.cfg.vocab_size, own_lm_head=own_lm_head))
    path = tmp_path / "medusa"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(path / "medusa_lm_head.safetensors"))
    d = load_drafter(path, model)
    assert isinstance(d, MedusaDrafter) and d.spec.name == "medusa" and d.heads.own_lm_head == own_lm_head
    assert "Medusa heads (4 heads, hidden 64" in capsys.readouterr().out
    assert _proposals(d, model, tok) == _proposals(MedusaDrafter(model, heads), model, tok)


def test_minispec_single_files(tmp_path, target, capsys):
    """minispec's own checkpoints (fp16 safetensors + JSON): EAGLE-3, Medusa and the draft model."""
    from minispec.drafters.draft_checkpoint import SHARED
    from minispec.drafters.draft_model import DraftModel
    from minispec.train.distill_draft import build_draft, save_draft
    from minispec.train.eagle3 import save_head
    from minispec.train.medusa import save_heads

    model, tok = target
    head = _eagle3(model)
    save_head(head, tmp_path / "e3.safetensors", {"format": "minispec-eagle3-v1", "config": head.config.to_dict()})
    heads = _randomize(MedusaHeads(model.cfg.d_model, 3, model.cfg.vocab_size))
    save_heads(heads, tmp_path / "m.safetensors", {"format": "minispec-medusa-v1", "config": {}})
    draft = build_draft(model, [1])  # shares the target's embedding and LM head: randomize only its own tensors
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name not in SHARED:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    cfg = {k: v for k, v in draft.cfg.__dict__.items() if k != "extra"}
    save_draft(draft, tmp_path / "d.safetensors", {"format": "minispec-draft-v1", "config": cfg})

    d3 = load_drafter(tmp_path / "e3.safetensors", model, tree="4,3,8")
    assert "float16" in capsys.readouterr().out
    ref = Eagle3Drafter(model, head.half().float(), tree="4,3,8")  # the file holds fp16 weights
    assert _proposals(d3, model, tok) == _proposals(ref, model, tok)
    dm = load_drafter(tmp_path / "m.safetensors", model, tree="chain:3")
    assert _proposals(dm, model, tok) == _proposals(MedusaDrafter(model, heads.half().float(), tree="chain:3"), model, tok)
    dd = load_drafter(tmp_path / "d.safetensors", model)
    assert isinstance(dd, DraftModel) and "draft model" in capsys.readouterr().out
    with torch.no_grad():  # the file holds fp16 weights
        for name, p in draft.named_parameters():
            if name not in SHARED:
                p.copy_(p.half().float())
    assert _proposals(dd, model, tok) == _proposals(DraftModel(draft, tree="chain:4"), model, tok)


def test_heads_for_another_model_are_refused(tmp_path, target):
    model, _ = target
    small, _ = load("tiny-gpt2-draft")  # hidden 32
    head = _randomize(EagleHead(EagleConfig.for_target(small.cfg)))
    with pytest.raises(ValueError, match="hidden size 32 vs the target's 64"):
        load_drafter(_write_dir(tmp_path / "a", head.cfg.to_dict(), head.state_dict(), "safetensors"), model)
    head3 = _eagle3(model, vocab=300)
    with pytest.raises(ValueError, match="vocab size 300 vs the target's 256"):
        load_drafter(_write_dir(tmp_path / "b", head3.config.to_dict(), head3.state_dict(), "safetensors"), model)
    heads = MedusaHeads(32, 2, 256)
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="hidden size 32 vs the target's 64"):
        load_drafter(tmp_path / "m.safetensors", model)


def test_unknown_layouts_and_missing_checkpoints(tmp_path, target, monkeypatch):
    model, _ = target
    save_file({"blocks.0.weight": torch.zeros(2, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="unknown drafter layout"):
        load_drafter(tmp_path / "x.safetensors", model)
    head = _eagle1(model)
    state = dict(head.state_dict())
    state.pop("layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="missing.*up_proj"):
        load_drafter(_write_dir(tmp_path / "broken", head.cfg.to_dict(), state, "safetensors"), model)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="hub is not reachable"):
        load_drafter("someone/EAGLE3-model", model)


def test_draft_vocab_applies_to_eagle1_and_medusa_heads_only(tmp_path, target):
    model, _ = target
    e1 = _write_dir(tmp_path / "e1", _eagle1(model).cfg.to_dict(), _eagle1(model).state_dict(), "safetensors")
    e3 = _eagle3(model)
    e3 = _write_dir(tmp_path / "e3", e3.config.to_dict(), e3.state_dict(), "safetensors")
    m = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in _randomize(MedusaHeads(model.cfg.d_model, 2, 256)).state_dict().items()}, str(m))
    with pytest.raises(ValueError, match="draft_vocab applies to EAGLE-1/2 and Medusa heads, not to a eagle3 checkpoint"):
        load_drafter(e3, model, verbose=False, draft_vocab=16)
    with pytest.raises(ValueError, match="head_dtype applies to EAGLE-1/2 heads, not to a medusa checkpoint"):
        load_drafter(m, model, verbose=False, head_dtype=torch.bfloat16)
    for path in (e1, m):
        with pytest.raises(ValueError, match="token counts cover 49152 tokens but the target's vocabulary has 256"):
            load_drafter(path, model, verbose=False, draft_vocab=16)  # the shipped counts are SmolLM2's
        d = load_drafter(path, model, verbose=False)
        assert d.draft_vocab is None and d.lm_head is model.lm_head


def test_medusa_heads_with_their_own_lm_heads_draft_over_the_draft_vocabulary(target):
    """Medusa-1 heads with an LM head each: a draft vocabulary restricts every one of them to its rows."""
    from minispec.drafters.vocab import top_tokens

    model, _ = target
    heads = _randomize(MedusaHeads(model.cfg.d_model, 4, model.cfg.vocab_size, own_lm_head=True))
    counts = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    d = MedusaDrafter(model, heads, draft_vocab=24, token_counts=counts)
    keep = torch.zeros(model.cfg.vocab_size, dtype=torch.bool)
    keep[top_tokens(counts, 24)] = True
    f = torch.randn(3, model.cfg.d_model)
    with torch.inference_mode():
        full, small = heads(f), heads(f, d.lm_head)  # [4, 3, V] each head's own LM head, over all tokens / the 24
    assert [tuple(lm.head.weight.shape) for lm in d.lm_head] == [(24, model.cfg.d_model)] * 4
    torch.testing.assert_close(small[..., keep], full[..., keep])
    assert torch.isinf(small[..., ~keep]).all() and (small[..., ~keep] < 0).all()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_export_round_trip(tmp_path, target, kind):
    """export_head writes the official layout; load_drafter reads it back and drafts the same trees."""
    from minispec.lab.export import export_head

    model, tok = target
    head = _eagle1(model) if kind == "eagle" else _eagle3(model)
    out = export_head(head, tmp_path / kind, max_position_embeddings=model.cfg.max_seq_len, dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["max_position_embeddings"] == model.cfg.max_seq_len
    assert cfg["architectures"] == (["LlamaForCausalLM"] if kind == "eagle" else ["LlamaForCausalLMEagle3"])
    d = load_drafter(out, model, verbose=False, tree="4,3,8")
    assert type(d) is (EagleDrafter if kind == "eagle" else Eagle3Drafter)
    for k, v in head.state_dict().items():
        assert torch.equal(d.head.state_dict()[k], v), k
    ref = (EagleDrafter if kind == "eagle" else Eagle3Drafter)(model, head, tree="4,3,8")
    assert _proposals(d, model, tok) == _proposals(ref, model, tok)
    half = export_head(head, tmp_path / "half", dtype=torch.float16)
    from safetensors.torch import load_file
    tensors = load_file(str(half / "model.safetensors"))
    assert all(v.dtype == torch.float16 for k, v in tensors.items() if k not in ("d2t", "t2d"))


def test_export_refuses_other_modules(tmp_path):
    from minispec.lab.export import export_head

    with pytest.raises(TypeError, match="EAGLE-1/2 and EAGLE-3 heads"):
        export_head(torch.nn.Linear(2, 2), tmp_path)
