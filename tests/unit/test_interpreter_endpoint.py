"""`Endpoint` against a tiny in-test server that fakes the native protocol with a MockBackend."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from plait.interpreter import BackendError, MockBackend
from plait.interpreter.backends.http import Endpoint
from plait.lang import assistant, gen, program, select, user

SMOLLM_LIKE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n'}}{% endfor %}"
)


def make_handler(backend: MockBackend, model_info: dict[str, Any]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def reply(self, code: int, body: Any, content_type: str = "application/json") -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/get_model_info":
                self.reply(200, model_info)
            else:
                self.reply(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"{}")
            if self.path == "/flush_cache":
                self.reply(200, "Cache flushed.", "text/plain")
            elif self.path == "/abort_request":
                backend.abort(body["rid"])
                self.reply(200, {})
            elif self.path != "/generate":
                self.reply(404, {"error": {"message": "not found"}})
            elif body["sampling_params"].get("temperature") == -1:
                self.reply(400, {"error": {"message": "temperature: must be in [0.0, 100.0]"}})
            elif body.get("stream"):
                self.stream(
                    backend.generate_stream(
                        body["text"], body["sampling_params"], rid=body.get("rid")
                    )
                )
            else:
                options = {
                    k: body[k]
                    for k in (
                        "return_logprob",
                        "logprob_start_len",
                        "top_logprobs_num",
                        "return_text_in_logprobs",
                        "rid",
                    )
                    if k in body
                }
                self.reply(200, backend.generate(body["text"], body["sampling_params"], **options))

        def stream(self, chunks: Iterator[dict[str, Any]]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def server():
    servers = []

    def start(backend: MockBackend, **model_info: Any) -> str:
        httpd = ThreadingHTTPServer(
            ("127.0.0.1", 0), make_handler(backend, {"model_path": "fake", **model_info})
        )
        threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


@program
def quiz(s):
    s += user("Capital of France?")
    s += assistant("It is" + select("city", [" Paris", " Rome"]) + ". " + gen("why", max_tokens=8))


def test_programs_run_against_an_endpoint(server):
    mock = MockBackend("Because.", scorer=lambda ctx, tok: 0.0 if "Paris" in tok else -5.0)
    endpoint = Endpoint(server(mock))
    assert endpoint.model_info["model_path"] == "fake"
    state = quiz.run(backend=endpoint)
    assert state["city"] == " Paris" and state["why"] == "Because."
    assert state.text() == (
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nIt is Paris. Because.<|im_end|>\n"
    )
    # like SGLang's frontend: a prefill-only call for the prompt length, then one scoring call
    count, score, generate = mock.calls
    assert count.is_prefill_only and not count.return_logprob
    assert score.return_logprob and len(score.text) == 2
    assert generate.sampling_params == {"max_new_tokens": 8}


def test_streaming_over_sse(server):
    endpoint = Endpoint(server(MockBackend("one two three four")))
    state = quiz.run(backend=endpoint, stream=True)
    chunks = list(state.text_iter("why"))
    assert "".join(chunks) == "one two three four"


def test_chat_template_from_model_info(server):
    endpoint = Endpoint(server(MockBackend("x"), chat_template=SMOLLM_LIKE))
    assert endpoint.chat_template().name == "fake"
    assert endpoint.chat_template().markers("user", ()).prefix == "<|im_start|>user\n"
    assert Endpoint(server(MockBackend("x"))).chat_template().name == "chatml"


def test_http_errors_and_helpers(server):
    mock = MockBackend("x")
    endpoint = Endpoint(server(mock))
    with pytest.raises(BackendError, match="HTTP 400.*temperature"):
        endpoint.generate("hi", {"temperature": -1})
    endpoint.flush_cache()
    endpoint.abort("abc")
    assert mock.aborted == ["abc"]
    with pytest.raises(BackendError, match="HTTP 404"):
        endpoint.get_server_info()
    with pytest.raises(BackendError, match="cannot reach"):
        Endpoint("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="http://"):
        Endpoint("localhost:30000")
