"""HTTP plumbing of the server: the bearer-token check, and the readers/writer gates of the routes:
the version gate, which keeps every completion on one weights version (a push waits for in-flight
requests and holds new ones back), and the same lock where a score needs the engine alone
(grpo/serving/routes.py); a failure under a dead engine answered as the engine's death."""
import asyncio
import contextlib
import hashlib
import json
import secrets
from typing import Callable, Optional

OPEN_PATHS = frozenset({"/health", "/grpo/health", "/grpo/weights_version"})


class VersionGate:
    """Readers (requests) share; a writer (a push) waits for them and holds new ones back."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def reading(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writing(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
                # a writer that gave up waiting (its client hung up) held readers back: wake them
                self._cond.notify_all()
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class BearerAuth:
    """ASGI middleware: everything but OPEN_PATHS needs the run's token (constant-time check)."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and not (
            scope["path"] in OPEN_PATHS and scope.get("method", "GET") in ("GET", "HEAD")
        ):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1").partition(" ")
            ok = scheme.lower() == "bearer" and secrets.compare_digest(
                hashlib.sha256(given.encode()).digest(), self._digest)
            if not ok:
                from starlette.responses import JSONResponse

                resp = JSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class GateRequests:
    """ASGI middleware: vLLM's own routes (/v1/...) hold the read side of the gate while they run."""

    def __init__(self, app, gate: VersionGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/grpo/") or scope["path"] in ("/health", "/metrics"):
            return await self.app(scope, receive, send)
        async with self.gate.reading():
            return await self.app(scope, receive, send)


class EngineDeathIs503:
    """ASGI middleware: a request that fails while the engine is dead gets 503 "the vLLM engine
    died: ...", whatever its route made of the failure. A call that meets a dead engine fails in
    many ways inside vLLM (EngineDeadError, a load refused as a 400, any exception as a 500), and
    vLLM's death flag can come after the failure; a 4xx/500 ends the trainer's run as a refusal of
    its request, while a 503 is retried until the server has exited (it does, within
    EngineProcessWatch's poll), then the trainer restarts it and calls again. CI's chaos soak lost
    an attempt so: its engine killed mid-generation, one call of the run answered with an error
    before the server exited. `died()` gives the reason, or None while the engine lives."""

    def __init__(self, app, died: Callable[[], Optional[str]]) -> None:
        self.app = app
        self.died = died

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = replaced = False

        async def answer_died(why: str) -> None:
            body = json.dumps({"error": f"the vLLM engine died: {why}"}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        async def send_unless_died(message) -> None:
            nonlocal started, replaced
            if message["type"] == "http.response.start":
                started = True
                # 499: the client left, nobody reads it; 503 says it already
                if message["status"] >= 400 and message["status"] not in (499, 503) and (why := self.died()):
                    replaced = True
                    return await answer_died(why)
            elif replaced:
                return  # the body of the failure answered instead
            await send(message)

        try:
            await self.app(scope, receive, send_unless_died)
        except Exception:
            if replaced:
                return  # answered; the route's exception was the engine's death
            if not started and (why := self.died()):
                return await answer_died(why)
            raise


class Guarded:
    """vLLM's app behind our middlewares, as the outermost ASGI layer.

    vLLM has built the app's middleware stack by the time we get it (add_middleware refuses),
    so the checks wrap the whole app instead; attribute access goes to the app for serve_http.
    """

    def __init__(self, app, asgi) -> None:
        self._app, self._asgi = app, asgi

    async def __call__(self, scope, receive, send):
        await self._asgi(scope, receive, send)

    def __getattr__(self, name):
        return getattr(self._app, name)
