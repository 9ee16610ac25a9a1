"""The engine help cache: `vllm serve --help=all` imports vLLM and torch (20-30 s of every converge on the lab),
so the engine role keeps the help of one exact engine install in a root-owned directory on the head."""

import os

import pytest

from llmfleet.engine import node as engine_node
from llmfleet.engine.command import PlanError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the cache trusts only root-owned files")


@pytest.fixture
def engine(tmp_path):
    """A fake engine that counts its --help runs."""
    exe = tmp_path / "bin" / "fakeengine"
    exe.parent.mkdir()
    exe.write_text(f'#!/bin/sh\necho run >> {tmp_path}/runs\necho "  --tp-size TP  tensor parallel size"\n')
    exe.chmod(0o755)
    tmp_path.chmod(0o755)
    return exe


def runs(exe):
    p = exe.parent.parent / "runs"
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_the_second_call_reads_the_cache(engine, tmp_path):
    cache = str(tmp_path / "cache")
    first = engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=cache, cache_key="v1")
    second = engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=cache, cache_key="v1")
    assert first == (second[0], False) and second[1] is True and "--tp-size" in second[0]
    assert runs(engine) == 1
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"


def test_a_new_version_or_reinstall_misses(engine, tmp_path):
    cache = str(tmp_path / "cache")
    engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=cache, cache_key="v1")
    assert engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=cache, cache_key="v2")[1] is False
    os.utime(engine, ns=(1, 1))  # the same version reinstalled: another mtime
    assert engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=cache, cache_key="v2")[1] is False
    assert engine_node.help_text([str(engine), "serve"], "vllm", 10, cache_dir=cache, cache_key="v2")[1] is False
    assert runs(engine) == 4


def test_no_cache_dir_always_runs(engine):
    assert engine_node.help_text([str(engine), "serve"], "sglang", 10)[1] is False
    assert engine_node.help_text([str(engine), "serve"], "sglang", 10)[1] is False
    assert runs(engine) == 2


def test_a_help_someone_else_could_write_is_not_trusted(engine, tmp_path):
    cache = tmp_path / "cache"
    engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=str(cache), cache_key="v1")
    (entry,) = [p for p in cache.iterdir() if p.name.startswith("help-")]
    entry.write_text("  --anything  planted\n")
    os.chown(entry, 1000, 1000)  # written by a user who is not root
    text, cached = engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=str(cache), cache_key="v1")
    assert cached is False and "planted" not in text
    cache.chmod(0o777)  # a directory anyone can change: nothing from it is trusted, nothing stored there
    assert engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=str(cache), cache_key="v1")[1] is False


def test_a_failed_help_is_never_cached(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(PlanError, match="check engine_command"):
        engine_node.help_text(["/bin/false"], "sglang", 10, cache_dir=str(cache), cache_key="v1")
    assert not cache.exists() or not list(cache.iterdir())


def test_old_entries_are_collected(engine, tmp_path):
    cache = tmp_path / "cache"
    for i in range(engine_node.HELP_CACHE_KEEP + 3):
        engine_node.help_text([str(engine), "serve"], "sglang", 10, cache_dir=str(cache), cache_key=f"v{i}")
    assert len([p for p in cache.iterdir() if p.name.startswith("help-")]) == engine_node.HELP_CACHE_KEEP
