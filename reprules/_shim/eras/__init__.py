"""JAX's three eras of replication tracking; each module chooses and installs its adapters.

``rep`` (JAX 0.4.28 - 0.5.x, ``check_rep=True``): per-primitive check and
rewrite rules, with ``rep_gaps`` filling the rules JAX lacks there; ``vma``
(0.6 - 0.9, ``check_vma=True``): varying axes carried in the types; ``mat``
(0.10 - 0.12): the same through ``manual_axis_type``. The façade
(``reprules._shim``) picks one by feature detection, once.
"""
