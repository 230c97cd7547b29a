"""A small HTTP server in a daemon thread: the chief's `/metrics`, the launcher's status page.

```python
server = Server("127.0.0.1", 0, {"/metrics": lambda: (CONTENT_TYPE, metrics.text())})
print(server.url)
```
"""

import http.server
import threading


class _Handler(http.server.BaseHTTPRequestHandler):
    routes = {}

    def do_GET(self):  # noqa: N802 - the standard library's name
        route = self.routes.get(self.path.split("?", 1)[0])
        if route is None:
            self.send_error(404, f"no such page; pages: {', '.join(sorted(self.routes))}")
            return
        try:
            content_type, body = route()
        except Exception as e:  # noqa: BLE001 - a page that fails says why, the job goes on
            self.send_error(500, f"{type(e).__name__}: {e}")
            return
        if isinstance(body, str):
            body = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - quiet: scrapes are not news
        pass


class Server:
    """Serves `routes` ({path: () -> (content type, body)}) at `address:port` (0: any free
    port) until `close()`."""

    def __init__(self, address, port, routes):
        handler = type("Handler", (_Handler,), {"routes": dict(routes)})
        self._server = http.server.ThreadingHTTPServer((address, port), handler)
        self._server.daemon_threads = True
        self.address = address
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kfit_ps-http", daemon=True)
        self._thread.start()

    @property
    def url(self):
        host = "127.0.0.1" if self.address in ("", "0.0.0.0") else self.address
        return f"http://{host}:{self.port}/"

    def close(self):
        self._server.shutdown()
        self._server.server_close()
