"""Decode-time C++ kernels (`csrc/kernels.cpp`), compiled for this CPU on first use.

Each has a readable PyTorch twin that the model uses when the kernels are unavailable (no C++
compiler, `HYBRIDKV_NATIVE=0`) and that the tests compare it with:

    rows_matmul(x, w)            x @ w for a few rows (decode batches), w [D, N] float32 or bfloat16
    moe_experts(x, ...)          hybridkv.ops.moe.routed_experts
    gdn_decode(mixed, ...)       GatedDeltaNet's PyTorch decode step (conv, norms, gates, delta rule)

The build (~10 s; the system's g++, ninja from PyPI) is cached by torch.utils.cpp_extension under
$TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), per source and per CPU feature set,
since the code is built with -march=native.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
DISABLE_ENV = "HYBRIDKV_NATIVE"


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: a build for one CPU may not run on another."""
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features"))),
            "",
        )
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


@functools.cache
def kernels() -> Any | None:
    """`torch.ops.hybridkv` once built and loaded, or None (the build failed: logged once)."""
    try:
        import ninja  # the PyPI package: its binary may not be on PATH when the venv is not activated
        from torch.utils import cpp_extension

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        cpp_extension.load(
            name=f"hybridkv_kernels_{_cpu_tag()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported platform: the PyTorch path still works
        log.warning("hybridkv C++ kernels unavailable, using the PyTorch path (slower decode): %s", exc)
        return None
    return torch.ops.hybridkv


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors: not disabled by HYBRIDKV_NATIVE=0, built, on the
    CPU, and no autograd needed (the kernels have no backward; training runs the PyTorch twins)."""
    if os.environ.get(DISABLE_ENV) == "0" or any(t.device.type != "cpu" or t.requires_grad for t in tensors):
        return False
    return kernels() is not None


def _ops() -> Any:
    ops = kernels()
    assert ops is not None, "check native.enabled() first"
    return ops


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ w [D, N] → [T, N] float32, for few rows (≲ 32): every row in one pass over w."""
    return _ops().rows_matmul(x, w)


def moe_experts(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Same contract as `hybridkv.ops.moe.routed_experts`; float32 result. For few tokens."""
    return _ops().moe_experts(x, experts, weights, gate_up, down)


def gdn_decode(
    mixed: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    Hk: int,
    dk: int,
    pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    snapshot_of_token: torch.Tensor,
) -> torch.Tensor:
    """One Gated DeltaNet decode step after in_proj, token n being sequence n.

    mixed [T, C + Hv·dv + 2·Hv] = conv input q|k|v, then z, b, a; conv_weight [C, K]; A_log, dt_bias
    [Hv]; norm_weight [dv]; pools = (conv [slots, C, K-1], delta [slots, Hv, dk, dv], snap_conv,
    snap_delta), all float32. Updates conv[slots[n]] and delta[slots[n]] in place and copies them to
    the snapshot pools at snapshot_of_token[n] where that is >= 0.
    Returns RMSNorm(o)·silu(z) [T, Hv·dv] float32, o being the delta rule's read-out.
    """
    conv, delta, snap_conv, snap_delta = pools
    return _ops().gdn_decode(
        mixed,
        conv_weight,
        A_log,
        dt_bias,
        norm_weight,
        eps,
        Hk,
        dk,
        conv,
        delta,
        slots,
        snap_conv,
        snap_delta,
        snapshot_of_token,
    )
