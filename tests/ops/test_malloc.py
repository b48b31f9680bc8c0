"""glibc keeps freed activation buffers for reuse (`ops.malloc`), unless the user chose thresholds."""

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, torch
from hybridkv.ops.malloc import keep_freed_memory
print(keep_freed_memory())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(4 << 20).fill_(1.0)  # 16 MiB, written and freed: once
before = faults()
for _ in range(40):
    torch.empty(4 << 20).fill_(1.0)
print(faults() - before)
"""


def _probe(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_buffer_is_reused_without_faulting_its_pages_in_again() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    kept, faults = _probe(env)
    assert kept
    # 40 more 16 MiB buffers (4,096 pages each): a few faulted in while the heap settles (1-3
    # measured), not one per buffer.
    assert faults < 10 * 4096, faults
    # glibc's own variables win, and then each buffer is mapped and faulted in afresh.
    kept, faults = _probe({**env, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert not kept
    assert faults > 30 * 4096, faults
