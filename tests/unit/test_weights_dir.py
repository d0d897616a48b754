"""Where pushed weights go (sync.weights_dir): RAM only when every server can read this machine's
/dev/shm and it has room; the store or the given path otherwise."""

from __future__ import annotations

import os
import shutil

import pytest

from tasks.push import RAM_DIR, is_loopback, weights_root

pytestmark = pytest.mark.unit


def test_auto_is_ram_for_local_servers_with_room_and_the_store_otherwise(tmp_path):
    if not os.access(RAM_DIR, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    kw = {"keep_last": 2, "model_bytes": 1 << 20}
    path, ram = weights_root("auto", tmp_path, local_servers=True, **kw)
    assert ram and path.parent == RAM_DIR / f"grpoflow-{os.getuid()}"
    assert weights_root("auto", tmp_path / "other", local_servers=True, **kw)[0] != path  # per store
    assert weights_root("auto", tmp_path, local_servers=False, **kw) == (tmp_path, False)
    too_big = shutil.disk_usage(RAM_DIR).free
    assert weights_root("auto", tmp_path, local_servers=True, keep_last=2, model_bytes=too_big) == (
        tmp_path,
        False,
    )


def test_store_and_a_path_are_taken_as_given(tmp_path):
    kw = {"local_servers": True, "keep_last": 2, "model_bytes": 1}
    assert weights_root("store", tmp_path, **kw) == (tmp_path, False)
    assert weights_root(str(tmp_path / "w"), tmp_path, **kw) == (tmp_path / "w", False)


def test_loopback_urls():
    assert (
        is_loopback("http://127.0.0.1:8000")
        and is_loopback("http://localhost:1")
        and is_loopback("http://[::1]:9")
    )
    assert not is_loopback("http://10.0.0.5:8000") and not is_loopback("http://gpu1:8000")
