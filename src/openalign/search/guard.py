"""Guards in front of the search app: an API key, request bodies that are too big, too slow or too many
at once (ASGI middleware), and JSON bodies holding numbers that are not finite (a route class).

Everything a client can make the server hold is bounded here before a route runs: a body over the size
limit is refused (413) from its declared length or as soon as it grows past it; a body that has not fully
arrived within the read timeout is dropped (408), so a client that stalls mid-upload frees its memory;
and the bodies held at once (with the copies parsing makes) stay within a budget, new ones waiting for
room and then refused (503). A body that has not arrived in time has its connection closed with the 408,
once the client has stopped sending: what it still sends is read and dropped (for at most another read
timeout), since closing on unread bytes resets the connection and the client never reads why. Python's JSON
parser accepts NaN, Infinity and 1e400 (as inf), which no validation error can then print as JSON; such
a body gets a one-line 422 and leaves the connection usable. So does a body too large in structure
(``BodyShape``: keys, items, depth) for its validation errors to be worth building; other bodies are parsed
and validated in a worker thread, and their errors listed up to a count.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

# A JSON body is held as bytes, then as the text json.loads decodes, then as the parsed image string.
BODY_COPIES = 3
# A client silent this long after the read timeout has stopped sending: its 408 can go and the connection close.
QUIET_S = 0.5
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
# Items of a list (or keys of an object) a validation error shows of the input it names.
PRINTED_ITEMS = 16


async def reply(
    scope: dict, send: Any, status: int, detail: str, *, close: bool = False, headers: dict[str, str] | None = None
) -> None:
    """Send a JSON ``{"detail": ...}`` response; ``close`` ends the connection after it.

    Without ``close`` the server reads and drops whatever is left of the body, holding none of it, and
    the connection stays usable; closing while a client is still sending would reset the connection
    before the client reads why.
    """
    extra = dict(headers or {})
    if close:
        extra["connection"] = "close"
    response = JSONResponse({"detail": detail}, status_code=status, headers=extra)
    await response(scope, _no_body, send)


async def _no_body() -> dict:
    return {"type": "http.disconnect"}


class MemoryBudget:
    """Bytes that request bodies may hold across all requests; ``take`` waits (polling) for room.

    Polling rather than an asyncio condition keeps it usable from any event loop (test clients run one
    per request), and waiting only happens when the server is already overloaded.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def try_take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    async def take(self, nbytes: int, deadline: float) -> bool:
        """Reserve ``nbytes`` (one request bigger than the budget runs alone); False at ``deadline``."""
        while not self.try_take(nbytes):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class BodyGuard:
    """Reads a POST/PUT/PATCH body in full within ``timeout_s`` and ``limit`` bytes, holding its share of
    ``budget``, before the app sees it (ASGI middleware); other requests pass straight through.

    With a ``shape``, the body's separators are counted as it arrives (``check_bytes``'s rule): one far larger
    in structure than any query is answered with a 422 then, and the rest is dropped unstored."""

    def __init__(self, app: Any, limit: int, timeout_s: float, budget: MemoryBudget, shape: BodyShape | None = None):
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s
        self.budget = budget
        self.shape = shape

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is not None and size > self.limit:
            await reply(scope, send, 413, f"request body over {self.limit} bytes")
            return
        deadline = time.monotonic() + self.timeout_s
        # A body of unknown length may grow to the limit, so it reserves that much.
        share = BODY_COPIES * (self.limit if size is None else size)
        if not await self.budget.take(share, deadline):
            await reply(
                scope, send, 503, "the server is busy with other uploads; retry later", headers={"retry-after": "5"}
            )
            return
        held = share
        try:
            try:
                body = await self._read(scope, receive, send, deadline)
            except asyncio.TimeoutError:
                # The part read is gone, so its share is free for other uploads while the rest drains.
                self.budget.give(held)
                held = 0
                await _drain(receive, QUIET_S, time.monotonic() + self.timeout_s)
                detail = f"the request body did not arrive within {self.timeout_s:g} s"
                await reply(scope, send, 408, detail, close=True)
                return
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
        finally:
            self.budget.give(held)

    async def _read(self, scope: dict, receive: Any, send: Any, deadline: float) -> bytes | None:
        """The whole body, or None once a 413 has been sent (or the client has gone); TimeoutError at
        ``deadline``, the part read dropped."""
        chunks: list[bytes] = []
        received, more = 0, True
        separators = Separators()
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                chunks.clear()  # the traceback keeps this frame alive while the rest drains
                raise
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.limit:
                await reply(scope, send, 413, f"request body over {self.limit} bytes")
                return None
            if self.shape is not None and (refused := separators.add(chunk, self.shape)) is not None:
                chunks.clear()
                await reply(scope, send, 422, refused.detail)
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


async def _drain(receive: Any, quiet_s: float, until: float) -> None:
    """Read and drop what a client sends until it has been quiet for ``quiet_s``, has gone, or ``until``."""
    while (left := until - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), min(quiet_s, left))
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that yields the body read ahead, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict = await receive()
        return message

    return replay


class ApiKeyGuard:
    """Lets a request through only with ``Authorization: Bearer KEY`` or ``X-API-Key: KEY`` (ASGI
    middleware); paths in ``open_paths`` need none. Keys are compared in constant time."""

    def __init__(self, app: Any, key: str, open_paths: tuple[str, ...] = ("/health",)):
        if not key:
            raise ValueError("the API key is empty")
        self.app = app
        self.key = key.encode()
        self.open_paths = open_paths

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        offered = []
        for name, value in headers:
            if name == b"x-api-key":
                offered.append(value.strip())
            elif name == b"authorization" and value[:7].lower() == b"bearer ":
                offered.append(value[7:].strip())
        # Every offered key is compared, so the time taken does not depend on which one was right.
        matches = [hmac.compare_digest(value, self.key) for value in offered]
        return any(matches)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.allowed(scope.get("headers") or []):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await reply(
            scope,
            send,
            401,
            "missing or wrong API key: send 'Authorization: Bearer KEY' or 'X-API-Key: KEY'",
            headers={"www-authenticate": "Bearer"},
        )


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A one-line warning when ``host`` lets other machines reach a server that has no API key."""
    if api_key or is_loopback(host):
        return None
    return (
        f"warning: serving on {host} without an API key lets anyone who can reach this machine query the index "
        "and fetch its images; set OPENALIGN_API_KEY (or --api-key), or bind 127.0.0.1"
    )


class NonFiniteNumber(ValueError):
    """A JSON number that is not a finite float: NaN, Infinity or one too large for a double."""


def _reject_constant(name: str) -> float:
    raise NonFiniteNumber(f"request body: {name} is not a JSON number; send finite numbers only")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"request body: the number {text[:40]} is too large for a double")
    return value


@dataclass(frozen=True)
class BodyShape:
    """How large a JSON body may be by structure, checked before it is validated.

    A body within the size limit can still hold hundreds of thousands of keys or items, each of which would
    cost a validation error; such a body is refused with one line before parsing (from counts of its ``:``,
    ``,`` and brackets, which no valid query comes near) or right after (per object, per list and in depth).
    """

    max_keys: int = 64  # keys in one JSON object
    max_items: int = 16384  # items in one JSON list
    max_depth: int = 8  # objects and lists nested in each other
    max_tokens: int = 65536  # ':', ',' or opening brackets in the whole body (text inside strings counts too)
    max_errors: int = 20  # validation errors listed in one reply


def _refuse(detail: str) -> HTTPException:
    return HTTPException(422, f"request body: {detail}")


class Separators:
    """Running counts of a body's ``:``, ``,`` and opening brackets, chunk by chunk."""

    def __init__(self) -> None:
        self.keys = self.items = self.opened = 0

    def add(self, chunk: bytes, shape: BodyShape) -> HTTPException | None:
        """Count ``chunk``; the 422 to answer once a count passes ``shape.max_tokens``, else None."""
        self.keys += chunk.count(b":")
        self.items += chunk.count(b",")
        self.opened += chunk.count(b"[") + chunk.count(b"{")
        limit = shape.max_tokens
        if self.keys > limit:
            return _refuse(f"more than {limit} keys; a query has a few dozen at most")
        if self.items > limit:
            return _refuse(f"more than {limit} items; a list holds at most {shape.max_items}")
        if self.opened > limit:
            return _refuse(f"nested too deep or too many lists and objects (more than {limit})")
        return None


def check_bytes(body: bytes, shape: BodyShape) -> None:
    """Refuse a body whose separators alone show it is far larger in structure than any query (a body
    shorter than the limit is within it)."""
    if len(body) > shape.max_tokens and (refused := Separators().add(body, shape)) is not None:
        raise refused


def check_shape(value: Any, shape: BodyShape) -> None:
    """Refuse a parsed body with an object of too many keys, a list of too many items, or too deep."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
            if len(node) > shape.max_keys:
                raise _refuse(f"an object with {len(node)} keys, more than {shape.max_keys}")
        elif isinstance(node, list):
            children = node
            if len(node) > shape.max_items:
                raise _refuse(f"a list of {len(node)} items, more than {shape.max_items}")
        else:
            continue
        if depth > shape.max_depth:
            raise _refuse(f"nested deeper than {shape.max_depth} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def capped_errors(errors: list[Any], shape: BodyShape) -> list[Any]:
    """The first ``max_errors`` validation errors, printable, and a note of how many more there were."""
    shown = [printable(error) for error in jsonable_encoder(errors[: shape.max_errors])]
    if len(errors) > shape.max_errors:
        more = len(errors) - shape.max_errors
        shown.append({"type": "more_errors", "loc": ["body"], "msg": f"{more} more errors not shown"})
    return shown


class StrictJSONRequest(Request):
    """A request whose JSON body may hold only finite numbers (Python's parser accepts NaN and Infinity),
    within ``BodyShape``, parsed and validated against ``body_field`` in a worker thread."""

    body_field: Any = None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            shape = getattr(self.app.state, "body_shape", None) or BodyShape()
            self._json = await run_in_threadpool(self._parse, body, shape)
        return self._json

    def _parse(self, body: bytes, shape: BodyShape) -> Any:
        check_bytes(body, shape)
        try:
            value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
        except NonFiniteNumber as err:
            raise HTTPException(422, str(err)) from None
        except RecursionError:
            raise _refuse(f"nested deeper than {shape.max_depth} levels") from None
        check_shape(value, shape)
        if self.body_field is not None:
            # Errors are built here, off the event loop, and capped; a valid body is validated again by the route.
            _, errors = self.body_field.validate(value, {}, loc=("body",))
            if errors:
                raise HTTPException(422, capped_errors(list(errors), shape))
        return value


class StrictJSONRoute(APIRoute):
    """A route that parses its body with ``StrictJSONRequest``: non-finite numbers and bodies outside
    ``BodyShape`` get a one-line 422, and validation errors are built in a worker thread."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_field = self.body_field

        async def strict(request: Request) -> Response:
            strict_request = StrictJSONRequest(request.scope, request.receive)
            strict_request.body_field = body_field
            return await handler(strict_request)

        return strict


def printable(value: Any) -> Any:
    """``value`` (validation errors) with non-finite floats as text and long strings, lists and objects cut,
    so that the error itself is valid JSON and does not echo a whole upload back."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + "…"
    if isinstance(value, dict):
        shown = {k: printable(v) for k, v in list(value.items())[:PRINTED_ITEMS]}
        if len(value) > PRINTED_ITEMS:
            shown["…"] = f"{len(value) - PRINTED_ITEMS} more keys"
        return shown
    if isinstance(value, (list, tuple)):
        items = [printable(v) for v in value[:PRINTED_ITEMS]]
        return [*items, f"… {len(value) - PRINTED_ITEMS} more items"] if len(value) > PRINTED_ITEMS else items
    return value


# Descriptors kept back from connections for the index's files, images served and the listening socket.
FD_RESERVE = 64
_BUSY = b'{"detail":"the server has too many open connections; retry later"}'
BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 5\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY
)


def connection_cap(max_connections: int) -> tuple[int, int]:
    """(connections, backlog): ``max_connections`` lowered to what the open-file limit leaves after
    ``FD_RESERVE`` and three backlogs' worth of sockets.

    asyncio accepts a backlog's worth in one go, and a connection is made, and one closed to make room for it,
    over the loop's next iterations: up to three such bursts are open before the cap has closed any.
    """
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections, 2048
    room = max(4, soft - FD_RESERVE)
    backlog = max(1, min(2048, room // 8))
    return max(1, min(max_connections, room - 3 * backlog)), backlog


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type:
    """uvicorn's h11 protocol that closes a connection whose request headers have not fully arrived within
    ``header_timeout_s`` of its opening or its last answer, and keeps at most ``max_connections`` open.

    Past the cap the connection waiting longest for its headers is closed to make room, so idle sockets
    cannot crowd out a client that asks; with none waiting (all busy) the new one gets a 503.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None
        waiting_since = 0.0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            if len(self.connections) > max_connections and not self._evict():
                transport.write(BUSY_REPLY)  # type: ignore[attr-defined]
                transport.close()
                return
            self._arm()

        def waiting(self) -> bool:
            """Whether this connection is open and has not sent a whole request head since its last answer."""
            return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

        def _evict(self) -> bool:
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c.waiting()]
            if not idle:
                return False
            min(idle, key=lambda c: c.waiting_since).transport.close()
            return True

        def _arm(self) -> None:
            self._disarm()
            self.waiting_since = self.loop.time()
            self.header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _header_timeout(self) -> None:
            self.header_timer = None
            if self.waiting():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol
