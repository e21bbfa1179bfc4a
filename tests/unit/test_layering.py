"""The packages' layering (shared/DESIGN.md section 1), read from the source, not trusted to review.

The import graph is built with ``ast`` over every source file of the four packages, counting
imports inside functions and under ``if TYPE_CHECKING:`` too: a cycle or an upward import hidden
in a function body or a type annotation is still one (the review of 2026-12-03 found both).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("masklab", "theory", "kernels", "sdp_train")
ALLOWED = {  # package -> the project packages it may import
    "masklab": set(),
    "theory": {"masklab"},
    "kernels": set(),
    # DESIGN: sdp_train uses masklab and kernels. It is also the application layer: the `sdp`
    # command dispatches to theory's subcommands and `sdp compare` reports the covering
    # theorem's bound (theory.coverage). theory never imports sdp_train, so the arrows still
    # point one way.
    "sdp_train": {"masklab", "kernels", "theory"},
}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the four packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The project modules `name` imports anywhere in `source` (``from p import m`` counts as p.m when m is a module)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path.read_text(encoding="utf-8"), set(modules),
                                   is_package=path.name == "__init__.py")
            for name, path in modules.items()}


def test_the_import_graph_sees_imports_inside_functions_and_type_checking_blocks():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sync\n"
        "if TYPE_CHECKING:\n"
        "    from sdp_train.trainer.train import Run\n"
        "def f():\n"
        "    import theory.bounds\n"
        "    from ..masklab import io\n"
    )
    known = {"sdp_train.sync", "sdp_train.trainer.train", "theory.bounds", "masklab.io"}
    assert imported_modules("sdp_train.x", source, known) == known


def test_every_package_imports_only_the_packages_below_it():
    wrong = sorted(f"{module} imports {target}" for module, targets in import_graph().items() for target in targets
                   if target.split(".")[0] not in ALLOWED[module.split(".")[0]] | {module.split(".")[0]})
    assert wrong == []


# sdp_train's own packages (docs/design.md §6) -> those they may import besides themselves and
# sdp_train.errors. The library (`parallel`) knows no trainer and no model family; a family may use
# the library's block maps; the trainer drives the library; planning and compare sit above it.
SDP_ALLOWED = {
    "parallel": set(),
    "data": set(),
    "models": {"parallel"},
    "trainer": {"parallel", "models", "data"},
    "planning": {"parallel", "models", "data", "trainer"},
    "compare": {"parallel", "models", "data", "trainer", "planning"},
    "cli": {"parallel", "models", "data", "trainer", "planning", "compare", "integrations"},
    # other libraries driving ours: Hugging Face's Trainer the wrapper; lm-eval a built-in model, converted
    "integrations": {"parallel", "models", "data"},
}


def sdp_part(module: str) -> str:
    """``sdp_train.parallel.sync`` -> ``parallel``; a top-level module (errors, testing) is its own part."""
    return module.split(".")[1] if module.count(".") else ""


def test_sdp_train_packages_import_only_the_packages_below_them():
    graph = import_graph()
    assert set(SDP_ALLOWED) <= {sdp_part(m) for m in graph}
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() if sdp_part(module) in SDP_ALLOWED
                   for target in targets if target.startswith("sdp_train.")
                   and sdp_part(target) not in SDP_ALLOWED[sdp_part(module)] | {sdp_part(module), "errors"})
    assert wrong == []


def test_the_project_imports_its_own_modules_by_their_current_paths():
    """Release 0.1's flat paths (``sdp_train.api``, ...) still import for users, with a warning; the
    project itself never uses them, so the aliases can go without breaking it."""
    graph = import_graph()
    stale = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                   if target.startswith("sdp_train.") and target not in graph)
    assert stale == []


def test_old_module_paths_import_the_moved_modules_with_a_warning():
    code = (
        "import importlib, warnings\n"
        "import sdp_train\n"
        "for old, new in sdp_train.MOVED.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module('sdp_train.' + old)\n"
        "    assert module is importlib.import_module('sdp_train.' + new), old\n"
        "    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old\n"
        "assert len(sdp_train.MOVED) > 30\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_no_module_of_a_package_imports_itself_back_through_others():
    """A cycle, even one closed by a function-level import, means a module can run half-initialised
    and that the two cannot be understood or changed apart; the shared piece belongs below both."""
    graph = import_graph()
    edges = [(a, b) for a, targets in graph.items() for b in targets
             if b in graph and b != a and a.split(".")[0] == b.split(".")[0]]
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(nx.DiGraph(edges)))
    assert cycles == []


def test_importing_every_masklab_module_loads_neither_sdp_train_nor_theory():
    code = (
        "import importlib, pkgutil, sys\n"
        "import masklab\n"
        "names = [m.name for m in pkgutil.walk_packages(masklab.__path__, 'masklab.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('sdp_train', 'theory'))\n"
        "assert len(names) > 10, names\n"
        "assert loaded == [], loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_family_knowledge_stays_in_models():
    """Outside `sdp_train.models` no module tells a family by its attributes or classes: it asks
    `models.data_kind` and the family's own declarations (issue 31: ``hasattr(..., "vocab_size")``
    in three places, ``isinstance(model, ResNet)`` and ``LLAMA_MLP`` outside `models/`)."""
    probes = (r'hasattr\([^()]*, "vocab_size"\)', r"isinstance\([^()]*, ResNet\)", r"\bLLAMA_MLP\b")
    found = sorted(f"{path.relative_to(ROOT)}: {probe}" for name, path in project_modules().items()
                   if name.startswith("sdp_train.") and not name.startswith("sdp_train.models")
                   for probe in probes if re.search(probe, path.read_text()))
    assert found == []
