"""Cross-cutting steps of a model turn, as hook objects run_turn calls at named points
(proxy/server/turn.py, TurnHook): the side-effect ledger (ledger.py), a stored thread's
load and commit (persist.py), usage logging (usage.py)."""
