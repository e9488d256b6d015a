"""tools.tokenizer, the client side of GET /api/v1/tokenizer, against a stand-in server: the
files land in `<dir>/<tokenizer_id>/` and load with transformers' AutoTokenizer; a name that
would escape --dir, an error answer or an unreachable service is one line and exit 2, with
nothing written. (The route itself, on a real service: test_service_sampling_sdk.py.)"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools import tokenizer

TOKENIZER_JSON = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2},
              "unk_token": "[UNK]"},
}  # fmt: skip


@pytest.fixture
def serve():
    """Start a server answering every GET with (status, body); yields a function -> url."""
    servers, keys = [], []

    def start(status: int, body: dict) -> str:
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                keys.append(self.headers.get("X-API-Key"))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    start.keys = keys  # type: ignore[attr-defined]
    yield start
    for s in servers:
        s.shutdown()


def _tool(tmp_path, url, key="tml-some-tenant-key-0123"):
    """(exit code, stderr) of `python -m tools.tokenizer --url URL --dir tmp/client`, run as
    `run(main)` exits (bad input: one line, exit 2)."""
    argv = ["--url", url, "--dir", str(tmp_path / "client")]
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_API_KEY", key)
    try:
        with pytest.raises(SystemExit) as e:
            tokenizer.run(lambda: tokenizer.main(argv))
    finally:
        mp.undo()
    return e.value.code


def test_files_land_under_the_id_and_load_with_autotokenizer(tmp_path, serve, capsys):
    from transformers import AutoTokenizer

    url = serve(200, {"tokenizer_id": "titanscale/debug",
                      "files": {"tokenizer.json": json.dumps(TOKENIZER_JSON),
                                "tokenizer_config.json": "{}", "evil.py": "x"}})  # fmt: skip
    assert _tool(tmp_path, url) == 0, capsys.readouterr().err
    assert serve.keys == ["tml-some-tenant-key-0123"]  # the tenant's key, as the SDK sends it
    folder = tmp_path / "client" / "titanscale" / "debug"
    assert sorted(f.name for f in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.encode("hello world", add_special_tokens=False) == [1, 2]


@pytest.mark.parametrize(
    "status,body,words",
    [
        (200, {"tokenizer_id": "../../escape", "files": {"tokenizer.json": "{}"}}, "unusable"),
        (200, {"tokenizer_id": "/etc/x", "files": {"tokenizer.json": "{}"}}, "unusable"),
        (200, {"tokenizer_id": "a/b", "files": {}}, "no tokenizer.json"),
        (404, {"detail": "tokenizer not found"}, "answered 404 tokenizer not found"),
        (401, {"detail": "unknown key"}, "answered 401"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(tmp_path, serve, status, body, words, capsys):
    code = _tool(tmp_path, serve(status, body))
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err
    assert not any((tmp_path / "client").rglob("*.json"))
    assert not (tmp_path / "escape").exists()


def test_no_key_and_no_service_are_one_line(tmp_path, capsys):
    assert _tool(tmp_path, "http://127.0.0.1:9", key="") == 2
    assert "TINKER_API_KEY" in capsys.readouterr().err
    assert _tool(tmp_path, "http://127.0.0.1:9") == 2
    assert "cannot reach the service" in capsys.readouterr().err
