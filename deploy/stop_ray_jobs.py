"""Stop every running Ray job of a cluster the way `ray job stop` does, then wait for them to end.

    python deploy/stop_ray_jobs.py [--address http://HOST:8265] [--timeout SECONDS]

The preStop hook of the Ray pods in k8s/. KubeRay deletes a cluster's pods (RayJob deleted or
suspended, head pod evicted, node drained) without stopping the job first, and the kubelet's
SIGTERM then ends Ray itself and the training driver with it, mid-step. Run before that
SIGTERM, this script asks Ray's job API to stop each PENDING or RUNNING job: Ray's job
supervisor sends SIGTERM to the entrypoint, the trainer finishes its current step, writes a
checkpoint and exits (cagrpo_ray/run.py), and the supervisor waits `RAY_JOB_STOP_WAIT_TIME_S`
(set on the head) before it sends SIGKILL. The script returns once every job it stopped has
ended, so the kubelet stops Ray only after the checkpoint; the pod's
terminationGracePeriodSeconds bounds the whole wait.

The address defaults to the head's dashboard: `http://$FQ_RAY_IP:8265` on a worker (KubeRay
sets FQ_RAY_IP there), `http://127.0.0.1:8265` on the head. With token authentication on, the
job API needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in the environment; KubeRay sets both in
every Ray container of a cluster with `authOptions.mode: token`.

Exit status: 0 when no job is left running (or none was), 1 when a job is still running at
--timeout, 2 when the job API refused or could not be reached (the head already gone).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ACTIVE = {"PENDING", "RUNNING"}


def default_address() -> str:
    """The head's dashboard, from a worker (FQ_RAY_IP) or on the head itself."""
    return f"http://{os.environ.get('FQ_RAY_IP', '127.0.0.1')}:8265"


def stop_jobs(client, timeout_s: float | None, poll_s: float = 2.0) -> int:
    """Stop the client's PENDING and RUNNING jobs and wait until none of them is; exit status."""
    stopping = [
        job.submission_id
        for job in client.list_jobs()
        if job.submission_id and str(job.status) in ACTIVE
    ]
    for submission_id in stopping:
        print(f"stopping Ray job {submission_id}", flush=True)
        client.stop_job(submission_id)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        running = [s for s in stopping if str(client.get_job_status(s)) in ACTIVE]
        if not running:
            print(f"{len(stopping)} Ray job(s) stopped", flush=True)
            return 0
        if deadline is not None and time.monotonic() > deadline:
            print(f"still running after {timeout_s:.0f} s: {', '.join(running)}", flush=True)
            return 1
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=default_address(), help="Ray dashboard URL")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds to wait (default: no limit)"
    )
    args = parser.parse_args(argv)
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(args.address)
        return stop_jobs(client, args.timeout)
    except Exception as error:  # the head gone, or the token refused: nothing left to wait for
        print(f"cannot stop the Ray jobs at {args.address}: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
