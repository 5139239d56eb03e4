"""The triton backend runs on the Triton versions it is written for and refuses any other, naming the version found and
the range (backends/triton/__init__.py, docs/triton.md "Triton versions"): never a kernel compiled on the chance."""

from __future__ import annotations

import pytest
from attnkit.backends import triton as triton_package

import attnkit
from attnkit import AttentionSpec, BackendUnavailableError
from attnkit.backend import LazyBackend

triton = pytest.importorskip("triton")

from attnkit.backends.triton import backend as triton_backend  # noqa: E402  (imports triton)


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.7.1+git1a2b3c4", "3.8.0", "3.9.0", "3.9.5"])
def test_versions_in_the_range_are_accepted(version: str) -> None:
    assert triton_package.unsupported_triton(version) == []


@pytest.mark.parametrize("version", ["3.5.1", "3.0.0", "2.3.1", "3.10.0", "3.10.0rc1", "4.0.0", "nightly"])
def test_versions_outside_the_range_are_refused_by_name(version: str) -> None:
    (reason,) = triton_package.unsupported_triton(version)
    assert reason.startswith(f"triton {version} (supported: >=3.6,<3.10;"), reason


def test_the_registry_reports_an_unsupported_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `attnkit info` and dispatch see: the stand-in, unavailable with the version's reason, and a call naming
    the backend fails with that reason; the kernels' module is not needed to say so."""
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    (stand_in,) = triton_package.backends()
    assert isinstance(stand_in, triton_package.UnsupportedTritonBackend)
    assert stand_in.name == "triton"
    (reason,) = stand_in.available()
    assert reason.startswith("triton 3.5.1 (supported: >=3.6,<3.10;"), reason
    assert stand_in.supports(AttentionSpec(), None) == [reason]  # type: ignore[arg-type]
    with pytest.raises(BackendUnavailableError, match=r"triton 3\.5\.1 \(supported: >=3\.6,<3\.10"):
        stand_in.forward(AttentionSpec(), None, need_lse=False)  # type: ignore[arg-type]


def test_the_installed_triton_is_accepted() -> None:
    """This environment's Triton is in the range (CI runs the newest and the oldest): the backend is the real one,
    its module imported at its first use."""
    (found,) = triton_package.backends()
    assert isinstance(found, LazyBackend), found.available()
    assert isinstance(found.load(), triton_backend.TritonBackend)


def test_the_backend_itself_refuses_a_triton_outside_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TritonBackend made directly (not through the registry's guard) checks the version too."""
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    reasons = triton_backend.TritonBackend().available()
    assert reasons and reasons[0].startswith("triton 3.10.0 (supported: >=3.6,<3.10;"), reasons
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert not any(reason.startswith("triton ") for reason in triton_backend.TritonBackend().available())


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "refused"),
    [
        ("3.6.0", "2.4.6", True),
        ("3.6.0", "2.4.0rc1", True),
        ("3.6.0", "2.3.5", False),
        ("3.7.1", "2.4.6", False),
        ("3.9.0", "2.4.6", False),
    ],
)
def test_the_interpreter_of_triton_3_6_is_refused_under_numpy_2_4(
    triton_version: str, numpy_version: str, refused: bool
) -> None:
    reasons = triton_backend.interpreter_refusals(triton_version, numpy_version)
    if refused:
        assert reasons == [
            f"triton {triton_version}'s interpreter cannot run under numpy {numpy_version} (it needs numpy<2.4; "
            "triton>=3.7 has no such limit)"
        ]
    else:
        assert reasons == []


def test_an_interpreted_backend_applies_the_numpy_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    if not triton_backend.launch.INTERPRETED:
        pytest.skip("the Triton kernels are compiled in this process (TRITON_INTERPRET is not set)")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(triton_backend.numpy, "__version__", "2.4.6")
    assert triton_backend.TritonBackend().available() == triton_backend.interpreter_refusals("3.6.0", "2.4.6")
    monkeypatch.setattr(triton_backend.numpy, "__version__", "2.3.5")
    assert attnkit.registered_backends()["triton"].available() == []
