"""`aiayn export`'s guards against a training run and its clean-up of killed exports' leftovers,
where the folders above OUT cannot be listed or another thread of the process exports too."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn import export


def test_an_out_under_a_folder_named_best_that_cannot_be_listed_is_taken(tmp_path, monkeypatch):
    """OUT /srv/shared/best/hf, where /srv/shared may be entered but not listed (mode 0711): the
    look for a run's step checkpoints there was PermissionError, and the export was refused with
    "aiayn export: error: /srv/shared: Permission denied"."""
    import aiayn.checkpoint

    def unlistable(run_dir, moved_aside=False):
        raise PermissionError(13, "Permission denied", str(run_dir))

    monkeypatch.setattr(aiayn.checkpoint, "step_checkpoints", unlistable)
    out = tmp_path / "shared" / "best" / "hf"
    assert export.check_out(out) == out
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "train.json").write_text("{}")  # a run's folder is still known by its train.json
    with pytest.raises(export.AiaynError, match="a checkpoint of the training run"):
        export.check_out(out)


def test_another_threads_clean_up_does_not_take_a_temporary_folder_just_made(tmp_path, monkeypatch):
    """A temporary folder was made before it was recorded as in flight: another thread's export to the
    same OUT, cleaning up just then, took it for a killed export's (its pid is ours) and removed it."""
    out = tmp_path / "hf"

    class CleanedMeanwhile(set):
        def add(self, name: str) -> None:
            export._remove_abandoned(out)  # the other thread's clean-up, just before this add lands
            super().add(name)

    monkeypatch.setattr(export, "_IN_FLIGHT", CleanedMeanwhile())
    with export._export_dir(out) as tmp:
        assert tmp.is_dir()
        (tmp / "model.bin").write_bytes(b"weights")
    assert (out / "model.bin").read_bytes() == b"weights" and not export._IN_FLIGHT
