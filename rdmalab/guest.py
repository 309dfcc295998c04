"""One boot of the lab: qemu runs the guest, the guest runs one command, qemu exits.

Lifecycle of a :class:`Guest`:

1. ``start()``: write ``command.sh`` into the outbox (a host directory the guest mounts
   read-write at ``/tmp/rdmalab``), start ``qemu-system-x86_64`` (TCG by default, no NIC, the
   host's ``/`` shared read-only over virtio-9p) and the reader thread ``rdmalab-console``,
   which reads qemu's stdout (the guest's ttyS0) line by line until EOF.
2. ``wait(timeout_s)``: until the guest's init says ``ready`` (``boot_timeout_s``), then until
   qemu exits (``timeout_s`` from the start). Either deadline passed: qemu is killed
   (``LabBootError`` / ``LabTimeout``, with the output so far). Returns a :class:`LabResult`.
3. ``close()``: kill qemu if it still runs, join the reader thread, remove the outbox if the
   guest made it. Idempotent; ``with Guest(...) as g`` calls it.

qemu also gets SIGKILL if the process that started it dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rdmalab.assets import Assets
from rdmalab.config import LabConfig
from rdmalab.errors import LabBootError, LabTimeout

CONTROL = "@@rdmalab "
GUEST_OUTBOX = "/tmp/rdmalab"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The exit status init reports when it failed before the command ran.
INIT_FAILED = 125


@dataclass(frozen=True, slots=True)
class LabResult:
    """How one command ended in the guest.

    ``returncode`` is the command's exit status; ``output`` its stdout and stderr (control lines
    removed); ``boot_s`` seconds from qemu's start to the guest's ``ready``; ``wall_s`` seconds
    from qemu's start to its exit.
    """

    returncode: int
    output: str
    boot_s: float
    wall_s: float


def qemu_argv(config: LabConfig, assets: Assets, outbox: Path) -> list[str]:
    """The qemu command line (see the module docstring for what each part is for)."""
    accel = ["-accel", "kvm", "-cpu", "host"] if config.accel == "kvm" else ["-accel", "tcg,thread=multi",
                                                                            "-cpu", config.cpu]
    return ["qemu-system-x86_64", "-nodefaults", "-no-user-config", "-display", "none", *accel,
            "-m", str(config.memory_mib), "-smp", str(config.cpus),
            "-kernel", str(assets.kernel), "-initrd", str(assets.initramfs),
            "-append", "console=ttyS0 loglevel=3 panic=-1",
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={outbox},mount_tag=outbox,security_model=none",
            # the working directory again, mounted at its own path after the guest's tmpfs mounts:
            # a checkout under /tmp would otherwise be hidden by the guest's empty /tmp
            "-virtfs", f"local,path={config.workdir},mount_tag=workdir,security_model=none,readonly=on,"
                       "multidevs=remap",
            "-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console",
            "-nic", "none", "-no-reboot"]


def command_script(argv: Sequence[str], workdir: Path, env: Mapping[str, str]) -> str:
    """The ``sh`` script the guest runs: the environment, ``cd workdir``, ``exec argv``."""
    base = {"PATH": GUEST_PATH, "HOME": "/tmp/home", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PDSERVE_LAB": "1",
            "RDMALAB_OUTBOX": GUEST_OUTBOX}
    lines = [f"export {k}={shlex.quote(v)}" for k, v in {**base, **env}.items()]
    lines += [f"cd {shlex.quote(str(workdir))} || exit 126", f"exec {shlex.join(argv)}"]
    return "\n".join(lines) + "\n"


def _precompile(workdir: Path) -> None:
    """Byte-compile the working directory's Python files (hidden directories such as ``.venv``
    excluded) on the host: the guest sees the checkout read-only and compiles each module again in
    every process otherwise, under its emulated CPU (a fresh clone has no ``__pycache__``)."""
    import compileall
    import re

    compileall.compile_dir(str(workdir), quiet=1, rx=re.compile(r"/\."))


def _die_with_parent() -> None:   # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


class Guest:
    """A guest running ``argv`` (see the module docstring for the lifecycle).

    Args:
        config: the lab settings; assets: from :func:`rdmalab.assets.prepare`.
        argv: the command, run in ``config.workdir`` inside the guest.
        env: extra environment for the command.
        outbox: host directory shared read-write as ``/tmp/rdmalab`` (``$RDMALAB_OUTBOX``);
            None: a temporary one, removed by ``close()``.
        echo: called with each output line as it arrives (e.g. to print it live).
    """

    def __init__(self, config: LabConfig, assets: Assets, argv: Sequence[str], *,
                 env: Mapping[str, str] | None = None, outbox: Path | None = None,
                 echo: Callable[[str], None] | None = None) -> None:
        self.config, self.assets, self.argv = config, assets, list(argv)
        self.env = dict(env or {})
        self._own_outbox = outbox is None
        self.outbox = Path(tempfile.mkdtemp(prefix="rdmalab-")) if outbox is None else outbox
        self._echo = echo
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._settled = threading.Event()   # ready, or the console closed first
        self._boot_s: float | None = None
        self._init_error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._t0 = 0.0
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Guest":
        _precompile(self.config.workdir)
        self.outbox.mkdir(parents=True, exist_ok=True)
        (self.outbox / "rc").unlink(missing_ok=True)
        (self.outbox / "command.sh").write_text(command_script(self.argv, self.config.workdir, self.env))
        (self.outbox / "workdir").write_text(f"{self.config.workdir}\n")   # where init mounts it
        self._t0 = time.monotonic()
        self._proc = subprocess.Popen(qemu_argv(self.config, self.assets, self.outbox), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._read, name="rdmalab-console", daemon=True)
        self._reader.start()
        return self

    def wait(self, timeout_s: float) -> LabResult:
        """Block until the command ends; see the module docstring for the deadlines.

        Raises ``LabBootError`` (guest did not come up, or its init failed), ``LabTimeout``.
        """
        assert self._proc is not None, "start() first"
        boot_deadline = min(self.config.boot_timeout_s, timeout_s)
        self._settled.wait(boot_deadline)
        if not self._ready.is_set():
            self._kill()
            raise LabBootError(f"the guest was not ready within {boot_deadline:g}s "
                               f"({self._init_error or 'no error reported'})", self.output())
        try:
            self._proc.wait(max(0.0, self._t0 + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill()
            raise LabTimeout(f"the command did not finish within {timeout_s:g}s; guest killed",
                             self.output()) from None
        wall_s = time.monotonic() - self._t0
        self._reader.join()
        rc_file = self.outbox / "rc"
        if not rc_file.exists():
            raise LabBootError(f"the guest stopped without an exit status (qemu exit {self._proc.returncode})",
                               self.output())
        returncode = int(rc_file.read_text().strip())
        return LabResult(returncode, self.output(), self._boot_s or 0.0, wall_s)

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the guest's init reports ready (True), or its console closes or
        ``timeout_s`` passes first (False)."""
        self._settled.wait(timeout_s)
        return self._ready.is_set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kill()
        if self._reader is not None:
            self._reader.join()
        if self._own_outbox:
            shutil.rmtree(self.outbox, ignore_errors=True)

    def __enter__(self) -> "Guest":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- console --------------------------------------------------------------------------------
    def output(self) -> str:
        """The command's output so far (and any kernel message printed in between)."""
        with self._lock:
            return "".join(self._lines)

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        finished = False   # after "exit=" only the kernel's power-down message follows
        for raw in self._proc.stdout:
            line = raw.decode("utf-8", errors="replace").replace("\r", "")
            if line.startswith(CONTROL):
                finished = finished or line.startswith(CONTROL + "exit=")
                self._control(line[len(CONTROL):].strip())
                continue
            if finished:
                continue
            with self._lock:
                self._lines.append(line)
            if self._echo is not None:
                self._echo(line)
        self._settled.set()

    def _control(self, message: str) -> None:
        if message.startswith("ready"):
            self._boot_s = time.monotonic() - self._t0
            self._ready.set()
            self._settled.set()
        elif message.startswith("error"):
            self._init_error = message
            with self._lock:
                self._lines.append(f"rdmalab init: {message}\n")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def run(config: LabConfig, assets: Assets, argv: Sequence[str], timeout_s: float, **kwargs) -> LabResult:
    """Boot, run ``argv``, return its result; the guest is always gone afterwards.
    Keyword arguments go to :class:`Guest`."""
    with Guest(config, assets, argv, **kwargs) as guest:
        return guest.wait(timeout_s)
