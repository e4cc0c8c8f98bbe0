"""Salience from the conversation itself (issue 22, item 3): a value that a later message
of the same turn names (a code span, a quoted phrase, a file:line, a number with its
unit, an identifier) or a later call takes as an argument is kept in the compressed
result and in the digest. Only the closed turn counts, so the bytes stay the same from
one request to the next (the prompt cache)."""

from __future__ import annotations

import json

import pytest

from proxy.core.compress import compress_tool_output, compressed_for, evidence_lines, holds
from proxy.core.items import Item, chat_item
from proxy.core.memory import extract, referenced_values
from proxy.core.projection import ProjectionPolicy, ProjectionRequest, project_context
from proxy.core.tokens import TokenCounter

BUG = "    days_in_year = 365"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def listing() -> str:
    lines = []
    for block in range(60):
        lines += [
            f"def helper_{block}(value, factor={block + 2}):",
            f'    """Scale value by factor (helper {block})."""',
            f"    scaled = value * factor + {block}",
            "    return scaled",
            "",
        ]
    lines.insert(151, BUG)
    return "\n".join(f"{n + 1:4d}  {line}" for n, line in enumerate(lines))


def call(call_id: str, name: str, arguments: dict[str, object]) -> Item:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return chat_item(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    )


def reading_turn(n: int, said: str) -> list[Item]:
    return [
        chat_item({"role": "user", "content": f"Read src/billing/calendar_{n}.py"}),
        call(f"call_{n}", "read_file", {"path": f"src/billing/calendar_{n}.py"}),
        chat_item({"role": "tool", "tool_call_id": f"call_{n}", "content": listing()}),
        chat_item({"role": "assistant", "content": said}),
    ]


SAID = "Found it: `days_in_year = 365` ignores leap years."


def test_a_code_span_the_assistant_names_is_salient() -> None:
    found = referenced_values([chat_item({"role": "assistant", "content": SAID})])
    assert "days_in_year = 365" in found


@pytest.mark.parametrize(
    ("said", "value"),
    [
        ('The error says "connection reset by peer".', "connection reset by peer"),
        ("See src/billing/proration.py:88 for the division.", "src/billing/proration.py:88"),
        ("Latency went to 870ms at peak.", "870ms"),
        ("The flag retry_budget is wrong.", "retry_budget"),
    ],
)
def test_quoted_phrases_locations_units_and_identifiers_are_salient(said: str, value: str) -> None:
    assert value in referenced_values([chat_item({"role": "user", "content": said})])


def test_a_later_calls_argument_values_are_salient_not_its_keys() -> None:
    found = referenced_values([call("c2", "restart", {"service": "checkout-api", "port": 8443})])
    assert {"checkout-api", "8443"} <= found and "service" not in found


def test_the_line_the_turn_names_survives_compression(counter: TokenCounter) -> None:
    output = reading_turn(0, SAID)[2]
    referenced = referenced_values(reading_turn(0, SAID)[3:])
    small = compress_tool_output(output, None, 300, counter, referenced)
    assert BUG in json.loads(small.raw["content"])["excerpt"]
    assert counter.item(small) <= 300


def test_the_projection_keeps_what_the_rest_of_the_turn_names(counter: TokenCounter) -> None:
    items = [chat_item({"role": "system", "content": "You are a coding agent."})]
    for n in range(4):
        items += reading_turn(n, SAID if n == 0 else f"Calendar {n} looks fine.")
    items.append(chat_item({"role": "user", "content": "Fix it."}))
    policy = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=300)
    request = ProjectionRequest(items, window=counter.items(items) // 2, output=500, epsilon=100)
    first = project_context(request, counter, policy)
    [compressed] = [i for i in first.items if i.output_for == "call_0"]
    assert "threadkeeper_compressed" in compressed.raw["content"]
    assert BUG in compressed.raw["content"]
    again = project_context(request, counter, policy)
    assert [i.raw for i in again.items] == [i.raw for i in first.items]  # same bytes


def test_the_digest_keeps_the_line_the_turn_names() -> None:
    state = extract(reading_turn(0, SAID))
    fact = next(f for f in state.facts if f.startswith("read_file"))
    assert "days_in_year = 365" in fact


def test_a_value_every_line_holds_singles_none_out(counter: TokenCounter) -> None:
    """The flight named in every fare line says nothing about which line matters: the
    lines are not all kept for it (the result would grow past its room), the one line
    holding a value named once is."""
    lines = [f"fare {i} for LH-103: class {i % 5}, seat map row {i}" for i in range(300)]
    output = chat_item({"role": "tool", "tool_call_id": "c", "content": "\n".join(lines)})
    referenced = frozenset({"LH-103", "row 217"})
    shown = json.loads(compress_tool_output(output, None, 300, counter, referenced).raw["content"])
    assert "fare 217 for LH-103: class 2, seat map row 217" in shown["excerpt"]
    assert shown["excerpt"].count("LH-103") < 40


def coding_history(later_user: str) -> list[Item]:
    items = [chat_item({"role": "system", "content": "You are a coding agent."})]
    items += reading_turn(0, "Calendar 0 is a set of helpers.")
    items += reading_turn(1, "Calendar 1 looks fine.")
    items.append(chat_item({"role": "user", "content": later_user}))
    items.append(chat_item({"role": "assistant", "content": "Noted."}))
    items += reading_turn(2, "Calendar 2 looks fine.")
    items += reading_turn(3, "Calendar 3 looks fine.")
    items.append(chat_item({"role": "user", "content": "Fix it."}))
    return items


def sent_result(items: list[Item], counter: TokenCounter) -> str:
    policy = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=300)
    request = ProjectionRequest(items, window=counter.items(items) // 2, output=500, epsilon=100)
    projection = project_context(request, counter, policy)
    [compressed] = [i for i in projection.items if i.output_for == "call_0"]
    return str(compressed.raw["content"])


@pytest.mark.parametrize(
    "later_user",
    ["I think line 152 of calendar_0.py explains the leap-year bug.", "Is `days_in_year` right?"],
)
def test_a_line_a_later_turn_names_survives_compression(
    counter: TokenCounter, later_user: str
) -> None:
    """Named in a later turn (by its number, or by the identifier it defines), not in
    the result's own: the compressed result still carries the line."""
    shown = sent_result(coding_history(later_user), counter)
    assert "threadkeeper_compressed" in shown and BUG.strip() in shown


def test_a_later_turn_naming_nothing_of_a_result_leaves_its_form_alone(
    counter: TokenCounter,
) -> None:
    """The form made by the result's own turn stays byte for byte when a later turn names
    only what it already carries or what it does not hold at all (the prompt cache)."""
    quiet = sent_result(coding_history("Let us look at the other files."), counter)
    assert sent_result(coding_history("Is helper_0 used anywhere? See ORD-17."), counter) == quiet


def pool_log() -> str:
    """Routine lines, a dozen rare error lines of different kinds, and one rare line that
    reports no error: the change the finding rests on."""
    lines = [
        f"2026-11-14T14:{m:02d}:00Z INFO payments-api request ok path=/v2/cart took={m + 20}ms"
        for m in range(60)
    ]
    kinds = ["disk", "tls", "dns", "kafka", "redis", "smtp", "ldap", "s3", "ntp", "cron"]
    for n, kind in enumerate(kinds):
        lines.insert(
            5 * n + 2, f"2026-11-14T14:{n:02d}:09Z ERROR {kind}-probe-{n} check failed code={n}"
        )
    lines.insert(44, POOL)
    return "\n".join(lines)


POOL = "2026-11-14T14:41:05Z INFO db.pool: config reload, max_connections lowered from 200 to 20 by deploy 8812"
FINDING = "The deploy lowered max_connections to 20: that is why checkout fails."


def test_a_finding_links_back_to_its_evidence_line() -> None:
    found = evidence_lines(pool_log(), [FINDING])
    assert POOL in found
    assert evidence_lines(pool_log(), ["Checkout fails a lot today."]) == frozenset()


def test_the_evidence_of_a_finding_survives_compression_and_the_digest(
    counter: TokenCounter,
) -> None:
    """Rare error lines compete for the room with the one rare line that reports no
    error: the line the assistant's finding rests on is kept first."""
    items = [
        call("c1", "query_logs", {"query": "service:payments-api level>=WARN"}),
        chat_item({"role": "tool", "tool_call_id": "c1", "content": pool_log()}),
        chat_item({"role": "assistant", "content": FINDING}),
    ]
    plain = compressed_for(items[1], items[0], 160, counter, frozenset())
    assert POOL not in json.loads(plain.raw["content"])["excerpt"]  # the rare errors rank first
    small = compressed_for(items[1], items[0], 160, counter, frozenset(), said=[FINDING])
    assert POOL in json.loads(small.raw["content"])["excerpt"]
    fact = next(f for f in extract(items).facts if f.startswith("query_logs"))
    assert POOL in fact


def test_a_plain_word_names_a_line_only_standing_alone() -> None:
    assert holds("region eu-west: refunds paused", "refunds")
    assert holds("service=refunds status=503", "refunds")
    assert not holds("GET path=/v1/refunds took=12ms", "refunds")
    assert not holds("host refunds-db-2 down", "refunds")
    assert holds("GET path=/v1/refunds/RF-2231", "RF-2231")  # an id, wherever it stands


def queried_log() -> str:
    """Routine 503s and slow requests, one slow request on the path /v1/refunds, and
    one rare failure."""
    lines = ["# query: service:billing level>=WARN last 30m"]
    for i in range(36):
        stamp = f"2026-12-01T09:{i:02d}:{(7 * i) % 60:02d}Z"
        if i % 3:
            lines.append(
                f"{stamp} ERROR billing upstream=10.2.0.{i % 4}:9000 status=503"
                f' msg="Service Unavailable" trace={i * 7919:016x}'
            )
        else:
            path = "/v1/refunds" if i == 21 else ("/v1/invoices", "/v1/plans")[i % 2]
            lines.append(
                f"{stamp} WARN billing slow request path={path} took={900 + 37 * i}ms"
                f" trace={i * 104729:016x}"
            )
    lines.insert(17, f"2026-12-01T09:16:41Z ERROR ledger: {REPLICA_LAG}")
    return "\n".join(lines)


REPLICA_LAG = "replication slot lag exceeded on replica-2 (48213 s behind) wal_sender pid=7731"


def test_a_later_query_of_a_plain_word_does_not_crowd_out_the_rare_line() -> None:
    """A later call queries the service `refunds`; the word stands in one line of this
    log only inside a path (/v1/refunds), which it does not name: the digest still
    leads with the rare failure, whole."""
    items = [
        chat_item({"role": "user", "content": "Pull the billing warnings."}),
        call("call_1", "query_logs", {"service": "billing", "level": "WARN"}),
        chat_item({"role": "tool", "tool_call_id": "call_1", "content": queried_log()}),
        chat_item({"role": "assistant", "content": "Mostly 503s."}),
        chat_item({"role": "user", "content": "Now the refunds service."}),
        call("call_2", "query_logs", {"service": "refunds", "level": "WARN"}),
        chat_item({"role": "tool", "tool_call_id": "call_2", "content": "no hits"}),
    ]
    fact = extract(items).facts[0]
    assert REPLICA_LAG in fact
    assert "path=/v1/refunds" not in fact


def manifest() -> str:
    lines = ["apiVersion: apps/v1", "kind: Deployment", "metadata:", "  name: ledger", "spec:"]
    lines += ["  template:", "    spec:", "      containers:", "      - name: ledger"]
    lines += ["        image: registry.internal/ledger:1.12.0", "        env:"]
    for n in range(30):
        lines += [f"        - name: CACHE_TTL_{n}", f'          value: "{n * 7}"']
    lines += ["        resources:", "          requests:", "            cpu: 250m"]
    lines += ["            memory: 128Mi", "          limits:", '            cpu: "1"']
    lines += ["            memory: 320Mi"]
    return "\n".join(lines)


RAISE = "So raise the memory limit we saw in the manifest to double."


def test_a_line_is_described_by_the_keys_it_is_nested_under() -> None:
    """`memory: 320Mi` under `limits:` is "the memory limit"; `memory: 128Mi` under
    `requests:` shares only "memory" with it (structure_words)."""
    assert evidence_lines(manifest(), [RAISE]) == frozenset({"memory: 320Mi"})


def test_the_digest_keeps_the_line_a_later_user_message_describes() -> None:
    """The user describes a line in words ("the memory limit we saw"), turns after the
    result: the digest of the chunk keeps that line, not the first `memory:` line."""
    items = [
        call("c1", "kubectl", {"args": "get deploy ledger -o yaml"}),
        chat_item({"role": "tool", "tool_call_id": "c1", "content": manifest()}),
        chat_item({"role": "assistant", "content": "The deployment runs one container."}),
        chat_item({"role": "user", "content": "And the events?"}),
        chat_item({"role": "assistant", "content": "One OOM kill on the ledger container."}),
        chat_item({"role": "user", "content": RAISE}),
    ]
    fact = next(f for f in extract(items).facts if f.startswith("kubectl"))
    assert "memory: 320Mi" in fact
