"""An OpenAI-compatible chat server on loopback that answers from a script (the one allowed fake).

Each request is routed by the `ROLE: <name>` line of its system prompt to that role's queue of
scripted answers: `{"content": ...}`, `{"tool": name, "args": {...}}`, `{"tool": name, "raw": "..."}`
(malformed arguments) or `{"status": 429}`. An empty queue gets a harmless default.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULTS: dict[str, dict[str, Any]] = {
    "ideator": {"content": '{"children": []}'},
    "insight": {"content": "No new lesson."},
    "executor": {"tool": "finish", "args": {"report": "nothing to do"}},
}


class FakeLLM:
    def __init__(self, script: dict[str, list[dict[str, Any]]]) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = fake.answer(body, self.headers.get("Authorization", ""))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeLLM:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def role_of(self, body: dict[str, Any]) -> str:
        system = next((m.get("content") or "" for m in body["messages"] if m["role"] == "system"), "")
        match = re.search(r"ROLE: (\w+)", system)
        return match.group(1) if match else "unknown"

    def answer(self, body: dict[str, Any], authorization: str = "") -> tuple[int, dict[str, Any]]:
        with self.lock:
            role = self.role_of(body)
            self.requests.append({"role": role, "body": body, "authorization": authorization})
            queue = self.script.get(role, [])
            step = queue.pop(0) if queue else DEFAULTS.get(role, {"content": ""})
        if "status" in step:
            return int(step["status"]), {"error": {"message": "scripted failure", "type": "rate_limit_error"}}
        message: dict[str, Any] = {"role": "assistant", "content": step.get("content")}
        if "tool" in step:
            args = step.get("raw", json.dumps(step.get("args", {})))
            message["tool_calls"] = [
                {
                    "id": f"call_{len(self.requests)}",
                    "type": "function",
                    "function": {"name": step["tool"], "arguments": args},
                }
            ]
        prompt_tokens = len(json.dumps(body["messages"])) // 4
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {"index": 0, "message": message, "finish_reason": "tool_calls" if "tool" in step else "stop"}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 20,
                "total_tokens": prompt_tokens + 20,
            },
        }
