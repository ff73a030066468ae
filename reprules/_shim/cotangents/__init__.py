"""Cotangents of ``custom_vjp`` functions that call a kernel with a rule.

A kernel's bwd returns, for a replicated primal, a cotangent that may vary over
the activations' axes; JAX's transpose either psums it defensively (checking
off) or not at all. ``_bwd_trace`` reads a bwd's equations where they are staged,
``_taint`` tells which of its cotangents mix replicated and varying parts, and
``custom_vjp`` (vma and mat eras) and ``custom_vjp_rep`` (rep era) add exactly
the psums that are needed, or raise ``CotangentError`` explaining the bwd.
"""
