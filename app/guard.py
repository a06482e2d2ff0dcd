"""Who may drive the app: every request proves it holds the app's key, and names a host the app answers to.

The app starts processes on this machine, so being able to reach its port is not enough, even on loopback (every
user and container of the machine shares it). Each start of the app draws a key (or takes HF_DILOCO_APP_KEY), writes
it to a file only the user can read and prints a link that carries it, as Jupyter does. Opening that link sets a
cookie (HttpOnly, SameSite=Strict, named for the port) and redirects to the page without the key in its address;
every later request of the page carries the cookie. Programs send the key in the X-HF-Diloco-Key header; for
gradio_client, `Client(url, httpx_kwargs={"auth": KeyAuth(key)})` puts it on every request, its login with --auth
included.

The Host header is checked too, because a page on another site can rebind its own name to 127.0.0.1 and then talk
to the app from the user's own browser (DNS rebinding): the app answers to IP addresses, `localhost`, the name it
was asked to bind and, bound to every interface, this machine's names; an Origin header, when the browser sends
one, must name one of those. A public share link (--share) comes through Gradio's tunnel under a name not known in
advance, so it skips the Host check; it still needs the key and, as before, --auth.

Refused requests get a short page that says what to do, never the app: 401 without the key, 403 for a foreign host
or origin.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx

HEADER = "x-hf-diloco-key"
KEY_ENV = "HF_DILOCO_APP_KEY"
# Gradio's launch asks the server it started whether it is up before anyone has the key; the answer says nothing
# and the call only starts the queue, once.
OPEN_PATHS = frozenset({"/gradio_api/startup-events"})
WIDE = ("0.0.0.0", "::", "")


def key_file(runs_dir: Path, port: int) -> Path:
    return runs_dir / f".app-{port}.key"


def draw_key(runs_dir: Path, port: int) -> tuple[str, Path]:
    """The key of this start of the app ($HF_DILOCO_APP_KEY, or 32 random bytes) and the file it is written to,
    readable by the user only."""
    key = os.environ.pop(KEY_ENV, None) or secrets.token_urlsafe(32)  # popped: the runs it starts never see it
    path = key_file(runs_dir, port)
    runs_dir.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a file left by an earlier start may have looser permissions
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(key + "\n")
    return key, path


def answered_names(host: str) -> frozenset[str]:
    """The host names (not IP addresses, which are always answered) the app serves under when bound to `host`."""
    names = {"localhost"}
    if host in WIDE:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    else:
        names.add(host.lower().strip("[]"))
    return frozenset(names)


def host_name(value: str) -> str:
    """The name part of a Host header or an origin's authority: no port, no brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """ASGI middleware in front of the whole Gradio app (pages, API, static files, event streams)."""

    def __init__(self, app, *, key: str, key_path: Path, host: str, port: int, check_host: bool = True):
        self.app, self.key, self.key_path, self.check_host = app, key, key_path, check_host
        self.names = answered_names(host)
        self.cookie = f"hf_diloco_key_{port}"

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        refusal = self.foreign(headers)
        if refusal is None and scope["path"] not in OPEN_PATHS:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            if self.holds_key(query.get("key")) and scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
                return await self.let_in(scope, query, send)
            if not (self.holds_key(headers.get(HEADER)) or self.holds_key(self.cookie_key(headers))
                    or self.holds_key(query.get("key"))):
                refusal = (401, f"This hf-diloco app needs its key: open the link 'hf-diloco app' printed when "
                                f"it started, or add ?key= and the key in {self.key_path} (readable only by the "
                                f"user who started it) to the address.")
        if refusal is None:
            return await self.app(scope, receive, send)
        status, text = refusal
        if scope["type"] == "websocket":
            await receive()
            return await send({"type": "websocket.close", "code": 1008})
        await refuse(send, status, text)

    def foreign(self, headers: dict[str, str]) -> tuple[int, str] | None:
        """Why a request names a host or origin this app does not answer to, or None."""
        if not self.check_host:
            return None
        name = host_name(headers.get("host", ""))
        if not (is_ip(name) or name in self.names):
            return 403, (f"This hf-diloco app does not answer to the host {name!r}: it serves "
                         f"{', '.join(sorted(self.names))} and IP addresses only (a page of another site can point "
                         f"its own name at this machine; it is refused).")
        origin = headers.get("origin")
        if origin is not None:
            parts = urlsplit(origin)
            named = host_name(parts.netloc) if parts.scheme in ("http", "https") else ""
            if not named or not (is_ip(named) or named in self.names):
                return 403, f"This hf-diloco app refuses requests sent by pages of {origin!r}."
        return None

    def holds_key(self, offered: str | None) -> bool:
        return bool(offered) and hmac.compare_digest(offered.encode(), self.key.encode())

    def cookie_key(self, headers: dict[str, str]) -> str | None:
        jar = SimpleCookie()
        try:
            jar.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header is a request without the key
            return None
        return jar[self.cookie].value if self.cookie in jar else None

    async def let_in(self, scope, query: dict[str, str], send) -> None:
        """The link with the key: set the cookie and send the browser to the same address without the key."""
        rest = urlencode({name: value for name, value in query.items() if name != "key"})
        location = scope.get("root_path", "") + scope["path"] + (f"?{rest}" if rest else "")
        cookie = f"{self.cookie}={self.key}; Path=/; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode("latin-1")),
                                (b"cache-control", b"no-store"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


class KeyAuth(httpx.Auth):
    """httpx authentication that sends the app's key with every request (`httpx_kwargs={"auth": KeyAuth(key)}` for
    gradio_client, whose `headers` miss its login request)."""

    def __init__(self, key: str):
        self.key = key

    def auth_flow(self, request):
        request.headers[HEADER] = self.key
        yield request


async def refuse(send, status: int, text: str) -> None:
    from html import escape

    body = (f"<!doctype html><meta charset=utf-8><title>hf-diloco app: refused</title>"
            f"<p style='font: 16px sans-serif; margin: 2em'>{escape(text, quote=False)}</p>\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/html; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})
