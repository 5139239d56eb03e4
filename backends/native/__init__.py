"""Native backends: thin lowerings of the contract onto the attention call a framework already has.

``torch-sdpa`` (torch scaled_dot_product_attention), ``torch-flex`` (torch flex_attention, compiled by inductor),
``jax-xla`` (jax.nn.dot_product_attention), ``flash-attn`` (flash_attn_func / varlen, CUDA). Where a backend's
package is missing a stand-in takes its name and says what to install.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, Framework, LazyBackend, MissingPackageBackend

TORCH, JAX = frozenset({Framework.TORCH}), frozenset({Framework.JAX})


def backends() -> list[Backend | LazyBackend]:
    """Each backend's module is imported at its first use (attnkit.backend.LazyBackend)."""
    found: list[Backend | LazyBackend] = []
    if importlib.util.find_spec("torch") is not None:
        found += [
            LazyBackend("torch-sdpa", TORCH, f"{__name__}.torch_sdpa:TorchSdpaBackend"),
            LazyBackend("torch-flex", TORCH, f"{__name__}.torch_flex:TorchFlexBackend"),
        ]
    else:
        found += [MissingPackageBackend(name, "torch", "torch") for name in ("torch-sdpa", "torch-flex")]
    if importlib.util.find_spec("jax") is not None:
        found.append(LazyBackend("jax-xla", JAX, f"{__name__}.jax_xla:JaxXlaBackend"))
    else:
        found.append(MissingPackageBackend("jax-xla", "jax", "jax"))
    if importlib.util.find_spec("torch") is not None:
        found.append(LazyBackend("flash-attn", TORCH, f"{__name__}.flash_attn:FlashAttnBackend"))
    else:
        found.append(MissingPackageBackend("flash-attn", "torch", "torch"))
    return found
