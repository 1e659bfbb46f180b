"""What every chapter's notebook does the same way, written once: the first cell (``setup``), printing library
code (``show``), the greedy timing table of chapters 1-2 (``time_greedy``) and the interactive explorers
(``interact``).

The explorers are ``ipywidgets.interact`` when a person runs the notebook, one plain call at the explorer's
default arguments in fast mode (CI, nbmake). Run without a browser, a cell that builds widgets now and then
never completes for the notebook client: the kernel sits idle, nbclient waits for a reply that does not come
(jupyter/nbclient#312; seen in minispec's CI on the ``interact`` cells, with ipykernel 6 and 7). Fast mode
therefore builds no widget at all and draws each explorer once, so the cell's code still runs and is checked.

The decode-loop exactness section of chapters 3, 4, 5 and 7 is one call too:
``minispec.lab.joint_law.decode_loop_exactness``.
"""

from __future__ import annotations

import inspect
import os
import platform

from .. import config


def setup() -> bool:
    """The first cell of every chapter: print the versions, FAST mode, whether the Hugging Face hub answers
    and the device the chapter measures on; return FAST (``MINISPEC_FAST=1``: smaller sample counts and
    shorter generations, what CI runs)."""
    import torch

    import minispec
    from ..loading import hub_reachable

    fast = config.fast()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    print(f"python {platform.python_version()} | torch {torch.__version__} | minispec {minispec.__version__}")
    print(f"FAST mode: {'on' if fast else 'off'} (MINISPEC_FAST={os.environ.get('MINISPEC_FAST', '')!r})")
    print(f"Hugging Face hub reachable: {hub_reachable()}")
    print(f"device: {'GPU ' + gpu if gpu else 'no CUDA GPU'}; CPU {config.cpu_model() or platform.machine()}, "
          f"{torch.get_num_threads()} torch thread(s)")
    return fast


def show(obj) -> None:
    """Print the source of a minispec function or class (a notebook never redefines library code)."""
    print(inspect.getsource(obj))


def smollm2_and_draft(loaded: tuple | None = None):
    """(SmolLM2-135M, its tokenizer, minispec's distilled draft or None when its checkpoint is missing): the
    models chapters 1-2 time. ``loaded``: ``joint_law.load_tv_models``'s (target name, draft name, target, draft,
    tokenizer), reused when it holds SmolLM2."""
    from ..loading import load

    if loaded is not None and loaded[0].startswith("SmolLM2"):
        return loaded[2], loaded[4], loaded[3]
    model, tok = load("smollm2-135m")
    try:
        from ..drafters.draft_checkpoint import load_draft_model

        return model, tok, load_draft_model(model)
    except (ImportError, FileNotFoundError) as e:
        print(f"NOTE: the distilled SmolLM2 draft is not available ({type(e).__name__}: {e}): no draft-model rows")
        return model, tok, None


def time_greedy(model, tok, prompt: str, drafters: dict, n_new: int) -> dict:
    """Greedy decoding of ``prompt`` by vanilla and by each drafter (name -> Drafter), after a warm-up; asserts
    that every speculative run emits exactly vanilla's tokens and prints one line per method (tokens, target
    forwards, tau, tokens/s, acceptance by depth) under the device it ran on.

    Returns:
        {"vanilla": GenerationResult, name: GenerationResult, ...}.
    """
    import torch

    from ..generate import generate

    generate(model, tok, prompt, max_new_tokens=4)  # warm-up (first-call overheads)
    runs = {"vanilla": generate(model, tok, prompt, max_new_tokens=n_new)}
    for name, d in drafters.items():
        runs[name] = generate(model, tok, prompt, drafter=d, max_new_tokens=n_new)
        assert runs[name].tokens == runs["vanilla"].tokens, f"{name}: greedy output differs from vanilla greedy"
    where = (f"GPU {torch.cuda.get_device_name(0)}" if model.device.type == "cuda" else
             f"this machine's CPU ({config.cpu_model() or platform.machine()}), torch threads: "
             f"{torch.get_num_threads()}")
    print(f"device: {where}; greedy, {n_new} new tokens, prompt {prompt[:60]!r}")
    print(f"{'method':<32} {'tokens':>6} {'target fwd':>10} {'tau':>5} {'tokens/s':>9}  acceptance by depth")
    for name, r in runs.items():
        s = r.stats
        acc = " ".join(f"{a:.2f}" for a in s.acceptance_by_position)
        print(f"{name:<32} {s.new_tokens:>6} {s.target_forwards:>10} {s.tau:>5.2f} {s.tokens_per_s:>9.1f}  {acc}")
    print("every speculative run emitted exactly the vanilla greedy tokens")
    return runs


def interact(fn, **controls):
    """``ipywidgets.interact(fn, **controls)`` (controls in its abbreviations: ``(min, max[, step])`` for
    a slider, a list for a choice; the start values are ``fn``'s defaults); in fast mode ``fn()``."""
    if config.fast():
        return fn()
    import ipywidgets

    return ipywidgets.interact(fn, **controls)
