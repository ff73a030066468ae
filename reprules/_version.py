"""Release numbers as tuples: one parser for reprules (imports nothing)."""

from __future__ import annotations

import re


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.4.38"`` -> ``(0, 4, 38)``; ``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; ``"0.5.0rc1"`` -> ``(0, 5, 0)``.

    Digits are kept per dot-separated part (a pre-release suffix is dropped),
    so tuples compare in release order.
    """
    parts = []
    for part in version.split("."):
        digits = re.match(r"\d*", part)
        parts.append(int(digits.group()) if digits and digits.group() else 0)
    return tuple(parts)
