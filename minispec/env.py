"""``python -m minispec check-env``: is everything minispec needs installed?

One [OK]/[FAIL] line per dependency; CUDA and the Triton interpreter are reported as
information ([INFO]), since no GPU is a normal setup for the CPU chapters.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys

REQUIRED = ["torch", "numpy", "transformers", "safetensors", "gguf", "accelerate", "tqdm", "triton",
            "matplotlib", "ipywidgets", "jupyterlab", "nbmake", "pytest"]


def default_threads(cores: int | None = None, load: float | None = None) -> int:
    """Torch CPU threads to use unless told (``--threads``): the cores that are idle now.

    torch's threads wait for each other at every matrix product, so one more thread than there
    are free cores makes decoding collapse (``benchmarks/threads.py``: several times slower on a
    2-core machine beside one busy process). Idle cores = cores - the 1-minute load average,
    rounded; at least 1.

    Args:
        cores: CPU cores (default ``os.cpu_count()``); load: the load average (default ``os.getloadavg()[0]``).
    """
    cores = cores or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # not on every platform
            load = 0.0
    return max(1, min(cores, round(cores - load)))


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
    print(("all required dependencies found" if not failed else f"{failed} required dependencies missing"), file=out)
    return 1 if failed else 0
