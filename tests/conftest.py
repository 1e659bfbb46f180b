import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never wait on a hub that cannot be reached
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

pytest_plugins = ["conftest_grading"]  # --impl minispec|solutions|exercises
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU through the interpreter (chapter 6)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from minispec.models import load, load_hf

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm2():
    """(minispec model, tokenizer) for SmolLM2-135M; downloads and converts on first use."""
    return load("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf():
    return load_hf("smollm2-135m")
