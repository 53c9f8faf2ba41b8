"""The run directory's disk: the space check before training, a disk that fills up mid-run, and
a run directory that turns read-only mid-run. Each failure ends in one message (the path, free
against needed bytes, the last complete checkpoint, resume=auto), no traceback and no partial
checkpoint; resume=auto then goes on from the last complete checkpoint.

Where this process may mount (root), the disk is real: a tmpfs that holds about 1.5 checkpoints,
and a read-only bind mount of the run directory over itself (new files are refused, as on a file
system remounted read-only after an error). Elsewhere the same errors are injected
(``RAG_MM_FAULT=enospc:...`` / ``erofs:...``)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from rag_mm.build import build_rag
from rag_mm.config import ConfigError, compose
from rag_mm.ft import disk
from rag_mm.trainer import Trainer
from tests.ops.helpers import REPO, env, valid_checkpoints
from tests.rag_mm.conftest import tiny_overrides

DISK_ARGS = ("ckpt_every=2", "keep_checkpoints=1", "log_every=1", "deterministic=true")


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory) -> bool:
    """Whether this process can mount a tmpfs (root, and a kernel and container that allow it)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = tmp_path_factory.mktemp("mount_probe")
    ok = _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
    if ok:
        _umount(probe)
    return ok


@contextmanager
def tmpfs(path: Path, size: int):
    path.mkdir(parents=True, exist_ok=True)
    assert _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


def one_checkpoint(root, run_dir) -> int:
    cfg = compose(tiny_overrides(root, run_dir, *DISK_ARGS))
    return disk.checkpoint_bytes(build_rag(cfg, torch.device("cpu")).rag)


def train(
    root, run_dir, *extra: str, fault: str = "", timeout: int = 300
) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "rag_mm.train",
        *tiny_overrides(root, run_dir, *DISK_ARGS, *extra),
    ]
    return subprocess.run(
        args,
        cwd=REPO,
        env=env(**({"RAG_MM_FAULT": fault} if fault else {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_estimate_matches_a_written_checkpoint(tiny_world, tmp_path):
    run_dir = tmp_path / "run"
    t = Trainer(compose(tiny_overrides(tiny_world, run_dir, "max_steps=2", "ckpt_every=2")))
    try:
        t.fit()
    finally:
        t.close()
    written = sum(p.stat().st_size for p in (run_dir / "checkpoints" / "step_00000002").iterdir())
    assert written <= t.ckpt_bytes <= 1.1 * written, (written, t.ckpt_bytes)


def test_too_little_space_warns_with_the_numbers_or_stops_when_asked(
    tiny_world, tmp_path, monkeypatch, caplog
):
    one = one_checkpoint(tiny_world, tmp_path / "run")
    monkeypatch.setattr(disk, "free_bytes", lambda path: int(1.5 * one))
    with pytest.raises(ConfigError) as err:
        Trainer(
            compose(tiny_overrides(tiny_world, tmp_path / "run", *DISK_ARGS, "disk_check=stop"))
        )
    msg = str(err.value)
    assert (
        f"{disk.human(1.5 * one)} free" in msg
        and f"~{disk.human(one)}" in msg
        and "room for 2 checkpoints" in msg
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
    caplog.set_level("WARNING", logger="rag_mm.trainer")
    Trainer(
        compose(tiny_overrides(tiny_world, tmp_path / "run", *DISK_ARGS))
    ).close()  # disk_check=warn
    assert "keep_checkpoints=1 needs room for 2 checkpoints" in caplog.text


def test_fault_finds_space_and_permission_errors_wrapped_by_dcp():
    from torch.distributed.checkpoint.api import CheckpointException

    short = CheckpointException(
        "save",
        {
            0: (
                RuntimeError(
                    "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
                ),
                [],
            )
        },
    )
    assert disk.fault(short).kind == "full"
    full = CheckpointException(
        "save", {1: (OSError(errno.ENOSPC, "No space left on device", "/r/x.distcp"), [])}
    )
    assert (disk.fault(full).kind, disk.fault(full).path) == ("full", "/r/x.distcp")
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system", b"/r/metrics.jsonl")
        except OSError as exc:
            raise RuntimeError("while logging") from exc
    except RuntimeError as wrapped:
        assert (disk.fault(wrapped).kind, disk.fault(wrapped).path) == (
            "read-only",
            "/r/metrics.jsonl",
        )
    assert (
        disk.fault(RuntimeError("size mismatch")) is None
        and disk.fault(OSError(errno.ENOENT, "gone")) is None
    )


def _assert_one_message(res, kind: str, last: str) -> None:
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "Exception in thread" not in res.stderr, res.stderr[
        -3000:
    ]
    msg = res.stderr[res.stderr.index("rag_mm.train: ") :]
    head = "the disk is full" if kind == "full" else "the run directory is not writable"
    assert msg.startswith(f"rag_mm.train: {head}: writing "), msg
    assert "free space: " in msg and "one checkpoint needs ~" in msg
    assert f"last complete checkpoint: {last}" in msg and "resume=auto" in msg


def test_full_disk_stops_with_one_message_and_resume_goes_on(tiny_world, tmp_path, can_mount):
    """The file system holds 1.5 checkpoints: the one of step 2 fits, the one of step 4 does not."""
    small = tmp_path / "small"
    run_dir = small / "run"
    one = one_checkpoint(tiny_world, run_dir)
    with tmpfs(small, int(1.5 * one)) if can_mount else _nothing(small):
        res = train(tiny_world, run_dir, "max_steps=6", fault="" if can_mount else "enospc:save=4")
        if can_mount:  # the space check said so before training
            assert "keep_checkpoints=1 needs room for 2 checkpoints" in res.stderr
        _assert_one_message(res, "full", str(run_dir / "checkpoints" / "step_00000002"))
        assert "the partial checkpoint" in res.stderr and "was removed" in res.stderr
        left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert left == ["step_00000002"] and [p.name for p in valid_checkpoints(run_dir)] == left
        if can_mount:  # room again
            assert _mount("-o", f"remount,size={4 * one}", str(small))
        res = train(tiny_world, run_dir, "max_steps=6")
        assert res.returncode == 0, res.stderr[-3000:]
        assert "resumed from" in res.stderr and "at step 2" in res.stderr
        assert (run_dir / "metrics.json").is_file()


@contextmanager
def _nothing(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    yield path


def test_read_only_run_directory_mid_run_stops_with_one_message_and_resume_goes_on(
    tiny_world, tmp_path, can_mount
):
    run_dir = tmp_path / "run"
    if not can_mount:
        res = train(tiny_world, run_dir, "max_steps=6", fault="erofs:step=3")
    else:  # the run directory turns read-only once the checkpoint of step 2 is written
        args = [
            sys.executable,
            "-m",
            "rag_mm.train",
            *tiny_overrides(tiny_world, run_dir, *DISK_ARGS, "max_steps=500"),
        ]
        err_path = tmp_path / f"stderr-{uuid.uuid4().hex}.txt"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                args, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=err, text=True
            )
            deadline = time.monotonic() + 300
            while not (run_dir / "checkpoints" / "step_00000002").is_dir():
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[
                    -3000:
                ]
                time.sleep(0.05)
            assert _mount("--bind", str(run_dir), str(run_dir)) and _mount(
                "-o", "remount,bind,ro", str(run_dir)
            )
            try:
                out, _ = proc.communicate(timeout=300)
            finally:
                _umount(run_dir)  # writable again
        res = subprocess.CompletedProcess(args, proc.returncode, out, err_path.read_text())
    _assert_one_message(res, "read-only", str(run_dir / "checkpoints" / "step_00000002"))
    assert "Read-only file system" in res.stderr
    res = train(tiny_world, run_dir, "max_steps=6")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr and "at step 2" in res.stderr
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
