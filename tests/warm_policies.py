"""Build the policies that the integration tier loads, before it needs them.

    nice -n 15 python tests/warm_policies.py

`make test` starts this in the background at a low CPU priority (nice 15: above the `beside`
tests' 19, below every other test's 0) as soon as the venv is installed. On a machine whose
policy cache is empty, `tests/test_tools_run.py`'s cut-short `chain_sum_tools` build (~50 s of
one core; the `chain_sum` preset ships with the package, and resolves at once) would be built
inside the first test that loads it, while the other core idles; niced, it takes only the
CPU time that the unit tier and the first integration modules leave idle, and the modules
that load them run last (the `preset` marker, ordered in `conftest.py`). A test
that needs a build still in progress waits on the cache's lock and reads it when it lands, as
any two callers of `ensure_policy` do. With a warm cache this exits at once.

The SmolLM2 conversion is not built here: unit tests read it, and one of them waiting on a
low-priority conversion would hold a unit-tier worker.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from test_tools_run import tools_policy

    from cagrpo_ray.policies.build import resolve_policy

    for name, build in (("chain_sum", lambda: resolve_policy("chain_sum")),
                        ("chain_sum_tools (cut short)", tools_policy)):  # fmt: skip
        start = time.monotonic()
        path = build()
        took = time.monotonic() - start
        print(f"{time.strftime('%H:%M:%S')} {name}: {path} ({took:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
