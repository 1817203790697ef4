"""shared/storage.py on local paths and on a real S3 server (SeaweedFS on loopback, see tests/conftest.py).

Most tests take the `root` fixture, which runs them once under a local temp folder and once under a fresh
`s3://` prefix, so both backends are held to the same behaviour.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shared import storage

LARGE_SIZE = 1 << 20  # big enough that open_read must hand it over in several chunks
CHUNK = 64 << 10


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A folder URI nothing else writes under: local temp dir or S3 prefix."""
    if request.param == "s3":
        return request.getfixturevalue("s3_prefix")
    return str(tmp_path / "store")


def write_tree(root: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        storage.write_bytes(storage.join(root, rel), data)


# ----------------------------------------------------------------------------------------- URI helpers
def test_split_s3_and_is_s3() -> None:
    assert storage.split_s3("s3://bucket/a/b.tar") == ("bucket", "a/b.tar")
    assert storage.split_s3("s3://bucket") == ("bucket", "")
    assert storage.is_s3("s3://bucket/x") and not storage.is_s3("/data/s3://x")
    for bad in ("s3://", "/local/path", "http://host/key"):
        with pytest.raises(storage.StorageError, match="expected s3://bucket/prefix"):
            storage.split_s3(bad)


def test_join_and_relpath() -> None:
    assert storage.join("s3://b/root/", "/a/", "b.txt") == "s3://b/root/a/b.txt"
    assert storage.join("/data/root", "a", "b.txt") == os.path.join("/data/root", "a", "b.txt")
    assert storage.relpath("s3://b/root/a/b.txt", "s3://b/root") == "a/b.txt"
    assert storage.relpath("/data/root/a/b.txt", "/data/root") == os.path.join("a", "b.txt")
    with pytest.raises(storage.StorageError, match="is not under"):
        storage.relpath("s3://b/other/x", "s3://b/root")


# ---------------------------------------------------------------------------------------- read / write
def test_write_and_read_bytes_and_json(root: str) -> None:
    blob = storage.join(root, "nested/dir/blob.bin")
    storage.write_bytes(blob, b"\x00\x01binary\xff")
    assert storage.read_bytes(blob) == b"\x00\x01binary\xff"
    storage.write_bytes(blob, b"replaced")
    assert storage.read_bytes(blob) == b"replaced"

    doc = storage.join(root, "doc.json")
    obj = {"caption": "ünïcödé 東京", "sizes": [256, 512], "nested": {"ok": True, "none": None}}
    storage.write_json(doc, obj)
    assert storage.read_json(doc) == obj
    assert storage.read_bytes(doc).endswith(b"\n")


def test_iter_lines(root: str) -> None:
    uri = storage.join(root, "lines.txt")
    storage.write_bytes(uri, "first\nsecond ü\n\nlast".encode())
    assert list(storage.iter_lines(uri)) == ["first", "second ü", "", "last"]


def test_local_write_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "out" / "manifest.json"
    for i in range(5):
        storage.write_json(str(target), {"version": i})
    assert [p.name for p in target.parent.iterdir()] == ["manifest.json"]
    assert storage.read_json(str(target)) == {"version": 4}


def test_local_write_that_fails_keeps_the_old_file_and_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    storage.write_bytes(str(target), b"old")
    with pytest.raises(TypeError):
        storage.write_bytes(str(target), "not bytes")  # type: ignore[arg-type]  # fails mid-write
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_local_write_gets_the_usual_file_mode(tmp_path: Path) -> None:
    """Outputs are shared with other readers: the temp file's private 0600 must not leak through."""
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    written = tmp_path / "written"
    storage.write_bytes(str(written), b"x")
    assert oct(written.stat().st_mode & 0o777) == oct(plain.stat().st_mode & 0o777)


def test_exists_and_delete(root: str) -> None:
    uri = storage.join(root, "a/file.txt")
    assert not storage.exists(uri)
    storage.write_bytes(uri, b"x")
    assert storage.exists(uri)
    storage.delete(uri)
    assert not storage.exists(uri)
    storage.delete(uri)  # deleting what is gone is not an error


def test_missing_file_errors_name_the_uri(root: str) -> None:
    missing = storage.join(root, "no/such/file.json")
    for call in (storage.read_bytes, storage.read_json, storage.stat, storage.open_read):
        with pytest.raises(FileNotFoundError, match=re.escape(f"{missing} does not exist")):
            call(missing)


# ------------------------------------------------------------------------------------- listing / stat
def test_list_files_is_recursive_and_sorted(root: str) -> None:
    files = {"b.txt": b"bb", "a/c.txt": b"c", "a/b/d.txt": b"dddd", "a0.txt": b""}
    write_tree(root, files)
    storage.write_bytes(f"{root}-sibling/x.txt", b"not under root")  # same string prefix, other folder

    listed = storage.list_files(root)
    uris = [info.uri for info in listed]
    assert uris == sorted(uris)
    assert sorted(storage.relpath(u, root).replace(os.sep, "/") for u in uris) == sorted(files)
    assert {storage.relpath(i.uri, root).replace(os.sep, "/"): i.size for i in listed} == {
        rel: len(data) for rel, data in files.items()
    }
    sub = storage.join(root, "a", "b")
    assert [storage.relpath(i.uri, sub) for i in storage.list_files(sub)] == ["d.txt"]


def test_list_files_of_a_missing_folder_is_empty(root: str) -> None:
    assert storage.list_files(storage.join(root, "nothing-here")) == []


def test_stat_size_and_version_change_when_replaced(root: str) -> None:
    uri = storage.join(root, "shard.tar")
    storage.write_bytes(uri, b"first version")
    before = storage.stat(uri)
    assert before.uri == uri and before.size == len(b"first version") and before.version
    storage.write_bytes(uri, b"other version")  # same size, new content
    after = storage.stat(uri)
    assert after.size == before.size
    assert after.version != before.version
    assert [i.version for i in storage.list_files(root)] == [after.version]


def test_open_read_streams_in_chunks(root: str) -> None:
    data = os.urandom(LARGE_SIZE)
    uri = storage.join(root, "large.bin")
    storage.write_bytes(uri, data)
    chunks = []
    with storage.open_read(uri) as stream:
        while chunk := stream.read(CHUNK):
            assert len(chunk) <= CHUNK
            chunks.append(chunk)
    assert len(chunks) >= LARGE_SIZE // CHUNK
    assert b"".join(chunks) == data


# ------------------------------------------------------------------------------------------ trees
def test_delete_tree_removes_only_that_folder(root: str) -> None:
    write_tree(root, {"tree/a.txt": b"a", "tree/sub/b.txt": b"b", "tree-keep/c.txt": b"c"})
    storage.delete_tree(storage.join(root, "tree"))
    assert storage.list_files(storage.join(root, "tree")) == []
    assert [storage.relpath(i.uri, root).replace(os.sep, "/") for i in storage.list_files(root)] == [
        "tree-keep/c.txt"
    ]
    storage.delete_tree(storage.join(root, "tree"))  # already gone: fine


def make_local_tree(folder: Path) -> dict[str, bytes]:
    files = {"index.json": b"{}", "shard.00000.mds": os.urandom(2048), "sub/deep/x.bin": b"x"}
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return files


def read_local_tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_upload_dir_and_download_dir_round_trip(root: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_local_tree(src)
    dest = storage.join(root, "published")
    storage.upload_dir(src, dest)
    if not storage.is_s3(root):
        assert not src.exists()  # local publishing is one rename of the finished folder
    got = storage.download_dir(dest, tmp_path / "down")
    assert got == tmp_path / "down"
    assert read_local_tree(got) == files


def test_upload_dir_local_replaces_a_leftover(tmp_path: Path) -> None:
    target = tmp_path / "out" / "part-0"
    (target / "stale").mkdir(parents=True)
    (target / "stale" / "old.mds").write_bytes(b"old")
    files = make_local_tree(tmp_path / "src")
    storage.upload_dir(tmp_path / "src", str(target))
    assert read_local_tree(target) == files


def _other_filesystem_dir(tmp_path: Path) -> Path | None:
    """A writable folder on another filesystem than `tmp_path` (tmpfs /dev/shm on most Linux boxes)."""
    for candidate in (Path("/dev/shm"), Path("/run/user") / str(os.getuid())):
        writable = candidate.is_dir() and os.access(candidate, os.W_OK)
        if writable and candidate.stat().st_dev != tmp_path.stat().st_dev:
            return candidate
    return None


def test_upload_dir_local_across_filesystems(tmp_path: Path) -> None:
    other = _other_filesystem_dir(tmp_path)
    if other is None:
        pytest.skip("no writable folder on a second filesystem to move a directory across")
    src = other / f"sd-pretrain-test-{os.getpid()}-{tmp_path.name}"
    try:
        files = make_local_tree(src)
        storage.upload_dir(src, str(tmp_path / "out" / "part-0"))
        assert read_local_tree(tmp_path / "out" / "part-0") == files
        assert not src.exists()
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["part-0"]  # no staging left behind
    finally:
        storage.shutil.rmtree(src, ignore_errors=True)


# -------------------------------------------------------------------------------------- patterns
def test_expand_braces_keeps_zero_padding() -> None:
    assert storage.expand_braces("s3://b/{00000..00002}.tar") == [
        "s3://b/00000.tar",
        "s3://b/00001.tar",
        "s3://b/00002.tar",
    ]
    assert storage.expand_braces("{8..11}.tar") == ["8.tar", "9.tar", "10.tar", "11.tar"]
    assert storage.expand_braces("{0..2}") == ["0", "1", "2"]
    assert storage.expand_braces("{98..0100}")[:2] == ["0098", "0099"]  # bash: either end padded pads all
    assert storage.expand_braces("{7..7}.tar") == ["7.tar"]
    assert storage.expand_braces("plain.tar") == ["plain.tar"]


def test_expand_braces_with_several_ranges() -> None:
    assert storage.expand_braces("part{0..1}/{000..002}.tar") == [
        "part0/000.tar",
        "part0/001.tar",
        "part0/002.tar",
        "part1/000.tar",
        "part1/001.tar",
        "part1/002.tar",
    ]


def test_expand_braces_backwards_range_is_an_error() -> None:
    with pytest.raises(storage.StorageError, match=r"\{5\.\.2\}.*runs backwards"):
        storage.expand_braces("x/{5..2}.tar")


def test_expand_pattern_globs(root: str) -> None:
    names = ["00000.tar", "00001.tar", "00002.tar", "00003.tar", "notes.txt", "old/00009.tar"]
    write_tree(storage.join(root, "shards"), dict.fromkeys(names, b"x"))
    shards = storage.join(root, "shards")

    def expand(pattern: str) -> list[str]:
        return [storage.relpath(u, shards).replace(os.sep, "/") for u in storage.expand_pattern(pattern)]

    # `*` stays within one folder level, as in a shell: old/00009.tar is not matched
    assert expand(storage.join(shards, "*.tar")) == ["00000.tar", "00001.tar", "00002.tar", "00003.tar"]
    assert expand(storage.join(shards, "0000[13].tar")) == ["00001.tar", "00003.tar"]
    assert expand(storage.join(shards, "0000?.t*")) == ["00000.tar", "00001.tar", "00002.tar", "00003.tar"]
    assert expand(storage.join(shards, "*/*.tar")) == ["old/00009.tar"]
    assert expand(storage.join(shards, "{00001..00002}*")) == ["00001.tar", "00002.tar"]
    assert expand(storage.join(shards, "*.parquet")) == []


def test_expand_pattern_brace_ranges_name_files_that_may_be_missing(root: str) -> None:
    """Missing members are reported when opened, so one missing shard does not hide the others."""
    storage.write_bytes(storage.join(root, "00000.tar"), b"x")
    got = storage.expand_pattern(storage.join(root, "{00000..00001}.tar"))
    assert got == [storage.join(root, "00000.tar"), storage.join(root, "00001.tar")]


def test_expand_pattern_local_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_tree("data", {"a.tar": b"x", "b.tar": b"x", "c.txt": b"x"})
    assert storage.expand_pattern("data/*.tar") == ["data/a.tar", "data/b.tar"]
    assert storage.expand_pattern("./data/*.tar") == ["data/a.tar", "data/b.tar"]
    assert storage.expand_pattern("data//[ab].tar") == ["data/a.tar", "data/b.tar"]


# ------------------------------------------------------------------------------------------ S3 only
@pytest.mark.s3
def test_fixture_points_boto3_and_env_at_the_test_server(s3_server, s3_prefix: str) -> None:
    assert os.environ["S3_ENDPOINT_URL"] == s3_server.endpoint
    bucket, key = storage.split_s3(s3_prefix)
    assert bucket == s3_server.bucket and key.startswith("test_fixture_points")
    assert storage.s3_client().meta.endpoint_url == s3_server.endpoint


@pytest.fixture
def wrong_s3_credentials(s3_server, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-known-key")
    storage._client.cache_clear()
    yield
    monkeypatch.undo()
    storage._client.cache_clear()


@pytest.mark.s3
def test_wrong_credentials_give_an_error_naming_the_fix(s3_prefix: str, wrong_s3_credentials) -> None:
    """The server verifies signatures (identities file), so a bad key fails with a message that helps."""
    uri = storage.join(s3_prefix, "x.json")
    for call in (lambda: storage.write_bytes(uri, b"x"), lambda: storage.read_bytes(uri)):
        with pytest.raises(storage.StorageError, match=r"AWS_ACCESS_KEY_ID.*S3_ENDPOINT_URL") as info:
            call()
        assert not info.value.transient  # a setting to fix: no restart gets past it


@pytest.mark.s3
def test_missing_bucket_is_a_storage_error(s3_server) -> None:
    with pytest.raises(storage.StorageError, match="no-such-bucket-here"):
        storage.read_bytes("s3://no-such-bucket-here/key.json")
    with pytest.raises(storage.StorageError, match="no-such-bucket-here"):
        storage.list_files("s3://no-such-bucket-here/prefix")


def test_an_outage_is_transient_and_a_refusal_is_not() -> None:
    """After the retries, an outage may be over by a restart from the last checkpoint (the supervisor's);
    a refusal is a setting to fix (train records it fatal)."""
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    def answered(status: int, code: str) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
        )

    outages = [
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
        answered(503, "SlowDown"),
        answered(500, "InternalError"),
        answered(400, "RequestTimeout"),
    ]
    refusals = [
        answered(403, "AccessDenied"),
        answered(404, "NoSuchBucket"),
        answered(403, "InvalidAccessKeyId"),
    ]
    assert [storage.s3_error(err, "s3://b/k").transient for err in outages] == [True] * len(outages)
    assert [storage.s3_error(err, "s3://b/k").transient for err in refusals] == [False] * len(refusals)
