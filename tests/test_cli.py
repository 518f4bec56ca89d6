"""The ``torchfn`` command: doctor reports truthfully, unknown commands fail clearly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torchfn.cli import doctor_report, main


def test_doctor_reports_this_machine(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert "usable devices" in out
    rows = dict(doctor_report())
    assert rows["torch"] == torch.__version__
    assert rows["TF32"] == (f"matmul {torch.backends.cuda.matmul.allow_tf32}, "
                            f"cuDNN {torch.backends.cudnn.allow_tf32}")
    usable = rows["usable devices"].split(", ")
    assert usable[0] == "cpu"
    assert len(usable) == 1 + (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_console_script_runs_doctor():
    out = subprocess.run(
        [sys.executable, "-m", "torchfn.cli", "doctor"], capture_output=True, text=True, check=True
    ).stdout
    assert "torch CUDA build" in out


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
