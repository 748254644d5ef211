"""The Dockerfile, read without a Docker engine (none runs here): what it copies exists and is
not excluded by .dockerignore, the extras it installs are defined, the stages it refers to
exist, the base images are pinned, each final stage runs as a non-root user without a
CUDA toolkit or general build tools, the GPU stages match the CUDA of the torch that the
pinned vLLM requires, and the GPU build installs FlashInfer's precompiled kernels. Whether the
images build and run is not checked here."""

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parent.parent
FINAL_STAGES = {"gpu", "cpu"}
LOCK = "deploy/requirements-gpu.txt"
BUILD_TOOLS = {"build-essential", "cmake", "git", "ninja-build", "make", "cuda-toolkit"}

# Facts about the GPU stack, read once from the wheels (the tests cannot download them):
# `pip download --no-deps vllm==0.33.0 torch==2.14.0` (manylinux_2_28_x86_64, cp311), then
# their .dist-info/METADATA and torch/version.py. vllm 0.33.0 has `Requires-Dist:
# torch==2.14.0`; torch 2.14.0 has `cuda = '13.0'` (version 2.14.0+cu130) and requires
# cuda-toolkit==13.0.3 and nvidia-nccl-cu13==2.30.7; both wheels say `Metadata-Version: 2.4`.
# The -gencode flags embedded in its libtorch_cuda.so name sm_75 80 86 90 100 120.
# Re-read them when the pin changes: test_the_gpu_pin_is_the_one_the_facts_were_read_from.
GPU_PIN = "vllm==0.33.0"
TORCH_CUDA = (13, 0)
TORCH_CUDA_ARCHS = {"7.5", "8.0", "8.6", "9.0", "10.0", "12.0"}
WHEEL_METADATA_VERSION = (2, 4)
# uv parses a wheel's METADATA whatever its 2.x Metadata-Version, and since 0.1.17 ("Add
# support for Metadata 2.2", astral-sh/uv#2293) reads an sdist's PKG-INFO for 2.2 <= version
# < 3.0 (read in uv's source at tags 0.1.17, 0.2.0, 0.5.0, 0.8.4 and on main after 0.12.5).
FIRST_UV_READING_METADATA_2_4 = (0, 1, 17)
# The driver floor of CUDA 13.x: ">= 580" in NVIDIA's CUDA minor-version compatibility table.
DRIVER_FLOOR = 580
# FlashInfer's kernels, read in the vllm 0.33.0 and flashinfer-python 0.7.2.post1 wheels (the
# latter is vllm's `Requires-Dist: flashinfer-python==0.7.2.post1`): `vllm download-kernels`
# (vllm/entrypoints/cli/download_kernels.py) runs `python -m flashinfer download-kernels`, which
# installs flashinfer-cubin and flashinfer-jit-cache, when torch's CUDA is at least 12.9
# (vllm/utils/flashinfer.py, has_flashinfer_jit_cache_wheels), else flashinfer-cubin only.
# FlashInfer publishes jit-cache wheels for CUDA 12.9, 13.0 and 13.4 (flashinfer/__main__.py,
# _SUPPORTED_JIT_CACHE_CUDA_VERSIONS) and takes the newest one not above torch's, of its major.
FIRST_CUDA_WITH_JIT_CACHE_WHEELS = (12, 9)
JIT_CACHE_CUDAS = {(12, 9), (13, 0), (13, 4)}


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
    """Whether .dockerignore excludes `path` or a folder above it (`**/` matches any depth; the
    last matching pattern decides, and one starting with `!` includes again)."""
    parts = Path(path).parts
    prefixes = [parts[: i + 1] for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        include = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        anywhere = pattern.startswith("**/")
        pattern = pattern.removeprefix("**/")
        for prefix in prefixes:
            tails = [prefix[j:] for j in range(len(prefix))] if anywhere else [prefix]
            if any(fnmatch.fnmatchcase("/".join(tail), pattern) for tail in tails):
                excluded = not include
                break
    return excluded


def test_dockerignored_reads_negations_last_match_first():
    patterns = ["deploy/*", "!deploy/keep.py", "**/__pycache__"]
    assert dockerignored("deploy/other.py", patterns)
    assert not dockerignored("deploy/keep.py", patterns)
    assert dockerignored("deploy/__pycache__/x.pyc", patterns)
    assert not dockerignored("configs/a.yaml", patterns)


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
    assert installed == {"cpu": "cpu-build", "data": "cpu-build", "track": "cpu-build"}
    assert set(installed) <= defined
    # The gpu extra (with data and track) comes from its lock file, made from pyproject.toml.
    assert "--extra gpu --extra data --extra track" in (ROOT / LOCK).read_text().splitlines()[1]


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
        # Numeric, so that Kubernetes' runAsNonRoot can check it without /etc/passwd.
        assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users[-1]
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


# ------------------------------------------------------------------------- the GPU stack


def stage(dockerfile: dict, name: str) -> dict:
    [found] = [s for s in dockerfile["stages"] if s["name"] == name]
    return found


def env(stage: dict) -> dict[str, str]:
    """The stage's ENV values (KEY=VALUE form), later ones winning."""
    values = {}
    for keyword, rest in stage["steps"]:
        if keyword == "ENV":
            values.update(word.split("=", 1) for word in shlex.split(rest))
    return values


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_gpu_pin_is_the_one_the_facts_were_read_from():
    gpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["gpu"]
    assert GPU_PIN in gpu_extra, (
        f"the gpu extra is {gpu_extra}, the GPU facts above were read for {GPU_PIN}: re-read "
        "the torch pin, its CUDA and the metadata version from the new wheels"
    )


def test_gpu_images_use_the_cuda_of_the_torch_that_vllm_pins(dockerfile):
    versions = {}
    for name, flavors in (("gpu-build", {"devel"}), ("gpu", {"base", "runtime"})):
        image = expand(stage(dockerfile, name)["base"], dockerfile["args"])
        match = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-(\w+)-ubuntu\d+\.\d+", image)
        assert match, f"stage {name}: {image} is not an nvidia/cuda image"
        assert match.group(2) in flavors, f"stage {name}: {image} should be {flavors}"
        versions[name] = version_tuple(match.group(1))
        assert versions[name][:2] == TORCH_CUDA, f"{image}: torch is built for CUDA {TORCH_CUDA}"
    # nvcc of the build stage and the runtime of the final stage are the same release.
    assert versions["gpu-build"] == versions["gpu"]
    cuda = ".".join(map(str, TORCH_CUDA))
    assert env(stage(dockerfile, "gpu"))["NVIDIA_REQUIRE_CUDA"] == f"cuda>={cuda}"


def test_deepspeed_ops_target_archs_that_torch_has_kernels_for_with_bf16(dockerfile):
    archs = env(stage(dockerfile, "gpu-build"))["TORCH_CUDA_ARCH_LIST"].split()
    assert archs and set(archs) <= TORCH_CUDA_ARCHS, archs
    # DeepSpeed builds an op without bf16 when any target is 7.x; CUDA 13 dropped below 7.5.
    assert all(version_tuple(arch)[0] >= 8 for arch in archs), archs
    assert {"8.0", "9.0"} <= set(archs)


def test_the_gpu_build_installs_flashinfers_precompiled_kernels_into_the_copied_venv(dockerfile):
    """The final stage has no nvcc: without the kernel wheels vLLM would switch FlashInfer off,
    and a pod would otherwise compile kernels and fetch cubins at start (docs/gpu.md)."""
    assert TORCH_CUDA >= FIRST_CUDA_WITH_JIT_CACHE_WHEELS, "only flashinfer-cubin would install"
    matching = [cuda for cuda in JIT_CACHE_CUDAS if cuda[0] == TORCH_CUDA[0] and cuda <= TORCH_CUDA]
    assert matching, f"FlashInfer has no flashinfer-jit-cache wheel for CUDA {TORCH_CUDA}"
    assert max(matching) == TORCH_CUDA, "the Dockerfile's comment names the +cu130 wheel"
    runs = [rest for keyword, rest in stage(dockerfile, "gpu-build")["steps"] if keyword == "RUN"]
    [gpu_install] = [i for i, rest in enumerate(runs) if "requirements-gpu.txt" in rest]
    kernels = [i for i, rest in enumerate(runs) if re.search(r"\bvllm download-kernels\b", rest)]
    assert kernels, "the gpu-build stage does not run `vllm download-kernels`"
    # After vLLM (and FlashInfer) are installed, and a failed download fails the build.
    assert kernels[0] > gpu_install
    assert not re.search(r"\|\||--dry-run", runs[kernels[0]]), runs[kernels[0]]
    copies = [
        copy_parts(rest) for keyword, rest in stage(dockerfile, "gpu")["steps"] if keyword == "COPY"
    ]
    assert ({"from": "gpu-build"}, ["/opt/venv"], "/opt/venv") in copies


def test_the_pinned_uv_reads_the_wheels_metadata_version(dockerfile):
    assert (2, 2) <= WHEEL_METADATA_VERSION < (3, 0)
    uv = version_tuple(dockerfile["args"]["UV_VERSION"])
    assert uv >= FIRST_UV_READING_METADATA_2_4, uv
    assert stage(dockerfile, "uv")["base"] == "ghcr.io/astral-sh/uv:${UV_VERSION}"


def test_the_driver_floor_is_documented_in_the_dockerfile_header_and_the_k8s_readme():
    header = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            break
        header.append(line.lstrip("#"))
    floor = f"driver >= {DRIVER_FLOOR}"
    assert floor in " ".join(" ".join(header).split()), "the Dockerfile header"
    readme = " ".join((ROOT / "k8s" / "README.md").read_text().split())
    assert floor in readme, "k8s/README.md"


def test_the_gpu_build_installs_the_locked_gpu_extra_with_hashes(dockerfile):
    """Every package of the gpu extra pinned with hashes, the lock's vllm the extra's pin."""
    runs = [rest for keyword, rest in stage(dockerfile, "gpu-build")["steps"] if keyword == "RUN"]
    [install] = [rest for rest in runs if "requirements-gpu.txt" in rest]
    assert "--require-hashes" in install and "--no-deps" in install
    assert "--no-deps --no-build-isolation ." in install
    copies = [copy_parts(r) for k, r in stage(dockerfile, "gpu-build")["steps"] if k == "COPY"]
    assert ({}, [LOCK], "./") in copies
    requirements = re.findall(
        r"^([A-Za-z0-9_.\-\[\]]+)==(\S+) \\$", (ROOT / LOCK).read_text(), re.M
    )
    pinned = {name.lower(): version for name, version in requirements}
    assert len(pinned) > 200
    assert GPU_PIN == f"vllm=={pinned['vllm']}"
    text = (ROOT / LOCK).read_text()
    blocks = re.split(r"^(?=\S)", text, flags=re.M)
    for block in blocks:
        if "==" in block.split("\n")[0]:
            assert "--hash=sha256:" in block, block.split("\n")[0]


def test_the_gpu_image_has_the_verbs_libraries_nccl_opens_and_the_prestop_script(dockerfile):
    runs = " ".join(r for k, r in stage(dockerfile, "gpu")["steps"] if k == "RUN")
    assert {"libibverbs1", "ibverbs-providers", "librdmacm1"} <= set(runs.split())
    for name in FINAL_STAGES:
        copies = [copy_parts(r) for k, r in stage(dockerfile, name)["steps"] if k == "COPY"]
        assert ({}, ["deploy/stop_ray_jobs.py"], "/app/deploy/") in copies, name
