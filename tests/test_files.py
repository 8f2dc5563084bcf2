"""The one checked open (packers.files): regular files only, bounded size, bounded JSON depth, one-line messages."""

from __future__ import annotations

import io
import os
import threading

import pytest

from packers import PackstreamError
from packers.files import MAX_JSON_DEPTH, load_json, open_checked, read_checked, show_path, value_depth


def test_regular_file_reads(tmp_path):
    p = tmp_path / "m.json"
    p.write_bytes(b'{"a": 1}')
    assert read_checked(str(p), what="manifest.json", limit=100) == b'{"a": 1}'
    with open_checked(str(p), what="input") as f:
        assert f.read() == b'{"a": 1}'


def test_file_url_is_local(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b"[]")
    assert read_checked(f"file://{p}", what="input", limit=10) == b"[]"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    done = []

    def attempt():
        with pytest.raises(PackstreamError, match="FIFO"):
            read_checked(str(fifo), what="manifest.json", limit=100)
        done.append(True)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    assert done, "opening a FIFO blocked"


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_link_to_a_device_is_refused(tmp_path):
    link = tmp_path / "rejected.jsonl"
    link.symlink_to("/dev/zero")
    with pytest.raises(PackstreamError, match="is a device"):
        read_checked(str(link), what="rejected.jsonl", limit=1 << 20)
    with pytest.raises(PackstreamError, match="is a device"):
        open_checked(str(link), what="input")


def test_folder_and_missing(tmp_path):
    with pytest.raises(PackstreamError, match="is a folder"):
        read_checked(str(tmp_path), what="--config file", limit=10)
    with pytest.raises(PackstreamError, match="cannot read --config file .*No such file"):
        read_checked(str(tmp_path / "nope.yaml"), what="--config file", limit=10)


def test_size_cap_before_reading(tmp_path):
    p = tmp_path / "big.json"
    p.write_bytes(b" " * 2048)
    with pytest.raises(PackstreamError, match=r"2 KiB, more than the 1 KiB a manifest.json may hold; re-run pack"):
        read_checked(str(p), what="manifest.json", limit=1024, fix="re-run pack")


def test_size_cap_on_a_stream_that_lies(tmp_path):
    """A remote object is read through an opener: at most limit + 1 bytes, whatever it claims."""
    data = b"x" * 5000
    reads = []

    class Stream(io.BytesIO):
        def read(self, n=-1):
            reads.append(n)
            return super().read(n)

    with pytest.raises(PackstreamError, match="holds more than the 1 KiB"):
        read_checked("gs://bucket/manifest.json", what="manifest.json", limit=1024, opener=lambda p: Stream(data))
    assert reads == [1025]


def test_remote_without_opener(tmp_path):
    with pytest.raises(PackstreamError, match="remote paths"):
        read_checked("s3://b/k", what="input", limit=1)


def test_newline_in_a_name_stays_on_one_line(tmp_path):
    bad = tmp_path / "a\nb.json"
    with pytest.raises(PackstreamError) as e:
        read_checked(str(bad), what="manifest.json", limit=10)
    assert "\n" not in str(e.value)
    assert show_path("plain/path.json") == "plain/path.json"


@pytest.mark.parametrize("data, match", [
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested deeper than 512"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 512"),  # past Python's own recursion limit
    (b'{"n": 1' + b"0" * 5000 + b"}", "cannot be read"),  # more digits than int() converts
    (b"\xff\xfe", "not UTF-8"),
    (b'{"a": ', "not valid JSON"),
])
def test_json_failures_are_one_line(data, match):
    with pytest.raises(PackstreamError, match=match) as e:
        load_json(data, what="manifest.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("manifest.json: ")


def test_json_at_the_depth_limit_loads():
    v = load_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, what="x")
    assert value_depth(v) == MAX_JSON_DEPTH
    assert load_json("\ufeff{}".encode(), what="x") == {}
