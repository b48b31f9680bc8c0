"""Where the C++ kernels' build is cached: by what the sources are, not where they lie."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from hybridkv.ops import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")

PACKAGE = Path(native.__file__).parents[1]
LOAD = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
    "from hybridkv.ops import native; sys.exit(native.kernels() is None)"
)


def _checkout(root: Path) -> Path:
    """A second checkout of this source tree (the package without its model) at another path."""
    shutil.copytree(PACKAGE, root / "hybridkv", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    return root


def _load_in(checkout: Path, extensions: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "TORCH_EXTENSIONS_DIR": str(extensions)}
    return subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=600)


def test_the_name_follows_the_sources_bytes_not_their_path(tmp_path: Path) -> None:
    copy = shutil.copytree(native.SOURCE.parent, tmp_path / "elsewhere" / "csrc")
    sources = sorted(copy.glob("*.cpp"))
    assert native.build_name(sources) == native.build_name()
    with open(sources[0], "a") as f:
        f.write("\n// one more line\n")
    assert native.build_name(sources) != native.build_name()


def test_a_second_checkout_loads_the_library_the_first_built_without_building(tmp_path: Path) -> None:
    name = native.build_name()
    built = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}{cpp_extension.LIB_EXT}"
    extensions = tmp_path / "torch_extensions"
    (extensions / name).mkdir(parents=True)
    library = Path(shutil.copy2(built, extensions / name))
    mtime = library.stat().st_mtime_ns

    result = _load_in(_checkout(tmp_path / "checkout2"), extensions)

    assert result.returncode == 0, result.stderr
    assert "build" not in result.stderr, result.stderr  # neither "building" nor "built"
    assert library.stat().st_mtime_ns == mtime
    # no ninja file, no objects: the library and the mark of its use
    assert sorted(p.name for p in (extensions / name).iterdir()) == sorted([library.name, native.USED])


@pytest.mark.slow
def test_a_build_is_announced_once_then_loads_silently(tmp_path: Path) -> None:
    checkout, extensions = _checkout(tmp_path / "checkout"), tmp_path / "torch_extensions"
    first = _load_in(checkout, extensions)
    assert first.returncode == 0, first.stderr
    assert "built hybridkv's C++ kernels for this CPU" in first.stderr
    second = _load_in(_checkout(tmp_path / "other"), extensions)
    assert second.returncode == 0, second.stderr
    assert "built" not in second.stderr


def test_a_build_leaves_the_name_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cpp_extension.load appends torch's link flags to the lists it is given: the build must not
    hand it the ones the name is made of (a later `build_name` in the process would differ, and a
    second checkout would look for a library that is not there)."""
    name = native.build_name()

    def load(**kwargs: object) -> None:  # what cpp_extension.load does to its arguments
        for key in ("extra_cflags", "extra_ldflags"):
            flags = kwargs[key]
            assert isinstance(flags, list)
            flags.append("-ltorch")

    build_dir = tmp_path / "hybridkv_kernels_x"  # its parent, where the build prunes, holds nothing else
    build_dir.mkdir()
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda *args, **kwargs: str(build_dir))
    monkeypatch.setattr(cpp_extension, "load", load)
    native._load()
    assert native.build_name() == name


def test_stale_builds_are_pruned_and_used_or_locked_ones_kept(tmp_path: Path) -> None:
    now = 1_000_000_000.0
    day = 86400.0

    def build(name: str, used_days_ago: float | None, lock: bool = False) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / f"{name}.so").write_bytes(b"\0")
        if used_days_ago is not None:
            (d / native.USED).touch()
            os.utime(d / native.USED, (now - used_days_ago * day,) * 2)
        if lock:
            (d / "lock").touch()
        os.utime(d, (now - 90 * day,) * 2)  # built long ago
        return d

    build("hybridkv_kernels_new_x", None)  # the build just made (kept by name)
    build("hybridkv_kernels_recent_x", 2)  # another checkout's, loaded two days ago
    build("hybridkv_kernels_stale_x", 45)
    build("hybridkv_kernels_unmarked_x", None)  # from before the marker: its build time counts
    build("hybridkv_kernels_building_x", 45, lock=True)  # a build under way
    build("other_extension", 45)

    removed = native.prune_stale_builds(tmp_path, keep="hybridkv_kernels_new_x", now=now)

    assert removed == ["hybridkv_kernels_stale_x", "hybridkv_kernels_unmarked_x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hybridkv_kernels_building_x",
        "hybridkv_kernels_new_x",
        "hybridkv_kernels_recent_x",
        "other_extension",
    ]
