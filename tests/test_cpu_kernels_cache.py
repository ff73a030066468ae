"""``reprules.testing.cpu_kernels``: where the compiled library is cached, pruning, unwritable caches."""

import os
import pathlib
import time

import pytest

from reprules.testing import cpu_kernels


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("REPRULES_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return monkeypatch


def test_cache_dir_order(env, tmp_path):
    assert cpu_kernels.cache_dir() == pathlib.Path.home() / ".cache" / "reprules"
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_kernels.cache_dir() == tmp_path / "xdg" / "reprules"
    env.setenv("REPRULES_CACHE", str(tmp_path / "mine"))
    assert cpu_kernels.cache_dir() == tmp_path / "mine"  # REPRULES_CACHE wins


def test_relative_xdg_cache_home_is_ignored(env):
    env.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid per the XDG specification
    assert cpu_kernels.cache_dir() == pathlib.Path.home() / ".cache" / "reprules"


def _touch(path, days_ago):
    path.write_bytes(b"")
    t = time.time() - days_ago * 86400
    os.utime(path, (t, t))


def test_prune_deletes_only_libraries_unused_for_30_days(tmp_path):
    old, recent, keep = (tmp_path / f"libreprules_cpu_{n}.so" for n in ("old", "recent", "keep"))
    other = tmp_path / "something_else.so"
    _touch(old, 31)
    _touch(recent, 29)
    _touch(keep, 365)  # the one just built or loaded is never pruned
    _touch(other, 365)  # not ours
    assert cpu_kernels.prune(tmp_path, keep=keep) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([recent.name, keep.name, other.name])


def test_unwritable_cache_is_a_clear_error(env, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    env.setenv("REPRULES_CACHE", str(blocker / "cache"))
    env.setattr(cpu_kernels, "_loaded", False)
    with pytest.raises(cpu_kernels.KernelBuildError,
                       match=r"(?s)the cache directory '.*a_file/cache' cannot be written \(.*Error: .*\)\.\n"
                             r"Why: the C\+\+ library is compiled once per jaxlib version.*\n"
                             r"Fix: set REPRULES_CACHE \(or XDG_CACHE_HOME\) to a writable directory"):
        cpu_kernels.load()
    assert not cpu_kernels._loaded


@pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason=str(cpu_kernels.unavailable_reason()))
def test_build_into_the_xdg_cache_prunes_stale_libraries(env, tmp_path):
    env.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "reprules"
    cache.mkdir()
    stale = cache / "libreprules_cpu_0123456789abcdef.so"
    _touch(stale, 40)
    path = cpu_kernels._library_path()
    assert path.parent == cache
    cpu_kernels._build(path)
    assert path.exists() and not stale.exists()
    assert [p.name for p in cache.iterdir()] == [path.name]  # no build directory left behind
