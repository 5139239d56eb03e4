"""Typed user errors. Every error attnkit raises for bad input derives from :class:`AttnkitError`."""

from __future__ import annotations


class AttnkitError(Exception):
    """Base class of every error attnkit raises for a user mistake or an unservable call."""


class InvalidInputError(AttnkitError, ValueError):
    """A tensor argument has the wrong shape, range or relation to the others."""


class InvalidSpecError(AttnkitError, ValueError):
    """An AttentionSpec field has an invalid value; the message names the field and the fix."""


class InvalidInputTypeError(AttnkitError, TypeError):
    """A tensor argument has the wrong type, dtype or device."""


class UnknownBackendError(AttnkitError, ValueError):
    """A backend name that is not registered."""


class BackendUnavailableError(AttnkitError, RuntimeError):
    """The requested backend (or every backend, for ``auto``) cannot serve this call.

    The message lists every backend considered with the reasons it refused.
    """


class ConfigError(AttnkitError, ValueError):
    """A configuration file or dict names an unknown key, backend or value."""


class BuildError(AttnkitError, RuntimeError):
    """Code compiled at run time (attnkit/build.py) could not be built or may not be loaded; the message says why,
    with the compiler's first error lines for a failed compile."""


class MaskProgramError(InvalidInputError):
    """A ``mask_mod`` that is not a mask program (docs/semantics.md §17): an operation a program cannot contain, a
    captured tensor of the wrong dtype, device or framework, or a function of the wrong arity. The message names
    ``mask_mod`` and the operation."""


class UnexpectedArgumentError(InvalidInputTypeError, InvalidSpecError):
    """A call that does not fit attnkit's signature, often one written as another attention library writes it: no
    spec before q, k, v (``attend(q, k, v)``), an AttentionSpec field given by position (``AttentionSpec(True)``), or
    a keyword attnkit spells otherwise (``is_causal=``, ``attn_mask=``, ``softmax_scale=``, ``dropout_p=`` in a
    spec). The message says what to write instead. A ``TypeError``, as Python's own error for such a call is (and an
    :class:`InvalidInputTypeError` and :class:`InvalidSpecError`, whose calls it is)."""


class EmptyRowsWarning(UserWarning):
    """A causal call whose alignment leaves query rows that see no key (bottom-right with more queries than keys):
    per docs/semantics.md §4.1 and §5 they output 0 with lse −∞. Said once per process; silence it with
    ``warnings.filterwarnings("ignore", category=attnkit.EmptyRowsWarning)``."""
