"""The kept transformers reference (`tests.hf_reference`): where it lives and what its key covers.
Its content is checked by every test that compares against it (the reference tests load it and
would differ from the engine if it were not transformers' conversion)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_reference import _key, cache_root

pytestmark = pytest.mark.unit


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_TEST_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pdserve"
    monkeypatch.setenv("PDSERVE_TEST_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_the_key_is_the_files_bytes(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.gguf", "b.gguf", "c.gguf"))
    a.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    b.write_bytes(a.read_bytes())
    c.write_bytes(a.read_bytes()[:-1] + b"\x00")   # one byte differs, at the end
    assert _key(a) == _key(b) != _key(c)
    assert len(_key(Path(a))) == 20
