"""Training (tooling: nothing in the runtime imports it).

Trainers, one file each holding its model and loss: the distilled draft model (``train draft``,
``distill_draft.py``), EAGLE-1/2 heads (``train eagle``, ``eagle.py``), EAGLE-3 heads
(``train eagle3``, ``eagle3.py``) and Medusa heads (``train medusa``, ``medusa.py``). What they
share: ``loop.py`` (the one training loop: batches, AdamW, schedule, evaluation, resume, several
processes through ``ddp.py``, the JSON record and the save tail), ``measure.py`` (greedy tau of a
saved head), ``data.py`` (sequences and the frozen target's cached features), ``sharegpt.py`` (the
one ShareGPT V3 reader), ``selfdistill.py`` (the target's own answers with recorded features) and
``token_counts.py`` (the draft vocabulary's token counts).
"""
import torch

TARGET = "smollm2-135m"  # the target every trainer trains its heads for (its shipped checkpoints)


def native_bf16() -> bool:
    """True where bf16 autocast is fast on this CPU (AVX512-BF16 or AMX tiles).

    On a CPU without them (e.g. AVX2-only) oneDNN emulates bf16 matmuls, which measured
    hundreds of times slower than fp32 for the EAGLE-3 training step, so the trainers' ``--bf16``
    default follows this check; ``--bf16`` / ``--no-bf16`` override it.
    """
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, p, lambda: False)()) for p in probes)


def bf16_help() -> str:
    return ("bf16 autocast for the training forward/backward (fp32 weights and optimizer); "
            f"default: on only where the CPU has native bf16 (here: {'yes' if native_bf16() else 'no'})")
