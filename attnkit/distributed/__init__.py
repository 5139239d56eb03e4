"""Context parallelism (docs/semantics.md §14): attention over a sequence sharded across ranks or devices.

torch tensors run on a torch.distributed process group (:mod:`attnkit.distributed.torch_cp`); JAX arrays on a mesh
axis, or inside the caller's own shard_map (:mod:`attnkit.distributed.jax_cp`).
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

from attnkit import empty_rows, spellings
from attnkit.distributed.sharding import Sharding, Strategy
from attnkit.errors import InvalidInputError
from attnkit.frontends import ops_for
from attnkit.spec import AttentionSpec

_NAME = "attnkit.distributed.attend"


def _implementation(x: Any, argument: str) -> ModuleType:
    """The module serving ``x``'s framework; ops_for raises the typed error for anything else."""
    if ops_for(x, argument).framework.value == "jax":
        from attnkit.distributed import jax_cp

        return jax_cp
    from attnkit.distributed import torch_cp

    return torch_cp


def _placement(is_jax: bool, group: Any, mesh: Any, axis_name: Any) -> None:
    if is_jax and (mesh is None or axis_name is None):
        raise InvalidInputError(f"JAX arrays need mesh= and axis_name= (got mesh={mesh!r}, axis_name={axis_name!r})")
    if is_jax and group is not None:
        raise InvalidInputError("group= is a torch.distributed process group; JAX arrays take mesh= and axis_name=")
    if not is_jax and (mesh is not None or axis_name is not None):
        raise InvalidInputError("mesh= and axis_name= are for JAX arrays; torch tensors take group=")


def attend(spec: Any, q: Any, k: Any, v: Any = ..., **options: Any) -> Any:
    """The sharded call of §14: every rank (device) passes its shards of q, k, v and gets its shard of out (and lse).
    The result and gradients are those of :func:`attnkit.attend` on the whole tensors, whichever strategy and
    sharding run it. torch: a collective over ``group``; a bad input on any rank raises a typed error on every rank.
    JAX: ``mesh=`` and ``axis_name=``, or ``axis_name=`` alone inside a shard_map.

    Keyword arguments (``options``):

    * ``group``: torch's process group (``None``: the default group);
    * ``mesh``, ``axis_name``: JAX's mesh and the axis the sequence is sharded along; with ``mesh``, q, k, v (and
      segment ids) are whole arrays laid out by :func:`shard`, and out and lse come back so laid out; without it,
      inside the caller's shard_map, they are the device's local shards;
    * ``strategy``: ``"ring"`` (K/V chunks passed around the ring, the default), ``"allgather"`` or ``"ulysses"``
      (sequence shards to head shards; Hq and Hkv multiples of the rank count), a :class:`Strategy`;
    * ``sharding``: ``"zigzag"`` (the default; rank r holds chunks r and 2P−1−r of 2P) or ``"contiguous"``, a
      :class:`Sharding`; the sequence length must divide into the chunks;
    * ``q_lengths``, ``kv_lengths``: the global lengths (B,), the same on every rank;
    * ``q_segment_ids``, ``kv_segment_ids``: sharded like q and k;
    * ``mask``, ``bias`` (torch): the rank's rows against every key in global order, (B|1, Hq|1, local Lq, global Lk);
    * ``return_lse``, ``backend``: as for :func:`attnkit.attend`; lse comes back as the rank's shard, float32;
    * ``sinks``: (Hq,), the same on every rank, joining each row once, after its blocks are merged (§15);
    * ``alibi_slopes``: (Hq,) or (B, Hq), the same on every rank, ALiBi's at global distances (§16);
    * ``mask_mod``: a mask program (§17) that sees global positions;
    * ``dropout_p``, ``dropout_seed``, ``dropout_key``: dropout (§18) that keeps what the single-device call keeps,
      with one seed on every rank (the same ``dropout_seed`` on each, or drawn by rank 0 in torch).

    :param spec: the call's spec, the same on every rank.
    :param q: this rank's shard of the queries (torch), or the laid-out array (JAX).
    :param k: this rank's shard of the keys, sharded as q.
    :param v: this rank's shard of the values, sharded as q.
    :returns: this rank's shard of out, or ``(out, lse)`` with ``return_lse=True``.
    :raises attnkit.InvalidInputError: a length that does not divide into the chunks, head counts ``"ulysses"``
        cannot split, or inputs the ranks disagree on.
    """
    implementation = _implementation(q, "q")
    local = implementation.attend_jax if implementation.__name__.endswith("jax_cp") else implementation.attend_torch
    if type(spec) is not AttentionSpec or v is ...:
        raise spellings.call_error(local, spec, {"v": v}, {}, AttentionSpec, _NAME)
    try:
        with empty_rows.intended():  # a block's rows that see no key are the larger call's plan
            return local(spec, q, k, v, **options)
    except TypeError:
        unknown = {key: value for key, value in options.items() if key not in inspect.signature(local).parameters}
        if unknown:  # then Python refused the call before it ran: say what attnkit spells instead
            raise spellings.call_error(local, spec, {"v": v}, unknown, AttentionSpec, _NAME) from None
        raise


def shard(
    x: Any, group: Any = None, sharding: str = "zigzag", seq_axis: int = 2, *, mesh: Any = None, axis_name: Any = None
) -> Any:
    """This rank's shard of the whole tensor ``x`` along ``seq_axis`` (torch); for JAX, the whole array laid out on
    ``mesh`` so that device r of ``axis_name`` holds its chunks.

    :param x: the whole tensor (torch: the same on every rank) or JAX array.
    :param group: torch's process group (``None``: the default group).
    :param sharding: ``"zigzag"`` or ``"contiguous"``, as :func:`attend` takes it.
    :param seq_axis: the sequence axis of ``x`` (2 for bhsd q, k, v; 1 for bshd).
    :param mesh: JAX's mesh.
    :param axis_name: the mesh axis the sequence is sharded along.
    """
    implementation = _implementation(x, "x")
    is_jax = implementation.__name__.endswith("jax_cp")
    _placement(is_jax, group, mesh, axis_name)
    if is_jax:
        return implementation.shard_jax(x, mesh, axis_name, sharding, seq_axis)
    return implementation.shard_torch(x, group, sharding, seq_axis)


def unshard(
    x_local: Any, group: Any = None, sharding: str = "zigzag", seq_axis: int = 2, *, mesh: Any = None,
    axis_name: Any = None,
) -> Any:  # fmt: skip
    """The whole tensor in global order: from every rank's shard (torch, a collective), or from a JAX array laid out
    by :func:`shard` (out, lse and gradients too).

    :param x_local: this rank's shard (torch) or the laid-out JAX array.
    :param group: torch's process group (``None``: the default group).
    :param sharding: the sharding ``x_local`` was made with.
    :param seq_axis: the sequence axis (for lse, (B, Hq, L), it is 2 as well).
    :param mesh: JAX's mesh.
    :param axis_name: the mesh axis the sequence is sharded along.
    """
    implementation = _implementation(x_local, "x_local")
    is_jax = implementation.__name__.endswith("jax_cp")
    _placement(is_jax, group, mesh, axis_name)
    if is_jax:
        return implementation.unshard_jax(x_local, mesh, axis_name, sharding, seq_axis)
    return implementation.unshard_torch(x_local, group, sharding, seq_axis)


__all__ = ["Sharding", "Strategy", "attend", "shard", "unshard"]
