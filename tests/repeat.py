"""Run one test (or any pytest arguments) N times in a row and stop at the first failure: how a test that
failed at random is shown fixed. Not collected by pytest (no test_ prefix); run by hand, not in CI:

    .venv/bin/python tests/repeat.py 20 "tests/test_invariance.py::test_fsdp2_gives_the_gradient_of_one_process_also_when_ranks_run_different_rows"
"""
import subprocess
import sys
import time


def main(times: int, pytest_args: list[str]):
    for i in range(1, times + 1):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                              capture_output=True, text=True)
        print(f"run {i}/{times}: {'passed' if proc.returncode == 0 else 'FAILED'} in {time.monotonic() - start:.0f}s",
              flush=True)
        if proc.returncode:
            print(proc.stdout[-6000:], proc.stderr[-3000:])
            sys.exit(1)
    print(f"{times} runs in a row passed")


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit(__doc__)
    main(int(sys.argv[1]), sys.argv[2:])
