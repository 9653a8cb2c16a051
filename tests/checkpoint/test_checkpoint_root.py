"""A checkpoint root is a local or shared POSIX path: a URI is refused with a
``ConfigError`` that points at the snapshot store, by the epoch log itself and by
the Dagster resource, so that ``VOLLEY_CHECKPOINTS=s3://...`` never becomes a local
folder named ``s3:``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dagster import EnvVar, asset, materialize

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.dagster.resources import CheckpointResource
from volley_dagster.errors import ConfigError

URIS = ["s3://bucket/ckpt", "s3a://bucket/ckpt/", "gs://bucket", "file:///tmp/ckpt"]


@pytest.mark.parametrize("uri", URIS)
def test_the_epoch_log_refuses_a_uri_and_names_the_snapshot_store(uri: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"is a URI.*VOLLEY_SNAPSHOT_STORE"):
        EpochLog(uri)
    # what ``Path(root) / pipeline`` makes of it: the URI's ``//`` collapsed
    with pytest.raises(ConfigError, match="VOLLEY_SNAPSHOT_STORE"):
        EpochLog(Path(uri) / "payments")
    assert list(tmp_path.iterdir()) == []  # no folder named "s3:" or "gs:"


def test_local_roots_are_accepted_as_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert EpochLog("state/payments").root == tmp_path / "state" / "payments"
    assert EpochLog(tmp_path / "a:b" / "c").root == tmp_path / "a:b" / "c"  # a colon inside a path is no scheme
    assert CheckpointResource(root=str(tmp_path / "state")).root == str(tmp_path / "state")


@pytest.mark.parametrize("uri", URIS)
def test_the_resource_refuses_a_uri_when_built(uri: str) -> None:
    with pytest.raises(ConfigError, match=r"is a URI.*snapshot_store_uri"):
        CheckpointResource(root=uri, snapshot_store_uri="s3://bucket/snapshots")


def test_a_uri_from_the_environment_fails_the_run_at_resource_init(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VOLLEY_TEST_CHECKPOINTS", "s3://bucket/ckpt")
    used: list[str] = []

    @asset
    def epochs(checkpoints: CheckpointResource) -> None:
        used.append(checkpoints.root)

    result = materialize([epochs], resources={"checkpoints": CheckpointResource(root=EnvVar("VOLLEY_TEST_CHECKPOINTS"))},
                         raise_on_error=False)
    assert not result.success and used == []
    failure = next(e for e in result.all_events if e.event_type_value == "RESOURCE_INIT_FAILURE")
    assert "VOLLEY_SNAPSHOT_STORE" in str(failure.event_specific_data)
    assert not any(p.name.startswith("s3") for p in Path(os.getcwd()).iterdir())
