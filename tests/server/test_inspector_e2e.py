"""The thread inspector at /threadkeeper/ui/ through the real socket: off without an
operator token, 401 with no page content for anyone without a valid token or session,
tenant keys confined to their tenant, signed cookies and CSRF tokens checked, hostile
thread text shown as text. The browser test is test_inspector_browser.py."""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from proxy import admin
from proxy.clock import ManualClock
from proxy.fake_provider import Reply
from proxy.server import inspector as inspector_module
from proxy.server.state import POLICIES, STORE

from .conftest import TENANT_KEY, Proxy
from .test_explain_e2e import written
from .test_ledger_e2e import CHAT_TOOLS, REFUND, tools_policy
from .test_stateful_responses_e2e import tool_turn

OPERATOR = "op-token-0123456789abcdef"
OTHER_KEY = "sk-tk-globex-test-key"
WINDOW = 6000
HOSTILE = '<script>document.title="pwned"</script><img src=x onerror=alert(1)>'
UI = "/threadkeeper/ui"


@dataclass
class Seeded:
    thread_id: str
    request_id: str  # the last model request on the thread


async def seed_thread(proxy: Proxy, thread_id: str = "t-orders", turns: int = 8) -> Seeded:
    """A chat thread driven past its window (cut and summarized), with hostile text in
    its first message and, on its last turn, a guarded refund call left `issued`."""
    client = proxy.client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    headers = {"X-Thread-Id": thread_id}
    for turn in range(turns):
        proxy.provider.script.append(Reply(text=f"Noted order ORD-{turn}. " + "detail " * 400))
        text = (HOSTILE if turn == 0 else "") + f"Order ORD-{turn}: " + "words " * 400
        messages.append({"role": "user", "content": text})
        reply = await client.chat.completions.create(
            model="gpt-4o", messages=messages, extra_headers=headers
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    proxy.provider.script.append(Reply(tool_calls=[REFUND]))
    messages.append({"role": "user", "content": "Refund ORD-1 please"})
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=messages, tools=CHAT_TOOLS, extra_headers=headers
    )
    assert raw.parse().choices[0].message.tool_calls
    await written(proxy)
    return Seeded(thread_id, raw.headers["x-threadkeeper-request-id"])


def add_globex(proxy: Proxy) -> None:
    """A second keyed tenant, so isolation is between two real tenants."""
    key_hash = hashlib.sha256(OTHER_KEY.encode()).hexdigest()
    (proxy.policies_dir / "globex.yaml").write_text(
        f'tenant: globex\napi_keys: ["{key_hash}"]\nmodels:\n'
        '  "*": {context_window: 128000, max_output_tokens: 4096}\n'
    )
    proxy.app[POLICIES].reload()  # type: ignore[index]


async def inspector(
    make_proxy: Callable[..., Awaitable[Proxy]], store_url: str | None = None
) -> Proxy:
    return await make_proxy(
        window=WINDOW,
        acme_extra=tools_policy(),
        store_url=store_url,
        settings={"operator_token": OPERATOR},
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "the page carries a CSRF token"
    return found.group(1)


async def test_the_inspector_is_off_without_an_operator_token(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await make_proxy()
    async with proxy.http() as http:
        for path in (f"{UI}/", f"{UI}/login", f"{UI}/ledger", f"{UI}/requests/req_x"):
            answer = await http.get(path, headers=bearer(TENANT_KEY))
            assert answer.status_code == 404, path
        assert (await http.post(f"{UI}/login", data={"token": "x"})).status_code == 404


async def test_no_or_wrong_token_is_401_with_no_page_content(
    make_proxy: Callable[..., Awaitable[Proxy]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 12 wrong tokens from one address: more than the throttle lets through (tested below)
    monkeypatch.setattr(inspector_module, "LOGIN_FAILURES_PER_ADDRESS", 50)
    proxy = await inspector(make_proxy)
    seeded = await seed_thread(proxy)
    thread = f"{UI}/thread?tenant=acme&id={seeded.thread_id}"
    pages = (f"{UI}/", thread, f"{UI}/requests/{seeded.request_id}", f"{UI}/ledger")
    async with proxy.http() as http:
        for path in pages:
            for headers in (
                {},
                bearer("wrong-token"),
                bearer(OPERATOR + "x"),
                bearer("sk-unknown-key"),  # the default policy allows unknown keys for the API
                {"Authorization": f"Basic {OPERATOR}"},
            ):
                answer = await http.get(path, headers=headers)
                assert answer.status_code == 401, (path, headers)
                body = answer.text
                for secret in ("ORD-", seeded.thread_id, seeded.request_id, "refund"):
                    assert secret not in body, (path, secret)
                assert f'href="{UI}/login"' in body
        resolve = await http.post(
            f"{UI}/ledger/resolve",
            data={"tenant": "acme", "scope": "tenant", "key": "refund:ORD-1", "status": "failed"},
        )
        assert resolve.status_code == 401
        answer = await http.get(f"{UI}/ledger", headers=bearer(OPERATOR))
        assert 'data-key="refund:ORD-1" data-status="issued"' in answer.text, "store unchanged"


async def test_operator_sees_every_tenant_and_a_tenant_key_only_its_own(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy)
    add_globex(proxy)
    seeded = await seed_thread(proxy)
    thread = f"{UI}/thread?tenant=acme&id={seeded.thread_id}"
    request = f"{UI}/requests/{seeded.request_id}"
    async with proxy.http() as http:
        for token in (OPERATOR, TENANT_KEY):
            listed = await http.get(f"{UI}/", headers=bearer(token))
            assert listed.status_code == 200 and seeded.thread_id in listed.text
            for path in (thread, request):
                assert (await http.get(path, headers=bearer(token))).status_code == 200, path
        assert 'list="tenants"' in (await http.get(f"{UI}/", headers=bearer(OPERATOR))).text
        for path in (thread, request, f"{UI}/?tenant=acme", f"{UI}/?q={seeded.thread_id}"):
            answer = await http.get(path, headers=bearer(OTHER_KEY))
            assert "ORD-" not in answer.text and seeded.request_id not in answer.text, path
            if path in (thread, request):
                assert answer.status_code == 404, path
            else:
                assert 'id="no-threads"' in answer.text, path
        ledger = await http.get(f"{UI}/ledger", headers=bearer(OTHER_KEY))
        assert ledger.status_code == 200 and "refund:ORD-1" not in ledger.text
        forged = await http.post(
            f"{UI}/ledger/resolve",
            headers=bearer(OTHER_KEY),  # a bearer request needs no CSRF token: no browser sends one
            data={
                "tenant": "acme",
                "scope": "tenant",
                "key": "refund:ORD-1",
                "status": "failed",
            },
        )
        assert forged.status_code == 404, "a tenant key cannot settle another tenant's entry"
        answer = await http.get(f"{UI}/ledger", headers=bearer(OPERATOR))
        assert 'data-key="refund:ORD-1" data-status="issued"' in answer.text


async def test_login_cookie_session_csrf_and_logout(
    store_url: str,  # before make_proxy: a PostgreSQL schema outlives the proxy
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy, store_url)
    await seed_thread(proxy)
    async with proxy.http() as http:
        form = await http.get(f"{UI}/login")
        assert form.status_code == 200 and 'name="token"' in form.text
        refused = await http.post(f"{UI}/login", data={"token": "nope"})
        assert refused.status_code == 401 and "set-cookie" not in refused.headers
        signed = await http.post(f"{UI}/login", data={"token": OPERATOR})
        assert signed.status_code == 303 and signed.headers["location"] == f"{UI}/"
        cookie = signed.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert OPERATOR not in cookie, "the cookie holds a signed session, not the token"
        value = http.cookies["threadkeeper_session"]

        ledger = await http.get(f"{UI}/ledger")
        assert ledger.status_code == 200 and "refund:ORD-1" in ledger.text
        entry = {"tenant": "acme", "scope": "tenant", "key": "refund:ORD-1"}
        missing = await http.post(f"{UI}/ledger/resolve", data={**entry, "status": "failed"})
        assert missing.status_code == 403
        wrong = await http.post(
            f"{UI}/ledger/resolve", data={**entry, "status": "failed", "csrf": "0" * 64}
        )
        assert wrong.status_code == 403
        still = await http.get(f"{UI}/ledger")
        assert 'data-key="refund:ORD-1" data-status="issued"' in still.text

        for tampered in (
            value[:-1] + ("0" if value[-1] != "0" else "1"),  # signature changed
            "x" + value,  # payload changed
            value.partition(".")[0],  # no signature
            OPERATOR,  # the token itself is no session
        ):
            http.cookies.clear()
            http.cookies.set("threadkeeper_session", tampered)
            answer = await http.get(f"{UI}/ledger")
            assert answer.status_code == 401 and "refund" not in answer.text
        http.cookies.clear()
        raw = b"threadkeeper_session=\xff\xfe." + value.partition(".")[2].encode()
        answer = await http.get(f"{UI}/ledger", headers={"Cookie": raw})  # type: ignore[dict-item]
        assert answer.status_code == 401, "undecodable cookie bytes are no session, not a 500"

        http.cookies.clear()
        assert (await http.post(f"{UI}/login", data={"token": OPERATOR})).status_code == 303
        page = (await http.get(f"{UI}/ledger")).text
        resolved = await http.post(
            f"{UI}/ledger/resolve",
            data={**entry, "status": "completed", "result": "refunded", "csrf": csrf_of(page)},
        )
        assert resolved.status_code == 303
        assert (await http.get(resolved.headers["location"])).status_code == 200
        shown = await http.get(f"{UI}/thread?tenant=acme&id=t-orders")
        assert 'data-key="refund:ORD-1" data-status="completed"' in shown.text
        assert shown.text.count('<a href="/threadkeeper/ui/requests/req_') == 9, "every turn"
        again = await http.post(
            f"{UI}/ledger/resolve",
            data={**entry, "status": "failed", "csrf": csrf_of(page)},
        )
        assert again.status_code == 409, "only an issued entry resolves"

        out = await http.post(f"{UI}/logout", data={"csrf": csrf_of(page)})
        assert out.status_code == 303 and out.headers["location"] == f"{UI}/login"
        assert (await http.get(f"{UI}/")).status_code == 401


async def test_a_tenant_session_ends_when_its_key_is_revoked(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy)
    add_globex(proxy)
    async with proxy.http() as http:
        signed = await http.post(f"{UI}/login", data={"token": OTHER_KEY})
        assert signed.status_code == 303
        page = await http.get(f"{UI}/")
        assert page.status_code == 200 and "tenant globex" in page.text
        assert 'list="tenants"' not in page.text, "no tenant filter for a tenant"
        (proxy.policies_dir / "globex.yaml").write_text(
            'tenant: globex\napi_keys: []\nmodels:\n  "*": {context_window: 128000}\n'
        )
        proxy.app[POLICIES].reload()  # type: ignore[index]
        assert (await http.get(f"{UI}/")).status_code == 401


async def test_hostile_thread_text_is_shown_as_text(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy)
    seeded = await seed_thread(proxy, thread_id='t-<b>"x"</b>')
    async with proxy.http() as http:
        listed = await http.get(f"{UI}/", headers=bearer(OPERATOR))
        assert "<b>" not in listed.text and "t-&lt;b&gt;&quot;x&quot;&lt;/b&gt;" in listed.text
        shown = await http.get(
            f"{UI}/thread",
            params={"tenant": "acme", "id": seeded.thread_id},
            headers=bearer(OPERATOR),
        )
        assert shown.status_code == 200
        assert "<script>document.title" not in shown.text and "<img src=x" not in shown.text
        assert "&lt;script&gt;document.title=&quot;pwned&quot;&lt;/script&gt;" in shown.text
        # the one script of the page is the inspector's own, allowed by hash
        assert shown.text.count("<script>") == 1
        assert "script-src 'sha256-" in shown.headers["content-security-policy"]
        request = await http.get(f"{UI}/requests/{seeded.request_id}", headers=bearer(OPERATOR))
        assert request.status_code == 200 and request.text.count("<script>") == 1
        assert "<b>" not in request.text


async def test_unknown_ids_are_404_pages(make_proxy: Callable[..., Awaitable[Proxy]]) -> None:
    proxy = await inspector(make_proxy)
    async with proxy.http() as http:
        bare = await http.get(UI)
        assert (bare.status_code, bare.headers["location"]) == (303, f"{UI}/")
        for path in (f"{UI}/requests/req_nope", f"{UI}/thread?tenant=acme&id=nope", f"{UI}/thread"):
            answer = await http.get(path, headers=bearer(OPERATOR))
            assert answer.status_code == 404 and "text/html" in answer.headers["content-type"]


async def test_a_session_expires_after_twelve_hours(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    clock = ManualClock()
    proxy = await make_proxy(settings={"operator_token": OPERATOR}, clock=clock)
    async with proxy.http() as http:
        assert (await http.post(f"{UI}/login", data={"token": OPERATOR})).status_code == 303
        clock.advance(timedelta(hours=11, minutes=59))
        assert (await http.get(f"{UI}/")).status_code == 200
        clock.advance(timedelta(minutes=2))
        assert (await http.get(f"{UI}/")).status_code == 401


async def test_changing_the_operator_token_ends_every_session(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    first = await make_proxy(settings={"operator_token": OPERATOR})
    second = await make_proxy(settings={"operator_token": OPERATOR + "-rotated"})
    async with first.http() as http:
        assert (await http.post(f"{UI}/login", data={"token": OPERATOR})).status_code == 303
        cookie = http.cookies["threadkeeper_session"]
    async with second.http() as http:
        http.cookies.set("threadkeeper_session", cookie)
        assert (await http.get(f"{UI}/")).status_code == 401


async def test_compressed_tool_results_expand_to_the_original(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy)
    client = proxy.client()
    conversation = await client.conversations.create()
    store = proxy.app[STORE]  # type: ignore[index]
    for turn in range(14):
        await client.responses.create(
            model="gpt-4o", conversation=conversation.id, input=tool_turn(turn)
        )
        shown = await admin.show_thread(store, conversation.id, "acme")
        if shown["compressed"]:
            break
    assert shown["compressed"], "a tool result was compressed"
    compressed = shown["compressed"][0]
    original = next(e for e in shown["log"] if e["seq"] == compressed["seq"])
    async with proxy.http() as http:
        page = await http.get(
            f"{UI}/thread",
            params={"tenant": "acme", "id": conversation.id},
            headers=bearer(OPERATOR),
        )
    item = re.search(
        rf'<li class="item[^"]* compressed" data-seq="{compressed["seq"]}".*?</li>', page.text, re.S
    )
    assert item, "the compressed item is marked"
    assert f"compressed {compressed['original_tokens']} → {compressed['tokens']} tokens" in item[0]
    sent_form = re.search(r'class="compressed-form">.*?<pre>(.*?)</pre>', item[0], re.S)
    assert sent_form and html.unescape(sent_form[1]) == compressed["text"]
    full = re.search(r'<pre class="full-text">(.*?)</pre>', item[0], re.S)
    assert full and "shipment event 59" in html.unescape(full[1])
    assert original["tokens"] == compressed["original_tokens"]


async def test_pinned_items_are_marked(make_proxy: Callable[..., Awaitable[Proxy]]) -> None:
    proxy = await inspector(make_proxy)
    messages = [
        {"role": "system", "content": "You quote prices."},
        {"role": "user", "content": "All prices in EUR, please."},  # acme's pin pattern
    ]
    proxy.provider.script.append(Reply(text="Understood."))
    await proxy.client().chat.completions.create(
        model="gpt-4o", messages=messages, extra_headers={"X-Thread-Id": "t-pins"}
    )
    messages += [
        {"role": "assistant", "content": "Understood."},
        {"role": "user", "content": "What does ORD-1 cost?"},
    ]
    proxy.provider.script.append(Reply(text="20 EUR."))
    await proxy.client().chat.completions.create(
        model="gpt-4o", messages=messages, extra_headers={"X-Thread-Id": "t-pins"}
    )
    async with proxy.http() as http:
        page = await http.get(f"{UI}/thread?tenant=acme&id=t-pins", headers=bearer(OPERATOR))
    found = re.findall(r'<li class="([^"]*)" data-seq="(\d+)"', page.text)
    by_seq = {int(seq): cls.split() for cls, seq in found}
    assert by_seq == {
        0: ["item", "pinned"],
        1: ["item", "pinned"],
        2: ["item"],
        3: ["item"],
        4: ["item"],
    }


async def test_a_long_thread_is_paged(
    make_proxy: Callable[..., Awaitable[Proxy]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inspector_module, "PAGE_ITEMS", 5)
    proxy = await inspector(make_proxy)
    seeded = await seed_thread(proxy)  # 19 items
    url = f"{UI}/thread?tenant=acme&id={seeded.thread_id}"
    async with proxy.http() as http:
        last = (await http.get(url, headers=bearer(OPERATOR))).text
        middle = (await http.get(f"{url}&from=7", headers=bearer(OPERATOR))).text
        first = (await http.get(f"{url}&from=0", headers=bearer(OPERATOR))).text
    seqs = [[int(s) for s in re.findall(r'<li class="item[^"]*" data-seq="(\d+)"', page)]
            for page in (last, middle, first)]  # fmt: skip
    assert seqs == [[14, 15, 16, 17, 18], [7, 8, 9, 10, 11], [0, 1, 2, 3, 4]]
    assert 'id="later"' not in last and "from=9" in last  # earlier: from 14 - 5
    assert "from=2" in middle and "from=12" in middle
    assert 'id="earlier"' not in first and "from=5" in first
    start = int(re.search(r'id="cut" data-window-start="(\d+)"', middle)[1])  # type: ignore[index]
    assert 7 < start <= 11 and 'id="cut"' not in first and 'id="cut"' not in last


# --- issue 20 item 7: every query parameter is checked --------------------------------------


async def test_out_of_range_or_malformed_query_parameters_are_400_pages(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy)
    seeded = await seed_thread(proxy, turns=2)
    thread = {"tenant": "acme", "id": seeded.thread_id}
    bad: list[tuple[str, dict[str, str] | str, str]] = [
        (f"{UI}/thread", {**thread, "from": "9223372036854775808"}, "from must be an integer"),
        (f"{UI}/thread", {**thread, "from": "²"}, "from must be an integer"),
        (f"{UI}/thread", {**thread, "from": "-1"}, "from must be an integer"),
        (f"{UI}/thread", {**thread, "from": "1e3"}, "from must be an integer"),
        (f"{UI}/thread", {**thread, "from": "9" * 400}, "from must be an integer"),
        (f"{UI}/thread", {"tenant": "acme\x07", "id": seeded.thread_id}, "tenant holds"),
        (f"{UI}/thread", {"tenant": "acme", "id": "t" * 1025}, "id is longer than 1024"),
        (f"{UI}/thread", {**thread, "page": "2"}, "Unknown query parameter"),
        (f"{UI}/thread", f"tenant=acme&id={seeded.thread_id}&from=1&from=2", "more than once"),
        (f"{UI}/", {"q": "x" * 2000}, "q is longer than 1024"),
        (f"{UI}/", {"tenant": "ac\x1bme"}, "tenant holds"),
        (f"{UI}/ledger", {"resolved": "k\x1fk"}, "resolved holds"),
        (f"{UI}/requests/{seeded.request_id}", {"x": "1"}, "Unknown query parameter"),
        (f"{UI}/requests/{'r' * 300}", {}, "request id is longer than 256"),
        (f"{UI}/login", {"next": "/"}, "Unknown query parameter"),
    ]
    async with proxy.http() as http:
        for path, params, problem in bad:
            answer = await http.get(path, params=params, headers=bearer(OPERATOR))
            assert answer.status_code == 400, (path, params, answer.status_code)
            assert "text/html" in answer.headers["content-type"]
            assert problem in html.unescape(answer.text), (path, params)
        for first in ("9223372036854775807", "0", ""):  # the range's ends, and none
            answer = await http.get(
                f"{UI}/thread", params={**thread, "from": first}, headers=bearer(OPERATOR)
            )
            assert answer.status_code == 200, first
        found = await http.get(f"{UI}/", params={"q": "", "tenant": ""}, headers=bearer(OPERATOR))
        assert found.status_code == 200 and seeded.thread_id in found.text, "the empty form"


# --- issue 20 item 8: the sign-in throttle, server-side sessions, Secure --------------------


def from_address(address: str) -> dict[str, str]:
    return {"X-Forwarded-For": address}


async def test_failed_sign_ins_are_throttled_per_address_then_for_everyone(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    clock = ManualClock()
    proxy = await make_proxy(  # the test talks through a "proxy" at 127.0.0.1
        settings={"operator_token": OPERATOR, "trusted_proxies": ("127.0.0.1",)}, clock=clock
    )
    per_address = inspector_module.LOGIN_FAILURES_PER_ADDRESS
    window = int(inspector_module.LOGIN_WINDOW_SECONDS)
    async with proxy.http() as http:
        statuses = []
        for attempt in range(300):
            answer = await http.post(
                f"{UI}/login", data={"token": f"guess-{attempt}"}, headers=from_address("10.0.0.1")
            )
            statuses.append(answer.status_code)
        assert statuses == [401] * per_address + [429] * (300 - per_address)
        assert answer.headers["retry-after"] == str(window)
        assert "set-cookie" not in answer.headers
        right = await http.post(
            f"{UI}/login", data={"token": OPERATOR}, headers=from_address("10.0.0.1")
        )
        assert right.status_code == 429, "a throttled address is refused before the check"
        page = await http.get(f"{UI}/", headers={**bearer(OPERATOR), **from_address("10.0.0.1")})
        assert page.status_code == 429, "bearer tokens go through the same throttle"
        assert 'id="search"' not in page.text and "Too many failed sign-ins" in page.text
        other = await http.post(
            f"{UI}/login", data={"token": OPERATOR}, headers=from_address("10.0.0.2")
        )
        assert other.status_code == 303, "another address still signs in"
        http.cookies.clear()

        clock.advance(window)  # the failures leave the window
        again = await http.post(
            f"{UI}/login", data={"token": OPERATOR}, headers=from_address("10.0.0.1")
        )
        assert again.status_code == 303
        http.cookies.clear()

        overall = inspector_module.LOGIN_FAILURES_OVERALL
        for attempt in range(overall):  # spread thinly over many addresses
            answer = await http.get(
                f"{UI}/",
                headers={**bearer(f"guess-{attempt}"), **from_address(f"10.1.{attempt}.1")},
            )
            assert answer.status_code == 401, attempt
        fresh = await http.post(
            f"{UI}/login", data={"token": OPERATOR}, headers=from_address("10.2.0.1")
        )
        assert fresh.status_code == 429 and int(fresh.headers["retry-after"]) == window
        clock.advance(window)
        assert (
            await http.post(
                f"{UI}/login", data={"token": OPERATOR}, headers=from_address("10.2.0.1")
            )
        ).status_code == 303


async def test_forwarded_for_from_an_untrusted_peer_does_not_dodge_the_throttle(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await make_proxy(settings={"operator_token": OPERATOR})  # no trusted proxies
    per_address = inspector_module.LOGIN_FAILURES_PER_ADDRESS
    async with proxy.http() as http:
        statuses = [
            (
                await http.post(
                    f"{UI}/login", data={"token": "guess"}, headers=from_address(f"10.9.{n}.1")
                )
            ).status_code
            for n in range(per_address + 5)
        ]
    assert statuses == [401] * per_address + [429] * 5


async def test_sessions_live_in_the_store_shared_by_replicas_and_sign_out_ends_them(
    store_url: str,  # before make_proxy: a PostgreSQL schema outlives the proxy
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    first = await make_proxy(store_url=store_url, settings={"operator_token": OPERATOR})
    second = await make_proxy(store_url=store_url, settings={"operator_token": OPERATOR})
    async with first.http() as http:
        assert (await http.post(f"{UI}/login", data={"token": OPERATOR})).status_code == 303
        cookie = http.cookies["threadkeeper_session"]
        kept = (await http.get(f"{UI}/ledger")).text
    async with second.http() as http:
        http.cookies.set("threadkeeper_session", cookie)
        assert (await http.get(f"{UI}/")).status_code == 200, "a session works on every replica"
        out = await http.post(f"{UI}/logout", data={"csrf": csrf_of(kept)})
        assert out.status_code == 303
    for replica in (first, second):
        async with replica.http() as http:
            http.cookies.set("threadkeeper_session", cookie)  # a copy kept from before
            answer = await http.get(f"{UI}/ledger")
            assert answer.status_code == 401, "signed out everywhere, not just this browser"
    store = first.app[STORE]  # type: ignore[index]
    async with store.db.read() as conn:
        rows = await conn.fetch("SELECT id_hash FROM inspector_sessions")
    assert rows == [], "sign-out deleted the row"


async def test_a_new_operator_token_revokes_the_old_tokens_sessions_in_the_store(
    tmp_path: Any, make_proxy: Callable[..., Awaitable[Proxy]]
) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    before = await make_proxy(store_url=url, settings={"operator_token": OPERATOR})
    async with before.http() as http:
        assert (await http.post(f"{UI}/login", data={"token": OPERATOR})).status_code == 303
        cookie = http.cookies["threadkeeper_session"]
    await make_proxy(store_url=url, settings={"operator_token": OPERATOR + "-rotated"})
    back = await make_proxy(store_url=url, settings={"operator_token": OPERATOR})
    for proxy in (before, back):  # even with the old token back, the session is gone
        async with proxy.http() as http:
            http.cookies.set("threadkeeper_session", cookie)
            assert (await http.get(f"{UI}/")).status_code == 401


@pytest.mark.parametrize(
    ("setting", "trusted", "forwarded", "secure"),
    [
        ("auto", (), None, False),  # plain http straight to the proxy
        ("auto", (), "https", False),  # anyone can send the header: not believed
        ("auto", ("127.0.0.0/8",), "https", True),  # TLS ended by a trusted proxy
        ("auto", ("127.0.0.0/8",), "http", False),
        ("always", (), None, True),
        ("never", ("127.0.0.0/8",), "https", False),
    ],
)
async def test_the_cookie_is_secure_behind_a_trusted_tls_proxy_or_when_configured(
    make_proxy: Callable[..., Awaitable[Proxy]],
    setting: str,
    trusted: tuple[str, ...],
    forwarded: str | None,
    secure: bool,
) -> None:
    proxy = await make_proxy(
        settings={
            "operator_token": OPERATOR,
            "inspector_cookie_secure": setting,
            "trusted_proxies": trusted,
        }
    )
    headers = {"X-Forwarded-Proto": forwarded} if forwarded else {}
    async with proxy.http() as http:
        signed = await http.post(f"{UI}/login", data={"token": OPERATOR}, headers=headers)
    assert signed.status_code == 303
    flags = [part.strip().lower() for part in signed.headers["set-cookie"].split(";")]
    assert ("secure" in flags) is secure, flags


# --- issue 20 item 17: one tenant label, the original size of a summarized block -----------

LABEL = re.compile(r'<span class="tenant">(.*?)</span>')


async def test_every_page_labels_a_tenant_the_same_way(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy)
    await seed_thread(proxy, turns=1)
    caller = proxy.client(api_key="sk-passthrough-caller-key")  # a key no policy lists
    proxy.provider.script.append(Reply(text="Hello."))
    raw = await caller.chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Hi"}],
        extra_headers={"X-Thread-Id": "t-pass"},
    )
    request_id = raw.headers["x-threadkeeper-request-id"]
    await written(proxy)
    (stored,) = await proxy.app[STORE].find_threads("t-pass")  # type: ignore[index]
    label = html.escape(inspector_module.inspector_html.tenant_label(stored.tenant))
    async with proxy.http() as http:
        listed = (await http.get(f"{UI}/", headers=bearer(OPERATOR))).text
        row = re.search(r'<tr data-thread="t-pass"[^>]*>.*?</tr>', listed, re.S)
        assert row and LABEL.findall(row[0]) == [label]
        link = html.unescape(re.search(r'href="([^"]+)"', row[0])[1])  # type: ignore[index]
        thread = await http.get(link, headers=bearer(OPERATOR))
        assert thread.status_code == 200 and LABEL.findall(thread.text) == [label]
        request = await http.get(f"{UI}/requests/{request_id}", headers=bearer(OPERATOR))
        assert request.status_code == 200 and LABEL.findall(request.text) == [label]
        back = re.search(r'id="thread-link" href="([^"]+)"', request.text)
        assert back, "the request page links its thread"
        opened = await http.get(html.unescape(back[1]), headers=bearer(OPERATOR))
        assert opened.status_code == 200 and 'data-seq="0"' in opened.text
        ledger = (await http.get(f"{UI}/ledger", headers=bearer(OPERATOR))).text
        acme = html.escape(inspector_module.inspector_html.tenant_label("acme"))
        assert LABEL.findall(ledger) == [acme]
        assert acme in LABEL.findall(listed)


async def test_a_summarized_block_shows_the_size_of_what_it_stands_for(
    make_proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    proxy = await inspector(make_proxy)
    seeded = await seed_thread(proxy)  # the last request reads the thread's stored cut
    store = proxy.app[STORE]  # type: ignore[index]
    pins = tuple(proxy.app[POLICIES].get("acme").memory.pin_patterns)  # type: ignore[index, union-attr]
    shown = await admin.show_thread(store, seeded.thread_id, "acme", pin_patterns=pins)
    start = shown["window_start"]
    stood_for = sum(e["tokens"] for e in shown["log"] if e["seq"] < start and not e["pinned"])
    async with proxy.http() as http:
        page = (await http.get(f"{UI}/requests/{seeded.request_id}", headers=bearer(OPERATOR))).text
    rows = re.findall(
        r'<tr class="block" data-kind="summary" data-action="summarized" '
        r'data-original="(\d+)" data-sent="(\d+)">',
        page,
    )
    assert len(rows) == 1, page
    original, sent = (int(n) for n in rows[0])
    assert original == stood_for > sent > 0, (original, sent, stood_for)
    assert "<th>Original tokens</th><th>Sent tokens</th>" in page


def test_the_throttle_holds_at_most_the_overall_limit_and_forgets_with_the_window() -> None:
    throttle = inspector_module.LoginThrottle(per_address=3, overall=10, window=60)
    refused = 0
    for n in range(1000):  # 1000 addresses, one guess each
        address = f"10.0.{n // 250}.{n % 250}"
        if throttle.retry_after(address, now=float(n) / 100) is not None:
            refused += 1
            continue
        throttle.failed(address, now=float(n) / 100)
    assert refused == 990 and len(throttle._all) == 10, "refused guesses are not held"
    assert throttle.retry_after("10.9.9.9", now=10.0) == 60 - 10 + 0
    assert throttle.retry_after("10.9.9.9", now=60.1) is None, "the oldest failures aged out"
    for _ in range(3):
        throttle.failed("10.8.0.1", now=100.0)
    assert throttle.retry_after("10.8.0.1", now=130.0) == 30
    assert throttle.retry_after("10.8.0.2", now=130.0) is None
    assert throttle.retry_after("10.8.0.1", now=160.0) is None
    assert throttle._by_address == {} and not throttle._all, "addresses go with their failures"


def test_an_ipv6_client_counts_by_its_64_and_forwarded_hops_only_from_trusted_peers() -> None:
    import ipaddress

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    def address(peer: str, forwarded: str | None, trusted: tuple[str, ...]) -> str:
        app = web.Application()
        app[inspector_module.TRUSTED] = tuple(ipaddress.ip_network(t) for t in trusted)
        headers = {"X-Forwarded-For": forwarded} if forwarded else {}
        request = make_mocked_request("GET", "/", headers=headers, app=app)
        request._transport_peername = (peer, 1234)  # type: ignore[attr-defined]
        return inspector_module.client_address(request)

    assert address("2001:db8:1:2:3:4:5:6", None, ()) == "2001:db8:1:2::/64"
    assert address("::ffff:10.0.0.7", None, ()) == "10.0.0.7"
    assert address("10.0.0.7", "1.2.3.4", ()) == "10.0.0.7", "an untrusted peer's header"
    assert address("10.0.0.7", "1.2.3.4, 10.0.0.9", ("10.0.0.0/8",)) == "1.2.3.4"
    assert address("10.0.0.7", "1.2.3.4, 5.6.7.8", ("10.0.0.0/8",)) == "5.6.7.8"
    assert address("10.0.0.7", None, ("10.0.0.0/8",)) == "10.0.0.7"
