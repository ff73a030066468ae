"""What every other folder of the shim stands on; it knows nothing of kernels or rules.

``_jax`` is the one module of reprules that imports ``jax._src``: every JAX
internal the shim uses is reached through it, per version. ``_patches`` records
each change made to JAX so that it can be undone; ``_frames`` tells which JAX
function reached a hook; ``_source`` makes the equations reprules adds point at
the user's line; ``_types`` reads and writes the varying axes of a value in each
era's own way (the rep era's mesh sets, the vma era's ``vma``, the mat era's
``manual_axis_type``).
"""
