"""The viewer on an index written by someone else: a chunk name that is no file of the tree folder (``..``, ``.``, a
folder, a path) is never opened; the data route answers 4xx for it, never a 500."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from arpo_algo.eval.trees import INDEX, TreeReader, start_folder
from serve.viewer import build_app

KEY = "viewer-paths-key-0123456789"


def _folder(tmp_path, chunk: str):
    folder = start_folder(tmp_path / "trees")
    (folder / "sub").mkdir()
    row = {"iteration": 1, "chunk": chunk, "groups": [{"offset": 0, "length": 2}]}
    (folder / INDEX).write_text(json.dumps(row) + "\n")
    return folder


def test_a_chunk_name_that_is_no_file_is_not_read(tmp_path):
    for chunk in ("..", ".", "sub", "/etc/passwd", "../trees/sub"):
        folder = _folder(tmp_path / chunk.replace("/", "_").replace(".", "d"), chunk)
        assert TreeReader(folder).refresh() == [], chunk


def test_the_viewer_answers_4xx_for_a_dotdot_chunk(tmp_path):
    port = 8123
    client = TestClient(build_app(_folder(tmp_path, ".."), KEY, port=port), base_url=f"http://127.0.0.1:{port}")
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/v1/index", headers=auth).json()["rows"] == []
    r = client.get("/v1/group?iteration=1&group=0", headers=auth)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
