"""Device and dtype flags shared by ``train-draft``, ``calibrate-confidence`` and ``eval-draft``.

``--device`` takes ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when
usable, else CPU). Asking for CUDA where torch sees none is a
:class:`~dspark_core.errors.ConfigError` before any model is loaded, not a
crash deep inside the first forward.

``--dtype`` is the target's weight dtype. It defaults to float32 everywhere:
the teacher labels and the features the draft is trained on should be the
ones serving computes (the CPU engine runs float32), and SmolLM2-135M is small
enough that float32 costs little on a GPU. The draft always trains in float32
(its LM-head product can run in bfloat16, ``--head_dtype``).
"""

from __future__ import annotations

import argparse

import torch

from dspark_core.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The torch device for a ``--device`` value; a clear error when it cannot be used here."""
    text = (name or "cpu").strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device={name}: not a device name (use cpu, cuda, cuda:N or auto)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"--device={name}: draft training runs on cpu or cuda only")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device={name}: CUDA was asked for, but this PyTorch build sees no CUDA device "
                          f"(torch {torch.__version__}, torch.cuda.is_available() is false); use --device=cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device={name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"--dtype={name}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--device", default="cpu", help="Torch device: cpu, cuda, cuda:N or auto (cuda when usable). Default: cpu.")
    a("--dtype", choices=sorted(DTYPES), default="float32",
      help="Target weight dtype (teacher features and labels). Default: float32, as the CPU engine serves.")


def setup(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Check ``--device``/``--dtype`` and set CPU threads; returns (device, dtype)."""
    device = resolve_device(getattr(args, "device", "cpu"))
    dtype = resolve_dtype(getattr(args, "dtype", "float32"))
    torch.set_num_threads(max(1, getattr(args, "threads", 1)))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # keep the teacher's float32 maths as serving computes it
    return device, dtype
