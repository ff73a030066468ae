"""The collectives report behind ``reprules.testing``: every collective of a program, found
at three levels and judged.

``_collectives`` runs one function through trace, lower and compile, and merges
what the others find: ``_walk`` reads the jaxpr (every collective and opaque
kernel, and which all-reduces are defensive), ``_hlo`` and ``_hlo_graph`` the
StableHLO and compiled-HLO text, ``_levels`` matches the three; ``_implicit``
finds the collectives XLA's partitioner inserted around opaque kernels,
``_cheaper`` those with a cheaper equivalent, ``_link_model`` estimates their
time. ``_records`` and ``_comm`` are the records users get and their rendering.
"""
