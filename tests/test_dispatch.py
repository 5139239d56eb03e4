"""Registry and dispatch (issue §3): priority order, named backends, explain, caching, threads, plugins."""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from attnkit.backends.reference.torch_naive import TorchNaiveBackend

import attnkit
from attnkit import (
    AttentionInputs,
    AttentionSpec,
    BackendUnavailableError,
    Capabilities,
    Framework,
    cost,
    dispatch,
    registry,
)
from attnkit.backend import Feature
from attnkit.call_cache import CACHE, CallCache
from tests.conftest import PLUGIN_DISTRIBUTION, backend_params


class CountingBackend(TorchNaiveBackend):
    """torch-naive under another name, counting its forward calls and supports() queries."""

    def __init__(self, name: str, features: frozenset[str] | None = None) -> None:
        self.name = name
        base = TorchNaiveBackend.capabilities
        self.capabilities = Capabilities(
            frameworks=base.frameworks,
            dtypes=base.dtypes,
            devices=base.devices,
            features=base.features if features is None else features,
        )
        self.forward_calls = 0
        self.supports_calls = 0
        self.available_calls = 0

    def available(self):
        self.available_calls += 1
        return super().available()

    def supports(self, spec, problem):
        self.supports_calls += 1
        return super().supports(spec, problem)

    def forward(self, spec, inputs, need_lse):
        self.forward_calls += 1
        return super().forward(spec, inputs, need_lse)


@pytest.fixture
def plugin():
    backend = CountingBackend("test-plugin", features=frozenset({Feature.CAUSAL, Feature.GRAD, Feature.LSE}))
    attnkit.register_backend(backend)
    try:
        yield backend
    finally:
        attnkit.unregister_backend("test-plugin")


def tensors() -> tuple[Any, Any, Any]:
    return torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)


def test_auto_runs_first_backend_in_priority_that_can_serve(plugin: CountingBackend) -> None:
    with attnkit.use_config({"priority": {"cpu": ["test-plugin", "torch-naive"]}}):
        attnkit.attend(AttentionSpec(causal=True), *tensors())
        assert plugin.forward_calls == 1
        # softcap is not declared by the plugin: auto moves on to torch-naive, and explain says why
        attnkit.attend(AttentionSpec(softcap=3.0), *tensors())
        assert plugin.forward_calls == 1
        table = attnkit.explain(AttentionSpec(softcap=3.0), *tensors())
    assert "test-plugin" in table and "softcap is not supported" in table
    assert "-> torch-naive" in table


def test_named_backend_raises_with_its_reasons_instead_of_falling_back(plugin: CountingBackend) -> None:
    with pytest.raises(
        BackendUnavailableError, match="(?s)backend=.test-plugin. cannot serve.*softcap is not supported"
    ):
        attnkit.attend(AttentionSpec(softcap=3.0), *tensors(), backend="test-plugin")
    assert plugin.forward_calls == 0


def test_no_backend_can_serve_lists_every_backend_with_reasons(plugin: CountingBackend) -> None:
    with attnkit.use_config({"priority": {"cpu": ["test-plugin"]}}):
        with pytest.raises(BackendUnavailableError, match="no backend can serve this call") as raised:
            attnkit.attend(AttentionSpec(softcap=3.0), *tensors())
    message = str(raised.value)
    for name in attnkit.registered_backends():
        assert name in message


def test_decision_is_cached_per_spec_and_problem(plugin: CountingBackend) -> None:
    dispatch.clear_cache()
    with attnkit.use_config({"priority": {"cpu": ["test-plugin"]}}):
        for _ in range(5):
            attnkit.attend(AttentionSpec(causal=True), *tensors())
        assert (plugin.supports_calls, plugin.forward_calls) == (1, 5)
        attnkit.attend(AttentionSpec(causal=True), torch.randn(1, 2, 5, 8), *tensors()[1:])  # new shape
        assert plugin.supports_calls == 2


def test_availability_is_read_once_per_registry_state_not_per_new_shape(plugin: CountingBackend) -> None:
    """A growing KV cache makes a new shape, so a new decision, at every decode step: it must not look at the
    machine (imports, compilers, devices) again each time."""
    dispatch.clear_cache()
    with attnkit.use_config({"priority": {"cpu": ["test-plugin"]}}):
        for len_k in range(4, 12):
            attnkit.attend(AttentionSpec(causal=True), torch.randn(1, 2, 1, 8), *[torch.randn(1, 2, len_k, 8)] * 2)
        assert (plugin.available_calls, plugin.supports_calls, plugin.forward_calls) == (1, 8, 8)
        dispatch.clear_cache()
        attnkit.attend(AttentionSpec(causal=True), *tensors())
        assert plugin.available_calls == 2
        attnkit.register_backend(CountingBackend("test-other"))  # a registry change reads it again too
        try:
            attnkit.attend(AttentionSpec(causal=True), torch.randn(1, 2, 2, 8), *tensors()[1:])
        finally:
            attnkit.unregister_backend("test-other")
        assert plugin.available_calls == 3


def test_use_backend_forces_a_backend_for_the_block(plugin: CountingBackend) -> None:
    with attnkit.use_backend("test-plugin"):
        attnkit.attend(AttentionSpec(), *tensors())
    assert plugin.forward_calls == 1
    attnkit.attend(AttentionSpec(), *tensors())
    assert plugin.forward_calls == 1


def test_environment_forces_a_backend(plugin: CountingBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_BACKEND", "test-plugin")
    attnkit.configure()
    attnkit.attend(AttentionSpec(), *tensors())
    assert plugin.forward_calls == 1


def test_concurrent_calls_and_registrations_are_safe() -> None:
    """Many threads dispatching while others register and unregister backends: no error, right answers."""
    spec = AttentionSpec(causal=True)
    q, k, v = tensors()
    expected = attnkit.attend(spec, q, k, v, backend="torch-naive")
    stop = threading.Event()

    def churn() -> None:
        index = 0
        while not stop.is_set():
            name = f"churn-{index % 4}"
            attnkit.register_backend(CountingBackend(name), replace=True)
            attnkit.unregister_backend(name)
            index += 1

    def call(_: int) -> torch.Tensor:
        return attnkit.attend(spec, q, k, v)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(400)))
    finally:
        stop.set()
        churner.join()
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)


def test_use_backend_is_per_thread(plugin: CountingBackend) -> None:
    barrier = threading.Barrier(2)
    chosen: dict[str, str] = {}

    def worker(label: str, forced: str | None) -> None:
        problem = attnkit.Problem(Framework.TORCH, "cpu", "float32", 1, 2, 2, 3, 4, 8, 8)
        if forced:
            with attnkit.use_backend(forced):
                barrier.wait()
                chosen[label] = dispatch.select(AttentionSpec(), problem).name
        else:
            barrier.wait()
            chosen[label] = dispatch.select(AttentionSpec(), problem).name

    threads = [
        threading.Thread(target=worker, args=("forced", "test-plugin")),
        threading.Thread(target=worker, args=("free", None)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert chosen["forced"] == "test-plugin" and chosen["free"] != "test-plugin"


def test_register_rejects_non_backends_and_duplicates(plugin: CountingBackend) -> None:
    with pytest.raises(attnkit.InvalidInputTypeError, match="does not implement attnkit.Backend"):
        attnkit.register_backend(object())  # type: ignore[arg-type]
    with pytest.raises(attnkit.InvalidInputError, match="already registered"):
        attnkit.register_backend(CountingBackend("test-plugin"))


def test_entry_point_plugins_load_but_never_silently_replace_a_builtin(
    plugin_distribution: None, caplog: pytest.LogCaptureFixture
) -> None:
    builtin_sdpa = registry._backends["torch-sdpa"]
    with caplog.at_level(logging.WARNING, logger="attnkit"):
        registered, origins = attnkit.registered_backends(), registry.origins()
    source = f"from {PLUGIN_DISTRIBUTION}"
    assert origins["test-plugin-fresh"] == f"entry point fresh = attnkit_test_plugin:fresh {source}"
    # a declared replacement of a built-in is obeyed, and says so
    assert type(registered["torch-chunked"]).__module__ == "attnkit_test_plugin"
    assert origins["torch-chunked"] == f"entry point replace = attnkit_test_plugin:replace {source}, replacing built-in"
    # an undeclared clash is refused as a whole (its other backend too), logged and listed with the reason
    assert registered["torch-sdpa"] is builtin_sdpa and origins["torch-sdpa"] == "built-in"
    assert "test-plugin-other" not in registered
    refused = {plugin.entry_point.split()[2]: plugin.reason for plugin in registry.refused_plugins()}
    assert set(refused) == {"clash", "broken", "missing"}
    assert refused["clash"].startswith("InvalidInputError: backend name 'torch-sdpa' is already taken by built-in")
    assert (
        "replaces_builtin = True" in refused["clash"] and "register_backend(backend, replace=True)" in refused["clash"]
    )
    assert refused["broken"] == "RuntimeError: the plugin failed to start"
    assert refused["missing"].startswith("ModuleNotFoundError: No module named 'attnkit_test_plugin_missing'")
    warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any("entry point clash" in message and "torch-sdpa" in message for message in warned), warned
    # the user may ask for the replacement explicitly
    import attnkit_test_plugin  # type: ignore[import-not-found]

    attnkit.register_backend(attnkit_test_plugin.Renamed("torch-sdpa"), replace=True)
    assert registry.origins()["torch-sdpa"] == "registered at run time by tests.test_dispatch, replacing built-in"


def test_a_run_time_registration_says_who_made_it(plugin: CountingBackend) -> None:
    assert registry.origins()["test-plugin"] == "registered at run time by tests.test_dispatch"
    assert set(registry.origins()) == set(attnkit.registered_backends())


def test_debug_log_once_per_decision(plugin: CountingBackend, caplog: pytest.LogCaptureFixture) -> None:
    dispatch.clear_cache()
    with caplog.at_level(logging.DEBUG, logger="attnkit"):
        for _ in range(3):
            attnkit.attend(AttentionSpec(causal=True), *tensors())
    decisions = [r for r in caplog.records if "->" in r.getMessage()]
    assert len(decisions) == 1


def test_capability_reasons_name_value_and_allowed() -> None:
    caps = Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16"}),
        devices=frozenset({"cuda"}),
        features=frozenset(),
        head_dims=(16, 256),
    )
    problem = attnkit.Problem(Framework.TORCH, "cpu", "float32", 1, 2, 2, 3, 4, 320, 8, has_mask=True)
    reasons = attnkit.capability_reasons(caps, AttentionSpec(causal=True), problem)
    assert "device=cpu (supported: cuda)" in reasons
    assert "dtype=float32 (supported: float16)" in reasons
    assert "head_dim=320 (supported: 16..256)" in reasons
    assert "head_dim_v=8 (supported: 16..256)" in reasons
    assert "causal is not supported" in reasons and "mask is not supported" in reasons
    # Arrays of a framework it does not take: that one reason, as a backend not yet imported gives it
    # (attnkit.backend.LazyBackend), the others being moot.
    foreign = dataclasses.replace(problem, framework=Framework.JAX)
    assert attnkit.capability_reasons(caps, AttentionSpec(causal=True), foreign) == ["framework=jax (supported: torch)"]


def test_repeated_calls_still_check_length_values_and_follow_config(plugin: CountingBackend) -> None:
    """The per-signature fast path re-checks what is data (length values) and what can change (config)."""
    q, k, v = tensors()
    attnkit.attend(AttentionSpec(), q, k, v, kv_lengths=torch.tensor([4]))
    with pytest.raises(attnkit.InvalidInputError, match=r"kv_lengths values must lie in \[0, 4\], got min=5"):
        attnkit.attend(AttentionSpec(), q, k, v, kv_lengths=torch.tensor([5]))
    spec = AttentionSpec(causal=True)
    attnkit.attend(spec, q, k, v)
    with attnkit.use_config({"priority": {"cpu": ["test-plugin"]}}):
        attnkit.attend(spec, q, k, v)
    assert plugin.forward_calls == 1
    with pytest.raises(attnkit.InvalidInputTypeError, match="k has dtype float64"):
        attnkit.attend(spec, q, k.double(), v)


def test_repeated_calls_follow_configure_and_nested_scopes(plugin: CountingBackend) -> None:
    """The fast path's key reads the config state without a call: configure() and each scope must still change it."""
    spec = AttentionSpec()
    q, k, v = tensors()
    attnkit.attend(spec, q, k, v)  # cached under the shipped config
    attnkit.configure({"priority": {"cpu": ["test-plugin"]}})
    try:
        attnkit.attend(spec, q, k, v)
        assert plugin.forward_calls == 1
        with attnkit.use_config({"priority": {"cpu": ["torch-naive"]}}):
            attnkit.attend(spec, q, k, v)
            assert plugin.forward_calls == 1
            with attnkit.use_backend("test-plugin"):
                attnkit.attend(spec, q, k, v)
                assert plugin.forward_calls == 2
            attnkit.attend(spec, q, k, v)
            assert plugin.forward_calls == 2
        attnkit.attend(spec, q, k, v)
        assert plugin.forward_calls == 3
    finally:
        attnkit.configure()
    attnkit.attend(spec, q, k, v)
    assert plugin.forward_calls == 3


def test_the_innermost_scope_wins_on_repeated_calls(plugin: CountingBackend) -> None:
    """use_backend is use_config({"backend": ...}): whichever is inner wins, a scope's keys override only what they
    name, and the fast path (each call is made twice) never serves an outer scope's route."""
    inner = CountingBackend("test-inner")
    attnkit.register_backend(inner)
    spec, (q, k, v) = AttentionSpec(), tensors()

    def ran_on() -> str:
        before = plugin.forward_calls, inner.forward_calls
        for _ in range(2):
            attnkit.attend(spec, q, k, v)
        counts = {"test-plugin": plugin.forward_calls - before[0], "test-inner": inner.forward_calls - before[1]}
        return next((name for name, count in counts.items() if count == 2), "another backend")

    try:
        with attnkit.use_backend("test-plugin"):
            assert ran_on() == "test-plugin"
            with attnkit.use_config({"backend": "test-inner"}):
                assert ran_on() == "test-inner"
                with attnkit.use_backend("test-plugin"):
                    assert ran_on() == "test-plugin"
                assert ran_on() == "test-inner"
            with attnkit.use_config({"priority": {"cpu": ["test-inner"]}}):  # names no backend: the outer one holds
                assert ran_on() == "test-plugin"
            with attnkit.use_config({"backend": "auto", "priority": {"cpu": ["torch-naive"]}}):
                assert ran_on() == "another backend"
            attnkit.configure({"backend": "test-inner"})  # a scope's config is fixed on entry
            assert ran_on() == "test-plugin"
        assert ran_on() == "test-inner"
        with attnkit.use_config({"backend": "test-plugin"}):
            with attnkit.use_backend("auto"):  # forces nothing, whatever the layers below force
                assert ran_on() == "another backend"
    finally:
        attnkit.configure()
        attnkit.unregister_backend("test-inner")


class PlainCallBackend(CountingBackend):
    """Runs its own forward through a differentiable_forward runner that declares a plain call, counting both."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.runner_calls = 0
        self.plain_calls = 0

    def differentiable_forward(self, spec, problem):
        def run(inputs):
            self.runner_calls += 1
            out, lse = self.forward(spec, inputs, True)
            return out, lse if problem.return_lse else None

        return run

    def plain_call(self, spec, problem):
        def plain(q, k, v):
            self.plain_calls += 1
            return self.forward(spec, AttentionInputs(q, k, v), False)[0]

        return plain


def test_a_declared_plain_call_serves_repeated_calls_with_q_k_v_alone_and_nothing_else() -> None:
    backend = PlainCallBackend("test-plain")
    attnkit.register_backend(backend)
    try:
        spec, (q, k, v) = AttentionSpec(causal=True), tensors()
        expected = attnkit.attend(spec, q, k, v, backend="torch-naive")
        for _ in range(3):
            assert torch.allclose(attnkit.attend(spec, q, k, v, backend="test-plain"), expected)
        assert (backend.runner_calls, backend.plain_calls) == (1, 2)  # the first call validates and dispatches
        mask = torch.ones(3, 4, dtype=torch.bool)
        for _ in range(2):
            attnkit.attend(spec, q, k, v, backend="test-plain", return_lse=True)
            attnkit.attend(spec, q, k, v, backend="test-plain", mask=mask)
            attnkit.attend(spec, q, k, v, backend="test-plain", kv_lengths=torch.tensor([3]))
        assert (backend.runner_calls, backend.plain_calls) == (7, 2)
    finally:
        attnkit.unregister_backend("test-plain")


@pytest.mark.parametrize("backend", backend_params())
def test_repeated_calls_give_the_first_calls_answer_and_gradients(backend: str) -> None:
    """The first call in each grad mode validates and dispatches; later ones take the cached runner (or its plain
    call) and must give exactly what it gave (a backend may compute a forward-only call on another path)."""
    spec = AttentionSpec(causal=True)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, 16, generator=generator, requires_grad=True) for length in (1, 80, 80))
    try:
        attnkit.attend(spec, q, k, v, backend=backend)
    except (BackendUnavailableError, attnkit.InvalidInputTypeError) as refusal:
        pytest.skip(f"{backend} does not serve this torch call: {refusal}")
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            outs = [attnkit.attend(spec, q, k, v, backend=backend) for _ in range(3)]
        assert all(torch.equal(out, outs[0]) and out.requires_grad == grad_mode for out in outs), f"{grad_mode=}"
    grads = [torch.autograd.grad(attnkit.attend(spec, q, k, v, backend=backend).sum(), (q, k, v)) for _ in range(3)]
    assert all(torch.equal(a, b) for again in grads[1:] for a, b in zip(again, grads[0]))


def test_the_decision_cache_stays_bounded_under_a_growing_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CACHE, "limit", 4)
    dispatch.clear_cache()
    spec, generator = AttentionSpec(causal=True), torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 8, generator=generator)
    for len_k in range(4, 14):
        kv = torch.randn(1, 2, len_k, 8, generator=generator)
        out = attnkit.attend(spec, q, kv, kv)
        # the float64 oracle (torch-naive on float64 tensors), at float32's tolerance
        expected = attnkit.attend(spec, q.double(), kv.double(), kv.double(), backend="torch-naive")
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6)
        assert len(CACHE.decisions) <= 4 and len(CACHE.calls) <= 4 and len(CACHE.length_classes) <= 4


class LateBackend(CountingBackend):
    """Unavailable until ``installed`` is set: a package installed mid-process."""

    installed = False

    def available(self):
        return super().available() if self.installed else ["its package is not installed"]


def test_clear_cache_makes_a_call_seen_before_dispatch_again(plugin: CountingBackend) -> None:
    """dispatch.clear_cache() forgets attend()'s fast path too: the next call, one made before, reads the machine
    again and runs where the new reading routes it (it kept the old runner once)."""
    late = LateBackend("test-late")
    attnkit.register_backend(late)
    spec, (q, k, v) = AttentionSpec(causal=True), tensors()
    try:
        with attnkit.use_config({"priority": {"cpu": ["test-late", "test-plugin"]}}):
            for _ in range(2):
                attnkit.attend(spec, q, k, v)
            assert (late.forward_calls, plugin.forward_calls) == (0, 2)
            late.installed = True
            attnkit.attend(spec, q, k, v)  # the reading is kept until told otherwise
            assert (late.forward_calls, plugin.forward_calls) == (0, 3)
            dispatch.clear_cache()
            for _ in range(2):
                attnkit.attend(spec, q, k, v)
            assert (late.forward_calls, plugin.forward_calls) == (2, 3)
            assert "-> test-late" in attnkit.explain(spec, q, k, v)
    finally:
        attnkit.unregister_backend("test-late")


def test_one_clear_empties_every_table_and_each_change_clears() -> None:
    spec, (q, k, v) = AttentionSpec(), tensors()
    masked = torch.ones(1, 1, q.shape[2], k.shape[2], dtype=torch.bool)  # a mask: kept by exact shape, not by class
    attnkit.attend(spec, q, k, v)
    attnkit.attend(spec, q, k, v, mask=masked)
    assert CACHE.length_classes and CACHE.calls and CACHE.decisions and CACHE.availability
    dispatch.clear_cache()
    assert not (CACHE.length_classes or CACHE.calls or CACHE.decisions or CACHE.availability)
    for change in (
        lambda: attnkit.configure(),
        lambda: attnkit.register_backend(CountingBackend("test-change")),
        lambda: attnkit.unregister_backend("test-change"),
    ):
        attnkit.attend(spec, q, k, v)
        attnkit.attend(spec, q, k, v, mask=masked)
        assert CACHE.length_classes and CACHE.calls
        change()
        assert not (CACHE.length_classes or CACHE.calls or CACHE.decisions or CACHE.availability)


def test_a_store_made_before_a_clear_is_dropped() -> None:
    """A dispatch that read the state before a clear (another thread's configure() or registration) must not store
    what it found after the clear, where it would be served under the new state."""
    cache = CallCache(limit=2)
    epoch = cache.epoch
    cache.clear()
    assert not cache.remember(cache.decisions, "key", "stale", epoch)
    assert cache.decisions == {}
    assert cache.remember(cache.decisions, "key", "fresh", cache.epoch)
    assert not cache.remember(cache.decisions, "key", "again", cache.epoch)  # stored, but not new
    cache.remember(cache.decisions, "other", "x", cache.epoch)
    cache.remember(cache.decisions, "third", "y", cache.epoch)  # full: emptied first
    assert cache.decisions == {"third": "y"}


def test_scopes_key_apart_and_end_with_their_block() -> None:
    cache = CallCache()
    assert cache.scope_serial() is None
    with cache.scope() as outer:
        assert cache.scope_serial() == outer
        with cache.scope() as inner:
            assert cache.scope_serial() == inner != outer
        assert cache.scope_serial() == outer
    with cache.scope() as again:
        assert again not in (outer, inner)
    assert cache.scope_serial() is None


@pytest.mark.parametrize(
    ("spec", "term", "expected"),
    [
        (AttentionSpec(), "mask", "torch-sdpa"),  # SDPA's own masked call (issue 16)
        (AttentionSpec(softcap=30.0, causal=True), "mask", "cpu-flash"),  # SDPA has no softcap: the fused kernel
        (AttentionSpec(variant="cosine"), "bias", "cpu-flash"),
    ],
    ids=["mask", "softcap-mask", "cosine-bias"],
)
def test_auto_serves_masks_and_biases_with_a_fused_cpu_backend(spec: AttentionSpec, term: str, expected: str) -> None:
    """The shipped config sends masked and biased CPU calls to a backend with memory linear in L (never torch-naive),
    with and without grad, at a length the cost table has measured."""
    if attnkit.get_backend(expected).available():
        pytest.skip(f"{expected} is unavailable here")
    q, k = torch.randn(2, 4, 512, 64), torch.randn(2, 2, 512, 64)
    extra = {"mask": torch.rand(2, 1, 1, 512) < 0.9} if term == "mask" else {"bias": torch.randn(1, 4, 512, 512)}
    for grad in (False, True):
        table = attnkit.explain(spec, q.requires_grad_(grad), k, k, **extra)
        assert next(row.split()[1] for row in table.splitlines() if row.startswith("->")) == expected, table


def test_auto_sends_a_long_packed_row_to_a_backend_that_skips_the_documents_tiles() -> None:
    """§4.5 on the CPU: a row of 8 causal documents of 512 tokens goes to a backend that skips the tiles its documents
    hide (cpu-flash, torch-chunked, torch-flex), never to torch-sdpa, which serves segment ids only as an O(L²) mask:
    the cost table counts every pair of a packed row as visible, so the shipped order must decide."""
    skipping = {"cpu-flash", "torch-chunked", "torch-flex"}
    ids = (torch.arange(4096) // 512).view(1, -1)
    for grad in (False, True):
        q = torch.randn(1, 8, 4096, 64, requires_grad=grad)
        table = attnkit.explain(AttentionSpec(causal=True), q, q, q, q_segment_ids=ids, kv_segment_ids=ids)
        rows = [row.split(None, 2) for row in table.splitlines() if row.startswith(("->", "   "))]
        chosen = next(row[1] for row in rows if row[0] == "->")
        servable = {row[0] for row in rows if row[0] != "->" and row[1] == "ok"} | {chosen}
        if not skipping & servable:
            pytest.skip(f"none of {sorted(skipping)} serves segment ids here")
        assert chosen in skipping, table


def test_explain_says_which_rule_decided() -> None:
    """The priority list and its margin, or a prediction past the margin, or no prediction: explain prints the rule
    that picked the backend, with the times it weighed (a user saw torch-sdpa picked over a cpu-flash predicted
    faster, 357 us against 312, and no word of the margin)."""
    servable = ["torch-sdpa", "cpu-flash", "torch-chunked"]
    within = cost.decision(servable, {"torch-sdpa": 357.0, "cpu-flash": 312.0}, 0.2, "torch-sdpa")
    assert within == (
        "torch-sdpa is the first in the priority list that can serve the call; cpu-flash is predicted faster "
        "(312 us against 357 us) but not by more than the cost margin (20%)"
    )
    past = cost.decision(servable, {"torch-sdpa": 900.0, "cpu-flash": 312.0}, 0.2, "cpu-flash")
    assert past.startswith("cpu-flash is predicted at 312 us, faster than torch-sdpa") and "(900 us)" in past
    assert "no cost prediction" in cost.decision(servable, {}, 0.2, "torch-sdpa")
    q = torch.randn(1, 2, 8, 16)
    text = attnkit.explain(AttentionSpec(), q, q, q)
    chosen = next(line.split()[1] for line in text.splitlines() if line.startswith("->"))
    assert text.splitlines()[-1].startswith(f"decided by: {chosen} ")
    with attnkit.use_backend("torch-naive"):
        assert (
            attnkit.explain(AttentionSpec(), q, q, q).splitlines()[-1] == "decided by: torch-naive is forced "
            "(configuration or ATTNKIT_BACKEND)"
        )
