"""A local HTTP server that speaks the Hub endpoints huggingface_hub calls for create_repo and upload_folder.

GET /api/models/<repo> and /api/datasets/<repo> (repo info: 404 "RepoNotFound" unless created here),
POST /api/repos/create, POST /api/validate-yaml, POST /api/models/<repo>/preupload/<rev> (every file "regular",
so contents come inline) and POST /api/models/<repo>/commit/<rev> (NDJSON). Received files are kept in memory,
decoded, per repo, with the Authorization header of each request, so tests can check what arrived and with which
token.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.tokens: list[str] = []
        self.commits: list[dict] = []
        server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path = self.path.split("?")[0]
                for kind in ("models", "datasets"):
                    prefix = f"/api/{kind}/"
                    if path.startswith(prefix):
                        repo_id = path[len(prefix):].split("/revision/")[0]
                        if repo_id in hub.repos:
                            return self._reply(200, {"id": repo_id, "sha": "1" * 40, "siblings": []})
                        self.send_response(404)
                        self.send_header("X-Error-Code", "RepoNotFound")
                        self.send_header("X-Error-Message", "Repository not found")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return None
                return self._reply(404, {"error": f"not served here: {path}"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.tokens.append(self.headers.get("Authorization", ""))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    request = json.loads(body)
                    repo_id = "/".join(filter(None, [request.get("organization"), request["name"]]))
                    hub.repos[repo_id] = request
                    hub.files.setdefault(repo_id, {})
                    return self._reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
                if path == "/api/validate-yaml":  # the model card's metadata is checked before the upload
                    return self._reply(200, {"errors": [], "warnings": []})
                if path.startswith("/api/models/") and "/preupload/" in path:
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False} for f in files]})
                if path.startswith("/api/models/") and "/commit/" in path:
                    repo_id = path[len("/api/models/"):].split("/commit/")[0]
                    if repo_id not in hub.repos:
                        return self._reply(404, {"error": "Repository not found"})
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    for line in lines:
                        if line["key"] == "file":
                            hub.files[repo_id][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                    hub.commits.append({"repo": repo_id, "header": lines[0]["value"]})
                    return self._reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/1", "commitOid": "1" * 40})
                return self._reply(404, {"error": f"not served here: {path}"})

        return Handler
