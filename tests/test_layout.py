"""The repository's layout rules, checked statically on the source (nothing is imported).

Modules here are the numbered scripts at the top level (`NN_name.py`, the book's steps), the
modules of the `minivllm/` package (the engine as a library) and those of `kit/` (the shared
toolbox). An import edge is `import X`,
`from X import ...` (`from kit import cli` is an edge to `kit.cli`), or a call
`importlib.import_module("literal")` (or `__import__("literal")`) anywhere in a file,
including inside functions, whose target is one of those modules.

The rules (README, "Layout: where things live"):

- no import loops among these modules;
- a script imports only numbered scripts of its own or earlier chapters (and `kit`); the
  chapter of a script is `book_chapter(name)` below, the table the book's index states;
- `kit` imports no numbered script;
- every `minivllm` module names its chapter on the first line of its docstring ("Chapter 7: ...")
  and imports only `minivllm` modules of its own or earlier chapters, never `kit`, never a
  numbered script, never through importlib; the two exceptions are named below: support
  modules (data and plumbing every chapter may read, importing nothing of the package) and
  the composition root (`LLM`), which wires every chapter's feature;
- a numbered script imports only `minivllm` modules of its own or earlier chapters; the
  composition root counts as Chapter 9, where the engine is assembled (its later features are
  switches, off by default);
- no module-level `__getattr__` (PEP 562 shims hide where things live);
- every numbered script defines its own `main()` and ends with the
  `if __name__ == "__main__": main()` idiom;
- an `--engine` spec `module:Class` (in the README, the book, scripts/ and tests/) names the
  file that defines the engine class: there is no table of old names.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KIT = "kit"
PACKAGE = "minivllm"
PACKAGE_SUPPORT = {"minivllm.config", "minivllm.threads"}   # data and plumbing, no chapter
PACKAGE_ROOT = {"minivllm", "minivllm.llm"}                 # the composition root
ROOT_CHAPTER = 9                                            # where the book assembles the engine
DOC_CHAPTER = re.compile(r"^Chapters? (\d+)")
ENGINE_ROOT_CLASS = "BaseOfflineEngine"
NUMBERED = re.compile(r"^(\d\d)_\w+$")
# A spec such as `10_model_engine:ModelEngine`: a numbered module, a colon, a class name.
SPEC = re.compile(r"(?<![\w.])(\d\d_\w+):([A-Za-z_]\w*)")


# ---------------------------------------------------------------------------------------------
# Reading the source
# ---------------------------------------------------------------------------------------------

@dataclass
class Module:
    name: str                      # "04_engine", "kit", "kit.cli"
    path: Path
    tree: ast.Module
    is_package: bool = False
    imports: dict[str, list[int]] = field(default_factory=dict)   # target module -> line numbers

    @property
    def rel(self) -> str:
        return self.path.relative_to(REPO_ROOT).as_posix()

    @property
    def numbered(self) -> bool:
        return NUMBERED.match(self.name) is not None

    @property
    def in_package(self) -> bool:
        return self.name == PACKAGE or self.name.startswith(PACKAGE + ".")


# The book's chapter of each numbered script. Script numbers rise with chapter order but are not
# chapter numbers: 01-06 are all Chapter 1, 07 is Chapter 2, number 08 holds two chapters told
# apart by name (the KV cache, then the roofline), and from 09 on script NN is Chapter NN - 4.
SHARED_NUMBER = {"08_kv_cache": 3, "08_roofline": 4}
LAST_CHAPTER = 18   # Chapter 18, replicas (scripts 22_*)


def book_chapter(name: str) -> int:
    """The chapter of the book that teaches script `name` ('08_roofline' -> 4, '13_scheduler' -> 9)."""
    number = int(name[:2])
    if number <= 6:
        return 1
    if number == 7:
        return 2
    if number == 8:
        for prefix, chapter in SHARED_NUMBER.items():
            if name == prefix or name.startswith(prefix + "_"):
                return chapter
        raise ValueError(f"{name}: a script numbered 08 must start with one of {sorted(SHARED_NUMBER)}")
    return number - 4


def chapter_number(name: str) -> int:
    """A number that orders chapters: the book's chapter (scripts 01-06 are all Chapter 1,
    so they may import each other)."""
    return book_chapter(name)


def _module_files() -> dict[str, tuple[Path, bool]]:
    files: dict[str, tuple[Path, bool]] = {}
    for path in sorted(REPO_ROOT.glob("[0-9][0-9]_*.py")):
        files[path.stem] = (path, False)
    for path in sorted([*(REPO_ROOT / KIT).rglob("*.py"), *(REPO_ROOT / PACKAGE).rglob("*.py")]):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        files[".".join(parts)] = (path, is_package)
    return files


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Module]:
    """Every numbered script and kit module, parsed, with its import edges."""
    found: dict[str, Module] = {}
    broken = []
    for name, (path, is_package) in _module_files().items():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as exc:
            broken.append(f"{path.relative_to(REPO_ROOT)}:{exc.lineno}: {exc.msg}")
            continue
        found[name] = Module(name, path, tree, is_package)
    assert not broken, "cannot parse:\n  " + "\n  ".join(broken)
    for module in found.values():
        module.imports = _import_edges(module, set(found))
    return found


def _resolve_relative(module: Module, level: int, target: str | None) -> str:
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if level > 1:
        package = package[: len(package) - (level - 1)]
    return ".".join(package + ([target] if target else []))


def _known(name: str, known: set[str]) -> str | None:
    """The module `name` or its longest enclosing module among the known ones."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def _import_module_aliases(tree: ast.Module) -> set[str]:
    """Names bound to importlib.import_module (`from importlib import import_module as im`)."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "importlib" and not node.level
            for alias in node.names if alias.name == "import_module"}


def _literal_import_call(node: ast.Call, aliases: set[str] = frozenset()) -> tuple[str, str | None] | None:
    """`importlib.import_module("x")`, `import_module("x", package="p")`, `__import__("x")`."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if isinstance(func, ast.Name) and name in aliases:
        name = "import_module"
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    package = None
    package_node = node.args[1] if name == "import_module" and len(node.args) > 1 else None
    for keyword in node.keywords:
        if keyword.arg == "package":
            package_node = keyword.value
    if isinstance(package_node, ast.Constant) and isinstance(package_node.value, str):
        package = package_node.value
    return first.value, package


def _import_edges(module: Module, known: set[str]) -> dict[str, list[int]]:
    edges: dict[str, list[int]] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None:   # a module importing itself counts: it is a loop too
            edges.setdefault(target, []).append(line)

    aliases = _import_module_aliases(module.tree)
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, known), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                submodule = f"{base}.{alias.name}" if base else alias.name
                if alias.name != "*" and submodule in known:
                    add(submodule, node.lineno)
                else:
                    add(_known(base, known), node.lineno)
        elif isinstance(node, ast.Call):
            call = _literal_import_call(node, aliases)
            if call is None:
                continue
            target, package = call
            if target.startswith("."):
                if package is None:
                    continue
                level = len(target) - len(target.lstrip("."))
                parts = package.split(".")
                parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
                rest = target.lstrip(".")
                target = ".".join(parts + ([rest] if rest else []))
            add(_known(target, known), node.lineno)
    return edges


def _edge(source: Module, target: str) -> str:
    lines = ", ".join(str(line) for line in sorted(set(source.imports[target])))
    return f"{source.name} -> {target}  ({source.rel}:{lines})"


# ---------------------------------------------------------------------------------------------
# Imports
# ---------------------------------------------------------------------------------------------

def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path (first node repeated at the end) per strongly connected loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:   # Tarjan's algorithm; the graph is small
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)

    cycles = []
    for component in components:
        start = component[0]
        if len(component) == 1 and start not in graph.get(start, ()):
            continue
        members = set(component)
        # Shortest path back to `start` inside the component (breadth-first).
        parents: dict[str, str] = {}
        frontier = [start]
        end = None
        while frontier and end is None:
            following = []
            for node in frontier:
                for nxt in sorted(graph.get(node, ())):
                    if nxt not in members:
                        continue
                    if nxt == start:
                        end = node
                        break
                    if nxt not in parents:
                        parents[nxt] = node
                        following.append(nxt)
                if end is not None:
                    break
            frontier = following
        path = [start]
        node = end
        while node != start:
            path.append(node)
            node = parents[node]
        path = [start] + path[1:][::-1] + [start]
        cycles.append(path)
    return cycles


def test_no_import_loops():
    mods = modules()
    graph = {name: set(module.imports) for name, module in mods.items()}
    cycles = _cycles(graph)
    report = []
    for cycle in cycles:
        report.append(" -> ".join(cycle))
        report.extend("      " + _edge(mods[a], b) for a, b in zip(cycle, cycle[1:]))
    assert not cycles, (f"{len(cycles)} import loop(s) among the numbered scripts and kit "
                        "(one path per loop; break it so each module only imports what comes before it):\n  "
                        + "\n  ".join(report))


def test_chapters_import_only_earlier_chapters():
    offenders = []
    for module in modules().values():
        if not module.numbered:
            continue
        for target in sorted(module.imports):
            if NUMBERED.match(target) and chapter_number(target) > chapter_number(module.name):
                offenders.append(f"{_edge(module, target)}: Chapter {chapter_number(target)} > "
                                 f"Chapter {chapter_number(module.name)}")
    assert not offenders, ("a numbered script may import only numbered scripts of its chapter or earlier ones "
                           "(and kit); these reach forward:\n  " + "\n  ".join(offenders))


def test_every_numbered_script_has_a_chapter():
    problems = []
    for name, module in modules().items():
        if module.numbered:
            try:
                if not 1 <= book_chapter(name) <= LAST_CHAPTER:
                    problems.append(f"{module.rel}: chapter {book_chapter(name)} is not in the book (1-{LAST_CHAPTER})")
            except ValueError as exc:
                problems.append(str(exc))
    assert not problems, "\n".join(problems)


def test_book_chapter_table():
    assert [book_chapter(n) for n in ("01_setup", "06_benchmark_online", "07_decode_loop", "08_kv_cache",
                                      "08_kv_cache_sizes", "08_roofline", "09_static_batching",
                                      "13_matmul_bound", "16_quantization", "17_compile", "18_tensor_parallel", "19_gpu")] \
        == [1, 1, 2, 3, 3, 4, 5, 9, 12, 13, 14, 15]


def test_kit_imports_no_numbered_script():
    offenders = [_edge(module, target)
                 for module in modules().values() if not module.numbered
                 for target in sorted(module.imports) if NUMBERED.match(target)]
    assert not offenders, ("kit (the toolbox every chapter shares) and minivllm (the engine) import "
                           "no numbered script (statically or through importlib):\n  " + "\n  ".join(offenders))


def package_chapter(module: Module) -> int | None:
    """The chapter a minivllm module names on its docstring's first line (None: support or root)."""
    doc = ast.get_docstring(module.tree) or ""
    match = DOC_CHAPTER.match(doc)
    return int(match.group(1)) if match else None


def test_every_package_module_names_its_chapter():
    problems = []
    for module in modules().values():
        if not module.in_package or module.name in PACKAGE_SUPPORT | PACKAGE_ROOT:
            continue
        chapter = package_chapter(module)
        if chapter is None or not 1 <= chapter <= LAST_CHAPTER:
            first = (ast.get_docstring(module.tree) or "(no docstring)").splitlines()[0][:80]
            problems.append(f"{module.rel}: its docstring must start 'Chapter N: ...' (got {first!r})")
    assert not problems, "\n".join(problems)


def test_package_modules_import_only_earlier_chapters():
    mods = modules()
    offenders = []
    for module in mods.values():
        if not module.in_package:
            continue
        for target in sorted(module.imports):
            where = _edge(module, target)
            if not mods[target].in_package:
                offenders.append(f"{where}: the package imports neither kit nor a numbered script")
            elif module.name in PACKAGE_ROOT:
                continue
            elif module.name in PACKAGE_SUPPORT:
                offenders.append(f"{where}: a support module imports nothing of the package")
            elif target in PACKAGE_ROOT:
                offenders.append(f"{where}: only the composition root wires features together")
            elif target not in PACKAGE_SUPPORT and package_chapter(mods[target]) > package_chapter(module):
                offenders.append(f"{where}: Chapter {package_chapter(mods[target])} > "
                                 f"Chapter {package_chapter(module)}")
        calls = [node.lineno for node in ast.walk(module.tree) if isinstance(node, ast.Call)
                 and isinstance(node.func, (ast.Name, ast.Attribute))
                 and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
                 in ("import_module", "__import__")]
        if calls:
            offenders.append(f"{module.rel}:{', '.join(map(str, calls))}: a feature looked up by name; "
                             "import it, so the edge shows")
    assert not offenders, ("a minivllm module imports only modules of its own or earlier chapters "
                           "(the composition root excepted):\n  " + "\n  ".join(offenders))


def test_numbered_scripts_import_only_earlier_package_modules():
    mods = modules()
    offenders = []
    for module in mods.values():
        if not module.numbered:
            continue
        for target in sorted(module.imports):
            if not mods[target].in_package or target in PACKAGE_SUPPORT:
                continue
            chapter = ROOT_CHAPTER if target in PACKAGE_ROOT else package_chapter(mods[target])
            if chapter > chapter_number(module.name):
                offenders.append(f"{_edge(module, target)}: Chapter {chapter} > Chapter {chapter_number(module.name)}")
    assert not offenders, ("a numbered script may import only package modules of its chapter or "
                           "earlier ones:\n  " + "\n  ".join(offenders))


# ---------------------------------------------------------------------------------------------
# Module shape
# ---------------------------------------------------------------------------------------------

def _module_scope(body: list[ast.stmt]):
    """Statements that run at module level, also inside top-level if/try/with/for blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for attr in ("body", "orelse", "finalbody"):
            yield from _module_scope(getattr(node, attr, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            yield from _module_scope(handler.body)
        for case in getattr(node, "cases", []) or []:
            yield from _module_scope(case.body)


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == name
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    return any(isinstance(sub, ast.Name) and sub.id == name
               for target in targets for sub in ast.walk(target))


def test_no_module_getattr_shims():
    offenders = [f"{module.rel}:{node.lineno}"
                 for module in modules().values()
                 for node in _module_scope(module.tree.body) if _binds(node, "__getattr__")]
    assert not offenders, ("module-level __getattr__ (a PEP 562 shim) hides where a name lives; "
                           "import it from the file that defines it instead:\n  " + "\n  ".join(offenders))


def _is_main_guard(node: ast.stmt) -> bool:
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _calls_own_main(stmt: ast.stmt) -> bool:
    """`main()`, `sys.exit(main())` or `raise SystemExit(main())`."""
    if isinstance(stmt, ast.Expr):
        call = stmt.value
    elif isinstance(stmt, ast.Raise):
        call = stmt.exc
    else:
        return False
    if not isinstance(call, ast.Call):
        return False
    if isinstance(call.func, ast.Name) and call.func.id == "main":
        return True
    exits = ((isinstance(call.func, ast.Attribute) and call.func.attr == "exit")
             or (isinstance(call.func, ast.Name) and call.func.id in ("SystemExit", "exit")))
    return (exits and len(call.args) == 1 and isinstance(call.args[0], ast.Call)
            and isinstance(call.args[0].func, ast.Name) and call.args[0].func.id == "main"
            and not call.args[0].args and not call.args[0].keywords)


def test_every_numbered_script_has_its_own_main():
    offenders = []
    for module in modules().values():
        if not module.numbered:
            continue
        body = module.tree.body
        defs = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        if not defs:
            offenders.append(f"{module.rel}: no top-level `def main(`")
        rebinds = [n for n in _module_scope(body) if _binds(n, "main") and n not in defs]
        if rebinds:
            offenders.append(f"{module.rel}:{rebinds[0].lineno}: `main` rebound at module level "
                             "(it must be this file's own function)")
        last = body[-1] if body else None
        if last is None or not _is_main_guard(last):
            offenders.append(f"{module.rel}: does not end with `if __name__ == \"__main__\": main()`")
        elif not _calls_own_main(last.body[-1]) or last.orelse:
            offenders.append(f"{module.rel}:{last.lineno}: the `__main__` block must end by calling "
                             "this file's own main() (got: "
                             f"{ast.unparse(last.body[-1]).splitlines()[0][:80]})")
    assert not offenders, ("every numbered script defines a top-level main() and ends with "
                           "`if __name__ == \"__main__\": main()`:\n  " + "\n  ".join(offenders))


# ---------------------------------------------------------------------------------------------
# Engines live in the file their --engine spec names
# ---------------------------------------------------------------------------------------------

def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):          # Generic[T] and the like
        node = node.value
    if isinstance(node, ast.Attribute):          # engine04.BaselineEngine
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _top_level_classes(module: Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in module.tree.body if isinstance(node, ast.ClassDef)}


@functools.lru_cache(maxsize=None)
def engine_classes() -> frozenset[str]:
    """Names of the classes whose bases chain, by name across the repo's source, to BaseOfflineEngine."""
    bases: dict[str, set[str]] = {}
    for module in modules().values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(
                    name for name in map(_base_name, node.bases) if name)

    @functools.lru_cache(maxsize=None)
    def is_engine(name: str, seen: frozenset = frozenset()) -> bool:
        if name == ENGINE_ROOT_CLASS:
            return True
        if name in seen:
            return False
        return any(is_engine(base, seen | {name}) for base in bases.get(name, ()))

    return frozenset(name for name in bases if name != ENGINE_ROOT_CLASS and is_engine(name))


def _spec_sources() -> list[Path]:
    paths = [REPO_ROOT / "README.md"]
    paths += sorted((REPO_ROOT / "book").rglob("*.md"))
    paths += sorted((REPO_ROOT / "scripts").glob("*.py"))
    paths += sorted((REPO_ROOT / "tests").glob("*.py"))
    return [p for p in paths if p.is_file()]


def _found_specs(engines: frozenset[str]) -> dict[str, list[str]]:
    """Engine specs in the docs, scripts and tests: spec -> where ('path:line').

    A spec counts when its class is an engine class somewhere in the repo or is named
    `...Engine`; the tests' deliberately wrong specs (`04_engine:NoSuchClass`) and
    `05_server:create_app` are not engines.
    """
    found: dict[str, list[str]] = {}
    for path in _spec_sources():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in SPEC.finditer(line):
                cls = match.group(2)
                if cls in engines or cls.endswith("Engine"):
                    found.setdefault(match.group(0), []).append(f"{path.relative_to(REPO_ROOT)}:{lineno}")
    return found


def test_engines_live_in_the_file_their_spec_names():
    mods = modules()
    engines = engine_classes()
    specs = _found_specs(engines)
    offenders = []
    for target in sorted(specs):
        module_name, _, cls = target.partition(":")
        module = mods.get(module_name)
        if module is None or not module.numbered:
            problem = f"there is no numbered script {module_name}.py"
        elif cls not in _top_level_classes(module):
            homes = [m.rel for m in mods.values() if cls in _top_level_classes(m)]
            problem = f"{module_name}.py does not define class {cls} at top level" + (
                f" (it is defined in {', '.join(homes)})" if homes else "")
        elif cls not in engines:
            problem = f"{cls} in {module_name}.py is not an engine (its bases do not reach {ENGINE_ROOT_CLASS})"
        else:
            continue
        uses = specs[target]
        where = ", ".join(uses[:3]) + (f", ... {len(uses) - 3} more" if len(uses) > 3 else "")
        offenders.append(f"{target}: {problem}\n      [in {where}]")
    assert not offenders, ("an --engine spec 'module:Class' must name the file that defines the "
                           "engine; these do not:\n  " + "\n  ".join(offenders))
