"""``import torchfn`` leaves Dynamo and Inductor unimported (seconds a program that never
compiles -- or each data-loader worker -- would pay); they load on first use. Except where
Triton is installed (CUDA builds of torch): registering the fused Gram-norm Triton op at import
(``torchfn.ops._gram_triton``; it cannot be registered inside a compiled step) imports them."""

from __future__ import annotations

import subprocess
import sys

import torch


def _modules_after(code: str) -> tuple[set[str], bool]:
    """The modules a fresh interpreter holds after ``code``, and whether the fused Gram-norm
    Triton op registered at import."""
    tail = ("import sys\nfrom torchfn.ops import _gram_triton\n"
            "print(int(_gram_triton._REGISTERED), ' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", f"{code}\n{tail}"], check=True,
                         capture_output=True, text=True, timeout=300)
    flag, *mods = out.stdout.split()
    return set(mods), flag == "1"


def test_import_torchfn_does_not_import_dynamo_or_inductor() -> None:
    mods, registered = _modules_after(
        "import torchfn, torchfn.persample, torchfn.meta, torchfn.compile")
    assert "torchfn.persample" in mods
    if not registered:  # with Triton the op's registration imports Inductor (module doc)
        assert "torch._dynamo" not in mods and "torch._inductor" not in mods
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
