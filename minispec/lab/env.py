"""``python -m minispec check-env``: is everything minispec needs installed?

One [OK]/[FAIL] line per dependency, and [OK]/[WARN] for JupyterLab (the course extra: the
notebooks in a browser; nothing else needs it, so its absence fails nothing); CUDA and the Triton
interpreter are reported as information ([INFO]), since no GPU is a normal setup for the CPU chapters. Then whether the
decode forward's rows are invariant to the row count on this CPU (``minispec.exact``): the
property that makes greedy speculative decoding identical to vanilla by construction; and which
prepacked linear kernel this machine runs (``minispec.exact.kernels``).
"""

from __future__ import annotations

import importlib
import os
import platform
import sys

REQUIRED = ["torch", "numpy", "transformers", "safetensors", "gguf", "accelerate", "tqdm", "triton",
            "matplotlib", "ipywidgets", "nbmake", "pytest"]
# the course extra: opening the notebooks in a browser. Missing, check-env warns and does not fail: scripts, the
# tests and headless notebook runs (pytest --nbmake) work without it
COURSE = {"jupyterlab": "open the notebooks in a browser: make lab (or pip install -e '.[course]')"}




def default_threads(cores: int | None = None, load: float | None = None, idle: float | None = None) -> int:
    """Torch CPU threads to use unless told (``--threads``): the cores that are idle now.

    torch's threads wait for each other at every matrix product, so one more thread than there
    are free cores makes decoding collapse (``benchmarks/threads.py``: several times slower on a
    2-core machine beside one busy process). Idle cores are measured over a quarter second
    (``idle_cores``: /proc/stat). Where that cannot be read, cores - the 1-minute load average,
    which lags: right after an install it still counts the install's work, and would give a
    2-core machine one thread for a demo that has both. Rounded; at least 1.

    Args:
        cores: CPU cores (default ``os.cpu_count()``).
        load: a load average to use instead of measuring (the old rule: cores - load).
        idle: idle cores to use instead of measuring.
    """
    cores = cores or os.cpu_count() or 1
    if idle is None and load is None:
        idle = idle_cores()
    if idle is None:
        if load is None:
            try:
                load = os.getloadavg()[0]
            except (AttributeError, OSError):  # not on every platform
                load = 0.0
        idle = cores - load
    return max(1, min(cores, round(idle)))


def _cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat's first line; None where there is none."""
    try:
        with open(path) as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    return fields[3] + fields[4], sum(fields)


def idle_cores(interval: float = 0.25, read=_cpu_times, cores: int | None = None) -> float | None:
    """Cores idle over the next ``interval`` seconds (CPU count x idle share of /proc/stat's jiffies);
    None where /proc/stat cannot be read or no time passed."""
    import time

    a = read()
    time.sleep(interval)
    b = read()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (cores or os.cpu_count() or 1) * (b[0] - a[0]) / (b[1] - a[1])


def _version(mod) -> str:
    return getattr(mod, "__version__", "") or "installed"


def check_env(out=sys.stdout) -> int:
    """Print one line per dependency; return 1 if a required one is missing, else 0."""
    failed = 0
    major, minor = sys.version_info[:2]
    ok = (major, minor) >= (3, 10)
    failed += not ok
    print(f"[{'OK' if ok else 'FAIL'}] python {platform.python_version()} (>= 3.10 required)", file=out)
    for name in REQUIRED:
        try:
            mod = importlib.import_module(name)
            print(f"[OK] {name} {_version(mod)}", file=out)
        except Exception as e:  # a broken install can raise more than ImportError
            failed += 1
            print(f"[FAIL] {name}: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=out)
    for name, why in COURSE.items():
        try:
            print(f"[OK] {name} {_version(importlib.import_module(name))}", file=out)
        except Exception as e:
            print(f"[WARN] {name} not installed ({e.__class__.__name__}): needed to {why}", file=out)
    try:
        import torch

        if torch.cuda.is_available():
            print(f"[INFO] CUDA available: {torch.cuda.get_device_name(0)} (torch CUDA {torch.version.cuda})", file=out)
        else:
            print("[INFO] CUDA not available: GPU chapters (CUDA graphs, GPU timings) will skip; everything else runs on CPU", file=out)
            if torch.version.cuda:
                print(f"[WARN] torch {torch.__version__} is a CUDA {torch.version.cuda} build but no GPU is visible: the CPU "
                      "build is a fraction of its size (pip install torch --index-url "
                      "https://download.pytorch.org/whl/cpu, or make install on a machine without nvidia-smi)", file=out)
        print(f"[INFO] torch threads: {torch.get_num_threads()}", file=out)
    except Exception:
        pass
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    print(f"[INFO] Triton interpreter {'on' if interp else 'off'} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}; "
          "set TRITON_INTERPRET=1 before importing triton to run kernels on CPU)", file=out)
    if not failed:
        for line in row_invariance_lines():
            print(line, file=out)
    print(("all required dependencies found" if not failed else f"{failed} required dependencies missing"), file=out)
    return 1 if failed else 0


SMOLLM2_LINEARS = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))  # qkv, out, gate_up, down, LM head


def row_invariance_lines(shapes=SMOLLM2_LINEARS) -> list[str]:
    """[OK]/[WARN] lines: does a row of the CPU decode forward give the same bits whatever rows come with
    it, at the running thread count? Probes the Linear kernel of each of SmolLM2's weight shapes (random
    weights) and the dense attention on a tree of 9 rows over 24 + 9 and 300 + 9 keys against each row
    alone, and names the recipe each runs under."""
    import torch

    from ..exact.attention import attention_padding, invariant_attention
    from ..exact.linear import ExactLinear
    from ..exact.kernels import describe

    n = torch.get_num_threads()
    lines, notes, broken = [], [], []
    if ExactLinear.cpu_kernel == "auto":
        lines.append(f"[INFO] linear kernel ('auto', {n} threads): {describe()}")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n_in, n_out in shapes:
            layer = ExactLinear(n_in, n_out, bias=False)
            layer.weight.copy_(torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5)
            x = torch.zeros(1, n_in)
            recipe = layer.row_recipe(x)
            if not recipe.invariant:
                broken.append(f"{n_in}->{n_out} ({recipe.describe()})")
            elif recipe.varies:
                notes.append(f"{n_in}->{n_out} {recipe.describe()}")
        path = {"panels": "weight panels (torch.bmm)", "onednn": "oneDNN prepacked weights", "f_linear": "F.linear"}.get(recipe.kernel, recipe.kernel)
        if broken:
            lines.append(f"[WARN] linear layers ({path}, {n} threads): rows depend on the row count for "
                         f"{'; '.join(broken)}: greedy speculative output may differ from vanilla here")
        else:
            lines.append(f"[OK] linear layers ({path}, {n} threads): each row's bits do not depend on the row count"
                         + (f"; {'; '.join(notes)}" if notes else ", every SmolLM2 shape as it is"))
        padding = attention_padding(64)
        same = True
        for P in (24, 300):  # one block of keys, and two
            q, k, v = torch.randn(1, 9, 9, 64, generator=gen), torch.randn(1, 3, P + 9, 64, generator=gen), \
                torch.randn(1, 3, P + 9, 64, generator=gen)
            parents = [-1, 0, 1, 0, 3, 0, 1, 2]  # root + 8 nodes: a tree with interleaved branches
            tree = torch.eye(9, dtype=torch.bool)
            for i, p in enumerate(parents, start=1):
                tree[i] |= tree[p + 1]
            mask = torch.cat([torch.ones(9, P, dtype=torch.bool), tree], dim=1)
            out = invariant_attention(q, k, v, mask)
            same &= all(torch.equal(out[0, :, t], invariant_attention(q[:, :, t:t + 1], k[:, :, mask[t]],
                                                                      v[:, :, mask[t]])[0, :, 0]) for t in range(9))
    lines.append(f"[{'OK' if same else 'WARN'}] attention (exact backend, CPU, {padding.describe()}): a tree row "
                 + ("equals the row alone over its own keys, bit for bit" if same else
                    "differs from the row alone over its own keys: greedy speculative output may differ from vanilla here"))
    return lines
