"""Native backends: thin lowerings of the contract onto the attention call a framework already has.

``torch-sdpa`` (torch scaled_dot_product_attention), ``torch-flex`` (torch flex_attention, compiled by inductor),
``jax-xla`` (jax.nn.dot_product_attention), ``flash-attn`` (flash_attn_func / varlen, CUDA). Where a backend's
package is missing a stand-in takes its name and says what to install.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, MissingPackageBackend


def backends() -> list[Backend]:
    found: list[Backend] = []
    if importlib.util.find_spec("torch") is not None:
        from .flash_attn import FlashAttnBackend
        from .torch_flex import TorchFlexBackend
        from .torch_sdpa import TorchSdpaBackend

        found += [TorchSdpaBackend(), TorchFlexBackend()]
    else:
        found += [MissingPackageBackend(name, "torch", "torch") for name in ("torch-sdpa", "torch-flex")]
    if importlib.util.find_spec("jax") is not None:
        from .jax_xla import JaxXlaBackend

        found.append(JaxXlaBackend())
    else:
        found.append(MissingPackageBackend("jax-xla", "jax", "jax"))
    if importlib.util.find_spec("torch") is not None:
        found.append(FlashAttnBackend())
    else:
        found.append(MissingPackageBackend("flash-attn", "torch", "torch"))
    return found
