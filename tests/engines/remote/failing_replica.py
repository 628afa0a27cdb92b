"""A replica gone bad: every read is answered 500, as a GPU that faults does, while its health route and
model listing still answer (passed on to a real replica). Run as a process of its own:

    python tests/engines/remote/failing_replica.py http://127.0.0.1:PORT_OF_A_REAL_REPLICA LISTEN_PORT
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

#: what a slotread engine whose GPU faulted answers (vLLM's error shape)
FAULT = (
    b'{"error": {"message": "CUDA error: an illegal memory access was encountered", '
    b'"type": "InternalServerError", "param": null, "code": 500}}'
)


class Handler(BaseHTTPRequestHandler):
    upstream = ""

    def do_GET(self) -> None:
        response = httpx.get(self.upstream + self.path, timeout=5.0)
        self._send(response.status_code, response.content)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(500, FAULT)

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet: the tests count, not read, requests
        pass


if __name__ == "__main__":
    Handler.upstream = sys.argv[1].rstrip("/")
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler).serve_forever()
