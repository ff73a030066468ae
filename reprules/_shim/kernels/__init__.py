"""Which kernel an equation belongs to: identity, never a name another kernel shares.

``_identity`` ties a ``pallas_call`` equation to the kernel object JAX traced
it from (remembered by kernel jaxpr, however early the call object was built)
and gives :class:`~reprules._shim.kernels._identity.PallasCall`, the one lookup
per bind that everything above is handed; ``_bodies`` does the same for the
bodies of ``pl.kernel`` / ``pl.core_map`` equations. Which *rule* applies is not
decided here but in ``rules``.
"""
