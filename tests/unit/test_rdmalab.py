"""rdmalab: the initramfs archive, module dependency order, the guest's command and qemu line."""

from __future__ import annotations

import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from rdmalab.config import LabConfig
from rdmalab.errors import LabUnavailable
from rdmalab.guest import command_script, qemu_argv
from rdmalab.initramfs import CpioWriter, init_script
from rdmalab.kernel import load_order, module_depends

pytestmark = pytest.mark.unit


def read_newc(path: Path) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """name -> (mode, data, (rdevmajor, rdevminor)) of a newc archive."""
    data, pos, out = path.read_bytes(), 0, {}
    while True:
        assert data[pos:pos + 6] == b"070701"
        fields = [int(data[pos + 6 + i * 8:pos + 14 + i * 8], 16) for i in range(13)]
        namesize, filesize = fields[11], fields[6]
        name_start = pos + 110
        name = data[name_start:name_start + namesize - 1].decode()
        body = name_start + namesize + (-(110 + namesize) % 4)
        if name == "TRAILER!!!":
            return out
        out[name] = (fields[1], data[body:body + filesize], (fields[9], fields[10]))
        pos = body + filesize + (-filesize % 4)


def test_cpio_newc_archive_reads_back(tmp_path):
    cpio = CpioWriter(tmp_path / "a.cpio")
    cpio.directory("bin")
    cpio.file("bin/tool", b"\x7fELF...", 0o755)
    cpio.file("odd", b"abc")          # lengths that need padding
    cpio.char_device("dev/console", 5, 1)
    cpio.close()
    entries = read_newc(tmp_path / "a.cpio")
    assert stat.S_ISDIR(entries["bin"][0])
    assert entries["bin/tool"][1] == b"\x7fELF..." and entries["bin/tool"][0] & 0o777 == 0o755
    assert entries["odd"][1] == b"abc"
    assert stat.S_ISCHR(entries["dev/console"][0]) and entries["dev/console"][2] == (5, 1)


def fake_module(depends: str) -> bytes:
    """A minimal ELF64 LE file whose .modinfo carries ``depends=``."""
    modinfo = b"license=GPL\0depends=" + depends.encode() + b"\0vermagic=x\0"
    shstr = b"\0.modinfo\0.shstrtab\0"
    body_off = 64
    shoff = body_off + len(modinfo) + len(shstr)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, shoff, 0,
                                                                       64, 0, 0, 64, 3, 2)
    sections = struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    sections += struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, body_off, len(modinfo), 0, 0, 1, 0)
    sections += struct.pack("<IIQQQQIIQQ", 10, 3, 0, 0, body_off + len(modinfo), len(shstr), 0, 0, 1, 0)
    return header + modinfo + shstr + sections


def test_module_depends_and_load_order(tmp_path):
    assert module_depends(fake_module("ib_core,udp-tunnel")) == ["ib_core", "udp_tunnel"]
    assert module_depends(fake_module("")) == []
    mods = tmp_path / "kernel"
    (mods / "a").mkdir(parents=True)
    (mods / "a" / "rdma_rxe.ko").write_bytes(fake_module("ib_core,udp_tunnel"))
    (mods / "a" / "ib_core.ko").write_bytes(fake_module(""))
    (mods / "a" / "udp_tunnel.ko").write_bytes(fake_module(""))
    (mods / "a" / "crc32_generic.ko").write_bytes(fake_module(""))
    order = [p.name for p in load_order(mods, ("crc32_generic", "rdma_rxe"))]
    assert order == ["crc32_generic.ko", "ib_core.ko", "udp_tunnel.ko", "rdma_rxe.ko"]
    with pytest.raises(LabUnavailable, match="veth"):
        load_order(mods, ("veth",))


def test_guest_command_and_qemu_line(tmp_path):
    script = command_script(["python", "-c", "print('a b')"], Path("/work/repo"), {"X": "1 2"})
    assert "cd /work/repo || exit 126" in script and "exec python -c 'print('\"'\"'a b'\"'\"')'" in script
    assert "export X='1 2'" in script and "export PDSERVE_LAB=1" in script
    from rdmalab.assets import Assets
    argv = qemu_argv(LabConfig(), Assets(tmp_path / "k", tmp_path / "i", "6.1"), tmp_path)
    joined = " ".join(argv)
    assert "-nic none" in joined and "readonly=on" in joined and "multidevs=remap" in joined
    assert "tcg" in joined and f"path={tmp_path},mount_tag=outbox" in joined
    # the checkout is shared on its own too: a clone under /tmp is hidden by the guest's tmpfs
    assert f"path={LabConfig().workdir},mount_tag=workdir" in joined and "workdir" in init_script().decode()
    with pytest.raises(ValueError):
        LabConfig(accel="auto")


def test_init_script_parses():
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    res = subprocess.run([sh, "-n"], input=init_script(), capture_output=True)
    assert res.returncode == 0, res.stderr
