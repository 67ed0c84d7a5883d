"""A server process for tests and benchmarks: started, awaited, stopped."""
import atexit
import os
import subprocess
import time


class ServerProcess:
    """A server that prints '<banner>HOST:PORT ...' on stdout when ready.

    Its output goes to files in `workdir` (never pipes: a chatty server must
    not block on a full pipe); `target` is the HOST:PORT it printed.
    """

    def __init__(self, argv, banner, workdir, name, timeout_s=40):
        self.stdout = os.path.join(workdir, f"{name}.stdout")
        self.stderr = os.path.join(workdir, f"{name}.stderr")
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.process = subprocess.Popen(argv, stdout=out, stderr=err)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.stdout) as f:
                for line in f:
                    if line.startswith(banner):
                        self.target = line[len(banner):].split()[0]
                        return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        with open(self.stderr) as f:
            raise RuntimeError(f"{name} did not start: {f.read()}")

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
