"""The triton backend's compiled launches, planned on CPU: what ``launch.TritonLauncher`` does for a GPU up to the
launch itself, for sm_80 and sm_90, in every declared dtype, under every kernel switch that changes the plan.

The launcher plans for a ``launch.Target`` (compiled, an arch) and hands each launch to a ``launch.KernelExecutor``.
Here a recording executor stands for the GPU (``interpreted = False``: it gets the compiled kernels' constexprs) and
the autotuner gets a timer that needs no GPU, so the compiled branches run in CI: ``gpu_configs``, the autotuner,
tensor descriptors, the warp-specialised candidate and its allocator, the one-pass backward, split-K (with a fake SM
count) and the Δ kernel's rows. Each launch is checked against the kernel's signature in kernels.py and against
what the plan must be, written out here from docs/triton.md rather than from launch.py's functions.

The executing variant at the end runs the compiled plan's kernels in Triton's interpreter on CPU tensors and compares
them with the float64 oracle (``attnkit.testing``).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs, Dropout, PagedInputs
from attnkit.contract import diagonal_band
from attnkit.spec import CausalAlignment, Variant
from tests.conftest import available_backends

pytestmark = pytest.mark.skipif("triton" not in available_backends(), reason="triton not available here")

ARCHS = ("sm_80", "sm_90")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: A fake GPU's SM count, so that decode calls plan split-K (contract.kernels.decode_splits).
PROCESSORS = 132
#: The dropout of the DROPOUT scenarios: the threshold round(0.7 · 2³²) has its top bit set, so does the seed.
DROPOUT = Dropout(0.7, torch.tensor(-(1 << 63) + 12345, dtype=torch.int64), head_start=1, query_start=2, key_start=3)
#: The descriptor parameters of each kernel that has them, and the operand each describes.
DESCRIPTOR_OPERANDS = {"forward": {"KTiles": "K", "VTiles": "V"}, "backward_dq": {"KTiles": "K", "VTiles": "V"},
                       "backward_dkdv": {"QTiles": "Q", "DOutTiles": "DOut"}}  # fmt: skip


# ---------------------------------------------------------------------------------------------- the recording GPU


@dataclass
class Launch:
    kernel: Any  # contract.kernels.Kernel
    grid: tuple[int, int, int]
    args: list[Any]
    constants: dict[str, Any]
    options: dict[str, int]

    @property
    def tile(self) -> Any:
        from attnkit.backends.triton import launch

        return launch.TileConfig(self.constants["BLOCK_M"], self.constants["BLOCK_N"], self.options["num_warps"],
                                 self.options["num_stages"], self.constants.get("WARP_SPECIALIZE", False))  # fmt: skip


def signature(kernel: Any) -> tuple[list[str], set[str], set[str]]:
    """A kernel's runtime parameters in order, its constexprs, and those of them without a default, read from the
    Python function in kernels.py."""
    from attnkit.backends.triton import launch

    function = launch.FUNCTIONS[kernel]
    parameters = inspect.signature(getattr(function, "fn", function)).parameters.values()
    constexpr = {p.name for p in parameters if "constexpr" in str(p.annotation)}
    runtime = [p.name for p in parameters if p.name not in constexpr]
    required = {p.name for p in parameters if p.name in constexpr and p.default is inspect.Parameter.empty}
    return runtime, constexpr, required


def executor(*, compiled: bool) -> Any:
    """A KernelExecutor that records each launch instead of running it. Compiled (``interpreted = False``), it also
    does to the one-pass dq sum what the dK/dV kernel does: adds into it (one per launch), so a plan that launches it
    more than once on the caller's dq sum shows in dq."""
    from attnkit.backends.triton import launch

    class Recording(launch.KernelExecutor):
        interpreted = not compiled

        def __init__(self) -> None:
            self.launches: list[Launch] = []

        def launch(self, kernel: Any, grid: Any, args: list[Any], constants: dict[str, Any], options: Any) -> None:
            self.launches.append(Launch(kernel, grid, args, constants, options))
            if constants.get("ATOMIC_DQ"):
                args[signature(kernel)[0].index("DQSum")].add_(1.0)

    return Recording()


def decreasing_timer() -> Callable[[Callable[[], None]], float]:
    """An autotuner timer without a GPU: runs the launch twice, as a benchmark runs it repeatedly, and times each
    candidate faster than the one before, so the last candidate is the one chosen."""
    counter = itertools.count()

    def timer(run: Callable[[], None]) -> float:
        run()
        run()
        return -float(next(counter))

    return timer


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PROCESSORS SMs for split-K's rule, and no allocator set before the test (as in a fresh process): restored."""
    from triton.runtime import _allocation

    import attnkit.contract.kernels as contract

    monkeypatch.setattr(contract, "_processors", lambda device: PROCESSORS)
    before = _allocation._allocator.get()
    try:
        yield
    finally:
        _allocation._allocator.set(before)


# ---------------------------------------------------------------------------------------------- the calls planned


@dataclass(frozen=True)
class Scenario:
    name: str
    spec: AttentionSpec = field(default_factory=AttentionSpec)
    head_dim: int = 64
    head_dim_v: int | None = None  # None: head_dim
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    len_q: int = 77
    len_k: int = 300
    mask: bool = False
    bias: bool = False  # with dbias
    q_lengths: bool = False
    kv_lengths: bool = False
    segments: bool = False
    dlse: bool = False
    alibi: bool = False  # per (batch, query head) slopes
    paged: bool = False  # attend_paged: forward only
    dropout: bool = False  # DROPOUT: p above 1/2, the seed's top bit set, a shard's offsets
    deterministic: bool = False  # the two-kernel backward wherever one pass would run
    warp_specialize: bool = False  # the backend's option: the launcher offers the warp-specialised tile
    aligned: bool = True  # q, k, v, dout rows on 16 bytes (descriptors need them)

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim


def _scenarios() -> list[Scenario]:
    whole: dict[str, Any] = dict(len_q=256, len_k=384)  # whole 128-row tiles: the warp-specialised candidate can serve
    causal_top_left = AttentionSpec(causal=True, causal_alignment=CausalAlignment.TOP_LEFT)
    scenarios = [
        Scenario("plain"),
        Scenario("plain whole tiles", **whole),
        Scenario("warp_specialize on", warp_specialize=True, **whole),
        Scenario("warp_specialize on D=128", head_dim=128, warp_specialize=True, **whole),
        Scenario("warp_specialize on, deterministic", warp_specialize=True, deterministic=True, **whole),
        Scenario("warp_specialize on, partial tiles", warp_specialize=True),
        Scenario("warp_specialize on, causal", spec=AttentionSpec(causal=True), warp_specialize=True, **whole),
        Scenario("warp_specialize on, unaligned", warp_specialize=True, aligned=False, **whole),
        Scenario("deterministic", deterministic=True),
        Scenario("causal bottom-right", spec=AttentionSpec(causal=True)),
        Scenario("causal top-left", spec=causal_top_left),
        Scenario("window both sides", spec=AttentionSpec(window=(20, 5))),
        Scenario("window left, causal", spec=AttentionSpec(causal=True, window=(20, None))),
        Scenario("mask", mask=True),
        Scenario("bias and dbias", bias=True),
        Scenario("softcap", spec=AttentionSpec(softcap=20.0)),
        Scenario("cosine", spec=AttentionSpec(variant=Variant.COSINE)),
        Scenario("cosine D=128", spec=AttentionSpec(variant=Variant.COSINE), head_dim=128),
        Scenario("q lengths", q_lengths=True, head_dim=128),
        Scenario("kv lengths", kv_lengths=True, head_dim=128),
        Scenario("both lengths", q_lengths=True, kv_lengths=True),
        Scenario("segment ids", segments=True),
        Scenario("dlse", dlse=True),
        Scenario("alibi, warp_specialize on", alibi=True, warp_specialize=True, **whole),
        Scenario("alibi causal, deterministic", spec=AttentionSpec(causal=True), alibi=True, deterministic=True),
        Scenario("dropout", dropout=True),
        Scenario("dropout, warp_specialize on", dropout=True, warp_specialize=True, **whole),
        Scenario("dropout causal, deterministic", spec=AttentionSpec(causal=True), dropout=True, deterministic=True),
        Scenario("paged decode", spec=AttentionSpec(causal=True), len_q=1, len_k=300, paged=True),
        Scenario("split-K decode", len_q=1, len_k=2048, batch=1, heads_q=2, heads_kv=1),
        Scenario("paged split-K decode", len_q=1, len_k=2048, batch=1, heads_q=2, heads_kv=1, paged=True),
        Scenario(
            "paged split-K decode, alibi", len_q=1, len_k=2048, batch=1, heads_q=2, heads_kv=1, paged=True, alibi=True
        ),
        Scenario("unaligned", aligned=False),
        Scenario("unaligned D=128", aligned=False, head_dim=128),
        Scenario("Dv < D", head_dim=64, head_dim_v=32),
        Scenario("Dv > D", head_dim=24, head_dim_v=96),
        Scenario("Dv > D, deterministic", head_dim=24, head_dim_v=96, deterministic=True),
    ]
    # Padded head dims in every tile bucket (16..64, 128, 256), some padded; the one-pass limit (128) on both sides.
    for head_dim in (16, 40, 64, 96, 128, 160, 256):
        scenarios.append(Scenario(f"D={head_dim}", head_dim=head_dim))
        scenarios.append(Scenario(f"D={head_dim} causal, kv lengths", spec=AttentionSpec(causal=True),
                                  head_dim=head_dim, kv_lengths=True))  # fmt: skip
    return scenarios


SCENARIOS = _scenarios()


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, aligned: bool, generator: torch.Generator) -> torch.Tensor:
    """Random values; not ``aligned``: one element into its storage, so no row starts on 16 bytes."""
    count = 1
    for size in shape:
        count *= size
    flat = torch.randn(count + 1, generator=generator).to(dtype)
    return flat[:count].view(shape) if aligned else flat[1:].view(shape)


@dataclass
class Planned:
    """One scenario's forward and backward launches, and what the backward returned."""

    forward: list[Launch]
    backward: list[Launch]
    dq: torch.Tensor | None
    scale: float


def plan(scenario: Scenario, arch: str, dtype: torch.dtype, *, triton_version: str | None = None) -> Planned:
    """Plan the scenario's forward (and backward) for a compiled ``arch`` with a recording executor."""
    from attnkit.backends.triton import launch

    from attnkit.contract.kernels import attention_backward, attention_forward

    executor_ = executor(compiled=True)
    kwargs = {} if triton_version is None else {"triton_version": triton_version}
    launcher = launch.TritonLauncher(
        scenario.warp_specialize,
        target=launch.Target(compiled=True, arch=arch),
        executor=executor_,
        autotuner=launch.Autotuner(timer=decreasing_timer()),
        **kwargs,
    )
    s, generator = scenario, torch.Generator().manual_seed(0)
    q = _tensor((s.batch, s.heads_q, s.len_q, s.head_dim), dtype, s.aligned, generator)
    optional: dict[str, Any] = {}
    if s.mask:
        optional["mask"] = torch.rand(s.batch, 1, s.len_q, s.len_k, generator=generator) > 0.3
    if s.bias:
        optional["bias"] = torch.randn(1, s.heads_q, s.len_q, s.len_k, generator=generator).to(dtype)
    if s.q_lengths:
        optional["q_lengths"] = torch.tensor([s.len_q, s.len_q // 2][: s.batch], dtype=torch.int32)
    if s.kv_lengths or s.paged:
        optional["kv_lengths"] = torch.tensor([s.len_k, s.len_k // 3][: s.batch], dtype=torch.int32)
    if s.alibi:
        optional["alibi_slopes"] = torch.rand(s.batch, s.heads_q, generator=generator)
    if s.dropout:
        optional["dropout"] = DROPOUT
    if s.segments:
        optional["q_segment_ids"] = (torch.arange(s.len_q) * 3 // s.len_q).expand(s.batch, -1)
        optional["kv_segment_ids"] = (torch.arange(s.len_k) * 3 // s.len_k).expand(s.batch, -1)
    if s.paged:
        block_size = 16
        blocks = s.batch * -(-s.len_k // block_size)
        k_cache = _tensor((blocks, block_size, s.heads_kv, s.head_dim), dtype, s.aligned, generator)
        v_cache = _tensor((blocks, block_size, s.heads_kv, s.dv), dtype, s.aligned, generator)
        table = torch.randperm(blocks, generator=generator).view(s.batch, -1).to(torch.int32)
        paged = PagedInputs(q, k_cache, v_cache, table, optional["kv_lengths"], optional.get("alibi_slopes"))
        attention_forward(launcher, s.spec, paged)
        return Planned(executor_.launches, [], None, 0.0)
    k = _tensor((s.batch, s.heads_kv, s.len_k, s.head_dim), dtype, s.aligned, generator)
    v = _tensor((s.batch, s.heads_kv, s.len_k, s.dv), dtype, s.aligned, generator)
    inputs = AttentionInputs(q, k, v, **optional)
    out, lse = attention_forward(launcher, s.spec, inputs)
    forward = executor_.launches[:]
    executor_.launches.clear()
    dout = _tensor(tuple(out.shape), dtype, s.aligned, generator)
    dlse = torch.randn(lse.shape, generator=generator) if s.dlse else None
    dq, *_ = attention_backward(
        launcher, s.spec, inputs, out, lse.zero_(), dout, dlse, need_dbias=s.bias, deterministic=s.deterministic
    )
    return Planned(forward, executor_.launches, dq, s.spec.resolved_scale(s.head_dim))


# ---------------------------------------------------------------------------------------------- what it must be


def _padded(head_dim: int, head_dim_v: int) -> int:
    """docs/triton.md: both widths padded to the larger head dim's power of two, at least 16."""
    width = 16
    while width < max(head_dim, head_dim_v):
        width *= 2
    return width


def _bucket(block_d: int) -> int:
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256


def _splits(scenario: Scenario) -> int:
    from attnkit.contract.kernels import SPLIT_K_QUERY_TILE, decode_splits

    return decode_splits(scenario.batch * scenario.heads_q * -(-scenario.len_q // SPLIT_K_QUERY_TILE),
                         scenario.len_k if not scenario.paged else _table_keys(scenario), PROCESSORS)  # fmt: skip


def _table_keys(scenario: Scenario) -> int:
    return -(-scenario.len_k // 16) * 16  # the block table's capacity (16-key blocks, one table row per batch row)


def expected_tiles(kernel: str, scenario: Scenario, arch: str, dtype: torch.dtype, split_k: bool) -> tuple:
    """docs/triton.md, "Tile configurations": float32's own tiles; Hopper's for half-precision calls that read nothing
    beyond q, k and v (no mask, bias, segment ids, block table or split-K partials); else the common table."""
    from attnkit.backends.triton import launch

    bucket = _bucket(_padded(scenario.head_dim, scenario.dv))
    heavy = scenario.mask or scenario.bias or scenario.segments or scenario.paged or split_k
    if dtype == torch.float32:
        return launch.FLOAT32_GPU_CONFIGS[kernel][bucket]
    if arch == "sm_90" and not heavy and bucket in launch.SM90_GPU_CONFIGS[kernel]:
        return launch.SM90_GPU_CONFIGS[kernel][bucket]
    return launch.GPU_CONFIGS[kernel][bucket]


def expect_descriptors(kernel: str, scenario: Scenario, arch: str, dtype: torch.dtype) -> bool:
    """docs/triton.md, "Tensor descriptors": on Hopper in half precision, not in the cosine variant, not in dK/dV
    below D = 128; only where their zero fill is the load masks' work (no per-batch lengths on the side they read,
    no segment ids, no block table); only for 16-byte aligned rows."""
    if arch != "sm_90" or dtype == torch.float32 or scenario.spec.variant is Variant.COSINE or not scenario.aligned:
        return False
    if scenario.paged or scenario.segments:
        return False
    if kernel == "backward_dkdv":
        return _padded(scenario.head_dim, scenario.dv) >= 128 and not scenario.q_lengths
    return not scenario.kv_lengths


def expect_warp_specialized(kernel: str, scenario: Scenario, arch: str, dtype: torch.dtype, offered: bool) -> bool:
    """docs/triton.md, "Warp specialisation": offered, on Hopper, for the forward and dQ, where every tile is interior
    (no band, mask, bias, softcap, cosine, ALiBi, dropout, lengths, segment ids, paging or split-K; whole 128-row
    tiles), at
    padded head dims 64 and 128, with K and V through descriptors."""
    spec = scenario.spec
    edges = (spec.causal or spec.window is not None or scenario.mask or scenario.bias or spec.softcap is not None
             or spec.variant is Variant.COSINE or scenario.alibi or scenario.q_lengths or scenario.kv_lengths
             or scenario.segments or scenario.paged or scenario.dropout)  # fmt: skip
    return (
        offered
        and kernel in ("forward", "backward_dq")
        and not edges
        and scenario.len_q % 128 == 0
        and scenario.len_k % 128 == 0
        and _padded(scenario.head_dim, scenario.dv) in (64, 128)
        and expect_descriptors(kernel, scenario, arch, dtype)
    )


def check_signature(launch_: Launch) -> None:
    """Every runtime parameter of the kernel passed positionally, in order; constexprs by name, only ones the kernel
    declares and every one without a default."""
    runtime, constexpr, required = signature(launch_.kernel)
    assert len(launch_.args) == len(runtime), (launch_.kernel, len(launch_.args), len(runtime))
    assert set(launch_.constants) <= constexpr, sorted(set(launch_.constants) - constexpr)
    assert required <= set(launch_.constants), sorted(required - set(launch_.constants))


def check_constants(launch_: Launch, scenario: Scenario, dtype: torch.dtype, split_k: bool, one_pass: bool) -> None:
    """The feature switches the kernel declares, the head dims and widths, and the compiled kernels' own."""
    spec, c = scenario.spec, launch_.constants
    lower, upper = diagonal_band(spec)
    block = _padded(scenario.head_dim, scenario.dv)
    kernel = str(launch_.kernel)
    expected = dict(HEAD_DIM=scenario.head_dim, HEAD_DIM_V=scenario.dv, BLOCK_D=block, BLOCK_DV=block,
                    HAS_LOWER=lower is not None, HAS_UPPER=upper is not None,
                    BOTTOM_RIGHT=spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT, HAS_MASK=scenario.mask,
                    HAS_BIAS=scenario.bias, HAS_SOFTCAP=spec.softcap is not None,
                    COSINE=spec.variant is Variant.COSINE, HAS_Q_LENGTHS=scenario.q_lengths,
                    HAS_KV_LENGTHS=scenario.kv_lengths or scenario.paged, HAS_SEGMENT_IDS=scenario.segments,
                    HAS_ALIBI=scenario.alibi, HAS_DROPOUT=scenario.dropout,
                    PAGED=scenario.paged, SPLIT_K=split_k, HAS_DBIAS=scenario.bias, ATOMIC_DQ=one_pass,
                    HAS_DLSE=scenario.dlse, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                    COMPILED=True, INTERPRETER_BF16=False)  # fmt: skip
    wrong = {name: (c[name], value) for name, value in expected.items() if name in c and c[name] != value}
    assert not wrong, f"{kernel}: (planned, expected) {wrong}"


def check_dropout(launch_: Launch, scenario: Scenario) -> None:
    """§18's arguments after the program's: the seed tensor itself, 0-d int64 (the kernels read it: no host read);
    the threshold round(p · 2³²) as the int32 of its bits; 1 / (1 − p) rounded to float32; the offsets.
    None without dropout."""
    runtime = signature(launch_.kernel)[0]
    names = ("Seed", "dropout_threshold", "dropout_scale", "dropout_offsets")
    seed, threshold, scale, offsets = (launch_.args[runtime.index(name)] for name in names)
    if not scenario.dropout:
        assert (seed, threshold, scale, offsets) == (None,) * 4
        return
    assert isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.shape == ()
    assert seed.data_ptr() == DROPOUT.seed.data_ptr()  # no copy: a CUDA graph would replay a stale one
    assert isinstance(threshold, int) and threshold == round(DROPOUT.p * 2**32) - 2**32 and -(2**31) <= threshold
    assert scale == float(np.float32(1 / (1 - DROPOUT.p))) and offsets == (1, 2, 3)


def check_grid(launch_: Launch, scenario: Scenario, rows: int, splits: int) -> None:
    """Programs cover the sequence once: ceil(length / rows) tiles (times the splits) × heads × batch."""
    along_keys = str(launch_.kernel) == "backward_dkdv"
    length = scenario.len_k if along_keys else scenario.len_q
    heads = scenario.heads_kv if along_keys else scenario.heads_q
    tiles, splits_left = divmod(launch_.grid[0], splits)
    assert splits_left == 0 and (tiles - 1) * rows < length <= tiles * rows, (launch_.grid, rows, length, splits)
    assert launch_.grid[1:] == (heads, scenario.batch), launch_.grid


def check_descriptors(launch_: Launch, scenario: Scenario, arch: str, dtype: torch.dtype) -> None:
    """Descriptors exactly where they serve and pay: of the operand they stand for, whole, in tiles of the launch's
    rows along their sequence and the padded head dim; TMA says so."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = str(launch_.kernel)
    runtime = signature(launch_.kernel)[0]
    wanted = expect_descriptors(kernel, scenario, arch, dtype)
    assert launch_.constants["TMA"] is wanted, (kernel, launch_.constants["TMA"])
    for name, operand in DESCRIPTOR_OPERANDS[kernel].items():
        given = launch_.args[runtime.index(name)]
        if not wanted:
            assert given is None, (kernel, name)
            continue
        base = launch_.args[runtime.index(operand)]
        rows = launch_.constants["BLOCK_N"] if kernel != "backward_dkdv" else launch_.constants["BLOCK_M"]
        assert isinstance(given, TensorDescriptor) and given.base is base, (kernel, name)
        assert list(given.shape) == list(base.shape) and list(given.strides) == list(base.stride())
        assert list(given.block_shape) == [1, 1, rows, launch_.constants["BLOCK_D"]], given.block_shape


def check_autotuned(launches: list[Launch], candidates: tuple) -> None:
    """Each candidate launched twice by the timer, in order, then the chosen one (the last: the fake timer's fastest)
    once more."""
    planned = [launch_.tile for launch_ in launches]
    assert planned == [tile for tile in candidates for _ in range(2)] + [candidates[-1]], planned
    assert all(tile.block_m % 16 == 0 and tile.block_n % 16 == 0 for tile in planned)  # SEGMENT_GRANULE


def check_plan(scenario: Scenario, arch: str, dtype: torch.dtype, planned: Planned, offered: bool) -> None:
    from attnkit.backends.triton import launch
    from triton.runtime import _allocation

    splits = _splits(scenario)
    split_k = splits > 1
    one_pass = not scenario.deterministic and arch == "sm_90" and _padded(scenario.head_dim, scenario.dv) <= 128
    by_kernel: dict[str, list[Launch]] = {}
    for launch_ in planned.forward + planned.backward:
        check_signature(launch_)
        check_constants(launch_, scenario, dtype, split_k, one_pass)
        by_kernel.setdefault(str(launch_.kernel), []).append(launch_)
    order = [str(launch_.kernel) for launch_ in planned.backward]
    expected_order = ["backward_delta"] + ["backward_dq"] * (0 if one_pass else 1) + ["backward_dkdv"]
    assert [name for name, _ in itertools.groupby(order)] == (expected_order if not scenario.paged else [])
    specialized = False
    # Split-K: the forward, then its combine, one launch of one program per query row (docs/triton.md).
    merges = by_kernel.pop(launch.MERGE, [])
    assert [str(launch_.kernel) for launch_ in planned.forward[-2:]][-len(merges) - 1 :] == (
        ["forward", launch.MERGE] if split_k else ["forward"]
    )
    for merge in merges:
        assert merge.grid == (scenario.batch * scenario.heads_q * scenario.len_q, 1, 1) and merge.options == {}
        assert merge.constants["BLOCK_S"] >= splits == merge.args[signature(merge.kernel)[0].index("splits")]
    for kernel, launches in by_kernel.items():
        if kernel == "backward_delta":
            [delta] = launches
            assert delta.constants["BLOCK_M"] == launch.DELTA_BLOCK_M and delta.options == {}
            check_grid(delta, scenario, launch.DELTA_BLOCK_M, 1)
            continue
        name = {"forward": "fwd", "backward_dq": "dq", "backward_dkdv": "dkdv"}[kernel]
        candidates = expected_tiles(name, scenario, arch, dtype, split_k and kernel == "forward")
        if expect_warp_specialized(kernel, scenario, arch, dtype, offered):
            candidates = (*candidates, launch.WARP_SPECIALIZED)
            specialized = True
        check_autotuned(launches, candidates)
        for launch_ in launches:
            rows = launch_.constants["BLOCK_N" if kernel == "backward_dkdv" else "BLOCK_M"]
            check_grid(launch_, scenario, rows, splits if kernel == "forward" else 1)
            check_descriptors(launch_, scenario, arch, dtype)
            check_dropout(launch_, scenario)
        if kernel == "forward":
            assert launches[-1].args[signature(launches[-1].kernel)[0].index("splits")] == splits
    # In-kernel descriptors of the warp-specialised tile need an allocator: set where it ran, as on the GPU.
    allocator_set = not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    assert allocator_set is specialized
    if planned.dq is not None and one_pass:  # the recording dK/dV added 1 per launch: one launch's worth, scaled
        once = bool(torch.equal(planned.dq, torch.full_like(planned.dq, planned.scale)))
        assert once, f"dq sum holds {planned.dq.flatten()[0].item() / planned.scale:g} launches' additions, not 1"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_plan(arch: str, dtype: torch.dtype, fake_gpu: None) -> None:
    from attnkit.backends.triton import launch
    from triton.runtime import _allocation

    offered = launch.warp_specialization_checked(launch.triton.__version__)
    for scenario in SCENARIOS:
        _allocation._allocator.set(_allocation.NullAllocator())
        try:
            check_plan(scenario, arch, dtype, plan(scenario, arch, dtype), offered and scenario.warp_specialize)
        except Exception as error:
            raise AssertionError(f"{scenario.name} [{arch} {dtype}]: {type(error).__name__}: {error}") from error


def test_autotuned_once_per_key(fake_gpu: None) -> None:
    """A second call with the autotuner's key launches the chosen tile once, untimed."""
    from attnkit.backends.triton import launch

    from attnkit.contract.kernels import attention_forward

    executor_ = executor(compiled=True)
    launcher = launch.TritonLauncher(target=launch.Target(compiled=True, arch="sm_90"), executor=executor_,
                                     autotuner=launch.Autotuner(timer=decreasing_timer()))  # fmt: skip
    q, k, v = (torch.randn(1, 2, 100, 64, dtype=torch.bfloat16) for _ in range(3))
    attention_forward(launcher, AttentionSpec(), AttentionInputs(q, k, v))
    first = [launch_.tile for launch_ in executor_.launches]
    executor_.launches.clear()
    attention_forward(launcher, AttentionSpec(), AttentionInputs(q, k, v))
    assert [launch_.tile for launch_ in executor_.launches] == [first[-1]] and len(first) > 1


def test_arch_and_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compute capability 9.0 and up takes Hopper's tables; a compiled target needs one of the two."""
    from attnkit.backends.triton import launch

    for capability, arch in (((7, 5), "sm_80"), ((8, 0), "sm_80"), ((8, 9), "sm_80"), ((9, 0), "sm_90"),
                             ((10, 0), "sm_90")):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert launch.arch_of(torch.device("cuda")) == arch
    with pytest.raises(launch.UnknownArchError):
        launch.Target(compiled=True, arch="sm_75")
    with pytest.raises(launch.UnknownArchError):
        launch.Target(compiled=True)
    assert launch.target_of(torch.device("cpu")) == launch.INTERPRETER_TARGET  # this process interprets


def test_warp_specialized_offer_follows_the_triton_version(fake_gpu: None) -> None:
    """The warp-specialised candidate is offered only on the Triton versions where it was checked to compile as
    intended (launch.WARP_SPECIALIZATION_CHECKED: 3.6 and 3.9), whatever the option says elsewhere."""
    from attnkit.backends.triton import launch

    assert [launch.warp_specialization_checked(v) for v in ("3.6.0", "3.9.0", "3.9.1+gitabc", "3.7.0", "3.10.0",
                                                            "3.5.1", "4.0.0", "nightly")] == [True, True, True,
                                                            False, False, False, False, False]  # fmt: skip
    scenario = next(s for s in SCENARIOS if s.name == "warp_specialize on")
    for version, offered in (("3.6.0", True), ("3.9.0", True), ("3.7.0", False), ("3.10.0", False)):
        planned = plan(scenario, "sm_90", torch.bfloat16, triton_version=version)
        tiles = [launch_.tile for launch_ in planned.forward + planned.backward if "BLOCK_N" in launch_.constants]
        assert (launch.WARP_SPECIALIZED in tiles) is offered, version


# ---------------------------------------------------------------------------------------------- executed


def _cases() -> list[Any]:
    from attnkit.testing import Case

    cases = []
    for arch, dtype in itertools.product(ARCHS, ("float16", "bfloat16", "float32")):
        cases.append(pytest.param(arch, Case(spec=AttentionSpec(), batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=1,
                                                 dtype=dtype), id=f"{arch}-{dtype}-smallest"))  # fmt: skip
        if dtype == "bfloat16":  # GQA's head mapping and a padded head dim, causal, with dropout, on both archs
            cases.append(pytest.param(arch, Case(spec=AttentionSpec(causal=True), batch=1, heads_q=2, heads_kv=1,
                                                     len_q=20, len_k=24, head_dim=24, head_dim_v=24, dtype=dtype,
                                                     dropout=(0.3, 0xF00D_CAFE_1234_5678)),
                                      id=f"{arch}-{dtype}-causal-gqa-dropout"))  # fmt: skip
    return cases


@pytest.mark.parametrize(("arch", "case"), _cases())
def test_compiled_plan_executed_agrees_with_the_oracle(arch: str, case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled plan (GPU tiles, the one-pass backward on sm_90, descriptors where they pay, the autotuner timing
    each candidate twice on the live arguments) with the kernels run by Triton's interpreter on CPU tensors: the
    constexprs that follow execution (INTERPRETER_BF16, COMPILED) are the interpreter's. The first call per autotuner
    key is the one the timer's repeated launches could corrupt, so each test has its own autotuner."""
    from attnkit.backends.triton import launch
    from attnkit.backends.triton.backend import TritonBackend

    from attnkit.testing import assert_backends_agree

    launcher = launch.TritonLauncher(target=launch.Target(compiled=True, arch=arch),
                                     autotuner=launch.Autotuner(timer=decreasing_timer()))  # fmt: skip
    assert launcher.executor.interpreted
    monkeypatch.setattr(TritonBackend, "kernel_launcher", lambda self: launcher)
    monkeypatch.setattr(TritonBackend, "deterministic", lambda self: False)  # the one-pass backward where it runs
    assert "triton" in assert_backends_agree(case, backends=["triton"])


def test_the_proxy_script_asks_gpu_configs_for_sm_90_on_todays_signature() -> None:
    """scripts/proxy_against_gpu_run.py called gpu_configs with 531af8d's three arguments; today's takes five."""
    import importlib.util
    from pathlib import Path

    from attnkit.backends.triton import launch

    from attnkit.contract.kernels import KernelSwitches

    path = Path(__file__).resolve().parent.parent / "scripts" / "proxy_against_gpu_run.py"
    spec = importlib.util.spec_from_file_location("proxy_against_gpu_run", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for kernel in ("fwd", "dq", "dkdv"):
        expected = launch.gpu_configs(kernel, 128, torch.bfloat16, "sm_90", KernelSwitches())
        assert script.candidate_tiles(launch, kernel, 128) == expected == launch.SM90_GPU_CONFIGS[kernel][128]
