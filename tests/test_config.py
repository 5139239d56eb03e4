"""Configuration (issue §4): shipped defaults, files, dicts, scoped overrides, validation messages."""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import logging
import re
import threading
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import AttentionSpec, ConfigError, dispatch
from attnkit.config import current_config, default_config_path, load_config

PROBLEM = attnkit.Problem(attnkit.Framework.TORCH, "cpu", "float32", 1, 2, 2, 3, 4, 8, 8)


def chosen(spec: AttentionSpec | None = None) -> str:
    return dispatch.select(spec or AttentionSpec(), PROBLEM).name


def test_shipped_default_is_valid_and_names_registered_backends() -> None:
    config = load_config(default_config_path())
    assert set(config.priority) == {"cpu", "cuda"}
    assert set(config.priority["cpu"]) <= set(attnkit.registered_backends())


def test_user_file_through_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "attnkit.toml"
    path.write_text('[priority]\ncpu = ["torch-naive"]\n')
    monkeypatch.setenv("ATTNKIT_CONFIG", str(path))
    attnkit.configure()
    assert chosen() == "torch-naive"
    assert current_config().priority["cuda"] == load_config(default_config_path()).priority["cuda"]


def test_configure_with_a_dict_and_back() -> None:
    default = chosen()
    attnkit.configure({"priority": {"cpu": ["torch-naive"]}})
    assert chosen() == "torch-naive"
    attnkit.configure()
    assert chosen() == default


def test_refinement_per_spec_feature() -> None:
    config = {"refine": [{"when": ["cosine"], "priority": {"cpu": ["torch-naive"]}}]}
    with attnkit.use_config(config):
        assert chosen(AttentionSpec(variant="cosine")) == "torch-naive"
        assert chosen(AttentionSpec()) == load_config(default_config_path()).priority["cpu"][0]


def test_refinement_on_any_of_its_features() -> None:
    config = {"refine": [{"when_any": ["cosine", "softcap"], "priority": {"cpu": ["torch-naive"]}}]}
    with attnkit.use_config(config):
        assert chosen(AttentionSpec(variant="cosine")) == "torch-naive"
        assert chosen(AttentionSpec(softcap=5.0)) == "torch-naive"
        assert chosen(AttentionSpec(causal=True)) != "torch-naive"


@pytest.mark.parametrize(
    ("spec", "len_q", "len_k", "offset"),
    [
        (AttentionSpec(causal=True), 3, 4, True),
        (AttentionSpec(causal=True), 5, 4, True),
        (AttentionSpec(causal=True), 4, 4, False),  # the diagonal is the same for both alignments
        (AttentionSpec(causal=True), 1, 4, False),  # one bottom-right query sees every key: no diagonal
        (AttentionSpec(causal=True, causal_alignment="top_left"), 3, 4, False),
        (AttentionSpec(), 3, 4, False),
    ],
)
def test_bottom_right_offset_routes_only_offset_diagonals(
    spec: AttentionSpec, len_q: int, len_k: int, offset: bool
) -> None:
    problem = attnkit.Problem(attnkit.Framework.TORCH, "cpu", "float32", 1, 2, 2, len_q, len_k, 8, 8)
    config = {"refine": [{"when": ["bottom_right_offset"], "priority": {"cpu": ["torch-naive"]}}]}
    with attnkit.use_config(config):
        assert (dispatch.select(spec, problem).name == "torch-naive") is offset


def test_use_config_restores_on_exit_and_on_error() -> None:
    before = current_config()
    with pytest.raises(RuntimeError):
        with attnkit.use_config({"priority": {"cpu": ["torch-naive"]}}):
            assert chosen() == "torch-naive"
            raise RuntimeError("boom")
    assert current_config() is before


def test_use_backend_is_async_task_local() -> None:
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)

    async def forced() -> str:
        with attnkit.use_backend("torch-naive"):
            await asyncio.sleep(0.01)
            attnkit.attend(AttentionSpec(), q, k, v)
            return chosen()

    async def free() -> str:
        await asyncio.sleep(0.005)
        return chosen()

    async def both() -> list[str]:
        return list(await asyncio.gather(forced(), free()))

    forced_choice, free_choice = asyncio.run(both())
    assert forced_choice == "torch-naive"
    assert free_choice == load_config(default_config_path()).priority["cpu"][0]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"priority": {"cpu": ["flash"]}},
            r"configure\(dict\): key priority.cpu: unknown backend 'flash' \(allowed: .*torch-naive",
        ),
        ({"priority": {"tpu": ["torch-naive"]}}, r"key priority.tpu: unknown device \(allowed"),
        ({"priorty": {}}, "key priorty: Extra inputs are not permitted"),
        ({"backend": "nope"}, "key backend: unknown backend 'nope'"),
        ({"refine": [{"when": ["cosin"], "priority": {}}]}, r"unknown feature\(s\) \['cosin'\]"),
        ({"refine": [{"when_any": ["offset"], "priority": {}}]}, r"unknown feature\(s\) \['offset'\]"),
        ({"refine": [{"priority": {"cpu": ["torch-naive"]}}]}, r"a refinement needs `when` \(all of\) or `when_any`"),
        # each source is validated alone, before the merge (a list here was a raw TypeError)
        ({"priority": ["torch-naive"]}, r"key priority: Input should be a valid dictionary \(a table of device"),
        (
            {"priority": {"cpu": "torch-naive"}},
            r"key priority.cpu: Input should be a valid tuple \(got 'torch-naive'\)",
        ),
        ({"refine": {"when": ["window"]}}, r"key refine: Input should be a valid tuple \(an array of tables"),
        # strict scalars: no string is a bool or a number
        ({"use_costs": "no"}, r"key use_costs: Input should be a valid boolean \(got 'no'\)"),
        ({"use_costs": 0}, r"key use_costs: Input should be a valid boolean \(got 0\)"),
        ({"cost_margin": "0.9"}, r"key cost_margin: Input should be a valid number \(got '0.9'\)"),
        ({"cost_margin": True}, r"key cost_margin: Input should be a valid number \(got True\)"),
        ({"backend": 3}, r"key backend: Input should be a valid string \(got 3\)"),
        ({"refine": [{"when": [1], "priority": {}}]}, r"key refine\[0\].when\[0\]: Input should be a valid string"),
        # a backend's options: only those it declares, of its defaults' types
        ({"backend_options": {"nope": {}}}, r"key backend_options.nope: unknown backend 'nope' \(allowed: "),
        (
            {"backend_options": {"torch-naive": {"deterministic": True}}},
            r"key backend_options.torch-naive.deterministic: backend 'torch-naive' has no option 'deterministic' "
            r"\(its options: none\)",
        ),
        (
            {"backend_options": {"triton": {"determinstic": True}}},
            r"backend 'triton' has no option 'determinstic' "
            r"\(its options: deterministic = False, warp_specialize = False\)",
        ),
        (
            {"backend_options": {"triton": {"deterministic": "yes"}}},
            r"key backend_options.triton.deterministic: expected a bool \(default False\), got 'yes'",
        ),
        ({"backend_options": {"triton": ["deterministic"]}}, r"key backend_options.triton: Input should be a valid"),
    ],
)
def test_invalid_config_names_the_key_and_allowed_values(source: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        attnkit.configure(source)


def test_an_int_is_a_fine_number_and_auto_forces_nothing() -> None:
    assert attnkit.configure({"cost_margin": 1}).cost_margin == 1.0
    assert attnkit.configure({"backend": "auto"}).backend is None


def test_a_bad_source_is_refused_before_it_touches_the_config_in_force() -> None:
    before = current_config()
    with pytest.raises(ConfigError, match=r"use_config\(dict\): key priority"):
        with attnkit.use_config({"priority": ["torch-naive"]}):
            pass
    with pytest.raises(attnkit.InvalidInputTypeError, match="expected a TOML file's path .* or a mapping, got list"):
        attnkit.configure(["torch-naive"])  # type: ignore[arg-type]
    assert current_config() is before


def test_environment_errors_name_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_BACKEND", "nope")
    with pytest.raises(ConfigError, match=r"^ATTNKIT_BACKEND: unknown backend 'nope' \(allowed: auto, .*torch-naive"):
        attnkit.configure()
    monkeypatch.setenv("ATTNKIT_BACKEND", "auto")
    assert attnkit.configure({"backend": "torch-naive"}).backend is None  # the variable is the later layer
    path = tmp_path / "user.toml"
    path.write_text('use_costs = "no"\n')
    monkeypatch.setenv("ATTNKIT_CONFIG", str(path))
    with pytest.raises(
        ConfigError, match=f"^ATTNKIT_CONFIG={re.escape(str(path))}: key use_costs: Input should be a valid boolean"
    ):
        attnkit.configure()


def test_unknown_log_level_is_an_error_at_the_first_call_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("attnkit")
    monkeypatch.setenv("ATTNKIT_LOG", "verbose")
    importlib.reload(attnkit)  # import reads no variable: a typo cannot make `import attnkit` fail
    with pytest.raises(ConfigError, match=r"ATTNKIT_LOG='verbose': unknown log level \(allowed, any case: debug, info"):
        attnkit.configure()
    monkeypatch.setenv("ATTNKIT_LOG", "DEBUG")
    attnkit.configure()
    assert logger.level == logging.DEBUG and len(logger.handlers) == 1
    attnkit.configure()  # read again: still one handler
    assert len(logger.handlers) == 1
    monkeypatch.delenv("ATTNKIT_LOG")
    attnkit.configure()
    assert (logger.level, logger.handlers) == (logging.NOTSET, [])


WINDOW = AttentionSpec(window=(2, 0))


def test_a_user_priority_list_wins_over_the_refinements_below_it_for_its_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = load_config(default_config_path())
    assert any(refinement.matches(WINDOW.features()) for refinement in shipped.refine)  # what is overridden
    with attnkit.use_config({"priority": {"cpu": ["torch-naive"]}}):
        assert chosen(WINDOW) == "torch-naive"
    # a user file's refinements, under a later layer: kept for the devices it gives no priority list for
    path = tmp_path / "user.toml"
    path.write_text('[[refine]]\nwhen = ["window"]\npriority.cpu = ["torch-chunked"]\npriority.cuda = ["triton"]\n')
    monkeypatch.setenv("ATTNKIT_CONFIG", str(path))
    assert attnkit.configure({"priority": {"cuda": ["torch-naive"]}}).priority_for("cpu", WINDOW.features()) == (
        "torch-chunked",
    )
    assert chosen(WINDOW) == "torch-chunked"
    config = attnkit.configure({"priority": {"cpu": ["torch-naive"]}})
    assert chosen(WINDOW) == "torch-naive"
    assert config.priority_for("cuda", WINDOW.features()) == ("triton",)
    # the same layer's refinements apply on top of its own priority lists
    attnkit.configure(
        {"priority": {"cpu": ["torch-naive"]}, "refine": [{"when": ["window"], "priority": {"cpu": ["torch-chunked"]}}]}
    )
    assert (chosen(WINDOW), chosen()) == ("torch-chunked", "torch-naive")


def test_scopes_compose_innermost_first() -> None:
    default = chosen()
    with attnkit.use_backend("torch-naive"):
        with attnkit.use_config({"backend": "torch-chunked"}):
            assert chosen() == "torch-chunked"
            with attnkit.use_backend("torch-naive"):
                assert chosen() == "torch-naive"
        with attnkit.use_config({"use_costs": False}):  # names no backend: the outer one holds
            assert chosen() == "torch-naive"
        with attnkit.use_config({"backend": "auto"}):
            assert chosen() == default
        assert chosen() == "torch-naive"


def test_thread_pools_drop_the_scope_unless_given_the_context() -> None:
    """README, "Choosing a backend": contextvars do not cross loop.run_in_executor or a thread pool by themselves;
    contextvars.copy_context().run carries them."""

    async def in_executor() -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        with attnkit.use_backend("torch-naive"):
            lost = await loop.run_in_executor(None, chosen)
            kept = await loop.run_in_executor(None, contextvars.copy_context().run, chosen)
        return lost, kept

    lost, kept = asyncio.run(in_executor())
    assert (lost, kept) == (chosen(), "torch-naive")


def test_invalid_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[priority]\ncpu = ["nope"]\n')
    with pytest.raises(ConfigError, match=f"{path}: key priority.cpu: unknown backend 'nope'"):
        attnkit.configure(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        attnkit.configure(tmp_path / "missing.toml")


def test_unknown_backend_in_use_backend() -> None:
    with pytest.raises(attnkit.UnknownBackendError, match="backend='nope' is not registered"):
        with attnkit.use_backend("nope"):
            pass


def test_a_backward_on_another_thread_reads_the_options_of_the_forward_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA autograd runs the backward on its device thread, where a use_config scope (a context variable) is
    unset: the backend's backward reads its options inside the forward's context, so
    ``[backend_options.triton] deterministic = true`` given by a scope holds for the backward it asks about."""
    backend = attnkit.get_backend("triton")
    if backend.available():
        pytest.skip(f"triton is unavailable here: {backend.available()}")
    seen: list[bool] = []
    deterministic = type(backend).deterministic
    monkeypatch.setattr(type(backend), "deterministic", lambda self: seen.append(deterministic(self)) or seen[-1])
    q, k, v = (torch.randn(1, 1, 4, 16, requires_grad=True) for _ in range(3))
    with attnkit.use_config({"backend_options": {"triton": {"deterministic": True}}}):
        out = attnkit.attend(AttentionSpec(), q, k, v, backend="triton")
    backward = threading.Thread(target=lambda: out.sum().backward())  # outside the scope, as a device thread is
    backward.start()
    backward.join(timeout=120)
    assert seen == [True] and q.grad is not None
