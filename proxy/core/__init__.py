"""The pure core: items, tokens, blocks, budget, projection, compression, invariants.

No I/O, no clocks, no environment: callers pass everything in (SPEC section 3).
"""
