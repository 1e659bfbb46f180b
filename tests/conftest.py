import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never wait on a hub that cannot be reached
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

pytest_plugins = ["conftest_grading"]  # --impl minispec|solutions|exercises
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU through the interpreter (chapter 6)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from minispec.loading import load, load_hf

# pytest-xdist workers share the cores: one more torch thread than there are free cores makes every
# matrix product wait (benchmarks/threads.py), so each worker gets its share
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.fixture(scope="session")
def smollm2():
    """(minispec model, tokenizer) for SmolLM2-135M; downloads and converts on first use."""
    return load("smollm2-135m")


def _once_per_run(tmp_path_factory, worker_id, suffix: str, save, read):
    """``get(name, compute)``: ``compute()``'s result, saved by the pytest-xdist worker that asks first (the
    others wait for it and read the file); keyed by ``name`` and the torch thread count (a row recipe is chosen
    per thread count); without xdist, simply ``compute()``."""
    from filelock import FileLock

    def get(name: str, compute):
        if worker_id == "master":
            return compute()
        path = tmp_path_factory.getbasetemp().parent / f"shared-{name}-{torch.get_num_threads()}t.{suffix}"
        with FileLock(f"{path}.lock"):
            if not path.exists():
                save(compute(), path)
            return read(path)
    return get


@pytest.fixture(scope="session")
def shared(tmp_path_factory, worker_id):
    """``shared(name, compute)``: ``compute()``'s result (JSON), computed once per test run and read by every
    pytest-xdist worker, instead of once per worker (the SmolLM2 greedy references cost a minute each on a
    slow 2-core machine)."""
    import json

    return _once_per_run(tmp_path_factory, worker_id, "json", lambda x, path: path.write_text(json.dumps(x)),
                         lambda path: json.loads(path.read_text()))


@pytest.fixture(scope="session")
def shared_torch(tmp_path_factory, worker_id):
    """``shared_torch(name, compute)``: as ``shared``, for a result of tensors (dicts, lists and tensors, such as
    a trained head's state dict): saved with ``torch.save``, read back with ``torch.load(weights_only=True)``."""
    return _once_per_run(tmp_path_factory, worker_id, "pt", torch.save,
                         lambda path: torch.load(path, weights_only=True))


@pytest.fixture(scope="session")
def smollm2_hf():
    return load_hf("smollm2-135m")


N_REF = 32  # new tokens of the SmolLM2 greedy references


def one_per_category() -> list[str]:
    """The first prompt of each category of ``own_prompts`` (chat, code, math, knowledge, writing),
    plus the code prompt with a library call: six prompts."""
    from minispec.prompts import own_prompts

    seen, out = set(), []
    for p in own_prompts():
        if p["category"] not in seen or "pandas" in p["prompt"]:
            seen.add(p["category"])
            out.append(p["prompt"])
    return out


def half_of(refs: dict, i: int) -> dict:
    """Every other item of ``refs`` from the ``i % 2``-th: the prompts (and their references) that the ``i``-th
    tree method of tests/test_smollm2_speculative.py decodes, so that the methods alternate halves of
    ``one_per_category`` and each prompt meets half of them."""
    return dict(list(refs.items())[i % 2::2])


@pytest.fixture(scope="session")
def smollm2_vanilla(smollm2, shared):
    """{prompt: minispec's greedy tokens} on ``one_per_category`` x N_REF new tokens (chat template), computed
    once per test run: what tests/test_smollm2.py holds against transformers' ``generate`` and every
    speculative method on SmolLM2 against."""
    from minispec import generate

    model, tok = smollm2
    return shared(f"smollm2-vanilla-6x{N_REF}", lambda: {p: generate(model, tok, p, max_new_tokens=N_REF).tokens
                                                        for p in one_per_category()})
