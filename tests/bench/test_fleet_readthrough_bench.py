"""bench.fleet_readthrough at its smallest (2 boxes, each its own daemon and `kvstore serve`, one
real `weed mini` behind the counting proxy, 2 chats x 4 turns, every mode); and the proxy's
request count on a keep-alive connection (Content-Length and chunked bodies)."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import fleet_readthrough as fr
from bench.s3proxy import S3Proxy


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: several requests on one connection

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._reply(b"x" * 10)

    def do_GET(self) -> None:
        self._reply(b"y" * 50_000)

    def do_PUT(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            got = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                got += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()  # the empty trailer line
        else:
            got = self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(str(len(got)).encode())

    def log_message(self, *args) -> None:
        pass


def test_the_proxy_counts_each_request_on_a_kept_alive_connection():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = S3Proxy(server.server_address[1], bps=1e6, delay=0.001)
    try:
        c = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        for method, body, chunked in [("HEAD", None, False), ("PUT", b"z" * 70_000, False),
                                      ("GET", None, False), ("PUT", b"w" * 1000, True),
                                      ("HEAD", None, False)]:  # fmt: skip
            if chunked:
                c.request(method, "/b/k", body=iter([body[:300], body[300:]]),
                          encode_chunked=True)  # fmt: skip
            else:
                c.request(method, "/b/k", body=body)
            r = c.getresponse()
            data = r.read()
            if method == "PUT":
                assert data == str(len(body)).encode()
            if method == "GET":
                assert len(data) == 50_000
        c.close()
        assert proxy.snapshot()["methods"] == {"HEAD": 2, "PUT": 2, "GET": 1}
        assert proxy.snapshot()["bytes_down"] > 50_000
    finally:
        proxy.close()
        server.shutdown()


@pytest.mark.slow
def test_the_fleet_benchmark_runs_real_boxes_in_every_mode():
    res = fr.run(quick=True)
    assert res["prefill_tokens_per_s"] > 0
    assert "regime: this machine prefills" in fr.table(res)
    prompt = res["off"]["prompt_tokens"]
    for name in fr.MODES:
        m = res[name]
        assert m["requests"] == fr.QUICK["chats"] * fr.QUICK["turns"]
        assert m["prompt_tokens"] == prompt  # the same chats in every mode
        # the replies' usage and the serves' /metrics agree on what was prefilled
        assert sum(m["tokens_by_source"].values()) == prompt
        assert m["tokens_by_source"]["prefill"] == m["prefilled_tokens"]
        assert m["bucket"]["methods"].get("PUT", 0) > 0  # the daemons uploaded what they learned
        assert m["ttft_mean_s"] > 0
    off, on = res["off"], res["on"]
    assert off["fetched_bytes"] == 0 and "GET" not in off["bucket"]["methods"]
    assert off["tokens_by_source"]["fleet"] == 0 and off["read_through_requests_per_request"] == 0
    # with read-through on, the boxes asked the bucket on their misses; what the cost rule and the
    # deadline then decided depends on this machine's load (a fetch served is counted as such)
    assert on["read_through_requests_per_request"] > 0 and sum(on["reads"].values()) > 0
    if on["reads"]["fetched"]:
        assert on["tokens_by_source"]["fleet"] > 0 and on["fetched_bytes"] > 0
        assert on["prefilled_tokens"] < off["prefilled_tokens"]
