"""The chat smoke checks (qwen3-chat: TensorRT-LLM's trtllm-serve, OpenAI /v1/chat/completions).

TensorRT-LLM cannot run on these machines (its wheels come from NVIDIA's index, which is
unreachable, and the GPU machine has no Docker), so these tests run the check logic against a
STAND-IN: a small loopback server that speaks the OpenAI chat-completions shape. It stands in for
trtllm-serve only; what the checks decide is real."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from builder.smoke import chat_checks


def serve(reply):
    """reply(prompt, call_number) -> content (None: answer 500)."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][-1]["content"]
            calls.append(body)
            content = reply(prompt, len(calls))
            if content is None:
                self.send_response(500)
                self.end_headers()
                return
            data = json.dumps({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", calls


@pytest.fixture
def stand_in(request):
    servers = []

    def start(reply):
        server, base, calls = serve(reply)
        servers.append(server)
        return base, calls

    yield start
    for server in servers:
        server.shutdown()


def test_greedy_server_passes(stand_in):
    base, calls = stand_in(lambda prompt, n: f"Answer to {prompt}")
    assert chat_checks(base, ["What is the capital of France?", "2+2?"]) == {"completion": "ok",
                                                                            "deterministic": "ok"}
    assert all(c["temperature"] == 0 and c["max_tokens"] == 16 for c in calls) and len(calls) == 4


def test_empty_completion_fails(stand_in):
    base, _ = stand_in(lambda prompt, n: "   ")
    checks = chat_checks(base, ["hi"])
    assert "is empty" in checks["completion"] and checks["deterministic"].startswith("skipped")


def test_non_deterministic_server_fails(stand_in):
    base, _ = stand_in(lambda prompt, n: f"sample {n}")
    checks = chat_checks(base, ["hi"])
    assert checks["completion"] == "ok" and "differ" in checks["deterministic"]


def test_server_error_fails(stand_in):
    base, _ = stand_in(lambda prompt, n: None)
    assert "answered 500" in chat_checks(base, ["hi"])["completion"]
