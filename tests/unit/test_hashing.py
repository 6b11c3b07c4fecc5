"""builder/hashing.py: the digests stage keys, locks and bundles rely on."""
from __future__ import annotations

import hashlib
import io

from builder import hashing


def test_file_stream_and_bytes_digests_agree(tmp_path, monkeypatch):
    data = bytes(range(256)) * 40_000  # 10 MB: more than one read chunk
    path = tmp_path / "blob"
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    reads = []

    class Counting(io.BytesIO):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    assert hashing.sha256_file(path) == expected
    assert hashing.sha256_stream(Counting(data)) == expected
    assert reads and all(size == hashing.CHUNK for size in reads) and len(reads) == -(-len(data) // hashing.CHUNK) + 1
    assert hashing.sha256_bytes(data) == expected
    assert hashing.sha256_bytes(b"") == hashlib.sha256(b"").hexdigest()


def test_text_digest_separates_parts():
    assert hashing.sha256_text("ab", "c") != hashing.sha256_text("a", "bc")
    assert hashing.sha256_text("a") == hashlib.sha256(b"a\0").hexdigest()


def test_dump_json_is_canonical():
    assert hashing.dump_json({"b": 1, "a": ["é"]}) == '{\n  "a": [\n    "é"\n  ],\n  "b": 1\n}\n'


def test_tree_sha256_lists_each_file_and_tree_digest_builds_on_it(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"bee")
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / ".hidden").write_bytes(b"skipped")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"skipped")
    files = hashing.tree_sha256(tmp_path)
    assert list(files.items()) == [("a.json", hashlib.sha256(b"{}").hexdigest()),
                                   ("sub/b.txt", hashlib.sha256(b"bee").hexdigest())]
    assert hashing.tree_sha256(tmp_path, "*.json") == {"a.json": hashlib.sha256(b"{}").hexdigest()}
    expected = hashlib.sha256()
    for name, data in (("a.json", b"{}"), ("sub/b.txt", b"bee")):
        expected.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    assert hashing.tree_digest(tmp_path) == expected.hexdigest()
