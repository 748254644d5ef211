"""The learner and the weight sync on one GPU, in a few minutes (benchmarks/README.md).

    python benchmarks/gpu_check.py [--wheels DIR] [--out DIR] [--quick] [--cpu]
        [--sections learner,memory,sync]

Needs torch, transformers and DeepSpeed, not Ray or vLLM; `--wheels DIR` installs the wheels
in DIR (DeepSpeed and its small dependencies) into a directory of its own when DeepSpeed does
not import. Three sections, in this order, each in a process of its own (fresh CUDA memory
statistics, and a crash or a hang is recorded instead of ending the run):

- learner: a random bf16 Qwen2-shaped policy (vocabulary 151,936, head dim 128) trains 3 steps
  with ZeRO-2, then 3 with ZeRO-3, gradient checkpointing on; every loss and gradient norm
  must be finite; the peak CUDA memory is set beside the planner's estimate;
- memory: the 1.5B recipe's model shape (random weights) and micro-batch, one forward and
  backward through the learner's `TokenLogprobs`, with and without gradient checkpointing;
  peak memory and what the forward pass keeps for backward, beside the planner's estimates.
  An out-of-memory error is a result;
- sync: learner rank 0 (ZeRO-3, on GPU 0) and a receiver process. The rendezvous must refuse
  a receiver on the learner's GPU, on both sides; the learner's CUDA parameters then travel
  over gloo, 3 versions, and must arrive bit for bit; with two GPUs also over NCCL to GPU 1
  (vLLM's PyNccl communicator: that transfer alone needs vLLM installed).
  There is no CUDA-IPC path (colocated layouts are refused).

Writes gpu_check.json and gpu_check.md to --out (default $OUT, else runs/gpu_check) after
every section; exits 1 when a check failed. `--cpu` runs every path at tiny sizes on the CPU
(tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package need not be installed on the GPU machine
    sys.path.insert(0, str(ROOT))

GiB = 2**30
HOST = "127.0.0.1"
STEPS = 3
VERSIONS = 3
BUCKET_MB = 64.0  # sync.bucket_mb's default
SYNC_TIMEOUT_S = 120.0  # sync.timeout_s's default
REFUSAL_TIMEOUT_S = 60.0
RECIPE = ROOT / "configs" / "gpu-r1-distill-1.5b.yaml"
IPC = "not implemented; colocated layouts are refused"
STAND_IN_GPU = "GPU-cpu-smoke-stand-in"  # both ends announce it in --cpu runs

# A Qwen2 policy with the recipes' vocabulary and head dim, small enough that a step of 16 x
# 1,024 tokens takes seconds: about 400M parameters, 311M of them in the embedding and head.
LEARNER_MODEL = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
)
TINY_MODEL = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)
# learner batch: groups x group_size rows of `width` tokens; memory probe rows (None: the
# recipe's micro-batch) and width (None: the recipe's max_model_len)
SIZES = {
    "full": dict(groups=4, group_size=4, width=1024, micro=4, probe_rows=None, probe_width=None),
    "quick": dict(groups=2, group_size=4, width=512, micro=4, probe_rows=1, probe_width=None),
    "cpu": dict(groups=2, group_size=4, width=64, micro=4, probe_rows=2, probe_width=64),
}
# The most each section's process may take (a learner stage, the memory probe, the sync: run
# in this order, the sync last because an NCCL teardown is the likeliest hang), within the
# overall --time-limit-s.
SECTION_LIMITS_S = {"learner": 180.0, "memory": 150.0, "sync": 300.0}
SECTION_NAMES = tuple(SECTION_LIMITS_S)


def log(start: float, message: str) -> None:
    print(f"[gpu_check {time.time() - start:6.1f}s] {message}", flush=True)


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GiB, 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def finite(*values) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


# ----------------------------------------------------------------------------- wheels


def deepspeed_import_error() -> str | None:
    """None when `import deepspeed` works in a fresh interpreter (with our PYTHONPATH), else the
    last line of its error (a subprocess: a failed import would leave half a package here)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import deepspeed"], capture_output=True, text=True
    )
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {probe.returncode}"


def wheels_to_install(wheels: Path) -> list[str]:
    """`name==version` of every project in `wheels` that is missing here or older here."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    wanted = {}
    for wheel in sorted(wheels.glob("*.whl")):
        name, wheel_version = wheel.name.split("-")[:2]
        wanted[name] = wheel_version
    out = []
    for name, wheel_version in sorted(wanted.items()):
        try:
            if Version(version(name)) >= Version(wheel_version):
                continue
        except PackageNotFoundError:
            pass
        out.append(f"{name}=={wheel_version}")
    return out


def install_wheels(wheels: Path, site: Path, start: float) -> dict:
    """Make DeepSpeed importable: when it is not, pip-install (no index, no dependencies) every
    project of `wheels` that is missing or older here into `site`, which goes first on
    sys.path and PYTHONPATH (so that the processes this script starts see it too). pip picks,
    among a project's wheels, the one built for this Python."""
    report = {"wheels": str(wheels), "site": str(site)}
    error = deepspeed_import_error()
    if error is None:
        report["installed"] = []
        report["note"] = "deepspeed already importable; nothing installed"
        return report
    report["deepspeed_import_error"] = error
    requirements = wheels_to_install(wheels)
    log(start, f"import deepspeed failed ({error}); installing {', '.join(requirements)}")
    report["installed"] = requirements
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if has_pip.returncode == 0:
        command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade"]
        command += ["--find-links", str(wheels), "--target", str(site), *requirements]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            report["install_error"] = (done.stdout + done.stderr)[-3000:]
            return report
    else:
        report["installer"] = "no pip here: the wheels were unzipped into the site directory"
        try:
            unzip_wheels(wheels, site, requirements)
        except Exception as exc:  # a bad or missing wheel: recorded, the run goes on
            report["install_error"] = f"{type(exc).__name__}: {exc}"
            return report
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p
    )
    report["deepspeed_import_error_after"] = deepspeed_import_error()
    return report


def unzip_wheels(wheels: Path, site: Path, requirements: list[str]) -> None:
    """What `pip install --target` does with these wheels, for a Python without pip: unzip,
    for each `name==version`, the wheel whose tags this interpreter supports."""
    import zipfile

    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename

    supported = set(sys_tags())
    by_project = {}
    for wheel in wheels.glob("*.whl"):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        if tags & supported:
            by_project[f"{name}=={version}"] = wheel
    for requirement in requirements:
        name, version = requirement.split("==")
        wheel = by_project.get(f"{canonicalize_name(name)}=={version}")
        if wheel is None:
            raise RuntimeError(f"no wheel of {requirement} in {wheels} fits this Python")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


# ----------------------------------------------------------------------------- machine


def machine_info(cpu: bool) -> dict:
    """The benchmarks' machine description and commit (metrics/provenance.py), plus the
    versions and GPUs this check depends on."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    from cagrpo_ray.metrics.provenance import git_commit, machine

    try:
        deepspeed = version("deepspeed")
    except PackageNotFoundError:
        deepspeed = "not installed (see --wheels)"
    info = {
        **machine(),
        "commit": git_commit(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "deepspeed": deepspeed,
        "device": "cpu" if cpu else "cuda",
    }
    if cpu or not torch.cuda.is_available():
        return info
    info["gpus"] = []
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        info["gpus"].append(
            {
                "name": p.name,
                "memory_gib": gib(p.total_memory),
                "capability": f"{p.major}.{p.minor}",
            }
        )
    get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
    info["cuda_driver_api"] = get_driver() if get_driver else None
    try:
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (AttributeError, RuntimeError) as exc:
        info["nccl"] = f"unknown ({exc})"
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True)
        info["driver"] = done.stdout.strip().splitlines()[0] if done.stdout.strip() else None
    else:
        info["driver"] = "nvidia-smi not found"
    return info


# ----------------------------------------------------------------------------- processes


def _child(conn, target, kwargs) -> None:
    try:
        for update in target(**kwargs):
            conn.send(update)
        conn.send(None)
    except BaseException:  # the parent records it and goes on with the next section
        conn.send({"error": traceback.format_exc()[-4000:]})
    conn.close()


def run_in_process(target, kwargs: dict, timeout_s: float) -> dict:
    """Run the generator function `target(**kwargs)` in a fresh (spawned) process and merge
    the dicts it yields as they come, so that a crash, a hang or the time limit keeps what
    was measured before it; {"error": ...} says what ended it early (a process still running
    after `timeout_s` is killed)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(theirs, target, kwargs))
    process.start()
    theirs.close()
    result, deadline = {}, time.time() + timeout_s
    while True:
        if not ours.poll(max(0.0, deadline - time.time())):
            result["error"] = f"unfinished after {timeout_s:.0f} s (killed)"
            process.kill()
            break
        try:
            update = ours.recv()
        except EOFError:
            process.join(10)
            result["error"] = f"the process exited with code {process.exitcode} before the end"
            break
        if update is None:
            break
        result.update(update)
        if "error" in update:
            break
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join()
    return result


def cuda_memory():
    """torch.cuda where this process measures CUDA memory, else None (CPU runs)."""
    import torch

    return torch.cuda if torch.cuda.is_available() else None


# ----------------------------------------------------------------------------- learner


def save_learner_model(model: dict, path: Path) -> tuple[str, int]:
    """A random bf16 Qwen2 policy (untied head) saved in the Hugging Face layout (the learner
    loads only the model, no tokenizer); returns its folder and parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**model, tie_word_embeddings=False, max_position_embeddings=32768)
    policy = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    policy.save_pretrained(path)
    return str(path), sum(p.numel() for p in policy.parameters())


def learner_batch(sizes: dict, vocab: int, seed: int) -> dict:
    """A learner batch (docs/architecture.md) like tests/test_learner.py's `random_batch` at
    realistic widths: prompts of 1/32 to 1/4 of the width, right-padded responses; the first
    row of every micro-batch fills the width, so each micro-batch is `width` tokens wide."""
    import torch

    from cagrpo_ray.algo import group_advantages

    g = torch.Generator().manual_seed(seed)
    groups, group_size, width = sizes["groups"], sizes["group_size"], sizes["width"]
    rows = groups * group_size
    prompt = torch.randint(width // 32 + 1, width // 4, (rows,), generator=g)
    length = torch.randint(width // 2, width + 1, (rows,), generator=g)
    length[:: sizes["micro"]] = width
    columns = torch.arange(width)
    attention = (columns < length[:, None]).long()
    response_mask = (columns >= prompt[:, None]) & attention.bool()
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    return {
        "input_ids": torch.randint(0, vocab, (rows, width), generator=g) * attention,
        "attention_mask": attention,
        "response_mask": response_mask,
        "behavior_logprobs": -torch.rand(rows, width, generator=g) * response_mask,
        "rewards": rewards,
        "advantages": group_advantages(rewards, group_size),
        "group_ids": torch.arange(groups).repeat_interleave(group_size),
    }


def build_learner(model_dir: str, stage: int, sizes: dict):
    from cagrpo_ray.algo import LossSpec
    from cagrpo_ray.learner.learner import Learner
    from cagrpo_ray.learner.settings import LearnerSettings

    settings = LearnerSettings(
        model_dir,
        zero_stage=stage,
        micro_batch_size=sizes["micro"],
        lr=1e-4,  # large enough that every version of the sync check differs in bf16
        warmup_steps=0,
        dtype="bfloat16",
        gradient_checkpointing=True,
    )
    return Learner(settings, LossSpec("cagrpo"), master_port=free_port())


def planner_learner_estimate(model_dir: str, stage: int, sizes: dict, device: str) -> dict:
    """The planner's peak for this learner (one rank, same shapes and settings), or why not."""
    try:
        from cagrpo_ray.config import load_config
        from cagrpo_ray.plan.memory import CUDA_CONTEXT_BYTES, learner_memory
        from cagrpo_ray.plan.shapes import model_shape
    except Exception as exc:  # pydantic or PyYAML missing: the measurement stands alone
        return {"unavailable": f"planner unavailable: {type(exc).__name__}: {exc}"}
    overrides = [
        f"model.path={model_dir}",
        "model.dtype=bfloat16",
        f"learner.zero_stage={stage}",
        "learner.num_learners=1",
        f"learner.micro_batch_size={sizes['micro']}",
        "learner.gradient_checkpointing=true",
        f"rollout.prompts_per_step={sizes['groups']}",
        f"rollout.group_size={sizes['group_size']}",
        f"rollout.max_tokens={sizes['width'] // 2}",
        f"rollout.max_model_len={sizes['width']}",
    ]
    try:
        estimate = learner_memory(load_config(None, overrides), model_shape(model_dir), device)
    except Exception as exc:  # recorded; the learner's own checks do not depend on it
        return {"unavailable": f"planner failed: {type(exc).__name__}: {exc}"}
    context = CUDA_CONTEXT_BYTES if device == "cuda" else 0
    return {
        "total_gib": gib(estimate.total),
        # max_memory_allocated does not see the CUDA context the estimate allows for
        "without_cuda_context_gib": gib(estimate.total - context),
        "components_gib": {c.name: gib(c.bytes) for c in estimate.components},
    }


def learner_case(model_dir: str, stage: int, sizes: dict, vocab: int, start: float):
    """Build a one-rank learner (bf16, ZeRO `stage`, checkpointing), train STEPS steps;
    yields the results so far after each stage of it."""
    cuda = cuda_memory()
    if cuda:
        cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    learner = build_learner(model_dir, stage, sizes)
    result = {"init_s": round(time.perf_counter() - began, 2), "steps": []}
    if cuda:
        result["allocated_after_init_gib"] = gib(cuda.memory_allocated())
    log(start, f"learner ZeRO-{stage}: built in {result['init_s']} s")
    yield result
    for step in range(STEPS):
        metrics = learner.train_step(learner_batch(sizes, vocab, seed=step))
        record = {
            "loss": metrics["loss/total"],
            "grad_norm": metrics["grad_norm"],
            "entropy": metrics["entropy/mean"],
            "tokens": metrics["learner/tokens"],
            "seconds": round(metrics["time/train_step_s"], 3),
        }
        if cuda:
            record["peak_so_far_gib"] = gib(cuda.max_memory_allocated())
        result["steps"].append(record)
        log(start, f"learner ZeRO-{stage} step {step + 1}: {record}")
        yield {"steps": result["steps"]}
    if cuda:
        cuda.synchronize()
        result["peak_allocated_gib"] = gib(cuda.max_memory_allocated())
        result["peak_reserved_gib"] = gib(cuda.max_memory_reserved())
    planner = planner_learner_estimate(model_dir, stage, sizes, "cuda" if cuda else "cpu")
    result["planner"] = planner
    if cuda and "without_cuda_context_gib" in planner:
        result["measured_over_planner"] = round(
            result["peak_allocated_gib"] / planner["without_cuda_context_gib"], 3
        )
    result["passed"] = all(
        finite(s["loss"], s["grad_norm"]) and s["grad_norm"] > 0 for s in result["steps"]
    )
    yield result


# ----------------------------------------------------------------------------- sync


def digest(tensor) -> list:
    """[dtype, shape, sha256 of the bytes]: equal digests mean equal tensors bit for bit."""
    import torch

    data = tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy()
    return [str(tensor.dtype), list(tensor.shape), hashlib.sha256(data).hexdigest()]


def receiver_main(conn, address: dict, versions: int, gpu: int | None, device_id: str | None):
    """A generator worker's stand-in: joins the sync group as rank 1 (on CUDA device `gpu`),
    then receives `versions` versions and sends back every tensor's digest. Messages:
    ("refused", error), ("joined", None), ("version", {...}), ("error", traceback)."""
    try:
        import torch

        from cagrpo_ray.sync import WeightReceiver, WeightSyncError

        if gpu is not None:
            torch.cuda.set_device(gpu)
        try:
            receiver = WeightReceiver(address, rank=1, device_id=device_id)
        except WeightSyncError as exc:
            conn.send(("refused", str(exc)))
            return
        conn.send(("joined", None))
        for version in range(1, versions + 1):
            digests = {}

            def load(named_tensors, digests=digests):
                for name, tensor in named_tensors:
                    digests[name] = digest(tensor)

            stats = receiver.receive(version, load)
            conn.send(("version", {"digests": digests, "seconds": stats.seconds}))
        receiver.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()[-4000:]))
    finally:
        conn.close()


def start_receiver(address: dict, versions: int, gpu: int | None, device_id: str | None):
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=receiver_main, args=(theirs, address, versions, gpu, device_id)
    )
    process.start()
    theirs.close()
    return ours, process


def receive_message(conn, timeout_s: float) -> tuple[str, object]:
    try:
        if conn.poll(timeout_s):
            return conn.recv()
    except EOFError:
        return "error", "the receiver process exited without a message"
    return "error", f"no message from the receiver within {timeout_s:.0f} s"


def stop(process) -> None:
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join()


def refusal_check(learner, cpu: bool) -> dict:
    """A receiver on the learner's GPU: both ends must fail at the rendezvous, naming the GPU.
    On CUDA the learner's sender and the receiver announce their GPU's UUID (NCCL); --cpu
    runs have no GPU, so both ends announce one stand-in id over gloo."""
    from cagrpo_ray.sync import WeightSender, WeightSyncError

    if cpu:
        sender = WeightSender(
            HOST, 0, 2, "gloo", REFUSAL_TIMEOUT_S, BUCKET_MB, device_id=STAND_IN_GPU
        )
        address, device_id, gpu = asdict(sender.address), STAND_IN_GPU, None
    else:
        address = learner.open_weight_sender(HOST, 2, "nccl", REFUSAL_TIMEOUT_S, BUCKET_MB)
        sender, device_id, gpu = learner.weight_sender, None, 0
    conn, process = start_receiver(address, 0, gpu, device_id)
    try:
        sender.wait_joined()
        learner_error = None
    except WeightSyncError as exc:
        learner_error = str(exc)
    kind, message = receive_message(conn, REFUSAL_TIMEOUT_S + 30)
    sender.close()
    stop(process)
    receiver_error = message if kind == "refused" else None
    return {
        "device_ids": "stand-in id (CPU run)" if cpu else "GPU UUIDs from torch.cuda",
        "learner_error": learner_error,
        "receiver_error": receiver_error,
        "receiver_outcome": kind if kind != "refused" else None,
        "receiver_detail": None if kind in ("refused", "joined") else message,
        "passed": all(e is not None and "same GPU" in e for e in (learner_error, receiver_error)),
    }


def transfer_check(learner, backend: str, gpu: int | None, sizes: dict, vocab: int) -> dict:
    """VERSIONS syncs from the learner to a receiver process; the learner trains a step
    before each one after the first. Every tensor must arrive bit for bit, and each version
    must differ from the one before (so that the comparison is not of stale weights). The
    caller closes the sender, after it has kept the result (an NCCL group's teardown is the
    likeliest place for a hang)."""
    address = learner.open_weight_sender(HOST, 2, backend, SYNC_TIMEOUT_S, BUCKET_MB)
    conn, process = start_receiver(address, VERSIONS, gpu, None)
    versions, previous = [], None
    try:
        for version in range(1, VERSIONS + 1):
            if version > 1:
                learner.train_step(learner_batch(sizes, vocab, seed=100 + version))
            stats = learner.send_weights(version)
            if "error" in stats:
                versions.append({"version": version, "error": stats["error"]})
                break
            sent = {name: digest(tensor) for name, tensor in learner.iter_sync_weights()}
            kind, message = receive_message(conn, SYNC_TIMEOUT_S)
            if kind == "joined":
                kind, message = receive_message(conn, SYNC_TIMEOUT_S)
            if kind != "version":
                versions.append({"version": version, "error": f"receiver: {kind}: {message}"})
                break
            got = message["digests"]
            differing = sorted(n for n in sent.keys() | got.keys() if sent.get(n) != got.get(n))
            versions.append(
                {
                    "version": version,
                    "tensors": stats["num_tensors"],
                    "bytes": stats["num_bytes"],
                    "buckets": stats["num_buckets"],
                    "sender_s": round(stats["seconds"], 3),
                    "receiver_s": round(message["seconds"], 3),
                    "differing_tensors": differing[:10],
                    "changed_since_previous": previous is None or sent != previous,
                }
            )
            previous = sent
    finally:
        stop(process)
    passed = len(versions) == VERSIONS and all(
        "error" not in v and not v["differing_tensors"] and v["changed_since_previous"]
        for v in versions
    )
    return {"backend": backend, "receiver_gpu": gpu, "versions": versions, "passed": passed}


def sync_case(model_dir: str, sizes: dict, vocab: int, gpus: int, start: float):
    """Learner rank 0 (ZeRO-3, so that every sync gathers its parameters) and receivers;
    yields each check's result as it is done."""
    yield {"ipc": IPC}
    learner = build_learner(model_dir, 3, sizes)
    log(start, "sync: refusal of a receiver on the learner's GPU")
    refusal = refusal_check(learner, cpu=cuda_memory() is None)
    yield {"refusal": refusal}
    log(start, f"sync: refusal {'passed' if refusal['passed'] else 'FAILED'}; gloo transfer")
    gloo = transfer_check(learner, "gloo", None, sizes, vocab)
    yield {"gloo": gloo}
    learner.weight_sender.close()
    if gpus < 2:
        yield {"nccl": {"skipped": "one GPU (NCCL refuses two ranks on one GPU: see refusal)"}}
        return
    log(start, f"sync: gloo {'passed' if gloo['passed'] else 'FAILED'}; NCCL to GPU 1")
    yield {"nccl": transfer_check(learner, "nccl", 1, sizes, vocab)}
    learner.weight_sender.close()


# ----------------------------------------------------------------------------- memory


def recipe_probe() -> dict:
    """The 1.5B recipe's model shape (plan/models.json) and learner micro-batch, read without
    the config package (PyYAML comes with transformers)."""
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text())
    models = json.loads((ROOT / "cagrpo_ray" / "plan" / "models.json").read_text())["models"]
    shape = models[recipe["model"]["path"]]
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    return {
        "model": recipe["model"]["path"],
        "shape": {k: shape[k] for k in (*keys, "num_key_value_heads", "vocab_size")},
        "rows": recipe["learner"]["micro_batch_size"],
        "width": recipe["rollout"]["max_model_len"],
        "temperature": recipe["rollout"]["temperature"],
        "logits_chunk_mib": recipe["learner"].get("logits_chunk_mib", 1024.0),
    }


def planner_probe_estimate(shape: dict, rows: int, width: int, chunk_mib: float) -> dict:
    """The planner's activations (kept for backward, and with one recomputed layer), logits
    work, and bf16 gradients for one forward and backward, per checkpointing setting."""
    try:
        from cagrpo_ray.plan.memory import activation_bytes, layer_activation_bytes, logits_bytes
        from cagrpo_ray.plan.shapes import shape_from_config
    except Exception as exc:
        return {"unavailable": f"planner unavailable: {type(exc).__name__}: {exc}"}
    model = shape_from_config({**shape, "model_type": "qwen2"}, "gpu_check")
    s = 2  # bfloat16
    head = model.vocab_size * model.hidden_size * s
    out = {}
    for name, checkpointing in (("checkpointing", True), ("no_checkpointing", False)):
        try:
            activations = activation_bytes(model, s, rows, width, checkpointing)
            recomputed = rows * width * layer_activation_bytes(model, s) if checkpointing else 0
            logits = logits_bytes(model, s, rows * width, chunk_mib)
        except Exception as exc:  # recorded; the probe's own checks do not depend on it
            return {"unavailable": f"planner failed: {type(exc).__name__}: {exc}"}
        kept = activations - recomputed
        out[name] = {
            "kept_for_backward_gib": gib(kept),
            "activations_gib": gib(activations),
            "logits_gib": gib(logits),
            # every parameter's bf16 gradient; the head's is already in the logits term
            "peak_above_weights_gib": gib(activations + logits + s * model.parameters() - head),
        }
    return out


def probe_pass(forward, rows: int, width: int, cuda) -> dict:
    """One forward and backward of `rows` x `width` right-padded random tokens."""
    import torch

    device = next(forward.parameters()).device
    g = torch.Generator().manual_seed(0)
    vocab = forward.policy.config.vocab_size
    lengths = width - torch.arange(rows) * (width // (4 * rows))  # row 0 fills the width
    mask = (torch.arange(width) < lengths[:, None]).long().to(device)
    ids = (torch.randint(0, vocab, (rows, width), generator=g) * mask.cpu()).to(device)
    base = 0
    if cuda:
        cuda.empty_cache()
        cuda.reset_peak_memory_stats()
        base = cuda.memory_allocated()
    began = time.perf_counter()
    try:
        logprobs, _ = forward(ids, mask)
        kept = cuda.memory_allocated() - base if cuda else None
        loss = -(logprobs * mask).sum() / mask.sum()
        loss.backward()
        if cuda:
            cuda.synchronize()
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        # cuBLAS reports its own failed allocations as a RuntimeError
        if isinstance(exc, torch.OutOfMemoryError) or "ALLOC_FAILED" in text:
            return {"oom": text}
        raise
    grads = [
        torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        for p in forward.parameters()
        if p.grad is not None
    ]
    return {
        "seconds": round(time.perf_counter() - began, 3),
        "loss": float(loss),
        "grad_norm": float(torch.stack(grads).norm()),
        "kept_for_backward_gib": gib(kept),
        "peak_above_weights_gib": gib(cuda.max_memory_allocated() - base) if cuda else None,
    }


def memory_case(
    shape: dict, rows: int, width: int, temperature: float, chunk_mib: float, start: float
):
    """Forward and backward through the learner's TokenLogprobs, with and without gradient
    checkpointing (non-reentrant, train mode, as the learner runs it); yields each case."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cagrpo_ray.learner.logprobs import TokenLogprobs

    cuda = cuda_memory()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    config = Qwen2Config(
        **shape, tie_word_embeddings=False, use_cache=False, max_position_embeddings=32768
    )
    with device:
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).to(device)
    forward = TokenLogprobs(model, temperature, chunk_mib)
    result = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "attention": model.config._attn_implementation,
        "weights_gib": gib(cuda.memory_allocated()) if cuda else None,
    }
    yield result
    for name, checkpointing in (("checkpointing", True), ("no_checkpointing", False)):
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.gradient_checkpointing_disable()
        model.train()
        result[name] = probe_pass(forward, rows, width, cuda)
        log(start, f"memory {name}: {result[name]}")
        yield {name: result[name]}
        model.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            cuda.empty_cache()
    result["planner"] = planner_probe_estimate(shape, rows, width, chunk_mib)
    if cuda and "unavailable" not in result["planner"]:
        for name in ("checkpointing", "no_checkpointing"):
            measured, planned = result[name], result["planner"][name]
            for key in ("kept_for_backward_gib", "peak_above_weights_gib"):
                if measured.get(key) and planned[key]:
                    measured[f"{key}_over_planner"] = round(measured[key] / planned[key], 3)
    checkpointed, full = result["checkpointing"], result["no_checkpointing"]
    result["passed"] = (
        "oom" not in checkpointed
        and finite(checkpointed["loss"], checkpointed["grad_norm"])
        and ("oom" in full or finite(full["loss"], full["grad_norm"]))
    )
    yield result


# ----------------------------------------------------------------------------- report


def checks_of(report: dict) -> list[dict]:
    """One row per check: name, passed (None: skipped) and the numbers that matter."""
    rows = []
    if "error" in report:
        rows.append({"check": "set-up", "passed": False, "detail": [report["error"]]})
    wheels = report.get("wheels", {})
    if wheels.get("installed"):
        error = wheels.get("install_error", "").strip().splitlines()[-1:]
        failure = (error or [None])[0] or wheels.get("deepspeed_import_error_after")
        installed = f"installed {', '.join(wheels['installed'])} into {wheels['site']}"
        rows.append({"check": "wheels", "passed": not failure, "detail": [installed, failure]})
    learner = report.get("learner", {})
    for stage in ("zero2", "zero3"):
        case = learner.get(stage)
        if case is None:
            continue
        detail = [
            f"step {i + 1}: loss {s['loss']:.4g}, grad norm {s['grad_norm']:.4g}, {s['seconds']} s"
            for i, s in enumerate(case.get("steps", []))
        ]
        planner = case.get("planner", {})
        if case.get("peak_allocated_gib") is not None:
            planned = planner.get("without_cuda_context_gib", "n/a")
            detail.append(f"peak {case['peak_allocated_gib']} GiB (planner {planned} GiB)")
        detail += [planner.get("unavailable"), *_last_line(case)]
        rows.append(
            {"check": f"learner {stage}", "passed": bool(case.get("passed")), "detail": detail}
        )
    sync = report.get("sync", {})
    if "error" in sync:
        rows.append({"check": "sync", "passed": False, "detail": _last_line(sync)})
    if "refusal" in sync:
        r = sync["refusal"]
        text = r["learner_error"] or r["receiver_detail"] or r["receiver_outcome"] or ""
        rows.append({"check": "sync refusal on one GPU", "passed": r["passed"], "detail": [text]})
    for backend in ("gloo", "nccl"):
        case = sync.get(backend)
        if case is None:
            continue
        if "skipped" in case:
            rows.append({"check": f"sync {backend}", "passed": None, "detail": [case["skipped"]]})
            continue
        detail = [
            v.get("error")
            or f"v{v['version']}: {v['tensors']} tensors, {v['bytes'] / 2**20:.1f} MiB in "
            f"{v['sender_s']} s, {len(v['differing_tensors'])} differing"
            for v in case.get("versions", [])
        ]
        rows.append({"check": f"sync {backend}", "passed": case["passed"], "detail": detail})
    if sync:
        rows.append({"check": "sync CUDA IPC", "passed": None, "detail": [sync.get("ipc", IPC)]})
    memory = report.get("memory")
    if memory:
        detail = _last_line(memory)
        for name in ("checkpointing", "no_checkpointing"):
            case = memory.get(name)
            if case is None:
                continue
            if "oom" in case:
                detail.append(f"{name}: out of memory")
            elif case["peak_above_weights_gib"] is None:
                detail.append(f"{name}: loss {case['loss']:.4g}, {case['seconds']} s")
            else:
                planned = memory.get("planner", {}).get(name, {})
                detail.append(
                    f"{name}: peak {case['peak_above_weights_gib']} GiB above the weights "
                    f"(planner {planned.get('peak_above_weights_gib', 'n/a')}), kept for "
                    f"backward {case['kept_for_backward_gib']} GiB (planner "
                    f"{planned.get('kept_for_backward_gib', 'n/a')}), {case['seconds']} s"
                )
        rows.append(
            {"check": "memory probe", "passed": bool(memory.get("passed")), "detail": detail}
        )
    return rows


def _last_line(case: dict) -> list[str]:
    """The last line of the case's error (its traceback's exception), or nothing."""
    return case.get("error", "").strip().splitlines()[-1:]


def write_report(report: dict, out: Path) -> None:
    checks = checks_of(report)
    passed = all(c["passed"] is not False for c in checks)
    report.update(passed=passed, checks=checks)
    ordered = {"passed": passed, "checks": checks} | report  # the verdict first
    (out / "gpu_check.json").write_text(json.dumps(ordered, indent=2) + "\n")
    m = report.get("machine", {})
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in m.get("gpus", [])) or "none"
    lines = [
        f"# gpu_check ({report['mode']})",
        "",
        f"torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), transformers "
        f"{m.get('transformers')}, deepspeed {m.get('deepspeed')}, Python {m.get('python')}; "
        f"GPUs: {gpus}; driver {m.get('driver', 'n/a')}; commit {m.get('commit')}; "
        f"{report.get('elapsed_s')} s",
        "",
        "| check | result | numbers |",
        "|---|---|---|",
    ]
    for c in report["checks"]:
        result = {True: "pass", False: "FAIL", None: "skipped"}[c["passed"]]
        numbers = "; ".join(str(d) for d in c["detail"] if d)
        numbers = numbers.replace("|", "/").replace("\n", " ")
        lines.append(f"| {c['check']} | {result} | {numbers} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check")
    parser.add_argument("--wheels", help="wheels of DeepSpeed and its dependencies to install")
    parser.add_argument("--site", default=str(Path(tempfile.gettempdir()) / "gpu-check-site"))
    parser.add_argument(
        "--quick", action="store_true", help="8 x 512-token learner batches, 1-row memory probe"
    )
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (smoke test)")
    parser.add_argument("--sections", default=",".join(SECTION_NAMES))
    parser.add_argument(
        "--time-limit-s", type=float, default=450.0, help="skip what would start after it"
    )
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTION_NAMES)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTION_NAMES}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    if args.cpu:  # before torch is imported, here and in every process started from here
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["DS_ACCELERATOR"] = "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = "cpu" if args.cpu else "quick" if args.quick else "full"
    sizes = SIZES[mode]
    report = {"mode": mode, "sizes": sizes}
    if args.wheels:
        report["wheels"] = install_wheels(Path(args.wheels), Path(args.site), start)
    report["machine"] = machine_info(args.cpu)
    log(start, f"machine: {report['machine']}")
    gpus = len(report["machine"].get("gpus", []))
    if not args.cpu and gpus == 0:
        report["error"] = "no CUDA device visible (use --cpu for the CPU smoke run)"
        write_report(report, out)
        return 1
    sections = args.sections.split(",")
    model = TINY_MODEL if args.cpu else LEARNER_MODEL
    vocab = model["vocab_size"]

    def run(section: str, name: str, target, **kwargs) -> dict:
        left = args.time_limit_s - (time.time() - start)
        if left < 20:
            return {"error": f"skipped: the {args.time_limit_s:g} s time limit was reached"}
        log(start, f"{name}: starting")
        limit = min(SECTION_LIMITS_S[section], left)
        result = run_in_process(target, {**kwargs, "start": start}, limit)
        log(start, f"{name}: {'error' if 'error' in result else 'done'}")
        report["elapsed_s"] = round(time.time() - start, 1)
        return result

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if "learner" in sections or "sync" in sections:
            model_dir, parameters = save_learner_model(model, Path(tmp) / "policy")
            report["learner_model"] = {**model, "parameters": parameters}
            log(start, f"learner model saved: {report['learner_model']}")
        if "learner" in sections:
            report["learner"] = {}
            for stage in (2, 3):
                report["learner"][f"zero{stage}"] = run(
                    "learner",
                    f"learner ZeRO-{stage}",
                    learner_case,
                    model_dir=model_dir,
                    stage=stage,
                    sizes=sizes,
                    vocab=vocab,
                )
                write_report(report, out)
        if "memory" in sections:
            probe = recipe_probe()
            if args.cpu:
                probe["model"] = f"a tiny stand-in for {probe['model']} (--cpu)"
                probe["shape"] = {k: v for k, v in TINY_MODEL.items() if k != "head_dim"}
            probe["rows"] = sizes["probe_rows"] or probe["rows"]
            probe["width"] = sizes["probe_width"] or probe["width"]
            report["memory"] = {"probe": probe}
            report["memory"] |= run(
                "memory",
                "memory",
                memory_case,
                shape=probe["shape"],
                rows=probe["rows"],
                width=probe["width"],
                temperature=probe["temperature"],
                chunk_mib=probe["logits_chunk_mib"],
            )
            write_report(report, out)
        if "sync" in sections:
            report["sync"] = run(
                "sync", "sync", sync_case, model_dir=model_dir, sizes=sizes, vocab=vocab, gpus=gpus
            )
    report["elapsed_s"] = round(time.time() - start, 1)
    write_report(report, out)
    log(start, f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    print((out / "gpu_check.md").read_text(), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
