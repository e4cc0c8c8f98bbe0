"""The thread inspector: server-rendered pages at /threadkeeper/ui/ (issue 11 item 3).

Off (every path 404) unless `operator_token` is set. Who may look:

- `Authorization: Bearer <operator_token>` (compared in constant time) sees every tenant;
- a tenant's API key (one a policy file lists) sees its own tenant's threads only;
- a browser signs in at /threadkeeper/ui/login with either and gets a session cookie
  (HttpOnly, SameSite=Strict) holding an HMAC-signed session, never the token itself.
  The signing key is derived from the operator token, so changing the token ends every
  session; a tenant session also ends when its key leaves the policy file.

Anything else gets 401 and no page content. Forms that change state (ledger resolve,
logout) carry a CSRF token derived from the session; a cookie session's POST without the
right one is 403.
The pages reuse the operator functions of proxy/admin.py (the CLI's), so the inspector
and `threadkeeper threads ...` show the same facts. Rendering is in inspector_html.py.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy import admin
from proxy.logs import register_secret
from proxy.namespaces import Scope, tenant_of
from proxy.policy import hash_key
from proxy.server import explain, inspector_html
from proxy.server.auth import bearer_token, is_utf8
from proxy.server.state import CLOCK, POLICIES, SETTINGS, STORE
from proxy.store.base import Thread

PREFIX = "/threadkeeper/ui"
COOKIE = "threadkeeper_session"
SESSION_SECONDS = 12 * 3600
THREADS_LIMIT = 100
LEDGER_LIMIT = 200
PAGE_ITEMS = 200  # timeline items per page: the last ones, or those from ?from=SEQ
RECENT_REQUESTS = 20
SESSION_KEY_CONTEXT = b"threadkeeper-inspector-session-v1"


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


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def session_cookie(app: web.Application, tenant: str | None, key_hash: str | None) -> str:
    """`<payload>.<hmac>`: who (operator, or tenant and its key's hash), a session id, expiry."""
    payload = {
        "tenant": tenant,
        "key": key_hash,
        "sid": secrets.token_hex(16),
        "exp": int(app[CLOCK].now().timestamp()) + SESSION_SECONDS,
    }
    body = _b64(json.dumps(payload, separators=(",", ":")).encode())
    return f"{body}.{_sign(app, body.encode())}"


def _session_viewer(request: web.Request, value: str) -> Viewer | None:
    body, _, signature = value.partition(".")
    if not hmac.compare_digest(_bytes(signature), _sign(request.app, _bytes(body)).encode()):
        return None
    try:
        payload: dict[str, Any] = json.loads(_unb64(body))
    except ValueError:
        return None
    if (
        not isinstance(payload, dict)
        or payload.get("exp", 0) < request.app[CLOCK].now().timestamp()
    ):
        return None
    tenant, key = payload.get("tenant"), payload.get("key")
    if tenant is not None:
        policy = request.app[POLICIES].get(str(tenant))
        if policy is None or key not in policy.api_keys:
            return None  # the key was revoked since the sign-in
    return Viewer(tenant, str(payload.get("sid", "")), from_cookie=True)


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


def viewer_of(request: web.Request) -> Viewer | None:
    token = bearer_token(request)
    if token is not None:
        found = token_viewer(request, token)
        return found[0] if found is not None else None
    cookie = request.cookies.get(COOKIE)
    return _session_viewer(request, cookie) if cookie else None


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
        viewer = viewer_of(request)
        if viewer is None:  # nothing of the store in it: a pointer to the sign-in form only
            return _html(inspector_html.unauthorized_page(), 401)
        try:
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
    store = request.app[STORE]
    query = request.query.get("q", "").strip()
    scope = viewer.scope(
        request.query.get("tenant", "").strip() or None,
        request.query.get("namespace", "").strip() or None,
    )
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
    store = request.app[STORE]
    if scope.namespace is not None:
        thread = await store.get_thread(scope.namespace, thread_id)
        return [thread] if thread is not None else []
    return [t for t in await store.find_threads(thread_id) if scope.matches(t.tenant)]


async def thread_page(request: web.Request, viewer: Viewer) -> web.Response:
    """The timeline of one thread: ?namespace=N&id=ID (`tenant=N` in older links)."""
    tenant = request.query.get("namespace") or request.query.get("tenant", "")
    thread_id = request.query.get("id", "")
    if not tenant or not thread_id or not viewer.may_see(tenant):
        raise _not_found("No such thread.")
    policy = request.app[POLICIES].get(tenant_of(tenant))
    pins = tuple(policy.memory.pin_patterns) if policy is not None else ()
    first = request.query.get("from", "")
    try:
        shown = await admin.show_thread(
            request.app[STORE],
            thread_id,
            tenant,
            pin_patterns=pins,
            detail=True,
            first_seq=int(first) if first.isdigit() else None,
            max_items=PAGE_ITEMS,
        )
    except admin.AdminError:
        raise _not_found("No such thread.") from None
    ledger = await admin.ledger_for_calls(
        request.app[STORE], tenant, [c for item in shown["log"] for c in item["call_ids"]]
    )
    records = await request.app[STORE].explain_for_thread(tenant, thread_id, limit=RECENT_REQUESTS)
    requests = [r.record for r in records]
    return _html(
        inspector_html.thread_page(
            shown, ledger, requests, chrome=_chrome(request, viewer), page_items=PAGE_ITEMS
        )
    )


async def request_page(request: web.Request, viewer: Viewer) -> web.Response:
    """What one model request sent: the token bar, its blocks, the stand-ins, the ledger."""
    request_id = request.match_info["request_id"]
    found = await explain.find_record(request.app, viewer.tenant, request_id)
    if found is None:
        raise _not_found("No explain record with this id (they are kept for a while only).")
    return _html(inspector_html.request_page(found.record, chrome=_chrome(request, viewer)))


async def ledger_page(request: web.Request, viewer: Viewer) -> web.Response:
    """Tool calls whose outcome nobody reported (status issued), each with a resolve form."""
    entries = await admin.ledger_list(
        request.app[STORE], viewer.scope(None, None), "issued", LEDGER_LIMIT
    )
    return _html(
        inspector_html.ledger_page(
            entries, resolved=request.query.get("resolved"), chrome=_chrome(request, viewer)
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
    return _html(inspector_html.login_page(failed=False))


async def login(request: web.Request) -> web.Response:
    """POST token=...: a signed session cookie, then the threads list."""
    form = await request.post()
    found = token_viewer(request, str(form.get("token", "")).strip())
    if found is None:
        return _html(inspector_html.login_page(failed=True), status=401)
    viewer, key_hash = found
    response = _redirect(f"{PREFIX}/")
    response.set_cookie(
        COOKIE,
        session_cookie(request.app, viewer.tenant, key_hash),
        max_age=SESSION_SECONDS,
        path=f"{PREFIX}/",
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return response


async def logout(request: web.Request, viewer: Viewer) -> web.Response:
    _check_csrf(request, viewer, await request.post())
    response = _redirect(f"{PREFIX}/login")
    response.del_cookie(COOKIE, path=f"{PREFIX}/")
    return response


def _chrome(request: web.Request, viewer: Viewer) -> inspector_html.Chrome:
    return inspector_html.Chrome(
        who="operator (every tenant)" if viewer.tenant is None else f"tenant {viewer.tenant}",
        csrf=csrf_token(request, viewer),
        signed_in=viewer.from_cookie,
    )


async def _to_index(request: web.Request) -> web.Response:
    return _redirect(f"{PREFIX}/")


def add_routes(app: web.Application) -> None:
    """The inspector's routes; none at all unless `operator_token` is set (so 404)."""
    token = app[SETTINGS].operator_token
    if token is None:
        return
    register_secret(token)
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
