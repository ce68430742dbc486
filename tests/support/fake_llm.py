"""An OpenAI-compatible chat server on loopback that answers from a script (the one allowed fake).

Each request is routed by the `ROLE: <name>` line of its system prompt (or, for a model without a
system role, of its first message) to that role's queue of scripted answers:

- `{"content": ...}`: a plain answer (also how a model in the text action format acts);
- `{"tool": name, "args": {...}}`, or `{"tool": name, "raw": "..."}` for arguments as written;
- `"finish_reason": "length"` on either: the answer was cut off by the output limit;
- `{"status": 502, "retry_after": "0"}`: an error status, with a `Retry-After` header if given;
- `{"context_error": True}`: the 400 a server sends for a prompt longer than its context;
- `{"wait": threading.Event()}` before any of these: the answer waits until the event is set;
  `{"set": threading.Event()}` sets the event when the answer is given.

A key `"<role>|<text>"` holds a queue of its own for that role's requests whose messages contain
`<text>` (e.g. `"executor|(node n3)"`): it is served before the role's queue, while it lasts, so
concurrent nodes can be scripted apart.

An empty queue repeats a `finish` it ended on (the confirmation finish asks for), or gets a
harmless default. `refuse_tool_choice` and `refuse_tools` make the server
answer 400 to any request carrying `tool_choice` or `tools`, as servers without tool support do;
`refuse_formats` makes it answer 500 to a `response_format` of those types, as llama.cpp's server
does to `json_schema`.
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


# The tiny study's sealed file holds 777.125 and its held-out scores lie between 750 and 800 (its dev
# scores below 11): no prompt of any test may hold such a number; a `FakeLLM` fails on leaving its
# `with` block if one did.
SEALED = (r"\b7[5-9]\d\.\d",)


class FakeLLM:
    def __init__(
        self,
        script: dict[str, list[dict[str, Any]]],
        refuse_tool_choice: bool = False,
        refuse_tools: bool = False,
        forbidden: tuple[str, ...] = SEALED,
        refuse_formats: tuple[str, ...] = (),
    ) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.refuse_tool_choice, self.refuse_tools = refuse_tool_choice, refuse_tools
        self.refuse_formats = refuse_formats
        self.last: dict[str, dict[str, Any]] = {}
        self.forbidden = [re.compile(p) for p in forbidden]
        self.leaks: list[str] = []
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = fake.answer(body, self.headers.get("Authorization", ""))
                headers = payload.pop("_headers", {})
                data = json.dumps(payload).encode()
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
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
        assert not self.leaks, f"a prompt held a sealed byte or a held-out number: {self.leaks[:3]}"

    def role_of(self, body: dict[str, Any]) -> str:
        first = body["messages"][0] if body["messages"] else {}
        system = next((m.get("content") or "" for m in body["messages"] if m["role"] == "system"), "")
        match = re.search(r"ROLE: (\w+)", system or str(first.get("content") or ""))
        return match.group(1) if match else "unknown"

    def answer(self, body: dict[str, Any], authorization: str = "") -> tuple[int, dict[str, Any]]:
        with self.lock:
            role = self.role_of(body)
            self.requests.append({"role": role, "body": body, "authorization": authorization})
            text = json.dumps(body["messages"])
            self.leaks += [m.group(0) for rx in self.forbidden for m in rx.finditer(text)]
            if self.refuse_tool_choice and "tool_choice" in body:
                return 400, {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                                  "--tool-call-parser to be set", "type": "BadRequestError"}}  # fmt: skip
            kind = (body.get("response_format") or {}).get("type")
            if kind in self.refuse_formats:  # as llama.cpp's server answers `json_schema`
                return 500, {
                    "error": {"message": f"Unsupported response_format type: {kind}", "type": "server_error"}
                }
            if self.refuse_tools and "tools" in body:
                return 400, {
                    "error": {"message": "this model does not support tools", "type": "BadRequestError"}
                }
            own = next((k for k, q in self.script.items() if q and k.startswith(f"{role}|")
                        and k.split("|", 1)[1] in text), None)  # fmt: skip
            if own is not None:
                role = own
            queue = self.script.get(role, [])
            last = self.last.get(role, {})
            if queue:
                step = queue.pop(0)
            elif last.get("tool") == "finish" or '"tool": "finish"' in str(last.get("content")):
                step = last  # a model that finished confirms when shown its change
            else:
                step = DEFAULTS.get(role, {"content": ""})
            self.last[role] = step
        if "set" in step:
            step["set"].set()
        if "wait" in step:
            step["wait"].wait(timeout=120)
        if step.get("context_error"):
            return 400, {"error": {"message": "This model's maximum context length is 4096 tokens. However, "
                                              "your messages resulted in 9000 tokens.", "type": "invalid_request_error",
                                   "code": "context_length_exceeded"}}  # fmt: skip
        if "status" in step:
            error = {"error": {"message": "scripted failure", "type": "server_error"}}
            if "retry_after" in step:
                error["_headers"] = {"Retry-After": str(step["retry_after"])}
            return int(step["status"]), error
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
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": step.get("finish_reason")
                    or ("tool_calls" if "tool" in step else "stop"),
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 20,
                "total_tokens": prompt_tokens + 20,
            },
        }
