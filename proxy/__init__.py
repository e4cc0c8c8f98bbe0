"""threadkeeper: a short-term-memory proxy for the OpenAI API.

An app points OPENAI_BASE_URL at the proxy and changes nothing else. Each request goes:

    auth (bearer -> tenant policy)            proxy/server/auth.py, proxy/policy.py
    Idempotency-Key (a retry gets the first   proxy/server/idempotency.py,
      answer)                                 proxy/core/idempotency.py
    parse + validate, pick API, mode, plan    proxy/server/chat.py, proxy/server/responses.py,
                                              proxy/server/validate.py (the door)
    the turn, once for every API and mode     proxy/server/turn.py (run_turn: load, rewrite,
                                              project, forward, relay, commit over frozen
                                              values), API shapes in api.py
    items view of the history                 proxy/core/items.py
    load the thread (X-Thread-Id, stored      proxy/threads.py, proxy/server/modes.py
      responses, conversations)
    side-effect ledger: restore calls, judge  proxy/server/ledger.py (its rewriters),
      repeated calls, record tool outputs     proxy/core/ledger.py, server/holdback.py
    compaction items -> their summary text;   proxy/server/compaction.py (its rewriters),
      context_management compacts the turn    proxy/core/compaction.py, proxy/core/memory.py
    orphan check (output for an unknown call) proxy/threads.py (first_orphan), ledger.py
    budget  B_H = W - S - T - U - O - eps     proxy/core/budget.py; the model's window and
                                              count: proxy/server/model_budget.py
    projection under the budget               proxy/core/projection.py (blocks, compress,
                                              memory), gathered by turn.py (rebuild_turn)
    invariant check (never send a broken one) proxy/core/invariants.py
    forward upstream, retries                 proxy/upstream.py
    check the answer's shape (else 502)       proxy/core/answers.py
    send in the API the upstream serves       proxy/server/relay.py (send_model),
      (a Chat-only one: translated)           proxy/server/chat_upstream.py
    relay (one loop, pluggable transformers)  proxy/sse.py, proxy/server/relay.py
    commit the turn (new items + reply, OCC)  proxy/threads.py, ChatThread / ResponseChain /
                                              Conversation in proxy/server/modes.py
    log the budget breakdown, metrics         proxy/server/turn.py, proxy/logs.py,
                                              proxy/metrics.py
    observers (usage, summaries ahead): read  proxy/server/observe.py,
      chunks cut (or about to be), in the     proxy/server/summaries.py, proxy/summarizer.py,
      background, stored by chunk digest      proxy/core/llm_summary.py, memory.guard

Around the requests: `serve --workers N` forks N processes on one port under a supervisor
(proxy/server/workers.py); every handler and background task reads time from the app's one
clock (proxy/clock.py, app key CLOCK); background loops (heartbeats and recovery sweeps in
proxy/server/recovery.py, the idempotency purge, policy reloads) run on proxy/periodic.py.
What operators see: explain records (proxy/server/explain.py), the threads and ledger CLI
(proxy/admin.py, proxy/cli.py) and the thread inspector pages built from the same
functions (proxy/server/inspector.py serves them, inspector_html.py renders them). What
operators do (resolve a ledger entry, fork a thread) is written once in
proxy/operations.py, for the HTTP routes and the CLI alike.

proxy/core/ is pure Python (no network, database, web framework, environment or clock),
enforced by the banned-import rule in proxy/core/ruff.toml. Everything with I/O sits at
the edges: the aiohttp handlers, the upstream client and the store.
"""

__version__ = "0.1.0"
