"""``reprules audit``: the command line that reports each training step's collectives,
checking off next to reprules.

``_cli`` parses the command and runs each workload (the bundled ones of
``reprules._demo`` or the user's target, read by ``_target``) both ways through
``reprules.testing``; ``_coverage`` says how each kernel got its rule,
``_communication`` adds the implicit collectives and cheaper equivalents, and
``_text`` and ``_html`` render the report (the JSON is built in ``_cli``).
"""
