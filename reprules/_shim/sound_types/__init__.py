"""Sound types where JAX's are provably too small: checking on is never worse than off.

From JAX 0.6 some outputs are typed replicated while they differ per device:
a rule-less ``ffi_call``, user primitive or ``jax.pure_callback``
(``opaque_types``), and ``cond`` / ``switch`` / ``while_loop`` on a
device-varying predicate (``control_flow``, jax#40823). Both are typed here by
the axes they really vary over, once ``import reprules`` has run
(``REPRULES_SOUND_TYPES=0`` keeps JAX's typing); ``out_specs_note`` adds to
JAX's ``out_specs`` refusal why such a value varies. This is everything that
changes code which calls no registered kernel (the safety page lists it).
"""
