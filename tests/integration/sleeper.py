"""A stand-in server for process tests: starts a grandchild (as vLLM starts its engine), writes both pids
to the file named in argv[1], then sleeps."""

import subprocess
import sys
import time

if __name__ == "__main__":
    child = subprocess.Popen(["sleep", "600"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{__import__('os').getpid()} {child.pid}")
    time.sleep(600)
