"""``import torchfn`` leaves Dynamo and Inductor unimported (seconds a program that never
compiles -- or each data-loader worker -- would pay); they load on first use. That holds where
Triton is installed too (CUDA builds of torch): the fused Gram-norm Triton op, whose
registration imports them, registers on first use (``make_ghost_model``), not at import."""

from __future__ import annotations

import subprocess
import sys

import torch


def _modules_after(code: str) -> tuple[set[str], tuple[bool, bool]]:
    """The modules a fresh interpreter holds after ``code``, and whether the fused Gram-norm
    Triton op can run on this install and is registered."""
    tail = ("import sys\nfrom torchfn.ops import _gram_triton as m\n"
            "print(int(m._AVAILABLE), int(m._REGISTERED), ' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", f"{code}\n{tail}"], check=True,
                         capture_output=True, text=True, timeout=300)
    available, registered, *mods = out.stdout.split()
    return set(mods), (available == "1", registered == "1")


def test_import_torchfn_does_not_import_dynamo_or_inductor() -> None:
    mods, (_, registered) = _modules_after(
        "import torchfn, torchfn.persample, torchfn.meta, torchfn.compile")
    assert "torchfn.persample" in mods
    assert "torch._dynamo" not in mods and "torch._inductor" not in mods
    assert not registered
    assert "torchfn.distributed" not in mods  # on first use
    used, _ = _modules_after("import torchfn\nassert torchfn.distributed.__name__ == "
                             "'torchfn.distributed'\nfrom torchfn.compile import "
                             "inductor_options\ninductor_options()")
    assert {"torchfn.distributed", "torch._dynamo", "torch._inductor.custom_graph_pass"} <= used


def test_the_constant_marker_is_the_one_torch_sets() -> None:
    """``_ghost_layers`` marks a function as ``assume_constant_result`` does, by attribute,
    to keep ``torch._dynamo`` unimported; this fails if torch renames the attribute."""
    from torchfn.persample import _ghost_layers

    def f() -> int:
        return 0

    marked = torch.compiler.assume_constant_result(f)
    names = {k for k, v in vars(marked).items() if v is True}
    assert names == {"_dynamo_marked_constant"}, names
    assert _ghost_layers._fp32_matmul_is_highest._dynamo_marked_constant is True


def test_make_ghost_model_registers_the_gram_op_where_triton_can_run_it() -> None:
    """The op registers when a ghost model is made (before any compiled step traces it),
    wherever this install can run it; elsewhere nothing is imported for it."""
    mods, (available, registered) = _modules_after(
        "import torch, torchfn\ntorchfn.persample.make_ghost_model(torch.nn.Linear(2, 2))")
    assert registered == available
    if not available:
        assert "torch._inductor" not in mods
