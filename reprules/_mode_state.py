"""Whether each opt-in mode is on: the state that ``_modes`` switches and the
shim reads. A leaf module (it imports nothing of reprules), so dependencies run
one way: façade and ``_modes`` -> shim -> this."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

VERIFY_ENV = "REPRULES_VERIFY"
STRICT_ENV = "REPRULES_STRICT"
INFER_ENV = "REPRULES_INFER"
DORMANT_ENV = "REPRULES_DORMANT"  # patch nothing until a rule is registered
SOUND_TYPES_ENV = "REPRULES_SOUND_TYPES"  # 0: keep JAX's types where they are provably too small

lock = threading.Lock()
sound_types_pending = False  # JAX was imported by the shim's own import: it arms sound types at its end
_depth = {"verify": 0, "strict": 0, "infer": 0, "no_infer": 0}


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _env_off(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"0", "false", "no", "off"}


def enter(mode: str) -> None:
    with lock:
        _depth[mode] += 1


def leave(mode: str) -> None:
    with lock:
        _depth[mode] -= 1


def verifying() -> bool:
    return _depth["verify"] > 0 or _env_on(VERIFY_ENV)


def strict_on() -> bool:
    return _depth["strict"] > 0 or _env_on(STRICT_ENV)


def inferring() -> bool:
    """Inference for every rule-less kernel: ``reprules.inference()`` or ``REPRULES_INFER=1``
    (``inference(False)`` wins over both)."""
    return _depth["no_infer"] == 0 and (_depth["infer"] > 0 or _env_on(INFER_ENV))


def inferring_by_default() -> bool:
    """Inference for a rule-less kernel that JAX itself would refuse under checking
    (or, for a 0.8 - 0.9 ``pl.kernel``, type replicated): on unless ``REPRULES_INFER=0``
    or ``reprules.inference(False)``."""
    return _depth["no_infer"] == 0 and not _env_off(INFER_ENV)


INFERENCE_TEXT = {
    "all": "inference on",  # reprules.inference(), REPRULES_INFER=1, --infer, --reprules-infer
    "default": "inference where JAX would refuse",  # the default: a rule-less kernel JAX would refuse
    "off": "inference off",  # REPRULES_INFER=0 or reprules.inference(False)
}
"""Each inference mode, as the pytest plugin's header and ``reprules audit`` (text, JSON, HTML) name it."""


def inference_mode() -> str:
    """The inference mode in force here, a key of :data:`INFERENCE_TEXT`: ``"all"`` (every
    rule-less Pallas kernel), ``"default"`` (those JAX would refuse) or ``"off"``."""
    if inferring():
        return "all"
    return "default" if inferring_by_default() else "off"


def sound_types() -> bool:
    """Whether reprules types rule-less opaque calls and control flow on a varying
    predicate soundly where JAX's types are too small: on unless ``REPRULES_SOUND_TYPES=0``."""
    return not _env_off(SOUND_TYPES_ENV)


# The variables read at trace time, as they were when last looked at (see notice_env).
_TRACE_ENVS = (VERIFY_ENV, STRICT_ENV, INFER_ENV, SOUND_TYPES_ENV)
# CPython's os.environ keeps its entries in a dict under encoded keys: a lookup there costs a
# tenth of os.environ.get's for an unset variable (a KeyError caught), and notice_env runs at
# every bind (os.environ.get where that dict is not there).
_ENV_KEYS = [getattr(os.environ, "encodekey", str)(name) for name in _TRACE_ENVS]


def _env_now() -> list[object]:
    data = getattr(os.environ, "_data", None)
    if type(data) is dict:
        return [data.get(key) for key in _ENV_KEYS]
    return [os.environ.get(name) for name in _TRACE_ENVS]


_env_seen = _env_now()
env_changed: Callable[[], None] | None = None  # set by _modes: strict's hook follows, JAX's caches dropped


def notice_env() -> None:
    """Where a trace may start (the shim calls it): if a mode's environment variable changed
    since the last look, runs :data:`env_changed`, so that no trace or type JAX cached in the
    old mode is reused (JAX keys its caches by its own config, never by reprules' modes).
    The context managers of ``_modes`` drop the caches themselves."""
    global _env_seen
    now = _env_now()
    if now == _env_seen:
        return
    with lock:
        if now == _env_seen:
            return
        _env_seen = now
    if env_changed is not None:
        env_changed()


def dormant() -> bool:
    return _env_on(DORMANT_ENV)


def modes() -> tuple[bool, bool, bool, bool, bool]:
    """(verifying, strict, inferring, inferring by default, sound types), as a trace cache key."""
    return verifying(), strict_on(), inferring(), inferring_by_default(), sound_types()
