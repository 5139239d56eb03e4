"""Native backends: thin lowerings of the contract onto the attention call a framework already has.

``torch-sdpa`` (torch scaled_dot_product_attention), ``torch-flex`` (torch flex_attention, compiled by inductor),
``jax-xla`` (jax.nn.dot_product_attention), ``flash-attn`` (flash_attn_func / varlen, CUDA). Each registers on
import; where its package is missing a stand-in registers under the same name and says what to install.
"""

from __future__ import annotations

import importlib.util

from attnkit import MissingPackageBackend, register_backend

if importlib.util.find_spec("torch") is not None:
    from .torch_sdpa import TorchSdpaBackend

    register_backend(TorchSdpaBackend())
else:
    register_backend(MissingPackageBackend("torch-sdpa", "torch", "torch"))

if importlib.util.find_spec("torch") is not None:
    from .torch_flex import TorchFlexBackend

    register_backend(TorchFlexBackend())
else:
    register_backend(MissingPackageBackend("torch-flex", "torch", "torch"))

if importlib.util.find_spec("jax") is not None:
    from .jax_xla import JaxXlaBackend

    register_backend(JaxXlaBackend())
else:
    register_backend(MissingPackageBackend("jax-xla", "jax", "jax"))

if importlib.util.find_spec("torch") is not None:
    from .flash_attn import FlashAttnBackend

    register_backend(FlashAttnBackend())
else:
    register_backend(MissingPackageBackend("flash-attn", "torch", "torch"))
