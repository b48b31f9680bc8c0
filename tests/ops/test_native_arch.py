"""The C++ kernels built for other classes of CPU (HYBRIDKV_ARCH) pass the block kernels' tests and
the Gated DeltaNet kernel's (8-lane vectors there): code paths this machine's own build never takes
(AVX2 without AVX-512 or VNNI; VNNI on 256-bit vectors only), each a library of its own, built and
tested in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.ops import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")

OPS = Path(__file__).parent
KERNEL_TESTS = [str(OPS / name) for name in ("test_quant.py", "test_quant_k.py", "test_claimed_rows.py")] + [
    f"{OPS / 'test_native.py'}::test_gdn_forward_equals_pytorch_path_and_updates_slots_and_snapshots",
    f"{OPS / 'test_native.py'}::test_attention_decode_equals_pytorch_step",  # 8-lane score tiles there
]
# target flags -> the /proc/cpuinfo flags this machine needs to run what they build
ARCHES = {
    "-march=x86-64-v3": {"avx2", "fma", "f16c", "bmi2"},
    "-march=x86-64-v3 -mavx512f -mavx512vl -mavx512vnni": {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni"},
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@pytest.mark.parametrize("arch", list(ARCHES), ids=["avx2", "vnni256"])
def test_block_kernels_built_for_another_cpu_class_pass_their_tests(arch: str) -> None:
    if missing := ARCHES[arch] - _cpu_flags():
        pytest.skip(f"this CPU cannot run a build for {arch!r}: no {', '.join(sorted(missing))}")
    env = {**os.environ, native.ARCH_ENV: arch}

    def python(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)

    build = python("-c", "import sys; from hybridkv.ops import native; sys.exit(native.main())")
    assert build.returncode == 0, build.stderr[-3000:]
    name = python("-c", "from hybridkv.ops import native; print(native.build_name())")
    assert name.stdout.strip() != native.build_name()  # its own library, not this machine's
    tests = python("-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and " skipped" not in tests.stdout.splitlines()[-1], tests.stdout[-500:]


def test_a_bad_arch_is_an_error_naming_the_variable() -> None:
    assert native.arch_flags("") == ["-march=native"]
    assert native.arch_flags("-march=x86-64-v3 -mavx512vnni") == ["-march=x86-64-v3", "-mavx512vnni"]
    with pytest.raises(ValueError, match="HYBRIDKV_ARCH takes compiler target flags .* got '-O0'"):
        native.arch_flags("-march=x86-64-v3 -O0")
