"""Conversation families for bench/fidelity.py (issue 22): generated, randomized by seed.

Each family is a kind of long agent conversation as it is met in practice (support desk,
coding agent, incident on-call, data analysis, travel, research, CRM, infrastructure).
A seed (`random.Random(seed)`) decides where the planted facts sit (which turn, which
line or record of a tool result), how many look-alike distractors surround them, upper
or lower case for levels and statuses, JSON or text tool results, and Chat or Responses.

Planted facts are what a support agent, an SRE or a coder would need later: the user's
rule given in turn one, the one rare line among frequent ones, the value a later turn
refers to (by position or description, not by quoting it), the outlier in a series, an
id in a list. They were written from the work, not from the compressor: this module was
written without reading proxy/core/compress.py or memory.py, and no generator may be
shaped to what they keep.

Seeds 1-5 are the tuning set. Seeds 100-119 are the held-out set: no heuristic is
adjusted against them; a change is tuned on 1-5 and only measured on 100-119.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Api = Literal["chat", "responses"]
Kind = Literal["must", "nice"]
JsonDict = dict[str, Any]

# The window of each scenario's model (the policy's `models` section).
WINDOWS = {"gpt-4.1-mini": 8000, "gpt-4.1": 10000, "gpt-4o-mini": 12000, "gpt-4o": 16000}

TUNING_SEEDS = tuple(range(1, 6))
HELDOUT_SEEDS = tuple(range(100, 120))


@dataclass(frozen=True)
class Call:
    call_id: str
    name: str
    arguments: JsonDict
    output: str  # what the client's tool returns


@dataclass(frozen=True)
class Turn:
    user: str
    steps: tuple[tuple[Call, ...] | str, ...]  # tool calls (answered by the client) or text


@dataclass(frozen=True)
class Fact:
    text: str
    turn: int
    kind: Kind
    what: str = ""  # the kind of fact: "user rule", "rare line", "referenced value", ...


@dataclass(frozen=True)
class Scenario:
    name: str
    api: Api
    model: str
    system: str
    turns: tuple[Turn, ...]
    facts: tuple[Fact, ...]
    family: str = ""
    seed: int = 0
    tag: str = ""  # makes scripted response and message ids unique per conversation

    @property
    def window(self) -> int:
        return WINDOWS[self.model]


# --- building blocks ------------------------------------------------------------------------

RULE, RARE, REFERRED, OUTLIER, LISTED, RESULT, DECISION = (
    "user rule",
    "rare line",
    "referenced value",
    "outlier in a series",
    "id in a list",
    "tool result value",
    "decision",
)


@dataclass
class Style:
    """What a seed decides besides positions: case of levels and statuses, result format."""

    upper: bool
    json: bool

    def case(self, word: str) -> str:
        return word.upper() if self.upper else word.lower()


@dataclass
class Builder:
    family: str
    seed: int
    rng: random.Random
    style: Style
    turns: list[Turn] = field(default_factory=list)
    facts: list[Fact] = field(default_factory=list)
    calls: int = 0

    def call(self, name: str, arguments: JsonDict, output: str | JsonDict) -> Call:
        self.calls += 1
        text = output if isinstance(output, str) else json.dumps(output, indent=None)
        return Call(f"call_{self.family[:4]}{self.seed}_{self.calls}", name, arguments, text)

    def turn(
        self,
        user: str,
        *steps: tuple[Call, ...] | Call | str,
        facts: tuple[tuple[str, Kind, str], ...] = (),
    ) -> int:
        index = len(self.turns)
        shaped = tuple((s,) if isinstance(s, Call) else s for s in steps)
        self.turns.append(Turn(user, shaped))
        self.facts += [Fact(text, index, kind, what) for text, kind, what in facts]
        return index

    def scenario(self, model: str, system: str) -> Scenario:
        api: Api = "responses" if self.rng.random() < 0.5 else "chat"
        tag = f"{self.family[:4]}{self.seed}"
        return Scenario(
            f"{self.family}-s{self.seed}",
            api,
            model,
            system,
            tuple(self.turns),
            tuple(self.facts),
            family=self.family,
            seed=self.seed,
            tag=tag,
        )


def _hex(rng: random.Random, digits: int) -> str:
    return f"{rng.randrange(16**digits):0{digits}x}"


def _ts(rng: random.Random, day: int = 14, hour: int | None = None) -> str:
    h = rng.randrange(8, 18) if hour is None else hour
    return f"2026-11-{day:02d}T{h:02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}Z"


def _insert(rng: random.Random, lines: list[Any], planted: Any, lo: float = 0.1) -> int:
    """Put `planted` somewhere in `lines` (not in the first tenth), return its position."""
    at = rng.randrange(max(1, int(len(lines) * lo)), len(lines) + 1)
    lines.insert(at, planted)
    return at


def _filler(b: Builder, count: int, make: Callable[[int], tuple[str, Call, str]]) -> None:
    for i in range(count):
        user, call, answer = make(i)
        b.turn(user, call, answer)


# --- 1. support desk ------------------------------------------------------------------------

HUBS = ("Rotterdam", "Venlo", "Duisburg", "Leipzig", "Kassel", "Erfurt", "Hannover", "Bremen")
SCANS = ("arrival scan", "departure scan", "processed at facility", "in transit to next hub")


def _tracking(b: Builder, order: str, events: int, planted: str = "") -> str:
    s, rng = b.style, b.rng
    rows = [
        {
            "at": _ts(rng, 3 + i // 6, 6 + (i * 3) % 14),
            "hub": rng.choice(HUBS),
            "status": s.case("in_transit"),
            "event": rng.choice(SCANS),
            "scan_id": f"SC{rng.randrange(10**8):08d}",
        }
        for i in range(events)
    ]
    if planted:
        _insert(
            rng,
            rows,
            {
                "at": _ts(rng, 3 + rng.randrange(events) // 6, rng.randrange(6, 20)),
                "hub": rng.choice(HUBS),
                "status": s.case("exception"),
                "event": planted,
                "scan_id": f"SC{rng.randrange(10**8):08d}",
            },
        )
    rows.sort(key=lambda r: r["at"])
    if s.json:
        return json.dumps({"order_id": order, "carrier": "DHL Paket", "events": rows})
    lines = [f"Tracking for {order} (carrier DHL Paket)"]
    lines += [
        f"{r['at']}  {r['hub']:<9} {r['status']:<10} {r['event']}  {r['scan_id']}" for r in rows
    ]
    return "\n".join(lines)


def support(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("support", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    first = rng.choice(("Maria", "Jonas", "Aylin", "Tomasz", "Ines", "Kwame"))
    last = rng.choice(("Keller", "Novak", "Demir", "Laurent", "Okafor", "Rossi"))
    phone = f"+49 15{rng.randrange(10)} {rng.randrange(1000, 9999)} {rng.randrange(1000, 9999)}"
    limit = rng.choice((100, 150, 200, 250))
    b.turn(
        f"Hi, {first} {last} here. Two things before we start: don't refund anything over "
        f"{limit} EUR without checking with me, and if you need to reach me use SMS to {phone}, "
        "no calls please.",
        f"Hello {first}, noted: refunds above {limit} EUR need your OK first, and SMS only.",
        facts=(
            (f"over {limit} EUR without checking with me", "must", RULE),
            (phone, "nice", RULE),
        ),
    )
    orders = [f"ORD-{rng.randrange(40000, 99999)}" for _ in range(12)]
    items = ("kettle", "desk lamp", "headphones", "blender", "rug", "speaker", "monitor arm")

    def lookup(i: int) -> tuple[str, Call, str]:
        order = orders[3 + i]
        call = b.call(
            "get_tracking", {"order_id": order}, _tracking(b, order, rng.randrange(30, 55))
        )
        return (
            f"And the {rng.choice(items)} in {order}?",
            call,
            f"{order} is in transit, last scanned at {rng.choice(HUBS)}.",
        )

    _filler(b, rng.randrange(0, 2), lookup)
    # The one exception scan among routine scans: the pickup code the customer needs later.
    code = f"{rng.choice('ABCDEFGHJK')}{rng.randrange(100, 999)}-{rng.randrange(10, 99)}"
    depot = rng.choice(HUBS)
    planted = f"address not found, parcel held at {depot} depot, pickup code {code}"
    b.turn(
        f"My {items[0]} from {orders[0]} still hasn't arrived, it's been ten days.",
        b.call(
            "get_tracking",
            {"order_id": orders[0]},
            _tracking(b, orders[0], rng.randrange(35, 60), planted),
        ),
        f"There was a delivery problem with {orders[0]}; the parcel is waiting at a depot.",
        facts=((f"pickup code {code}", "must", RARE),),
    )
    _filler(b, rng.randrange(1, 3), lambda i: lookup(2 + i))
    # A refund the customer asks about later without naming it.
    refund = f"RF-{rng.randrange(10000, 99999)}"
    amount = f"{rng.randrange(20, limit - 5)}.{rng.choice(('00', '90', '49', '99'))}"
    result: JsonDict = {
        "refund_id": refund,
        "order_id": orders[1],
        "amount": f"{amount} EUR",
        "status": b.style.case("approved"),
        "method": "original payment method",
        "eta_business_days": rng.randrange(3, 8),
    }
    b.turn(
        f"The {items[2]} in {orders[1]} arrived broken. Refund it please, {amount} EUR.",
        b.call("create_refund", {"order_id": orders[1], "amount": amount}, result),
        f"Done, the refund of {amount} EUR is approved.",
        facts=((refund, "must", REFERRED),),
    )
    # A ticket search: the one ticket about the cracked screen among look-alikes.
    topics = ("late delivery", "wrong colour", "missing manual", "invoice copy", "address change")
    tickets = [
        {
            "ticket": f"TCK-{rng.randrange(100000, 999999)}",
            "subject": rng.choice(topics),
            "status": b.style.case(rng.choice(("closed", "solved"))),
            "opened": _ts(rng, rng.randrange(1, 28)),
        }
        for _ in range(rng.randrange(15, 30))
    ]
    screen = f"TCK-{rng.randrange(100000, 999999)}"
    _insert(
        rng,
        tickets,
        {
            "ticket": screen,
            "subject": "monitor arrived with cracked screen",
            "status": b.style.case("open"),
            "opened": _ts(rng, 9),
        },
    )
    ticket_text = (
        json.dumps({"tickets": tickets})
        if b.style.json
        else "\n".join(
            f"{t['ticket']} | {t['status']:<6} | {t['opened']} | {t['subject']}" for t in tickets
        )
    )
    b.turn(
        "I also opened a ticket weeks ago about a monitor, can you find it?",
        b.call("search_tickets", {"customer": f"{first} {last}"}, ticket_text),
        "Found it: the cracked-screen ticket is still open.",
        facts=((screen, "nice", LISTED),),
    )
    kb = [
        "Returns are accepted within 30 days of delivery in the original packaging.",
        "Refunds go to the original payment method; bank transfers take 3-5 business days.",
        "Items marked as final sale cannot be returned unless they are defective.",
        "Exchanges are free within Germany and Austria; other countries pay return shipping.",
        "Gift cards are not refundable and cannot be exchanged for cash.",
    ]
    warranty = f"Monitors carry a {rng.choice((24, 36))}-month manufacturer warranty counted from the delivery date"
    article = [rng.choice(kb) for _ in range(rng.randrange(25, 40))]
    _insert(rng, article, warranty + ".")
    b.turn(
        "What's the warranty on the monitor?",
        b.call("search_kb", {"query": "monitor warranty"}, " ".join(article)),
        "The KB article covers monitor warranties; it runs from delivery.",
        facts=((warranty, "nice", RESULT),),
    )
    _filler(b, rng.randrange(2, 5), lambda i: lookup(4 + i))
    b.turn("Is that refund through yet?", "Let me check the refund from earlier for you.")
    b.turn(
        "And where exactly do I pick up the parcel that went astray?",
        "You can pick it up at the depot with the code from the tracking.",
    )
    _filler(b, rng.randrange(2, 4), lambda i: lookup(6 + i))
    b.turn("Please summarize everything open for me.", "Here is what is still open.")
    return b.scenario(
        "gpt-4.1-mini", "You are the customer support agent of an online electronics shop."
    )


# --- 2. coding agent --------------------------------------------------------------------------

BUGS = (
    ("days_in_year = 365", "the hardcoded year length", "leap years"),
    ("if attempt > max_retries:", "the retry comparison", "an off-by-one in the retry loop"),
    ("timeout = 30  # seconds", "the client timeout", "the timeout being too short for exports"),
    ("rounding = ROUND_DOWN", "the rounding mode", "cents being truncated"),
    ("cache_ttl = 0", "the cache TTL", "the cache never holding anything"),
)
NAMES = ("invoice", "ledger", "payment", "customer", "discount", "tax", "export", "period")


def _source(b: Builder, path: str, planted: str) -> tuple[str, int]:
    """A Python file listing with line numbers; where `planted` sits (1-based line)."""
    rng = b.rng
    lines = [f'"""{path}: billing helpers."""', "from decimal import Decimal, ROUND_HALF_UP", ""]
    for _ in range(rng.randrange(18, 28)):
        name = f"{rng.choice(NAMES)}_{rng.choice(NAMES)}"
        arg = rng.choice(NAMES)
        lines += [
            f"def {name}({arg}, factor=Decimal('{rng.randrange(1, 9)}.{rng.randrange(10, 99)}')):",
            f'    """Return the {arg} scaled by factor."""',
            f"    value = Decimal({arg}) * factor",
            "    return value.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP)",
            "",
        ]
    at = _insert(rng, lines, "    " + planted if planted else "", 0.3) + 1
    numbered = [f"{n:>4} | {line}" for n, line in enumerate(lines, start=1)]
    if b.style.json:
        return json.dumps({"path": path, "lines": len(lines), "content": "\n".join(lines)}), at
    return "\n".join([f"==> {path} <==", *numbered]), at


def _pytest(b: Builder, failing: str) -> str:
    rng = b.rng
    lines = [
        "============================= test session starts ==============================",
        "platform linux -- Python 3.11.9, pytest-8.3.3, pluggy-1.5.0",
        "",
    ]
    tests = [
        f"tests/billing/test_{rng.choice(NAMES)}.py::test_{rng.choice(NAMES)}_{rng.choice(NAMES)}_{i}"
        for i in range(rng.randrange(90, 140))
    ]
    lines += [f"{t} PASSED" for t in tests]
    if failing:
        _insert(rng, lines, f"{failing} FAILED", 0.2)
        lines += [
            "=================================== FAILURES ===================================",
            f"{failing}: AssertionError: assert Decimal('{rng.randrange(10, 99)}.{rng.randrange(10, 99)}') == Decimal('0.00')",
            f"=========== 1 failed, {len(tests)} passed in {rng.randrange(20, 60)}.{rng.randrange(10, 99)}s ===========",
        ]
    else:
        lines.append(
            f"=========== {len(tests)} passed in {rng.randrange(20, 60)}.{rng.randrange(10, 99)}s ==========="
        )
    return "\n".join(lines)


def coding(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("coding", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    b.turn(
        "Ground rules: we're on Python 3.11, don't touch anything under migrations/, and every "
        "fix comes with a regression test.",
        "Got it: 3.11, migrations/ stays untouched, a test with every fix.",
        facts=(("don't touch anything under migrations/", "must", RULE),),
    )
    files = [f"billing/{n}.py" for n in rng.sample(NAMES, 8)]

    def read(i: int) -> tuple[str, Call, str]:
        path = files[2 + i % 6]
        text, _ = _source(b, path, "")
        return (
            f"Open {path}.",
            b.call("read_file", {"path": path}, text),
            f"{path} is a set of scaling helpers.",
        )

    _filler(b, rng.randrange(0, 2), read)
    bug, described, symptom = rng.choice(BUGS)
    failing = f"tests/billing/test_{rng.choice(NAMES)}.py::test_{rng.choice(NAMES)}_regression"
    b.turn(
        "Run the billing tests.",
        b.call("run_tests", {"path": "tests/billing"}, _pytest(b, failing)),
        "One test fails with an AssertionError on a Decimal.",
        facts=((failing, "must", RARE),),
    )
    listing, line = _source(b, files[0], bug)
    b.turn(
        f"Open {files[0]}.",
        b.call("read_file", {"path": files[0]}, listing),
        f"{files[0]} holds the helpers the failing test uses.",
        facts=((bug, "must", REFERRED),),
    )
    _filler(b, rng.randrange(1, 3), read)
    log = [
        f"{_hex(rng, 7)} {rng.choice(('fix', 'refactor', 'chore', 'feat'))}: "
        f"{rng.choice(NAMES)} {rng.choice(('rounding', 'cleanup', 'types', 'docs'))}"
        for _ in range(rng.randrange(20, 35))
    ]
    culprit = _hex(rng, 7)
    _insert(rng, log, f"{culprit} fix: treat negative amounts as credits in {files[0]}")
    b.turn(
        f"I think line {line} of {files[0]}, {described}, explains {symptom}. Keep that in mind; "
        "first show me the git log.",
        b.call("git_log", {"path": files[0], "n": 40}, "\n".join(log)),
        "Small refactors, and one commit about negative amounts.",
        facts=((culprit, "nice", REFERRED),),
    )
    grep = [
        f"{p}:{rng.randrange(5, 120)}:    value = Decimal({rng.choice(NAMES)}) * factor"
        for p in files
        for _ in range(rng.randrange(3, 6))
    ]
    b.turn(
        "Where else is this pattern used?",
        b.call("grep", {"pattern": "Decimal(.*) \\* factor"}, "\n".join(grep)),
        f"The pattern appears {len(grep)} times across {len(files)} files.",
    )
    _filler(b, rng.randrange(3, 5), lambda i: read(2 + i))
    b.turn(
        "Now fix the line I pointed at earlier, and add the regression test.",
        b.call("apply_patch", {"path": files[0], "line": line}, {"ok": True, "hunks": 1}),
        "Patched that line and added a test next to the failing one.",
    )
    b.turn(
        "Rerun the tests.",
        b.call("run_tests", {"path": "tests/billing"}, _pytest(b, "")),
        "All green now.",
    )
    _filler(b, rng.randrange(2, 4), lambda i: read(4 + i))
    b.turn(
        "Also revert the commit from that log that touched negative amounts.",
        b.call("git_revert", {"commit": culprit}, {"ok": True, "new_commit": _hex(rng, 7)}),
        "Reverted it.",
    )
    b.turn(
        "Write the commit message.",
        "fix(billing): correct the line flagged in review; add a regression test",
    )
    return b.scenario("gpt-4.1", "You are a coding agent working in the billing repository.")


# --- 3. incident / logs -------------------------------------------------------------------

RARE_LINES = (
    (
        "db.pool",
        "connection pool exhausted (max_connections={n} reached) pid={pid}",
        (100, 200, 400),
    ),
    (
        "kubelet",
        "OOMKilled: container payments-worker exceeded memory limit {n}Mi pid={pid}",
        (256, 512, 768),
    ),
    (
        "tls",
        "x509: certificate has expired or is not yet valid: current time 2026-11-14T14:{n}:07Z is after 2026-11-14T00:00:00Z",
        (12, 31, 47),
    ),
    (
        "kafka",
        "disk quota exceeded on /var/lib/kafka/data ({n}% used) broker pid={pid}",
        (97, 98, 99),
    ),
    (
        "resolver",
        "lookup ledger.internal on 10.0.0.{n}:53: server misbehaving pid={pid}",
        (2, 10, 53),
    ),
)


def _logs(b: Builder, service: str, count: int, planted: str = "") -> str:
    rng, s = b.rng, b.style
    upstreams = ("10.4.2.17:8080", "10.4.2.18:8080", "10.4.3.9:8080", "10.4.3.11:8080")
    lines = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.7:
            lines.append(
                f"{_ts(rng, 14, 14)} {s.case('error')} {service} upstream={rng.choice(upstreams)} "
                f'status=502 msg="Bad Gateway" trace={_hex(rng, 16)}'
            )
        else:
            lines.append(
                f"{_ts(rng, 14, 14)} {s.case('warn')} {service} slow request path=/v2/"
                f"{rng.choice(('checkout', 'cart', 'orders'))} took={rng.randrange(900, 2900)}ms "
                f"trace={_hex(rng, 16)}"
            )
    if planted:
        _insert(rng, lines, planted)
    # A log query answers in time order: the timestamps go up whatever the line.
    start = rng.randrange(0, 2700)
    seconds = sorted(rng.randrange(start, start + 900) for _ in lines)
    lines = [
        f"2026-11-14T14:{t // 60:02d}:{t % 60:02d}Z{line[20:]}"
        for t, line in zip(seconds, lines, strict=True)
    ]
    if s.json:
        return json.dumps(
            {"query": f"service:{service} level>=WARN", "hits": len(lines), "lines": lines}
        )
    return "\n".join(
        [f"# query: service:{service} level>=WARN last 15m ({len(lines)} hits)", *lines]
    )


def incident(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("incident", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    dba = rng.choice(("Priya", "Lukas", "Mei", "Olusegun", "Sofia"))
    ext = rng.randrange(2000, 8999)
    b.turn(
        f"Runbook reminder: never restart the primary database during business hours; page the "
        f"on-call DBA ({dba}, ext {ext}) before touching it.",
        "Understood, no primary restarts in business hours, and the DBA gets paged first.",
        facts=(
            ("never restart the primary database during business hours", "must", RULE),
            (f"ext {ext}", "must", RULE),
        ),
    )
    services = ["checkout", "payments-api", "cart", "gateway", "orders", "search", "auth", "ledger"]

    def query(i: int) -> tuple[str, Call, str]:
        svc = services[(i + 2) % len(services)]
        return (
            f"Check {svc}.",
            b.call(
                "query_logs",
                {"service": svc, "level": "WARN"},
                _logs(b, svc, rng.randrange(35, 55)),
            ),
            f"{svc}: the usual 502s from the upstreams, nothing new.",
        )

    _filler(b, rng.randrange(0, 2), query)
    component, template, values = rng.choice(RARE_LINES)
    rare = template.format(n=rng.choice(values), pid=rng.randrange(1000, 65000))
    line = f"{_ts(rng, 14, 14)} {b.style.case('error')} {component}: {rare}"
    b.turn(
        "Checkout errors are spiking. Pull the warnings and errors for payments-api.",
        b.call(
            "query_logs",
            {"service": "payments-api", "level": "WARN"},
            _logs(b, "payments-api", rng.randrange(40, 60), line),
        ),
        "Mostly 502 Bad Gateway from the upstreams, plus one line that stands out.",
        facts=((rare, "must", RARE),),
    )
    incident_id = f"INC-{rng.randrange(1000, 9999)}"
    b.turn(
        "Open an incident, SEV2.",
        b.call(
            "open_incident",
            {"severity": "SEV2", "title": "checkout errors"},
            {"incident": incident_id, "status": b.style.case("open"), "commander": "you"},
        ),
        "Incident opened as SEV2.",
        facts=((incident_id, "must", RESULT),),
    )
    # A latency series with one spike.
    points = [{"t": f"14:{m:02d}", "p99_ms": rng.randrange(180, 420)} for m in range(0, 60, 1)]
    spike_at = rng.randrange(10, 55)
    spike = rng.randrange(4100, 9800)
    points[spike_at]["p99_ms"] = spike
    series = (
        json.dumps({"metric": "payments-api p99", "points": points})
        if b.style.json
        else "\n".join(f"{p['t']} p99={p['p99_ms']}ms" for p in points)
    )
    spike_text = f'"p99_ms": {spike}' if b.style.json else f"p99={spike}ms"
    b.turn(
        "Show me payments-api p99 latency for the last hour.",
        b.call(
            "query_metrics", {"metric": "p99", "service": "payments-api", "range": "1h"}, series
        ),
        "Latency is flat apart from one spike.",
        facts=((spike_text, "must", OUTLIER),),
    )
    _filler(b, rng.randrange(3, 5), query)
    b.turn(
        "When exactly was that spike, and how high?",
        "It was the single spike in the hour; I'll line it up with the deploys.",
    )
    _filler(b, rng.randrange(2, 4), lambda i: query(3 + i))
    b.turn(
        "What's the root cause, based on that odd line from payments-api?",
        "The odd line in the payments-api logs points to the root cause.",
    )
    b.turn("Draft the status update.", f"Status: {incident_id} investigating checkout errors.")
    return b.scenario(
        rng.choice(("gpt-4.1-mini", "gpt-4.1")), "You are the incident commander's assistant."
    )


# --- 4. data analysis over JSON tables -----------------------------------------------------

REGIONS = ("DACH", "Nordics", "Benelux", "Iberia", "UK&I", "France", "Italy", "CEE")


def _table(b: Builder, rows: list[JsonDict]) -> str:
    if b.style.json:
        return json.dumps({"rows": rows, "row_count": len(rows)})
    columns = list(rows[0])
    out = [" | ".join(columns), "-+-".join("-" * len(c) for c in columns)]
    out += [" | ".join(str(r[c]) for c in columns) for r in rows]
    out.append(f"({len(rows)} rows)")
    return "\n".join(out)


def analysis(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("analysis", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    b.turn(
        "For this analysis: exclude test accounts (their ids start with TST-), and report money "
        "in EUR with two decimals.",
        "Will do: TST- accounts excluded, EUR with two decimals.",
        facts=(("exclude test accounts (their ids start with TST-)", "must", RULE),),
    )

    def daily(i: int) -> tuple[str, Call, str]:
        region = REGIONS[(i + 1) % len(REGIONS)]
        rows = [
            {
                "day": f"2026-10-{d:02d}",
                "region": region,
                "orders": rng.randrange(800, 1400),
                "revenue_eur": round(rng.uniform(40000, 70000), 2),
                "returns": rng.randrange(5, 60),
                "new_customers": rng.randrange(40, 300),
            }
            for d in range(1, 31)
        ]
        return (
            f"Daily orders for {region} in October.",
            b.call(
                "run_sql",
                {
                    "sql": f"SELECT day, region, orders, revenue_eur FROM daily WHERE region = '{region}'"
                },
                _table(b, rows),
            ),
            f"{region} is steady through October.",
        )

    _filler(b, rng.randrange(0, 2), daily)
    region = rng.choice(REGIONS)
    rows = [
        {
            "day": f"2026-10-{d:02d}",
            "region": region,
            "orders": rng.randrange(800, 1400),
            "revenue_eur": round(rng.uniform(40000, 70000), 2),
            "returns": rng.randrange(5, 60),
            "new_customers": rng.randrange(40, 300),
        }
        for d in range(1, 31)
    ]
    dip = rng.randrange(5, 28)
    rows[dip]["orders"] = rng.randrange(30, 90)
    rows[dip]["revenue_eur"] = round(rng.uniform(1500, 4000), 2)
    outlier = rows[dip]["revenue_eur"]
    outlier_text = f'"revenue_eur": {outlier}' if b.style.json else f"| {outlier}"
    b.turn(
        f"Same for {region}.",
        b.call(
            "run_sql",
            {
                "sql": f"SELECT day, region, orders, revenue_eur FROM daily WHERE region = '{region}'"
            },
            _table(b, rows),
        ),
        f"{region} has one day far below the rest.",
        facts=((outlier_text, "must", OUTLIER),),
    )
    churned = [
        {
            "account_id": f"ACC-{rng.randrange(100000, 999999)}",
            "plan": rng.choice(("starter", "team", "business")),
            "mrr_eur": round(rng.uniform(20, 900), 2),
            "status": b.style.case("churned"),
        }
        for _ in range(rng.randrange(12, 25))
    ]
    for _ in range(rng.randrange(2, 5)):
        _insert(
            rng,
            churned,
            {
                "account_id": f"TST-{rng.randrange(1000, 9999)}",
                "plan": "business",
                "mrr_eur": 0.0,
                "status": b.style.case("churned"),
            },
        )
    pick = rng.randrange(len(churned))
    while churned[pick]["account_id"].startswith("TST-"):
        pick = (pick + 1) % len(churned)
    biggest = max(
        (r for r in churned if r["account_id"].startswith("ACC-")), key=lambda r: r["mrr_eur"]
    )
    b.turn(
        "Which accounts churned last month?",
        b.call(
            "run_sql",
            {
                "sql": "SELECT account_id, plan, mrr_eur, status FROM accounts WHERE churned_at >= '2026-10-01'"
            },
            _table(b, churned),
        ),
        f"{len(churned)} rows, some of them test accounts.",
        facts=(
            (biggest["account_id"], "must", REFERRED),
            (churned[pick]["account_id"], "nice", LISTED),
        ),
    )
    _filler(b, rng.randrange(3, 6), daily)
    b.turn(
        "The churned account with the highest MRR: pull its invoices next. First, what was the worst day in October?",
        "The worst day was the dip in the regional series; I'll pull that account's invoices next.",
    )
    _filler(b, rng.randrange(3, 6), lambda i: daily(3 + i))
    b.turn(
        "Write up the findings.",
        "Findings: one regional dip, churn concentrated in a few accounts.",
    )
    return b.scenario(
        "gpt-4.1-mini", "You are a data analyst with SQL access to the sales warehouse."
    )


# --- 5. travel with parallel tool calls ------------------------------------------------------


def travel(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("travel", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    budget = rng.choice((1200, 1500, 1800, 2400))
    b.turn(
        f"Planning a trip for two. Hard limits: {budget} EUR total, nothing departing before "
        "07:00, and the hotel must have step-free access (my partner uses a wheelchair).",
        f"Noted: {budget} EUR total, no departures before 07:00, step-free hotels only.",
        facts=((f"{budget} EUR total", "must", RULE), ("step-free access", "must", RULE)),
    )
    cities = ["Lisbon", "Porto", "Seville", "Valencia", "Bologna", "Lyon", "Ghent", "Krakow"]

    def flights(dest: str, count: int) -> str:
        rows = [
            {
                "flight": f"{rng.choice(('LH', 'TP', 'IB', 'VY', 'EW'))}{rng.randrange(100, 9999)}",
                "departs": f"2027-05-{rng.randrange(10, 20)}T{rng.randrange(7, 22):02d}:{rng.choice(('05', '20', '35', '50'))}",
                "price_eur": rng.randrange(80, 420),
                "stops": rng.randrange(2),
                "fare": b.style.case(rng.choice(("light", "classic", "flex"))),
            }
            for _ in range(count)
        ]
        if b.style.json:
            return json.dumps({"to": dest, "offers": rows})
        return "\n".join(
            f"{r['flight']:<7} {r['departs']} {r['price_eur']:>4} EUR stops={r['stops']} {r['fare']}"
            for r in rows
        )

    def hotels(city: str, count: int, planted: JsonDict | None = None) -> str:
        rows = [
            {
                "hotel": f"{rng.choice(('Casa', 'Hotel', 'Residencia', 'Maison'))} {rng.choice(('Sol', 'Luz', 'Mar', 'Rio', 'Alto', 'Verde'))} {rng.randrange(1, 99)}",
                "eur_night": rng.randrange(70, 260),
                "rating": round(rng.uniform(6.5, 9.6), 1),
                "step_free": "no",
            }
            for _ in range(count)
        ]
        if planted:
            _insert(rng, rows, planted)
        if b.style.json:
            return json.dumps({"city": city, "hotels": rows})
        return "\n".join(
            f"{r['hotel']:<24} {r['eur_night']:>4} EUR/night rating {r['rating']} step-free: {r['step_free']}"
            for r in rows
        )

    def day_trip(i: int) -> tuple[str, tuple[Call, ...], str]:
        place = cities[(i + 3) % len(cities)]
        return (
            f"Look at a side trip to {place}: trains and hotels.",
            (
                b.call("search_trains", {"to": place}, flights(place, rng.randrange(20, 35))),
                b.call("search_hotels", {"city": place}, hotels(place, rng.randrange(15, 25))),
            ),
            f"{place}: several trains a day, hotels from 70 EUR.",
        )

    def trip_turn(i: int) -> None:
        user, calls, answer = day_trip(i)
        b.turn(user, calls, answer)

    city = rng.choice(cities[:3])
    accessible = {
        "hotel": f"Hotel {rng.choice(('Arcadia', 'Miradouro', 'Atlantico', 'Bellavista'))}",
        "eur_night": rng.randrange(90, 180),
        "rating": 8.7,
        "step_free": "yes",
    }
    b.turn(
        f"Search flights from Berlin to {city} and hotels there for 5 nights.",
        (
            b.call(
                "search_flights", {"from": "BER", "to": city}, flights(city, rng.randrange(25, 40))
            ),
            b.call(
                "search_hotels",
                {"city": city, "nights": 5},
                hotels(city, rng.randrange(20, 30), accessible),
            ),
        ),
        "Plenty of flights; only one hotel in the results is step-free.",
        facts=((accessible["hotel"], "must", REFERRED),),
    )
    ref = f"BK{rng.choice('ABCDEFGH')}{rng.randrange(10000, 99999)}"
    conf = f"HC-{rng.randrange(100000, 999999)}"
    b.turn(
        "Book the cheapest morning flight and the step-free hotel.",
        (
            b.call(
                "book_flight",
                {"from": "BER", "to": city, "slot": "morning"},
                {"booking_ref": ref, "status": b.style.case("confirmed")},
            ),
            b.call(
                "book_hotel",
                {"city": city, "nights": 5, "step_free": True},
                {"confirmation": conf, "status": b.style.case("confirmed")},
            ),
        ),
        "Both booked.",
        facts=((ref, "must", RESULT), (conf, "must", RESULT)),
    )
    for i in range(rng.randrange(2, 4)):
        trip_turn(i)
    fee = rng.choice((45, 60, 75, 90))
    rules = [
        "Carry-on bag up to 8 kg included.",
        "Seat selection is charged per segment.",
        "Check-in opens 30 hours before departure.",
        "Online check-in closes 40 minutes before departure.",
    ]
    fare = [rng.choice(rules) for _ in range(rng.randrange(15, 25))]
    _insert(
        rng,
        fare,
        f"Name changes cost {fee} EUR per passenger; the ticket is otherwise non-refundable.",
    )
    b.turn(
        "What are the fare rules on the booked flight?",
        b.call("get_fare_rules", {"booking_ref": ref}, " ".join(fare)),
        "Standard rules, with one restriction worth knowing.",
        facts=((f"Name changes cost {fee} EUR per passenger", "nice", RARE),),
    )
    for i in range(rng.randrange(4, 6)):
        trip_turn(2 + i)
    b.turn("Remind me which hotel we booked and why.", "The step-free one from the first search.")
    b.turn("Recap the bookings and my limits.", "Recap as above.")
    return b.scenario(
        "gpt-4.1-mini", "You are a travel agent. Use the tools, in parallel when you can."
    )


# --- 6. research over web pages ------------------------------------------------------------

SENTENCES = (
    "Support teams increasingly route simple questions to self-service articles.",
    "Several vendors report that chat deflection rates vary widely by industry.",
    "Survey respondents cited staffing as their main constraint for the year.",
    "Most teams measure satisfaction with a short survey after each ticket closes.",
    "Analysts caution that self-reported figures tend to overstate improvements.",
    "Larger organisations were more likely to run a dedicated quality team.",
    "The report groups companies by headcount and by primary support channel.",
    "Response-time targets differ between email, chat and phone queues.",
)


def research(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("research", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    b.turn(
        "I'm writing a brief on AI in customer support. Only use sources published in 2024 or "
        "later, and cite every figure with its URL.",
        "Understood: sources from 2024 on, and a URL for every figure.",
        facts=(("sources published in 2024 or later", "must", RULE),),
    )
    hosts = (
        "supportweekly.com",
        "cx-insights.org",
        "helpdeskreview.net",
        "servicemetrics.io",
        "contactcenterpulse.com",
    )

    def page(url: str, count: int, planted: str = "") -> str:
        body = [rng.choice(SENTENCES) for _ in range(count)]
        if planted:
            _insert(rng, body, planted)
        text = " ".join(body)
        if b.style.json:
            return json.dumps(
                {
                    "url": url,
                    "title": "Customer support trends",
                    "published": f"202{rng.randrange(4, 6)}-0{rng.randrange(1, 9)}-1{rng.randrange(10)}",
                    "text": text,
                }
            )
        return f"URL: {url}\nTitle: Customer support trends\n\n{text}"

    def fetch(i: int) -> tuple[str, Call, str]:
        url = f"https://{rng.choice(hosts)}/blog/{rng.randrange(1000, 9999)}-support-trends"
        return (
            f"Read {url}.",
            b.call("fetch_page", {"url": url}, page(url, rng.randrange(90, 130))),
            "General trends, no hard numbers.",
        )

    results = [
        {
            "url": f"https://{rng.choice(hosts)}/{rng.choice(('reports', 'blog', 'news'))}/{rng.randrange(1000, 9999)}",
            "title": rng.choice(
                (
                    "Support trends",
                    "The state of service",
                    "Chatbots in support",
                    "Help desk survey",
                )
            ),
            "year": rng.randrange(2019, 2026),
        }
        for _ in range(rng.randrange(12, 20))
    ]
    b.turn(
        "Search for recent studies on AI assistants in support.",
        b.call(
            "web_search",
            {"q": "AI assistant customer support study first response time"},
            json.dumps({"results": results})
            if b.style.json
            else "\n".join(f"{r['year']}  {r['title']}  {r['url']}" for r in results),
        ),
        "A dozen results of mixed age.",
    )
    _filler(b, rng.randrange(0, 2), fetch)
    before, after = rng.randrange(10, 30), rng.randrange(2, 6)
    stat = f"median first-response time fell from {before}.{rng.randrange(10)} hours to {after}.{rng.randrange(10)} hours"
    url = f"https://{rng.choice(hosts)}/reports/{rng.randrange(1000, 9999)}-ai-support-study"
    b.turn(
        f"Read {url}.",
        b.call(
            "fetch_page",
            {"url": url},
            page(
                url,
                rng.randrange(70, 100),
                f"Across the {rng.randrange(200, 900)} companies studied, the {stat} after the assistants were introduced.",
            ),
        ),
        "This study has the one hard number we need.",
        facts=((stat, "must", REFERRED), (url, "nice", RESULT)),
    )
    _filler(b, rng.randrange(3, 5), fetch)
    b.turn(
        "Quote the figure from that study exactly, with its source.",
        "I'll quote the study's first-response figure with its URL.",
    )
    _filler(b, rng.randrange(3, 5), lambda i: fetch(3 + i))
    b.turn(
        "Draft the brief's opening paragraph.",
        "Draft: AI assistants are reshaping support response times.",
    )
    return b.scenario(
        rng.choice(("gpt-4.1-mini", "gpt-4.1")), "You are a research assistant with web search."
    )


# --- 7. CRM / sales -------------------------------------------------------------------------


def crm(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("crm", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    b.turn(
        "Ground rules for today: quote in EUR only, and never e-mail a customer without my OK.",
        "Understood: EUR only, no customer e-mails without your OK.",
        facts=(("never e-mail a customer without my OK", "must", RULE),),
    )
    towns = ("Bremen", "Graz", "Lyon", "Ghent", "Turin", "Malmo", "Porto", "Brno")
    stages = ("lead", "qualified", "proposal", "negotiation")

    def account(acc: str, deals: int, note: str = "", big: JsonDict | None = None) -> str:
        rows = [
            {
                "deal": f"D-{rng.randrange(10000, 99999)}",
                "stage": b.style.case(rng.choice(stages)),
                "value_eur": rng.randrange(2000, 40000),
                "owner": rng.choice(("ana", "ben", "chloe", "dev")),
            }
            for _ in range(deals)
        ]
        if big:
            _insert(rng, rows, big)
        contacts = [
            {
                "name": f"{rng.choice(('Lena', 'Marc', 'Sara', 'Piet', 'Olga'))} {rng.choice(('Berg', 'Moreau', 'Visser', 'Kral'))}",
                "role": rng.choice(("buyer", "cfo", "it", "ops")),
            }
            for _ in range(4)
        ]
        notes = [
            f"{_ts(rng, rng.randrange(1, 28))} {rng.choice(('call', 'meeting', 'e-mail'))} logged by {rng.choice(('ana', 'ben'))}: follow-up scheduled"
            for _ in range(rng.randrange(12, 22))
        ]
        if note:
            _insert(rng, notes, f"{_ts(rng, rng.randrange(1, 28))} {note}")
        notes.sort()
        if b.style.json:
            return json.dumps(
                {
                    "account": acc,
                    "city": rng.choice(towns),
                    "contacts": contacts,
                    "deals": rows,
                    "activity": notes,
                }
            )
        out = [f"Account {acc} ({rng.choice(towns)})", "Contacts:"] + [
            f"  {c['name']} - {c['role']}" for c in contacts
        ]
        out += ["Deals:"] + [
            f"  {r['deal']}  {r['stage']:<12} {r['value_eur']:>7} EUR  owner={r['owner']}"
            for r in rows
        ]
        out += ["Activity:"] + [f"  {n}" for n in notes]
        return "\n".join(out)

    def lookup(i: int) -> tuple[str, Call, str]:
        acc = f"ACC-{rng.randrange(1000, 9999)}"
        return (
            f"Look up {acc}.",
            b.call("get_account", {"account": acc}, account(acc, rng.randrange(14, 24))),
            f"{acc}: nothing urgent.",
        )

    _filler(b, rng.randrange(1, 3), lookup)
    hold = f"legal hold: do not contact until 2027-0{rng.randrange(1, 9)}-{rng.randrange(10, 28)} (dispute {rng.randrange(100, 999)})"
    acc = f"ACC-{rng.randrange(1000, 9999)}"
    b.turn(
        f"Check {acc}, they asked for a call.",
        b.call("get_account", {"account": acc}, account(acc, rng.randrange(8, 14), note=hold)),
        f"{acc} has several open deals; there is a note in the activity log to respect.",
        facts=((hold, "must", RARE),),
    )
    big_deal = f"D-{rng.randrange(10000, 99999)}"
    big = {
        "deal": big_deal,
        "stage": b.style.case("negotiation"),
        "value_eur": rng.randrange(180000, 400000),
        "owner": "ana",
    }
    acc2 = f"ACC-{rng.randrange(1000, 9999)}"
    b.turn(
        f"What's open at {acc2}?",
        b.call("get_account", {"account": acc2}, account(acc2, rng.randrange(10, 16), big=big)),
        f"{acc2}: many small deals and one very large one in negotiation.",
        facts=((big_deal, "must", OUTLIER),),
    )
    discount = rng.choice((8, 10, 12, 15))
    b.turn(
        f"Decision: we offer {discount}% on the big one if they sign before the quarter ends.",
        f"Noted: {discount}% if signed this quarter.",
        facts=((f"we offer {discount}% on the big one", "must", DECISION),),
    )
    _filler(b, rng.randrange(3, 5), lookup)
    quote = f"QT-{rng.randrange(10000, 99999)}"
    b.turn(
        "Create the quote for the big deal with the discount we agreed.",
        b.call(
            "create_quote",
            {"account": acc2, "discount_pct": discount},
            {"quote": quote, "status": b.style.case("pending_review")},
        ),
        "The quote is waiting for review.",
        facts=((quote, "must", RESULT),),
    )
    _filler(b, rng.randrange(3, 5), lookup)
    b.turn(f"Can we call {acc} now?", "I'll check the note on that account before anyone calls.")
    b.turn("What is still open for me?", "The quote under review and the account with a note.")
    return b.scenario("gpt-4.1-mini", "You are a sales-operations agent with CRM tools.")


# --- 8. infrastructure: manifests and kubectl -------------------------------------------


def infra(seed: int) -> Scenario:
    rng = random.Random(seed)
    b = Builder("infra", seed, rng, Style(rng.random() < 0.5, rng.random() < 0.5))
    b.turn(
        "Before anything: namespace payments-prod is change-frozen until Friday, and nothing gets "
        "applied anywhere without a --dry-run=server first.",
        "Understood: payments-prod is frozen, and every apply gets a server dry run first.",
        facts=(("payments-prod is change-frozen until Friday", "must", RULE),),
    )
    apps = ("api", "worker", "scheduler", "web", "ledger", "notifier", "search", "gateway")

    def pods(ns: str, count: int, planted: str = "") -> str:
        rows = [
            f"{rng.choice(apps)}-{_hex(rng, 9)}-{_hex(rng, 5)}   1/1     Running   "
            f"{rng.randrange(3)}          {rng.randrange(1, 30)}d"
            for _ in range(count)
        ]
        if planted:
            _insert(rng, rows, planted)
        if b.style.json:
            return json.dumps(
                {
                    "namespace": ns,
                    "items": [
                        dict(
                            zip(
                                ("name", "ready", "status", "restarts", "age"),
                                r.split(),
                                strict=False,
                            )
                        )
                        for r in rows
                    ],
                }
            )
        return "\n".join(["NAME                          READY   STATUS    RESTARTS   AGE", *rows])

    def get_pods(i: int) -> tuple[str, Call, str]:
        ns = rng.choice(("payments-staging", "search-prod", "ledger-prod", "web-prod"))
        return (
            f"kubectl get pods in {ns}.",
            b.call("kubectl", {"args": f"get pods -n {ns}"}, pods(ns, rng.randrange(30, 50))),
            f"{ns}: all pods running.",
        )

    _filler(b, rng.randrange(0, 2), get_pods)
    broken = f"ledger-{_hex(rng, 9)}-{_hex(rng, 5)}"
    restarts = rng.randrange(12, 90)
    line = f"{broken}   0/1     CrashLoopBackOff   {restarts}         {rng.randrange(1, 5)}h"
    b.turn(
        "Something's off in ledger-prod. Get the pods.",
        b.call(
            "kubectl",
            {"args": "get pods -n ledger-prod"},
            pods("ledger-prod", rng.randrange(35, 55), line),
        ),
        "One pod is crash-looping, the rest are fine.",
        facts=((broken, "must", RARE),),
    )
    limit = rng.choice((192, 256, 320, 384))
    image_tag = f"1.{rng.randrange(10, 30)}.{rng.randrange(10)}"
    previous = f"1.{rng.randrange(5, 9)}.{rng.randrange(10)}"
    manifest = [
        "apiVersion: apps/v1",
        "kind: Deployment",
        "metadata:",
        "  name: ledger",
        "  namespace: ledger-prod",
        "spec:",
        f"  replicas: {rng.randrange(3, 8)}",
        "  template:",
        "    spec:",
        "      containers:",
        "      - name: ledger",
        f"        image: registry.internal/ledger:{image_tag}",
        "        env:",
    ]
    manifest += [
        f'        - name: {rng.choice(("LOG", "DB", "CACHE", "QUEUE"))}_{rng.choice(("LEVEL", "HOST", "PORT", "TTL", "SIZE"))}_{i}\n          value: "{rng.randrange(1000)}"'
        for i in range(rng.randrange(25, 40))
    ]
    manifest += [
        "        resources:",
        "          requests:",
        "            cpu: 250m",
        "            memory: 128Mi",
        "          limits:",
        '            cpu: "1"',
        f"            memory: {limit}Mi",
    ]
    b.turn(
        "Show me the ledger deployment manifest.",
        b.call(
            "kubectl", {"args": "get deploy ledger -n ledger-prod -o yaml"}, "\n".join(manifest)
        ),
        "The ledger deployment runs a single container with tight limits.",
        facts=((f"memory: {limit}Mi", "must", REFERRED),),
    )
    history = [
        f"{n}         image registry.internal/ledger:1.{rng.randrange(0, 5)}.{rng.randrange(10)}"
        for n in range(1, rng.randrange(6, 10))
    ]
    history += [
        f"{len(history) + 1}         image registry.internal/ledger:{previous}",
        f"{len(history) + 2}         image registry.internal/ledger:{image_tag}",
    ]
    b.turn(
        "And the rollout history.",
        b.call(
            "kubectl",
            {"args": "rollout history deploy/ledger -n ledger-prod"},
            "deployment.apps/ledger\nREVISION  CHANGE-CAUSE\n" + "\n".join(history),
        ),
        "The current image went out in the last revision.",
        facts=((f"ledger:{previous}", "nice", REFERRED),),
    )
    _filler(b, rng.randrange(2, 4), get_pods)
    events = [
        f"{rng.randrange(1, 59)}m   Normal   Pulled   pod/{rng.choice(apps)}-{_hex(rng, 5)}   Container image already present on machine"
        for _ in range(rng.randrange(25, 40))
    ]
    _insert(
        rng,
        events,
        f"{rng.randrange(1, 9)}m   Warning  OOMKilling   node/ip-10-2-{rng.randrange(255)}-{rng.randrange(255)}   Memory cgroup out of memory: Killed process {rng.randrange(1000, 60000)} (ledger)",
    )
    b.turn(
        "Events in ledger-prod?",
        b.call("kubectl", {"args": "get events -n ledger-prod"}, "\n".join(events)),
        "Mostly image pulls, and one OOM kill on the ledger container.",
    )
    b.turn(
        "So raise the memory limit we saw in the manifest to double, and if that doesn't help, roll back to the revision before the current one.",
        "Plan: double that memory limit (dry run first), then roll back one revision if needed.",
    )
    _filler(b, rng.randrange(3, 5), get_pods)
    b.turn(
        "Write the change request.",
        "Change request: raise the ledger memory limit, fallback a rollback.",
    )
    return b.scenario("gpt-4.1-mini", "You are an SRE assistant with kubectl access.")


FAMILIES: dict[str, Callable[[int], Scenario]] = {
    "support": support,
    "coding": coding,
    "incident": incident,
    "analysis": analysis,
    "travel": travel,
    "research": research,
    "crm": crm,
    "infra": infra,
}

SETS = {"tuning": TUNING_SEEDS, "heldout": HELDOUT_SEEDS}


def generate(families: list[str], seeds: tuple[int, ...] | list[int]) -> list[Scenario]:
    return [FAMILIES[f](seed) for f in families for seed in seeds]
