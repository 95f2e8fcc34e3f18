"""The launcher that runs first inside every sandbox: limits, identity, then the model's program.

Its source is passed as
`python -s -P -S -B -X utf8 -c <source> roll-sandbox-child MAIN READY_FD UID PARENT CPUS OFFSET SITE NAME=SOFT:HARD...`
(READY_FD, UID, PARENT and SITE are `-` when unused; no `-P` before Python 3.11), so it may import only the standard
library, must not import roll, and imports as little as it can (every run pays for its start). Not `-I`: the
interpreter reads its environment (PYTHONHASHSEED=0, a fixed string hash), which the runner builds whole (bwrap's
`--clearenv`, the unsandboxed child's `env`). Before Python 3.11 (no `-P`), the '' that `-c` puts first on
`sys.path` (the working folder) is removed before anything is imported, as `-I` did. It runs before any model
code, in this order:
0. if a parent pid is given (unsandboxed runs, which have no bwrap `--die-with-parent`), ask the kernel for
   SIGKILL when the thread that started this process ends (roll's run thread, which waits for the run: so, when
   roll dies), and leave at once if that parent is already gone (it died before the request);
1. set every resource limit given (hard limits, which the program cannot raise again);
2. if a uid is given (the caller is root), drop to that uid and gid: RLIMIT_NPROC is never enforced for root,
   and the drop also clears the two capabilities (setuid, setgid) bwrap kept for this step;
3. pin this process (and so every process it starts) to N = min(CPUS, CPUs it may use) of its CPUs, taken in
   turn from position OFFSET of that set (the caller spreads concurrent runs that way), make `os.cpu_count()`
   return N (Python < 3.13 would say the host's count: `multiprocessing.Pool()`, `ProcessPoolExecutor()` and
   joblib would start more workers than `max_processes` allows), and set OMP_NUM_THREADS, OPENBLAS_NUM_THREADS,
   MKL_NUM_THREADS and PYTHON_CPU_COUNT (3.13+, read by interpreters started without -I/-E) to N;
3b. add the site-packages folders of SITE (os.pathsep-separated: a configured interpreter's, e.g. a virtual
   environment's; `-S` skipped them) to `sys.path` as `site` would, their .pth files included (under the limits);
4. write one byte to READY_FD and close it: the caller learns that the sandbox came up, so a failure before
   this point is a sandbox error, never a wrong answer;
5. run MAIN as the `__main__` module, with `exit()`/`quit()` defined, as `python MAIN` would.

Nothing secret is in this process: expected outputs never enter the sandbox, they are compared outside it.
"""

import sys

if sys.path and sys.path[0] == "":  # Python < 3.11 has no -P: no module of the working folder shadows ours
    del sys.path[0]

import os
import resource


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent thread ends (Linux prctl PR_SET_PDEATHSIG); exit if it has already."""
    import ctypes  # only here: sandboxed runs never pay for it

    pr_set_pdeathsig, sigkill = 1, 9
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, sigkill, 0, 0, 0) != 0:
        raise SystemExit(f"roll-sandbox-child: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
    if os.getppid() != parent:  # roll died before the request: nobody reads this run
        os._exit(1)


def pin_cpus(wanted: int, offset: int) -> int:
    """Pin to `wanted` of the CPUs this process may use (fewer if it may use fewer), from position `offset` of
    their sorted list on (wrapping); make `os.cpu_count()` and the thread-pool variables agree. Returns the count."""
    allowed = sorted(os.sched_getaffinity(0))
    count = min(wanted, len(allowed))
    os.sched_setaffinity(0, [allowed[(offset + i) % len(allowed)] for i in range(count)])
    os.cpu_count = lambda: count  # this interpreter and every process it forks
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYTHON_CPU_COUNT"):
        os.environ[name] = str(count)
    return count


def main() -> None:
    path, ready, uid, parent, cpus, offset, site_dirs, *limits = sys.argv[2:]
    if parent != "-":
        die_with_parent(int(parent))
    for item in limits:
        name, values = item.split("=")
        soft, hard = values.split(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    if uid != "-":
        os.setgroups([])
        os.setgid(int(uid))
        os.setuid(int(uid))
        if os.getuid() != int(uid) or os.geteuid() != int(uid):
            raise SystemExit("roll-sandbox-child: could not drop privileges")
    pin_cpus(int(cpus), int(offset))
    import site

    if site_dirs != "-":
        for folder in site_dirs.split(os.pathsep):
            site.addsitedir(folder)
    if ready != "-":
        os.write(int(ready), b"1")
        os.close(int(ready))
    site.setquit()
    with open(path, "rb") as f:
        source = f.read()
    module = type(sys)("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.argv = [path]
    exec(compile(source, path, "exec"), module.__dict__)


if __name__ == "__main__":  # `python -c` runs this as __main__; importing it runs nothing
    main()
