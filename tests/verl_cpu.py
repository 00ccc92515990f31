"""A CPU platform for verl 0.9.1, so that its FSDP engine runs an actor step on a machine without an accelerator.

verl picks its device through a platform registry (verl/plugin/platform/platform_manager.py): NVIDIA, Huawei and AMD
are registered, and on a CPU it falls back to NVIDIA (`_detect_platform_name`), whose device mesh then calls
torch.cuda.set_device, which a CPU build of torch does not have. verl's registry is its documented way to add a
device (`@PlatformRegistry.register(platform=...)`, selected with VERL_PLATFORM): this is that, for the CPU, the
smallest subclass of verl's `PlatformBase` whose abstract methods all exist. A test stand-in, not a verl feature."""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


class _CPUDevice(ModuleType):
    """torch.cpu plus the memory counters verl reads from its device module (engine_workers.py _postprocess_output:
    max_memory_allocated; the FSDP engine's log_gpu_memory_usage: memory_allocated, memory_reserved, mem_get_info),
    which the CPU does not keep: reported as 0."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "get_device_name":  # verl's flops counter names the CPU "CPU" (utils/flops_counter.py)
            return lambda *args, **kwargs: "CPU"
        if "memory" in name or name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0) if name == "mem_get_info" else 0
        raise AttributeError(name)


_DEVICE = _CPUDevice("verl_cpu_device")


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # never auto-detected: chosen by VERL_PLATFORM=cpu only

    def current_device(self):
        return torch.device("cpu")  # verl passes it as `device=` (fsdp_utils.py: model.to(device=get_device_id())),
        # where an integer means an accelerator

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def register_fsdp_engine_on_cpu() -> None:
    """verl registers its FSDP language-model engine for the devices "cuda" and "npu" only
    (workers/engine/fsdp/transformer_impl.py, `@EngineRegistry.register(..., device=["cuda", "npu"])`); the same
    class, registered through the same decorator for "cpu"."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if "cpu" not in EngineRegistry._engines["language_model"].get("fsdp", {}):
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
            FSDPEngineWithLMHead)
