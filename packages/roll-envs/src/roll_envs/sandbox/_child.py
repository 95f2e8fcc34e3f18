"""The launcher that runs first inside every sandbox: limits, identity, then the model's program.

Its source is passed as `python -I -S -B -X utf8 -c <source> roll-sandbox-child MAIN READY_FD UID NAME=SOFT:HARD...`
(READY_FD and UID are `-` when unused), so it may import only the standard library, must not import roll, and
imports as little as it can (every run pays for its start). It runs before any model code, in this order:
1. set every resource limit given (hard limits, which the program cannot raise again);
2. if a uid is given (the caller is root), drop to that uid and gid: RLIMIT_NPROC is never enforced for root,
   and the drop also clears the two capabilities (setuid, setgid) bwrap kept for this step;
3. write one byte to READY_FD and close it: the caller learns that the sandbox came up, so a failure before
   this point is a sandbox error, never a wrong answer;
4. run MAIN as the `__main__` module, with `exit()`/`quit()` defined, as `python MAIN` would.

Nothing secret is in this process: expected outputs never enter the sandbox, they are compared outside it.
"""

import os
import resource
import sys


def main() -> None:
    path, ready, uid, *limits = sys.argv[2:]
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
    if ready != "-":
        os.write(int(ready), b"1")
        os.close(int(ready))
    import site

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
