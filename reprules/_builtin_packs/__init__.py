"""reprules' own rule packs, loaded through the ``reprules.rules`` entry points.

See :mod:`reprules._packs` for the mechanism and ``pyproject.toml`` for the
entry points.
"""
