"""attnkit: one attention API across kernel backends, with one semantic contract (docs/semantics.md)."""

from __future__ import annotations

from attnkit.api import attend, explain
from attnkit.backend import (
    AttentionInputs,
    Backend,
    BaseBackend,
    Capabilities,
    Delegation,
    Feature,
    Framework,
    Gradients,
    MissingPackageBackend,
    Problem,
    capability_reasons,
)
from attnkit.config import configure, current_config, use_backend, use_config
from attnkit.dropout import dropout_keep_mask
from attnkit.errors import (
    AttnkitError,
    BackendUnavailableError,
    ConfigError,
    EmptyRowsWarning,
    InvalidInputError,
    InvalidInputTypeError,
    InvalidSpecError,
    MaskProgramError,
    UnexpectedArgumentError,
    UnknownBackendError,
)
from attnkit.ragged import attend_paged, attend_varlen
from attnkit.registry import backends as registered_backends
from attnkit.registry import get_backend, register_backend, unregister_backend
from attnkit.spec import AttentionSpec, CausalAlignment, Layout, Variant

__version__ = "0.2.0"

__all__ = [
    "AttentionInputs",
    "AttentionSpec",
    "AttnkitError",
    "Backend",
    "BaseBackend",
    "BackendUnavailableError",
    "Capabilities",
    "CausalAlignment",
    "ConfigError",
    "EmptyRowsWarning",
    "Delegation",
    "Feature",
    "Framework",
    "Gradients",
    "InvalidInputError",
    "InvalidInputTypeError",
    "InvalidSpecError",
    "Layout",
    "MaskProgramError",
    "MissingPackageBackend",
    "Problem",
    "UnexpectedArgumentError",
    "UnknownBackendError",
    "Variant",
    "attend",
    "attend_paged",
    "attend_varlen",
    "registered_backends",
    "capability_reasons",
    "configure",
    "current_config",
    "dropout_keep_mask",
    "explain",
    "get_backend",
    "register_backend",
    "unregister_backend",
    "use_backend",
    "use_config",
]
