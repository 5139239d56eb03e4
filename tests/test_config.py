"""Configuration (issue §4): shipped defaults, files, dicts, scoped overrides, validation messages."""

from __future__ import annotations

import asyncio
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
            r"config dict: key priority.cpu: unknown backend 'flash' \(allowed: .*torch-naive",
        ),
        ({"priority": {"tpu": ["torch-naive"]}}, r"key priority.tpu: unknown device \(allowed"),
        ({"priorty": {}}, "key priorty: Extra inputs are not permitted"),
        ({"backend": "nope"}, "key backend: unknown backend 'nope'"),
        ({"refine": [{"when": ["cosin"], "priority": {}}]}, r"unknown feature\(s\) \['cosin'\]"),
        ({"refine": [{"when_any": ["offset"], "priority": {}}]}, r"unknown feature\(s\) \['offset'\]"),
        ({"refine": [{"priority": {"cpu": ["torch-naive"]}}]}, r"a refinement needs `when` \(all of\) or `when_any`"),
    ],
)
def test_invalid_config_names_the_key_and_allowed_values(source: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        attnkit.configure(source)


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
