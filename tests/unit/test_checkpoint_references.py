"""The reference Redis keeps in place of a checkpoint written to the object store: a tagged,
versioned JSON body that never passes for a checkpoint, and is rejected whole when malformed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks import scripts
from tasks.artifacts import ArtifactStore
from tasks.checkpoint_objects import (
    REFERENCE_MAGIC,
    CheckpointObjectError,
    CheckpointObjects,
    CheckpointReference,
    CheckpointReferenceError,
    is_reference,
)
from tasks.errors import SettingsError
from tasks.settings import load_settings
from tasks.settings.artifacts import DEFAULT_OFFLOAD_BYTES, ArtifactSettings
from workers.checkpoint import Checkpoint

pytestmark = pytest.mark.timeout(30)

JOB = "0123456789abcdef"
NAME = f"checkpoints/{JOB}/7-0123456789ab.ckpt"


def _body(**changes: object) -> bytes:
    body = {"v": 1, "name": NAME, "size": 3, "sha256": "a" * 64, **changes}
    return REFERENCE_MAGIC + json.dumps(body).encode()


def test_a_reference_round_trips_and_names_its_job() -> None:
    # given a reference to a checkpoint's bytes
    reference = CheckpointReference.of(NAME, b"abc")
    # when it is encoded and decoded
    stored = reference.encode()
    back = CheckpointReference.decode(stored)
    # then it is the same reference, tagged as one, of the job its name says
    assert back == reference and is_reference(stored)
    assert back.size_bytes == 3 and back.job_id == JOB
    assert len(stored) < 200


def test_a_checkpoint_is_never_taken_for_a_reference() -> None:
    # given an encoded checkpoint, empty and not
    blobs = [Checkpoint().encode(),
             Checkpoint({"latents": torch.zeros(4, 4)}, {"step": 3}).encode()]
    # then none reads as a reference, and the magic reads as a header far too large to be one
    assert not any(is_reference(blob) for blob in blobs)
    assert int.from_bytes(REFERENCE_MAGIC, "little") > 100 * 1024 * 1024


@pytest.mark.parametrize(("stored", "problem"), [
    (b"not a reference", "no magic prefix"),
    (REFERENCE_MAGIC + b"{", "not JSON"),
    (REFERENCE_MAGIC + b"[1, 2]", "exactly the fields"),
    (_body(v=2), "version 2"),
    (_body(extra=1), "exactly the fields"),
    (_body(name="../../etc/passwd"), "checkpoints/<job id>"),
    (_body(name=f"checkpoints/{JOB}/../x.ckpt"), "checkpoints/<job id>"),
    (_body(size=-1), "not a count"),
    (_body(size=True), "not a count"),
    (_body(size="3"), "not a count"),
    (_body(sha256="ABC"), "64 lowercase hex"),
    (REFERENCE_MAGIC + b" " * 2000, "at most 1024"),
])
def test_a_malformed_reference_is_rejected_naming_what_is_wrong(stored: bytes,
                                                               problem: str) -> None:
    with pytest.raises(CheckpointReferenceError, match=problem):
        CheckpointReference.decode(stored)


def test_the_commit_script_knows_the_same_magic() -> None:
    # given the commit script, which reports the reference its checkpoint replaced
    source = (scripts.LUA_DIR / "commit.lua").read_text()
    # then it tests for the very prefix the codec writes
    assert f"local REFERENCE_MAGIC = '{REFERENCE_MAGIC.decode()}'" in source


def test_a_checkpoint_above_the_threshold_goes_to_the_store_and_comes_back_whole(
    tmp_path: Path,
) -> None:
    # given a store offloading checkpoints above 16 bytes
    objects = CheckpointObjects(ArtifactStore(tmp_path), 16)
    blob = Checkpoint({"latents": torch.arange(64, dtype=torch.float32)}).encode()
    # when a small and a large checkpoint are offered
    assert objects.offload(JOB, 1, b"tiny") is None
    reference = objects.offload(JOB, 2, blob)
    # then the large one is an object that resolves to the same bytes
    assert reference is not None and reference.size_bytes == len(blob)
    assert objects.resolve(JOB, reference.encode()) == blob
    assert objects.resolve(JOB, b"tiny") == b"tiny"
    assert objects.job_ids() == [JOB]


def test_a_missing_or_corrupt_object_is_a_clear_error(tmp_path: Path) -> None:
    # given two offloaded checkpoints, one then removed and one overwritten
    objects = CheckpointObjects(ArtifactStore(tmp_path), 0)
    gone = objects.offload(JOB, 1, b"first state")
    corrupt = objects.offload(JOB, 2, b"second state")
    assert gone is not None and corrupt is not None
    objects.forget([gone.encode(), b"kept in Redis itself", None])
    (tmp_path / corrupt.name).write_bytes(b"second stat!")
    # then reading either raises, naming the object and what is wrong
    with pytest.raises(CheckpointObjectError, match="missing"):
        objects.resolve(JOB, gone.encode())
    with pytest.raises(CheckpointObjectError, match="do not match the reference"):
        objects.resolve(JOB, corrupt.encode())
    with pytest.raises(CheckpointObjectError, match="another job's object"):
        objects.resolve("f" * 16, corrupt.encode())


def test_the_sweep_removes_the_objects_of_ended_and_vanished_jobs_only(tmp_path: Path) -> None:
    # given objects of a running, a finished and a vanished job
    objects = CheckpointObjects(ArtifactStore(tmp_path), 0)
    for job_id in ("a" * 16, "b" * 16, "c" * 16):
        objects.offload(job_id, 1, b"state")
    # when the sweep is told their states
    swept = objects.sweep({"a" * 16: "RUNNING", "b" * 16: "DONE", "c" * 16: None})
    # then only the running job keeps its objects
    assert sorted(swept) == ["b" * 16, "c" * 16]
    assert objects.job_ids() == ["a" * 16]


def test_the_threshold_defaults_to_offloading_only_from_a_shared_store() -> None:
    # given the settings with no threshold, then with one
    unset, set_ = ArtifactSettings(), ArtifactSettings(checkpoint_offload_bytes=4096)
    # then a local store keeps checkpoints in Redis unless told, a shared one offloads at 1 MiB
    assert unset.offload_threshold_bytes(store_is_local=True) is None
    assert unset.offload_threshold_bytes(store_is_local=False) == DEFAULT_OFFLOAD_BYTES
    assert set_.offload_threshold_bytes(store_is_local=True) == 4096


@pytest.mark.parametrize("value", [-1, 512 * 1024 * 1024 + 1])
def test_a_threshold_out_of_bounds_is_rejected(value: int) -> None:
    with pytest.raises(SettingsError, match=r"artifacts\.checkpoint_offload_bytes"):
        load_settings(artifacts={"checkpoint_offload_bytes": value})
