"""An image server on the loopback that never finishes sending, for tests of what stops a fetch."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class DrippingImage:
    """An image server on the loopback that sends its headers, then one byte every 50 ms for 30 s
    (a fetch of it ends only by the fetch's own timeout, 10 s, or by being cancelled), and notes
    when its client hangs up."""

    def __init__(self) -> None:
        self.started = threading.Event()  # a fetch of it began
        self.hung_up = threading.Event()
        dripping = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                dripping.started.set()
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                try:
                    for _ in range(600):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.05)
                except (BrokenPipeError, ConnectionResetError):
                    dripping.hung_up.set()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/image.png"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
