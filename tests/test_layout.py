"""The package layout: dependencies flow one way, no package reaches into another's privates.

Rule (every import statement of every module under torchfn/, function-local ones included):

- a package may import only the torchfn packages listed for it in ``ALLOWED`` below
  (ops: none; optim: ops; functional: optim; compile: functional, optim, ops;
  persample, ensembles, meta: compile, functional, optim, ops (meta also data);
  data: none; distributed: anything); top-level modules (cli.py, _demo.py, __init__.py)
  may import anything;
- ``torchfn._checks`` (shared private validators; it imports only torch and the standard
  library) is the one module that every package, ``torchfn.data`` and ``torchfn.ops``
  included, may import;
- no module imports a private module (``torchfn.pkg._x``) or a private name
  (``from torchfn.pkg import _x``) of another package.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib

import pytest
import torch

import torchfn

ROOT = pathlib.Path(torchfn.__file__).resolve().parent
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
_ABOVE = {"compile", "functional", "optim", "ops"}
ALLOWED: dict[str, set[str]] = {
    "ops": set(),
    "optim": {"ops"},
    "functional": {"optim"},
    "compile": {"functional", "optim", "ops"},
    "persample": _ABOVE,
    "ensembles": _ABOVE,
    "meta": _ABOVE | {"data"},
    "data": set(),
    "distributed": set(PACKAGES),
}
SHARED = "torchfn._checks"


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "_csrc" not in p.parts)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str, list[str]]]:
    """Return ``(line, absolute module, imported names)`` of every import in the file."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def _violations(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    rel = path.relative_to(root.parent)
    parts = _module_name(path, root).split(".")
    own = parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None
    found = []
    for line, module, names in _imports(path, root):
        if module != "torchfn" and not module.startswith("torchfn."):
            continue
        targets = [module]
        if module == "torchfn":  # `from torchfn import ops` imports the package ops
            targets = [f"torchfn.{n}" for n in names]
            names = []
        for target in targets:
            tparts = target.split(".")
            if target == SHARED or target.startswith(SHARED + "."):
                continue
            if len(tparts) < 2 or tparts[1] not in PACKAGES:
                if own is not None:  # a package importing a top-level module (cli, _demo)
                    found.append(f"{rel}:{line}: imports top-level module {target}")
                continue
            pkg = tparts[1]
            if pkg == own:
                continue
            if own is not None and pkg not in ALLOWED[own]:
                found.append(f"{rel}:{line}: torchfn.{own} may not import {target}")
            private = [p for p in tparts[2:] if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            if private:
                found.append(f"{rel}:{line}: imports private {private} of torchfn.{pkg}")
    return found


def test_every_package_has_a_rule() -> None:
    assert sorted(ALLOWED) == PACKAGES


def test_dependencies_flow_one_way_and_no_private_imports_across_packages() -> None:
    found = [v for path in _modules() for v in _violations(path)]
    assert found == []


def test_checker_catches_forbidden_imports(tmp_path: pathlib.Path) -> None:
    # The rule above must be able to fail: plant offending modules in a copy of the layout.
    fake = tmp_path / "torchfn"
    for pkg in ("functional", "ensembles", "data"):
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "__init__.py").write_text("")
    (fake / "functional" / "_bad.py").write_text("def f():\n    import torchfn.ops\n")
    (fake / "ensembles" / "_bad.py").write_text(
        "from torchfn.functional._train_step import TrainState\n"
        "from torchfn.functional import _private\n"
    )
    (fake / "data" / "_ok.py").write_text("from torchfn._checks import _check_rank\n")
    found = [v for path in sorted(fake.rglob("*.py")) for v in _violations(path, fake)]
    assert found == [
        os.path.join("torchfn", "ensembles", "_bad.py")
        + ":1: imports private ['_train_step'] of torchfn.functional",
        os.path.join("torchfn", "ensembles", "_bad.py")
        + ":2: imports private ['_private'] of torchfn.functional",
        os.path.join("torchfn", "functional", "_bad.py")
        + ":2: torchfn.functional may not import torchfn.ops",
    ]


def test_checks_imports_only_torch_and_the_standard_library() -> None:
    roots = {m.split(".")[0] for _, m, _ in _imports(ROOT / "_checks.py")}
    assert roots <= {"__future__", "collections", "contextlib", "functools", "inspect", "types",
                     "typing", "torch"}


@pytest.mark.parametrize("package", PACKAGES)
def test_all_names_exist_and_import(package: str) -> None:
    module = importlib.import_module(f"torchfn.{package}")
    assert module.__all__ == sorted(set(module.__all__), key=module.__all__.index)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        exec(f"from torchfn.{package} import {name}", {})


def test_top_level_lists_every_package() -> None:
    assert sorted(n for n in torchfn.__all__ if n != "__version__") == PACKAGES
    for name in PACKAGES:
        assert getattr(torchfn, name) is importlib.import_module(f"torchfn.{name}")
        assert f":mod:`torchfn.{name}`" in (torchfn.__doc__ or "")


def test_compile_exports_exactly_twelve_names() -> None:
    """torchfn.compile's public surface is fixed: the three compile helpers; the profiling
    helpers (profile_step, memory_snapshot, and the StepProfile / OpTime results profile_step
    returns, public so users can type and read them); compile_step (and the CompiledStep it
    returns), which says when a step compiles and for how long; and the compile-cache helpers
    (enable_compile_cache, save_compile_cache, load_compile_cache)."""
    assert sorted(torchfn.compile.__all__) == [
        "CompiledStep", "OpTime", "StepProfile", "compile_step", "enable_compile_cache",
        "inductor_options", "load_compile_cache", "make_graphed_step", "memory_snapshot",
        "profile_step", "save_compile_cache", "unfold_convs"]


MOVED = [
    ("functional", "make_dp_train_step", "torchfn.persample.make_dp_train_step"),
    ("functional", "RDPAccountant", "torchfn.persample.RDPAccountant"),
    ("functional", "ghost_grad_norms", "torchfn.persample.ghost_grad_norms"),
    ("functional", "NoiseScaleState", "torchfn.persample.NoiseScaleState"),
    ("functional", "adam", "torchfn.optim.adam"),
    ("functional", "make_graphed_step", "torchfn.compile.make_graphed_step"),
    ("functional", "GraphedStep", "torchfn.compile (internal now"),
    ("ops", "stacked_adam", "torchfn.optim.stacked_adam"),
    ("ops", "StackedSgdState", "torchfn.optim.StackedSgdState"),
    ("ensembles", "per_member_adam", "torchfn.optim.per_member_adam"),
    ("ensembles", "per_member_optimizer", "torchfn.optim.per_member_optimizer"),
    ("meta", "unfold_convs", "torchfn.compile.unfold_convs"),
    ("meta", "inductor_options", "torchfn.compile.inductor_options"),
    ("meta", "UnfoldConv2d", "torchfn.compile (internal now"),
]


@pytest.mark.parametrize(("package", "name", "home"), MOVED)
def test_moved_names_raise_naming_their_new_home(package: str, name: str, home: str) -> None:
    module = importlib.import_module(f"torchfn.{package}")
    assert name not in module.__all__
    with pytest.raises(AttributeError, match=rf"^torchfn\.{package}\.{name} moved to "
                       + home.replace(".", r"\.").replace("(", r"\(")):
        getattr(module, name)
    with pytest.raises(ImportError, match=name):
        exec(f"from torchfn.{package} import {name}", {})


def test_unknown_names_still_raise_the_plain_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        torchfn.functional.no_such_name  # noqa: B018


def test_functional_does_not_load_ops_on_its_own() -> None:
    # Importing any torchfn package runs torchfn/__init__ (which loads everything), so the
    # static rule above is what keeps functional off ops; here: not one module of
    # functional names ops, even lazily.
    for path in (ROOT / "functional").rglob("*.py"):
        for _, module, names in _imports(path):
            assert not module.startswith("torchfn.ops"), path
            assert not (module == "torchfn" and "ops" in names), path


def test_checkpoint_records_stable_public_names(tmp_path: pathlib.Path) -> None:
    from torchfn.functional import init_train_state, load_checkpoint, save_checkpoint
    from torchfn.optim import StackedAdamState, stacked_adam

    opt = stacked_adam(lr=torch.tensor([1e-2, 1e-1]))
    state = init_train_state({"w": torch.ones(2, 3)}, {}, opt, seed=0)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, state)
    raw = torch.load(path, weights_only=True)["state"]["opt_state"]
    assert raw["type"] == "torchfn.optim.StackedAdamState"
    loaded, _ = load_checkpoint(path)
    assert type(loaded.opt_state) is StackedAdamState
    torch.testing.assert_close(loaded.opt_state.mu["w"], state.opt_state.mu["w"], rtol=0, atol=0)
