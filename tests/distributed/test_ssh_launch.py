"""`shardkit launch --hostfile` against a real OpenSSH server on loopback: two "hosts", 127.0.0.1 and 127.0.0.2.

The test starts its own ``sshd`` (its own config, host key and authorized key in a temporary directory, on a free
port, as the current user) and points the launcher's ``ssh`` at a temporary client config, so nothing in ~/.ssh or
the system's sshd is used. It checks that a 2-host x 1-rank DDP job trains with the losses of the same job on one
process, that one host failing ends the other host's rank (stopped and named), and that Ctrl-C ends every host's
processes: nothing started for the job is left running.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from shardkit.distributed import find_free_port

pytestmark = pytest.mark.distributed

SSHD = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)),
                                    None)
HOSTS = ("127.0.0.1", "127.0.0.2")

TRAIN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    from shardkit import DDP, Runner

    kind, out = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    runner = Runner(strategy=DDP())
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (out / f"rank-{runner.rank}.json").write_text(json.dumps({"pid": os.getpid(),
                                                              "ssh": os.environ.get("SSH_CONNECTION", ""),
                                                              "omp": os.environ.get("OMP_NUM_THREADS")}))
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    shard = slice(runner.rank * 8, runner.rank * 8 + 8)  # each rank its half of the batch
    losses = []
    for step in range(5):
        if kind == "die" and step == 2:
            if runner.rank == 1:
                raise RuntimeError("rank 1 gives up at step 2")
            break  # rank 0 is outside any collective: only the launcher can end it
        loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
        runner.backward(loss)
        runner.step()
        losses.append(runner.strategy.all_reduce(loss.detach().clone(), "mean").item())
    if runner.rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
    (out / f"waiting-{runner.rank}").write_text("")
    while kind != "ok":  # stays until stopped
        time.sleep(1)
    runner.teardown()
""")


def _wait_for_port(host: str, port: int, sshd: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if sshd.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sshd did not listen on {host}:{port}:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def ssh_args(tmp_path_factory):
    """``--ssh_args`` that reach a private sshd on both loopback hosts with a key of its own."""
    if SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH (sshd, ssh, ssh-keygen) is not installed; scripts/install_system_deps.sh installs it "
                    "(apt-get install openssh-server openssh-client)")
    if not sys.platform.startswith("linux"):
        pytest.skip("the second loopback host 127.0.0.2 needs Linux's 127.0.0.0/8 loopback")
    folder = tmp_path_factory.mktemp("sshd")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory, as root
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    shutil.copy(folder / "client_key.pub", folder / "authorized_keys")
    port = find_free_port()
    (folder / "sshd_config").write_text(textwrap.dedent(f"""\
        HostKey {folder}/host_key
        PidFile {folder}/sshd.pid
        AuthorizedKeysFile {folder}/authorized_keys
        ListenAddress {HOSTS[0]}
        ListenAddress {HOSTS[1]}
        PermitRootLogin yes
        StrictModes no
        UsePAM no
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PubkeyAuthentication yes
        """))
    host_key = " ".join((folder / "host_key.pub").read_text().split()[:2])
    (folder / "known_hosts").write_text("".join(f"[{host}]:{port} {host_key}\n" for host in HOSTS))
    (folder / "ssh_config").write_text(textwrap.dedent(f"""\
        Host *
          Port {port}
          User {getpass.getuser()}
          IdentityFile {folder}/client_key
          IdentitiesOnly yes
          UserKnownHostsFile {folder}/known_hosts
          GlobalKnownHostsFile /dev/null
          StrictHostKeyChecking yes
        """))
    log = folder / "sshd.log"
    with open(log, "w") as sink:
        sshd = subprocess.Popen([SSHD, "-f", str(folder / "sshd_config"), "-D", "-e", "-p", str(port)],
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        for host in HOSTS:
            _wait_for_port(host, port, sshd, log)
        yield f"-F {folder / 'ssh_config'}"
    finally:
        sshd.terminate()
        sshd.wait(timeout=30)


def _sigint_as_a_terminal_gives_it() -> None:
    # A suite started in the background (`pytest ... &`) ignores SIGINT, and a child inherits that: the launcher
    # rightly leaves an ignored SIGINT ignored, so the Ctrl-C this test sends would never arrive.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _launch(tmp_path: Path, ssh_args: str, kind: str) -> tuple[subprocess.Popen, Path]:
    job = tmp_path / "job"
    (job / "out").mkdir(parents=True)
    (job / "train.py").write_text(TRAIN)
    (job / "hosts").write_text(f"# the two loopback hosts\n{HOSTS[0]} slots=1\n\n{HOSTS[1]} slots=1\n")
    (job / ".deepspeed_env").write_text("OMP_NUM_THREADS=1\n")  # forwarded to every host, as DeepSpeed's
    env = {**os.environ, "SHARDKIT_COLLECTIVE_TIMEOUT": "60"}
    env.pop("OMP_NUM_THREADS", None)
    log = open(tmp_path / "launch.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "shardkit.cli", "launch", "--hostfile", "hosts", "--ssh_args",
                                ssh_args, "--main-process-port", str(find_free_port()), "--stop-grace", "5",
                                "train.py", kind, "out"], cwd=job, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, preexec_fn=_sigint_as_a_terminal_gives_it)
    process.log = log  # type: ignore[attr-defined]
    return process, job


def _wait_for(paths: list[Path], process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not all(path.exists() for path in paths):
        if process.poll() is not None or time.monotonic() > deadline:
            _end(process)
            pytest.fail(f"the job never reached {[p.name for p in paths]}:\n{_output(process)[-4000:]}")
        time.sleep(0.5)


def _end(process: subprocess.Popen, seconds: float = 120) -> str:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"the launcher did not end:\n{_output(process)[-4000:]}")
    return _output(process)


def _output(process: subprocess.Popen) -> str:
    process.log.seek(0)
    return process.log.read()


def _left_running(job: Path) -> list[str]:
    """Every live process started for the job (launcher, agents, torchrun, ranks): it runs train.py in the job's
    directory."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or b"train.py" not in (entry / "cmdline").read_bytes():
                continue
            alive = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if alive and (entry / "cwd").resolve() == job.resolve():
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def _still_running_after(job: Path, seconds: float = 30.0) -> list[str]:
    """The job's processes still alive ``seconds`` after the launcher returned (each host's agent stops its ranks
    once its ssh session ends, a moment after the launcher's own exit on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while (left := _left_running(job)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _reference_losses() -> list[float]:
    """The same model and data on one process, the whole batch per step: what DDP's mean gradient gives."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_two_hosts_train_together_and_ctrl_c_ends_every_hosts_processes(tmp_path, ssh_args):
    launcher, job = _launch(tmp_path, ssh_args, "sleep")
    _wait_for([job / "out" / "losses.json", job / "out" / "waiting-0", job / "out" / "waiting-1"], launcher)
    ranks = [json.loads((job / "out" / f"rank-{r}.json").read_text()) for r in range(2)]
    # each rank ran through its own host's ssh session, with the forwarded .deepspeed_env variable
    assert [rank["ssh"].split()[2] for rank in ranks] == list(HOSTS)
    assert [rank["omp"] for rank in ranks] == ["1", "1"]
    losses = json.loads((job / "out" / "losses.json").read_text())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference_losses()), rtol=1e-5, atol=1e-6)
    assert _left_running(job), "the ranks should be running until Ctrl-C"

    os.kill(launcher.pid, signal.SIGINT)
    output = _end(launcher)
    assert launcher.returncode != 0
    assert "got SIGINT; stopping every host" in output, output[-3000:]
    assert _still_running_after(job) == [], output[-3000:]


def test_a_failing_host_ends_the_other_hosts_rank_and_is_named(tmp_path, ssh_args):
    launcher, job = _launch(tmp_path, ssh_args, "die")
    output = _end(launcher, seconds=300)
    assert launcher.returncode == 1, output[-4000:]
    assert any(line.startswith(f"{HOSTS[1]}: ") and "RuntimeError: rank 1 gives up at step 2" in line
               for line in output.splitlines()), output[-4000:]  # the failed rank's error, under its host's name
    assert f"host {HOSTS[1]} (machine 1) failed (exit code 1); stopping the other hosts" in output, output[-4000:]
    assert f"host {HOSTS[1]} (machine 1): exit code 1 (failed first)" in output, output[-4000:]
    assert f"host {HOSTS[0]} (machine 0): ended by the stop (stopped by the launcher)" in output, output[-4000:]
    assert (job / "out" / "waiting-0").exists()  # rank 0 was outside any collective, ended only by the stop
    pid = json.loads((job / "out" / "rank-0.json").read_text())["pid"]
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] \
        == "Z"
    assert _still_running_after(job) == [], output[-3000:]
