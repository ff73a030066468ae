"""Rules for the kernels of JAX's own Pallas ops (``jax.experimental.pallas.ops``).

Each function is an entry point of the ``reprules.rules`` group, named after
the op module it covers, and is called with that module right after it is
imported. It registers rules on the op's kernel functions as they are, with no
copy or edit of JAX's code. The kernels of each op are listed in
:data:`KERNELS`; one the installed JAX's module lacks (renamed or removed in
JAX) is reported, not skipped silently: the others are registered, then the
pack raises, so the import shows a ``PackWarning`` naming it and
``reprules.packs()`` marks the pack failed (tests/test_jax_pallas_ops.py fails
on every JAX where such a name is missing).

Every kernel covered here computes each block of its outputs from blocks of
its inputs on one device and never communicates, so its outputs vary over the
union of what its inputs vary over: ``rules.same()``. Inputs the kernel reads
whole on every device (a replicated weight, a page pool, a mask table, a
replicated key/value head shared by sharded query heads) are cast up to that
union, which is free in the forward pass; the backward pass then psums their
gradients over exactly the axes they were cast over (or, for ops with a
``custom_vjp``, the cotangent is psummed over the axes it varies over and its
primal does not). Ops whose kernels are nested inside the op's Python function
(made anew on every call: megablox, TPU paged attention, ragged paged
attention, the TPU PRNG) get ``rules.inferred()`` on ``kernels_in(module)``
instead, as the tokamax pack does (see the functions at the end).
"""

from __future__ import annotations

from types import ModuleType

import reprules
from reprules import rules

# The kernels each pack function registers, by their names in the op module.
KERNELS: dict[str, tuple[str, ...]] = {
    "layer_norm": ("layer_norm_forward_kernel", "layer_norm_backward_kernel_dx", "layer_norm_backward_kernel_dw_db"),
    "rms_norm": ("rms_norm_forward_kernel", "rms_norm_backward_kernel_dx", "rms_norm_backward_kernel_dw_db"),
    "softmax": ("_vmappable_softmax_kernel",),
    "attention": ("mha_forward_kernel", "_preprocess_backward_kernel", "mha_backward_kernel"),
    "decode_attention": ("attn_forward_kernel",),
    "paged_attention_gpu": ("paged_attention_kernel",),
    "splash_attention": ("flash_attention_kernel", "_flash_attention_dq_kernel", "_flash_attention_dkv_kernel"),
    "flash_attention_tpu": ("_flash_attention_kernel", "_flash_attention_dkv_kernel", "_flash_attention_dq_kernel"),
    "matmul_tpu": ("matmul_kernel",),
    "example_kernel_tpu": ("double_kernel",),
}


def _register(module: ModuleType, rule: rules.RuleLike, function: str) -> None:
    """Registers ``rule`` on every kernel of ``KERNELS[function]``; raises after if any is missing."""
    missing = []
    for name in KERNELS[function]:
        kernel = getattr(module, name, None)
        if kernel is None:
            missing.append(name)
        else:
            reprules.replication_rule(rule)(kernel)
    if missing:
        import jax

        raise LookupError(
            f"{module.__name__} in JAX {jax.__version__} has no {', '.join(missing)}: renamed or removed "
            "in JAX, so calls of it get no rule (the module's other kernels have theirs).\n"
            "Fix: upgrade reprules; until then, register the renamed kernel yourself with "
            "`import reprules` and reprules.replication_rule(reprules.rules.same())(kernel)."
        )


def layer_norm(module: ModuleType) -> None:
    """``ops.gpu.layer_norm`` (0.4.29+) and ``ops.layer_norm`` (0.4.28).

    Every row is normalised on its own device; the dw/db kernel sums over the
    local rows, so its outputs vary like the input (the psum over the batch
    axes is then inserted by the custom_vjp cotangent handling).
    """
    _register(module, rules.same(), "layer_norm")


def rms_norm(module: ModuleType) -> None:
    """``ops.gpu.rms_norm`` (0.4.29+) and ``ops.rms_norm`` (0.4.28).

    As :func:`layer_norm`: per-row forward and dx kernels; the dw/db kernel
    sums over the local rows (psummed over the batch axes by the custom_vjp
    cotangent handling).
    """
    _register(module, rules.same(), "rms_norm")


def softmax(module: ModuleType) -> None:
    """``ops.gpu.softmax`` (0.4.29+) and ``ops.softmax`` (0.4.28): one row per program."""
    _register(module, rules.same(), "softmax")


def attention(module: ModuleType) -> None:
    """``ops.gpu.attention`` (0.4.29+) and ``ops.attention`` (0.4.28): ``mha``.

    Forward, backward-preprocess (delta) and backward (dq, dk, dv) kernels work
    per (batch, head) on local blocks; with batch or heads sharded every input
    and output varies alike.
    """
    _register(module, rules.same(), "attention")


def decode_attention(module: ModuleType) -> None:
    """``ops.gpu.decode_attention`` (0.4.29+): ``mqa`` and ``gqa`` (one kernel, vmapped over batch).

    The kernel returns per-split partial outputs and softmax statistics that
    the op combines in plain JAX, all per batch element.
    """
    _register(module, rules.same(), "decode_attention")


def paged_attention_gpu(module: ModuleType) -> None:
    """``ops.gpu.paged_attention`` (0.5.1+).

    The page pool (``k_pages``/``v_pages``) is read whole on each device and
    the block tables and lengths are per sequence: the output varies like the
    union (the sharded batch), and a replicated pool is cast up for free.
    """
    _register(module, rules.same(), "paged_attention_gpu")


def splash_attention(module: ModuleType) -> None:
    """``ops.tpu.splash_attention.splash_attention_kernel`` (kernels present from 0.4.28).

    Forward, dq and dkv (fused backward) kernels. The mask tables (scalar
    prefetch and partial mask blocks) are replicated constants; with MQA the
    shared k/v are replicated while query heads are sharded, so dk/dv vary
    over the head axes and are psummed over exactly those axes.
    """
    _register(module, rules.same(), "splash_attention")


def flash_attention_tpu(module: ModuleType) -> None:
    """``ops.tpu.flash_attention`` (kernels present from 0.4.28).

    Forward (o, l, m), dkv and dq (dq, d_bias) kernels, per (batch, head) block.
    """
    _register(module, rules.same(), "flash_attention_tpu")


def matmul_tpu(module: ModuleType) -> None:
    """``ops.tpu.matmul`` (0.4.33+): each output tile from a row block of x and a column block of y."""
    _register(module, rules.same(), "matmul_tpu")


def example_kernel_tpu(module: ModuleType) -> None:
    """``ops.tpu.example_kernel`` (0.4.28+): elementwise ``double``."""
    _register(module, rules.same(), "example_kernel_tpu")


# --- ops whose kernels are nested functions, made anew on every call: rules derived from bodies ---


def _inferred(module: ModuleType) -> None:
    """``rules.inferred()`` on every kernel defined in ``module``'s source (its package, for a
    package's ``__init__``): nothing to name ahead of time, so each kernel gets the rule
    ``reprules.inference()`` derives from its body, or a ``MissingRuleError`` saying why not."""
    reprules.replication_rule(rules.inferred())(reprules.kernels_in(module.__name__))


def megablox(module: ModuleType) -> None:
    """``ops.tpu.megablox`` (``gmm``, ``tgmm``): kernels nested in ``gmm``/``tgmm``.

    Per-tile matmuls over local rows with scalar-prefetched group metadata; no
    communication. Derived: ``gmm``'s output varies like the tokens, a
    replicated weight's gradient (``tgmm``, a per-shard partial sum) is
    psummed over exactly the token axes.
    """
    _inferred(module)


def paged_attention_tpu(module: ModuleType) -> None:
    """``ops.tpu.paged_attention``: the kernel is nested in ``paged_attention``.

    Per-sequence attention reading pages by block table (scalar prefetch) from
    a page pool read whole on each device: output varies like the sequences.
    """
    _inferred(module)


def ragged_paged_attention_tpu(module: ModuleType) -> None:
    """``ops.tpu.ragged_paged_attention``: the kernel is nested in ``ragged_paged_attention``."""
    _inferred(module)


def random_tpu(module: ModuleType) -> None:
    """``ops.tpu.random`` (threefry, philox): counter-based PRNG kernels nested per call.

    Bits depend on the key alone: replicated key, replicated bits; a key
    sharded over an axis, bits varying over it. (``prng_utils`` holds no kernel.)
    """
    _inferred(module)
