"""Decode-time C++ kernels (`csrc/kernels.cpp`), compiled for this CPU on first use.

Each has a readable PyTorch twin that the model uses when the kernels are unavailable (no C++
compiler, `HYBRIDKV_NATIVE=0`) and that the tests compare it with:

    rows_matmul(x, w)            x @ w for a few rows (decode batches), w [D, N] float32 or bfloat16
    rows_matmul_t(x, w)          x @ wᵀ for a few rows, w [N, D] (a tied lm_head: the embedding)
    rms_norm(x, w, eps)          F.rms_norm in float32
    add_rms_norm(x, d, w, eps)   (x + d, rms_norm(x + d, w, eps)): a residual add and the norm after it
    silu_mul(gate_up)            ops.matmul.silu_mul in float32 (SwiGLU's activation)
    moe_combine(y, w, shared, g) ops.moe.moe_block's weighted sum of its pairs and gated shared expert
    moe_block(x, ...)            hybridkv.ops.moe.moe_block's PyTorch path (router, experts, shared expert)
    gdn_forward(mixed, ...)      GatedDeltaNet's PyTorch path after in_proj (conv, norms, gates, delta rule)
    attention_decode(qkv, ...)   GatedAttention's PyTorch decode step (norms, RoPE, paged attention, gate)
    decode_layer(x, normed, ...) a decoder layer's decode step (or every layer's), the ops above in one call

The build (1–2.5 min on 2 cores; the system's g++, ninja from PyPI) goes to a directory of
torch.utils.cpp_extension's root ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) named
by a hash of what makes the library — the sources' bytes, the flags, torch's version — and of this
CPU's features (the code is built with -march=native, or HYBRIDKV_ARCH's flags), never by where
the sources lie: every checkout of the same sources on this machine loads the one library, which
is opened directly when it exists (no ninja run). After a build, the other builds there that no
process has loaded for 30 days are removed (`prune_stale_builds`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
SOURCES = sorted(SOURCE.parent.glob("*.cpp"))  # with quant.cpp: GGUF block kernels (hybridkv.ops.quant)
DISABLE_ENV = "HYBRIDKV_NATIVE"
# Read once: `enabled` runs dozens of times per decode step. Tests flip it with monkeypatch.
disabled = os.environ.get(DISABLE_ENV) == "0"


# The instruction sets the kernels are built for: this CPU's (-march=native), or, to build and test
# the code paths of another class of CPU on this one, the compiler's target flags in HYBRIDKV_ARCH:
# tests/ops/test_native_arch.py runs the block kernels' tests with "-march=x86-64-v3" (AVX2, FMA, no
# AVX-512, no VNNI: Zen 2 and 3, Haswell to Comet Lake) and with "-march=x86-64-v3 -mavx512f
# -mavx512vl -mavx512vnni" (VNNI on 256-bit vectors only: the paths of AVX-VNNI CPUs such as Alder
# Lake, in their EVEX form). Flags for instructions this CPU lacks build a library that crashes.
ARCH_ENV = "HYBRIDKV_ARCH"


def arch_flags(value: str | None = None) -> list[str]:
    """The target flags of HYBRIDKV_ARCH (`value` if given): -march=... and -m... only, default
    -march=native; ValueError naming the variable otherwise."""
    value = os.environ.get(ARCH_ENV, "") if value is None else value
    flags = value.split() or ["-march=native"]
    if bad := [f for f in flags if not f.startswith("-m") or len(f) < 3]:
        raise ValueError(f"{ARCH_ENV} takes compiler target flags (-march=..., -m...), got {bad[0]!r} in {value!r}")
    return flags


def cflags() -> list[str]:
    return ["-O3", *arch_flags(), "-fopenmp"]


LDFLAGS = ["-fopenmp"]


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


def build_name(sources: list[Path] = SOURCES) -> str:
    """The library's name: a hash of the sources' names and bytes (every .cpp and .h in csrc/),
    the build flags and torch's version, then the CPU tag. Equal sources give equal names wherever
    they are checked out; a changed byte gives a new name (a build beside the old library)."""
    digest = hashlib.sha256(f"{torch.__version__} {cflags()} {LDFLAGS}".encode())
    for path in sorted({*sources, *(p for p in sources[0].parent.iterdir() if p.suffix in (".cpp", ".h"))}):
        digest.update(f"\0{path.name}\0".encode() + path.read_bytes())
    return f"hybridkv_kernels_{digest.hexdigest()[:12]}_{_cpu_tag()}"


@functools.cache
def kernels() -> Any | None:
    """`torch.ops.hybridkv` once built and loaded, or None (the build failed: logged once)."""
    try:
        _load()
    except Exception as exc:  # no compiler, no ninja, unsupported platform: the PyTorch path still works
        log.warning("hybridkv C++ kernels unavailable, using the PyTorch path (slower decode and prefill): %s", exc)
        return None
    return torch.ops.hybridkv


def _load() -> None:
    """Load the library of these sources for this CPU, building it first if no checkout has."""
    from torch.utils import cpp_extension

    name = build_name()
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # where load() would build it
    library = build_dir / f"{name}{cpp_extension.LIB_EXT}"
    building_elsewhere = (build_dir / "lock").exists()  # cpp_extension's lock: a build is under way
    if library.is_file() and not building_elsewhere:
        torch.ops.load_library(str(library))
        _mark_used(build_dir)
        return
    log.info("building the C++ kernels (%s) in %s", ", ".join(p.name for p in SOURCES), build_dir)
    start = time.perf_counter()
    import ninja  # the PyPI package: its binary may not be on PATH when the venv is not activated

    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # -fopenmp: at::parallel_for is inline OpenMP in torch's CPU build, so without it the kernels
    # would run on one thread. The extension then binds to torch's own libgomp (same soname,
    # already loaded): one thread pool, not two competing for the cores. load() waits for another
    # process's build of the same name (its lock), then loads the library that one left.
    cpp_extension.load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=cflags(),  # copies: load() appends torch's own flags to the lists it gets,
        extra_ldflags=list(LDFLAGS),  # which would change `build_name` for the rest of the process
        build_directory=str(build_dir),
        is_python_module=False,
    )
    seconds = time.perf_counter() - start
    _mark_used(build_dir)
    if building_elsewhere:
        log.warning("waited %.0f s for another process to build hybridkv's C++ kernels", seconds)
    else:
        log.warning("built hybridkv's C++ kernels for this CPU in %.0f s (once: cached in %s)", seconds, build_dir)
        prune_stale_builds(build_dir.parent, keep=build_dir.name)


USED = "last-used"  # a build directory's marker, touched whenever a process loads its library
STALE_DAYS = 30


def _mark_used(build_dir: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache still loads
        (build_dir / USED).touch()


def prune_stale_builds(root: Path, keep: str, now: float | None = None) -> list[str]:
    """Remove the other hybridkv kernel builds under `root` that no process has loaded for
    STALE_DAYS (each source change leaves a new build of ~4 MB beside the old ones; other
    checkouts' builds in use stay). Run after a build; returns the names removed."""
    cutoff = (time.time() if now is None else now) - STALE_DAYS * 86400
    removed = []
    for d in sorted(root.glob("hybridkv_kernels_*")):
        if d.name == keep or not d.is_dir() or (d / "lock").exists():
            continue
        marker = d / USED
        try:
            used = (marker if marker.exists() else d).stat().st_mtime
        except OSError:
            continue
        if used < cutoff:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    if removed:
        log.info("removed %d hybridkv kernel builds unused for %d days from %s", len(removed), STALE_DAYS, root)
    return removed


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors: not disabled (HYBRIDKV_NATIVE=0 at start), built, on the
    CPU, and no autograd needed (the kernels have no backward; training runs the PyTorch twins)."""
    if disabled:
        return False
    for t in tensors:
        if t.requires_grad or not t.is_cpu:
            return False
    return kernels() is not None


def _ops() -> Any:
    ops = kernels()
    assert ops is not None, "check native.enabled() first"
    return ops


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ w [D, N] → [T, N] float32, for few rows (≲ 32): every row in one pass over w."""
    return _ops().rows_matmul(x, w)


def rows_matmul_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ w [N, D]ᵀ → [T, N] float32, for few rows: w's rows are read once, each against
    every row of x (`F.linear(x, w)` in float32)."""
    return _ops().rows_matmul_t(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · weight over the last dim (float32 math), in x's dtype: `F.rms_norm` in one call
    (on the CPU that is half a dozen ops)."""
    return _ops().rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, `rms_norm`(x + delta, weight, eps)) in one call: a decoder layer's residual add
    and the norm that follows it, the same numbers as the two ops."""
    total, normed = _ops().add_rms_norm(x, delta, weight, eps)
    return total, normed


def moe_combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A MoE layer's output Σ_j weights[t, j] · y[t·k + j] + sigmoid(gate[t]) · shared[t] from its
    pairs' products y [T·k, D], weights [T, k], shared [T, D] and gate [T, 1], float32: one pass,
    its rows split across threads (ATen's weighting ran on one thread)."""
    return _ops().moe_combine(y, weights, shared, gate)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up [T, 2I], gate columns first → [T, I] float32: one call instead
    of a chunk, a SiLU and a product (three ops and their buffers at every decode layer)."""
    return _ops().silu_mul(gate_up)


def moe_block(
    x: torch.Tensor,
    gate_in: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_down: torch.Tensor,
    top_k: int,
    norm_topk: bool,
) -> torch.Tensor:
    """`hybridkv.ops.moe.moe_block` in one call, float32 result: router, top-k, the gated shared
    expert, and the chosen experts, read once in place (no gather) when they have few rows, by MKL
    (float32) when they have many."""
    return _ops().moe_block(x, gate_in, gate_up, down, shared_down, top_k, norm_topk)


def gdn_forward(
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
    cu_seqlens: torch.Tensor,
    snapshot_at: torch.Tensor,
    snapshot_ids: torch.Tensor,
    tiled: bool = False,
) -> torch.Tensor:
    """A Gated DeltaNet mixer after in_proj over a packed batch (prefill or decode), the delta rule
    run token by token (on a CPU faster than the chunked form: a head's state stays in L1).

    mixed [T, C + Hv·dv + 2·Hv] = conv input q|k|v, then z, b, a; conv_weight [C, K]; A_log, dt_bias
    [Hv]; norm_weight [dv]; pools = (conv [slots, C, K-1], delta [slots, Hv, dk, dv], snap_conv,
    snap_delta), all float32; slots [N] and cu_seqlens [N+1] as in `ForwardBatch`. Updates
    conv[slots[n]] and delta[slots[n]] in place; the states after token snapshot_at[i] (ascending)
    go to row snapshot_ids[i] of the snapshot pools. Value head h reads key head h // (Hv/Hk), or
    h % Hk when `tiled` (llama.cpp's qwen35 order).
    Returns RMSNorm(o)·silu(z) [T, Hv·dv] float32, o being the delta rule's read-out.
    """
    conv, delta, snap_conv, snap_delta = pools
    return _ops().gdn_forward(
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
        cu_seqlens,
        snap_conv,
        snap_delta,
        snapshot_at,
        snapshot_ids,
        tiled,
    )


def attention_decode(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    H: int,
) -> torch.Tensor:
    """One gated-attention decode step after qkv_proj, token n being sequence n.

    qkv [T, (2H + 2Hkv)·hd] = q | gate | k | v; q_norm, k_norm [hd] (RMSNorm weights, float32);
    cos, sin [T, rd]; pools = (k_pool, v_pool) [num_blocks, block_size, Hkv, hd] (float32,
    bfloat16 or float16, whatever qkv's dtype). Writes each token's normalised, rotated key and
    its value at slot_mapping[n], then attends over the sequence's kv_lens[n] positions through
    block_tables[n], in place. Returns attention · sigmoid(gate) [T, H·hd] float32
    (`paged_attention`'s decode case, gated).
    """
    k_pool, v_pool = pools
    return _ops().attention_decode(
        qkv, q_norm, k_norm, eps, cos, sin, k_pool, v_pool, slot_mapping, block_tables, kv_lens, scale, H
    )


def decode_layer(
    x: torch.Tensor,
    normed: torch.Tensor,
    weights: list[torch.Tensor],
    plan: list[int],
    scalars: list[float],
    step: list[torch.Tensor],
    counts: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's step over few float32 rows in one call: mixer, residual add and post norm,
    then (unless the plan leaves it to the caller) the feed-forward, residual add and the next norm.
    The layer is `weights` and `plan` as `csrc/layer.cpp` describes them, built once by
    `DecoderLayer.native_plan`; `step` holds this step's cache tensors. The same kernels the
    layer's Python calls one op at a time, in the same order: the same numbers.

    With `counts`, every layer of a forward in one call (the `decode_layers` op): layer i reads the
    next counts[4i], counts[4i+1], counts[4i+2] and counts[4i+3] entries of weights, plan, scalars
    and step. Every plan is read and checked before any layer runs; each must run its feed-forward."""
    if counts is None:
        total, normed_out = _ops().decode_layer(x, normed, weights, plan, scalars, step)
    else:
        total, normed_out = _ops().decode_layers(x, normed, weights, plan, scalars, step, counts)
    return total, normed_out


def main() -> int:
    """Build (or find) the kernels now; 1 if they cannot be built (`make test` runs this first)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    if kernels() is None:
        return 1
    print(f"hybridkv C++ kernels ready in {time.perf_counter() - start:.1f} s")
    return 0
