"""The rule behind an equation, and where a declared type disagrees with it.

``_resolve`` finds an equation's rule (a registered one always wins, then one
derived by inference where inference is on for that kernel), describes each
opaque primitive to the entry points (``Opaque``) and tells reports what
reprules knows of a call (``identify``). ``_kernel_inference`` derives the
rules of ``pl.kernel`` calls at their bind. ``_union`` widens an ``out_shape``
annotated by hand that claims fewer varying axes than the rule, and ``pcast``
keeps JAX's ``pcast`` exact on a value so widened.
"""
