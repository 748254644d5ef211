"""The Dockerfile, read without a Docker engine (none runs here): what it copies exists and is
not excluded by .dockerignore, the extras it installs are defined, the stages it refers to
exist, the base images are pinned, and each final stage runs as a non-root user without a
CUDA toolkit or general build tools. Whether the images build and run is not checked here."""

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parent.parent
FINAL_STAGES = {"gpu", "cpu"}
BUILD_TOOLS = {"build-essential", "cmake", "git", "ninja-build", "make", "cuda-toolkit"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
            pending = ""
    return out


def parse(text: str) -> dict:
    """{"args": global ARG defaults, "stages": [{"name", "base", "steps"}]}."""
    args, stages = {}, []
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert match, f"FROM {rest}"
            stages.append({"base": match.group(1), "name": match.group(2), "steps": []})
        elif keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1]["steps"].append((keyword, rest))
    return {"args": args, "stages": stages}


def expand(value: str, args: dict) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], value)


def copy_parts(rest: str) -> tuple[dict, list[str], str]:
    """COPY's --flags, sources and destination."""
    words = rest.split()
    flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1], paths[-1]


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes `path` or a folder above it (`**/` matches any depth)."""
    parts = Path(path).parts
    prefixes = [parts[: i + 1] for i in range(len(parts))]
    for pattern in patterns:
        anywhere = pattern.startswith("**/")
        pattern = pattern.removeprefix("**/")
        for prefix in prefixes:
            tails = [prefix[j:] for j in range(len(prefix))] if anywhere else [prefix]
            if any(fnmatch.fnmatchcase("/".join(tail), pattern) for tail in tails):
                return True
    return False


@pytest.fixture(scope="module")
def dockerfile():
    return parse((ROOT / "Dockerfile").read_text())


def test_parser_joins_continuations_and_reads_stages():
    text = "ARG V=1\nFROM img:${V} AS a\nRUN x \\\n    # note\n    && y\nFROM a\nUSER 1000\n"
    parsed = parse(text)
    assert parsed["args"] == {"V": "1"}
    assert [(s["name"], s["base"]) for s in parsed["stages"]] == [("a", "img:${V}"), (None, "a")]
    assert parsed["stages"][0]["steps"] == [("RUN", "x && y")]


def test_every_copied_file_exists_and_is_in_the_build_context(dockerfile):
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = []
    for stage in dockerfile["stages"]:
        for keyword, rest in stage["steps"]:
            if keyword not in ("COPY", "ADD"):
                continue
            flags, sources, _ = copy_parts(rest)
            if "from" in flags:
                continue
            for source in sources:
                assert (ROOT / source).exists(), f"{keyword} {source}: no such file in the repo"
                assert not dockerignored(source, patterns), f"{source} is in .dockerignore"
                copied.append(source)
    assert {"pyproject.toml", "README.md", "cagrpo_ray", "configs"} <= set(copied)
    assert dockerignored(".venv", patterns) and dockerignored("cagrpo_ray/__pycache__", patterns)


def test_every_installed_extra_is_defined_in_pyproject(dockerfile):
    defined = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    installed = {}
    for stage in dockerfile["stages"]:
        for keyword, rest in stage["steps"]:
            if keyword == "RUN":
                for extras in re.findall(r"['\"]?\.\[([\w,\s-]+)\]['\"]?", rest):
                    for extra in extras.split(","):
                        installed[extra.strip()] = stage["name"]
    assert installed == {"gpu": "gpu-build", "cpu": "cpu-build"}
    assert set(installed) <= defined


def test_stages_referenced_exist_and_final_stages_are_the_targets(dockerfile):
    stages = dockerfile["stages"]
    names = [s["name"] for s in stages]
    assert len(set(names)) == len(names)
    assert FINAL_STAGES <= set(names)
    used = set()
    for index, stage in enumerate(stages):
        earlier = set(names[:index])
        if stage["base"] in names:
            assert stage["base"] in earlier, f"{stage['name']} builds on a later stage"
            used.add(stage["base"])
        for keyword, rest in stage["steps"]:
            if keyword == "COPY":
                source = copy_parts(rest)[0].get("from")
                if source is not None:
                    assert source in earlier, f"COPY --from={source}: no earlier stage of that name"
                    used.add(source)
    leaves = set(names) - used
    assert leaves == FINAL_STAGES


def test_base_images_are_pinned(dockerfile):
    args = dockerfile["args"]
    for stage in dockerfile["stages"]:
        if stage["base"] in {s["name"] for s in dockerfile["stages"]}:
            continue
        image = expand(stage["base"], args)
        tag = image.rpartition(":")[2]
        assert ":" in image and tag != "latest" and re.search(r"\d+\.\d+", tag), image
    assert re.fullmatch(r"3\.11\.\d+", args["PYTHON_VERSION"])


def test_final_stages_run_as_a_non_root_user_without_build_tools(dockerfile):
    for stage in dockerfile["stages"]:
        if stage["name"] not in FINAL_STAGES:
            continue
        users = [rest for keyword, rest in stage["steps"] if keyword == "USER"]
        assert users, f"stage {stage['name']} has no USER"
        assert users[-1].split(":")[0] not in ("root", "0")
        assert "devel" not in stage["base"], stage["base"]
        for keyword, rest in stage["steps"]:
            if keyword == "RUN" and "apt-get install" in rest:
                packages = set(rest.split("apt-get install", 1)[1].split("&&")[0].split())
                assert not packages & BUILD_TOOLS, (stage["name"], packages & BUILD_TOOLS)
            assert not (keyword == "COPY" and "/usr/local/bin/uv" in rest)


def test_the_cpu_target_removes_what_the_makefile_removes(dockerfile):
    makefile = (ROOT / "Makefile").read_text()
    removed = re.search(r"uninstall -y ([\w ]+)", makefile).group(1).split()
    [build] = [s for s in dockerfile["stages"] if s["name"] == "cpu-build"]
    runs = " ".join(rest for keyword, rest in build["steps"] if keyword == "RUN")
    assert re.search(r"uninstall -y " + " ".join(removed), runs)
