"""The demo workloads of ``reprules audit``: training steps, not library code.

``workloads`` holds the bundled cases the audit runs with no target (JAX
#21855, a tensor-parallel MLP with a Pallas matmul, JAX's Pallas ``layer_norm``,
a small transformer), each built with checking off and with reprules;
``transformer`` is the Megatron-style transformer they and the benchmark use,
and ``scale`` its collective bytes per step on paper. They use reprules only
through its public API, as a user's step would.
"""
