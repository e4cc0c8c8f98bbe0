"""The thread inspector: server-rendered pages at /threadkeeper/ui/ (issue 11 item 3).

Off (every path 404) unless `operator_token` is set. Who may look:

- `Authorization: Bearer <operator_token>` (compared in constant time) sees every tenant;
- a tenant's API key (one a policy file lists) sees its own tenant's threads only;
- a browser signs in at /threadkeeper/ui/login with either and gets a session cookie
  (HttpOnly, SameSite=Strict; Secure per `inspector_cookie_secure`) holding a random
  session id signed with a key derived from the operator token, never the token itself.
  The session is a store row (`inspector_sessions`, shared by every worker and replica):
  sign-out deletes it, a proxy started with another operator token deletes the old
  token's, and a tenant session also ends when its key leaves the policy file.

Anything else gets 401 and no page content. Failed token checks (the sign-in form and
bearer tokens alike) are throttled per client address and in all (`LoginThrottle`): past
the limits the answer is 429 with Retry-After and the token is not even checked. Forms
that change state (ledger resolve, logout) carry a CSRF token derived from the session; a
cookie session's POST without the right one is 403. Every query parameter goes through
`query_values` (a page's parameters, each with its length or range).
The pages reuse the operator functions of proxy/admin.py (the CLI's), so the inspector
and `threadkeeper threads ...` show the same facts. Rendering is in inspector_html.py.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import re
import secrets
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import structlog
from aiohttp import web

from proxy import admin
from proxy.clock import utc_iso
from proxy.logs import register_secret
from proxy.namespaces import Scope
from proxy.policy import hash_key
from proxy.server import explain, inspector_html
from proxy.server.auth import bearer_token, is_utf8
from proxy.server.state import CLOCK, POLICIES, SETTINGS, STORE
from proxy.store.base import (
    ExplainStore,
    InspectorSession,
    InspectorSessionStore,
    StoreUnavailable,
    Thread,
    ThreadStore,
)

log = structlog.get_logger("threadkeeper.inspector")

PREFIX = "/threadkeeper/ui"
COOKIE = "threadkeeper_session"
SESSION_SECONDS = 12 * 3600
THREADS_LIMIT = 100
LEDGER_LIMIT = 200
PAGE_ITEMS = 200  # timeline items per page: the last ones, or those from ?from=SEQ
RECENT_REQUESTS = 20
SESSION_KEY_CONTEXT = b"threadkeeper-inspector-session-v1"
# Failed token checks tolerated within LOGIN_WINDOW_SECONDS, per client address (an IPv6
# client counts by its /64) and from all addresses together; each serving process counts
# its own (with `workers: N`, N times these).
LOGIN_FAILURES_PER_ADDRESS = 10
LOGIN_FAILURES_OVERALL = 100
LOGIN_WINDOW_SECONDS = 300.0
MAX_SEQ = 2**63 - 1  # a store sequence number is a signed 64-bit integer
TEXT_PARAM_MAX = 1024  # characters of a text query parameter (ids, tenants, ledger keys)


@dataclass(frozen=True)
class Viewer:
    """Who is looking: `tenant` None is the operator (every tenant)."""

    tenant: str | None
    session_id: str  # what the CSRF token is bound to
    from_cookie: bool

    def may_see(self, namespace: str) -> bool:
        return self.tenant is None or self.tenant == namespace

    def scope(self, tenant: str | None, namespace: str | None) -> Scope:
        """The filter a listing uses: a tenant viewer's own namespace (never its tenant's
        passthrough callers'), whatever was asked; an operator's as asked."""
        if self.tenant is not None:
            return Scope(namespace=self.tenant)
        try:
            return Scope(tenant=tenant, namespace=namespace)
        except ValueError as exc:
            raise _page(400, inspector_html.message_page("Bad request", str(exc))) from None


# --- sessions and tokens ------------------------------------------------------------------


def _secret(app: web.Application) -> bytes:
    token = app[SETTINGS].operator_token or ""
    return hmac.new(token.encode("utf-8"), SESSION_KEY_CONTEXT, hashlib.sha256).digest()


def _sign(app: web.Application, data: bytes) -> str:
    return hmac.new(_secret(app), data, hashlib.sha256).hexdigest()


def _bytes(text: str) -> bytes:
    """Text from a header or a form as bytes to compare; undecodable input (lone
    surrogates) is replaced, and then matches no signature or token."""
    return text.encode("utf-8", "replace")


def _signing_key(app: web.Application) -> str:
    """Names the operator token sessions are signed under, without revealing it."""
    return _sign(app, b"signing-key-id")[:32]


def _id_hash(session_id: str) -> str:
    return hashlib.sha256(_bytes(session_id)).hexdigest()


async def new_session(app: web.Application, tenant: str | None, key_hash: str | None) -> str:
    """Stores a session and returns its cookie value, `<session id>.<hmac>`."""
    session_id = secrets.token_urlsafe(32)
    now = app[CLOCK].now()
    store: InspectorSessionStore = app[STORE]
    await store.inspector_sessions_purge(now=utc_iso(now))  # the expired: rows stay few
    await store.inspector_session_create(
        InspectorSession(
            _id_hash(session_id),
            tenant,
            key_hash,
            _signing_key(app),
            utc_iso(now),
            utc_iso(now + timedelta(seconds=SESSION_SECONDS)),
        )
    )
    return f"{session_id}.{_session_signature(app, session_id)}"


def _session_signature(app: web.Application, session_id: str) -> str:
    return _sign(app, b"session\x00" + _bytes(session_id))


def _session_id(request: web.Request, value: str) -> str | None:
    """The session id of a cookie whose signature holds (else no store lookup at all)."""
    session_id, _, signature = value.partition(".")
    expected = _session_signature(request.app, session_id)
    if not session_id or not hmac.compare_digest(_bytes(signature), expected.encode()):
        return None
    return session_id


async def _session_viewer(request: web.Request, value: str) -> Viewer | None:
    session_id = _session_id(request, value)
    if session_id is None:
        return None
    store: InspectorSessionStore = request.app[STORE]
    session = await store.inspector_session_get(_id_hash(session_id))
    if (
        session is None
        or session.signing_key != _signing_key(request.app)
        or session.expires_at <= request.app[CLOCK].iso()
    ):
        return None
    if session.tenant is not None:
        policy = request.app[POLICIES].get(session.tenant)
        if policy is None or session.key_hash not in policy.api_keys:
            return None  # the key was revoked since the sign-in
    return Viewer(session.tenant, session_id, from_cookie=True)


def token_viewer(request: web.Request, token: str) -> tuple[Viewer, str | None] | None:
    """The viewer a bearer token (or a signed-in token) stands for, and its key hash."""
    expected = request.app[SETTINGS].operator_token
    if not token or not is_utf8(token) or expected is None:
        return None
    register_secret(token)
    session_id = hashlib.sha256(b"bearer\x00" + token.encode()).hexdigest()
    if hmac.compare_digest(token.encode(), expected.encode()):
        return Viewer(None, session_id, from_cookie=False), None
    key_hash = hash_key(token)
    policy = request.app[POLICIES].resolve(token)
    if policy is None or key_hash not in policy.api_keys:
        return None  # only keys a policy lists; passthrough callers have no tenant to see
    return Viewer(policy.tenant, session_id, from_cookie=False), key_hash


async def viewer_of(request: web.Request) -> Viewer | None:
    """Who sent the request; a bearer token is checked through the throttle."""
    token = bearer_token(request)
    if token is not None:
        found = checked_token(request, token)
        return found[0] if found is not None else None
    cookie = request.cookies.get(COOKIE)
    return await _session_viewer(request, cookie) if cookie else None


def checked_token(request: web.Request, token: str) -> tuple[Viewer, str | None] | None:
    """token_viewer behind the sign-in throttle: a 429 once the client address (or every
    address together) failed too often, and a failure counted otherwise."""
    throttle = request.app[THROTTLE]
    address = client_address(request)
    now = request.app[CLOCK].now().timestamp()
    wait = throttle.retry_after(address, now)
    if wait is not None:
        raise _too_many(wait)
    found = token_viewer(request, token)
    if found is None:
        throttle.failed(address, now)
    return found


# --- the sign-in throttle, and what trusted proxies say -------------------------------------


class LoginThrottle:
    """Failed token checks over a sliding window, per client address and in all.

    Once an address has `per_address` failures in the last `window` seconds it is refused
    until the oldest of them leaves the window; once all addresses together have
    `overall`, everyone is. A refused attempt is not counted, so at most `overall`
    failures are held, whatever the number of addresses."""

    def __init__(self, per_address: int, overall: int, window: float) -> None:
        self.per_address, self.overall, self.window = per_address, overall, window
        self._all: deque[tuple[float, str]] = deque()
        self._by_address: dict[str, deque[float]] = {}

    def retry_after(self, address: str, now: float) -> int | None:
        """Seconds until `address` may try again, or None when it may now."""
        self._forget(now)
        waits = []
        mine = self._by_address.get(address)
        if mine is not None and len(mine) >= self.per_address:
            waits.append(mine[-self.per_address] + self.window - now)
        if len(self._all) >= self.overall:
            waits.append(self._all[-self.overall][0] + self.window - now)
        return max(1, math.ceil(max(waits))) if waits else None

    def failed(self, address: str, now: float) -> None:
        self._all.append((now, address))
        self._by_address.setdefault(address, deque()).append(now)

    def _forget(self, now: float) -> None:
        while self._all and self._all[0][0] <= now - self.window:
            _, address = self._all.popleft()
            mine = self._by_address[address]
            mine.popleft()
            if not mine:
                del self._by_address[address]


THROTTLE = web.AppKey("inspector_throttle", LoginThrottle)
TRUSTED = web.AppKey("inspector_trusted_proxies", tuple)  # of ip_network: trusted_proxies


def _address(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address((text or "").strip())
    except ValueError:
        return None


def _trusted(request: web.Request, text: str | None) -> bool:
    address = _address(text)
    return address is not None and any(address in net for net in request.app[TRUSTED])


def client_address(request: web.Request) -> str:
    """Whom a failed sign-in counts against: the peer, or, when the peer is a trusted
    proxy, the nearest X-Forwarded-For hop that is not one. IPv6 counts by its /64."""
    chosen = request.remote or ""
    if _trusted(request, chosen):
        hops = [hop.strip() for hop in request.headers.get("X-Forwarded-For", "").split(",")]
        for hop in reversed([h for h in hops if h]):
            chosen = hop
            if not _trusted(request, hop):
                break
    address = _address(chosen)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address) if address is not None else chosen[:64]


def cookie_secure(request: web.Request) -> bool:
    """The Secure flag of the session cookie (`inspector_cookie_secure`)."""
    setting = request.app[SETTINGS].inspector_cookie_secure
    if setting != "auto":
        return setting == "always"
    if request.secure:
        return True
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return forwarded == "https" and _trusted(request, request.remote)


def _too_many(wait: int) -> _HtmlAnswer:
    answer = _page(
        429,
        inspector_html.message_page(
            "Too many failed sign-ins", f"Too many failed sign-ins: try again in {wait} s."
        ),
    )
    answer.response.headers["Retry-After"] = str(wait)
    return answer


# --- query parameters ---------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One query parameter a page takes: text up to `longest` characters, or an integer
    in [low, high]. An empty value is the same as none."""

    kind: Literal["text", "int"] = "text"
    longest: int = TEXT_PARAM_MAX
    low: int = 0
    high: int = MAX_SEQ


_DIGITS = re.compile(r"[0-9]{1,19}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def checked_value(name: str, value: str, param: Param) -> str | int:
    """The value of one parameter, or a 400 page naming it and what it must be."""
    if param.kind == "int":
        if not _DIGITS.fullmatch(value) or not param.low <= int(value) <= param.high:
            raise _bad_request(f"{name} must be an integer from {param.low} to {param.high}.")
        return int(value)
    if len(value) > param.longest:
        raise _bad_request(f"{name} is longer than {param.longest} characters.")
    if not is_utf8(value) or _CONTROL.search(value):
        raise _bad_request(f"{name} holds invalid UTF-8 or a control character.")
    return value


def query_values(request: web.Request, params: Mapping[str, Param]) -> dict[str, str | int]:
    """The page's query parameters, each checked (absent and empty ones left out); an
    unknown or repeated parameter is a 400 too."""
    values: dict[str, str | int] = {}
    for name in request.query:
        if name not in params:
            raise _bad_request(f"Unknown query parameter {name[:64]!r}.")
        given = request.query.getall(name)
        if len(given) > 1:
            raise _bad_request(f"Query parameter {name} is given more than once.")
        if given[0].strip():
            values[name] = checked_value(name, given[0].strip(), params[name])
    return values


def _text(values: Mapping[str, str | int], name: str) -> str:
    value = values.get(name, "")
    return value if isinstance(value, str) else str(value)


def _bad_request(problem: str) -> _HtmlAnswer:
    return _page(400, inspector_html.message_page("Bad request", problem))


def csrf_token(request: web.Request, viewer: Viewer) -> str:
    return _sign(request.app, b"csrf\x00" + viewer.session_id.encode())


def _check_csrf(request: web.Request, viewer: Viewer, form: Any) -> None:
    """A cookie session's POST must carry the session's CSRF token. A bearer request needs
    none: a browser never adds an Authorization header to a cross-site request."""
    if not viewer.from_cookie:
        return
    given = str(form.get("csrf", ""))
    if not hmac.compare_digest(_bytes(given), csrf_token(request, viewer).encode()):
        raise _page(403, inspector_html.message_page("Forbidden", "Missing or wrong CSRF token."))


# --- responses ----------------------------------------------------------------------------


class _HtmlAnswer(Exception):
    """Carries a finished HTML answer (a 403, 404, 409) out of a page handler."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def _html(body: str, status: int = 200) -> web.Response:
    response = web.Response(status=status, text=body, content_type="text/html")
    response.headers.update(inspector_html.SECURITY_HEADERS)
    return response


def _page(status: int, body: str) -> _HtmlAnswer:
    return _HtmlAnswer(_html(body, status))


Page = Callable[[web.Request, Viewer], Awaitable[web.Response]]


def _guarded(page: Page) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        try:
            viewer = await viewer_of(request)
            if viewer is None:  # nothing of the store in it: a pointer to the sign-in form
                return _html(inspector_html.unauthorized_page(), 401)
            return await page(request, viewer)
        except _HtmlAnswer as answer:
            return answer.response

    return handler


def _not_found(what: str) -> _HtmlAnswer:
    return _page(404, inspector_html.message_page("Not found", what))


def _redirect(location: str) -> web.Response:
    response = web.Response(status=303, headers={"Location": location})
    response.headers.update(inspector_html.SECURITY_HEADERS)
    return response


# --- pages --------------------------------------------------------------------------------


async def threads_page(request: web.Request, viewer: Viewer) -> web.Response:
    """Threads, newest first; `q` finds a thread by id; operators filter by `tenant` (its
    passthrough callers included) or `namespace` (one caller's)."""
    store: ThreadStore = request.app[STORE]
    values = query_values(request, THREADS_PARAMS)
    query = _text(values, "q")
    scope = viewer.scope(_text(values, "tenant") or None, _text(values, "namespace") or None)
    if query:
        found = await _find(request, query, scope)
        threads = [admin.thread_json(t) for t in found]
    else:
        threads = await admin.list_threads(store, scope, THREADS_LIMIT)
    tenants = request.app[POLICIES].tenants() if viewer.tenant is None else []
    return _html(
        inspector_html.threads_page(
            threads,
            query=query,
            tenant=scope.tenant,
            namespace=scope.namespace if viewer.tenant is None else None,
            tenants=tenants,
            chrome=_chrome(request, viewer),
        )
    )


async def _find(request: web.Request, thread_id: str, scope: Scope) -> list[Thread]:
    store: ThreadStore = request.app[STORE]
    if scope.namespace is not None:
        thread = await store.get_thread(scope.namespace, thread_id)
        return [thread] if thread is not None else []
    return [t for t in await store.find_threads(thread_id) if scope.matches(t.tenant)]


async def thread_page(request: web.Request, viewer: Viewer) -> web.Response:
    """The timeline of one thread: ?namespace=N&id=ID (`tenant=N` in older links)."""
    values = query_values(request, THREAD_PARAMS)
    tenant = _text(values, "namespace") or _text(values, "tenant")
    thread_id = _text(values, "id")
    first = values.get("from")
    if not tenant or not thread_id or not viewer.may_see(tenant):
        raise _not_found("No such thread.")
    pins = _pin_patterns(request, tenant)
    try:
        shown = await admin.show_thread(
            request.app[STORE],
            thread_id,
            tenant,
            pin_patterns=pins,
            detail=True,
            first_seq=first if isinstance(first, int) else None,
            max_items=PAGE_ITEMS,
        )
    except admin.AdminError:
        raise _not_found("No such thread.") from None
    ledger = await admin.ledger_for_calls(
        request.app[STORE], tenant, [c for item in shown["log"] for c in item["call_ids"]]
    )
    explained: ExplainStore = request.app[STORE]
    records = await explained.explain_for_thread(tenant, thread_id, limit=RECENT_REQUESTS)
    requests = [r.record for r in records]
    return _html(
        inspector_html.thread_page(
            shown, ledger, requests, chrome=_chrome(request, viewer), page_items=PAGE_ITEMS
        )
    )


async def request_page(request: web.Request, viewer: Viewer) -> web.Response:
    """What one model request sent: the token bar, its blocks, the stand-ins, the ledger."""
    query_values(request, {})
    request_id = str(checked_value("request id", request.match_info["request_id"], REQUEST_ID))
    found = await explain.find_record(request.app, viewer.tenant, request_id)
    if found is None:
        raise _not_found("No explain record with this id (they are kept for a while only).")
    return _html(
        inspector_html.request_page(
            found.record,
            tenant=found.tenant,
            stood_for=await _stood_for(request, found.tenant, found.record),
            chrome=_chrome(request, viewer),
        )
    )


def _pin_patterns(request: web.Request, namespace: str) -> tuple[str, ...]:
    policy = request.app[POLICIES].get(namespace.partition(":")[0])
    return tuple(policy.memory.pin_patterns) if policy is not None else ()


async def _stood_for(
    request: web.Request, tenant: str, record: Mapping[str, Any]
) -> dict[int, int | None]:
    """By block index, what each summary block of a thread's request stands for, read
    from the thread's log (admin.stood_for_tokens)."""
    thread_id = record.get("thread_id")
    if not isinstance(thread_id, str):
        return {}
    pins = _pin_patterns(request, tenant)
    return {
        index: await admin.stood_for_tokens(
            request.app[STORE], tenant, thread_id, int(block["last"]), pins
        )
        for index, block in enumerate(record["projection"]["blocks"])
        if block["kind"] == "summary"
    }


async def ledger_page(request: web.Request, viewer: Viewer) -> web.Response:
    """Tool calls whose outcome nobody reported (status issued), each with a resolve form."""
    values = query_values(request, LEDGER_PARAMS)
    entries = await admin.ledger_list(
        request.app[STORE], viewer.scope(None, None), "issued", LEDGER_LIMIT
    )
    return _html(
        inspector_html.ledger_page(
            entries, resolved=_text(values, "resolved") or None, chrome=_chrome(request, viewer)
        )
    )


async def resolve_entry(request: web.Request, viewer: Viewer) -> web.Response:
    """POST: settles an `issued` entry as completed (with its result) or failed."""
    form = await request.post()
    _check_csrf(request, viewer, form)
    scope, key = (str(form.get(name, "")) for name in ("scope", "key"))
    tenant = str(form.get("namespace") or form.get("tenant", ""))  # `tenant`: older pages
    status = str(form.get("status", ""))
    result = str(form.get("result", "")) or None
    if not viewer.may_see(tenant):
        raise _not_found("No such ledger entry.")
    if status not in ("completed", "failed"):
        raise _page(400, inspector_html.message_page("Bad request", "Choose completed or failed."))
    try:
        await admin.ledger_resolve(
            request.app[STORE],
            tenant,
            scope,
            key,
            "completed" if status == "completed" else "failed",
            result if status == "completed" else None,
        )
    except admin.AdminError as exc:
        raise _page(409, inspector_html.message_page("Not resolved", str(exc))) from None
    return _redirect(f"{PREFIX}/ledger?resolved={inspector_html.quoted(key)}")


async def login_form(request: web.Request) -> web.Response:
    try:
        query_values(request, {})
    except _HtmlAnswer as answer:
        return answer.response
    return _html(inspector_html.login_page(failed=False))


async def login(request: web.Request) -> web.Response:
    """POST token=...: a stored session and its signed cookie, then the threads list."""
    form = await request.post()
    try:
        found = checked_token(request, str(form.get("token", "")).strip())
    except _HtmlAnswer as answer:
        return answer.response
    if found is None:
        return _html(inspector_html.login_page(failed=True), status=401)
    viewer, key_hash = found
    response = _redirect(f"{PREFIX}/")
    response.set_cookie(
        COOKIE,
        await new_session(request.app, viewer.tenant, key_hash),
        max_age=SESSION_SECONDS,
        path=f"{PREFIX}/",
        httponly=True,
        samesite="Strict",
        secure=cookie_secure(request),
    )
    return response


async def logout(request: web.Request, viewer: Viewer) -> web.Response:
    """Ends the session in the store (every worker and replica), then drops the cookie."""
    _check_csrf(request, viewer, await request.post())
    if viewer.from_cookie:
        store: InspectorSessionStore = request.app[STORE]
        await store.inspector_session_revoke(_id_hash(viewer.session_id))
    response = _redirect(f"{PREFIX}/login")
    response.del_cookie(COOKIE, path=f"{PREFIX}/")
    return response


def _chrome(request: web.Request, viewer: Viewer) -> inspector_html.Chrome:
    return inspector_html.Chrome(
        who=(
            "operator (every tenant)"
            if viewer.tenant is None
            else f"tenant {inspector_html.tenant_label(viewer.tenant)}"
        ),
        csrf=csrf_token(request, viewer),
        signed_in=viewer.from_cookie,
    )


async def _to_index(request: web.Request) -> web.Response:
    return _redirect(f"{PREFIX}/")


THREADS_PARAMS = {"q": Param(), "tenant": Param(), "namespace": Param()}
THREAD_PARAMS = {
    "namespace": Param(),
    "tenant": Param(),
    "id": Param(),
    "from": Param("int"),
}
LEDGER_PARAMS = {"resolved": Param()}
REQUEST_ID = Param(longest=256)  # the request page's path part


async def _revoke_other_tokens(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: at start, the sessions of another operator token (and the expired)
    leave the store, so a token changed and changed back does not revive them."""
    try:
        store: InspectorSessionStore = app[STORE]
        purged = await store.inspector_sessions_purge(
            now=app[CLOCK].iso(), signing_key=_signing_key(app)
        )
    except StoreUnavailable as exc:  # they are refused anyway: their signing key differs
        log.warning("inspector_sessions_purge_failed", error=str(exc))
    else:
        if purged:
            log.info("inspector_sessions_purged", count=purged)
    yield


def add_routes(app: web.Application) -> None:
    """The inspector's routes; none at all unless `operator_token` is set (so 404)."""
    settings = app[SETTINGS]
    token = settings.operator_token
    if token is None:
        return
    register_secret(token)
    app[THROTTLE] = LoginThrottle(
        LOGIN_FAILURES_PER_ADDRESS, LOGIN_FAILURES_OVERALL, LOGIN_WINDOW_SECONDS
    )
    app[TRUSTED] = tuple(ipaddress.ip_network(net) for net in settings.trusted_proxies)
    app.cleanup_ctx.append(_revoke_other_tokens)
    router = app.router
    router.add_get(PREFIX, _to_index, name="ui.root")
    router.add_get(f"{PREFIX}/", _guarded(threads_page), name="ui.threads")
    router.add_get(f"{PREFIX}/thread", _guarded(thread_page), name="ui.thread")
    router.add_get(f"{PREFIX}/requests/{{request_id}}", _guarded(request_page), name="ui.request")
    router.add_get(f"{PREFIX}/ledger", _guarded(ledger_page), name="ui.ledger")
    router.add_post(f"{PREFIX}/ledger/resolve", _guarded(resolve_entry), name="ui.ledger.resolve")
    router.add_get(f"{PREFIX}/login", login_form, name="ui.login")
    router.add_post(f"{PREFIX}/login", login, name="ui.login.post")
    router.add_post(f"{PREFIX}/logout", _guarded(logout), name="ui.logout")
