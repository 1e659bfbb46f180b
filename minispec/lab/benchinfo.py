"""What every benchmark result file records: device, versions, threads, time."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch

from ..config import cpu_model


def device_info() -> dict:
    info = dict(cpu=platform.processor() or platform.machine(), torch_threads=torch.get_num_threads(),
                cuda=torch.cuda.is_available())
    if cpu_model():
        info["cpu_model"] = cpu_model()
    info["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
    info["linear_kernel"] = linear_kernel()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def linear_kernel() -> str:
    """The prepacked CPU kernel ``minispec.exact.linear.ExactLinear`` runs at the running thread count ("auto: onednn"
    where this machine's saved choice names it, ``minispec.exact.kernels``; read, never timed)."""
    from ..exact.linear import ExactLinear
    from ..exact.kernels import chosen_kernel, onednn_available

    if not ExactLinear.prepack:
        return "f_linear (prepacking off)"
    if ExactLinear.cpu_kernel != "auto":
        return ExactLinear.cpu_kernel if ExactLinear.cpu_kernel != "onednn" or onednn_available() else "panels"
    return f"auto: {chosen_kernel()}"


def versions() -> dict:
    import transformers

    from .. import __version__

    return dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                minispec=__version__)


def save_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   device=device_info(), versions=versions(), **payload)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
