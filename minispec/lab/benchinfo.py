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
    """The prepacked CPU kernel ``minispec.linear.Linear`` runs at the running thread count ("auto: onednn" where
    ``minispec.kernel_choice`` chose it for this machine).

    On a host with a CUDA GPU the kernels are never timed for this line: a result file written there reads
    the machine's recorded choice, if any ("auto: ...", else "auto: not chosen on this machine"). Timing them
    would cost the GPU run seconds of CPU work for a kernel its forwards do not use."""
    from ..linear import Linear, onednn_available, time_kernels

    if not Linear.prepack:
        return "f_linear (prepacking off)"
    if Linear.cpu_kernel != "auto":
        return Linear.cpu_kernel if Linear.cpu_kernel != "onednn" or onednn_available() else "panels"
    from ..kernel_choice import choice_path, chosen_kernel, read_choice

    if torch.cuda.is_available():
        record = read_choice(choice_path()) if onednn_available() else {"kernel": "panels"}
        return f"auto: {record['kernel']}" if record else "auto: not chosen on this machine (not timed on a GPU host)"
    return f"auto: {chosen_kernel(time_kernels)}"


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
