"""The messages that teach, one module per concern; the exceptions they go with are in ``_errors``.

Each says what happened (the kernel or primitive, the mesh axes, the varying
sets seen), why, the fix (the line to paste), and the JAX version:

``advice``       the rule to write: MissingRuleError, StrictModeError, a broken rule's fix
``out_types``    output types JAX alone gets wrong: out_shape annotations, rule-less calls, control flow
``gradients``    a custom_vjp bwd's cotangent that cannot be made exact (CotangentError)
``calls``        calls no rule can type: a hidden abstract mesh, pl.core_map, an MPMD pl.kernel
"""
