"""The examples (examples/): each runs on small shapes, its own check against an independent reference passes
(plain-framework attention, per-document calls, a dense mask, transformers' eager attention), and what a user types
on the command line reaches the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Float32 throughout: every example compares relative to the largest magnitude of its reference.
TOLERANCE = 1e-5
SMALL_MODEL = ["--dim", "32", "--heads", "4", "--kv-heads", "2"]


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: the run is under __main__
    return module


def test_every_example_is_tested_here() -> None:
    """A new example gets a test of its run (context_parallel's is of its flags: its run spawns ranks)."""
    tested = {"torch_training_step", "jax_training_step", "decode_growing_cache", "decode_paged_cache",
              "transformers_model", "packed_documents", "custom_mask", "context_parallel"}  # fmt: skip
    assert {path.stem for path in EXAMPLES.glob("*.py")} == tested


@pytest.mark.parametrize("dropout", ["0", "0.2"])
def test_torch_training_step_agrees_with_plain_torch_and_learns(dropout: str) -> None:
    argv = ["--steps", "3", "--batch", "2", "--length", "16", "--vocab", "64", "--dropout", dropout, *SMALL_MODEL]
    losses, error = _example("torch_training_step").main(argv)
    assert error < 1e-4
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_jax_training_step_agrees_with_plain_jax_and_learns() -> None:
    pytest.importorskip("jax")
    argv = ["--steps", "3", "--batch", "2", "--length", "16", "--vocab", "64", *SMALL_MODEL]
    losses, error = _example("jax_training_step").main(argv)
    assert error < 1e-4
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_decode_with_a_growing_cache_matches_a_full_recompute() -> None:
    argv = ["--batch", "3", "--prompt", "8", "--new-tokens", "4", *SMALL_MODEL]
    assert _example("decode_growing_cache").main(argv) < TOLERANCE


def test_decode_with_a_paged_cache_matches_contiguous_attention() -> None:
    # Blocks of 4 over prompts of 8, 6 and 4 tokens: sequences cross block boundaries while decoding.
    argv = ["--batch", "3", "--prompt", "8", "--new-tokens", "4", "--block-size", "4", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "8"]  # fmt: skip
    assert _example("decode_paged_cache").main(argv) < TOLERANCE


def test_transformers_model_matches_eager_and_sdpa() -> None:
    pytest.importorskip("transformers")
    argv = ["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "64", "--batch", "2",
            "--length", "8", "--new-tokens", "3"]  # fmt: skip
    assert _example("transformers_model").main(argv) < 1e-4


def test_packed_documents_match_per_document_calls() -> None:
    argv = ["--documents", "4", "--longest", "8", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]
    assert _example("packed_documents").main(argv) < TOLERANCE


@pytest.mark.parametrize("pattern", ["prefix-lm", "chunked"])
def test_custom_mask_matches_a_dense_mask(pattern: str) -> None:
    argv = ["--pattern", pattern, "--batch", "2", "--length", "24", "--documents", "3", "--chunk", "4",
            "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]  # fmt: skip
    assert _example("custom_mask").main(argv) < TOLERANCE


def test_context_parallel_takes_the_shape_and_run_as_flags() -> None:
    """The layer's length, heads, head dim, batch, steps and sharding are flags, not constants of the script."""
    example = _example("context_parallel")
    args = example.arguments(["jax", "--length", "64", "--heads", "8", "--head-dim", "32", "--batch", "1",
                              "--steps", "2", "--sharding", "contiguous", "--strategy", "ulysses"])  # fmt: skip
    assert (args.framework, args.length, args.heads, args.head_dim, args.batch, args.steps) == ("jax", 64, 8, 32, 1, 2)
    assert (args.sharding, args.strategy) == ("contiguous", "ulysses")
    defaults = example.arguments(["torch"])
    assert (defaults.length, defaults.heads, defaults.sharding, defaults.strategy) == (2048, 4, "zigzag", "ring")
    with pytest.raises(SystemExit):
        example.arguments(["torch", "--length", "0"])
