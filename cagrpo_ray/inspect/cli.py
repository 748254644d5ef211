"""Command line: write an inspected step's page, or serve a run's steps.

    python -m cagrpo_ray.inspect RUN_DIR [--step N] [--out FILE] [--serve PORT] [--host HOST]

Without --serve, the page of step N (default: the newest inspected step) is written to FILE
(default: RUN_DIR/inspect/step_{N:06d}.html) and its path printed; the page needs nothing
else, so it can be copied and opened anywhere. Its list of the other inspected steps has no
links: --serve browses them. With --serve, every inspected step is served (see `server.py`)
on HOST (default 127.0.0.1: prompts and responses can be sensitive) until Ctrl-C; port 0
picks a free port. A missing run directory or step is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cagrpo_ray.console import log_dir
from cagrpo_ray.inspect.page import render_page
from cagrpo_ray.inspect.records import INSPECT_DIR, inspected_steps, read_step
from cagrpo_ray.inspect.server import InspectorServer
from cagrpo_ray.rewards.errors import ERRORS_FILE, read_errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cagrpo_ray.inspect",
        description="Which tokens CA-GRPO tames: a page per inspected step of a run.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (runs/<run.name>)")
    parser.add_argument("--step", type=int, help="inspected step to show (default: newest)")
    parser.add_argument("--out", type=Path, help="page to write (default: beside the records)")
    parser.add_argument("--serve", type=int, metavar="PORT", help="serve over HTTP (0: any port)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to serve on")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.serve is None:
            print(write_page(args.run_dir, args.step, args.out))
        else:
            serve(args.run_dir, args.step, args.host, args.serve)
    except (OSError, ValueError) as error:  # a missing run or step, a port in use, a foreign file
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def write_page(run_dir: Path, step: int | None, out: Path | None) -> Path:
    """Write the page of `step` (None: the newest) and return its path."""
    table, metadata = read_step(run_dir, step)
    step = metadata["step"]
    out = out or run_dir / INSPECT_DIR / f"step_{step:06d}.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = read_errors(log_dir(run_dir) / ERRORS_FILE)
    page = render_page(table, metadata, inspected_steps(run_dir), lambda s: None, errors)
    out.write_text(page)
    return out


def serve(run_dir: Path, step: int | None, host: str, port: int) -> None:
    """Serve until interrupted; a missing run directory or `step` fails before binding."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    if step is not None:
        read_step(run_dir, step)
    server = InspectorServer(run_dir, host=host, port=port)
    url = server.url + (f"step/{step}" if step is not None else "")
    print(f"serving the inspected steps of {run_dir} at {url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
