"""The safety modes: checks a user turns on to trust a rule, or to refuse silent typing.

``_verify`` inserts, after each registered kernel call, the run-time check of
``reprules.verify()``: every output the rule types replicated is gathered and
compared across its axes. ``strict`` (``reprules.strict()``) refuses any output
JAX typed replicated over axes its inputs vary over, unless a rule vouches
for it.
"""
