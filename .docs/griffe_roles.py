"""Griffe extension: Sphinx roles in docstrings (:class:`Report`) render as code (`Report`)."""

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|data|func|meth|mod|attr|exc|obj):`~?([^`]+)`")


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
