"""Where kernels enter a program: one adapter per way of calling an opaque kernel.

``_pallas_hooks`` hooks what every ``pallas_call`` goes through when it is
traced (every era): the kernel is found where JAX traces it, then once at the
bind; ``pallas_grad`` names the kernel in JAX's refusal of ``jax.grad``
through a ``pallas_call``, with the ``custom_vjp`` that fixes it.
``pallas_call`` types a ``pallas_call``'s outputs by its rule (vma and mat
eras); ``core_map`` does the same for Pallas' second entry point, ``pl.kernel``
/ ``pl.core_map``; ``primitives`` for user primitives, ``ffi_call`` and
jax-triton's ``triton_call``. Each entry point takes the rule from ``rules``.
"""
