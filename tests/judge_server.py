"""A stdlib HTTP server speaking OpenAI's /v1/models, /v1/chat/completions and /v1/completions, with a
deterministic judge behind it, for the remote-judge tests (tests/test_rewards_judge*.py)."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def judge_rule(user_text: str) -> str:
    """The server's deterministic judgement: 10 when the answer section says 4, 2 otherwise; "???" (no score)
    when the answer says "confuse"."""
    answer = user_text.split("[Assistant's answer]\n", 1)[-1].split("\n\n", 1)[0]
    if "confuse" in answer:
        return "I cannot decide."
    return "Correct.\nScore: 10" if re.search(r"\b4\b", answer) else "Wrong.\nScore: 2"


class JudgeServer:
    """A stdlib HTTP server speaking OpenAI's /v1/models, /v1/chat/completions and /v1/completions."""

    def __init__(self, fail_first: int = 0, hang_s: float = 0.0, rule=judge_rule, api_key: str | None = None):
        """api_key: every request must carry `Authorization: Bearer <api_key>`, else HTTP 401."""
        self.fail_first, self.hang_s, self.rule, self.api_key = fail_first, hang_s, rule, api_key
        self.authorizations: list[str | None] = []  # the Authorization header of every request
        self.requests, self.in_flight, self.max_in_flight = 0, 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                given = self.headers.get("Authorization")
                with server.lock:
                    server.authorizations.append(given)
                if server.api_key is None or given == f"Bearer {server.api_key}":
                    return True
                self._reply(401, {"error": {"message": "invalid or missing API key", "code": 401}})
                return False

            def do_GET(self):
                if self._authorized():
                    self._reply(200, {"object": "list", "data": [{"id": "judge-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized():
                    return
                with server.lock:
                    server.requests += 1
                    n = server.requests
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    code, reply = self._answer(body, n)
                finally:  # counted out before the reply goes: the client may send its next request at once
                    with server.lock:
                        server.in_flight -= 1
                self._reply(code, reply)

            def _answer(self, body: dict, n: int) -> tuple[int, dict]:
                time.sleep(0.05)  # let requests overlap, so concurrency is observable
                if server.hang_s:
                    time.sleep(server.hang_s)
                if n <= server.fail_first:
                    return 503, {"error": "warming up"}
                if body.get("model") != "judge-model" or body.get("temperature") != 0.0:
                    return 400, {"error": f"bad request {body}"}
                if self.path == "/v1/chat/completions":
                    text = server.rule(body["messages"][-1]["content"])
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}}
                else:
                    choice = {"index": 0, "text": server.rule(body["prompt"])}
                return 200, {"object": "chat.completion", "choices": [choice]}

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
