"""Inference: a kernel body's jaxpr in, a replication rule or a refusal out.

``_equations`` reads what one equation does to its operands from JAX's own
marks; ``_effects`` is the data of what each accepted primitive may read and
write; ``_analysis`` runs a body against it and proves what each ref ends up
depending on (or names the first equation that is not local); ``infer`` turns
that into a rule for a ``pallas_call`` or ``pl.kernel`` call. Nothing here
patches JAX.
"""
