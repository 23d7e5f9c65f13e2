"""The house keeps the shape of its design note: one concern per module, arrows pointing down.

The import graph of src/aiayn is read from the source (module-level and function-level imports, so
a lazy import inside a function counts as much as one at the top) and must have no cycle; no library
module imports the CLI; the paper's model depends on nothing but its config, kernels (and search's
decoding step on them) and cache.
"""

from __future__ import annotations

import ast
from pathlib import Path

from aiayn.config import INFERENCE_PRECISIONS, PRECISIONS, ModelConfig
from aiayn.tokenizer import PAD_ID, PIECES

SRC = Path(__file__).resolve().parents[1] / "src" / "aiayn"
MODEL_MAX_LINES = 450  # the paper (Sections 3.1-3.5) reads in one sitting


def module_names(package: Path = SRC) -> dict[str, Path]:
    """Dotted module name inside the package -> its file: `model`, `data` (its __init__), `data.corpus`."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:  # the package's own __init__ is not a room
            names[".".join(parts)] = path
    return names


def import_graph(package: Path = SRC) -> dict[str, set[str]]:
    """module -> the aiayn modules it imports anywhere in its source (itself and the package excluded);
    subpackage modules by their dotted name (`data.corpus`)."""
    modules = module_names(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("aiayn."))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "aiayn":
                base = node.module.split(".", 1)[1] if "." in node.module else ""
                for a in node.names:  # `from aiayn.x import y` names x.y if that is a module, else x
                    sub = f"{base}.{a.name}" if base else a.name
                    if sub in modules:
                        deps.add(sub)
                    elif base:
                        deps.add(base)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert {"model", "config", "cli"} <= set(graph)  # the graph really was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_library_module_imports_the_cli():
    importers = sorted(m for m, deps in import_graph().items() if "cli" in deps and m != "__main__")
    assert importers == []


def test_the_paper_depends_only_on_what_lies_below_it():
    graph = import_graph()
    assert graph["model"] <= {"config", "kernels", "step", "cache"}
    assert graph["step"] <= {"kernels"}  # search's decoding step: speed only, on the kernels
    for low in ("config", "errors", "files", "kernels", "cache"):  # the floor every other room stands on
        assert graph[low] <= {"errors"}, (low, graph[low])


def test_the_data_path_imports_only_what_lies_before_it():
    """download -> prepare -> bindata -> batching -> corpus, as the subpackage's docstring draws it."""
    graph = import_graph()
    order = ["data.lock", "data.text", "data.wmt14", "data.download", "data.bindata", "data.prepare", "data.batching",
             "data.corpus"]
    for i, m in enumerate(order):
        later = {d for d in graph[m] if d.startswith("data")} - set(order[:i])
        assert not later, (m, later)


def test_plot_does_not_import_train_for_one_formula():
    """The schedule plot needs `config.learning_rate`, not the whole training loop (and torch.distributed)."""
    assert "train" not in import_graph()["plot"]


def test_the_trainer_is_the_mechanism_below_the_run():
    """trainer.py (the update, precision, DDP, validation, RNG state) knows nothing of the run that
    drives it (the loop: train.py; flags: train_options.py; run directory, resume policy: rundir.py)."""
    graph = import_graph()
    assert "trainer" in graph["train"]
    assert not graph["trainer"] & {"train", "train_options", "rundir", "checkpoint", "cli"}, graph["trainer"]
    assert not graph["train_options"] & {"train", "rundir"} and "train" not in graph["rundir"]


def test_model_py_reads_in_one_sitting():
    lines = len((SRC / "model.py").read_text(encoding="utf-8").splitlines())
    assert lines < MODEL_MAX_LINES, f"model.py has {lines} lines; move what is not the paper out"


def duplicated_definitions(package: Path = SRC) -> list[str]:
    """`file:line what` for each copy of a definition that has one home: a literal tuple, list or set
    of precision names outside config.py, a special piece name ("<pad>", ...) outside tokenizer.py,
    an integer default for a special id (pad_id=0) outside tokenizer.py and config.py."""
    precisions, pieces = set(PRECISIONS), set(PIECES.values())
    ids = {"pad_id", "unk_id", "bos_id", "eos_id"}
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and path.name != "config.py":
                values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if len(values) == len(node.elts) >= 2 and set(values) <= precisions:
                    found.append(f"{where} precision names {tuple(values)}")
            elif isinstance(node, ast.Constant) and node.value in pieces and path.name != "tokenizer.py":
                found.append(f"{where} piece name {node.value!r}")
            elif isinstance(node, ast.arguments) and path.name not in ("tokenizer.py", "config.py"):
                args = [*node.posonlyargs, *node.args]
                named = list(zip(args[len(args) - len(node.defaults):], node.defaults))
                named += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
                found += [f"{path.name}:{d.lineno} {a.arg}={d.value}" for a, d in named
                          if a.arg in ids and isinstance(d, ast.Constant) and isinstance(d.value, int)]
    return found


def test_the_duplicate_finder_finds_duplicates(tmp_path):
    (tmp_path / "serve.py").write_text('choices = ("fp32", "bf16")\nx = "fp32"\n')
    (tmp_path / "export.py").write_text('kw = dict(eos_token="</s>")\ndoc = "ends with </s>"\n')
    (tmp_path / "train.py").write_text("def loss(m, pad_id: int = 0, *, eos_id=3, bos_id=BOS_ID): ...\n")
    assert duplicated_definitions(tmp_path) == ["export.py:1 piece name '</s>'", "serve.py:1 precision names "
                                                "('fp32', 'bf16')", "train.py:1 pad_id=0", "train.py:1 eos_id=3"]


def test_one_definition_of_the_special_ids_and_precisions():
    assert ModelConfig().pad_id == PAD_ID  # config stands below tokenizer: its literal default is pinned here
    assert set(INFERENCE_PRECISIONS) - {"int8"} <= set(PRECISIONS)  # int8: decoding only (train refuses it)
    assert duplicated_definitions() == []
